//! Test support shared by the backends: a gate that counts, refuses and scribbles, arena
//! patterns, deadline-bounded waits, and the scenarios every backend must pass.

use crate::{Agent, AgentEvent, BlockArena, ReadGate, ReadOp, ReadPermit, Segment, TransportError, WriteGate, WriteOp, WritePermit};
use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Upper bound for anything a test waits for.
pub(crate) const WAIT: Duration = Duration::from_secs(20);

pub(crate) type Events = mpsc::UnboundedReceiver<AgentEvent>;

/// Awaits `f`, failing the test after [`WAIT`].
pub(crate) async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {WAIT:?} waiting for {what}"),
    }
}

/// Waits until `cond` holds, checking every millisecond, failing the test after [`WAIT`].
pub(crate) async fn eventually(what: &str, cond: impl Fn() -> bool) {
    within(what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
}

pub(crate) async fn next_event(rx: &mut Events) -> AgentEvent {
    within("an agent event", rx.recv()).await.expect("event channel open")
}

/// The next notification, failing on any other event.
pub(crate) async fn next_notif(rx: &mut Events) -> (String, Vec<u8>) {
    match next_event(rx).await {
        AgentEvent::Notification { from, bytes } => (from, bytes),
        other => panic!("expected a notification, got {other:?}"),
    }
}

/// Deterministic bytes for `len`, different per `seed`.
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub(crate) fn fill_block(arena: &BlockArena, block: u32, seed: u64) {
    // SAFETY: tests own their arenas; nothing reads this block concurrently.
    unsafe { arena.copy_in(block, 0, &pattern(seed, arena.block_bytes())) }
}

pub(crate) fn block(arena: &BlockArena, block: u32) -> Vec<u8> {
    let mut out = vec![0; arena.block_bytes()];
    // SAFETY: in range; tests read blocks nobody writes at the time.
    unsafe { arena.copy_out(block, 0, &mut out) };
    out
}

/// A snapshot of the whole arena, at memcpy speed.
pub(crate) fn whole(arena: &BlockArena) -> Vec<u8> {
    let mut out = vec![0; arena.len()];
    for (b, chunk) in out.chunks_mut(arena.block_bytes()).enumerate() {
        // SAFETY: in range; tests read blocks nobody else writes at the time.
        unsafe { arena.copy_out(b as u32, 0, chunk) };
    }
    out
}

pub(crate) fn seg(remote_block: u32, remote_offset: u32, local_block: u32, local_offset: u32, len: u32) -> Segment {
    Segment { remote_block, remote_offset, local_block, local_offset, len }
}

/// A gate that serves every lease except those refused, counts permits, and (optionally)
/// overwrites the blocks of a read the moment its permit is dropped, as a pool reusing them at
/// release would: a backend that drops the permit before the bytes left shows garbage.
#[derive(Clone, Default)]
pub(crate) struct TestGate {
    shared: Arc<GateShared>,
}

#[derive(Default)]
struct GateShared {
    live: AtomicUsize,
    max_live: AtomicUsize,
    granted: AtomicUsize,
    refused: AtomicUsize,
    refuse: Mutex<HashSet<u64>>,
    scribble: Mutex<Option<Arc<BlockArena>>>,
    calls: Mutex<Vec<(String, u64, Vec<u32>)>>,
    /// The tag shown with each call, in order.
    tags: Mutex<Vec<Vec<u8>>>,
}

/// The byte a scribbling gate writes over released blocks.
pub(crate) const SCRIBBLE: u8 = 0xEE;

struct TestPermit {
    shared: Arc<GateShared>,
    blocks: Vec<u32>,
}

impl Drop for TestPermit {
    fn drop(&mut self) {
        if let Some(arena) = &*self.shared.scribble.lock().unwrap() {
            let junk = vec![SCRIBBLE; arena.block_bytes()];
            for &b in &self.blocks {
                // SAFETY: the test's "pool" reuses the block now that the read ended.
                unsafe { arena.copy_in(b, 0, &junk) };
            }
        }
        self.shared.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl TestGate {
    pub(crate) fn new() -> TestGate {
        TestGate::default()
    }

    pub(crate) fn refuse(&self, lease_id: u64) {
        self.shared.refuse.lock().unwrap().insert(lease_id);
    }

    pub(crate) fn scribble_on_release(&self, arena: Arc<BlockArena>) {
        *self.shared.scribble.lock().unwrap() = Some(arena);
    }

    pub(crate) fn live(&self) -> usize {
        self.shared.live.load(Ordering::SeqCst)
    }

    pub(crate) fn max_live(&self) -> usize {
        self.shared.max_live.load(Ordering::SeqCst)
    }

    pub(crate) fn granted(&self) -> usize {
        self.shared.granted.load(Ordering::SeqCst)
    }

    pub(crate) fn refused(&self) -> usize {
        self.shared.refused.load(Ordering::SeqCst)
    }

    pub(crate) fn calls(&self) -> Vec<(String, u64, Vec<u32>)> {
        self.shared.calls.lock().unwrap().clone()
    }

    pub(crate) fn tags(&self) -> Vec<Vec<u8>> {
        self.shared.tags.lock().unwrap().clone()
    }
}

impl ReadGate for TestGate {
    fn begin_read(&self, peer: &str, lease_id: u64, blocks: &[u32], tag: &[u8]) -> Option<ReadPermit> {
        let s = &self.shared;
        s.calls.lock().unwrap().push((peer.to_owned(), lease_id, blocks.to_vec()));
        s.tags.lock().unwrap().push(tag.to_vec());
        if s.refuse.lock().unwrap().contains(&lease_id) {
            s.refused.fetch_add(1, Ordering::SeqCst);
            return None;
        }
        s.granted.fetch_add(1, Ordering::SeqCst);
        let live = s.live.fetch_add(1, Ordering::SeqCst) + 1;
        s.max_live.fetch_max(live, Ordering::SeqCst);
        Some(Box::new(TestPermit { shared: Arc::clone(s), blocks: blocks.to_vec() }))
    }
}

/// Two connected agents: `p` serves reads through `gate`, `d` reads.
pub(crate) struct Pair {
    pub p: Arc<dyn Agent>,
    pub p_events: Events,
    pub d: Arc<dyn Agent>,
    pub d_events: Events,
    pub gate: TestGate,
    pub p_arena: Arc<BlockArena>,
}

/// Data written into P's blocks arrives byte-identical at D's local blocks, whole blocks and
/// slices at offsets (heterogeneous TP), and P gets the read's notification only after every
/// byte landed at D. Needs 16 blocks of ≥ 4 KiB on both sides; larger blocks make a notification
/// sent too early visible.
pub(crate) async fn scenario_read_round_trip(mut pair: Pair) {
    let bb = pair.p_arena.block_bytes() as u32;
    assert!(bb >= 4096 && pair.p_arena.num_blocks() >= 16 && pair.d.arena().num_blocks() >= 16);
    for b in 0..16 {
        fill_block(&pair.p_arena, b, 100 + u64::from(b));
    }
    let mut segments = vec![
        seg(0, 0, 3, 0, bb),            // a whole block
        seg(1, 1024, 5, 2048, 1024),    // a head slice, landing at another offset
        seg(2, bb - 96, 5, 0, 96),      // the block's tail
        seg(4, 0, 6, 0, 0),             // empty
        seg(7, 17, 6, 4000 - 333, 333), // odd sizes and offsets
    ];
    segments.extend((8..16).map(|b| seg(b, 0, 23 - b, 0, bb))); // bulk, reversed
    let mut expected = vec![0u8; pair.d.arena().len()];
    for s in &segments {
        let (from, to) = ((s.remote_offset) as usize, (s.local_block * bb + s.local_offset) as usize);
        expected[to..to + s.len as usize].copy_from_slice(&block(&pair.p_arena, s.remote_block)[from..from + s.len as usize]);
    }
    let op = ReadOp { lease_id: 42, segments, notif: Some(b"read-done".to_vec()), tag: b"prompt-digest".to_vec() };
    let (d, peer) = (Arc::clone(&pair.d), pair.p.name().to_owned());
    let read = tokio::spawn(async move { d.read(&peer, op).await });

    let (from, bytes) = next_notif(&mut pair.p_events).await;
    assert_eq!((from.as_str(), bytes.as_slice()), (pair.d.name(), &b"read-done"[..]));
    assert!(whole(pair.d.arena()) == expected, "every byte landed at D before P got the notification");
    within("the read", read).await.expect("read task").expect("read ok");
    assert!(whole(pair.d.arena()) == expected, "D's arena holds exactly the requested bytes, nothing else");
    let blocks: Vec<u32> = [0, 1, 2, 4, 7].into_iter().chain(8..16).collect();
    assert_eq!(pair.gate.calls(), vec![(pair.d.name().to_owned(), 42, blocks)], "the gate saw the lease and its blocks");
    assert_eq!(pair.gate.tags(), vec![b"prompt-digest".to_vec()], "S4: the gate saw the read's tag");

    // An empty read completes too, and still notifies.
    let op = ReadOp { lease_id: 43, segments: vec![], notif: Some(b"empty".to_vec()), tag: Vec::new() };
    within("an empty read", pair.d.read(pair.p.name(), op)).await.expect("empty read ok");
    assert_eq!(next_notif(&mut pair.p_events).await.1, b"empty");
}

/// A large read (64 MiB in 1 MiB segments, reversed block order) lands byte-identical.
pub(crate) async fn scenario_large_read(pair: Pair) {
    let n = pair.p_arena.num_blocks();
    let bb = pair.p_arena.block_bytes() as u32;
    for b in 0..n {
        fill_block(&pair.p_arena, b, 7 + u64::from(b));
    }
    let segments = (0..n).map(|b| seg(b, 0, n - 1 - b, 0, bb)).collect();
    let op = ReadOp { lease_id: 1, segments, notif: None, tag: Vec::new() };
    within("a large read", pair.d.read(pair.p.name(), op)).await.expect("large read ok");
    for b in 0..n {
        assert!(block(pair.d.arena(), n - 1 - b) == block(&pair.p_arena, b), "block {b}");
    }
}

/// SPEC P5: a refused read fails with `Refused{lease_id}`, copies nothing, sends no notification.
pub(crate) async fn scenario_refused_read_copies_nothing(mut pair: Pair) {
    for b in 0..4 {
        fill_block(&pair.p_arena, b, b.into());
    }
    pair.gate.refuse(9);
    let bb = pair.p_arena.block_bytes() as u32;
    let op =
        ReadOp { lease_id: 9, segments: vec![seg(0, 0, 0, 0, bb), seg(1, 0, 1, 0, bb)], notif: Some(b"nope".to_vec()), tag: Vec::new() };
    let r = within("a refused read", pair.d.read(pair.p.name(), op)).await;
    assert_eq!(r, Err(TransportError::Refused { lease_id: 9 }));
    assert!(whole(pair.d.arena()).iter().all(|&b| b == 0), "no byte of a refused read lands");
    assert_eq!((pair.gate.refused(), pair.gate.live()), (1, 0));
    // The refused read's notification was never sent: the next one P sees is this one.
    let op = ReadOp { lease_id: 10, segments: vec![seg(2, 0, 2, 0, bb)], notif: Some(b"ok".to_vec()), tag: Vec::new() };
    within("a served read", pair.d.read(pair.p.name(), op)).await.expect("lease 10 is served");
    assert_eq!(next_notif(&mut pair.p_events).await.1, b"ok");
}

/// SPEC P5: the permit is held while the bytes are copied out and dropped after: the test
/// gate reuses (overwrites) the blocks the moment the permit drops, and D still gets the
/// original bytes.
pub(crate) async fn scenario_permit_held_during_copy(pair: Pair) {
    let n = pair.p_arena.num_blocks().min(16);
    for b in 0..n {
        fill_block(&pair.p_arena, b, 1000 + u64::from(b));
    }
    let originals: Vec<Vec<u8>> = (0..n).map(|b| block(&pair.p_arena, b)).collect();
    pair.gate.scribble_on_release(Arc::clone(&pair.p_arena));
    let bb = pair.p_arena.block_bytes() as u32;
    let op = ReadOp { lease_id: 3, segments: (0..n).map(|b| seg(b, 0, b, 0, bb)).collect(), notif: None, tag: Vec::new() };
    within("the read", pair.d.read(pair.p.name(), op)).await.expect("read ok");
    for b in 0..n {
        assert!(block(pair.d.arena(), b) == originals[b as usize], "block {b} was read before its permit dropped");
    }
    let gate = pair.gate.clone();
    eventually("the permit to be dropped", move || gate.live() == 0).await;
    assert_eq!((pair.gate.granted(), pair.gate.max_live()), (1, 1));
    assert!(block(&pair.p_arena, 0).iter().all(|&b| b == SCRIBBLE), "the gate did reuse the blocks: the test can fail");
}

/// Notifications flow both ways, in order, with binary payloads from 0 bytes to 1 MiB.
pub(crate) async fn scenario_notifications_in_order(mut pair: Pair) {
    let mut payloads: Vec<Vec<u8>> = vec![vec![], vec![0], (0..=255u8).collect(), pattern(5, 64 * 1024), pattern(6, 1024 * 1024)];
    payloads.extend((0..300u32).map(|i| [&i.to_le_bytes()[..], &pattern(u64::from(i), (i % 40) as usize)].concat()));
    payloads.push(vec![]);
    for p in &payloads {
        pair.d.send_notif(pair.p.name(), p.clone()).expect("D→P queued");
        pair.p.send_notif(pair.d.name(), p.iter().rev().copied().collect()).expect("P→D queued");
    }
    for (i, p) in payloads.iter().enumerate() {
        let (from, bytes) = next_notif(&mut pair.p_events).await;
        assert_eq!(from, pair.d.name());
        assert!(&bytes == p, "D→P notification {i} ({} bytes) arrived intact and in order", p.len());
        let (from, bytes) = next_notif(&mut pair.d_events).await;
        assert_eq!(from, pair.p.name());
        assert!(bytes.iter().rev().eq(p.iter()), "P→D notification {i} arrived intact and in order");
    }
}

/// A segment outside either arena fails with `OutOfRange` before the gate is asked; the
/// connection keeps working.
pub(crate) async fn scenario_out_of_range(pair: Pair) {
    let n = pair.p_arena.num_blocks();
    let bb = pair.p_arena.block_bytes() as u32;
    let dn = pair.d.arena().num_blocks();
    let bad = [
        seg(n, 0, 0, 0, 16),              // no such remote block
        seg(0, bb - 8, 0, 0, 16),         // past the remote block's end
        seg(0, u32::MAX, 0, 0, u32::MAX), // offset + len overflow
        seg(u32::MAX, 0, 0, 0, 1),
        seg(0, 0, dn, 0, 16),    // no such local block
        seg(0, 0, 0, bb - 1, 2), // past the local block's end
    ];
    for s in bad {
        let op = ReadOp { lease_id: 1, segments: vec![seg(1, 0, 1, 0, 8), s], notif: Some(b"x".to_vec()), tag: Vec::new() };
        match within("an out-of-range read", pair.d.read(pair.p.name(), op)).await {
            Err(TransportError::OutOfRange(msg)) => assert!(!msg.is_empty()),
            other => panic!("{s:?}: expected OutOfRange, got {other:?}"),
        }
    }
    assert!(pair.gate.calls().is_empty(), "out-of-range reads never reach the gate");
    fill_block(&pair.p_arena, 1, 77);
    let op = ReadOp { lease_id: 1, segments: vec![seg(1, 0, 1, 0, bb)], notif: None, tag: Vec::new() };
    within("a good read", pair.d.read(pair.p.name(), op)).await.expect("still serving");
    assert!(block(pair.d.arena(), 1) == block(&pair.p_arena, 1));
}

/// Reads and notifications naming a peer never added fail at once with `UnknownPeer`.
pub(crate) async fn scenario_unknown_peer(pair: Pair) {
    let op = ReadOp { lease_id: 1, segments: vec![seg(0, 0, 0, 0, 1)], notif: None, tag: Vec::new() };
    assert_eq!(pair.d.read("nobody", op).await, Err(TransportError::UnknownPeer("nobody".into())));
    assert_eq!(pair.d.send_notif("nobody", vec![1]), Err(TransportError::UnknownPeer("nobody".into())));
    assert!(pair.d.can_refuse_reads() && pair.p.can_refuse_reads());
}

/// Both directions work: each side reads the other and notifies it.
pub(crate) async fn check_both_directions(a: &dyn Agent, a_events: &mut Events, b: &dyn Agent, b_events: &mut Events) {
    check_one_direction(a, a_events, b, b_events).await;
    check_one_direction(b, b_events, a, a_events).await;
}

/// `x` reads `y` with a notification, and `y` notifies `x`.
async fn check_one_direction(x: &dyn Agent, x_events: &mut Events, y: &dyn Agent, y_events: &mut Events) {
    fill_block(y.arena(), 0, 99);
    let op = ReadOp { lease_id: 5, segments: vec![seg(0, 0, 1, 0, 64)], notif: Some(b"done".to_vec()), tag: Vec::new() };
    within("a read", x.read(y.name(), op)).await.unwrap_or_else(|e| panic!("{} reads {}: {e}", x.name(), y.name()));
    assert!(block(x.arena(), 1)[..64] == block(y.arena(), 0)[..64]);
    assert_eq!(next_notif(y_events).await, (x.name().to_owned(), b"done".to_vec()));
    y.send_notif(x.name(), b"hi".to_vec()).expect("notify back");
    assert_eq!(next_notif(x_events).await, (y.name().to_owned(), b"hi".to_vec()));
}

// ---- writes (push mode, SPEC §13) ----

/// D's side of push-mode tests: lets writes land except under refused keys, records every call,
/// counts permits, and snapshots D's arena when a permit drops, so a backend that drops the
/// permit before the last byte landed shows it.
#[derive(Clone, Default)]
pub(crate) struct TestWriteGate {
    shared: Arc<WriteGateShared>,
}

#[derive(Default)]
struct WriteGateShared {
    live: AtomicUsize,
    granted: AtomicUsize,
    refuse: Mutex<HashSet<Vec<u8>>>,
    /// `(peer, key, blocks, tag)` of each call, in order.
    calls: Mutex<Vec<WriteCall>>,
    snapshot_of: Mutex<Option<Arc<BlockArena>>>,
    /// D's arena when each permit dropped.
    at_release: Mutex<Vec<Vec<u8>>>,
}

/// What a write gate was shown: `(peer, key, blocks, tag)`.
pub(crate) type WriteCall = (String, Vec<u8>, Vec<u32>, Vec<u8>);

struct TestWritePermit(Arc<WriteGateShared>);

impl Drop for TestWritePermit {
    fn drop(&mut self) {
        if let Some(arena) = &*self.0.snapshot_of.lock().unwrap() {
            self.0.at_release.lock().unwrap().push(whole(arena));
        }
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}

impl TestWriteGate {
    pub(crate) fn new() -> TestWriteGate {
        TestWriteGate::default()
    }

    pub(crate) fn refuse(&self, key: &[u8]) {
        self.shared.refuse.lock().unwrap().insert(key.to_vec());
    }

    pub(crate) fn snapshot_on_release(&self, arena: Arc<BlockArena>) {
        *self.shared.snapshot_of.lock().unwrap() = Some(arena);
    }

    pub(crate) fn live(&self) -> usize {
        self.shared.live.load(Ordering::SeqCst)
    }

    pub(crate) fn granted(&self) -> usize {
        self.shared.granted.load(Ordering::SeqCst)
    }

    pub(crate) fn calls(&self) -> Vec<WriteCall> {
        self.shared.calls.lock().unwrap().clone()
    }

    pub(crate) fn at_release(&self) -> Vec<Vec<u8>> {
        self.shared.at_release.lock().unwrap().clone()
    }
}

impl WriteGate for TestWriteGate {
    fn begin_write(&self, peer: &str, key: &[u8], blocks: &[u32], tag: &[u8]) -> Option<WritePermit> {
        let s = &self.shared;
        s.calls.lock().unwrap().push((peer.to_owned(), key.to_vec(), blocks.to_vec(), tag.to_vec()));
        if s.refuse.lock().unwrap().contains(key) {
            return None;
        }
        s.granted.fetch_add(1, Ordering::SeqCst);
        s.live.fetch_add(1, Ordering::SeqCst);
        Some(Box::new(TestWritePermit(Arc::clone(s))))
    }
}

/// Two connected agents: `p` writes into `d`, whose write gate is `gate`.
pub(crate) struct WritePair {
    pub p: Arc<dyn Agent>,
    pub p_events: Events,
    pub d: Arc<dyn Agent>,
    pub d_events: Events,
    pub gate: TestWriteGate,
    /// D's arena (as `d.arena()`), for the gate's snapshots.
    pub d_arena: Arc<BlockArena>,
}

/// P's blocks `0..16` filled, and D's arena as it must be after `segments` landed in a zeroed one.
fn expected_after_write(pair: &WritePair, segments: &[Segment]) -> Vec<u8> {
    let bb = pair.p.arena().block_bytes();
    let mut expected = vec![0u8; pair.d.arena().len()];
    for s in segments {
        let (from, to) = (s.local_offset as usize, s.remote_block as usize * bb + s.remote_offset as usize);
        expected[to..to + s.len as usize].copy_from_slice(&block(pair.p.arena(), s.local_block)[from..from + s.len as usize]);
    }
    expected
}

/// SPEC U4, §13: P's blocks written into D's registered blocks arrive byte-identical (whole
/// blocks, slices at offsets, odd sizes, empty segments, several MiB in reversed order); D's
/// gate saw the key, the blocks in order (each once) and the tag; D gets the write's
/// notification only after every byte landed, and the gate's permit was held until then. An
/// empty write notifies too. Needs 16 blocks of ≥ 4 KiB on both sides.
pub(crate) async fn scenario_u4_write_round_trip(mut pair: WritePair) {
    let bb = pair.p.arena().block_bytes() as u32;
    assert!(bb >= 4096 && pair.p.arena().num_blocks() >= 16 && pair.d.arena().num_blocks() >= 16);
    for b in 0..16 {
        fill_block(pair.p.arena(), b, 500 + u64::from(b));
    }
    let mut segments = vec![
        seg(3, 0, 0, 0, bb),            // a whole block
        seg(5, 2048, 1, 1024, 1024),    // a slice, landing at another offset
        seg(5, 0, 2, bb - 96, 96),      // the same destination block again: named once
        seg(6, 0, 4, 0, 0),             // empty
        seg(6, 4000 - 333, 7, 17, 333), // odd sizes and offsets
    ];
    segments.extend((8..16).map(|b| seg(b, 0, 23 - b, 0, bb))); // bulk, reversed
    let expected = expected_after_write(&pair, &segments);
    pair.gate.snapshot_on_release(Arc::clone(&pair.d_arena));
    let op =
        WriteOp { key: b"transfer-1/attempt-0".to_vec(), segments, notif: Some(b"write-done".to_vec()), tag: b"prompt-digest".to_vec() };
    let (p, peer) = (Arc::clone(&pair.p), pair.d.name().to_owned());
    let write = tokio::spawn(async move { p.write(&peer, op).await });

    let (from, bytes) = next_notif(&mut pair.d_events).await;
    assert_eq!((from.as_str(), bytes.as_slice()), (pair.p.name(), &b"write-done"[..]));
    assert!(whole(pair.d.arena()) == expected, "every byte landed at D before D got the notification");
    within("the write", write).await.expect("write task").expect("write ok");
    assert!(whole(pair.d.arena()) == expected, "D's arena holds exactly the written bytes, nothing else");
    let blocks: Vec<u32> = [3, 5, 6].into_iter().chain(8..16).collect();
    assert_eq!(
        pair.gate.calls(),
        vec![(pair.p.name().to_owned(), b"transfer-1/attempt-0".to_vec(), blocks, b"prompt-digest".to_vec())],
        "the gate saw the key, the destination blocks in order and the tag"
    );
    assert_eq!((pair.gate.granted(), pair.gate.live()), (1, 0), "the permit was dropped once the write ended");
    assert!(pair.gate.at_release() == vec![expected], "the permit was held until the last byte landed");

    // An empty write completes too, and still notifies.
    let op = WriteOp { key: b"k2".to_vec(), segments: vec![], notif: Some(b"empty".to_vec()), tag: Vec::new() };
    within("an empty write", pair.p.write(pair.d.name(), op)).await.expect("empty write ok");
    assert_eq!(next_notif(&mut pair.d_events).await.1, b"empty");
    assert!(pair.p_events.try_recv().is_err(), "the writer gets no notification of its own write");
}

/// SPEC U4, U8: a write the receiver's gate refuses (its registration ended) fails on P with
/// `WriteRefused`, lands not a byte, and delivers no notification; the link keeps working.
pub(crate) async fn scenario_u4_u8_refused_write_lands_nothing(mut pair: WritePair) {
    let bb = pair.p.arena().block_bytes() as u32;
    for b in 0..4 {
        fill_block(pair.p.arena(), b, 40 + u64::from(b));
    }
    pair.gate.refuse(b"ended");
    let op = WriteOp {
        key: b"ended".to_vec(),
        segments: vec![seg(0, 0, 0, 0, bb), seg(1, 0, 1, 0, bb)],
        notif: Some(b"nope".to_vec()),
        tag: Vec::new(),
    };
    let r = within("a refused write", pair.p.write(pair.d.name(), op)).await;
    assert_eq!(r, Err(TransportError::WriteRefused { peer: pair.d.name().to_owned() }));
    assert!(whole(pair.d.arena()).iter().all(|&b| b == 0), "no byte of a refused write lands");
    assert_eq!((pair.gate.granted(), pair.gate.live()), (0, 0));
    // The refused write's notification was never delivered: the next one D sees is this one.
    let op = WriteOp { key: b"live".to_vec(), segments: vec![seg(2, 0, 2, 0, bb)], notif: Some(b"ok".to_vec()), tag: Vec::new() };
    within("an accepted write", pair.p.write(pair.d.name(), op)).await.expect("a live registration is written");
    assert_eq!(next_notif(&mut pair.d_events).await.1, b"ok");
    assert!(block(pair.d.arena(), 2) == block(pair.p.arena(), 2));
    assert!(block(pair.d.arena(), 0).iter().all(|&b| b == 0));
}

/// SPEC U8, S2: a write naming blocks outside either arena fails with `OutOfRange` before the
/// receiver's gate is asked, lands nothing, and the link keeps working; so does one naming an
/// unknown peer (`UnknownPeer`).
pub(crate) async fn scenario_u8_out_of_range_write(pair: WritePair) {
    let bb = pair.p.arena().block_bytes() as u32;
    let (pn, dn) = (pair.p.arena().num_blocks(), pair.d.arena().num_blocks());
    let bad = [
        seg(dn, 0, 0, 0, 16),             // no such destination block
        seg(0, bb - 8, 0, 0, 16),         // past the destination block's end
        seg(0, u32::MAX, 0, 0, u32::MAX), // offset + len overflow
        seg(u32::MAX, 0, 0, 0, 1),
        seg(0, 0, pn, 0, 16),    // no such source block
        seg(0, 0, 0, bb - 1, 2), // past the source block's end
    ];
    fill_block(pair.p.arena(), 1, 9);
    for s in bad {
        let op = WriteOp { key: b"k".to_vec(), segments: vec![seg(1, 0, 1, 0, 8), s], notif: Some(b"x".to_vec()), tag: Vec::new() };
        match within("an out-of-range write", pair.p.write(pair.d.name(), op)).await {
            Err(TransportError::OutOfRange(msg)) => assert!(!msg.is_empty()),
            other => panic!("{s:?}: expected OutOfRange, got {other:?}"),
        }
    }
    assert!(pair.gate.calls().is_empty(), "out-of-range writes never reach the gate");
    assert!(whole(pair.d.arena()).iter().all(|&b| b == 0), "nothing of them landed");
    let op = WriteOp { key: b"k".to_vec(), segments: vec![seg(1, 0, 1, 0, bb)], notif: None, tag: Vec::new() };
    within("a good write", pair.p.write(pair.d.name(), op.clone())).await.expect("still writing");
    assert!(block(pair.d.arena(), 1) == block(pair.p.arena(), 1));
    assert_eq!(pair.p.write("nobody", op).await, Err(TransportError::UnknownPeer("nobody".into())));
    assert!(pair.p.can_refuse_writes() && pair.d.can_refuse_writes());
}
