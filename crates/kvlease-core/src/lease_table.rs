//! P's leases (SPEC §4): grant, renew, complete, release, reap — exactly once each.
//!
//! A lease lives in slot `id mod capacity` of a power-of-two table; the slot keeps the id's
//! high bits (its generation), so finding a lease is one index and one comparison under any
//! pattern of grants and releases, and an id whose slot has since been reused is lost, never
//! another lease (ids are never handed out twice: SPEC §3). Ids are handed out in a row,
//! skipping only ids whose slot a lease of an earlier turn still holds, so a heartbeat's sorted
//! ids stay nearly consecutive on the wire. A renewal reads and writes one aligned 32-byte
//! record (generation, holder, deadline, grant time, index position) and never touches the
//! expiry index. The index is a timing wheel of buckets `min(I/10, 100 ms)` wide holding each
//! live lease's slot once, each bucket remembering its earliest deadline, so an idle reaper tick
//! is O(1) and a tick that expires k leases costs O(k) (SPEC P4); a tick can be given a work
//! budget and carries the rest over. An index entry whose lease was renewed since is moved to
//! the bucket of its current deadline when its old bucket comes due, at most once per extension
//! period, touching only the lease's 32-byte record. The table doubles before live leases fill
//! 7/8 of its slots.
//!
//! The table owns a payload per lease (the engine's block guards) and hands it back when the
//! lease is released; if a read of the lease is in progress (SPEC P5) the payload is held until
//! the last reader ends, so no block is reused under a reader.
//!
//! Every lease belongs to one [`Holder`] (SPEC S5): the first engine, as the transport
//! authenticated it, to renew, read, complete or release it. Messages about it from any other
//! engine are answered as lost and change nothing, so an engine of the cluster cannot release,
//! complete or keep alive another engine's leases by guessing their (sequential) ids. Each lease
//! also keeps the digest of the prompt it was granted for (SPEC S4): a completion for another
//! prompt is not confirmed.

use crate::config::LeaseConfig;
use crate::digest::PromptDigest;
use crate::wire::Message;
use crate::{LeaseId, Nanos};
use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroU32;
use std::time::Duration;

/// An engine that holds leases on P (SPEC S5): one per authenticated engine id and incarnation,
/// handed out by [`LeaseTable::holder`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder(pub NonZeroU32);

/// Why a lease ended; each release is counted under exactly one (SPEC P3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ReleaseReason {
    Transferred,
    Released,
    Expired,
    Shutdown,
}

impl ReleaseReason {
    pub const ALL: [ReleaseReason; 4] =
        [ReleaseReason::Transferred, ReleaseReason::Released, ReleaseReason::Expired, ReleaseReason::Shutdown];

    /// SPEC P5 where the transport cannot fence reads (NIXL): whether a READ of the lease's
    /// blocks may still be on its way. Only a lease whose every expected reader reported
    /// completion is known to have none.
    pub fn may_have_readers(self) -> bool {
        self != ReleaseReason::Transferred
    }

    /// The `reason` label of `kvlease_leases_released_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Transferred => "transferred",
            ReleaseReason::Released => "released",
            ReleaseReason::Expired => "expired",
            ReleaseReason::Shutdown => "shutdown",
        }
    }
}

/// A lease that just ended.
#[derive(Debug)]
pub struct Released<T> {
    pub lease_id: LeaseId,
    pub reason: ReleaseReason,
    /// The payload, or `None` when a reader still holds the lease's blocks: it comes back from
    /// [`LeaseTable::end_read`] when the last reader ends.
    pub payload: Option<T>,
    pub blocks: u32,
    /// Grant to release (`kvlease_lease_hold_seconds`).
    pub held: Duration,
}

/// What [`LeaseTable::on_message`] did: the answer for the sender, and how many leases a
/// heartbeat renewed (`kvlease_lease_renewals_total`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub reply: Option<Message>,
    pub renewed: usize,
}

/// What a read completion did (SPEC P8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// Counted; more consumers are expected (or this one had reported already).
    Pending,
    /// The last expected consumer reported: the lease is released as `transferred`.
    Transferred,
    /// The lease is not live: the reader must not use what it read (SPEC P6).
    Lost,
}

/// Proof that a read of a live lease began; hand it back to [`LeaseTable::end_read`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a read ticket must be ended, or the lease's blocks are never reused"]
pub struct ReadTicket {
    lease_id: LeaseId,
}

impl ReadTicket {
    pub fn lease_id(&self) -> LeaseId {
        self.lease_id
    }
}

/// The counters of SPEC §11 that the table owns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseStats {
    pub granted: u64,
    pub renewals: u64,
    /// Indexed like [`ReleaseReason::ALL`].
    pub released: [u64; 4],
}

impl LeaseStats {
    pub fn released(&self, reason: ReleaseReason) -> u64 {
        self.released[reason as usize]
    }
}

/// The hot part of a lease, touched by every renewal and by the reaper: one aligned half cache
/// line. `deadline == 0` marks a vacant slot.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
struct Hot {
    /// The lease id's high bits: `id = gen << shift | slot`.
    gen: u32,
    /// SPEC S5: who owns the lease; 0 until an engine first names it.
    holder: u32,
    deadline: u64,
    /// Grant time; SPEC P9's cap is `granted + max(max_lifetime, L)`.
    granted: u64,
    /// Where the lease's one expiry-index entry is: ring bucket and position in it.
    bucket: u32,
    pos: u32,
}

const VACANT: Hot = Hot { gen: 0, holder: 0, deadline: 0, granted: 0, bucket: 0, pos: 0 };

/// The cold part of a lease: what a release and a completion need, and the payload.
#[derive(Debug)]
struct Cold<T> {
    /// SPEC S4: the prompt the lease's KV belongs to.
    digest: PromptDigest,
    blocks: u32,
    payload: Option<T>,
}

impl<T> Cold<T> {
    const VACANT: Cold<T> = Cold { digest: PromptDigest([0; 16]), blocks: 0, payload: None };

    fn slots(n: usize) -> Vec<Cold<T>> {
        (0..n).map(|_| Self::VACANT).collect()
    }
}

/// What few leases carry at a time: reads in progress (SPEC P5) and partial completions (P8).
#[derive(Debug, Default)]
struct Aux {
    readers: u32,
    expected: u32,
    done: Vec<u32>,
}

/// Payloads of released leases that readers still hold, by lease id: (payload, readers).
type Parked<T> = HashMap<LeaseId, (T, u32)>;

/// Expiry-index entries per [`LeaseTable::tick_budget`] that keep one tick well under SPEC P4's
/// 100 µs at 10^6 leases on the benchmark machine (about 40 µs; see BENCHMARKS.md).
pub const REAP_BUDGET: usize = 1024;

/// The table grows (doubling) before live leases would fill more than this share of its slots.
const MAX_LOAD_NUM: usize = 7;
const MAX_LOAD_DEN: usize = 8;
const MIN_SLOTS: usize = 16;

/// A reaper pass over the current bucket, interrupted by its work budget or still running.
#[derive(Debug, Clone, Copy)]
struct Pass {
    bucket: usize,
    /// Entries at `[next, len)` have been looked at in this pass.
    next: usize,
    /// Earliest deadline among the entries the pass kept.
    kept_min: u64,
    /// Earliest deadline filed into this bucket since the pass began.
    filed_min: u64,
}

/// P's lease table for one engine.
///
/// A lease lives in slot `id mod capacity` (the capacity is a power of two) and the slot keeps
/// the rest of the id, so a lookup is one index and one comparison, and an id whose slot was
/// reused is lost, never another lease. Ids still increase by one per grant except where the next slot
/// is taken by a lease still live from a previous turn, which is skipped: ids granted in a row
/// stay nearly consecutive and the wire's delta encoding keeps about one byte per id.
#[derive(Debug)]
pub struct LeaseTable<T> {
    lease: u64,
    extension: u64,
    max_lifetime: Option<u64>,
    /// Never handed out twice (SPEC §3 fencing token); ids only increase.
    next_id: LeaseId,
    /// `capacity - 1`, and `log2(capacity)`.
    mask: u64,
    shift: u32,
    hot: Vec<Hot>,
    cold: Vec<Cold<T>>,
    live: usize,
    aux: HashMap<LeaseId, Aux>,
    parked: Parked<T>,
    wheel: Wheel,
    leased_blocks: u64,
    stats: LeaseStats,
    /// SPEC S5: holders by authenticated engine name; ordered, so nothing depends on a hash seed.
    holders: BTreeMap<String, Holder>,
}

impl<T> LeaseTable<T> {
    pub fn new(cfg: &LeaseConfig) -> Self {
        Self::with_capacity(cfg, 0)
    }

    /// A table sized for `live` leases at once, so it never grows (a doubling moves every
    /// lease, holding the table for about 50 ms at 10^6). Each lease pins at least one block,
    /// so an engine's block count bounds its live leases.
    pub fn with_capacity(cfg: &LeaseConfig, live: usize) -> Self {
        let slots = live
            .saturating_mul(MAX_LOAD_DEN)
            .div_ceil(MAX_LOAD_NUM)
            .saturating_add(1)
            .checked_next_power_of_two()
            .unwrap_or(1 << 31)
            .clamp(MIN_SLOTS, 1 << 31);
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let width = nanos(cfg.reap_granularity()).max(1);
        let horizon = nanos(cfg.lease_duration.max(cfg.extension));
        LeaseTable {
            lease: nanos(cfg.lease_duration),
            extension: nanos(cfg.extension),
            max_lifetime: cfg.max_lifetime.map(nanos),
            next_id: 1,
            mask: slots as u64 - 1,
            shift: slots.trailing_zeros(),
            hot: vec![VACANT; slots],
            cold: Cold::slots(slots),
            live: 0,
            aux: HashMap::new(),
            parked: HashMap::new(),
            wheel: Wheel::new(width, horizon),
            leased_blocks: 0,
            stats: LeaseStats::default(),
            holders: BTreeMap::new(),
        }
    }

    /// SPEC S5: the holder for an engine as the transport authenticated it (engine id and
    /// incarnation); the same name always gets the same holder.
    pub fn holder(&mut self, engine: &str) -> Holder {
        if let Some(h) = self.holders.get(engine) {
            return *h;
        }
        let next = u32::try_from(self.holders.len() + 1).ok().and_then(NonZeroU32::new).unwrap_or(NonZeroU32::MAX);
        let h = Holder(next);
        self.holders.insert(engine.to_owned(), h);
        h
    }

    /// SPEC P1: grant a lease of `L` from `now` over `blocks` blocks of the prompt whose digest is
    /// `digest` (S4), owning `payload`. The caller grants only for a request that finished
    /// prefill normally and holds ≥ 1 block.
    pub fn grant(&mut self, now: Nanos, blocks: u32, digest: PromptDigest, payload: T) -> LeaseId {
        let lease = Duration::from_nanos(self.lease);
        self.grant_for(now, lease, blocks, digest, payload)
    }

    /// SPEC B1: a grant whose first deadline is `lifetime` away rather than L (a decoder's
    /// cached turn, held for `decoder_kv_blocks_ttl`); renewals, release and expiry as for any
    /// lease.
    pub fn grant_for(&mut self, now: Nanos, lifetime: Duration, blocks: u32, digest: PromptDigest, payload: T) -> LeaseId {
        if (self.live + 1) * MAX_LOAD_DEN > self.hot.len() * MAX_LOAD_NUM {
            self.grow();
        }
        // Skip ids whose slot a lease of an earlier turn still holds; the load bound keeps a
        // free slot, and skips to about live / (capacity - live) per grant on average. A slot
        // keeps 32 bits of generation: past them the table grows (after 2^36 grants at least).
        loop {
            if self.next_id >> self.shift > u64::from(u32::MAX) {
                self.grow();
            } else if self.hot[(self.next_id & self.mask) as usize].deadline != 0 {
                self.next_id += 1;
            } else {
                break;
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let s = (id & self.mask) as usize;
        let deadline = now.0.saturating_add(u64::try_from(lifetime.as_nanos()).unwrap_or(u64::MAX)).max(1);
        self.hot[s] = Hot { gen: (id >> self.shift) as u32, holder: 0, deadline, granted: now.0, bucket: 0, pos: 0 };
        self.cold[s].digest = digest;
        self.cold[s].blocks = blocks;
        self.cold[s].payload = Some(payload);
        self.live += 1;
        self.leased_blocks += u64::from(blocks);
        self.stats.granted += 1;
        self.file(s, deadline, self.wheel.cursor);
        id
    }

    /// SPEC P2, P6: renew each live id to `max(deadline, now + E)` (capped by P9). Ids that are
    /// unknown, released or past their deadline go to `lost`; the latter are released as
    /// `expired` into `released` right here. A lease that P9 keeps from being renewed for a full
    /// E goes to `lost` too, though it stays live until its cap: D must not count on it and
    /// should recompute rather than race the cap (SPEC D6). A lease `holder` does not own goes to
    /// `lost` unchanged (S5). Returns how many leases were renewed.
    pub fn renew(
        &mut self,
        holder: Holder,
        ids: &[LeaseId],
        now: Nanos,
        lost: &mut Vec<LeaseId>,
        released: &mut Vec<Released<T>>,
    ) -> usize {
        let target = now.0.saturating_add(self.extension);
        let who = holder.0.get();
        let shift = self.shift;
        let life = self.max_lifetime.map(|m| m.max(self.lease));
        let mut renewed = 0;
        for &id in ids {
            let s = (id & self.mask) as usize;
            let h = &mut self.hot[s];
            if h.deadline == 0 || u64::from(h.gen) != id >> shift || id == 0 || (h.holder != 0 && h.holder != who) {
                lost.push(id);
                continue;
            }
            h.holder = who;
            if h.deadline <= now.0 {
                lost.push(id);
                self.end(s, ReleaseReason::Expired, now, released);
                continue;
            }
            let cap = life.map_or(u64::MAX, |m| h.granted.saturating_add(m));
            let want = target.min(cap);
            if want > h.deadline {
                h.deadline = want;
            }
            if want < target {
                lost.push(id);
                continue;
            }
            renewed += 1;
        }
        self.stats.renewals += renewed as u64;
        renewed
    }

    /// Everything P does with a message from D (SPEC P2, P3, P6, P8, B2): applies it and returns
    /// the answer to send back to the sender, if any. `HeartbeatAck.lost_ids` is the `LeaseLost`
    /// answer to a heartbeat and `ReadDoneAck{live: false}` the one to a completion, so D learns
    /// in the same round trip; a release naming dead leases is answered with `LeaseLost`.
    /// `holder` is the engine that sent it, as the transport authenticated it (SPEC S5).
    pub fn on_message(&mut self, holder: Holder, msg: &Message, now: Nanos, released: &mut Vec<Released<T>>) -> Answer {
        match msg {
            Message::Heartbeat { seq, lease_ids } => {
                let mut lost = Vec::new();
                let renewed = self.renew(holder, lease_ids, now, &mut lost, released);
                lost.sort_unstable();
                Answer { reply: Some(Message::HeartbeatAck { seq: *seq, lost_ids: lost }), renewed }
            }
            Message::Release { lease_ids } => {
                let mut lost = Vec::new();
                self.release(holder, lease_ids, now, &mut lost, released);
                Answer { reply: (!lost.is_empty()).then_some(Message::LeaseLost { lease_ids: lost }), renewed: 0 }
            }
            Message::ReadDone { lease_id, consumer_rank, n, digest } => {
                let c = self.complete(holder, *lease_id, *consumer_rank, *n, *digest, now, released);
                Answer { reply: Some(Message::ReadDoneAck { lease_id: *lease_id, live: c != Completion::Lost }), renewed: 0 }
            }
            Message::ClockPing { seq, t0 } => {
                Answer { reply: Some(Message::ClockPong { seq: *seq, t0: *t0, t1: now.0, t2: now.0 }), renewed: 0 }
            }
            _ => Answer { reply: None, renewed: 0 },
        }
    }

    /// SPEC D4, P6: D will not read these leases; release the live ones as `released`. Leases
    /// another holder owns go to `lost` unchanged (S5).
    pub fn release(&mut self, holder: Holder, ids: &[LeaseId], now: Nanos, lost: &mut Vec<LeaseId>, released: &mut Vec<Released<T>>) {
        for &id in ids {
            match self.find(id) {
                None => lost.push(id),
                Some(s) if !self.admit(s, holder) => lost.push(id),
                Some(s) if self.hot[s].deadline <= now.0 => {
                    lost.push(id);
                    self.end(s, ReleaseReason::Expired, now, released);
                }
                Some(s) => self.end(s, ReleaseReason::Released, now, released),
            }
        }
    }

    /// Ends lease `id` as `released` if no holder has claimed it yet (no heartbeat, read or
    /// release named it) and it is live: the granting engine takes back the blocks of a lease
    /// nobody is using — a decoder's cached turn no conversation continued yet (SPEC B1) — when
    /// it needs them for new requests. A claimed lease is in use (B3: the next turn's prefill
    /// engine renews it, or reads it) and is left alone. Returns whether the lease ended.
    pub fn revoke_unclaimed(&mut self, id: LeaseId, now: Nanos, released: &mut Vec<Released<T>>) -> bool {
        match self.find(id) {
            Some(s) if self.hot[s].holder == 0 && self.hot[s].deadline > now.0 => {
                self.end(s, ReleaseReason::Released, now, released);
                true
            }
            _ => false,
        }
    }

    /// SPEC P8: consumer rank `consumer`, one of `n`, finished reading the lease for the prompt
    /// whose digest is `digest`. Not confirmed (`Lost`, nothing changes) when another holder owns
    /// the lease (S5) or the digest is not the lease's prompt (S4).
    #[allow(clippy::too_many_arguments)]
    pub fn complete(
        &mut self,
        holder: Holder,
        id: LeaseId,
        consumer: u32,
        n: u32,
        digest: PromptDigest,
        now: Nanos,
        released: &mut Vec<Released<T>>,
    ) -> Completion {
        let s = match self.find(id) {
            None => return Completion::Lost,
            Some(s) if self.cold[s].digest != digest => return Completion::Lost,
            Some(s) if !self.admit(s, holder) => return Completion::Lost,
            Some(s) if self.hot[s].deadline <= now.0 => {
                self.end(s, ReleaseReason::Expired, now, released);
                return Completion::Lost;
            }
            Some(s) => s,
        };
        // One expected consumer and nothing recorded yet (the common case): no bookkeeping.
        let done = match self.aux.get_mut(&id) {
            None if n <= 1 => true,
            aux => {
                let a = match aux {
                    Some(a) => a,
                    None => self.aux.entry(id).or_default(),
                };
                a.expected = a.expected.max(n.max(1));
                if !a.done.contains(&consumer) {
                    a.done.push(consumer);
                }
                a.done.len() >= a.expected as usize
            }
        };
        if done {
            self.end(s, ReleaseReason::Transferred, now, released);
            Completion::Transferred
        } else {
            Completion::Pending
        }
    }

    /// SPEC P5: a read of a live lease begins. Refused (`None`) for a lease that is not live,
    /// that another holder owns (S5), or, when the reader shows the digest of the prompt it reads
    /// for, that was granted for another prompt (S4: checked here, before a byte is served, as
    /// well as on the read's completion).
    pub fn begin_read(
        &mut self,
        holder: Holder,
        id: LeaseId,
        digest: Option<PromptDigest>,
        now: Nanos,
        released: &mut Vec<Released<T>>,
    ) -> Option<ReadTicket> {
        match self.find(id) {
            None => None,
            Some(s) if digest.is_some_and(|d| self.cold[s].digest != d) => None,
            Some(s) if !self.admit(s, holder) => None,
            Some(s) if self.hot[s].deadline <= now.0 => {
                self.end(s, ReleaseReason::Expired, now, released);
                None
            }
            Some(_) => {
                self.aux.entry(id).or_default().readers += 1;
                Some(ReadTicket { lease_id: id })
            }
        }
    }

    /// The payload of a lease released while readers still hold its blocks (it comes back from
    /// [`LeaseTable::end_read`] when the last one ends); `None` for any other id.
    pub fn parked_payload(&self, id: LeaseId) -> Option<&T> {
        self.parked.get(&id).map(|(p, _)| p)
    }

    /// SPEC P5: a read ended. Returns the lease's payload if the lease was released while it was
    /// being read and this was its last reader: only now may its blocks be reused.
    pub fn end_read(&mut self, ticket: ReadTicket) -> Option<T> {
        let id = ticket.lease_id;
        if self.find(id).is_some() {
            if let Some(a) = self.aux.get_mut(&id) {
                a.readers = a.readers.saturating_sub(1);
                if a.readers == 0 && a.done.is_empty() && a.expected == 0 {
                    self.aux.remove(&id);
                }
            }
            return None;
        }
        let (_, readers) = self.parked.get_mut(&id)?;
        *readers -= 1;
        if *readers == 0 {
            return self.parked.remove(&id).map(|(p, _)| p);
        }
        None
    }

    /// SPEC P4: release every lease whose deadline ≤ `now`, as `expired`, however long it takes.
    pub fn tick(&mut self, now: Nanos, released: &mut Vec<Released<T>>) {
        while self.tick_budget(now, usize::MAX, released) {}
    }

    /// SPEC P4 with a bound on the time the table is held: like [`LeaseTable::tick`], but looks
    /// at no more than `max_work` expiry-index entries (each released, refiled or kept; see
    /// [`REAP_BUDGET`]). Returns
    /// whether work is left: then tick again soon (the lock released in between); what is left
    /// carries over, and [`LeaseTable::next_expiry`] says it is due.
    pub fn tick_budget(&mut self, now: Nanos, max_work: usize, released: &mut Vec<Released<T>>) -> bool {
        let start = released.len();
        self.wheel.expired.clear();
        let more = self.reap(now.0, max_work.max(1), released);
        self.wheel.backlog = more.then_some(now.0);
        // Buckets are visited in deadline order; within one, hand leases out in deadline order
        // too (then by id), whatever order their entries were filed in.
        let keys = std::mem::take(&mut self.wheel.expired);
        if released.len() - start != keys.len() || keys.windows(2).all(|w| w[0] <= w[1]) {
            // In order already (or not only expiries: left as they are).
        } else if keys.windows(2).all(|w| w[0] >= w[1]) {
            // A bucket filed in grant order and visited from its end.
            released[start..].reverse();
        } else {
            let mut tail: Vec<((u64, LeaseId), Released<T>)> = keys.iter().copied().zip(released.drain(start..)).collect();
            tail.sort_by_key(|(k, _)| *k);
            released.extend(tail.into_iter().map(|(_, r)| r));
        }
        self.wheel.expired = keys;
        more
    }

    /// **Simulator only** (`kvlease sim`'s `vllm-lease` policy; never on the real path): vLLM's
    /// expiry sweep as vLLM implements it (vLLM #58222), head-only in grant order. Leases are
    /// visited oldest grant first and the sweep stops at the first live one whose deadline has
    /// not passed: an expired lease granted after a renewed one stays pinned until every lease
    /// granted before it has ended. Returns the head's deadline (when this sweep can next free
    /// anything; a grant or release may make it sooner), `None` when no lease is live.
    /// O(live log live) per call: fine for a simulation, not for SPEC P4.
    #[doc(hidden)]
    pub fn tick_head_only(&mut self, now: Nanos, released: &mut Vec<Released<T>>) -> Option<Nanos> {
        let mut live: Vec<(LeaseId, usize)> =
            (0..self.hot.len()).filter(|&s| self.hot[s].deadline != 0).map(|s| (self.id_of(s), s)).collect();
        live.sort_unstable();
        for (_, s) in live {
            let d = self.hot[s].deadline;
            if d > now.0 {
                return Some(Nanos(d));
            }
            self.end(s, ReleaseReason::Expired, now, released);
        }
        None
    }

    /// When the next lease may expire: the driver's reaper need not tick before then. A lower
    /// bound (renewals are not reflected until that bucket is visited), never later than the
    /// truth; while a budgeted tick left work over, the time of that tick.
    pub fn next_expiry(&self) -> Option<Nanos> {
        if let Some(t) = self.wheel.backlog {
            return Some(Nanos(t));
        }
        self.wheel.earliest().map(Nanos)
    }

    /// Engine shutdown: release every live lease as `shutdown`.
    pub fn shutdown(&mut self, now: Nanos, released: &mut Vec<Released<T>>) {
        for s in 0..self.hot.len() {
            if self.hot[s].deadline != 0 {
                self.end(s, ReleaseReason::Shutdown, now, released);
            }
        }
    }

    /// The payload of a live lease.
    pub fn get(&self, id: LeaseId) -> Option<&T> {
        self.cold[self.find(id)?].payload.as_ref()
    }

    /// The current deadline of a live lease (it may already be past, awaiting the reaper).
    pub fn deadline(&self, id: LeaseId) -> Option<Nanos> {
        self.find(id).map(|s| Nanos(self.hot[s].deadline))
    }

    /// Live leases (`kvlease_leases_active`).
    pub fn live(&self) -> usize {
        self.live
    }

    /// Blocks pinned by live leases (`kvlease_leased_blocks`).
    pub fn leased_blocks(&self) -> u64 {
        self.leased_blocks
    }

    /// Released leases whose payload readers still hold.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    pub fn stats(&self) -> &LeaseStats {
        &self.stats
    }

    /// Lease slots (a power of two; live leases fill at most 7/8 of them).
    pub fn capacity(&self) -> usize {
        self.hot.len()
    }

    /// The slot of a live lease.
    fn find(&self, id: LeaseId) -> Option<usize> {
        let s = (id & self.mask) as usize;
        let h = &self.hot[s];
        (id != 0 && h.deadline != 0 && u64::from(h.gen) == id >> self.shift).then_some(s)
    }

    /// The id of the lease in slot `s`.
    fn id_of(&self, s: usize) -> LeaseId {
        u64::from(self.hot[s].gen) << self.shift | s as u64
    }

    /// SPEC S5 for a live lease: whether `holder` may act on it; the first to ask owns it.
    fn admit(&mut self, s: usize, holder: Holder) -> bool {
        let h = &mut self.hot[s].holder;
        if *h == 0 {
            *h = holder.0.get();
        }
        *h == holder.0.get()
    }

    /// Ends a live lease: the one place a release happens and is counted (SPEC P3).
    fn end(&mut self, s: usize, reason: ReleaseReason, now: Nanos, released: &mut Vec<Released<T>>) {
        let h = self.hot[s];
        if h.deadline == 0 {
            return;
        }
        let id = self.id_of(s);
        self.unfile(s);
        self.hot[s] = VACANT;
        let payload = self.cold[s].payload.take();
        let blocks = self.cold[s].blocks;
        self.live -= 1;
        self.leased_blocks -= u64::from(blocks);
        self.stats.released[reason as usize] += 1;
        let readers = if self.aux.is_empty() { 0 } else { self.aux.remove(&id).map_or(0, |a| a.readers) };
        let payload = match payload {
            Some(p) if readers > 0 => {
                self.parked.insert(id, (p, readers));
                None
            }
            p => p,
        };
        released.push(Released { lease_id: id, reason, payload, blocks, held: now.since(Nanos(h.granted)) });
    }

    /// Doubles the slots; each live lease moves to `id mod` the new capacity, where no other
    /// can be (two ids equal mod 2c are equal mod c).
    fn grow(&mut self) {
        let cap = self.hot.len() * 2;
        let (mask, shift) = (cap as u64 - 1, self.shift + 1);
        let mut hot = vec![VACANT; cap];
        let mut cold = Cold::slots(cap);
        for s in 0..self.hot.len() {
            if self.hot[s].deadline != 0 {
                let id = self.id_of(s);
                let t = (id & mask) as usize;
                hot[t] = Hot { gen: (id >> shift) as u32, ..self.hot[s] };
                cold[t] = std::mem::replace(&mut self.cold[s], Cold::VACANT);
            }
        }
        let (old, old_shift) = (&self.hot, self.shift);
        for b in &mut self.wheel.buckets {
            for e in &mut b.slots {
                let id = u64::from(old[*e as usize].gen) << old_shift | u64::from(*e);
                *e = (id & mask) as u32;
            }
        }
        self.hot = hot;
        self.cold = cold;
        self.mask = mask;
        self.shift = shift;
    }

    /// Files slot `s` under `deadline`, in a bucket no earlier than `lo`.
    fn file(&mut self, s: usize, deadline: u64, lo: u64) {
        let w = &mut self.wheel;
        let ring = w.buckets.len() as u64;
        // Past the horizon an entry waits in the furthest bucket and is refiled when visited.
        let k = (deadline / w.width).clamp(lo, w.cursor + ring - 1).max(lo);
        let r = (k % ring) as usize;
        let b = &mut w.buckets[r];
        b.min = b.min.min(deadline);
        self.hot[s].bucket = r as u32;
        self.hot[s].pos = b.slots.len() as u32;
        b.slots.push(s as u32);
        w.len += 1;
        if let Some(p) = w.pass.as_mut().filter(|p| p.bucket == r) {
            p.filed_min = p.filed_min.min(deadline);
        }
    }

    /// Removes slot `s`'s expiry-index entry.
    fn unfile(&mut self, s: usize) {
        let (bucket, pos) = (self.hot[s].bucket, self.hot[s].pos);
        let b = &mut self.wheel.buckets[bucket as usize];
        let pos = pos as usize;
        if b.slots.get(pos) != Some(&(s as u32)) {
            debug_assert!(false, "expiry index out of step for slot {s}");
            return;
        }
        b.slots.swap_remove(pos);
        if let Some(&moved) = b.slots.get(pos) {
            self.hot[moved as usize].pos = pos as u32;
        }
        self.wheel.len -= 1;
    }

    /// The reaper (SPEC P4): visits due buckets in order, at most `budget` entries; each entry
    /// is released if its lease expired, refiled under its current deadline if the lease was
    /// renewed, or kept. Returns whether work is left.
    fn reap(&mut self, now: u64, budget: usize, released: &mut Vec<Released<T>>) -> bool {
        let ring = self.wheel.buckets.len() as u64;
        let now_k = now / self.wheel.width;
        let mut work = 0;
        if self.wheel.len == 0 {
            self.wheel.cursor = self.wheel.cursor.max(now_k);
            self.wheel.pass = None;
            return false;
        }
        // After a long gap every bucket is due: visit each once, not once per elapsed width.
        if now_k >= self.wheel.cursor + ring {
            self.wheel.cursor = now_k + 1 - ring;
            self.wheel.pass = None;
        }
        while self.wheel.cursor <= now_k {
            let cursor = self.wheel.cursor;
            let r = (cursor % ring) as usize;
            if cursor < now_k {
                // The cursor leaves this bucket: everything in it goes, expired or refiled
                // (also entries filed here from past the horizon).
                self.wheel.pass = None;
                while let Some(&s) = self.wheel.buckets[r].slots.last() {
                    if work >= budget {
                        return true;
                    }
                    work += 1;
                    let (s, d) = (s as usize, self.hot[s as usize].deadline);
                    if d <= now {
                        self.wheel.expired.push((d, self.id_of(s)));
                        self.end(s, ReleaseReason::Expired, Nanos(now), released);
                    } else {
                        self.unfile(s);
                        self.file(s, d, cursor + 1);
                    }
                }
                self.wheel.buckets[r].min = u64::MAX;
                self.wheel.cursor += 1;
                continue;
            }
            // The current bucket: release what expired, refile what was renewed past it, keep
            // the rest; a pass interrupted by the budget resumes where it stopped.
            let mut pass = match self.wheel.pass {
                Some(p) if p.bucket == r => p,
                _ => {
                    if self.wheel.buckets[r].min > now {
                        return false;
                    }
                    Pass { bucket: r, next: self.wheel.buckets[r].slots.len(), kept_min: u64::MAX, filed_min: u64::MAX }
                }
            };
            pass.next = pass.next.min(self.wheel.buckets[r].slots.len());
            self.wheel.pass = Some(pass);
            while pass.next > 0 {
                if work >= budget {
                    self.wheel.pass = Some(Pass { filed_min: self.wheel.pass.map_or(u64::MAX, |p| p.filed_min), ..pass });
                    return true;
                }
                work += 1;
                pass.next -= 1;
                let Some(&s) = self.wheel.buckets[r].slots.get(pass.next) else { continue };
                let (s, d) = (s as usize, self.hot[s as usize].deadline);
                if d <= now {
                    self.wheel.expired.push((d, self.id_of(s)));
                    self.end(s, ReleaseReason::Expired, Nanos(now), released);
                } else if d / self.wheel.width == cursor {
                    pass.kept_min = pass.kept_min.min(d);
                } else {
                    self.unfile(s);
                    self.file(s, d, cursor);
                }
            }
            let filed_min = self.wheel.pass.take().map_or(u64::MAX, |p| p.filed_min);
            let b = &mut self.wheel.buckets[r];
            b.min = if b.slots.is_empty() { u64::MAX } else { pass.kept_min.min(filed_min) };
            if b.min > now {
                return false;
            }
        }
        false
    }
}

/// The expiry index: a ring of buckets `width` ns wide covering `horizon` ahead of the cursor.
/// Each live lease has exactly one entry (its slot), filed under a deadline no later than its
/// lease's and removed when the lease ends; a renewed lease's entry is moved to the bucket of
/// its current deadline when its old bucket comes due, at most once per extension period.
#[derive(Debug)]
struct Wheel {
    width: u64,
    buckets: Vec<Bucket>,
    /// Absolute index (`deadline / width`) of the earliest bucket not yet fully visited.
    cursor: u64,
    len: usize,
    pass: Option<Pass>,
    /// Set while a budgeted tick left work over: that tick's time.
    backlog: Option<u64>,
    /// (deadline, id) of each lease the running tick expired, in the order it released them.
    expired: Vec<(u64, LeaseId)>,
}

#[derive(Debug, Clone)]
struct Bucket {
    /// No later than the earliest deadline filed here.
    min: u64,
    slots: Vec<u32>,
}

const EMPTY: Bucket = Bucket { min: u64::MAX, slots: Vec::new() };

impl Wheel {
    fn new(width: u64, horizon: u64) -> Wheel {
        let n = (horizon / width).saturating_add(3).min(1 << 16) as usize;
        Wheel { width, buckets: vec![EMPTY; n], cursor: 0, len: 0, pass: None, backlog: None, expired: Vec::new() }
    }

    fn earliest(&self) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        let ring = self.buckets.len() as u64;
        (0..ring).map(|i| &self.buckets[((self.cursor + i) % ring) as usize]).filter(|b| !b.slots.is_empty()).map(|b| b.min).min()
    }
}

#[cfg(test)]
mod head_only_tests {
    use super::*;

    /// The planted vLLM sweep (vLLM #58222): an expired lease behind a renewed one is not freed
    /// until the one before it ends; the real reaper frees it on time.
    #[test]
    fn head_only_sweep_frees_late_behind_a_renewed_head() {
        let cfg = LeaseConfig::with_lease_secs(30.0).unwrap();
        let s = Nanos(1_000_000_000);
        let sec = |x: u64| Duration::from_secs(x);
        let run = |head_only: bool| {
            let mut t: LeaseTable<u32> = LeaseTable::new(&cfg);
            let head = t.grant(s, 4, PromptDigest([1; 16]), 1);
            let behind = t.grant(s, 4, PromptDigest([2; 16]), 2);
            let holder = t.holder("d");
            let mut released = Vec::new();
            // D keeps renewing only the head.
            let mut now = s;
            while now < s + sec(60) {
                now = now + sec(5);
                t.on_message(holder, &Message::Heartbeat { seq: 1, lease_ids: vec![head] }, now, &mut released);
                if head_only {
                    t.tick_head_only(now, &mut released);
                } else {
                    t.tick(now, &mut released);
                }
            }
            (t.get(head).is_some(), t.get(behind).is_some())
        };
        assert_eq!(run(false), (true, false), "the real reaper frees the expired lease");
        assert_eq!(run(true), (true, true), "the head-only sweep stops at the renewed head");
    }
}
