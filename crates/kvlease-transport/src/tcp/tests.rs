//! The tcp backend over real loopback sockets: the shared scenarios, and what only a socket
//! brings: strangers and impostors, malformed frames, peers dying mid-read, dial races, shutdown.

use super::wire::{self, Outgoing};
use super::*;
use crate::testing::*;
use crate::{OpenGate, WriteOp};
use kvlease_core::auth::{Nonce, NONCE_LEN, TAG_LEN};
use std::collections::BTreeMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Short hold and proof deadline, so tests about strangers do not wait seconds; a 2 MiB frame
/// limit.
fn quick() -> TcpOptions {
    TcpOptions {
        hold_unknown: Duration::from_millis(300),
        proof_timeout: Duration::from_millis(300),
        max_frame: 2 * 1024 * 1024,
        ..TcpOptions::default()
    }
}

const SECRET: &[u8] = b"the cluster's secret";

/// [`quick`], with the cluster secret `secret`.
fn secured(secret: &[u8]) -> TcpOptions {
    TcpOptions { secret: Some(secret.to_vec()), ..quick() }
}

async fn agent(name: &str, blocks: u32, block_bytes: usize, gate: Arc<dyn ReadGate>, options: TcpOptions) -> (Arc<TcpAgent>, Events) {
    let (tx, rx) = mpsc::unbounded_channel();
    let a = TcpAgent::start_with(name.to_owned(), "127.0.0.1", BlockArena::new(blocks, block_bytes), gate, tx, options)
        .await
        .expect("agent starts");
    (a, rx)
}

/// Both sides add each other at once; asserts they share one socket.
async fn connect(a: &TcpAgent, b: &TcpAgent) {
    let (a_md, b_md) = (a.metadata(), b.metadata());
    let (ra, rb) = within("add_peer both ways", async { tokio::join!(a.add_peer(&b_md), b.add_peer(&a_md)) }).await;
    assert_eq!(ra.expect("a adds b"), b.name());
    assert_eq!(rb.expect("b adds a"), a.name());
    assert_one_connection(a, b);
}

fn assert_one_connection(a: &TcpAgent, b: &TcpAgent) {
    let (ea, eb) = (a.conn_ends(b.name()).expect("a has a connection"), b.conn_ends(a.name()).expect("b has a connection"));
    assert_eq!(ea, (eb.1, eb.0), "both agents use the same single connection");
}

impl TcpAgent {
    fn conn_ends(&self, peer: &str) -> Option<(SocketAddr, SocketAddr)> {
        lock(&self.inner.state).peers.get(peer)?.conn.as_ref()?.ends
    }

    fn holds(&self, name: &str) -> bool {
        lock(&self.inner.state).held.contains_key(name)
    }

    /// Bytes waiting in the connection's queues, as counted against `max_queued_bytes`.
    fn queued_bytes(&self, peer: &str) -> Option<usize> {
        Some(lock(&self.inner.state).peers.get(peer)?.conn.as_ref()?.queued.load(Ordering::Relaxed))
    }
}

async fn pair_with(blocks: u32, block_bytes: usize, options: TcpOptions) -> Pair {
    let gate = TestGate::new();
    let (p, p_events) = agent("p", blocks, block_bytes, Arc::new(gate.clone()), options.clone()).await;
    let (d, d_events) = agent("d", blocks, block_bytes, Arc::new(OpenGate), options).await;
    connect(&p, &d).await;
    let p_arena = Arc::clone(&p.inner.arena);
    Pair { p, p_events, d, d_events, gate, p_arena }
}

async fn pair(blocks: u32, block_bytes: usize) -> Pair {
    pair_with(blocks, block_bytes, TcpOptions::default()).await
}

async fn send(s: &mut TcpStream, f: &Outgoing) {
    s.write_all(&f.to_bytes()).await.expect("raw write");
}

/// The next frame from an agent, or `None` once it closed the connection.
async fn recv(s: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    within("a frame or the close", async {
        let mut head = [0u8; wire::HEADER_LEN];
        s.read_exact(&mut head).await.ok()?;
        let mut body = vec![0u8; u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize];
        s.read_exact(&mut body).await.ok()?;
        Some((head[4], body))
    })
    .await
}

/// Waits until the agent closes the connection.
async fn closed(s: &mut TcpStream) {
    within("the agent to close the connection", async {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = s.read(&mut buf).await {
            let _ = n;
        }
    })
    .await
}

/// A raw client's side of the handshake, as `from` to the agent `to` at `addr`, with the key
/// `key`: says hello, gets a bare nonce, and proves itself first. This pins the wire format.
async fn raw_handshake(addr: SocketAddr, from: &str, to: &str, key: &ClusterKey) -> (TcpStream, Answer) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let nonce: Nonce = [0x11; NONCE_LEN];
    send(&mut s, &Outgoing::hello(from, to, &nonce)).await;
    let (kind, body) = recv(&mut s).await.expect("a challenge");
    assert_eq!(kind, wire::HELLO_CHALLENGE);
    assert_eq!(body.len(), NONCE_LEN, "the challenge is a nonce and nothing computed from the secret");
    let nonces = Nonces { dialer: nonce, acceptor: wire::decode_challenge(&body).expect("a well-formed challenge") };
    let answer = Answer::new(key, Parties::agents(from, to), nonces);
    send(&mut s, &Outgoing::hello_proof(&answer.proof)).await;
    (s, answer)
}

/// A raw client that completes the handshake as the known peer `name` of `agent` (which has
/// no secret), checking the agent's proof in its ack.
async fn raw_known_peer(agent: &TcpAgent, name: &str) -> TcpStream {
    let key = ClusterKey::new(None);
    let (mut s, answer) = raw_handshake(agent.local_addr(), name, agent.name(), &key).await;
    eventually("the agent to hold the proven stranger", || agent.holds(name)).await;
    let md = wire::encode_metadata(name, "127.0.0.1:9".parse().unwrap());
    assert_eq!(within("add_peer", agent.add_peer(&md)).await.expect("adopts the held connection"), name);
    let (kind, proof) = recv(&mut s).await.expect("the ack");
    assert_eq!(kind, wire::HELLO_ACK);
    assert!(answer.check(&proof).is_ok(), "the ack carries the agent's proof");
    s
}

/// Events until `n` of them are `Rejected`, tallied by reason, plus the notifications seen.
async fn rejections(rx: &mut Events, n: usize) -> (BTreeMap<&'static str, usize>, Vec<AgentEvent>) {
    let (mut tally, mut others) = (BTreeMap::new(), Vec::new());
    while tally.values().sum::<usize>() < n {
        match next_event(rx).await {
            AgentEvent::Rejected { reason } => *tally.entry(reason).or_default() += 1,
            e => others.push(e),
        }
    }
    (tally, others)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_round_trip_lands_byte_identical_then_notifies_p() {
    scenario_read_round_trip(pair(16, 1024 * 1024).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_read_of_64_mib_in_1_mib_segments_lands_intact() {
    scenario_large_read(pair(64, 1024 * 1024).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_read_fails_with_refused_and_copies_nothing_p5() {
    scenario_refused_read_copies_nothing(pair(8, 4096).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permit_is_held_while_bytes_leave_the_arena_and_dropped_after_p5() {
    // 32 × 64 KiB: several response chunks, so the permit must outlive more than one write.
    scenario_permit_held_during_copy(pair(32, 64 * 1024).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_flow_both_ways_in_order_with_binary_payloads() {
    scenario_notifications_in_order(pair(8, 4096).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_segments_fail_with_out_of_range_without_panic() {
    scenario_out_of_range(pair(8, 4096).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_peer_fails_at_once() {
    scenario_unknown_peer(pair(8, 4096).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_dropped_and_counted_while_known_peers_are_served_s2_p7() {
    let mut pr = pair_with(8, 4096, quick()).await;
    let p_addr = wire::decode_metadata(&pr.p.metadata()).unwrap().1;
    let stranger = move |bytes: Vec<u8>| async move {
        let mut s = TcpStream::connect(p_addr).await.expect("connect");
        s.write_all(&bytes).await.expect("write");
        closed(&mut s).await;
    };
    let nonce = [0u8; NONCE_LEN];
    let mut v1_hello = Outgoing::hello("d", "p", &nonce).body()[..].to_vec();
    v1_hello.truncate(v1_hello.len() - NONCE_LEN);
    v1_hello[4] = 1;
    let strangers = tokio::spawn(async move {
        tokio::join!(
            stranger(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),            // garbage
            stranger(Outgoing::hello("mallory", "p", &nonce).to_bytes()),       // never proves itself
            stranger(Outgoing::hello("d2", "someone-else", &nonce).to_bytes()), // meant for another agent
            stranger(Outgoing::raw(wire::HELLO, b"KVLT\x02\xff\xff".to_vec()).to_bytes()), // broken hello
            stranger(Outgoing::raw(wire::HELLO, v1_hello).to_bytes()),          // the old, unproven hello
            stranger([&(100u32 << 20).to_le_bytes()[..], &[wire::HELLO]].concat()), // a 100 MiB "hello"
            stranger(Vec::new()),                                               // never says hello
        )
    });
    // While strangers are held, the known peer is served.
    fill_block(&pr.p_arena, 0, 1);
    let op = ReadOp { lease_id: 1, segments: vec![seg(0, 0, 0, 0, 4096)], notif: Some(b"served".to_vec()), tag: Vec::new() };
    within("a read during the hold", pr.d.read("p", op)).await.expect("known peer served");
    assert!(block(pr.d.arena(), 0) == block(&pr.p_arena, 0));
    within("strangers dropped", strangers).await.expect("stranger tasks");

    let (tally, others) = rejections(&mut pr.p_events, 7).await;
    assert_eq!(tally, BTreeMap::from([("malformed", 4), ("unauthenticated", 1), ("unknown_agent", 2)]));
    assert_eq!(others, vec![AgentEvent::Notification { from: "d".into(), bytes: b"served".to_vec() }]);
    check_both_directions(&*pr.p, &mut pr.p_events, &*pr.d, &mut pr.d_events).await;
    assert!(pr.p_events.try_recv().is_err(), "nothing else was reported");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_frames_from_a_known_peer_are_dropped_and_counted_p7() {
    let gate = TestGate::new();
    let (p, mut p_events) = agent("p", 8, 4096, Arc::new(gate.clone()), quick()).await;
    let (d, mut d_events) = agent("d", 8, 4096, Arc::new(OpenGate), quick()).await;
    connect(&p, &d).await;
    let mut raw = raw_known_peer(&p, "raw").await;

    send(&mut raw, &Outgoing::raw(99, b"what".to_vec())).await; // unknown kind
    send(&mut raw, &Outgoing::raw(wire::READ_REQ, vec![1, 2, 3])).await; // short request
    send(&mut raw, &Outgoing::hello("raw", "p", &[0; NONCE_LEN])).await; // hello after the handshake
    send(&mut raw, &Outgoing::raw(wire::READ_ERR, vec![0; 3])).await; // short error
    send(&mut raw, &Outgoing::raw(wire::READ_DATA, vec![0; 5])).await; // data shorter than its id
    send(&mut raw, &Outgoing::notif(vec![7; 3 * 1024 * 1024])).await; // over the 2 MiB limit
    send(&mut raw, &Outgoing::notif(b"still here".to_vec())).await;
    let (tally, others) = rejections(&mut p_events, 6).await;
    assert_eq!(tally, BTreeMap::from([("malformed", 5), ("oversized", 1)]));
    let still = match others.as_slice() {
        [] => next_event(&mut p_events).await,
        [e] => e.clone(),
        more => panic!("unexpected events {more:?}"),
    };
    assert_eq!(still, AgentEvent::Notification { from: "raw".into(), bytes: b"still here".to_vec() }, "the stream stayed in step");

    // Well-formed requests from this peer are served; this also pins the wire format.
    fill_block(p.arena(), 2, 5);
    let req = Outgoing::read_req(77, 1, &[seg(2, 100, 0, 0, 16)], &[]);
    send(&mut raw, &req).await;
    let (kind, body) = recv(&mut raw).await.expect("a response");
    assert_eq!(kind, wire::READ_DATA);
    assert_eq!(body[..8], 77u64.to_le_bytes());
    assert_eq!(body[8..], block(p.arena(), 2)[100..116]);
    assert_eq!(gate.calls(), vec![("raw".to_owned(), 1, vec![2])]);

    // A length no frame can have: the stream is out of step, the connection goes.
    raw.write_all(&[0xff, 0xff, 0xff, 0xff, wire::NOTIF]).await.unwrap();
    assert_eq!(next_event(&mut p_events).await, AgentEvent::Rejected { reason: "oversized" });
    assert_eq!(next_event(&mut p_events).await, AgentEvent::Disconnected { peer: "raw".into() });
    closed(&mut raw).await;
    check_both_directions(&*p, &mut p_events, &*d, &mut d_events).await;
}

/// A fake P agent behind `listener` that accepts `d`'s dial and says hello back.
async fn fake_p_handshake(d: &TcpAgent, listener: &TcpListener) -> TcpStream {
    let md = wire::encode_metadata("fake-p", listener.local_addr().unwrap());
    let fake = async {
        let (mut s, _) = listener.accept().await.unwrap();
        let (kind, body) = recv(&mut s).await.expect("hello");
        assert_eq!(kind, wire::HELLO);
        let hello = wire::decode_hello(&body).expect("a well-formed hello");
        assert_eq!((hello.from.as_str(), hello.to.as_str()), ("d", "fake-p"));
        let challenge = Challenge::new([0x22; NONCE_LEN]);
        send(&mut s, &Outgoing::hello_challenge(challenge.nonce())).await;
        let (kind, proof) = recv(&mut s).await.expect("d's proof");
        assert_eq!(kind, wire::HELLO_PROOF);
        let proven = challenge.check(&ClusterKey::new(None), Parties::agents("d", "fake-p"), hello.nonce, &proof).expect("d proves itself");
        send(&mut s, &Outgoing::hello_ack(&proven.proof)).await;
        s
    };
    let (added, s) = within("handshake with the fake", async { tokio::join!(d.add_peer(&md), fake) }).await;
    assert_eq!(added.expect("added"), "fake-p");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_read_fails_with_disconnected_when_the_peer_dies_others_unaffected() {
    let (d, mut d_events) = agent("d", 8, 4096, Arc::new(OpenGate), quick()).await;
    let (q, mut q_events) = agent("q", 8, 4096, Arc::new(OpenGate), quick()).await;
    connect(&d, &q).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();

    // The fake dies with the read pending (silent), then, reconnected, half-way through the data.
    for half_way in [false, true] {
        let mut s = fake_p_handshake(&d, &listener).await;
        let op = ReadOp { lease_id: 4, segments: vec![seg(0, 0, 0, 0, 4096)], notif: Some(b"done".to_vec()), tag: Vec::new() };
        let d2 = Arc::clone(&d);
        let read = tokio::spawn(async move { d2.read("fake-p", op).await });
        let (kind, body) = recv(&mut s).await.expect("the read request");
        assert_eq!(kind, wire::READ_REQ, "the read is pending at the fake");
        if half_way {
            let req_id = u64::from_le_bytes(body[..8].try_into().unwrap());
            s.write_all(&wire::read_data_header(req_id, 4096)).await.unwrap();
            s.write_all(&[1u8; 2048]).await.unwrap();
        }
        drop(s);
        assert_eq!(within("the read", read).await.unwrap(), Err(TransportError::Disconnected("fake-p".into())));
        assert_eq!(next_event(&mut d_events).await, AgentEvent::Disconnected { peer: "fake-p".into() });
        let op = ReadOp { lease_id: 4, segments: vec![seg(0, 0, 0, 0, 8)], notif: None, tag: Vec::new() };
        assert_eq!(d.read("fake-p", op).await, Err(TransportError::Disconnected("fake-p".into())), "the next read fails too");
        assert_eq!(d.send_notif("fake-p", vec![1]), Err(TransportError::Disconnected("fake-p".into())));
    }
    check_both_directions(&*d, &mut d_events, &*q, &mut q_events).await;
    assert!(d_events.try_recv().is_err(), "each death was reported once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_peer_agent_fails_reads_with_disconnected_and_reports_it_once() {
    let (p, _p_events) = agent("p", 8, 4096, Arc::new(OpenGate), quick()).await;
    let (d, mut d_events) = agent("d", 8, 4096, Arc::new(OpenGate), quick()).await;
    let (q, mut q_events) = agent("q", 8, 4096, Arc::new(OpenGate), quick()).await;
    connect(&p, &d).await;
    connect(&q, &d).await;
    drop(p);
    assert_eq!(next_event(&mut d_events).await, AgentEvent::Disconnected { peer: "p".into() });
    let op = ReadOp { lease_id: 1, segments: vec![seg(0, 0, 0, 0, 8)], notif: None, tag: Vec::new() };
    assert_eq!(d.read("p", op).await, Err(TransportError::Disconnected("p".into())));
    check_both_directions(&*d, &mut d_events, &*q, &mut q_events).await;
    assert!(d_events.try_recv().is_err(), "Disconnected was reported once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_peer_works_in_either_order_and_when_both_dial_at_once() {
    connect_in_every_order(quick()).await;
}

/// SPEC S2: agents that share the cluster secret prove it to each other on every connection
/// and connect as before, whoever adds whom first, and when both dial at once (the tie-break
/// acts on proven connections only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_sharing_a_secret_connect_in_either_order_and_when_both_dial_at_once_s2() {
    connect_in_every_order(secured(SECRET)).await;
}

async fn connect_in_every_order(options: TcpOptions) {
    // One side first: its dial is held by the other until that one adds it back. Both name
    // orders, so the held dialer is once the smaller and once the larger name.
    for (first, second) in [("a", "b"), ("y", "x")] {
        let (f, mut f_events) = agent(first, 4, 4096, Arc::new(OpenGate), options.clone()).await;
        let (s, mut s_events) = agent(second, 4, 4096, Arc::new(OpenGate), options.clone()).await;
        let (f2, s_md) = (Arc::clone(&f), s.metadata());
        let first_add = tokio::spawn(async move { f2.add_peer(&s_md).await });
        eventually("the dial to be held", || s.holds(first)).await;
        assert_eq!(within("second add_peer", s.add_peer(&f.metadata())).await.expect("second adds first"), first);
        assert_eq!(within("first add_peer", first_add).await.unwrap().expect("first adds second"), second);
        assert_one_connection(&f, &s);
        check_both_directions(&*f, &mut f_events, &*s, &mut s_events).await;
        // Adding again is a no-op on the same connection.
        let before = f.conn_ends(second);
        within("re-add", f.add_peer(&s.metadata())).await.expect("idempotent");
        assert_eq!(f.conn_ends(second), before);
    }
    // Both at once, many times, to meet the races.
    for round in 0..20 {
        let (a, mut a_events) = agent(&format!("a{round}"), 2, 4096, Arc::new(OpenGate), options.clone()).await;
        let (b, mut b_events) = agent(&format!("b{round}"), 2, 4096, Arc::new(OpenGate), options.clone()).await;
        connect(&a, &b).await;
        a.send_notif(b.name(), vec![round]).unwrap();
        b.send_notif(a.name(), vec![round]).unwrap();
        assert_eq!(next_notif(&mut b_events).await, (a.name().to_owned(), vec![round]));
        assert_eq!(next_notif(&mut a_events).await, (b.name().to_owned(), vec![round]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_peer_closes_the_connection_and_refuses_the_peer_afterwards() {
    let options = TcpOptions { connect_timeout: Duration::from_millis(1500), ..quick() };
    let (p, mut p_events) = agent("p", 4, 4096, Arc::new(OpenGate), options.clone()).await;
    let (d, mut d_events) = agent("d", 4, 4096, Arc::new(OpenGate), options).await;
    connect(&p, &d).await;
    p.remove_peer("d");
    assert_eq!(next_event(&mut d_events).await, AgentEvent::Disconnected { peer: "p".into() });
    assert_eq!(p.send_notif("d", vec![1]), Err(TransportError::UnknownPeer("d".into())));
    let op = ReadOp { lease_id: 1, segments: vec![seg(0, 0, 0, 0, 8)], notif: None, tag: Vec::new() };
    assert_eq!(d.read("p", op).await, Err(TransportError::Disconnected("p".into())));
    // d tries to come back: p no longer knows it and refuses.
    assert!(matches!(within("a refused add_peer", d.add_peer(&p.metadata())).await, Err(TransportError::Io(_))));
    assert_eq!(next_event(&mut p_events).await, AgentEvent::Rejected { reason: "unknown_agent" });
    // Until p adds it again.
    connect(&p, &d).await;
    while let Ok(e) = p_events.try_recv() {
        assert_eq!(e, AgentEvent::Rejected { reason: "unknown_agent" }, "only the refused redials were reported");
    }
    check_both_directions(&*p, &mut p_events, &*d, &mut d_events).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_and_dropping_the_agent_close_listener_and_connections_and_end_tasks() {
    let (p, _p_events) = agent("p", 4, 4096, Arc::new(OpenGate), quick()).await;
    let (d, mut d_events) = agent("d", 4, 4096, Arc::new(OpenGate), quick()).await;
    connect(&p, &d).await;
    let p_addr = p.local_addr();
    p.shutdown();
    assert_eq!(next_event(&mut d_events).await, AgentEvent::Disconnected { peer: "p".into() });
    let op = ReadOp { lease_id: 1, segments: vec![seg(0, 0, 0, 0, 8)], notif: None, tag: Vec::new() };
    assert_eq!(p.read("d", op).await, Err(TransportError::Disconnected("d".into())));
    assert!(p.add_peer(&d.metadata()).await.is_err());
    within("p's listener to close", async {
        while TcpStream::connect(p_addr).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;

    // Dropping the last Arc ends every task: nothing keeps the agent's state alive.
    let weak_p = Arc::downgrade(&p.inner);
    let weak_d = Arc::downgrade(&d.inner);
    drop(p);
    drop(d);
    eventually("all tasks to end", || weak_p.strong_count() == 0 && weak_d.strong_count() == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_read_never_writes_its_blocks_afterwards() {
    let (d, _d_events) = agent("d", 8, 4096, Arc::new(OpenGate), quick()).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut fake = fake_p_handshake(&d, &listener).await;
    let d2 = Arc::clone(&d);
    let read = tokio::spawn(async move {
        d2.read(
            "fake-p",
            ReadOp { lease_id: 1, segments: vec![seg(0, 0, 0, 0, 4096), seg(1, 0, 1, 0, 4096)], notif: None, tag: Vec::new() },
        )
        .await
    });
    let (_, req) = recv(&mut fake).await.expect("request");
    let req_id = u64::from_le_bytes(req[..8].try_into().unwrap());
    // Half the response lands...
    fake.write_all(&wire::read_data_header(req_id, 8192)).await.unwrap();
    fake.write_all(&[0xAB; 4096]).await.unwrap();
    eventually("the first half to land", || block(d.arena(), 0).iter().all(|&b| b == 0xAB)).await;
    // ...then the reader gives up on it, and the blocks are its own again.
    read.abort();
    assert!(within("the aborted read", read).await.unwrap_err().is_cancelled());
    let zeros = vec![0u8; 4096];
    for b in 0..2 {
        // SAFETY: the read is gone; these blocks are ours.
        unsafe { d.arena().copy_in(b, 0, &zeros) };
    }
    fake.write_all(&[0xCD; 4096]).await.unwrap();
    // A later read is answered after the rest of the dropped one: once it is done, the rest
    // was drained.
    let d2 = Arc::clone(&d);
    let later = tokio::spawn(async move {
        d2.read("fake-p", ReadOp { lease_id: 1, segments: vec![seg(0, 0, 4, 0, 16)], notif: None, tag: Vec::new() }).await
    });
    let (_, req) = recv(&mut fake).await.expect("request");
    fake.write_all(&wire::read_data_header(u64::from_le_bytes(req[..8].try_into().unwrap()), 16)).await.unwrap();
    fake.write_all(&[0xEF; 16]).await.unwrap();
    within("the later read", later).await.unwrap().expect("read ok");
    assert!(block(d.arena(), 4)[..16].iter().all(|&b| b == 0xEF));
    assert!(block(d.arena(), 0) == zeros && block(d.arena(), 1) == zeros, "nothing landed after the read was dropped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_reads_leave_the_connection_usable() {
    const BB: usize = 128 * 1024;
    let pr = pair(64, BB).await;
    for b in 0..64 {
        fill_block(&pr.p_arena, b, u64::from(b) + 1);
    }
    let span = |lease_id, blocks: std::ops::Range<u32>| ReadOp {
        lease_id,
        segments: blocks.map(|b| seg(b, 0, b, 0, BB as u32)).collect(),
        notif: Some(b"done".to_vec()),
        tag: Vec::new(),
    };
    let (d_arena, zeros) = (pr.d.arena(), vec![0u8; BB]);
    for round in 0..5 {
        // Dropped mid-flight (or just done): from now on blocks 0..32 are ours again.
        let _ = tokio::time::timeout(Duration::from_micros(50 * round), pr.d.read("p", span(1, 0..32))).await;
        for b in 0..32 {
            // SAFETY: the read was dropped; nobody may write these blocks any more.
            unsafe { d_arena.copy_in(b, 0, &zeros) };
        }
        // Responses come in order: once this read is done, the dropped one was drained.
        within("a later read", pr.d.read("p", span(2, 32..64))).await.expect("read ok");
        for b in 0..32 {
            assert!(block(d_arena, b) == zeros, "round {round}: block {b} was written after its read was dropped");
        }
        for b in 32..64 {
            assert!(block(d_arena, b) == block(&pr.p_arena, b), "round {round}: block {b}");
        }
    }
    let gate = pr.gate.clone();
    eventually("every permit to be dropped", move || gate.live() == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notification_overtakes_a_large_response_in_flight() {
    let (p, _p_events) = agent("p", 64, 1024 * 1024, Arc::new(OpenGate), quick()).await;
    let mut raw = raw_known_peer(&p, "raw").await;
    // 64 MiB asked, nothing read yet: the response fills the socket and the writer waits.
    let segments: Vec<Segment> = (0..64).map(|b| seg(b, 0, 0, 0, 1024 * 1024)).collect();
    send(&mut raw, &Outgoing::read_req(1, 1, &segments, &[])).await;
    p.send_notif("raw", b"heartbeat".to_vec()).unwrap();
    let mut data_before = 0usize;
    loop {
        match recv(&mut raw).await.expect("frames") {
            (wire::READ_DATA, body) => data_before += body.len() - 8,
            (wire::NOTIF, body) => {
                assert_eq!(body, b"heartbeat");
                break;
            }
            (kind, _) => panic!("unexpected frame kind {kind}"),
        }
    }
    assert!(data_before < 32 * 1024 * 1024, "the notification waited for {data_before} bytes of a 64 MiB response");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reader_that_stops_reading_mid_response_is_cut_off_after_write_stall_releasing_its_permit() {
    const STALL: Duration = Duration::from_millis(500);
    /// For the socket buffers to fill before the stall starts, and for a loaded machine.
    const MARGIN: Duration = Duration::from_secs(2);
    const MIB: usize = 1024 * 1024;
    let gate = TestGate::new();
    let (p, mut p_events) = agent("p", 64, MIB, Arc::new(gate.clone()), TcpOptions { write_stall: STALL, ..quick() }).await;
    let (d, mut d_events) = agent("d", 64, MIB, Arc::new(OpenGate), quick()).await;
    connect(&p, &d).await;
    let mut raw = raw_known_peer(&p, "raw").await;
    // A read of p's own waits on that connection too: it must fail, not hang.
    let p2 = Arc::clone(&p);
    let ours = tokio::spawn(async move {
        p2.read("raw", ReadOp { lease_id: 9, segments: vec![seg(0, 0, 0, 0, 4096)], notif: None, tag: Vec::new() }).await
    });

    // raw asks for 64 MiB and reads nothing from now on: like a D that was SIGSTOPped or
    // partitioned mid-transfer. The response fills the socket buffers and p's writer waits.
    let segments: Vec<Segment> = (0..64).map(|b| seg(b, 0, 0, 0, MIB as u32)).collect();
    send(&mut raw, &Outgoing::read_req(1, 1, &segments, &[])).await;
    eventually("raw's read to be granted", || gate.calls().iter().any(|(peer, _, _)| peer == "raw")).await;
    let granted = Instant::now();

    // Meanwhile p serves d.
    fill_block(p.arena(), 3, 3);
    let op = ReadOp { lease_id: 2, segments: vec![seg(3, 0, 3, 0, MIB as u32)], notif: None, tag: Vec::new() };
    within("d's read while raw is stalled", d.read("p", op)).await.expect("d is served");
    assert!(block(d.arena(), 3) == block(p.arena(), 3));

    // The stalled response is dropped with its permit: the lease's blocks are free again.
    let released = tokio::time::timeout_at(granted + STALL + MARGIN, async {
        while gate.live() > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert!(released.is_ok(), "raw's permit still held {:?} after it was granted (write_stall {STALL:?})", granted.elapsed());
    assert_eq!(within("p's read over the stalled connection", ours).await.unwrap(), Err(TransportError::Disconnected("raw".into())));
    assert_eq!(next_event(&mut p_events).await, AgentEvent::Disconnected { peer: "raw".into() });
    assert_eq!(p.send_notif("raw", vec![1]), Err(TransportError::Disconnected("raw".into())));
    closed(&mut raw).await;

    // p keeps serving d, and reported raw's end once.
    check_both_directions(&*p, &mut p_events, &*d, &mut d_events).await;
    assert!(p_events.try_recv().is_err(), "Disconnected was reported once");
    assert_eq!(gate.live(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_to_a_peer_that_never_reads_close_the_connection_at_the_queue_cap() {
    const CAP: usize = 1024 * 1024;
    const NOTIF: usize = 64 * 1024;
    /// Far more than the cap and any loopback socket buffers: without a cap, the queue would
    /// take all of it.
    const FLOOD: usize = 64 * 1024 * 1024;
    // A long write stall, so that it is the cap that ends the connection.
    let options = TcpOptions { max_queued_bytes: CAP, write_stall: Duration::from_secs(60), ..quick() };
    let (p, mut p_events) = agent("p", 8, 4096, Arc::new(OpenGate), options).await;
    let (d, mut d_events) = agent("d", 8, 4096, Arc::new(OpenGate), quick()).await;
    connect(&p, &d).await;
    let mut raw = raw_known_peer(&p, "raw").await; // and never read from now on

    let mut sent = 0;
    let refused = loop {
        match p.send_notif("raw", vec![0x5A; NOTIF]) {
            Ok(()) => sent += NOTIF,
            Err(e) => break e,
        }
        let queued = p.queued_bytes("raw").unwrap_or(0);
        assert!(queued <= CAP, "{queued} bytes queued for raw, over the cap of {CAP}");
        assert!(sent < FLOOD, "{sent} bytes of notifications accepted for a peer that reads nothing");
    };
    assert_eq!(refused, TransportError::Disconnected("raw".into()));
    assert_eq!(p.queued_bytes("raw"), None, "the connection is gone");
    assert_eq!(next_event(&mut p_events).await, AgentEvent::Disconnected { peer: "raw".into() });
    assert_eq!(p.send_notif("raw", vec![1]), Err(TransportError::Disconnected("raw".into())));
    closed(&mut raw).await;

    check_both_directions(&*p, &mut p_events, &*d, &mut d_events).await;
    assert!(p_events.try_recv().is_err(), "Disconnected was reported once");
}

/// P and D, which share the cluster secret and are connected; P's gate records the reads it
/// is asked for.
struct SecuredPair {
    p: Arc<TcpAgent>,
    p_events: Events,
    d: Arc<TcpAgent>,
    d_events: Events,
    gate: TestGate,
}

async fn secured_pair() -> SecuredPair {
    let gate = TestGate::new();
    let (p, p_events) = agent("p", 8, 4096, Arc::new(gate.clone()), secured(SECRET)).await;
    let (d, d_events) = agent("d", 8, 4096, Arc::new(OpenGate), secured(SECRET)).await;
    connect(&p, &d).await;
    SecuredPair { p, p_events, d, d_events, gate }
}

/// The real P and D still talk over the very connection they had: a read with its
/// notification, and a notification each way; nothing else reached either engine.
async fn real_connection_unharmed(pr: &mut SecuredPair, ends: (SocketAddr, SocketAddr)) {
    assert_eq!(pr.d.conn_ends("p"), Some(ends), "d's connection to p was neither replaced nor closed");
    assert_one_connection(&pr.p, &pr.d);
    check_both_directions(&*pr.p, &mut pr.p_events, &*pr.d, &mut pr.d_events).await;
    assert!(pr.p_events.try_recv().is_err(), "p: nothing else was reported");
    assert!(pr.d_events.try_recv().is_err(), "d: nothing else was reported");
}

/// The lease id the impostors read under, so the gate shows whether it was ever asked.
const STOLEN_LEASE: u64 = 666;

/// SPEC S2, "Trust on the wire" (a): an outsider knows P's agent name (names are public) but not
/// the cluster secret, and dials D's agent as P, to answer D's heartbeats and acknowledge D's
/// reads as live (wrong answers with HTTP 200). D proves the secret, the impostor cannot check
/// the proof nor give its own: the connection is refused and counted as `unauthenticated` on
/// both sides, its notifications never reach D, and P's connection to D is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impostor_with_a_wrong_secret_dialing_d_as_p_is_refused_and_p_keeps_its_connection_s2() {
    let mut pr = secured_pair().await;
    let ends = pr.d.conn_ends("p").expect("connected");
    let (impostor, mut impostor_events) = agent("p", 8, 4096, Arc::new(OpenGate), secured(b"a guess")).await;
    let refused = within("the impostor's add_peer", impostor.add_peer(&pr.d.metadata())).await;
    match refused {
        Err(TransportError::Io(why)) => assert!(why.contains("refused our proof") && why.contains("cluster secret"), "{why}"),
        other => panic!("the impostor's dial was not refused: {other:?}"),
    }
    assert_eq!(next_event(&mut impostor_events).await, AgentEvent::Rejected { reason: "unauthenticated" });
    assert_eq!(next_event(&mut pr.d_events).await, AgentEvent::Rejected { reason: "unauthenticated" });
    // It has no connection to send on: no forged LeaseLost or ReadDoneAck reaches D.
    assert!(impostor.send_notif("d", b"ReadDoneAck live".to_vec()).is_err());
    real_connection_unharmed(&mut pr, ends).await;
}

/// SPEC S2, "Trust on the wire" (b): an outsider dials P's agent as D, to read another request's
/// KV cache and release every lease. Its dial is refused before anything else: its read never
/// reaches P's gate, let alone P's memory, and the real D keeps reading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn impostor_with_a_wrong_secret_dialing_p_as_d_reads_nothing_s2() {
    let mut pr = secured_pair().await;
    let ends = pr.d.conn_ends("p").expect("connected");
    let (impostor, mut impostor_events) = agent("d", 8, 4096, Arc::new(OpenGate), secured(b"a guess")).await;
    assert!(within("the impostor's add_peer", impostor.add_peer(&pr.p.metadata())).await.is_err(), "refused");
    assert_eq!(next_event(&mut impostor_events).await, AgentEvent::Rejected { reason: "unauthenticated" });
    assert_eq!(next_event(&mut pr.p_events).await, AgentEvent::Rejected { reason: "unauthenticated" });
    fill_block(pr.p.arena(), 0, 42);
    let op =
        ReadOp { lease_id: STOLEN_LEASE, segments: vec![seg(0, 0, 0, 0, 4096)], notif: Some(b"Release all".to_vec()), tag: Vec::new() };
    assert!(within("the impostor's read", impostor.read("p", op)).await.is_err(), "not served");
    assert!(block(impostor.arena(), 0) != block(pr.p.arena(), 0), "no byte of p's block reached the impostor");
    assert_eq!(pr.gate.calls(), Vec::new(), "p's gate was never asked");
    real_connection_unharmed(&mut pr, ends).await;
}

/// SPEC S2: what the old attack did, against either side. A raw client says `Hello` with the
/// right names (D's agent to P, P's agent to D), cannot answer the challenge, and sends a forged
/// proof followed by a read request and a notification. It gets the challenge — a bare nonce,
/// nothing to test guesses of the secret against (the dialer proves first) — and then only a
/// bare refusal of its proof: no ack, no data, no delivery; the gate is never asked. A client that never answers the
/// challenge is dropped after `proof_timeout`. Each is counted as `unauthenticated`, and P and D
/// keep their connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_hello_with_the_right_names_gets_nothing_s2() {
    let mut pr = secured_pair().await;
    let ends = pr.d.conn_ends("p").expect("connected");
    fill_block(pr.p.arena(), 0, 7);
    for (target, claimed) in [(pr.p.local_addr(), "d"), (pr.d.local_addr(), "p")] {
        let to = if claimed == "d" { "p" } else { "d" };
        for proof in [Some([0u8; TAG_LEN]), None] {
            let mut s = TcpStream::connect(target).await.expect("connect");
            send(&mut s, &Outgoing::hello(claimed, to, &[0x33; NONCE_LEN])).await;
            let (kind, body) = recv(&mut s).await.expect("the challenge");
            assert_eq!((kind, body.len()), (wire::HELLO_CHALLENGE, NONCE_LEN), "a bare nonce");
            if let Some(proof) = proof {
                let forged = [
                    Outgoing::hello_proof(&proof).to_bytes(),
                    Outgoing::read_req(1, STOLEN_LEASE, &[seg(0, 0, 0, 0, 4096)], &[]).to_bytes(),
                    Outgoing::notif(b"LeaseLost".to_vec()).to_bytes(),
                ]
                .concat();
                // The agent may have closed the connection already: that is the point.
                let _ = s.write_all(&forged).await;
                assert_eq!(recv(&mut s).await, Some((wire::HELLO_REFUSED, Vec::new())), "a bare refusal");
            }
            assert_eq!(recv(&mut s).await, None, "closed, having sent nothing else after the challenge");
            let events = if claimed == "d" { &mut pr.p_events } else { &mut pr.d_events };
            assert_eq!(next_event(events).await, AgentEvent::Rejected { reason: "unauthenticated" });
        }
    }
    assert_eq!(pr.gate.calls(), Vec::new(), "p's gate was never asked");
    real_connection_unharmed(&mut pr, ends).await;
}

/// SPEC S2, issue 22: strangers cannot keep a peer out. With `max_unproven` silent connections
/// held, each newcomer evicts the oldest (counted as `overloaded`) instead of being turned away,
/// so the real peer's dial, the newest, gets in and completes while the silent ones are still
/// there; they are dropped after `proof_timeout` without a word to count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_strangers_at_the_cap_never_keep_a_peer_out_s2() {
    let capped = TcpOptions { max_unproven: 3, max_unproven_per_source: 3, proof_timeout: Duration::from_secs(60), ..secured(SECRET) };
    let (p, mut p_events) = agent("p", 4, 4096, Arc::new(OpenGate), capped).await;
    let (d, mut d_events) = agent("d", 4, 4096, Arc::new(OpenGate), secured(SECRET)).await;
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(TcpStream::connect(p.local_addr()).await.expect("connect"));
    }
    eventually("the silent ones to take every place", || p.inner.admission.len() == 3).await;
    let first = TcpStream::connect(p.local_addr()).await.expect("connect");
    assert_eq!(next_event(&mut p_events).await, AgentEvent::Rejected { reason: "overloaded" });
    assert_eq!(recv(&mut silent[0]).await, None, "the oldest was evicted, unanswered");
    // D's dial (if D dials: P may dial first) evicts the next oldest and completes long before
    // the 60 s the strangers may wait.
    connect(&p, &d).await;
    while let Ok(e) = p_events.try_recv() {
        assert_eq!(e, AgentEvent::Rejected { reason: "overloaded" }, "only D's dial made room");
    }
    check_both_directions(&*p, &mut p_events, &*d, &mut d_events).await;
    drop(silent);
    drop(first);
    eventually("the places to be given back", || p.inner.admission.is_empty()).await;
    assert!(p_events.try_recv().is_err(), "the silent ones that left were not counted");
}

/// SPEC S2: proven connections waiting for `add_peer` have their own small cap: beyond
/// `max_handshakes`, a proven stranger is closed at once and counted as `overloaded`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proven_connections_waiting_for_add_peer_are_capped_apart_s2() {
    let capped = TcpOptions { max_handshakes: 1, hold_unknown: Duration::from_secs(60), ..secured(SECRET) };
    let (p, mut p_events) = agent("p", 4, 4096, Arc::new(OpenGate), capped).await;
    let key = ClusterKey::new(Some(SECRET));
    let (_held, _) = raw_handshake(p.local_addr(), "x1", "p", &key).await;
    eventually("the proven stranger to be held", || p.holds("x1")).await;
    let (mut over, _) = raw_handshake(p.local_addr(), "x2", "p", &key).await;
    assert_eq!(recv(&mut over).await, None, "closed at once, unanswered");
    assert_eq!(next_event(&mut p_events).await, AgentEvent::Rejected { reason: "overloaded" });
    assert_eq!(p.inner.handshakes.load(Ordering::Relaxed), 1);
}

// ---- writes (push mode, SPEC §13) ----

async fn write_pair(blocks: u32, block_bytes: usize, options: TcpOptions) -> WritePair {
    let gate = TestWriteGate::new();
    let (p, p_events) = agent("p", blocks, block_bytes, Arc::new(OpenGate), options.clone()).await;
    let (d, d_events) = agent("d", blocks, block_bytes, Arc::new(OpenGate), options).await;
    d.set_write_gate(Arc::new(gate.clone()));
    connect(&p, &d).await;
    let d_arena = Arc::clone(&d.inner.arena);
    WritePair { p, p_events, d, d_events, gate, d_arena }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_write_lands_byte_identical_then_notifies_d() {
    scenario_u4_write_round_trip(write_pair(16, 1024 * 1024, TcpOptions::default()).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_u8_refused_write_fails_with_write_refused_and_lands_nothing() {
    scenario_u4_u8_refused_write_lands_nothing(write_pair(8, 4096, quick()).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u8_out_of_range_write_fails_without_reaching_the_gate() {
    scenario_u8_out_of_range_write(write_pair(8, 4096, quick()).await).await;
}

/// SPEC U4: an engine that does not take pushed KV never set a write gate: every write into it
/// is refused, and not a byte lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_an_agent_without_a_write_gate_refuses_every_write() {
    let (p, _p_events) = agent("p", 4, 4096, Arc::new(OpenGate), quick()).await;
    let (d, mut d_events) = agent("d", 4, 4096, Arc::new(OpenGate), quick()).await;
    connect(&p, &d).await;
    fill_block(p.arena(), 0, 3);
    let op = WriteOp { key: b"k".to_vec(), segments: vec![seg(0, 0, 0, 0, 4096)], notif: Some(b"n".to_vec()), tag: Vec::new() };
    assert_eq!(within("a write", p.write("d", op)).await, Err(TransportError::WriteRefused { peer: "d".into() }));
    assert!(whole(d.arena()).iter().all(|&b| b == 0));
    assert!(d_events.try_recv().is_err(), "no notification of a refused write");
}

/// SPEC P7, U4, U8: malformed write frames from a known peer are dropped and counted, never
/// panic, and the stream stays in step; a write naming blocks outside D's arena or under a
/// refused key lands nothing (its data is skipped); more data than a write named is refused; a
/// cancelled write drops its permit without a notification. A well-formed write lands, is
/// notified, then acknowledged: this pins the wire format.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_u8_malformed_out_of_range_and_cancelled_writes_from_a_peer_land_nothing_p7() {
    let gate = TestWriteGate::new();
    let (d, mut d_events) = agent("d", 8, 4096, Arc::new(OpenGate), quick()).await;
    d.set_write_gate(Arc::new(gate.clone()));
    let mut raw = raw_known_peer(&d, "raw").await;
    let req_id_of = |body: &[u8]| u64::from_le_bytes(body[..8].try_into().expect("a request id"));

    send(&mut raw, &Outgoing::raw(wire::WRITE_REQ, vec![1, 2, 3])).await; // shorter than its id: unanswerable
    send(&mut raw, &Outgoing::raw(wire::WRITE_REQ, [&5u64.to_le_bytes()[..], &[0xff; 6]].concat())).await; // names itself
    send(&mut raw, &Outgoing::raw(wire::WRITE_ACK, vec![0; 3])).await;
    send(&mut raw, &Outgoing::raw(wire::WRITE_ERR, vec![0; 3])).await;
    send(&mut raw, &Outgoing::raw(wire::WRITE_CANCEL, vec![0; 9])).await;
    send(&mut raw, &Outgoing::raw(wire::WRITE_DATA, vec![0; 5])).await; // data shorter than its id
    send(&mut raw, &Outgoing::write_ack(12345)).await; // an answer to no write of ours: ignored
    let (tally, others) = rejections(&mut d_events, 6).await;
    assert_eq!(tally, BTreeMap::from([("malformed", 6)]));
    assert!(others.is_empty(), "{others:?}");
    let (kind, body) = recv(&mut raw).await.expect("an answer to the request that named itself");
    assert_eq!((kind, wire::decode_read_err(&body).map(|e| (e.0, e.1))), (wire::WRITE_ERR, Some((5, wire::ERR_MALFORMED))));

    // Outside the arena: refused before the gate, its data skipped.
    send(&mut raw, &Outgoing::write_req(6, &[seg(8, 0, 0, 0, 16)], b"k", b"", Some(b"x"))).await;
    send(&mut raw, &Outgoing::raw(wire::WRITE_DATA, [&6u64.to_le_bytes()[..], &[1u8; 16]].concat())).await;
    let (kind, body) = recv(&mut raw).await.expect("the refusal");
    assert_eq!((kind, wire::decode_read_err(&body).map(|e| (e.0, e.1))), (wire::WRITE_ERR, Some((6, wire::ERR_OUT_OF_RANGE))));
    assert!(gate.calls().is_empty());

    // Under a refused key: refused by the gate, its data skipped.
    gate.refuse(b"ended");
    send(&mut raw, &Outgoing::write_req(7, &[seg(1, 0, 0, 0, 16)], b"ended", b"", Some(b"x"))).await;
    send(&mut raw, &Outgoing::raw(wire::WRITE_DATA, [&7u64.to_le_bytes()[..], &[1u8; 16]].concat())).await;
    let (kind, body) = recv(&mut raw).await.expect("the refusal");
    assert_eq!((kind, wire::decode_read_err(&body).map(|e| (e.0, e.1))), (wire::WRITE_ERR, Some((7, wire::ERR_REFUSED))));

    // More data than the write named: refused, and its permit dropped.
    send(&mut raw, &Outgoing::write_req(8, &[seg(2, 0, 0, 0, 16)], b"k", b"", Some(b"x"))).await;
    send(&mut raw, &Outgoing::raw(wire::WRITE_DATA, [&8u64.to_le_bytes()[..], &[1u8; 17]].concat())).await;
    let (kind, body) = recv(&mut raw).await.expect("the refusal");
    assert_eq!((kind, wire::decode_read_err(&body).map(|e| (e.0, e.1))), (wire::WRITE_ERR, Some((8, wire::ERR_MALFORMED))));
    assert_eq!(next_event(&mut d_events).await, AgentEvent::Rejected { reason: "malformed" });

    // Cancelled half-way: the permit goes, no notification, no answer, later data skipped.
    send(&mut raw, &Outgoing::write_req(9, &[seg(3, 0, 0, 0, 64)], b"k", b"", Some(b"x"))).await;
    send(&mut raw, &Outgoing::raw(wire::WRITE_DATA, [&9u64.to_le_bytes()[..], &[2u8; 32]].concat())).await;
    let g = gate.clone();
    eventually("the cancelled write's permit to be taken", move || g.granted() == 2).await;
    send(&mut raw, &Outgoing::write_cancel(9)).await;
    let g = gate.clone();
    eventually("the cancelled write's permit to be dropped", move || g.live() == 0).await;
    send(&mut raw, &Outgoing::raw(wire::WRITE_DATA, [&9u64.to_le_bytes()[..], &[3u8; 32]].concat())).await;
    assert!(block(d.arena(), 3)[32..64].iter().all(|&b| b == 0), "nothing lands after the cancel");

    // A well-formed write: request, data in two frames, then the notification and the ack.
    send(&mut raw, &Outgoing::write_req(10, &[seg(4, 100, 0, 0, 16), seg(5, 0, 0, 0, 8)], b"key", b"tag", Some(b"done"))).await;
    send(&mut raw, &Outgoing::raw(wire::WRITE_DATA, [&10u64.to_le_bytes()[..], &[7u8; 10]].concat())).await;
    send(&mut raw, &Outgoing::raw(wire::WRITE_DATA, [&10u64.to_le_bytes()[..], &[8u8; 14]].concat())).await;
    assert_eq!(next_event(&mut d_events).await, AgentEvent::Notification { from: "raw".into(), bytes: b"done".to_vec() });
    let (kind, body) = recv(&mut raw).await.expect("the ack");
    assert_eq!((kind, req_id_of(&body), body.len()), (wire::WRITE_ACK, 10, 8));
    assert_eq!(block(d.arena(), 4)[100..116], [[7u8; 10].as_slice(), &[8u8; 6]].concat()[..]);
    assert_eq!(block(d.arena(), 5)[..8], [8u8; 8]);
    assert!(block(d.arena(), 1).iter().chain(block(d.arena(), 0).iter()).all(|&b| b == 0), "refused writes landed nothing");
    assert_eq!(gate.calls().last(), Some(&("raw".to_owned(), b"key".to_vec(), vec![4, 5], b"tag".to_vec())));
    assert_eq!(gate.live(), 0);
    assert!(d_events.try_recv().is_err(), "no other notification: not of refused, cancelled or malformed writes");
}

/// A write whose connection drops half-way fails with `Disconnected` (the driver then reports
/// the failure, SPEC U6), as does one still waiting for its answer; the peer's death is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u6_write_fails_with_disconnected_when_the_connection_drops_mid_write() {
    let (p, mut p_events) = agent("p", 8, 64 * 1024, Arc::new(OpenGate), quick()).await;
    for b in 0..8 {
        fill_block(p.arena(), b, u64::from(b));
    }
    for half_way in [false, true] {
        let mut raw = raw_known_peer(&p, "raw").await;
        let op =
            WriteOp { key: b"k".to_vec(), segments: (0..8).map(|b| seg(b, 0, b, 0, 64 * 1024)).collect(), notif: None, tag: Vec::new() };
        let p2 = Arc::clone(&p);
        let write = tokio::spawn(async move { p2.write("raw", op).await });
        let (kind, _) = recv(&mut raw).await.expect("the write request");
        assert_eq!(kind, wire::WRITE_REQ, "the request comes before its data");
        if half_way {
            let (kind, body) = recv(&mut raw).await.expect("data");
            assert_eq!(kind, wire::WRITE_DATA);
            let source: Vec<u8> = (0..8).flat_map(|b| block(p.arena(), b)).collect();
            assert!(body[8..] == source[..body.len() - 8], "the data is P's blocks, in order");
        }
        drop(raw);
        assert_eq!(within("the write", write).await.expect("write task"), Err(TransportError::Disconnected("raw".into())));
        assert_eq!(next_event(&mut p_events).await, AgentEvent::Disconnected { peer: "raw".into() });
        p.remove_peer("raw");
    }
}

/// A write future dropped before its answer cancels the write at the peer: `WriteCancel` is
/// sent, and no data of it follows the cancel (P stops reading its source blocks at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_dropped_write_future_cancels_the_write_at_the_peer() {
    // More than loopback's socket buffers hold, so the writer is still sending when it is dropped.
    const BLOCKS: u32 = 48;
    let (p, _p_events) = agent("p", BLOCKS, 1024 * 1024, Arc::new(OpenGate), TcpOptions::default()).await;
    let mut raw = raw_known_peer(&p, "raw").await;
    let segments = (0..BLOCKS).map(|b| seg(b, 0, b, 0, 1024 * 1024)).collect();
    let op = WriteOp { key: b"k".to_vec(), segments, notif: None, tag: Vec::new() };
    let p2 = Arc::clone(&p);
    let write = tokio::spawn(async move { p2.write("raw", op).await });
    let (kind, body) = recv(&mut raw).await.expect("the write request");
    assert_eq!(kind, wire::WRITE_REQ);
    let req_id = u64::from_le_bytes(body[..8].try_into().expect("an id"));
    write.abort();
    let _ = write.await;
    let mut data = 0usize;
    loop {
        let (kind, body) = recv(&mut raw).await.expect("frames until the cancel");
        match kind {
            wire::WRITE_DATA => data += body.len() - 8,
            wire::WRITE_CANCEL => {
                assert_eq!(wire::decode_req_id(&body), Some(req_id));
                break;
            }
            other => panic!("unexpected frame kind {other}"),
        }
    }
    assert!(data < BLOCKS as usize * 1024 * 1024, "the cancel came before all the data");
    // Nothing of the write follows its cancel: the next frame is the notification sent now.
    p.send_notif("raw", b"after".to_vec()).expect("queued");
    assert_eq!(recv(&mut raw).await, Some((wire::NOTIF, b"after".to_vec())));
}

/// Writes and reads share a connection's writer: a 16 MiB write P → D and a 16 MiB read by D of
/// P's blocks, at once, both land intact, with their notifications after their data; a write
/// whose request would exceed the frame limit is refused before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_writes_and_reads_at_once_on_one_connection_both_land_intact() {
    const MIB: usize = 1024 * 1024;
    let mut pair = write_pair(32, MIB, quick()).await;
    for b in 0..32 {
        fill_block(pair.p.arena(), b, 3000 + u64::from(b));
    }
    let write = WriteOp {
        key: b"k".to_vec(),
        segments: (0..16).map(|b| seg(b, 0, b, 0, MIB as u32)).collect(),
        notif: Some(b"written".to_vec()),
        tag: Vec::new(),
    };
    let read = ReadOp {
        lease_id: 1,
        segments: (16..32).map(|b| seg(b, 0, b, 0, MIB as u32)).collect(),
        notif: Some(b"read".to_vec()),
        tag: Vec::new(),
    };
    let (w, r) =
        within("a write and a read at once", async { tokio::join!(pair.p.write(pair.d.name(), write), pair.d.read(pair.p.name(), read)) })
            .await;
    assert_eq!((w, r), (Ok(()), Ok(())));
    assert!((0..32).all(|b| block(pair.d.arena(), b) == block(pair.p.arena(), b)), "both transfers landed intact");
    assert_eq!(next_notif(&mut pair.d_events).await.1, b"written");
    assert_eq!(next_notif(&mut pair.p_events).await.1, b"read");

    let too_big = WriteOp { key: b"k".to_vec(), segments: vec![seg(0, 0, 0, 0, 8)], notif: Some(vec![0; 2 * MIB]), tag: Vec::new() };
    assert!(matches!(pair.p.write(pair.d.name(), too_big).await, Err(TransportError::Io(_))));
    let too_long_key = WriteOp { key: vec![0; crate::MAX_WRITE_KEY + 1], segments: vec![], notif: None, tag: Vec::new() };
    assert!(matches!(pair.p.write(pair.d.name(), too_long_key).await, Err(TransportError::Io(_))));
    assert_eq!(pair.gate.granted(), 1, "refused before anything was sent");
}

// ---- SPEC S6: per-engine certificates ----

/// [`quick`], with the certificate of engine `id` (signed by `pki`'s cluster CA).
fn certified(pki: &crate::tls::tests::Pki, id: &str) -> TcpOptions {
    TcpOptions { tls: Some(pki.engine(id)), ..quick() }
}

async fn pair_tls(pki: &crate::tls::tests::Pki, blocks: u32, block_bytes: usize) -> Pair {
    let gate = TestGate::new();
    let (p, p_events) = agent("p", blocks, block_bytes, Arc::new(gate.clone()), certified(pki, "p")).await;
    let (d, d_events) = agent("d", blocks, block_bytes, Arc::new(OpenGate), certified(pki, "d")).await;
    connect(&p, &d).await;
    let p_arena = Arc::clone(&p.inner.arena);
    Pair { p, p_events, d, d_events, gate, p_arena }
}

/// SPEC S6: over mutual TLS, reads land byte-identical (small, and 64 MiB in 1 MiB segments),
/// a refused read copies nothing (P5), and notifications keep their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_reads_and_notifications_over_mutual_tls() {
    let pki = crate::tls::tests::Pki::new("tcp-reads");
    scenario_read_round_trip(pair_tls(&pki, 16, 1024 * 1024).await).await;
    scenario_large_read(pair_tls(&pki, 64, 1024 * 1024).await).await;
    scenario_refused_read_copies_nothing(pair_tls(&pki, 8, 4096).await).await;
    scenario_notifications_in_order(pair_tls(&pki, 8, 4096).await).await;
}

/// SPEC S6, S5 against insiders: an agent holding the cluster's certificate for engine `x`
/// cannot connect as engine `y`'s agent, dialing or dialed: both sides refuse, naming both
/// engines, and no connection carries `y`'s name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_an_agent_cannot_use_another_engines_name() {
    let pki = crate::tls::tests::Pki::new("tcp-impostor");
    let (p, mut p_events) = agent("p", 4, 4096, Arc::new(OpenGate), certified(&pki, "p")).await;
    let (liar, _liar_events) = agent("y/1/0", 4, 4096, Arc::new(OpenGate), certified(&pki, "x")).await;
    // It dials p: p's check of its certificate refuses it.
    let md = p.metadata();
    let e = within("the liar's dial", liar.add_peer(&md)).await.expect_err("refused").to_string();
    assert!(e.contains("our certificate is not the engine our agent is named for"), "{e}");
    let (tally, _) = rejections(&mut p_events, 1).await;
    assert_eq!(tally.get("unauthenticated"), Some(&1), "{tally:?}");
    assert!(p.conn_ends("y/1/0").is_none(), "no connection under y's name");

    // p dials an agent that says it is y but whose certificate is x's: p refuses, naming both.
    let (p2, _p2_events) = agent("p2", 4, 4096, Arc::new(OpenGate), certified(&pki, "p2")).await;
    let (liar2, _) = agent("y/1/1", 4, 4096, Arc::new(OpenGate), certified(&pki, "x")).await;
    let md = liar2.metadata();
    let e = within("p2's dial", p2.add_peer(&md)).await.expect_err("refused").to_string();
    assert!(e.contains("its certificate is engine \"x\"'s but it claims to be engine \"y\""), "{e}");
    assert!(p2.conn_ends("y/1/1").is_none());
}

/// SPEC S6: an agent whose certificate another CA signed gets no connection, and one without
/// certificates (plain TCP) none either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s6_another_ca_or_no_certificate_gets_no_connection() {
    let pki = crate::tls::tests::Pki::new("tcp-ca");
    let (p, mut p_events) = agent("p", 4, 4096, Arc::new(OpenGate), certified(&pki, "p")).await;
    let flags = pki.leaf("s", &["kvlease://engine/s"], true);
    let other = crate::tls::TransferTls::load(&crate::tls::TransferTlsFlags { ca: pki.dir.join("s-ca.pem"), ..flags }).unwrap();
    let (s, _) = agent("s", 4, 4096, Arc::new(OpenGate), TcpOptions { tls: Some(other), ..quick() }).await;
    let md = p.metadata();
    let e = within("the foreign dial", s.add_peer(&md)).await.expect_err("refused").to_string();
    assert!(e.contains("mutual TLS handshake failed"), "{e}");
    let (tally, _) = rejections(&mut p_events, 1).await;
    assert_eq!(tally.get("unauthenticated"), Some(&1), "{tally:?}");

    let (plain, _) = agent("q", 4, 4096, Arc::new(OpenGate), quick()).await;
    let md = p.metadata();
    assert!(within("the plain dial", plain.add_peer(&md)).await.is_err());
    assert!(p.conn_ends("q").is_none() && p.conn_ends("s").is_none());
}
