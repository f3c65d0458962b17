//! P's leases under ids another process issues (`IssuedLeases`, the vLLM connector's P side)
//! against a reference model, over random interleavings: P's scheduler issues ids, its worker
//! grants them a step later, D's renewals, reads' confirmations and releases arrive at any time
//! — before the grant too — and P ends leases by their read, by a drop, or by expiry.
//!
//! Checked after every step (SPEC P1, P2, P5, P6, S5):
//! * a `ReadDone` is confirmed only for a lease that was granted and, at the answer, is live
//!   (not past its deadline) and not another engine's, or that ended by its read while held by
//!   the asker or by nobody;
//! * a renewal never reports lost an id that is live for its sender, nor one the scheduler
//!   issued and the worker has not granted yet (within the window);
//! * every held message is answered once its lease is granted, and none is left after E.

use kvlease_core::config::LeaseConfig;
use kvlease_core::issued::{IssuedLeases, PENDING_WINDOW};
use kvlease_core::lease_table::{Holder, ReleaseReason};
use kvlease_core::wire::Message;
use kvlease_core::{digest::PromptDigest, Nanos};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

const SERIES: u64 = 7 << 32;
const MS: u64 = 1_000_000;

#[derive(Debug, Clone)]
enum Op {
    /// P's scheduler ends a prefill: issues the next id.
    Issue,
    /// P's worker steps: grants (and names) every id issued so far.
    Step,
    /// Time passes (ms).
    Advance(u64),
    /// D engine `d` renews the lease of the `i`-th issued id (or an id never issued).
    Renew { d: usize, i: usize },
    /// D engine `d` asks whether its read of the `i`-th issued id may be used.
    ReadDone { d: usize, i: usize },
    /// D engine `d` releases the `i`-th issued id.
    Release { d: usize, i: usize },
    /// P's worker sees the read of the `i`-th issued id complete (vLLM's notification).
    Transferred(usize),
    /// P drops the `i`-th issued id's request.
    Dropped(usize),
    /// P's reaper runs.
    Tick,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Issue),
        2 => Just(Op::Step),
        3 => (1u64..8_000).prop_map(Op::Advance),
        3 => (0usize..2, 0usize..12).prop_map(|(d, i)| Op::Renew { d, i }),
        3 => (0usize..2, 0usize..12).prop_map(|(d, i)| Op::ReadDone { d, i }),
        1 => (0usize..2, 0usize..12).prop_map(|(d, i)| Op::Release { d, i }),
        1 => (0usize..12).prop_map(Op::Transferred),
        1 => (0usize..12).prop_map(Op::Dropped),
        1 => Just(Op::Tick),
    ]
}

/// The reference: what P's leases are, by issued id.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Ref {
    /// Issued by the scheduler, not granted by the worker yet.
    Issued,
    /// Granted: live until `deadline` (ns), held by `holder` (None: nobody named it yet).
    Live { deadline: u64, holder: Option<usize> },
    /// Ended by its read while held by `holder`.
    Read { holder: Option<usize> },
    /// Ended otherwise (released, dropped, expired).
    Gone,
}

struct World {
    t: IssuedLeases<u64>,
    holders: [Holder; 2],
    refs: BTreeMap<u64, Ref>,
    lease_of: HashMap<u64, u64>,
    issued: Vec<u64>,
    granted_upto: usize,
    now: u64,
    /// ReadDones held, by (holder index, id): when they came.
    waiting: BTreeMap<(usize, u64), u64>,
    /// Releases held for their lease's grant: (holder index, id, when they came).
    held_releases: Vec<(usize, u64, u64)>,
    /// Renewals of ids on their way, by the first engine that renewed each.
    early_renewed: BTreeMap<u64, usize>,
    cfg: LeaseConfig,
}

impl World {
    fn new() -> Self {
        let cfg = LeaseConfig::with_lease_secs(12.0).unwrap(); // E = 8 s, I = 2 s
        let mut t = IssuedLeases::new(&cfg, 0);
        let holders = [t.holder("d0"), t.holder("d1")];
        World {
            t,
            holders,
            refs: BTreeMap::new(),
            lease_of: HashMap::new(),
            issued: Vec::new(),
            granted_upto: 0,
            now: 1_000 * MS,
            waiting: BTreeMap::new(),
            held_releases: Vec::new(),
            early_renewed: BTreeMap::new(),
            cfg,
        }
    }

    fn id(&self, i: usize) -> u64 {
        // An id never issued: far ahead (lost at once), or just ahead of the last (on its way).
        self.issued.get(i).copied().unwrap_or_else(|| match i % 2 {
            0 => SERIES + 10_000_000,
            _ => self.issued.last().map_or(SERIES, |w| w + 1),
        })
    }

    /// The reference's view of `w` now: a live lease past its deadline has expired.
    fn look(&mut self, w: u64) -> Option<Ref> {
        let r = self.refs.get(&w).copied()?;
        if let Ref::Live { deadline, .. } = r {
            if deadline <= self.now {
                self.refs.insert(w, Ref::Gone);
                return Some(Ref::Gone);
            }
        }
        Some(r)
    }

    /// The highest id the worker has granted (and named), 0 before the first.
    fn highest_granted(&self) -> u64 {
        self.granted_upto.checked_sub(1).map_or(0, |i| self.issued[i])
    }

    /// Whether `w` may be on its way to the worker (the rule the connector relies on).
    fn pending(&self, w: u64) -> bool {
        let hi = self.highest_granted();
        w > hi && (hi == 0 || w - hi <= PENDING_WINDOW)
    }

    fn held_by(&self, h: Holder) -> usize {
        self.holders.iter().position(|x| *x == h).unwrap_or(usize::MAX)
    }

    /// An answer to D engine `d`'s `ReadDone` of `w`: checked against the reference.
    fn check_read_answer(&mut self, d: usize, w: u64, live: bool) {
        let r = self.look(w);
        if live {
            match r {
                Some(Ref::Live { holder, .. }) | Some(Ref::Read { holder }) => {
                    assert!(holder.is_none_or(|h| h == d), "{w:#x} confirmed to d{d}, held by {holder:?}")
                }
                other => panic!("{w:#x} confirmed to d{d} but it is {other:?}"),
            }
        }
        self.waiting.remove(&(d, w));
    }

    fn apply(&mut self, op: &Op) {
        let now = Nanos(self.now);
        let mut rel = Vec::new();
        match *op {
            Op::Issue => {
                let w = SERIES + self.issued.len() as u64 + 1;
                self.issued.push(w);
                self.refs.insert(w, Ref::Issued);
            }
            Op::Step => {
                let lease = self.cfg.lease_duration;
                for &w in &self.issued[self.granted_upto..] {
                    let id = self.t.grant(now, lease, 1, w);
                    assert!(self.t.name(id, w, now, &mut rel));
                    self.lease_of.insert(w, id);
                    // A renewal that came before the grant is applied at it.
                    let (deadline, holder) = match self.early_renewed.remove(&w) {
                        Some(d) => (self.now + lease.max(self.cfg.extension).as_nanos() as u64, Some(d)),
                        None => (self.now + lease.as_nanos() as u64, None),
                    };
                    self.refs.insert(w, Ref::Live { deadline, holder });
                }
                self.granted_upto = self.issued.len();
            }
            Op::Advance(ms) => self.now += ms * MS,
            Op::Renew { d, i } => {
                let w = self.id(i);
                let before = self.look(w);
                let a = self.t.on_message(self.holders[d], &Message::Heartbeat { seq: 1, lease_ids: vec![w] }, now, true, &mut rel);
                let Some(Message::HeartbeatAck { lost_ids, .. }) = a.reply else { panic!("a renewal is always answered") };
                let lost = lost_ids.contains(&w);
                match before {
                    Some(Ref::Live { holder, .. }) if holder.is_none_or(|h| h == d) => {
                        assert!(!lost, "live {w:#x} reported lost to d{d}");
                        let e = self.cfg.extension.as_nanos() as u64;
                        if let Some(Ref::Live { deadline, .. }) = self.refs.get(&w).copied() {
                            self.refs.insert(w, Ref::Live { deadline: deadline.max(self.now + e), holder: Some(d) });
                        }
                    }
                    Some(Ref::Issued) | None if self.pending(w) => {
                        // Kept for the grant, the first engine's; another's is lost.
                        let first = *self.early_renewed.entry(w).or_insert(d);
                        assert_eq!(lost, first != d, "{w:#x}, on its way, renewed by d{d} (first d{first})");
                    }
                    _ => assert!(lost, "{w:#x} ({before:?}) renewed for d{d}"),
                }
            }
            Op::ReadDone { d, i } => {
                let w = self.id(i);
                let msg = Message::ReadDone { lease_id: w, consumer_rank: 0, n: 1, digest: PromptDigest([0; 16]) };
                match self.t.on_message(self.holders[d], &msg, now, true, &mut rel).reply {
                    Some(Message::ReadDoneAck { lease_id, live }) => self.check_read_answer(d, lease_id, live),
                    None => {
                        self.waiting.entry((d, w)).or_insert(self.now);
                    }
                    other => panic!("{other:?}"),
                }
            }
            Op::Release { d, i } => {
                let w = self.id(i);
                let before = self.look(w);
                if self.pending(w) {
                    self.held_releases.push((d, w, self.now));
                }
                let a = self.t.on_message(self.holders[d], &Message::Release { lease_ids: vec![w] }, now, true, &mut rel);
                let lost = matches!(&a.reply, Some(Message::LeaseLost { lease_ids }) if lease_ids.contains(&w));
                if let Some(Ref::Live { holder, .. }) = before {
                    if holder.is_none_or(|h| h == d) {
                        assert!(!lost, "the holder's release of {w:#x} refused");
                        self.refs.insert(w, Ref::Gone);
                    }
                }
            }
            Op::Transferred(i) | Op::Dropped(i) => {
                let w = self.id(i);
                let looked = self.look(w);
                if let (Some(&id), Some(Ref::Live { holder, .. })) = (self.lease_of.get(&w), looked) {
                    let read = matches!(op, Op::Transferred(_));
                    let reason = if read { ReleaseReason::Transferred } else { ReleaseReason::Released };
                    assert!(self.t.end(id, reason, now, &mut rel));
                    self.refs.insert(w, if read { Ref::Read { holder } } else { Ref::Gone });
                }
            }
            Op::Tick => self.t.tick(now, &mut rel),
        }
        // Held messages due now are answered; each answer is checked like any other.
        let max_age = self.cfg.ack_wait();
        for due in self.t.answer_due(Nanos(self.now), max_age, &mut rel) {
            let d = self.held_by(due.holder);
            if let Some(Message::ReadDoneAck { lease_id, live }) = due.reply {
                self.check_read_answer(d, lease_id, live);
            }
        }
        // Held releases the table answered just now (their lease granted, or no longer
        // possible, or E passed) took effect as a release by their sender would.
        let e = max_age.as_nanos() as u64;
        for (d, w, at) in std::mem::take(&mut self.held_releases) {
            if self.pending(w) && self.now < at + e {
                self.held_releases.push((d, w, at));
                continue;
            }
            if let Some(Ref::Live { holder, .. }) = self.look(w) {
                if holder.is_none_or(|h| h == d) {
                    self.refs.insert(w, Ref::Gone);
                }
            }
        }
        // Nothing held past E (once the table has been asked at a time past it).
        for (&(d, w), &at) in &self.waiting {
            assert!(self.now < at + e, "d{d}'s ReadDone of {w:#x}, held since {at}, unanswered past E");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// SPEC P1, P2, P5, P6, S5 for leases whose ids another process issues (vLLM's scheduler):
    /// see the module's documentation.
    #[test]
    fn p5_p6_s5_issued_leases_match_the_reference(ops in proptest::collection::vec(op(), 1..120)) {
        let mut w = World::new();
        for op in &ops {
            w.apply(op);
        }
    }
}
