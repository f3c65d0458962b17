//! The mem backend: agents in one process on a [`MemNetwork`], for tests and for the
//! deterministic simulator, which runs whole engines on it under virtual time.
//!
//! Same contract and errors as the tcp backend, without sockets: metadata is the agent's name,
//! a read asks the serving agent's [`ReadGate`] and copies arena to arena directly, a
//! notification goes onto the peer's event channel. A link works while both agents are alive,
//! each has added the other, and the network does not cut it ([`MemNetwork::partition`]). Each
//! network is its own world: there are no global statics.
//!
//! The network also carries the engines' handshake side channel ([`MemNetwork::listen`],
//! [`MemNetwork::connect`]: in-memory byte streams), and, for the simulator, seeded faults
//! ([`Faults`]): notifications lost, duplicated, delayed (so reordered), reads slowed, and
//! handshakes refused or left hanging. With [`Faults::unfenced`] reads behave as NIXL's do:
//! P is not asked, and a read, once posted, lands even if its caller gave up on it.
//!
//! Writes (push mode) mirror reads: a write asks the receiving agent's [`WriteGate`] (refusing
//! every write until [`MemAgent::set_write_gate`]) and copies arena to arena, then delivers its
//! notification. Their faults: [`Faults::write_delay`] (slow writes) and [`Faults::write_fail`]
//! (a write that lands only its first half and fails, as a broken link leaves one); unfenced, the
//! gate is not asked, as NIXL's WRITE does not ask D, and a write once posted runs to its end
//! even if its caller gave up on it (dropped its future): it reads P's source blocks and lands in
//! D's when its delay is over, whatever either side did with them meanwhile (SPEC U4, U8).

use crate::{Agent, AgentEvent, BlockArena, BoxFuture, ReadGate, ReadOp, RefuseWrites, Segment, TransportError, WriteGate, WriteOp};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::time::Duration;
use tokio::io::DuplexStream;
use tokio::sync::{mpsc, Notify};

/// How long `add_peer` waits for the peer to add us too (the tcp backend's hold).
const ADD_PEER_WAIT: Duration = Duration::from_secs(5);

/// A cloneable handle on one in-process network of agents.
#[derive(Clone, Default)]
pub struct MemNetwork {
    net: Arc<Net>,
}

impl std::fmt::Debug for MemNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = lock(&self.net.state);
        f.debug_struct("MemNetwork").field("agents", &st.agents.keys().collect::<Vec<_>>()).field("cut", &st.cut).finish()
    }
}

#[derive(Default)]
struct Net {
    state: Mutex<NetState>,
    /// Signalled when an agent appears, leaves, or adds or removes a peer.
    changed: Notify,
}

#[derive(Default)]
struct NetState {
    agents: BTreeMap<String, Weak<MemAgent>>,
    /// Cut links, as (smaller name, larger name).
    cut: BTreeSet<(String, String)>,
    /// Side-channel listeners by address.
    listeners: BTreeMap<String, mpsc::UnboundedSender<DuplexStream>>,
    next_port: u16,
    faults: Faults,
    /// splitmix64 state, from [`Faults::seed`].
    rng: u64,
    /// Writes that landed whole (the simulator's check that P counts a transfer only when its
    /// KV was written, SPEC U5).
    writes_landed: u64,
}

/// Seeded faults of a [`MemNetwork`] (all off by default). Probabilities are per message or
/// per attempt; delays are drawn uniformly from their range.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    pub seed: u64,
    /// A notification is lost.
    pub loss: f64,
    /// A notification is delivered twice.
    pub duplicate: f64,
    /// A notification's delay (different delays reorder them).
    pub delay: (Duration, Duration),
    /// A read's delay before it touches memory.
    pub read_delay: (Duration, Duration),
    /// How long a fenced read is in progress: the serving side's permit is held this long
    /// before the bytes are copied (a long read; SPEC P5 on the serving side).
    pub read_hold: (Duration, Duration),
    /// A handshake connection is refused.
    pub refuse_handshake: f64,
    /// A handshake connection is accepted by nobody: it hangs until the dialer gives up.
    pub hang_handshake: f64,
    /// Reads as NIXL does them: the serving side is not asked, and a posted read lands even if
    /// the caller stopped waiting for it. Writes too: the receiving side's gate is not asked.
    pub unfenced: bool,
    /// A write's delay before it touches memory (a slow write).
    pub write_delay: (Duration, Duration),
    /// A write fails after landing the first half of its segments (a link broken half-way):
    /// the writer gets `Disconnected`, the receiver no notification.
    pub write_fail: f64,
}

impl NetState {
    fn random(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.random() < p
    }

    fn between(&mut self, (lo, hi): (Duration, Duration)) -> Duration {
        if hi <= lo {
            return lo;
        }
        lo + (hi - lo).mul_f64(self.random())
    }
}

/// A side-channel listener on a [`MemNetwork`]; dropping it closes the address.
pub struct MemListener {
    addr: String,
    rx: mpsc::UnboundedReceiver<DuplexStream>,
    net: Weak<Net>,
}

impl MemListener {
    /// The address dialers use (`host:port`).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The next connection; `None` once the network is gone.
    pub async fn accept(&mut self) -> Option<DuplexStream> {
        self.rx.recv().await
    }
}

impl Drop for MemListener {
    fn drop(&mut self) {
        if let Some(net) = self.net.upgrade() {
            lock(&net.state).listeners.remove(&self.addr);
        }
    }
}

/// Side-channel buffer per direction.
const STREAM_BUFFER: usize = 64 * 1024;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn link_key(a: &str, b: &str) -> (String, String) {
    if a <= b {
        (a.to_owned(), b.to_owned())
    } else {
        (b.to_owned(), a.to_owned())
    }
}

impl MemNetwork {
    pub fn new() -> MemNetwork {
        MemNetwork::default()
    }

    /// Creates an agent on this network. A live agent of the same name is replaced (as a
    /// restarted process taking over an address would be); names carry an incarnation, so
    /// this only happens on purpose.
    pub fn agent(
        &self,
        name: impl Into<String>,
        arena: Arc<BlockArena>,
        gate: Arc<dyn ReadGate>,
        events: mpsc::UnboundedSender<AgentEvent>,
    ) -> Arc<MemAgent> {
        let agent = Arc::new(MemAgent {
            name: name.into(),
            arena,
            gate,
            write_gate: RwLock::new(Arc::new(RefuseWrites)),
            events,
            net: Arc::clone(&self.net),
            peers: Mutex::default(),
        });
        lock(&self.net.state).agents.insert(agent.name.clone(), Arc::downgrade(&agent));
        self.net.changed.notify_waiters();
        agent
    }

    /// Sets the network's faults and reseeds its random draws.
    pub fn set_faults(&self, faults: Faults) {
        let mut st = lock(&self.net.state);
        st.rng = faults.seed;
        st.faults = faults;
    }

    /// Writes that landed whole on this network so far.
    pub fn writes_landed(&self) -> u64 {
        lock(&self.net.state).writes_landed
    }

    /// Listens for side-channel connections at `host:port`; port 0 picks a free one.
    pub fn listen(&self, host: &str, port: u16) -> Result<MemListener, TransportError> {
        let mut st = lock(&self.net.state);
        let port = if port == 0 {
            loop {
                st.next_port = st.next_port.wrapping_add(1).max(10_000);
                if !st.listeners.contains_key(&format!("{host}:{}", st.next_port)) {
                    break st.next_port;
                }
            }
        } else {
            port
        };
        let addr = format!("{host}:{port}");
        if st.listeners.get(&addr).is_some_and(|l| !l.is_closed()) {
            return Err(TransportError::Io(format!("{addr} is in use")));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        st.listeners.insert(addr.clone(), tx);
        Ok(MemListener { addr, rx, net: Arc::downgrade(&self.net) })
    }

    /// Dials a side-channel listener. Under [`Faults`] the connection may be refused, or hang
    /// (then the dialer's own timeout ends it).
    pub async fn connect(&self, addr: &str) -> std::io::Result<DuplexStream> {
        let (refuse, hang, listener) = {
            let mut st = lock(&self.net.state);
            let (r, h) = (st.faults.refuse_handshake, st.faults.hang_handshake);
            (st.chance(r), st.chance(h), st.listeners.get(addr).cloned())
        };
        let refused = || std::io::Error::new(std::io::ErrorKind::ConnectionRefused, format!("nothing listens at {addr}"));
        let Some(listener) = listener.filter(|_| !refuse) else { return Err(refused()) };
        let (ours, theirs) = tokio::io::duplex(STREAM_BUFFER);
        if hang {
            // Accepted by nobody: the peer end stays open and silent.
            std::mem::forget(theirs);
            return Ok(ours);
        }
        listener.send(theirs).map_err(|_| refused())?;
        Ok(ours)
    }

    /// Cuts (`true`) or heals (`false`) the link between agents `a` and `b`. While cut, reads
    /// and writes fail with `Disconnected` and notifications are silently lost; cutting reports
    /// `Disconnected` to each side that had added the other.
    pub fn partition(&self, a: &str, b: &str, cut: bool) {
        let newly_cut = {
            let mut st = lock(&self.net.state);
            if cut {
                st.cut.insert(link_key(a, b))
            } else {
                st.cut.remove(&link_key(a, b));
                false
            }
        };
        if newly_cut {
            for (x, y) in [(a, b), (b, a)] {
                if let Some(agent) = self.net.lookup(x) {
                    if agent.knows(y) {
                        let _ = agent.events.send(AgentEvent::Disconnected { peer: y.to_owned() });
                    }
                }
            }
        }
        self.net.changed.notify_waiters();
    }
}

impl Net {
    fn lookup(&self, name: &str) -> Option<Arc<MemAgent>> {
        lock(&self.state).agents.get(name).and_then(Weak::upgrade)
    }

    fn is_cut(&self, a: &str, b: &str) -> bool {
        lock(&self.state).cut.contains(&link_key(a, b))
    }
}

/// An in-process transfer agent.
pub struct MemAgent {
    name: String,
    arena: Arc<BlockArena>,
    gate: Arc<dyn ReadGate>,
    /// Judges peers' writes into our arena; refuses every one until the engine sets its own.
    write_gate: RwLock<Arc<dyn WriteGate>>,
    events: mpsc::UnboundedSender<AgentEvent>,
    net: Arc<Net>,
    peers: Mutex<BTreeSet<String>>,
}

impl std::fmt::Debug for MemAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemAgent").field("name", &self.name).field("peers", &*lock(&self.peers)).finish()
    }
}

/// Why a link to a peer is not usable.
enum LinkDown {
    /// We never added the peer (or removed it).
    Unknown,
    /// The peer is gone or does not know us (any more).
    Gone,
    /// The network cut the link.
    Cut,
}

impl MemAgent {
    /// The gate that judges peers' writes into our arena (push mode, SPEC U4, U8); until this
    /// is called every write is refused ([`RefuseWrites`]).
    pub fn set_write_gate(&self, gate: Arc<dyn WriteGate>) {
        *self.write_gate.write().unwrap_or_else(PoisonError::into_inner) = gate;
    }

    fn knows(&self, peer: &str) -> bool {
        lock(&self.peers).contains(peer)
    }

    fn link(&self, peer: &str) -> Result<Arc<MemAgent>, LinkDown> {
        if !self.knows(peer) {
            return Err(LinkDown::Unknown);
        }
        let other = self.net.lookup(peer).ok_or(LinkDown::Gone)?;
        if !other.knows(&self.name) {
            return Err(LinkDown::Gone);
        }
        if self.net.is_cut(&self.name, peer) {
            return Err(LinkDown::Cut);
        }
        Ok(other)
    }

    /// A fenced read, at once, or with the serving side's permit held for `hold` first.
    async fn read_fenced(&self, peer: &str, op: ReadOp, hold: Duration) -> Result<(), TransportError> {
        let other = self.link(peer).map_err(|down| match down {
            LinkDown::Unknown => TransportError::UnknownPeer(peer.to_owned()),
            LinkDown::Gone | LinkDown::Cut => TransportError::Disconnected(peer.to_owned()),
        })?;
        for s in &op.segments {
            other.arena.check(s.remote_block, s.remote_offset, s.len, peer)?;
            self.arena.check(s.local_block, s.local_offset, s.len, "our")?;
        }
        // In the order the read names them (SPEC S4: the gate checks it), a block split over
        // several segments counted once.
        let mut blocks: Vec<u32> = op.segments.iter().map(|s| s.remote_block).collect();
        blocks.dedup();
        let permit =
            other.gate.begin_read(&self.name, op.lease_id, &blocks, &op.tag).ok_or(TransportError::Refused { lease_id: op.lease_id })?;
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        let same_arena = Arc::ptr_eq(&self.arena, &other.arena);
        for s in &op.segments {
            // SAFETY: both ranges passed `contains`; the permit keeps the remote blocks from
            // being reused (SPEC P5) and the caller owns its local blocks during the read.
            unsafe {
                if same_arena {
                    // Source and destination may overlap: go through a buffer.
                    let mut tmp = vec![0; s.len as usize];
                    other.arena.copy_out(s.remote_block, s.remote_offset as usize, &mut tmp);
                    self.arena.copy_in(s.local_block, s.local_offset as usize, &tmp);
                } else {
                    let start = s.remote_block as usize * other.arena.block_bytes() + s.remote_offset as usize;
                    let src = std::slice::from_raw_parts(other.arena.as_ptr().add(start), s.len as usize);
                    self.arena.copy_in(s.local_block, s.local_offset as usize, src);
                }
            }
        }
        drop(permit);
        if let Some(bytes) = op.notif {
            let _ = other.events.send(AgentEvent::Notification { from: self.name.clone(), bytes });
        }
        Ok(())
    }
}

/// How a posted write goes, drawn from the network's faults when it is posted.
struct WriteFate {
    delay: Duration,
    fail: bool,
    unfenced: bool,
}

impl MemAgent {
    /// A write: checked, judged by the receiver's gate (unless unfenced), delayed, landed (half
    /// of it when it fails), then its notification.
    async fn write_to(&self, peer: &str, op: WriteOp, fate: WriteFate) -> Result<(), TransportError> {
        let down = |down| match down {
            LinkDown::Unknown => TransportError::UnknownPeer(peer.to_owned()),
            LinkDown::Gone | LinkDown::Cut => TransportError::Disconnected(peer.to_owned()),
        };
        let other = self.link(peer).map_err(down)?;
        if op.key.len() > crate::MAX_WRITE_KEY {
            return Err(TransportError::Io(format!("a write key of {} bytes exceeds the limit of {}", op.key.len(), crate::MAX_WRITE_KEY)));
        }
        for s in &op.segments {
            self.arena.check(s.local_block, s.local_offset, s.len, "our")?;
            other.arena.check(s.remote_block, s.remote_offset, s.len, peer)?;
        }
        let permit = if fate.unfenced {
            None
        } else {
            // In the order the write names them, a block split over several segments once.
            let mut blocks: Vec<u32> = op.segments.iter().map(|s| s.remote_block).collect();
            blocks.dedup();
            let gate = Arc::clone(&other.write_gate.read().unwrap_or_else(PoisonError::into_inner));
            let tag = &op.tag[..op.tag.len().min(256)];
            Some(
                gate.begin_write(&self.name, &op.key, &blocks, tag)
                    .ok_or_else(|| TransportError::WriteRefused { peer: peer.to_owned() })?,
            )
        };
        if fate.unfenced {
            // As NIXL: posted now, lands after the delay whether or not anyone still waits.
            let (done_tx, done_rx) = tokio::sync::oneshot::channel();
            let (me, name, net) = (Arc::clone(&self.arena), self.name.clone(), Arc::clone(&self.net));
            let peer_name = peer.to_owned();
            tokio::spawn(async move {
                tokio::time::sleep(fate.delay).await;
                let _ = done_tx.send(land_write_unfenced(&me, &name, &net, &other, &peer_name, op, fate.fail));
            });
            return done_rx.await.unwrap_or_else(|_| Err(TransportError::Disconnected(peer.to_owned())));
        }
        if !fate.delay.is_zero() {
            tokio::time::sleep(fate.delay).await;
        }
        // The link may have broken while the write was on its way.
        let other = self.link(peer).map_err(down)?;
        let landing = if fate.fail { &op.segments[..op.segments.len() / 2] } else { &op.segments[..] };
        copy_to_peer(&self.arena, &other.arena, landing);
        drop(permit);
        if fate.fail {
            return Err(TransportError::Disconnected(peer.to_owned()));
        }
        lock(&self.net.state).writes_landed += 1;
        if let Some(bytes) = op.notif {
            let _ = other.events.send(AgentEvent::Notification { from: self.name.clone(), bytes });
        }
        Ok(())
    }
}

/// Copies each segment's `local_*` range of `ours` to its `remote_*` range of `theirs` (which
/// may be the same arena), through a buffer.
fn copy_to_peer(ours: &BlockArena, theirs: &BlockArena, segments: &[Segment]) {
    for s in segments {
        let mut tmp = vec![0; s.len as usize];
        // SAFETY: both ranges were checked against their arenas; the writer owns its source
        // blocks while its future lives, and the receiver's permit (or, unfenced, the core's
        // deadline rules, SPEC U8) keeps the destination blocks from reuse.
        unsafe {
            ours.copy_out(s.local_block, s.local_offset as usize, &mut tmp);
            theirs.copy_in(s.remote_block, s.remote_offset as usize, &tmp);
        }
    }
}

/// An unfenced write lands: our source bytes as they are now (P may have reused the blocks),
/// into the peer's blocks (D may have reused them too); then its notification, as NIXL's that
/// follows the WRITE. A peer that went away takes nothing.
fn land_write_unfenced(
    ours: &BlockArena,
    name: &str,
    net: &Net,
    other: &MemAgent,
    peer: &str,
    op: WriteOp,
    fail: bool,
) -> Result<(), TransportError> {
    if !other.knows(name) || net.is_cut(name, peer) {
        return Err(TransportError::Disconnected(peer.to_owned()));
    }
    let landing = if fail { &op.segments[..op.segments.len() / 2] } else { &op.segments[..] };
    copy_to_peer(ours, &other.arena, landing);
    if fail {
        return Err(TransportError::Disconnected(peer.to_owned()));
    }
    lock(&net.state).writes_landed += 1;
    if let Some(bytes) = op.notif {
        let _ = other.events.send(AgentEvent::Notification { from: name.to_owned(), bytes });
    }
    Ok(())
}

/// An unfenced read lands: P's bytes, whatever they are now, into our blocks; then its
/// notification, as a NIXL notification that follows the READ.
fn land_unfenced(ours: &BlockArena, name: &str, other: &MemAgent, op: ReadOp) -> Result<(), TransportError> {
    for s in &op.segments {
        other.arena.check(s.remote_block, s.remote_offset, s.len, &other.name)?;
        ours.check(s.local_block, s.local_offset, s.len, "our")?;
    }
    for s in &op.segments {
        let mut tmp = vec![0; s.len as usize];
        // SAFETY: both ranges were checked; like NIXL, nothing stops P from reusing the block
        // meanwhile: that is what the lease's ReadDone acknowledgement is for.
        unsafe {
            other.arena.copy_out(s.remote_block, s.remote_offset as usize, &mut tmp);
            ours.copy_in(s.local_block, s.local_offset as usize, &tmp);
        }
    }
    if let Some(bytes) = op.notif {
        let _ = other.events.send(AgentEvent::Notification { from: name.to_owned(), bytes });
    }
    Ok(())
}

impl MemAgent {
    /// Puts a notification on `other`'s channel, through the network's faults.
    fn deliver(&self, other: &Arc<MemAgent>, bytes: Vec<u8>) {
        let (lost, delays) = {
            let mut st = lock(&self.net.state);
            let f = st.faults.clone();
            let lost = st.chance(f.loss);
            let copies = if st.chance(f.duplicate) { 2 } else { 1 };
            let delays: Vec<Duration> = (0..copies).map(|_| st.between(f.delay)).collect();
            (lost, delays)
        };
        if lost {
            return;
        }
        for delay in delays {
            let ev = AgentEvent::Notification { from: self.name.clone(), bytes: bytes.clone() };
            if delay.is_zero() {
                let _ = other.events.send(ev);
            } else {
                let events = other.events.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = events.send(ev);
                });
            }
        }
    }
}

impl Drop for MemAgent {
    fn drop(&mut self) {
        let others: Vec<Arc<MemAgent>> = {
            let mut st = lock(&self.net.state);
            let me: *const MemAgent = self;
            if st.agents.get(&self.name).is_some_and(|w| std::ptr::eq(w.as_ptr(), me)) {
                st.agents.remove(&self.name);
            }
            st.agents.values().filter_map(Weak::upgrade).collect()
        };
        let peers = std::mem::take(&mut *lock(&self.peers));
        for other in others {
            if peers.contains(&other.name) && other.knows(&self.name) {
                let _ = other.events.send(AgentEvent::Disconnected { peer: self.name.clone() });
            }
        }
        self.net.changed.notify_waiters();
    }
}

impl Agent for MemAgent {
    fn name(&self) -> &str {
        &self.name
    }

    fn metadata(&self) -> Vec<u8> {
        self.name.as_bytes().to_vec()
    }

    /// Registers the peer, then waits (up to 5 s, like the tcp backend's hold) until the peer
    /// has added us too, so that both directions work when it returns.
    fn add_peer<'a>(&'a self, metadata: &'a [u8]) -> BoxFuture<'a, Result<String, TransportError>> {
        Box::pin(async move {
            let name = match std::str::from_utf8(metadata) {
                Ok("") => return Err(TransportError::BadMetadata("empty agent name".into())),
                Ok(n) if n == self.name => return Err(TransportError::BadMetadata(format!("{n:?} is this agent's own metadata"))),
                Ok(n) => n.to_owned(),
                Err(_) => return Err(TransportError::BadMetadata("mem agent metadata is a UTF-8 name".into())),
            };
            lock(&self.peers).insert(name.clone());
            self.net.changed.notify_waiters();
            let deadline = tokio::time::Instant::now() + ADD_PEER_WAIT;
            loop {
                let notified = self.net.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if !self.knows(&name) {
                    return Err(TransportError::UnknownPeer(name));
                }
                match self.net.lookup(&name) {
                    None => return Err(TransportError::Io(format!("no agent {name:?} on this network"))),
                    Some(other) if other.knows(&self.name) => return Ok(name),
                    Some(_) => {}
                }
                if tokio::time::timeout_at(deadline, notified).await.is_err() {
                    return Err(TransportError::Io(format!("{name} has not added us within {ADD_PEER_WAIT:?}")));
                }
            }
        })
    }

    fn remove_peer(&self, peer: &str) {
        if lock(&self.peers).remove(peer) {
            if let Some(other) = self.net.lookup(peer) {
                if other.knows(&self.name) {
                    let _ = other.events.send(AgentEvent::Disconnected { peer: self.name.clone() });
                }
            }
        }
        self.net.changed.notify_waiters();
    }

    fn read<'a>(&'a self, peer: &'a str, op: ReadOp) -> BoxFuture<'a, Result<(), TransportError>> {
        let (delay, hold, unfenced) = {
            let mut st = lock(&self.net.state);
            let (range, hold) = (st.faults.read_delay, st.faults.read_hold);
            (st.between(range), st.between(hold), st.faults.unfenced)
        };
        Box::pin(async move {
            if !unfenced {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                return self.read_fenced(peer, op, hold).await;
            }
            // As NIXL: posted now, lands after the delay whether or not anyone still waits.
            let other = self.link(peer).map_err(|_| TransportError::Disconnected(peer.to_owned()))?;
            let (done_tx, done_rx) = tokio::sync::oneshot::channel();
            let (me, name) = (Arc::clone(&self.arena), self.name.clone());
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = done_tx.send(land_unfenced(&me, &name, &other, op));
            });
            done_rx.await.unwrap_or_else(|_| Err(TransportError::Disconnected(peer.to_owned())))
        })
    }

    fn write<'a>(&'a self, peer: &'a str, op: WriteOp) -> BoxFuture<'a, Result<(), TransportError>> {
        let fate = {
            let mut st = lock(&self.net.state);
            let (range, p, unfenced) = (st.faults.write_delay, st.faults.write_fail, st.faults.unfenced);
            WriteFate { delay: st.between(range), fail: st.chance(p), unfenced }
        };
        Box::pin(self.write_to(peer, op, fate))
    }

    fn send_notif(&self, peer: &str, bytes: Vec<u8>) -> Result<(), TransportError> {
        match self.link(peer) {
            Ok(other) => {
                self.deliver(&other, bytes);
                Ok(())
            }
            // Lost on the cut link, as a datagram would be; the sender cannot tell.
            Err(LinkDown::Cut) => Ok(()),
            Err(LinkDown::Unknown) => Err(TransportError::UnknownPeer(peer.to_owned())),
            Err(LinkDown::Gone) => Err(TransportError::Disconnected(peer.to_owned())),
        }
    }

    fn can_refuse_reads(&self) -> bool {
        !lock(&self.net.state).faults.unfenced
    }

    fn can_refuse_writes(&self) -> bool {
        !lock(&self.net.state).faults.unfenced
    }

    fn arena(&self) -> &BlockArena {
        &self.arena
    }
}

#[cfg(test)]
mod tests;
