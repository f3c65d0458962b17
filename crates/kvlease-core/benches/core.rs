//! Core benchmarks (divan): `cargo bench -p kvlease-core --bench core`.
//!
//! Each kvlease figure has a baseline measured in the same run, so the ratio survives a noisy
//! machine: a `std::collections::HashMap` lease table for renewals, and vLLM's full sweep of all
//! leases for the reaper tick. Figures are per call; divide by `k` for per-lease costs.

use divan::{black_box, Bencher};
use kvlease_core::config::LeaseConfig;
use kvlease_core::digest::PromptDigest;
use kvlease_core::lease_table::{Holder, LeaseTable, Released};
use kvlease_core::wire::{encode_heartbeat, Message};
use kvlease_core::Nanos;
use std::collections::HashMap;

fn main() {
    divan::main();
}

const K: usize = 1000;
const SEC: u64 = 1_000_000_000;
const D: Holder = Holder(std::num::NonZeroU32::MIN);
const DIGEST: PromptDigest = PromptDigest([0; 16]);

/// A table of `n` live leases granted at t = 0, and the encoded heartbeat for `K` of them
/// granted in a row, from the middle.
fn table(n: usize) -> (LeaseTable<u32>, Vec<u8>) {
    let mut t = LeaseTable::new(&LeaseConfig::default());
    let ids: Vec<u64> = (0..n).map(|i| t.grant(Nanos(0), 1, DIGEST, i as u32)).collect();
    let start = n / 2 - K.min(n) / 2;
    let mut hb = Vec::new();
    encode_heartbeat(1, &ids[start..start + K.min(n)], &mut hb);
    (t, hb)
}

/// Decode one heartbeat of 1,000 ids and renew them in a table of `n` leases (SPEC P2).
#[divan::bench(args = [1_000, 100_000, 1_000_000], sample_count = 200)]
fn renew_heartbeat_1000(bencher: Bencher, n: usize) {
    let (mut t, hb) = table(n);
    let (mut lost, mut rel) = (Vec::new(), Vec::new());
    let mut now = SEC;
    bencher.counter(divan::counter::ItemsCount::new(K)).bench_local(|| {
        now += 1;
        let Ok(Message::Heartbeat { lease_ids, .. }) = Message::decode(black_box(&hb)) else { unreachable!() };
        lost.clear();
        t.renew(D, &lease_ids, Nanos(now), &mut lost, &mut rel)
    });
}

/// Baseline: the same heartbeat against a std HashMap<u64, deadline> table.
#[divan::bench(args = [1_000, 100_000, 1_000_000], sample_count = 200)]
fn baseline_hashmap_renew_1000(bencher: Bencher, n: usize) {
    let mut map: HashMap<u64, u64> = (1..=n as u64).map(|id| (id, 30 * SEC)).collect();
    let (_, hb) = table(n.min(1_000));
    let Ok(Message::Heartbeat { lease_ids, .. }) = Message::decode(&hb) else { unreachable!() };
    let shift = (n as u64 / 2).saturating_sub(500);
    let mut now = SEC;
    bencher.counter(divan::counter::ItemsCount::new(K)).bench_local(|| {
        now += 1;
        let Ok(Message::Heartbeat { lease_ids: ids, .. }) = Message::decode(black_box(&hb)) else { unreachable!() };
        let mut renewed = 0;
        for id in ids {
            if let Some(d) = map.get_mut(&(id + shift)) {
                *d = (*d).max(now + 20 * SEC);
                renewed += 1;
            }
        }
        black_box(&lease_ids);
        renewed
    });
}

/// A reaper tick at n = 10^6 with nothing expired (SPEC P4: O(1), not a scan).
#[divan::bench(sample_count = 200)]
fn tick_idle_1m(bencher: Bencher) {
    let (mut t, _) = table(1_000_000);
    let mut rel: Vec<Released<u32>> = Vec::new();
    let mut now = 10 * SEC;
    bencher.bench_local(|| {
        now += 1_000; // 1 µs per tick: the same bucket, as a busy reaper would see it
        t.tick(Nanos(now), &mut rel);
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
                t.grant(Nanos(0), 1, DIGEST, i);
            }
            for i in 0..999_000u32 {
                t.grant(Nanos(10 * SEC), 1, DIGEST, i);
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
