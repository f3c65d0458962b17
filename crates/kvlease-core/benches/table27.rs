//! The lease table's independent bench (issue #27): `cargo bench -p kvlease-core --bench table27`.
//!
//! Measured the way the reviewer measured it, not the way `core.rs` does: payload `u32`
//! (not `()`), about 6.7×10^5 live leases, and a mix of churn (grants, and releases of random
//! live ids) with heartbeats that renew 1,000 random live ids each. The baseline, in the same
//! run and driven by the same code, is a std `HashMap<u64, (deadline, holder, payload)>` with the
//! same renewal rule. Two id patterns:
//!
//! * `dense`: the live leases were granted in a row (live ids nearly consecutive);
//! * `sparse`: after the same grants, four times as many grants each replaced a random live lease
//!   (released), so the live ids are scattered over five times their number.
//!
//! Memory is counted by a global allocator that tracks every live byte of the process: a table's
//! bytes are what the process holds less what it holds once that table is dropped, so every
//! allocation the table owns counts (slots, expiry index, holders, side maps). `main` prints
//! bytes per live lease for each case before the timed runs: after the fill, and after a further
//! 6.7×10^5 churn steps.
//!
//! Timed cases, per iteration (inputs drawn untimed just before, `sample_size = 1`):
//!
//! * `mix`: one heartbeat of 1,000 random live ids (sorted, as on the wire), then 500 grants and
//!   500 releases of random live ids: 2,000 operations;
//! * `beats`: the heartbeat alone (1,000 renewals);
//! * `churn`: the 500 grants and 500 releases alone;
//! * `best` (dense only): the same 1,000 consecutive ids renewed every time, hot in cache.
//!
//! Divan's item rate is per operation; the ratio is the `HashMap` time over kvlease's.

use divan::Bencher;
use kvlease_core::config::LeaseConfig;
use kvlease_core::lease_table::{Holder, LeaseTable, Released};
use kvlease_core::Nanos;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};

/// Counts every live heap byte of the process.
struct LiveBytes;
static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards every call to `System` unchanged; only counts sizes.
unsafe impl GlobalAlloc for LiveBytes {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Relaxed);
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: LiveBytes = LiveBytes;

const N: usize = 670_000;
const BEAT: usize = 1_000;
const CHURN: usize = 500;
const SEC: u64 = 1_000_000_000;
/// Simulated time per iteration: every lease is renewed long before it could expire.
const STEP: u64 = 100_000;

/// xorshift64*: fixed seeds, so every run draws the same traffic.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// What the bench does with a lease table; kvlease's and the baseline's.
trait Table {
    fn new() -> Self;
    fn grant(&mut self, now: u64, payload: u32) -> u64;
    fn release(&mut self, id: u64, now: u64);
    fn renew(&mut self, ids: &[u64], now: u64) -> usize;
    fn describe(&self) -> String;
}

struct Kv {
    t: LeaseTable<u32>,
    holder: Holder,
    lost: Vec<u64>,
    rel: Vec<Released<u32>>,
}

impl Table for Kv {
    fn new() -> Kv {
        let mut t = LeaseTable::new(&LeaseConfig::default());
        let holder = t.holder("decoder-0");
        Kv { t, holder, lost: Vec::new(), rel: Vec::new() }
    }
    fn grant(&mut self, now: u64, payload: u32) -> u64 {
        self.t.grant(Nanos(now), 1, payload)
    }
    fn release(&mut self, id: u64, now: u64) {
        self.rel.clear();
        self.lost.clear();
        self.t.release(self.holder, &[id], Nanos(now), &mut self.lost, &mut self.rel);
    }
    fn renew(&mut self, ids: &[u64], now: u64) -> usize {
        self.rel.clear();
        self.lost.clear();
        self.t.renew(self.holder, ids, Nanos(now), &mut self.lost, &mut self.rel)
    }
    fn describe(&self) -> String {
        format!("kvlease (capacity {} slots)", self.t.capacity())
    }
}

/// Baseline: `HashMap<id, (deadline ns, holder, payload)>` (std hasher), ids handed out in a
/// row, renewing by the same rule (live, same holder or none yet: `max(deadline, now + E)`).
struct Base {
    map: HashMap<u64, (u64, u32, u32)>,
    next: u64,
}

impl Table for Base {
    fn new() -> Base {
        Base { map: HashMap::new(), next: 0 }
    }
    fn grant(&mut self, now: u64, payload: u32) -> u64 {
        self.next += 1;
        self.map.insert(self.next, (now + 30 * SEC, 0, payload));
        self.next
    }
    fn release(&mut self, id: u64, _now: u64) {
        self.map.remove(&id);
    }
    fn renew(&mut self, ids: &[u64], now: u64) -> usize {
        let mut renewed = 0;
        for &id in ids {
            if let Some(l) = self.map.get_mut(&id) {
                if (l.1 == 0 || l.1 == 1) && l.0 > now {
                    l.1 = 1;
                    l.0 = l.0.max(now + 20 * SEC);
                    renewed += 1;
                }
            }
        }
        renewed
    }
    fn describe(&self) -> String {
        format!("HashMap (capacity {} entries)", self.map.capacity())
    }
}

/// A table under traffic, with the driver's list of its live ids.
struct State<T> {
    t: T,
    live: Vec<u64>,
    rng: Rng,
    now: u64,
    payload: u32,
}

impl<T: Table> State<T> {
    /// `N` leases granted in a row; `sparse`: then `4 N` grants each replacing a random live one.
    fn fill(sparse: bool) -> State<T> {
        let mut s = State { t: T::new(), live: Vec::with_capacity(N), rng: Rng(0x9e37_79b9_7f4a_7c15), now: SEC, payload: 0 };
        for _ in 0..N {
            s.grant();
        }
        if sparse {
            s.churn_steps(4 * N);
        }
        s
    }

    fn grant(&mut self) {
        self.payload = self.payload.wrapping_add(1);
        let id = self.t.grant(self.now, self.payload);
        self.live.push(id);
    }

    /// `n` grants, each followed by the release of a random live lease.
    fn churn_steps(&mut self, n: usize) {
        for _ in 0..n {
            self.now += STEP / 1_000;
            self.grant();
            let i = self.rng.below(self.live.len());
            let id = self.live.swap_remove(i);
            self.t.release(id, self.now);
        }
    }

    /// The next iteration's inputs: a heartbeat of `BEAT` distinct random live ids, sorted, and
    /// `CHURN` random live ids to release (taken off the live list now).
    fn draw(&mut self, beat: bool, churn: bool) -> Input {
        self.now += STEP;
        let mut hb = Vec::new();
        if beat {
            let n = self.live.len();
            for j in 0..BEAT {
                // A partial Fisher-Yates shuffle of the tail: distinct ids.
                let i = n - 1 - j;
                let k = self.rng.below(i + 1);
                self.live.swap(i, k);
                hb.push(self.live[i]);
            }
            hb.sort_unstable();
        }
        let mut rel = Vec::new();
        if churn {
            for _ in 0..CHURN {
                let i = self.rng.below(self.live.len());
                rel.push(self.live.swap_remove(i));
            }
        }
        Input { now: self.now, hb, rel, granted: Vec::with_capacity(CHURN) }
    }
}

struct Input {
    now: u64,
    hb: Vec<u64>,
    rel: Vec<u64>,
    granted: Vec<u64>,
}

/// The timed part of an iteration: the heartbeat, then the grants and releases interleaved.
fn run<T: Table>(t: &mut T, input: &mut Input, payload: u32) -> usize {
    let mut renewed = 0;
    if !input.hb.is_empty() {
        renewed = t.renew(&input.hb, input.now);
    }
    for (j, &id) in input.rel.iter().enumerate() {
        input.granted.push(t.grant(input.now, payload.wrapping_add(j as u32)));
        t.release(id, input.now);
    }
    renewed + input.granted.len()
}

fn bench<T: Table>(bencher: Bencher, sparse: bool, what: &str) {
    let (beat, churn) = match what {
        "mix" => (true, true),
        "beats" => (true, false),
        "churn" => (false, true),
        _ => unreachable!("{what}"),
    };
    let state = RefCell::new(State::<T>::fill(sparse));
    let ops = if beat { BEAT } else { 0 } + if churn { 2 * CHURN } else { 0 };
    bencher
        .counter(divan::counter::ItemsCount::new(ops))
        .with_inputs(|| {
            let mut s = state.borrow_mut();
            s.payload = s.payload.wrapping_add(CHURN as u32);
            let p = s.payload;
            (s.draw(beat, churn), p)
        })
        .bench_local_values(|(mut input, payload)| {
            let mut s = state.borrow_mut();
            let n = run(&mut s.t, &mut input, payload);
            s.live.extend_from_slice(&input.granted);
            n
        });
}

const CASES: [&str; 3] = ["mix", "beats", "churn"];

#[divan::bench(args = CASES, sample_count = 300, sample_size = 1)]
fn dense_kvlease(bencher: Bencher, what: &str) {
    bench::<Kv>(bencher, false, what);
}

#[divan::bench(args = CASES, sample_count = 300, sample_size = 1)]
fn dense_hashmap(bencher: Bencher, what: &str) {
    bench::<Base>(bencher, false, what);
}

#[divan::bench(args = CASES, sample_count = 300, sample_size = 1)]
fn sparse_kvlease(bencher: Bencher, what: &str) {
    bench::<Kv>(bencher, true, what);
}

#[divan::bench(args = CASES, sample_count = 300, sample_size = 1)]
fn sparse_hashmap(bencher: Bencher, what: &str) {
    bench::<Base>(bencher, true, what);
}

/// Best case: the same 1,000 consecutive ids renewed every iteration (hot in cache).
fn best<T: Table>(bencher: Bencher) {
    let mut s = State::<T>::fill(false);
    let mut hb = s.live[N / 2..N / 2 + BEAT].to_vec();
    hb.sort_unstable();
    let mut now = s.now;
    bencher.counter(divan::counter::ItemsCount::new(BEAT)).bench_local(|| {
        now += STEP;
        s.t.renew(divan::black_box(&hb), now)
    });
}

#[divan::bench(sample_count = 300)]
fn best_kvlease(bencher: Bencher) {
    best::<Kv>(bencher);
}

#[divan::bench(sample_count = 300)]
fn best_hashmap(bencher: Bencher) {
    best::<Base>(bencher);
}

/// Bytes the process holds for `t`: its live bytes now less after dropping it.
fn bytes_of<T>(t: T) -> isize {
    let with = LIVE.load(Relaxed);
    drop(t);
    with - LIVE.load(Relaxed)
}

fn memory<T: Table>(sparse: bool) {
    let s = State::<T>::fill(sparse);
    let filled = s.live.len();
    let name = s.t.describe();
    let State { t, live, rng, now, payload } = s;
    let b0 = bytes_of(t);
    // Rebuild the same table (same seeds), then churn it further, to measure after the churn.
    let _ = (live, rng, now, payload);
    let mut s = State::<T>::fill(sparse);
    s.churn_steps(N);
    let name2 = s.t.describe();
    let after = s.live.len();
    let b1 = bytes_of(s.t);
    let case = if sparse { "sparse" } else { "dense " };
    println!("  {case} {name:<40} after fill: {:5.1} B/live ({filled} live)", b0 as f64 / filled as f64);
    println!("  {case} {name2:<40} after {N} more churn steps: {:5.1} B/live ({after} live)", b1 as f64 / after as f64);
}

fn main() {
    println!("table bytes per live lease (every byte the table holds, payload u32):");
    for sparse in [false, true] {
        memory::<Kv>(sparse);
        memory::<Base>(sparse);
    }
    divan::main();
}
