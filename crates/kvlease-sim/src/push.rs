//! Push mode's protocol under deterministic simulation (issue #24): P's [`PushSource`] and D's
//! [`PushSink`], the core machines only, under virtual time with faults drawn from one seed — no
//! engine, no transport, no socket (as [`crate::heartbeat`] runs only the renewer and the lease
//! table).
//!
//! * **Requests**: the router dispatches both legs at once. D admits the request
//!   ([`PushSink::admit`]: renewed from now, U2), waits for destination blocks in its pool and
//!   registers them ([`PushSink::register`]) while P prefills (random durations, source blocks
//!   from P's pool) and then grants ([`PushSource::grant`]). Each request expects 1–2
//!   destination ranks × 1–2 pipeline stages of writes. P's driver posts each write of a
//!   [`WriteJob`] after a posting delay (sometimes long: a handshake that came late) through
//!   [`PushSource::begin_write`], and the write **lands when the NIC gets to it**: it copies
//!   whatever P's source blocks hold at that moment into D's blocks, then is reported
//!   ([`PushSource::end_write`]). Sometimes D registers again with new blocks (a preemption,
//!   U11); sometimes P aborts its leg (P1).
//! * **Memory**: P's source blocks and D's destination blocks are slots with an owner and a
//!   generation; a destination block keeps, per (rank, stage), whose KV was written into it.
//! * **Faults**: every message is encoded and decoded ([`Message`]) and may be lost,
//!   duplicated, delayed and so reordered; writes fail (and may leave garbage); P→D links are
//!   down for a while (writes cannot be posted: [`PushSource::fail_writes`]); a D is killed
//!   while it waits (for good) or paused (sometimes past E); a P is killed mid-write (its
//!   writes in flight land or not; it may come back as a new incarnation); clients abort on D
//!   at any point (before allocation, after registration, after some writes).
//!
//! Every run checks, by SPEC id:
//! * **U7/U12**: D schedules a request only when every block of its newest registration holds,
//!   for every rank and stage, exactly that request's KV, and no write of it failed;
//! * **U4**: no write is posted after its lease ended, and no source block is reused while a
//!   write from it is in flight;
//! * **U8**: no write lands in a destination block D has handed back or reused;
//! * **U5/P3**: every lease ends exactly once, as `transferred` only after every expected write
//!   completed; at the end every lease of a live P ended and every block is back in its pool;
//! * **U2/P2** and **P4**: a lease expires neither before the deadline D's renewals (those
//!   that reached P, whatever key they named) and P's own writes gave it, nor later than that
//!   plus one reaper tick — so a dead or paused D's lease is gone by its bound;
//! * **U6**: a write failure on P (an error, a write that could not be posted) is followed, by
//!   the time every sibling write stopped, by a message that closes D's tally;
//! * **U9**: after any abort on D, P's lease ends by the release, not by expiry, unless the
//!   release itself was lost;
//! * **U3**: D does not wait out, until its timeout, a registration P never paired while P
//!   held the lease and D's renewals kept reaching it;
//! * **U10/U6 liveness**: every request on a live D ends — ready, failed over, aborted — at the
//!   latest `push_registration_timeout` after P's last progress, and the run comes to rest.
//!
//! [`PlantedPushBug`] plants each of vLLM's push bugs in the sim's drivers, and a test shows a
//! seed finds it. The same seed gives the same trace: `kvlease sim --push --seed N` replays it.

use crate::cluster::Rng;
use crate::seeded::{Counts, EventQueue, Seeded};
use kvlease_core::config::{LeaseConfig, LoadFailurePolicy};
use kvlease_core::digest::PromptDigest;
use kvlease_core::holder::BlockGuard;
use kvlease_core::lease_table::ReleaseReason;
use kvlease_core::push::sink::{PushAction, PushSink, PushVerdict};
use kvlease_core::push::source::{EarlyJob, EarlyTicket, PushSettled, PushSource, WriteJob, WriteRefused, WriteTicket};
use kvlease_core::wire::{Message, PushKey};
use kvlease_core::{LeaseId, Nanos};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// vLLM's push bugs, planted on purpose in the simulator's drivers (its own tests only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlantedPushBug {
    /// vLLM #53095: D's heartbeats name D's own request id, an id P never matches: nothing is
    /// renewed (found by U2/P2).
    HeartbeatWrongKey,
    /// vLLM #48633: a write that failed, or could not be posted, is only logged on P: neither
    /// reported to the core nor to D, which waits over half-written blocks (found by U6).
    FailureOnlyLogged,
    /// vLLM #46283: an aborted D request never tells P (its `PushRelease` is not sent; found
    /// by U9).
    AbortNotSent,
    /// vLLM #55470: P posts a write its gate refused (the lease ended, the request retired),
    /// and the transport's notification reports it done: another request's KV, HTTP 200
    /// (found by U4, and U7/U12 or U8 when it lands).
    WriteWithoutGate,
}

impl PlantedPushBug {
    pub const ALL: [PlantedPushBug; 4] = [
        PlantedPushBug::HeartbeatWrongKey,
        PlantedPushBug::FailureOnlyLogged,
        PlantedPushBug::AbortNotSent,
        PlantedPushBug::WriteWithoutGate,
    ];
}

/// One run of push mode and its faults, all drawn from `seed` by [`Push::from_seed`].
#[derive(Debug, Clone)]
pub struct Push {
    pub seed: u64,
    pub p_engines: usize,
    pub d_engines: usize,
    pub requests: usize,
    /// Mean arrivals per simulated second.
    pub rate: f64,
    pub lease_secs: f64,
    /// `push_registration_timeout`, seconds.
    pub timeout_secs: f64,
    pub policy: LoadFailurePolicy,
    /// Each message's chance to be lost, or to arrive twice; its delay is up to `max_delay`.
    pub loss: f64,
    pub duplicate: f64,
    pub max_delay: Duration,
    /// A prefill's length, and the chance of a slow one with its longest.
    pub prefill: (Duration, Duration),
    pub slow_prefill: (f64, Duration),
    /// Source blocks per P, destination blocks per D; a request needs 1–4.
    pub p_blocks: u32,
    pub d_blocks: u32,
    /// From a write job to posting a write, and the chance of a late one (a deferred
    /// handshake) with its longest.
    pub post_delay: Duration,
    pub slow_post: (f64, Duration),
    /// How long a write takes to land, and the chance of a slow one with its longest.
    pub write_time: Duration,
    pub slow_write: (f64, Duration),
    /// A write's chance to end in error (then half the time it wrote garbage).
    pub write_error: f64,
    /// P→D links down for a while (writes cannot be posted): from, length, P, D.
    pub links_down: Vec<(Duration, Duration, usize, usize)>,
    /// A D killed for good: when, which.
    pub d_kill: Option<(Duration, usize)>,
    /// D pauses: when, how long, which.
    pub d_pauses: Vec<(Duration, Duration, usize)>,
    /// A P killed: when, which, and after how long it comes back as a new incarnation.
    pub p_kill: Option<(Duration, usize, Option<Duration>)>,
    /// A request's chance to be aborted by its client on D, to be aborted on P, and to be
    /// registered again on D (new blocks).
    pub abort: f64,
    pub p_abort: f64,
    pub preempt: f64,
    /// A decode's length at most.
    pub decode: Duration,
    pub planted: Option<PlantedPushBug>,
}

/// A push run's own counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PushCounts {
    /// Decoded from the pushed KV.
    pub used: usize,
    pub recomputed: usize,
    /// Failed cleanly (`kv_load_failure_policy: fail`).
    pub failed: usize,
    pub aborted: usize,
    /// Ended with their D killed.
    pub lost_with_d: usize,
    pub writes: usize,
}

impl Counts for PushCounts {
    const FLAG: &'static str = "--push";
    fn add(&mut self, o: &Self) {
        self.used += o.used;
        self.recomputed += o.recomputed;
        self.failed += o.failed;
        self.aborted += o.aborted;
        self.lost_with_d += o.lost_with_d;
        self.writes += o.writes;
    }
}

/// What one run found.
pub type Outcome = crate::seeded::Outcome<PushCounts>;

impl Seeded for Push {
    type Planted = PlantedPushBug;
    type Counts = PushCounts;

    /// A run drawn from `seed`.
    fn from_seed(seed: u64) -> Push {
        let mut r = Rng(seed ^ 0x9005_5eed_b10c);
        let lease_secs = [3.0, 6.0, 30.0][r.below(3)];
        let e = lease_secs * 2.0 / 3.0;
        let timeout_secs = [lease_secs, 2.0 * lease_secs, 30.0][r.below(3)];
        let p_engines = 1 + r.below(2);
        let d_engines = 1 + r.below(3);
        let requests = 8 + r.below(32);
        let rate = 1.0 + r.unit() * 10.0;
        let span = requests as f64 / rate;
        let noisy = r.chance(0.7);
        let lease = LeaseConfig::with_lease_secs(lease_secs).unwrap_or_default();
        // SPEC U8: a write lands within P's margin and D's grace of its posting deadline; the
        // sim keeps its writes (and delays) inside that, as the protocol assumes.
        let margin = PushSource::<Src>::write_margin(&lease).as_secs_f64();
        let mut links_down = Vec::new();
        if r.chance(0.3) {
            links_down.push((r.secs(0.0, span + 1.0), r.secs(0.05, e), r.below(p_engines), r.below(d_engines)));
        }
        let mut d_pauses = Vec::new();
        for _ in 0..r.below(3) {
            d_pauses.push((r.secs(0.0, span + 1.0), r.secs(0.05, e * 1.5), r.below(d_engines)));
        }
        Push {
            seed,
            p_engines,
            d_engines,
            requests,
            rate,
            lease_secs,
            timeout_secs,
            policy: if r.chance(0.2) { LoadFailurePolicy::Fail } else { LoadFailurePolicy::Recompute },
            loss: if noisy { r.unit() * 0.1 } else { 0.0 },
            duplicate: if noisy { r.unit() * 0.1 } else { 0.0 },
            max_delay: if noisy { r.secs(0.0, 0.05) } else { r.secs(0.0, 0.002) },
            prefill: (Duration::from_millis(5), r.secs(0.01, 0.3)),
            slow_prefill: (if r.chance(0.4) { r.unit() * 0.3 } else { 0.0 }, r.secs(0.3, lease_secs * 1.5)),
            p_blocks: 12 + r.below(40) as u32,
            d_blocks: 6 + r.below(30) as u32,
            post_delay: r.secs(0.0, 0.005),
            slow_post: (if r.chance(0.4) { r.unit() * 0.3 } else { 0.0 }, r.secs(0.1, lease_secs * 1.5)),
            write_time: r.secs(0.001, 0.02),
            slow_write: (if r.chance(0.4) { r.unit() * 0.3 } else { 0.0 }, r.secs(0.02, margin * 0.5)),
            write_error: if r.chance(0.5) { r.unit() * 0.1 } else { 0.0 },
            links_down,
            d_kill: r.chance(0.25).then(|| (r.secs(0.0, span + 1.0), r.below(d_engines))),
            d_pauses,
            p_kill: r.chance(0.2).then(|| (r.secs(0.0, span + 1.0), r.below(p_engines), r.chance(0.5).then(|| r.secs(1.0, 5.0)))),
            abort: if r.chance(0.5) { r.unit() * 0.3 } else { 0.0 },
            p_abort: if r.chance(0.2) { r.unit() * 0.1 } else { 0.0 },
            preempt: if r.chance(0.3) { r.unit() * 0.2 } else { 0.0 },
            decode: r.secs(0.05, 1.0),
            planted: None,
        }
    }

    fn plant(&mut self, bug: Option<PlantedPushBug>) {
        self.planted = bug;
    }

    /// Runs the workload until the run comes to rest, checking every invariant.
    fn run(&self) -> Outcome {
        let mut w = World::new(self);
        w.run();
        w.finish()
    }
}

impl Push {
    fn lease(&self) -> LeaseConfig {
        let mut l = LeaseConfig::with_lease_secs(self.lease_secs).unwrap_or_default();
        l.load_failure_policy = self.policy;
        l.push_registration_timeout = Duration::from_secs_f64(self.timeout_secs);
        l
    }
}

/// P's source blocks under a lease.
#[derive(Debug)]
struct Src(Vec<u32>);

impl BlockGuard for Src {
    fn ids(&self) -> &[u32] {
        &self.0
    }
}

#[derive(Debug, Clone)]
enum Ev {
    ArriveP {
        r: usize,
    },
    ArriveD {
        r: usize,
    },
    PrefillDone {
        r: usize,
        inc: u64,
    },
    /// P's driver posts one write of a job.
    Post {
        p: usize,
        inc: u64,
        r: usize,
        attempt: u32,
        rank: u32,
        stage: u32,
    },
    /// P's driver posts an early write (SPEC U4: blocks its prefill computed, before the grant).
    EarlyPost {
        p: usize,
        inc: u64,
        r: usize,
        attempt: u32,
    },
    /// A posted write lands (or fails).
    Land {
        w: usize,
    },
    PPoll {
        p: usize,
        gen: u64,
    },
    DPoll {
        d: usize,
        gen: u64,
    },
    ToP {
        p: usize,
        d: usize,
        bytes: Vec<u8>,
    },
    ToD {
        d: usize,
        p: usize,
        bytes: Vec<u8>,
    },
    AbortD {
        r: usize,
    },
    AbortP {
        r: usize,
    },
    Preempt {
        r: usize,
    },
    DecodeDone {
        r: usize,
    },
    KillD {
        d: usize,
    },
    KillP {
        p: usize,
    },
    RestartP {
        p: usize,
    },
}

/// Whose KV a part of a destination block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kv {
    Of(usize),
    Garbage,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DEnd {
    Used,
    Recomputed(&'static str),
    Failed(&'static str),
    Aborted,
    DKilled,
}

/// One registration's destination blocks on D.
struct Alloc {
    attempt: u32,
    blocks: Vec<u32>,
    gens: Vec<u64>,
    freed: bool,
}

/// One request: both legs and what the checks need.
struct Req {
    p: usize,
    d: usize,
    key: PushKey,
    rid_d: String,
    tokens: Vec<u32>,
    blocks: u32,
    ranks: u32,
    stages: u32,
    prefill: Duration,
    // P's side.
    p_inc: Option<u64>,
    src: Vec<u32>,
    prefilled: bool,
    p_aborted: bool,
    /// Registrations (attempts) an early write filled whole, every block of P's KV, with no
    /// failed early write after it: the transfer's writes then carry no byte (as the engine's
    /// writer does once every block landed early).
    early_whole: BTreeSet<u32>,
    lease: Option<LeaseId>,
    /// SPEC P2/P4: the deadline the lease must reach at least (surely renewed) and may reach at
    /// most (renewed within a millisecond of the deadline).
    dl_min: Nanos,
    dl_max: Nanos,
    ended: Vec<(Nanos, ReleaseReason)>,
    /// Writes that completed on P, by (attempt, rank, stage); writes that failed.
    writes_ok: BTreeSet<(u32, u32, u32)>,
    writes_failed: BTreeSet<u32>,
    /// SPEC U6: a write failure on P (when), and whether a message closing D's tally went out.
    failed_at: Option<Nanos>,
    closed_at: Option<Nanos>,
    // D's side.
    allocs: Vec<Alloc>,
    registered_at: Option<Nanos>,
    last_progress: Option<Nanos>,
    end: Option<(Nanos, DEnd)>,
    aborted_at: Option<Nanos>,
    release_sent: bool,
    release_delivered: bool,
    /// SPEC U3: when P granted, when a renewal meant for it last reached P, whether P paired a
    /// registration with the lease (a write job).
    granted_at: Option<Nanos>,
    renewed_at: Option<Nanos>,
    paired: bool,
}

struct Write {
    r: usize,
    p: usize,
    inc: u64,
    attempt: u32,
    rank: u32,
    stage: u32,
    src: Vec<u32>,
    d: usize,
    dst: Vec<(u32, u64)>,
    ticket: Option<WriteTicket>,
    /// An early write (SPEC U4): it fills every rank and stage and counts toward nothing.
    early: Option<EarlyTicket>,
    /// Whether it was an early write (`early` is taken when it lands).
    was_early: bool,
    landed: bool,
    dropped: bool,
}

struct PSlot {
    /// Whose KV the block holds (`None`: being prefilled or never written).
    kv: Option<usize>,
    free: bool,
}

struct PEngine {
    alive: bool,
    inc: u64,
    src: PushSource<Src>,
    slots: Vec<PSlot>,
    free: Vec<u32>,
    waiting: VecDeque<usize>,
    gen: u64,
    /// When the armed reaper turn runs: a later one does not replace it (the engine's reaper
    /// sleeps until its next deadline and is woken only when that moved earlier).
    armed: Option<Nanos>,
}

struct DSlot {
    gen: u64,
    owner: Option<(usize, u32)>,
    parts: BTreeMap<(u32, u32), Kv>,
}

struct DEngine {
    alive: bool,
    sink: PushSink,
    slots: Vec<DSlot>,
    free: Vec<u32>,
    waiting: VecDeque<usize>,
    gen: u64,
    reqs: BTreeMap<String, usize>,
    /// The same poll instant over and over: a spin (liveness).
    spins: u32,
}

struct World {
    c: Push,
    cfg: LeaseConfig,
    rng: Rng,
    queue: EventQueue<Ev>,
    now: Nanos,
    ps: Vec<PEngine>,
    ds: Vec<DEngine>,
    reqs: Vec<Req>,
    writes: Vec<Write>,
    /// Requests by (P engine, key), and heartbeat keys D's planted driver renamed.
    by_key: BTreeMap<(usize, PushKey), usize>,
    alias: BTreeMap<PushKey, usize>,
    /// Tickets the planted driver never ended.
    leaked: Vec<WriteTicket>,
    pauses: Vec<(Nanos, Nanos, usize)>,
    trace: Vec<String>,
    violations: Vec<String>,
    reported: BTreeSet<String>,
}

fn index(engine_id: &str, prefix: char) -> Option<usize> {
    engine_id.strip_prefix(prefix)?.parse().ok()
}

fn at(d: Duration) -> Nanos {
    Nanos::ZERO + d
}

const MS: Duration = Duration::from_millis(1);

impl World {
    fn new(c: &Push) -> World {
        let cfg = c.lease();
        let ps = (0..c.p_engines)
            .map(|i| PEngine {
                alive: true,
                inc: 100 + i as u64,
                src: PushSource::new(&cfg, 100 + i as u64),
                slots: (0..c.p_blocks).map(|_| PSlot { kv: None, free: true }).collect(),
                free: (0..c.p_blocks).rev().collect(),
                waiting: VecDeque::new(),
                gen: 0,
                armed: None,
            })
            .collect();
        let ds = (0..c.d_engines)
            .map(|_| DEngine {
                alive: true,
                sink: PushSink::new(&cfg),
                slots: (0..c.d_blocks).map(|_| DSlot { gen: 0, owner: None, parts: BTreeMap::new() }).collect(),
                free: (0..c.d_blocks).rev().collect(),
                waiting: VecDeque::new(),
                gen: 0,
                reqs: BTreeMap::new(),
                spins: 0,
            })
            .collect();
        let mut w = World {
            c: c.clone(),
            cfg,
            rng: Rng(c.seed ^ 0x0070_5115_ea5e),
            queue: EventQueue::new(),
            now: Nanos::ZERO,
            ps,
            ds,
            reqs: Vec::new(),
            writes: Vec::new(),
            by_key: BTreeMap::new(),
            alias: BTreeMap::new(),
            leaked: Vec::new(),
            pauses: c.d_pauses.iter().map(|&(a, len, d)| (at(a), at(a + len), d)).collect(),
            trace: Vec::new(),
            violations: Vec::new(),
            reported: BTreeSet::new(),
        };
        w.workload();
        w
    }

    fn workload(&mut self) {
        let mut r = Rng(self.c.seed ^ 0x0bad_f00d_0042);
        let mut t = 0.0;
        let max_blocks = 4.min(self.c.p_blocks.min(self.c.d_blocks));
        for n in 0..self.c.requests {
            t += -(1.0 - r.unit()).ln() / self.c.rate;
            let arrive = Duration::from_secs_f64(t);
            let key = if r.chance(0.7) { PushKey::Transfer(format!("tx-{n}")) } else { PushKey::Request(format!("cmpl-{n}")) };
            let prefill = if r.chance(self.c.slow_prefill.0) {
                r.secs(self.c.prefill.1.as_secs_f64(), self.c.slow_prefill.1.as_secs_f64())
            } else {
                r.secs(self.c.prefill.0.as_secs_f64(), self.c.prefill.1.as_secs_f64())
            };
            let p = r.below(self.c.p_engines);
            let d = r.below(self.c.d_engines);
            let tokens: Vec<u32> = (0..1 + r.below(64)).map(|_| r.next() as u32).collect();
            // Aborts at any point: while D waits for blocks, after registration, mid-writes.
            let abort_after = r.chance(self.c.abort).then(|| r.secs(0.0, prefill.as_secs_f64() + 0.05));
            self.by_key.insert((p, key.clone()), n);
            self.reqs.push(Req {
                p,
                d,
                key,
                rid_d: format!("d-req-{n}"),
                tokens,
                blocks: 1 + r.below(max_blocks as usize) as u32,
                ranks: 1 + r.below(2) as u32,
                stages: 1 + r.below(2) as u32,
                prefill,
                p_inc: None,
                src: Vec::new(),
                prefilled: false,
                p_aborted: false,
                early_whole: BTreeSet::new(),
                lease: None,
                dl_min: Nanos::ZERO,
                dl_max: Nanos::ZERO,
                ended: Vec::new(),
                writes_ok: BTreeSet::new(),
                writes_failed: BTreeSet::new(),
                failed_at: None,
                closed_at: None,
                allocs: Vec::new(),
                registered_at: None,
                last_progress: None,
                end: None,
                aborted_at: None,
                release_sent: false,
                release_delivered: false,
                granted_at: None,
                renewed_at: None,
                paired: false,
            });
            // Both legs at once, each a router hop away.
            let hop = |r: &mut Rng| r.secs(0.0, 0.01);
            self.push(at(arrive + hop(&mut r)), Ev::ArriveP { r: n });
            self.push(at(arrive + hop(&mut r)), Ev::ArriveD { r: n });
            if let Some(a) = abort_after {
                self.push(at(arrive + a), Ev::AbortD { r: n });
            }
            if r.chance(self.c.p_abort) {
                self.push(at(arrive + r.secs(0.0, prefill.as_secs_f64() * 1.5)), Ev::AbortP { r: n });
            }
            if r.chance(self.c.preempt) {
                self.push(at(arrive + r.secs(0.0, prefill.as_secs_f64() + 0.05)), Ev::Preempt { r: n });
            }
        }
        if let Some((a, d)) = self.c.d_kill {
            self.push(at(a), Ev::KillD { d });
        }
        if let Some((a, p, _)) = self.c.p_kill {
            self.push(at(a), Ev::KillP { p });
        }
    }

    fn push(&mut self, t: Nanos, ev: Ev) {
        self.queue.push(t, ev);
    }

    fn note(&mut self, what: String) {
        let line = format!("{:>14.9} s  {what}", self.now.as_secs_f64());
        self.trace.push(line);
    }

    fn violation(&mut self, what: String) {
        self.note(format!("VIOLATION {what}"));
        self.violations.push(what);
    }

    /// Once per (kind, subject): a broken rule is reported where it first shows.
    fn violation_once(&mut self, id: String, what: String) {
        if self.reported.insert(id) {
            self.violation(what);
        }
    }

    fn on_d(&self, ev: &Ev) -> Option<usize> {
        match ev {
            Ev::ToD { d, .. } | Ev::DPoll { d, .. } => Some(*d),
            Ev::ArriveD { r } | Ev::AbortD { r } | Ev::Preempt { r } | Ev::DecodeDone { r } => Some(self.reqs[*r].d),
            _ => None,
        }
    }

    fn paused_until(&self, d: usize, t: Nanos) -> Option<Nanos> {
        self.pauses.iter().filter(|p| p.2 == d && p.0 <= t && t < p.1).map(|p| p.1).max()
    }

    fn link_down(&self, p: usize, d: usize, t: Nanos) -> bool {
        self.c.links_down.iter().any(|&(from, len, lp, ld)| lp == p && ld == d && at(from) <= t && t < at(from + len))
    }

    fn run(&mut self) {
        let c = self.c.clone();
        self.note(format!("{c:?}"));
        let last = self.reqs.len() as f64 / c.rate;
        let pauses: f64 = c.d_pauses.iter().map(|p| p.1.as_secs_f64()).sum();
        let horizon =
            at(Duration::from_secs_f64(last * 4.0 + 10.0 + pauses + (c.timeout_secs + c.lease_secs * 2.0) * (8.0 + c.requests as f64)));
        while let Some((t, ev)) = self.queue.pop() {
            if t > horizon {
                self.violation(format!(
                    "U6/U10 liveness: events still due at {:.3} s, past the horizon {:.3} s",
                    t.as_secs_f64(),
                    horizon.as_secs_f64()
                ));
                break;
            }
            self.now = t;
            if let Some(d) = self.on_d(&ev) {
                if !self.ds[d].alive {
                    continue;
                }
                if let Some(until) = self.paused_until(d, t) {
                    self.push(until, ev);
                    continue;
                }
            }
            self.dispatch(ev);
        }
        self.final_checks();
    }

    fn dispatch(&mut self, ev: Ev) {
        match ev {
            Ev::ArriveP { r } => self.arrive_p(r),
            Ev::ArriveD { r } => self.arrive_d(r),
            Ev::PrefillDone { r, inc } => self.prefill_done(r, inc),
            Ev::Post { p, inc, r, attempt, rank, stage } => self.post(p, inc, r, attempt, rank, stage),
            Ev::EarlyPost { p, inc, r, attempt } => self.early_post(p, inc, r, attempt),
            Ev::Land { w } => self.land(w),
            Ev::PPoll { p, gen } => {
                if self.ps[p].alive && self.ps[p].gen == gen {
                    self.ps[p].armed = None;
                    let mut out = PushSettled::default();
                    while self.ps[p].src.poll(self.now, &mut out) {}
                    self.p_settled(p, out);
                }
            }
            Ev::DPoll { d, gen } => {
                if self.ds[d].gen == gen {
                    let mut acts = Vec::new();
                    self.ds[d].sink.poll(self.now, &mut acts);
                    self.d_actions(d, acts, false);
                }
            }
            Ev::ToP { p, d, bytes } => self.deliver_to_p(p, d, &bytes),
            Ev::ToD { d, p, bytes } => self.deliver_to_d(d, p, &bytes),
            Ev::AbortD { r } => self.abort_d(r),
            Ev::AbortP { r } => self.abort_p(r),
            Ev::Preempt { r } => self.preempt(r),
            Ev::DecodeDone { r } => self.decode_done(r),
            Ev::KillD { d } => self.kill_d(d),
            Ev::KillP { p } => self.kill_p(p),
            Ev::RestartP { p } => self.restart_p(p),
        }
    }

    // ---- the network ----

    fn send(&mut self, to_p: bool, p: usize, d: usize, msg: &Message) {
        let bytes = msg.encode();
        let (from, to) = if to_p { (format!("d{d}"), format!("p{p}")) } else { (format!("p{p}"), format!("d{d}")) };
        if self.rng.chance(self.c.loss) {
            self.note(format!("net: {from} → {to} {} lost", kind(msg)));
            return;
        }
        let copies = if self.rng.chance(self.c.duplicate) { 2 } else { 1 };
        for _ in 0..copies {
            let delay = self.rng.secs(0.0, self.c.max_delay.as_secs_f64());
            let ev = if to_p { Ev::ToP { p, d, bytes: bytes.clone() } } else { Ev::ToD { d, p, bytes: bytes.clone() } };
            self.push(self.now + delay, ev);
        }
    }

    fn decode(&mut self, bytes: &[u8]) -> Option<Message> {
        match Message::decode(bytes) {
            Ok(m) => Some(m),
            Err(e) => {
                self.violation(format!("wire: a message sent does not decode: {e}"));
                None
            }
        }
    }

    // ---- P ----

    fn arrive_p(&mut self, r: usize) {
        let p = self.reqs[r].p;
        if !self.ps[p].alive {
            self.note(format!("req {r}: p{p} is down, its prefill leg is lost"));
            return;
        }
        if self.reqs[r].p_aborted {
            return;
        }
        self.reqs[r].p_inc = Some(self.ps[p].inc);
        self.ps[p].waiting.push_back(r);
        self.alloc_p(p);
    }

    fn alloc_p(&mut self, p: usize) {
        while let Some(&r) = self.ps[p].waiting.front() {
            let n = self.reqs[r].blocks as usize;
            if self.ps[p].free.len() < n {
                return;
            }
            self.ps[p].waiting.pop_front();
            let mut ids = Vec::new();
            for _ in 0..n {
                let Some(b) = self.ps[p].free.pop() else { break };
                ids.push(b);
            }
            let inc = self.ps[p].inc;
            for &b in &ids {
                // SPEC U4: a source block goes to a new prefill only when no write reads it.
                let reader =
                    self.writes.iter().find(|w| w.p == p && w.inc == inc && !w.landed && !w.dropped && w.src.contains(&b)).map(|w| w.r);
                if let Some(x) = reader {
                    self.violation_once(
                        format!("U4 reuse p{p} {b} {r}"),
                        format!("U4: p{p} reused source block {b} for req {r} while a write of req {x} from it was in flight"),
                    );
                }
                self.ps[p].slots[b as usize] = PSlot { kv: None, free: false };
            }
            self.note(format!("p{p}: req {r} prefills in source blocks {ids:?}"));
            self.reqs[r].src = ids;
            let done = self.now + self.reqs[r].prefill;
            self.push(done, Ev::PrefillDone { r, inc });
            // SPEC U4: from now on D's registration may be written early.
            let (key, tokens, src) = (self.reqs[r].key.clone(), self.reqs[r].tokens.clone(), self.reqs[r].src.clone());
            let mut out = PushSettled::default();
            self.ps[p].src.prefill_started(&key, &format!("p-req-{r}"), &tokens, &src, &mut out);
            for job in out.early {
                self.early_job(p, inc, r, job);
            }
        }
    }

    /// An early job: one early write posted some time into the prefill (or after it, when the
    /// source refuses it).
    fn early_job(&mut self, p: usize, inc: u64, r: usize, job: EarlyJob) {
        if self.by_key.get(&(p, job.key.clone())) != Some(&r) {
            self.violation(format!("U1: p{p} made an early job of {} for req {r}", job.key));
            return;
        }
        let delay = self.rng.secs(0.0, self.reqs[r].prefill.as_secs_f64() * 1.2);
        self.push(self.now + delay, Ev::EarlyPost { p, inc, r, attempt: job.attempt });
    }

    /// SPEC U4: an early write, if the source lets it be posted now.
    fn early_post(&mut self, p: usize, inc: u64, r: usize, attempt: u32) {
        if !self.ps[p].alive || self.ps[p].inc != inc || self.link_down(p, self.reqs[r].d, self.now) {
            return;
        }
        let key = self.reqs[r].key.clone();
        let mut out = PushSettled::default();
        let ticket = self.ps[p].src.begin_early_write(&key, attempt, self.now, &mut out);
        self.p_settled(p, out);
        let ticket = match ticket {
            Ok(t) => t,
            Err(e) => return self.note(format!("p{p}: req {r}'s early write of attempt {attempt} not posted: {e}")),
        };
        // After the prefill, only under its live lease, before the transfer's writes.
        let req = &self.reqs[r];
        let posted = self.writes.iter().any(|w| w.r == r && !w.was_early && w.attempt == attempt);
        if req.p_aborted || (req.prefilled && (req.lease.is_none() || !req.ended.is_empty() || posted)) {
            self.violation_once(
                format!("U4 early {r}"),
                format!("U4: p{p} posted an early write of req {r} outside its prefill and its live lease"),
            );
        }
        let d = self.reqs[r].d;
        let dst = match self.reqs[r].allocs.iter().find(|a| a.attempt == attempt) {
            Some(a) => a.blocks.iter().copied().zip(a.gens.iter().copied()).collect(),
            None => Vec::new(),
        };
        let longest = if self.rng.chance(self.c.slow_write.0) { self.c.slow_write.1 } else { self.c.write_time };
        let time = self.rng.secs(0.0, longest.as_secs_f64());
        let w = self.writes.len();
        let src = self.reqs[r].src.clone();
        self.writes.push(Write {
            r,
            p,
            inc,
            attempt,
            rank: 0,
            stage: 0,
            src,
            d,
            dst,
            ticket: None,
            early: Some(ticket),
            was_early: true,
            landed: false,
            dropped: false,
        });
        let when = if self.reqs[r].prefilled { ", after the grant" } else { "" };
        self.note(format!("p{p}: req {r}'s early write of attempt {attempt} posted (w{w}, lands in {:.3} s{when})", time.as_secs_f64()));
        self.push(self.now + time, Ev::Land { w });
    }

    fn prefill_done(&mut self, r: usize, inc: u64) {
        let p = self.reqs[r].p;
        if !self.ps[p].alive || self.ps[p].inc != inc || self.reqs[r].p_aborted {
            return;
        }
        let now = self.now;
        for &b in &self.reqs[r].src {
            self.ps[p].slots[b as usize].kv = Some(r);
        }
        self.reqs[r].prefilled = true;
        let q = &self.reqs[r];
        let (key, tokens, blocks) = (q.key.clone(), q.tokens.clone(), Src(q.src.clone()));
        let mut out = PushSettled::default();
        match self.ps[p].src.grant(now, Some(key), &format!("p-req-{r}"), blocks, &tokens, &mut out) {
            Ok(g) => {
                self.note(format!("p{p}: req {r} prefilled, lease {} granted under {}", g.lease_id, g.key));
                let q = &mut self.reqs[r];
                q.lease = Some(g.lease_id);
                q.granted_at = Some(now);
                q.dl_min = now + self.cfg.lease_duration;
                q.dl_max = q.dl_min;
            }
            Err(e) => self.note(format!("p{p}: req {r} prefilled, no lease: {e}")),
        }
        self.p_settled(p, out);
    }

    fn abort_p(&mut self, r: usize) {
        let p = self.reqs[r].p;
        if !self.ps[p].alive || self.reqs[r].p_inc != Some(self.ps[p].inc) || self.reqs[r].p_aborted {
            return;
        }
        self.reqs[r].p_aborted = true;
        self.note(format!("p{p}: req {r} aborted on P"));
        let mut out = PushSettled::default();
        let key = self.reqs[r].key.clone();
        if !self.reqs[r].prefilled {
            // Not granted: its blocks (if any) come back (P1), once no early write reads them (U4).
            self.ps[p].waiting.retain(|&x| x != r);
            let ids = std::mem::take(&mut self.reqs[r].src);
            self.ps[p].src.abort_prefill(&key, &format!("p-req-{r}"), Some(Src(ids)), self.now, &mut out);
        } else {
            self.ps[p].src.abort(&key, self.now, &mut out);
        }
        self.p_settled(p, out);
    }

    fn post(&mut self, p: usize, inc: u64, r: usize, attempt: u32, rank: u32, stage: u32) {
        if !self.ps[p].alive || self.ps[p].inc != inc {
            return;
        }
        let now = self.now;
        let (d, key) = (self.reqs[r].d, self.reqs[r].key.clone());
        let mut out = PushSettled::default();
        if self.link_down(p, d, now) {
            self.note(format!("p{p}: req {r}'s write ({rank},{stage}) cannot be posted: no link to d{d}"));
            self.reqs[r].failed_at.get_or_insert(now);
            if self.c.planted == Some(PlantedPushBug::FailureOnlyLogged) {
                self.note("  planted #48633: only logged".into());
            } else {
                self.ps[p].src.fail_writes(&key, kvlease_core::wire::PushFailure::NotPosted, now, &mut out);
            }
            self.p_settled(p, out);
            return;
        }
        if self.writes.iter().any(|w| w.r == r && w.early.is_some() && !w.landed && !w.dropped) {
            // The engine's writer posts a transfer's writes once its early writes ended.
            self.push(now + MS, Ev::Post { p, inc, r, attempt, rank, stage });
            return;
        }
        let ticket = match self.ps[p].src.begin_write(&key, attempt, rank, stage, now, &mut out) {
            Ok(t) => Some(t),
            Err(WriteRefused::NotLive) if self.c.planted == Some(PlantedPushBug::WriteWithoutGate) => {
                self.note(format!("p{p}: req {r}'s write ({rank},{stage}) refused (not live), planted #55470: posted anyway"));
                None
            }
            Err(e) => {
                self.note(format!("p{p}: req {r}'s write ({rank},{stage}) of attempt {attempt} not posted: {e}"));
                self.p_settled(p, out);
                return;
            }
        };
        // SPEC U4: posted only while the lease is live, over blocks still holding its KV.
        if self.reqs[r].lease.is_none() || !self.reqs[r].ended.is_empty() {
            self.violation_once(format!("U4 post {r}"), format!("U4: p{p} posted a write of req {r} after its lease ended"));
        }
        if ticket.is_some() {
            let e = self.cfg.extension;
            let q = &mut self.reqs[r];
            if now + MS < q.dl_min {
                q.dl_min = q.dl_min.max(now + e);
            }
            if now < q.dl_max + MS {
                q.dl_max = q.dl_max.max(now + e);
            }
        }
        // Every block landed early into this registration: the write carries no byte, only
        // its completion (SPEC U4, U5).
        let nothing = self.reqs[r].early_whole.contains(&attempt);
        let dst = match self.reqs[r].allocs.iter().find(|a| a.attempt == attempt) {
            Some(a) if !nothing => a.blocks.iter().copied().zip(a.gens.iter().copied()).collect(),
            _ => Vec::new(),
        };
        let src = if nothing { Vec::new() } else { self.reqs[r].src.clone() };
        let slow = self.rng.chance(self.c.slow_write.0);
        let time = if slow {
            self.rng.secs(self.c.write_time.as_secs_f64(), self.c.slow_write.1.as_secs_f64())
        } else {
            self.rng.secs(0.0, self.c.write_time.as_secs_f64())
        };
        let w = self.writes.len();
        self.writes.push(Write {
            r,
            p,
            inc,
            attempt,
            rank,
            stage,
            src,
            d,
            dst,
            ticket,
            early: None,
            was_early: false,
            landed: false,
            dropped: false,
        });
        let what = if nothing { ", no byte: every block landed early" } else { "" };
        self.note(format!(
            "p{p}: req {r}'s write ({rank},{stage}) of attempt {attempt} posted (w{w}, lands in {:.3} s{what})",
            time.as_secs_f64()
        ));
        self.push(now + time, Ev::Land { w });
        self.p_settled(p, out);
    }

    fn land(&mut self, w: usize) {
        let now = self.now;
        let (r, p, inc, attempt, rank, stage, d) = {
            let x = &self.writes[w];
            (x.r, x.p, x.inc, x.attempt, x.rank, x.stage, x.d)
        };
        self.writes[w].landed = true;
        if self.writes[w].dropped {
            return;
        }
        let ok = self.ds[d].alive && !self.rng.chance(self.c.write_error);
        let garbage = !ok && self.ds[d].alive && self.rng.chance(0.5);
        // An early write that put P's KV, right, into every block of the registration.
        let mut whole = ok && self.writes[w].was_early && self.writes[w].dst.len() == self.reqs[r].src.len();
        if ok || garbage {
            let mut moved = false;
            for i in 0..self.writes[w].dst.len() {
                let (b, gen) = self.writes[w].dst[i];
                let slot = &self.ds[d].slots[b as usize];
                if slot.gen != gen || slot.owner != Some((r, attempt)) {
                    whole = false;
                    if !moved {
                        moved = true;
                        self.violation_once(
                            format!("U8 w{w}"),
                            format!(
                                "U8: write w{w} of req {r} (attempt {attempt}, rank {rank}, stage {stage}) landed in d{d}'s block {b} after D handed it back or reused it"
                            ),
                        );
                    }
                    continue;
                }
                let src = self.writes[w].src.get(i).map(|s| &self.ps[p].slots[*s as usize]);
                let kv = if garbage {
                    Kv::Garbage
                } else if self.writes[w].early.is_some() {
                    // The prefill computed the block: it holds req r's KV while not given back.
                    match src {
                        Some(s) if !s.free && s.kv.is_none_or(|x| x == r) => Kv::Of(r),
                        _ => Kv::Garbage,
                    }
                } else {
                    match src.and_then(|s| s.kv) {
                        Some(x) => Kv::Of(x),
                        None => Kv::Garbage,
                    }
                };
                whole &= kv == Kv::Of(r);
                if self.writes[w].early.is_some() {
                    let (ranks, stages) = (self.reqs[r].ranks, self.reqs[r].stages);
                    for part in (0..ranks).flat_map(|x| (0..stages).map(move |y| (x, y))) {
                        self.ds[d].slots[b as usize].parts.insert(part, kv);
                    }
                } else {
                    self.ds[d].slots[b as usize].parts.insert((rank, stage), kv);
                }
            }
        }
        self.note(format!("w{w} (req {r}, ({rank},{stage})) lands in d{d}: {}", if ok { "ok" } else { "error" }));
        if self.writes[w].was_early && !self.writes[w].dropped {
            // The engine's writer stops writing early after a failure and writes the rest itself.
            if whole {
                self.reqs[r].early_whole.insert(attempt);
            } else {
                self.reqs[r].early_whole.remove(&attempt);
            }
        }
        if !self.ps[p].alive || self.ps[p].inc != inc {
            return;
        }
        if let Some(early) = self.writes[w].early.take() {
            let mut out = PushSettled::default();
            self.ps[p].src.end_early_write(early, &mut out);
            return self.p_settled(p, out);
        }
        let Some(ticket) = self.writes[w].ticket.take() else {
            // Planted #55470: the transport's notification reports the ungated write done.
            if ok {
                let key = self.reqs[r].key.clone();
                self.send(false, p, d, &Message::PushWriteDone { key, attempt, dst_rank: rank, stage });
            }
            return;
        };
        if ok {
            self.reqs[r].writes_ok.insert((attempt, rank, stage));
        } else {
            self.reqs[r].writes_failed.insert(attempt);
            self.reqs[r].failed_at.get_or_insert(now);
            if self.c.planted == Some(PlantedPushBug::FailureOnlyLogged) {
                self.note("  planted #48633: the failure is only logged".into());
                self.leaked.push(ticket);
                return;
            }
        }
        let mut out = PushSettled::default();
        self.ps[p].src.end_write(ticket, ok, now, &mut out);
        self.p_settled(p, out);
    }

    /// Carries out what P's machine decided, checking each lease's end.
    fn p_settled(&mut self, p: usize, out: PushSettled<Src>) {
        let now = self.now;
        for o in out.send {
            let Some(d) = index(&o.to, 'd') else {
                self.violation(format!("p{p} addressed {:?}, not a D engine", o.to));
                continue;
            };
            // SPEC U6: does it close D's tally?
            let closes = match &o.msg {
                Message::PushWriteFailed { key, done, failed, .. } => {
                    self.by_key.get(&(p, key.clone())).copied().filter(|&r| done + failed >= self.reqs[r].ranks * self.reqs[r].stages)
                }
                Message::PushLost { keys } => keys.iter().find_map(|k| self.by_key.get(&(p, k.clone())).copied()),
                _ => None,
            };
            if let Some(r) = closes {
                self.reqs[r].closed_at.get_or_insert(now);
            }
            if let Message::PushLost { keys } = &o.msg {
                for k in keys {
                    if let Some(&r) = self.by_key.get(&(p, k.clone())) {
                        self.reqs[r].closed_at.get_or_insert(now);
                    }
                }
            }
            self.note(format!("p{p} → d{d}: {}", short(&o.msg)));
            self.send(false, p, d, &o.msg);
        }
        for e in out.ended {
            let Some(r) = self.reqs.iter().position(|q| q.lease == Some(e.lease_id) && q.p == p && q.p_inc == Some(self.ps[p].inc)) else {
                self.violation(format!("P3: p{p} ended lease {} that the sim never saw granted", e.lease_id));
                continue;
            };
            self.lease_ended(p, r, e.reason);
        }
        for b in out.freed {
            for &id in b.ids() {
                let slot = &mut self.ps[p].slots[id as usize];
                if slot.free {
                    self.violation(format!("P3: p{p} gave back source block {id} twice"));
                    continue;
                }
                slot.free = true;
                self.ps[p].free.push(id);
            }
        }
        let inc = self.ps[p].inc;
        for job in out.ready {
            self.job(p, inc, job);
        }
        for job in out.early {
            if let Some(&r) = self.by_key.get(&(p, job.key.clone())) {
                self.early_job(p, inc, r, job);
            }
        }
        self.alloc_p(p);
        self.arm_p(p);
    }

    fn job(&mut self, p: usize, inc: u64, job: WriteJob) {
        let Some(&r) = self.by_key.get(&(p, job.key.clone())) else {
            self.violation(format!("U1: p{p} paired {} with no request", job.key));
            return;
        };
        if index(&job.to, 'd') != Some(self.reqs[r].d) {
            self.violation(format!("U1: p{p} paired req {r} with {}, not d{}", job.to, self.reqs[r].d));
        }
        self.reqs[r].paired = true;
        self.note(format!(
            "p{p}: req {r} ready to write, attempt {} into {:?} ({}×{})",
            job.attempt, job.block_ids, job.dst_ranks, job.stages
        ));
        for rank in 0..job.dst_ranks {
            for stage in 0..job.stages {
                let delay = if self.rng.chance(self.c.slow_post.0) {
                    self.rng.secs(0.0, self.c.slow_post.1.as_secs_f64())
                } else {
                    self.rng.secs(0.0, self.c.post_delay.as_secs_f64())
                };
                self.push(self.now + delay, Ev::Post { p, inc, r, attempt: job.attempt, rank, stage });
            }
        }
    }

    fn lease_ended(&mut self, p: usize, r: usize, reason: ReleaseReason) {
        let now = self.now;
        self.note(format!("p{p}: req {r}'s lease ends: {reason:?}"));
        let gran = self.cfg.reap_granularity();
        let q = &self.reqs[r];
        let mut v = Vec::new();
        if !q.ended.is_empty() {
            v.push(format!("P3/U5: req {r}'s lease ended twice ({:?}, then {reason:?})", q.ended));
        }
        if reason == ReleaseReason::Transferred {
            let all = |a: u32| (0..q.ranks).all(|x| (0..q.stages).all(|y| q.writes_ok.contains(&(a, x, y))));
            if !q.writes_ok.iter().any(|&(a, _, _)| all(a)) {
                v.push(format!("U5: req {r}'s lease ended transferred before every write completed ({:?})", q.writes_ok));
            }
        }
        if reason == ReleaseReason::Expired {
            let (lo, hi) = (q.dl_min, q.dl_max);
            if now + MS < lo {
                v.push(format!(
                    "U2/P2: req {r}'s lease expired at {:.3} s, before {:.3} s, the deadline its D's renewals that reached p{p} and its writes gave it",
                    now.as_secs_f64(),
                    lo.as_secs_f64()
                ));
            }
            if now > hi + gran + MS * 2 {
                v.push(format!(
                    "P4: req {r}'s lease expired at {:.3} s, later than its deadline {:.3} s and a reaper tick",
                    now.as_secs_f64(),
                    hi.as_secs_f64()
                ));
            }
            if let Some(t) = q.aborted_at.filter(|&t| t < now && (q.release_delivered || !q.release_sent)) {
                v.push(format!(
                    "U9: d{} aborted req {r} at {:.3} s, yet P's lease waited for expiry (no release was lost on the way)",
                    q.d,
                    t.as_secs_f64()
                ));
            }
        }
        for x in v {
            self.violation(x);
        }
        self.reqs[r].ended.push((now, reason));
    }

    fn arm_p(&mut self, p: usize) {
        if !self.ps[p].alive {
            return;
        }
        let Some(t) = self.ps[p].src.poll_timeout(self.now).map(|t| t.max(self.now)) else { return };
        if self.ps[p].armed.is_some_and(|at| at >= self.now && at <= t) {
            return;
        }
        self.ps[p].gen += 1;
        self.ps[p].armed = Some(t);
        let gen = self.ps[p].gen;
        self.push(t, Ev::PPoll { p, gen });
    }

    fn deliver_to_p(&mut self, p: usize, d: usize, bytes: &[u8]) {
        if !self.ps[p].alive {
            return;
        }
        let Some(msg) = self.decode(bytes) else { return };
        let now = self.now;
        self.note(format!("p{p} ← d{d}: {}", short(&msg)));
        match &msg {
            Message::PushHeartbeat { renewals, .. } => {
                let e = self.cfg.extension;
                for rn in renewals {
                    // What D meant to renew, whatever key its driver put on the wire.
                    let r = self.by_key.get(&(p, rn.key.clone())).copied().or_else(|| self.alias.get(&rn.key).copied());
                    let Some(r) = r.filter(|&r| self.reqs[r].d == d && self.reqs[r].p_inc == Some(self.ps[p].inc)) else { continue };
                    let q = &mut self.reqs[r];
                    q.renewed_at = Some(now);
                    if q.lease.is_some() && q.ended.is_empty() {
                        if now + MS < q.dl_min {
                            q.dl_min = q.dl_min.max(now + e);
                        }
                        if now < q.dl_max + MS {
                            q.dl_max = q.dl_max.max(now + e);
                        }
                    }
                }
            }
            Message::PushRelease { keys } => {
                for k in keys {
                    if let Some(&r) = self.by_key.get(&(p, k.clone())) {
                        self.reqs[r].release_delivered = true;
                    }
                }
            }
            _ => {}
        }
        let mut out = PushSettled::default();
        self.ps[p].src.on_message(&format!("d{d}"), &msg, now, &mut out);
        self.p_settled(p, out);
    }

    fn kill_p(&mut self, p: usize) {
        if !self.ps[p].alive {
            return;
        }
        self.note(format!("p{p} killed (incarnation {})", self.ps[p].inc));
        self.ps[p].alive = false;
        let inc = self.ps[p].inc;
        for i in 0..self.writes.len() {
            let w = &self.writes[i];
            if w.p == p && w.inc == inc && !w.landed && self.rng.chance(0.5) {
                self.writes[i].dropped = true;
            }
        }
        if let Some((_, _, Some(after))) = self.c.p_kill {
            // Back once its dead writes stopped, as a new incarnation with its memory reused.
            let after = after.max(self.c.slow_write.1 + self.c.write_time + MS);
            self.push(self.now + after, Ev::RestartP { p });
        }
    }

    fn restart_p(&mut self, p: usize) {
        let e = &mut self.ps[p];
        e.inc += 1000;
        e.alive = true;
        // SPEC D5: it knows when it started, to answer lost a registration older than itself.
        e.src = PushSource::new(&self.cfg, e.inc).started_at(self.now);
        e.free = (0..self.c.p_blocks).rev().collect();
        for s in &mut e.slots {
            s.free = true;
        }
        e.waiting.clear();
        e.armed = None;
        let inc = e.inc;
        self.note(format!("p{p} restarts as incarnation {inc}"));
    }

    // ---- D ----

    fn arrive_d(&mut self, r: usize) {
        let d = self.reqs[r].d;
        let (p, key, rid) = (self.reqs[r].p, self.reqs[r].key.clone(), self.reqs[r].rid_d.clone());
        self.note(format!("d{d}: req {r} admitted under {key}, waits for {} blocks", self.reqs[r].blocks));
        self.ds[d].sink.admit(&rid, &format!("p{p}"), key, self.now);
        self.ds[d].reqs.insert(rid, r);
        self.ds[d].waiting.push_back(r);
        self.alloc_d(d);
        self.arm_d(d);
    }

    /// Allocates `n` destination blocks for registration `attempt` of `r`, if free.
    fn take_blocks(&mut self, d: usize, r: usize, attempt: u32) -> Option<Vec<u32>> {
        let n = self.reqs[r].blocks as usize;
        if self.ds[d].free.len() < n {
            return None;
        }
        let mut blocks = Vec::new();
        let mut gens = Vec::new();
        for _ in 0..n {
            let b = self.ds[d].free.pop()?;
            let s = &mut self.ds[d].slots[b as usize];
            s.gen += 1;
            s.owner = Some((r, attempt));
            s.parts.clear();
            blocks.push(b);
            gens.push(s.gen);
        }
        self.reqs[r].allocs.push(Alloc { attempt, blocks: blocks.clone(), gens, freed: false });
        Some(blocks)
    }

    fn alloc_d(&mut self, d: usize) {
        while let Some(&r) = self.ds[d].waiting.front() {
            let attempt = self.reqs[r].allocs.len() as u32 + 1;
            let Some(blocks) = self.take_blocks(d, r, attempt) else { return };
            self.ds[d].waiting.pop_front();
            self.register(d, r, blocks);
        }
    }

    fn register(&mut self, d: usize, r: usize, blocks: Vec<u32>) {
        let q = &self.reqs[r];
        let (rid, digest, ranks, stages) = (q.rid_d.clone(), PromptDigest::of(&q.tokens), q.ranks, q.stages);
        match self.ds[d].sink.register(&rid, 1_000 + d as u64, 0, digest, ranks, stages, blocks.clone(), self.now) {
            Ok(act) => {
                self.note(format!("d{d}: req {r} registers blocks {blocks:?} ({ranks}×{stages})"));
                self.reqs[r].registered_at = Some(self.now);
                self.d_actions(d, vec![act], false);
            }
            Err(e) => self.violation(format!("d{d}: req {r}'s registration refused: {e}")),
        }
    }

    fn preempt(&mut self, r: usize) {
        let d = self.reqs[r].d;
        if self.reqs[r].end.is_some() || self.reqs[r].registered_at.is_none() {
            return;
        }
        let attempt = self.reqs[r].allocs.len() as u32 + 1;
        let Some(blocks) = self.take_blocks(d, r, attempt) else { return };
        self.note(format!("d{d}: req {r} preempted, registers again"));
        self.register(d, r, blocks);
    }

    fn abort_d(&mut self, r: usize) {
        let d = self.reqs[r].d;
        if self.reqs[r].end.is_some() || !self.ds[d].reqs.contains_key(&self.reqs[r].rid_d) {
            return;
        }
        self.note(format!("d{d}: client aborts req {r}"));
        self.ds[d].waiting.retain(|&x| x != r);
        let p = self.reqs[r].p;
        if self.ps[p].alive && self.reqs[r].p_inc.is_none_or(|i| i == self.ps[p].inc) {
            self.reqs[r].aborted_at = Some(self.now);
        }
        self.end_d(r, DEnd::Aborted);
        let mut acts = Vec::new();
        let rid = self.reqs[r].rid_d.clone();
        self.ds[d].sink.abort(&rid, self.now, &mut acts);
        self.d_actions(d, acts, true);
    }

    fn decode_done(&mut self, r: usize) {
        let d = self.reqs[r].d;
        let mut acts = Vec::new();
        let rid = self.reqs[r].rid_d.clone();
        self.ds[d].sink.finish(&rid, self.now, &mut acts);
        // The decode's blocks: the newest registration's.
        if let Some(a) = self.reqs[r].allocs.last().map(|a| a.attempt) {
            self.free_d(d, r, a);
        }
        self.d_actions(d, acts, false);
    }

    fn free_d(&mut self, d: usize, r: usize, attempt: u32) {
        let Some(i) = self.reqs[r].allocs.iter().position(|a| a.attempt == attempt && !a.freed) else { return };
        self.reqs[r].allocs[i].freed = true;
        let blocks = self.reqs[r].allocs[i].blocks.clone();
        for b in blocks {
            let s = &mut self.ds[d].slots[b as usize];
            s.gen += 1;
            s.owner = None;
            self.ds[d].free.push(b);
        }
    }

    fn end_d(&mut self, r: usize, how: DEnd) {
        if self.reqs[r].end.is_some() {
            return;
        }
        let now = self.now;
        self.reqs[r].end = Some((now, how));
        let d = self.reqs[r].d;
        // SPEC U10: no later than the timeout after P's last progress (or the registration).
        if let Some(reg) = self.reqs[r].registered_at {
            let from = self.reqs[r].last_progress.map_or(reg, |t| t.max(reg));
            let mut bound = from + self.cfg.push_registration_timeout;
            while let Some(u) = self.paused_until(d, bound) {
                bound = u;
            }
            if now > bound + MS * 5 {
                self.violation(format!(
                    "U10: d{d}'s req {r} waited until {:.3} s, past {:.3} s (push_registration_timeout after P's last progress)",
                    now.as_secs_f64(),
                    bound.as_secs_f64()
                ));
            }
        }
    }

    fn d_actions(&mut self, d: usize, acts: Vec<PushAction>, from_abort: bool) {
        let now = self.now;
        for a in acts {
            match a {
                PushAction::Send { engine_id, mut msg } => {
                    let Some(p) = index(&engine_id, 'p') else {
                        self.violation(format!("d{d} addressed {engine_id:?}, not a P engine"));
                        continue;
                    };
                    if let Message::PushRelease { keys } = &msg {
                        if from_abort && self.c.planted == Some(PlantedPushBug::AbortNotSent) {
                            self.note(format!("d{d}: planted #46283: the release of {} is not sent", keys.len()));
                            continue;
                        }
                        for k in keys {
                            if let Some(&r) = self.by_key.get(&(p, k.clone())) {
                                self.reqs[r].release_sent = true;
                            }
                        }
                    }
                    if let (Message::PushHeartbeat { renewals, .. }, Some(PlantedPushBug::HeartbeatWrongKey)) = (&mut msg, self.c.planted) {
                        // vLLM #53095: D names its own request id.
                        for rn in renewals.iter_mut() {
                            if let Some(&r) = self.by_key.get(&(p, rn.key.clone())) {
                                let alias = PushKey::Request(self.reqs[r].rid_d.clone());
                                self.alias.insert(alias.clone(), r);
                                rn.key = alias;
                            }
                        }
                    }
                    self.note(format!("d{d} → p{p}: {}", short(&msg)));
                    self.send(true, p, d, &msg);
                }
                PushAction::Ready { request_id } => {
                    let Some(&r) = self.ds[d].reqs.get(&request_id) else { continue };
                    self.check_ready(d, r);
                    self.end_d(r, DEnd::Used);
                    let t = self.rng.secs(0.0, self.c.decode.as_secs_f64());
                    self.push(now + t, Ev::DecodeDone { r });
                }
                PushAction::Failed { request_id, verdict, blocks_reusable } => {
                    let Some(&r) = self.ds[d].reqs.get(&request_id) else { continue };
                    self.ds[d].waiting.retain(|&x| x != r);
                    let how = match &verdict {
                        PushVerdict::Recompute(l) => DEnd::Recomputed(l.kind()),
                        PushVerdict::Fail(l) => DEnd::Failed(l.kind()),
                    };
                    self.note(format!("d{d}: req {r} fails over: {how:?}, blocks reusable: {blocks_reusable}"));
                    if matches!(how, DEnd::Recomputed("push_timed_out") | DEnd::Failed("push_timed_out")) {
                        self.check_waited_out(r);
                    }
                    self.end_d(r, how);
                }
                PushAction::BlocksFree { request_id, attempt } => {
                    let Some(&r) = self.ds[d].reqs.get(&request_id) else { continue };
                    self.note(format!("d{d}: req {r}'s blocks of attempt {attempt} free"));
                    self.free_d(d, r, attempt);
                }
            }
        }
        self.alloc_d(d);
        self.arm_d(d);
    }

    /// SPEC U3: D timed out although P held the lease, granted well before (not too late to
    /// write, U8), D was not paused while it waited, and its renewals kept reaching P within E:
    /// P never paired a registration D went on waiting for.
    fn check_waited_out(&mut self, r: usize) {
        let now = self.now;
        let q = &self.reqs[r];
        let p = q.p;
        let live = self.ps[p].alive && q.p_inc == Some(self.ps[p].inc) && q.ended.is_empty();
        let early = q.granted_at.is_some_and(|g| g + self.cfg.heartbeat_interval * 2 < now);
        let heard = q.renewed_at.is_some_and(|h| h + self.cfg.extension > now);
        let d = q.d;
        // A D paused while it waited may rightly time out (its deadline ran on).
        let since = q.registered_at.unwrap_or(now);
        let paused = self.pauses.iter().any(|&(a, b, pd)| pd == d && a < now && b > since);
        if live && early && heard && !paused && !q.paired {
            self.violation(format!(
                "U3: d{d} waited out req {r}'s registration until its timeout while p{p} held the lease and d{d}'s renewals kept reaching it; P never paired it"
            ));
        }
    }

    /// SPEC U7, U12 (D7): the blocks of the newest registration hold exactly this request's KV
    /// from every rank and stage, and no write of it failed.
    fn check_ready(&mut self, d: usize, r: usize) {
        let q = &self.reqs[r];
        let Some(a) = q.allocs.last() else {
            self.violation(format!("U7: d{d} scheduled req {r}, which never registered blocks"));
            return;
        };
        let mut wrong = None;
        for (i, &b) in a.blocks.iter().enumerate() {
            let s = &self.ds[d].slots[b as usize];
            if a.freed || s.gen != a.gens[i] || s.owner != Some((r, a.attempt)) {
                wrong = Some(format!("block {b} is no longer its own"));
                break;
            }
            for x in 0..q.ranks {
                for y in 0..q.stages {
                    match s.parts.get(&(x, y)) {
                        Some(Kv::Of(o)) if *o == r => {}
                        other => {
                            wrong.get_or_insert(format!("block {b}, rank {x}, stage {y} holds {other:?}"));
                        }
                    }
                }
            }
        }
        if let Some(why) = wrong {
            self.violation(format!("U7/U12: d{d} scheduled req {r} over blocks that are not its KV: {why}"));
        } else if q.writes_failed.contains(&a.attempt) {
            self.violation(format!("U7: d{d} scheduled req {r} although a write of attempt {} failed", a.attempt));
        } else {
            self.note(format!("d{d}: req {r} ready: its KV is in every block, rank and stage"));
        }
    }

    fn arm_d(&mut self, d: usize) {
        self.ds[d].gen += 1;
        let Some(t) = self.ds[d].sink.poll_timeout() else { return };
        if t <= self.now {
            self.ds[d].spins += 1;
            if self.ds[d].spins > 10_000 {
                self.violation_once(format!("spin {d}"), format!("U10 liveness: d{d}'s poll comes due at once, over and over"));
                return;
            }
        } else {
            self.ds[d].spins = 0;
        }
        let gen = self.ds[d].gen;
        self.push(t.max(self.now), Ev::DPoll { d, gen });
    }

    fn deliver_to_d(&mut self, d: usize, p: usize, bytes: &[u8]) {
        let Some(msg) = self.decode(bytes) else { return };
        let key = match &msg {
            Message::PushRegisterAck { key, .. } | Message::PushWriteDone { key, .. } => Some(key.clone()),
            _ => None,
        };
        if let Some(&r) = key.and_then(|k| self.by_key.get(&(p, k))) {
            self.reqs[r].last_progress = Some(self.now);
        }
        self.note(format!("d{d} ← p{p}: {}", short(&msg)));
        let mut acts = Vec::new();
        self.ds[d].sink.on_message(&format!("p{p}"), &msg, self.now, &mut acts);
        self.d_actions(d, acts, false);
    }

    fn kill_d(&mut self, d: usize) {
        self.note(format!("d{d} killed"));
        self.ds[d].alive = false;
        for r in 0..self.reqs.len() {
            if self.reqs[r].d == d && self.reqs[r].end.is_none() && self.ds[d].reqs.contains_key(&self.reqs[r].rid_d) {
                self.reqs[r].end = Some((self.now, DEnd::DKilled));
            }
        }
    }

    // ---- the end ----

    fn final_checks(&mut self) {
        let now = self.now;
        for r in 0..self.reqs.len() {
            let q = &self.reqs[r];
            let mut v = Vec::new();
            let (p, d) = (q.p, q.d);
            let p_alive = q.p_inc == Some(self.ps[p].inc) && self.ps[p].alive;
            if p_alive && q.lease.is_some() && q.ended.is_empty() {
                v.push(format!("P3: req {r}'s lease on p{p} never ended"));
            }
            if self.ds[d].alive && q.end.is_none() && self.ds[d].reqs.contains_key(&q.rid_d) {
                v.push(format!("U6/U10 liveness: d{d}'s req {r} never ended"));
            }
            // SPEC U6: a failure on P was followed by a message closing D's tally once every
            // sibling write stopped (a slow write's time at most).
            if let Some(f) = q.failed_at {
                let due = f + self.c.slow_write.1 + self.c.write_time + MS * 10;
                let p_lived = p_alive || self.c.p_kill.is_some_and(|(t, kp, _)| kp != p || at(t) > due);
                if p_lived && q.closed_at.is_none_or(|c| c > due) {
                    v.push(format!(
                        "U6: p{p}'s write of req {r} failed at {:.3} s and nothing closing d{d}'s tally was sent by {:.3} s ({})",
                        f.as_secs_f64(),
                        due.as_secs_f64(),
                        q.closed_at.map_or("never".into(), |c| format!("at {:.3} s", c.as_secs_f64()))
                    ));
                }
            }
            for x in v {
                self.violation(x);
            }
        }
        for p in 0..self.ps.len() {
            let e = &self.ps[p];
            if e.alive && e.free.len() != self.c.p_blocks as usize {
                let held: Vec<usize> = (0..e.slots.len()).filter(|&i| !e.slots[i].free).collect();
                self.violation(format!("U4/P5: p{p}'s source blocks {held:?} never came back"));
            }
        }
        for d in 0..self.ds.len() {
            let e = &self.ds[d];
            if e.alive && e.free.len() != self.c.d_blocks as usize {
                let held: Vec<(usize, Option<(usize, u32)>)> =
                    (0..e.slots.len()).filter(|&i| e.slots[i].owner.is_some()).map(|i| (i, e.slots[i].owner)).collect();
                self.violation(format!("U8: d{d}'s destination blocks {held:?} never came back"));
            }
        }
        let _ = now;
    }

    fn finish(self) -> Outcome {
        let mut out = Outcome { seed: self.c.seed, requests: self.reqs.len(), ..Outcome::default() };
        let n = &mut out.counts;
        n.writes = self.writes.len();
        for q in &self.reqs {
            match q.end {
                Some((_, DEnd::Used)) => n.used += 1,
                Some((_, DEnd::Recomputed(_))) => n.recomputed += 1,
                Some((_, DEnd::Failed(_))) => n.failed += 1,
                Some((_, DEnd::Aborted)) => n.aborted += 1,
                Some((_, DEnd::DKilled)) => n.lost_with_d += 1,
                None => {}
            }
        }
        out.simulated = self.now.since(Nanos::ZERO);
        out.violations = self.violations;
        out.trace = self.trace;
        out
    }
}

fn kind(m: &Message) -> &'static str {
    match m {
        Message::PushRegister(_) => "PushRegister",
        Message::PushRegisterAck { .. } => "PushRegisterAck",
        Message::PushHeartbeat { .. } => "PushHeartbeat",
        Message::PushRelease { .. } => "PushRelease",
        Message::PushLost { .. } => "PushLost",
        Message::PushWriteDone { .. } => "PushWriteDone",
        Message::PushWriteFailed { .. } => "PushWriteFailed",
        _ => "other",
    }
}

fn short(m: &Message) -> String {
    match m {
        Message::PushRegister(r) => format!("PushRegister {} attempt {} {}×{} {:?}", r.key, r.attempt, r.dst_ranks, r.stages, r.block_ids),
        Message::PushRegisterAck { key, attempt, granted } => format!("PushRegisterAck {key} attempt {attempt} granted {granted}"),
        Message::PushHeartbeat { renewals, .. } => {
            let keys: Vec<String> = renewals.iter().map(|r| r.key.to_string()).collect();
            format!("PushHeartbeat [{}]", keys.join(", "))
        }
        Message::PushRelease { keys } => format!("PushRelease {keys:?}"),
        Message::PushLost { keys } => format!("PushLost {keys:?}"),
        Message::PushWriteDone { key, attempt, dst_rank, stage } => format!("PushWriteDone {key} attempt {attempt} ({dst_rank},{stage})"),
        Message::PushWriteFailed { key, attempt, done, failed, why } => {
            format!("PushWriteFailed {key} attempt {attempt} done {done} failed {failed} ({})", why.as_str())
        }
        other => format!("{other:?}"),
    }
}
