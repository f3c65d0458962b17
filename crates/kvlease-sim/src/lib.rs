//! kvlease-sim: a prefill engine and a decode engine in one thread, under virtual time, driving
//! the same protocol core as the real runtime (`LeaseTable`, `Renewer`, the wire codec), with
//! seeded arrivals, network delay and loss, a traffic surge and a decoder crash.
//!
//! It exists to show the policies of SPEC §1 side by side on the same seeded workload:
//! * `fixed`: P holds blocks until the read or a single timeout (vLLM's old 480 s, or a short
//!   one), D never renews and reads whenever it gets to the request — after expiry, freed and
//!   reused blocks (vLLM #21570: garbage with HTTP 200);
//! * `lease`: kvlease — a short lease, heartbeats from arrival, acknowledged reads, recompute on
//!   a lost lease.
//!
//! Everything is deterministic: the same [`Scenario`] gives the same [`Report`], so a failing
//! seed is a test that can be replayed forever.

pub mod cluster;

use kvlease_core::config::LeaseConfig;
use kvlease_core::digest::PromptDigest;
use kvlease_core::lease_table::LeaseTable;
use kvlease_core::renewer::{Action, ReadCheck, Remote, Renewer, Untrack};
use kvlease_core::wire::Message;
use kvlease_core::Nanos;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

/// How P keeps blocks for D.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// A single timeout of this many seconds; no renewal; D reads without checking.
    Fixed(f64),
    /// kvlease: a lease of this many seconds, renewed by heartbeats, reads acknowledged.
    Lease(f64),
}

impl Policy {
    pub fn name(&self) -> String {
        match self {
            Policy::Fixed(s) => format!("fixed {s} s"),
            Policy::Lease(s) => format!("lease {s} s"),
        }
    }
}

/// The workload and the faults.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub seed: u64,
    /// Simulated time.
    pub duration: Duration,
    /// Requests per second reaching P (Poisson).
    pub rate: f64,
    /// During `surge`, the rate is multiplied by `surge_factor`.
    pub surge: Option<(Duration, Duration)>,
    pub surge_factor: f64,
    /// KV blocks per request.
    pub blocks: u32,
    /// D's concurrent decode slots and decode time per request.
    pub d_slots: usize,
    pub decode_time: Duration,
    /// One-way network delay and the chance a message is lost.
    pub delay: Duration,
    pub loss: f64,
    /// When D crashes (it stops everything, for good; no new work is routed to it).
    pub d_crash: Option<Duration>,
}

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            seed: 1,
            duration: Duration::from_secs(600),
            rate: 4.0,
            surge: Some((Duration::from_secs(100), Duration::from_secs(160))),
            surge_factor: 3.0,
            blocks: 64,
            d_slots: 4,
            decode_time: Duration::from_millis(900),
            delay: Duration::from_millis(1),
            loss: 0.01,
            d_crash: Some(Duration::from_secs(400)),
        }
    }
}

/// What happened under one policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    pub policy: String,
    pub arrived: u64,
    /// Decoded from KV that was live when read.
    pub served: u64,
    /// Decoded from KV read after P had freed (and possibly reused) it.
    pub garbage: u64,
    /// D found the lease lost, or its transfer failed, and computed the prompt itself.
    pub recomputed: u64,
    /// Block-seconds P kept pinned after D had crashed: memory held for nobody.
    pub dead_block_seconds: f64,
    /// Seconds after D's crash until P held no lease.
    pub reclaim_after_crash: Option<f64>,
    pub peak_leased_blocks: u64,
}

#[derive(Debug)]
enum Event {
    /// A request reaches P, which prefills it and grants.
    Arrive,
    /// P's answer (the lease) reaches D.
    Params {
        req: u64,
        lease: u64,
    },
    ToP(Vec<u8>),
    ToD(Vec<u8>),
    /// A decode on D finished.
    Decoded,
    /// D gives up on a read whose answer never came (a lost message).
    ReadTimeout {
        lease: u64,
    },
    ReapTick,
    RenewerPoll,
    Crash,
}

struct Sim {
    sc: Scenario,
    policy: Policy,
    rng: u64,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: HashMap<u64, Event>,
    table: LeaseTable<()>,
    renewer: Renewer,
    lease_cfg: LeaseConfig,
    d_alive: bool,
    d_waiting: VecDeque<(u64, u64)>,
    d_busy: usize,
    /// Requests whose read is in flight: request → lease.
    reading: HashMap<u64, u64>,
    next_req: u64,
    report: Report,
    last_sample: u64,
    crashed_at: Option<u64>,
}

const P: &str = "P";
/// The decoder, as P's lease table knows it (SPEC S5).
const D: &str = "D";
/// Every simulated request has the same prompt: the simulator models time, not content.
const PROMPT: PromptDigest = PromptDigest([0; 16]);

impl Sim {
    fn new(sc: Scenario, policy: Policy) -> Sim {
        let secs = match policy {
            Policy::Fixed(s) | Policy::Lease(s) => s,
        };
        let lease_cfg = LeaseConfig::with_lease_secs(secs).unwrap_or_default();
        Sim {
            rng: sc.seed ^ 0x9e37_79b9_7f4a_7c15,
            sc,
            policy,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: HashMap::new(),
            table: LeaseTable::new(&lease_cfg),
            renewer: Renewer::new(&lease_cfg),
            lease_cfg,
            d_alive: true,
            d_waiting: VecDeque::new(),
            d_busy: 0,
            reading: HashMap::new(),
            next_req: 0,
            report: Report { policy: policy.name(), ..Report::default() },
            last_sample: 0,
            crashed_at: None,
        }
    }

    fn random(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn at(&mut self, after: Duration, ev: Event) {
        self.seq += 1;
        let t = self.now.saturating_add(after.as_nanos() as u64);
        self.queue.push(Reverse((t, self.seq)));
        self.events.insert(self.seq, ev);
    }

    /// A message over the network: delayed, sometimes lost.
    fn send(&mut self, ev: Event) {
        if self.random() >= self.sc.loss {
            self.at(self.sc.delay, ev);
        }
    }

    fn next_arrival(&mut self) {
        let t = Duration::from_nanos(self.now);
        let surging = self.sc.surge.is_some_and(|(a, b)| t >= a && t < b);
        let rate = self.sc.rate * if surging { self.sc.surge_factor } else { 1.0 };
        let gap = -(1.0 - self.random()).ln() / rate;
        self.at(Duration::from_secs_f64(gap), Event::Arrive);
    }

    fn run(mut self) -> Report {
        self.next_arrival();
        self.at(self.lease_cfg.reap_granularity(), Event::ReapTick);
        if let Policy::Lease(_) = self.policy {
            self.at(Duration::ZERO, Event::RenewerPoll);
        }
        if let Some(c) = self.sc.d_crash {
            self.at(c, Event::Crash);
        }
        let end = self.sc.duration.as_nanos() as u64;
        while let Some(Reverse((t, id))) = self.queue.pop() {
            if t > end {
                break;
            }
            self.sample(t);
            self.now = t;
            if let Some(ev) = self.events.remove(&id) {
                self.handle(ev);
            }
        }
        self.sample(end);
        self.report
    }

    /// Integrates pinned blocks over time.
    fn sample(&mut self, t: u64) {
        let blocks = self.table.leased_blocks();
        if self.crashed_at.is_some() {
            self.report.dead_block_seconds += blocks as f64 * (t - self.last_sample) as f64 / 1e9;
        }
        self.report.peak_leased_blocks = self.report.peak_leased_blocks.max(blocks);
        self.last_sample = t;
    }

    fn handle(&mut self, ev: Event) {
        let now = Nanos(self.now);
        match ev {
            Event::Arrive => {
                if self.crashed_at.is_some() {
                    // The router has noticed D is gone and sends no more work its way.
                    return;
                }
                self.report.arrived += 1;
                let req = self.next_req;
                self.next_req += 1;
                let lease = self.table.grant(now, self.sc.blocks, PROMPT, ());
                self.send(Event::Params { req, lease });
                self.next_arrival();
            }
            Event::Params { req, lease } => {
                if !self.d_alive {
                    return;
                }
                if let Policy::Lease(_) = self.policy {
                    let remote = Remote { engine_id: P.into(), host: "p".into(), port: 1, incarnation: 1 };
                    self.renewer.track(&req.to_string(), &remote, lease, now);
                }
                self.d_waiting.push_back((req, lease));
                self.admit();
            }
            Event::ToP(bytes) => {
                let Ok(msg) = Message::decode(&bytes) else { return };
                let mut released = Vec::new();
                let holder = self.table.holder(D);
                let answer = self.table.on_message(holder, &msg, now, &mut released);
                if let Some(reply) = answer.reply {
                    self.send(Event::ToD(reply.encode()));
                }
            }
            Event::ToD(bytes) => {
                if !self.d_alive {
                    return;
                }
                let Ok(msg) = Message::decode(&bytes) else { return };
                match msg {
                    Message::ReadDoneAck { lease_id, live } => self.read_done(lease_id, live),
                    other => {
                        self.renewer.on_message(P, &other);
                        self.admit();
                    }
                }
            }
            Event::Decoded => {
                self.d_busy -= 1;
                self.admit();
            }
            Event::ReadTimeout { lease } => {
                // The transfer failed (a lost message): D computes the prompt itself.
                if let Some(req) = self.reading.remove(&lease).filter(|_| self.d_alive) {
                    self.d_busy -= 1;
                    if let Policy::Lease(_) = self.policy {
                        self.renewer.untrack(&req.to_string(), Untrack::Abandoned);
                    }
                    self.report.recomputed += 1;
                    self.decode();
                }
            }
            Event::ReapTick => {
                let mut released = Vec::new();
                self.table.tick(now, &mut released);
                if self.crashed_at.is_some() && self.table.live() == 0 && self.report.reclaim_after_crash.is_none() {
                    self.report.reclaim_after_crash = self.crashed_at.map(|c| (self.now - c) as f64 / 1e9);
                }
                self.at(self.lease_cfg.reap_granularity(), Event::ReapTick);
            }
            Event::RenewerPoll => {
                if !self.d_alive {
                    return;
                }
                let mut actions = Vec::new();
                self.renewer.poll(now, &mut actions);
                for a in actions {
                    match a {
                        Action::Handshake { engine_id, .. } => {
                            self.renewer.handshake_done(
                                &engine_id,
                                Ok(kvlease_core::renewer::Handshook { incarnation: 1, agents: Vec::new() }),
                                now,
                            );
                        }
                        Action::Send { bytes, .. } => self.send(Event::ToP(bytes)),
                        Action::Lost { .. } | Action::Forget { .. } => {}
                    }
                }
                self.admit();
                let next = self.renewer.poll_timeout().map(|t| t.since(now)).unwrap_or(Duration::from_millis(100));
                self.at(next.clamp(Duration::from_millis(1), Duration::from_millis(100)), Event::RenewerPoll);
            }
            Event::Crash => {
                self.d_alive = false;
                self.crashed_at = Some(self.now);
            }
        }
    }

    /// D takes waiting requests into free slots and reads their KV.
    fn admit(&mut self) {
        while self.d_alive && self.d_busy < self.sc.d_slots {
            let Some(&(req, lease)) = self.d_waiting.front() else { return };
            if let Policy::Lease(_) = self.policy {
                match self.renewer.read_check(&req.to_string(), self.lease_cfg.read_budget(), Nanos(self.now)) {
                    ReadCheck::Safe => {}
                    // The renewal goes out on the next poll; the ack brings us back here.
                    ReadCheck::RenewFirst => return,
                    ReadCheck::Untracked | ReadCheck::Unreachable => {
                        self.d_waiting.pop_front();
                        self.report.recomputed += 1;
                        self.decode();
                        continue;
                    }
                }
            }
            self.d_waiting.pop_front();
            self.d_busy += 1;
            self.reading.insert(lease, req);
            self.send(Event::ToP(Message::ReadDone { lease_id: lease, consumer_rank: 0, n: 1, digest: PROMPT }.encode()));
            self.at(self.sc.delay * 2 + Duration::from_secs(1), Event::ReadTimeout { lease });
        }
    }

    /// P answered a read: the bytes were live, or not.
    fn read_done(&mut self, lease: u64, live: bool) {
        let Some(req) = self.reading.remove(&lease) else { return };
        self.d_busy -= 1;
        match self.policy {
            Policy::Lease(_) => {
                let how = if live { Untrack::Transferred } else { Untrack::Abandoned };
                self.renewer.untrack(&req.to_string(), how);
                if live {
                    self.report.served += 1;
                } else {
                    self.report.recomputed += 1;
                }
            }
            // vLLM before leases: whatever was read is decoded.
            Policy::Fixed(_) if live => self.report.served += 1,
            Policy::Fixed(_) => self.report.garbage += 1,
        }
        self.decode();
    }

    fn decode(&mut self) {
        self.d_busy += 1;
        self.at(self.sc.decode_time, Event::Decoded);
    }
}

/// Runs one policy on a scenario.
pub fn simulate(sc: &Scenario, policy: Policy) -> Report {
    Sim::new(sc.clone(), policy).run()
}
