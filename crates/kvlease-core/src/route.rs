//! The routing proxy's rules (SPEC §10, O2–O4, B1): one request's way through a prefill engine
//! (P) and a decode engine (D), as a state machine fed what happened to its legs and polled for
//! what to do next; and the turn cache that hands a conversation's last decoder turn to its next
//! prefill.
//!
//! `kvlease proxy` (HTTP) and the simulator (`kvlease-sim`, virtual time, seeded faults) drive
//! the same [`Route`]: they send the legs, relay the answers and report back; every decision —
//! which engine takes a leg, whether a failed leg is retried, whether P's lease is released,
//! whether a turn is cached or given back — is made here. No I/O, no clock: time comes in as
//! [`Nanos`].
//!
//! The driver's loop: [`Route::poll`] with the engines as they are now ([`Pools`]) until it
//! returns `None` (waiting for an event, or done); carry out each [`Action`]; report what
//! happened with [`Route::handle`].

use crate::pull::PlantedBug;
use crate::Nanos;
use serde_json::Value;
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;
use thiserror::Error;

/// One upstream engine as the router sees it when it picks: `upstream` is the driver's name for
/// it (an address, an index), compared to avoid an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate<U> {
    pub upstream: U,
    /// Answered its last health probe (or has not failed one).
    pub healthy: bool,
    /// Legs in flight on it.
    pub outstanding: usize,
    /// A prefiller that takes both legs at once (SPEC §13, U1, U2): a push engine whose
    /// coordinates the driver knows ([`PushPeer`]). Ignored for decoders.
    pub push: bool,
}

/// One role's engines now, and where ties start (the driver turns it, so equal loads take turns).
#[derive(Debug, Clone, Copy)]
pub struct Pool<'a, U> {
    pub candidates: &'a [Candidate<U>],
    pub start: usize,
}

/// Both roles' engines now.
#[derive(Debug, Clone, Copy)]
pub struct Pools<'a, U> {
    pub prefill: Pool<'a, U>,
    pub decode: Pool<'a, U>,
}

impl<U> Pools<'_, U> {
    /// No engines: for polling a route that has no leg left to send.
    pub const EMPTY: Self = Pools { prefill: Pool { candidates: &[], start: 0 }, decode: Pool { candidates: &[], start: 0 } };
}

/// The healthy candidate with the fewest legs outstanding (ties in turn from `start`), never
/// `except`, and not `avoid` while a healthy candidate other than it can take the leg; when none
/// is healthy, the least busy of all (it may be back: trying beats refusing).
///
/// SPEC O4: the decode leg avoids the engine that prefilled — a `kv_both` engine paired with
/// itself serves from its own blocks, but another decoder spreads the load.
pub fn pick<'a, U: PartialEq>(pool: Pool<'a, U>, except: Option<&U>, avoid: Option<&U>) -> Option<&'a U> {
    pick_candidate(pool, except, avoid).map(|c| &c.upstream)
}

/// [`pick`], the whole candidate.
fn pick_candidate<'a, U: PartialEq>(pool: Pool<'a, U>, except: Option<&U>, avoid: Option<&U>) -> Option<&'a Candidate<U>> {
    let n = pool.candidates.len();
    let least = |healthy_only: bool, avoid: Option<&U>| {
        (0..n)
            .map(|k| &pool.candidates[(pool.start.wrapping_add(k)) % n])
            .filter(|c| Some(&c.upstream) != except && (avoid.is_none() || Some(&c.upstream) != avoid))
            .filter(|c| !healthy_only || c.healthy)
            .min_by_key(|c| c.outstanding)
    };
    least(true, avoid).or_else(|| least(true, None)).or_else(|| least(false, None))
}

/// How an upstream answered a leg (its answer's head).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// 2xx.
    Success,
    /// Turned away without reading the request (draining, SPEC O1, or at its connection cap: a
    /// 503 with `Retry-After`). Another engine may take it.
    TurnedAwayUnread,
    /// Any other error: the engine read the request and refused it.
    Refused,
}

/// How P answered the prefill leg.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrefillAnswer<E> {
    /// 2xx and its body read; `lease`: it names `kv_transfer_params` (a lease P holds for D).
    Params { lease: bool },
    /// 2xx, but the body could not be read as JSON.
    Unreadable(E),
    /// Any other answer.
    Other(Answer),
}

/// Which leg an answer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    Prefill,
    Decode,
}

/// What happened, as the driver saw it. `E` is the driver's own error for a leg that failed.
#[derive(Debug, Clone, PartialEq)]
pub enum Event<E> {
    /// P answered the prefill leg.
    PrefillAnswered(PrefillAnswer<E>),
    /// The prefill leg failed before any answer (unreachable, cut before the answer's head).
    PrefillFailed(E),
    /// D answered the decode leg (or, batched, the local leg).
    DecodeAnswered(Answer),
    /// The decode leg failed: before its answer, or while it was relayed.
    DecodeFailed(E),
    /// The first byte of the answer reached the client: nothing can be retried from now on.
    FirstByteRelayed,
    /// D's answer ended, naming the turn D keeps (SPEC B1) if it did.
    DecodeDone { turn: Option<Value> },
    /// The request's deadline passed.
    DeadlinePassed,
    /// The client went away.
    ClientGone,
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Action<U, E> {
    /// Send the prefill leg to `to`: the client's request as P's leg (one token, not streamed,
    /// `do_remote_decode`), carrying `turn` — the conversation's cached decoder turn — as its
    /// `kv_transfer_params` when there is one. `retry`: a second try, on another prefiller.
    SendPrefill { to: U, turn: Option<Value>, retry: bool },
    /// Send the decode leg to `to`: the client's request with P's `kv_transfer_params` (none if
    /// P gave none), never the client's own (SPEC S1). `retry`: on another decoder, same params.
    /// In push mode: the same params as the dispatch's decode leg ([`PushPeer::decode_params`]).
    SendDecode { to: U, retry: bool },
    /// Push mode (SPEC §13, U1, U2): send both legs at once — the prefill leg to `prefill`
    /// (as [`Action::SendPrefill`], its params naming a `transfer_id` the driver draws, unique
    /// per dispatch: [`PushPeer::prefill_params`]) and the decode leg to `decode` (P's
    /// coordinates and the same `transfer_id`, no blocks: [`PushPeer::decode_params`]).
    /// `retry`: a second dispatch, on another prefiller, with a new `transfer_id`.
    SendBoth { prefill: U, decode: U, retry: bool },
    /// Push mode (SPEC U9, O2): drop the decode leg that is out — its request and its answer if
    /// held — so that D aborts it and releases P's lease itself.
    CancelDecode,
    /// A batch of prompts has no single KV to hand over: send the client's request, without
    /// `kv_transfer_params`, to decoder `to`, which computes it.
    SendLocal { to: U },
    /// End P's lease on `on` at once (SPEC O3, O4): no decoder will read it.
    Release { on: U },
    /// Relay the answer just given (by D) to the client as it streams.
    RelayStream,
    /// Relay the last answer of `leg` the driver holds (an error, or a turn-away) whole.
    RelayWhole { leg: Leg },
    /// Answer the client with this error; if the answer had begun, end the stream with it.
    Fail { error: RouteError<E>, relayed: bool },
    /// Put the conversation's turn back in the [`TurnCache`]: no prefill read it.
    GiveBack { conversation: String, turn: Turn },
    /// Keep D's turn for the conversation's next request ([`TurnCache::keep`]).
    KeepTurn { conversation: String, params: Value },
}

/// Why a request could not be routed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RouteError<E> {
    #[error("no prefiller")]
    NoPrefiller,
    #[error("no decoder")]
    NoDecoder,
    #[error("no answer within the request's deadline")]
    TimedOut,
    /// A leg failed; the driver's own account of it.
    #[error("{0}")]
    Leg(E),
}

/// An event the request's stage does not expect (a driver bug): it changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("the route is {stage}; it does not expect {event}")]
pub struct StrayEvent {
    pub stage: &'static str,
    pub event: &'static str,
}

/// Where the request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Start,
    /// A prefill leg is out; `retry`: it is the second.
    Prefill {
        retry: bool,
    },
    /// The first prefill leg went wrong: try another prefiller, else end with `fallback`.
    PrefillRetry {
        fallback: Fallback,
    },
    /// P answered with its params: a decoder is to be picked.
    Decode,
    /// A decode leg is out.
    DecodeSent,
    /// Push mode (SPEC §13): both legs went out at once. `answered`: P answered with its
    /// params; `decode`: where the decode leg is.
    Both {
        retry: bool,
        answered: bool,
        decode: BothDecode,
    },
    /// A batch's leg is out to a decoder.
    Local,
    /// The answer is streaming to the client.
    Relaying,
    Done,
}

/// Push mode: the decode leg of a dispatch of both legs at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BothDecode {
    /// Out, no answer yet.
    Out,
    /// D answered 2xx (the driver holds the answer): relayed once P has answered too.
    Held,
    /// It failed or was turned away: another decoder is to be picked (O2).
    Picking,
}

/// How a request ends when there is no other engine to try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fallback {
    /// Relay the turn-away the driver holds.
    TurnedAway,
    /// Fail with the leg's error (kept in `Route::error`).
    Error,
}

/// One request's route (SPEC O2–O4, B1). `U` names an engine, `E` is the driver's error for a
/// leg that failed.
#[derive(Debug)]
pub struct Route<U, E> {
    stage: Stage,
    conversation: Option<String>,
    batched: bool,
    /// The conversation's cached turn, taken for this request's prefill.
    turn: Option<Turn>,
    /// The prefiller asked last (the one that answered, once P has).
    prefiller: Option<U>,
    /// The decoder asked last, and the last one that turned the leg away or failed it.
    decoder: Option<U>,
    tried: Option<U>,
    decode_attempts: u8,
    /// P holds a lease for this request (its answer named params) not yet released.
    lease: bool,
    relayed: bool,
    /// A decoder turned the leg away unread: its answer (held by the driver) is relayed if no
    /// other decoder takes the leg.
    turned_away: bool,
    error: Option<E>,
    out: VecDeque<Action<U, E>>,
    #[doc(hidden)]
    pub planted: Option<PlantedBug>,
}

/// Decoders a decode leg is tried on (SPEC O2: retried once).
const DECODE_ATTEMPTS: u8 = 2;

impl<U: Clone + PartialEq, E> Route<U, E> {
    /// A request: of `conversation` (multi-turn), whose cached turn it takes from `turns` at
    /// `now`; `batched` if it is a list of prompts (no single KV to hand over).
    pub fn new(conversation: Option<String>, batched: bool, turns: &mut TurnCache, now: Nanos) -> Route<U, E> {
        let turn = conversation.as_deref().and_then(|c| turns.take(c, now));
        Route {
            stage: Stage::Start,
            conversation,
            batched,
            turn,
            prefiller: None,
            decoder: None,
            tried: None,
            decode_attempts: 0,
            lease: false,
            relayed: false,
            turned_away: false,
            error: None,
            out: VecDeque::new(),
            planted: None,
        }
    }

    /// Whether this request's prefill carries the conversation's cached turn.
    pub fn has_turn(&self) -> bool {
        self.turn.is_some()
    }

    /// Whether D's answer is to be searched for the turn it keeps: it would be cached.
    pub fn keeps_turn(&self) -> bool {
        self.conversation.is_some() && !self.batched
    }

    /// The prefiller that answered (or was asked last).
    pub fn prefiller(&self) -> Option<&U> {
        self.prefiller.as_ref()
    }

    /// The decoder asked last.
    pub fn decoder(&self) -> Option<&U> {
        self.decoder.as_ref()
    }

    /// Whether the request is over: nothing more will be asked for.
    pub fn is_done(&self) -> bool {
        self.stage == Stage::Done && self.out.is_empty()
    }

    /// The next thing to do, picking engines from `pools` when a leg is to be sent; `None`
    /// while waiting for an event, or when done.
    pub fn poll(&mut self, pools: Pools<'_, U>) -> Option<Action<U, E>> {
        if let Some(a) = self.out.pop_front() {
            return Some(a);
        }
        match self.stage {
            Stage::Start if self.batched => {
                self.give_back();
                match pick(pools.decode, None, None) {
                    Some(to) => {
                        self.decoder = Some(to.clone());
                        self.stage = Stage::Local;
                        self.out.push_back(Action::SendLocal { to: to.clone() });
                    }
                    None => self.fail(RouteError::NoDecoder),
                }
            }
            Stage::Start => match pick_candidate(pools.prefill, None, None) {
                Some(c) => self.dispatch(c, pools.decode, false),
                None => {
                    self.give_back();
                    self.fail(RouteError::NoPrefiller);
                }
            },
            Stage::PrefillRetry { fallback } => match pick_candidate(pools.prefill, self.prefiller.as_ref(), None) {
                Some(c) => self.dispatch(c, pools.decode, true),
                None => {
                    // No prefill read the turn: the conversation keeps it (D still holds it).
                    self.give_back();
                    match fallback {
                        Fallback::TurnedAway => self.finish(Action::RelayWhole { leg: Leg::Prefill }),
                        Fallback::Error => self.fail_with_leg_error(),
                    }
                }
            },
            Stage::Decode => self.next_decoder(pools.decode, Stage::DecodeSent, None),
            // O2 in push mode: the decode leg failed before its first byte while P may still be
            // prefilling: once more on another decoder, with the same transfer (P pairs by its
            // key, U1); with none, P's lease is released at once (O4).
            Stage::Both { retry, answered, decode: BothDecode::Picking } => {
                self.next_decoder(pools.decode, Stage::Both { retry, answered, decode: BothDecode::Out }, Some(true))
            }
            Stage::Prefill { .. } | Stage::DecodeSent | Stage::Both { .. } | Stage::Local | Stage::Relaying | Stage::Done => {}
        }
        self.out.pop_front()
    }

    /// SPEC O2, O3, O4: a decoder for the decode leg (a retry only before its first byte, at
    /// most [`DECODE_ATTEMPTS`] in all), which moves the route to `then`; with none, nobody will
    /// read P's blocks: P's lease is released and the request ends. `retry`: whether the leg is
    /// a retry (`None`: whether an earlier attempt went out).
    fn next_decoder(&mut self, decoders: Pool<'_, U>, then: Stage, retry: Option<bool>) {
        let next = (self.decode_attempts < DECODE_ATTEMPTS).then(|| pick(decoders, self.tried.as_ref(), self.prefiller.as_ref())).flatten();
        match next {
            Some(to) => {
                self.decode_attempts += 1;
                self.decoder = Some(to.clone());
                self.stage = then;
                let retry = retry.unwrap_or(self.decode_attempts > 1);
                self.out.push_back(Action::SendDecode { to: to.clone(), retry });
            }
            None => {
                self.release();
                if self.turned_away {
                    self.finish(Action::RelayWhole { leg: Leg::Decode });
                } else if self.error.is_some() {
                    self.fail_with_leg_error();
                } else {
                    self.fail(RouteError::NoDecoder);
                }
            }
        }
    }

    /// What happened.
    pub fn handle(&mut self, event: Event<E>) -> Result<(), StrayEvent> {
        match (self.stage, event) {
            (Stage::Prefill { retry }, Event::PrefillAnswered(answer)) => match answer {
                PrefillAnswer::Params { lease } => {
                    self.lease = lease;
                    self.stage = Stage::Decode;
                }
                // P answered but its params cannot be read: whether it read the turn is unknown.
                PrefillAnswer::Unreadable(e) => self.fail(RouteError::Leg(e)),
                PrefillAnswer::Other(Answer::TurnedAwayUnread) if !retry => {
                    self.stage = Stage::PrefillRetry { fallback: Fallback::TurnedAway };
                }
                // P answered an error: it did not read the turn (it releases a turn it tracked).
                PrefillAnswer::Other(_) => {
                    self.give_back();
                    self.finish(Action::RelayWhole { leg: Leg::Prefill });
                }
            },
            // It never got the request (or not all of it), so nothing was leased (O2).
            (Stage::Prefill { retry: false }, Event::PrefillFailed(e)) => {
                self.error = Some(e);
                self.stage = Stage::PrefillRetry { fallback: Fallback::Error };
            }
            (Stage::Prefill { retry: true }, Event::PrefillFailed(e)) => {
                self.give_back();
                self.fail(RouteError::Leg(e));
            }
            // Push mode (SPEC §13): P answered while the decode leg is out (or answered).
            (Stage::Both { retry, decode, .. }, Event::PrefillAnswered(answer)) => match answer {
                // P leased under the dispatch's key; D's answer is relayed once it has come.
                PrefillAnswer::Params { .. } if decode == BothDecode::Held => {
                    self.lease = false;
                    self.stage = Stage::Relaying;
                    self.out.push_back(Action::RelayStream);
                }
                PrefillAnswer::Params { .. } => self.stage = Stage::Both { retry, answered: true, decode },
                // O4: P answered but unreadably: it may hold a lease nobody will take.
                PrefillAnswer::Unreadable(e) => {
                    self.out.push_back(Action::CancelDecode);
                    self.release();
                    self.fail(RouteError::Leg(e));
                }
                // U9: P did not lease (it refused, or turned the leg away unread): D's leg is
                // dropped (D releases what it renewed), and the prefill tried again or P's
                // answer relayed, as without push.
                PrefillAnswer::Other(Answer::TurnedAwayUnread) if !retry => {
                    self.out.push_back(Action::CancelDecode);
                    self.lease = false;
                    self.stage = Stage::PrefillRetry { fallback: Fallback::TurnedAway };
                }
                PrefillAnswer::Other(_) => {
                    self.out.push_back(Action::CancelDecode);
                    self.lease = false;
                    self.give_back();
                    self.finish(Action::RelayWhole { leg: Leg::Prefill });
                }
            },
            // O2, O4, U9: the prefill leg failed before its answer: D's leg is dropped and P's
            // lease under the key released (P may have granted it before the leg broke, and no
            // decoder will take it); then another prefiller, once.
            (Stage::Both { retry, .. }, Event::PrefillFailed(e)) => {
                self.out.push_back(Action::CancelDecode);
                self.release();
                if retry {
                    self.give_back();
                    self.fail(RouteError::Leg(e));
                } else {
                    self.error = Some(e);
                    self.stage = Stage::PrefillRetry { fallback: Fallback::Error };
                }
            }
            (Stage::Both { retry, answered, decode: BothDecode::Out }, Event::DecodeAnswered(answer)) => match answer {
                Answer::Success if answered => {
                    self.lease = false;
                    self.stage = Stage::Relaying;
                    self.out.push_back(Action::RelayStream);
                }
                // Not relayed before P has answered: a prefill that fails still cancels it.
                Answer::Success => self.stage = Stage::Both { retry, answered, decode: BothDecode::Held },
                Answer::TurnedAwayUnread => {
                    self.tried = self.decoder.clone();
                    self.turned_away = true;
                    self.stage = Stage::Both { retry, answered, decode: BothDecode::Picking };
                }
                // O3: D refused the leg: P's lease under the key is released now (before P's
                // grant it is refused at the grant), and D's answer relayed.
                Answer::Refused => {
                    self.release();
                    self.finish(Action::RelayWhole { leg: Leg::Decode });
                }
            },
            (Stage::Both { retry, answered, decode: BothDecode::Out | BothDecode::Held }, Event::DecodeFailed(e)) => {
                self.tried = self.decoder.clone();
                self.error = Some(e);
                self.stage = Stage::Both { retry, answered, decode: BothDecode::Picking };
            }
            (Stage::DecodeSent, Event::DecodeAnswered(answer)) => match answer {
                Answer::Success => {
                    self.lease = false;
                    self.stage = Stage::Relaying;
                    self.out.push_back(Action::RelayStream);
                }
                // Draining, or at its connection cap: D never read the request, P's lease is
                // untouched. Another decoder may take it.
                Answer::TurnedAwayUnread => {
                    self.tried = self.decoder.clone();
                    self.turned_away = true;
                    self.stage = Stage::Decode;
                }
                // D refused before taking the request (it releases P's lease itself, O3): the
                // router makes sure, and relays D's answer.
                Answer::Refused => {
                    self.release();
                    self.finish(Action::RelayWhole { leg: Leg::Decode });
                }
            },
            // O2: before its first byte a decode leg is retried with the same params (the lease
            // is still live); after it, the stream ends with an error.
            (Stage::DecodeSent, Event::DecodeFailed(e)) => {
                self.tried = self.decoder.clone();
                self.error = Some(e);
                self.stage = Stage::Decode;
            }
            (Stage::Local, Event::DecodeAnswered(_)) => {
                self.stage = Stage::Relaying;
                self.out.push_back(Action::RelayStream);
            }
            (Stage::Local, Event::DecodeFailed(e)) => self.fail(RouteError::Leg(e)),
            (Stage::Relaying, Event::FirstByteRelayed) => self.relayed = true,
            (Stage::Relaying, Event::DecodeFailed(e)) => {
                let planted = self.planted == Some(PlantedBug::RetryAfterFirstByte);
                if (!self.relayed || planted) && !self.batched {
                    self.tried = self.decoder.clone();
                    self.error = Some(e);
                    self.stage = Stage::Decode;
                } else {
                    self.fail(RouteError::Leg(e));
                }
            }
            (Stage::Relaying, Event::DecodeDone { turn }) => {
                self.stage = Stage::Done;
                if let (Some(conversation), Some(params), false) = (self.conversation.clone(), turn, self.batched) {
                    self.out.push_back(Action::KeepTurn { conversation, params });
                }
            }
            (Stage::Done, Event::FirstByteRelayed | Event::DecodeDone { .. } | Event::ClientGone) => {}
            (_, Event::DeadlinePassed) => self.abandon(true),
            (_, Event::ClientGone) => self.abandon(false),
            (stage, event) => {
                return Err(StrayEvent { stage: stage.name(), event: event.name() });
            }
        }
        Ok(())
    }

    /// The deadline passed or the client left: whatever is out is dropped with the request.
    /// P's lease is released when no decoder has been handed it (one that has sees its
    /// connection close and releases it, SPEC D4). A taken turn is not given back once a
    /// prefill leg may have read it.
    fn abandon(&mut self, answer: bool) {
        if self.stage == Stage::Done {
            return;
        }
        if matches!(self.stage, Stage::Start | Stage::PrefillRetry { .. }) {
            self.give_back();
        }
        // Push mode: P pairs by a key the route named, whether or not a decoder took it (a
        // decoder that did releases it too, U9; P refuses a release of a lease a decoder holds).
        if self.stage == Stage::Decode || matches!(self.stage, Stage::Both { .. }) {
            self.release();
        }
        if answer {
            self.fail(RouteError::TimedOut);
        } else {
            self.stage = Stage::Done;
        }
    }

    /// Sends the prefill leg to `c`; to a push prefiller (SPEC §13) with the decode leg at once,
    /// to a decoder picked now, unless the request carries a cached turn (push mode has no
    /// multi-turn reads), there is no decoder, or the only one is the prefiller itself (then the
    /// legs go one after the other, as before).
    fn dispatch(&mut self, c: &Candidate<U>, decoders: Pool<'_, U>, retry: bool) {
        let decoder =
            (c.push && self.turn.is_none()).then(|| pick(decoders, None, Some(&c.upstream))).flatten().filter(|d| **d != c.upstream);
        let Some(d) = decoder else { return self.send_prefill(c.upstream.clone(), retry) };
        self.prefiller = Some(c.upstream.clone());
        self.decoder = Some(d.clone());
        self.tried = None;
        self.turned_away = false;
        self.decode_attempts = 1;
        // P will lease under the dispatch's key: released unless a decoder takes it (O4).
        self.lease = true;
        self.stage = Stage::Both { retry, answered: false, decode: BothDecode::Out };
        self.out.push_back(Action::SendBoth { prefill: c.upstream.clone(), decode: d.clone(), retry });
    }

    fn send_prefill(&mut self, to: U, retry: bool) {
        self.prefiller = Some(to.clone());
        self.stage = Stage::Prefill { retry };
        let turn = self.turn.as_ref().map(|t| t.params.clone());
        self.out.push_back(Action::SendPrefill { to, turn, retry });
    }

    /// P's lease, released if P holds one for this request.
    fn release(&mut self) {
        if std::mem::take(&mut self.lease) {
            if let Some(on) = self.prefiller.clone() {
                self.out.push_back(Action::Release { on });
            }
        }
    }

    fn give_back(&mut self) {
        if let (Some(conversation), Some(turn)) = (self.conversation.clone(), self.turn.take()) {
            self.out.push_back(Action::GiveBack { conversation, turn });
        }
    }

    fn fail(&mut self, error: RouteError<E>) {
        let relayed = self.relayed;
        self.finish(Action::Fail { error, relayed });
    }

    fn fail_with_leg_error(&mut self) {
        match self.error.take() {
            Some(e) => self.fail(RouteError::Leg(e)),
            None => self.fail(RouteError::NoDecoder),
        }
    }

    fn finish(&mut self, last: Action<U, E>) {
        self.stage = Stage::Done;
        self.out.push_back(last);
    }
}

impl Stage {
    fn name(self) -> &'static str {
        match self {
            Stage::Start => "starting",
            Stage::Prefill { .. } => "waiting for the prefill leg",
            Stage::PrefillRetry { .. } => "retrying the prefill leg",
            Stage::Decode => "picking a decoder",
            Stage::DecodeSent => "waiting for the decode leg",
            Stage::Both { .. } => "waiting for both legs",
            Stage::Local => "waiting for the batch's leg",
            Stage::Relaying => "relaying the answer",
            Stage::Done => "done",
        }
    }
}

impl<E> Event<E> {
    fn name(&self) -> &'static str {
        match self {
            Event::PrefillAnswered(_) => "a prefill answer",
            Event::PrefillFailed(_) => "a prefill failure",
            Event::DecodeAnswered(_) => "a decode answer",
            Event::DecodeFailed(_) => "a decode failure",
            Event::FirstByteRelayed => "a first byte relayed",
            Event::DecodeDone { .. } => "the end of an answer",
            Event::DeadlinePassed => "the deadline",
            Event::ClientGone => "the client's leaving",
        }
    }
}

/// A push prefiller as the router knows it (SPEC §13): what D needs to reach it, learnt from
/// one of its answers ([`PushPeer::from_answer`]) or from its registration, so that later
/// requests send both legs at once ([`Action::SendBoth`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushPeer {
    pub engine_id: String,
    /// P's transfer address (its side channel), as D's handshake reaches it.
    pub host: String,
    pub port: u16,
    pub tp_size: u32,
}

impl PushPeer {
    /// P's coordinates from the `kv_transfer_params` of its prefill answer: `Some` only for a
    /// push engine's answer (`transfer_mode: "push"`); a pull engine's answer is `None`.
    pub fn from_answer(params: &Value) -> Option<PushPeer> {
        if params.get("transfer_mode").and_then(Value::as_str) != Some("push") {
            return None;
        }
        match crate::params::KvRole::parse(Some(params)) {
            Ok(crate::params::KvRole::DecodePush(r)) => {
                Some(PushPeer { engine_id: r.engine_id, host: r.host, port: r.port, tp_size: r.tp_size })
            }
            _ => None,
        }
    }

    /// SPEC U1: the prefill leg's `kv_transfer_params` of a dispatch of both legs at once: P
    /// keys its lease by `transfer_id`.
    pub fn prefill_params(transfer_id: &str) -> Value {
        serde_json::json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
            "transfer_id": transfer_id,
        })
    }

    /// SPEC U1, U2: the decode leg's `kv_transfer_params`, sent with the prefill leg: P's
    /// coordinates and the same `transfer_id`, no blocks and no incarnation (any incarnation of
    /// P may pair, U11). They also name the lease to P's release (O3, O4).
    pub fn decode_params(&self, transfer_id: &str) -> Value {
        let key = crate::wire::PushKey::Transfer(transfer_id.to_owned());
        let peer = crate::params::PushAnswer {
            engine_id: &self.engine_id,
            host: &self.host,
            port: self.port,
            tp_size: self.tp_size,
            num_tokens: None,
            incarnation: None,
            key: &key,
        };
        peer.to_json()
    }
}

/// A conversation's cached decoder turn: D's params and when they go stale (on the driver's
/// clock).
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub params: Value,
    until: Nanos,
}

/// Conversations whose last turn the router remembers, by default.
pub const MAX_CONVERSATIONS: usize = 10_000;

/// Multi-turn (SPEC B1, B4), as vLLM's multi-turn proxy does it: each conversation's last
/// decoder turn, by the request's `conversation_id`, handed to that conversation's next prefill
/// once, and dropped a second before D's TTL for it runs out. Bounded: past the bound, the
/// conversations kept longest ago go.
#[derive(Debug)]
pub struct TurnCache {
    /// Each conversation's turn and when it was kept (a sequence number).
    map: BTreeMap<String, (Turn, u64)>,
    /// The conversations in the order they were kept. An entry whose number is not its
    /// conversation's (taken, or kept again since) is stale and skipped.
    order: VecDeque<(u64, String)>,
    seq: u64,
    max: usize,
}

impl Default for TurnCache {
    fn default() -> TurnCache {
        TurnCache::new(MAX_CONVERSATIONS)
    }
}

/// How long before D's TTL runs out a turn stops being handed on: P must still reach D.
const TURN_MARGIN: Duration = Duration::from_secs(1);

impl TurnCache {
    /// At most `max` conversations.
    pub fn new(max: usize) -> TurnCache {
        TurnCache { map: BTreeMap::new(), order: VecDeque::new(), seq: 0, max: max.max(1) }
    }

    /// Conversations with a turn kept (stale ones included until taken or pushed out).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The conversation's turn, once; `None` if there is none or it has gone stale by `now`.
    pub fn take(&mut self, conversation: &str, now: Nanos) -> Option<Turn> {
        let (turn, _) = self.map.remove(conversation)?;
        (now < turn.until).then_some(turn)
    }

    /// D's params for the conversation's turn, answered at `now`: kept until a second before
    /// their `remote_blocks_ttl_remaining` runs out; not kept (false) without a TTL above that.
    pub fn keep(&mut self, conversation: String, params: Value, now: Nanos) -> bool {
        let ttl = params.get("remote_blocks_ttl_remaining").and_then(Value::as_f64);
        let Some(ttl) = ttl.filter(|t| t.is_finite() && *t > TURN_MARGIN.as_secs_f64()) else {
            return false;
        };
        let until = now + Duration::from_secs_f64(ttl) - TURN_MARGIN;
        self.insert(conversation, Turn { params, until });
        true
    }

    /// A taken turn no prefill got to read: back for the conversation's next request, with its
    /// own deadline, unless a newer turn came meanwhile.
    pub fn give_back(&mut self, conversation: String, turn: Turn) {
        if !self.map.contains_key(&conversation) {
            self.insert(conversation, turn);
        }
    }

    /// Keeps `turn` as the conversation's, within the bound.
    fn insert(&mut self, conversation: String, turn: Turn) {
        self.seq += 1;
        self.map.insert(conversation.clone(), (turn, self.seq));
        self.order.push_back((self.seq, conversation));
        while self.map.len() > self.max {
            let Some((seq, oldest)) = self.order.pop_front() else { break };
            if self.map.get(&oldest).is_some_and(|e| e.1 == seq) {
                self.map.remove(&oldest);
            }
        }
        if self.order.len() > 2 * self.max {
            let map = &self.map;
            self.order.retain(|(seq, c)| map.get(c).is_some_and(|e| e.1 == *seq));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    type R = Route<&'static str, &'static str>;
    type A = Action<&'static str, &'static str>;

    fn healthy(names: &[&'static str]) -> Vec<Candidate<&'static str>> {
        names.iter().map(|&upstream| Candidate { upstream, healthy: true, outstanding: 0, push: false }).collect()
    }

    /// Two prefillers p1, p2 and two decoders d1, d2, all idle and healthy.
    struct Cluster {
        prefill: Vec<Candidate<&'static str>>,
        decode: Vec<Candidate<&'static str>>,
    }

    impl Cluster {
        fn new() -> Cluster {
            Cluster { prefill: healthy(&["p1", "p2"]), decode: healthy(&["d1", "d2"]) }
        }
        fn pools(&self) -> Pools<'_, &'static str> {
            Pools { prefill: Pool { candidates: &self.prefill, start: 0 }, decode: Pool { candidates: &self.decode, start: 0 } }
        }
        /// Every action the route asks for now.
        fn drain(&self, r: &mut R) -> Vec<A> {
            std::iter::from_fn(|| r.poll(self.pools())).collect()
        }
    }

    fn route(conversation: Option<&str>, turns: &mut TurnCache) -> R {
        Route::new(conversation.map(str::to_owned), false, turns, Nanos::ZERO)
    }

    fn prefill(to: &'static str, retry: bool) -> A {
        Action::SendPrefill { to, turn: None, retry }
    }

    fn decode(to: &'static str, retry: bool) -> A {
        Action::SendDecode { to, retry }
    }

    /// A route that P (p1) has answered with a lease.
    fn leased(c: &Cluster) -> R {
        let mut r = route(None, &mut TurnCache::default());
        assert_eq!(c.drain(&mut r), [prefill("p1", false)]);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Params { lease: true })).unwrap();
        r
    }

    /// The way through: P, then D, streamed; nothing released (D read the lease).
    #[test]
    fn o2_a_request_goes_to_p_then_d_and_streams() {
        let c = Cluster::new();
        let mut r = leased(&c);
        assert_eq!(c.drain(&mut r), [decode("d1", false)]);
        r.handle(Event::DecodeAnswered(Answer::Success)).unwrap();
        assert_eq!(c.drain(&mut r), [Action::RelayStream]);
        r.handle(Event::FirstByteRelayed).unwrap();
        r.handle(Event::DecodeDone { turn: None }).unwrap();
        assert_eq!(c.drain(&mut r), []);
        assert!(r.is_done());
    }

    /// SPEC O2: a decode leg that fails before its first byte is retried once, on another
    /// decoder, with the same params (no release: the lease is still live); a second failure
    /// fails the request and releases P's lease (nobody will read it, O4).
    #[test]
    fn o2_a_decode_leg_failing_before_its_first_byte_is_retried_once_on_another_decoder() {
        let c = Cluster::new();
        let mut r = leased(&c);
        assert_eq!(c.drain(&mut r), [decode("d1", false)]);
        r.handle(Event::DecodeFailed("d1 unreachable")).unwrap();
        assert_eq!(c.drain(&mut r), [decode("d2", true)]);
        r.handle(Event::DecodeFailed("d2 unreachable")).unwrap();
        let fail = Action::Fail { error: RouteError::Leg("d2 unreachable"), relayed: false };
        assert_eq!(c.drain(&mut r), [Action::Release { on: "p1" }, fail]);
        assert!(r.is_done());
    }

    /// SPEC O2: an answer's head came but nothing reached the client yet: still retried.
    #[test]
    fn o2_a_decode_leg_failing_after_its_head_but_before_the_first_byte_relayed_is_retried() {
        let c = Cluster::new();
        let mut r = leased(&c);
        c.drain(&mut r);
        r.handle(Event::DecodeAnswered(Answer::Success)).unwrap();
        assert_eq!(c.drain(&mut r), [Action::RelayStream]);
        r.handle(Event::DecodeFailed("cut")).unwrap();
        assert_eq!(c.drain(&mut r), [decode("d2", true)]);
    }

    /// SPEC O2: after the first byte a failure ends the stream with an error, never a retry
    /// (the client would get a second answer after part of the first).
    #[test]
    fn o2_a_decode_leg_failing_after_its_first_byte_ends_the_stream() {
        let c = Cluster::new();
        let mut r = leased(&c);
        c.drain(&mut r);
        r.handle(Event::DecodeAnswered(Answer::Success)).unwrap();
        c.drain(&mut r);
        r.handle(Event::FirstByteRelayed).unwrap();
        r.handle(Event::DecodeFailed("cut")).unwrap();
        assert_eq!(c.drain(&mut r), [Action::Fail { error: RouteError::Leg("cut"), relayed: true }]);
        // The planted bug retries: what the simulator must catch.
        let mut bad = leased(&c);
        bad.planted = Some(PlantedBug::RetryAfterFirstByte);
        c.drain(&mut bad);
        bad.handle(Event::DecodeAnswered(Answer::Success)).unwrap();
        c.drain(&mut bad);
        bad.handle(Event::FirstByteRelayed).unwrap();
        bad.handle(Event::DecodeFailed("cut")).unwrap();
        assert_eq!(c.drain(&mut bad), [decode("d2", true)]);
    }

    /// SPEC O2: a prefill leg that could not be sent (nothing leased) or that P turned away
    /// unread is tried once more on another prefiller; with no other, the error or P's
    /// turn-away is the answer.
    #[test]
    fn o2_a_prefill_leg_unreached_or_turned_away_is_retried_once_on_another_prefiller() {
        let c = Cluster::new();
        let mut r = route(None, &mut TurnCache::default());
        assert_eq!(c.drain(&mut r), [prefill("p1", false)]);
        r.handle(Event::PrefillFailed("p1 unreachable")).unwrap();
        assert_eq!(c.drain(&mut r), [prefill("p2", true)]);
        r.handle(Event::PrefillFailed("p2 unreachable")).unwrap();
        assert_eq!(c.drain(&mut r), [Action::Fail { error: RouteError::Leg("p2 unreachable"), relayed: false }]);

        let mut r = route(None, &mut TurnCache::default());
        c.drain(&mut r);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Other(Answer::TurnedAwayUnread))).unwrap();
        assert_eq!(c.drain(&mut r), [prefill("p2", true)]);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Other(Answer::TurnedAwayUnread))).unwrap();
        assert_eq!(c.drain(&mut r), [Action::RelayWhole { leg: Leg::Prefill }], "the second's answer, whatever it is");

        let alone = Cluster { prefill: healthy(&["p1"]), ..Cluster::new() };
        let mut r = route(None, &mut TurnCache::default());
        alone.drain(&mut r);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Other(Answer::TurnedAwayUnread))).unwrap();
        assert_eq!(alone.drain(&mut r), [Action::RelayWhole { leg: Leg::Prefill }]);
        let mut r = route(None, &mut TurnCache::default());
        alone.drain(&mut r);
        r.handle(Event::PrefillFailed("down")).unwrap();
        assert_eq!(alone.drain(&mut r), [Action::Fail { error: RouteError::Leg("down"), relayed: false }]);
        let none = Cluster { prefill: Vec::new(), ..Cluster::new() };
        let mut r = route(None, &mut TurnCache::default());
        assert_eq!(none.drain(&mut r), [Action::Fail { error: RouteError::NoPrefiller, relayed: false }]);
    }

    /// SPEC O3: D refused the request before admission: P's lease is released at once (D does
    /// it too; the router makes sure) and D's answer relayed; never another decoder.
    #[test]
    fn o3_a_refused_decode_leg_releases_ps_lease_and_relays_ds_answer() {
        let c = Cluster::new();
        let mut r = leased(&c);
        c.drain(&mut r);
        r.handle(Event::DecodeAnswered(Answer::Refused)).unwrap();
        assert_eq!(c.drain(&mut r), [Action::Release { on: "p1" }, Action::RelayWhole { leg: Leg::Decode }]);
        // P answered without params: there is no lease to release.
        let mut r = route(None, &mut TurnCache::default());
        c.drain(&mut r);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Params { lease: false })).unwrap();
        c.drain(&mut r);
        r.handle(Event::DecodeAnswered(Answer::Refused)).unwrap();
        assert_eq!(c.drain(&mut r), [Action::RelayWhole { leg: Leg::Decode }]);
    }

    /// SPEC O4: when no decoder takes the leg (each turned it away unread, or none is there),
    /// nobody will read P's blocks: the lease is released, once, and the turn-away relayed.
    #[test]
    fn o4_a_lease_no_decoder_took_is_released_at_once() {
        let c = Cluster::new();
        let mut r = leased(&c);
        assert_eq!(c.drain(&mut r), [decode("d1", false)]);
        r.handle(Event::DecodeAnswered(Answer::TurnedAwayUnread)).unwrap();
        assert_eq!(c.drain(&mut r), [decode("d2", true)]);
        r.handle(Event::DecodeFailed("d2 unreachable")).unwrap();
        assert_eq!(c.drain(&mut r), [Action::Release { on: "p1" }, Action::RelayWhole { leg: Leg::Decode }]);
        assert!(r.is_done());
        let none = Cluster { decode: Vec::new(), ..Cluster::new() };
        let mut r = leased(&none);
        assert_eq!(none.drain(&mut r), [Action::Release { on: "p1" }, Action::Fail { error: RouteError::NoDecoder, relayed: false }]);
    }

    /// SPEC O4: the client gone or the deadline passed after P leased and before any decoder
    /// was handed the params: released at once. Once a decoder has them it releases them itself
    /// when its connection closes (D4): the router does not.
    #[test]
    fn o4_a_request_abandoned_before_its_decode_leg_releases_ps_lease() {
        let c = Cluster::new();
        let mut r = leased(&c);
        r.handle(Event::ClientGone).unwrap();
        assert_eq!(c.drain(&mut r), [Action::Release { on: "p1" }]);
        assert!(r.is_done());
        let mut r = leased(&c);
        r.handle(Event::DeadlinePassed).unwrap();
        assert_eq!(c.drain(&mut r), [Action::Release { on: "p1" }, Action::Fail { error: RouteError::TimedOut, relayed: false }]);
        let mut r = leased(&c);
        c.drain(&mut r);
        r.handle(Event::DeadlinePassed).unwrap();
        assert_eq!(c.drain(&mut r), [Action::Fail { error: RouteError::TimedOut, relayed: false }]);
    }

    /// SPEC O4 (self-pairing): the decode leg avoids the engine that prefilled while another
    /// healthy decoder can take it — whatever the load — and falls back to it when it is the
    /// only healthy one; a retry never goes back to the decoder that failed; with none healthy
    /// the least busy of all is tried.
    #[test]
    fn o4_the_decode_leg_avoids_the_prefilling_engine_while_another_can_take_it() {
        let mut d = healthy(&["a", "b"]);
        d[1].outstanding = 5;
        for start in 0..4 {
            let pool = Pool { candidates: &d, start };
            assert_eq!(pick(pool, None, Some(&"a")), Some(&"b"));
            assert_eq!(pick(pool, None, None), Some(&"a"), "least outstanding");
        }
        d[1].healthy = false;
        let pool = Pool { candidates: &d, start: 0 };
        assert_eq!(pick(pool, None, Some(&"a")), Some(&"a"), "the only healthy one");
        assert_eq!(pick(pool, Some(&"a"), Some(&"a")), Some(&"b"), "not the one that failed");
        d[0].healthy = false;
        assert_eq!(pick(Pool { candidates: &d, start: 0 }, None, None), Some(&"a"), "none healthy: the least busy");
        let even = healthy(&["a", "b"]);
        assert_eq!(pick(Pool { candidates: &even, start: 1 }, None, None), Some(&"b"), "ties take turns");
        assert_eq!(pick(Pool::<&str> { candidates: &[], start: 3 }, None, None), None);
    }

    fn ttl(secs: f64, n: u64) -> Value {
        json!({"remote_blocks_ttl_remaining": secs, "n": n})
    }

    fn at(secs: u64) -> Nanos {
        Nanos(secs * 1_000_000_000)
    }

    /// SPEC B1: a conversation's turn is handed on once, dropped a second before D's TTL for it,
    /// not kept without a TTL above that margin; the cache is bounded, the oldest going.
    #[test]
    fn b1_turns_are_single_use_expire_and_are_bounded() {
        let mut t = TurnCache::new(4);
        assert!(t.keep("c".into(), ttl(10.0, 1), at(0)));
        assert!(t.take("c", at(0)).is_some());
        assert!(t.take("c", at(0)).is_none(), "single use");
        t.keep("c".into(), ttl(10.0, 1), at(0));
        assert!(t.take("c", at(9)).is_none(), "dropped a second before its TTL");
        assert!(!t.keep("c".into(), ttl(1.0, 1), at(0)) && !t.keep("c".into(), json!({}), at(0)));
        assert!(!t.keep("c".into(), json!({"remote_blocks_ttl_remaining": "x"}), at(0)));
        for i in 0..6 {
            t.keep(format!("c{i}"), ttl(100.0, i), at(0));
        }
        assert_eq!(t.len(), 4);
        assert!(t.take("c0", at(0)).is_none() && t.take("c5", at(0)).is_some(), "the oldest went");
    }

    /// SPEC B1: a turn taken for a request whose prefill never read it goes back with its own
    /// deadline, unless a newer turn of the conversation came meanwhile; and it counts against
    /// the bound like any other.
    #[test]
    fn b1_a_turn_no_prefill_read_goes_back_with_its_deadline() {
        let mut t = TurnCache::default();
        t.keep("c".into(), ttl(10.0, 1), at(0));
        let taken = t.take("c", at(0)).expect("cached");
        t.give_back("c".into(), taken);
        let again = t.take("c", at(5)).expect("given back");
        assert_eq!(again.params["n"], 1);
        t.give_back("c".into(), again);
        assert!(t.take("c", at(9)).is_none(), "still stale a second before its first TTL, not a new one");
        t.keep("c".into(), ttl(10.0, 1), at(0));
        let old = t.take("c", at(0)).expect("cached");
        t.keep("c".into(), ttl(10.0, 2), at(0));
        t.give_back("c".into(), old);
        assert_eq!(t.take("c", at(0)).expect("the newer").params["n"], 2, "a newer turn wins");

        let mut t = TurnCache::new(3);
        t.keep("back".into(), ttl(100.0, 0), at(0));
        let taken = t.take("back", at(0)).expect("cached");
        for i in 0..3 {
            t.keep(format!("c{i}"), ttl(100.0, i), at(0));
        }
        t.give_back("back".into(), taken);
        assert_eq!(t.len(), 3, "bounded");
        assert!(t.take("back", at(0)).is_some() && t.take("c0", at(0)).is_none(), "the oldest went, not the one given back");
    }

    /// SPEC B1, B4: the conversation's turn rides on the prefill leg (and on its retry); D's new
    /// turn is kept at the end of its answer; a turn no prefill read goes back (P refused, no
    /// prefiller reached, a batch).
    #[test]
    fn b1_the_turn_rides_the_prefill_leg_and_goes_back_when_no_prefill_read_it() {
        let c = Cluster::new();
        let mut turns = TurnCache::default();
        turns.keep("c".into(), ttl(30.0, 1), at(0));
        let mut r = route(Some("c"), &mut turns);
        assert!(r.has_turn() && r.keeps_turn());
        let Some(Action::SendPrefill { turn: Some(t), .. }) = r.poll(c.pools()) else { panic!("a prefill leg with the turn") };
        assert_eq!(t["n"], 1);
        r.handle(Event::PrefillFailed("p1 unreachable")).unwrap();
        let Some(Action::SendPrefill { turn: Some(_), retry: true, .. }) = r.poll(c.pools()) else { panic!("the retry, with the turn") };
        r.handle(Event::PrefillAnswered(PrefillAnswer::Other(Answer::Refused))).unwrap();
        let acts = c.drain(&mut r);
        assert!(matches!(&acts[..], [Action::GiveBack { conversation, turn }, Action::RelayWhole { leg: Leg::Prefill }]
            if conversation == "c" && turn.params["n"] == 1));

        // Read by P: not given back; D's new turn kept.
        let mut turns = TurnCache::default();
        turns.keep("c".into(), ttl(30.0, 1), at(0));
        let mut r = route(Some("c"), &mut turns);
        c.drain(&mut r);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Params { lease: true })).unwrap();
        c.drain(&mut r);
        r.handle(Event::DecodeAnswered(Answer::Success)).unwrap();
        c.drain(&mut r);
        r.handle(Event::DecodeDone { turn: Some(ttl(30.0, 2)) }).unwrap();
        assert_eq!(c.drain(&mut r), [Action::KeepTurn { conversation: "c".into(), params: ttl(30.0, 2) }]);

        // A batch: the turn goes back, the decoder computes the prompts, nothing is kept.
        let mut turns = TurnCache::default();
        turns.keep("c".into(), ttl(30.0, 1), at(0));
        let mut r: R = Route::new(Some("c".into()), true, &mut turns, at(0));
        assert!(!r.keeps_turn());
        let acts = c.drain(&mut r);
        assert!(matches!(&acts[..], [Action::GiveBack { .. }, Action::SendLocal { to: "d1" }]), "{acts:?}");
        r.handle(Event::DecodeAnswered(Answer::Success)).unwrap();
        assert_eq!(c.drain(&mut r), [Action::RelayStream]);
        r.handle(Event::DecodeDone { turn: Some(ttl(30.0, 2)) }).unwrap();
        assert_eq!(c.drain(&mut r), []);

        // No prefiller at all: back too.
        let none = Cluster { prefill: Vec::new(), ..Cluster::new() };
        let mut turns = TurnCache::default();
        turns.keep("c".into(), ttl(30.0, 1), at(0));
        let mut r = route(Some("c"), &mut turns);
        assert!(matches!(&none.drain(&mut r)[..], [Action::GiveBack { .. }, Action::Fail { error: RouteError::NoPrefiller, .. }]));
    }

    /// Two push prefillers p1, p2 (coordinates known) and two decoders.
    fn push_cluster() -> Cluster {
        let mut c = Cluster::new();
        c.prefill.iter_mut().for_each(|p| p.push = true);
        c
    }

    fn both(prefill: &'static str, decode: &'static str, retry: bool) -> A {
        Action::SendBoth { prefill, decode, retry }
    }

    /// SPEC U1, U2, U12: a push prefiller gets both legs at once, the decoder picked avoiding
    /// it; D's answer streams once P has answered, whichever answered first; nothing released
    /// (D took the lease).
    #[test]
    fn u1_u2_a_push_prefiller_gets_both_legs_at_once() {
        let c = push_cluster();
        for p_first in [true, false] {
            let mut r = route(None, &mut TurnCache::default());
            assert_eq!(c.drain(&mut r), [both("p1", "d1", false)]);
            assert_eq!((r.prefiller(), r.decoder()), (Some(&"p1"), Some(&"d1")));
            let p = Event::PrefillAnswered(PrefillAnswer::Params { lease: true });
            let d = Event::DecodeAnswered(Answer::Success);
            let (first, second) = if p_first { (p, d) } else { (d, p) };
            r.handle(first).unwrap();
            assert_eq!(c.drain(&mut r), [], "nothing relayed before both legs answered");
            r.handle(second).unwrap();
            assert_eq!(c.drain(&mut r), [Action::RelayStream]);
            r.handle(Event::FirstByteRelayed).unwrap();
            r.handle(Event::DecodeDone { turn: None }).unwrap();
            assert_eq!(c.drain(&mut r), []);
            assert!(r.is_done());
        }
        // Self-pairing is avoided as in pull (O4).
        let both_roles =
            Cluster { prefill: vec![Candidate { upstream: "d1", healthy: true, outstanding: 0, push: true }], ..Cluster::new() };
        let mut r = route(None, &mut TurnCache::default());
        assert_eq!(both_roles.drain(&mut r), [both("d1", "d2", false)]);
        let alone = Cluster { decode: healthy(&["d1"]), ..both_roles };
        let mut r = route(None, &mut TurnCache::default());
        assert_eq!(alone.drain(&mut r), [prefill("d1", false)], "never both legs to one engine");
    }

    /// SPEC §13: a prefiller not known as push (a pull engine, or a push engine whose
    /// coordinates the driver has not learnt yet), a request carrying a cached turn, or no
    /// decoder: the legs go one after the other, as in pull.
    #[test]
    fn u12_legs_go_one_after_the_other_unless_the_prefiller_is_known_push() {
        let mut r = route(None, &mut TurnCache::default());
        assert_eq!(Cluster::new().drain(&mut r), [prefill("p1", false)]);
        let mut turns = TurnCache::default();
        turns.keep("c".into(), json!({"remote_blocks_ttl_remaining": 30.0}), at(0));
        let mut r = route(Some("c"), &mut turns);
        assert!(matches!(&push_cluster().drain(&mut r)[..], [Action::SendPrefill { to: "p1", turn: Some(_), .. }]));
        let no_decoder = Cluster { decode: Vec::new(), ..push_cluster() };
        let mut r = route(None, &mut TurnCache::default());
        assert_eq!(no_decoder.drain(&mut r), [prefill("p1", false)]);
    }

    /// SPEC O2, O4, U9: the prefill leg fails before its answer: the decode leg is dropped (D
    /// aborts and releases, U9), P's lease under the key released (P may have granted it), and
    /// both legs go once more to another prefiller; a second failure fails the request.
    #[test]
    fn o2_u9_a_failed_prefill_leg_cancels_the_decode_leg_and_releases() {
        let c = push_cluster();
        let mut r = route(None, &mut TurnCache::default());
        c.drain(&mut r);
        r.handle(Event::PrefillFailed("p1 unreachable")).unwrap();
        assert_eq!(c.drain(&mut r), [Action::CancelDecode, Action::Release { on: "p1" }, both("p2", "d1", true)]);
        r.handle(Event::DecodeAnswered(Answer::Success)).unwrap();
        r.handle(Event::PrefillFailed("p2 unreachable")).unwrap();
        let fail = Action::Fail { error: RouteError::Leg("p2 unreachable"), relayed: false };
        assert_eq!(c.drain(&mut r), [Action::CancelDecode, Action::Release { on: "p2" }, fail], "D's held answer is never relayed");
        assert!(r.is_done());
        // P answered unreadably: it may hold a lease: dropped and released.
        let mut r = route(None, &mut TurnCache::default());
        c.drain(&mut r);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Unreadable("garbled"))).unwrap();
        let fail = Action::Fail { error: RouteError::Leg("garbled"), relayed: false };
        assert_eq!(c.drain(&mut r), [Action::CancelDecode, Action::Release { on: "p1" }, fail]);
    }

    /// SPEC O2, U9: P refused the prefill leg (it leased nothing): the decode leg is dropped
    /// and P's answer relayed; turned away unread, both legs go to another prefiller.
    #[test]
    fn o2_u9_a_refused_prefill_leg_cancels_the_decode_leg() {
        let c = push_cluster();
        let mut r = route(None, &mut TurnCache::default());
        c.drain(&mut r);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Other(Answer::Refused))).unwrap();
        assert_eq!(c.drain(&mut r), [Action::CancelDecode, Action::RelayWhole { leg: Leg::Prefill }]);
        let mut r = route(None, &mut TurnCache::default());
        c.drain(&mut r);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Other(Answer::TurnedAwayUnread))).unwrap();
        assert_eq!(c.drain(&mut r), [Action::CancelDecode, both("p2", "d1", true)]);
    }

    /// SPEC O3, O4: D refused the decode leg — whether P has answered yet or not — so P's
    /// lease under the key is released at once (one P has not granted yet is refused at its
    /// grant) and D's answer relayed.
    #[test]
    fn o3_a_refused_decode_leg_releases_ps_push_lease_at_once() {
        let c = push_cluster();
        for p_answered in [false, true] {
            let mut r = route(None, &mut TurnCache::default());
            c.drain(&mut r);
            if p_answered {
                r.handle(Event::PrefillAnswered(PrefillAnswer::Params { lease: true })).unwrap();
            }
            r.handle(Event::DecodeAnswered(Answer::Refused)).unwrap();
            assert_eq!(c.drain(&mut r), [Action::Release { on: "p1" }, Action::RelayWhole { leg: Leg::Decode }]);
            assert!(r.is_done());
        }
    }

    /// SPEC O2, O4: the decode leg fails (or is turned away) before its first byte: once more
    /// on another decoder, same transfer, while P may still prefill; when that fails too, P's
    /// lease is released at once and the request fails.
    #[test]
    fn o2_o4_a_failed_push_decode_leg_is_retried_once_then_ps_lease_released() {
        let c = push_cluster();
        let mut r = route(None, &mut TurnCache::default());
        c.drain(&mut r);
        r.handle(Event::DecodeFailed("d1 unreachable")).unwrap();
        assert_eq!(c.drain(&mut r), [decode("d2", true)]);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Params { lease: true })).unwrap();
        r.handle(Event::DecodeFailed("d2 unreachable")).unwrap();
        let fail = Action::Fail { error: RouteError::Leg("d2 unreachable"), relayed: false };
        assert_eq!(c.drain(&mut r), [Action::Release { on: "p1" }, fail]);
        let mut r = route(None, &mut TurnCache::default());
        c.drain(&mut r);
        r.handle(Event::DecodeAnswered(Answer::TurnedAwayUnread)).unwrap();
        assert_eq!(c.drain(&mut r), [decode("d2", true)]);
        r.handle(Event::DecodeAnswered(Answer::Success)).unwrap();
        r.handle(Event::PrefillAnswered(PrefillAnswer::Params { lease: true })).unwrap();
        assert_eq!(c.drain(&mut r), [Action::RelayStream]);
    }

    /// SPEC O4: a push request abandoned (deadline, client gone) while its legs are out: P's
    /// lease under the key is released (P refuses it if a decoder holds it; that decoder sees
    /// its connection close and releases it, U9).
    #[test]
    fn o4_a_push_request_abandoned_releases_ps_lease() {
        let c = push_cluster();
        let mut r = route(None, &mut TurnCache::default());
        c.drain(&mut r);
        r.handle(Event::ClientGone).unwrap();
        assert_eq!(c.drain(&mut r), [Action::Release { on: "p1" }]);
        let mut r = route(None, &mut TurnCache::default());
        c.drain(&mut r);
        r.handle(Event::PrefillAnswered(PrefillAnswer::Params { lease: true })).unwrap();
        r.handle(Event::DeadlinePassed).unwrap();
        assert_eq!(c.drain(&mut r), [Action::Release { on: "p1" }, Action::Fail { error: RouteError::TimedOut, relayed: false }]);
    }

    /// SPEC §13, U1: a push engine's answer gives its coordinates (a pull answer none); the
    /// legs' params name one transfer id, and D reads the decode leg's as push params keyed by it.
    #[test]
    fn u1_push_peers_are_learnt_from_answers_and_both_legs_name_one_transfer() {
        use crate::params::{KvRole, PushAnswer};
        use crate::wire::PushKey;
        let key = PushKey::Request("rid".into());
        let answer =
            PushAnswer { engine_id: "p0", host: "10.0.0.1", port: 7, tp_size: 2, num_tokens: Some(3), incarnation: Some(9), key: &key };
        let peer = PushPeer::from_answer(&answer.to_json()).expect("a push answer");
        assert_eq!(peer, PushPeer { engine_id: "p0".into(), host: "10.0.0.1".into(), port: 7, tp_size: 2 });
        let pull = json!({"do_remote_prefill": true, "remote_engine_id": "p0", "remote_host": "h", "remote_port": 7,
            "remote_block_ids": [1], "remote_lease_id": 3, "remote_request_id": "r"});
        assert_eq!(PushPeer::from_answer(&pull), None);
        let mut no_mode = answer.to_json();
        no_mode.as_object_mut().unwrap().remove("transfer_mode");
        assert_eq!(PushPeer::from_answer(&no_mode), None, "only an answer that says push");
        let KvRole::DecodePush(d) = KvRole::parse(Some(&peer.decode_params("t-1"))).unwrap() else { panic!("push params") };
        assert_eq!(
            (d.key, d.engine_id.as_str(), d.port, d.tp_size, d.pp_size, d.incarnation),
            (PushKey::Transfer("t-1".into()), "p0", 7, 2, 1, 0)
        );
        let p = PushPeer::prefill_params("t-1");
        assert!(matches!(KvRole::parse(Some(&p)), Ok(KvRole::PrefillForRemote(None))));
        assert_eq!(KvRole::transfer_id(Some(&p)), Ok(Some("t-1".into())));
    }

    /// Events out of order change nothing and say so; nothing panics.
    #[test]
    fn a_stray_event_is_refused_and_changes_nothing() {
        let c = Cluster::new();
        let mut r = route(None, &mut TurnCache::default());
        assert!(r.handle(Event::DecodeAnswered(Answer::Success)).is_err());
        assert!(r.handle(Event::FirstByteRelayed).is_err());
        assert_eq!(c.drain(&mut r), [prefill("p1", false)]);
        assert!(r.handle(Event::DecodeFailed("x")).is_err());
        r.handle(Event::PrefillAnswered(PrefillAnswer::Params { lease: true })).unwrap();
        assert!(r.handle(Event::PrefillAnswered(PrefillAnswer::Params { lease: true })).is_err());
        assert_eq!(c.drain(&mut r), [decode("d1", false)]);
    }
}
