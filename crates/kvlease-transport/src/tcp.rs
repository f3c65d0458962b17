//! The tcp backend: one TCP connection per pair of agents, carrying one-sided reads and
//! notifications both ways (the wire format is in [`wire`]).
//!
//! Who talks to us (SPEC S2, P7): only agents introduced by [`Agent::add_peer`] that prove they
//! hold the cluster secret ([`TcpOptions::secret`]). A name proves nothing by itself: agent names
//! (`{engine_id}/{incarnation}/{rank}`) are public, any HTTP client can learn them. So every
//! connection is mutually authenticated before either side adopts it (`K` the secret), with the
//! challenge-response the engine's side channel uses too (the crate's `auth` module):
//!
//! ```text
//! dialer D                                          acceptor P
//!   Hello{from D, to P, nonce_d}                 →
//!                                                ←  HelloChallenge{nonce_p}
//!   HelloProof{HMAC(K, "dial" · D · P · nonce_d · nonce_p)} →
//!                                                ←  HelloAck or HelloNack{HMAC(K, "accept" · D · P · nonce_d · nonce_p)}
//! ```
//!
//! Why this shape: each side proves the secret on a nonce the other chose just now, so nothing
//! recorded from an earlier connection can be replayed; both names (with their incarnations) and
//! a label per direction are in every proof, so a proof is worth nothing for another pair, for
//! the other direction, or reflected back. **The dialer proves first**: anyone can reach an
//! acceptor's port, and it hands out nothing computed from the secret until the dialer has
//! proven it holds it, so nobody gets a MAC to test guesses of a weak secret against offline (a
//! dialer only dials agents its engine was introduced to over the signed handshake). The dialer
//! checks the acceptor's proof before it adopts the connection or believes a `HelloNack`, and
//! says so in `add_peer`'s error when it fails. It costs one round trip per connection more than
//! an unauthenticated hello, and nothing per frame.
//!
//! The acceptor checks the proof *before* it looks at its peers: the hold for `add_peer`, the
//! tie-break between simultaneous dials and the replacement of an older connection act only on
//! proven connections. A connection that does not prove itself (a wrong proof, anything else, or
//! nothing within [`TcpOptions::proof_timeout`]) is closed and counted as `unauthenticated` (as
//! `unknown_agent` when it never said hello), and never touches the connection of the agent it
//! claimed to be. Notifications and reads travel only on adopted connections, so they are
//! authenticated by construction.
//!
//! What it does not do by itself: authenticate each frame. An attacker on the path, who can
//! inject into or take over an established TCP connection, is out of scope unless the engines
//! hold certificates. Without a secret the exchange runs under the empty key and proves nothing:
//! the agents must then listen on loopback only (SPEC S3; the binary enforces it).
//!
//! With per-engine certificates ([`TcpOptions::tls`], SPEC S6) every connection first runs
//! mutual TLS ([`crate::tls`]) and everything above travels inside it, so each frame is
//! authenticated and encrypted. The dialer refuses an acceptor whose certificate is not the
//! engine of the agent it dialed; the acceptor refuses (`HelloRefused`, counted
//! `unauthenticated`, logged naming both) a `Hello` from an agent that is not its certificate's
//! engine's, before its challenge. So a connection's agent name — under which the engine keeps
//! leases (S5) and serves reads — is the certificate's engine, not a claim: an insider with the
//! cluster secret and a certificate for X cannot connect as Y. The plain reader's zero-copy path
//! becomes a copy out of the TLS buffer.
//!
//! What a stranger can cost us, and why it cannot keep a peer out (issue 22): a handshake
//! frame's length is checked (at most `MAX_HELLO`, about 2 KiB) before its body is read, and the
//! handshake buffers nothing else. Until it has proven the secret, a connection is one of at most
//! [`TcpOptions::max_unproven`] (at most [`TcpOptions::max_unproven_per_source`] from one address)
//! and must prove itself within [`TcpOptions::proof_timeout`]; a newcomer beyond either cap
//! evicts the oldest unproven connection (of its own address first, counted as `overloaded`), so
//! a real peer, which answers within a round trip, always gets in (`crate::admission`). Proven
//! connections waiting for `add_peer` are capped apart ([`TcpOptions::max_handshakes`]); strangers
//! never take their places. Established connections run on their own tasks: nothing on them
//! waits for a handshake.
//!
//! A proven connection from an agent not (yet) added is held for `hold_unknown` waiting for the
//! engine's `add_peer`, then dropped and counted as `unknown_agent`. When both sides dial at
//! once, the connection dialed by the smaller name wins.
//!
//! Per connection, a reader task parses frames (serving read requests through the [`ReadGate`],
//! handing read data and notifications on) and a writer task owns the socket's write half.
//! The writer sends control frames (notifications, requests, errors) before the next chunk of a
//! read response, so heartbeats are not stuck behind a 64 MiB transfer, and writes response
//! bytes straight from the arena with vectored writes while it holds the read's permit
//! (SPEC P5). A peer that stops reading (stopped, partitioned) must not pin those permits, nor
//! grow our memory: a socket write that makes no progress for [`TcpOptions::write_stall`], or
//! more than [`TcpOptions::max_queued_bytes`] waiting to be sent, closes the connection as
//! stalled (SPEC §1): its queued responses are dropped with their permits, its pending reads fail
//! with `Disconnected`, and `Disconnected` is reported.
//!
//! The reading side receives response bytes straight into its arena with vectored non-blocking
//! reads, each done under the read's lock; a read future that is dropped takes that lock to
//! cancel, so once it is gone nothing writes its blocks any more. Neither side copies the bulk
//! bytes itself: the kernel's two copies are all.
//!
//! Writes (push mode, SPEC §13) run the other way on the same connection: the writer (P) sends
//! a `WriteReq` naming the receiver's registration key and blocks, then the data in chunks on
//! its bulk queue, without waiting for an answer. The receiver (D) asks its [`WriteGate`] when
//! the request arrives: refused, it answers `WriteErr` and skips the data (not a byte lands,
//! SPEC U4, U8); allowed, it lands the data straight into its arena as a read's response lands,
//! holding the gate's permit, delivers the request's notification once the last byte landed,
//! and answers `WriteAck`, which resolves the writer's future. The writer copies each chunk out
//! of its arena under a lock the write future takes to cancel (one copy more than a read): its
//! source blocks are the future's only while the future lives, and a dropped future must stop
//! the reading of them at once. It then sends `WriteCancel`, and the receiver drops the write.
//! A connection that closes fails the writes in flight on both sides (`Disconnected` on the
//! writer; the receiver drops their permits, after the last fill under way).

mod stream;
mod wire;

use crate::admission::{Admission, Unproven};
use crate::auth;
use crate::tls;
use crate::{
    Agent, AgentEvent, BlockArena, BoxFuture, ReadGate, ReadOp, ReadPermit, RefuseWrites, Segment, TransportError, WriteGate, WriteOp,
    WritePermit,
};
use kvlease_core::auth::{Answer, Challenge, ClusterKey, Nonces, Parties, Proven};
use std::collections::HashMap;
use std::future::Future;
use std::io::{self, IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;
use stream::{Rd, Wr};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::time::Instant;
use wire::Outgoing;

/// Read response bytes per `ReadData` frame: small enough to interleave control frames soon,
/// large enough that per-frame costs vanish.
const CHUNK: usize = 1024 * 1024;
/// Arena slices gathered into one vectored write (Linux allows 1024).
const MAX_IOV: usize = 128;
/// Control frames gathered into one vectored write.
const MAX_BATCH: usize = 64;
/// The reader's socket buffer: small frames are parsed from it, large payloads bypass it.
const READ_BUFFER: usize = 16 * 1024;
/// A frame header announcing more than this is not a frame: the stream is out of step, so the
/// connection is closed instead of draining it.
const DESYNC_LEN: usize = 256 * 1024 * 1024;
/// After a `HelloNack`, how long to wait for the peer's own connection before dialing again.
const NACK_RETRY: Duration = Duration::from_millis(500);

/// Tunables of a [`TcpAgent`].
#[derive(Clone)]
pub struct TcpOptions {
    /// The cluster secret (`--kv-transfer-secret-file`): every connection proves it both ways
    /// (SPEC S2; see the module doc). `None`: the handshake runs under the empty key and proves
    /// nothing, so listen on loopback only (SPEC S3).
    pub secret: Option<Vec<u8>>,
    /// How long a dialer has to say hello and prove the secret before its connection is dropped
    /// (as `unknown_agent` without a hello, `unauthenticated` without the proof). Short: a peer
    /// answers within a round trip, and a stranger holds its place no longer than this.
    pub proof_timeout: Duration,
    /// The most inbound connections that have not proven the secret yet; a newcomer beyond it
    /// evicts the oldest (counted as `overloaded`), so strangers can never keep a peer out.
    pub max_unproven: usize,
    /// Of those, the most from one address: a newcomer from an address at this cap evicts that
    /// address's oldest unproven connection, not another address's.
    pub max_unproven_per_source: usize,
    /// How long a proven connection from an agent not yet added waits for `add_peer` before it
    /// is dropped as `unknown_agent`.
    pub hold_unknown: Duration,
    /// The most proven inbound connections waiting for `add_peer` (or being adopted) at once;
    /// more are closed at once and counted as `overloaded`. Only holders of the secret get here.
    pub max_handshakes: usize,
    /// How long `add_peer` tries to get a connection up.
    pub connect_timeout: Duration,
    /// The largest notification (and control frame) accepted; larger frames from a peer are
    /// dropped as `oversized` and larger `send_notif`s refused.
    pub max_frame: usize,
    /// How long one socket write may make no progress before the connection is closed as
    /// stalled: the peer stopped reading (stopped process, partition). Its queued and in-flight
    /// responses are dropped, releasing their read permits, so a dead peer pins no blocks for
    /// longer than this (SPEC §1).
    pub write_stall: Duration,
    /// The most bytes a connection may have waiting to be sent: control frames in full, read
    /// responses by their request only (their payload streams from the arena). Queueing beyond
    /// it closes the connection as stalled. Keep it well above `max_frame`.
    pub max_queued_bytes: usize,
    /// The address peers are told to dial (in [`Agent::metadata`]), when it is not the one the
    /// agent listens on: a wildcard bind (`0.0.0.0`) behind an address other machines reach.
    pub advertise: Option<std::net::IpAddr>,
    /// Per-engine certificates (SPEC S6, `--kv-transfer-tls-*`): every connection runs mutual
    /// TLS first, and a peer whose certificate is not its agent name's engine is refused, naming
    /// both. `None`: plain TCP, as before.
    pub tls: Option<tls::TransferTls>,
}

impl std::fmt::Debug for TcpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpOptions")
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("proof_timeout", &self.proof_timeout)
            .field("max_unproven", &self.max_unproven)
            .field("max_unproven_per_source", &self.max_unproven_per_source)
            .field("hold_unknown", &self.hold_unknown)
            .field("max_handshakes", &self.max_handshakes)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_frame", &self.max_frame)
            .field("write_stall", &self.write_stall)
            .field("max_queued_bytes", &self.max_queued_bytes)
            .field("advertise", &self.advertise)
            .field("tls", &self.tls)
            .finish()
    }
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            secret: None,
            proof_timeout: Duration::from_secs(2),
            max_unproven: 1024,
            max_unproven_per_source: 256,
            hold_unknown: Duration::from_secs(5),
            max_handshakes: 64,
            connect_timeout: Duration::from_secs(10),
            max_frame: 16 * 1024 * 1024,
            write_stall: Duration::from_secs(10),
            max_queued_bytes: 64 * 1024 * 1024,
            advertise: None,
            tls: None,
        }
    }
}

/// A transfer agent over TCP. Dropping the last `Arc` (or [`TcpAgent::shutdown`]) closes the
/// listener and every connection.
pub struct TcpAgent {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TcpAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpAgent").field("name", &self.inner.name).field("addr", &self.inner.addr).finish()
    }
}

struct Inner {
    name: String,
    addr: SocketAddr,
    arena: Arc<BlockArena>,
    gate: Arc<dyn ReadGate>,
    /// Asked before a peer's write lands in our arena ([`TcpAgent::set_write_gate`]); refuses
    /// every write until the engine sets its own.
    write_gate: RwLock<Arc<dyn WriteGate>>,
    events: mpsc::UnboundedSender<AgentEvent>,
    options: TcpOptions,
    /// The key of every handshake proof, from `options.secret`.
    key: ClusterKey,
    /// Inbound connections that have not proven the secret yet (see [`TcpOptions::max_unproven`]).
    admission: Admission,
    /// Proven inbound connections not yet adopted nor closed (see [`TcpOptions::max_handshakes`]).
    handshakes: AtomicUsize,
    state: Mutex<State>,
    /// Signalled whenever `state` changes in a way a waiter may care about.
    changed: Notify,
    shutdown: watch::Sender<bool>,
}

#[derive(Default)]
struct State {
    peers: HashMap<String, Peer>,
    /// Inbound connections that proved who they are and wait for `add_peer`, by name.
    held: HashMap<String, usize>,
    closed: bool,
}

struct Peer {
    addr: SocketAddr,
    conn: Option<Arc<Conn>>,
    /// One of our `add_peer`s is dialing it now.
    dialing: bool,
}

/// One live connection to a peer.
struct Conn {
    peer: String,
    dialed_by_us: bool,
    /// Our end and the peer's end of the socket (tests check both sides share one).
    #[cfg_attr(not(test), allow(dead_code))]
    ends: Option<(SocketAddr, SocketAddr)>,
    ctrl: mpsc::UnboundedSender<Outgoing>,
    bulk: mpsc::UnboundedSender<BulkJob>,
    /// Bytes queued on `ctrl` and `bulk` and not yet written (see [`BulkJob::cost`]).
    queued: AtomicUsize,
    /// Our reads waiting for data, by request id; `None` once the connection is closed.
    reads: Mutex<Option<HashMap<u64, PendingRead>>>,
    /// Our writes waiting for the peer's answer, by request id; `None` once closed.
    writes: Mutex<Option<HashMap<u64, WriteAnswer>>>,
    /// The peer's writes landing in our arena, by its request id; `None` once closed.
    incoming: Mutex<Option<HashMap<u64, IncomingWrite>>>,
    next_req: AtomicU64,
    stop: watch::Sender<bool>,
}

/// Where the peer's answer to one of our writes goes: the write future.
type WriteAnswer = oneshot::Sender<Result<(), TransportError>>;

struct PendingRead {
    lease_id: u64,
    remaining: u64,
    sink: Arc<ReadSink>,
    done: oneshot::Sender<Result<(), TransportError>>,
}

/// Where a read's bytes land: its local segments, filled in order. The connection's reader
/// writes the arena only inside [`ReadSink::fill`], under `cursor`'s lock, and never after
/// the read future (which owns those blocks) cancelled it.
struct ReadSink {
    arena: Arc<BlockArena>,
    segments: Vec<Segment>,
    cursor: Mutex<SinkCursor>,
}

#[derive(Default)]
struct SinkCursor {
    cancelled: bool,
    next: usize,
    offset: usize,
}

/// A peer's write being landed in our arena: the gate's permit, held until the last byte landed.
struct IncomingWrite {
    remaining: u64,
    /// Our blocks, as `local_*` of its segments.
    sink: Arc<ReadSink>,
    notif: Option<Vec<u8>>,
    _permit: WritePermit,
}

impl Drop for IncomingWrite {
    /// Nothing lands after the permit is gone: a fill under way finishes first (under the
    /// cursor's lock), later ones skip their bytes.
    fn drop(&mut self) {
        lock(&self.sink.cursor).cancelled = true;
    }
}

/// The source of one of our writes: our blocks, read only under `cancelled`'s lock and never
/// once the write future (which owns them) has ended.
struct WriteSource {
    arena: Arc<BlockArena>,
    segments: Vec<Segment>,
    cancelled: Mutex<bool>,
}

/// A write we send: the writer copies its next chunk out of the source, frames it, sends it.
struct WriteJob {
    req_id: u64,
    source: Arc<WriteSource>,
    next: usize,
    offset: usize,
}

/// What a connection's writer sends from an arena, one chunk at a time.
enum BulkJob {
    Serve(ServeJob),
    Write(WriteJob),
}

impl BulkJob {
    /// What a queued job costs against [`TcpOptions::max_queued_bytes`]: its own memory, not
    /// the payload it will send from the arena.
    fn cost(&self) -> usize {
        match self {
            BulkJob::Serve(j) => j.cost(),
            BulkJob::Write(j) => std::mem::size_of::<WriteJob>() + j.source.segments.len() * std::mem::size_of::<Segment>(),
        }
    }
}

/// A read we serve: the writer sends its bytes straight from the arena, chunk by chunk, and
/// drops the permit once the last byte has left the arena.
struct ServeJob {
    req_id: u64,
    segments: Vec<wire::RemoteSegment>,
    next: usize,
    offset: usize,
    _permit: ReadPermit,
}

impl ServeJob {
    /// What a queued job costs against [`TcpOptions::max_queued_bytes`]: its own memory, not
    /// the payload it will send from the arena.
    fn cost(&self) -> usize {
        std::mem::size_of::<ServeJob>() + self.segments.len() * std::mem::size_of::<wire::RemoteSegment>()
    }
}

/// Why a connection's reader stopped.
enum ConnEnd {
    Io,
    Desync,
}

impl From<io::Error> for ConnEnd {
    fn from(_: io::Error) -> Self {
        ConnEnd::Io
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    // A dropped sender also means stop.
    let _ = rx.wait_for(|s| *s).await;
}

/// The metadata a tcp agent named `name` reachable at `addr` publishes (what its
/// [`Agent::metadata`] returns): how a peer, or a test posing as one, addresses it.
pub fn metadata(name: &str, addr: SocketAddr) -> Vec<u8> {
    wire::encode_metadata(name, addr)
}

impl TcpAgent {
    /// Starts an agent listening on `host` at a port the OS chooses.
    pub async fn start(
        name: String,
        host: &str,
        arena: Arc<BlockArena>,
        gate: Arc<dyn ReadGate>,
        events: mpsc::UnboundedSender<AgentEvent>,
    ) -> Result<Arc<TcpAgent>, TransportError> {
        Self::start_with(name, host, arena, gate, events, TcpOptions::default()).await
    }

    /// [`TcpAgent::start`] with explicit tunables.
    pub async fn start_with(
        name: String,
        host: &str,
        arena: Arc<BlockArena>,
        gate: Arc<dyn ReadGate>,
        events: mpsc::UnboundedSender<AgentEvent>,
        options: TcpOptions,
    ) -> Result<Arc<TcpAgent>, TransportError> {
        if !wire::valid_name(&name) {
            return Err(TransportError::BadMetadata(format!("agent names are 1 to {} bytes, got {}", wire::MAX_NAME, name.len())));
        }
        let listener = crate::listen(host, 0).await.map_err(|e| TransportError::Io(format!("cannot listen on {host}: {e}")))?;
        let mut addr = listener.local_addr().map_err(|e| TransportError::Io(format!("listener address: {e}")))?;
        if let Some(ip) = options.advertise {
            addr.set_ip(ip);
        }
        let key = ClusterKey::new(options.secret.as_deref());
        let admission = Admission::new(options.max_unproven, options.max_unproven_per_source);
        let inner = Arc::new(Inner {
            admission,
            name,
            addr,
            arena,
            gate,
            write_gate: RwLock::new(Arc::new(RefuseWrites)),
            events,
            options,
            key,
            handshakes: AtomicUsize::new(0),
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            shutdown: watch::Sender::new(false),
        });
        tokio::spawn(Arc::clone(&inner).accept_loop(listener));
        Ok(Arc::new(TcpAgent { inner }))
    }

    /// The gate that judges peers' writes into our arena (push mode, SPEC U4, U8): until this
    /// is called every write is refused ([`RefuseWrites`]). Applies to writes whose request
    /// arrives from now on.
    pub fn set_write_gate(&self, gate: Arc<dyn WriteGate>) {
        *self.inner.write_gate.write().unwrap_or_else(PoisonError::into_inner) = gate;
    }

    /// Where peers reach this agent: where it listens, or its advertised address.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Closes the listener and every connection; reads in flight fail with `Disconnected`.
    /// Idempotent; also done when the last `Arc` is dropped.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

impl Drop for TcpAgent {
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}

impl Agent for TcpAgent {
    fn name(&self) -> &str {
        &self.inner.name
    }

    fn metadata(&self) -> Vec<u8> {
        metadata(&self.inner.name, self.inner.addr)
    }

    fn add_peer<'a>(&'a self, metadata: &'a [u8]) -> BoxFuture<'a, Result<String, TransportError>> {
        Box::pin(async move {
            let (name, addr) = wire::decode_metadata(metadata)?;
            if name == self.inner.name {
                return Err(TransportError::BadMetadata(format!("{name:?} is this agent's own metadata")));
            }
            {
                let mut st = lock(&self.inner.state);
                if st.closed {
                    return Err(TransportError::Disconnected(name));
                }
                st.peers.entry(name.clone()).and_modify(|p| p.addr = addr).or_insert(Peer { addr, conn: None, dialing: false });
            }
            self.inner.changed.notify_waiters();
            self.inner.ensure_connected(&name).await?;
            Ok(name)
        })
    }

    fn remove_peer(&self, peer: &str) {
        let conn = lock(&self.inner.state).peers.remove(peer).and_then(|p| p.conn);
        if let Some(conn) = conn {
            self.inner.close_conn(&conn, false);
        }
        self.inner.changed.notify_waiters();
    }

    fn read<'a>(&'a self, peer: &'a str, op: ReadOp) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.read(peer, op))
    }

    fn write<'a>(&'a self, peer: &'a str, op: WriteOp) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(self.inner.write(peer, op))
    }

    fn send_notif(&self, peer: &str, bytes: Vec<u8>) -> Result<(), TransportError> {
        self.inner.check_notif_size(bytes.len())?;
        let conn = self.inner.conn_to(peer)?;
        self.inner.send_ctrl(&conn, Outgoing::notif(bytes))
    }

    fn can_refuse_reads(&self) -> bool {
        true
    }

    fn can_refuse_writes(&self) -> bool {
        true
    }

    fn flush(&self, within: Duration) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let deadline = tokio::time::Instant::now() + within;
            // Every queued frame is counted until its writer has written it to the socket.
            while !self.inner.all_written() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    }

    fn arena(&self) -> &BlockArena {
        &self.inner.arena
    }
}

impl Inner {
    /// Whether no connection has bytes queued and not yet written.
    fn all_written(&self) -> bool {
        let st = lock(&self.state);
        st.peers.values().filter_map(|p| p.conn.as_ref()).all(|c| c.queued.load(Ordering::Relaxed) == 0)
    }

    fn reject(&self, reason: &'static str) {
        let _ = self.events.send(AgentEvent::Rejected { reason });
    }

    fn shutdown(&self) {
        let conns: Vec<Arc<Conn>> = {
            let mut st = lock(&self.state);
            if st.closed {
                return;
            }
            st.closed = true;
            st.peers.values_mut().filter_map(|p| p.conn.take()).collect()
        };
        self.shutdown.send_replace(true);
        for conn in conns {
            self.close_conn(&conn, false);
        }
        self.changed.notify_waiters();
    }

    fn check_notif_size(&self, len: usize) -> Result<(), TransportError> {
        if len > self.options.max_frame {
            return Err(TransportError::Io(format!("a notification of {len} bytes exceeds the frame limit of {}", self.options.max_frame)));
        }
        Ok(())
    }

    /// The live connection to a known peer.
    fn conn_to(&self, peer: &str) -> Result<Arc<Conn>, TransportError> {
        let st = lock(&self.state);
        match st.peers.get(peer) {
            None => Err(TransportError::UnknownPeer(peer.to_owned())),
            Some(p) => p.conn.clone().ok_or_else(|| TransportError::Disconnected(peer.to_owned())),
        }
    }

    /// Counts `cost` more bytes queued on `conn`; past [`TcpOptions::max_queued_bytes`] the
    /// peer is not keeping up (or not reading at all), and the connection is closed as stalled.
    fn admit(&self, conn: &Arc<Conn>, cost: usize) -> Result<(), TransportError> {
        let queued = conn.queued.fetch_add(cost, Ordering::Relaxed) + cost;
        if queued > self.options.max_queued_bytes {
            conn.queued.fetch_sub(cost, Ordering::Relaxed);
            self.close_conn(conn, true);
            return Err(TransportError::Disconnected(conn.peer.clone()));
        }
        Ok(())
    }

    /// Queues a control frame for `conn`'s writer.
    fn send_ctrl(&self, conn: &Arc<Conn>, frame: Outgoing) -> Result<(), TransportError> {
        self.admit(conn, frame.len())?;
        conn.ctrl.send(frame).map_err(|_| TransportError::Disconnected(conn.peer.clone()))
    }

    /// Ends a connection once: fails its pending reads, stops its tasks, forgets it, and
    /// reports `Disconnected` if asked (not when we closed it on purpose).
    fn close_conn(&self, conn: &Arc<Conn>, report: bool) {
        let Some(pending) = lock(&conn.reads).take() else { return };
        conn.stop.send_replace(true);
        for p in pending.into_values() {
            let _ = p.done.send(Err(TransportError::Disconnected(conn.peer.clone())));
        }
        for done in lock(&conn.writes).take().into_iter().flat_map(HashMap::into_values) {
            let _ = done.send(Err(TransportError::Disconnected(conn.peer.clone())));
        }
        // The peer's writes end here: dropped outside the lock (each waits for a fill under way).
        let incoming = lock(&conn.incoming).take();
        drop(incoming);
        {
            let mut st = lock(&self.state);
            if let Some(p) = st.peers.get_mut(&conn.peer) {
                if p.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                    p.conn = None;
                }
            }
        }
        self.changed.notify_waiters();
        if report {
            let _ = self.events.send(AgentEvent::Disconnected { peer: conn.peer.clone() });
        }
    }

    // ---- connection set-up ----

    async fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        let stop = stopped(self.shutdown.subscribe());
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => return,
                accepted = listener.accept() => match accepted {
                    Ok((stream, source)) => {
                        // Always admitted: at the cap, the oldest stranger makes room.
                        let (place, evicted) = self.admission.admit(source.ip());
                        for _ in 0..evicted {
                            self.reject("overloaded");
                        }
                        tokio::spawn(Arc::clone(&self).accept_inbound(stream, place));
                    }
                    // Out of descriptors or similar: back off instead of spinning.
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                },
            }
        }
    }

    /// `f`, unless the agent shuts down first (`None`) or `deadline` passes (`Some(Err(_))`).
    async fn bounded<T>(&self, deadline: Instant, f: impl Future<Output = T>) -> Option<Result<T, tokio::time::error::Elapsed>> {
        tokio::select! {
            _ = stopped(self.shutdown.subscribe()) => None,
            r = tokio::time::timeout_at(deadline, f) => Some(r),
        }
    }

    /// Handshake of a connection someone dialed to us: the dialer proves who it is, waits for
    /// `add_peer` if need be, and is adopted (or told to wait for our own dial), with our proof.
    async fn accept_inbound(self: Arc<Self>, stream: TcpStream, mut place: Unproven) {
        let _ = stream.set_nodelay(true);
        let ends = stream.local_addr().ok().zip(stream.peer_addr().ok());
        let (cert, (mut rd, mut wr)) = match &self.options.tls {
            None => (None, stream::split_plain(stream)),
            Some(tls) => {
                // SPEC S6: mutual TLS first, within the same time a dialer has for its proof.
                let deadline = Instant::now() + self.options.proof_timeout;
                let accepted = tokio::select! {
                    _ = place.evicted() => return,
                    r = self.bounded(deadline, tls.accept(stream)) => r,
                };
                match accepted {
                    None => return,
                    Some(Err(_)) => return self.reject("unknown_agent"),
                    Some(Ok(Err(e))) if e.is_silent_close() => return,
                    Some(Ok(Err(e))) => {
                        let from = ends.map_or_else(|| "?".to_string(), |(_, p)| p.to_string());
                        tracing::warn!("tcp agent {}: refusing a connection from {from}: {e}", self.name);
                        return self.reject("unauthenticated");
                    }
                    Some(Ok(Ok((s, id)))) => (Some(id), stream::split_tls(s.into())),
                }
            }
        };
        let Some((from, Proven { proof: ours, .. })) = self.prove_inbound(&mut rd, &mut wr, place, cert.as_deref()).await else { return };
        // Proven: one of the few places for a holder of the secret (never a stranger's).
        let Some(slot) = HandshakeSlot::take(&self) else { return self.reject("overloaded") };

        // Hold the connection until the engine adds the peer (SPEC S2), or give up.
        let deadline = Instant::now() + self.options.hold_unknown;
        *lock(&self.state).held.entry(from.clone()).or_default() += 1;
        self.changed.notify_waiters();
        let stop = stopped(self.shutdown.subscribe());
        tokio::pin!(stop);
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = lock(&self.state);
                if st.closed || st.peers.contains_key(&from) {
                    break;
                }
            }
            tokio::select! {
                _ = &mut stop => break,
                r = tokio::time::timeout_at(deadline, notified) => if r.is_err() { break },
            }
        }

        enum Verdict {
            Closed,
            Unknown,
            /// Our own dial to the peer wins the tie.
            Nack,
            Adopt(Arc<Conn>, ConnQueues, Option<Arc<Conn>>),
        }
        // Only a proven connection gets here: the tie-break and the replacement of an older
        // connection never act for a stranger that merely claims a peer's name.
        let verdict = {
            let mut st = lock(&self.state);
            if let Some(n) = st.held.get_mut(&from) {
                *n -= 1;
                if *n == 0 {
                    st.held.remove(&from);
                }
            }
            let closed = st.closed;
            match st.peers.get_mut(&from) {
                _ if closed => Verdict::Closed,
                None => Verdict::Unknown,
                Some(peer) if self.name < from && (peer.dialing || peer.conn.as_ref().is_some_and(|c| c.dialed_by_us)) => Verdict::Nack,
                Some(peer) => {
                    let (conn, queues) = Conn::new(from, false, ends);
                    // Queued before anyone else can see the connection: the first frame out.
                    // (Not through `send_ctrl`: closing needs the state lock we hold.)
                    let ack = Outgoing::hello_ack(&ours);
                    conn.queued.fetch_add(ack.len(), Ordering::Relaxed);
                    let _ = conn.ctrl.send(ack);
                    let old = peer.conn.replace(Arc::clone(&conn));
                    Verdict::Adopt(conn, queues, old)
                }
            }
        };
        self.changed.notify_waiters();
        drop(slot);
        match verdict {
            Verdict::Closed => {}
            Verdict::Unknown => self.reject("unknown_agent"),
            Verdict::Nack => {
                let _ = tokio::time::timeout(Duration::from_secs(1), send(&mut wr, &Outgoing::hello_nack(&ours).to_bytes())).await;
            }
            Verdict::Adopt(conn, queues, old) => {
                let rd = BufReader::with_capacity(READ_BUFFER, rd);
                Arc::clone(&self).spawn_conn(conn, queues, rd, wr);
                // Replaced, not lost: the peer is connected (its reads on the old connection
                // still fail), so nobody is told it disconnected.
                if let Some(old) = old {
                    self.close_conn(&old, false);
                }
            }
        }
    }

    /// The unauthenticated part of an inbound connection, all within `proof_timeout` and unless
    /// a newcomer evicts it first: the dialer's `Hello`, our challenge, its proof (SPEC S2; see
    /// the module doc). Nothing we send depends on the secret. Returns the proven dialer's name
    /// and our proof for it; otherwise the refusal is counted and the connection is to be closed.
    /// With certificates (SPEC S6), `cert` is the engine the dialer's certificate names, and a
    /// dialer whose agent is another engine's is refused.
    async fn prove_inbound(&self, rd: &mut Rd, wr: &mut Wr, mut place: Unproven, cert: Option<&str>) -> Option<(String, Proven)> {
        let deadline = Instant::now() + self.options.proof_timeout;
        let said_hello = std::sync::atomic::AtomicBool::new(false);
        let exchange = async {
            let hello = match read_handshake_frame(rd).await {
                Err(HandshakeError::Closed) => return Err(None),
                Err(HandshakeError::Broken) => return Err(Some("malformed")),
                Ok((wire::HELLO, body)) => wire::decode_hello(&body).ok_or(Some("malformed"))?,
                Ok(_) => return Err(Some("malformed")),
            };
            said_hello.store(true, Ordering::Relaxed);
            if hello.to != self.name || hello.from == self.name {
                return Err(Some("unknown_agent"));
            }
            if let Some(Err(e)) = cert.map(|id| tls::check_claim(id, tls::agent_engine(&hello.from))) {
                tracing::warn!("tcp agent {}: refusing agent {:?}: {e}", self.name, hello.from);
                let _ = send(wr, &Outgoing::hello_refused().to_bytes()).await;
                return Err(Some("unauthenticated"));
            }
            let challenge = Challenge::new(auth::nonce().map_err(|_| None)?);
            send(wr, &Outgoing::hello_challenge(challenge.nonce()).to_bytes()).await.map_err(|_| Some("unauthenticated"))?;
            // Anything but a valid proof (a wrong one, another frame, a close) is a failed proof.
            let proof = match read_handshake_frame(rd).await {
                Ok((wire::HELLO_PROOF, proof)) => proof,
                _ => return Err(Some("unauthenticated")),
            };
            match challenge.check(&self.key, Parties::agents(&hello.from, &self.name), hello.nonce, &proof) {
                Ok(proven) => Ok((hello.from, proven)),
                Err(_) => {
                    // Says nothing of the secret, and spares a peer configured with another one
                    // its retries: it learns at once (best effort; we close anyway).
                    let _ = send(wr, &Outgoing::hello_refused().to_bytes()).await;
                    Err(Some("unauthenticated"))
                }
            }
        };
        let outcome = tokio::select! {
            // A newcomer took the place (counted when it did).
            _ = place.evicted() => return None,
            r = self.bounded(deadline, exchange) => r?,
        };
        match outcome {
            Ok(Ok(proven)) => {
                place.proven();
                Some(proven)
            }
            Ok(Err(Some(reason))) => self.refuse(reason),
            Ok(Err(None)) => None,
            // Silence: never said who it is, or never proved it.
            Err(_) if said_hello.load(Ordering::Relaxed) => self.refuse("unauthenticated"),
            Err(_) => self.refuse("unknown_agent"),
        }
    }

    fn refuse<T>(&self, reason: &'static str) -> Option<T> {
        self.reject(reason);
        None
    }

    /// Makes sure a connection to the known `peer` exists: dials, or waits for the peer's
    /// connection when one is held or the peer's dial wins.
    async fn ensure_connected(self: &Arc<Self>, peer: &str) -> Result<(), TransportError> {
        let deadline = Instant::now() + self.options.connect_timeout;
        let stop = stopped(self.shutdown.subscribe());
        tokio::pin!(stop);
        let mut redial_at: Option<Instant> = None;
        let mut last_error: Option<TransportError> = None;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let dial_to = {
                let mut st = lock(&self.state);
                if st.closed {
                    return Err(TransportError::Disconnected(peer.to_owned()));
                }
                let held = st.held.contains_key(peer);
                let Some(p) = st.peers.get_mut(peer) else { return Err(TransportError::UnknownPeer(peer.to_owned())) };
                if p.conn.is_some() {
                    return Ok(());
                }
                let backing_off = redial_at.is_some_and(|t| Instant::now() < t);
                if p.dialing || held || backing_off {
                    None
                } else {
                    p.dialing = true;
                    Some(p.addr)
                }
            };
            let Some(addr) = dial_to else {
                let wake = redial_at.filter(|t| Instant::now() < *t).map_or(deadline, |t| t.min(deadline));
                tokio::select! {
                    _ = &mut stop => return Err(TransportError::Disconnected(peer.to_owned())),
                    r = tokio::time::timeout_at(wake, notified) => {
                        if r.is_err() && Instant::now() >= deadline {
                            return Err(last_error.unwrap_or_else(|| TransportError::Io(format!(
                                "no connection to {peer} within {:?}: has it added us?", self.options.connect_timeout
                            ))));
                        }
                    }
                }
                continue;
            };
            let guard = DialGuard { inner: self, peer };
            let outcome = tokio::select! {
                _ = &mut stop => return Err(TransportError::Disconnected(peer.to_owned())),
                r = tokio::time::timeout_at(deadline, self.dial(peer, addr)) => r.unwrap_or_else(|_| {
                    Err(TransportError::Io(format!("handshake with {peer} at {addr} timed out: has it added us?")))
                }),
            };
            drop(guard);
            match outcome {
                Ok(Dialed::Adopted) => return Ok(()),
                // The peer keeps its own connection to us; it arrives shortly.
                Ok(Dialed::Nacked) => redial_at = Some(Instant::now() + NACK_RETRY),
                // It does not know us (yet), or it still sees an old connection of ours.
                Ok(Dialed::Closed) => {
                    last_error = Some(TransportError::Io(format!(
                        "{peer} at {addr} closed the handshake: it has not added us, refused our proof (another cluster secret?) or our certificate (another --kv-transfer-tls-ca?), or takes no more handshakes now"
                    )));
                    redial_at = Some(Instant::now() + NACK_RETRY);
                }
                // An inbound connection may have won meanwhile.
                Err(_) if self.conn_to(peer).is_ok() => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// Dials `peer`; each side proves the cluster secret to the other (see the module doc).
    async fn dial(self: &Arc<Self>, peer: &str, addr: SocketAddr) -> Result<Dialed, TransportError> {
        let io_err = |what: &str, e: &dyn std::fmt::Display| TransportError::Io(format!("{what} {peer} at {addr}: {e}"));
        let bad_reply = || io_err("bad handshake reply from", &"not a kvlease agent of this version");
        let stream = TcpStream::connect(addr).await.map_err(|e| io_err("cannot connect to", &e))?;
        let _ = stream.set_nodelay(true);
        let ends = stream.local_addr().ok().zip(stream.peer_addr().ok());
        let (mut rd, mut wr) = match &self.options.tls {
            None => stream::split_plain(stream),
            // SPEC S6: the peer's certificate must be its agent name's engine's.
            Some(tls) => match tls.connect(stream, tls::agent_engine(peer)).await {
                Ok(s) => stream::split_tls(s.into()),
                Err(e) => {
                    self.reject("unauthenticated");
                    tracing::warn!("tcp agent {}: refusing {peer} at {addr}: {e}", self.name);
                    return Err(io_err("refusing", &e));
                }
            },
        };
        let nonce = auth::nonce()?;
        send(&mut wr, &Outgoing::hello(&self.name, peer, &nonce).to_bytes()).await.map_err(|e| io_err("hello failed to", &e))?;
        let challenge = match read_handshake_frame(&mut rd).await {
            Ok((wire::HELLO_CHALLENGE, body)) => wire::decode_challenge(&body).ok_or_else(bad_reply)?,
            // SPEC S6: our certificate is not the engine our agent is named for.
            Ok((wire::HELLO_REFUSED, _)) if self.options.tls.is_some() => {
                self.reject("unauthenticated");
                return Err(io_err(
                    "handshake refused by",
                    &"our certificate is not the engine our agent is named for (its log names both)",
                ));
            }
            Ok(_) => return Err(bad_reply()),
            // Refused before any proof: not the agent we mean, or too many handshakes there.
            Err(_) => return Ok(Dialed::Closed),
        };
        // We prove first (see the module doc); the acceptor's proof comes with its verdict.
        let answer = Answer::new(&self.key, Parties::agents(&self.name, peer), Nonces { dialer: nonce, acceptor: challenge });
        send(&mut wr, &Outgoing::hello_proof(&answer.proof).to_bytes()).await.map_err(|e| io_err("handshake failed with", &e))?;
        let (verdict, theirs) = match read_handshake_frame(&mut rd).await {
            Ok((kind @ (wire::HELLO_ACK | wire::HELLO_NACK), body)) => (kind, wire::decode_proof(&body).ok_or_else(bad_reply)?),
            Ok((wire::HELLO_REFUSED, _)) => {
                self.reject("unauthenticated");
                let why = if self.options.tls.is_some() {
                    "it refused our proof of the cluster secret (check --kv-transfer-secret-file on both engines), or our certificate is not the engine our agent is named for (its log names both)"
                } else {
                    "it refused our proof of the cluster secret: it holds another one (check --kv-transfer-secret-file on both engines)"
                };
                return Err(io_err("handshake refused by", &why));
            }
            Ok(_) => return Err(bad_reply()),
            // It refused our proof (another secret?), did not add us in time, or is full.
            Err(_) => return Ok(Dialed::Closed),
        };
        if answer.check(&theirs).is_err() {
            self.reject("unauthenticated");
            return Err(io_err(
                "refusing",
                &"it did not prove it holds the cluster secret (check --kv-transfer-secret-file on both engines)",
            ));
        }
        if verdict == wire::HELLO_NACK {
            return Ok(Dialed::Nacked);
        }
        // The handshake read exactly its frames: whatever follows is the connection's.
        let rd = BufReader::with_capacity(READ_BUFFER, rd);
        let (conn, queues) = Conn::new(peer.to_owned(), true, ends);
        let old = {
            let mut st = lock(&self.state);
            if st.closed {
                return Err(TransportError::Disconnected(peer.to_owned()));
            }
            let Some(p) = st.peers.get_mut(peer) else { return Err(TransportError::UnknownPeer(peer.to_owned())) };
            p.conn.replace(Arc::clone(&conn))
        };
        self.changed.notify_waiters();
        Arc::clone(self).spawn_conn(conn, queues, rd, wr);
        if let Some(old) = old {
            self.close_conn(&old, false);
        }
        Ok(Dialed::Adopted)
    }

    fn spawn_conn(self: Arc<Self>, conn: Arc<Conn>, queues: ConnQueues, rd: BufReader<Rd>, wr: Wr) {
        let (inner, c) = (Arc::clone(&self), Arc::clone(&conn));
        tokio::spawn(async move {
            let end = tokio::select! {
                _ = stopped(c.stop.subscribe()) => return,
                end = inner.read_frames(&c, rd) => end,
            };
            if matches!(end, ConnEnd::Desync) {
                inner.reject("oversized");
            }
            inner.close_conn(&c, true);
        });
        tokio::spawn(async move {
            let result = tokio::select! {
                _ = stopped(conn.stop.subscribe()) => return,
                r = self.write_frames(&conn, queues, wr) => r,
            };
            if result.is_err() {
                self.close_conn(&conn, true);
            }
        });
    }

    // ---- the two halves of a connection ----

    async fn read_frames(&self, conn: &Arc<Conn>, mut rd: BufReader<Rd>) -> ConnEnd {
        match self.read_frames_inner(conn, &mut rd).await {
            Ok(never) => match never {},
            Err(end) => end,
        }
    }

    async fn read_frames_inner(&self, conn: &Arc<Conn>, rd: &mut BufReader<Rd>) -> Result<std::convert::Infallible, ConnEnd> {
        loop {
            if *conn.stop.borrow() {
                // Closed meanwhile (say, as stalled while serving a request): frames still
                // buffered are not served.
                return Err(ConnEnd::Io);
            }
            let mut head = [0u8; wire::HEADER_LEN];
            rd.read_exact(&mut head).await?;
            let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
            let kind = head[4];
            if len > DESYNC_LEN {
                return Err(ConnEnd::Desync);
            }
            if kind == wire::READ_DATA && len >= 8 {
                let mut id = [0u8; 8];
                rd.read_exact(&mut id).await?;
                self.on_read_data(conn, u64::from_le_bytes(id), len - 8, rd).await?;
                continue;
            }
            if kind == wire::WRITE_DATA && len >= 8 {
                let mut id = [0u8; 8];
                rd.read_exact(&mut id).await?;
                self.on_write_data(conn, u64::from_le_bytes(id), len - 8, rd).await?;
                continue;
            }
            if len > self.options.max_frame {
                self.reject("oversized");
                skip(rd, len).await?;
                continue;
            }
            let mut body = vec![0u8; len];
            rd.read_exact(&mut body).await?;
            match kind {
                wire::NOTIF => {
                    let _ = self.events.send(AgentEvent::Notification { from: conn.peer.clone(), bytes: body });
                }
                wire::READ_REQ => match wire::decode_read_req(&body) {
                    Some(req) => self.serve_read(conn, req),
                    None => self.reject("malformed"),
                },
                wire::READ_ERR => match wire::decode_read_err(&body) {
                    Some((req_id, code, message)) => conn.fail_read(req_id, code, message),
                    None => self.reject("malformed"),
                },
                wire::WRITE_REQ => match wire::decode_write_req(&body) {
                    Some(req) => self.accept_write(conn, req),
                    None => {
                        self.reject("malformed");
                        // Answered when it names itself, so the writer does not wait forever.
                        if let Some(req_id) = body.get(..8).and_then(wire::decode_req_id) {
                            let _ = self.send_ctrl(conn, Outgoing::write_err(req_id, wire::ERR_MALFORMED, "malformed write request"));
                        }
                    }
                },
                wire::WRITE_ACK => match wire::decode_req_id(&body) {
                    Some(req_id) => conn.end_write(req_id, Ok(())),
                    None => self.reject("malformed"),
                },
                wire::WRITE_ERR => match wire::decode_read_err(&body) {
                    Some((req_id, code, message)) => {
                        let e = match code {
                            wire::ERR_REFUSED => TransportError::WriteRefused { peer: conn.peer.clone() },
                            wire::ERR_OUT_OF_RANGE => TransportError::OutOfRange(message),
                            _ => TransportError::Io(format!("{} failed the write: {message}", conn.peer)),
                        };
                        conn.end_write(req_id, Err(e));
                    }
                    None => self.reject("malformed"),
                },
                wire::WRITE_CANCEL => match wire::decode_req_id(&body) {
                    Some(req_id) => {
                        let dropped = lock(&conn.incoming).as_mut().and_then(|m| m.remove(&req_id));
                        drop(dropped);
                    }
                    None => self.reject("malformed"),
                },
                _ => self.reject("malformed"),
            }
        }
    }

    /// `len` bytes of the response to our read `req_id` follow on `rd`.
    async fn on_read_data(&self, conn: &Conn, req_id: u64, len: usize, rd: &mut BufReader<Rd>) -> Result<(), ConnEnd> {
        enum Route {
            /// Land the bytes; the sender when they are the read's last.
            Land(Arc<ReadSink>, Option<oneshot::Sender<Result<(), TransportError>>>),
            Excess(oneshot::Sender<Result<(), TransportError>>),
            Skip,
        }
        let route = {
            let mut reads = lock(&conn.reads);
            match reads.as_mut() {
                None => Route::Skip,
                Some(map) => match map.get_mut(&req_id) {
                    // A read we no longer wait for (cancelled): drain its bytes.
                    None => Route::Skip,
                    Some(p) if len as u64 > p.remaining => Route::Excess(map.remove(&req_id).map(|p| p.done).expect("entry present")),
                    Some(p) => {
                        p.remaining -= len as u64;
                        let sink = Arc::clone(&p.sink);
                        let done = if p.remaining == 0 { map.remove(&req_id).map(|p| p.done) } else { None };
                        Route::Land(sink, done)
                    }
                },
            }
        };
        match route {
            Route::Land(sink, done) => {
                land(rd, &sink, len).await?;
                if let Some(done) = done {
                    let _ = done.send(Ok(()));
                }
            }
            Route::Excess(done) => {
                self.reject("malformed");
                let _ = done.send(Err(TransportError::Io(format!("{} sent more bytes than the read asked for", conn.peer))));
                skip(rd, len).await?;
            }
            Route::Skip => skip(rd, len).await?,
        }
        Ok(())
    }

    /// A peer asks to write our blocks (push mode): check the ranges, ask the write gate
    /// (SPEC U4, U8, U11), and make ready to land its data; refused, it learns at once and its
    /// data is skipped (nothing is waiting for that request id).
    fn accept_write(&self, conn: &Arc<Conn>, req: wire::WriteReq) {
        let refuse = |code, message: &str| {
            let _ = self.send_ctrl(conn, Outgoing::write_err(req.req_id, code, message));
        };
        if let Some(Err(e)) = req.segments.iter().map(|s| self.arena.check(s.block, s.offset, s.len, &self.name)).find(Result::is_err) {
            return refuse(wire::ERR_OUT_OF_RANGE, &e.to_string());
        }
        if lock(&conn.incoming).as_ref().is_some_and(|m| m.contains_key(&req.req_id)) {
            self.reject("malformed");
            return refuse(wire::ERR_MALFORMED, "a write request id already in use");
        }
        // In the order the write names them (the gate checks it), a block split over several
        // segments counted once.
        let mut blocks: Vec<u32> = req.segments.iter().map(|s| s.block).collect();
        blocks.dedup();
        let gate = Arc::clone(&self.write_gate.read().unwrap_or_else(PoisonError::into_inner));
        let Some(permit) = gate.begin_write(&conn.peer, &req.key, &blocks, &req.tag) else {
            return refuse(wire::ERR_REFUSED, "registration not live");
        };
        let segments: Vec<Segment> = req
            .segments
            .iter()
            .filter(|s| s.len > 0)
            .map(|s| Segment { remote_block: 0, remote_offset: 0, local_block: s.block, local_offset: s.offset, len: s.len })
            .collect();
        let remaining = segments.iter().map(|s| u64::from(s.len)).sum();
        let sink = Arc::new(ReadSink { arena: Arc::clone(&self.arena), segments, cursor: Mutex::default() });
        let write = IncomingWrite { remaining, sink, notif: req.notif, _permit: permit };
        if remaining == 0 {
            return self.landed(conn, req.req_id, write);
        }
        if let Some(map) = lock(&conn.incoming).as_mut() {
            map.insert(req.req_id, write);
        }
    }

    /// Every byte of the peer's write `req_id` landed: its notification goes to the engine
    /// (after the data, as NIXL's), the permit is dropped, and the writer learns.
    fn landed(&self, conn: &Arc<Conn>, req_id: u64, mut write: IncomingWrite) {
        if let Some(bytes) = write.notif.take() {
            let _ = self.events.send(AgentEvent::Notification { from: conn.peer.clone(), bytes });
        }
        drop(write);
        let _ = self.send_ctrl(conn, Outgoing::write_ack(req_id));
    }

    /// `len` bytes of the peer's write `req_id` follow on `rd`.
    async fn on_write_data(&self, conn: &Arc<Conn>, req_id: u64, len: usize, rd: &mut BufReader<Rd>) -> Result<(), ConnEnd> {
        enum Route {
            /// Land the bytes; the write itself when they are its last.
            Land(Arc<ReadSink>, Option<IncomingWrite>),
            Excess(IncomingWrite),
            Skip,
        }
        let route = {
            let mut incoming = lock(&conn.incoming);
            let map = incoming.as_mut();
            match map.and_then(|m| m.get(&req_id).map(|w| (w.remaining, Arc::clone(&w.sink))).map(|r| (r, m))) {
                // Refused, cancelled, or never asked: drain its bytes.
                None => Route::Skip,
                Some(((remaining, _), m)) if len as u64 > remaining => m.remove(&req_id).map_or(Route::Skip, Route::Excess),
                Some(((remaining, sink), m)) if len as u64 == remaining => Route::Land(sink, m.remove(&req_id)),
                Some(((_, sink), m)) => {
                    if let Some(w) = m.get_mut(&req_id) {
                        w.remaining -= len as u64;
                    }
                    Route::Land(sink, None)
                }
            }
        };
        match route {
            Route::Land(sink, last) => {
                land(rd, &sink, len).await?;
                if let Some(write) = last {
                    self.landed(conn, req_id, write);
                }
            }
            Route::Excess(write) => {
                drop(write);
                self.reject("malformed");
                let _ = self.send_ctrl(conn, Outgoing::write_err(req_id, wire::ERR_MALFORMED, "more bytes than the write request named"));
                skip(rd, len).await?;
            }
            Route::Skip => skip(rd, len).await?,
        }
        Ok(())
    }

    /// A peer asks to read our blocks: check the ranges, ask the gate, queue the response.
    fn serve_read(&self, conn: &Arc<Conn>, req: wire::ReadReq) {
        if let Some(Err(e)) = req.segments.iter().map(|s| self.arena.check(s.block, s.offset, s.len, &self.name)).find(Result::is_err) {
            let _ = self.send_ctrl(conn, Outgoing::read_err(req.req_id, wire::ERR_OUT_OF_RANGE, &e.to_string()));
            return;
        }
        // In the order the read names them (SPEC S4: the gate checks it), a block split over
        // several segments counted once.
        let mut blocks: Vec<u32> = req.segments.iter().map(|s| s.block).collect();
        blocks.dedup();
        match self.gate.begin_read(&conn.peer, req.lease_id, &blocks, &req.tag) {
            None => {
                let _ = self.send_ctrl(conn, Outgoing::read_err(req.req_id, wire::ERR_REFUSED, "lease lost"));
            }
            Some(permit) => {
                let mut segments = req.segments;
                segments.retain(|s| s.len > 0);
                let job = BulkJob::Serve(ServeJob { req_id: req.req_id, segments, next: 0, offset: 0, _permit: permit });
                // Refused (connection closed or over its cap): the job drops here, and its permit.
                if self.admit(conn, job.cost()).is_ok() {
                    let _ = conn.bulk.send(job);
                }
            }
        }
    }

    /// Drains `conn`'s queues into the socket. Returns an error if the socket broke or a write
    /// stalled; the queued jobs, and the job in flight, drop with the future (and their permits).
    async fn write_frames(&self, conn: &Conn, mut queues: ConnQueues, mut wr: Wr) -> io::Result<()> {
        let stall = self.options.write_stall;
        let mut batch: Vec<Outgoing> = Vec::with_capacity(MAX_BATCH);
        // A write's next chunk, copied out of our arena (see the module doc).
        let mut chunk: Vec<u8> = Vec::new();
        let mut job: Option<BulkJob> = None;
        loop {
            while batch.len() < MAX_BATCH {
                match queues.ctrl.try_recv() {
                    Ok(f) => batch.push(f),
                    Err(_) => break,
                }
            }
            if !batch.is_empty() {
                let mut slices: Vec<IoSlice<'_>> = batch.iter().flat_map(|f| [IoSlice::new(f.head()), IoSlice::new(f.body())]).collect();
                write_all_vectored(&mut wr, &mut slices, stall).await?;
                conn.queued.fetch_sub(batch.iter().map(Outgoing::len).sum(), Ordering::Relaxed);
                batch.clear();
                continue;
            }
            match job.as_mut() {
                Some(BulkJob::Serve(j)) => {
                    let (head, pieces, done) = next_chunk(&self.arena, j);
                    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(pieces.len() + 1);
                    slices.push(IoSlice::new(&head));
                    slices.extend(pieces.iter().map(|p| IoSlice::new(p)));
                    write_all_vectored(&mut wr, &mut slices, stall).await?;
                    if done {
                        // The last byte has left the arena: end the read for the gate (SPEC P5).
                        conn.queued.fetch_sub(std::mem::take(&mut job).map_or(0, |j| j.cost()), Ordering::Relaxed);
                    }
                    continue;
                }
                Some(BulkJob::Write(j)) => {
                    let done = match next_write_chunk(j, &mut chunk) {
                        // The write future ended (cancelled, or refused by the peer): stop.
                        None => true,
                        Some((head, done)) => {
                            write_all_vectored(&mut wr, &mut [IoSlice::new(&head), IoSlice::new(&chunk)], stall).await?;
                            done
                        }
                    };
                    if done {
                        conn.queued.fetch_sub(std::mem::take(&mut job).map_or(0, |j| j.cost()), Ordering::Relaxed);
                    }
                    continue;
                }
                None => {}
            }
            if let Ok(j) = queues.bulk.try_recv() {
                job = Some(j);
                continue;
            }
            tokio::select! {
                f = queues.ctrl.recv() => match f {
                    Some(f) => batch.push(f),
                    None => return Ok(()),
                },
                j = queues.bulk.recv() => match j {
                    Some(j) => job = Some(j),
                    None => return Ok(()),
                },
            }
        }
    }

    // ---- reading ----

    async fn read(&self, peer: &str, op: ReadOp) -> Result<(), TransportError> {
        for s in &op.segments {
            self.arena.check(s.local_block, s.local_offset, s.len, "our")?;
        }
        let max_segments = (self.options.max_frame.saturating_sub(wire::READ_REQ_FIXED)) / wire::READ_REQ_PER_SEGMENT;
        if op.segments.len() > max_segments {
            return Err(TransportError::Io(format!("a read of {} segments exceeds the limit of {max_segments}", op.segments.len())));
        }
        if let Some(n) = &op.notif {
            self.check_notif_size(n.len())?;
        }
        let conn = self.conn_to(peer)?;
        let disconnected = || TransportError::Disconnected(peer.to_owned());
        let total: u64 = op.segments.iter().map(|s| u64::from(s.len)).sum();
        let req_id = conn.next_req.fetch_add(1, Ordering::Relaxed);
        let (done, landed) = oneshot::channel();
        let sink = Arc::new(ReadSink { arena: Arc::clone(&self.arena), segments: op.segments, cursor: Mutex::default() });
        match lock(&conn.reads).as_mut() {
            Some(map) => map.insert(req_id, PendingRead { lease_id: op.lease_id, remaining: total, sink: Arc::clone(&sink), done }),
            None => return Err(disconnected()),
        };
        let _pending = PendingGuard { conn: &conn, req_id, sink: &sink };
        self.send_ctrl(&conn, Outgoing::read_req(req_id, op.lease_id, &sink.segments, &op.tag))?;
        landed.await.unwrap_or_else(|_| Err(disconnected()))?;
        // Only now that every byte landed may the peer learn the read is done (ReadDone, P8).
        if let Some(n) = op.notif {
            self.send_ctrl(&conn, Outgoing::notif(n))?;
        }
        Ok(())
    }

    // ---- writing (push mode) ----

    async fn write(&self, peer: &str, op: WriteOp) -> Result<(), TransportError> {
        for s in &op.segments {
            self.arena.check(s.local_block, s.local_offset, s.len, "our")?;
        }
        if op.key.len() > crate::MAX_WRITE_KEY {
            return Err(TransportError::Io(format!("a write key of {} bytes exceeds the limit of {}", op.key.len(), crate::MAX_WRITE_KEY)));
        }
        let request = wire::WRITE_REQ_FIXED
            + wire::READ_REQ_PER_SEGMENT.saturating_mul(op.segments.len())
            + op.key.len()
            + op.tag.len().min(wire::MAX_TAG)
            + op.notif.as_ref().map_or(0, Vec::len);
        if request > self.options.max_frame {
            return Err(TransportError::Io(format!(
                "a write request of {} segments and a {}-byte notification exceeds the frame limit of {}",
                op.segments.len(),
                op.notif.as_ref().map_or(0, Vec::len),
                self.options.max_frame
            )));
        }
        let conn = self.conn_to(peer)?;
        let disconnected = || TransportError::Disconnected(peer.to_owned());
        let req_id = conn.next_req.fetch_add(1, Ordering::Relaxed);
        let (done, answered) = oneshot::channel();
        match lock(&conn.writes).as_mut() {
            Some(map) => map.insert(req_id, done),
            None => return Err(disconnected()),
        };
        let segments: Vec<Segment> = op.segments.iter().copied().filter(|s| s.len > 0).collect();
        let total: u64 = segments.iter().map(|s| u64::from(s.len)).sum();
        let source = Arc::new(WriteSource { arena: Arc::clone(&self.arena), segments, cancelled: Mutex::new(false) });
        let mut guard = WriteGuard { inner: self, conn: &conn, req_id, source: &source, answered: false };
        // The request goes on the control queue before its data on the bulk queue, and the
        // writer drains control frames first: the peer sees the request before any data.
        self.send_ctrl(&conn, Outgoing::write_req(req_id, &op.segments, &op.key, &op.tag, op.notif.as_deref()))?;
        if total > 0 {
            let job = BulkJob::Write(WriteJob { req_id, source: Arc::clone(&source), next: 0, offset: 0 });
            self.admit(&conn, job.cost())?;
            conn.bulk.send(job).map_err(|_| disconnected())?;
        }
        let result = answered.await.unwrap_or_else(|_| Err(disconnected()));
        guard.answered = true;
        result
    }
}

/// Ends one of our writes when its future ends, also when it is dropped half-way: after this
/// the writer reads none of its source blocks, and a write the peer has not answered is
/// cancelled there.
struct WriteGuard<'a> {
    inner: &'a Inner,
    conn: &'a Arc<Conn>,
    req_id: u64,
    source: &'a WriteSource,
    answered: bool,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        // Waits for a chunk being copied out (at most CHUNK bytes) to finish.
        *lock(&self.source.cancelled) = true;
        let pending = lock(&self.conn.writes).as_mut().and_then(|m| m.remove(&self.req_id));
        if pending.is_some() && !self.answered {
            let _ = self.inner.send_ctrl(self.conn, Outgoing::write_cancel(self.req_id));
        }
    }
}

/// How a dial ended, short of an error.
enum Dialed {
    /// The peer adopted our connection.
    Adopted,
    /// The peer keeps the connection it dialed to us instead.
    Nacked,
    /// The peer closed the connection during the handshake: it did not add us in time, or
    /// refused the connection before any proof.
    Closed,
}

/// The queues a connection's writer drains.
struct ConnQueues {
    ctrl: mpsc::UnboundedReceiver<Outgoing>,
    bulk: mpsc::UnboundedReceiver<BulkJob>,
}

impl Conn {
    fn new(peer: String, dialed_by_us: bool, ends: Option<(SocketAddr, SocketAddr)>) -> (Arc<Conn>, ConnQueues) {
        let (ctrl, ctrl_rx) = mpsc::unbounded_channel();
        let (bulk, bulk_rx) = mpsc::unbounded_channel();
        let conn = Conn {
            peer,
            dialed_by_us,
            ends,
            ctrl,
            bulk,
            queued: AtomicUsize::new(0),
            reads: Mutex::new(Some(HashMap::new())),
            writes: Mutex::new(Some(HashMap::new())),
            incoming: Mutex::new(Some(HashMap::new())),
            next_req: AtomicU64::new(1),
            stop: watch::Sender::new(false),
        };
        (Arc::new(conn), ConnQueues { ctrl: ctrl_rx, bulk: bulk_rx })
    }

    /// The peer answered our write `req_id`.
    fn end_write(&self, req_id: u64, result: Result<(), TransportError>) {
        if let Some(done) = lock(&self.writes).as_mut().and_then(|m| m.remove(&req_id)) {
            let _ = done.send(result);
        }
    }

    /// The peer answered our read `req_id` with an error.
    fn fail_read(&self, req_id: u64, code: u8, message: String) {
        let Some(p) = lock(&self.reads).as_mut().and_then(|m| m.remove(&req_id)) else { return };
        let e = match code {
            wire::ERR_REFUSED => TransportError::Refused { lease_id: p.lease_id },
            wire::ERR_OUT_OF_RANGE => TransportError::OutOfRange(message),
            _ => TransportError::Io(format!("{} failed the read: {message}", self.peer)),
        };
        let _ = p.done.send(Err(e));
    }
}

/// Ends a read when its future ends, also when it is dropped half-way: after this, the
/// connection writes none of its blocks.
struct PendingGuard<'a> {
    conn: &'a Conn,
    req_id: u64,
    sink: &'a ReadSink,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        // Waits for a fill in progress (one non-blocking socket read) to finish.
        lock(&self.sink.cursor).cancelled = true;
        if let Some(map) = lock(&self.conn.reads).as_mut() {
            map.remove(&self.req_id);
        }
    }
}

/// One of the [`TcpOptions::max_handshakes`] places for a proven inbound connection not yet
/// adopted; given back when dropped.
struct HandshakeSlot(Arc<Inner>);

impl HandshakeSlot {
    fn take(inner: &Arc<Inner>) -> Option<HandshakeSlot> {
        if inner.handshakes.fetch_add(1, Ordering::AcqRel) >= inner.options.max_handshakes {
            inner.handshakes.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(HandshakeSlot(Arc::clone(inner)))
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        self.0.handshakes.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Clears a peer's `dialing` mark when a dial ends, also when `add_peer` is dropped.
struct DialGuard<'a> {
    inner: &'a Inner,
    peer: &'a str,
}

impl Drop for DialGuard<'_> {
    fn drop(&mut self) {
        if let Some(p) = lock(&self.inner.state).peers.get_mut(self.peer) {
            p.dialing = false;
        }
        self.inner.changed.notify_waiters();
    }
}

impl ReadSink {
    /// Offers the arena slices for the next (at most) `max` bytes of the read to `f`, which
    /// returns how many it filled; `None` once the read was cancelled.
    fn fill(&self, max: usize, f: impl FnOnce(&mut [IoSliceMut<'_>]) -> io::Result<usize>) -> Option<io::Result<usize>> {
        let mut cur = lock(&self.cursor);
        if cur.cancelled {
            return None;
        }
        let base = self.arena.as_ptr().cast_mut();
        let bb = self.arena.block_bytes();
        let mut slices = Vec::new();
        let (mut next, mut offset, mut total) = (cur.next, cur.offset, 0);
        while total < max && slices.len() < MAX_IOV {
            let Some(s) = self.segments.get(next) else { break };
            let take = (s.len as usize - offset).min(max - total);
            if take > 0 {
                let start = s.local_block as usize * bb + s.local_offset as usize + offset;
                // SAFETY: every local segment passed `contains` before the read was sent; the
                // read's caller owns these blocks until its future ends, and the future cancels
                // (under this lock) before it ends, so nobody else touches them now.
                slices.push(IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(base.add(start), take) }));
            }
            total += take;
            offset += take;
            if offset == s.len as usize {
                next += 1;
                offset = 0;
            }
        }
        let result = f(&mut slices);
        if let Ok(mut n) = result {
            // Advance by what was filled.
            while n > 0 {
                let Some(s) = self.segments.get(cur.next) else { break };
                let take = (s.len as usize - cur.offset).min(n);
                n -= take;
                cur.offset += take;
                if cur.offset == s.len as usize {
                    cur.next += 1;
                    cur.offset = 0;
                }
            }
        }
        Some(result)
    }
}

/// Moves `len` bytes of a read's response from `rd` into its sink: what the reader buffered is
/// copied, the rest read from the socket straight into the arena; dropped if cancelled.
async fn land(rd: &mut BufReader<Rd>, sink: &ReadSink, mut len: usize) -> io::Result<()> {
    let mut plain: Option<Vec<u8>> = None;
    while len > 0 {
        let buffered = rd.buffer();
        if !buffered.is_empty() {
            let k = buffered.len().min(len);
            let data = &buffered[..k];
            let _ = sink.fill(k, |slices| {
                let mut at = 0;
                for s in slices.iter_mut() {
                    let n = s.len();
                    s.copy_from_slice(&data[at..at + n]);
                    at += n;
                }
                Ok(at)
            });
            rd.consume(k);
            len -= k;
            continue;
        }
        match rd.get_mut() {
            Rd::Plain(socket) => {
                socket.readable().await?;
                match sink.fill(len, |slices| socket.try_read_vectored(slices)) {
                    None => return skip(rd, len).await,
                    Some(Ok(0)) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Some(Ok(n)) => len -= n,
                    Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Some(Err(e)) => return Err(e),
                }
            }
            // Decrypted into a buffer, then copied (SPEC S6).
            Rd::Tls(tls) => {
                let buf = plain.get_or_insert_with(|| vec![0u8; READ_BUFFER * 4]);
                let want = len.min(buf.len());
                let n = tls.read(&mut buf[..want]).await?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                len -= n;
                if !copy_into(sink, &buf[..n]) {
                    return skip(rd, len).await;
                }
            }
        }
    }
    Ok(())
}

/// Copies `data` into the read's next bytes; `false` once the read was cancelled.
fn copy_into(sink: &ReadSink, data: &[u8]) -> bool {
    let mut at = 0;
    while at < data.len() {
        let filled = sink.fill(data.len() - at, |slices| {
            let start = at;
            let mut end = at;
            for s in slices.iter_mut() {
                let n = s.len();
                s.copy_from_slice(&data[end..end + n]);
                end += n;
            }
            Ok(end - start)
        });
        match filled {
            None => return false,
            // Nothing left to fill: the frame carried more than the read's segments (checked
            // against `remaining` before landing, so not reached).
            Some(Ok(0)) | Some(Err(_)) => return true,
            Some(Ok(n)) => at += n,
        }
    }
    true
}

/// The next `ReadData` frame of a served read: its header, the arena slices to send, and
/// whether it is the last.
fn next_chunk<'a>(arena: &'a BlockArena, job: &mut ServeJob) -> ([u8; wire::HEADER_LEN + 8], Vec<&'a [u8]>, bool) {
    let mut pieces = Vec::new();
    let mut payload = 0usize;
    while payload < CHUNK && pieces.len() < MAX_IOV {
        let Some(s) = job.segments.get(job.next) else { break };
        let take = (s.len as usize - job.offset).min(CHUNK - payload);
        let start = s.block as usize * arena.block_bytes() + s.offset as usize + job.offset;
        // SAFETY: the segment passed `contains` before the job was queued, so the range is
        // inside the arena, which outlives the slice; the job's permit keeps the lease's blocks
        // from being reused or written (SPEC P5) until the job is dropped, after this write.
        pieces.push(unsafe { std::slice::from_raw_parts(arena.as_ptr().add(start), take) });
        payload += take;
        job.offset += take;
        if job.offset == s.len as usize {
            job.next += 1;
            job.offset = 0;
        }
    }
    (wire::read_data_header(job.req_id, payload), pieces, job.next >= job.segments.len())
}

/// The next `WriteData` frame of one of our writes: copies its payload into `buf` and returns
/// the header and whether it is the last; `None` once the write future ended (see
/// [`WriteGuard`]).
fn next_write_chunk(job: &mut WriteJob, buf: &mut Vec<u8>) -> Option<([u8; wire::HEADER_LEN + 8], bool)> {
    let cancelled = lock(&job.source.cancelled);
    if *cancelled {
        return None;
    }
    buf.clear();
    let src = &job.source;
    while buf.len() < CHUNK {
        let Some(s) = src.segments.get(job.next) else { break };
        let take = (s.len as usize - job.offset).min(CHUNK - buf.len());
        let start = buf.len();
        buf.resize(start + take, 0);
        // SAFETY: every local segment passed `contains` before the write was queued; the write
        // future owns its source blocks while it lives, and it sets `cancelled` (under this lock)
        // before it ends, so they are unchanged and in use now.
        unsafe { src.arena.copy_out(s.local_block, s.local_offset as usize + job.offset, &mut buf[start..]) };
        job.offset += take;
        if job.offset == s.len as usize {
            job.next += 1;
            job.offset = 0;
        }
    }
    drop(cancelled);
    Some((wire::write_data_header(job.req_id, buf.len()), job.next >= src.segments.len()))
}

/// Writes all of `slices`, failing with `TimedOut` once a single write makes no progress for
/// `stall`: the peer stopped reading.
async fn write_all_vectored(wr: &mut Wr, mut slices: &mut [IoSlice<'_>], stall: Duration) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        let n = tokio::time::timeout(stall, wr.write_vectored(slices))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("the peer read nothing for {stall:?}")))??;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    // TLS holds what it encrypted until flushed; a plain socket has nothing to flush.
    tokio::time::timeout(stall, wr.flush())
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("the peer read nothing for {stall:?}")))?
}

/// Writes one handshake frame, flushed.
async fn send(wr: &mut Wr, bytes: &[u8]) -> io::Result<()> {
    wr.write_all(bytes).await?;
    wr.flush().await
}

async fn skip(rd: &mut BufReader<Rd>, len: usize) -> io::Result<()> {
    let copied = tokio::io::copy(&mut (&mut *rd).take(len as u64), &mut tokio::io::sink()).await?;
    if copied < len as u64 {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

enum HandshakeError {
    /// Closed before sending a byte.
    Closed,
    /// Not a handshake frame, or the connection broke inside one.
    Broken,
}

/// One small frame of the handshake: `(kind, body)`. Reads exactly the frame (nothing is
/// buffered past it), and refuses a length over `MAX_HELLO` before allocating anything.
async fn read_handshake_frame(rd: &mut Rd) -> Result<(u8, Vec<u8>), HandshakeError> {
    let mut head = [0u8; wire::HEADER_LEN];
    match rd.read(&mut head).await {
        Ok(0) => return Err(HandshakeError::Closed),
        Ok(n) => rd.read_exact(&mut head[n..]).await.map_err(|_| HandshakeError::Broken)?,
        Err(_) => return Err(HandshakeError::Broken),
    };
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    if len > wire::MAX_HELLO {
        return Err(HandshakeError::Broken);
    }
    let mut body = vec![0u8; len];
    rd.read_exact(&mut body).await.map_err(|_| HandshakeError::Broken)?;
    Ok((head[4], body))
}

#[cfg(test)]
mod tests;
