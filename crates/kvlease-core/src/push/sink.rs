//! Push mode, D's side (SPEC §13): a request whose KV P writes into blocks D allocated, from
//! admission to the moment D may schedule it, fail it over, or reuse its blocks.
//!
//! * **Renewal from admission** (U2, D1): heartbeats name the transfer's key from
//!   [`PushSink::admit`] on, while the request waits for blocks and before P has granted; one
//!   batched `PushHeartbeat` per P engine per interval I, split at `max_notif_bytes` (D2).
//! * **Registration until heard** (U3): the newest registration goes out again with each
//!   heartbeat round, carrying what is left of D's wait, until P acknowledges it paired with
//!   its lease or reports a write of it: a registration lost on the way is not waited out.
//! * **The tally** (U7): a registration expects one write per destination rank and pipeline
//!   stage; the request is ready only when every one of them was reported done and none failed.
//!   After a failure the policy is applied only once every sibling write stopped — P's running
//!   totals (`PushWriteFailed`) or `PushLost` close the tally — never over a half-written block.
//! * **D's own deadline** (U10): the wait for writes ends at `push_registration_timeout` after
//!   the registration, pushed back by P's progress (its acknowledgements, each new write done).
//!   When it passes, the request fails over to the policy and P is told (`PushRelease`); each
//!   heartbeat tells P how long D still waits, and P posts nothing after that (U8).
//! * **Block reuse** (U8): destination blocks come back ([`PushAction::BlocksFree`]) only after
//!   their writes finished or failed, or P answered a release (`PushLost`), or the write deadline
//!   P was told passed, plus a grace for a write posted at its very end. A write P gave up on
//!   over a transport that cannot cancel it (`PushFailure::TimedOut`, NIXL) has not stopped: the
//!   request fails over at once, into other blocks (`blocks_reusable: false`), and the registered
//!   ones wait for P's `PushLost` (sent once the write ended) or the deadline's bound, which
//!   over such a transport adds the pull mode's quarantine
//!   ([`crate::config::LeaseConfig::quarantine`]) to cover a write P gave up on at its end.
//! * **Aborts** (U9): any abort, before allocation, after registration or on a full prefix hit,
//!   sends `PushRelease` at once.
//! * **Superseded registrations** (U11): a request registered again (new blocks) counts only its
//!   newest registration's completions; an older one's are counted only to free its blocks.
//!
//! A driver (D's engine) calls, in order:
//! 1. [`PushSink::admit`] when the request enters the scheduler (D1);
//! 2. [`PushSink::register`] once its destination blocks are allocated, and sends the message;
//! 3. [`PushSink::on_message`] for every push message from P (`PushRegisterAck`,
//!    `PushWriteDone`, `PushWriteFailed`, `PushLost`);
//! 4. [`PushSink::poll`] from its own timer (not the forward loop, D3), at
//!    [`PushSink::poll_timeout`];
//! 5. [`PushSink::abort`] whenever it gives the request up, [`PushSink::finish`] once a ready
//!    request is decoding,
//!
//! and carries out each [`PushAction`] in order: send, schedule, apply the policy, free blocks.
//! Handshakes stay the driver's (the [`crate::renewer::Renewer`]'s, D5): a `Send` toward an
//! engine without a link waits for it or is dropped; the deadline covers the loss.

use crate::config::{LeaseConfig, LoadFailurePolicy};
use crate::digest::PromptDigest;
use crate::wire::{Message, PushFailure, PushKey, PushRegistration, PushRenewal};
use crate::Nanos;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::Duration;

/// Why a push transfer's KV will not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteLost {
    /// P reported writes failed or not posted (U6), and why.
    Failed(PushFailure),
    /// P holds nothing for the key (U3): ended, released, or never its own.
    LeaseLost,
    /// No progress from P within `push_registration_timeout` (U10).
    TimedOut { waited: Duration },
    /// D has no transfer link to P: the handshake that would carry the registration failed (D5).
    NoLink,
}

impl WriteLost {
    /// A short name for logs and failure labels.
    pub fn kind(&self) -> &'static str {
        match self {
            WriteLost::Failed(why) => why.as_str(),
            WriteLost::LeaseLost => "lease_lost",
            WriteLost::TimedOut { .. } => "push_timed_out",
            WriteLost::NoLink => "no_link",
        }
    }
}

impl fmt::Display for WriteLost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WriteLost::Failed(why) => write!(f, "the prefill engine's writes failed ({})", why.as_str()),
            WriteLost::LeaseLost => write!(f, "the prefill engine holds no lease for the transfer"),
            WriteLost::TimedOut { waited } => write!(f, "no progress from the prefill engine's writes within {waited:?}"),
            WriteLost::NoLink => write!(f, "no transfer link to the prefill engine: its handshake failed"),
        }
    }
}

/// What the request does instead of using P's KV (`kv_load_failure_policy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushVerdict {
    /// Compute the prompt locally (D7 keeps the output the same).
    Recompute(WriteLost),
    /// Fail the request with a clear error.
    Fail(WriteLost),
}

/// What the driver does, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PushAction {
    /// Send `msg` to P engine `engine_id`.
    Send { engine_id: String, msg: Message },
    /// SPEC U7: every expected write landed and none failed: schedule the request.
    Ready { request_id: String },
    /// SPEC U7, U10: the KV will not come; apply the verdict. `blocks_reusable`: every write
    /// stopped, so the request may recompute in its own blocks; otherwise it must not touch them
    /// before [`PushAction::BlocksFree`].
    Failed { request_id: String, verdict: PushVerdict, blocks_reusable: bool },
    /// SPEC U8: the destination blocks of registration `attempt` may be reused now.
    BlocksFree { request_id: String, attempt: u32 },
}

/// Why a registration was not made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("request {0:?} is not admitted for push (or its transfer already ended)")]
    NotAdmitted(String),
    #[error("a push registration expects at least one destination rank and one pipeline stage")]
    NoWrites,
    #[error("{0} writes are more than one registration may expect")]
    TooManyWrites(u64),
}

/// The tally of one registration.
#[derive(Debug)]
struct Tally {
    attempt: u32,
    dst_ranks: u32,
    stages: u32,
    done: BTreeSet<(u32, u32)>,
    /// P's running totals from its failure reports (the largest seen).
    p_done: u32,
    p_failed: u32,
    why: Option<PushFailure>,
    /// P said it holds nothing: every write stopped.
    lost: bool,
    /// P gave a write up that its transport cannot cancel (`PushFailure::TimedOut`): counted
    /// failed, it may still land until P's `PushLost` (U4, U8).
    landing: bool,
    /// The latest write deadline P was told (U8), on D's clock.
    told_until: Nanos,
    /// D answered for this registration already (ready or failed).
    settled: bool,
    /// The registration as sent, and whether P was heard on it: acknowledged it paired with its
    /// lease, or reported a write of it. Until then it goes out again with every heartbeat
    /// round (U3): a registration lost on the way is not waited out.
    reg: PushRegistration,
    heard: bool,
    /// P acknowledged it at least once (a first acknowledgement is progress, a repeated one
    /// before the grant is not: a P that only keeps it does not hold D forever, U10).
    acked: bool,
}

impl Tally {
    fn expected(&self) -> u32 {
        self.dst_ranks * self.stages
    }

    fn done(&self) -> u32 {
        (self.done.len() as u32).max(self.p_done)
    }

    /// Every write stopped: done or failed (none given up on but still landing), or P holds
    /// nothing.
    fn stopped(&self) -> bool {
        self.lost || (!self.landing && self.ended())
    }

    /// Every write is accounted for by P: done, failed or given up on (some may still land).
    fn ended(&self) -> bool {
        self.done() + self.p_failed >= self.expected()
    }

    fn complete(&self) -> bool {
        self.done.len() as u32 >= self.expected() && self.p_failed == 0 && !self.lost
    }
}

/// One request in push mode.
#[derive(Debug)]
struct Sink {
    engine_id: String,
    key: PushKey,
    /// U10: D's wait for writes ends here (pushed back by progress); `None` before registering.
    until: Option<Nanos>,
    /// The newest registration is the last; older ones stay until their blocks are free.
    tallies: Vec<Tally>,
    next_attempt: u32,
    /// D gave up (aborted, failed over) and sent `PushRelease`: nothing is renewed any more.
    released: bool,
    /// The request is ready or failed over; only block bookkeeping is left.
    done: bool,
    /// The registration D scheduled the request over ([`PushAction::Ready`]): its blocks are
    /// the decode's, not handed back. An aborted request whose writes all land later has none.
    ready: Option<u32>,
    /// When D admitted it: a registration tells P its age (SPEC D5: a P that started after
    /// the request's prefill leg went out answers it lost at once).
    admitted: Nanos,
}

/// How long ago D admitted a request admitted at `admitted` (SPEC D5, [`PushRegistration::age_ns`]).
fn age_ns(admitted: Nanos, now: Nanos) -> u64 {
    u64::try_from(now.since(admitted).as_nanos()).unwrap_or(u64::MAX)
}

/// D's push transfers (see the module's documentation).
#[derive(Debug)]
pub struct PushSink {
    cfg: LeaseConfig,
    requests: BTreeMap<String, Sink>,
    /// (P engine, key) → request, to route P's messages.
    by_key: BTreeMap<(String, PushKey), String>,
    /// Per P engine: when its next heartbeat is due.
    due: BTreeMap<String, Nanos>,
    seq: u64,
    /// SPEC U8: whether a write P gave up on stops at once (tcp, mem) or may run on (NIXL).
    fenced_writes: bool,
}

impl PushSink {
    pub fn new(cfg: &LeaseConfig) -> PushSink {
        PushSink { cfg: cfg.clone(), requests: BTreeMap::new(), by_key: BTreeMap::new(), due: BTreeMap::new(), seq: 0, fenced_writes: true }
    }

    /// SPEC U8: whether the transport stops a write its writer gave up on (tcp, mem) or not
    /// (NIXL): then a write P posted just before the deadline and gave up on may land for a
    /// quarantine more, and blocks past the deadline wait that long too. Fenced until told
    /// otherwise; set once the transfer agents are known.
    pub fn set_fenced_writes(&mut self, fenced: bool) {
        self.fenced_writes = fenced;
    }

    /// SPEC U8: how long past the write deadline P was told the blocks of a registration whose
    /// writes did not all stop are kept: [`PushSink::write_grace`], plus the quarantine where
    /// writes are not fenced.
    fn hold_past_deadline(&self) -> Duration {
        let grace = Self::write_grace(&self.cfg);
        if self.fenced_writes {
            grace
        } else {
            grace + self.cfg.quarantine()
        }
    }

    /// SPEC U8: how long past the write deadline P was told D still keeps the blocks: for a
    /// write P posted just before it (P stops a write margin before it) to land.
    pub fn write_grace(cfg: &LeaseConfig) -> Duration {
        cfg.read_timeout()
    }

    /// SPEC D1, U2: request `request_id` entered the scheduler; P engine `engine_id` will write
    /// its KV under `key`. Its lease is renewed from now on, registered or not. Admitting a
    /// request twice changes nothing.
    pub fn admit(&mut self, request_id: &str, engine_id: &str, key: PushKey, now: Nanos) {
        if self.requests.contains_key(request_id) {
            return;
        }
        self.by_key.insert((engine_id.to_owned(), key.clone()), request_id.to_owned());
        self.due.entry(engine_id.to_owned()).or_insert(now + self.cfg.heartbeat_interval);
        self.requests.insert(
            request_id.to_owned(),
            Sink {
                engine_id: engine_id.to_owned(),
                key,
                until: None,
                tallies: Vec::new(),
                next_attempt: 1,
                released: false,
                done: false,
                ready: None,
                admitted: now,
            },
        );
    }

    /// SPEC U1, U8, U10, U11: the request's destination blocks `block_ids` are allocated on
    /// `dst_ranks` ranks, for P's `stages` pipeline stages: the registration to send to P. D
    /// waits `push_registration_timeout` for the writes from now. Registering again supersedes
    /// the last registration (new blocks: the old ones come back by [`PushAction::BlocksFree`]).
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        &mut self,
        request_id: &str,
        incarnation: u64,
        granted_by: u64,
        digest: PromptDigest,
        dst_ranks: u32,
        stages: u32,
        block_ids: Vec<u32>,
        now: Nanos,
    ) -> Result<PushAction, RegisterError> {
        if dst_ranks == 0 || stages == 0 {
            return Err(RegisterError::NoWrites);
        }
        let writes = u64::from(dst_ranks) * u64::from(stages);
        if writes > crate::wire::MAX_PUSH_WRITES {
            return Err(RegisterError::TooManyWrites(writes));
        }
        let timeout = self.cfg.push_registration_timeout;
        let s = self.requests.get_mut(request_id).filter(|s| !s.released && !s.done);
        let Some(s) = s else { return Err(RegisterError::NotAdmitted(request_id.to_owned())) };
        let attempt = s.next_attempt;
        s.next_attempt += 1;
        let until = now + timeout;
        s.until = Some(until);
        for old in &mut s.tallies {
            old.settled = true;
        }
        s.tallies.push(Tally {
            attempt,
            dst_ranks,
            stages,
            done: BTreeSet::new(),
            p_done: 0,
            p_failed: 0,
            why: None,
            lost: false,
            landing: false,
            told_until: until,
            settled: false,
            reg: PushRegistration {
                key: s.key.clone(),
                attempt,
                incarnation,
                granted_by,
                digest,
                dst_ranks,
                stages,
                block_ids: block_ids.clone(),
                window_ns: 0,
                age_ns: 0,
            },
            heard: false,
            acked: false,
        });
        let reg = PushRegistration {
            key: s.key.clone(),
            attempt,
            incarnation,
            granted_by,
            digest,
            dst_ranks,
            stages,
            block_ids,
            window_ns: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
            age_ns: age_ns(s.admitted, now),
        };
        Ok(PushAction::Send { engine_id: s.engine_id.clone(), msg: Message::PushRegister(reg) })
    }

    /// Everything D does with a push message from P engine `engine_id`: acknowledgements and
    /// completions are progress (U10), failures and `PushLost` close the tally (U6, U7), and a
    /// superseded registration's news only frees its blocks (U11).
    pub fn on_message(&mut self, engine_id: &str, msg: &Message, now: Nanos, out: &mut Vec<PushAction>) {
        match msg {
            Message::PushRegisterAck { key, attempt, granted } => {
                self.with(engine_id, key, Some(*attempt), now, out, |t| {
                    let first = !t.acked;
                    t.acked = true;
                    t.heard |= *granted;
                    first || *granted
                });
            }
            Message::PushWriteDone { key, attempt, dst_rank, stage } => {
                let (r, s) = (*dst_rank, *stage);
                self.with(engine_id, key, Some(*attempt), now, out, |t| {
                    t.heard = true;
                    r < t.dst_ranks && s < t.stages && t.done.insert((r, s))
                });
            }
            Message::PushWriteFailed { key, attempt, done, failed, why } => {
                self.with(engine_id, key, Some(*attempt), now, out, |t| {
                    t.heard = true;
                    t.p_done = t.p_done.max(*done);
                    t.p_failed = t.p_failed.max(*failed);
                    t.landing |= *why == PushFailure::TimedOut;
                    t.why.get_or_insert(*why);
                    false
                });
            }
            Message::PushLost { keys } => {
                for key in keys {
                    self.with(engine_id, key, None, now, out, |t| {
                        t.lost = true;
                        false
                    });
                    // Admitted, not registered: the lease is gone all the same.
                    if let Some(req) = self.by_key.get(&(engine_id.to_owned(), key.clone())).cloned() {
                        self.lost_unregistered(&req, WriteLost::LeaseLost, out);
                    }
                }
            }
            _ => {}
        }
    }

    /// SPEC U9: D gives the request up (aborted before allocation, after registration, a full
    /// prefix hit, a refusal): `PushRelease` goes out at once. Its blocks come back by
    /// [`PushAction::BlocksFree`] (at once when nothing was registered or every write stopped).
    pub fn abort(&mut self, request_id: &str, now: Nanos, out: &mut Vec<PushAction>) {
        let Some(s) = self.requests.get_mut(request_id) else { return };
        s.done = true;
        for t in &mut s.tallies {
            t.settled = true;
        }
        if !s.released {
            s.released = true;
            out.push(PushAction::Send { engine_id: s.engine_id.clone(), msg: Message::PushRelease { keys: vec![s.key.clone()] } });
        }
        self.free_blocks(request_id, now, out);
    }

    /// A request that was [`PushAction::Ready`] is decoding: nothing of its transfer is left to
    /// track (P released its lease on the last write, U5).
    pub fn finish(&mut self, request_id: &str, now: Nanos, out: &mut Vec<PushAction>) {
        if let Some(s) = self.requests.get_mut(request_id) {
            s.done = true;
            s.released = true;
        }
        self.free_blocks(request_id, now, out);
    }

    /// SPEC D5, O4: the handshake with P engine `engine_id` failed, so D has no transfer link
    /// to it: no registration reaches it and no write of it lands. Every request registered
    /// with it and not yet answered fails over now (its policy, as pull's requests waiting for
    /// the same handshake are recomputed at once), rather than waiting out
    /// `push_registration_timeout` (U10) in a slot of D's. Its blocks come back as for any
    /// failure (U8: at once unless a write of it may still land). A request not registered yet
    /// registers later, over the next handshake, or fails over at its failure.
    pub fn link_failed(&mut self, engine_id: &str, now: Nanos, out: &mut Vec<PushAction>) {
        let ids: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, s)| s.engine_id == engine_id && !s.done && !s.tallies.is_empty())
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            self.fail(&id, WriteLost::NoLink, now, out);
        }
    }

    /// SPEC D2, D3, U2, U8, U10: heartbeats due, D's deadlines passed, blocks whose write
    /// deadline passed.
    pub fn poll(&mut self, now: Nanos, out: &mut Vec<PushAction>) {
        let ids: Vec<String> = self.requests.keys().cloned().collect();
        for id in &ids {
            let timed_out = self.requests.get(id).is_some_and(|s| !s.done && s.until.is_some_and(|u| now >= u));
            if timed_out {
                let waited = self.cfg.push_registration_timeout;
                self.fail(id, WriteLost::TimedOut { waited }, now, out);
            }
            self.free_blocks(id, now, out);
        }
        let engines: Vec<String> = self.due.iter().filter(|(_, at)| **at <= now).map(|(e, _)| e.clone()).collect();
        for engine in engines {
            let renewals: Vec<PushRenewal> = self
                .requests
                .values()
                .filter(|s| s.engine_id == engine && !s.released && !s.done)
                .map(|s| {
                    let window = s.until.map_or(0, |u| u64::try_from(u.since(now).as_nanos()).unwrap_or(u64::MAX));
                    PushRenewal { key: s.key.clone(), window_ns: window }
                })
                .collect();
            if renewals.is_empty() {
                self.due.remove(&engine);
                continue;
            }
            for t in self.requests.values_mut().filter(|s| s.engine_id == engine && !s.released && !s.done) {
                if let (Some(u), Some(tally)) = (t.until, t.tallies.last_mut()) {
                    tally.told_until = tally.told_until.max(u);
                    if !tally.heard {
                        // U3: not heard on yet (lost, or forgotten by a P that kept it for E with
                        // nobody renewing): again, with what is left of D's wait (U8). A
                        // duplicate is acknowledged and changes nothing (U1).
                        let window_ns = u64::try_from(u.since(now).as_nanos()).unwrap_or(u64::MAX);
                        let reg = PushRegistration { window_ns, age_ns: age_ns(t.admitted, now), ..tally.reg.clone() };
                        out.push(PushAction::Send { engine_id: engine.clone(), msg: Message::PushRegister(reg) });
                    }
                }
            }
            for chunk in chunks(renewals, self.cfg.max_notif_bytes) {
                self.seq += 1;
                out.push(PushAction::Send { engine_id: engine.clone(), msg: Message::PushHeartbeat { seq: self.seq, renewals: chunk } });
            }
            self.due.insert(engine, now + self.cfg.heartbeat_interval);
        }
    }

    /// When [`PushSink::poll`] must run next.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        let grace = self.hold_past_deadline();
        let mut next = self.due.values().min().copied();
        for s in self.requests.values() {
            let mut at = |t: Nanos| next = Some(next.map_or(t, |n| n.min(t)));
            if let Some(u) = s.until.filter(|_| !s.done) {
                at(u);
            }
            for t in s.tallies.iter().filter(|t| !t.stopped()) {
                at(t.told_until + grace);
            }
        }
        next
    }

    /// SPEC U8: whether registration `attempt`'s destination blocks may be reused now.
    pub fn blocks_reusable(&self, request_id: &str, attempt: u32, now: Nanos) -> bool {
        let Some(s) = self.requests.get(request_id) else { return true };
        s.tallies.iter().find(|t| t.attempt == attempt).is_none_or(|t| self.reusable(s, t, now))
    }

    /// SPEC U4, U8, U11, S4: D's write gate. May P engine `engine_id` write `blocks` (in the
    /// order its write names them) of registration `attempt` of `key`, showing `digest`? Only
    /// into the newest registration of a request still waiting for it, a run of its blocks in
    /// their order (all of them, or the part an early write fills while P still prefills), for
    /// its prompt, before the write deadline P was told (plus the grace a write posted at its
    /// end needs to land).
    pub fn may_write(&self, engine_id: &str, key: &PushKey, attempt: u32, blocks: &[u32], digest: &[u8], now: Nanos) -> bool {
        let Some(id) = self.by_key.get(&(engine_id.to_owned(), key.clone())) else { return false };
        let Some(s) = self.requests.get(id).filter(|s| !s.done && !s.released) else { return false };
        let Some(t) = s.tallies.last().filter(|t| t.attempt == attempt && !t.settled && !t.stopped()) else { return false };
        let run = blocks.first().and_then(|first| t.reg.block_ids.iter().position(|b| b == first));
        run.is_some_and(|i| t.reg.block_ids[i..].starts_with(blocks))
            && t.reg.digest.0[..] == *digest
            && now < t.told_until + Self::write_grace(&self.cfg)
    }

    /// SPEC U1: whether another request here already waits for P engine `engine_id`'s writes
    /// under `key` (a replayed or duplicated decode leg): it must not take the transfer over.
    pub fn key_taken(&self, engine_id: &str, key: &PushKey) -> bool {
        self.by_key.get(&(engine_id.to_owned(), key.clone())).is_some_and(|r| self.requests.contains_key(r))
    }

    /// Requests tracked.
    pub fn tracked(&self) -> usize {
        self.requests.len()
    }

    /// Whether `request_id` is tracked (its lease renewed, or its blocks not yet free).
    pub fn is_tracked(&self, request_id: &str) -> bool {
        self.requests.contains_key(request_id)
    }

    fn reusable(&self, s: &Sink, t: &Tally, now: Nanos) -> bool {
        let superseded = s.tallies.last().is_some_and(|last| last.attempt != t.attempt);
        (s.done || superseded) && (t.stopped() || now >= t.told_until + self.hold_past_deadline())
    }

    /// Applies news from P to the registration `attempt` of `key` (every registration of it
    /// when `None`), and decides; `apply` says whether the news moved a registration on.
    fn with(
        &mut self,
        engine_id: &str,
        key: &PushKey,
        attempt: Option<u32>,
        now: Nanos,
        out: &mut Vec<PushAction>,
        apply: impl Fn(&mut Tally) -> bool,
    ) {
        let Some(req) = self.by_key.get(&(engine_id.to_owned(), key.clone())).cloned() else { return };
        let timeout = self.cfg.push_registration_timeout;
        let Some(s) = self.requests.get_mut(&req) else { return };
        let newest = s.tallies.last().map(|t| t.attempt);
        let mut progress = false;
        for i in 0..s.tallies.len() {
            if attempt.is_some_and(|a| a != s.tallies[i].attempt) {
                continue;
            }
            let t = &mut s.tallies[i];
            let moved = apply(t);
            progress |= moved && Some(t.attempt) == newest;
        }
        if progress && !s.done {
            // U10: P's progress pushes D's wait back; the next heartbeat tells P (U8).
            s.until = s.until.map(|u| u.max(now + timeout));
        }
        self.decide(&req, now, out);
    }

    /// SPEC U7: ready when every write landed and none failed; after a failure, the policy once
    /// every sibling stopped.
    fn decide(&mut self, req: &str, now: Nanos, out: &mut Vec<PushAction>) {
        let Some(s) = self.requests.get_mut(req) else { return };
        if !s.done {
            if let Some(t) = s.tallies.last_mut().filter(|t| !t.settled) {
                if t.complete() {
                    t.settled = true;
                    s.ready = Some(t.attempt);
                    s.done = true;
                    s.released = true;
                    out.push(PushAction::Ready { request_id: req.to_owned() });
                } else if t.lost || (t.p_failed > 0 && t.ended()) {
                    // Every write stopped, or P gave up on those still landing (U4): the policy
                    // now, in other blocks if some may still land ([`PushSink::fail`]).
                    let why = if t.lost && t.p_failed == 0 {
                        WriteLost::LeaseLost
                    } else {
                        WriteLost::Failed(t.why.unwrap_or(PushFailure::WriteError))
                    };
                    self.fail(req, why, now, out);
                }
            }
        }
        self.free_blocks(req, now, out);
    }

    /// The request fails over (U7, U10): the verdict, and `PushRelease` to P (U9).
    fn fail(&mut self, req: &str, why: WriteLost, now: Nanos, out: &mut Vec<PushAction>) {
        let policy = self.cfg.load_failure_policy;
        let Some(s) = self.requests.get_mut(req) else { return };
        s.done = true;
        let reusable = s.tallies.last().is_none_or(Tally::stopped);
        for t in &mut s.tallies {
            t.settled = true;
        }
        if !s.released {
            s.released = true;
            out.push(PushAction::Send { engine_id: s.engine_id.clone(), msg: Message::PushRelease { keys: vec![s.key.clone()] } });
        }
        let verdict = match policy {
            LoadFailurePolicy::Recompute => PushVerdict::Recompute(why),
            LoadFailurePolicy::Fail => PushVerdict::Fail(why),
        };
        out.push(PushAction::Failed { request_id: req.to_owned(), verdict, blocks_reusable: reusable });
        self.free_blocks(req, now, out);
    }

    /// `PushLost` for a request admitted but not registered: its lease is gone (U3).
    fn lost_unregistered(&mut self, req: &str, why: WriteLost, out: &mut Vec<PushAction>) {
        let Some(s) = self.requests.get_mut(req) else { return };
        if s.done || !s.tallies.is_empty() {
            return;
        }
        s.released = true;
        let verdict = match self.cfg.load_failure_policy {
            LoadFailurePolicy::Recompute => PushVerdict::Recompute(why),
            LoadFailurePolicy::Fail => PushVerdict::Fail(why),
        };
        out.push(PushAction::Failed { request_id: req.to_owned(), verdict, blocks_reusable: true });
        self.forget(req);
    }

    /// SPEC U8: hands back the blocks of every registration of `req` that may be reused now;
    /// forgets the request once nothing of it is left.
    fn free_blocks(&mut self, req: &str, now: Nanos, out: &mut Vec<PushAction>) {
        let Some(s) = self.requests.get(req) else { return };
        let free: Vec<u32> = s.tallies.iter().filter(|t| self.reusable(s, t, now)).map(|t| t.attempt).collect();
        // A ready request's blocks hold its KV: they are the decode's now, not free. (Not every
        // complete tally: a request aborted after registration may see its last write land.)
        let decoding = s.ready;
        let Some(s) = self.requests.get_mut(req) else { return };
        for attempt in free {
            s.tallies.retain(|t| t.attempt != attempt);
            if decoding != Some(attempt) {
                out.push(PushAction::BlocksFree { request_id: req.to_owned(), attempt });
            }
        }
        if s.done && s.tallies.is_empty() {
            self.forget(req);
        }
    }

    fn forget(&mut self, req: &str) {
        if let Some(s) = self.requests.remove(req) {
            self.by_key.remove(&(s.engine_id, s.key));
        }
    }
}

/// Splits renewals into heartbeats of at most `max_bytes` each (SPEC D2); each holds at least one.
fn chunks(renewals: Vec<PushRenewal>, max_bytes: usize) -> Vec<Vec<PushRenewal>> {
    // Header, seq and count; per renewal a kind byte, a length, the text, a window.
    const OVERHEAD: usize = 24;
    let cost = |r: &PushRenewal| match &r.key {
        PushKey::Transfer(s) | PushKey::Request(s) => 1 + 5 + s.len() + 10,
        PushKey::Lease(_) => 1 + 10 + 10,
    };
    let budget = max_bytes.saturating_sub(OVERHEAD);
    let mut out: Vec<Vec<PushRenewal>> = Vec::new();
    let mut used = 0;
    for r in renewals {
        let c = cost(&r);
        match out.last_mut() {
            Some(last) if used + c <= budget => {
                used += c;
                last.push(r);
            }
            _ => {
                used = c;
                out.push(vec![r]);
            }
        }
    }
    out
}
