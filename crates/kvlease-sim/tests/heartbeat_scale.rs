//! Heartbeat traffic at scale (issue #12 part 4), at small sizes: the counts the simulator
//! reports are the protocol's, message for message and byte for byte.

use kvlease_core::wire::{heartbeat_chunks, Message};
use kvlease_sim::heartbeat::{request_id, run, vllm_heartbeat_bytes, Routing, Scale};
use std::time::Duration;

/// SPEC D2: with no churn and leases dealt in turn, each P receives exactly one heartbeat per D
/// per interval, each exactly the encoding of the ids that D holds of it; P acknowledges each
/// with one empty `HeartbeatAck`; vLLM's text heartbeat for the same leases is one notification
/// per (D, P) per interval of `"HB:" + ",".join(ids)`.
#[test]
fn one_heartbeat_per_decoder_per_interval_of_the_encoded_size() {
    let (prefills, decoders, live) = (3, 4, 40);
    let sc = Scale { hold: None, routing: Routing::RoundRobin, ..Scale::new(prefills, decoders, live) };
    let rounds = (sc.window.as_nanos() / sc.lease.heartbeat_interval.as_nanos()) as u64;
    let r = run(&sc);
    assert_eq!(r.lost, 0);
    assert_eq!((r.live_min, r.live_max), (live, live));
    // A fresh table grants 1, 2, 3, ...: D d holds ids d+1, d+1+decoders, ... of every P.
    let per_round: usize = (0..decoders)
        .map(|d| {
            let ids: Vec<u64> = (1..=live as u64).filter(|i| (i - 1) as usize % decoders == d).collect();
            // Seqs stay below 128 here: one varint byte, as for seq 1.
            Message::Heartbeat { seq: 1, lease_ids: ids }.encode().len()
        })
        .sum();
    let ack = Message::HeartbeatAck { seq: 1, lost_ids: vec![] }.encode().len();
    let vllm_one = vllm_heartbeat_bytes(live / decoders, request_id(0).len());
    for (p, f) in r.per_p.iter().enumerate() {
        assert_eq!(f.heartbeats.msgs, decoders as u64 * rounds, "P {p}: {f:?}");
        assert_eq!(f.heartbeats.bytes, per_round as u64 * rounds, "P {p}: {f:?}");
        assert_eq!(f.acks.msgs, f.heartbeats.msgs, "P {p}: every heartbeat acknowledged once");
        assert_eq!(f.acks.bytes, ack as u64 * f.acks.msgs, "P {p}: nothing lost");
        assert_eq!(f.vllm.msgs, decoders as u64 * rounds, "P {p}: {f:?}");
        assert_eq!(f.vllm.bytes, (vllm_one * decoders) as u64 * rounds, "P {p}: {f:?}");
    }
}

/// SPEC D2: a D's heartbeat to a P is split at `max_notif_bytes`, as `heartbeat_chunks` cuts it.
#[test]
fn heartbeats_are_split_at_max_notif_bytes() {
    let (decoders, live) = (2, 200);
    let mut sc = Scale { hold: None, routing: Routing::RoundRobin, ..Scale::new(1, decoders, live) };
    sc.lease.max_notif_bytes = 64;
    let rounds = (sc.window.as_nanos() / sc.lease.heartbeat_interval.as_nanos()) as u64;
    let r = run(&sc);
    let chunks: usize = (0..decoders)
        .map(|d| {
            let ids: Vec<u64> = (1..=live as u64).filter(|i| (i - 1) as usize % decoders == d).collect();
            heartbeat_chunks(&ids, 64).len()
        })
        .sum();
    assert!(chunks > decoders, "the test must split: {chunks}");
    assert_eq!(r.per_p[0].heartbeats.msgs, chunks as u64 * rounds, "{:?}", r.per_p[0]);
    assert_eq!(r.per_p[0].acks.msgs, r.per_p[0].heartbeats.msgs);
    // vLLM sends its text unsplit: one per (D, P) per interval.
    assert_eq!(r.per_p[0].vllm.msgs, decoders as u64 * rounds);
}

/// Under churn (leases read and replaced, requests routed at random) the live count per P stays
/// exact, no lease is lost, and each P still gets one heartbeat per D per interval (every D holds
/// some of its leases at these sizes), as vLLM's does; the same seed gives the same report.
#[test]
fn churn_keeps_live_count_and_one_heartbeat_per_pair() {
    let sc = Scale { hold: Some(Duration::from_secs(7)), ..Scale::new(4, 8, 400) };
    let rounds = (sc.window.as_nanos() / sc.lease.heartbeat_interval.as_nanos()) as u64;
    let r = run(&sc);
    assert_eq!(r.lost, 0, "{r:?}");
    assert_eq!((r.live_min, r.live_max), (400, 400));
    // 400 granted at the start, then 400 per 7 s over warm-up and window (70 s).
    assert!(r.grants > 4 * 400 * 10, "churned: {} grants", r.grants);
    for f in &r.per_p {
        assert_eq!(f.heartbeats.msgs, 8 * rounds, "{f:?}");
        assert_eq!(f.vllm.msgs, f.heartbeats.msgs);
        assert!(f.heartbeats.bytes * 10 < f.vllm.bytes, "binary ids are far smaller than text: {f:?}");
    }
    assert_eq!(run(&sc), r);
}
