//! P's leases (SPEC §4): grant, renew, complete, release, reap — exactly once each.
//!
//! Lease ids are handed out in a row, so live leases sit in a dense window indexed by
//! `id - base`: a heartbeat's sorted ids renew with sequential memory access and no hashing.
//! The window only ever holds O(live) slots: when stragglers keep its front alive while later
//! leases come and go, they move to a small side map. Renewal never touches the expiry index;
//! the index is a timing wheel of buckets `min(I/10, 100 ms)` wide, each remembering its earliest
//! deadline, so an idle reaper tick is O(1) and a tick that expires k leases costs O(k) (SPEC P4).
//! An index entry whose lease was renewed since is moved to the bucket of its current deadline
//! when its old bucket comes due, at most once per extension period.
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
use std::collections::{BTreeMap, HashMap, VecDeque};
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

/// The hot part of a lease, touched by every renewal. `deadline == 0` marks a vacant slot.
#[derive(Debug, Clone, Copy)]
struct Slot {
    deadline: u64,
    /// SPEC P9: the latest deadline a renewal may set.
    cap: u64,
    /// SPEC S5: who owns the lease; `None` until an engine first names it.
    holder: Option<Holder>,
}

const VACANT: Slot = Slot { deadline: 0, cap: 0, holder: None };

impl Slot {
    /// SPEC S5: whether `holder` may act on this live lease; the first to ask owns it.
    fn admit(&mut self, holder: Holder) -> bool {
        *self.holder.get_or_insert(holder) == holder
    }
}

#[derive(Debug)]
struct Entry<T> {
    payload: T,
    granted: Nanos,
    /// SPEC S4: the prompt the lease's KV belongs to.
    digest: PromptDigest,
    blocks: u32,
    readers: u32,
    /// SPEC P8: consumers expected (0 until the first completion says) and those that reported.
    expected: u32,
    done: Vec<u32>,
}

/// Payloads of released leases that readers still hold, by lease id: (payload, readers).
type Parked<T> = HashMap<LeaseId, (T, u32)>;

/// P's lease table for one engine.
#[derive(Debug)]
pub struct LeaseTable<T> {
    lease: u64,
    extension: u64,
    max_lifetime: Option<u64>,
    next_id: LeaseId,
    /// Id of `slots[0]`.
    base: LeaseId,
    slots: VecDeque<Slot>,
    entries: VecDeque<Option<Entry<T>>>,
    /// Live leases in the window.
    window_live: usize,
    /// Live leases that fell below `base`.
    side: HashMap<LeaseId, (Slot, Entry<T>)>,
    parked: Parked<T>,
    wheel: Wheel,
    leased_blocks: u64,
    stats: LeaseStats,
    /// SPEC S5: holders by authenticated engine name; ordered, so nothing depends on a hash seed.
    holders: BTreeMap<String, Holder>,
}

impl<T> LeaseTable<T> {
    pub fn new(cfg: &LeaseConfig) -> Self {
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let width = nanos(cfg.reap_granularity()).max(1);
        let horizon = nanos(cfg.lease_duration.max(cfg.extension));
        LeaseTable {
            lease: nanos(cfg.lease_duration),
            extension: nanos(cfg.extension),
            max_lifetime: cfg.max_lifetime.map(nanos),
            next_id: 1,
            base: 1,
            slots: VecDeque::new(),
            entries: VecDeque::new(),
            window_live: 0,
            side: HashMap::new(),
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
        let id = self.next_id;
        self.next_id += 1;
        let deadline = now.0.saturating_add(lifetime.as_nanos() as u64).max(1);
        let cap = match self.max_lifetime {
            Some(m) => now.0.saturating_add(m.max(self.lease)),
            None => u64::MAX,
        };
        self.slots.push_back(Slot { deadline, cap, holder: None });
        self.entries.push_back(Some(Entry { payload, granted: now, digest, blocks, readers: 0, expected: 0, done: Vec::new() }));
        self.window_live += 1;
        self.leased_blocks += u64::from(blocks);
        self.stats.granted += 1;
        self.wheel.insert(id, deadline);
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
        let mut renewed = 0;
        for &id in ids {
            let Some(slot) = self.slot_mut(id).filter(|s| s.holder.is_none_or(|h| h == holder)) else {
                lost.push(id);
                continue;
            };
            slot.holder = Some(holder);
            if slot.deadline <= now.0 {
                lost.push(id);
                self.end(id, ReleaseReason::Expired, now, released);
                continue;
            }
            let want = target.min(slot.cap);
            if want > slot.deadline {
                slot.deadline = want;
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
            match self.live_deadline(id) {
                None => lost.push(id),
                Some(_) if !self.admit(id, holder) => lost.push(id),
                Some(d) if d <= now.0 => {
                    lost.push(id);
                    self.end(id, ReleaseReason::Expired, now, released);
                }
                Some(_) => self.end(id, ReleaseReason::Released, now, released),
            }
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
        match self.live_deadline(id) {
            None => return Completion::Lost,
            Some(_) if self.entry_mut(id).is_some_and(|e| e.digest != digest) => return Completion::Lost,
            Some(_) if !self.admit(id, holder) => return Completion::Lost,
            Some(d) if d <= now.0 => {
                self.end(id, ReleaseReason::Expired, now, released);
                return Completion::Lost;
            }
            Some(_) => {}
        }
        let Some(entry) = self.entry_mut(id) else { return Completion::Lost };
        entry.expected = entry.expected.max(n.max(1));
        if !entry.done.contains(&consumer) {
            entry.done.push(consumer);
        }
        if entry.done.len() >= entry.expected as usize {
            self.end(id, ReleaseReason::Transferred, now, released);
            Completion::Transferred
        } else {
            Completion::Pending
        }
    }

    /// SPEC P5: a read of a live lease begins. Refused (`None`) for a lease that is not live, or
    /// that another holder owns (S5).
    pub fn begin_read(&mut self, holder: Holder, id: LeaseId, now: Nanos, released: &mut Vec<Released<T>>) -> Option<ReadTicket> {
        match self.live_deadline(id) {
            None => None,
            Some(_) if !self.admit(id, holder) => None,
            Some(d) if d <= now.0 => {
                self.end(id, ReleaseReason::Expired, now, released);
                None
            }
            Some(_) => {
                self.entry_mut(id)?.readers += 1;
                Some(ReadTicket { lease_id: id })
            }
        }
    }

    /// SPEC P5: a read ended. Returns the lease's payload if the lease was released while it was
    /// being read and this was its last reader: only now may its blocks be reused.
    pub fn end_read(&mut self, ticket: ReadTicket) -> Option<T> {
        let id = ticket.lease_id;
        if let Some(entry) = self.entry_mut(id) {
            entry.readers = entry.readers.saturating_sub(1);
            return None;
        }
        let (_, readers) = self.parked.get_mut(&id)?;
        *readers -= 1;
        if *readers == 0 {
            return self.parked.remove(&id).map(|(p, _)| p);
        }
        None
    }

    /// SPEC P4: release every lease whose deadline ≤ `now`, as `expired`.
    pub fn tick(&mut self, now: Nanos, released: &mut Vec<Released<T>>) {
        let mut due = std::mem::take(&mut self.wheel.scratch);
        loop {
            due.clear();
            if !self.wheel.take_due(now.0, &mut due) {
                break;
            }
            for &id in &due {
                match self.live_deadline(id) {
                    None => {}
                    Some(d) if d <= now.0 => self.end(id, ReleaseReason::Expired, now, released),
                    Some(d) => self.wheel.insert(id, d),
                }
            }
        }
        self.wheel.scratch = due;
    }

    /// When the next lease may expire: the driver's reaper need not tick before then. A lower
    /// bound (renewals are not reflected until that bucket is visited), never later than the truth.
    pub fn next_expiry(&self) -> Option<Nanos> {
        self.wheel.earliest().map(Nanos)
    }

    /// Engine shutdown: release every live lease as `shutdown`.
    pub fn shutdown(&mut self, now: Nanos, released: &mut Vec<Released<T>>) {
        let ids: Vec<LeaseId> = (0..self.slots.len() as u64)
            .filter(|&i| self.slots[i as usize].deadline != 0)
            .map(|i| self.base + i)
            .chain(self.side.keys().copied())
            .collect();
        for id in ids {
            self.end(id, ReleaseReason::Shutdown, now, released);
        }
    }

    /// The payload of a live lease.
    pub fn get(&self, id: LeaseId) -> Option<&T> {
        if id >= self.base {
            let i = usize::try_from(id - self.base).ok()?;
            return self.entries.get(i)?.as_ref().map(|e| &e.payload);
        }
        self.side.get(&id).map(|(_, e)| &e.payload)
    }

    /// The current deadline of a live lease (it may already be past, awaiting the reaper).
    pub fn deadline(&self, id: LeaseId) -> Option<Nanos> {
        self.live_deadline(id).map(Nanos)
    }

    /// Live leases (`kvlease_leases_active`).
    pub fn live(&self) -> usize {
        self.window_live + self.side.len()
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

    fn live_deadline(&self, id: LeaseId) -> Option<u64> {
        let d =
            if id >= self.base { self.slots.get(usize::try_from(id - self.base).ok()?)?.deadline } else { self.side.get(&id)?.0.deadline };
        (d != 0).then_some(d)
    }

    /// SPEC S5 for a live lease: see [`Slot::admit`].
    fn admit(&mut self, id: LeaseId, holder: Holder) -> bool {
        self.slot_mut(id).is_some_and(|s| s.admit(holder))
    }

    fn slot_mut(&mut self, id: LeaseId) -> Option<&mut Slot> {
        let slot =
            if id >= self.base { self.slots.get_mut(usize::try_from(id - self.base).ok()?)? } else { &mut self.side.get_mut(&id)?.0 };
        (slot.deadline != 0).then_some(slot)
    }

    fn entry_mut(&mut self, id: LeaseId) -> Option<&mut Entry<T>> {
        if id >= self.base {
            return self.entries.get_mut(usize::try_from(id - self.base).ok()?)?.as_mut();
        }
        self.side.get_mut(&id).map(|(_, e)| e)
    }

    /// Ends a live lease: the one place a release happens and is counted (SPEC P3).
    fn end(&mut self, id: LeaseId, reason: ReleaseReason, now: Nanos, released: &mut Vec<Released<T>>) {
        let entry = if id >= self.base {
            let Some(i) = usize::try_from(id - self.base).ok().filter(|&i| i < self.slots.len()) else { return };
            if self.slots[i].deadline == 0 {
                return;
            }
            self.slots[i] = VACANT;
            self.window_live -= 1;
            let Some(entry) = self.entries[i].take() else { return };
            self.compact();
            entry
        } else {
            let Some((_, entry)) = self.side.remove(&id) else { return };
            entry
        };
        self.leased_blocks -= u64::from(entry.blocks);
        self.stats.released[reason as usize] += 1;
        let payload = if entry.readers > 0 {
            self.parked.insert(id, (entry.payload, entry.readers));
            None
        } else {
            Some(entry.payload)
        };
        released.push(Released { lease_id: id, reason, payload, blocks: entry.blocks, held: now.since(entry.granted) });
    }

    /// Drops vacant slots off the front; moves live stragglers to the side map when the window
    /// is mostly holes, so memory stays O(live) whatever the lifetimes.
    fn compact(&mut self) {
        while let Some(front) = self.slots.front().copied() {
            let sparse = self.slots.len() > 1024 && self.slots.len() > 4 * self.window_live;
            if front.deadline != 0 && !sparse {
                break;
            }
            self.slots.pop_front();
            if let Some(Some(entry)) = self.entries.pop_front() {
                self.side.insert(self.base, (front, entry));
                self.window_live -= 1;
            }
            self.base += 1;
        }
    }
}

/// The expiry index: a ring of buckets `width` ns wide covering `horizon` ahead of the cursor.
/// Entries are lease ids filed under a deadline no later than their lease's; entries for leases
/// that have since been released are dropped when their bucket is visited.
#[derive(Debug)]
struct Wheel {
    width: u64,
    buckets: Vec<Bucket>,
    /// Absolute index (`deadline / width`) of the earliest bucket not yet fully visited.
    cursor: u64,
    len: usize,
    scratch: Vec<LeaseId>,
}

#[derive(Debug, Clone)]
struct Bucket {
    min: u64,
    ids: Vec<LeaseId>,
}

const EMPTY: Bucket = Bucket { min: u64::MAX, ids: Vec::new() };

impl Wheel {
    fn new(width: u64, horizon: u64) -> Wheel {
        let n = (horizon / width).saturating_add(3).min(1 << 16) as usize;
        Wheel { width, buckets: vec![EMPTY; n], cursor: 0, len: 0, scratch: Vec::new() }
    }

    fn insert(&mut self, id: LeaseId, deadline: u64) {
        let ring = self.buckets.len() as u64;
        // Past the horizon an entry waits in the furthest bucket and is refiled when visited.
        let k = (deadline / self.width).clamp(self.cursor, self.cursor + ring - 1);
        let b = &mut self.buckets[(k % ring) as usize];
        b.min = b.min.min(deadline);
        b.ids.push(id);
        self.len += 1;
    }

    /// Moves the entries of one due bucket (one whose earliest deadline ≤ now, or one the
    /// cursor passes) into `out`.
    /// Returns false when no bucket is due.
    fn take_due(&mut self, now: u64, out: &mut Vec<LeaseId>) -> bool {
        let ring = self.buckets.len() as u64;
        let now_k = now / self.width;
        if self.len == 0 {
            self.cursor = self.cursor.max(now_k);
            return false;
        }
        // After a long gap every bucket is due: visit each once, not once per elapsed width.
        if now_k >= self.cursor + ring {
            self.cursor = now_k + 1 - ring;
        }
        while self.cursor <= now_k {
            let b = &mut self.buckets[(self.cursor % ring) as usize];
            // A bucket the cursor is leaving may still hold far entries filed at the horizon:
            // they are taken too and refiled, never left to wait a whole turn of the ring.
            if b.min <= now || (self.cursor < now_k && !b.ids.is_empty()) {
                self.len -= b.ids.len();
                std::mem::swap(out, &mut b.ids);
                b.min = u64::MAX;
                return true;
            }
            if self.cursor == now_k {
                break;
            }
            self.cursor += 1;
        }
        false
    }

    fn earliest(&self) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        let ring = self.buckets.len() as u64;
        (0..ring).map(|i| self.buckets[((self.cursor + i) % ring) as usize].min).find(|&m| m != u64::MAX)
    }
}
