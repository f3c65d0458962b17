//! D's renewer against SPEC §5, one test per invariant.

use kvlease_core::config::LeaseConfig;
use kvlease_core::renewer::{Action, Endpoint, Handshook, NotRead, ReadCheck, Remote, Renewer, SendKind, SideChannelRelease, Untrack};
use kvlease_core::wire::Message;
use kvlease_core::Nanos;
use std::time::Duration;

fn p(engine: &str) -> Remote {
    Remote { engine_id: engine.into(), host: "127.0.0.1".into(), port: 7000, incarnation: 11 }
}

/// What a handshake with incarnation `n` finds: one agent, named as P's.
fn found(n: u64) -> Handshook {
    Handshook { incarnation: n, agents: vec![format!("P/{n:x}/0")] }
}

fn at(ms: u64) -> Nanos {
    Nanos(ms * 1_000_000)
}

fn poll(r: &mut Renewer, now: Nanos) -> Vec<Action> {
    let mut out = Vec::new();
    r.poll(now, &mut out);
    out
}

/// Decoded messages sent to `engine` among `actions`.
fn sent(actions: &[Action], engine: &str) -> Vec<Message> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { engine_id, bytes, .. } if engine_id == engine => Some(Message::decode(bytes).unwrap()),
            _ => None,
        })
        .collect()
}

fn heartbeat_ids(actions: &[Action], engine: &str) -> Vec<u64> {
    sent(actions, engine)
        .into_iter()
        .flat_map(|m| match m {
            Message::Heartbeat { lease_ids, .. } => lease_ids,
            _ => vec![],
        })
        .collect()
}

fn ready(r: &mut Renewer, engine: &str, now: Nanos) {
    let acts = poll(r, now);
    assert!(acts.iter().any(|a| matches!(a, Action::Handshake { engine_id, .. } if engine_id == engine)), "{acts:?}");
    r.handshake_done(engine, Ok(found(11)), now);
}

/// SPEC D1: tracking starts on arrival, grouped by remote engine: the first poll asks for a
/// handshake per engine, and once ready each engine gets one heartbeat naming only its leases.
#[test]
fn d1_tracks_from_arrival_grouped_by_engine() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("req-a", &p("P1"), 5, at(0));
    r.track("req-b", &p("P1"), 3, at(0));
    r.track("req-c", &p("P2"), 5, at(0));
    assert_eq!(r.tracked(), 3);
    let acts = poll(&mut r, at(0));
    let mut hs: Vec<&str> =
        acts.iter().filter_map(|a| if let Action::Handshake { engine_id, .. } = a { Some(engine_id.as_str()) } else { None }).collect();
    hs.sort();
    assert_eq!(hs, ["P1", "P2"]);
    r.handshake_done("P1", Ok(found(11)), at(1));
    r.handshake_done("P2", Ok(found(11)), at(1));
    let acts = poll(&mut r, at(1));
    assert_eq!(heartbeat_ids(&acts, "P1"), vec![3, 5]);
    assert_eq!(heartbeat_ids(&acts, "P2"), vec![5]);
    assert_eq!(sent(&acts, "P1").len(), 1, "one batched message per engine");
}

/// SPEC D2, D6: the first lease toward an idle engine is renewed at once when reads are not
/// fenced (D must know it is live before reading); over a fenced transport it joins the engine's
/// next round, an interval later (P's gate checks it at the read), one message per interval.
#[test]
fn d2_d6_a_fenced_reader_does_not_renew_the_first_lease_at_once() {
    let i = LeaseConfig::default().heartbeat_interval;
    for fenced in [false, true] {
        let mut r = Renewer::new(&LeaseConfig::default());
        r.set_fenced_reads(fenced);
        r.track("req-0", &p("P1"), 1, at(0));
        ready(&mut r, "P1", at(0));
        assert_eq!(heartbeat_ids(&poll(&mut r, at(0)), "P1"), vec![1], "a new engine's first heartbeat follows its handshake (D5)");
        r.untrack("req-0", Untrack::Transferred);
        // Idle for longer than an interval, then a lease arrives.
        let t = at(0) + i * 3;
        r.track("req-1", &p("P1"), 2, t);
        let first = heartbeat_ids(&poll(&mut r, t), "P1");
        if fenced {
            assert!(first.is_empty(), "fenced: no renewal at once ({first:?})");
            assert!(heartbeat_ids(&poll(&mut r, t + i - Duration::from_millis(1)), "P1").is_empty());
            assert_eq!(heartbeat_ids(&poll(&mut r, t + i), "P1"), vec![2], "renewed in the next round");
            assert_eq!(r.read_check("req-1", Duration::from_secs(5), true, t), ReadCheck::Safe, "read at once");
        } else {
            assert_eq!(first, vec![2], "not fenced: renewed at once");
        }
    }
}

/// SPEC D2: one heartbeat per engine per interval I, covering every tracked lease, and chunked
/// to max_notif_bytes (down to 256 B) when large.
#[test]
fn d2_one_batched_heartbeat_per_interval_chunked() {
    let cfg = LeaseConfig { max_notif_bytes: 256, ..LeaseConfig::default() };
    let mut r = Renewer::new(&cfg);
    for i in 0..2000u64 {
        r.track(&format!("r{i}"), &p("P"), 1000 + i * 7, at(0));
    }
    ready(&mut r, "P", at(0));
    let first = poll(&mut r, at(0));
    let msgs = sent(&first, "P");
    assert!(msgs.len() > 1, "2000 ids do not fit in 256 B");
    assert!(first.iter().all(|a| !matches!(a, Action::Send { bytes, .. } if bytes.len() > 256)));
    assert_eq!(heartbeat_ids(&first, "P"), (0..2000u64).map(|i| 1000 + i * 7).collect::<Vec<_>>());
    // Nothing more until I = 5 s has passed.
    assert!(poll(&mut r, at(4999)).is_empty());
    assert_eq!(r.poll_timeout(), Some(at(5000)));
    let second = poll(&mut r, at(5003));
    assert_eq!(heartbeat_ids(&second, "P").len(), 2000);
    let Some(Action::Send { kind: SendKind::Heartbeat { lateness }, .. }) = second.first() else { panic!("{second:?}") };
    assert_eq!(*lateness, Duration::from_millis(3));
}

/// SPEC D4: a transfer done stops tracking silently; an abort before the transfer sends an
/// explicit Release at once.
#[test]
fn d4_abort_releases_at_once_transfer_stops_silently() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("done", &p("P"), 1, at(0));
    r.track("gone", &p("P"), 2, at(0));
    r.track("stay", &p("P"), 3, at(0));
    ready(&mut r, "P", at(0));
    poll(&mut r, at(0));
    r.untrack("done", Untrack::Transferred);
    r.untrack("gone", Untrack::Abandoned);
    assert!(!r.is_tracked("done") && !r.is_tracked("gone"));
    assert_eq!(r.poll_timeout(), Some(Nanos::ZERO), "the release is due now");
    let acts = poll(&mut r, at(10));
    assert_eq!(sent(&acts, "P"), vec![Message::Release { lease_ids: vec![2] }]);
    let later = poll(&mut r, at(5000));
    assert_eq!(heartbeat_ids(&later, "P"), vec![3]);
    r.untrack("stay", Untrack::Transferred);
    assert!(poll(&mut r, at(10_000)).is_empty(), "no heartbeats for an engine with nothing tracked");
    assert_eq!(r.poll_timeout(), Some(at(70_000)), "only forgetting the idle engine, a minute later");
}

/// SPEC D5: the handshake runs in the background (poll never waits); failures back off; one
/// dead P delays nothing toward another; new coordinates or a new incarnation reconnect.
#[test]
fn d5_background_handshake_backoff_and_reconnect() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("dead"), 1, at(0));
    r.track("b", &p("live"), 1, at(0));
    assert_eq!(poll(&mut r, at(0)).len(), 2);
    assert!(poll(&mut r, at(1)).is_empty(), "pending handshakes are not restarted");
    r.handshake_done("live", Ok(found(11)), at(2));
    r.handshake_done("dead", Err(()), at(2));
    let acts = poll(&mut r, at(2));
    assert_eq!(heartbeat_ids(&acts, "live"), vec![1], "first heartbeat right after the handshake");
    assert!(sent(&acts, "dead").is_empty());
    // Back-off: 100 ms, then 200 ms, 400 ms ...
    assert!(poll(&mut r, at(101)).is_empty());
    assert!(matches!(&poll(&mut r, at(102))[..], [Action::Handshake { engine_id, .. }] if engine_id == "dead"));
    r.handshake_done("dead", Err(()), at(102));
    assert!(poll(&mut r, at(301)).is_empty());
    assert_eq!(poll(&mut r, at(302)).len(), 1);
    // The live engine's schedule is unaffected by the dead one.
    assert_eq!(heartbeat_ids(&poll(&mut r, at(5002)), "live"), vec![1]);
    // New coordinates for "live": reconnect.
    let moved = Remote { port: 7001, ..p("live") };
    r.track("c", &moved, 2, at(5003));
    assert!(matches!(&poll(&mut r, at(5003))[..], [Action::Handshake { port: 7001, .. }]));
    r.handshake_done("live", Ok(found(11)), at(5004));
    assert_eq!(heartbeat_ids(&poll(&mut r, at(5004)), "live"), vec![1, 2]);
    // A new incarnation: reconnect, and leases of the old one are lost.
    let reborn = Remote { incarnation: 12, ..moved };
    r.track("d", &reborn, 1, at(6000));
    // Lease 1 of the old incarnation ("b") is dead at once: the new one reuses its id.
    let acts = poll(&mut r, at(6000));
    assert!(matches!(&acts[..], [Action::Lost { request_id, lease_id: 1 }, Action::Handshake { .. }] if request_id == "b"), "{acts:?}");
    r.handshake_done("live", Ok(found(12)), at(6001));
    let acts = poll(&mut r, at(6001));
    assert!(matches!(&acts[0], Action::Lost { request_id, lease_id: 2 } if request_id == "c"), "{acts:?}");
    assert_eq!(heartbeat_ids(&acts, "live"), vec![1]);
    assert!(r.is_tracked("d"));
}

/// SPEC D6: D reads only while an acknowledged heartbeat covers the read budget; otherwise it
/// renews first; a lost id in an ack (or a LeaseLost) stops tracking and is reported.
#[test]
fn d6_read_only_under_an_acknowledged_lease() {
    let mut r = Renewer::new(&LeaseConfig::default()); // E = 20 s
    r.track("a", &p("P"), 7, at(0));
    r.track("b", &p("P"), 8, at(0));
    ready(&mut r, "P", at(0));
    let budget = Duration::from_secs(1);
    assert_eq!(r.read_check("a", budget, false, at(0)), ReadCheck::RenewFirst, "no ack yet");
    let acts = poll(&mut r, at(0));
    let Message::Heartbeat { seq, .. } = sent(&acts, "P")[0] else { panic!() };
    r.on_message("P", &Message::HeartbeatAck { seq, lost_ids: vec![8] }, Nanos::ZERO);
    // Acked at send time 0 + E: safe while now + budget < 20 s. Later heartbeats go unacked.
    let acts = poll(&mut r, at(5_000));
    assert!(acts.iter().any(|a| matches!(a, Action::Lost { request_id, lease_id: 8 } if request_id == "b")), "{acts:?}");
    assert_eq!(heartbeat_ids(&acts, "P"), vec![7], "a lost lease is renewed no more");
    poll(&mut r, at(10_000));
    poll(&mut r, at(15_000));
    assert_eq!(r.read_check("a", budget, false, at(18_999)), ReadCheck::Safe);
    assert_eq!(r.read_check("a", budget, false, at(19_000)), ReadCheck::RenewFirst);
    // The renewal for the read goes out now, not at the next interval.
    let acts = poll(&mut r, at(19_000));
    assert!(matches!(&acts[..], [Action::Send { kind: SendKind::ReadRenewal, .. }]), "{acts:?}");
    assert_eq!(heartbeat_ids(&acts, "P"), vec![7]);
    assert_eq!(r.read_check("b", budget, false, at(19_000)), ReadCheck::Untracked);
    // An unsolicited LeaseLost.
    r.on_message("P", &Message::LeaseLost { lease_ids: vec![7, 99] }, Nanos::ZERO);
    assert!(matches!(&poll(&mut r, at(19_001))[..], [Action::Lost { lease_id: 7, .. }]));
    assert_eq!(r.tracked(), 0);
}

/// A heartbeat's acknowledgement measures the round trip to P (smoothed, TCP's SRTT), for the
/// resend of a renewal for a read; a second rank's acknowledgement of the same heartbeat does
/// not count again.
#[test]
fn d6_acknowledgements_measure_the_round_trip() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("P"), 7, at(0));
    ready(&mut r, "P", at(0));
    assert_eq!(r.round_trip("P"), None, "nothing measured yet");
    let acts = poll(&mut r, at(0));
    let Message::Heartbeat { seq, .. } = sent(&acts, "P")[0] else { panic!() };
    r.on_message("P", &Message::HeartbeatAck { seq, lost_ids: vec![] }, at(8));
    assert_eq!(r.round_trip("P"), Some(Duration::from_millis(8)));
    r.on_message("P", &Message::HeartbeatAck { seq, lost_ids: vec![] }, at(100));
    assert_eq!(r.round_trip("P"), Some(Duration::from_millis(8)), "one acknowledgement per heartbeat");
    let acts = poll(&mut r, at(5_000));
    let Message::Heartbeat { seq, .. } = sent(&acts, "P")[0] else { panic!() };
    r.on_message("P", &Message::HeartbeatAck { seq, lost_ids: vec![] }, at(5_016));
    assert_eq!(r.round_trip("P"), Some(Duration::from_millis(9)), "7/8 of 8 ms and 1/8 of 16 ms");
}

/// SPEC D6: an acknowledgement that arrives after E no longer proves anything.
#[test]
fn d6_stale_acknowledgements_are_ignored() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("P"), 7, at(0));
    ready(&mut r, "P", at(0));
    let acts = poll(&mut r, at(0));
    let Message::Heartbeat { seq, .. } = sent(&acts, "P")[0] else { panic!() };
    poll(&mut r, at(20_000)); // the heartbeat of t=0 ages out
    r.on_message("P", &Message::HeartbeatAck { seq, lost_ids: vec![] }, Nanos::ZERO);
    assert_eq!(r.read_check("a", Duration::ZERO, false, at(20_001)), ReadCheck::RenewFirst);
}

/// SPEC D4 × §3: a release queued for one incarnation of P is never sent to the next one, where
/// the same lease id names another request's blocks.
#[test]
fn d4_release_never_reaches_another_incarnation() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("old", &p("P"), 1, at(0));
    ready(&mut r, "P", at(0));
    poll(&mut r, at(0));
    r.disconnected("P"); // P restarts
    r.untrack("old", Untrack::Abandoned);
    r.track("new", &Remote { incarnation: 12, ..p("P") }, 5, at(10));
    assert!(matches!(&poll(&mut r, at(10))[..], [Action::Handshake { .. }]));
    r.handshake_done("P", Ok(found(12)), at(11));
    let acts = poll(&mut r, at(11));
    assert!(sent(&acts, "P").iter().all(|m| !matches!(m, Message::Release { .. })), "{acts:?}");
    assert_eq!(heartbeat_ids(&acts, "P"), vec![5]);
}

/// An engine nothing is tracked toward is forgotten after a while (no map grows forever).
#[test]
fn idle_engines_are_forgotten() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("P"), 1, at(0));
    ready(&mut r, "P", at(0));
    poll(&mut r, at(0));
    r.untrack("a", Untrack::Transferred);
    assert!(poll(&mut r, at(1_000)).is_empty());
    assert!(poll(&mut r, at(60_999)).is_empty());
    assert_eq!(poll(&mut r, at(61_000)), vec![Action::Forget { engine_id: "P".into(), agents: vec!["P/b/0".into()] }]);
    assert!(!r.is_ready("P"));
}

/// SPEC D4: an abort toward a P engine whose connection is down still gets its Release
/// delivered (a handshake is started for it), and a release older than E is dropped: P has
/// expired the lease by then anyway.
#[test]
fn d4_pending_releases_reconnect_then_age_out() {
    let mut r = Renewer::new(&LeaseConfig::default()); // E = 20 s
    r.track("a", &p("P"), 1, at(0));
    ready(&mut r, "P", at(0));
    poll(&mut r, at(0));
    r.disconnected("P");
    r.untrack("a", Untrack::Abandoned);
    assert!(matches!(&poll(&mut r, at(10))[..], [Action::Handshake { .. }]), "a release alone is reason to reconnect");
    r.handshake_done("P", Ok(found(11)), at(20));
    assert_eq!(sent(&poll(&mut r, at(20)), "P"), vec![Message::Release { lease_ids: vec![1] }]);
    // Another abort while P is unreachable for longer than E: dropped, not sent forever.
    r.track("b", &p("P"), 2, at(30));
    poll(&mut r, at(30));
    r.disconnected("P");
    r.untrack("b", Untrack::Abandoned);
    assert!(matches!(&poll(&mut r, at(40))[..], [Action::Handshake { .. }]));
    r.handshake_done("P", Err(()), at(50));
    assert!(poll(&mut r, at(20_041)).is_empty(), "aged out after E");
}

/// SPEC P9 × D6: a lease P acknowledges as lost (e.g. capped by its lifetime) stops being
/// tracked and is released, so P frees it now instead of at its cap.
#[test]
fn d6_acknowledged_lost_leases_are_released() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("P"), 4, at(0));
    ready(&mut r, "P", at(0));
    let acts = poll(&mut r, at(0));
    let Message::Heartbeat { seq, .. } = sent(&acts, "P")[0] else { panic!() };
    r.on_message("P", &Message::HeartbeatAck { seq, lost_ids: vec![4] }, Nanos::ZERO);
    let acts = poll(&mut r, at(1));
    assert!(acts.iter().any(|a| matches!(a, Action::Lost { lease_id: 4, .. })));
    assert_eq!(sent(&acts, "P"), vec![Message::Release { lease_ids: vec![4] }]);
}

/// SPEC D5, D6: a read of a lease whose P engine cannot be reached (its last handshake failed)
/// is not waited for: D recomputes at once instead of waiting out the lease.
#[test]
fn d6_unreachable_engine_is_not_waited_for() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("P"), 1, at(0));
    assert!(matches!(&poll(&mut r, at(0))[..], [Action::Handshake { .. }]));
    assert_eq!(r.read_check("a", Duration::from_secs(1), false, at(1)), ReadCheck::NoLink, "handshake still pending");
    r.handshake_done("P", Err(()), at(2));
    assert_eq!(r.read_check("a", Duration::from_secs(1), false, at(3)), ReadCheck::Unreachable);
}

/// SPEC D6 over a fenced transport (issue 15): the read waits for the handshake with P, not for
/// an acknowledged heartbeat, and queues no renewal; a failed handshake is still unreachable.
#[test]
fn d6_a_fenced_read_waits_for_the_handshake_only() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("P"), 1, at(0));
    let budget = Duration::from_secs(1);
    assert!(matches!(&poll(&mut r, at(0))[..], [Action::Handshake { .. }]));
    assert_eq!(r.read_check("a", budget, true, at(1)), ReadCheck::NoLink, "handshake still pending");
    r.handshake_done("P", Ok(found(11)), at(2));
    assert_eq!(r.read_check("a", budget, true, at(2)), ReadCheck::Safe, "no ack needed");
    let acts = poll(&mut r, at(3));
    assert!(!acts.iter().any(|a| matches!(a, Action::Send { kind: SendKind::ReadRenewal, .. })), "no renewal queued: {acts:?}");
    assert_eq!(r.read_check("a", budget, false, at(3)), ReadCheck::RenewFirst, "unfenced: an acknowledgement is needed");
    let mut down = Renewer::new(&LeaseConfig::default());
    down.track("a", &p("P"), 1, at(0));
    poll(&mut down, at(0));
    down.handshake_done("P", Err(()), at(1));
    assert_eq!(down.read_check("a", budget, true, at(2)), ReadCheck::Unreachable);
}

/// SPEC B2: while leases toward an engine are tracked, its clock offset is measured again every
/// 30 s (a `ClockPing` it answers with its own stamps), so a cached turn's expiry on its clock
/// can be judged on ours.
#[test]
fn b2_the_clock_offset_is_refreshed_while_the_link_lives() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("turn", &p("P"), 1, at(0));
    ready(&mut r, "P", at(0));
    assert!(r.peer("P").is_some_and(|p| p.clock.estimate(at(0)).is_none()), "no sample yet");
    let pings = |acts: &[Action]| sent(acts, "P").into_iter().filter(|m| matches!(m, Message::ClockPing { .. })).count();
    assert_eq!(pings(&poll(&mut r, at(1))), 0);
    let acts = poll(&mut r, at(30_000));
    assert_eq!(pings(&acts), 1, "{acts:?}");
    let Some(Message::ClockPing { seq, t0 }) = sent(&acts, "P").into_iter().find(|m| matches!(m, Message::ClockPing { .. })) else {
        panic!("{acts:?}")
    };
    // P's clock is 7 s ahead; 2 ms each way.
    let (t1, t2) = (t0 + 7_000_000_000 + 2_000_000, t0 + 7_000_000_000 + 2_000_000);
    r.on_message("P", &Message::ClockPong { seq, t0, t1, t2 }, Nanos(t0 + 4_000_000));
    let est = r.peer("P").and_then(|p| p.clock.estimate(Nanos(t0 + 4_000_000))).expect("an estimate");
    assert_eq!(est.offset_ns, 7_000_000_000);
    assert_eq!(pings(&poll(&mut r, at(31_000))), 0, "the next probe is 30 s away");
}

/// SPEC D1, S5 (issue 23: racing replays): `track_first` checks and tracks in one step: a second
/// request naming a lease another request here renews is refused (it computes its prompt
/// itself) and the first keeps the lease; once the first stops, the lease can be tracked again.
#[test]
fn d1_a_second_request_with_the_same_params_cannot_take_the_lease_over() {
    let mut r = Renewer::new(&LeaseConfig::default());
    assert!(r.track_first("a", &p("P"), 7, at(0)));
    assert!(!r.track_first("b", &p("P"), 7, at(1)), "the replay is refused");
    assert!(r.is_tracked("a") && !r.is_tracked("b"));
    assert!(r.track_first("c", &p("P"), 8, at(1)), "another lease of the same engine");
    let other_life = Remote { incarnation: 12, ..p("P") };
    assert!(r.track_first("d", &other_life, 9, at(1)), "another incarnation's lease 9 is another lease");
    r.untrack("a", Untrack::Transferred);
    assert!(r.track_first("e", &p("P"), 7, at(2)));
}

/// SPEC O3, O4: `release` queues a `Release` for a lease nobody here tracks, delivered once the
/// engine is ready; it leaves a lease another request renews alone.
#[test]
fn o4_release_queues_a_release_without_tracking() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("P"), 7, at(0));
    r.release(&p("P"), 7, at(0));
    r.release(&p("P"), 8, at(0));
    assert_eq!(r.tracked(), 1);
    ready(&mut r, "P", at(1));
    let releases: Vec<Message> = sent(&poll(&mut r, at(2)), "P").into_iter().filter(|m| matches!(m, Message::Release { .. })).collect();
    assert_eq!(releases, vec![Message::Release { lease_ids: vec![8] }], "7 is renewed by a request here");
}

/// The releases over a side channel among `actions`.
fn side_releases(actions: &[Action]) -> Vec<SideChannelRelease> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::ReleaseOverSideChannel(r) => Some(r.clone()),
            _ => None,
        })
        .collect()
}

/// SPEC O4: when the handshake with P fails (timed out, refused: a geometry mismatch), what D
/// will not read is released at once over P's side channel, without a transfer link: retried
/// with back-off while it fails, never sent twice at once, forgotten once P answered or after E.
#[test]
fn o4_releases_without_a_link_go_over_the_side_channel() {
    let mut r = Renewer::new(&LeaseConfig::default()); // E = 20 s
    r.track("a", &p("P"), 1, at(0));
    r.track("b", &p("P"), 2, at(0));
    assert!(matches!(&poll(&mut r, at(0))[..], [Action::Handshake { .. }]));
    r.handshake_done("P", Err(()), at(1));
    assert_eq!(r.read_check("a", Duration::from_secs(1), true, at(1)), ReadCheck::Unreachable);
    r.untrack("a", Untrack::Abandoned);
    r.untrack("b", Untrack::Abandoned);
    assert_eq!(r.poll_timeout(), Some(Nanos::ZERO), "a release to hand over is due at once");
    let acts = poll(&mut r, at(2));
    let want = SideChannelRelease {
        engine_id: "P".into(),
        host: "127.0.0.1".into(),
        port: 7000,
        granted_by: 11,
        lease_ids: vec![1, 2],
        why: NotRead::NoLink,
    };
    assert_eq!(side_releases(&acts), vec![want.clone()], "{acts:?}");
    assert!(sent(&acts, "P").is_empty(), "nothing over the agents: there is no link");
    // What P's answer released: all but what it named lost, and nothing when another
    // incarnation than the granting one answered.
    assert_eq!(want.released_by(11, &[2]), 1);
    assert_eq!(want.released_by(12, &[]), 0, "another incarnation holds none of them");
    assert_eq!(SideChannelRelease { granted_by: 0, ..want.clone() }.released_by(12, &[]), 2, "granting incarnation unknown");
    assert!(side_releases(&poll(&mut r, at(3))).is_empty(), "one delivery at a time");
    // Unreachable too: retried after a back-off.
    r.side_release_done(&want, Err(()), at(4));
    assert!(side_releases(&poll(&mut r, at(103))).is_empty());
    assert_eq!(side_releases(&poll(&mut r, at(104))), vec![want.clone()]);
    // A refused request's params toward the same engine join the next delivery.
    r.release(&p("P"), 3, at(105));
    r.side_release_done(&want, Ok(11), at(106));
    assert_eq!(side_releases(&poll(&mut r, at(106))).iter().map(|r| r.lease_ids.clone()).collect::<Vec<_>>(), vec![vec![3]]);
    r.side_release_done(&SideChannelRelease { lease_ids: vec![3], ..want.clone() }, Ok(11), at(107));
    assert_eq!(r.side_releases_pending(), 0);
    // Never delivered: dropped after E (P has expired the lease by then).
    r.release(&p("P"), 4, at(200));
    let first = side_releases(&poll(&mut r, at(200)));
    assert_eq!(first.len(), 1);
    r.side_release_done(&first[0], Err(()), at(201));
    assert!(side_releases(&poll(&mut r, at(20_200))).is_empty(), "aged out after E");
    assert_eq!(r.side_releases_pending(), 0);
}

fn endpoint(port: u16, incarnation: u64) -> Endpoint {
    Endpoint { host: "127.0.0.1".into(), port, incarnation }
}

/// SPEC O4, §3, D5: params of another incarnation at another address while D is linked to a
/// live incarnation are a second live engine under the same id (an operator's mistake). D does
/// not flap: no reconnect, the linked engine keeps its leases and heartbeats; the duplicate's
/// request is reported lost (recomputed) and its lease released at once over its own side
/// channel; the mistake is said once.
#[test]
fn o4_a_duplicate_engine_id_is_not_read_and_its_lease_released_at_once() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("P"), 1, at(0));
    ready(&mut r, "P", at(0));
    assert_eq!(heartbeat_ids(&poll(&mut r, at(0)), "P"), vec![1]);
    let twin = Remote { port: 7001, incarnation: 12, ..p("P") };
    r.track("b", &twin, 1, at(10));
    assert!(!r.is_tracked("b"));
    let acts = poll(&mut r, at(10));
    assert!(acts.iter().any(|a| matches!(a, Action::Lost { request_id, lease_id: 1 } if request_id == "b")), "{acts:?}");
    assert!(acts.contains(&Action::DuplicateEngine { engine_id: "P".into(), kept: endpoint(7000, 11), other: endpoint(7001, 12) }));
    assert_eq!(
        side_releases(&acts),
        vec![SideChannelRelease {
            engine_id: "P".into(),
            host: "127.0.0.1".into(),
            port: 7001,
            granted_by: 12,
            lease_ids: vec![1],
            why: NotRead::Duplicate { kept: endpoint(7000, 11) },
        }]
    );
    assert!(!acts.iter().any(|a| matches!(a, Action::Handshake { .. })), "no flapping: {acts:?}");
    assert!(r.is_ready("P") && r.is_tracked("a"));
    // Another of its requests: released too, the mistake not said again.
    r.track("c", &twin, 2, at(20));
    let acts = poll(&mut r, at(20));
    assert!(!acts.iter().any(|a| matches!(a, Action::DuplicateEngine { .. })), "{acts:?}");
    assert!(acts.iter().any(|a| matches!(a, Action::Lost { request_id, .. } if request_id == "c")));
    // The linked engine is renewed as before.
    assert_eq!(heartbeat_ids(&poll(&mut r, at(5_000)), "P"), vec![1]);
}

/// SPEC O4: while the handshake with one address is in flight, params of another incarnation at
/// another address are not read either (their lease is released there at once), and the
/// handshake in flight is not abandoned for them; once it answers, the mistake is said.
#[test]
fn o4_params_of_another_address_during_the_handshake_are_not_read() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("P"), 1, at(0));
    assert!(matches!(&poll(&mut r, at(0))[..], [Action::Handshake { port: 7000, .. }]));
    r.track("b", &Remote { port: 7001, incarnation: 12, ..p("P") }, 1, at(1));
    let acts = poll(&mut r, at(1));
    assert!(acts.iter().any(|a| matches!(a, Action::Lost { request_id, .. } if request_id == "b")), "{acts:?}");
    assert_eq!(side_releases(&acts).iter().map(|s| (s.port, s.granted_by)).collect::<Vec<_>>(), vec![(7001, 12)]);
    assert!(!acts.iter().any(|a| matches!(a, Action::Handshake { .. } | Action::DuplicateEngine { .. })), "{acts:?}");
    assert!(r.is_tracked("a"), "lease ids of the two engines collide: the first keeps its own");
    r.handshake_done("P", Ok(found(11)), at(2));
    let acts = poll(&mut r, at(2));
    assert!(acts.contains(&Action::DuplicateEngine { engine_id: "P".into(), kept: endpoint(7000, 11), other: endpoint(7001, 12) }));
    assert_eq!(heartbeat_ids(&acts, "P"), vec![1]);
}

/// SPEC D5, §3: a restart elsewhere is not a duplicate: once the old address fails, params of
/// the new address move D there; the old incarnation's lease is lost (it died with it), and
/// nothing is released or said about a duplicate.
#[test]
fn d5_a_restart_at_another_address_moves_there_once_the_old_one_fails() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.track("a", &p("P"), 1, at(0));
    assert!(matches!(&poll(&mut r, at(0))[..], [Action::Handshake { port: 7000, .. }]));
    r.handshake_done("P", Err(()), at(2));
    r.track("b", &Remote { port: 7001, incarnation: 12, ..p("P") }, 1, at(3));
    let acts = poll(&mut r, at(3));
    assert!(acts.iter().any(|a| matches!(a, Action::Handshake { port: 7001, .. })), "{acts:?}");
    r.handshake_done("P", Ok(found(12)), at(4));
    let acts = poll(&mut r, at(4));
    assert!(!acts.iter().any(|a| matches!(a, Action::DuplicateEngine { .. } | Action::ReleaseOverSideChannel(_))), "{acts:?}");
    assert_eq!(heartbeat_ids(&acts, "P"), vec![1]);
    assert!(r.is_tracked("b") && !r.is_tracked("a"));
}

/// SPEC D5, U9: a push request given up before the renewer even polled (its client left at
/// once) leaves a release parked for P: the parked message holds the link, so the handshake is
/// still made and the release delivered; once it went, nothing holds the link. Without the hold
/// nobody dials, and P keeps the lease until it expires (seen in CI: the engine's
/// `u9_an_abort_on_d_frees_p_at_once` under load).
#[test]
fn u9_a_parked_message_keeps_the_link_wanted_until_it_goes() {
    let mut r = Renewer::new(&LeaseConfig::default());
    r.push_link(&p("P"), at(0));
    assert!(r.push_hold("P"), "the engine is known");
    r.push_unlink("P");
    ready(&mut r, "P", at(1));
    r.push_unlink("P");
    assert!(!r.push_hold("nobody"), "an engine never linked has nothing to dial");

    let mut r = Renewer::new(&LeaseConfig::default());
    r.push_link(&p("P"), at(0));
    r.push_unlink("P");
    assert!(poll(&mut r, at(1)).iter().all(|a| !matches!(a, Action::Handshake { .. })), "nothing wanted, nothing dialled");
}
