//! P's leases (SPEC §4): grant, renew, complete, release, reap — exactly once each.
//!
//! Slots are addressed by the lease id through linear hashing (with `2^k ≤ capacity ≤
//! 2^(k+1)`, lease `id` lives in slot `id mod 2^(k+1)`, or `id mod 2^k` where that is past the
//! end); the slot keeps the id's high bits (its generation), so finding a lease is one index and
//! one comparison under any pattern of grants and releases, and an id whose slot has since been
//! reused is lost, never another lease (ids are never handed out twice: SPEC §3). The table
//! grows a few slots at a time, splitting one slot per new slot, so live leases fill 94–97 % of
//! the slots at every size and no grant moves more than 2,048 leases. Ids are handed out in
//! a row, skipping only ids whose slot a lease of an earlier turn still holds, so a heartbeat's
//! sorted ids stay nearly consecutive on the wire; a bitmap of taken slots lets a grant skip a
//! run of them a word at a time. A slot is a lease record (generation, deadline and grant time
//! — times in milliseconds from a table epoch that moves forward every 12 days —, holder and
//! block count in 16 bits each, larger values kept whole in a side map, and the payload: 16
//! bytes and the payload, a vacant slot costing nothing more) and, beside it, the 8-byte links of
//! the expiry index. A renewal reads and writes the record and never touches the index. The index
//! is a timing wheel of buckets `min(I/10, 100 ms)` wide, each a doubly linked list threaded
//! through the slots and remembering its earliest deadline, so an idle reaper tick is O(1) and
//! a tick that expires k leases costs O(k) (SPEC P4); a tick can be given a work budget and
//! carries the rest over. An index entry whose lease was renewed since is moved to the bucket
//! of its current deadline when its old bucket comes due, at most once per extension period. A
//! release leaves its entry in the list as a hole (its slot is free at once) that the reaper
//! drops when it passes, or that a later grant due no earlier takes over as it is: a release
//! touches its own slot, not its neighbours in the list. Per live lease: 24 B and the payload
//! per slot, two bits of bitmaps, at 94–97 % fill; nothing else grows with the live count (but
//! for a decoder's cached turns, SPEC B1, whose ids also sit in an ordered set for eviction).
//!
//! The table owns a payload per lease (the engine's block guards) and hands it back when the
//! lease is released; if a read of the lease is in progress (SPEC P5) the payload is held until
//! the last reader ends, so no block is reused under a reader.
//!
//! Every lease belongs to one [`Holder`] (SPEC S5): the first engine, as the transport
//! authenticated it, to renew, read, complete or release it. Messages about it from any other
//! engine are answered as lost and change nothing, so an engine of the cluster cannot release,
//! complete or keep alive another engine's leases by guessing their (sequential) ids. The
//! payload names the digest of the prompt the lease was granted for ([`LeasePayload`], SPEC
//! S4): a completion for another prompt is not confirmed.

use crate::config::LeaseConfig;
use crate::digest::PromptDigest;
use crate::wire::Message;
use crate::{LeaseId, Nanos};
use std::collections::{BTreeMap, BTreeSet, HashMap};
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

/// What the table asks of the payload the engine attaches to a lease: the digest of the prompt
/// the lease's KV belongs to (SPEC S4), which the engine keeps there rather than the table
/// keeping 16 bytes of it per slot. `None`: nothing to check; a read or completion for any
/// prompt is confirmed. No default: every payload type says which it is (the engine's always
/// names its digest), so none turns the S4 check off by forgetting.
pub trait LeasePayload {
    fn prompt_digest(&self) -> Option<&PromptDigest>;
}

/// Payloads with no prompt behind them (benches, tests, the simulator's traffic model).
macro_rules! no_prompt {
    ($($t:ty),*) => {$(
        impl LeasePayload for $t {
            fn prompt_digest(&self) -> Option<&PromptDigest> {
                None
            }
        }
    )*};
}
no_prompt!((), u32, u64, &str);

/// A payload `T` for the prompt whose digest is the first field (SPEC S4).
impl<T> LeasePayload for (PromptDigest, T) {
    fn prompt_digest(&self) -> Option<&PromptDigest> {
        Some(&self.0)
    }
}

/// A live lease: everything but its expiry-index links ([`Link`]), so a renewal or a release
/// reads and writes this record only. 16 bytes and the payload; a vacant slot is `None` at no
/// cost (the deadline is never 0). Times are milliseconds from the table's epoch
/// (`LeaseTable::epoch`), which moves forward long before they would overflow.
#[derive(Debug)]
struct Lease<T> {
    /// Rounded up to the millisecond: a lease never ends before the deadline D was given.
    deadline: NonZeroU32,
    /// The lease id's high bits: `id >> k` in a slot of `k` bits (see [`LeaseTable::slot`]).
    gen: u32,
    /// SPEC S5: who owns the lease: 0 until an engine first names it, else its holder number,
    /// or `WIDE` for a holder number that does not fit (in [`LeaseTable::wide`]).
    holder: u16,
    /// The lease's blocks, or `WIDE` for a count that does not fit (in [`LeaseTable::wide`]).
    blocks: u16,
    /// Grant time, rounded down; SPEC P9's cap is `granted + max(max_lifetime, L)`.
    granted: u32,
    payload: T,
}

/// A slot's place in the expiry index (a doubly linked list per wheel bucket threaded through
/// the slots), kept apart from the leases so renewals walk 20 bytes a slot (with a `u32`
/// payload), not 28. A slot whose lease was released by anything but the reaper stays in its
/// list as a *hole* (no lease, still linked) until the reaper passes it or a grant reuses it with
/// its entry: a release touches its own lease only, not its neighbours' links.
#[derive(Debug, Clone, Copy)]
struct Link {
    /// The next slot in the bucket's list, or `NIL`.
    next: u32,
    /// The previous slot in the bucket's list, `HEAD | bucket` for the first, `NIL`: unlinked.
    prev: u32,
}

const UNLINKED: Link = Link { next: NIL, prev: NIL };

/// A lease's holder and block count where they do not fit its record's 16 bits (rare: 65,535
/// blocks in one lease, or an engine past the 65,534th the table met).
#[derive(Debug, Default, Clone, Copy)]
struct Wide {
    holder: u32,
    blocks: u32,
}

/// In [`Lease::holder`] and [`Lease::blocks`]: the value is in [`LeaseTable::wide`].
const WIDE: u16 = u16::MAX;

/// The 16-bit form of a holder number or block count (`WIDE`: too large).
#[inline]
fn narrow(x: u32) -> u16 {
    u16::try_from(x).ok().filter(|&x| x != WIDE).unwrap_or(WIDE)
}

/// SPEC S5 for the live lease `id` with record `l`: whether engine `who` may act on it; the
/// first to ask owns it.
fn claim<T>(l: &mut Lease<T>, wide: &mut HashMap<LeaseId, Wide>, id: LeaseId, who: u32) -> bool {
    let code = narrow(who);
    let first = l.holder == 0;
    if first {
        l.holder = code;
    } else if l.holder != code {
        return false;
    }
    code != WIDE || claim_wide(wide, id, who, first)
}

/// [`claim`] for a holder number past 16 bits, kept in `wide`: the first to ask owns the lease,
/// later askers must match it.
#[cold]
#[inline(never)]
fn claim_wide(wide: &mut HashMap<LeaseId, Wide>, id: LeaseId, who: u32, first: bool) -> bool {
    if first {
        wide.entry(id).or_default().holder = who;
        return true;
    }
    wide.get(&id).is_some_and(|w| w.holder == who)
}

/// The record in slot `s` (named by the low `w` bits of an id) if it is lease `id`'s: `find`
/// for a caller that goes on to change the record (a borrow of the pages alone, so the caller
/// may still use the table's other fields).
#[inline(always)]
fn record_of<T>(pages: &mut [Page<T>], s: usize, w: u32, id: LeaseId) -> Option<&mut Lease<T>> {
    let l = pages.get_mut(s >> PAGE_BITS)?.lease.get_mut(s & (PAGE - 1))?.as_mut()?;
    (id != 0 && u64::from(l.gen) == id >> w).then_some(l)
}

/// What the table's tests read of a slot: the lease's deadline (0: vacant).
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
struct Hot {
    deadline: u32,
}

const NIL: u32 = u32::MAX;
const HEAD: u32 = 1 << 31;

/// Slots per page: the table grows by appending slots to the last page, never by doubling.
const PAGE_BITS: u32 = 14;
const PAGE: usize = 1 << PAGE_BITS;
/// The most slots one growth step adds.
const GROW_MAX: usize = 2048;

/// `PAGE` slots (the last page may be shorter): leases and links side by side.
#[derive(Debug)]
struct Page<T> {
    lease: Vec<Option<Lease<T>>>,
    link: Vec<Link>,
}

/// Heartbeat ids ahead of the one being renewed whose records [`LeaseTable::renew`] asks the
/// CPU to fetch: a heartbeat's ids are scattered over the table, each record a cache miss, and
/// fetching a few ahead lets those misses overlap rather than follow one another. 16, not 8:
/// a renewal takes about 8 ns and a miss to memory about ten times that (table27 bench, 12-05:
/// heartbeats 6.1-8.3x the `HashMap` at 16 against 4.7-6.0x at 8, alternated).
const FETCH_AHEAD: usize = 16;

/// A hint that the cache line at `p` is needed soon. It changes nothing the program computes;
/// `p` need not point at anything valid.
#[inline(always)]
fn prefetch<X>(p: *const X) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetch` needs SSE, which every x86_64 CPU has, and never faults or reads into
    // the program, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
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

/// Live leases fill at most `1 - 1/FREE_SHARE` of the slots (31/32): the rest keeps the
/// grant's search for a free slot short and ids nearly consecutive.
const FREE_SHARE: usize = 32;
const MIN_SLOTS: usize = 16;
/// Nanoseconds per unit of the table's 32-bit times.
const MS: u64 = 1_000_000;
/// The epoch moves forward once now is this far past it (about 24.9 days), by `REBASE_BY`.
const REBASE_AT: u64 = 1 << 31;
const REBASE_BY: u64 = 1 << 30;

/// A reaper pass over the current bucket, interrupted by its work budget or still running.
#[derive(Debug, Clone, Copy)]
struct Pass {
    bucket: usize,
    /// The next slot to look at in the bucket's list (`NIL`: the pass is through).
    next: u32,
    /// Earliest deadline among the entries the pass kept.
    kept_min: u64,
    /// Earliest deadline filed into this bucket since the pass began.
    filed_min: u64,
}

/// P's lease table for one engine.
///
/// Slots are addressed by linear hashing on the lease id: with `2^k ≤ capacity < 2^(k+1)`,
/// lease `id` lives in slot `id mod 2^(k+1)`, or `id mod 2^k` when that is past the end. The
/// table grows a few slots at a time by splitting the next slot of the round (moving the lease
/// in it, if any, to the new slot), so it never doubles, never moves every lease at once and
/// stays between 94 % and 97 % full. Each slot keeps the id's high bits, so a lookup is one
/// index and one comparison, and an id whose slot was reused is lost, never another lease. Ids
/// still increase by one per grant except where the next slot is taken by a lease still live,
/// which is skipped: ids granted in a row stay nearly consecutive on the wire.
#[derive(Debug)]
pub struct LeaseTable<T> {
    lease: u64,
    extension: u64,
    max_lifetime: Option<u64>,
    /// Never handed out twice (SPEC §3 fencing token); ids only increase.
    next_id: LeaseId,
    /// Linear hashing: `2^k ≤ cap ≤ 2^(k+1)`; slots `[0, cap - 2^k)` and `[2^k, cap)` are split
    /// (addressed by `k + 1` bits), the rest by `k` bits.
    k: u32,
    cap: usize,
    pages: Vec<Page<T>>,
    /// One bit per slot, set while a lease holds it: a grant skips a run of taken slots a word at
    /// a time.
    used: Vec<u64>,
    /// One bit per slot, set while it is a hole (see [`Link`]): a grant learns it without
    /// reading the slot, so granting writes the slot without waiting for it.
    holes: Vec<u64>,
    /// Holders and block counts too large for a record's 16 bits, by lease id (see [`Wide`]).
    wide: HashMap<LeaseId, Wide>,
    /// The latest deadline (table time) a lease had when it was released into a hole. A hole's
    /// entry is filed no later than that deadline, so a lease due no earlier than this may take
    /// the entry over. Only leases due within L of their release leave a hole, so this stays
    /// about `now + L`, below a plain grant's deadline.
    holes_until: u32,
    /// The table's times are milliseconds from here (a multiple of 1 ms, only increasing).
    epoch: u64,
    /// `epoch + REBASE_AT` ms: the epoch moves once now reaches this ([`LeaseTable::rebase`]).
    rebase_from: u64,
    /// A grant grows the table first once this many leases are live (the load bound, kept with
    /// the capacity).
    grow_at: usize,
    /// The first id a slot's 32-bit generation cannot name at the current `k`.
    id_end: u64,
    live: usize,
    aux: HashMap<LeaseId, Aux>,
    parked: Parked<T>,
    wheel: Wheel,
    leased_blocks: u64,
    stats: LeaseStats,
    /// SPEC S5: holders by authenticated engine name; ordered, so nothing depends on a hash seed.
    holders: BTreeMap<String, Holder>,
    /// Simulator only ([`LeaseTable::tick_head_only`]): ids below this have ended.
    head_only_from: LeaseId,
    /// Every read of the leased blocks passes [`LeaseTable::begin_read`] (the `tcp` agent's
    /// gate; not NIXL): a completion of a live lease needs no acknowledgement.
    fenced_reads: bool,
    /// SPEC B1: the live cached turns ([`LeaseTable::grant_turn`]), the ones
    /// [`LeaseTable::evict_turn`] may end. Ids only increase, so this is oldest first. Empty on
    /// an engine that keeps no turns: nothing else pays for it.
    turns: BTreeSet<LeaseId>,
}

/// The cached turn [`LeaseTable::evict_turn`] ended (as `released`), and what its conversation
/// loses by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evicted {
    /// No engine had named it (no heartbeat, read or release): nobody continues the
    /// conversation now; its next turn, if any, is recomputed.
    Unclaimed(LeaseId),
    /// A prefill engine was renewing it (B3) but not reading it: its next turn, waiting on that
    /// engine, is recomputed there (D7: same output) rather than holding the blocks.
    Claimed(LeaseId),
}

impl Evicted {
    pub fn lease_id(self) -> LeaseId {
        match self {
            Evicted::Unclaimed(id) | Evicted::Claimed(id) => id,
        }
    }
}

impl<T> LeaseTable<T> {
    pub fn new(cfg: &LeaseConfig) -> Self {
        Self::with_capacity(cfg, 0)
    }

    /// A table sized for `live` leases at once, so it need not grow (growing splits a few
    /// slots per grant, moving at most one lease each).
    pub fn with_capacity(cfg: &LeaseConfig, live: usize) -> Self {
        let slots = (live + live / (FREE_SHARE - 1) + 2).clamp(MIN_SLOTS, 1 << 31);
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let width = nanos(cfg.reap_granularity()).max(1);
        let horizon = nanos(cfg.lease_duration.max(cfg.extension));
        let mut t = LeaseTable {
            lease: nanos(cfg.lease_duration),
            extension: nanos(cfg.extension),
            max_lifetime: cfg.max_lifetime.map(nanos),
            next_id: 1,
            k: MIN_SLOTS.trailing_zeros(),
            cap: 0,
            pages: Vec::new(),
            used: Vec::new(),
            holes: Vec::new(),
            wide: HashMap::new(),
            holes_until: 0,
            epoch: 0,
            rebase_from: REBASE_AT * MS,
            grow_at: 0,
            id_end: 0,
            live: 0,
            aux: HashMap::new(),
            parked: HashMap::new(),
            wheel: Wheel::new(width, horizon),
            leased_blocks: 0,
            stats: LeaseStats::default(),
            holders: BTreeMap::new(),
            head_only_from: 1,
            fenced_reads: false,
            turns: BTreeSet::new(),
        };
        t.append(slots);
        t.cap = MIN_SLOTS;
        t.resized();
        while t.cap < slots {
            t.split();
        }
        t
    }

    /// Whether every read of the leased blocks is fenced by [`LeaseTable::begin_read`] (the
    /// transport's gate refuses a read of a lease that is not live). Then a `ReadDone` of a live
    /// lease is not acknowledged: D, reading through the same gate, does not wait for it.
    pub fn set_fenced_reads(&mut self, fenced: bool) {
        self.fenced_reads = fenced;
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

    /// SPEC P1: grant a lease of `L` from `now` over `blocks` blocks, owning `payload` (which
    /// names the prompt's digest, SPEC S4). The caller grants only for a request that finished
    /// prefill normally and holds ≥ 1 block.
    pub fn grant(&mut self, now: Nanos, blocks: u32, payload: T) -> LeaseId {
        self.grant_ns(now, self.lease, blocks, payload)
    }

    /// SPEC B1: a grant whose first deadline is `lifetime` away rather than L (a decoder's
    /// cached turn, held for `decoder_kv_blocks_ttl`); renewals, release and expiry as for any
    /// lease.
    pub fn grant_for(&mut self, now: Nanos, lifetime: Duration, blocks: u32, payload: T) -> LeaseId {
        self.grant_ns(now, u64::try_from(lifetime.as_nanos()).unwrap_or(u64::MAX), blocks, payload)
    }

    /// [`LeaseTable::grant_for`] with the lifetime in nanoseconds.
    fn grant_ns(&mut self, now: Nanos, lifetime: u64, blocks: u32, payload: T) -> LeaseId {
        self.rebase(now);
        while self.live >= self.grow_at {
            self.grow();
        }
        // Skip ids whose slot a lease of an earlier turn still holds; the load bound keeps a
        // free slot in every 32 on average. A slot keeps 32 bits of the id: past them the table
        // grows (after 2^36 grants at least).
        let s = loop {
            if self.next_id >= self.id_end {
                self.grow();
                continue;
            }
            let s = self.slot(self.next_id);
            let (run, free) = self.taken_run(self.next_id, s);
            self.next_id += run;
            if free {
                debug_assert_eq!(s + run as usize, self.slot(self.next_id), "id {} run {run} cap {} k {}", self.next_id, self.cap, self.k);
                break s + run as usize;
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        let deadline_ns = now.0.saturating_add(lifetime);
        let deadline = self.ms_ceil(deadline_ns);
        let granted = self.ms_floor(now.0);
        let gen = (id >> self.width(s)) as u32;
        let narrow_blocks = narrow(blocks);
        if narrow_blocks == WIDE {
            self.wide.entry(id).or_default().blocks = blocks;
        }
        let lease = Lease {
            deadline: NonZeroU32::new(deadline).unwrap_or(NonZeroU32::MIN),
            gen,
            holder: 0,
            blocks: narrow_blocks,
            granted,
            payload,
        };
        // A hole's entry is filed no later than any deadline a released lease had when it left
        // a hole (`holes_until`): this lease, due no earlier, may take it over as it is.
        let linked = self.holes[s / 64] & (1 << (s % 64)) != 0;
        let keep = linked && deadline >= self.holes_until;
        if linked && !keep {
            self.unfile(s);
        }
        self.holes[s / 64] &= !(1 << (s % 64));
        self.pages[s >> PAGE_BITS].lease[s & (PAGE - 1)] = Some(lease);
        self.used[s / 64] |= 1 << (s % 64);
        self.live += 1;
        self.leased_blocks += u64::from(blocks);
        self.stats.granted += 1;
        if !keep {
            let cursor = self.wheel.cursor;
            self.file(s, self.ns(deadline), cursor);
        }
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
        self.rebase(now);
        let now_ms = self.ms_floor(now.0);
        let target = self.ms_ceil(now.0.saturating_add(self.extension));
        let who = holder.0.get();
        let code = narrow(who);
        let life = self.max_lifetime.map(|m| u32::try_from(m.max(self.lease) / MS).unwrap_or(u32::MAX));
        let mut renewed = 0;
        let (k, cap) = (self.k, self.cap);
        let (base, mask) = (1usize << k, (2u64 << k) - 1);
        let slot = |id: LeaseId| {
            let s = (id & mask) as usize;
            if s >= cap {
                s - base
            } else {
                s
            }
        };
        for &id in ids.iter().take(FETCH_AHEAD) {
            self.prefetch_lease(slot(id));
        }
        for (i, &id) in ids.iter().enumerate() {
            if let Some(&ahead) = ids.get(i + FETCH_AHEAD) {
                self.prefetch_lease(slot(ahead));
            }
            // `find` on the record, indexed once (slot and width from the values read above).
            let s = slot(id);
            let w = k + u32::from(s < cap - base || s >= base);
            let Some(h) = record_of(&mut self.pages, s, w, id) else {
                lost.push(id);
                continue;
            };
            // SPEC S5: the first holder to name the lease owns it.
            if h.holder == 0 {
                h.holder = code;
                if code == WIDE {
                    self.wide.entry(id).or_default().holder = who;
                }
            } else if h.holder != code || (code == WIDE && self.wide.get(&id).map(|x| x.holder) != Some(who)) {
                lost.push(id);
                continue;
            }
            if h.deadline.get() <= now_ms {
                lost.push(id);
                self.end(s, ReleaseReason::Expired, now, released);
                continue;
            }
            let cap = life.map_or(u32::MAX, |m| h.granted.saturating_add(m));
            let want = target.min(cap);
            if let Some(want) = NonZeroU32::new(want).filter(|&w| w > h.deadline) {
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

    /// SPEC D4, P6: D will not read these leases; release the live ones as `released`. Leases
    /// another holder owns go to `lost` unchanged (S5).
    pub fn release(&mut self, holder: Holder, ids: &[LeaseId], now: Nanos, lost: &mut Vec<LeaseId>, released: &mut Vec<Released<T>>) {
        self.rebase(now);
        let who = holder.0.get();
        for &id in ids {
            // `find`, `admit` and `expired` on one record, looked up once: a release of a random
            // id is one cache miss, and the fewer instructions around it, the more of the next
            // release's miss the CPU overlaps with this one's.
            let s = self.slot(id);
            let w = self.width(s);
            let Some(l) = record_of(&mut self.pages, s, w, id) else {
                lost.push(id);
                continue;
            };
            if !claim(l, &mut self.wide, id, who) {
                lost.push(id);
                continue;
            }
            // Past its deadline at `now` (`expired`, without converting `now`).
            let reason = if self.epoch.saturating_add(u64::from(l.deadline.get()) * MS) <= now.0 {
                lost.push(id);
                ReleaseReason::Expired
            } else {
                ReleaseReason::Released
            };
            self.end_id(s, id, reason, now, released);
        }
    }

    /// SPEC B1: a decoder's cached turn: a lease like [`LeaseTable::grant_for`]'s (first
    /// deadline `ttl` away), that the granting engine may also take back when it needs the blocks
    /// ([`LeaseTable::evict_turn`]).
    pub fn grant_turn(&mut self, now: Nanos, ttl: Duration, blocks: u32, payload: T) -> LeaseId {
        let id = self.grant_for(now, ttl, blocks, payload);
        self.turns.insert(id);
        id
    }

    /// SPEC B1: the granting engine needs blocks for new requests: end the cached turn it can
    /// best spare, as `released`, and say which. A cached turn is a cache, and a turn ended early
    /// costs its conversation a recompute, never a wrong answer (D7: a later heartbeat or read of
    /// it is answered `LeaseLost`, P5, P6). The order:
    ///
    /// 1. the oldest turn no engine has claimed: nobody continues that conversation now;
    /// 2. else the oldest turn a prefill engine renews (B3) but is not reading: its next turn
    ///    waits on that engine, which recomputes the prompt instead. Never evicting those could
    ///    hold the decoder's pool forever: a prefill engine whose queue waits on the decoder's
    ///    requests (their leases pin its blocks while the decoder cannot admit them) keeps
    ///    renewing the turns that fill the decoder's pool;
    /// 3. never a turn under a read (P5): the read ends soon, and its blocks come back then.
    ///
    /// A turn past its deadline that the scan meets is released as `expired` (what the reaper
    /// would do on its next tick) and its blocks are in `released` too, without counting as an
    /// eviction. `None`: no turn can be evicted now.
    pub fn evict_turn(&mut self, now: Nanos, released: &mut Vec<Released<T>>) -> Option<Evicted> {
        self.rebase(now);
        let (mut unclaimed, mut claimed, mut expired) = (None, None, Vec::new());
        for &id in &self.turns {
            let Some(s) = self.find(id) else { continue };
            if self.expired(s, now) {
                expired.push(s);
            } else if self.aux.get(&id).is_some_and(|a| a.readers > 0) {
                continue;
            } else if self.holder_in(s) == 0 {
                unclaimed = Some((s, Evicted::Unclaimed(id)));
                break;
            } else if claimed.is_none() {
                claimed = Some((s, Evicted::Claimed(id)));
            }
        }
        for s in expired {
            self.end(s, ReleaseReason::Expired, now, released);
        }
        let (s, evicted) = unclaimed.or(claimed)?;
        self.end(s, ReleaseReason::Released, now, released);
        Some(evicted)
    }

    /// Live cached turns ([`LeaseTable::grant_turn`]).
    pub fn turns(&self) -> usize {
        self.turns.len()
    }

    /// SPEC P5: a read of a live lease begins. Refused (`None`) for a lease that is not live,
    /// that another holder owns (S5), or, when the reader shows the digest of the prompt it reads
    /// for, whose payload names another prompt (S4: checked here, before a byte is served, as
    /// well as on the read's completion).
    pub fn begin_read(
        &mut self,
        holder: Holder,
        id: LeaseId,
        digest: Option<PromptDigest>,
        now: Nanos,
        released: &mut Vec<Released<T>>,
    ) -> Option<ReadTicket>
    where
        T: LeasePayload,
    {
        self.rebase(now);
        let other_prompt = |p: Option<&T>| match (digest, p.and_then(LeasePayload::prompt_digest)) {
            (Some(shown), Some(granted)) => shown != *granted,
            _ => false,
        };
        match self.find(id) {
            None => None,
            Some(_) if other_prompt(self.get(id)) => None,
            Some(s) if !self.admit(s, holder) => None,
            Some(s) if self.expired(s, now) => {
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
        self.rebase(now);
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
    /// Ids only increase, so grant order is id order: the sweep walks ids up from the oldest
    /// it has not passed (amortised O(1) per lease; it sorted every live lease per call before,
    /// which made `kvlease sim --rate 400` take minutes).
    #[doc(hidden)]
    pub fn tick_head_only(&mut self, now: Nanos, released: &mut Vec<Released<T>>) -> Option<Nanos> {
        self.rebase(now);
        while self.head_only_from < self.next_id {
            if let Some(s) = self.find(self.head_only_from) {
                let d = self.ns(self.deadline_ms(s));
                if d > now.0 {
                    return Some(Nanos(d));
                }
                self.end(s, ReleaseReason::Expired, now, released);
            }
            self.head_only_from += 1;
        }
        None
    }

    /// When the next lease may expire: the driver's reaper need not tick before then. A lower
    /// bound (renewals and released leases are not reflected until that bucket is visited:
    /// it may name the deadline of a lease already released), never later than the
    /// truth; while a budgeted tick left work over, the time of that tick.
    pub fn next_expiry(&self) -> Option<Nanos> {
        if let Some(t) = self.wheel.backlog {
            return Some(Nanos(t));
        }
        self.wheel.earliest().map(Nanos)
    }

    /// Engine shutdown: release every live lease as `shutdown`.
    pub fn shutdown(&mut self, now: Nanos, released: &mut Vec<Released<T>>) {
        for s in 0..self.cap {
            if self.deadline_ms(s) != 0 {
                self.end(s, ReleaseReason::Shutdown, now, released);
            }
        }
    }

    /// P ends one of its leases itself, whoever holds it: its read completed as the transport
    /// reported it (`Transferred`; vLLM's NIXL notifications), or its request went away
    /// (`Released`). Returns whether it was live.
    pub fn end_lease(&mut self, id: LeaseId, reason: ReleaseReason, now: Nanos, released: &mut Vec<Released<T>>) -> bool {
        self.rebase(now);
        match self.find(id) {
            Some(s) => {
                self.end(s, reason, now, released);
                true
            }
            None => false,
        }
    }

    /// SPEC S5: the engine that holds a live lease (the first whose renewal, release or
    /// completion named it), or `None` when it is not live or nobody has named it yet.
    pub fn holder_of(&self, id: LeaseId) -> Option<Holder> {
        self.find(id).and_then(|s| NonZeroU32::new(self.holder_in(s))).map(Holder)
    }

    /// SPEC P5, asked without acting: whether `holder` may use a read of lease `id` that just
    /// completed — the lease is live, not past its deadline, and not another holder's (S5). A
    /// lease found past its deadline ends here as `expired`. Claims nothing.
    pub fn confirms(&mut self, holder: Holder, id: LeaseId, now: Nanos, released: &mut Vec<Released<T>>) -> bool {
        self.rebase(now);
        let Some(s) = self.find(id) else { return false };
        if self.expired(s, now) {
            self.end(s, ReleaseReason::Expired, now, released);
            return false;
        }
        let h = self.holder_in(s);
        h == 0 || h == holder.0.get()
    }

    /// The payload of a live lease.
    pub fn get(&self, id: LeaseId) -> Option<&T> {
        let s = self.find(id)?;
        self.lease(s).map(|l| &l.payload)
    }

    /// The payload of a live lease, to change (P fills in what it learns at the grant: the
    /// lease id its params digest binds, S4).
    pub fn get_mut(&mut self, id: LeaseId) -> Option<&mut T> {
        let s = self.find(id)?;
        self.lease_mut(s).map(|l| &mut l.payload)
    }

    /// The current deadline of a live lease (it may already be past, awaiting the reaper),
    /// rounded up to the millisecond.
    pub fn deadline(&self, id: LeaseId) -> Option<Nanos> {
        self.find(id).map(|s| Nanos(self.ns(self.deadline_ms(s))))
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

    /// Lease slots (live leases fill at most 31/32 of them).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Asks the CPU to fetch slot `s`'s lease record ([`prefetch`]); `s` may be past the end.
    fn prefetch_lease(&self, s: usize) {
        if let Some(p) = self.pages.get(s >> PAGE_BITS) {
            prefetch(p.lease.as_ptr().wrapping_add(s & (PAGE - 1)));
        }
    }

    fn link(&self, s: usize) -> Link {
        self.pages[s >> PAGE_BITS].link[s & (PAGE - 1)]
    }

    fn link_mut(&mut self, s: usize) -> &mut Link {
        &mut self.pages[s >> PAGE_BITS].link[s & (PAGE - 1)]
    }

    fn lease(&self, s: usize) -> Option<&Lease<T>> {
        self.pages[s >> PAGE_BITS].lease[s & (PAGE - 1)].as_ref()
    }

    fn lease_mut(&mut self, s: usize) -> Option<&mut Lease<T>> {
        self.pages[s >> PAGE_BITS].lease[s & (PAGE - 1)].as_mut()
    }

    /// Slot `s` as the table's tests read it.
    #[cfg(test)]
    fn hot(&self, s: usize) -> Hot {
        Hot { deadline: self.deadline_ms(s) }
    }

    /// Tests: every live slot is in the expiry index, a vacant one is linked exactly when its
    /// hole bit is set, the taken bits match, and the index holds every linked slot once.
    #[cfg(test)]
    fn check_index(&self) {
        let mut linked = 0;
        for s in 0..self.pages.iter().map(|p| p.lease.len()).sum::<usize>() {
            let (live, prev, bit) = (self.lease(s).is_some(), self.link(s).prev, |v: &Vec<u64>| v[s / 64] & (1 << (s % 64)) != 0);
            assert_eq!(live, bit(&self.used), "slot {s}: taken bit");
            assert_eq!(!live && prev != NIL, bit(&self.holes), "slot {s}: hole bit");
            assert!(!live || prev != NIL, "slot {s}: live but not in the index");
            linked += usize::from(prev != NIL);
        }
        assert_eq!(linked, self.wheel.len);
    }

    /// The holder number of the lease in slot `s` (0: vacant, or no holder yet).
    fn holder_in(&self, s: usize) -> u32 {
        self.lease(s).map_or(0, |l| self.holder_at(s, l))
    }

    /// The deadline of the lease in slot `s` (0: vacant).
    fn deadline_ms(&self, s: usize) -> u32 {
        self.lease(s).map_or(0, |l| l.deadline.get())
    }

    /// The holder number of the lease in slot `s` (0: none yet).
    fn holder_at(&self, s: usize, l: &Lease<T>) -> u32 {
        match l.holder {
            WIDE => self.wide.get(&self.id_of(s)).map_or(0, |w| w.holder),
            h => u32::from(h),
        }
    }

    /// How many ids from `id` (in slot `s`) on are in slots a lease holds, counted up to the
    /// end of `s`'s bitmap word, of the run of slots the next ids map to one by one, and of the
    /// ids a slot's 32-bit generation can name: the grant's skip over taken slots.
    ///
    /// Also whether the slot of the id `run` ahead is known free: the run ended at a vacant
    /// slot of the word, not at the end of the word, of the row or of the generations (so `id +
    /// run` lives in slot `s + run`).
    fn taken_run(&self, id: LeaseId, s: usize) -> (u64, bool) {
        let word = self.used[s / 64] >> (s % 64);
        let taken = u64::from((!word).trailing_zeros());
        if taken == 0 {
            return (0, true);
        }
        let raw = id & ((2u64 << self.k) - 1);
        let in_row = if raw < self.cap as u64 { self.cap as u64 - raw } else { (2u64 << self.k) - raw };
        let gens = self.id_end.saturating_sub(id);
        // `taken` ends at a vacant slot of the word unless the word ended first; it names a slot
        // of this row and generation only if both go on past it.
        let free = taken < 64 - (s % 64) as u64 && taken < in_row && taken < gens;
        (taken.min(in_row).min(gens).max(1), free)
    }

    /// The slot of lease `id` if it is live (linear hashing; see [`LeaseTable`]).
    fn slot(&self, id: LeaseId) -> usize {
        let s = (id & ((2u64 << self.k) - 1)) as usize;
        if s >= self.cap {
            s - (1usize << self.k)
        } else {
            s
        }
    }

    /// How many low bits of an id name slot `s`: `k + 1` if it is split, else `k`.
    fn width(&self, s: usize) -> u32 {
        let base = 1usize << self.k;
        self.k + u32::from(s < self.cap - base || s >= base)
    }

    /// The slot of a live lease.
    fn find(&self, id: LeaseId) -> Option<usize> {
        let s = self.slot(id);
        let l = self.lease(s)?;
        (id != 0 && u64::from(l.gen) == id >> self.width(s)).then_some(s)
    }

    /// The id of the lease in slot `s`.
    fn id_of(&self, s: usize) -> LeaseId {
        let w = self.width(s);
        u64::from(self.lease(s).map_or(0, |l| l.gen)) << w | (s as u64 & ((1u64 << w) - 1))
    }

    /// Whether the lease in slot `s` is past its deadline at `now`.
    fn expired(&self, s: usize, now: Nanos) -> bool {
        self.lease(s).is_some_and(|l| l.deadline.get() <= self.ms_floor(now.0))
    }

    /// `t` as the table's time, rounded down (a time already reached).
    fn ms_floor(&self, t: u64) -> u32 {
        u32::try_from(t.saturating_sub(self.epoch) / MS).unwrap_or(u32::MAX)
    }

    /// `t` as the table's time, rounded up (a deadline: never earlier than asked), at least 1.
    fn ms_ceil(&self, t: u64) -> u32 {
        u32::try_from(t.saturating_sub(self.epoch).div_ceil(MS)).unwrap_or(u32::MAX).max(1)
    }

    /// The table's time `ms` on the caller's clock.
    fn ns(&self, ms: u32) -> u64 {
        self.epoch.saturating_add(u64::from(ms) * MS)
    }

    /// Moves the epoch forward once `now` is about 25 days past it, by about 12 days, so
    /// deadlines (≤ now + L or a cached turn's TTL) keep fitting in 32 bits. Every live lease's
    /// times move with it; a grant time older than the new epoch is kept as the epoch (the hold
    /// time and SPEC P9's cap of a lease older than 12 days are counted from there), and a
    /// deadline already past it as 1 ms after it (still past). O(capacity), once in 12 days.
    #[inline(always)]
    fn rebase(&mut self, now: Nanos) {
        if now.0 >= self.rebase_from {
            self.move_epoch(now);
        }
    }

    #[cold]
    #[inline(never)]
    fn move_epoch(&mut self, now: Nanos) {
        // `rebase_from` saturates at the end of the clock's range: only move when due.
        if now.0.saturating_sub(self.epoch) / MS < REBASE_AT {
            return;
        }
        let by = now.0.saturating_sub(self.epoch) / MS - REBASE_AT + REBASE_BY;
        let by32 = u32::try_from(by).unwrap_or(u32::MAX);
        self.epoch += by * MS;
        self.rebase_from = self.epoch.saturating_add(REBASE_AT * MS);
        for l in self.pages.iter_mut().flat_map(|p| p.lease.iter_mut()).flatten() {
            l.deadline = NonZeroU32::new(l.deadline.get().saturating_sub(by32)).unwrap_or(NonZeroU32::MIN);
            l.granted = l.granted.saturating_sub(by32);
        }
        self.holes_until = self.holes_until.saturating_sub(by32);
    }

    /// SPEC S5 for a live lease: whether `holder` may act on it; the first to ask owns it.
    fn admit(&mut self, s: usize, holder: Holder) -> bool {
        let id = self.id_of(s);
        let Some(l) = self.pages[s >> PAGE_BITS].lease[s & (PAGE - 1)].as_mut() else { return false };
        claim(l, &mut self.wide, id, holder.0.get())
    }

    /// Ends a live lease: the one place a release happens and is counted (SPEC P3).
    /// Kept out of line: [`LeaseTable::renew`] calls it for the rare lease past its deadline,
    /// and inlined there it added 13 instructions to every renewal (97 -> 110, callgrind).
    #[inline(never)]
    fn end(&mut self, s: usize, reason: ReleaseReason, now: Nanos, released: &mut Vec<Released<T>>) {
        if self.lease(s).is_some() {
            let id = self.id_of(s);
            self.end_id(s, id, reason, now, released);
        }
    }

    /// [`LeaseTable::end`] of lease `id`, known to be live in slot `s`.
    #[inline(always)]
    fn end_id(&mut self, s: usize, id: LeaseId, reason: ReleaseReason, now: Nanos, released: &mut Vec<Released<T>>) {
        if !self.turns.is_empty() {
            self.forget_turn(id);
        }
        let Some(l) = self.pages.get_mut(s >> PAGE_BITS).and_then(|p| p.lease.get_mut(s & (PAGE - 1))).and_then(Option::take) else {
            return;
        };
        self.used[s / 64] &= !(1 << (s % 64));
        // The entry stays as a hole if a grant from now on, due `L` from now or later, could
        // take it over as it is (see `holes_until`); a lease due later is unlinked at once.
        let d = l.deadline.get();
        // (`d <= ms_ceil(now + L)`, without the division: `d·MS < now + L + 1 ms` from the epoch.)
        if self.ns(d) < now.0.saturating_add(self.lease).saturating_add(MS) {
            self.holes_until = self.holes_until.max(d);
            self.holes[s / 64] |= 1 << (s % 64);
        } else {
            self.unfile(s);
        }
        let wide = if l.holder == WIDE || l.blocks == WIDE { self.take_wide(id) } else { Wide::default() };
        let blocks = if l.blocks == WIDE { wide.blocks } else { u32::from(l.blocks) };
        let payload = Some(l.payload);
        self.live -= 1;
        self.leased_blocks -= u64::from(blocks);
        self.stats.released[reason as usize] += 1;
        let payload = match payload {
            Some(p) if !self.aux.is_empty() => self.park(id, p),
            p => p,
        };
        released.push(Released { lease_id: id, reason, payload, blocks, held: now.since(Nanos(self.ns(l.granted))) });
    }

    // The rare branches of `end_id`, out of line so a plain release's code stays short.

    #[cold]
    #[inline(never)]
    fn forget_turn(&mut self, id: LeaseId) {
        self.turns.remove(&id);
    }

    #[cold]
    #[inline(never)]
    fn take_wide(&mut self, id: LeaseId) -> Wide {
        self.wide.remove(&id).unwrap_or_default()
    }

    /// SPEC P5: the payload of a lease that just ended, parked while readers hold its blocks
    /// (`None`), or given back (no reader).
    #[cold]
    #[inline(never)]
    fn park(&mut self, id: LeaseId, payload: T) -> Option<T> {
        match self.aux.remove(&id).map_or(0, |a| a.readers) {
            0 => Some(payload),
            readers => {
                self.parked.insert(id, (payload, readers));
                None
            }
        }
    }

    /// Appends `n` vacant slots after the last (the capacity is set by the caller).
    fn append(&mut self, mut n: usize) {
        while n > 0 {
            if self.pages.last().is_none_or(|p| p.lease.len() == PAGE) {
                self.pages.push(Page { lease: Vec::new(), link: Vec::new() });
            }
            let Some(p) = self.pages.last_mut() else { return };
            let m = n.min(PAGE - p.lease.len());
            p.lease.reserve_exact(m);
            p.link.reserve_exact(m);
            p.lease.extend((0..m).map(|_| None));
            p.link.resize(p.link.len() + m, UNLINKED);
            n -= m;
        }
        let slots = (self.pages.len() - 1) * PAGE + self.pages.last().map_or(0, |p| p.lease.len());
        let words = slots.div_ceil(64);
        if words > self.used.len() {
            self.used.reserve_exact(words - self.used.len());
            self.used.resize(words, 0);
            self.holes.reserve_exact(words - self.holes.len());
            self.holes.resize(words, 0);
        }
    }

    /// Grows the table by about 1/64 of its slots (`GROW_MAX` at most, so a growing grant
    /// holds the table for tens of µs), one split each.
    fn grow(&mut self) {
        let n = (self.cap / 64).clamp(1, GROW_MAX);
        self.append(n);
        for _ in 0..n {
            self.split();
        }
    }

    /// Linear hashing's split: slot `cap - 2^k` becomes addressed by `k + 1` bits, its lease
    /// (if any) moving to the new slot `cap` when the id's bit `k` is set; the capacity grows
    /// by one. The new slot must be allocated already.
    fn split(&mut self) {
        let base = 1usize << self.k;
        let from = self.cap - base;
        let to = self.cap;
        self.cap += 1;
        if let Some(l) = self.lease_mut(from) {
            // Its gen was `id >> k`; now `id >> (k + 1)`, and bit k says where it lives.
            let moves = l.gen & 1 == 1;
            l.gen >>= 1;
            if moves {
                self.relocate(from, to);
            }
        }
        if self.cap == 2 * base {
            self.k += 1;
        }
        self.resized();
    }

    /// Keeps `grow_at` and `id_end` with the capacity and `k`: a grant grows the table while
    /// `(live + 1) / cap > 1 - 1/FREE_SHARE` or fewer than two slots would stay free.
    fn resized(&mut self) {
        self.grow_at = (self.cap * (FREE_SHARE - 1) / FREE_SHARE).min(self.cap - 1);
        self.id_end = (u64::from(u32::MAX) + 1) << self.k;
    }

    /// Moves the lease in slot `from` to the vacant slot `to`, keeping its expiry-index entry.
    fn relocate(&mut self, from: usize, to: usize) {
        let lease = self.pages[from >> PAGE_BITS].lease[from & (PAGE - 1)].take();
        let Link { next, prev } = std::mem::replace(self.link_mut(from), UNLINKED);
        self.pages[to >> PAGE_BITS].lease[to & (PAGE - 1)] = lease;
        *self.link_mut(to) = Link { next, prev };
        self.used[from / 64] &= !(1 << (from % 64));
        self.used[to / 64] |= 1 << (to % 64);
        if prev & HEAD != 0 {
            self.wheel.buckets[(prev & !HEAD) as usize].head = to as u32;
        } else if prev != NIL {
            self.link_mut(prev as usize).next = to as u32;
        }
        if next != NIL {
            self.link_mut(next as usize).prev = to as u32;
        }
        if let Some(p) = self.wheel.pass.as_mut().filter(|p| p.next == from as u32) {
            p.next = to as u32;
        }
    }

    /// Files slot `s` under `deadline` (ns), in a bucket no earlier than `lo`.
    fn file(&mut self, s: usize, deadline: u64, lo: u64) {
        let w = &mut self.wheel;
        let ring = w.buckets.len() as u64;
        // Past the horizon an entry waits in the furthest bucket and is refiled when visited.
        let k = (deadline / w.width).clamp(lo, w.cursor + ring - 1).max(lo);
        let r = w.index(k);
        let b = &mut w.buckets[r];
        // An empty bucket's `min` may be a stale bound from entries removed before the cursor
        // reached it (the cursor skips ahead over an empty wheel): it starts afresh.
        b.min = if b.head == NIL { deadline } else { b.min.min(deadline) };
        let head = b.head;
        b.head = s as u32;
        w.len += 1;
        if let Some(p) = w.pass.as_mut().filter(|p| p.bucket == r) {
            p.filed_min = p.filed_min.min(deadline);
        }
        let l = self.link_mut(s);
        l.next = head;
        l.prev = HEAD | r as u32;
        if head != NIL {
            self.link_mut(head as usize).prev = s as u32;
        }
    }

    /// Removes the entry of a hole the reaper is at (the lease it just expired).
    fn drop_hole(&mut self, s: usize) {
        if self.holes[s / 64] & (1 << (s % 64)) != 0 {
            self.unfile(s);
        }
    }

    /// Removes slot `s`'s expiry-index entry.
    fn unfile(&mut self, s: usize) {
        let Link { next, prev } = self.link(s);
        if prev == NIL {
            debug_assert!(false, "expiry index out of step for slot {s}");
            return;
        }
        if prev & HEAD != 0 {
            self.wheel.buckets[(prev & !HEAD) as usize].head = next;
        } else {
            self.link_mut(prev as usize).next = next;
        }
        if next != NIL {
            self.link_mut(next as usize).prev = prev;
        }
        let l = self.link_mut(s);
        l.next = NIL;
        l.prev = NIL;
        self.holes[s / 64] &= !(1 << (s % 64));
        if let Some(p) = self.wheel.pass.as_mut().filter(|p| p.next == s as u32) {
            p.next = next;
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
            let r = self.wheel.index(cursor);
            if cursor < now_k {
                // The cursor leaves this bucket: everything in it goes, expired or refiled
                // (also entries filed here from past the horizon).
                self.wheel.pass = None;
                while self.wheel.buckets[r].head != NIL {
                    if work >= budget {
                        return true;
                    }
                    work += 1;
                    let s = self.wheel.buckets[r].head as usize;
                    let d = self.ns(self.deadline_ms(s));
                    if self.lease(s).is_none() {
                        self.unfile(s);
                    } else if d <= now {
                        self.wheel.expired.push((d, self.id_of(s)));
                        self.end(s, ReleaseReason::Expired, Nanos(now), released);
                        self.drop_hole(s);
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
            // the rest; a pass interrupted by the budget resumes where it stopped (an entry
            // removed or moved meanwhile moves the pass along: see `unfile`, `relocate`).
            let mut pass = match self.wheel.pass {
                Some(p) if p.bucket == r => p,
                _ => {
                    if self.wheel.buckets[r].min > now {
                        return false;
                    }
                    Pass { bucket: r, next: self.wheel.buckets[r].head, kept_min: u64::MAX, filed_min: u64::MAX }
                }
            };
            self.wheel.pass = Some(pass);
            loop {
                let s = match self.wheel.pass {
                    Some(p) if p.next != NIL => p.next as usize,
                    _ => break,
                };
                if work >= budget {
                    if let Some(p) = self.wheel.pass.as_mut() {
                        p.kept_min = pass.kept_min;
                    }
                    return true;
                }
                work += 1;
                let next = self.link(s).next;
                if let Some(p) = self.wheel.pass.as_mut() {
                    p.next = next;
                }
                let d = self.ns(self.deadline_ms(s));
                if self.lease(s).is_none() {
                    self.unfile(s);
                } else if d <= now {
                    self.wheel.expired.push((d, self.id_of(s)));
                    self.end(s, ReleaseReason::Expired, Nanos(now), released);
                    self.drop_hole(s);
                } else if d / self.wheel.width == cursor {
                    pass.kept_min = pass.kept_min.min(d);
                } else {
                    self.unfile(s);
                    self.file(s, d, cursor);
                }
            }
            let filed_min = self.wheel.pass.take().map_or(u64::MAX, |p| p.filed_min);
            let b = &mut self.wheel.buckets[r];
            b.min = if b.head == NIL { u64::MAX } else { pass.kept_min.min(filed_min) };
            // An emptied bucket is through even at `now` = u64::MAX, where no `min` is later.
            if b.min > now || b.head == NIL {
                return false;
            }
        }
        false
    }
}

impl<T: LeasePayload> LeaseTable<T> {
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
                let live = c != Completion::Lost;
                // Over a fenced transport the read passed this table's `begin_read` (live lease,
                // this prompt) and D used the bytes without waiting: only a completion of a
                // lease no longer live is answered (P3), so D learns of it.
                let reply = (!self.fenced_reads || !live).then_some(Message::ReadDoneAck { lease_id: *lease_id, live });
                Answer { reply, renewed: 0 }
            }
            Message::ClockPing { seq, t0 } => {
                Answer { reply: Some(Message::ClockPong { seq: *seq, t0: *t0, t1: now.0, t2: now.0 }), renewed: 0 }
            }
            _ => Answer { reply: None, renewed: 0 },
        }
    }

    /// SPEC P8: consumer rank `consumer`, one of `n`, finished reading the lease for the prompt
    /// whose digest is `digest`. Not confirmed (`Lost`, nothing changes) when another holder owns
    /// the lease (S5) or the digest is not the one the lease's payload names (S4).
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
        self.rebase(now);
        let other_prompt = |p: Option<&T>| p.and_then(LeasePayload::prompt_digest).is_some_and(|d| *d != digest);
        let s = match self.find(id) {
            None => return Completion::Lost,
            Some(_) if other_prompt(self.get(id)) => return Completion::Lost,
            Some(s) if !self.admit(s, holder) => return Completion::Lost,
            Some(s) if self.expired(s, now) => {
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
}

/// The expiry index: a ring of buckets `width` ns wide covering `horizon` ahead of the cursor,
/// each a doubly linked list threaded through the slots. Each live lease has exactly one entry,
/// filed under a deadline no later than its lease's; when the lease ends the entry is removed,
/// or stays as a hole (see [`Link`]) that the reaper drops or a lease due no earlier takes over.
/// A renewed lease's entry is moved to the bucket of its current deadline when its old bucket
/// comes due, at most once per extension period. `len` counts entries, holes included.
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
    /// No later than the earliest deadline filed here (ns).
    min: u64,
    /// The first slot of the bucket's list, or `NIL`.
    head: u32,
}

const EMPTY: Bucket = Bucket { min: u64::MAX, head: NIL };

impl Wheel {
    fn new(width: u64, horizon: u64) -> Wheel {
        // A power of two, so a bucket's place in the ring is a mask, not a division.
        let n = ((horizon / width).saturating_add(3).min(1 << 16) as usize).next_power_of_two();
        Wheel { width, buckets: vec![EMPTY; n], cursor: 0, len: 0, pass: None, backlog: None, expired: Vec::new() }
    }

    /// The place in the ring of absolute bucket `k`.
    fn index(&self, k: u64) -> usize {
        (k & (self.buckets.len() as u64 - 1)) as usize
    }

    /// The earliest `min` of a non-empty bucket. Buckets are looked at from the cursor on and
    /// the scan stops at the first bucket that starts after the best so far: an entry is filed
    /// below its own deadline's bucket only into the cursor's bucket or the next (`file`'s
    /// `lo`), and past the horizon into an earlier bucket than its deadline's, never a later
    /// one. So a reaper's wake-up looks at a bucket or two, not the whole ring (65,536 buckets
    /// at long leases, on every wake).
    fn earliest(&self) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        let ring = self.buckets.len() as u64;
        let mut best = None::<u64>;
        for i in 0..ring {
            let k = self.cursor + i;
            if i >= 2 && best.is_some_and(|b| k.saturating_mul(self.width) >= b) {
                break;
            }
            let b = &self.buckets[self.index(k)];
            if b.head != NIL {
                best = Some(best.map_or(b.min, |x| x.min(b.min)));
            }
        }
        debug_assert_eq!(
            best,
            (0..ring).map(|i| &self.buckets[self.index(self.cursor + i)]).filter(|b| b.head != NIL).map(|b| b.min).min(),
            "the early-stopping scan missed an earlier bucket"
        );
        best
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
            let head = t.grant(s, 4, 1);
            let behind = t.grant(s, 4, 2);
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

    /// The tests' seeded random numbers.
    fn xorshift(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// SPEC P4: the reaper's wake-up time stops its scan early and still finds the earliest
    /// bucket (the `debug_assert` in `Wheel::earliest` compares it with the whole ring) under
    /// grants past the horizon (turns kept for their TTL), renewals, releases, budgeted ticks
    /// and long gaps between ticks; and it is never later than the earliest live deadline (or
    /// now, for a lease already due).
    #[test]
    fn p4_early_stopping_wake_up_is_the_whole_rings_minimum() {
        let cfg = LeaseConfig::with_lease_secs(0.6).unwrap();
        let mut t: LeaseTable<u32> = LeaseTable::new(&cfg);
        let h = t.holder("d");
        let mut ids: Vec<LeaseId> = Vec::new();
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut now = Nanos(5_000_000_000);
        for step in 0..30_000u32 {
            let x = xorshift(&mut x);
            now = now + Duration::from_micros(if x.is_multiple_of(97) { (x >> 32) % 30_000_000 } else { (x >> 32) % 40_000 });
            let (mut rel, mut lost) = (Vec::new(), Vec::new());
            match (x >> 8) % 10 {
                0..=2 => ids.push(t.grant(now, 1, step)),
                3 => ids.push(t.grant_for(now, Duration::from_millis((x >> 16) % 120_000), 1, step)),
                4..=5 if !ids.is_empty() => {
                    t.renew(h, &[ids[(x >> 20) as usize % ids.len()]], now, &mut lost, &mut rel);
                }
                6 if !ids.is_empty() => {
                    let id = ids.swap_remove((x >> 20) as usize % ids.len());
                    t.release(h, &[id], now, &mut lost, &mut rel);
                }
                _ => {
                    t.tick_budget(now, 1 + (x >> 24) as usize % 8, &mut rel);
                }
            }
            ids.retain(|id| t.get(*id).is_some());
            let earliest = (0..t.cap).filter(|&s| t.hot(s).deadline != 0).map(|s| t.ns(t.hot(s).deadline)).min();
            if let Some(e) = earliest {
                // A lease already due (a budgeted tick left work over) is due now.
                let due = e.max(now.0);
                assert!(t.next_expiry().is_some_and(|n| n.0 <= due), "step {step}: next_expiry {:?} later than {due}", t.next_expiry());
            }
        }
    }

    /// The head-only sweep as it was first written: sort every live lease by id, walk up.
    fn sorted_sweep(t: &mut LeaseTable<u32>, now: Nanos, released: &mut Vec<Released<u32>>) -> Option<Nanos> {
        t.rebase(now);
        let mut live: Vec<(LeaseId, usize)> = (0..t.cap).filter(|&s| t.hot(s).deadline != 0).map(|s| (t.id_of(s), s)).collect();
        live.sort_unstable();
        for (_, s) in live {
            let d = t.ns(t.hot(s).deadline);
            if d > now.0 {
                return Some(Nanos(d));
            }
            t.end(s, ReleaseReason::Expired, now, released);
        }
        None
    }

    /// The cursor sweep frees the same leases, in the same order, and reports the same next
    /// deadline as sorting every live lease, under random grants, renewals and releases.
    #[test]
    fn head_only_cursor_matches_the_sorted_sweep() {
        let cfg = LeaseConfig::with_lease_secs(3.0).unwrap();
        let (mut a, mut b): (LeaseTable<u32>, LeaseTable<u32>) = (LeaseTable::new(&cfg), LeaseTable::new(&cfg));
        let (ha, hb) = (a.holder("d"), b.holder("d"));
        let mut ids: Vec<LeaseId> = Vec::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut now = Nanos(1_000_000_000);
        for step in 0..20_000u32 {
            let x = xorshift(&mut x);
            now = now + Duration::from_millis(x % 50);
            let (mut ra, mut rb, mut lost) = (Vec::new(), Vec::new(), Vec::new());
            match x >> 60 {
                0..=5 => {
                    let (ia, ib) = (a.grant(now, 1, step), b.grant(now, 1, step));
                    assert_eq!(ia, ib);
                    ids.push(ia);
                }
                6..=9 if !ids.is_empty() => {
                    let pick = [ids[(x >> 20) as usize % ids.len()]];
                    a.renew(ha, &pick, now, &mut lost, &mut ra);
                    b.renew(hb, &pick, now, &mut lost, &mut rb);
                }
                10 if !ids.is_empty() => {
                    let pick = [ids.swap_remove((x >> 20) as usize % ids.len())];
                    a.release(ha, &pick, now, &mut lost, &mut ra);
                    b.release(hb, &pick, now, &mut lost, &mut rb);
                }
                _ => assert_eq!(a.tick_head_only(now, &mut ra), sorted_sweep(&mut b, now, &mut rb)),
            }
            let key = |r: &Vec<Released<u32>>| r.iter().map(|r| (r.lease_id, r.reason)).collect::<Vec<_>>();
            assert_eq!(key(&ra), key(&rb), "step {step}");
            assert_eq!(a.live(), b.live());
        }
    }
}

#[cfg(test)]
mod generation_tests {
    use super::*;

    /// A slot keeps 32 bits of the id above the slot bits. Ids past them make the table grow
    /// (more slot bits) rather than wrap the generation: no id ever matches a lease it is not,
    /// including ids that differ from a live one by exactly 2^32 generations.
    #[test]
    fn generation_past_32_bits_grows_never_aliases() {
        let cfg = LeaseConfig::default();
        let mut t: LeaseTable<u64> = LeaseTable::new(&cfg);
        assert_eq!((t.k, t.cap), (4, 16));
        let d = Holder(NonZeroU32::MIN);
        let mut rel = Vec::new();
        let early: Vec<u64> = (0..5).map(|i| t.grant(Nanos(0), 1, i)).collect();
        // Jump the id counter to just before the last generation of 4-bit slots.
        t.next_id = (u64::from(u32::MAX) << 4) + 10;
        let late: Vec<u64> = (0..12).map(|i| t.grant(Nanos(0), 1, 100 + i)).collect();
        assert!(late.windows(2).all(|w| w[0] < w[1]));
        assert!(*late.last().unwrap() >> 4 > u64::from(u32::MAX), "ids went past 32 bits of generation");
        assert!(t.k >= 5, "the table grew instead of wrapping: k = {}", t.k);
        for (i, id) in early.iter().enumerate() {
            assert_eq!(t.get(*id), Some(&(i as u64)));
        }
        for (i, id) in late.iter().enumerate() {
            assert_eq!(t.get(*id), Some(&(100 + i as u64)));
            // The same slot and generation bits modulo 2^32: another id, lost.
            for alias in [id.wrapping_add(1 << 36), id.wrapping_sub(1 << 36), id ^ (1 << 40)] {
                assert_eq!(t.get(alias), None, "{alias} aliases {id}");
                let mut lost = Vec::new();
                assert_eq!(t.renew(d, &[alias], Nanos(1), &mut lost, &mut rel), 0);
                assert_eq!(lost, vec![alias]);
            }
        }
        // Released ids of either era stay lost once their slots are reused.
        t.release(d, &[early[0], late[0]], Nanos(1), &mut Vec::new(), &mut rel);
        let more: Vec<u64> = (0..40).map(|i| t.grant(Nanos(1), 1, 200 + i)).collect();
        assert_eq!(t.get(early[0]), None);
        assert_eq!(t.get(late[0]), None);
        for (i, id) in more.iter().enumerate() {
            assert_eq!(t.get(*id), Some(&(200 + i as u64)));
        }
        assert_eq!(t.live(), 4 + 11 + 40);
    }

    /// Linear hashing keeps every live lease findable while the table grows one slot at a time
    /// through several rounds, whatever the ids (gaps, releases, leases from many rounds ago).
    #[test]
    fn growth_by_splits_keeps_every_lease() {
        let mut t: LeaseTable<u64> = LeaseTable::new(&LeaseConfig::default());
        let d = Holder(NonZeroU32::MIN);
        let mut rel = Vec::new();
        let mut live = BTreeMap::new();
        let mut x = 7u64;
        for i in 0..20_000u64 {
            let id = t.grant(Nanos(0), 1, i);
            live.insert(id, i);
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            if x >> 62 == 0 {
                if let Some((&old, _)) = live.iter().nth((x >> 20) as usize % live.len()) {
                    t.release(d, &[old], Nanos(0), &mut Vec::new(), &mut rel);
                    live.remove(&old);
                }
            }
            if i % 997 == 0 {
                t.check_index();
                for (id, v) in &live {
                    assert_eq!(t.get(*id), Some(v));
                }
            }
        }
        assert_eq!(t.live(), live.len());
        assert!(t.live() * 32 <= t.capacity() * 31 && t.live() * 100 >= t.capacity() * 90, "{} of {}", t.live(), t.capacity());
    }
}

#[cfg(test)]
mod wheel_tests {
    use super::*;

    fn secs(s: f64) -> Nanos {
        Nanos::from_secs_f64(s)
    }

    /// SPEC P4 (found by `kvlease sim --push`, seed 1834): a lease that ends before the cursor
    /// reaches its bucket leaves no stale bound there once the wheel emptied and the cursor
    /// skipped ahead: a later lease filed into that bucket wakes the reaper at its own deadline.
    #[test]
    fn p4_a_bucket_emptied_ahead_of_the_cursor_keeps_no_stale_bound() {
        let cfg = LeaseConfig::with_lease_secs(6.0).unwrap();
        let mut t: LeaseTable<()> = LeaseTable::new(&cfg);
        let d = Holder(NonZeroU32::MIN);
        let mut rel = Vec::new();
        let a = t.grant(Nanos(0), 1, ());
        t.release(d, &[a], secs(0.1), &mut Vec::new(), &mut rel);
        // Empty: the cursor jumps to now without visiting the bucket `a` was filed in.
        t.tick(secs(6.2), &mut rel);
        let b = t.grant(secs(6.35), 1, ());
        assert_eq!(t.next_expiry(), t.deadline(b), "the reaper wakes for the live lease, not the gone one");
    }
}

#[cfg(test)]
mod record_tests {
    use super::*;

    /// Per slot: 24 bytes and the payload, a vacant slot costing nothing more (issue #27's
    /// ≤ 32 B per live lease with `u32` payloads at 95–97 % fill).
    #[test]
    fn a_slot_is_24_bytes_and_the_payload() {
        let slot = |lease: usize| lease + std::mem::size_of::<Link>();
        assert_eq!(slot(std::mem::size_of::<Option<Lease<()>>>()), 24);
        assert_eq!(slot(std::mem::size_of::<Option<Lease<u32>>>()), 28);
        assert_eq!(slot(std::mem::size_of::<Option<Lease<u64>>>()), 32);
    }

    /// SPEC P3, P4 with holes: a released lease's entry stays as a hole that a later grant takes
    /// over or the reaper drops; a lease due later than L after its release (a long cached turn)
    /// is unlinked at once, so no hole ever sits in a bucket later than the lease that takes it
    /// over is due. Every lease still expires on its own deadline, exactly once.
    #[test]
    fn p4_holes_are_taken_over_or_dropped_never_late() {
        let cfg = LeaseConfig::with_lease_secs(3.0).unwrap();
        let mut t: LeaseTable<u32> = LeaseTable::new(&cfg);
        let d = Holder(NonZeroU32::MIN);
        let sec = |x: f64| Nanos::from_secs_f64(x);
        let (mut lost, mut rel) = (Vec::new(), Vec::new());
        let a = t.grant(sec(1.0), 1, 1);
        let turn = t.grant_for(sec(1.0), Duration::from_secs(60), 1, 2);
        t.release(d, &[a, turn], sec(1.5), &mut lost, &mut rel);
        assert_eq!(t.wheel.len, 1, "a's entry stays as a hole; the turn, due past L, is unlinked");
        // A grant with a short lifetime may not take a hole over (it is due before the hole's bound).
        let short = t.grant_for(sec(1.5), Duration::from_millis(10), 1, 3);
        let b = t.grant(sec(1.5), 1, 4);
        assert_eq!(t.live(), 2);
        rel.clear();
        t.tick(sec(1.6), &mut rel);
        assert_eq!(rel.iter().map(|r| r.lease_id).collect::<Vec<_>>(), vec![short], "the short lease expires on time");
        rel.clear();
        t.tick(sec(4.45), &mut rel);
        assert!(rel.is_empty() && t.get(b).is_some(), "b is due at 4.5 s");
        t.tick(sec(4.6), &mut rel);
        assert_eq!(rel.iter().map(|r| (r.lease_id, r.reason)).collect::<Vec<_>>(), vec![(b, ReleaseReason::Expired)]);
        assert_eq!((t.live(), t.wheel.len), (0, 0), "holes dropped by the reaper");
        let mut x = 0x5eed_u64;
        let mut ids = Vec::new();
        let mut now = sec(10.0);
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            now = now + Duration::from_millis(x % 7);
            rel.clear();
            match (x >> 8) % 8 {
                0..=2 => ids.push(t.grant(now, 1, step)),
                3 => ids.push(t.grant_for(now, Duration::from_millis((x >> 16) % 9_000), 1, step)),
                4 if !ids.is_empty() => {
                    t.renew(d, &[ids[(x >> 20) as usize % ids.len()]], now, &mut lost, &mut rel);
                }
                5 if !ids.is_empty() => {
                    let id = ids.swap_remove((x >> 20) as usize % ids.len());
                    t.release(d, &[id], now, &mut lost, &mut rel);
                }
                _ => t.tick(now, &mut rel),
            }
            for r in &rel {
                if r.reason == ReleaseReason::Expired {
                    assert!(r.held.as_nanos() > 0);
                }
            }
            ids.retain(|id| t.get(*id).is_some());
            if step.is_multiple_of(500) {
                t.check_index();
            }
            if (x >> 40).is_multiple_of(4) {
                t.tick(now, &mut rel);
                // Right after a tick, no live lease is past its deadline (P4).
                let ms = t.ms_floor(now.0);
                assert!((0..t.cap).all(|s| t.hot(s).deadline == 0 || t.hot(s).deadline > ms), "step {step}");
            }
        }
    }

    /// Block counts and holder numbers past 16 bits are kept whole (in `wide`) and dropped with
    /// their lease; S5 still tells such holders apart from each other and from small ones.
    #[test]
    fn s5_wide_holders_and_block_counts_are_exact() {
        let cfg = LeaseConfig::default();
        let mut t: LeaseTable<u32> = LeaseTable::new(&cfg);
        let h = |n: u32| Holder(NonZeroU32::new(n).unwrap());
        let (big1, big2, small) = (h(70_000), h(u32::MAX), h(3));
        let now = Nanos(1_000_000_000);
        let (mut lost, mut rel) = (Vec::new(), Vec::new());
        let a = t.grant(now, 100_000, 1);
        let b = t.grant(now, 65_535, 2);
        let c = t.grant(now, 65_534, 3);
        assert_eq!(t.leased_blocks(), 100_000 + 65_535 + 65_534);
        assert_eq!(t.renew(big1, &[a, b], now, &mut lost, &mut rel), 2);
        assert_eq!(t.holder_of(a), Some(big1));
        for other in [big2, small] {
            assert_eq!(t.renew(other, &[a, b], now, &mut lost, &mut rel), 0);
        }
        assert_eq!(t.renew(small, &[c], now, &mut lost, &mut rel), 1);
        assert_eq!(t.renew(big2, &[c], now, &mut lost, &mut rel), 0);
        assert!(t.confirms(big1, a, now, &mut rel) && !t.confirms(big2, a, now, &mut rel));
        lost.clear();
        t.release(big2, &[a], now, &mut lost, &mut rel);
        assert_eq!(lost, vec![a]);
        t.release(big1, &[a, b], now, &mut lost, &mut rel);
        t.release(small, &[c], now, &mut lost, &mut rel);
        let blocks: Vec<(LeaseId, u32)> = rel.iter().map(|r| (r.lease_id, r.blocks)).collect();
        assert_eq!(blocks, vec![(a, 100_000), (b, 65_535), (c, 65_534)]);
        assert_eq!(t.leased_blocks(), 0);
        assert!(t.wide.is_empty(), "wide entries end with their leases");
    }
}
