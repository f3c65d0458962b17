//! Push mode, P's side (SPEC §13): the lease over a request's source blocks while P **writes**
//! its KV into the destination blocks D registered, under the rules of §4 with the read replaced
//! by P's write.
//!
//! * **Pairing** (U1): a transfer is named by a [`PushKey`] on both sides; a registration pairs
//!   with the one lease P granted under that key, a duplicate is acknowledged and changes nothing,
//!   a key already granted is never granted again (two dispatches never cross-match).
//! * **Before the grant** (U2): D renews and registers from the moment it admits the request,
//!   often before P's prefill is done. What D said is kept under the key ([`PushSource`] holds it
//!   while D keeps renewing, at most [`PENDING_MEMORY`] keys) and applied at the grant: the kept
//!   renewal renews the new lease for the engine that sent it (S5), as
//!   [`crate::issued::IssuedLeases::name`] does for vLLM's ids, through the same
//!   [`LeaseTable::renew`].
//! * **Lost at once** (U3, P6): a registration, renewal or release of a key whose lease ended
//!   (remembered for [`ENDED_MEMORY`] keys), of a lease id not live, or of another engine's key,
//!   is answered `PushLost` — except its holder's renewal or registration of a key that ended
//!   because every write landed (U5): that is answered with the `PushWriteDone`s again (the
//!   holder has not heard them: one was lost or overtaken), so D never recomputes KV that
//!   landed whole.
//! * **The write gate** (U4, U8, U11, S4): [`PushSource::begin_write`] is asked right before a
//!   write is posted (also after a handshake that came late): the lease is live and the
//!   registration's engine holds it, the registration is the newest, its digest is the one of
//!   P's prefill, and D's write deadline is at least the write margin away. A write in flight
//!   holds the source blocks (the table's read ticket, P5 with the roles swapped) until
//!   [`PushSource::end_write`].
//! * **Early writes** (U4): blocks P's prefill has computed may be written into D's newest
//!   registration before the grant, and after it until the transfer's first write
//!   ([`PushSource::begin_early_write`]); they count toward no completion, and while one is in
//!   flight P's blocks stay out of the pool and no failure reaches D as final.
//! * **A write given up on** (U4, U8): a write that outlives P's write timeout is failed toward
//!   D at once ([`PushSource::abandon_write`]: D fails over, the lease ends, nothing more is
//!   posted), but where the transport cannot cancel a write (NIXL: a dropped future does not
//!   stop the WRITE) it is still in flight: its source blocks stay out of the pool, held by the
//!   pull mode's [`Quarantine`], until the transport says it ended
//!   ([`PushSource::abandoned_write_ended`]) or the quarantine passes; D is told `TimedOut`
//!   (not stopped) and hears `PushLost` only then, so it recomputes into other blocks and reuses
//!   the registered ones only after that. Where writes are fenced (tcp, mem: a dropped write
//!   reads no source block and lands no byte more), giving up is ending it.
//! * **Completion** (U5, P3, P8): each write (destination rank × pipeline stage) is reported to D;
//!   the last success of every expected write ends the lease as `transferred`, exactly once; a
//!   late completion changes nothing.
//! * **Failures** (U6): a write that ended in error or could not be posted, D's deadline passing,
//!   the lease expiring, a digest or incarnation mismatch, P's abort or shutdown: each sends D a
//!   `PushWriteFailed` with P's running totals of writes done and failed, so D's tally closes.
//!
//! Sans-io like [`crate::holder::LeaseHolder`]: what a call decided comes back in a
//! [`PushSettled`] — messages to send (each to the engine named), leases ended, blocks to give
//! back, transfers ready to write.
//!
//! A driver (P's engine) calls, in order:
//! 1. [`PushSource::on_message`] for every `PushRegister`, `PushHeartbeat` and `PushRelease`
//!    from a D engine (named as the transport authenticated it), at any time, also before the
//!    grant;
//! 2. [`PushSource::grant`] when the request's prefill finished normally (P1), with the key its
//!    params carry ([`PushKey::choose`]); or [`PushSource::abort`] if it was aborted;
//! 3. for each [`WriteJob`] in [`PushSettled::ready`]: for each destination rank and pipeline
//!    stage, [`PushSource::begin_write`] right before posting the write, and
//!    [`PushSource::end_write`] when the transport reports it done or failed;
//!    [`PushSource::fail_writes`] when writes cannot be posted at all (no handshake toward D);
//! 4. [`PushSource::poll`] from the reaper, at [`PushSource::poll_timeout`];
//!    [`PushSource::shutdown`] on exit.

use crate::config::LeaseConfig;
use crate::digest::PromptDigest;
use crate::holder::{BlockGuard, Ended, GrantError};
use crate::lease_table::{Holder, LeasePayload, LeaseTable, ReadTicket, ReleaseReason, Released, REAP_BUDGET};
use crate::quarantine::Quarantine;
use crate::wire::{Message, PushFailure, PushKey, PushRegistration};
use crate::{LeaseId, Nanos};
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

/// How many keys not granted yet P keeps what D said about at once; past that, a new one is
/// answered lost at once (D recomputes) rather than growing without bound.
pub const PENDING_MEMORY: usize = 1 << 14;

/// How many ended keys are remembered, so a late registration or renewal of one is answered
/// lost at once (U3) and a late grant under one is refused.
pub const ENDED_MEMORY: usize = 1 << 16;

/// What P keeps under a push lease.
#[derive(Debug)]
struct Source<B> {
    blocks: B,
    request: String,
    /// SPEC S4, U11: the digest of the tokens P prefilled ([`PromptDigest::of`]).
    digest: PromptDigest,
}

impl<B> LeasePayload for Source<B> {
    fn prompt_digest(&self) -> Option<&PromptDigest> {
        Some(&self.digest)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Write {
    Posted,
    Done,
    Failed,
    /// Given up on (counted failed, D told) but still in flight: the transport cannot cancel it
    /// (U4). Stops when the transport says so or its quarantine ends.
    Abandoned,
}

/// One registration of D's destination blocks.
#[derive(Debug)]
struct Reg {
    reg: PushRegistration,
    /// SPEC U8: D's write deadline on P's clock (the latest D told, counted from receipt).
    post_until: Nanos,
    writes: BTreeMap<(u32, u32), Write>,
    done: u32,
    failed: u32,
    /// Handed to the driver as a [`WriteJob`] already.
    announced: bool,
    /// Why its writes failed, as first reported to D (told again to a duplicate, U6).
    why: Option<PushFailure>,
    /// Early writes (of blocks already computed, before the grant) posted and not ended.
    early: u32,
    /// Handed to the driver as an [`EarlyJob`] already.
    early_announced: bool,
    /// A failure report held back while early writes were in flight (U7): sent when the last
    /// of them ends.
    deferred: bool,
}

impl Reg {
    fn new(reg: PushRegistration, post_until: Nanos) -> Reg {
        Reg {
            reg,
            post_until,
            writes: BTreeMap::new(),
            done: 0,
            failed: 0,
            announced: false,
            why: None,
            early: 0,
            early_announced: false,
            deferred: false,
        }
    }

    fn expected(&self) -> u32 {
        self.reg.dst_ranks.saturating_mul(self.reg.stages)
    }

    /// A write is posted and has not stopped (one given up on but uncancellable included).
    fn in_flight(&self) -> bool {
        self.early > 0 || self.writes.values().any(|w| matches!(w, Write::Posted | Write::Abandoned))
    }

    /// Every expected write stopped (done or failed): nothing can land in D's blocks any more.
    fn closed(&self) -> bool {
        self.done + self.failed >= self.expected()
    }

    /// The failure report to D (U6), remembered to be told again. Held back while early writes
    /// are in flight (U7: D acts on a failure as "nothing more lands in these blocks"; it is
    /// sent when the last of them ends), except `TimedOut`, which tells D exactly that a write
    /// may still land (it fails over elsewhere and keeps the blocks until `PushLost`).
    fn failed_msg(&mut self, why: PushFailure) -> Option<Message> {
        self.why.get_or_insert(why);
        if self.early > 0 && why != PushFailure::TimedOut {
            self.deferred = true;
            return None;
        }
        Some(self.report(why))
    }

    fn report(&self, why: PushFailure) -> Message {
        Message::PushWriteFailed { key: self.reg.key.clone(), attempt: self.reg.attempt, done: self.done, failed: self.failed, why }
    }

    /// Fails every write not posted yet; returns how many.
    fn fail_unposted(&mut self) -> u32 {
        let mut n = 0;
        for r in 0..self.reg.dst_ranks {
            for s in 0..self.reg.stages {
                if let std::collections::btree_map::Entry::Vacant(v) = self.writes.entry((r, s)) {
                    v.insert(Write::Failed);
                    n += 1;
                }
            }
        }
        self.failed += n;
        n
    }
}

/// Everything P knows of one key.
#[derive(Debug)]
struct Transfer<B> {
    /// SPEC S5: the engine that renewed or registered first, and its name, to address it.
    holder: Option<(Holder, String)>,
    lease: Option<LeaseId>,
    /// Before the grant: when D last named the key (kept while D renews it).
    seen: Nanos,
    /// Registrations, oldest first; the last is the newest, older ones stay only while writes of
    /// theirs are in flight (U11: they are reported stopped when they end).
    regs: Vec<Reg>,
    /// D released it, or the lease ended: answer `PushLost` to the holder once no write is in flight.
    ending: bool,
    /// U5: every expected write of this registration landed and the lease ended `transferred`.
    transferred: Option<Landed>,
    /// U4: source blocks that came back (an abort, a refused grant) while early writes of the key
    /// were in flight: out of the pool until the last of them ends.
    held: Vec<B>,
    /// U4: the lease's blocks held for early writes in flight when it was granted or posted
    /// after it.
    early_reads: Vec<ReadTicket>,
    /// U4: the lease was granted to the prefill that writes early (on its very blocks), so its
    /// early writer may go on after the grant; another prefill's early writer may not.
    early_granted: bool,
}

impl<B> Transfer<B> {
    fn new(holder: Option<(Holder, String)>, now: Nanos) -> Self {
        Transfer {
            holder,
            lease: None,
            seen: now,
            regs: Vec::new(),
            ending: false,
            transferred: None,
            held: Vec::new(),
            early_reads: Vec::new(),
            early_granted: false,
        }
    }

    fn in_flight(&self) -> bool {
        self.regs.iter().any(Reg::in_flight)
    }

    fn early_in_flight(&self) -> bool {
        self.regs.iter().any(|r| r.early > 0)
    }
}

/// A prefill that may write early (SPEC U4): its request, its prompt's digest and its source
/// blocks, which name it among prefills under the same key (two dispatches hold different blocks).
#[derive(Debug)]
struct Prefill {
    request: String,
    digest: PromptDigest,
    blocks: Vec<u32>,
}

/// A transfer whose every write landed (U5): what its holder is told again if its renewal of
/// the key arrives after the lease ended, instead of `PushLost` — a `PushWriteDone` that a
/// later message overtook, or that was lost, must not make D recompute KV that landed whole.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Landed {
    holder: String,
    attempt: u32,
    dst_ranks: u32,
    stages: u32,
}

/// A transfer whose lease is granted and whose registration is paired with it: the driver may
/// post its writes, one per destination rank and pipeline stage, each through
/// [`PushSource::begin_write`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteJob {
    pub key: PushKey,
    pub attempt: u32,
    pub lease_id: LeaseId,
    /// The D engine to write to (its holder name, as the transport authenticated it).
    pub to: String,
    pub dst_ranks: u32,
    pub stages: u32,
    /// D's destination blocks, in order.
    pub block_ids: Vec<u32>,
    /// P's source blocks, in order (the lease's): block `i` is written into `block_ids[i]`.
    pub src_blocks: Vec<u32>,
    /// The prompt's digest, shown to D's write gate with every write (SPEC S4, U11).
    pub digest: PromptDigest,
    pub request: String,
}

/// A transfer whose registration came while P still prefills (SPEC U4, early writes): the
/// driver may write the blocks its prefill has computed so far, each through
/// [`PushSource::begin_early_write`], before the grant (and after it, until the transfer's
/// first write: the blocks computed as the prefill ended). Early writes count toward nothing: the
/// transfer completes only by the [`WriteJob`]'s writes after the grant (which carry what the
/// early writes did not, possibly nothing), each through [`PushSource::begin_write`], so a
/// completion always follows the prefill's end and the grant's checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EarlyJob {
    pub key: PushKey,
    pub attempt: u32,
    /// The D engine to write to (its holder name, as the transport authenticated it).
    pub to: String,
    pub dst_ranks: u32,
    /// D's destination blocks, in order.
    pub block_ids: Vec<u32>,
    /// The prompt's digest, shown to D's write gate with every write (SPEC S4, U11).
    pub digest: PromptDigest,
}

/// An early write posted (SPEC U4): hand it back to [`PushSource::end_early_write`]. Until then
/// the source blocks are not reused and no failure is reported to D as final.
#[derive(Debug)]
#[must_use = "an early write ticket must be ended, or the key's blocks are never reused"]
pub struct EarlyTicket {
    key: PushKey,
    attempt: u32,
}

/// A message for the D engine named `to` (as its holder name came to
/// [`PushSource::on_message`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub to: String,
    pub msg: Message,
}

/// What a call of [`PushSource`] leaves the driver to carry out.
#[derive(Debug)]
pub struct PushSettled<B> {
    /// Messages to send, in order.
    pub send: Vec<Outgoing>,
    /// Leases that ended, each exactly once (P3).
    pub ended: Vec<Ended>,
    /// Source blocks to give back to the pool now.
    pub freed: Vec<B>,
    /// Transfers now ready to write.
    pub ready: Vec<WriteJob>,
    /// Transfers whose blocks may be written as P's prefill computes them (before the grant).
    pub early: Vec<EarlyJob>,
    /// [`PushSource::poll_timeout`] may have moved earlier.
    pub rearm: bool,
}

impl<B> Default for PushSettled<B> {
    fn default() -> Self {
        PushSettled { send: Vec::new(), ended: Vec::new(), freed: Vec::new(), ready: Vec::new(), early: Vec::new(), rearm: false }
    }
}

/// A write posted: hand it back to [`PushSource::end_write`]. Until then the source blocks are
/// not reused, whatever happens to the lease (U4).
#[derive(Debug)]
#[must_use = "a write ticket must be ended, or the lease's blocks are never reused"]
pub struct WriteTicket {
    key: PushKey,
    attempt: u32,
    dst_rank: u32,
    stage: u32,
    read: ReadTicket,
}

impl WriteTicket {
    pub fn key(&self) -> &PushKey {
        &self.key
    }
}

/// A write given up on that the transport cannot cancel: held in the quarantine with its
/// ticket's hold on the source blocks (U4).
#[derive(Debug)]
struct Abandoned {
    id: u64,
    key: PushKey,
    attempt: u32,
    /// An early write (before the grant: its hold is the key's early count), or the transfer's
    /// write of this destination rank and stage, holding the lease's blocks with its ticket.
    write: AbandonedWrite,
}

#[derive(Debug)]
enum AbandonedWrite {
    Early,
    Transfer { dst_rank: u32, stage: u32, read: ReadTicket },
}

/// Why a write may not be posted now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WriteRefused {
    /// SPEC U4: no live lease under the key (or another engine's registration).
    #[error("the lease is not live")]
    NotLive,
    /// SPEC U11: the write names a registration D has superseded, or none.
    #[error("the write names a registration that is not D's newest")]
    NotRegistered,
    /// The write is outside the registration's ranks and stages, or was posted already.
    #[error("the write is not one the registration expects, or was posted already")]
    NotExpected,
    /// SPEC U8: D's write deadline is too close (the write is failed and D told).
    #[error("D's write deadline is too close to post the write")]
    Deadline,
}

/// Why a push lease was not granted; the blocks come back at once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushGrantError {
    #[error(transparent)]
    Grant(#[from] GrantError),
    /// SPEC U1: a lease is already granted under this key: two dispatches never cross-match.
    #[error("a lease is already granted under {0}")]
    KeyTaken(PushKey),
    /// SPEC U9, O3: D released the key (or P aborted it) before the grant: nobody will take it.
    #[error("{0} was released before the grant")]
    Released(PushKey),
}

/// A push lease just granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushGranted {
    pub lease_id: LeaseId,
    /// The key the lease is paired by (the lease id itself when the params named no other).
    pub key: PushKey,
    /// The digest of the prefilled tokens a registration must show (U11).
    pub digest: PromptDigest,
    pub expiry: Nanos,
}

/// SPEC D5: how much later than its decode leg a request's prefill leg may reach P (a router
/// sends both at once). A registration for an unknown key from a request D admitted longer ago
/// than P has lived, by more than this, is from before P started ([`PushSource::started_at`]).
pub const PREFILL_LEG_SKEW: Duration = Duration::from_secs(1);

/// P's push leases (see the module's documentation).
#[derive(Debug)]
pub struct PushSource<B> {
    table: LeaseTable<Source<B>>,
    cfg: LeaseConfig,
    incarnation: u64,
    /// SPEC D5: when this incarnation started, if the driver said ([`PushSource::started_at`]).
    started: Option<Nanos>,
    keys: HashMap<PushKey, Transfer<B>>,
    /// SPEC U4: keys whose prefill runs here now (early writes allowed), with the request and
    /// the digest of its tokens.
    prefilling: HashMap<PushKey, Prefill>,
    by_lease: HashMap<LeaseId, PushKey>,
    pending: usize,
    /// Keys that ended, and for those whose every write landed, what was written (U3, U5).
    ended: HashMap<PushKey, Option<Landed>>,
    ended_order: VecDeque<PushKey>,
    /// When keys must be looked at again (a pending key nobody renews, a posting deadline);
    /// entries may be stale and are checked when due.
    timers: BTreeSet<(Nanos, PushKey)>,
    /// SPEC U4: whether a dropped write stops at once (tcp, mem) or runs on (NIXL).
    fenced_writes: bool,
    /// SPEC U4: writes given up on that may still read their source blocks.
    abandoned: Quarantine<Abandoned>,
    next_abandoned: u64,
}

impl<B: BlockGuard> PushSource<B> {
    /// The push leases of this engine in its incarnation `incarnation`.
    pub fn new(cfg: &LeaseConfig, incarnation: u64) -> Self {
        PushSource {
            table: LeaseTable::new(cfg),
            cfg: cfg.clone(),
            incarnation,
            started: None,
            keys: HashMap::new(),
            prefilling: HashMap::new(),
            by_lease: HashMap::new(),
            pending: 0,
            ended: HashMap::new(),
            ended_order: VecDeque::new(),
            timers: BTreeSet::new(),
            fenced_writes: true,
            abandoned: Quarantine::new(cfg, true),
            next_abandoned: 1,
        }
    }

    /// SPEC D5: this incarnation of the engine started at `at` (its clock): a registration for a
    /// key it never heard of, from a request D admitted before that by more than
    /// [`PREFILL_LEG_SKEW`], had its prefill at an earlier incarnation, and is answered lost at
    /// once. Without it no registration is judged by its age.
    pub fn started_at(mut self, at: Nanos) -> Self {
        self.started = Some(at);
        self
    }

    /// SPEC D5, §3: whether a registration for a key this engine holds nothing of, whose request
    /// D admitted `age_ns` before sending it, is from before this incarnation started: its
    /// prefill leg (sent with its decode leg) reached an earlier one, with the lease and the key.
    fn before_my_time(&self, age_ns: u64, now: Nanos) -> bool {
        let Some(started) = self.started else { return false };
        let lived = now.since(started);
        age_ns > 0 && Duration::from_nanos(age_ns) > lived + PREFILL_LEG_SKEW
    }

    /// SPEC U4: whether the transport stops a write whose future is dropped — reads none of its
    /// source blocks and lands no byte more after that (tcp, mem); NIXL cannot (its WRITE runs to
    /// its end). Fenced until told otherwise; set once the transfer agents are known, before any
    /// write is posted.
    pub fn set_fenced_writes(&mut self, fenced: bool) {
        self.fenced_writes = fenced;
        self.abandoned = Quarantine::new(&self.cfg, fenced);
    }

    /// SPEC U8: how far before D's write deadline P posts no more writes: a write posted at
    /// the limit lands before D may reuse the blocks ([`crate::push::sink::PushSink`] waits a
    /// grace past the deadline too).
    pub fn write_margin(cfg: &LeaseConfig) -> Duration {
        cfg.read_budget()
    }

    /// SPEC P1, U1, U2: the prefill of `request` finished normally: a lease of L on `blocks`,
    /// paired by `key` (the lease id when `None`). A registration and a renewal D sent before
    /// are applied now; if D's registration is here, the transfer is ready to write.
    pub fn grant(
        &mut self,
        now: Nanos,
        key: Option<PushKey>,
        request: &str,
        blocks: B,
        tokens: &[u32],
        out: &mut PushSettled<B>,
    ) -> Result<PushGranted, PushGrantError> {
        // The prefill that writes early is this one if it holds these very blocks.
        let early = key.as_ref().is_some_and(|k| self.prefilling.get(k).is_some_and(|p| p.request == request && p.blocks == blocks.ids()));
        if early {
            if let Some(k) = &key {
                self.prefilling.remove(k);
            }
        }
        if blocks.ids().is_empty() {
            out.freed.push(blocks);
            return Err(GrantError::NoBlocks.into());
        }
        if let Some(k) = &key {
            if self.ended.contains_key(k) {
                out.freed.push(blocks);
                return Err(PushGrantError::Released(k.clone()));
            }
            if self.keys.get(k).is_some_and(|t| t.lease.is_some()) {
                self.free_or_hold(k, blocks, out);
                return Err(PushGrantError::KeyTaken(k.clone()));
            }
            if self.keys.get(k).is_some_and(|t| t.ending) {
                // Released (or given up) while early writes were in flight: it ends with them.
                self.free_or_hold(k, blocks, out);
                return Err(PushGrantError::Released(k.clone()));
            }
        }
        let digest = PromptDigest::of(tokens);
        let n = blocks.ids().len() as u32;
        let lease_id = self.table.grant(now, n, Source { blocks, request: request.to_owned(), digest });
        let key = key.unwrap_or(PushKey::Lease(lease_id));
        self.by_lease.insert(lease_id, key.clone());
        let t = match self.keys.get_mut(&key) {
            Some(t) => {
                self.pending -= 1;
                t
            }
            None => self.keys.entry(key.clone()).or_insert(Transfer::new(None, now)),
        };
        t.lease = Some(lease_id);
        t.early_granted = early;
        // U2: the renewal D sent before the grant was acknowledged as kept: it holds now.
        let mut released = Vec::new();
        if let Some((h, _)) = &t.holder {
            self.table.renew(*h, &[lease_id], now, &mut Vec::new(), &mut released);
            // U4: early writes still in flight read these blocks: each holds them like a read.
            for _ in 0..t.regs.iter().map(|r| r.early).sum::<u32>() {
                if let Some(read) = self.table.begin_read(*h, lease_id, Some(digest), now, &mut released) {
                    t.early_reads.push(read);
                }
            }
        }
        self.settle(now, released, out);
        self.pair(&key, now, out);
        out.rearm = true;
        Ok(PushGranted { lease_id, key, digest, expiry: now + self.cfg.lease_duration })
    }

    /// Everything P does with a push message from D engine `from` (its holder name, as the
    /// transport authenticated it): `PushRegister` (U1, U3, U11), `PushHeartbeat` (U2, U3, U8),
    /// `PushRelease` (U9). Answers go into `out.send`.
    pub fn on_message(&mut self, from: &str, msg: &Message, now: Nanos, out: &mut PushSettled<B>) {
        let holder = self.table.holder(from);
        match msg {
            Message::PushRegister(reg) => self.register(holder, from, reg, now, out),
            Message::PushHeartbeat { renewals, .. } => {
                let mut lost = Vec::new();
                for r in renewals {
                    if !self.renew(holder, from, &r.key, r.window_ns, now, out)
                        && !self.lost_later(holder, &r.key)
                        && !self.tell_landed(from, &r.key, None, out)
                    {
                        lost.push(r.key.clone());
                    }
                }
                if !lost.is_empty() {
                    out.send.push(Outgoing { to: from.to_owned(), msg: Message::PushLost { keys: lost } });
                }
            }
            Message::PushRelease { keys } => {
                let mut lost = Vec::new();
                for k in keys {
                    if self.release(holder, k, now, out) {
                        lost.push(k.clone());
                    }
                }
                if !lost.is_empty() {
                    out.send.push(Outgoing { to: from.to_owned(), msg: Message::PushLost { keys: lost } });
                }
            }
            _ => {}
        }
    }

    /// SPEC U4, U8, U11: may the write of destination rank `dst_rank`, pipeline stage `stage`
    /// of registration `attempt` be posted now? Asked right before posting. On `Ok`, the source
    /// blocks stay out of the pool until the ticket comes back to [`PushSource::end_write`].
    pub fn begin_write(
        &mut self,
        key: &PushKey,
        attempt: u32,
        dst_rank: u32,
        stage: u32,
        now: Nanos,
        out: &mut PushSettled<B>,
    ) -> Result<WriteTicket, WriteRefused> {
        let margin = Self::write_margin(&self.cfg);
        let Some(t) = self.keys.get_mut(key) else { return Err(WriteRefused::NotLive) };
        let (Some(id), Some((holder, to))) = (t.lease, t.holder.clone()) else { return Err(WriteRefused::NotLive) };
        if t.ending {
            return Err(WriteRefused::NotLive);
        }
        let Some(reg) = t.regs.last_mut().filter(|r| r.reg.attempt == attempt && r.announced) else {
            return Err(WriteRefused::NotRegistered);
        };
        if dst_rank >= reg.reg.dst_ranks || stage >= reg.reg.stages || reg.writes.contains_key(&(dst_rank, stage)) {
            return Err(WriteRefused::NotExpected);
        }
        if now + margin > reg.post_until {
            // U8, U6: too late for this write; D learns it will not come.
            reg.writes.insert((dst_rank, stage), Write::Failed);
            reg.failed += 1;
            out.send.extend(reg.failed_msg(PushFailure::Deadline).map(|msg| Outgoing { to, msg }));
            return Err(WriteRefused::Deadline);
        }
        let digest = reg.reg.digest;
        let mut released = Vec::new();
        // The lease is live, this engine's, and for this prompt (U4, S5, U11) — the table's gate.
        let Some(read) = self.table.begin_read(holder, id, Some(digest), now, &mut released) else {
            self.settle(now, released, out);
            return Err(WriteRefused::NotLive);
        };
        // P's own progress keeps the lease while it writes: a write outliving E is failed.
        self.table.renew(holder, &[id], now, &mut Vec::new(), &mut released);
        self.settle(now, released, out);
        if let Some(reg) = self.keys.get_mut(key).and_then(|t| t.regs.last_mut()) {
            reg.writes.insert((dst_rank, stage), Write::Posted);
        }
        Ok(WriteTicket { key: key.clone(), attempt, dst_rank, stage, read })
    }

    /// SPEC U4, U5, U6: a posted write ended, `ok` or in error. Reports it to D; the last
    /// success of every expected write ends the lease as `transferred`. A success after the
    /// lease ended, or of a superseded registration, is not reported done: the lease is gone and
    /// D counts it failed (its blocks came back only now, U4).
    pub fn end_write(&mut self, ticket: WriteTicket, ok: bool, now: Nanos, out: &mut PushSettled<B>) {
        if let Some(source) = self.table.end_read(ticket.read) {
            out.freed.push(source.blocks);
        }
        let end = if ok { Write::Done } else { Write::Failed };
        self.write_ended(ticket.key, ticket.attempt, ticket.dst_rank, ticket.stage, end, now, out);
    }

    /// SPEC U4, U6, U8: P gives up on a posted write (it outlived the write timeout). D is told
    /// at once that it failed and the transfer ends (the writes not posted never will be, the
    /// lease ends). Where writes are fenced that is all: the write stopped when its future was
    /// dropped ([`PushSource::end_write`] with `ok = false`). Where they are not (NIXL), the write
    /// still reads the source blocks and lands in D's: its ticket is held in the quarantine,
    /// the source blocks with it, until [`PushSource::abandoned_write_ended`] or the quarantine
    /// passes ([`PushSource::poll`]); D hears `TimedOut` (it fails over but keeps its blocks) and
    /// `PushLost` only once the write stopped. Returns the id to tell the write's end by, or
    /// `None` when nothing is held.
    pub fn abandon_write(&mut self, ticket: WriteTicket, now: Nanos, out: &mut PushSettled<B>) -> Option<u64> {
        if self.fenced_writes {
            self.end_write(ticket, false, now, out);
            return None;
        }
        let WriteTicket { key, attempt, dst_rank, stage, read } = ticket;
        self.write_ended(key.clone(), attempt, dst_rank, stage, Write::Abandoned, now, out);
        Some(self.quarantine(key, attempt, AbandonedWrite::Transfer { dst_rank, stage, read }, now, out))
    }

    /// Holds a write given up on in the quarantine; returns the id to tell its end by.
    fn quarantine(&mut self, key: PushKey, attempt: u32, write: AbandonedWrite, now: Nanos, out: &mut PushSettled<B>) -> u64 {
        let id = self.next_abandoned;
        self.next_abandoned += 1;
        if let Some(a) = self.abandoned.hold(now, Abandoned { id, key, attempt, write }) {
            self.stopped(a, out);
        }
        out.rearm = true;
        id
    }

    /// SPEC U4: the transport says the write given up on as `id` ended (done or failed): its
    /// source blocks come back now, and D hears the transfer stopped.
    pub fn abandoned_write_ended(&mut self, id: u64, out: &mut PushSettled<B>) {
        if let Some(a) = self.abandoned.take(|a| a.id == id) {
            self.stopped(a, out);
        }
    }

    /// Writes given up on that are still held (their transport has not said they ended).
    pub fn abandoned_writes(&self) -> usize {
        self.abandoned.len()
    }

    /// A write given up on stopped (the transport said so, or its quarantine passed).
    fn stopped(&mut self, a: Abandoned, out: &mut PushSettled<B>) {
        let (dst_rank, stage, read) = match a.write {
            AbandonedWrite::Early => return self.early_ended(&a.key, a.attempt, out),
            AbandonedWrite::Transfer { dst_rank, stage, read } => (dst_rank, stage, read),
        };
        if let Some(source) = self.table.end_read(read) {
            out.freed.push(source.blocks);
        }
        if let Some(w) = self
            .keys
            .get_mut(&a.key)
            .and_then(|t| t.regs.iter_mut().find(|r| r.reg.attempt == a.attempt))
            .and_then(|r| r.writes.get_mut(&(dst_rank, stage)))
            .filter(|w| **w == Write::Abandoned)
        {
            *w = Write::Failed;
        }
        self.tidy(&a.key, out);
    }

    /// A posted write ended as `end`: done, failed, or abandoned (failed, still in flight).
    #[allow(clippy::too_many_arguments)]
    fn write_ended(&mut self, key: PushKey, attempt: u32, dst_rank: u32, stage: u32, end: Write, now: Nanos, out: &mut PushSettled<B>) {
        let ok = end == Write::Done;
        let ticket = (attempt, dst_rank, stage);
        let Some(t) = self.keys.get_mut(&key) else { return };
        let live = t.lease.is_some_and(|id| self.table.get(id).is_some()) && !t.ending;
        let newest = t.regs.last().map(|r| r.reg.attempt);
        let Some(to) = t.holder.as_ref().map(|(_, n)| n.clone()) else { return };
        let Some(reg) = t.regs.iter_mut().find(|r| r.reg.attempt == ticket.0) else { return };
        let Some(w) = reg.writes.get_mut(&(ticket.1, ticket.2)).filter(|w| **w == Write::Posted) else { return };
        let good = ok && live && newest == Some(ticket.0);
        if good {
            *w = Write::Done;
            reg.done += 1;
            out.send.push(Outgoing {
                to: to.clone(),
                msg: Message::PushWriteDone { key: key.clone(), attempt: ticket.0, dst_rank: ticket.1, stage: ticket.2 },
            });
        } else {
            *w = end;
            reg.failed += 1;
            let why = if end == Write::Abandoned {
                PushFailure::TimedOut
            } else if !ok {
                PushFailure::WriteError
            } else if newest != Some(ticket.0) {
                PushFailure::Superseded
            } else {
                PushFailure::LeaseLost
            };
            // A failed write ends the transfer: the writes not posted yet will not be.
            if live && newest == Some(ticket.0) {
                reg.fail_unposted();
            }
            out.send.extend(reg.failed_msg(why).map(|msg| Outgoing { to: to.clone(), msg }));
        }
        let (done, closed, failed) = (reg.done >= reg.expected(), reg.closed(), reg.failed > 0);
        if good && done && newest == Some(ticket.0) {
            // U5, P3, P8: the last expected write landed.
            t.transferred = Some(Landed { holder: to, attempt: ticket.0, dst_ranks: reg.reg.dst_ranks, stages: reg.reg.stages });
            if let Some(id) = t.lease {
                let mut released = Vec::new();
                self.table.end_lease(id, ReleaseReason::Transferred, now, &mut released);
                self.settle(now, released, out);
            }
        } else if closed && failed && live && newest == Some(ticket.0) {
            // Every write stopped (or was given up on) and the transfer failed: nothing more will
            // be posted; the lease ends (blocks under a write still in flight stay held, U4).
            if let Some(id) = t.lease {
                let mut released = Vec::new();
                self.table.end_lease(id, ReleaseReason::Released, now, &mut released);
                self.settle(now, released, out);
            }
        }
        self.tidy(&key, out);
    }

    /// SPEC U6: the writes of `key` not posted yet cannot be (no handshake toward D, the
    /// transport refused them): D is told, with P's totals. The writes in flight end as they end.
    pub fn fail_writes(&mut self, key: &PushKey, why: PushFailure, now: Nanos, out: &mut PushSettled<B>) {
        self.fail_transfer(key, why, None, now, out);
    }

    /// SPEC U4 (early writes): P's prefill of `request` under `key` started, of `tokens`. From
    /// now until its grant ([`PushSource::grant`]) or abort ([`PushSource::abort_prefill`]), a
    /// registration of `key` from D (come already, or still to come) is handed to the driver as
    /// an [`EarlyJob`], so the blocks the prefill has computed (of its source blocks `blocks`)
    /// can be written while it computes the rest. Returns false (no early writes for this
    /// prefill) when the key ended, is granted, or another prefill here runs under it (two
    /// dispatches never share one).
    pub fn prefill_started(&mut self, key: &PushKey, request: &str, tokens: &[u32], blocks: &[u32], out: &mut PushSettled<B>) -> bool {
        if self.ended.contains_key(key) || self.keys.get(key).is_some_and(|t| t.lease.is_some() || t.ending) {
            return false;
        }
        match self.prefilling.entry(key.clone()) {
            Entry::Occupied(_) => return false,
            Entry::Vacant(v) => {
                v.insert(Prefill { request: request.to_owned(), digest: PromptDigest::of(tokens), blocks: blocks.to_vec() });
            }
        }
        self.announce_early(key, out);
        true
    }

    /// SPEC U4, U8, U11: may an early write (blocks the prefill under `key` computed) into
    /// registration `attempt` be posted now? Before the grant: the prefill runs, the key is not
    /// ending or another engine's, the registration is D's newest and still open, and its digest
    /// is the prefill's. After the grant (the prefill's last blocks, computed as it ended): the
    /// lease is live, this engine's and for this prompt — the table's gate, as for a write —, the
    /// registration is the newest and none of the transfer's writes is posted yet; the early
    /// write holds the lease's blocks like a read until it ends. Both: D's write deadline is at
    /// least the write margin away. On `Ok`, no failure of the key is reported to D as final and
    /// no source block of it is reused until the ticket comes back to
    /// [`PushSource::end_early_write`]. A refusal changes nothing: the transfer's [`WriteJob`]
    /// writes what the early writes did not.
    pub fn begin_early_write(
        &mut self,
        key: &PushKey,
        attempt: u32,
        now: Nanos,
        out: &mut PushSettled<B>,
    ) -> Result<EarlyTicket, WriteRefused> {
        let margin = Self::write_margin(&self.cfg);
        let prefilling = self.prefilling.get(key).map(|p| p.digest);
        let Some(t) = self.keys.get_mut(key) else { return Err(WriteRefused::NotLive) };
        let Some((holder, _)) = t.holder.clone().filter(|_| !t.ending) else { return Err(WriteRefused::NotLive) };
        let granted = match (t.lease, prefilling) {
            (None, Some(_)) => None,
            // Only the granted prefill's own early writer: another's blocks are not the lease's.
            (Some(id), None) if t.early_granted => Some(id),
            _ => return Err(WriteRefused::NotLive),
        };
        let Some(reg) =
            t.regs.last_mut().filter(|r| r.reg.attempt == attempt && !r.closed() && prefilling.is_none_or(|d| r.reg.digest == d))
        else {
            return Err(WriteRefused::NotRegistered);
        };
        if granted.is_some() && !reg.writes.is_empty() {
            return Err(WriteRefused::NotExpected);
        }
        if now + margin > reg.post_until {
            return Err(WriteRefused::Deadline);
        }
        reg.early += 1;
        let digest = reg.reg.digest;
        if let Some(id) = granted {
            let mut released = Vec::new();
            let read = self.table.begin_read(holder, id, Some(digest), now, &mut released);
            match (read, self.keys.get_mut(key)) {
                (Some(read), Some(t)) => t.early_reads.push(read),
                (read, t) => {
                    // The lease ended meanwhile (or is no longer this engine's): not posted.
                    if let Some(reg) = t.and_then(|t| t.regs.last_mut()) {
                        reg.early -= 1;
                    }
                    if let Some(source) = read.and_then(|r| self.table.end_read(r)) {
                        out.freed.push(source.blocks);
                    }
                    self.settle(now, released, out);
                    return Err(WriteRefused::NotLive);
                }
            }
            self.settle(now, released, out);
        }
        Ok(EarlyTicket { key: key.clone(), attempt })
    }

    /// SPEC U4, U7: an early write ended (landed or not: it counts toward nothing). When it was
    /// the key's last in flight, a failure held back meanwhile goes to D now, source blocks that
    /// came back meanwhile go to the pool, and an ended key is forgotten.
    pub fn end_early_write(&mut self, ticket: EarlyTicket, out: &mut PushSettled<B>) {
        self.early_ended(&ticket.key, ticket.attempt, out);
    }

    fn early_ended(&mut self, key: &PushKey, attempt: u32, out: &mut PushSettled<B>) {
        let Some(t) = self.keys.get_mut(key) else { return };
        if let Some(read) = t.early_reads.pop() {
            if let Some(source) = self.table.end_read(read) {
                out.freed.push(source.blocks);
            }
        }
        let to = t.holder.as_ref().map(|(_, n)| n.clone());
        if let Some(reg) = t.regs.iter_mut().find(|r| r.reg.attempt == attempt) {
            reg.early = reg.early.saturating_sub(1);
            if reg.early == 0 && reg.deferred {
                reg.deferred = false;
                if let (Some(why), Some(to)) = (reg.why, to) {
                    out.send.push(Outgoing { to, msg: reg.report(why) });
                }
            }
        }
        if !t.early_in_flight() {
            out.freed.append(&mut t.held);
        }
        self.tidy(key, out);
    }

    /// SPEC U4, U6, U8: P gives up on an early write (it outlived the write timeout). Where
    /// writes are fenced, dropping it stopped it: it ends now. Where they are not (NIXL: it runs
    /// on), the transfer fails toward D as `TimedOut` at once (D fails over into other blocks and
    /// keeps these until `PushLost`), and the write holds the source blocks in the quarantine,
    /// as a transfer's write given up on does, until the transport says it ended
    /// ([`PushSource::abandoned_write_ended`] with the id returned) or the quarantine passes.
    pub fn abandon_early_write(&mut self, ticket: EarlyTicket, now: Nanos, out: &mut PushSettled<B>) -> Option<u64> {
        if self.fenced_writes {
            self.end_early_write(ticket, out);
            return None;
        }
        self.fail_transfer(&ticket.key, PushFailure::TimedOut, Some(ReleaseReason::Released), now, out);
        Some(self.quarantine(ticket.key, ticket.attempt, AbandonedWrite::Early, now, out))
    }

    /// SPEC P1, U4, U6: P's prefill under `key` was aborted, its source blocks `blocks` (early
    /// writes may be reading them) come back: D is told (once no early write is in flight), and
    /// the blocks go to the pool once the last early write ended.
    pub fn abort_prefill(&mut self, key: &PushKey, request: &str, blocks: Option<B>, now: Nanos, out: &mut PushSettled<B>) {
        let ids = blocks.as_ref().map(|b| b.ids());
        if self.prefilling.get(key).is_some_and(|p| p.request == request && ids.is_none_or(|ids| p.blocks == ids)) {
            self.prefilling.remove(key);
        }
        self.abort(key, now, out);
        if let Some(blocks) = blocks {
            self.free_or_hold(key, blocks, out);
        }
    }

    /// Source blocks back from P's own request under `key`: to the pool now, or held while
    /// early writes of `key` may still read them (U4; a transfer's writes read the lease's
    /// blocks, not these).
    fn free_or_hold(&mut self, key: &PushKey, blocks: B, out: &mut PushSettled<B>) {
        match self.keys.get_mut(key) {
            Some(t) if t.early_in_flight() => t.held.push(blocks),
            _ => out.freed.push(blocks),
        }
    }

    /// SPEC U4: hands `key`'s newest registration to the driver for early writes, if P prefills
    /// the key now, D registered it for that prompt, and it was not handed over already.
    fn announce_early(&mut self, key: &PushKey, out: &mut PushSettled<B>) {
        let Some(digest) = self.prefilling.get(key).map(|p| p.digest) else { return };
        let Some(t) = self.keys.get_mut(key) else { return };
        let Some((_, to)) = t.holder.clone().filter(|_| t.lease.is_none() && !t.ending) else { return };
        let Some(reg) = t.regs.last_mut().filter(|r| !r.early_announced && !r.closed() && r.reg.digest == digest) else { return };
        reg.early_announced = true;
        out.early.push(EarlyJob {
            key: key.clone(),
            attempt: reg.reg.attempt,
            to,
            dst_ranks: reg.reg.dst_ranks,
            block_ids: reg.reg.block_ids.clone(),
            digest,
        });
    }

    /// SPEC P1, U6: P's request under `key` was aborted: no lease (or its lease released), and
    /// a D that registered or renewed it is told at once.
    pub fn abort(&mut self, key: &PushKey, now: Nanos, out: &mut PushSettled<B>) {
        if !self.keys.contains_key(key) {
            self.remember_ended(key.clone());
            return;
        }
        self.fail_transfer(key, PushFailure::Aborted, Some(ReleaseReason::Released), now, out);
    }

    /// SPEC O3, O4, S5: a router's release of `key` (its decode leg failed or was refused):
    /// the lease ends at once as `released` — only while no decoder holds it (the first engine
    /// that renewed or registered the key owns it; that one releases it itself, U9). A key not
    /// granted yet is remembered as ended, so the grant under it is refused and the blocks come
    /// back at once. Returns whether it ended a lease or fenced a key; `false` when a decoder
    /// holds it or it had ended already.
    pub fn release_unheld(&mut self, key: &PushKey, now: Nanos, out: &mut PushSettled<B>) -> bool {
        if self.ended.contains_key(key) {
            return false;
        }
        match self.keys.get(key) {
            None if matches!(key, PushKey::Lease(_)) => false,
            None => {
                self.remember_ended(key.clone());
                true
            }
            Some(t) if t.holder.is_some() || t.ending => false,
            Some(t) => {
                let live = t.lease.is_some_and(|id| self.table.get(id).is_some());
                self.fail_transfer(key, PushFailure::Aborted, Some(ReleaseReason::Released), now, out);
                live
            }
        }
    }

    /// SPEC P4, U4, U6, U8: the reaper's turn. Ends leases past their deadline as `expired`
    /// (D told what failed), fails writes whose posting deadline passed, forgets keys not granted
    /// yet that D stopped renewing, lets out the source blocks of writes given up on whose
    /// quarantine passed. Returns whether work is left (poll again at once).
    pub fn poll(&mut self, now: Nanos, out: &mut PushSettled<B>) -> bool {
        let mut released = Vec::new();
        let more = self.table.tick_budget(now, REAP_BUDGET, &mut released);
        self.settle(now, released, out);
        let mut over = Vec::new();
        self.abandoned.poll(now, &mut over);
        for a in over {
            self.stopped(a, out);
        }
        let margin = Self::write_margin(&self.cfg);
        while let Some((at, key)) = self.timers.first().cloned() {
            if at > now {
                break;
            }
            self.timers.pop_first();
            let Some(t) = self.keys.get_mut(&key) else { continue };
            if t.lease.is_none() {
                if now.since(t.seen) >= self.cfg.extension {
                    if t.in_flight() {
                        // Early writes still read its prefill's blocks: looked at again later.
                        self.timers.insert((now + self.cfg.extension, key));
                    } else {
                        // Nobody renewed it for E: D is gone; what it said goes with it.
                        self.keys.remove(&key);
                        self.pending -= 1;
                    }
                }
                continue;
            }
            let Some(to) = t.holder.as_ref().map(|(_, n)| n.clone()) else { continue };
            if let Some(reg) = t.regs.last_mut().filter(|r| !r.closed() && now + margin > r.post_until) {
                if reg.fail_unposted() > 0 {
                    out.send.extend(reg.failed_msg(PushFailure::Deadline).map(|msg| Outgoing { to, msg }));
                }
            }
        }
        more
    }

    /// When [`PushSource::poll`] must run next.
    pub fn poll_timeout(&self, now: Nanos) -> Option<Nanos> {
        let next =
            [self.table.next_expiry(), self.timers.first().map(|(t, _)| *t), self.abandoned.next_release()].into_iter().flatten().min();
        next.map(|t| t.max(now + self.cfg.reap_granularity() / 4))
    }

    /// Engine shutdown: every lease ends as `shutdown`, and every D with a registration is told
    /// which writes will not come (U6). Writes still in flight are reported as they end.
    pub fn shutdown(&mut self, now: Nanos, out: &mut PushSettled<B>) {
        let mut keys: Vec<PushKey> = self.keys.keys().cloned().collect();
        keys.sort();
        for k in &keys {
            self.fail_transfer(k, PushFailure::Shutdown, Some(ReleaseReason::Shutdown), now, out);
        }
        // Writes given up on stop with the process.
        let held: Vec<Abandoned> = self.abandoned.drain().collect();
        for a in held {
            self.stopped(a, out);
        }
        let mut released = Vec::new();
        self.table.shutdown(now, &mut released);
        self.settle(now, released, out);
    }

    /// Whether lease `lease_id` is live.
    pub fn is_live(&self, lease_id: LeaseId) -> bool {
        self.table.get(lease_id).is_some()
    }

    /// The lease paired by `key`, if live.
    pub fn lease_of(&self, key: &PushKey) -> Option<LeaseId> {
        self.keys.get(key).and_then(|t| t.lease).filter(|id| self.table.get(*id).is_some())
    }

    /// The current deadline of a live lease.
    pub fn deadline(&self, lease_id: LeaseId) -> Option<Nanos> {
        self.table.deadline(lease_id)
    }

    /// Live leases (`kvlease_leases_active`).
    pub fn live(&self) -> usize {
        self.table.live()
    }

    /// Keys not granted yet that P keeps what D said about.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// The table's counters (§11).
    pub fn stats(&self) -> &crate::lease_table::LeaseStats {
        self.table.stats()
    }

    fn register(&mut self, holder: Holder, from: &str, reg: &PushRegistration, now: Nanos, out: &mut PushSettled<B>) {
        let lost = |out: &mut PushSettled<B>| {
            out.send.push(Outgoing { to: from.to_owned(), msg: Message::PushLost { keys: vec![reg.key.clone()] } })
        };
        // U11, §3: a registration meant for another life of this engine names nothing here.
        if reg.granted_by != 0 && reg.granted_by != self.incarnation {
            return lost(out);
        }
        // D5, §3: nor does one from a request older than this life, for a key of which nothing
        // is here but D's renewals (no prefill, no lease, no registration): the engine restarted
        // after the request's prefill leg reached it, and the key would wait for a prefill that
        // will not come.
        let nothing = self.keys.get(&reg.key).is_none_or(|t| t.lease.is_none() && t.regs.is_empty());
        if nothing && !self.prefilling.contains_key(&reg.key) && self.before_my_time(reg.age_ns, now) {
            return lost(out);
        }
        if !self.admit(holder, from, &reg.key, now) {
            if self.lost_later(holder, &reg.key) || self.tell_landed(from, &reg.key, Some(reg.attempt), out) {
                return;
            }
            return lost(out);
        }
        let Some(t) = self.keys.get_mut(&reg.key) else { return lost(out) };
        let granted = t.lease.is_some();
        if let Some(last) = t.regs.last() {
            if reg.attempt <= last.reg.attempt {
                // U1: a duplicate (or an older one) is acknowledged and changes nothing; U6: if
                // its writes failed, the acknowledgement is the failure, told again (the first
                // report may have been lost, and D sends its registration until it hears).
                if reg.attempt == last.reg.attempt {
                    let msg = match last.why.filter(|_| last.failed > 0 && !last.deferred) {
                        Some(why) => last.report(why),
                        None => Message::PushRegisterAck { key: reg.key.clone(), attempt: reg.attempt, granted },
                    };
                    out.send.push(Outgoing { to: from.to_owned(), msg });
                }
                return;
            }
            // U11: a newer registration supersedes: the older one's writes not posted never will be.
            let to = from.to_owned();
            let mut msgs = Vec::new();
            for old in t.regs.iter_mut().filter(|r| !r.closed()) {
                old.fail_unposted();
                msgs.extend(old.failed_msg(PushFailure::Superseded).map(|msg| Outgoing { to: to.clone(), msg }));
            }
            out.send.extend(msgs);
            t.regs.retain(|r| r.in_flight());
        }
        let post_until = now + Duration::from_nanos(reg.window_ns);
        t.regs.push(Reg::new(reg.clone(), post_until));
        self.timers.insert((post_until - Self::write_margin(&self.cfg), reg.key.clone()));
        if granted {
            self.pair(&reg.key, now, out);
        } else {
            out.send.push(Outgoing {
                to: from.to_owned(),
                msg: Message::PushRegisterAck { key: reg.key.clone(), attempt: reg.attempt, granted },
            });
            self.announce_early(&reg.key, out);
        }
        out.rearm = true;
    }

    /// SPEC U8: `key` is `holder`'s, ended, with writes still in flight: its `PushLost` goes out
    /// when the last of them stops ([`PushSource::end_write`]), not now — D takes it as "nothing
    /// more lands in your blocks" and reuses them.
    /// SPEC U5: if `key` ended because every write (of registration `attempt`, if given)
    /// landed, and `from` held it, tells `from` every `PushWriteDone` again and returns true:
    /// a renewal or a registration sent again after that means D has not heard them (one was
    /// lost, or overtaken by this answer's predecessor), and `PushLost` would make D recompute
    /// KV that landed whole.
    fn tell_landed(&self, from: &str, key: &PushKey, attempt: Option<u32>, out: &mut PushSettled<B>) -> bool {
        let Some(Some(landed)) = self.ended.get(key) else { return false };
        if landed.holder != from || attempt.is_some_and(|a| a != landed.attempt) {
            return false;
        }
        for dst_rank in 0..landed.dst_ranks {
            for stage in 0..landed.stages {
                let msg = Message::PushWriteDone { key: key.clone(), attempt: landed.attempt, dst_rank, stage };
                out.send.push(Outgoing { to: from.to_owned(), msg });
            }
        }
        true
    }

    fn lost_later(&self, holder: Holder, key: &PushKey) -> bool {
        self.keys.get(key).is_some_and(|t| t.holder.as_ref().is_some_and(|(h, _)| *h == holder) && t.regs.iter().any(Reg::in_flight))
    }

    /// SPEC S5, U2, U3: whether `holder` may act on `key`: its lease (live, or on its way) is
    /// that engine's, the first to name it. A key not known yet is kept for its grant.
    fn admit(&mut self, holder: Holder, from: &str, key: &PushKey, now: Nanos) -> bool {
        if self.ended.contains_key(key) {
            return false;
        }
        match self.keys.get_mut(key) {
            Some(t) => {
                if t.ending {
                    return false;
                }
                match &t.holder {
                    Some((h, _)) if *h != holder => return false,
                    Some(_) => {}
                    None => t.holder = Some((holder, from.to_owned())),
                }
                if t.lease.is_none() {
                    t.seen = now;
                    self.timers.insert((now + self.cfg.extension, key.clone()));
                }
                true
            }
            // A lease id names a lease already granted: not live, it is gone.
            None if matches!(key, PushKey::Lease(_)) => false,
            None if self.pending >= PENDING_MEMORY => false,
            None => {
                self.pending += 1;
                self.keys.insert(key.clone(), Transfer::new(Some((holder, from.to_owned())), now));
                self.timers.insert((now + self.cfg.extension, key.clone()));
                true
            }
        }
    }

    /// SPEC P2, U2, U8: a renewal of `key` by `holder`; returns false when it is lost.
    fn renew(&mut self, holder: Holder, from: &str, key: &PushKey, window_ns: u64, now: Nanos, out: &mut PushSettled<B>) -> bool {
        if !self.admit(holder, from, key, now) {
            return false;
        }
        let Some(t) = self.keys.get_mut(key) else { return false };
        if window_ns > 0 {
            if let Some(reg) = t.regs.last_mut() {
                let until = now + Duration::from_nanos(window_ns);
                if until > reg.post_until {
                    reg.post_until = until;
                    self.timers.insert((until - Self::write_margin(&self.cfg), key.clone()));
                }
            }
        }
        let Some(id) = t.lease else { return true };
        let (mut lost, mut released) = (Vec::new(), Vec::new());
        self.table.renew(holder, &[id], now, &mut lost, &mut released);
        self.settle(now, released, out);
        lost.is_empty()
    }

    /// SPEC U9: D released `key`. Returns whether to answer `PushLost` now (nothing in flight);
    /// otherwise it is answered when the last write in flight ends.
    fn release(&mut self, holder: Holder, key: &PushKey, now: Nanos, out: &mut PushSettled<B>) -> bool {
        let Some(t) = self.keys.get_mut(key) else {
            // Not known: remembered, so a grant under it later is refused at once (O3).
            if !matches!(key, PushKey::Lease(_)) {
                self.remember_ended(key.clone());
            }
            return true;
        };
        if t.holder.as_ref().is_some_and(|(h, _)| *h != holder) {
            return true;
        }
        t.ending = true;
        for reg in t.regs.iter_mut() {
            reg.fail_unposted();
        }
        if let Some(id) = t.lease {
            let mut released = Vec::new();
            self.table.release(holder, &[id], now, &mut Vec::new(), &mut released);
            self.settle(now, released, out);
        }
        let in_flight = self.keys.get(key).is_some_and(|t| t.regs.iter().any(Reg::in_flight));
        if !in_flight {
            self.forget(key);
        }
        !in_flight
    }

    /// Fails what is left of `key`'s transfer for `why` and tells D (U6). With `end`, the lease
    /// ends for that reason (P's own release, or shutdown) and the key is remembered as ended;
    /// without, the lease ends as `released` once every write stopped.
    fn fail_transfer(&mut self, key: &PushKey, why: PushFailure, end: Option<ReleaseReason>, now: Nanos, out: &mut PushSettled<B>) {
        let Some(t) = self.keys.get_mut(key) else { return };
        let to = t.holder.as_ref().map(|(_, n)| n.clone());
        let mut msgs = Vec::new();
        for reg in t.regs.iter_mut().filter(|r| !r.closed()) {
            reg.fail_unposted();
            if let Some(to) = &to {
                msgs.extend(reg.failed_msg(why).map(|msg| Outgoing { to: to.clone(), msg }));
            }
        }
        if msgs.is_empty() && end.is_some() && t.regs.is_empty() {
            if let Some(to) = &to {
                // Renewed, never registered: nothing to count; the key is gone.
                msgs.push(Outgoing { to: to.clone(), msg: Message::PushLost { keys: vec![key.clone()] } });
            }
        }
        out.send.extend(msgs);
        let Some(id) = t.lease else {
            if end.is_some() {
                if t.in_flight() {
                    // U4: early writes still run; the key ends when the last of them does.
                    t.ending = true;
                } else {
                    self.forget(key);
                }
            }
            return;
        };
        let stopped = !t.regs.iter().any(Reg::in_flight);
        if end.is_some() {
            t.ending = true;
        }
        if self.table.get(id).is_some() && (end.is_some() || stopped) {
            let mut released = Vec::new();
            self.table.end_lease(id, end.unwrap_or(ReleaseReason::Released), now, &mut released);
            self.settle(now, released, out);
        }
        self.tidy(key, out);
    }

    /// SPEC U1: a lease and a registration under one key, both here: check the registration
    /// (U11, S4) and hand the transfer to the driver.
    fn pair(&mut self, key: &PushKey, now: Nanos, out: &mut PushSettled<B>) {
        let margin = Self::write_margin(&self.cfg);
        let Some(t) = self.keys.get_mut(key) else { return };
        let (Some(id), Some((_, to))) = (t.lease, t.holder.clone()) else { return };
        let Some(source) = self.table.get(id) else { return };
        let (digest, request, src_blocks) = (source.digest, source.request.clone(), source.blocks.ids().to_vec());
        let Some(reg) = t.regs.last_mut().filter(|r| !r.announced && !r.closed()) else { return };
        if reg.reg.digest != digest {
            // U11, S4: D registered for another prompt: nothing is written into its blocks.
            reg.fail_unposted();
            out.send.extend(reg.failed_msg(PushFailure::Digest).map(|msg| Outgoing { to, msg }));
            return;
        }
        if now + margin > reg.post_until {
            // U8: D's deadline passed while P prefilled: no write may be posted.
            reg.fail_unposted();
            out.send.extend(reg.failed_msg(PushFailure::Deadline).map(|msg| Outgoing { to, msg }));
            return;
        }
        reg.announced = true;
        if reg.expected() == 0 {
            return;
        }
        out.send
            .push(Outgoing { to: to.clone(), msg: Message::PushRegisterAck { key: key.clone(), attempt: reg.reg.attempt, granted: true } });
        out.ready.push(WriteJob {
            key: key.clone(),
            attempt: reg.reg.attempt,
            lease_id: id,
            to,
            dst_ranks: reg.reg.dst_ranks,
            stages: reg.reg.stages,
            block_ids: reg.reg.block_ids.clone(),
            src_blocks,
            digest,
            request,
        });
    }

    /// Leases that ended: their blocks back (or held by writes in flight), D told what will not
    /// be written (U6), the key forgotten once nothing of it is in flight.
    fn settle(&mut self, _now: Nanos, released: Vec<Released<Source<B>>>, out: &mut PushSettled<B>) {
        for r in released {
            let request = match r.payload {
                Some(s) => {
                    out.freed.push(s.blocks);
                    s.request
                }
                None => self.table.parked_payload(r.lease_id).map(|s| s.request.clone()).unwrap_or_default(),
            };
            out.ended.push(Ended { lease_id: r.lease_id, reason: r.reason, held: r.held, request });
            let Some(key) = self.by_lease.remove(&r.lease_id) else { continue };
            let Some(t) = self.keys.get_mut(&key) else { continue };
            if r.reason != ReleaseReason::Transferred && !t.ending {
                let to = t.holder.as_ref().map(|(_, n)| n.clone());
                let why = if r.reason == ReleaseReason::Shutdown { PushFailure::Shutdown } else { PushFailure::LeaseLost };
                for reg in t.regs.iter_mut().filter(|r| !r.closed()) {
                    reg.fail_unposted();
                    if let Some(to) = &to {
                        out.send.extend(reg.failed_msg(why).map(|msg| Outgoing { to: to.clone(), msg }));
                    }
                }
            }
            t.ending = true;
            self.tidy(&key, out);
        }
    }

    /// Forgets `key` once its lease ended and no write of it is in flight; a release still to be
    /// answered is answered now.
    fn tidy(&mut self, key: &PushKey, out: &mut PushSettled<B>) {
        let Some(t) = self.keys.get_mut(key) else { return };
        let lease_gone = t.lease.is_some_and(|id| self.table.get(id).is_none());
        let (n, mut i) = (t.regs.len(), 0);
        t.regs.retain(|r| {
            i += 1;
            i == n || r.in_flight()
        });
        if !(t.ending || lease_gone) || t.regs.iter().any(Reg::in_flight) {
            return;
        }
        let answer = t.ending && t.regs.iter().any(|r| r.failed > 0 || r.done < r.expected());
        let to = t.holder.as_ref().map(|(_, n)| n.clone());
        self.forget(key);
        if let (true, Some(to)) = (answer, to) {
            out.send.push(Outgoing { to, msg: Message::PushLost { keys: vec![key.clone()] } });
        }
    }

    fn forget(&mut self, key: &PushKey) {
        let mut landed = None;
        if let Some(t) = self.keys.remove(key) {
            if t.lease.is_none() {
                self.pending -= 1;
            }
            if let Some(id) = t.lease {
                self.by_lease.remove(&id);
            }
            landed = t.transferred;
        }
        self.remember(key.clone(), landed);
    }

    fn remember_ended(&mut self, key: PushKey) {
        self.remember(key, None);
    }

    fn remember(&mut self, key: PushKey, landed: Option<Landed>) {
        match self.ended.entry(key) {
            Entry::Vacant(v) => {
                self.ended_order.push_back(v.key().clone());
                v.insert(landed);
            }
            // What landed is never forgotten by a later "ended".
            Entry::Occupied(mut o) if landed.is_some() => {
                o.insert(landed);
            }
            Entry::Occupied(_) => {}
        }
        while self.ended_order.len() > ENDED_MEMORY {
            if let Some(old) = self.ended_order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }
}
