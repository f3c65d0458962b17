//! P's leases when another process issues the ids D knows them by: vLLM's scheduler puts an id
//! in a request's `kv_transfer_params` when its prefill ends, and the worker that holds the
//! blocks (and this table) is handed the request, and grants its lease, one engine step later.
//! Every rule of SPEC §4 stays the [`LeaseTable`]'s; this adds what that split needs:
//!
//! * **Names.** Messages name leases by the issued id; [`IssuedLeases::name`] binds it to the
//!   table's own lease id once the worker learns it, and every answer names it back.
//! * **On its way** (P1, P6). Ids are issued in order and named in order, so an id above the
//!   highest named, by at most [`PENDING_WINDOW`], is a lease not granted *yet*, not a lost one:
//!   D may renew, read and confirm before P's next step (a loaded host delays it). Its renewal
//!   renews nothing and is not answered lost (the scheduler holds the blocks from the prefill's
//!   end, and the grant starts a full lease); its `ReadDone` or `Release` is held for the grant
//!   ([`IssuedLeases::answer_due`]), at most a caller-chosen age (E, D's own wait for an answer)
//!   and at most [`EARLY_MEMORY`] messages, answered when the lease is granted, or as not live
//!   when a later id was named first or the age passed. An id further ahead is lost at once.
//! * **Completions the transport reports** (P5). The worker sees a read complete through its own
//!   notifications and ends the lease as `transferred` ([`IssuedLeases::end`]); D's `ReadDone`
//!   is then a question — was the lease live, and not another engine's, when the read
//!   completed? — answered from the live lease or from a bounded memory of leases ended by their
//!   read ([`READ_MEMORY`]), never a completion of its own.

use crate::config::LeaseConfig;
use crate::lease_table::{Answer, Holder, LeaseTable, ReleaseReason, Released};
use crate::pull::PlantedBug;
use crate::wire::Message;
use crate::{LeaseId, Nanos};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

/// How far above the highest named id an id may be and still be on its way: the prefills P's
/// scheduler finishes between two engine steps, with a wide margin.
pub const PENDING_WINDOW: u64 = 1 << 16;

/// How many messages about leases not granted yet are held at once; past that, they are
/// answered at once (not live).
pub const EARLY_MEMORY: usize = 1 << 12;

/// How many leases ended by their read are remembered, for D's `ReadDone` that comes after.
pub const READ_MEMORY: usize = 1 << 16;

/// The ids the process that is not the table issues (vLLM's scheduler), in order — what
/// [`IssuedLeases::pending`] relies on. One series per life of P, drawn at random by the caller
/// (the core draws nothing): ids are `series << 32` onwards, so a restarted P does not issue a
/// dead life's ids (vLLM has no incarnation to fence with), and never the same id twice.
#[derive(Debug, Clone)]
pub struct Issuer {
    next: u64,
}

impl Issuer {
    /// Ids of the series `series` (its low 20 bits).
    pub fn new(series: u32) -> Issuer {
        Issuer { next: (u64::from(series & 0xF_FFFF) + 1) << 32 }
    }

    /// The next id, one above the last.
    pub fn next_id(&mut self) -> u64 {
        let id = self.next;
        self.next += 1;
        id
    }
}

/// What [`IssuedLeases`] counted beside the table's own stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IssuedStats {
    /// SPEC P6: ids a renewal or release named that are not live and not on their way.
    pub unknown: u64,
    /// Renewals of ids on their way (answered not lost, renewing nothing).
    pub early_renewals: u64,
    /// `ReadDone`s and `Release`s held for their lease's grant.
    pub held: u64,
}

/// A message about a lease on its way, held for its grant.
#[derive(Debug)]
struct Held {
    holder: Holder,
    /// The caller's name for where the message came from (a connection), handed back with the
    /// answer: one engine may speak on several connections (a rank each).
    tag: u64,
    msg: Message,
    at: Nanos,
}

/// A held message's turn: who sent it (the holder, and the caller's tag for the connection it
/// came on) and the answer to send back, if any (a `Release` that took effect has none).
#[derive(Debug, Clone, PartialEq)]
pub struct Due {
    pub holder: Holder,
    pub tag: u64,
    pub reply: Option<Message>,
}

/// P's [`LeaseTable`] under ids issued elsewhere (see the module's documentation).
#[derive(Debug)]
pub struct IssuedLeases<T> {
    table: LeaseTable<T>,
    by_issued: HashMap<u64, LeaseId>,
    issued_of: HashMap<LeaseId, u64>,
    /// The highest issued id named so far (0: none yet, so every id may be on its way).
    highest: u64,
    /// Leases ended by their read, with the engine that held them: issued id -> holder.
    read: HashMap<u64, Option<Holder>>,
    read_order: VecDeque<u64>,
    early: BTreeMap<u64, Vec<Held>>,
    early_n: usize,
    /// Ids on their way that an engine renewed before the grant: the renewal is applied at the
    /// grant (the first engine to renew holds the lease, S5), so the acknowledgement D counted
    /// on holds (D reads while an acknowledged renewal covers it, D6).
    early_renewed: HashMap<u64, Holder>,
    stats: IssuedStats,
    /// A bug the connector's simulator must find ([`PlantedBug::EarlyRenewalDropped`],
    /// [`PlantedBug::ConfirmExpiredRead`]). Never set outside the simulator's own tests.
    #[doc(hidden)]
    pub planted: Option<PlantedBug>,
}

impl<T> IssuedLeases<T> {
    pub fn new(cfg: &LeaseConfig, capacity: usize) -> Self {
        IssuedLeases {
            table: LeaseTable::with_capacity(cfg, capacity),
            by_issued: HashMap::new(),
            issued_of: HashMap::new(),
            highest: 0,
            read: HashMap::new(),
            read_order: VecDeque::new(),
            early: BTreeMap::new(),
            early_n: 0,
            early_renewed: HashMap::new(),
            stats: IssuedStats::default(),
            planted: None,
        }
    }

    /// The table itself, to read (deadlines, payloads, stats).
    pub fn table(&self) -> &LeaseTable<T> {
        &self.table
    }

    pub fn stats(&self) -> IssuedStats {
        self.stats
    }

    /// Messages held for their lease's grant.
    pub fn held(&self) -> usize {
        self.early_n
    }

    /// SPEC S5: the holder for an engine (see [`LeaseTable::holder`]).
    pub fn holder(&mut self, engine: &str) -> Holder {
        self.table.holder(engine)
    }

    /// SPEC P1: a lease until `now + lifetime` (see [`LeaseTable::grant_for`]); not named yet.
    pub fn grant(&mut self, now: Nanos, lifetime: Duration, blocks: u32, payload: T) -> LeaseId {
        self.table.grant_for(now, lifetime, blocks, payload)
    }

    /// The id P's scheduler issued for live lease `id`, named at `now` (the grant's step).
    /// Returns whether it now names it (not if the lease is not live or the id already names a
    /// live lease). A renewal of `issued` that came before, on its way, is applied now: the
    /// lease runs at least E from now and is that engine's (SPEC P2, S5).
    pub fn name(&mut self, id: LeaseId, issued: u64, now: Nanos, released: &mut Vec<Released<T>>) -> bool {
        self.highest = self.highest.max(issued);
        let renewed = self.early_renewed.remove(&issued).filter(|_| self.planted != Some(PlantedBug::EarlyRenewalDropped));
        if !self.early_renewed.is_empty() {
            // Ids below the highest named can no longer come: their renewals renewed nothing.
            let highest = self.highest;
            self.early_renewed.retain(|w, _| *w > highest);
        }
        if self.table.get(id).is_none() || self.by_issued.contains_key(&issued) {
            return false;
        }
        if let Some(old) = self.issued_of.insert(id, issued) {
            self.by_issued.remove(&old);
        }
        self.by_issued.insert(issued, id);
        if let Some(holder) = renewed {
            let from = released.len();
            self.table.renew(holder, &[id], now, &mut Vec::new(), released);
            self.forget(&released[from..]);
        }
        true
    }

    /// The live lease `issued` names.
    pub fn lease_of(&self, issued: u64) -> Option<LeaseId> {
        self.by_issued.get(&issued).copied().filter(|id| self.table.get(*id).is_some())
    }

    /// Whether `issued` may be a lease P's scheduler issued and this table has not been named
    /// yet: above every id named so far by at most [`PENDING_WINDOW`] (any id before the first).
    pub fn pending(&self, issued: u64) -> bool {
        issued > self.highest && (self.highest == 0 || issued - self.highest <= PENDING_WINDOW)
    }

    /// SPEC P2, P6 for ids of the table's own (vLLM's text heartbeats name requests, which the
    /// caller maps to lease ids): see [`LeaseTable::renew`].
    pub fn renew(
        &mut self,
        holder: Holder,
        ids: &[LeaseId],
        now: Nanos,
        lost: &mut Vec<LeaseId>,
        released: &mut Vec<Released<T>>,
    ) -> usize {
        let from = released.len();
        let renewed = self.table.renew(holder, ids, now, lost, released);
        self.forget(&released[from..]);
        renewed
    }

    /// P ends lease `id` itself: its read completed as the transport reported it
    /// (`Transferred`: a `ReadDone` for it that comes after is confirmed to its holder), or its
    /// request went away (`Released`). Returns whether it was live.
    pub fn end(&mut self, id: LeaseId, reason: ReleaseReason, now: Nanos, released: &mut Vec<Released<T>>) -> bool {
        let holder = self.table.holder_of(id);
        let from = released.len();
        if !self.table.end_lease(id, reason, now, released) {
            return false;
        }
        if reason == ReleaseReason::Transferred {
            if let Some(&issued) = self.issued_of.get(&id) {
                self.remember_read(issued, holder);
            }
        }
        self.forget(&released[from..]);
        true
    }

    /// SPEC P4: leases past their deadline, ended as `expired` (see [`LeaseTable::tick`]).
    pub fn tick(&mut self, now: Nanos, released: &mut Vec<Released<T>>) {
        let from = released.len();
        self.table.tick(now, released);
        self.forget(&released[from..]);
    }

    /// When [`IssuedLeases::tick`] has work next.
    pub fn next_expiry(&self) -> Option<Nanos> {
        self.table.next_expiry()
    }

    /// Everything P does with a kvlease message from `holder` that names leases by issued ids
    /// (SPEC P2, P5, P6, D4, S5): a `Heartbeat` renews (ids on their way are neither renewed nor
    /// lost), a `Release` ends the leases `holder` holds (others are answered `LeaseLost`), a
    /// `ReadDone` asks whether the read's lease was live and not another engine's. With `hold`,
    /// a `ReadDone` or `Release` of a lease on its way is held for its grant (no answer now).
    pub fn on_message(&mut self, holder: Holder, msg: &Message, now: Nanos, hold: bool, released: &mut Vec<Released<T>>) -> Answer {
        self.on_message_from(holder, 0, msg, now, hold, released)
    }

    /// [`IssuedLeases::on_message`] for a message that came on the connection the caller calls
    /// `tag`: a message held for its grant is answered with that tag ([`IssuedLeases::answer_due`]).
    pub fn on_message_from(
        &mut self,
        holder: Holder,
        tag: u64,
        msg: &Message,
        now: Nanos,
        hold: bool,
        released: &mut Vec<Released<T>>,
    ) -> Answer {
        let from = released.len();
        let answer = match msg {
            Message::Heartbeat { seq, lease_ids } => {
                let (mut lost, mut ids, mut names) = (Vec::new(), Vec::new(), Vec::new());
                for &w in lease_ids {
                    match self.lease_of(w) {
                        Some(id) => {
                            ids.push(id);
                            names.push(w);
                        }
                        None if self.pending(w) && self.keep_renewal(holder, w) => self.stats.early_renewals += 1,
                        None => {
                            self.stats.unknown += 1;
                            lost.push(w);
                        }
                    }
                }
                let mut gone = Vec::new();
                let renewed = self.table.renew(holder, &ids, now, &mut gone, released);
                if !gone.is_empty() {
                    let gone: HashSet<LeaseId> = gone.into_iter().collect();
                    lost.extend(ids.iter().zip(&names).filter(|(id, _)| gone.contains(id)).map(|(_, w)| *w));
                }
                lost.sort_unstable();
                Answer { reply: Some(Message::HeartbeatAck { seq: *seq, lost_ids: lost }), renewed }
            }
            Message::Release { lease_ids } => {
                let mut lost = Vec::new();
                for &w in lease_ids {
                    if hold && self.hold(holder, tag, w, Message::Release { lease_ids: vec![w] }, now) {
                        continue;
                    }
                    match self.lease_of(w) {
                        Some(id) => {
                            let mut refused = Vec::new();
                            self.table.release(holder, &[id], now, &mut refused, released);
                            if !refused.is_empty() {
                                lost.push(w);
                            }
                        }
                        None => {
                            self.stats.unknown += 1;
                            lost.push(w);
                        }
                    }
                }
                lost.sort_unstable();
                Answer { reply: (!lost.is_empty()).then_some(Message::LeaseLost { lease_ids: lost }), renewed: 0 }
            }
            Message::ReadDone { lease_id: w, .. } => {
                if hold && self.hold(holder, tag, *w, msg.clone(), now) {
                    Answer { reply: None, renewed: 0 }
                } else {
                    let live = self.read_was_live(holder, *w, now, released);
                    Answer { reply: Some(Message::ReadDoneAck { lease_id: *w, live }), renewed: 0 }
                }
            }
            _ => Answer { reply: None, renewed: 0 },
        };
        self.forget(&released[from..]);
        answer
    }

    /// The messages held for their lease's grant that are due now — the lease is named, or can
    /// no longer be (a later id was named), or the message waited `max_age` — answered in
    /// arrival order: each with who sent it and the answer to send back (none for a `Release`
    /// that took effect).
    pub fn answer_due(&mut self, now: Nanos, max_age: Duration, released: &mut Vec<Released<T>>) -> Vec<Due> {
        if self.early.is_empty() {
            return Vec::new();
        }
        let max_age = u64::try_from(max_age.as_nanos()).unwrap_or(u64::MAX);
        let aged = |h: &Held| now.0.saturating_sub(h.at.0) >= max_age;
        let due: Vec<u64> = self.early.iter().filter(|(w, items)| !self.pending(**w) || items.iter().any(aged)).map(|(w, _)| *w).collect();
        let mut items = Vec::new();
        for w in due {
            let Some(held) = self.early.remove(&w) else { continue };
            if self.pending(w) {
                // Each message waits its own maximum age; the younger ones stay held.
                let (old, young): (Vec<Held>, Vec<Held>) = held.into_iter().partition(|h| aged(h));
                items.extend(old);
                if !young.is_empty() {
                    self.early.insert(w, young);
                }
            } else {
                items.extend(held);
            }
        }
        self.early_n -= items.len();
        items.sort_by_key(|h| h.at);
        let mut out = Vec::new();
        for h in items {
            let reply = self.on_message_from(h.holder, h.tag, &h.msg, now, false, released).reply;
            out.push(Due { holder: h.holder, tag: h.tag, reply });
        }
        out
    }

    /// Keeps a renewal of `w`, on its way, for its grant (the first engine's; another engine's
    /// renews nothing, as it would not after the grant); false when there is no room (then the
    /// renewal is answered lost: it could not be kept).
    fn keep_renewal(&mut self, holder: Holder, w: u64) -> bool {
        if let Some(first) = self.early_renewed.get(&w) {
            return *first == holder;
        }
        if self.early_renewed.len() >= EARLY_MEMORY {
            return false;
        }
        self.early_renewed.insert(w, holder);
        true
    }

    /// Holds `msg` about issued id `w` for its grant if `w` is on its way and there is room.
    fn hold(&mut self, holder: Holder, tag: u64, w: u64, msg: Message, now: Nanos) -> bool {
        if self.early_n >= EARLY_MEMORY || !self.pending(w) {
            return false;
        }
        self.early.entry(w).or_default().push(Held { holder, tag, msg, at: now });
        self.early_n += 1;
        self.stats.held += 1;
        true
    }

    /// SPEC P5, S5: whether a read of the lease `w` names, just completed, may be used by
    /// `holder`: the lease is live and not another's, or it ended by its read while held by
    /// `holder` (or by nobody yet).
    fn read_was_live(&mut self, holder: Holder, w: u64, now: Nanos, released: &mut Vec<Released<T>>) -> bool {
        if let Some(was) = self.read.get(&w) {
            return was.is_none_or(|h| h == holder);
        }
        match self.lease_of(w) {
            Some(id) => self.table.confirms(holder, id, now, released),
            None => false,
        }
    }

    fn remember_read(&mut self, issued: u64, holder: Option<Holder>) {
        if self.read.insert(issued, holder).is_none() {
            self.read_order.push_back(issued);
        }
        while self.read_order.len() > READ_MEMORY {
            if let Some(old) = self.read_order.pop_front() {
                self.read.remove(&old);
            }
        }
    }

    /// Drops the names of leases that ended.
    fn forget(&mut self, released: &[Released<T>]) {
        for r in released {
            if let Some(issued) = self.issued_of.remove(&r.lease_id) {
                self.by_issued.remove(&issued);
                if r.reason == ReleaseReason::Expired && self.planted == Some(PlantedBug::ConfirmExpiredRead) {
                    self.remember_read(issued, None);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::PromptDigest;

    const SEC: u64 = 1_000_000_000;
    const L: Duration = Duration::from_secs(30);

    /// Ids come in order, one series per life, never 0, never twice.
    #[test]
    fn p1_issued_ids_come_in_order_in_their_series() {
        let mut a = Issuer::new(6);
        let (x, y) = (a.next_id(), a.next_id());
        assert_eq!((x, y), (7 << 32, (7 << 32) + 1));
        assert_eq!(Issuer::new(0).next_id(), 1 << 32);
        assert_eq!(Issuer::new(u32::MAX).next_id(), 1 << 52, "20 bits of series");
    }

    fn leases() -> (IssuedLeases<&'static str>, Holder, Holder) {
        let mut t = IssuedLeases::new(&LeaseConfig::default(), 0);
        let (d1, d2) = (t.holder("d1"), t.holder("d2"));
        (t, d1, d2)
    }

    fn hb(ids: &[u64]) -> Message {
        Message::Heartbeat { seq: 1, lease_ids: ids.to_vec() }
    }

    fn read_done(w: u64) -> Message {
        Message::ReadDone { lease_id: w, consumer_rank: 0, n: 1, digest: PromptDigest([0; 16]) }
    }

    fn lost_of(a: Answer) -> Vec<u64> {
        match a.reply {
            Some(Message::HeartbeatAck { lost_ids, .. }) => lost_ids,
            Some(Message::LeaseLost { lease_ids }) => lease_ids,
            other => panic!("{other:?}"),
        }
    }

    /// SPEC P2, P6: messages name leases by their issued ids, and answers name them back.
    #[test]
    fn p2_p6_renewals_name_leases_by_their_issued_ids() {
        let (mut t, d1, _) = leases();
        let mut rel = Vec::new();
        let a = t.grant(Nanos(0), L, 1, "a");
        assert!(t.name(a, (7 << 32) + 5, Nanos(0), &mut rel));
        let answer = t.on_message(d1, &hb(&[(7 << 32) + 5, 3]), Nanos(SEC), true, &mut rel);
        assert_eq!(answer.renewed, 1);
        assert_eq!(lost_of(answer), vec![3], "an id before the series is lost at once");
        assert_eq!(t.stats().unknown, 1);
    }

    /// SPEC P1, P6: an id above the highest named (within the window) is on its way: renewing
    /// it renews nothing and is not lost; a `ReadDone` or `Release` of it is held, then answered
    /// once it is granted and named. Far ahead, it is lost at once.
    #[test]
    fn p1_p6_messages_that_overtake_their_grant_are_held_not_lost() {
        let (mut t, d1, _) = leases();
        let mut rel = Vec::new();
        let s = 9 << 32;
        let a = t.grant(Nanos(0), L, 1, "a");
        t.name(a, s + 1, Nanos(0), &mut rel);
        // Before any id was named every id may be on its way; now, s+2 is.
        let answer = t.on_message(d1, &hb(&[s + 2, s + 1 + PENDING_WINDOW + 1]), Nanos(SEC), true, &mut rel);
        assert_eq!(lost_of(answer), vec![s + 2 + PENDING_WINDOW], "far ahead: lost");
        assert_eq!(t.stats().early_renewals, 1);
        // Two connections of the same engine (two ranks of D): each answer goes back on its own.
        assert_eq!(t.on_message_from(d1, 7, &read_done(s + 2), Nanos(SEC), true, &mut rel).reply, None, "held");
        assert_eq!(t.on_message_from(d1, 8, &Message::Release { lease_ids: vec![s + 3] }, Nanos(SEC), true, &mut rel).reply, None);
        assert_eq!(t.held(), 2);
        assert!(t.answer_due(Nanos(SEC), L, &mut rel).is_empty(), "not granted yet");
        // The worker's next step grants both; each message is answered as for a live lease.
        let b = t.grant(Nanos(2 * SEC), L, 1, "b");
        let c = t.grant(Nanos(2 * SEC), L, 1, "c");
        t.name(b, s + 2, Nanos(2 * SEC), &mut rel);
        t.name(c, s + 3, Nanos(2 * SEC), &mut rel);
        let due = t.answer_due(Nanos(2 * SEC), L, &mut rel);
        assert_eq!(
            due,
            vec![
                Due { holder: d1, tag: 7, reply: Some(Message::ReadDoneAck { lease_id: s + 2, live: true }) },
                Due { holder: d1, tag: 8, reply: None },
            ],
            "the release took effect: no answer, but its turn is said"
        );
        assert_eq!(rel.iter().map(|r| r.payload).collect::<Vec<_>>(), vec![Some("c")], "released by the held Release");
        assert_eq!(t.held(), 0);
    }

    /// SPEC P2, D6: a renewal that overtook its grant was acknowledged (not lost), so D may read
    /// on it: it is applied at the grant, whatever lifetime the grant came with, and the lease
    /// is the renewing engine's (S5); another engine's renewal of it is lost.
    #[test]
    fn p2_d6_a_renewal_before_the_grant_is_applied_at_the_grant() {
        let (mut t, d1, d2) = leases();
        let mut rel = Vec::new();
        let w = 11 << 32;
        let hb_lost = |t: &mut IssuedLeases<_>, h, rel: &mut Vec<_>| lost_of(t.on_message(h, &hb(&[w]), Nanos(4 * SEC), true, rel));
        assert_eq!(hb_lost(&mut t, d1, &mut rel), Vec::<u64>::new(), "on its way: not lost");
        assert_eq!(hb_lost(&mut t, d2, &mut rel), vec![w], "another engine's renewal of it");
        // P's step came late: vLLM's deadline leaves the grant 1 ms.
        let a = t.grant(Nanos(5 * SEC), Duration::from_millis(1), 1, "a");
        assert!(t.name(a, w, Nanos(5 * SEC), &mut rel));
        let e = LeaseConfig::default().extension;
        assert!(t.table().deadline(a).is_some_and(|d| d.0 >= 5 * SEC + e.as_nanos() as u64), "renewed at the grant");
        assert_eq!(t.table().holder_of(a), Some(d1));
        assert!(rel.is_empty());
    }

    /// A held message is answered not live when its lease can no longer come (a later id was
    /// named first) or when it waited its maximum age.
    #[test]
    fn held_messages_are_answered_not_live_when_their_lease_cannot_come() {
        let (mut t, d1, _) = leases();
        let mut rel = Vec::new();
        let a = t.grant(Nanos(0), L, 1, "a");
        t.name(a, 100, Nanos(0), &mut rel);
        assert_eq!(t.on_message(d1, &read_done(101), Nanos(0), true, &mut rel).reply, None);
        assert_eq!(t.on_message(d1, &read_done(105), Nanos(0), true, &mut rel).reply, None);
        let b = t.grant(Nanos(0), L, 1, "b");
        t.name(b, 102, Nanos(0), &mut rel);
        let not_live = |w| vec![Due { holder: d1, tag: 0, reply: Some(Message::ReadDoneAck { lease_id: w, live: false }) }];
        assert_eq!(t.answer_due(Nanos(SEC), L, &mut rel), not_live(101));
        assert!(t.answer_due(Nanos(SEC), Duration::from_secs(5), &mut rel).is_empty());
        assert_eq!(t.answer_due(Nanos(6 * SEC), Duration::from_secs(5), &mut rel), not_live(105));
    }

    /// At most EARLY_MEMORY messages are held; the rest are answered at once.
    #[test]
    fn holding_is_bounded() {
        let (mut t, d1, _) = leases();
        let mut rel = Vec::new();
        for i in 0..EARLY_MEMORY as u64 {
            assert_eq!(t.on_message(d1, &read_done(i + 1), Nanos(0), true, &mut rel).reply, None);
        }
        let answer = t.on_message(d1, &read_done(EARLY_MEMORY as u64 + 1), Nanos(0), true, &mut rel);
        assert_eq!(answer.reply, Some(Message::ReadDoneAck { lease_id: EARLY_MEMORY as u64 + 1, live: false }));
    }

    /// SPEC P5: a `ReadDone` is a question here: confirmed while the lease is live, and after P
    /// saw the read complete itself (ended as transferred); not after an expiry or a release.
    #[test]
    fn p5_a_read_done_is_confirmed_for_a_live_lease_or_one_ended_by_its_read() {
        let (mut t, d1, _) = leases();
        let mut rel = Vec::new();
        let (a, b, c) = (t.grant(Nanos(0), L, 1, "a"), t.grant(Nanos(0), L, 1, "b"), t.grant(Nanos(0), L, 1, "c"));
        for (id, w) in [(a, 11), (b, 12), (c, 13)] {
            t.name(id, w, Nanos(0), &mut rel);
        }
        let ack = |t: &mut IssuedLeases<_>, w, now, rel: &mut Vec<_>| t.on_message(d1, &read_done(w), Nanos(now), true, rel).reply;
        assert_eq!(ack(&mut t, 11, SEC, &mut rel), Some(Message::ReadDoneAck { lease_id: 11, live: true }));
        assert_eq!(t.table().live(), 3, "a question ends nothing");
        assert!(t.end(a, ReleaseReason::Transferred, Nanos(SEC), &mut rel));
        assert_eq!(ack(&mut t, 11, SEC, &mut rel), Some(Message::ReadDoneAck { lease_id: 11, live: true }), "ended by its read");
        assert!(t.end(b, ReleaseReason::Released, Nanos(SEC), &mut rel));
        assert_eq!(ack(&mut t, 12, SEC, &mut rel), Some(Message::ReadDoneAck { lease_id: 12, live: false }), "released");
        assert_eq!(ack(&mut t, 13, 31 * SEC, &mut rel), Some(Message::ReadDoneAck { lease_id: 13, live: false }), "past its deadline");
        assert_eq!(t.table().live(), 0);
        assert!(t.lease_of(13).is_none(), "names of ended leases are dropped");
    }

    /// SPEC S5: a lease is the first engine's that names it; another engine's renewal,
    /// release or read confirmation is answered lost and changes nothing — also for a lease
    /// that ended by its read.
    #[test]
    fn s5_another_engines_messages_are_answered_lost() {
        let (mut t, d1, d2) = leases();
        let mut rel = Vec::new();
        let a = t.grant(Nanos(0), L, 1, "a");
        t.name(a, 21, Nanos(0), &mut rel);
        assert_eq!(lost_of(t.on_message(d1, &hb(&[21]), Nanos(SEC), true, &mut rel)), Vec::<u64>::new());
        assert_eq!(lost_of(t.on_message(d2, &hb(&[21]), Nanos(SEC), true, &mut rel)), vec![21]);
        assert_eq!(lost_of(t.on_message(d2, &Message::Release { lease_ids: vec![21] }, Nanos(SEC), true, &mut rel)), vec![21]);
        assert_eq!(
            t.on_message(d2, &read_done(21), Nanos(SEC), true, &mut rel).reply,
            Some(Message::ReadDoneAck { lease_id: 21, live: false })
        );
        assert_eq!(t.table().live(), 1);
        t.end(a, ReleaseReason::Transferred, Nanos(SEC), &mut rel);
        assert_eq!(
            t.on_message(d2, &read_done(21), Nanos(SEC), true, &mut rel).reply,
            Some(Message::ReadDoneAck { lease_id: 21, live: false })
        );
        assert_eq!(
            t.on_message(d1, &read_done(21), Nanos(SEC), true, &mut rel).reply,
            Some(Message::ReadDoneAck { lease_id: 21, live: true })
        );
    }

    /// SPEC D4, P6: a `Release` ends the sender's leases now; names not live are answered
    /// `LeaseLost` (and counted).
    #[test]
    fn d4_p6_a_release_ends_the_holders_leases_and_names_the_rest_lost() {
        let (mut t, d1, _) = leases();
        let mut rel = Vec::new();
        let a = t.grant(Nanos(0), L, 1, "a");
        t.name(a, 31, Nanos(0), &mut rel);
        let answer = t.on_message(d1, &Message::Release { lease_ids: vec![31, 30] }, Nanos(SEC), true, &mut rel);
        assert_eq!(lost_of(answer), vec![30]);
        assert_eq!(rel.len(), 1);
        assert_eq!(rel[0].reason, ReleaseReason::Released);
        assert_eq!(t.stats().unknown, 1);
        assert!(t.lease_of(31).is_none());
    }
}
