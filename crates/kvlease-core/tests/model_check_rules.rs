//! Exhaustive model check (stateright) of the rules that live outside the lease protocol's
//! core machines but in kvlease-core all the same: the routing proxy's [`Route`] (SPEC O2–O4,
//! B1) and the vLLM connector's P side, [`IssuedLeases`] (P2, P3, P5, P6, S5). Unlike
//! `model_check.rs`, which checks an abstract model of the protocol, this drives the real code:
//! every interleaving of what its environment may do, within small bounds.
//!
//! Neither machine is `Clone`, so a state of the check is the history of what the environment
//! did, replayed into a fresh machine at every step (a history is at most ~16 steps), plus the
//! environment's own account (a reference, and what went wrong). States are told apart by the
//! machine's `Debug` text, with the entries of every `{…}` group sorted (a `HashMap` prints in
//! its seed's order; sorting distinct keys or field names is one-to-one, so equal text means
//! equal state) and counters dropped: two histories that leave the machine and its environment
//! in the same state are explored once.
//!
//! **Route** ([`RouteModel`]): one request through pools of one or two prefillers and none, one
//! or two decoders (or a decoder that is also the prefiller, `kv_both`), the first of each pool
//! healthy or not; a request without a conversation, a conversation with no cached turn, one
//! with a cached turn, and a batch with one. Each prefill leg is answered with a lease, with
//! params naming none, with an unreadable body, turned away, refused, or never reached; each
//! decode leg is taken, turned away, refused or never reached; a taken answer streams its first
//! byte or not, is cut, or ends (with a turn or not); the client may leave and the deadline may
//! pass at any point. Properties: O2 (no decode leg after the first byte reached the client; at
//! most one retry per leg, on another engine; an error after the first byte ends the stream),
//! O3/O4 (a lease P granted is taken by a decoder, or released by the router exactly once on
//! the engine that granted it, or handed to a decoder when the request was abandoned, D4: never
//! two of these, nothing left at the end), B1 (a taken turn goes back exactly when no prefill
//! may have read it), liveness (the route never waits with nothing out, and every route ends),
//! and the driver's contract (no event the route calls stray, no action after the end). ~3.3k
//! unique states over 64 starts.
//!
//! **IssuedLeases** ([`IssuedModel`]): P's scheduler issues two ids, the worker grants and
//! names them in order a step later, for L or for 1 s (vLLM's deadline after a slow step); two
//! D engines send up to three messages (renewal, `ReadDone`, `Release`, any engine, either id,
//! before or after the grant); the worker ends a lease by its read or because its request went
//! away (vLLM's `end`); time moves in steps of 1 s (L = 3 s, E = 2 s) and the reaper ticks. An
//! exact reference says what every answer must be. Properties: P5 (a `ReadDone` is confirmed
//! only for a granted lease live at the answer and not another engine's, or one ended by its
//! read while the asker's or nobody's), P6/S5 (another engine's or an ended lease's renewal or
//! release is answered lost and changes nothing), P3 (each lease ends once, under the reason
//! the reference gives), P2/D6 (a renewal acknowledged at t keeps the lease until t + E, also
//! one acknowledged before the grant), held messages (answered at the grant, on their
//! connection, or after E), and the table's agreement with the reference (deadlines, holders,
//! every answer). ~66k unique states. What the histories cannot tell apart is the lease
//! table's expiry wheel (its own tests check it): its `Debug` is left out of the state, the
//! deadline and holder of every lease are in.
//!
//! The whole file runs in ~15 s wall in debug on the shared 2-core dev machine
//! (`time cargo test -p kvlease-core --test model_check_rules`). Planted bugs prove each
//! property bites: the route's `RetryAfterFirstByte` (the simulator's switch), and, for the
//! connector, drivers that misuse the real table from the test (an early renewal acknowledged
//! and not passed on, as before 6ee67ac; a dropped request ended as read; one holder for every
//! engine).
//!
//! Abstractions: a prefill leg that fails before its answer, or that is dropped because the
//! request was abandoned, left no lease (P aborts a request whose connection closed, P1); an
//! unreadable prefill answer may name a lease the router cannot name, so P's expiry is its
//! bound (O4's one exception) and the check does not count it; a decode leg that fails before
//! its answer's head did not take the lease.

use kvlease_core::pull::PlantedBug;
use kvlease_core::route::{Action, Answer, Candidate, Event, Pool, Pools, PrefillAnswer, Route, TurnCache};
use kvlease_core::Nanos;
use serde_json::json;
use stateright::{Checker, Model, Property};
use std::hash::{Hash, Hasher};

/// Checks every state within a model's bounds (breadth first, one thread: the machine is
/// shared) and reports the counts.
fn check<M>(model: M) -> impl Checker<M>
where
    M: Model + Send + Sync + 'static,
    M::State: Hash + Send + Sync + Clone + std::fmt::Debug + PartialEq,
    M::Action: Clone + std::fmt::Debug + PartialEq,
{
    let started = std::time::Instant::now();
    let checker = model.checker().threads(1).spawn_bfs().join();
    eprintln!(
        "model check: {} states ({} unique), depth {}, in {:?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker
}

fn assert_found<M>(model: M, property: &'static str)
where
    M: Model + Send + Sync + 'static,
    M::State: Hash + Send + Sync + Clone + std::fmt::Debug + PartialEq,
    M::Action: Clone + std::fmt::Debug + PartialEq,
{
    let checker = check(model);
    let path = checker.discovery(property).unwrap_or_else(|| panic!("the checker missed it ({property})"));
    let last = path.last_state().clone();
    eprintln!("counterexample for {property:?}: {:?}\nending in {last:?}", path.into_actions());
}

// ---------------------------------------------------------------------------------------------
// The route (SPEC O2–O4, B1)
// ---------------------------------------------------------------------------------------------

/// Engines: prefillers 0 and 1, decoders 2 and 3; in the `kv_both` pool engine 0 decodes too.
type U = u8;
/// A leg's failure, as the driver reports it: the engine it failed on.
type R = Route<U, U>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Request {
    /// No conversation.
    Plain,
    /// A conversation with no cached turn: D's turn is kept at the end.
    Fresh,
    /// A conversation whose cached turn rides the prefill leg.
    Turn,
    /// A batch of prompts of a conversation with a cached turn: no single KV to hand over.
    Batch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Decoders {
    None,
    One,
    Two,
    /// Engine 0 prefills and decodes (`kv_both`), engine 3 decodes.
    Shared,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Start {
    request: Request,
    two_prefillers: bool,
    decoders: Decoders,
    /// The first engine of each pool fails its health probes.
    first_unhealthy: bool,
}

impl Start {
    fn prefillers(&self) -> Vec<Candidate<U>> {
        let names: &[U] = if self.two_prefillers { &[0, 1] } else { &[0] };
        self.candidates(names)
    }

    fn decoders(&self) -> Vec<Candidate<U>> {
        let names: &[U] = match self.decoders {
            Decoders::None => &[],
            Decoders::One => &[2],
            Decoders::Two => &[2, 3],
            Decoders::Shared => &[0, 3],
        };
        self.candidates(names)
    }

    fn candidates(&self, names: &[U]) -> Vec<Candidate<U>> {
        names
            .iter()
            .enumerate()
            .map(|(k, &u)| Candidate { upstream: u, healthy: !(k == 0 && self.first_unhealthy), outstanding: 0 })
            .collect()
    }
}

/// What the route's environment does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Happening {
    /// P answers the prefill leg out (or the leg fails).
    Prefill(PrefillOutcome),
    /// D answers the decode or batch leg out (or the leg fails before its head).
    Decode(DecodeOutcome),
    /// The first byte of D's answer reached the client.
    FirstByte,
    /// D's answer failed while it was relayed.
    Cut,
    /// D's answer ended, naming a turn D keeps or not.
    Done {
        turn: bool,
    },
    ClientGone,
    DeadlinePassed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum PrefillOutcome {
    /// 2xx with params naming a lease P holds.
    Lease,
    /// 2xx with params naming no lease.
    NoLease,
    /// 2xx, body not JSON.
    Unreadable,
    TurnedAway,
    Refused,
    /// Unreachable, or cut before the answer's head: P never got (all of) the request.
    Unreached,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum DecodeOutcome {
    /// 2xx: D admitted the request and took P's lease.
    Taken,
    TurnedAway,
    Refused,
    Unreached,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Out {
    Prefill {
        to: U,
        turn: bool,
    },
    Decode {
        to: U,
    },
    Local {
        to: U,
    },
    /// D's answer streams to the client.
    Stream,
}

const O2: &str = "O2: no decode leg after the first byte; one retry per leg, on another engine";
const O3_O4: &str = "O3/O4: a lease P granted is taken, released once on its engine, or handed on; never two";
const B1: &str = "B1: a taken turn goes back exactly when no prefill may have read it";
const STALL: &str = "liveness: the route never waits with nothing out";
const CONTRACT: &str = "driver contract: no stray event, no action after the end";
const FINISHES: &str = "liveness: every route finishes";

/// The environment's account of one route.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
struct Trace {
    out: Option<Out>,
    first_byte: bool,
    prefill_legs: u8,
    decode_legs: u8,
    local_legs: u8,
    /// The engine the last prefill leg went to, and the last decoder that failed or turned a
    /// leg away.
    last_prefiller: Option<U>,
    failed_decoder: Option<U>,
    /// P granted a lease the router can name, on this engine.
    lease_on: Option<U>,
    /// Decoders that took the lease (answered 2xx).
    taken: u8,
    releases: u8,
    /// The request was abandoned with a decode leg out: that decoder has the params and
    /// releases them when its connection closes (D4).
    handed_on: bool,
    turn_taken: bool,
    /// A prefill leg carrying the turn may have read it.
    turn_read: bool,
    turns_given_back: u8,
    /// D answered 2xx: the route is to relay its stream.
    head: bool,
    answered: bool,
    abandoned: bool,
    done: bool,
    violations: Vec<(&'static str, String)>,
}

impl Trace {
    fn violate(&mut self, property: &'static str, what: String) {
        self.violations.push((property, what));
    }

    /// What the route asked for.
    fn act(&mut self, s: &Start, a: Action<U, U>) {
        if self.done || self.answered && !matches!(a, Action::KeepTurn { .. }) {
            self.violate(CONTRACT, format!("{a:?} after the answer"));
        }
        match a {
            Action::SendPrefill { to, turn, retry } => {
                self.prefill_legs += 1;
                if self.prefill_legs > 2 || retry != (self.prefill_legs == 2) || (retry && Some(to) == self.last_prefiller) {
                    self.violate(O2, format!("prefill leg {} to {to} (retry {retry})", self.prefill_legs));
                }
                if turn.is_some() != (self.turn_taken && self.turns_given_back == 0) {
                    self.violate(B1, format!("prefill leg with turn {}", turn.is_some()));
                }
                self.expect_idle("SendPrefill");
                self.last_prefiller = Some(to);
                self.out = Some(Out::Prefill { to, turn: turn.is_some() });
            }
            Action::SendDecode { to, retry } => {
                self.decode_legs += 1;
                if self.first_byte {
                    self.violate(O2, format!("decode leg {} to {to} after the first byte", self.decode_legs));
                }
                if self.decode_legs > 2 || retry != (self.decode_legs == 2) || (retry && Some(to) == self.failed_decoder) {
                    self.violate(O2, format!("decode leg {} to {to} (retry {retry})", self.decode_legs));
                }
                self.expect_idle("SendDecode");
                self.out = Some(Out::Decode { to });
            }
            Action::SendLocal { to } => {
                self.local_legs += 1;
                if s.request != Request::Batch || self.local_legs > 1 {
                    self.violate(CONTRACT, format!("local leg {} to {to}", self.local_legs));
                }
                self.expect_idle("SendLocal");
                self.out = Some(Out::Local { to });
            }
            Action::Release { on } => {
                self.releases += 1;
                if self.lease_on != Some(on) || self.releases > 1 || self.taken > 0 {
                    self.violate(
                        O3_O4,
                        format!("release {} on {on}: lease on {:?}, taken by {}", self.releases, self.lease_on, self.taken),
                    );
                }
            }
            Action::RelayStream => {
                if !std::mem::take(&mut self.head) {
                    self.violate(CONTRACT, "relay a stream nobody answered".into());
                }
                self.out = Some(Out::Stream);
            }
            Action::RelayWhole { .. } => {
                self.answered = true;
                self.out = None;
            }
            Action::Fail { error, relayed } => {
                if relayed != self.first_byte {
                    self.violate(O2, format!("{error:?} relayed {relayed}, first byte {}", self.first_byte));
                }
                self.answered = true;
                self.out = None;
            }
            Action::GiveBack { .. } => {
                self.turns_given_back += 1;
                if !self.turn_taken || self.turn_read || self.turns_given_back > 1 {
                    self.violate(B1, format!("turn given back {} (read {})", self.turns_given_back, self.turn_read));
                }
            }
            Action::KeepTurn { .. } => {
                if !matches!(s.request, Request::Fresh | Request::Turn) {
                    self.violate(CONTRACT, "a turn kept".into());
                }
            }
        }
    }

    /// One leg at a time.
    fn expect_idle(&mut self, what: &str) {
        if self.out.is_some() {
            self.violate(CONTRACT, format!("{what} with {:?} out", self.out));
        }
    }
}

/// A route and its environment after `history`, replayed from the start.
fn replay(s: &Start, bug: Option<PlantedBug>, history: &[Happening]) -> (R, Trace) {
    let mut turns = TurnCache::default();
    let conversation = (s.request != Request::Plain).then(|| "c".to_string());
    if matches!(s.request, Request::Turn | Request::Batch) {
        turns.keep("c".into(), json!({"remote_blocks_ttl_remaining": 30.0}), Nanos(0));
    }
    let mut route: R = Route::new(conversation, s.request == Request::Batch, &mut turns, Nanos(0));
    route.planted = bug;
    let mut t = Trace { turn_taken: route.has_turn(), ..Trace::default() };
    drain(s, &mut route, &mut t);
    for &h in history {
        happen(&mut route, &mut t, h);
        drain(s, &mut route, &mut t);
    }
    (route, t)
}

fn drain(s: &Start, route: &mut R, t: &mut Trace) {
    let (p, d) = (s.prefillers(), s.decoders());
    let pools = Pools { prefill: Pool { candidates: &p, start: 0 }, decode: Pool { candidates: &d, start: 0 } };
    for _ in 0..16 {
        match route.poll(pools) {
            Some(a) => t.act(s, a),
            None => break,
        }
    }
    if route.poll(pools).is_some() {
        t.violate(STALL, "poll never stops".into());
    }
    if t.head {
        t.violate(CONTRACT, "D's answer not relayed".into());
    }
    let done = route.is_done();
    if t.done && !done {
        t.violate(CONTRACT, "done, then not".into());
    }
    t.done = done;
    if done {
        t.out = None;
        // A decoder that took the params (a second one may, after a cut before the first byte)
        // or has them reads or releases the lease; else the router has released it.
        if t.lease_on.is_some() && (t.taken > 0 || t.handed_on) == (t.releases > 0) {
            t.violate(O3_O4, format!("done: lease taken {}, released {}, handed on {}", t.taken, t.releases, t.handed_on));
        }
        if t.turn_taken && !t.turn_read && t.turns_given_back != 1 {
            t.violate(B1, "done with a turn no prefill read, not given back".into());
        }
        if !t.answered && !t.abandoned {
            t.violate(CONTRACT, "done without an answer".into());
        }
    } else if t.out.is_none() {
        t.violate(STALL, "waiting with nothing out".into());
    }
}

fn happen(route: &mut R, t: &mut Trace, h: Happening) {
    let event = match (h, t.out) {
        (Happening::Prefill(o), Some(Out::Prefill { to, turn })) => {
            t.out = None;
            // P read the turn if it answered with params (or may have, unreadably).
            t.turn_read |= turn && matches!(o, PrefillOutcome::Lease | PrefillOutcome::NoLease | PrefillOutcome::Unreadable);
            match o {
                PrefillOutcome::Lease => {
                    t.lease_on = Some(to);
                    Event::PrefillAnswered(PrefillAnswer::Params { lease: true })
                }
                PrefillOutcome::NoLease => Event::PrefillAnswered(PrefillAnswer::Params { lease: false }),
                PrefillOutcome::Unreadable => Event::PrefillAnswered(PrefillAnswer::Unreadable(to)),
                PrefillOutcome::TurnedAway => Event::PrefillAnswered(PrefillAnswer::Other(Answer::TurnedAwayUnread)),
                PrefillOutcome::Refused => Event::PrefillAnswered(PrefillAnswer::Other(Answer::Refused)),
                PrefillOutcome::Unreached => Event::PrefillFailed(to),
            }
        }
        (Happening::Decode(o), Some(Out::Decode { to } | Out::Local { to })) => {
            let local = matches!(t.out, Some(Out::Local { .. }));
            t.out = None;
            match o {
                DecodeOutcome::Taken => {
                    t.head = true;
                    t.taken += u8::from(!local && t.lease_on.is_some());
                    Event::DecodeAnswered(Answer::Success)
                }
                DecodeOutcome::TurnedAway => {
                    t.failed_decoder = Some(to);
                    Event::DecodeAnswered(Answer::TurnedAwayUnread)
                }
                DecodeOutcome::Refused => Event::DecodeAnswered(Answer::Refused),
                DecodeOutcome::Unreached => {
                    t.failed_decoder = Some(to);
                    Event::DecodeFailed(to)
                }
            }
        }
        (Happening::FirstByte, Some(Out::Stream)) => {
            t.first_byte = true;
            Event::FirstByteRelayed
        }
        (Happening::Cut, Some(Out::Stream)) => {
            t.out = None;
            t.failed_decoder = route.decoder().copied();
            Event::DecodeFailed(route.decoder().copied().unwrap_or(9))
        }
        (Happening::Done { turn }, Some(Out::Stream)) => {
            t.out = None;
            t.answered = true;
            Event::DecodeDone { turn: turn.then(|| json!({"remote_blocks_ttl_remaining": 30.0})) }
        }
        (Happening::ClientGone | Happening::DeadlinePassed, out) => {
            // Whatever is out is dropped with the request: a prefill leg's P aborts it (no
            // lease); a decode leg's D has the params and releases them itself (D4).
            t.handed_on |= matches!(out, Some(Out::Decode { .. })) && t.lease_on.is_some();
            t.turn_read |= matches!(out, Some(Out::Prefill { turn: true, .. }));
            t.out = None;
            t.abandoned = true;
            if h == Happening::ClientGone {
                Event::ClientGone
            } else {
                Event::DeadlinePassed
            }
        }
        (h, out) => {
            t.violate(CONTRACT, format!("{h:?} offered with {out:?} out"));
            return;
        }
    };
    if let Err(e) = route.handle(event) {
        t.violate(CONTRACT, e.to_string());
    }
}

#[derive(Clone, Debug)]
struct RouteState {
    start: Start,
    history: Vec<Happening>,
    trace: Trace,
    /// The route's own state, as its `Debug` says.
    route: String,
}

impl RouteState {
    fn key(&self) -> (&Start, &Trace, &str) {
        (&self.start, &self.trace, &self.route)
    }
}

impl Hash for RouteState {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.key().hash(h);
    }
}

impl PartialEq for RouteState {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

#[derive(Clone)]
struct RouteModel {
    bug: Option<PlantedBug>,
}

impl RouteModel {
    fn state(&self, start: Start, history: Vec<Happening>) -> RouteState {
        let (route, trace) = replay(&start, self.bug, &history);
        let route = format!("{route:?}");
        RouteState { start, history, trace, route }
    }
}

impl Model for RouteModel {
    type State = RouteState;
    type Action = Happening;

    fn init_states(&self) -> Vec<RouteState> {
        let mut out = Vec::new();
        for request in [Request::Plain, Request::Fresh, Request::Turn, Request::Batch] {
            for two_prefillers in [false, true] {
                for decoders in [Decoders::None, Decoders::One, Decoders::Two, Decoders::Shared] {
                    for first_unhealthy in [false, true] {
                        out.push(self.state(Start { request, two_prefillers, decoders, first_unhealthy }, Vec::new()));
                    }
                }
            }
        }
        out
    }

    fn actions(&self, s: &RouteState, out: &mut Vec<Happening>) {
        if s.trace.done || !s.trace.violations.is_empty() {
            return;
        }
        match s.trace.out {
            Some(Out::Prefill { .. }) => {
                use PrefillOutcome::*;
                out.extend([Lease, NoLease, Unreadable, TurnedAway, Refused, Unreached].map(Happening::Prefill));
            }
            Some(Out::Decode { .. }) => {
                use DecodeOutcome::*;
                out.extend([Taken, TurnedAway, Refused, Unreached].map(Happening::Decode));
            }
            Some(Out::Local { .. }) => out.extend([DecodeOutcome::Taken, DecodeOutcome::Unreached].map(Happening::Decode)),
            Some(Out::Stream) => {
                if !s.trace.first_byte {
                    out.push(Happening::FirstByte);
                }
                out.extend([Happening::Cut, Happening::Done { turn: false }, Happening::Done { turn: true }]);
            }
            None => {}
        }
        out.extend([Happening::ClientGone, Happening::DeadlinePassed]);
    }

    fn next_state(&self, s: &RouteState, h: Happening) -> Option<RouteState> {
        let mut history = s.history.clone();
        history.push(h);
        Some(self.state(s.start, history))
    }

    fn properties(&self) -> Vec<Property<Self>> {
        fn holds(s: &RouteState, p: &str) -> bool {
            s.trace.violations.iter().all(|(q, _)| *q != p)
        }
        vec![
            Property::always(O2, |_, s: &RouteState| holds(s, O2)),
            Property::always(O3_O4, |_, s: &RouteState| holds(s, O3_O4)),
            Property::always(B1, |_, s: &RouteState| holds(s, B1)),
            Property::always(STALL, |_, s: &RouteState| holds(s, STALL)),
            Property::always(CONTRACT, |_, s: &RouteState| holds(s, CONTRACT)),
            Property::eventually(FINISHES, |_, s: &RouteState| s.trace.done),
            // Not vacuous: each way through is reachable.
            Property::sometimes("a decode leg retried before the first byte", |_, s: &RouteState| s.trace.decode_legs == 2),
            Property::sometimes("a prefill leg retried", |_, s: &RouteState| s.trace.prefill_legs == 2),
            Property::sometimes("a stream cut after its first byte", |_, s: &RouteState| {
                s.trace.first_byte && s.trace.done && s.history.last() == Some(&Happening::Cut)
            }),
            Property::sometimes("a lease released by the router", |_, s: &RouteState| s.trace.releases == 1),
            Property::sometimes("a lease handed on at abandonment", |_, s: &RouteState| s.trace.handed_on),
            Property::sometimes("a turn given back", |_, s: &RouteState| s.trace.turns_given_back == 1),
        ]
    }
}

/// SPEC O2, O3, O4, B1 and the route's liveness, over every way one request can go.
#[test]
fn o2_o3_o4_b1_model_check_the_route() {
    check(RouteModel { bug: None }).assert_properties();
}

/// SPEC O2: with the simulator's planted bug (a decode leg retried after its first byte), the
/// checker finds the second decode leg.
#[test]
fn o2_planted_bug_retry_after_first_byte_is_found() {
    assert_found(RouteModel { bug: Some(PlantedBug::RetryAfterFirstByte) }, O2);
}
