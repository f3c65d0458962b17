//! D's renewer at scale (issue #11, part 3): `cargo bench -p kvlease-core --bench renewer`.
//!
//! 10^6 tracked requests across 100 P engines (10^4 each, lease ids granted in a row per engine,
//! every 8th request arriving out of order), every engine Ready. One iteration is one heartbeat
//! round: `poll` at the next interval builds and encodes every engine's heartbeats (64 KiB
//! messages), and P's acknowledgement of each is handed to `on_message`. The figure is per
//! tracked id (divan's items). `churn` rounds also replace a tenth of the requests before each
//! round (untrack 10^5, track 10^5 new), so the round folds late ids and tombstones in.
//!
//! Baseline in the same run: the renewer before issue #11's part 3 (a `BTreeMap` of tracked
//! leases per engine, each heartbeat keeping a copy of its ids, an acknowledgement looking up
//! every id it named), reduced to its round and acknowledgement.
//!
//! Before the timed runs, `main` prints bytes per tracked request (a counting global allocator
//! around the tracking calls; request ids' own bytes not counted) for both.

use divan::{black_box, Bencher};
use kvlease_core::config::LeaseConfig;
use kvlease_core::renewer::{Action, Handshook, Remote, Renewer, Untrack};
use kvlease_core::wire::{encode_heartbeat, heartbeat_chunks, Message};
use kvlease_core::{LeaseId, Nanos};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;

#[path = "common/counting.rs"]
mod counting;
use counting::{counted, Counting, HELD};

#[global_allocator]
static ALLOC: Counting = Counting;

const ENGINES: usize = 100;
const TRACKED: usize = 1_000_000;
const SEC: u64 = 1_000_000_000;
/// I of the default 30 s lease.
const INTERVAL: u64 = 5 * SEC;
const E: u64 = 20 * SEC;

fn engine_name(e: usize) -> String {
    format!("prefill-{e:03}")
}

fn remote(e: usize) -> Remote {
    Remote { engine_id: engine_name(e), host: "10.0.0.1".into(), port: 7000 + e as u16, incarnation: 11 }
}

/// vLLM-shaped request ids: `cmpl-<32 hex>-0` (40 bytes).
fn request_id(i: usize) -> String {
    format!("cmpl-{:032x}-0", (i as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
}

/// Request `i`'s engine and lease id: dealt round-robin, ids granted in a row per engine, every
/// 8th one (per engine) arriving after a later one.
fn placement(i: usize) -> (usize, LeaseId) {
    let e = i % ENGINES;
    let k = (i / ENGINES) as u64;
    let id = if k % 8 == 7 {
        k - 3
    } else if k % 8 == 4 {
        k + 3
    } else {
        k
    };
    (e, 1_000 + id)
}

struct Setup {
    r: Renewer,
    now: u64,
    next: usize,
    out: Vec<Action>,
}

/// A renewer tracking `TRACKED` requests, every engine handshaken, one round already sent.
fn setup() -> Setup {
    let mut r = Renewer::new(&LeaseConfig::default());
    for i in 0..TRACKED {
        let (e, id) = placement(i);
        r.track(&request_id(i), &remote(e), id, Nanos(SEC));
    }
    let mut out = Vec::new();
    r.poll(Nanos(SEC), &mut out);
    for e in 0..ENGINES {
        r.handshake_done(&engine_name(e), Ok(Handshook { incarnation: 11, agents: vec![format!("{}/0", engine_name(e))] }), Nanos(SEC));
    }
    let mut s = Setup { r, now: SEC, next: TRACKED, out };
    round(&mut s);
    s
}

/// One heartbeat round at the next interval, every heartbeat acknowledged. Returns ids sent.
fn round(s: &mut Setup) -> usize {
    s.now += INTERVAL;
    s.out.clear();
    s.r.poll(Nanos(s.now), &mut s.out);
    let mut ids = 0;
    for a in &s.out {
        if let Action::Send { engine_id, bytes, .. } = a {
            if let Ok(Message::Heartbeat { seq, lease_ids }) = Message::decode(bytes) {
                ids += lease_ids.len();
                s.r.on_message(engine_id, &Message::HeartbeatAck { seq, lost_ids: Vec::new() }, Nanos(s.now + SEC / 1000));
            }
        }
    }
    ids
}

/// Only what D does in a round, timed: P's decoding of the heartbeats into acks is done ahead.
fn round_timed(bencher: Bencher, churn: bool) {
    let s = std::cell::RefCell::new(setup());
    bencher
        .counter(divan::counter::ItemsCount::new(TRACKED))
        .with_inputs(|| {
            let s = &mut *s.borrow_mut();
            if churn {
                // The oldest tenth of the requests done, as many new ones arrived.
                for k in 0..TRACKED / 10 {
                    let old = s.next - TRACKED + k;
                    s.r.untrack(&request_id(old), Untrack::Transferred);
                }
                for _ in 0..TRACKED / 10 {
                    let (e, id) = placement(s.next);
                    s.r.track(&request_id(s.next), &remote(e), id, Nanos(s.now));
                    s.next += 1;
                }
            }
            s.now += INTERVAL;
        })
        .bench_local_refs(|_| {
            let s = &mut *s.borrow_mut();
            s.out.clear();
            s.r.poll(Nanos(s.now), &mut s.out);
            for a in &s.out {
                if let Action::Send { engine_id, bytes, .. } = a {
                    // The seq is the varint after the 4-byte header; P's ack names it.
                    let seq = seq_of(bytes);
                    s.r.on_message(engine_id, &Message::HeartbeatAck { seq, lost_ids: Vec::new() }, Nanos(s.now + SEC / 1000));
                }
            }
            black_box(s.out.len())
        });
}

fn seq_of(bytes: &[u8]) -> u64 {
    let mut v = 0u64;
    for (i, b) in bytes.iter().skip(4).take(10).enumerate() {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            break;
        }
    }
    v
}

/// A heartbeat round of 10^6 tracked ids across 100 engines, acknowledged.
#[divan::bench(sample_count = 20, sample_size = 1)]
fn round_1m_100_engines(bencher: Bencher) {
    round_timed(bencher, false);
}

/// The same with a tenth of the requests replaced before each round (not timed: see `track_untrack`).
#[divan::bench(sample_count = 20, sample_size = 1)]
fn round_1m_100_engines_churn(bencher: Bencher) {
    round_timed(bencher, true);
}

/// Tracking a new request and untracking an old one, at 10^6 tracked (per pair).
#[divan::bench(sample_count = 20, sample_size = 1)]
fn track_untrack_1m(bencher: Bencher) {
    let mut s = setup();
    const PAIRS: usize = 10_000;
    bencher.counter(divan::counter::ItemsCount::new(PAIRS)).bench_local(|| {
        for _ in 0..PAIRS {
            let (e, id) = placement(s.next);
            s.r.track(&request_id(s.next), &remote(e), id, Nanos(s.now));
            s.r.untrack(&request_id(s.next - TRACKED), Untrack::Transferred);
            s.next += 1;
        }
    });
}

/// The renewer before part 3, reduced to what a round and its acknowledgements do.
#[derive(Default)]
struct OldRenewer {
    engines: BTreeMap<String, OldEngine>,
    requests: BTreeMap<String, (String, LeaseId)>,
}

#[derive(Default)]
struct OldEngine {
    leases: BTreeMap<LeaseId, OldTracked>,
    seq: u64,
    inflight: VecDeque<(u64, u64, Vec<LeaseId>)>,
}

struct OldTracked {
    _request_id: String,
    _incarnation: u64,
    acked_until: u64,
}

impl OldRenewer {
    fn track(&mut self, request_id: &str, engine: &str, lease_id: LeaseId) {
        let e = self.engines.entry(engine.to_string()).or_default();
        e.leases.insert(lease_id, OldTracked { _request_id: request_id.to_string(), _incarnation: 11, acked_until: 0 });
        self.requests.insert(request_id.to_string(), (engine.to_string(), lease_id));
    }

    fn round(&mut self, now: u64, out: &mut Vec<(String, u64, Vec<u8>)>) {
        for (name, e) in &mut self.engines {
            while e.inflight.front().is_some_and(|(_, sent, _)| sent + E <= now) {
                e.inflight.pop_front();
            }
            let ids: Vec<LeaseId> = e.leases.keys().copied().collect();
            for range in heartbeat_chunks(&ids, 64 * 1024) {
                e.seq += 1;
                let mut bytes = Vec::new();
                encode_heartbeat(e.seq, &ids[range.clone()], &mut bytes);
                e.inflight.push_back((e.seq, now, ids[range].to_vec()));
                out.push((name.clone(), e.seq, bytes));
            }
        }
    }

    fn ack(&mut self, engine: &str, seq: u64) {
        let Some(e) = self.engines.get_mut(engine) else { return };
        if let Some(pos) = e.inflight.iter().position(|(s, _, _)| *s == seq) {
            let (_, sent, ids) = &e.inflight[pos];
            for id in ids {
                if let Some(t) = e.leases.get_mut(id) {
                    t.acked_until = t.acked_until.max(sent + E);
                }
            }
        }
    }
}

/// Baseline: the old renewer's round and acknowledgements over the same 10^6 requests.
#[divan::bench(sample_count = 20, sample_size = 1)]
fn round_1m_100_engines_old_btreemap(bencher: Bencher) {
    let mut old = OldRenewer::default();
    for i in 0..TRACKED {
        let (e, id) = placement(i);
        old.track(&request_id(i), &engine_name(e), id);
    }
    let mut now = SEC;
    let mut out = Vec::new();
    bencher.counter(divan::counter::ItemsCount::new(TRACKED)).bench_local(|| {
        now += INTERVAL;
        out.clear();
        old.round(now, &mut out);
        for (engine, seq, _) in &out {
            old.ack(engine, *seq);
        }
        black_box(out.len())
    });
}

fn main() {
    let ids: usize = (0..TRACKED).map(|i| request_id(i).len()).sum();
    let before = HELD.load(Relaxed);
    let s = counted(setup);
    let new = (HELD.load(Relaxed) - before) as f64 - ids as f64;
    let table = s.r.table_bytes();
    let mut s = s;
    let sent = round(&mut s);
    drop(s);
    let before = HELD.load(Relaxed);
    let old = counted(|| {
        let mut old = OldRenewer::default();
        for i in 0..TRACKED {
            let (e, id) = placement(i);
            old.track(&request_id(i), &engine_name(e), id);
        }
        let mut out = Vec::new();
        old.round(SEC, &mut out);
        old
    });
    // The old renewer keeps each request id twice (the lease's and the index's key).
    let old_bytes = (HELD.load(Relaxed) - before) as f64 - 2.0 * ids as f64;
    drop(old);
    println!("D's renewer, {TRACKED} tracked across {ENGINES} P engines, one round sent ({sent} ids):");
    println!(
        "  bytes per tracked request, request ids' bytes ({} B each) not counted: {:.1} B (renewer's own tables: {:.1} B) | before part 3: {:.1} B",
        ids / TRACKED,
        new / TRACKED as f64,
        table as f64 / TRACKED as f64,
        old_bytes / TRACKED as f64
    );
    divan::main();
}
