//! Exhaustive model check (stateright) of the rules that live outside the lease protocol's
//! core machines but in kvlease-core all the same: the routing proxy's [`Route`] (SPEC O2–O4,
//! B1) and the vLLM connector's P side, [`IssuedLeases`] (P2, P3, P5, P6, S5). Unlike
//! `model_check.rs`, which checks an abstract model of the protocol, this drives the real code:
//! every interleaving of what its environment may do, within small bounds.
//!
//! Neither machine is `Clone`, so a state of the check is the history of what the environment
//! did, replayed into a fresh machine at every step (a history is at most ~11 steps), plus the
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
//! and the driver's contract (no event the route calls stray, no action after the end). In push
//! mode (SPEC §13; every start without a cached turn, again with push prefillers) the route
//! sends both legs at once: each is answered, fails or is dropped in any order, D's answer may
//! come before P's (held, relayed only after P answered), the decode leg may be retried while P
//! prefills and the dispatch on another prefiller; O3/O4 there: the lease P may grant under a
//! dispatch's key is taken by a decoder, released by the router once on that prefiller, turned
//! down by P, or handed to a decoder holding the leg at abandonment, before the next dispatch
//! and at the end (a driver that drops the route's releases is found). ~7.5k unique states
//! (~11k visited) over 96 starts.
//!
//! **IssuedLeases** ([`IssuedModel`]): P's scheduler has issued two ids (the table never hears
//! of an issue, so issuing first loses no interleaving); the worker grants and names them in
//! order, for L or for 1 s (vLLM's deadline after a slow step); two D engines send up to two
//! messages (renewal, `ReadDone`, `Release`, either engine, either id, before or after the
//! grant; d1 speaks only after d0, the engines being interchangeable); vLLM ends a live lease
//! by its read or because its request went away (`end(Transferred|Released)`); time moves in
//! steps of 1 s over 3 s (L = 3 s, E = 2 s) and the reaper ticks when a lease is due. An exact
//! reference says what every answer must be. Properties: P5 (a `ReadDone` is confirmed only
//! for a granted lease live at the answer and not another engine's, or one ended by its read
//! while the asker's or nobody's), P6/S5 (another engine's or an ended lease's renewal or
//! release is answered lost and changes nothing), P3 (each lease ends once, under the reason
//! it ended for), P2/D6 (a renewal acknowledged at t keeps the lease until t + E, also one
//! acknowledged before the grant), held messages (answered at the grant, on their connection,
//! or after E), and the table's agreement with the reference (deadlines, holders, every
//! answer). ~30k unique states (~107k visited). The state keeps `IssuedLeases`' own fields
//! whole and, of its lease table, each lease's name, deadline, holder and payload: the table's
//! slots and expiry wheel (checked by its own tests) are left out.
//!
//! The whole file takes ~20 s of CPU in debug, ~14 of them the connector's check; the tests
//! run two at a time, so ~15 s wall on an idle 2-core machine, 35-55 s on the shared dev
//! machine under load (`time cargo test -p kvlease-core --test model_check_rules`). Planted
//! bugs prove each property bites, each found in under ~5k states: the route's
//! `RetryAfterFirstByte` (the simulator's switch), and, for the connector, drivers that misuse
//! the real table from the test (an early renewal acknowledged and not passed on, as before
//! 6ee67ac; a dropped request ended as read; one holder for every engine).
//!
//! Abstractions: a prefill leg that fails before its answer, or that is dropped because the
//! request was abandoned, left no lease (P aborts a request whose connection closed, P1); an
//! unreadable prefill answer may name a lease the router cannot name, so P's expiry is its
//! bound (O4's one exception) and the check does not count it; a decode leg that fails before
//! its answer's head did not take the lease.

use kvlease_core::config::LeaseConfig;
use kvlease_core::issued::IssuedLeases;
use kvlease_core::lease_table::{Holder, ReleaseReason};
use kvlease_core::pull::PlantedBug;
use kvlease_core::route::{Action, Answer, Candidate, Event, Pool, Pools, PrefillAnswer, Route, TurnCache};
use kvlease_core::wire::Message;
use kvlease_core::{digest::PromptDigest, LeaseId, Nanos};
use serde_json::json;
use stateright::{Checker, HasDiscoveries, Model, Property};
use std::hash::{Hash, Hasher};
use std::time::Duration;

/// `Debug` text made canonical: the items of every `{…}` group (a struct's fields, a map's or a
/// set's entries) sorted, fields named in `drop` left out; `[…]` and `(…)` keep their order.
fn canonical(debug: &str, drop: &[&str]) -> String {
    let drop: Vec<String> = drop.iter().map(|d| format!("{d}:")).collect();
    let mut i = 0;
    items(debug.as_bytes(), &mut i, None, &drop).concat()
}

/// `debug` without the field `name` (with its value, a balanced group up to the next `,`).
fn without(debug: &str, name: &str) -> String {
    let Some(at) = debug.find(name) else { return debug.to_string() };
    let b = debug.as_bytes();
    let (mut i, mut depth) = (at, 0i32);
    while i < b.len() {
        match b[i] {
            b'{' | b'[' | b'(' => depth += 1,
            b'}' | b']' | b')' if depth == 0 => break,
            b'}' | b']' | b')' => depth -= 1,
            b',' if depth == 0 => {
                i += 1;
                break;
            }
            _ => {}
        }
        i += 1;
    }
    format!("{}{}", &debug[..at], &debug[i..])
}

/// The items up to `close` (consumed), split at top-level commas, each made canonical.
fn items(c: &[u8], i: &mut usize, close: Option<u8>, drop: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut from = *i;
    let flush = |cur: &mut String, from: usize, to: usize| cur.push_str(std::str::from_utf8(&c[from..to]).expect("utf-8 at a delimiter"));
    while *i < c.len() {
        let ch = c[*i];
        match ch {
            _ if Some(ch) == close => {
                flush(&mut cur, from, *i);
                *i += 1;
                from = *i;
                break;
            }
            b',' => {
                flush(&mut cur, from, *i);
                out.push(std::mem::take(&mut cur).trim().to_string());
                *i += 1;
                from = *i;
            }
            b'{' | b'[' | b'(' => {
                flush(&mut cur, from, *i);
                *i += 1;
                let end = match ch {
                    b'{' => b'}',
                    b'[' => b']',
                    _ => b')',
                };
                let mut inner = items(c, i, Some(end), drop);
                if ch == b'{' {
                    inner.retain(|it| !drop.iter().any(|d| it.starts_with(d.as_str())));
                    inner.sort_unstable();
                }
                cur.push(char::from(ch));
                cur.push_str(&inner.join(","));
                cur.push(char::from(end));
                from = *i;
            }
            b'"' => {
                *i += 1;
                while *i < c.len() && c[*i] != b'"' {
                    *i += if c[*i] == b'\\' { 2 } else { 1 };
                }
                *i += 1;
            }
            _ => *i += 1,
        }
    }
    if from < (*i).min(c.len()) {
        flush(&mut cur, from, (*i).min(c.len()));
    }
    let last = cur.trim().to_string();
    if !last.is_empty() || !out.is_empty() {
        out.push(last);
    }
    out
}

/// Checks every state within a model's bounds (breadth first, one thread: the machine is
/// shared) and reports the counts.
fn check<M>(model: M, until: Option<&'static str>) -> impl Checker<M>
where
    M: Model + Send + Sync + 'static,
    M::State: Hash + Send + Sync + Clone + std::fmt::Debug + PartialEq,
    M::Action: Clone + std::fmt::Debug + PartialEq,
{
    let started = std::time::Instant::now();
    let builder = model.checker().threads(1);
    let builder = match until {
        Some(property) => builder.finish_when(HasDiscoveries::AnyOf([property].into())),
        None => builder,
    };
    let checker = builder.spawn_bfs().join();
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
    let checker = check(model, Some(property));
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
    /// The prefillers are push engines (SPEC §13): both legs go at once.
    push: bool,
}

impl Start {
    fn prefillers(&self) -> Vec<Candidate<U>> {
        let names: &[U] = if self.two_prefillers { &[0, 1] } else { &[0] };
        self.candidates(names).into_iter().map(|c| Candidate { push: self.push, ..c }).collect()
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
            .map(|(k, &u)| Candidate { upstream: u, healthy: !(k == 0 && self.first_unhealthy), outstanding: 0, push: false })
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
    /// Push mode: both legs of one dispatch, each out until answered (or dropped).
    Both {
        p: Option<U>,
        d: Option<U>,
    },
}

const O2: &str = "O2: no decode leg after the first byte; one retry per leg, on another engine";
const O3_O4: &str = "O3/O4: a lease P granted is taken, released once on its engine, or handed on; never two";
const PUSH_O3_O4: &str = "O3/O4 in push mode: a dispatch's lease is taken, released once on its engine, or handed on";
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
    /// Push mode: the prefiller of the dispatch whose lease (under its key) may be granted and
    /// is not yet taken by a decoder, released by the router, turned down by P or handed on.
    push_open: Option<U>,
    /// Releases for the current dispatch.
    push_releases: u8,
    /// D answered 2xx before P did: the route holds the answer until P answers.
    held: bool,
    /// Test-side: the driver does not carry out `Release` (the check must find it).
    drop_releases: bool,
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
                match self.out {
                    // Push mode: the decode leg again, on another decoder, while P may prefill.
                    Some(Out::Both { p, d: None }) => self.out = Some(Out::Both { p, d: Some(to) }),
                    _ => {
                        self.expect_idle("SendDecode");
                        self.out = Some(Out::Decode { to });
                    }
                }
            }
            Action::SendBoth { prefill, decode, retry } => {
                if !s.push {
                    self.violate(CONTRACT, format!("both legs to {prefill} and {decode} with no push prefiller"));
                }
                self.prefill_legs += 1;
                if self.prefill_legs > 2 || retry != (self.prefill_legs == 2) || (retry && Some(prefill) == self.last_prefiller) {
                    self.violate(O2, format!("prefill leg {} to {prefill} (retry {retry})", self.prefill_legs));
                }
                if self.turn_taken || prefill == decode {
                    self.violate(CONTRACT, format!("both legs with a turn ({}) or to one engine {prefill}", self.turn_taken));
                }
                if let Some(open) = self.push_open {
                    self.violate(PUSH_O3_O4, format!("a new dispatch while {open}'s lease is neither taken nor released"));
                }
                self.expect_idle("SendBoth");
                // Each dispatch is a new transfer: its decode leg may be retried once.
                self.decode_legs = 1;
                self.failed_decoder = None;
                self.last_prefiller = Some(prefill);
                self.push_open = Some(prefill);
                self.push_releases = 0;
                self.out = Some(Out::Both { p: Some(prefill), d: Some(decode) });
            }
            Action::CancelDecode => match self.out {
                Some(Out::Both { p, d: Some(_) }) => self.out = Some(Out::Both { p, d: None }),
                // D answered first and its answer is held: dropped, never relayed.
                Some(Out::Both { p, d: None }) if std::mem::take(&mut self.held) => self.out = Some(Out::Both { p, d: None }),
                out => self.violate(CONTRACT, format!("cancel a decode leg with {out:?} out")),
            },
            Action::SendLocal { to } => {
                self.local_legs += 1;
                if s.request != Request::Batch || self.local_legs > 1 {
                    self.violate(CONTRACT, format!("local leg {} to {to}", self.local_legs));
                }
                self.expect_idle("SendLocal");
                self.out = Some(Out::Local { to });
            }
            Action::Release { .. } if self.drop_releases => {}
            Action::Release { on } if s.push && self.lease_on.is_none() => {
                // Push mode: P leases under the dispatch's key; a release of one a decoder took
                // is refused by P (S5), so it may come after D's answer, but once, on P.
                self.push_releases += 1;
                if self.last_prefiller != Some(on) || self.push_releases > 1 {
                    self.violate(PUSH_O3_O4, format!("release {} on {on}, dispatched to {:?}", self.push_releases, self.last_prefiller));
                }
                self.push_open = None;
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
                let held = std::mem::take(&mut self.held);
                if !std::mem::take(&mut self.head) && !held {
                    self.violate(CONTRACT, "relay a stream nobody answered".into());
                }
                if matches!(self.out, Some(Out::Both { p: Some(_), .. })) {
                    self.violate(CONTRACT, "relay D's answer before P answered".into());
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

    /// One leg at a time (push mode: one dispatch at a time).
    fn expect_idle(&mut self, what: &str) {
        if !matches!(self.out, None | Some(Out::Both { p: None, d: None })) {
            self.violate(CONTRACT, format!("{what} with {:?} out", self.out));
        }
    }
}

/// A route and its environment after `history`, replayed from the start.
fn replay(s: &Start, bug: Option<PlantedBug>, drop_releases: bool, history: &[Happening]) -> (R, Trace) {
    let mut turns = TurnCache::default();
    let conversation = (s.request != Request::Plain).then(|| "c".to_string());
    if matches!(s.request, Request::Turn | Request::Batch) {
        turns.keep("c".into(), json!({"remote_blocks_ttl_remaining": 30.0}), Nanos(0));
    }
    let mut route: R = Route::new(conversation, s.request == Request::Batch, &mut turns, Nanos(0));
    route.planted = bug;
    let mut t = Trace { turn_taken: route.has_turn(), drop_releases, ..Trace::default() };
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
    if t.out == Some(Out::Both { p: None, d: None }) {
        t.out = None;
    }
    if t.head || t.held && matches!(t.out, Some(Out::Both { p: None, .. })) {
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
        if let Some(open) = t.push_open {
            t.violate(PUSH_O3_O4, format!("done: the lease {open} may hold under the key is neither taken, released nor handed on"));
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
        (Happening::Prefill(o), Some(Out::Both { p: Some(to), d })) => {
            t.out = Some(Out::Both { p: None, d });
            match o {
                PrefillOutcome::Lease | PrefillOutcome::NoLease => Event::PrefillAnswered(PrefillAnswer::Params { lease: true }),
                PrefillOutcome::Unreadable => Event::PrefillAnswered(PrefillAnswer::Unreadable(to)),
                // P answered without prefilling: it leased nothing under the key.
                PrefillOutcome::TurnedAway | PrefillOutcome::Refused => {
                    t.push_open = None;
                    let answer = if o == PrefillOutcome::Refused { Answer::Refused } else { Answer::TurnedAwayUnread };
                    Event::PrefillAnswered(PrefillAnswer::Other(answer))
                }
                // It may have leased before the leg broke.
                PrefillOutcome::Unreached => Event::PrefillFailed(to),
            }
        }
        (Happening::Decode(o), Some(Out::Both { p, d: Some(to) })) => {
            t.out = Some(Out::Both { p, d: None });
            match o {
                // D answers only once every write landed, or after it gave the transfer up
                // (it releases what it registered, U9): either way the lease is D's now.
                DecodeOutcome::Taken => {
                    t.push_open = None;
                    if p.is_some() {
                        t.held = true;
                    } else {
                        t.head = true;
                    }
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
            // lease); a decode leg's D has the params and releases them itself (D4, U9).
            t.handed_on |= matches!(out, Some(Out::Decode { .. })) && t.lease_on.is_some();
            if matches!(out, Some(Out::Both { d: Some(_), .. })) {
                t.push_open = None;
            }
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
    /// Only push-mode starts.
    push_only: bool,
    /// The driver does not carry out the route's `Release` (test-side).
    drop_releases: bool,
}

impl RouteModel {
    fn new(bug: Option<PlantedBug>) -> RouteModel {
        RouteModel { bug, push_only: false, drop_releases: false }
    }

    fn state(&self, start: Start, history: Vec<Happening>) -> RouteState {
        let (route, trace) = replay(&start, self.bug, self.drop_releases, &history);
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
                        // Push mode: requests without a cached turn go both legs at once.
                        for push in [false, true] {
                            if push && matches!(request, Request::Turn | Request::Batch) || self.push_only && !push {
                                continue;
                            }
                            out.push(self.state(Start { request, two_prefillers, decoders, first_unhealthy, push }, Vec::new()));
                        }
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
            Some(Out::Both { p, d }) => {
                if p.is_some() {
                    use PrefillOutcome::*;
                    out.extend([Lease, Unreadable, TurnedAway, Refused, Unreached].map(Happening::Prefill));
                }
                if d.is_some() {
                    use DecodeOutcome::*;
                    out.extend([Taken, TurnedAway, Refused, Unreached].map(Happening::Decode));
                }
            }
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
            Property::always(PUSH_O3_O4, |_, s: &RouteState| holds(s, PUSH_O3_O4)),
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
            Property::sometimes("push: D answered before P, relayed after", |_, s: &RouteState| {
                s.start.push
                    && s.trace.answered
                    && s.history.iter().position(|h| matches!(h, Happening::Decode(DecodeOutcome::Taken)))
                        < s.history.iter().position(|h| matches!(h, Happening::Prefill(PrefillOutcome::Lease)))
            }),
            Property::sometimes("push: a decode leg retried while P prefills", |_, s: &RouteState| {
                s.start.push && matches!(s.trace.out, Some(Out::Both { p: Some(_), d: Some(_) })) && s.trace.decode_legs == 2
            }),
            Property::sometimes("push: a dispatch retried on another prefiller", |_, s: &RouteState| {
                s.start.push && s.trace.prefill_legs == 2 && matches!(s.trace.out, Some(Out::Both { .. }))
            }),
            Property::sometimes("push: a lease released by the router", |_, s: &RouteState| s.start.push && s.trace.push_releases == 1),
        ]
    }
}

/// SPEC O2, O3, O4, B1 and the route's liveness, over every way one request can go.
#[test]
fn o2_o3_o4_b1_model_check_the_route() {
    check(RouteModel::new(None), None).assert_properties();
}

/// SPEC O2: with the simulator's planted bug (a decode leg retried after its first byte), the
/// checker finds the second decode leg.
#[test]
fn o2_planted_bug_retry_after_first_byte_is_found() {
    assert_found(RouteModel::new(Some(PlantedBug::RetryAfterFirstByte)), O2);
}

/// SPEC O3/O4 in push mode (U9): a driver that does not carry out the route's releases leaves a
/// lease P may have granted under the dispatch's key with nobody to take it: found.
#[test]
fn o4_push_a_driver_that_drops_releases_is_found() {
    assert_found(RouteModel { bug: None, push_only: true, drop_releases: true }, PUSH_O3_O4);
}

// ---------------------------------------------------------------------------------------------
// The vLLM connector's P side: leases under ids P's scheduler issues (SPEC P2, P3, P5, P6, S5)
// ---------------------------------------------------------------------------------------------

const SERIES: u64 = 7 << 32;
const SEC: u64 = 1_000_000_000;
/// L and E in seconds (SPEC §2: E = 2L/3); time moves a second at a time.
const L: u64 = 3;
const E: u64 = 2;
/// A grant after a slow engine step: vLLM's deadline leaves the lease this long.
const SHORT: u64 = 1;
const IDS: usize = 2;
const SENDS: u8 = 2;
const START: u64 = 1;
const NOW_MAX: u64 = START + 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Renew,
    ReadDone,
    Release,
}

/// What P's scheduler, its worker, the D engines and time do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Step {
    /// The worker grants the next issued id's lease and names it, for L or for [`SHORT`].
    Grant {
        short: bool,
    },
    /// D engine `d` sends a message about the `i`-th issued id (on its own connection).
    Send {
        d: u8,
        kind: Kind,
        i: u8,
    },
    /// vLLM ends the `i`-th lease: its read completed (`read`), or its request went away.
    End {
        i: u8,
        read: bool,
    },
    Advance,
    Tick,
}

/// A connector that misuses the real table (test-side: the table is not changed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DriverBug {
    /// A renewal of a lease not granted yet is acknowledged (not lost) by the connector and not
    /// passed to the table: kvlease before 6ee67ac.
    AckEarlyRenewalUnapplied,
    /// A lease whose request went away is ended as read (`Transferred`).
    DropEndedAsRead,
    /// Every D engine gets the same holder (engines told apart by nothing).
    OneHolder,
}

/// The reference's lease, by issued id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Lease {
    /// Issued by the scheduler, not granted yet.
    Issued,
    /// Granted, not ended (past its deadline, it awaits the reaper); held by the first engine
    /// that renewed or released it.
    Live { deadline: u64, holder: Option<u8> },
    /// Ended, for this reason, while held by `holder`.
    Ended { reason: ReleaseReason, holder: Option<u8> },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Held {
    d: u8,
    kind: Kind,
    i: u8,
    at: u64,
}

impl Held {
    /// The connection tag the message came with: one per engine, message kind and id, so an
    /// answer names the message it answers.
    fn tag(&self) -> u64 {
        tag(self.d, self.kind, self.i)
    }
}

fn tag(d: u8, kind: Kind, i: u8) -> u64 {
    u64::from(d) * 100 + kind as u64 * 10 + u64::from(i)
}

fn issued_id(i: usize) -> u64 {
    SERIES + 1 + i as u64
}

const P5: &str = "P5: a ReadDone confirmed only for a live lease not another's, or one ended by its read";
const P6_S5: &str = "P6/S5: another engine's or an ended lease's renewal or release is answered lost, changes nothing";
const P3: &str = "P3: each lease ends once, under the reason it ended for";
const P2_D6: &str = "P2/D6: a renewal acknowledged at t keeps its lease until t + E";
const HELD: &str = "held messages are answered at the grant, on their connection, or after E";
const AGREES: &str = "the table agrees with the reference";

/// What happened so far, as the reference tells it (the environment's side of a state).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Reference {
    now: u64,
    leases: Vec<Lease>,
    granted: usize,
    /// The first engine that renewed each id before its grant.
    early: [Option<u8>; IDS],
    /// Until when an acknowledged renewal promised each lease (D reads on it, D6).
    promised: [u64; IDS],
    held: Vec<Held>,
    ended_by_vllm: [bool; IDS],
    sends_left: u8,
    /// Engine d0 has sent a message: d1 sends only then (the engines are interchangeable, so
    /// the histories where d1 speaks first are these with the names swapped).
    d0_spoke: bool,
    /// Ways through seen, for the non-vacuity checks (bits of [`Seen`]).
    seen: u8,
    /// The properties broken, and the first account of each.
    violations: Vec<(&'static str, String)>,
}

#[derive(Clone, Copy)]
enum Seen {
    HeldReadConfirmedAtGrant = 1,
    EarlyRenewalApplied = 2,
    ReadConfirmedAfterItsEnd = 4,
    ForeignReleaseRefused = 8,
    HeldAnsweredByAge = 16,
}

/// What an answer must be.
#[derive(Debug, PartialEq)]
enum Expected {
    Held,
    Lost(bool),
    Live(bool),
}

struct World {
    t: IssuedLeases<u64>,
    holders: [Holder; 2],
    ids: [Option<LeaseId>; IDS],
    r: Reference,
    bug: Option<DriverBug>,
}

impl World {
    fn new(bug: Option<DriverBug>) -> World {
        let cfg = LeaseConfig::with_lease_secs(L as f64).expect("valid");
        assert_eq!(cfg.extension, Duration::from_secs(E));
        let mut t = IssuedLeases::new(&cfg, 0);
        let holders = if bug == Some(DriverBug::OneHolder) { [t.holder("d"), t.holder("d")] } else { [t.holder("d0"), t.holder("d1")] };
        let r = Reference {
            now: START,
            // P's scheduler issued both ids: the table never hears of an issue, and D can name
            // an id only once it is issued, so issuing first loses no interleaving.
            leases: vec![Lease::Issued; IDS],
            granted: 0,
            early: [None; IDS],
            promised: [0; IDS],
            held: Vec::new(),
            ended_by_vllm: [false; IDS],
            sends_left: SENDS,
            d0_spoke: false,
            seen: 0,
            violations: Vec::new(),
        };
        World { t, holders, ids: [None; IDS], r, bug }
    }

    fn violate(&mut self, property: &'static str, what: String) {
        if self.r.violations.iter().all(|(p, _)| *p != property) {
            self.r.violations.push((property, what));
            self.r.violations.sort();
        }
    }

    fn see(&mut self, s: Seen) {
        self.r.seen |= s as u8;
    }

    fn end(&mut self, i: usize, reason: ReleaseReason, holder: Option<u8>, ends: &mut Vec<(u64, ReleaseReason)>) {
        self.r.leases[i] = Lease::Ended { reason, holder };
        ends.push((i as u64, reason));
    }

    /// What the answer to D engine `d`'s message must be, and what it does to the reference.
    fn expect(&mut self, d: u8, kind: Kind, i: usize, hold: bool, ends: &mut Vec<(u64, ReleaseReason)>) -> Expected {
        let now = self.r.now;
        if i >= self.r.granted {
            // On its way: a renewal is kept for the grant (the first engine's); a ReadDone or a
            // Release is held for it, or, once aged, answered as not live.
            return match kind {
                Kind::Renew => {
                    let first = *self.r.early[i].get_or_insert(d);
                    if first == d {
                        self.r.promised[i] = self.r.promised[i].max(now + E);
                    }
                    Expected::Lost(first != d)
                }
                _ if hold => {
                    self.r.held.push(Held { d, kind, i: i as u8, at: now });
                    Expected::Held
                }
                Kind::ReadDone => Expected::Live(false),
                Kind::Release => Expected::Lost(true),
            };
        }
        let lease = self.r.leases[i];
        let mine = |h: Option<u8>| h.is_none_or(|h| h == d);
        match (kind, lease) {
            (Kind::Renew | Kind::Release, Lease::Live { holder, .. }) if !mine(holder) => {
                if kind == Kind::Release {
                    self.see(Seen::ForeignReleaseRefused);
                }
                Expected::Lost(true)
            }
            (_, Lease::Live { deadline, .. }) if deadline <= now => {
                self.end(i, ReleaseReason::Expired, Some(d), ends);
                if kind == Kind::ReadDone {
                    Expected::Live(false)
                } else {
                    Expected::Lost(true)
                }
            }
            (Kind::Renew, Lease::Live { deadline, .. }) => {
                self.r.leases[i] = Lease::Live { deadline: deadline.max(now + E), holder: Some(d) };
                self.r.promised[i] = self.r.promised[i].max(now + E);
                Expected::Lost(false)
            }
            (Kind::Release, Lease::Live { .. }) => {
                self.end(i, ReleaseReason::Released, Some(d), ends);
                Expected::Lost(false)
            }
            // A question: it claims nothing (SPEC S5 is about what changes a lease).
            (Kind::ReadDone, Lease::Live { holder, .. }) => Expected::Live(mine(holder)),
            (Kind::ReadDone, Lease::Ended { reason: ReleaseReason::Transferred, holder }) => {
                if mine(holder) {
                    self.see(Seen::ReadConfirmedAfterItsEnd);
                }
                Expected::Live(mine(holder))
            }
            (Kind::ReadDone, _) => Expected::Live(false),
            (_, _) => Expected::Lost(true),
        }
    }

    /// Compares an answer to D engine `d`'s message about the `i`-th id with what it must be.
    fn judge(&mut self, d: u8, kind: Kind, i: usize, expected: Expected, reply: Option<Message>) {
        let w = issued_id(i);
        let got = match (kind, reply) {
            (_, None) if expected == Expected::Held => Expected::Held,
            (Kind::Renew, Some(Message::HeartbeatAck { lost_ids, .. })) => Expected::Lost(lost_ids.contains(&w)),
            (Kind::Release, None) => Expected::Lost(false),
            (Kind::Release, Some(Message::LeaseLost { lease_ids })) => Expected::Lost(lease_ids.contains(&w)),
            (Kind::ReadDone, Some(Message::ReadDoneAck { lease_id, live })) if lease_id == w => Expected::Live(live),
            (_, reply) => {
                self.violate(AGREES, format!("d{d}'s {kind:?} of #{i} answered {reply:?}"));
                return;
            }
        };
        if got == expected {
            return;
        }
        let what = format!("d{d}'s {kind:?} of #{i} at {}: {got:?}, must be {expected:?} ({:?})", self.r.now, self.r.leases[i]);
        match (&got, &expected) {
            (Expected::Live(true), Expected::Live(false)) => self.violate(P5, what),
            (Expected::Lost(false), Expected::Lost(true)) => self.violate(P6_S5, what),
            _ => self.violate(AGREES, what),
        }
    }

    fn step(&mut self, step: Step) {
        let mut rel = Vec::new();
        // Ends the table must report in this step: (issued index, reason).
        let mut ends = Vec::new();
        let now = Nanos(self.r.now * SEC);
        match step {
            Step::Grant { short } => {
                let i = self.r.granted;
                let life = if short { SHORT } else { L };
                let id = self.t.grant(now, Duration::from_secs(life), 1, i as u64);
                if !self.t.name(id, issued_id(i), now, &mut rel) {
                    self.violate(AGREES, format!("#{i} not named"));
                }
                self.ids[i] = Some(id);
                self.r.granted += 1;
                // A renewal that came before is applied at the grant (SPEC P2, S5).
                self.r.leases[i] = match self.r.early[i].take() {
                    Some(d) => {
                        self.see(Seen::EarlyRenewalApplied);
                        Lease::Live { deadline: self.r.now + life.max(E), holder: Some(d) }
                    }
                    None => Lease::Live { deadline: self.r.now + life, holder: None },
                };
            }
            Step::Send { d, kind, i } => {
                self.r.sends_left -= 1;
                self.r.d0_spoke |= d == 0;
                let i = usize::from(i);
                let w = issued_id(i);
                let expected = self.expect(d, kind, i, true, &mut ends);
                let reply = match (kind, self.bug) {
                    (Kind::Renew, Some(DriverBug::AckEarlyRenewalUnapplied)) if self.t.lease_of(w).is_none() && self.t.pending(w) => {
                        Some(Message::HeartbeatAck { seq: 1, lost_ids: Vec::new() })
                    }
                    _ => {
                        let msg = match kind {
                            Kind::Renew => Message::Heartbeat { seq: 1, lease_ids: vec![w] },
                            Kind::ReadDone => Message::ReadDone { lease_id: w, consumer_rank: 0, n: 1, digest: PromptDigest([0; 16]) },
                            Kind::Release => Message::Release { lease_ids: vec![w] },
                        };
                        let holder = self.holders[usize::from(d)];
                        self.t.on_message_from(holder, tag(d, kind, i as u8), &msg, now, true, &mut rel).reply
                    }
                };
                self.judge(d, kind, i, expected, reply);
            }
            Step::End { i, read } => {
                let i = usize::from(i);
                self.r.ended_by_vllm[i] = true;
                let truth = if read { ReleaseReason::Transferred } else { ReleaseReason::Released };
                let told = if self.bug == Some(DriverBug::DropEndedAsRead) { ReleaseReason::Transferred } else { truth };
                let id = self.ids[i].expect("granted");
                let live = self.t.end(id, told, now, &mut rel);
                if let Lease::Live { holder, .. } = self.r.leases[i] {
                    // The table ends it under the reason it is told; what happened is `truth`.
                    self.end(i, truth, holder, &mut Vec::new());
                    ends.push((i as u64, told));
                }
                if live != ends.iter().any(|e| e.0 == i as u64) {
                    self.violate(P3, format!("vLLM's end of #{i} at {}: {live}", self.r.now));
                }
            }
            Step::Advance => self.r.now += 1,
            Step::Tick => {
                self.t.tick(now, &mut rel);
                for i in 0..self.r.leases.len() {
                    if matches!(self.r.leases[i], Lease::Live { deadline, .. } if deadline <= self.r.now) {
                        self.end(i, ReleaseReason::Expired, None, &mut ends);
                    }
                }
            }
        }
        self.answer_held(&mut rel, &mut ends);
        self.check_ends(&rel, ends);
        self.check_table();
    }

    /// The connector asks for the held messages due after every step; each answer is judged
    /// like any other.
    fn answer_held(&mut self, rel: &mut Vec<kvlease_core::lease_table::Released<u64>>, ends: &mut Vec<(u64, ReleaseReason)>) {
        let now = self.r.now;
        for due in self.t.answer_due(Nanos(now * SEC), Duration::from_secs(E), rel) {
            let Some(k) = self.r.held.iter().position(|h| h.tag() == due.tag) else {
                self.violate(HELD, format!("an answer for tag {} nobody waits for", due.tag));
                continue;
            };
            let h = self.r.held.remove(k);
            let i = usize::from(h.i);
            if due.holder != self.holders[usize::from(h.d)] {
                self.violate(HELD, format!("{h:?} answered to {:?}", due.holder));
            }
            let granted = i < self.r.granted;
            if !granted && now < h.at + E {
                self.violate(AGREES, format!("{h:?} answered at {now}, before its grant and before E"));
            }
            if !granted {
                self.see(Seen::HeldAnsweredByAge);
            }
            let expected = self.expect(h.d, h.kind, i, false, ends);
            if granted && h.kind == Kind::ReadDone && expected == Expected::Live(true) {
                self.see(Seen::HeldReadConfirmedAtGrant);
            }
            self.judge(h.d, h.kind, i, expected, due.reply);
        }
        let late: Vec<Held> = self.r.held.iter().filter(|h| usize::from(h.i) < self.r.granted || now >= h.at + E).copied().collect();
        if let Some(h) = late.first() {
            self.violate(HELD, format!("{h:?} still held at {now}"));
        }
    }

    /// SPEC P3, P2/D6: the leases the table ended in this step are the ones the reference
    /// ended, under the same reasons, and none expired while a renewal promised it.
    fn check_ends(&mut self, rel: &[kvlease_core::lease_table::Released<u64>], mut ends: Vec<(u64, ReleaseReason)>) {
        let mut got: Vec<(u64, ReleaseReason)> = rel.iter().map(|r| (r.payload.unwrap_or(u64::MAX), r.reason)).collect();
        for &(i, reason) in &got {
            let promised = self.r.promised.get(i as usize).copied().unwrap_or(0);
            if reason == ReleaseReason::Expired && self.r.now < promised {
                self.violate(P2_D6, format!("#{i} expired at {}, promised until {promised}", self.r.now));
            }
        }
        got.sort();
        ends.sort();
        if got != ends {
            self.violate(P3, format!("at {}: ended {got:?}, must be {ends:?}", self.r.now));
        }
    }

    /// Every lease's name, deadline and holder in the table are the reference's (SPEC P2, S5);
    /// as many messages are held.
    fn check_table(&mut self) {
        for i in 0..self.r.leases.len() {
            let w = issued_id(i);
            let named = self.t.lease_of(w);
            let ok = match self.r.leases[i] {
                Lease::Live { deadline, holder } => {
                    named.is_some()
                        && named == self.ids[i]
                        && self.t.table().deadline(named.unwrap_or(0)) == Some(Nanos(deadline * SEC))
                        && self.t.table().holder_of(named.unwrap_or(0)) == holder.map(|d| self.holders[usize::from(d)])
                }
                Lease::Issued | Lease::Ended { .. } => named.is_none(),
            };
            if !ok {
                let (deadline, holder) = named.map_or((None, None), |id| (self.t.table().deadline(id), self.t.table().holder_of(id)));
                let what =
                    format!("#{i} at {}: {named:?} until {deadline:?} held by {holder:?}, must be {:?}", self.r.now, self.r.leases[i]);
                let foreign = matches!(self.r.leases[i], Lease::Live { holder: Some(h), .. } if holder.is_some_and(|x| x != self.holders[usize::from(h)]));
                self.violate(if foreign { P6_S5 } else { AGREES }, what);
            }
        }
        if self.t.held() != self.r.held.len() {
            self.violate(AGREES, format!("{} held, must be {}", self.t.held(), self.r.held.len()));
        }
    }
}

#[derive(Clone, Debug)]
struct IssuedState {
    history: Vec<Step>,
    r: Reference,
    /// The connector's state: `IssuedLeases`' own, as its canonical `Debug` says (counters
    /// left out), and each lease of its table (name, deadline, holder, payload).
    table: String,
    /// The table's next expiry is due.
    expiry_due: bool,
}

impl Hash for IssuedState {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (&self.r, &self.table).hash(h);
    }
}

impl PartialEq for IssuedState {
    fn eq(&self, other: &Self) -> bool {
        (&self.r, &self.table) == (&other.r, &other.table)
    }
}

#[derive(Clone)]
struct IssuedModel {
    bug: Option<DriverBug>,
}

impl IssuedModel {
    fn state(&self, history: Vec<Step>) -> IssuedState {
        let mut w = World::new(self.bug);
        for &s in &history {
            w.step(s);
        }
        // IssuedLeases' own state whole; of its lease table, what each lease is.
        let debug = format!("{:?}", w.t);
        // The table is the first field; the rest is short (the fallback, whole, is slow).
        let own = match debug.find(", by_issued: ") {
            Some(at) => canonical(&debug[at..], &["stats"]),
            None => canonical(&without(&debug, "table: "), &["stats"]),
        };
        let t = w.t.table();
        let leases: Vec<_> =
            (0..IDS).map(|i| w.t.lease_of(issued_id(i)).map(|id| (id, t.deadline(id), t.holder_of(id), t.get(id).copied()))).collect();
        let table = format!("{own} {leases:?} {} {} {:?}", t.live(), t.leased_blocks(), t.next_expiry());
        let expiry_due = t.next_expiry().is_some_and(|at| at.0 <= w.r.now * SEC);
        IssuedState { history, r: w.r, table, expiry_due }
    }
}

impl Model for IssuedModel {
    type State = IssuedState;
    type Action = Step;

    fn init_states(&self) -> Vec<IssuedState> {
        vec![self.state(Vec::new())]
    }

    fn actions(&self, s: &IssuedState, out: &mut Vec<Step>) {
        let r = &s.r;
        if r.granted < r.leases.len() {
            out.extend([Step::Grant { short: false }, Step::Grant { short: true }]);
        }
        if r.sends_left > 0 {
            for d in 0..if r.d0_spoke { 2 } else { 1 } {
                for kind in [Kind::Renew, Kind::ReadDone, Kind::Release] {
                    out.extend((0..r.leases.len() as u8).map(|i| Step::Send { d, kind, i }));
                }
            }
        }
        for i in 0..r.granted {
            if !r.ended_by_vllm[i] && matches!(r.leases[i], Lease::Live { .. }) {
                out.extend([Step::End { i: i as u8, read: true }, Step::End { i: i as u8, read: false }]);
            }
        }
        // Time moves while it can change something: a lease not yet past its deadline, a
        // message held.
        let waiting = r.leases.iter().any(|l| matches!(l, Lease::Live { deadline, .. } if *deadline > r.now)) || !r.held.is_empty();
        if r.now < NOW_MAX && waiting {
            out.push(Step::Advance);
        }
        // The reaper, when the reference or the table has a lease due.
        if s.expiry_due || r.leases.iter().any(|l| matches!(l, Lease::Live { deadline, .. } if *deadline <= r.now)) {
            out.push(Step::Tick);
        }
    }

    fn next_state(&self, s: &IssuedState, step: Step) -> Option<IssuedState> {
        let mut history = s.history.clone();
        history.push(step);
        Some(self.state(history))
    }

    fn properties(&self) -> Vec<Property<Self>> {
        fn holds(s: &IssuedState, p: &str) -> bool {
            s.r.violations.iter().all(|(q, _)| *q != p)
        }
        fn seen(s: &IssuedState, what: Seen) -> bool {
            s.r.seen & what as u8 != 0
        }
        vec![
            Property::always(P5, |_, s: &IssuedState| holds(s, P5)),
            Property::always(P6_S5, |_, s: &IssuedState| holds(s, P6_S5)),
            Property::always(P3, |_, s: &IssuedState| holds(s, P3)),
            Property::always(P2_D6, |_, s: &IssuedState| holds(s, P2_D6)),
            Property::always(HELD, |_, s: &IssuedState| holds(s, HELD)),
            Property::always(AGREES, |_, s: &IssuedState| holds(s, AGREES)),
            // Not vacuous: each way through is reachable.
            Property::sometimes("a held ReadDone confirmed at its grant", |_, s: &IssuedState| seen(s, Seen::HeldReadConfirmedAtGrant)),
            Property::sometimes("a renewal before the grant applied at it", |_, s: &IssuedState| seen(s, Seen::EarlyRenewalApplied)),
            Property::sometimes("a ReadDone confirmed after its lease ended by its read", |_, s: &IssuedState| {
                seen(s, Seen::ReadConfirmedAfterItsEnd)
            }),
            Property::sometimes("another engine's release refused", |_, s: &IssuedState| seen(s, Seen::ForeignReleaseRefused)),
            Property::sometimes("a held message answered after E", |_, s: &IssuedState| seen(s, Seen::HeldAnsweredByAge)),
        ]
    }
}

/// SPEC P2, P3, P5, P6, S5 for leases under ids P's scheduler issues, over every interleaving
/// within the bounds (see the module's documentation).
#[test]
fn p2_p3_p5_p6_s5_model_check_issued_leases() {
    check(IssuedModel { bug: None }, None).assert_properties();
}

/// SPEC P2, D6: a renewal that overtook its grant, acknowledged and not applied (kvlease before
/// 6ee67ac), is found: the lease expires under the acknowledgement.
#[test]
fn p2_d6_planted_bug_early_renewal_acknowledged_not_applied_is_found() {
    assert_found(IssuedModel { bug: Some(DriverBug::AckEarlyRenewalUnapplied) }, P2_D6);
}

/// SPEC P5: a connector that ends a dropped request's lease as read is found: a later
/// `ReadDone` is confirmed for a lease nobody read.
#[test]
fn p5_planted_bug_drop_ended_as_read_is_found() {
    assert_found(IssuedModel { bug: Some(DriverBug::DropEndedAsRead) }, P5);
}

/// SPEC S5: a connector that gives every engine one holder is found: one engine releases
/// another's lease.
#[test]
fn s5_planted_bug_one_holder_for_every_engine_is_found() {
    assert_found(IssuedModel { bug: Some(DriverBug::OneHolder) }, P6_S5);
}
