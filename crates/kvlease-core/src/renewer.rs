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
    /// SPEC O4: D will not read these leases and no transfer link can carry their release (the
    /// handshake failed or was refused, or they are a duplicate engine's): deliver it over the
    /// P engine's side channel, then report with [`Renewer::side_release_done`].
    ReleaseOverSideChannel(SideChannelRelease),
    /// SPEC O4, §3: two live engines claim `engine_id` — D is linked to `kept` while `other`
    /// grants leases under the same id (an operator's mistake: two `--engine-id`s alike). D
    /// keeps reading from `kept` and releases `other`'s leases at once, unread; said once per
    /// incarnation of `other`, for the log and the metrics.
    DuplicateEngine { engine_id: String, kept: Endpoint, other: Endpoint },
}

/// Where one incarnation of a P engine answers: its side channel, as its params said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub incarnation: u64,
}

/// Releases for one P engine, granted by one of its incarnations, to deliver over its side
/// channel at `host:port` (SPEC O4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideChannelRelease {
    pub engine_id: String,
    pub host: String,
    pub port: u16,
    /// The incarnation that granted them (0: unknown): P releases none if it is another.
    pub granted_by: u64,
    pub lease_ids: Vec<LeaseId>,
    pub why: NotRead,
}

impl SideChannelRelease {
    /// How many of these leases P's answer released: none when an incarnation other than the
    /// one that granted them answered (it holds none of them), else every one it did not name
    /// lost.
    pub fn released_by(&self, answered_by: u64, lost: &[LeaseId]) -> usize {
        if self.granted_by != 0 && self.granted_by != answered_by {
            return 0;
        }
        self.lease_ids.len().saturating_sub(lost.len())
    }
}

/// Why D releases leases over the side channel instead of reading them (SPEC O4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotRead {
    /// No transfer link to the engine can carry the release: its handshake failed (timed out,
    /// unreachable) or was refused (a geometry mismatch, say).
    NoLink,
    /// Another live engine claims the same engine id, and D is linked to that one, `kept`.
    Duplicate { kept: Endpoint },
}

impl NotRead {
    /// The label P counts it under.
    pub fn label(&self) -> &'static str {
        match self {
            NotRead::NoLink => "no_handshake",
            NotRead::Duplicate { .. } => "duplicate_engine_id",
        }
    }
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
    /// No handshake with the lease's P engine has completed yet (it is asked for): nothing has
    /// renewed the lease, nor could; a renewal is queued for when there is a link.
    NoLink,
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

/// A tracked request: 40 bytes and its request id's bytes, in one slab (`Renewer::entries`),
/// found by request id through [`RequestIndex`] and by lease id through its engine's [`Order`].
/// It keeps no acknowledgement of its own: which heartbeats named it follows from its lease id
/// and `since` (see [`Sent`]), so acknowledging a heartbeat costs nothing per id.
#[derive(Debug)]
struct Entry {
    /// Empty for a free slot.
    request_id: Box<str>,
    lease_id: LeaseId,
    incarnation: u64,
    /// Index of its engine in `Renewer::engines`; `FREE` for a free slot.
    engine: u32,
    /// The engine's heartbeat seq when tracking started (low 32 bits): every heartbeat of a
    /// later seq whose id range holds the lease named it.
    since: u32,
}

const FREE: u32 = u32::MAX;

/// One heartbeat sent and not yet older than E: the sorted ids `lo..=hi` it named (all tracked
/// leases of the engine in that range at the time, or only `ids` for a read renewal).
#[derive(Debug)]
struct Sent {
    seq: u64,
    at: Nanos,
    lo: LeaseId,
    hi: LeaseId,
    ids: Option<Box<[LeaseId]>>,
    acked: bool,
}

impl Sent {
    fn named(&self, e: &Entry) -> bool {
        // 32 bits of seq: wrong only for a request tracked across 2^31 heartbeats to its engine.
        let after = (self.seq as u32).wrapping_sub(e.since) as i32 > 0;
        after
            && self.lo <= e.lease_id
            && e.lease_id <= self.hi
            && self.ids.as_ref().is_none_or(|ids| ids.binary_search(&e.lease_id).is_ok())
    }
}

/// An engine's tracked leases in lease-id order (what a heartbeat names), each with its entry:
/// a sorted array that ids granted in a row (the usual case) append to, with tombstones for
/// untracked ones and a small map for ids that arrive out of order; both are folded in by
/// [`Order::settle`] before each heartbeat round, in one pass.
#[derive(Debug, Default)]
struct Order {
    ids: Vec<LeaseId>,
    /// `handles[i]` is the entry of `ids[i]`, or `FREE` once untracked.
    handles: Vec<u32>,
    dead: usize,
    late: BTreeMap<LeaseId, u32>,
}

impl Order {
    fn len(&self) -> usize {
        self.ids.len() - self.dead + self.late.len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn insert(&mut self, id: LeaseId, handle: u32) {
        if self.ids.last().is_none_or(|&last| last < id) {
            if self.ids.len() == self.ids.capacity() {
                // Grow by an eighth, not double: the array is most of the renewer's memory.
                let more = self.ids.len() / 8 + 16;
                self.ids.reserve_exact(more);
                self.handles.reserve_exact(more);
            }
            self.ids.push(id);
            self.handles.push(handle);
        } else {
            self.late.insert(id, handle);
        }
    }

    fn get(&self, id: LeaseId) -> Option<u32> {
        if self.ids.last().is_none_or(|&last| last < id) {
            // Above every id here, late ones included (a late id is below the last on arrival).
            return None;
        }
        match self.ids.binary_search(&id) {
            Ok(i) if self.handles[i] != FREE => Some(self.handles[i]),
            _ => self.late.get(&id).copied(),
        }
    }

    fn remove(&mut self, id: LeaseId) -> Option<u32> {
        match self.ids.binary_search(&id) {
            Ok(i) if self.handles[i] != FREE => {
                self.dead += 1;
                Some(std::mem::replace(&mut self.handles[i], FREE))
            }
            _ => self.late.remove(&id),
        }
    }

    /// Folds late ids in and drops tombstones, in place: afterwards `ids` is every tracked
    /// lease, sorted. One pass forward to close the holes, one backward to merge the late ids.
    fn settle(&mut self) {
        if self.dead > 0 {
            let mut w = 0;
            for r in 0..self.ids.len() {
                if self.handles[r] != FREE {
                    self.ids[w] = self.ids[r];
                    self.handles[w] = self.handles[r];
                    w += 1;
                }
            }
            self.ids.truncate(w);
            self.handles.truncate(w);
            self.dead = 0;
        }
        if self.late.is_empty() {
            return;
        }
        let old = self.ids.len();
        let n = old + self.late.len();
        if n > self.ids.capacity() {
            // Room for an eighth more, as `insert` grows.
            self.ids.reserve_exact(n + n / 8 - old);
            self.handles.reserve_exact(n + n / 8 - old);
        }
        self.ids.resize(n, 0);
        self.handles.resize(n, FREE);
        // Merge from the back: the largest remaining of either side goes to the end.
        let mut r = old;
        let mut w = n;
        for (&l, &lh) in std::mem::take(&mut self.late).iter().rev() {
            while r > 0 && self.ids[r - 1] > l {
                r -= 1;
                w -= 1;
                self.ids[w] = self.ids[r];
                self.handles[w] = self.handles[r];
            }
            w -= 1;
            self.ids[w] = l;
            self.handles[w] = lh;
        }
    }

    /// Every tracked lease's entry, sorted by lease id.
    fn handles(&mut self) -> &[u32] {
        self.settle();
        &self.handles
    }

    fn bytes(&self) -> usize {
        self.ids.capacity() * 8 + self.handles.capacity() * 4 + self.late.len() * 24
    }
}

/// Request id → entry: open addressing over 8-byte slots (the entry's index and 32 bits of the
/// id's hash), linear probing, deletion by backward shift; the key is the entry's own
/// `request_id`, so a request id is stored once. Keyed hashing (std's `RandomState`): request
/// ids come from clients.
#[derive(Debug)]
struct RequestIndex {
    slots: Vec<u64>,
    len: usize,
    hasher: std::collections::hash_map::RandomState,
}

const EMPTY: u64 = u64::MAX;

impl RequestIndex {
    fn new() -> RequestIndex {
        RequestIndex { slots: Vec::new(), len: 0, hasher: Default::default() }
    }

    fn hash(&self, key: &str) -> u32 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(key) as u32
    }

    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// The slot holding `key`, and its entry.
    fn find(&self, key: &str, entries: &[Entry]) -> Option<(usize, u32)> {
        if self.len == 0 {
            return None;
        }
        let hash = self.hash(key);
        let mask = self.mask();
        let mut i = hash as usize & mask;
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return None;
            }
            let handle = s as u32;
            if (s >> 32) as u32 == hash && entries.get(handle as usize).is_some_and(|e| &*e.request_id == key) {
                return Some((i, handle));
            }
            i = (i + 1) & mask;
        }
    }

    /// Files `handle` under `key` (not already present).
    fn insert(&mut self, key: &str, handle: u32) {
        if (self.len + 1) * 8 > self.slots.len() * 7 {
            self.grow();
        }
        let hash = self.hash(key);
        self.put(u64::from(hash) << 32 | u64::from(handle));
        self.len += 1;
    }

    fn put(&mut self, slot: u64) {
        let mask = self.mask();
        let mut i = (slot >> 32) as usize & mask;
        while self.slots[i] != EMPTY {
            i = (i + 1) & mask;
        }
        self.slots[i] = slot;
    }

    fn grow(&mut self) {
        let cap = (self.slots.len() * 2).max(16);
        let old = std::mem::replace(&mut self.slots, vec![EMPTY; cap]);
        for s in old.into_iter().filter(|&s| s != EMPTY) {
            self.put(s);
        }
    }

    fn remove_at(&mut self, mut hole: usize) {
        let mask = self.mask();
        self.slots[hole] = EMPTY;
        self.len -= 1;
        let mut j = (hole + 1) & mask;
        while self.slots[j] != EMPTY {
            let home = (self.slots[j] >> 32) as usize & mask;
            // Move slot j back into the hole unless its home lies cyclically in (hole, j].
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[j];
                self.slots[j] = EMPTY;
                hole = j;
            }
            j = (j + 1) & mask;
        }
    }

    fn bytes(&self) -> usize {
        self.slots.capacity() * 8
    }
}

#[derive(Debug)]
struct RemoteEngine {
    name: String,
    host: String,
    port: u16,
    link: Link,
    /// Consecutive handshake failures, for back-off.
    failures: u32,
    leases: Order,
    next_due: Nanos,
    seq: u64,
    /// Heartbeats sent within E, oldest first.
    sent: VecDeque<Sent>,
    /// Acknowledgements of heartbeats up to this seq are ignored (sent before a reconnect).
    ack_floor: u64,
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
    /// Where the last few incarnations' params said they answer, newest last (SPEC O4): a lease
    /// of an incarnation seen at another address than the one we are linked to may be a live
    /// duplicate's, and is released there.
    seen: Vec<Endpoint>,
    /// Incarnations of another engine under this id already reported as duplicates.
    duplicates: BTreeSet<u64>,
    /// The smoothed round trip of a heartbeat and its acknowledgement (TCP's SRTT: 7/8 of the
    /// last estimate and 1/8 of the new sample), once one has been measured.
    srtt: Option<Duration>,
    /// Push transfers (SPEC §13) that need the link to this engine: P writes into our blocks
    /// over it, and the push sink's messages travel on it.
    pushes: u32,
}

/// How many incarnations' addresses an engine remembers.
const SEEN: usize = 4;

impl RemoteEngine {
    /// Remembers where `remote`'s incarnation answers.
    fn saw(&mut self, remote: &Remote) {
        if remote.incarnation == 0 {
            return;
        }
        self.seen.retain(|s| s.incarnation != remote.incarnation);
        if self.seen.len() == SEEN {
            self.seen.remove(0);
        }
        self.seen.push(Endpoint { host: remote.host.clone(), port: remote.port, incarnation: remote.incarnation });
    }

    /// Where incarnation `incarnation` was seen, if not at the address we are bound to.
    fn elsewhere(&self, incarnation: u64) -> Option<&Endpoint> {
        self.seen.iter().find(|s| s.incarnation == incarnation && (s.host != self.host || s.port != self.port))
    }

    /// The endpoint we are bound to, as incarnation `incarnation`.
    fn endpoint(&self, incarnation: u64) -> Endpoint {
        Endpoint { host: self.host.clone(), port: self.port, incarnation }
    }

    /// Acknowledgements of what was sent so far no longer count (the link is new).
    fn reconnect(&mut self) {
        self.link = Link::Unknown;
        self.ack_floor = self.seq;
    }
}

/// How often the clock offset toward an engine is measured again while the link lives.
const CLOCK_REFRESH: Duration = Duration::from_secs(30);

const BACKOFF_BASE: Duration = Duration::from_millis(100);
/// An engine nothing was tracked toward for max(12 I, this) is forgotten.
const FORGET_AFTER_MIN: Duration = Duration::from_secs(60);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Releases over a side channel retry sooner: they are worth something only within E.
const SIDE_BACKOFF_MAX: Duration = Duration::from_secs(2);
/// The most lease ids in one release over a side channel.
const SIDE_BATCH: usize = 4096;

/// Releases waiting for a side channel (SPEC O4), for one (engine, host, port, granted_by).
#[derive(Debug)]
struct SideBatch {
    /// Each id with when `poll` first saw it (after E it is pointless: P expired it itself).
    ids: BTreeMap<LeaseId, Option<Nanos>>,
    why: NotRead,
    in_flight: bool,
    failures: u32,
    retry_at: Nanos,
}

type SideKey = (String, String, u16, u64);

/// D's lease renewer for one engine: all remote P engines, all tracked requests.
///
/// Built for 10^6 tracked requests across 100s of P engines (issue #11): a heartbeat round of an
/// engine reads its sorted lease-id array once and encodes it; an acknowledgement marks its
/// heartbeat acknowledged and touches no lease; a request costs one slab entry, 8 bytes of
/// request index and 12 bytes of order (over the tables' spare room), and its request id once.
#[derive(Debug)]
pub struct Renewer {
    interval: Duration,
    extension: Duration,
    max_notif_bytes: usize,
    /// Engines by index (an entry names its engine by index); `None` once forgotten.
    engines: Vec<Option<RemoteEngine>>,
    by_name: BTreeMap<String, u32>,
    entries: Vec<Entry>,
    free: Vec<u32>,
    requests: RequestIndex,
    lost: Vec<(String, LeaseId)>,
    peers: Peers,
    /// Whether P's gate admits a read only for a live lease (the `tcp` agent; not NIXL).
    fenced_reads: bool,
    /// SPEC O4: releases no transfer link can carry, by where they go (ordered: deterministic).
    side: BTreeMap<SideKey, SideBatch>,
    /// Actions decided outside `poll` (a duplicate engine seen by `track`), for the next poll.
    notices: Vec<Action>,
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
            engines: Vec::new(),
            by_name: BTreeMap::new(),
            entries: Vec::new(),
            free: Vec::new(),
            requests: RequestIndex::new(),
            lost: Vec::new(),
            peers: Peers::default(),
            fenced_reads: false,
            side: BTreeMap::new(),
            notices: Vec::new(),
        }
    }

    fn engine_mut(&mut self, engine_id: &str) -> Option<&mut RemoteEngine> {
        let i = *self.by_name.get(engine_id)?;
        self.engines.get_mut(i as usize)?.as_mut()
    }

    fn engine(&self, engine_id: &str) -> Option<&RemoteEngine> {
        let i = *self.by_name.get(engine_id)?;
        self.engines.get(i as usize)?.as_ref()
    }

    /// The index of `remote`'s engine, known or new.
    fn engine_index(&mut self, remote: &Remote, now: Nanos) -> u32 {
        if let Some(&i) = self.by_name.get(&remote.engine_id) {
            return i;
        }
        let engine = RemoteEngine {
            name: remote.engine_id.clone(),
            host: remote.host.clone(),
            port: remote.port,
            link: Link::Unknown,
            failures: 0,
            leases: Order::default(),
            next_due: now,
            seq: 0,
            sent: VecDeque::new(),
            ack_floor: 0,
            to_release: BTreeMap::new(),
            renew_for_read: BTreeSet::new(),
            idle_since: None,
            next_probe: now + CLOCK_REFRESH,
            probe_seq: 0,
            seen: Vec::new(),
            duplicates: BTreeSet::new(),
            srtt: None,
            pushes: 0,
        };
        let i = match self.engines.iter().position(Option::is_none) {
            Some(i) => {
                self.engines[i] = Some(engine);
                i
            }
            None => {
                self.engines.push(Some(engine));
                self.engines.len() - 1
            }
        };
        self.by_name.insert(remote.engine_id.clone(), i as u32);
        i as u32
    }

    /// Whether this engine's reads are fenced by P's gate (a read of a lease that is not live
    /// is refused before a byte is served). Then a lease toward an idle engine is not renewed
    /// at once on arrival: it is renewed in the engine's next round, an interval later.
    pub fn set_fenced_reads(&mut self, fenced: bool) {
        self.fenced_reads = fenced;
    }

    /// SPEC D1: start renewing `lease_id` for `request_id` now, as it enters the scheduler.
    /// SPEC D5: a known engine seen at new coordinates or with a new incarnation is reconnected.
    ///
    /// SPEC O4: params of another incarnation at another address, while D is linked to a live
    /// incarnation of the engine, are a second live engine under the same id (a restart is told
    /// apart: the old one's agents disconnect, or the old address answers with the new
    /// incarnation). D does not flap between the two: it keeps the engine it has, does not
    /// track the request (it is reported lost, so it is recomputed) and releases the other's
    /// lease at once over that engine's side channel. The same while a handshake with the first
    /// one's address is in flight (it is not abandoned for them, and the lease ids of the two
    /// would collide); the mistake is said once that handshake proves the first one alive.
    pub fn track(&mut self, request_id: &str, remote: &Remote, lease_id: LeaseId, now: Nanos) {
        if self.requests.find(request_id, &self.entries).is_some() {
            return;
        }
        let e = self.engine_index(remote, now);
        let Some(engine) = self.engines.get_mut(e as usize).and_then(Option::as_mut) else { return };
        engine.saw(remote);
        let moved = engine.host != remote.host || engine.port != remote.port;
        let linked = if engine.link == Link::Ready { self.peers.get(&remote.engine_id).map(|p| p.incarnation) } else { None };
        // The incarnation D is linked to, or dialling (the last one whose params named the
        // address of the handshake in flight).
        let bound = match engine.link {
            Link::Ready => linked,
            Link::Pending => engine.seen.iter().rev().find(|s| s.host == engine.host && s.port == engine.port).map(|s| s.incarnation),
            _ => None,
        };
        if let Some(kept) = bound.filter(|&a| moved && remote.incarnation != 0 && a != remote.incarnation) {
            let kept = engine.endpoint(kept);
            let other = Endpoint { host: remote.host.clone(), port: remote.port, incarnation: remote.incarnation };
            self.lost.push((request_id.into(), lease_id));
            // Said once the link proves the kept engine alive (at once if it is up).
            self.duplicate(e, kept, other, lease_id, linked.is_some());
            return;
        }
        let reborn = linked.is_some_and(|a| remote.incarnation != 0 && a != remote.incarnation);
        if moved || reborn {
            if moved {
                // The old address is not a live duplicate's: forget what was seen there.
                engine.seen.retain(|s| s.host != engine.host || s.port != engine.port);
            }
            engine.host = remote.host.clone();
            engine.port = remote.port;
            engine.failures = 0;
            engine.reconnect();
        }
        if engine.leases.is_empty() {
            if self.fenced_reads {
                // P's gate checks the lease at the read itself (D6 over a fenced transport):
                // nothing waits on an early renewal, so the lease joins the engine's rounds, the
                // first an interval from now (one message per interval, D2; a new engine's first
                // heartbeat still goes as soon as its handshake is done, D5).
                if engine.next_due <= now {
                    engine.next_due = now + self.interval;
                }
            } else {
                // The first lease toward an idle engine is renewed at once: D learns it is live
                // early, and its read need not wait for the renewal (D6).
                engine.next_due = engine.next_due.min(now);
            }
        }
        let since = engine.seq as u32;
        if let Some(old) = engine.leases.get(lease_id) {
            // The same id from another incarnation of P: the older grant is certainly dead. From
            // the same one, the new request takes the lease over.
            if self.entries[old as usize].incarnation != remote.incarnation {
                self.lose(e, lease_id, false);
            } else {
                self.untrack_handle(old);
            }
        }
        let entry = Entry { request_id: request_id.into(), lease_id, incarnation: remote.incarnation, engine: e, since };
        let handle = match self.free.pop() {
            Some(h) => {
                self.entries[h as usize] = entry;
                h
            }
            None => {
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        self.requests.insert(request_id, handle);
        if let Some(engine) = self.engines.get_mut(e as usize).and_then(Option::as_mut) {
            engine.leases.insert(lease_id, handle);
        }
    }

    /// SPEC D1 for a request that must be its lease's only reader here: tracks it unless another
    /// request already renews that lease (as granted by the same incarnation), in one step, so
    /// two requests racing with the same params cannot both pass (a replayed decode leg computes
    /// its prompt itself instead of taking the lease over from the first). Returns whether it
    /// tracked.
    pub fn track_first(&mut self, request_id: &str, remote: &Remote, lease_id: LeaseId, now: Nanos) -> bool {
        if self.tracks_lease(&remote.engine_id, lease_id, remote.incarnation) {
            return false;
        }
        self.track(request_id, remote, lease_id, now);
        true
    }

    /// SPEC D5, §13: a push transfer with P engine `remote` starts: the link to it is made in
    /// the background, as for a tracked lease, and kept while any push transfer needs it. Its
    /// leases are the push sink's to renew, not the renewer's.
    pub fn push_link(&mut self, remote: &Remote, now: Nanos) {
        let e = self.engine_index(remote, now);
        if let Some(engine) = self.engines.get_mut(e as usize).and_then(Option::as_mut) {
            engine.saw(remote);
            engine.pushes += 1;
        }
    }

    /// SPEC D5, U9: a message to `engine_id` waits for the link (a release of a request given up
    /// before the handshake completed): the link stays wanted until it is delivered, also when
    /// no push transfer needs it any more; [`Renewer::push_unlink`] once it went. `false` if the
    /// engine is not known here (nothing to dial).
    pub fn push_hold(&mut self, engine_id: &str) -> bool {
        let Some(&e) = self.by_name.get(engine_id) else { return false };
        let Some(engine) = self.engines.get_mut(e as usize).and_then(Option::as_mut) else { return false };
        engine.pushes += 1;
        true
    }

    /// A push transfer with `engine_id` ended (see [`Renewer::push_link`]).
    pub fn push_unlink(&mut self, engine_id: &str) {
        if let Some(&e) = self.by_name.get(engine_id) {
            if let Some(engine) = self.engines.get_mut(e as usize).and_then(Option::as_mut) {
                engine.pushes = engine.pushes.saturating_sub(1);
            }
        }
    }

    /// Stops tracking entry `handle` everywhere; returns what it was.
    fn untrack_handle(&mut self, handle: u32) -> Option<Entry> {
        let e = self.entries.get(handle as usize)?;
        if e.engine == FREE {
            return None;
        }
        if let Some((slot, _)) = self.requests.find(&e.request_id, &self.entries) {
            self.requests.remove_at(slot);
        }
        let free = Entry { request_id: Box::default(), lease_id: 0, incarnation: 0, engine: FREE, since: 0 };
        let e = std::mem::replace(&mut self.entries[handle as usize], free);
        self.free.push(handle);
        if let Some(engine) = self.engines.get_mut(e.engine as usize).and_then(Option::as_mut) {
            engine.leases.remove(e.lease_id);
            engine.renew_for_read.remove(&e.lease_id);
        }
        Some(e)
    }

    /// SPEC D4: stop tracking a request; `Abandoned` queues a `Release` to P.
    pub fn untrack(&mut self, request_id: &str, how: Untrack) {
        let Some((_, handle)) = self.requests.find(request_id, &self.entries) else { return };
        let Some(e) = self.untrack_handle(handle) else { return };
        if how == Untrack::Abandoned {
            if let Some(engine) = self.engines.get_mut(e.engine as usize).and_then(Option::as_mut) {
                engine.to_release.insert(e.lease_id, (e.incarnation, None));
            }
        }
    }

    /// SPEC O3, O4: D will not read `lease_id` of `remote` (a refused request, params it decided
    /// not to use): queue a `Release` to P at once, without tracking anything. A lease a request
    /// here already renews is that request's and is left alone (callers ask
    /// [`Renewer::tracks_lease`] first when a replay is possible).
    pub fn release(&mut self, remote: &Remote, lease_id: LeaseId, now: Nanos) {
        if self.tracks_lease(&remote.engine_id, lease_id, remote.incarnation) {
            return;
        }
        let e = self.engine_index(remote, now);
        if let Some(engine) = self.engines.get_mut(e as usize).and_then(Option::as_mut) {
            engine.saw(remote);
            engine.to_release.insert(lease_id, (remote.incarnation, None));
        }
    }

    /// SPEC O4: engine `e` (linked or linking to `kept`) has a live duplicate `other`: release
    /// its lease `lease_id` over its side channel, and, when `say`, say so once per incarnation.
    fn duplicate(&mut self, e: u32, kept: Endpoint, other: Endpoint, lease_id: LeaseId, say: bool) {
        let Some(engine) = self.engines.get_mut(e as usize).and_then(Option::as_mut) else { return };
        let engine_id = engine.name.clone();
        if say && engine.duplicates.insert(other.incarnation) {
            self.notices.push(Action::DuplicateEngine { engine_id: engine_id.clone(), kept: kept.clone(), other: other.clone() });
        }
        let key = (engine_id, other.host, other.port, other.incarnation);
        queue_side(&mut self.side, key, lease_id, None, NotRead::Duplicate { kept });
    }

    /// SPEC O4: a release over a side channel finished: `Ok` with the answering engine's
    /// incarnation (what it did not release is ended or never was its own: either way nothing
    /// is left to do), or `Err` (unreachable, refused): retried with back-off while it is still
    /// worth it (E).
    pub fn side_release_done(&mut self, sent: &SideChannelRelease, result: Result<u64, ()>, now: Nanos) {
        let key = (sent.engine_id.clone(), sent.host.clone(), sent.port, sent.granted_by);
        let Some(batch) = self.side.get_mut(&key) else { return };
        batch.in_flight = false;
        match result {
            Ok(_) => {
                batch.failures = 0;
                for id in &sent.lease_ids {
                    batch.ids.remove(id);
                }
            }
            Err(()) => {
                batch.failures += 1;
                let backoff = BACKOFF_BASE.saturating_mul(1 << batch.failures.min(16).saturating_sub(1)).min(SIDE_BACKOFF_MAX);
                batch.retry_at = now + backoff;
            }
        }
        if batch.ids.is_empty() {
            self.side.remove(&key);
        }
    }

    /// Leases to be released over a side channel, not yet acknowledged (SPEC O4).
    pub fn side_releases_pending(&self) -> usize {
        self.side.values().map(|b| b.ids.len()).sum()
    }

    /// Requests tracked toward `engine_id`.
    pub fn tracked_toward(&self, engine_id: &str) -> usize {
        self.engine(engine_id).map_or(0, |e| e.leases.len())
    }

    /// The background handshake with `engine_id` finished: what it found, or failed. Leases
    /// granted by another incarnation of that engine are lost (SPEC §3), and the peer registry
    /// learns the engine's incarnation and agents.
    pub fn handshake_done(&mut self, engine_id: &str, result: Result<Handshook, ()>, now: Nanos) -> HandshakeTaken {
        let pending = self.engine(engine_id).is_some_and(|e| e.link == Link::Pending);
        let (true, Some(&index)) = (pending, self.by_name.get(engine_id)) else {
            return HandshakeTaken { taken: false, drop_agents: result.map(|h| h.agents).unwrap_or_default() };
        };
        let Some(engine) = self.engines.get_mut(index as usize).and_then(Option::as_mut) else { return HandshakeTaken::default() };
        match result {
            Ok(Handshook { incarnation, agents }) => {
                engine.link = Link::Ready;
                engine.failures = 0;
                engine.next_due = now;
                let entries = &self.entries;
                let stale: Vec<LeaseId> = engine
                    .leases
                    .handles()
                    .iter()
                    .map(|&h| &entries[h as usize])
                    .filter(|t| t.incarnation != 0 && t.incarnation != incarnation)
                    .map(|t| t.lease_id)
                    .collect();
                for id in stale {
                    self.lose(index, id, false);
                }
                // SPEC O4: incarnations whose params named another address while this handshake
                // was in flight (their leases were released, unread): the engine we dialled
                // just answered, so both live — said now.
                if let Some(engine) = self.engines.get_mut(index as usize).and_then(Option::as_mut) {
                    let kept = engine.endpoint(incarnation);
                    let others: Vec<Endpoint> = engine
                        .seen
                        .iter()
                        .filter(|s| s.incarnation != incarnation && engine.elsewhere(s.incarnation).is_some())
                        .cloned()
                        .collect();
                    for other in others {
                        if engine.duplicates.insert(other.incarnation) {
                            self.notices.push(Action::DuplicateEngine { engine_id: engine_id.to_string(), kept: kept.clone(), other });
                        }
                    }
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
            if let Some(engine) = self.engine_mut(engine_id) {
                if engine.link == Link::Ready {
                    engine.reconnect();
                }
            }
        }
        self.peers.learned(engine_id, incarnation, agents)
    }

    /// The connection to `engine_id` broke: handshake again before the next heartbeat. Returns
    /// the agents whose connections to drop.
    pub fn disconnected(&mut self, engine_id: &str) -> Vec<String> {
        if let Some(engine) = self.engine_mut(engine_id) {
            if engine.link == Link::Ready {
                engine.reconnect();
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
    /// The measured round trip of a heartbeat to `engine_id` and its acknowledgement (smoothed),
    /// once one has been measured: how long a renewal for a read waits before it is sent again
    /// ([`crate::pull::Pull::measured_round_trip`]).
    pub fn round_trip(&self, engine_id: &str) -> Option<Duration> {
        let i = *self.by_name.get(engine_id)?;
        self.engines.get(i as usize)?.as_ref()?.srtt
    }

    pub fn peer(&self, engine_id: &str) -> Option<&Peer> {
        self.peers.get(engine_id)
    }

    /// Records a clock sample from a handshake with `engine_id` (SPEC B2).
    pub fn clock_sample(&mut self, engine_id: &str, sample: crate::clock::ClockSample) {
        self.peers.clock_sample(engine_id, sample);
    }

    /// A message from a rank of P engine `engine_id`, at `now`: acknowledgements, lost leases,
    /// clock probe answers. An acknowledgement marks its heartbeat acknowledged (every lease it
    /// named is then live until its send time + E): no work per lease id.
    pub fn on_message(&mut self, engine_id: &str, msg: &Message, now: Nanos) {
        let Some(&index) = self.by_name.get(engine_id) else {
            if let Message::ClockPong { t0, t1, t2, .. } = msg {
                let sample = crate::clock::ClockSample { t0: *t0, t1: *t1, t2: *t2, t3: now.0 };
                self.peers.clock_sample(engine_id, sample);
            }
            return;
        };
        match msg {
            Message::ClockPong { t0, t1, t2, .. } => {
                let sample = crate::clock::ClockSample { t0: *t0, t1: *t1, t2: *t2, t3: now.0 };
                self.peers.clock_sample(engine_id, sample);
            }
            Message::HeartbeatAck { seq, lost_ids } => {
                let Some(engine) = self.engines.get_mut(index as usize).and_then(Option::as_mut) else { return };
                if *seq > engine.ack_floor {
                    if let Ok(pos) = engine.sent.binary_search_by_key(seq, |s| s.seq) {
                        // Ranks ack the same heartbeat each; one is enough, the others change nothing.
                        let sent = &mut engine.sent[pos];
                        if !sent.acked {
                            let sample = now.since(sent.at);
                            engine.srtt = Some(engine.srtt.map_or(sample, |s| (s * 7 + sample) / 8));
                        }
                        sent.acked = true;
                    }
                }
                for id in lost_ids {
                    self.lose(index, *id, true);
                }
            }
            Message::LeaseLost { lease_ids } => {
                for id in lease_ids {
                    self.lose(index, *id, false);
                }
            }
            _ => {}
        }
    }

    /// Until when P is known to hold entry `e`'s lease: the latest acknowledged heartbeat that
    /// named it, sent at t, proves t + E; `None` when none within E did.
    fn acked_until(&self, engine: &RemoteEngine, e: &Entry) -> Option<Nanos> {
        engine.sent.iter().rev().find(|s| s.acked && s.named(e)).map(|s| s.at + self.extension)
    }

    /// SPEC D6: may the request's lease be read now, finishing within `budget`?
    /// `RenewFirst` queues a renewal of it for the next [`Renewer::poll`].
    ///
    /// Over a `fenced` transport (P's gate admits a read only for a live lease and keeps its
    /// blocks until the read is out, SPEC P5; see [`crate::pull`]) the read is its own proof:
    /// `Safe` as soon as the handshake with P is done, no renewal queued.
    pub fn read_check(&mut self, request_id: &str, budget: Duration, fenced: bool, now: Nanos) -> ReadCheck {
        let Some((_, handle)) = self.requests.find(request_id, &self.entries) else { return ReadCheck::Untracked };
        let e = &self.entries[handle as usize];
        let Some(engine) = self.engines.get(e.engine as usize).and_then(Option::as_ref) else { return ReadCheck::Untracked };
        if fenced && engine.link == Link::Ready {
            return ReadCheck::Safe;
        }
        if self.acked_until(engine, e).is_some_and(|t| t > now + budget) {
            return ReadCheck::Safe;
        }
        if matches!(engine.link, Link::Failed { .. }) {
            return ReadCheck::Unreachable;
        }
        let linked = engine.link == Link::Ready;
        if fenced {
            // Waiting for the handshake, not for an acknowledgement.
            return if linked { ReadCheck::RenewFirst } else { ReadCheck::NoLink };
        }
        let (lease_id, index) = (e.lease_id, e.engine);
        if let Some(engine) = self.engines.get_mut(index as usize).and_then(Option::as_mut) {
            engine.renew_for_read.insert(lease_id);
        }
        if linked {
            ReadCheck::RenewFirst
        } else {
            ReadCheck::NoLink
        }
    }

    /// Everything due at `now`, appended to `out`.
    pub fn poll(&mut self, now: Nanos, out: &mut Vec<Action>) {
        for (request_id, lease_id) in self.lost.drain(..) {
            out.push(Action::Lost { request_id, lease_id });
        }
        out.append(&mut self.notices);
        for &index in self.by_name.values() {
            let Some(engine) = self.engines.get_mut(index as usize).and_then(Option::as_mut) else { continue };
            let engine_id = &engine.name;
            // An ack of a heartbeat sent more than E ago proves nothing any more: forget it.
            while engine.sent.front().is_some_and(|s| s.at + self.extension <= now) {
                engine.sent.pop_front();
            }
            for (_, queued) in engine.to_release.values_mut() {
                queued.get_or_insert(now);
            }
            engine.to_release.retain(|_, (_, queued)| queued.is_none_or(|t| now.since(t) < self.extension));
            let linked = if engine.link == Link::Ready { self.peers.get(engine_id).map(|p| p.incarnation) } else { None };
            // SPEC O4: releases no transfer link can carry go over a side channel: all of them
            // while the handshake fails; on a live link, those of a duplicate engine elsewhere
            // (those of an earlier incarnation here ended with it).
            let by_side: Vec<LeaseId> = match (engine.link, linked) {
                (Link::Failed { .. }, _) => engine.to_release.keys().copied().collect(),
                (Link::Ready, Some(inc)) => engine
                    .to_release
                    .iter()
                    .filter(|(_, (by, _))| *by != 0 && *by != inc && engine.elsewhere(*by).is_some())
                    .map(|(&id, _)| id)
                    .collect(),
                _ => Vec::new(),
            };
            for id in by_side {
                let Some((by, queued)) = engine.to_release.remove(&id) else { continue };
                let (to, why) = match (engine.elsewhere(by), linked) {
                    (Some(at), Some(inc)) => (at.clone(), NotRead::Duplicate { kept: engine.endpoint(inc) }),
                    (Some(at), None) => (at.clone(), NotRead::NoLink),
                    (None, _) => (engine.endpoint(by), NotRead::NoLink),
                };
                queue_side(&mut self.side, (engine_id.clone(), to.host, to.port, by), id, queued, why);
            }
            // Leases to renew, or releases to deliver, need a connection.
            let wanted = !engine.leases.is_empty() || !engine.to_release.is_empty() || engine.pushes > 0;
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
                        let lateness = now.since(engine.next_due);
                        engine.next_due = now + self.interval;
                        engine.renew_for_read.clear();
                        engine.leases.settle();
                        send_round(engine, now, self.max_notif_bytes, SendKind::Heartbeat { lateness }, out);
                    } else if !engine.renew_for_read.is_empty() {
                        let ids: Vec<LeaseId> = std::mem::take(&mut engine.renew_for_read).into_iter().collect();
                        send_for_read(engine, ids, now, self.max_notif_bytes, out);
                    }
                }
                _ => {}
            }
            let idle = engine.leases.is_empty() && engine.to_release.is_empty() && engine.pushes == 0 && engine.link != Link::Pending;
            engine.idle_since = if idle { engine.idle_since.or(Some(now)) } else { None };
        }
        // SPEC O4: releases over side channels, each batch one at a time, with back-off.
        let extension = self.extension;
        self.side.retain(|_, b| {
            for queued in b.ids.values_mut() {
                queued.get_or_insert(now);
            }
            b.ids.retain(|_, queued| queued.is_none_or(|t| now.since(t) < extension));
            b.in_flight || !b.ids.is_empty()
        });
        for ((engine_id, host, port, granted_by), b) in &mut self.side {
            if b.in_flight || now < b.retry_at {
                continue;
            }
            b.in_flight = true;
            out.push(Action::ReleaseOverSideChannel(SideChannelRelease {
                engine_id: engine_id.clone(),
                host: host.clone(),
                port: *port,
                granted_by: *granted_by,
                lease_ids: b.ids.keys().take(SIDE_BATCH).copied().collect(),
                why: b.why.clone(),
            }));
        }
        let forget_after = self.forget_after();
        let stale: Vec<(String, u32)> = self
            .by_name
            .iter()
            .filter(|(_, &i)| self.engines[i as usize].as_ref().is_some_and(|e| e.idle_since.is_some_and(|t| now.since(t) >= forget_after)))
            .map(|(id, &i)| (id.clone(), i))
            .collect();
        for (engine_id, index) in stale {
            self.by_name.remove(&engine_id);
            self.engines[index as usize] = None;
            let agents = self.peers.forget(&engine_id);
            out.push(Action::Forget { engine_id, agents });
        }
    }

    /// When [`Renewer::poll`] next has something to do; `None` when nothing is scheduled.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        if !self.lost.is_empty() || !self.notices.is_empty() {
            return Some(Nanos::ZERO);
        }
        let forget_after = self.forget_after();
        let side = self.side.values().filter(|b| !b.in_flight).map(|b| b.retry_at).min();
        self.engines
            .iter()
            .flatten()
            .filter_map(|e| match e.link {
                Link::Unknown if !e.leases.is_empty() || !e.to_release.is_empty() || e.pushes > 0 => Some(Nanos::ZERO),
                // Releases to hand over to the side channel (SPEC O4).
                Link::Failed { .. } if !e.to_release.is_empty() => Some(Nanos::ZERO),
                Link::Failed { retry_at, .. } if !e.leases.is_empty() || e.pushes > 0 => Some(retry_at),
                Link::Ready if !e.to_release.is_empty() || !e.renew_for_read.is_empty() => Some(Nanos::ZERO),
                Link::Ready if !e.leases.is_empty() => Some(e.next_due.min(e.next_probe)),
                // An idle engine is forgotten after a while.
                _ => e.idle_since.map(|t| t + forget_after),
            })
            .chain(side)
            .min()
    }

    /// An engine nothing was tracked toward for this long is forgotten.
    fn forget_after(&self) -> Duration {
        (self.interval * 12).max(FORGET_AFTER_MIN)
    }

    /// Requests being renewed.
    pub fn tracked(&self) -> usize {
        self.requests.len
    }

    /// Whether a request is tracked.
    pub fn is_tracked(&self, request_id: &str) -> bool {
        self.requests.find(request_id, &self.entries).is_some()
    }

    /// Whether a request already renews `lease_id` as granted by this `incarnation` of
    /// `engine_id`. A second request naming the same lease (a replayed or retried decode leg on
    /// this engine) must neither take it over from the first nor release it under it.
    pub fn tracks_lease(&self, engine_id: &str, lease_id: LeaseId, incarnation: u64) -> bool {
        self.engine(engine_id)
            .and_then(|e| e.leases.get(lease_id))
            .and_then(|h| self.entries.get(h as usize))
            .is_some_and(|t| t.incarnation == incarnation)
    }

    /// Whether the handshake with `engine_id` has completed.
    pub fn is_ready(&self, engine_id: &str) -> bool {
        matches!(self.engine(engine_id).map(|e| e.link), Some(Link::Ready))
    }

    /// Bytes the renewer's own tables hold for tracked requests (the slab, the request index, the
    /// engines' sorted lease ids and heartbeats in flight), request ids' bytes not counted: for
    /// the benches' memory per tracked request.
    pub fn table_bytes(&self) -> usize {
        let engines: usize = self
            .engines
            .iter()
            .flatten()
            .map(|e| {
                e.leases.bytes()
                    + e.sent.iter().map(|s| std::mem::size_of::<Sent>() + s.ids.as_ref().map_or(0, |i| i.len() * 8)).sum::<usize>()
            })
            .sum();
        self.entries.capacity() * std::mem::size_of::<Entry>() + self.free.capacity() * 4 + self.requests.bytes() + engines
    }

    /// Stops tracking a lost lease and reports it. `release`: P may still hold it (a renewal
    /// capped by P9 is acknowledged as lost), so free it now; pointless when P said it is gone.
    fn lose(&mut self, engine: u32, lease_id: LeaseId, release: bool) {
        let Some(handle) = self.engines.get(engine as usize).and_then(Option::as_ref).and_then(|e| e.leases.get(lease_id)) else { return };
        let Some(t) = self.untrack_handle(handle) else { return };
        if release {
            if let Some(engine) = self.engines.get_mut(engine as usize).and_then(Option::as_mut) {
                engine.to_release.insert(lease_id, (t.incarnation, None));
            }
        }
        self.lost.push((t.request_id.into(), lease_id));
    }
}

/// Queues `lease_id` for release over the side channel `key` says (SPEC O4); `queued`: when
/// `poll` first saw it, if it did.
fn queue_side(side: &mut BTreeMap<SideKey, SideBatch>, key: SideKey, lease_id: LeaseId, queued: Option<Nanos>, why: NotRead) {
    let batch = side.entry(key).or_insert_with(|| SideBatch {
        ids: BTreeMap::new(),
        why: why.clone(),
        in_flight: false,
        failures: 0,
        retry_at: Nanos::ZERO,
    });
    batch.why = why;
    batch.ids.entry(lease_id).or_insert(queued);
}

/// A heartbeat round: every tracked lease of `engine` (settled, so `ids` is sorted), in as
/// many messages as `max_bytes` needs.
fn send_round(engine: &mut RemoteEngine, now: Nanos, max_bytes: usize, kind: SendKind, out: &mut Vec<Action>) {
    let ids = &engine.leases.ids;
    for range in heartbeat_chunks(ids, max_bytes) {
        engine.seq += 1;
        let chunk = &ids[range];
        let mut bytes = Vec::with_capacity(chunk.len() * 2 + 24);
        encode_heartbeat(engine.seq, chunk, &mut bytes);
        let (lo, hi) = (chunk[0], chunk[chunk.len() - 1]);
        engine.sent.push_back(Sent { seq: engine.seq, at: now, lo, hi, ids: None, acked: false });
        out.push(Action::Send { engine_id: engine.name.clone(), bytes, kind });
    }
}

/// SPEC D6: a renewal of just these (sorted) leases, about to be read.
fn send_for_read(engine: &mut RemoteEngine, ids: Vec<LeaseId>, now: Nanos, max_bytes: usize, out: &mut Vec<Action>) {
    for range in heartbeat_chunks(&ids, max_bytes) {
        engine.seq += 1;
        let chunk = &ids[range];
        let mut bytes = Vec::new();
        encode_heartbeat(engine.seq, chunk, &mut bytes);
        let (lo, hi) = (chunk[0], chunk[chunk.len() - 1]);
        engine.sent.push_back(Sent { seq: engine.seq, at: now, lo, hi, ids: Some(chunk.into()), acked: false });
        out.push(Action::Send { engine_id: engine.name.clone(), bytes, kind: SendKind::ReadRenewal });
    }
}
