//! The mem backend: the shared scenarios, and its faults: dropped agents, removed peers, cut
//! links.

use super::*;
use crate::testing::*;
use crate::{OpenGate, ReadOp, WriteOp};

fn agent(net: &MemNetwork, name: &str, blocks: u32, block_bytes: usize, gate: Arc<dyn ReadGate>) -> (Arc<MemAgent>, Events) {
    let (tx, rx) = mpsc::unbounded_channel();
    (net.agent(name, BlockArena::new(blocks, block_bytes), gate, tx), rx)
}

async fn connect(a: &MemAgent, b: &MemAgent) {
    let (a_md, b_md) = (a.metadata(), b.metadata());
    let (ra, rb) = within("add_peer both ways", async { tokio::join!(a.add_peer(&b_md), b.add_peer(&a_md)) }).await;
    assert_eq!(ra.expect("a adds b"), b.name());
    assert_eq!(rb.expect("b adds a"), a.name());
}

async fn pair(blocks: u32, block_bytes: usize) -> Pair {
    let net = MemNetwork::new();
    let gate = TestGate::new();
    let (p, p_events) = agent(&net, "p", blocks, block_bytes, Arc::new(gate.clone()));
    let (d, d_events) = agent(&net, "d", blocks, block_bytes, Arc::new(OpenGate));
    connect(&p, &d).await;
    let p_arena = Arc::clone(&p.arena);
    Pair { p, p_events, d, d_events, gate, p_arena }
}

fn small_read() -> ReadOp {
    ReadOp { lease_id: 1, segments: vec![seg(0, 0, 0, 0, 8)], notif: Some(b"done".to_vec()), tag: Vec::new() }
}

#[tokio::test]
async fn read_round_trip_lands_byte_identical_then_notifies_p() {
    scenario_read_round_trip(pair(16, 1024 * 1024).await).await;
}

#[tokio::test]
async fn large_read_of_64_mib_in_1_mib_segments_lands_intact() {
    scenario_large_read(pair(64, 1024 * 1024).await).await;
}

#[tokio::test]
async fn refused_read_fails_with_refused_and_copies_nothing_p5() {
    scenario_refused_read_copies_nothing(pair(8, 4096).await).await;
}

#[tokio::test]
async fn permit_is_held_while_bytes_are_copied_and_dropped_after_p5() {
    scenario_permit_held_during_copy(pair(16, 4096).await).await;
}

#[tokio::test]
async fn notifications_flow_both_ways_in_order_with_binary_payloads() {
    scenario_notifications_in_order(pair(8, 4096).await).await;
}

#[tokio::test]
async fn out_of_range_segments_fail_with_out_of_range_without_panic() {
    scenario_out_of_range(pair(8, 4096).await).await;
}

#[tokio::test]
async fn unknown_peer_fails_at_once() {
    scenario_unknown_peer(pair(8, 4096).await).await;
}

#[tokio::test]
async fn dropping_an_agent_disconnects_its_peers_and_leaves_others_alone() {
    let net = MemNetwork::new();
    let (p, _p_events) = agent(&net, "p", 4, 4096, Arc::new(OpenGate));
    let (d, mut d_events) = agent(&net, "d", 4, 4096, Arc::new(OpenGate));
    let (q, mut q_events) = agent(&net, "q", 4, 4096, Arc::new(OpenGate));
    connect(&p, &d).await;
    connect(&q, &d).await;
    drop(p);
    assert_eq!(next_event(&mut d_events).await, AgentEvent::Disconnected { peer: "p".into() });
    assert_eq!(d.read("p", small_read()).await, Err(TransportError::Disconnected("p".into())));
    assert_eq!(d.send_notif("p", vec![1]), Err(TransportError::Disconnected("p".into())));
    check_both_directions(&*d, &mut d_events, &*q, &mut q_events).await;
    assert!(d_events.try_recv().is_err() && q_events.try_recv().is_err(), "q heard nothing of p");
}

#[tokio::test]
async fn remove_peer_disconnects_it_and_refuses_it_afterwards() {
    let net = MemNetwork::new();
    let (p, mut p_events) = agent(&net, "p", 4, 4096, Arc::new(OpenGate));
    let (d, mut d_events) = agent(&net, "d", 4, 4096, Arc::new(OpenGate));
    connect(&p, &d).await;
    p.remove_peer("d");
    assert_eq!(next_event(&mut d_events).await, AgentEvent::Disconnected { peer: "p".into() });
    assert_eq!(p.send_notif("d", vec![1]), Err(TransportError::UnknownPeer("d".into())));
    assert_eq!(d.read("p", small_read()).await, Err(TransportError::Disconnected("p".into())));
    assert_eq!(d.send_notif("p", vec![1]), Err(TransportError::Disconnected("p".into())));
    connect(&p, &d).await;
    check_both_directions(&*p, &mut p_events, &*d, &mut d_events).await;
}

#[tokio::test]
async fn partition_fails_reads_loses_notifications_and_heals() {
    let net = MemNetwork::new();
    let (p, mut p_events) = agent(&net, "p", 4, 4096, Arc::new(OpenGate));
    let (d, mut d_events) = agent(&net, "d", 4, 4096, Arc::new(OpenGate));
    let (q, mut q_events) = agent(&net, "q", 4, 4096, Arc::new(OpenGate));
    connect(&p, &d).await;
    connect(&q, &d).await;
    net.partition("d", "p", true);
    assert_eq!(next_event(&mut p_events).await, AgentEvent::Disconnected { peer: "d".into() });
    assert_eq!(next_event(&mut d_events).await, AgentEvent::Disconnected { peer: "p".into() });
    assert_eq!(d.read("p", small_read()).await, Err(TransportError::Disconnected("p".into())));
    d.send_notif("p", b"lost".to_vec()).expect("a notification into a cut link looks sent");
    check_both_directions(&*d, &mut d_events, &*q, &mut q_events).await;
    net.partition("p", "d", false);
    check_both_directions(&*p, &mut p_events, &*d, &mut d_events).await;
    assert!(p_events.try_recv().is_err(), "the notification sent into the cut was lost, not delayed");
}

#[tokio::test]
async fn add_peer_works_in_either_order_and_at_once() {
    let net = MemNetwork::new();
    let (a, mut a_events) = agent(&net, "a", 4, 4096, Arc::new(OpenGate));
    let (b, mut b_events) = agent(&net, "b", 4, 4096, Arc::new(OpenGate));
    let (a2, b_md) = (Arc::clone(&a), b.metadata());
    let first = tokio::spawn(async move { a2.add_peer(&b_md).await });
    // a's add_peer waits for b to add it back.
    assert_eq!(within("b adds a", b.add_peer(&a.metadata())).await, Ok("a".to_owned()));
    assert_eq!(within("a's add_peer", first).await.unwrap(), Ok("b".to_owned()));
    check_both_directions(&*a, &mut a_events, &*b, &mut b_events).await;

    let (c, mut c_events) = agent(&net, "c", 4, 4096, Arc::new(OpenGate));
    connect(&b, &c).await;
    check_both_directions(&*b, &mut b_events, &*c, &mut c_events).await;
}

#[tokio::test(start_paused = true)]
async fn add_peer_fails_for_bad_metadata_absent_or_silent_peers() {
    let net = MemNetwork::new();
    let (a, _a_events) = agent(&net, "a", 1, 64, Arc::new(OpenGate));
    let (_b, _b_events) = agent(&net, "b", 1, 64, Arc::new(OpenGate));
    assert!(matches!(a.add_peer(&[0xff, 0xfe]).await, Err(TransportError::BadMetadata(_))));
    assert!(matches!(a.add_peer(b"").await, Err(TransportError::BadMetadata(_))));
    assert!(matches!(a.add_peer(b"a").await, Err(TransportError::BadMetadata(_))), "own metadata");
    assert!(matches!(a.add_peer(b"nobody").await, Err(TransportError::Io(_))), "no such agent");
    // b never adds a: after the wait (virtual time), a's add_peer fails.
    assert!(matches!(a.add_peer(b"b").await, Err(TransportError::Io(_))));
}

#[tokio::test]
async fn networks_are_isolated_from_each_other() {
    let (n1, n2) = (MemNetwork::new(), MemNetwork::new());
    let (a, _a_events) = agent(&n1, "a", 1, 64, Arc::new(OpenGate));
    let (_b, _b_events) = agent(&n2, "b", 1, 64, Arc::new(OpenGate));
    assert!(matches!(a.add_peer(b"b").await, Err(TransportError::Io(_))));
}

// ---- writes (push mode, SPEC §13) ----

fn write_pair_on(net: &MemNetwork, blocks: u32, block_bytes: usize) -> (Arc<MemAgent>, Events, Arc<MemAgent>, Events, TestWriteGate) {
    let gate = TestWriteGate::new();
    let (p, p_events) = agent(net, "p", blocks, block_bytes, Arc::new(OpenGate));
    let (d, d_events) = agent(net, "d", blocks, block_bytes, Arc::new(OpenGate));
    d.set_write_gate(Arc::new(gate.clone()));
    (p, p_events, d, d_events, gate)
}

async fn write_pair(blocks: u32, block_bytes: usize) -> WritePair {
    let net = MemNetwork::new();
    let (p, p_events, d, d_events, gate) = write_pair_on(&net, blocks, block_bytes);
    connect(&p, &d).await;
    let d_arena = Arc::clone(&d.arena);
    WritePair { p, p_events, d, d_events, gate, d_arena }
}

fn whole_blocks(n: u32, bb: u32) -> WriteOp {
    WriteOp { key: b"k".to_vec(), segments: (0..n).map(|b| seg(b, 0, b, 0, bb)).collect(), notif: Some(b"done".to_vec()), tag: Vec::new() }
}

#[tokio::test]
async fn u4_write_lands_byte_identical_then_notifies_d() {
    scenario_u4_write_round_trip(write_pair(16, 64 * 1024).await).await;
}

#[tokio::test]
async fn u4_u8_refused_write_fails_with_write_refused_and_lands_nothing() {
    scenario_u4_u8_refused_write_lands_nothing(write_pair(8, 4096).await).await;
}

#[tokio::test]
async fn u8_out_of_range_write_fails_without_reaching_the_gate() {
    scenario_u8_out_of_range_write(write_pair(8, 4096).await).await;
}

/// SPEC U4: an agent whose engine never set a write gate refuses every write.
#[tokio::test]
async fn u4_an_agent_without_a_write_gate_refuses_every_write() {
    let net = MemNetwork::new();
    let (p, _p_events) = agent(&net, "p", 4, 4096, Arc::new(OpenGate));
    let (d, mut d_events) = agent(&net, "d", 4, 4096, Arc::new(OpenGate));
    connect(&p, &d).await;
    fill_block(&p.arena, 0, 1);
    assert_eq!(p.write("d", whole_blocks(1, 4096)).await, Err(TransportError::WriteRefused { peer: "d".into() }));
    assert!(whole(&d.arena).iter().all(|&b| b == 0));
    assert!(d_events.try_recv().is_err());
}

/// The simulator's faults apply to writes (SPEC U6, U7): a slow write lands only after its
/// delay; a failed one lands its first half, fails with `Disconnected`, notifies nothing and
/// drops its permit; a link cut while a write is on its way fails it without landing it.
#[tokio::test(start_paused = true)]
async fn u6_u7_write_faults_slow_writes_land_late_failed_ones_land_half_and_fail() {
    let net = MemNetwork::new();
    let (p, _p_events, d, mut d_events, gate) = write_pair_on(&net, 4, 4096);
    connect(&p, &d).await;
    for b in 0..4 {
        fill_block(&p.arena, b, 70 + u64::from(b));
    }

    net.set_faults(Faults { write_delay: (Duration::from_secs(2), Duration::from_secs(2)), ..Faults::default() });
    let started = tokio::time::Instant::now();
    let p2 = Arc::clone(&p);
    let write = tokio::spawn(async move { p2.write("d", whole_blocks(4, 4096)).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(whole(&d.arena).iter().all(|&b| b == 0), "a slow write has not landed before its delay");
    assert_eq!(gate.live(), 1, "but it holds its permit: the blocks are not reused under it");
    assert_eq!(write.await.expect("write task"), Ok(()));
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert!((0..4).all(|b| block(&d.arena, b) == block(&p.arena, b)));
    assert_eq!(next_notif(&mut d_events).await.1, b"done");

    // Cut while on its way: fails, lands nothing.
    for b in 0..4 {
        fill_block(&p.arena, b, 90 + u64::from(b));
    }
    let before = whole(&d.arena);
    let p2 = Arc::clone(&p);
    let write = tokio::spawn(async move { p2.write("d", whole_blocks(4, 4096)).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    net.partition("p", "d", true);
    assert_eq!(write.await.expect("write task"), Err(TransportError::Disconnected("d".into())));
    assert!(whole(&d.arena) == before, "nothing of a write whose link broke on the way landed");
    assert_eq!(next_event(&mut d_events).await, AgentEvent::Disconnected { peer: "p".into() });
    net.partition("p", "d", false);

    net.set_faults(Faults { write_fail: 1.0, ..Faults::default() });
    let r = p.write("d", whole_blocks(4, 4096)).await;
    assert_eq!(r, Err(TransportError::Disconnected("d".into())));
    assert!((0..2).all(|b| block(&d.arena, b) == block(&p.arena, b)), "the first half landed");
    assert!((2..4).all(|b| block(&d.arena, b) == before[b as usize * 4096..(b as usize + 1) * 4096]), "the rest did not");
    assert_eq!(gate.live(), 0, "the failed write's permit was dropped");
    assert!(d_events.try_recv().is_err(), "a failed write delivers no notification");
}

/// Unfenced (as NIXL): D cannot refuse writes, its gate is not asked, and the write lands; the
/// fencing is the core's deadline rules (SPEC U8).
#[tokio::test]
async fn u8_unfenced_writes_are_not_shown_to_the_gate_as_over_nixl() {
    let net = MemNetwork::new();
    let (p, _p_events, d, mut d_events, gate) = write_pair_on(&net, 2, 4096);
    connect(&p, &d).await;
    net.set_faults(Faults { unfenced: true, ..Faults::default() });
    assert!(!p.can_refuse_writes() && !d.can_refuse_writes());
    gate.refuse(b"k");
    fill_block(&p.arena, 0, 5);
    assert_eq!(p.write("d", whole_blocks(1, 4096)).await, Ok(()));
    assert!(block(&d.arena, 0) == block(&p.arena, 0));
    assert!(gate.calls().is_empty(), "the gate never saw the write");
    assert_eq!(next_notif(&mut d_events).await.1, b"done");
}
