//! Exhaustive model check (stateright) of the abstract lease protocol of SPEC §4-§5: every
//! interleaving of P, D and a network that loses, reorders and duplicates messages, with D
//! crashing or pausing and P restarting as a new incarnation, within small bounds.
//!
//! The model is the protocol, not the code: P grants a lease with a deadline (P1), heartbeats
//! extend it (P2), P expires leases on its own clock (P4), answers what it does not hold with
//! "lost" (P6) and confirms each read completion only while the lease is live (P5); D tracks a
//! lease once its params arrive (D1), heartbeats every lease of a P incarnation in one message
//! (D2), reads only under an acknowledged heartbeat and only from the incarnation that granted
//! the lease, and uses the bytes only when P's `ReadDoneAck` says live (D6), or releases the
//! lease on abort (D4). The read itself is one-sided (NIXL): it lands whenever the NIC gets to
//! it, possibly long after D checked the lease, and it returns the request's KV only if P still
//! holds the lease at that moment (a released block is assumed reused at once).
//!
//! Properties, named after their SPEC ids:
//! * `P5/D6` (safety): D never uses bytes that were read when the lease was not live.
//! * `P3` (safety): every lease is released at most once, under one reason.
//! * `P3-P4` (liveness): every request's lease is eventually granted and released.
//!
//! Bounds (two configurations, see [`Protocol`]): one lease under every fault (one loss, one
//! duplicate delivery, one D crash, one P restart, two handshakes, two heartbeats; ~364k unique
//! states), and two leases across a P restart that reuses a lease id (two handshakes, one
//! heartbeat, reordering only; ~350k). Time only moves while P holds a lease that has not yet
//! expired, and every fault and send is drawn from a finite budget, so the state graph is finite
//! and acyclic (stateright checks `eventually` only on acyclic paths). The whole file runs in
//! ~9 s wall (~13 s CPU) in debug on the shared 2-core dev machine
//! (`time cargo test -p kvlease-core --test model_check`). The planted-bug tests prove each
//! property bites: with a bug switched on, the checker must find a counterexample.
//!
//! Abstractions: one clock (D's checks use only differences of its own clock, and P's deadline
//! is measured from a receive time after D's send time); a handshake is atomic (a reply that
//! goes stale on the way is a P restarting right after answering); a crashed D does not come
//! back (a restarted D is a new D with no leases); a duplicate is a delivery that leaves a copy
//! in the network; pauses are the interleavings where D does nothing while time moves.

use stateright::{Checker, HasDiscoveries, Model, Property};

/// Initial lease L and heartbeat extension E, in model ticks (SPEC §2: E = 2L/3).
const L: u8 = 3;
const E: u8 = 2;

/// A bug planted on purpose (test-only switch), to show the checker finds what it claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bug {
    /// D uses the bytes as soon as its read lands, without waiting for P's `ReadDoneAck`.
    DUsesBytesWithoutAck,
    /// P answers a `ReadDone` with live=true for a lease it has already released.
    PAcksLiveAfterExpiry,
    /// A heartbeat naming a released lease brings it back to life (instead of P6's LeaseLost).
    PRevivesReleasedLease,
    /// P's reaper skips leases that were ever renewed (so a crashed D's lease is never freed).
    PNeverExpiresRenewedLease,
    /// D reads from whatever incarnation of P it last shook hands with, not checking that it is
    /// the one that granted the lease (the re-check before reading, D5/D6).
    DSkipsIncarnationCheck,
    /// P confirms a `ReadDone` without checking the prompt digest it carries (S4).
    PSkipsDigestCheck,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Reason {
    Transferred,
    Released,
    Expired,
    /// P's process ended (restart): its memory, blocks included, went with it.
    Crash,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Msg {
    /// D → P incarnation `to_inc`: renew `ids` (bit i = lease id i), sent at D's `sent_at`.
    Heartbeat { to_inc: u8, ids: u8, sent_at: u8 },
    /// P → D: heartbeat sent at `sent_at` applied to `ids`; `lost` were not live (P6).
    HeartbeatAck { from_inc: u8, ids: u8, lost: u8, sent_at: u8 },
    /// D → P: D will not read lease `id` (D4).
    Release { to_inc: u8, id: u8 },
    /// D → P: the read of lease `id` for request `req` (its prompt digest, S4) has landed.
    ReadDone { to_inc: u8, id: u8, req: u8 },
    /// P → D: whether lease `id` was live when its `ReadDone` arrived.
    ReadDoneAck { from_inc: u8, id: u8, live: bool },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum LeaseState {
    Live { deadline: u8, renewed: bool },
    Gone(Reason),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Lease {
    inc: u8,
    id: u8,
    req: u8,
    state: LeaseState,
}

/// D's view of one request (all requests are decoded on the one D).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum DReq {
    /// No params yet (the router has not brought the request to D).
    Waiting,
    /// Params arrived: tracked and heartbeated (D1); `acked_until` = latest acked send + E.
    Tracking { inc: u8, id: u8, acked_until: u8 },
    /// D checked the lease and issued the one-sided read (to P's incarnation `inc`); it has not
    /// landed yet.
    Reading { inc: u8, id: u8 },
    /// The read landed (`valid`: it returned this request's KV); waiting for `ReadDoneAck`.
    AwaitAck { inc: u8, id: u8, valid: bool },
    /// D used the bytes it read.
    Used { valid: bool },
    /// D recomputed locally (lease lost, read refused, or gave up waiting).
    Recomputed,
    /// The request was aborted on D before the transfer: D sent Release (D4).
    Aborted,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    now: u8,
    // P
    p_inc: u8,
    next_id: u8,
    granted: Vec<bool>,
    leases: Vec<Lease>,
    /// Every release P performed, in order: (incarnation, lease id, reason).
    releases: Vec<(u8, u8, Reason)>,
    // D
    d_crashed: bool,
    d_peer_inc: Option<u8>,
    d_reqs: Vec<DReq>,
    // The network: a multiset (sorted), so any message may be delivered next (reordering).
    net: Vec<Msg>,
    // Budgets that bound the state space.
    restarts_left: u8,
    d_crashes_left: u8,
    losses_left: u8,
    dups_left: u8,
    heartbeats_left: u8,
    hellos_left: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Tick,
    Grant(u8),
    Reap,
    RestartP,
    Route(u8),
    Handshake,
    SendHeartbeat,
    BeginRead(u8),
    ReadLands(u8),
    GiveUp(u8),
    Abort(u8),
    CrashD,
    Deliver(Msg),
    Lose(Msg),
    /// Deliver a copy and leave the message in the network, to be delivered again later.
    DeliverCopy(Msg),
}

#[derive(Clone)]
struct Protocol {
    requests: u8,
    restarts: u8,
    d_crashes: u8,
    losses: u8,
    dups: u8,
    heartbeats: u8,
    hellos: u8,
    bugs: Vec<Bug>,
}

impl Protocol {
    /// One lease under every fault: loss, duplication and reordering of any message, a D
    /// crash, D pauses (any interleaving), a P restart, a re-handshake.
    fn one_lease_all_faults() -> Protocol {
        Protocol { requests: 1, restarts: 1, d_crashes: 1, losses: 1, dups: 1, heartbeats: 2, hellos: 2, bugs: Vec::new() }
    }

    /// Two leases across a P restart: the new incarnation grants lease id 0 again, to another
    /// request, while D still holds params naming id 0 of the old one (reordering only).
    fn two_leases_across_a_restart() -> Protocol {
        Protocol { requests: 2, restarts: 1, d_crashes: 0, losses: 0, dups: 0, heartbeats: 1, hellos: 2, bugs: Vec::new() }
    }

    fn with_bugs(self, bugs: &[Bug]) -> Protocol {
        Protocol { bugs: bugs.to_vec(), ..self }
    }

    fn has(&self, bug: Bug) -> bool {
        self.bugs.contains(&bug)
    }
}

fn send(s: &mut State, m: Msg) {
    let at = s.net.binary_search(&m).unwrap_or_else(|e| e);
    s.net.insert(at, m);
}

fn take(s: &mut State, m: &Msg) -> bool {
    match s.net.binary_search(m) {
        Ok(i) => {
            s.net.remove(i);
            true
        }
        Err(_) => false,
    }
}

fn release(s: &mut State, i: usize, reason: Reason) {
    s.leases[i].state = LeaseState::Gone(reason);
    // Kept sorted: the order of releases is not what the properties are about, and a canonical
    // log merges states that differ only in it.
    let r = (s.leases[i].inc, s.leases[i].id, reason);
    let at = s.releases.binary_search(&r).unwrap_or_else(|e| e);
    s.releases.insert(at, r);
}

/// The index of P's lease `id` in its current incarnation.
fn current(s: &State, id: u8) -> Option<usize> {
    s.leases.iter().position(|l| l.inc == s.p_inc && l.id == id)
}

fn live(l: &Lease) -> bool {
    matches!(l.state, LeaseState::Live { .. })
}

impl Protocol {
    fn expirable(&self, l: &Lease, now: u8) -> bool {
        match l.state {
            LeaseState::Live { deadline, renewed } => deadline <= now && !(renewed && self.has(Bug::PNeverExpiresRenewedLease)),
            LeaseState::Gone(_) => false,
        }
    }

    /// P handles one message from D (SPEC §4).
    fn p_receive(&self, s: &mut State, m: Msg) {
        match m {
            // Sent to an agent of another incarnation: that agent is gone.
            Msg::Heartbeat { to_inc, .. } | Msg::Release { to_inc, .. } | Msg::ReadDone { to_inc, .. } if to_inc != s.p_inc => {}
            Msg::Heartbeat { ids, sent_at, .. } => {
                let mut lost = 0;
                for id in 0..8u8 {
                    if ids & (1 << id) == 0 {
                        continue;
                    }
                    match current(s, id) {
                        Some(i) if live(&s.leases[i]) => {
                            // P2: deadline = max(deadline, now + E); never shortens.
                            if let LeaseState::Live { deadline, .. } = s.leases[i].state {
                                // (Whether it was renewed matters only to the planted reaper bug;
                                // not tracking it otherwise keeps the state space small.)
                                let renewed = self.has(Bug::PNeverExpiresRenewedLease);
                                s.leases[i].state = LeaseState::Live { deadline: deadline.max(s.now + E), renewed };
                            }
                        }
                        Some(i) if self.has(Bug::PRevivesReleasedLease) => {
                            s.leases[i].state = LeaseState::Live { deadline: s.now + E, renewed: true };
                        }
                        _ => lost |= 1 << id,
                    }
                }
                send(s, Msg::HeartbeatAck { from_inc: s.p_inc, ids, lost, sent_at });
            }
            Msg::Release { id, .. } => {
                if let Some(i) = current(s, id).filter(|&i| live(&s.leases[i])) {
                    release(s, i, Reason::Released);
                }
            }
            Msg::ReadDone { id, req, .. } => {
                let ack = match current(s, id) {
                    // P5/P8 (n = 1): the read completed while the lease was live, for its own
                    // prompt (S4): the lease is transferred and the bytes are confirmed.
                    Some(i) if live(&s.leases[i]) && (s.leases[i].req == req || self.has(Bug::PSkipsDigestCheck)) => {
                        release(s, i, Reason::Transferred);
                        true
                    }
                    Some(i) => self.has(Bug::PAcksLiveAfterExpiry) && s.leases[i].req == req,
                    None => false,
                };
                send(s, Msg::ReadDoneAck { from_inc: s.p_inc, id, live: ack });
            }
            Msg::HeartbeatAck { .. } | Msg::ReadDoneAck { .. } => {
                unreachable!("a message for D delivered to P")
            }
        }
    }

    fn receive(&self, s: &mut State, m: Msg) {
        if for_p(&m) {
            self.p_receive(s, m);
        } else {
            self.d_receive(s, m);
        }
    }

    /// D handles one message from P (SPEC §5).
    fn d_receive(&self, s: &mut State, m: Msg) {
        if s.d_crashed {
            return;
        }
        match m {
            Msg::HeartbeatAck { from_inc, ids, lost, sent_at } => {
                for r in s.d_reqs.iter_mut() {
                    if let DReq::Tracking { inc, id, acked_until } = *r {
                        if inc != from_inc || ids & (1 << id) == 0 {
                            continue;
                        }
                        *r = if lost & (1 << id) != 0 {
                            DReq::Recomputed // D6: LeaseLost, never read
                        } else {
                            DReq::Tracking { inc, id, acked_until: acked_until.max(sent_at + E) }
                        };
                    }
                }
            }
            Msg::ReadDoneAck { from_inc, id, live } => {
                for r in s.d_reqs.iter_mut() {
                    if let DReq::AwaitAck { inc, id: rid, valid } = *r {
                        if inc == from_inc && rid == id {
                            *r = if live { DReq::Used { valid } } else { DReq::Recomputed };
                        }
                    }
                }
            }
            Msg::Heartbeat { .. } | Msg::Release { .. } | Msg::ReadDone { .. } => {
                unreachable!("a message for P delivered to D")
            }
        }
    }
}

fn for_p(m: &Msg) -> bool {
    matches!(m, Msg::Heartbeat { .. } | Msg::Release { .. } | Msg::ReadDone { .. })
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            now: 0,
            p_inc: 0,
            next_id: 0,
            granted: vec![false; self.requests as usize],
            leases: Vec::new(),
            releases: Vec::new(),
            d_crashed: false,
            d_peer_inc: None,
            d_reqs: vec![DReq::Waiting; self.requests as usize],
            net: Vec::new(),
            restarts_left: self.restarts,
            d_crashes_left: self.d_crashes,
            losses_left: self.losses,
            dups_left: self.dups,
            heartbeats_left: self.heartbeats,
            hellos_left: self.hellos,
        }]
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        // Time moves only while P holds a lease that has not expired yet (nothing else in the
        // model depends on time): this keeps the graph finite, and a path cannot end with a
        // live lease unless the reaper fails to release it.
        if s.leases.iter().any(|l| matches!(l.state, LeaseState::Live { deadline, .. } if deadline > s.now)) {
            out.push(Action::Tick);
        }
        if s.leases.iter().any(|l| self.expirable(l, s.now)) {
            out.push(Action::Reap);
        }
        for r in 0..self.requests {
            if !s.granted[r as usize] {
                out.push(Action::Grant(r));
            }
        }
        if s.restarts_left > 0 {
            out.push(Action::RestartP);
        }
        if !s.d_crashed {
            for (r, dr) in s.d_reqs.iter().enumerate() {
                let r = r as u8;
                match *dr {
                    DReq::Waiting if s.granted[r as usize] && s.leases.iter().any(|l| l.req == r) => out.push(Action::Route(r)),
                    DReq::Tracking { inc, acked_until, .. } => {
                        // D6: read only from the incarnation that granted the lease, and only
                        // under an acknowledged heartbeat that still covers the read.
                        let same = s.d_peer_inc == Some(inc) || (s.d_peer_inc.is_some() && self.has(Bug::DSkipsIncarnationCheck));
                        if same && acked_until > s.now {
                            out.push(Action::BeginRead(r));
                        }
                        out.push(Action::Abort(r));
                    }
                    DReq::Reading { .. } => out.push(Action::ReadLands(r)),
                    DReq::AwaitAck { .. } => out.push(Action::GiveUp(r)),
                    _ => {}
                }
            }
            if s.hellos_left > 0 {
                out.push(Action::Handshake);
            }
            if s.heartbeats_left > 0 && self.heartbeat(s).is_some() {
                out.push(Action::SendHeartbeat);
            }
            if s.d_crashes_left > 0 {
                out.push(Action::CrashD);
            }
        }
        let mut prev: Option<&Msg> = None;
        for m in &s.net {
            if prev == Some(m) {
                continue;
            }
            prev = Some(m);
            out.push(Action::Deliver(m.clone()));
            if s.losses_left > 0 {
                out.push(Action::Lose(m.clone()));
            }
            if s.dups_left > 0 {
                out.push(Action::DeliverCopy(m.clone()));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick => s.now += 1,
            Action::Reap => {
                // P4: every lease whose deadline has passed, whatever the order it was granted in.
                for i in 0..s.leases.len() {
                    if self.expirable(&s.leases[i], s.now) {
                        release(&mut s, i, Reason::Expired);
                    }
                }
            }
            Action::Grant(r) => {
                // P1: deadline = now + L; lease ids are never reused within an incarnation.
                s.granted[r as usize] = true;
                s.leases.push(Lease {
                    inc: s.p_inc,
                    id: s.next_id,
                    req: r,
                    state: LeaseState::Live { deadline: s.now + L, renewed: false },
                });
                s.next_id += 1;
            }
            Action::RestartP => {
                for i in 0..s.leases.len() {
                    if s.leases[i].inc == s.p_inc && live(&s.leases[i]) {
                        release(&mut s, i, Reason::Crash);
                    }
                }
                s.restarts_left -= 1;
                s.p_inc += 1;
                s.next_id = 0; // a new incarnation counts lease ids afresh
            }
            Action::Route(r) => {
                let l = s.leases.iter().find(|l| l.req == r)?;
                s.d_reqs[r as usize] = DReq::Tracking { inc: l.inc, id: l.id, acked_until: 0 };
            }
            Action::Handshake => {
                // D5: D learns P's current incarnation; a new one replaces the old, and nothing of
                // the old one is renewed or read. Atomic: a reply that goes stale on the way is
                // the same as a P that restarts just after answering; a lost one, no handshake.
                s.hellos_left -= 1;
                s.d_peer_inc = Some(s.p_inc);
            }
            Action::SendHeartbeat => {
                s.heartbeats_left -= 1;
                let hb = self.heartbeat(&s)?;
                send(&mut s, hb);
            }
            Action::BeginRead(r) => {
                let DReq::Tracking { inc, id, .. } = s.d_reqs[r as usize] else { return None };
                // The read goes to the agents of the incarnation D shook hands with last: the
                // one that granted the lease, unless the re-check is planted away.
                let to = if self.has(Bug::DSkipsIncarnationCheck) { s.d_peer_inc? } else { inc };
                s.d_reqs[r as usize] = DReq::Reading { inc: to, id };
            }
            Action::ReadLands(r) => {
                let DReq::Reading { inc, id } = s.d_reqs[r as usize] else { return None };
                // A one-sided read of lease `id` on the agents of P's incarnation `inc` (gone if P
                // restarted since): this request's KV only if that incarnation still holds lease
                // `id`, and holds it for this request.
                let valid = s.p_inc == inc && current(&s, id).is_some_and(|i| live(&s.leases[i]) && s.leases[i].req == r);
                send(&mut s, Msg::ReadDone { to_inc: inc, id, req: r });
                s.d_reqs[r as usize] =
                    if self.has(Bug::DUsesBytesWithoutAck) { DReq::Used { valid } } else { DReq::AwaitAck { inc, id, valid } };
            }
            Action::GiveUp(r) => s.d_reqs[r as usize] = DReq::Recomputed,
            Action::Abort(r) => {
                let DReq::Tracking { inc, id, .. } = s.d_reqs[r as usize] else { return None };
                send(&mut s, Msg::Release { to_inc: inc, id });
                s.d_reqs[r as usize] = DReq::Aborted;
            }
            Action::CrashD => {
                // D's memory is gone; messages on their way to it will find nobody.
                s.d_crashes_left -= 1;
                s.d_crashed = true;
                s.d_peer_inc = None;
                for r in s.d_reqs.iter_mut() {
                    if !matches!(r, DReq::Used { .. }) {
                        *r = DReq::Recomputed;
                    }
                }
                s.net.retain(for_p);
                s.hellos_left = 0;
                s.heartbeats_left = 0;
            }
            Action::Deliver(m) => {
                take(&mut s, &m).then_some(())?;
                self.receive(&mut s, m);
            }
            Action::DeliverCopy(m) => {
                s.dups_left -= 1;
                self.receive(&mut s, m);
            }
            Action::Lose(m) => {
                take(&mut s, &m).then_some(())?;
                s.losses_left -= 1;
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always("P5/D6: no used read of a lease that was not live", |_, s: &State| {
                s.d_reqs.iter().all(|r| !matches!(r, DReq::Used { valid: false }))
            }),
            Property::always("P3: each lease released at most once, under one reason", |_, s: &State| {
                s.releases.iter().enumerate().all(|(i, a)| s.releases[..i].iter().all(|b| (a.0, a.1) != (b.0, b.1)))
            }),
            Property::eventually("P3-P4: every lease is eventually released", |_, s: &State| {
                s.granted.iter().all(|&g| g) && s.leases.iter().all(|l| !live(l))
            }),
            // The model is not vacuous: each outcome is reachable.
            Property::sometimes("a read is used", |_, s: &State| s.d_reqs.iter().any(|r| matches!(r, DReq::Used { valid: true }))),
            Property::sometimes("a lease expires under a paused D's read", |_, s: &State| {
                s.d_reqs.iter().any(|r| matches!(r, DReq::Recomputed)) && s.releases.iter().any(|r| r.2 == Reason::Expired)
            }),
            Property::sometimes("a lease is released by D", |_, s: &State| s.releases.iter().any(|r| r.2 == Reason::Released)),
            Property::sometimes("P restarts under a tracked lease", |_, s: &State| {
                s.p_inc > 0 && s.d_reqs.iter().any(|r| matches!(r, DReq::Tracking { inc: 0, .. }))
            }),
        ];
        if self.requests > 1 {
            properties.push(Property::sometimes("a new incarnation reuses the id of a lease D tracks", |_, s: &State| {
                s.d_reqs.iter().any(|r| match *r {
                    DReq::Tracking { inc, id, .. } => {
                        s.leases.iter().any(|l| l.inc != inc && l.id == id && live(l)) && s.d_peer_inc == Some(s.p_inc)
                    }
                    _ => false,
                })
            }));
        }
        properties
    }
}

impl Protocol {
    /// D2: one heartbeat naming every lease D tracks in its peer's current incarnation.
    fn heartbeat(&self, s: &State) -> Option<Msg> {
        let to_inc = s.d_peer_inc?;
        let ids = s.d_reqs.iter().fold(0u8, |acc, r| match *r {
            DReq::Tracking { inc, id, .. } if inc == to_inc => acc | (1 << id),
            _ => acc,
        });
        (ids != 0).then_some(Msg::Heartbeat { to_inc, ids, sent_at: s.now })
    }
}

/// Checks every state within the model's bounds (breadth first, one thread: the machine is
/// shared), stopping at the first failure when a bug is planted.
fn check(model: Protocol) -> impl Checker<Protocol> {
    let planted = !model.bugs.is_empty();
    let builder = model.checker().threads(1);
    let builder = if planted { builder.finish_when(HasDiscoveries::AnyFailures) } else { builder };
    builder.spawn_bfs().join()
}

fn assert_holds(model: Protocol) {
    let started = std::time::Instant::now();
    let checker = check(model);
    eprintln!(
        "model check: {} states ({} unique), depth {}, in {:?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker.assert_properties();
}

/// SPEC P3, P4, P5, D6 over every interleaving of one lease under every fault.
#[test]
fn p3_p4_p5_d6_model_check_one_lease_all_faults() {
    assert_holds(Protocol::one_lease_all_faults());
}

/// SPEC P5, D6 (and D5's incarnation rule, P3): two leases across a P restart that reuses the
/// lease id of a lease D still tracks.
#[test]
fn p3_p5_d6_model_check_two_leases_across_a_restart() {
    assert_holds(Protocol::two_leases_across_a_restart());
}

fn assert_found(model: Protocol, bugs: &[Bug], property: &'static str) {
    let checker = check(model.with_bugs(bugs));
    let path = checker.discovery(property).unwrap_or_else(|| panic!("{bugs:?}: the checker missed it ({property})"));
    eprintln!("{bugs:?} → counterexample for {property:?}: {:?}", path.into_actions());
}

const NO_DEAD_READ_USED: &str = "P5/D6: no used read of a lease that was not live";

/// SPEC D6: the checker finds a D that uses a read without P's confirmation.
#[test]
fn d6_planted_bug_use_without_read_done_ack_is_found() {
    assert_found(Protocol::one_lease_all_faults(), &[Bug::DUsesBytesWithoutAck], NO_DEAD_READ_USED);
}

/// SPEC P5: the checker finds a P that confirms a read of an expired lease.
#[test]
fn p5_planted_bug_ack_live_after_expiry_is_found() {
    assert_found(Protocol::one_lease_all_faults(), &[Bug::PAcksLiveAfterExpiry], NO_DEAD_READ_USED);
}

/// SPEC P3/P6: the checker finds a P whose heartbeat revives a released lease (released twice).
#[test]
fn p3_planted_bug_heartbeat_revives_released_lease_is_found() {
    assert_found(Protocol::one_lease_all_faults(), &[Bug::PRevivesReleasedLease], "P3: each lease released at most once, under one reason");
}

/// SPEC P4: the checker finds a reaper that never frees a crashed D's renewed lease.
#[test]
fn p4_planted_bug_renewed_lease_never_expires_is_found() {
    assert_found(Protocol::one_lease_all_faults(), &[Bug::PNeverExpiresRenewedLease], "P3-P4: every lease is eventually released");
}

/// SPEC D5, D6, S4: after P restarts, its new incarnation grants lease id 0 again, to another
/// request. Two fences keep D from using that request's KV under its own old params: D's
/// incarnation re-check before reading, and P's digest check when the read is confirmed. With
/// both removed the checker finds the wrong KV used; with the incarnation check alone removed,
/// the digest check still holds (and the model itself holds with both, above).
#[test]
fn d5_d6_s4_planted_bugs_no_incarnation_check_and_no_digest_check_are_found() {
    assert_found(Protocol::two_leases_across_a_restart(), &[Bug::DSkipsIncarnationCheck, Bug::PSkipsDigestCheck], NO_DEAD_READ_USED);
}

/// SPEC S4: P's digest check alone fences a read through a reused lease id (see above).
#[test]
fn s4_digest_check_alone_fences_a_reused_lease_id() {
    let checker = check(Protocol::two_leases_across_a_restart().with_bugs(&[Bug::DSkipsIncarnationCheck]));
    checker.assert_no_discovery(NO_DEAD_READ_USED);
}
