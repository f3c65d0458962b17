//! Core benchmarks (divan): `cargo bench -p kvlease-core --bench core`.
//!
//! Each kvlease figure has a baseline measured in the same run, so the ratio survives a noisy
//! machine: a `std::collections::HashMap` lease table holding the same per-lease fields for
//! renewals, and vLLM's full sweep of all leases for the reaper tick. Figures are per call;
//! divide by `k` for per-lease costs (divan prints items/s where a counter is set).
//!
//! Before the timed runs, `main` prints what timing cannot show: bytes per live lease, counted
//! by a counting global allocator around the table's own calls (payload `()`), and wire bytes
//! per lease id, for every traffic shape below.
//!
//! Traffic shapes: `best` = the same 1,000 consecutive ids every time (hot in cache); `random` =
//! 1,000 live ids drawn at random from n live leases granted in a row; `churn` = the mix of
//! issue #11 (80 % of leases live 0.05–0.5 s, 20 % live 5–60 s, 150,000 grants per simulated
//! second, about 10^6 live after a minute), a heartbeat naming 1,000 random live ids;
//! `decoders` = the churn with leases dealt round-robin to 16 or 256 decoders, one decoder's
//! heartbeat naming 1,000 of its live ids in id order. Every renewal case cycles through
//! heartbeats that together name every live lease (1,000 samples × 1,000 ids = 10^6), so the
//! table is touched as a whole, not kept hot in cache; `best` alone repeats one heartbeat.

use divan::{black_box, Bencher};
use kvlease_core::config::LeaseConfig;
use kvlease_core::digest::PromptDigest;
use kvlease_core::lease_table::{Holder, LeaseTable, Released, REAP_BUDGET as BUDGET};
use kvlease_core::wire::{encode_heartbeat, Message};
use kvlease_core::Nanos;
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;

#[path = "common/counting.rs"]
mod counting;
use counting::{counted, Counting, HELD};

#[global_allocator]
static ALLOC: Counting = Counting;

const K: usize = 1000;
const SEC: u64 = 1_000_000_000;
const D: Holder = Holder(std::num::NonZeroU32::MIN);
const DIGEST: PromptDigest = PromptDigest([0; 16]);

/// xorshift64*: a fixed seed, so every run draws the same traffic.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// What a lease table does under traffic; implemented by kvlease's and by the baseline.
trait Table {
    fn grant(&mut self, now: u64) -> u64;
    fn release(&mut self, id: u64, now: u64);
    fn renew(&mut self, ids: &[u64], now: u64, lost: &mut Vec<u64>) -> usize;
}

struct Kv {
    t: LeaseTable<()>,
    rel: Vec<Released<()>>,
}

impl Kv {
    fn new() -> Kv {
        Kv { t: LeaseTable::new(&LeaseConfig::default()), rel: Vec::new() }
    }
}

impl Table for Kv {
    fn grant(&mut self, now: u64) -> u64 {
        self.t.grant(Nanos(now), 1, ())
    }
    fn release(&mut self, id: u64, now: u64) {
        self.rel.clear();
        self.t.release(D, &[id], Nanos(now), &mut Vec::new(), &mut self.rel);
    }
    fn renew(&mut self, ids: &[u64], now: u64, lost: &mut Vec<u64>) -> usize {
        self.t.renew(D, ids, Nanos(now), lost, &mut self.rel)
    }
}

/// Baseline: a std `HashMap` keyed by lease id holding what kvlease keeps per lease
/// (deadline, grant time, holder, blocks, prompt digest), renewing with the same rules.
#[derive(Clone, Copy)]
#[allow(dead_code)]
struct BaseLease {
    deadline: u64,
    granted: u64,
    holder: u32,
    blocks: u32,
    digest: PromptDigest,
}

#[derive(Default)]
struct Base {
    map: HashMap<u64, BaseLease>,
    next: u64,
}

impl Table for Base {
    fn grant(&mut self, now: u64) -> u64 {
        self.next += 1;
        self.map.insert(self.next, BaseLease { deadline: now + 30 * SEC, granted: now, holder: 0, blocks: 1, digest: DIGEST });
        self.next
    }
    fn release(&mut self, id: u64, _now: u64) {
        self.map.remove(&id);
    }
    fn renew(&mut self, ids: &[u64], now: u64, lost: &mut Vec<u64>) -> usize {
        let mut renewed = 0;
        for &id in ids {
            match self.map.get_mut(&id) {
                Some(l) if (l.holder == 0 || l.holder == 1) && l.deadline > now => {
                    l.holder = 1;
                    l.deadline = l.deadline.max(now + 20 * SEC);
                    renewed += 1;
                }
                _ => lost.push(id),
            }
        }
        renewed
    }
}

/// n leases granted in a row at t = 0, the table's bytes per live lease, and their ids.
fn granted<T: Table>(mut t: T, n: usize) -> (T, Vec<u64>, f64) {
    let before = HELD.load(Relaxed);
    let ids = {
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            let id = counted(|| t.grant(0));
            ids.push(id);
        }
        ids
    };
    let bytes = (HELD.load(Relaxed) - before) as f64 / n as f64;
    (t, ids, bytes)
}

/// The churn of issue #11 run for 65 simulated seconds: returns the table, its live leases as
/// `(id, decoder)` and its bytes per live lease. Leases go to `decoders` decoders round-robin.
fn churn<T: Table>(mut t: T, decoders: u64) -> (T, Vec<(u64, u64)>, f64) {
    const STEP: u64 = 10_000_000; // 10 ms
    const PER_STEP: u64 = 1_500; // 150,000 grants per second
    let ring = 6_100usize; // 61 s of 10 ms buckets: the longest lifetime fits
    let mut queue: Vec<Vec<(u64, u64)>> = vec![Vec::new(); ring];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let before = HELD.load(Relaxed);
    let mut seq = 0u64;
    for step in 0..6_500u64 {
        let now = step * STEP;
        for _ in 0..PER_STEP {
            let life = if rng.below(5) == 0 { 5 * SEC + rng.below(55 * SEC) } else { 50_000_000 + rng.below(450_000_000) };
            let id = counted(|| t.grant(now));
            let due = ((now + life) / STEP) as usize % ring;
            queue[due].push((id, seq % decoders));
            seq += 1;
        }
        let due = std::mem::take(&mut queue[(step as usize + 1) % ring]);
        for &(id, _) in &due {
            counted(|| t.release(id, now + STEP));
        }
        queue[(step as usize + 1) % ring] = due;
        queue[(step as usize + 1) % ring].clear();
    }
    let live: Vec<(u64, u64)> = queue.into_iter().flatten().collect();
    let bytes = (HELD.load(Relaxed) - before) as f64 / live.len() as f64;
    (t, live, bytes)
}

/// Heartbeats of 1,000 distinct random ids of `live` each, sorted as on the wire, together
/// naming every live lease once (at most 2,000 of them): cycling through them touches the whole
/// table, as P's heartbeats from every decoder do, rather than the same lines kept hot in cache.
fn random_beats(live: &[u64], seed: u64) -> Vec<Vec<u8>> {
    let mut rng = Rng(seed);
    let mut order = live.to_vec();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    order
        .chunks(K)
        .take(2_000)
        .map(|c| {
            let mut c = c.to_vec();
            c.sort_unstable();
            heartbeat(&c)
        })
        .collect()
}

/// Each decoder's live ids in id order, cut into heartbeats of 1,000 ids, the decoders' beats
/// interleaved as they reach P; together they name every live lease once (at most 2,000 beats).
fn decoder_beats(live: &[(u64, u64)], decoders: u64) -> Vec<Vec<u8>> {
    let mut per: Vec<Vec<u64>> = vec![Vec::new(); decoders as usize];
    for &(id, d) in live {
        per[d as usize].push(id);
    }
    let chunks: Vec<Vec<Vec<u64>>> = per
        .into_iter()
        .map(|mut ids| {
            ids.sort_unstable();
            ids.chunks(K).map(|c| c.to_vec()).collect()
        })
        .collect();
    let rounds = chunks.iter().map(Vec::len).max().unwrap_or(0);
    (0..rounds).flat_map(|r| chunks.iter().filter_map(move |c| c.get(r))).take(2_000).map(|c| heartbeat(c)).collect()
}

/// Bytes per id over a set of heartbeats.
fn bytes_per_id(beats: &[Vec<u8>]) -> f64 {
    let ids: usize = beats
        .iter()
        .map(|b| match Message::decode(b) {
            Ok(Message::Heartbeat { lease_ids, .. }) => lease_ids.len(),
            _ => 0,
        })
        .sum();
    beats.iter().map(Vec::len).sum::<usize>() as f64 / ids as f64
}

fn heartbeat(ids: &[u64]) -> Vec<u8> {
    let mut hb = Vec::new();
    encode_heartbeat(1, ids, &mut hb);
    hb
}

/// Decode a heartbeat and renew its ids, as P does on receipt (lost ids included), cycling
/// through `beats`. Per heartbeat; divan's item rate is per lease id.
fn bench_renew<T: Table>(bencher: Bencher, mut t: T, beats: Vec<Vec<u8>>) {
    let mut lost = Vec::new();
    let mut now = SEC;
    let mut i = 0;
    bencher.counter(divan::counter::ItemsCount::new(K)).bench_local(|| {
        now += 1;
        i += 1;
        let Ok(Message::Heartbeat { lease_ids, .. }) = Message::decode(black_box(&beats[i % beats.len()])) else { unreachable!() };
        lost.clear();
        t.renew(&lease_ids, now, &mut lost)
    });
}

fn main() {
    memory_and_wire_report();
    divan::main();
}

/// Bytes per live lease for every traffic shape, kvlease and the baseline, and wire bytes per id.
fn memory_and_wire_report() {
    println!("memory per live lease (counting allocator, payload `()`; kvlease | HashMap baseline):");
    for n in [1_000usize, 10_000, 100_000, 1_000_000, 10_000_000] {
        let (kv, _, a) = granted(Kv::new(), n);
        drop(kv);
        let (base, _, b) = granted(Base::default(), n);
        drop(base);
        println!("  granted in a row, n = {n:>10}: {a:6.1} B | {b:6.1} B");
    }
    let (kv, live, a) = churn(Kv::new(), 16);
    let n = live.len();
    let ids: Vec<u64> = live.iter().map(|(id, _)| *id).collect();
    let random = bytes_per_id(&random_beats(&ids, 7));
    let dec16 = bytes_per_id(&decoder_beats(&live, 16));
    let cap = kv.t.capacity();
    drop(kv);
    let (_, _, b) = churn(Base::default(), 16);
    println!("  churn, {n} live (capacity {cap} slots): {a:6.1} B | {b:6.1} B");
    println!("wire bytes per lease id (heartbeats of 1,000 ids; SPEC §9 delta encoding):");
    let (kv, ids, _) = granted(Kv::new(), 100_000);
    drop(kv);
    println!("  granted in a row:                          {:.2} B/id", bytes_per_id(&[heartbeat(&ids[50_000..51_000])]));
    println!("  churn, random live ids:                    {random:.2} B/id");
    println!("  churn, 16 interleaved decoders, own ids:   {dec16:.2} B/id");
    let (_, live, _) = churn(Kv::new(), 256);
    println!("  churn, 256 interleaved decoders, own ids:  {:.2} B/id", bytes_per_id(&decoder_beats(&live, 256)));
}

/// Best case: the same 1,000 consecutive ids every iteration (hot in cache), n = 10^6.
#[divan::bench(sample_count = 100)]
fn renew_best_1m(bencher: Bencher) {
    let (t, ids, _) = granted(Kv::new(), 1_000_000);
    bench_renew(bencher, t, vec![heartbeat(&ids[500_000..501_000])]);
}

#[divan::bench(sample_count = 100)]
fn renew_best_1m_hashmap(bencher: Bencher) {
    let (t, ids, _) = granted(Base::default(), 1_000_000);
    bench_renew(bencher, t, vec![heartbeat(&ids[500_000..501_000])]);
}

/// Heartbeats of 1,000 random live ids out of n, cycling through the table.
fn random_case<T: Table>(bencher: Bencher, t: T, n: usize) {
    let (t, ids, _) = granted(t, n);
    bench_renew(bencher, t, random_beats(&ids, 11));
}

#[divan::bench(args = [1_000, 10_000, 100_000, 1_000_000, 10_000_000], sample_count = 1000)]
fn renew_random(bencher: Bencher, n: usize) {
    random_case(bencher, Kv::new(), n);
}

#[divan::bench(args = [1_000, 10_000, 100_000, 1_000_000, 10_000_000], sample_count = 1000)]
fn renew_random_hashmap(bencher: Bencher, n: usize) {
    random_case(bencher, Base::default(), n);
}

/// Churn at about 10^6 live: a heartbeat of 1,000 random live ids.
#[divan::bench(sample_count = 1000)]
fn renew_churn_1m(bencher: Bencher) {
    let (t, live, _) = churn(Kv::new(), 1);
    let ids: Vec<u64> = live.iter().map(|(id, _)| *id).collect();
    bench_renew(bencher, t, random_beats(&ids, 13));
}

#[divan::bench(sample_count = 1000)]
fn renew_churn_1m_hashmap(bencher: Bencher) {
    let (t, live, _) = churn(Base::default(), 1);
    let ids: Vec<u64> = live.iter().map(|(id, _)| *id).collect();
    bench_renew(bencher, t, random_beats(&ids, 13));
}

/// Churn with `decoders` decoders interleaved: one decoder's heartbeat of 1,000 ids.
#[divan::bench(args = [16, 256], sample_count = 1000)]
fn renew_decoders(bencher: Bencher, decoders: u64) {
    let (t, live, _) = churn(Kv::new(), decoders);
    bench_renew(bencher, t, decoder_beats(&live, decoders));
}

#[divan::bench(args = [16, 256], sample_count = 1000)]
fn renew_decoders_hashmap(bencher: Bencher, decoders: u64) {
    let (t, live, _) = churn(Base::default(), decoders);
    bench_renew(bencher, t, decoder_beats(&live, decoders));
}

/// The churn itself at about 10^6 live: 10 ms of traffic per iteration (1,500 grants and the
/// releases that fall due), per grant.
fn churn_ops<T: Table>(bencher: Bencher, t: T) {
    let (mut t, live, _) = churn(t, 1);
    let mut rng = Rng(5);
    let mut pending: Vec<u64> = live.iter().map(|(id, _)| *id).collect();
    let mut now = 100 * SEC;
    bencher.counter(divan::counter::ItemsCount::new(1_500usize)).bench_local(|| {
        now += 10_000_000;
        for _ in 0..1_500 {
            let id = t.grant(now);
            // Release a random live lease in its place: the live count stays put.
            let i = rng.below(pending.len() as u64) as usize;
            let old = std::mem::replace(&mut pending[i], id);
            t.release(old, now);
        }
    });
}

#[divan::bench(sample_count = 50)]
fn churn_grant_release_1m(bencher: Bencher) {
    churn_ops(bencher, Kv::new());
}

#[divan::bench(sample_count = 50)]
fn churn_grant_release_1m_hashmap(bencher: Bencher) {
    churn_ops(bencher, Base::default());
}

/// Heartbeats of k random live ids each, naming up to 10^6 leases (at most 20,000 beats).
fn small_beats(ids: &[u64], k: usize) -> Vec<Vec<u8>> {
    let mut rng = Rng(17);
    (0..(1_000_000 / k).min(20_000))
        .map(|_| {
            let mut c: Vec<u64> = (0..k).map(|_| ids[rng.below(ids.len() as u64) as usize]).collect();
            c.sort_unstable();
            c.dedup();
            heartbeat(&c)
        })
        .collect()
}

/// Whole P path for a heartbeat of k ids out of 10^6 live (random): decode, renew, build and
/// encode the acknowledgement.
#[divan::bench(args = [1, 10, 100, 1_000], sample_count = 1000, sample_size = 16)]
fn p_path_heartbeat(bencher: Bencher, k: usize) {
    let (mut kv, ids, _) = granted(Kv::new(), 1_000_000);
    let beats = small_beats(&ids, k);
    let mut rel = Vec::new();
    let mut out = Vec::with_capacity(64);
    let mut now = SEC;
    let mut i = 0;
    bencher.counter(divan::counter::ItemsCount::new(k)).bench_local(|| {
        now += 1;
        i += 1;
        let Ok(msg) = Message::decode(black_box(&beats[i % beats.len()])) else { unreachable!() };
        let answer = kv.t.on_message(D, &msg, Nanos(now), &mut rel);
        out.clear();
        if let Some(reply) = answer.reply {
            reply.encode_into(&mut out);
        }
        out.len()
    });
}

#[divan::bench(args = [1, 10, 100, 1_000], sample_count = 1000, sample_size = 16)]
fn p_path_heartbeat_hashmap(bencher: Bencher, k: usize) {
    let (mut t, ids, _) = granted(Base::default(), 1_000_000);
    let beats = small_beats(&ids, k);
    let mut out = Vec::with_capacity(64);
    let mut now = SEC;
    let mut i = 0;
    bencher.counter(divan::counter::ItemsCount::new(k)).bench_local(|| {
        now += 1;
        i += 1;
        let Ok(Message::Heartbeat { seq, lease_ids }) = Message::decode(black_box(&beats[i % beats.len()])) else { unreachable!() };
        let mut lost = Vec::new();
        t.renew(&lease_ids, now, &mut lost);
        out.clear();
        Message::HeartbeatAck { seq, lost_ids: lost }.encode_into(&mut out);
        out.len()
    });
}

/// Steady state with the reaper: 10^6 leases kept alive by heartbeats of 1,000 ids, every lease
/// renewed once per I = 5 s (1,000 heartbeats, 5 ms apart), the reaper ticking (budgeted,
/// repeated while work is left) after each heartbeat. One iteration is 100 heartbeats (0.5 s
/// of traffic, five reaper buckets), so each sample carries its share of the refiling of
/// renewed leases; per renewal, including the expiry index's work.
fn steady(bencher: Bencher, reaper: bool) {
    let (mut kv, ids, _) = granted(Kv::new(), 1_000_000);
    let beats = random_beats(&ids, 3);
    let (mut lost, mut rel) = (Vec::new(), Vec::new());
    let mut now = 0;
    let mut i = 0;
    let step = 5 * SEC / beats.len() as u64;
    let mut beat = |kv: &mut Kv, now: &mut u64, i: &mut usize| {
        *now += step;
        let Ok(Message::Heartbeat { lease_ids, .. }) = Message::decode(&beats[*i % beats.len()]) else { unreachable!() };
        *i += 1;
        lost.clear();
        rel.clear();
        let n = kv.t.renew(D, &lease_ids, Nanos(*now), &mut lost, &mut rel);
        while reaper && kv.t.tick_budget(Nanos(*now), BUDGET, &mut rel) {}
        assert!(rel.is_empty(), "no lease expires in steady state");
        n
    };
    // Warm up a simulated minute, so every entry has been refiled at least once.
    for _ in 0..12_000 {
        beat(&mut kv, &mut now, &mut i);
    }
    bencher
        .counter(divan::counter::ItemsCount::new(100 * K))
        .bench_local(|| (0..100).map(|_| beat(&mut kv, &mut now, &mut i)).sum::<usize>());
}

#[divan::bench(sample_count = 100)]
fn steady_renew_with_reaper_1m(bencher: Bencher) {
    steady(bencher, true);
}

/// The same heartbeats with no reaper: renewal alone.
#[divan::bench(sample_count = 100)]
fn steady_renew_without_reaper_1m(bencher: Bencher) {
    steady(bencher, false);
}

/// The worst tick at 10^6 leases, budgeted to `BUDGET` entries: 10^6 leases granted in the same
/// instant all expire in one bucket.
#[divan::bench(sample_count = 30, sample_size = 1)]
fn worst_tick_1m_all_expire(bencher: Bencher) {
    bencher
        .with_inputs(|| {
            let (mut kv, _, _) = granted(Kv::new(), 1_000_000);
            kv.t.tick(Nanos(29 * SEC + 950_000_000), &mut kv.rel);
            (kv, Vec::with_capacity(BUDGET))
        })
        .bench_local_refs(|(kv, rel)| assert!(kv.t.tick_budget(Nanos(30 * SEC + 50_000_000), BUDGET, rel)));
}

/// The worst tick at 10^6 leases, budgeted: 10^6 leases renewed since they were filed all come
/// due in one bucket and must be refiled.
#[divan::bench(sample_count = 30, sample_size = 1)]
fn worst_tick_1m_all_refile(bencher: Bencher) {
    bencher
        .with_inputs(|| {
            let (mut kv, ids, _) = granted(Kv::new(), 1_000_000);
            let (mut lost, mut rel) = (Vec::new(), Vec::new());
            kv.t.renew(D, &ids, Nanos(15 * SEC), &mut lost, &mut rel);
            kv.t.tick(Nanos(29 * SEC + 950_000_000), &mut rel);
            (kv, Vec::with_capacity(BUDGET))
        })
        .bench_local_refs(|(kv, rel)| assert!(kv.t.tick_budget(Nanos(30 * SEC + 50_000_000), BUDGET, rel)));
}

/// For comparison: the same expiry of 10^6 leases in one unbudgeted tick.
#[divan::bench(sample_count = 10, sample_size = 1)]
fn unbudgeted_tick_1m_all_expire(bencher: Bencher) {
    bencher
        .with_inputs(|| {
            let (mut kv, _, _) = granted(Kv::new(), 1_000_000);
            kv.t.tick(Nanos(29 * SEC + 950_000_000), &mut kv.rel);
            (kv, Vec::with_capacity(1_000_000))
        })
        .bench_local_refs(|(kv, rel)| {
            kv.t.tick(Nanos(30 * SEC + 50_000_000), rel);
            assert_eq!(rel.len(), 1_000_000);
        });
}

/// A reaper tick at n = 10^6 with nothing expired (SPEC P4: O(1), not a scan).
#[divan::bench(sample_count = 200)]
fn tick_idle_1m(bencher: Bencher) {
    let (mut kv, _, _) = granted(Kv::new(), 1_000_000);
    let mut rel: Vec<Released<()>> = Vec::new();
    let mut now = 10 * SEC;
    bencher.bench_local(|| {
        now += 1_000; // 1 µs per tick: the same bucket, as a busy reaper would see it
        kv.t.tick(Nanos(now), &mut rel);
        rel.len()
    });
}

/// Baseline: vLLM's correct full sweep of every lease's expiry at n = 10^6.
#[divan::bench(sample_count = 20)]
fn baseline_full_sweep_1m(bencher: Bencher) {
    let deadlines: Vec<(u64, u64)> = (0..1_000_000u64).map(|i| (i, 30 * SEC + i)).collect();
    bencher.bench_local(|| black_box(&deadlines).iter().filter(|(_, d)| *d <= 10 * SEC).count());
}

/// A reaper tick at n = 10^6 that expires 1,000 leases (SPEC P4: O(expired)).
#[divan::bench(sample_count = 30, sample_size = 1)]
fn tick_expire_1000_of_1m(bencher: Bencher) {
    bencher
        .with_inputs(|| {
            let mut t: LeaseTable<u32> = LeaseTable::new(&LeaseConfig::default());
            for i in 0..1_000u32 {
                t.grant(Nanos(0), 1, i);
            }
            for i in 0..999_000u32 {
                t.grant(Nanos(10 * SEC), 1, i);
            }
            let mut rel = Vec::new();
            t.tick(Nanos(29 * SEC + 950_000_000), &mut rel);
            assert!(rel.is_empty());
            (t, Vec::with_capacity(1_000))
        })
        .bench_local_refs(|(t, rel)| {
            t.tick(Nanos(30 * SEC + 50_000_000), rel);
            assert_eq!(rel.len(), 1_000);
        });
}

/// Encode then decode a heartbeat of k ids granted in a row (SPEC §9).
#[divan::bench(args = [100, 1_000], sample_count = 200)]
fn heartbeat_encode_decode(bencher: Bencher, k: usize) {
    let ids: Vec<u64> = (5_000_000..5_000_000 + k as u64).collect();
    let mut buf = Vec::with_capacity(4 * k);
    bencher.counter(divan::counter::ItemsCount::new(k)).bench_local(|| {
        buf.clear();
        encode_heartbeat(7, black_box(&ids), &mut buf);
        Message::decode(&buf).map(|_| ())
    });
}

/// Baseline: vLLM's text heartbeat, `"HB:" + ",".join(request_ids)`, built and split.
#[divan::bench(args = [100, 1_000], sample_count = 200)]
fn baseline_text_heartbeat(bencher: Bencher, k: usize) {
    let ids: Vec<String> = (0..k).map(|i| format!("cmpl-{:032x}-0", 0x5f3759df_u64.wrapping_mul(i as u64 + 1))).collect();
    bencher.counter(divan::counter::ItemsCount::new(k)).bench_local(|| {
        let msg = format!("HB:{}", black_box(&ids).join(","));
        msg[3..].split(',').count()
    });
}
