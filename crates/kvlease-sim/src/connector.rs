//! The vLLM connector's protocol path under deterministic simulation (issue #23): the core types
//! `python/kvlease/vllm.py` runs on, wired as it wires them, under virtual time with faults
//! drawn from one seed — no engine, no Python, no socket.
//!
//! * **P** (one or two vLLM engines): P's scheduler issues each lease's wire id when a prefill
//!   ends ([`Issuer`], one random series per engine) and puts it in the params the router hands
//!   D; its worker grants the lease a step later ([`IssuedLeases::grant`] with vLLM's deadline,
//!   the scheduler's `now + L`, so a slow step leaves the grant less than L, then
//!   [`IssuedLeases::name`]). Steps take random times, the first step after the first prefill
//!   sometimes most of L. D's messages are decided the moment they arrive, as on the connector's
//!   control-channel thread ([`IssuedLeases::on_message_from`] with `hold`, one tag per message,
//!   answers to held ones go back on the connection they came on); each step answers what is
//!   due ([`IssuedLeases::answer_due`] with `ack_wait`, at the grant and before the reaper),
//!   sees the reads vLLM's notifications report complete (`end(.., Transferred)`; a notification
//!   for a lease not granted yet is dropped, as vLLM drops it) and reaps ([`IssuedLeases::tick`]).
//!   Now and then vLLM drops a lease itself (`end(.., Released)`).
//! * **D** (one to three engines): a [`Renewer`] polled by a thread of its own (at least every
//!   100 ms, woken by P's answers, new requests and held-back reads), a [`Pull`] per read
//!   (`waiting_for_link(L)`, `confirming_within(max(L, 30 s))`). A request is tracked at the
//!   worker's first step after it reached D's scheduler, read when the scheduler gives it a
//!   slot (it may queue), gated by the pull (held back and asked again on news or every 100 ms,
//!   or failed), and vLLM's handshake with P is made on D's heartbeat steps (every I). A read
//!   that landed is seen at D's next step: D stops renewing, asks P with a `ReadDone` and uses
//!   the bytes only on P's confirmation. A lease reported lost fails a read to come; a read
//!   already posted is left to its `ReadDone` (its Pull says so: P may end the lease on that
//!   very read). Some D engines are kvlease's own (an abort sends a `Release`, SPEC D4); vLLM's
//!   tells P nothing.
//! * **Faults**: every message is encoded and decoded ([`Message`]) and may be lost, duplicated,
//!   delayed and so reordered; a D engine may crash, or pause (its process stalls, sometimes
//!   longer than E); a client may abort; the router may hand one request's params to a second
//!   D engine (SPEC S5). D's one-sided read lands at a random later time, with the right KV only
//!   if P still held the blocks then (the scheduler holds them from the prefill's end, the lease
//!   from its grant; a released block is reused at once).
//!
//! Every run checks, by SPEC id:
//! * **P5/D6**: D never uses bytes read when P no longer held the blocks;
//! * **P2/D6**: a lease P acknowledged a renewal of (not lost) at `t` does not expire before
//!   `t + E` — D reads on that acknowledgement;
//! * **P3**: every granted lease ends exactly once, and every lease has ended at the end;
//! * **P4**: after a D crash, each lease only it held is gone by its bound: the latest of vLLM's
//!   deadline, the grant (plus E when a renewal overtook it) and the last renewal + E, plus one
//!   P step;
//! * **held**: no message held for its grant is left unanswered past E (at P's next step);
//! * **S5**: no two D engines get a positive answer (a renewal not lost, a `Release` that took
//!   effect, a confirmed read) about the same lease;
//! * **liveness**: every request ends, and the run comes to rest.
//!
//! The same seed gives the same trace: `kvlease sim --connector --seed N` replays a run.

use crate::cluster::Rng;
use crate::seeded::{Counts, EventQueue, Seeded};
use kvlease_core::config::{LeaseConfig, LoadFailurePolicy};
use kvlease_core::digest::PromptDigest;
use kvlease_core::issued::{IssuedLeases, Issuer};
use kvlease_core::lease_table::{ReleaseReason, Released};
use kvlease_core::pull::{AfterReads, PlantedBug, Pull, Step, Verdict};
use kvlease_core::renewer::{Action, Handshook, Remote, Renewer, SendKind, Untrack};
use kvlease_core::wire::Message;
use kvlease_core::{LeaseId, Nanos};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// How often the connector asks about a held-back read again without news (`RECHECK_NS`).
const RECHECK: Duration = Duration::from_millis(100);
/// The least a landed read waits for P's confirmation (`CONFIRM_WAIT_MIN_S`).
const CONFIRM_WAIT_MIN: Duration = Duration::from_secs(30);
/// The renewer thread's longest and shortest sleep.
const POLL_MAX: Duration = Duration::from_millis(100);
const POLL_MIN: Duration = Duration::from_millis(1);

/// One run of the connector's path and its faults, all drawn from `seed` by
/// [`Connector::from_seed`].
#[derive(Debug, Clone)]
pub struct Connector {
    pub seed: u64,
    pub p_engines: usize,
    pub d_engines: usize,
    pub requests: usize,
    /// Mean arrivals per simulated second (one in four comes at five times the rate).
    pub rate: f64,
    pub lease_secs: f64,
    pub policy: LoadFailurePolicy,
    /// Each message's chance to be lost, or to arrive twice; its delay is up to `max_delay`.
    pub loss: f64,
    pub duplicate: f64,
    pub max_delay: Duration,
    /// An engine step's length (P and D), and the chance of a long one with its longest.
    pub step: (Duration, Duration),
    pub long_step: (f64, Duration),
    /// Per P engine: the length of its step after its first prefill (vLLM grants after it).
    pub slow_first_step: Vec<Option<Duration>>,
    /// How long a one-sided read takes to land, and the chance of a slow one with its longest.
    pub read_time: (Duration, Duration),
    pub slow_read: (f64, Duration),
    /// A read's chance to find D's process stalling right after posting it (E/2 to 2 L): the
    /// read goes on, nothing of D does.
    pub stall_on_read: f64,
    /// D's slots (requests read and decoded at once) and a request's decode time.
    pub d_slots: usize,
    pub decode: (Duration, Duration),
    /// P's params to D through the router, and vLLM's handshake, at most.
    pub router_delay: Duration,
    pub handshake_delay: Duration,
    /// A D crash (for good): when, which.
    pub d_crash: Option<(Duration, usize)>,
    /// D pauses (the process stalls): when, how long, which.
    pub d_pauses: Vec<(Duration, Duration, usize)>,
    /// A request's chance to have its params handed to a second D engine too (a router's
    /// mistake), a client's to abort, vLLM's on P to drop a lease itself.
    pub stray: f64,
    pub abort: f64,
    pub p_drop: f64,
    /// Per D engine: kvlease's own D (an abort releases the lease, SPEC D4) or vLLM's.
    pub releasing_d: Vec<bool>,
    /// A bug planted on purpose (the simulator's own tests): [`PlantedBug::EarlyRenewalDropped`]
    /// or [`PlantedBug::ConfirmExpiredRead`] in P's [`IssuedLeases`].
    pub planted: Option<PlantedBug>,
}

/// A connector run's own counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConnectorCounts {
    /// Requests the router handed to two D engines.
    pub strays: usize,
    /// Decoded from the pulled KV.
    pub used: usize,
    /// The pull's bytes not used: the prompt computed on D.
    pub recomputed: usize,
    /// Failed cleanly (`kv_load_failure_policy: fail`, a crashed D, no D left).
    pub failed: usize,
    pub aborted: usize,
}

impl Counts for ConnectorCounts {
    const FLAG: &'static str = "--connector";
    fn add(&mut self, o: &Self) {
        self.strays += o.strays;
        self.used += o.used;
        self.recomputed += o.recomputed;
        self.failed += o.failed;
        self.aborted += o.aborted;
    }
}

/// What one run found (`simulated`: until the run came to rest).
pub type Outcome = crate::seeded::Outcome<ConnectorCounts>;

impl Seeded for Connector {
    type Planted = PlantedBug;
    type Counts = ConnectorCounts;

    /// A run drawn from `seed`.
    fn from_seed(seed: u64) -> Connector {
        let mut r = Rng(seed ^ 0xc0ec_7012_5eed);
        let lease_secs = [3.0, 6.0, 30.0][r.below(3)];
        let p_engines = 1 + r.below(2);
        let d_engines = 1 + r.below(3);
        let requests = 6 + r.below(30);
        let rate = 1.0 + r.unit() * 15.0;
        let span = requests as f64 / rate;
        let e = lease_secs * 2.0 / 3.0;
        let noisy = r.chance(0.7);
        let mut d_pauses = Vec::new();
        for _ in 0..r.below(3) {
            d_pauses.push((r.secs(0.0, span + 1.0), r.secs(0.05, e * 1.5), r.below(d_engines)));
        }
        Connector {
            seed,
            p_engines,
            d_engines,
            requests,
            rate,
            lease_secs,
            policy: if r.chance(0.2) { LoadFailurePolicy::Fail } else { LoadFailurePolicy::Recompute },
            loss: if noisy { r.unit() * 0.1 } else { 0.0 },
            duplicate: if noisy { r.unit() * 0.1 } else { 0.0 },
            max_delay: if noisy { r.secs(0.0, 0.05) } else { r.secs(0.0, 0.002) },
            step: (Duration::from_millis(5), r.secs(0.01, 0.05)),
            long_step: (if r.chance(0.3) { r.unit() * 0.01 } else { 0.0 }, r.secs(0.05, lease_secs * 1.5)),
            slow_first_step: (0..p_engines).map(|_| r.chance(0.5).then(|| r.secs(0.0, lease_secs * 1.5))).collect(),
            read_time: (Duration::from_millis(1), r.secs(0.002, 0.05)),
            slow_read: (if r.chance(0.5) { r.unit() * 0.4 } else { 0.0 }, r.secs(e * 0.5, lease_secs * 1.5)),
            stall_on_read: if r.chance(0.5) { r.unit() * 0.3 } else { 0.0 },
            d_slots: 1 + r.below(4),
            decode: (Duration::from_millis(50), r.secs(0.1, 2.0)),
            router_delay: r.secs(0.0, 0.02),
            handshake_delay: r.secs(0.001, 0.1),
            d_crash: r.chance(0.3).then(|| (r.secs(0.0, span + 1.0), r.below(d_engines))),
            d_pauses,
            stray: if d_engines > 1 && r.chance(0.5) { r.unit() * 0.2 } else { 0.0 },
            abort: if r.chance(0.5) { r.unit() * 0.1 } else { 0.0 },
            p_drop: if r.chance(0.3) { r.unit() * 0.05 } else { 0.0 },
            releasing_d: (0..d_engines).map(|_| r.chance(0.5)).collect(),
            planted: None,
        }
    }

    fn plant(&mut self, bug: Option<PlantedBug>) {
        self.planted = bug;
    }

    /// Runs the workload until the run comes to rest, checking every invariant.
    fn run(&self) -> Outcome {
        let mut w = World::new(self);
        w.run();
        w.finish()
    }
}

impl Connector {
    fn lease(&self) -> LeaseConfig {
        let mut l = LeaseConfig::with_lease_secs(self.lease_secs).unwrap_or_default();
        l.load_failure_policy = self.policy;
        l
    }
}

#[derive(Debug, Clone)]
enum Ev {
    /// A request reaches P's scheduler.
    ArriveP {
        r: usize,
    },
    /// A boundary of P's engine steps: the step that ran ends, the next starts.
    PStep {
        p: usize,
    },
    /// vLLM on P drops the request's lease itself.
    PDrop {
        r: usize,
    },
    /// The router hands P's params to D (copy `c` of a request).
    Params {
        c: usize,
    },
    DStep {
        d: usize,
    },
    /// The renewer thread's wake-up (stale unless `gen` is the engine's latest).
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
    /// vLLM's notification of a completed read (`req:n`) reaches P.
    Notif {
        p: usize,
        r: usize,
    },
    /// A one-sided read lands.
    Land {
        c: usize,
    },
    /// vLLM's handshake of D with P completed.
    Handshook {
        d: usize,
        p: usize,
    },
    Abort {
        c: usize,
    },
    /// A decode slot of D frees.
    Free {
        d: usize,
    },
    Crash {
        d: usize,
    },
}

/// One request, P's side of it and what the checks need.
struct Request {
    at: Duration,
    p: usize,
    d: usize,
    stray: Option<usize>,
    drop_after: Option<Duration>,
    /// The wire id P's scheduler issued (0 before), when, and the lease its worker granted.
    w: u64,
    issued: Option<Nanos>,
    lease: Option<LeaseId>,
    granted: Option<Nanos>,
    ended: Option<(Nanos, ReleaseReason)>,
    /// A renewal P answered not lost before the grant; P's receive time of the last it did.
    early_acked: bool,
    last_ack: Option<Nanos>,
    /// D engines P answered positively about this lease (SPEC S5).
    positive: BTreeSet<usize>,
    copies: Vec<usize>,
    /// The latest crash of a D that held it alone (SPEC P4).
    crash_check: Option<Nanos>,
    /// No live D engine to route it to.
    unrouted: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The router's params on their way to D.
    Routed,
    /// In D's scheduler; the worker tracks it at its next step.
    Arrived,
    /// Tracked, waiting for a slot.
    Queued,
    /// Its read held back by its pull.
    Deferred,
    Reading,
    Confirming,
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Used,
    Recomputed(&'static str),
    Failed(&'static str),
    Aborted,
}

/// A request on one D engine.
struct Copy {
    r: usize,
    d: usize,
    rid: String,
    state: State,
    abort_after: Option<Duration>,
    /// Whether the read, when it landed, brought the lease's KV (P still held the blocks).
    correct: Option<bool>,
    slot: bool,
    end: Option<(Nanos, End)>,
}

/// A message P holds for its lease's grant: who sent it, how many parts are held, since when.
struct Held {
    d: usize,
    parts: usize,
    at: Nanos,
    reported: bool,
}

struct PEngine {
    name: String,
    leases: IssuedLeases<usize>,
    issuer: Issuer,
    /// Requests arrived, to prefill in the next step; prefilling in the step that runs.
    waiting: Vec<usize>,
    in_step: Vec<usize>,
    /// Issued at the last boundary: granted at the next.
    to_grant: Vec<usize>,
    notifs: Vec<usize>,
    held: BTreeMap<u64, Held>,
    next_tag: u64,
    req_of_lease: BTreeMap<LeaseId, usize>,
    req_of_w: BTreeMap<u64, usize>,
    steps: u64,
    stepping: bool,
    max_step: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    None,
    Pending,
    Done,
}

type Confirming = (usize, Pull, Nanos, Option<Verdict>);

struct DEngine {
    name: String,
    renewer: Renewer,
    alive: bool,
    releasing: bool,
    /// vLLM's handshakes with each P engine (`_remote_agents`), and those the renewer waits for.
    agents: Vec<Link>,
    hs_pending: BTreeSet<usize>,
    new: Vec<usize>,
    gone: Vec<usize>,
    queue: VecDeque<usize>,
    busy: usize,
    deferred: BTreeMap<usize, (Pull, Nanos)>,
    pulls: BTreeMap<usize, Pull>,
    landed_unseen: Vec<usize>,
    confirming: BTreeMap<(usize, u64), Confirming>,
    lost: BTreeSet<usize>,
    reqs: BTreeMap<String, usize>,
    copies: Vec<usize>,
    news: u64,
    news_seen: u64,
    recheck_at: Nanos,
    next_hb: Nanos,
    stepping: bool,
    poll_at: Option<Nanos>,
    gen: u64,
}

struct World {
    c: Connector,
    cfg: LeaseConfig,
    rng: Rng,
    queue: EventQueue<Ev>,
    now: Nanos,
    ps: Vec<PEngine>,
    ds: Vec<DEngine>,
    reqs: Vec<Request>,
    copies: Vec<Copy>,
    /// D pauses (the plan's and stalls on reads): from, until, which D.
    pauses: Vec<(Nanos, Nanos, usize)>,
    trace: Vec<String>,
    violations: Vec<String>,
}

fn p_index(engine_id: &str) -> Option<usize> {
    engine_id.strip_prefix('p')?.parse().ok()
}

fn short(v: &Verdict) -> String {
    match v {
        Verdict::Use => "use".into(),
        Verdict::Recompute(l) => format!("recompute ({})", l.kind()),
        Verdict::Fail(l) => format!("fail ({})", l.kind()),
    }
}

impl World {
    fn new(c: &Connector) -> World {
        let cfg = c.lease();
        let mut plan = Rng(c.seed ^ 0x1ea5_e5ee_d000);
        let ps = (0..c.p_engines)
            .map(|i| {
                let mut leases = IssuedLeases::new(&cfg, 0);
                leases.planted = c.planted;
                PEngine {
                    name: format!("p{i}"),
                    leases,
                    issuer: Issuer::new(plan.next() as u32),
                    waiting: Vec::new(),
                    in_step: Vec::new(),
                    to_grant: Vec::new(),
                    notifs: Vec::new(),
                    held: BTreeMap::new(),
                    next_tag: 1,
                    req_of_lease: BTreeMap::new(),
                    req_of_w: BTreeMap::new(),
                    steps: 0,
                    stepping: false,
                    max_step: Duration::ZERO,
                }
            })
            .collect();
        let ds = (0..c.d_engines)
            .map(|j| DEngine {
                name: format!("d{j}"),
                renewer: Renewer::new(&cfg),
                alive: true,
                releasing: c.releasing_d.get(j).copied().unwrap_or(false),
                agents: vec![Link::None; c.p_engines],
                hs_pending: BTreeSet::new(),
                new: Vec::new(),
                gone: Vec::new(),
                queue: VecDeque::new(),
                busy: 0,
                deferred: BTreeMap::new(),
                pulls: BTreeMap::new(),
                landed_unseen: Vec::new(),
                confirming: BTreeMap::new(),
                lost: BTreeSet::new(),
                reqs: BTreeMap::new(),
                copies: Vec::new(),
                news: 0,
                news_seen: 0,
                recheck_at: Nanos::ZERO,
                // vLLM's heartbeat steps come every I, from wherever D's clock stood.
                next_hb: Nanos::ZERO + cfg.heartbeat_interval.mul_f64(plan.unit()),
                stepping: false,
                poll_at: None,
                gen: 0,
            })
            .collect();
        let mut w = World {
            c: c.clone(),
            cfg,
            rng: Rng(c.seed ^ 0x0123_4567_89ab),
            queue: EventQueue::new(),
            now: Nanos::ZERO,
            ps,
            ds,
            reqs: Vec::new(),
            copies: Vec::new(),
            pauses: c.d_pauses.iter().map(|&(at, len, d)| (Nanos::ZERO + at, Nanos::ZERO + at + len, d)).collect(),
            trace: Vec::new(),
            violations: Vec::new(),
        };
        w.workload(&mut plan);
        w
    }

    fn workload(&mut self, r: &mut Rng) {
        let mut t = 0.0;
        for i in 0..self.c.requests {
            let rate = if r.chance(0.25) { self.c.rate * 5.0 } else { self.c.rate };
            t += -(1.0 - r.unit()).ln() / rate;
            let d = r.below(self.c.d_engines);
            let stray =
                (self.c.d_engines > 1 && r.chance(self.c.stray)).then(|| (d + 1 + r.below(self.c.d_engines - 1)) % self.c.d_engines);
            let drop_after = r.chance(self.c.p_drop).then(|| r.secs(0.0, self.c.lease_secs));
            let at = Duration::from_secs_f64(t);
            self.reqs.push(Request {
                at,
                p: r.below(self.c.p_engines),
                d,
                stray,
                drop_after,
                w: 0,
                issued: None,
                lease: None,
                granted: None,
                ended: None,
                early_acked: false,
                last_ack: None,
                positive: BTreeSet::new(),
                copies: Vec::new(),
                crash_check: None,
                unrouted: false,
            });
            self.push(Nanos::ZERO + at, Ev::ArriveP { r: i });
        }
        if let Some((at, d)) = self.c.d_crash {
            self.push(Nanos::ZERO + at, Ev::Crash { d });
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

    fn step_time(&mut self) -> Duration {
        let (lo, hi) = self.c.step;
        if self.rng.chance(self.c.long_step.0) {
            self.rng.secs(hi.as_secs_f64(), self.c.long_step.1.as_secs_f64())
        } else {
            self.rng.secs(lo.as_secs_f64(), hi.as_secs_f64())
        }
    }

    /// The D engine whose process handles `ev` (a paused one after its pause; a crashed one
    /// never).
    fn on_d(&self, ev: &Ev) -> Option<usize> {
        match ev {
            Ev::DStep { d } | Ev::DPoll { d, .. } | Ev::ToD { d, .. } | Ev::Handshook { d, .. } | Ev::Free { d } => Some(*d),
            Ev::Params { c } | Ev::Abort { c } => Some(self.copies[*c].d),
            _ => None,
        }
    }

    fn paused_until(&self, d: usize, t: Nanos) -> Option<Nanos> {
        self.pauses.iter().filter(|p| p.2 == d && p.0 <= t && t < p.1).map(|p| p.1).max()
    }

    fn run(&mut self) {
        let c = self.c.clone();
        self.note(format!("{c:?}"));
        let last = self.reqs.last().map_or(Duration::ZERO, |r| r.at);
        let pauses: Duration = c.d_pauses.iter().map(|p| p.1).sum();
        // A liveness bound, generous: every request may queue behind every other.
        let per_request = self.cfg.lease_duration.max(CONFIRM_WAIT_MIN) + c.decode.1 + c.long_step.1;
        let horizon = Nanos::ZERO + last + pauses + self.cfg.lease_duration.max(CONFIRM_WAIT_MIN) * 20 + per_request * c.requests as u32;
        while let Some((t, ev)) = self.queue.pop() {
            if t > horizon {
                self.violation(format!(
                    "liveness: events still due at {:.3} s, past the horizon {:.3} s",
                    t.as_secs_f64(),
                    horizon.as_secs_f64()
                ));
                break;
            }
            self.now = t;
            if let Some(d) = self.on_d(&ev) {
                if !self.ds[d].alive {
                    if let Ev::Params { c } = ev {
                        self.end(c, End::Failed("d_down"));
                    }
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
        let t = self.now;
        match ev {
            Ev::ArriveP { r } => {
                let p = self.reqs[r].p;
                self.ps[p].waiting.push(r);
                self.note(format!("req {r} reaches p{p}"));
                self.wake_p(p, t);
            }
            Ev::PStep { p } => self.p_step(p, t),
            Ev::PDrop { r } => {
                let p = self.reqs[r].p;
                if let (Some(id), None) = (self.reqs[r].lease, self.reqs[r].ended) {
                    let mut rel = Vec::new();
                    if self.ps[p].leases.end(id, ReleaseReason::Released, t, &mut rel) {
                        self.note(format!("p{p} drops req {r}'s lease {:#x} (vLLM released it)", self.reqs[r].w));
                    }
                    self.released(p, rel, t);
                }
            }
            Ev::Params { c } => self.params(c, t),
            Ev::DStep { d } => self.d_step(d, t),
            Ev::DPoll { d, gen } => self.poll(d, gen, t),
            Ev::ToP { p, d, bytes } => self.on_p_message(p, d, &bytes, t),
            Ev::ToD { d, p, bytes } => self.on_d_message(d, p, &bytes, t),
            Ev::Notif { p, r } => {
                self.ps[p].notifs.push(r);
                self.wake_p(p, t);
            }
            Ev::Land { c } => self.land(c, t),
            Ev::Handshook { d, p } => {
                self.ds[d].agents[p] = Link::Done;
                self.note(format!("d{d}: vLLM's handshake with p{p} done"));
            }
            Ev::Abort { c } => self.abort(c, t),
            Ev::Free { d } => self.ds[d].busy = self.ds[d].busy.saturating_sub(1),
            Ev::Crash { d } => self.crash(d, t),
        }
    }

    // ---------------------------------------------------------------------------- P

    fn wake_p(&mut self, p: usize, t: Nanos) {
        if !self.ps[p].stepping {
            self.ps[p].stepping = true;
            self.push(t, Ev::PStep { p });
        }
    }

    /// A boundary of P's steps: the step that ran ends (vLLM's `get_finished`: completed reads,
    /// held answers due, the reaper; the scheduler issues the ids of the prefills it finished),
    /// the next starts (`start_load_kv`: the worker grants and names what was issued a step
    /// ago, and answers what became due).
    fn p_step(&mut self, p: usize, t: Nanos) {
        for r in std::mem::take(&mut self.ps[p].notifs) {
            match (self.reqs[r].lease, self.reqs[r].ended) {
                (Some(id), None) => {
                    let mut rel = Vec::new();
                    if self.ps[p].leases.end(id, ReleaseReason::Transferred, t, &mut rel) {
                        self.note(format!("p{p}: the read of lease {:#x} completed (vLLM's notification): transferred", self.reqs[r].w));
                    }
                    self.released(p, rel, t);
                }
                (None, _) => {
                    self.note(format!("p{p}: a read of req {r} completed before its lease was granted: vLLM drops the notification"))
                }
                _ => {}
            }
        }
        self.answer_early(p, t);
        let mut rel = Vec::new();
        self.ps[p].leases.tick(t, &mut rel);
        self.released(p, rel, t);
        let mut issued = Vec::new();
        for r in std::mem::take(&mut self.ps[p].in_step) {
            let w = self.ps[p].issuer.next_id();
            self.reqs[r].w = w;
            self.reqs[r].issued = Some(t);
            self.ps[p].req_of_w.insert(w, r);
            self.note(format!("p{p}: prefill of req {r} done; its lease is {w:#x} (vLLM's deadline: now + L)"));
            issued.push(r);
            self.route(r, t);
        }
        for r in std::mem::replace(&mut self.ps[p].to_grant, issued) {
            self.grant(p, r, t);
        }
        self.answer_early(p, t);
        let pe = &mut self.ps[p];
        pe.in_step = std::mem::take(&mut pe.waiting);
        let first = pe.steps == 1;
        pe.steps += 1;
        let dur = match self.c.slow_first_step.get(p).copied().flatten() {
            Some(slow) if first => slow,
            _ => self.step_time(),
        };
        let pe = &mut self.ps[p];
        pe.max_step = pe.max_step.max(dur);
        let busy = !pe.in_step.is_empty()
            || !pe.to_grant.is_empty()
            || !pe.notifs.is_empty()
            || pe.leases.table().live() > 0
            || pe.leases.held() > 0;
        if busy {
            self.push(t + dur, Ev::PStep { p });
        } else {
            pe.stepping = false;
        }
    }

    fn grant(&mut self, p: usize, r: usize, t: Nanos) {
        let (Some(issued), w) = (self.reqs[r].issued, self.reqs[r].w) else { return };
        let life = (issued + self.cfg.lease_duration).since(t).max(Duration::from_nanos(1));
        let id = self.ps[p].leases.grant(t, life, 1, r);
        self.ps[p].req_of_lease.insert(id, r);
        self.reqs[r].lease = Some(id);
        self.reqs[r].granted = Some(t);
        let mut rel = Vec::new();
        let named = self.ps[p].leases.name(id, w, t, &mut rel);
        let deadline = self.ps[p].leases.table().deadline(id).map_or(0.0, |d| d.as_secs_f64());
        self.note(format!("p{p}: lease {w:#x} granted for {:.3} s, named; deadline {deadline:.3} s", life.as_secs_f64()));
        if !named {
            self.violation(format!("p{p}: lease {w:#x} granted but not named"));
        }
        self.released(p, rel, t);
        if let Some(after) = self.reqs[r].drop_after {
            self.push(t + after, Ev::PDrop { r });
        }
    }

    /// Leases P's table ended: each exactly once (SPEC P3); an expiry keeps every renewal's
    /// promise (SPEC P2, D6).
    fn released(&mut self, p: usize, rel: Vec<Released<usize>>, t: Nanos) {
        for x in rel {
            let Some(&r) = self.ps[p].req_of_lease.get(&x.lease_id) else {
                self.violation(format!("p{p} ended lease {} it never granted", x.lease_id));
                continue;
            };
            let w = self.reqs[r].w;
            if let Some((at, why)) = self.reqs[r].ended {
                self.violation(format!("P3: p{p} ended lease {w:#x} twice: {why:?} at {:.3} s, {:?} now", at.as_secs_f64(), x.reason));
                continue;
            }
            self.reqs[r].ended = Some((t, x.reason));
            self.note(format!("p{p}: lease {w:#x} ended: {}", x.reason.as_str()));
            if x.reason == ReleaseReason::Expired {
                if let Some(a) = self.reqs[r].last_ack.filter(|&a| t < a + self.cfg.extension) {
                    self.violation(format!(
                        "P2/D6: p{p} expired lease {w:#x} at {:.3} s, though it acknowledged a renewal of it at {:.3} s (live until {:.3} s)",
                        t.as_secs_f64(),
                        a.as_secs_f64(),
                        (a + self.cfg.extension).as_secs_f64()
                    ));
                }
            }
        }
    }

    /// A positive answer of P to D engine `d` about request `r`'s lease (SPEC S5: one engine's).
    fn positive(&mut self, r: usize, d: usize) {
        if self.reqs[r].positive.insert(d) && self.reqs[r].positive.len() == 2 {
            let (p, w) = (self.reqs[r].p, self.reqs[r].w);
            self.violation(format!("S5: p{p} answered engines {:?} positively about lease {w:#x}", self.reqs[r].positive));
        }
    }

    /// The connector's `_kvlease_answer_early`: the held messages due now, answered on their
    /// connections; nothing held past E.
    fn answer_early(&mut self, p: usize, t: Nanos) {
        let max_age = self.cfg.ack_wait();
        let mut rel = Vec::new();
        let dues = self.ps[p].leases.answer_due(t, max_age, &mut rel);
        let mut by_held_release =
            rel.iter().filter(|x| x.reason == ReleaseReason::Released).map(|x| x.lease_id).collect::<Vec<_>>().into_iter();
        for due in dues {
            let Some(h) = self.ps[p].held.get_mut(&due.tag) else {
                self.violation(format!("p{p} answered a held message of unknown tag {}", due.tag));
                continue;
            };
            let d = h.d;
            h.parts -= 1;
            if h.parts == 0 {
                self.ps[p].held.remove(&due.tag);
            }
            match due.reply {
                None => {
                    let Some(r) = by_held_release.next().and_then(|id| self.ps[p].req_of_lease.get(&id).copied()) else { continue };
                    self.note(format!("p{p}: d{d}'s held release of {:#x} took effect", self.reqs[r].w));
                    self.positive(r, d);
                }
                Some(reply) => {
                    if let Message::ReadDoneAck { lease_id, live } = reply {
                        self.note(format!("p{p}: d{d}'s held read_done of {lease_id:#x} answered: live {live}"));
                        if let (true, Some(&r)) = (live, self.ps[p].req_of_w.get(&lease_id)) {
                            self.positive(r, d);
                        }
                    } else {
                        self.note(format!("p{p}: d{d}'s held message answered: {reply:?}"));
                    }
                    self.transmit(t, Ev::ToD { d, p, bytes: reply.encode() });
                }
            }
        }
        self.released(p, rel, t);
        let stale: Vec<(u64, usize, Nanos)> =
            self.ps[p].held.iter().filter(|(_, h)| !h.reported && t.since(h.at) >= max_age).map(|(&tag, h)| (tag, h.d, h.at)).collect();
        for (tag, d, at) in stale {
            if let Some(h) = self.ps[p].held.get_mut(&tag) {
                h.reported = true;
            }
            self.violation(format!(
                "held: p{p} still holds d{d}'s message of {:.3} s at {:.3} s, past E",
                at.as_secs_f64(),
                t.as_secs_f64()
            ));
        }
    }

    /// A D's message on P's control channel, decided at once (the connector's
    /// `_kvlease_answer`).
    fn on_p_message(&mut self, p: usize, d: usize, bytes: &[u8], t: Nanos) {
        let msg = match Message::decode(bytes) {
            Ok(m) => m,
            Err(e) => return self.violation(format!("wire: d{d}'s message to p{p} does not decode: {e}")),
        };
        let pe = &mut self.ps[p];
        let holder = pe.leases.holder(&self.ds[d].name);
        let tag = pe.next_tag;
        pe.next_tag += 1;
        let before = pe.leases.held();
        let mut rel = Vec::new();
        let answer = pe.leases.on_message_from(holder, tag, &msg, t, true, &mut rel);
        let held = pe.leases.held().saturating_sub(before);
        if held > 0 {
            pe.held.insert(tag, Held { d, parts: held, at: t, reported: false });
        }
        match &msg {
            Message::Heartbeat { lease_ids, .. } => {
                let lost = match &answer.reply {
                    Some(Message::HeartbeatAck { lost_ids, .. }) => lost_ids.clone(),
                    _ => Vec::new(),
                };
                for w in lease_ids.iter().filter(|w| !lost.contains(w)) {
                    let Some(&r) = self.ps[p].req_of_w.get(w) else { continue };
                    if self.reqs[r].granted.is_none() {
                        self.reqs[r].early_acked = true;
                    }
                    self.reqs[r].last_ack = Some(t);
                    self.positive(r, d);
                }
                self.note(format!("p{p} ← d{d} heartbeat {:x?}: lost {lost:x?}", lease_ids));
            }
            Message::Release { lease_ids } => {
                let freed: Vec<usize> = rel
                    .iter()
                    .filter(|x| x.reason == ReleaseReason::Released)
                    .filter_map(|x| self.ps[p].req_of_lease.get(&x.lease_id).copied())
                    .collect();
                for r in freed {
                    self.positive(r, d);
                }
                self.note(format!("p{p} ← d{d} release {lease_ids:x?}: {held} held, answer {:?}", answer.reply));
            }
            Message::ReadDone { lease_id, .. } => {
                if let (Some(Message::ReadDoneAck { live: true, .. }), Some(&r)) = (&answer.reply, self.ps[p].req_of_w.get(lease_id)) {
                    self.positive(r, d);
                }
                let what = match &answer.reply {
                    Some(Message::ReadDoneAck { live, .. }) => format!("live {live}"),
                    _ => "held for its grant".into(),
                };
                self.note(format!("p{p} ← d{d} read_done {lease_id:#x}: {what}"));
            }
            other => self.note(format!("p{p} ← d{d} {other:?}: not a message P takes")),
        }
        self.released(p, rel, t);
        if let Some(reply) = answer.reply {
            self.transmit(t, Ev::ToD { d, p, bytes: reply.encode() });
        }
        if held > 0 {
            self.wake_p(p, t);
        }
    }

    /// The network: lost, or delivered once or twice, each after its own delay.
    fn transmit(&mut self, t: Nanos, ev: Ev) {
        if self.rng.chance(self.c.loss) {
            let what = match &ev {
                Ev::ToP { p, d, .. } => format!("d{d} → p{p}"),
                Ev::ToD { d, p, .. } => format!("p{p} → d{d}"),
                _ => String::new(),
            };
            self.note(format!("network: a message {what} lost"));
            return;
        }
        let copies = if self.rng.chance(self.c.duplicate) { 2 } else { 1 };
        for _ in 0..copies {
            let delay = self.rng.secs(0.0, self.c.max_delay.as_secs_f64());
            self.push(t + delay, ev.clone());
        }
    }

    // ---------------------------------------------------------------------------- router

    /// P's params to a live D engine (from the one the workload drew, in turn), and to a second
    /// one when the router errs.
    fn route(&mut self, r: usize, t: Nanos) {
        let n = self.c.d_engines;
        let first = self.reqs[r].d;
        let Some(d) = (0..n).map(|k| (first + k) % n).find(|&k| self.ds[k].alive) else {
            self.reqs[r].unrouted = true;
            self.note(format!("req {r}: no live decoder; it fails at the router"));
            return;
        };
        let mut targets = vec![d];
        if let Some(s) = self.reqs[r].stray.filter(|&s| s != d && self.ds[s].alive) {
            targets.push(s);
            self.note(format!("req {r}: the router hands its params to d{d} and d{s}"));
        }
        for d in targets {
            let c = self.copies.len();
            let abort_after = self.rng.chance(self.c.abort).then(|| self.rng.secs(0.0, self.c.lease_secs * 1.5));
            self.copies.push(Copy {
                r,
                d,
                rid: format!("req{r}"),
                state: State::Routed,
                abort_after,
                correct: None,
                slot: false,
                end: None,
            });
            self.reqs[r].copies.push(c);
            self.ds[d].copies.push(c);
            let delay = self.rng.secs(0.0, self.c.router_delay.as_secs_f64());
            self.push(t + delay, Ev::Params { c });
        }
    }

    // ---------------------------------------------------------------------------- D

    fn remote(&self, p: usize) -> Remote {
        Remote { engine_id: self.ps[p].name.clone(), host: format!("10.0.0.{}", p + 1), port: 5600 + p as u16, incarnation: 0 }
    }

    fn params(&mut self, c: usize, t: Nanos) {
        let (d, r) = (self.copies[c].d, self.copies[c].r);
        self.copies[c].state = State::Arrived;
        self.ds[d].new.push(c);
        self.note(format!("req {r} reaches d{d} with lease {:#x} of p{}", self.reqs[r].w, self.reqs[r].p));
        if let Some(after) = self.copies[c].abort_after {
            self.push(t + after, Ev::Abort { c });
        }
        self.wake_d(d, t);
    }

    fn wake_d(&mut self, d: usize, t: Nanos) {
        if !self.ds[d].stepping {
            self.ds[d].stepping = true;
            self.push(t, Ev::DStep { d });
        }
    }

    fn schedule_poll(&mut self, d: usize, at: Nanos) {
        let de = &mut self.ds[d];
        de.gen += 1;
        de.poll_at = Some(at);
        let gen = de.gen;
        self.push(at, Ev::DPoll { d, gen });
    }

    /// The renewer thread is woken (`_kvlease_wake.set()`).
    fn wake_poll(&mut self, d: usize, t: Nanos) {
        if self.ds[d].poll_at.is_none_or(|at| at > t) {
            self.schedule_poll(d, t);
        }
    }

    /// The renewer's thread (`_kvlease_run`): polls, carries out, sleeps until due (1 ms to
    /// 100 ms) or woken.
    fn poll(&mut self, d: usize, gen: u64, t: Nanos) {
        if self.ds[d].gen != gen {
            return;
        }
        self.ds[d].poll_at = None;
        let mut actions = Vec::new();
        self.ds[d].renewer.poll(t, &mut actions);
        for a in actions {
            match a {
                Action::Handshake { engine_id, .. } => {
                    if let Some(p) = p_index(&engine_id) {
                        self.ds[d].hs_pending.insert(p);
                    }
                    self.handshakes_done(d, t);
                }
                Action::Lost { request_id, .. } => {
                    if let Some(&c) = self.ds[d].reqs.get(&request_id) {
                        self.lost_request(d, c, t);
                    }
                }
                Action::Send { engine_id, bytes, kind } => {
                    let Some(p) = p_index(&engine_id) else { continue };
                    if kind == SendKind::ClockProbe || self.ds[d].agents.get(p) != Some(&Link::Done) {
                        continue;
                    }
                    self.transmit(t, Ev::ToP { p, d, bytes });
                }
                Action::Forget { .. } | Action::ReleaseOverSideChannel(_) | Action::DuplicateEngine { .. } => {}
            }
        }
        let timeout = self.ds[d].renewer.poll_timeout();
        // With nothing tracked and nothing due within the thread's longest sleep, only an idle
        // engine's forgetting is left: the simulation lets the thread sleep until woken.
        if self.ds[d].renewer.tracked() == 0 && timeout.is_none_or(|at| at > t + POLL_MAX) {
            return;
        }
        let wait = timeout.map_or(POLL_MAX, |at| at.since(t).clamp(POLL_MIN, POLL_MAX));
        self.schedule_poll(d, t + wait);
    }

    /// The renewer learns of the handshakes it asked for that vLLM's worker has completed.
    fn handshakes_done(&mut self, d: usize, t: Nanos) {
        let done: Vec<usize> = self.ds[d].hs_pending.iter().copied().filter(|&p| self.ds[d].agents[p] == Link::Done).collect();
        for p in done {
            self.ds[d].hs_pending.remove(&p);
            let name = self.ps[p].name.clone();
            let agents = vec![format!("{name}-0")];
            self.ds[d].renewer.handshake_done(&name, Ok(Handshook { incarnation: 0, agents }), t);
            self.note(format!("d{d}: the renewer is linked to {name}"));
        }
    }

    /// Whether D's engine steps: it has requests, or news for its worker's next step.
    fn active(&self, d: usize) -> bool {
        !self.ds[d].gone.is_empty() || self.ds[d].copies.iter().any(|&c| !matches!(self.copies[c].state, State::Routed | State::Done))
    }

    /// One step of D's engine: the worker's `start_load_kv` (new requests tracked, reads gated
    /// and posted, vLLM's handshakes on a heartbeat step) and `get_finished` (reads that
    /// landed asked about, confirmations decided).
    fn d_step(&mut self, d: usize, t: Nanos) {
        // _kvlease_sync
        for c in std::mem::take(&mut self.ds[d].gone) {
            let rid = self.copies[c].rid.clone();
            let de = &mut self.ds[d];
            de.renewer.untrack(&rid, Untrack::Transferred);
            de.reqs.remove(&rid);
        }
        let new = std::mem::take(&mut self.ds[d].new);
        let mut tracked = false;
        for &c in &new {
            if self.copies[c].state != State::Arrived {
                continue;
            }
            let r = self.copies[c].r;
            let (p, w) = (self.reqs[r].p, self.reqs[r].w);
            let remote = self.remote(p);
            let rid = self.copies[c].rid.clone();
            let de = &mut self.ds[d];
            de.renewer.track(&rid, &remote, w, t);
            de.reqs.insert(rid, c);
            de.queue.push_back(c);
            self.copies[c].state = State::Queued;
            tracked = true;
        }
        self.handshakes_done(d, t);
        if tracked {
            self.wake_poll(d, t);
        }
        // vLLM's scheduler: requests given a slot are read this step.
        let mut to_recv = Vec::new();
        while self.ds[d].busy < self.c.d_slots {
            let Some(c) = self.ds[d].queue.pop_front() else { break };
            if self.copies[c].state != State::Queued {
                continue;
            }
            self.ds[d].busy += 1;
            self.copies[c].slot = true;
            to_recv.push(c);
        }
        // _kvlease_gate_reads
        let mut wake = false;
        let lost_now: Vec<usize> = to_recv.iter().copied().filter(|c| self.ds[d].lost.contains(c)).collect();
        for c in lost_now {
            self.ds[d].lost.remove(&c);
            to_recv.retain(|&x| x != c);
            self.fail_by_policy(c, "lease_lost", t);
        }
        if !to_recv.is_empty() || !self.ds[d].deferred.is_empty() {
            let de = &mut self.ds[d];
            let recheck = de.news != de.news_seen || t >= de.recheck_at;
            if recheck {
                de.news_seen = de.news;
                de.recheck_at = t + RECHECK;
            }
            let deferred: Vec<usize> = de.deferred.keys().copied().collect();
            for c in deferred {
                if self.ds[d].lost.remove(&c) {
                    self.ds[d].deferred.remove(&c);
                    self.fail_by_policy(c, "lease_lost", t);
                    continue;
                }
                let at = self.ds[d].deferred.get(&c).map_or(t, |x| x.1);
                if !recheck && t < at {
                    continue;
                }
                let Some((pull, _)) = self.ds[d].deferred.remove(&c) else { continue };
                self.gate(d, c, pull, t);
                wake = true;
            }
            for c in to_recv {
                let pull = self.new_pull(c, t);
                if !self.gate(d, c, pull, t) {
                    wake = true;
                }
            }
        }
        if wake {
            self.wake_poll(d, t);
        }
        // vLLM's heartbeat step: the handshakes the renewer's heartbeats need.
        if t >= self.ds[d].next_hb {
            let toward: BTreeSet<usize> = self.ds[d]
                .copies
                .iter()
                .filter(|&&c| matches!(self.copies[c].state, State::Queued | State::Deferred | State::Reading))
                .map(|&c| self.reqs[self.copies[c].r].p)
                .collect();
            if !toward.is_empty() {
                self.ds[d].next_hb = t + self.cfg.heartbeat_interval;
                for p in toward {
                    if self.ds[d].agents[p] == Link::None {
                        self.ds[d].agents[p] = Link::Pending;
                        let delay = self.rng.secs(0.0, self.c.handshake_delay.as_secs_f64());
                        self.push(t + delay, Ev::Handshook { d, p });
                    }
                }
                self.handshakes_done(d, t);
            }
        }
        // get_finished: reads landed, confirmations decided.
        for c in std::mem::take(&mut self.ds[d].landed_unseen) {
            if self.copies[c].state == State::Reading {
                self.landed(d, c, t);
            }
        }
        let decided: Vec<(usize, u64)> = self.ds[d].confirming.iter().filter(|(_, e)| e.3.is_some() || t >= e.2).map(|(k, _)| *k).collect();
        for k in decided {
            let Some((c, mut pull, _, verdict)) = self.ds[d].confirming.remove(&k) else { continue };
            let v = verdict.unwrap_or_else(|| pull.on_deadline());
            self.apply(c, v, t);
        }
        if self.active(d) {
            let dur = self.step_time();
            self.push(t + dur, Ev::DStep { d });
        } else {
            self.ds[d].stepping = false;
        }
    }

    /// The connector's `_kvlease_pull`.
    fn new_pull(&self, c: usize, t: Nanos) -> Pull {
        let p = self.reqs[self.copies[c].r].p;
        let l = self.cfg.lease_duration;
        Pull::new(&self.cfg, &self.ps[p].name, 0, false, t).waiting_for_link(l).confirming_within(l.max(CONFIRM_WAIT_MIN))
    }

    /// The connector's `_kvlease_step`: read now (true), hold back, or fail the load.
    fn gate(&mut self, d: usize, c: usize, mut pull: Pull, t: Nanos) -> bool {
        let rid = self.copies[c].rid.clone();
        let check = self.ds[d].renewer.read_check(&rid, pull.read_budget(), false, t);
        match pull.check(check, t) {
            Step::Read => match pull.reading(t) {
                Ok(_) => {
                    self.ds[d].pulls.insert(c, pull);
                    self.copies[c].state = State::Reading;
                    let lat = if self.rng.chance(self.c.slow_read.0) {
                        self.rng.secs(self.c.read_time.1.as_secs_f64(), self.c.slow_read.1.as_secs_f64())
                    } else {
                        self.rng.secs(self.c.read_time.0.as_secs_f64(), self.c.read_time.1.as_secs_f64())
                    };
                    self.note(format!("d{d}: req {} read ({check:?}); lands in {:.3} s", self.copies[c].r, lat.as_secs_f64()));
                    self.push(t + lat, Ev::Land { c });
                    if self.rng.chance(self.c.stall_on_read) {
                        let (e, l) = (self.cfg.extension.as_secs_f64(), self.c.lease_secs);
                        let len = self.rng.secs(e * 0.5, l * 2.0);
                        self.note(format!("d{d} stalls for {:.3} s", len.as_secs_f64()));
                        self.pauses.push((t, t + len, d));
                    }
                    return true;
                }
                Err(lost) => {
                    let v = pull.finish(Err(lost));
                    self.apply(c, v, t);
                }
            },
            Step::Wait { until, .. } => {
                if self.copies[c].state != State::Deferred {
                    self.note(format!("d{d}: req {} waits for an acknowledged renewal ({check:?})", self.copies[c].r));
                }
                self.copies[c].state = State::Deferred;
                self.ds[d].deferred.insert(c, (pull, until));
            }
            Step::Lost(lost) => {
                let v = pull.finish(Err(lost));
                self.apply(c, v, t);
            }
        }
        false
    }

    /// A read lands: its KV is right only if P still held the blocks; vLLM's notification
    /// goes to P, and D sees the landing at its next step.
    fn land(&mut self, c: usize, t: Nanos) {
        let r = self.copies[c].r;
        let p = self.reqs[r].p;
        let held = self.reqs[r].ended.is_none() && self.reqs[r].issued.is_some();
        self.copies[c].correct = Some(held);
        self.note(format!(
            "req {r}: d{}'s read of {:#x} landed ({})",
            self.copies[c].d,
            self.reqs[r].w,
            if held { "P held the blocks" } else { "blocks reused: garbage" }
        ));
        let delay = self.rng.secs(0.0, self.c.max_delay.as_secs_f64());
        self.push(t + delay, Ev::Notif { p, r });
        let d = self.copies[c].d;
        if self.ds[d].alive && self.copies[c].state == State::Reading {
            self.ds[d].landed_unseen.push(c);
        }
    }

    /// The connector's `_pop_done_transfers` for a read that landed: no more renewing, a
    /// `ReadDone` to P, its confirmation awaited.
    fn landed(&mut self, d: usize, c: usize, t: Nanos) {
        let r = self.copies[c].r;
        let (p, w) = (self.reqs[r].p, self.reqs[r].w);
        let Some(mut pull) = self.ds[d].pulls.remove(&c) else { return };
        let rid = self.copies[c].rid.clone();
        self.ds[d].renewer.untrack(&rid, Untrack::Transferred);
        match pull.reads_done(Ok(1), false, t) {
            AfterReads::AwaitAcks { until } => {
                self.copies[c].state = State::Confirming;
                let msg = Message::ReadDone { lease_id: w, consumer_rank: 0, n: 1, digest: PromptDigest::default() };
                let linked = self.ds[d].agents[p] == Link::Done;
                let verdict = if linked { None } else { Some(pull.on_deadline()) };
                self.ds[d].confirming.insert((p, w), (c, pull, until, verdict));
                if linked {
                    self.transmit(t, Ev::ToP { p, d, bytes: msg.encode() });
                }
            }
            AfterReads::Decided(v) => self.apply(c, v, t),
        }
    }

    /// P's answer on D's control link (the connector's `_kvlease_on_answer`).
    fn on_d_message(&mut self, d: usize, p: usize, bytes: &[u8], t: Nanos) {
        let msg = match Message::decode(bytes) {
            Ok(m) => m,
            Err(e) => return self.violation(format!("wire: p{p}'s message to d{d} does not decode: {e}")),
        };
        match &msg {
            Message::ReadDoneAck { lease_id, live } => {
                if let Some(e) = self.ds[d].confirming.get_mut(&(p, *lease_id)) {
                    if e.3.is_none() {
                        e.3 = e.1.on_read_done_ack(*live);
                    }
                }
            }
            Message::HeartbeatAck { .. } | Message::LeaseLost { .. } => {
                if let Message::HeartbeatAck { lost_ids, .. } | Message::LeaseLost { lease_ids: lost_ids } = &msg {
                    if !lost_ids.is_empty() {
                        self.note(format!("d{d} ← p{p}: lost {lost_ids:x?}"));
                    }
                }
                let name = self.ps[p].name.clone();
                let de = &mut self.ds[d];
                de.renewer.on_message(&name, &msg, t);
                de.news += 1;
                self.wake_poll(d, t);
            }
            other => self.note(format!("d{d} ← p{p} {other:?}: not a message D takes")),
        }
    }

    /// The connector's `_kvlease_lost_request`.
    fn lost_request(&mut self, d: usize, c: usize, _t: Nanos) {
        // What the loss means is the request's Pull's to say (SPEC D6, P5): a read posted, or
        // landed and awaiting P's confirmation, is left to its `ReadDone`.
        let de = &mut self.ds[d];
        let pull = match de.pulls.get_mut(&c) {
            Some(pull) => Some(pull),
            None => de.confirming.values_mut().find(|e| e.0 == c).map(|e| &mut e.1),
        };
        if pull.is_some_and(|pull| pull.on_lease_lost().is_none()) {
            self.note(format!("d{d}: req {}'s lease reported lost with its read posted; its ReadDone decides", self.copies[c].r));
            return;
        }
        self.note(format!("d{d}: req {}'s lease reported lost", self.copies[c].r));
        if matches!(self.copies[c].state, State::Queued | State::Deferred) {
            self.ds[d].lost.insert(c);
        }
    }

    fn fail_by_policy(&mut self, c: usize, why: &'static str, t: Nanos) {
        let v = match self.cfg.load_failure_policy {
            LoadFailurePolicy::Recompute => Verdict::Recompute(kvlease_core::pull::PullLost::LeaseLost),
            LoadFailurePolicy::Fail => Verdict::Fail(kvlease_core::pull::PullLost::LeaseLost),
        };
        self.note(format!("d{}: req {}'s load fails ({why})", self.copies[c].d, self.copies[c].r));
        self.apply(c, v, t);
    }

    /// A pull's verdict carried out: SPEC P5/D6, bytes are used only if P held them.
    fn apply(&mut self, c: usize, v: Verdict, t: Nanos) {
        let (d, r) = (self.copies[c].d, self.copies[c].r);
        self.note(format!("d{d}: req {r}: {}", short(&v)));
        let decode = self.rng.secs(self.c.decode.0.as_secs_f64(), self.c.decode.1.as_secs_f64());
        let (end, busy_for) = match v {
            Verdict::Use => {
                if self.copies[c].correct != Some(true) {
                    let (p, w) = (self.reqs[r].p, self.reqs[r].w);
                    self.violation(format!("P5/D6: d{d} used the KV of lease {w:#x} of p{p} read after P had freed its blocks (req {r})"));
                }
                (End::Used, Some(decode))
            }
            Verdict::Recompute(l) => (End::Recomputed(l.kind()), Some(decode)),
            Verdict::Fail(l) => (End::Failed(l.kind()), None),
        };
        self.end(c, end);
        self.ds[d].gone.push(c);
        if self.copies[c].slot {
            self.copies[c].slot = false;
            self.push(t + busy_for.unwrap_or_default(), Ev::Free { d });
        }
    }

    fn end(&mut self, c: usize, end: End) {
        if self.copies[c].end.is_some() {
            return;
        }
        self.copies[c].state = State::Done;
        self.copies[c].end = Some((self.now, end));
        if matches!(end, End::Failed("d_down")) {
            self.note(format!("req {}: d{} is down", self.copies[c].r, self.copies[c].d));
        }
    }

    /// A client aborts before the read: kvlease's D releases the lease (SPEC D4), vLLM's
    /// stops renewing.
    fn abort(&mut self, c: usize, t: Nanos) {
        let d = self.copies[c].d;
        let state = self.copies[c].state;
        if !matches!(state, State::Arrived | State::Queued | State::Deferred) {
            return;
        }
        let r = self.copies[c].r;
        self.note(format!("d{d}: req {r} aborted by its client"));
        if state == State::Deferred {
            self.ds[d].deferred.remove(&c);
        }
        if self.copies[c].slot {
            self.copies[c].slot = false;
            self.ds[d].busy = self.ds[d].busy.saturating_sub(1);
        }
        self.end(c, End::Aborted);
        let rid = self.copies[c].rid.clone();
        if self.ds[d].releasing {
            let (p, w) = (self.reqs[r].p, self.reqs[r].w);
            if state == State::Arrived {
                let remote = self.remote(p);
                self.ds[d].renewer.release(&remote, w, t);
            } else {
                self.ds[d].renewer.untrack(&rid, Untrack::Abandoned);
                self.ds[d].reqs.remove(&rid);
            }
            self.wake_poll(d, t);
        } else {
            self.ds[d].gone.push(c);
        }
    }

    fn crash(&mut self, d: usize, t: Nanos) {
        self.note(format!("crash d{d}"));
        self.ds[d].alive = false;
        for c in self.ds[d].copies.clone() {
            if self.copies[c].end.is_some() {
                continue;
            }
            self.end(c, End::Failed("d_crashed"));
            let r = self.copies[c].r;
            let others = self.reqs[r].copies.iter().any(|&o| o != c && self.copies[o].end.is_none());
            if !others {
                self.reqs[r].crash_check = Some(t);
            }
        }
    }

    // ---------------------------------------------------------------------------- checks

    fn final_checks(&mut self) {
        let e = self.cfg.extension;
        let l = self.cfg.lease_duration;
        for c in 0..self.copies.len() {
            if self.copies[c].end.is_none() {
                let (r, d, s) = (self.copies[c].r, self.copies[c].d, self.copies[c].state);
                self.violation(format!("liveness: req {r} on d{d} never ended ({s:?})"));
            }
        }
        for r in 0..self.reqs.len() {
            let q = &self.reqs[r];
            let (p, w, lease, ended, early_acked, last_ack) = (q.p, q.w, q.lease, q.ended, q.early_acked, q.last_ack);
            let (crash_check, issued, granted) = (q.crash_check, q.issued, q.granted);
            if issued.is_none() {
                self.violation(format!("liveness: req {r} was never prefilled"));
                continue;
            }
            if lease.is_some() && ended.is_none() {
                self.violation(format!("P3: p{p}'s lease {w:#x} never ended"));
            }
            if lease.is_none() {
                self.violation(format!("p{p} never granted req {r}'s lease {w:#x}"));
            }
            let (Some(crash), Some(issued), Some(g)) = (crash_check, issued, granted) else { continue };
            let step = self.ps[p].max_step + Duration::from_millis(1);
            let mut bound = (issued + l).max(g);
            if early_acked {
                bound = bound.max(g + e);
            }
            if let Some(a) = last_ack {
                bound = bound.max(a + e);
            }
            let bound = bound + step;
            match ended {
                Some((at, _)) if at <= bound => {}
                ended => {
                    let when = ended.map_or("never".to_string(), |(at, _)| format!("at {:.3} s", at.as_secs_f64()));
                    self.violation(format!(
                        "P4: p{p}'s lease {w:#x} of a D that crashed at {:.3} s ended {when}, past its bound {:.3} s",
                        crash.as_secs_f64(),
                        bound.as_secs_f64()
                    ));
                }
            }
        }
        for p in 0..self.ps.len() {
            let (live, held) = (self.ps[p].leases.table().live(), self.ps[p].leases.held());
            let stats = self.ps[p].leases.table().stats();
            let (granted, released) = (stats.granted, stats.released.iter().sum::<u64>());
            if live != 0 || held != 0 {
                self.violation(format!("P3/P4: p{p} still holds {live} leases and {held} messages at rest"));
            }
            if granted != released {
                self.violation(format!("P3: p{p} granted {granted} leases and released {released}"));
            }
        }
    }

    fn finish(self) -> Outcome {
        let count = |f: fn(&End) -> bool| self.copies.iter().filter(|c| c.end.as_ref().is_some_and(|(_, e)| f(e))).count();
        Outcome {
            seed: self.c.seed,
            requests: self.reqs.len(),
            counts: ConnectorCounts {
                strays: self.reqs.iter().filter(|r| r.copies.len() > 1).count(),
                used: count(|e| *e == End::Used),
                recomputed: count(|e| matches!(e, End::Recomputed(_))),
                failed: count(|e| matches!(e, End::Failed(_))) + self.reqs.iter().filter(|r| r.unrouted).count(),
                aborted: count(|e| *e == End::Aborted),
            },
            violations: self.violations,
            trace: self.trace,
            simulated: self.now.since(Nanos::ZERO),
        }
    }
}
