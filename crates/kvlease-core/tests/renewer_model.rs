//! D's renewer against a small reference model, under random operation sequences (SPEC D1, D2,
//! D4, D6): the renewer keeps no acknowledgement per lease (issue #11: an ack marks the heartbeat,
//! and which leases a heartbeat named follows from their ids and when they were tracked), so
//! the model keeps one per tracked request, set from exactly the ids each acknowledged heartbeat
//! carried, and the two must agree on every read check. Every round names exactly the tracked
//! leases, sorted; a lease id tracked again (by another request, or after a loss) is never
//! vouched for by a heartbeat sent before it was tracked.

use kvlease_core::config::LeaseConfig;
use kvlease_core::renewer::{Action, Handshook, ReadCheck, Remote, Renewer, SendKind, Untrack};
use kvlease_core::wire::Message;
use kvlease_core::{LeaseId, Nanos};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const ENGINES: [&str; 3] = ["P0", "P1", "P2"];
const E_NS: u64 = 20_000_000_000; // E of the default 30 s lease
/// Each engine's lease that is never untracked nor lost.
const KEEP: LeaseId = 10_000;

#[derive(Debug, Clone)]
enum Op {
    Advance(u64),
    Track { req: u8, engine: usize, lease: LeaseId },
    Untrack { req: u8, abandoned: bool },
    Poll,
    Ack { pick: usize, lost: Vec<usize> },
    LeaseLost { engine: usize, lease: LeaseId },
    Read { req: u8, budget_ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u64..4000).prop_map(Op::Advance),
        5 => (0u8..24, 0usize..3, 0u64..48).prop_map(|(req, engine, lease)| Op::Track { req, engine, lease }),
        2 => (0u8..24, any::<bool>()).prop_map(|(req, abandoned)| Op::Untrack { req, abandoned }),
        3 => Just(Op::Poll),
        3 => (any::<usize>(), prop::collection::vec(0usize..8, 0..2)).prop_map(|(pick, lost)| Op::Ack { pick, lost }),
        1 => (0usize..3, 0u64..48).prop_map(|(engine, lease)| Op::LeaseLost { engine, lease }),
        3 => (0u8..24, 0u64..25_000).prop_map(|(req, budget_ms)| Op::Read { req, budget_ms }),
    ]
}

/// The model's tracked request: a serial per tracking, so a re-tracked id is a new lease.
#[derive(Debug, Clone)]
struct Tracked {
    engine: usize,
    lease: LeaseId,
    serial: u64,
    acked_until: u64,
}

/// A heartbeat sent: engine, seq, sent at, what it named (lease, the model's serial).
type SentBeat = (usize, u64, u64, Vec<(LeaseId, u64)>);

fn remote(engine: usize) -> Remote {
    Remote { engine_id: ENGINES[engine].into(), host: "127.0.0.1".into(), port: 7000, incarnation: 11 }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn model_renewer_acks_rounds_and_losses(ops in prop::collection::vec(op(), 1..160)) {
        let mut r = Renewer::new(&LeaseConfig::default());
        let mut now = 1_000_000u64;
        // Every engine Ready, with a lease that stays tracked (an idle engine would be forgotten).
        for i in 0..ENGINES.len() {
            r.track(&format!("keep{i}"), &remote(i), KEEP, Nanos(now));
        }
        let mut out = Vec::new();
        r.poll(Nanos(now), &mut out);
        for name in ENGINES {
            r.handshake_done(name, Ok(Handshook { incarnation: 11, agents: vec![format!("{name}/a")] }), Nanos(now));
        }
        let mut model: BTreeMap<String, Tracked> = BTreeMap::new();
        let mut serial = 0u64;
        for i in 0..ENGINES.len() {
            serial += 1;
            model.insert(format!("keep{i}"), Tracked { engine: i, lease: KEEP, serial, acked_until: 0 });
        }
        let mut sent: Vec<SentBeat> = Vec::new();
        let mut lost_expected: BTreeSet<(String, LeaseId)> = BTreeSet::new();
        let mut releases: BTreeSet<(usize, LeaseId)> = BTreeSet::new();

        let holder = |model: &BTreeMap<String, Tracked>, engine: usize, lease: LeaseId| -> Option<String> {
            model.iter().find(|(_, t)| t.engine == engine && t.lease == lease).map(|(k, _)| k.clone())
        };

        for op in ops {
            match op {
                Op::Advance(ms) => now += ms * 1_000_000,
                Op::Track { req, engine, lease } => {
                    let req = format!("r{req}");
                    r.track(&req, &remote(engine), lease, Nanos(now));
                    if !model.contains_key(&req) {
                        // The same id from the same incarnation: the new request takes it over.
                        if let Some(old) = holder(&model, engine, lease) {
                            model.remove(&old);
                        }
                        serial += 1;
                        model.insert(req, Tracked { engine, lease, serial, acked_until: 0 });
                    }
                }
                Op::Untrack { req, abandoned } => {
                    let req = format!("r{req}");
                    r.untrack(&req, if abandoned { Untrack::Abandoned } else { Untrack::Transferred });
                    if let Some(t) = model.remove(&req) {
                        if abandoned {
                            releases.insert((t.engine, t.lease));
                        }
                    }
                }
                Op::Poll => {
                    out.clear();
                    r.poll(Nanos(now), &mut out);
                    for a in &out {
                        match a {
                            Action::Send { engine_id, bytes, kind } => {
                                let engine = ENGINES.iter().position(|e| e == engine_id).unwrap();
                                match Message::decode(bytes).unwrap() {
                                    Message::Heartbeat { seq, lease_ids } => {
                                        prop_assert!(lease_ids.windows(2).all(|w| w[0] < w[1]), "sorted, distinct");
                                        let mut named = Vec::new();
                                        for id in &lease_ids {
                                            let t = model.values().find(|t| t.engine == engine && t.lease == *id);
                                            prop_assert!(t.is_some(), "heartbeat to {engine_id} names untracked lease {id}");
                                            named.push((*id, t.unwrap().serial));
                                        }
                                        sent.push((engine, seq, now, named));
                                        let _ = kind;
                                    }
                                    Message::Release { lease_ids } => {
                                        for id in lease_ids {
                                            prop_assert!(releases.remove(&(engine, id)), "release of {id} to {engine_id} never queued");
                                        }
                                    }
                                    _ => {}
                                }
                            }
                            Action::Lost { request_id, lease_id } => {
                                prop_assert!(lost_expected.remove(&(request_id.clone(), *lease_id)), "unexpected loss {request_id}");
                            }
                            _ => {}
                        }
                    }
                    prop_assert!(lost_expected.is_empty(), "losses not reported: {lost_expected:?}");
                    // SPEC D2: a round names every tracked lease of its engine.
                    for (engine, name) in ENGINES.iter().enumerate() {
                        let round: BTreeSet<LeaseId> = out
                            .iter()
                            .filter_map(|a| match a {
                                Action::Send { engine_id, bytes, kind: SendKind::Heartbeat { .. } } if engine_id == name => match Message::decode(bytes).unwrap() {
                                    Message::Heartbeat { lease_ids, .. } => Some(lease_ids),
                                    _ => None,
                                },
                                _ => None,
                            })
                            .flatten()
                            .collect();
                        let is_round = out.iter().any(|a| matches!(a, Action::Send { engine_id, kind: SendKind::Heartbeat { .. }, .. } if engine_id == name));
                        if is_round {
                            let want: BTreeSet<LeaseId> = model.values().filter(|t| t.engine == engine).map(|t| t.lease).collect();
                            prop_assert_eq!(round, want);
                        }
                    }
                }
                Op::Ack { pick, lost } => {
                    if sent.is_empty() {
                        continue;
                    }
                    let (engine, seq, at, named) = sent[pick % sent.len()].clone();
                    let lost_ids: Vec<LeaseId> = {
                        let mut v: Vec<LeaseId> = lost.iter().filter_map(|i| named.get(*i).map(|n| n.0)).filter(|id| *id != KEEP).collect();
                        v.sort_unstable();
                        v.dedup();
                        v
                    };
                    r.on_message(ENGINES[engine], &Message::HeartbeatAck { seq, lost_ids: lost_ids.clone() }, Nanos(now));
                    for (id, s) in &named {
                        if lost_ids.contains(id) {
                            continue;
                        }
                        if let Some(t) = model.values_mut().find(|t| t.serial == *s) {
                            t.acked_until = t.acked_until.max(at + E_NS);
                        }
                    }
                    for id in lost_ids {
                        if let Some(req) = holder(&model, engine, id) {
                            model.remove(&req);
                            lost_expected.insert((req, id));
                            releases.insert((engine, id));
                        }
                    }
                }
                Op::LeaseLost { engine, lease } => {
                    r.on_message(ENGINES[engine], &Message::LeaseLost { lease_ids: vec![lease] }, Nanos(now));
                    if let Some(req) = holder(&model, engine, lease) {
                        model.remove(&req);
                        lost_expected.insert((req, lease));
                    }
                }
                Op::Read { req, budget_ms } => {
                    let req = format!("r{req}");
                    let budget = Duration::from_millis(budget_ms);
                    let got = r.read_check(&req, budget, false, Nanos(now));
                    let want = match model.get(&req) {
                        None => ReadCheck::Untracked,
                        Some(t) if t.acked_until > now + budget_ms * 1_000_000 => ReadCheck::Safe,
                        Some(_) => ReadCheck::RenewFirst,
                    };
                    prop_assert_eq!(got, want, "read check of {}", req);
                }
            }
            prop_assert_eq!(r.tracked(), model.len());
            for req in model.keys() {
                prop_assert!(r.is_tracked(req));
            }
        }
    }
}

/// Issue #11: a heartbeat round of 10^5 leases granted in a row, out of order, and half of them
/// untracked again names exactly the tracked ones, sorted, and one acknowledgement per message
/// makes every one of them safe to read.
#[test]
fn d2_d6_large_round_out_of_order_then_acked() {
    let mut r = Renewer::new(&LeaseConfig::default());
    let n = 100_000u64;
    // Granted in a row, tracked mostly in order with every 7th arriving late.
    for i in 0..n {
        let id = if i % 7 == 0 { n - i } else { 2 * n + i };
        r.track(&format!("q{i}"), &remote(0), id, Nanos(0));
    }
    for i in (0..n).step_by(2) {
        r.untrack(&format!("q{i}"), Untrack::Transferred);
    }
    let mut out = Vec::new();
    r.poll(Nanos(0), &mut out);
    r.handshake_done("P0", Ok(Handshook { incarnation: 11, agents: vec!["P0/a".into()] }), Nanos(0));
    out.clear();
    r.poll(Nanos(1), &mut out);
    let mut ids = Vec::new();
    for a in &out {
        if let Action::Send { bytes, kind: SendKind::Heartbeat { .. }, .. } = a {
            let Message::Heartbeat { seq, lease_ids } = Message::decode(bytes).unwrap() else { panic!() };
            ids.extend_from_slice(&lease_ids);
            r.on_message("P0", &Message::HeartbeatAck { seq, lost_ids: vec![] }, Nanos(2));
        }
    }
    let mut want: Vec<u64> = (1..n).step_by(2).map(|i| if i % 7 == 0 { n - i } else { 2 * n + i }).collect();
    want.sort_unstable();
    assert_eq!(ids, want);
    for i in (1..n).step_by(2) {
        assert_eq!(r.read_check(&format!("q{i}"), Duration::from_secs(5), false, Nanos(3)), ReadCheck::Safe, "q{i}");
    }
    assert_eq!(r.read_check("q0", Duration::from_secs(5), false, Nanos(3)), ReadCheck::Untracked);
    // A lease tracked after the round is not vouched for by its acknowledgement.
    r.track("new", &remote(0), 2 * n + 1, Nanos(4));
    assert_eq!(r.read_check("new", Duration::from_secs(5), false, Nanos(5)), ReadCheck::RenewFirst);
}
