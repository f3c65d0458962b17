//! The lease table against a small reference model, under random operation sequences
//! (SPEC P2, P3, P4, P5, P6, P8): every lease is released exactly once, under the right reason,
//! its payload comes back exactly once, and no expired lease survives a tick.

use kvlease_core::config::LeaseConfig;
use kvlease_core::digest::PromptDigest;
use kvlease_core::lease_table::{Completion, Holder, LeaseTable, ReadTicket, ReleaseReason, Released};
use kvlease_core::Nanos;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// One decoder holds every lease here; holders are proven in tests/lease_table.rs (SPEC S5).
const D: Holder = Holder(std::num::NonZeroU32::MIN);
const DIGEST: PromptDigest = PromptDigest([0; 16]);

#[derive(Debug, Clone)]
enum Op {
    Advance(u64),
    Grant(u32),
    Renew(Vec<usize>),
    Complete { pick: usize, consumer: u32, n: u32 },
    Release(Vec<usize>),
    BeginRead(usize),
    EndRead(usize),
    Tick,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u64..300).prop_map(Op::Advance),
        3 => (1u32..5).prop_map(Op::Grant),
        3 => prop::collection::vec(0usize..64, 0..6).prop_map(Op::Renew),
        2 => (0usize..64, 0u32..3, 0u32..4).prop_map(|(pick, consumer, n)| Op::Complete { pick, consumer, n }),
        1 => prop::collection::vec(0usize..64, 0..3).prop_map(Op::Release),
        1 => (0usize..64).prop_map(Op::BeginRead),
        1 => (0usize..64).prop_map(Op::EndRead),
        2 => Just(Op::Tick),
    ]
}

#[derive(Debug)]
struct ModelLease {
    deadline: u64,
    expected: u32,
    done: BTreeSet<u32>,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn model_exactly_once_and_no_stranded_expiry(ops in prop::collection::vec(op(), 1..200)) {
        // L = 600 ms, E = 400 ms, granularity 10 ms; time advances in ms.
        let cfg = LeaseConfig::with_lease_secs(0.6).unwrap();
        let (l, e) = (600_000_000u64, 400_000_000u64);
        let mut t: LeaseTable<u64> = LeaseTable::new(&cfg);
        let mut model: BTreeMap<u64, ModelLease> = BTreeMap::new();
        let mut issued: Vec<u64> = Vec::new();
        let mut released_ids: BTreeSet<u64> = BTreeSet::new();
        let mut payloads_back: BTreeSet<u64> = BTreeSet::new();
        let mut tickets: Vec<ReadTicket> = Vec::new();
        let mut now = 0u64;
        let mut rel: Vec<Released<u64>> = Vec::new();

        // A few leases granted first, then enough short-lived ones after them that the dense
        // window compacts and moves the first ones to the side map: every path is exercised.
        for _ in 0..3 {
            let id = t.grant(Nanos(now), 1, DIGEST, 0);
            issued.push(id);
            model.insert(id, ModelLease { deadline: now + l, expected: 0, done: BTreeSet::new() });
        }
        for _ in 0..1500 {
            let id = t.grant(Nanos(now), 1, DIGEST, 0);
            prop_assert_eq!(t.complete(D, id, 0, 1, DIGEST, Nanos(now), &mut rel), Completion::Transferred);
            issued.push(id);
            released_ids.insert(id);
            payloads_back.insert(id);
        }
        rel.clear();

        let pick = |issued: &Vec<u64>, i: usize| -> u64 {
            // The three long-lived leases (in the side map), one long released, the ones granted
            // during the run; sometimes ids never issued (late or forged messages).
            let recent = &issued[..4].iter().chain(issued[1503.min(issued.len())..].iter()).copied().collect::<Vec<_>>();
            if i >= recent.len() * 2 { 10_000_000 + i as u64 } else { recent[i % recent.len()] }
        };

        for op in ops {
            rel.clear();
            match op {
                Op::Advance(ms) => now += ms * 1_000_000,
                Op::Grant(blocks) => {
                    let id = t.grant(Nanos(now), blocks, DIGEST, 0);
                    prop_assert!(!issued.contains(&id), "id reused");
                    issued.push(id);
                    model.insert(id, ModelLease { deadline: now + l, expected: 0, done: BTreeSet::new() });
                }
                Op::Renew(picks) => {
                    let ids: Vec<u64> = picks.iter().map(|&i| pick(&issued, i)).collect();
                    let mut lost = Vec::new();
                    let n = t.renew(D, &ids, Nanos(now), &mut lost, &mut rel);
                    let mut want_lost = Vec::new();
                    let mut want_n = 0;
                    for id in &ids {
                        match model.get_mut(id) {
                            Some(m) if m.deadline > now => { m.deadline = m.deadline.max(now + e); want_n += 1; }
                            Some(_) => { model.remove(id); want_lost.push(*id); }
                            None => want_lost.push(*id),
                        }
                    }
                    prop_assert_eq!(n, want_n);
                    prop_assert_eq!(lost, want_lost);
                }
                Op::Complete { pick: i, consumer, n } => {
                    let id = pick(&issued, i);
                    let got = t.complete(D, id, consumer, n, DIGEST, Nanos(now), &mut rel);
                    let want = match model.get_mut(&id) {
                        Some(m) if m.deadline > now => {
                            m.expected = m.expected.max(n.max(1));
                            m.done.insert(consumer);
                            if m.done.len() >= m.expected as usize { model.remove(&id); Completion::Transferred } else { Completion::Pending }
                        }
                        Some(_) => { model.remove(&id); Completion::Lost }
                        None => Completion::Lost,
                    };
                    prop_assert_eq!(got, want);
                }
                Op::Release(picks) => {
                    let ids: Vec<u64> = picks.iter().map(|&i| pick(&issued, i)).collect();
                    let mut lost = Vec::new();
                    t.release(D, &ids, Nanos(now), &mut lost, &mut rel);
                    for id in &ids {
                        if model.remove(id).is_none() { prop_assert!(lost.contains(id)); }
                    }
                }
                Op::BeginRead(i) => {
                    let id = pick(&issued, i);
                    let live = model.get(&id).is_some_and(|m| m.deadline > now);
                    let got = t.begin_read(D, id, None, Nanos(now), &mut rel);
                    prop_assert_eq!(got.is_some(), live);
                    if !live { model.remove(&id); }
                    tickets.extend(got);
                }
                Op::EndRead(i) => {
                    if !tickets.is_empty() {
                        let ticket = tickets.swap_remove(i % tickets.len());
                        let id = ticket.lease_id();
                        if t.end_read(ticket).is_some() {
                            prop_assert!(released_ids.contains(&id), "payload back before release");
                            prop_assert!(payloads_back.insert(id), "payload returned twice");
                        }
                    }
                }
                Op::Tick => {
                    t.tick(Nanos(now), &mut rel);
                    let expired: Vec<u64> = model.iter().filter(|(_, m)| m.deadline <= now).map(|(id, _)| *id).collect();
                    for id in expired { model.remove(&id); }
                    // SPEC P4: nothing with a deadline ≤ now survives a tick.
                    for id in &issued {
                        if let Some(d) = t.deadline(*id) { prop_assert!(d.0 > now, "stranded expired lease {}", id); }
                    }
                }
            }
            for r in rel.drain(..) {
                prop_assert!(released_ids.insert(r.lease_id), "lease {} released twice", r.lease_id);
                prop_assert!(!model.contains_key(&r.lease_id), "released lease {} is live in the model", r.lease_id);
                if r.payload.is_some() { prop_assert!(payloads_back.insert(r.lease_id)); }
            }
            // The table's live set is the model's.
            prop_assert_eq!(t.live(), model.len());
            for (id, m) in &model {
                prop_assert_eq!(t.deadline(*id), Some(Nanos(m.deadline)));
            }
        }
        // Drain: end every read, shut down; every issued lease is released once and every
        // payload is back exactly once.
        for ticket in tickets.drain(..) {
            let id = ticket.lease_id();
            if t.end_read(ticket).is_some() { prop_assert!(payloads_back.insert(id)); }
        }
        rel.clear();
        t.shutdown(Nanos(now), &mut rel);
        for r in rel.drain(..) {
            prop_assert_eq!(r.reason, ReleaseReason::Shutdown);
            prop_assert!(released_ids.insert(r.lease_id));
            prop_assert!(r.payload.is_some());
            payloads_back.insert(r.lease_id);
        }
        prop_assert_eq!(released_ids.len(), issued.len());
        prop_assert_eq!(payloads_back.len(), issued.len());
        prop_assert_eq!(t.parked(), 0);
        let s = t.stats();
        prop_assert_eq!(s.released.iter().sum::<u64>(), issued.len() as u64);
    }
}
