//! D's side of the lease (SPEC §5): track requests from arrival, renew their leases with one
//! batched heartbeat per P engine per interval, keep each P engine's handshake state, learn from
//! P's acknowledgements whether a lease is safely live before reading it, and release at once
//! what will never be read.
//!
//! The renewer is polled: [`Renewer::poll`] says what to send and which handshakes to start,
//! [`Renewer::poll_timeout`] when to poll next. It never waits for anything, so a slow forward
//! step or a dead P never delays heartbeats to the others (SPEC D3, D5): the driver polls it
//! from a timer of its own, not from the forward loop.

use crate::config::LeaseConfig;
use crate::peers::{Peer, Peers};
use crate::wire::{encode_heartbeat, heartbeat_chunks, Message};
use crate::{LeaseId, Nanos};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// Where a P engine is, as its `kv_transfer_params` say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    pub engine_id: String,
    pub host: String,
    pub port: u16,
    /// `remote_incarnation`; 0 when P did not send one (accepted for any incarnation).
    pub incarnation: u64,
}

/// What the driver must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Start a handshake with this P engine in the background and report it with
    /// [`Renewer::handshake_done`] (SPEC D5).
    Handshake { engine_id: String, host: String, port: u16 },
    /// Send this message to every rank of the P engine that holds a shard (SPEC D2).
    Send { engine_id: String, bytes: Vec<u8>, kind: SendKind },
    /// The lease of this request is gone: never use its data; apply the load failure policy
    /// (SPEC D6). Tracking has stopped.
    Lost { request_id: String, lease_id: LeaseId },
    /// Nothing has been tracked toward this P engine for a long while: it is forgotten; close
    /// the connections to its `agents` (a new request naming it handshakes again).
    Forget { engine_id: String, agents: Vec<String> },
}

/// What a [`Action::Send`] carries, for metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SendKind {
    /// A periodic heartbeat, sent `lateness` after it was due (`kvlease_heartbeat_lateness_seconds`).
    Heartbeat {
        lateness: Duration,
    },
    /// A heartbeat for leases about to be read whose liveness is not yet acknowledged (SPEC D6).
    ReadRenewal,
    Release,
    /// A clock probe (SPEC B2): the offset toward an engine whose cached turns we read.
    ClockProbe,
}

/// How a request's tracking ends (SPEC D4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Untrack {
    /// D read the blocks and reported `ReadDone`: P releases on that; nothing to send.
    Transferred,
    /// D will not read (aborted, failed, finished without a transfer): tell P to free now.
    Abandoned,
}

/// The answer to "may I read this lease now, within `budget`?" (SPEC D6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadCheck {
    /// Acknowledged live for longer than the budget.
    Safe,
    /// Not known to be live long enough; a renewal is queued: poll, wait for the ack, ask again.
    RenewFirst,
    /// Not tracked (lost, or never tracked).
    Untracked,
    /// The last handshake with the lease's P engine failed: nothing can renew or read the lease
    /// until one succeeds. Waiting is a bet on P coming back within the lease; recomputing now is
    /// always right.
    Unreachable,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    Unknown,
    Pending,
    /// The handshake completed; the engine's incarnation and agents are in the peer registry.
    Ready,
    Failed {
        attempts: u32,
        retry_at: Nanos,
    },
}

#[derive(Debug)]
struct Tracked {
    request_id: String,
    incarnation: u64,
    /// P holds this lease at least until then, on our clock (send time of an acked heartbeat + E).
    acked_until: Nanos,
}

#[derive(Debug)]
struct RemoteEngine {
    host: String,
    port: u16,
    link: Link,
    /// Consecutive handshake failures, for back-off.
    failures: u32,
    leases: BTreeMap<LeaseId, Tracked>,
    next_due: Nanos,
    seq: u64,
    /// Heartbeats awaiting acknowledgement: (seq, sent at, ids).
    inflight: VecDeque<(u64, Nanos, Vec<LeaseId>)>,
    /// Leases to release, with the incarnation that granted them (a release is never sent to
    /// another incarnation, where the same id names someone else's lease) and when the release
    /// was first seen by `poll` (after E it is pointless: P has expired the lease itself).
    to_release: BTreeMap<LeaseId, (u64, Option<Nanos>)>,
    renew_for_read: BTreeSet<LeaseId>,
    /// Since when nothing is tracked or to be sent toward this engine.
    idle_since: Option<Nanos>,
    /// When the next clock probe is due while leases are tracked (SPEC B2).
    next_probe: Nanos,
    probe_seq: u64,
}

/// How often the clock offset toward an engine is measured again while the link lives.
const CLOCK_REFRESH: Duration = Duration::from_secs(30);

const BACKOFF_BASE: Duration = Duration::from_millis(100);
/// An engine nothing was tracked toward for max(12 I, this) is forgotten.
const FORGET_AFTER_MIN: Duration = Duration::from_secs(60);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// D's lease renewer for one engine: all remote P engines, all tracked requests.
#[derive(Debug)]
pub struct Renewer {
    interval: Duration,
    extension: Duration,
    max_notif_bytes: usize,
    engines: BTreeMap<String, RemoteEngine>,
    requests: BTreeMap<String, (String, LeaseId)>,
    lost: Vec<(String, LeaseId)>,
    peers: Peers,
}

/// What an accepted handshake with a P engine found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handshook {
    pub incarnation: u64,
    /// Its agents' names, one per rank.
    pub agents: Vec<String>,
}

/// What the driver does with a finished handshake's connections.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HandshakeTaken {
    /// Whether the result was taken. False for a handshake nobody waits for any more (the
    /// engine was forgotten, or reconnected elsewhere meanwhile): drop its agents' connections.
    pub taken: bool,
    /// Agents whose connections to drop: a previous incarnation's, or, when not taken, these.
    pub drop_agents: Vec<String>,
}

impl Renewer {
    pub fn new(cfg: &LeaseConfig) -> Renewer {
        Renewer {
            interval: cfg.heartbeat_interval,
            extension: cfg.extension,
            max_notif_bytes: cfg.max_notif_bytes,
            engines: BTreeMap::new(),
            requests: BTreeMap::new(),
            lost: Vec::new(),
            peers: Peers::default(),
        }
    }

    /// SPEC D1: start renewing `lease_id` for `request_id` now, as it enters the scheduler.
    /// SPEC D5: a known engine seen at new coordinates or with a new incarnation is reconnected.
    pub fn track(&mut self, request_id: &str, remote: &Remote, lease_id: LeaseId, now: Nanos) {
        if self.requests.contains_key(request_id) {
            return;
        }
        let engine = self.engines.entry(remote.engine_id.clone()).or_insert_with(|| RemoteEngine {
            host: remote.host.clone(),
            port: remote.port,
            link: Link::Unknown,
            failures: 0,
            leases: BTreeMap::new(),
            next_due: now,
            seq: 0,
            inflight: VecDeque::new(),
            to_release: BTreeMap::new(),
            renew_for_read: BTreeSet::new(),
            idle_since: None,
            next_probe: now + CLOCK_REFRESH,
            probe_seq: 0,
        });
        let moved = engine.host != remote.host || engine.port != remote.port;
        let known = self.peers.get(&remote.engine_id).map(|p| p.incarnation);
        let reborn = engine.link == Link::Ready && remote.incarnation != 0 && known.is_some_and(|i| i != remote.incarnation);
        if moved || reborn {
            engine.host = remote.host.clone();
            engine.port = remote.port;
            engine.link = Link::Unknown;
            engine.failures = 0;
            engine.inflight.clear();
        }
        // The same id from another incarnation of P: the older grant is certainly dead.
        let stale = engine.leases.get(&lease_id).is_some_and(|t| t.incarnation != remote.incarnation);
        if engine.leases.is_empty() {
            // The first lease toward an idle engine is renewed at once: D learns it is live early.
            engine.next_due = engine.next_due.min(now);
        }
        if stale {
            self.lose(&remote.engine_id, lease_id, false);
        }
        let Some(engine) = self.engines.get_mut(&remote.engine_id) else { return };
        engine
            .leases
            .insert(lease_id, Tracked { request_id: request_id.to_string(), incarnation: remote.incarnation, acked_until: Nanos::ZERO });
        self.requests.insert(request_id.to_string(), (remote.engine_id.clone(), lease_id));
    }

    /// SPEC D4: stop tracking a request; `Abandoned` queues a `Release` to P.
    pub fn untrack(&mut self, request_id: &str, how: Untrack) {
        let Some((engine_id, lease_id)) = self.requests.remove(request_id) else { return };
        let Some(engine) = self.engines.get_mut(&engine_id) else { return };
        let Some(t) = engine.leases.remove(&lease_id) else { return };
        engine.renew_for_read.remove(&lease_id);
        if how == Untrack::Abandoned {
            engine.to_release.insert(lease_id, (t.incarnation, None));
        }
    }

    /// The background handshake with `engine_id` finished: what it found, or failed. Leases
    /// granted by another incarnation of that engine are lost (SPEC §3), and the peer registry
    /// learns the engine's incarnation and agents.
    pub fn handshake_done(&mut self, engine_id: &str, result: Result<Handshook, ()>, now: Nanos) -> HandshakeTaken {
        let pending = self.engines.get(engine_id).is_some_and(|e| e.link == Link::Pending);
        if !pending {
            return HandshakeTaken { taken: false, drop_agents: result.map(|h| h.agents).unwrap_or_default() };
        }
        let Some(engine) = self.engines.get_mut(engine_id) else { return HandshakeTaken::default() };
        match result {
            Ok(Handshook { incarnation, agents }) => {
                engine.link = Link::Ready;
                engine.failures = 0;
                engine.next_due = now;
                let stale: Vec<LeaseId> =
                    engine.leases.iter().filter(|(_, t)| t.incarnation != 0 && t.incarnation != incarnation).map(|(id, _)| *id).collect();
                for id in stale {
                    self.lose(engine_id, id, false);
                }
                let drop_agents = self.peers.learned(engine_id, incarnation, agents);
                HandshakeTaken { taken: true, drop_agents }
            }
            Err(()) => {
                engine.failures += 1;
                let backoff = BACKOFF_BASE.saturating_mul(1 << engine.failures.min(16).saturating_sub(1)).min(BACKOFF_MAX);
                engine.link = Link::Failed { attempts: engine.failures, retry_at: now + backoff };
                HandshakeTaken { taken: true, drop_agents: Vec::new() }
            }
        }
    }

    /// An engine handshook with us (we serve it: it is a D engine, or a P engine that is also
    /// our decoder). The registry learns its agents; a new incarnation of an engine we renew
    /// with means its leases must be checked by a handshake of ours before the next heartbeat.
    /// Returns the agents of its previous incarnation, whose connections to drop.
    pub fn introduced(&mut self, engine_id: &str, incarnation: u64, agents: Vec<String>) -> Vec<String> {
        let old = self.peers.get(engine_id).map(|p| p.incarnation);
        if old.is_some_and(|i| i != incarnation) {
            if let Some(engine) = self.engines.get_mut(engine_id) {
                if engine.link == Link::Ready {
                    engine.link = Link::Unknown;
                    engine.inflight.clear();
                }
            }
        }
        self.peers.learned(engine_id, incarnation, agents)
    }

    /// The connection to `engine_id` broke: handshake again before the next heartbeat. Returns
    /// the agents whose connections to drop.
    pub fn disconnected(&mut self, engine_id: &str) -> Vec<String> {
        if let Some(engine) = self.engines.get_mut(engine_id) {
            if engine.link == Link::Ready {
                engine.link = Link::Unknown;
                engine.inflight.clear();
            }
        }
        self.peers.forget(engine_id)
    }

    /// An agent we know of no engine for went away.
    pub fn agent_gone(&mut self, agent: &str) {
        self.peers.forget_agent(agent);
    }

    /// The registry of remote engines (SPEC D5).
    pub fn peers(&self) -> &Peers {
        &self.peers
    }

    /// The remote engine a P engine's lease is read from, when its handshake is done.
    pub fn peer(&self, engine_id: &str) -> Option<&Peer> {
        self.peers.get(engine_id)
    }

    /// Records a clock sample from a handshake with `engine_id` (SPEC B2).
    pub fn clock_sample(&mut self, engine_id: &str, sample: crate::clock::ClockSample) {
        self.peers.clock_sample(engine_id, sample);
    }

    /// A message from a rank of P engine `engine_id`, at `now`: acknowledgements, lost leases,
    /// clock probe answers.
    pub fn on_message(&mut self, engine_id: &str, msg: &Message, now: Nanos) {
        match msg {
            Message::ClockPong { t0, t1, t2, .. } => {
                let sample = crate::clock::ClockSample { t0: *t0, t1: *t1, t2: *t2, t3: now.0 };
                self.peers.clock_sample(engine_id, sample);
            }
            Message::HeartbeatAck { seq, lost_ids } => {
                let extension = self.extension;
                let Some(engine) = self.engines.get_mut(engine_id) else { return };
                if let Some(pos) = engine.inflight.iter().position(|(s, _, _)| s == seq) {
                    let (_, sent_at, ids) = &engine.inflight[pos];
                    let until = *sent_at + extension;
                    for id in ids {
                        if lost_ids.binary_search(id).is_err() {
                            if let Some(t) = engine.leases.get_mut(id) {
                                t.acked_until = t.acked_until.max(until);
                            }
                        }
                    }
                    // Ranks ack the same heartbeat each; keep it for the others until it ages out.
                }
                for id in lost_ids {
                    self.lose(engine_id, *id, true);
                }
            }
            Message::LeaseLost { lease_ids } => {
                for id in lease_ids {
                    self.lose(engine_id, *id, false);
                }
            }
            _ => {}
        }
    }

    /// SPEC D6: may the request's lease be read now, finishing within `budget`?
    /// `RenewFirst` queues a renewal of it for the next [`Renewer::poll`].
    pub fn read_check(&mut self, request_id: &str, budget: Duration, now: Nanos) -> ReadCheck {
        let Some((engine_id, lease_id)) = self.requests.get(request_id) else { return ReadCheck::Untracked };
        let Some(engine) = self.engines.get_mut(engine_id) else { return ReadCheck::Untracked };
        let Some(t) = engine.leases.get(lease_id) else { return ReadCheck::Untracked };
        if t.acked_until > now + budget {
            return ReadCheck::Safe;
        }
        if matches!(engine.link, Link::Failed { .. }) {
            return ReadCheck::Unreachable;
        }
        engine.renew_for_read.insert(*lease_id);
        ReadCheck::RenewFirst
    }

    /// Everything due at `now`, appended to `out`.
    pub fn poll(&mut self, now: Nanos, out: &mut Vec<Action>) {
        for (request_id, lease_id) in self.lost.drain(..) {
            out.push(Action::Lost { request_id, lease_id });
        }
        for (engine_id, engine) in &mut self.engines {
            // An ack of a heartbeat sent more than E ago proves nothing any more: forget it.
            while engine.inflight.front().is_some_and(|(_, sent, _)| *sent + self.extension <= now) {
                engine.inflight.pop_front();
            }
            for (_, queued) in engine.to_release.values_mut() {
                queued.get_or_insert(now);
            }
            engine.to_release.retain(|_, (_, queued)| queued.is_none_or(|t| now.since(t) < self.extension));
            // Leases to renew, or releases to deliver, need a connection.
            let wanted = !engine.leases.is_empty() || !engine.to_release.is_empty();
            match engine.link {
                Link::Unknown if wanted => {
                    engine.link = Link::Pending;
                    out.push(Action::Handshake { engine_id: engine_id.clone(), host: engine.host.clone(), port: engine.port });
                }
                Link::Failed { retry_at, .. } if wanted && now >= retry_at => {
                    engine.link = Link::Pending;
                    out.push(Action::Handshake { engine_id: engine_id.clone(), host: engine.host.clone(), port: engine.port });
                }
                Link::Ready => {
                    let incarnation = self.peers.get(engine_id).map_or(0, |p| p.incarnation);
                    let lease_ids: Vec<LeaseId> = std::mem::take(&mut engine.to_release)
                        .into_iter()
                        .filter(|(_, (granted_by, _))| *granted_by == 0 || *granted_by == incarnation)
                        .map(|(id, _)| id)
                        .collect();
                    if !lease_ids.is_empty() {
                        out.push(Action::Send {
                            engine_id: engine_id.clone(),
                            bytes: Message::Release { lease_ids }.encode(),
                            kind: SendKind::Release,
                        });
                    }
                    if !engine.leases.is_empty() && now >= engine.next_probe {
                        engine.probe_seq += 1;
                        engine.next_probe = now + CLOCK_REFRESH;
                        out.push(Action::Send {
                            engine_id: engine_id.clone(),
                            bytes: Message::ClockPing { seq: engine.probe_seq, t0: now.0 }.encode(),
                            kind: SendKind::ClockProbe,
                        });
                    }
                    if !engine.leases.is_empty() && now >= engine.next_due {
                        let ids: Vec<LeaseId> = engine.leases.keys().copied().collect();
                        let lateness = now.since(engine.next_due);
                        engine.next_due = now + self.interval;
                        engine.renew_for_read.clear();
                        send_heartbeats(engine_id, engine, ids, now, self.max_notif_bytes, SendKind::Heartbeat { lateness }, out);
                    } else if !engine.renew_for_read.is_empty() {
                        let ids: Vec<LeaseId> = std::mem::take(&mut engine.renew_for_read).into_iter().collect();
                        send_heartbeats(engine_id, engine, ids, now, self.max_notif_bytes, SendKind::ReadRenewal, out);
                    }
                }
                _ => {}
            }
            let idle = engine.leases.is_empty() && engine.to_release.is_empty() && engine.link != Link::Pending;
            engine.idle_since = if idle { engine.idle_since.or(Some(now)) } else { None };
        }
        let forget_after = self.forget_after();
        let stale: Vec<String> = self
            .engines
            .iter()
            .filter(|(_, e)| e.idle_since.is_some_and(|t| now.since(t) >= forget_after))
            .map(|(id, _)| id.clone())
            .collect();
        for engine_id in stale {
            self.engines.remove(&engine_id);
            let agents = self.peers.forget(&engine_id);
            out.push(Action::Forget { engine_id, agents });
        }
    }

    /// When [`Renewer::poll`] next has something to do; `None` when nothing is scheduled.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        if !self.lost.is_empty() {
            return Some(Nanos::ZERO);
        }
        let forget_after = self.forget_after();
        self.engines
            .values()
            .filter_map(|e| match e.link {
                Link::Unknown if !e.leases.is_empty() || !e.to_release.is_empty() => Some(Nanos::ZERO),
                Link::Failed { retry_at, .. } if !e.leases.is_empty() || !e.to_release.is_empty() => Some(retry_at),
                Link::Ready if !e.to_release.is_empty() || !e.renew_for_read.is_empty() => Some(Nanos::ZERO),
                Link::Ready if !e.leases.is_empty() => Some(e.next_due.min(e.next_probe)),
                // An idle engine is forgotten after a while.
                _ => e.idle_since.map(|t| t + forget_after),
            })
            .min()
    }

    /// An engine nothing was tracked toward for this long is forgotten.
    fn forget_after(&self) -> Duration {
        (self.interval * 12).max(FORGET_AFTER_MIN)
    }

    /// Requests being renewed.
    pub fn tracked(&self) -> usize {
        self.requests.len()
    }

    /// Whether a request is tracked.
    pub fn is_tracked(&self, request_id: &str) -> bool {
        self.requests.contains_key(request_id)
    }

    /// Whether the handshake with `engine_id` has completed.
    pub fn is_ready(&self, engine_id: &str) -> bool {
        matches!(self.engines.get(engine_id).map(|e| e.link), Some(Link::Ready))
    }

    /// Stops tracking a lost lease and reports it. `release`: P may still hold it (a renewal
    /// capped by P9 is acknowledged as lost), so free it now; pointless when P said it is gone.
    fn lose(&mut self, engine_id: &str, lease_id: LeaseId, release: bool) {
        let Some(engine) = self.engines.get_mut(engine_id) else { return };
        let Some(t) = engine.leases.remove(&lease_id) else { return };
        engine.renew_for_read.remove(&lease_id);
        if release {
            engine.to_release.insert(lease_id, (t.incarnation, None));
        }
        self.requests.remove(&t.request_id);
        self.lost.push((t.request_id, lease_id));
    }
}

fn send_heartbeats(
    engine_id: &str,
    engine: &mut RemoteEngine,
    ids: Vec<LeaseId>,
    now: Nanos,
    max_bytes: usize,
    kind: SendKind,
    out: &mut Vec<Action>,
) {
    for range in heartbeat_chunks(&ids, max_bytes) {
        engine.seq += 1;
        let mut bytes = Vec::new();
        encode_heartbeat(engine.seq, &ids[range.clone()], &mut bytes);
        engine.inflight.push_back((engine.seq, now, ids[range].to_vec()));
        out.push(Action::Send { engine_id: engine_id.to_string(), bytes, kind });
    }
}
