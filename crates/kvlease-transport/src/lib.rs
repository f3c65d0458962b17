//! kvlease-transport: the transfer agent, in NIXL's model.
//!
//! An agent per rank owns a [`BlockArena`] (registered memory) and talks to peer agents it was
//! introduced to by metadata ([`Agent::metadata`] / [`Agent::add_peer`], exchanged over the
//! engine's own handshake channel). It does two things: one-sided reads of a peer's blocks into
//! its own ([`Agent::read`]), and small opaque notifications both ways ([`Agent::send_notif`],
//! [`AgentEvent::Notification`]). It knows nothing of leases beyond the `lease_id` a read names:
//! the serving side decides through its [`ReadGate`] whether a read may be served (SPEC P5, S2).
//! Push mode (SPEC §13) turns the transfer round: P writes its blocks into blocks D registered
//! ([`Agent::write`]), named by the registration's key, never by addresses; the receiving side
//! decides through its [`WriteGate`] whether a write may land (SPEC U4, U8, U11).
//!
//! Backends: `tcp` (tokio, the default), `mem` (in-process, for tests), `nixl` (feature `nixl`:
//! NIXL over UCX, one OS thread per agent).
//! A backend that cannot refuse reads (NIXL: the NIC reads P's memory without asking P) says so
//! with [`Agent::can_refuse_reads`]; the engine then relies on the `ReadDone` acknowledgement
//! alone (SPEC D6). Likewise a backend that cannot refuse writes (NIXL: the NIC writes D's
//! registered memory without asking D) says so with [`Agent::can_refuse_writes`]; the fencing is
//! then the core's deadline rules alone (SPEC U8: P posts no write past the registration's
//! deadline, D reuses nothing before it).
//! The networked backends take the cluster secret and accept a peer's name only with proof that
//! it holds the secret: `tcp` per connection, `nixl` per notification (SPEC S2). With per-engine
//! certificates ([`tls`], SPEC S6) `tcp` also runs mutual TLS and accepts a peer's name only if
//! its certificate is that engine's; the engine's side channel uses the same [`tls`].

pub mod admission;
mod arena;
pub mod auth;
pub mod mem;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod tcp;
#[cfg(test)]
mod testing;
pub mod tls;

pub use arena::{ArenaError, BlockArena, OutOfRange};

use std::future::Future;
use tokio::net::{TcpListener, TcpSocket};

/// How many connections a kvlease listener lets wait to be accepted (the kernel caps it at
/// `net.core.somaxconn`). tokio's own `TcpListener::bind` asks for 128: a burst of thousands of
/// clients overflowed it, and the kernel's dropped handshakes were retried until they timed out
/// a minute later (issue 27, `scripts/bench-scale.sh` with `RATE=0`). vLLM's uvicorn asks 2048.
pub const LISTEN_BACKLOG: u32 = 4096;

/// A TCP listener on `host:port` (a name, an IPv4 address or an IPv6 one, bracketed or not;
/// port 0: one the system picks), with [`LISTEN_BACKLOG`]: every kvlease listener (HTTP, side
/// channel, tcp agent) is made here.
pub async fn listen(host: &str, port: u16) -> std::io::Result<TcpListener> {
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let mut last = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        // As std's and tokio's bind: a restarted server takes its port back at once.
        socket.set_reuseaddr(true)?;
        match socket.bind(addr).and_then(|()| socket.listen(LISTEN_BACKLOG)) {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{host} names no address"))))
}
use std::pin::Pin;
use thiserror::Error;

/// A future returned by an [`Agent`] method.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One contiguous piece of a read: `len` bytes at `remote_offset` in the peer's block
/// `remote_block`, landing at `local_offset` in our block `local_block`. Heterogeneous TP reads
/// a slice of a block (its KV heads), hence offsets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub remote_block: u32,
    pub remote_offset: u32,
    pub local_block: u32,
    pub local_offset: u32,
    pub len: u32,
}

/// A one-sided read of a peer's blocks, fenced by the lease that pins them (SPEC S2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOp {
    pub lease_id: u64,
    pub segments: Vec<Segment>,
    /// Delivered to the peer as a notification once the data has landed here (NIXL attaches
    /// the notification to the READ; the `ReadDone` of SPEC P8).
    pub notif: Option<Vec<u8>>,
    /// Shown to the serving side's [`ReadGate`] with the request (tcp, mem; NIXL's one-sided
    /// READ carries nothing to P). The engine puts the prompt's digest here, so P refuses a read
    /// meant for another prompt before a byte is served (SPEC S4). Empty: nothing to show.
    pub tag: Vec<u8>,
}

/// A one-sided write of our blocks into a peer's registered blocks (push mode, SPEC §13),
/// posted by P once [`kvlease_core::push::source::PushSource::begin_write`] said yes.
///
/// The peer's blocks are named as the peer registered them (the block ids of its registration)
/// under `key`, never by address: the receiving agent shows `key`, the blocks and `tag` to its
/// [`WriteGate`] before a byte lands (tcp, mem). In each [`Segment`], `local_*` is our source
/// and `remote_*` the peer's destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteOp {
    /// The registration the destination blocks belong to, as the two engines name it (the
    /// engine encodes its push key and attempt here). At most [`MAX_WRITE_KEY`] bytes.
    pub key: Vec<u8>,
    pub segments: Vec<Segment>,
    /// Delivered to the peer as a notification once every byte has landed there, and only then
    /// (NIXL attaches it to the WRITE): the peer learns of the write and its data together. Not
    /// delivered when the write fails or is refused.
    pub notif: Option<Vec<u8>>,
    /// Shown to the receiving side's [`WriteGate`] (tcp, mem; NIXL's WRITE carries nothing to D
    /// before the bytes land): the engine puts the prompt's digest here, so D refuses a write
    /// meant for another prompt (SPEC U11, S4). Empty: nothing to show. At most 256 bytes.
    pub tag: Vec<u8>,
}

/// The longest [`WriteOp::key`] an agent sends.
pub const MAX_WRITE_KEY: usize = 1024;

/// What an agent reports, on the channel given at its start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentEvent {
    /// A notification from a peer that completed a handshake and proved it holds the cluster
    /// secret (SPEC S2).
    Notification { from: String, bytes: Vec<u8> },
    /// A message or connection dropped before it reached the engine (SPEC P7, S2): `reason` is
    /// `unknown_agent`, `malformed`, `oversized`, `unauthenticated` (no proof of the cluster
    /// secret: see the tcp and nixl module docs) or `overloaded` (a connection refused because
    /// too many were in their handshake) (`kvlease_messages_rejected_total{reason}`).
    Rejected { reason: &'static str },
    /// The connection to a peer broke; its in-flight reads failed with `Disconnected`.
    Disconnected { peer: String },
}

/// The serving side's say over reads of its memory (SPEC P5, S2).
pub trait ReadGate: Send + Sync + 'static {
    /// Peer `peer` asks to read `blocks` (in the order its segments name them, a block repeated in
    /// consecutive segments once) under `lease_id`, showing `tag` ([`ReadOp::tag`]).
    /// Return a permit to serve it, or `None` to refuse (the lease is not live, the blocks are
    /// not the lease's, or the tag does not match it). The agent drops the permit when the bytes
    /// have been copied out: until then no block of the lease is reused.
    fn begin_read(&self, peer: &str, lease_id: u64, blocks: &[u32], tag: &[u8]) -> Option<ReadPermit>;
}

/// Held while a read is served; dropping it ends the read.
pub type ReadPermit = Box<dyn Send>;

/// The receiving side's say over writes into its memory (push mode, SPEC U4, U8, U11): the
/// mirror of [`ReadGate`], implemented by D's engine from its push sink.
pub trait WriteGate: Send + Sync + 'static {
    /// Peer `peer` asks to write `blocks` (in the order its segments name them, a block repeated
    /// in consecutive segments once) of the registration named `key` ([`WriteOp::key`]),
    /// showing `tag` ([`WriteOp::tag`]). Return a permit to let the bytes land, or `None` to
    /// refuse (the registration ended or was superseded, its deadline passed, the blocks are not
    /// its blocks in its order, or the tag does not match its prompt): then not a byte lands and
    /// the writer's future fails with [`TransportError::WriteRefused`]. The agent drops the
    /// permit when the last byte has landed (or the write failed half-way, or the writer
    /// cancelled it): until then bytes may land, so the destination blocks must not be reused,
    /// even past the registration's deadline (SPEC U8). What bounds a permit is the writer: P
    /// posts no write near that deadline and drops a write future that outlives it (which
    /// cancels the write here), and a writer that stops sending is cut off with its connection
    /// (tcp: `TcpOptions::write_stall`).
    fn begin_write(&self, peer: &str, key: &[u8], blocks: &[u32], tag: &[u8]) -> Option<WritePermit>;
}

/// Held while a write lands; dropping it ends the write on the receiving side.
pub type WritePermit = Box<dyn Send>;

/// The write gate of an engine that does not take pushed KV: every write is refused. The
/// default of every agent, so nothing writes into memory that did not ask for it.
#[derive(Debug, Default, Clone, Copy)]
pub struct RefuseWrites;

impl WriteGate for RefuseWrites {
    fn begin_write(&self, _peer: &str, _key: &[u8], _blocks: &[u32], _tag: &[u8]) -> Option<WritePermit> {
        None
    }
}

/// A gate that serves every read (and lets every write land) of a known peer: for memory not
/// under leases (tests).
#[derive(Debug, Default, Clone, Copy)]
pub struct OpenGate;

impl ReadGate for OpenGate {
    fn begin_read(&self, _peer: &str, _lease_id: u64, _blocks: &[u32], _tag: &[u8]) -> Option<ReadPermit> {
        Some(Box::new(()))
    }
}

/// Lets every write of a known peer land: for memory not under registrations (tests).
impl WriteGate for OpenGate {
    fn begin_write(&self, _peer: &str, _key: &[u8], _blocks: &[u32], _tag: &[u8]) -> Option<WritePermit> {
        Some(Box::new(()))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TransportError {
    #[error("unknown peer agent {0:?}: no handshake with it")]
    UnknownPeer(String),
    #[error("peer refused the read of lease {lease_id}: lease lost")]
    Refused { lease_id: u64 },
    /// SPEC U4, U8: the receiving side's [`WriteGate`] refused the write (its registration
    /// ended, was superseded, or does not own those blocks, or the tag did not match): not a
    /// byte landed.
    #[error("peer agent {peer:?} refused the write: its registration is not live for those blocks")]
    WriteRefused { peer: String },
    #[error("peer agent {0:?} disconnected")]
    Disconnected(String),
    #[error("bad agent metadata: {0}")]
    BadMetadata(String),
    #[error("segment out of range: {0}")]
    OutOfRange(String),
    #[error("transport I/O error: {0}")]
    Io(String),
}

/// A transfer agent (one per rank).
pub trait Agent: Send + Sync + 'static {
    /// This agent's unique name (`{engine_id}/{incarnation}/{rank}` by convention).
    fn name(&self) -> &str;

    /// What a peer needs to reach this agent; opaque, a few hundred bytes.
    fn metadata(&self) -> Vec<u8>;

    /// Introduce a peer by its metadata (NIXL's `load_remote_md`). Until this is called for a
    /// peer, its connections, reads and notifications are refused (SPEC S2, P7). Returns the
    /// peer's name. Either side may add the other first; both directions then work.
    fn add_peer<'a>(&'a self, metadata: &'a [u8]) -> BoxFuture<'a, Result<String, TransportError>>;

    /// Forget a peer: its connection is closed and its messages refused from now on.
    fn remove_peer(&self, peer: &str);

    /// Read from a peer's registered blocks into ours; resolves when the data has landed and the
    /// op's notification was handed to the peer.
    fn read<'a>(&'a self, peer: &'a str, op: ReadOp) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Write our blocks into a peer's registered blocks (push mode); resolves when the data has
    /// landed there and the op's notification was delivered after it, or with the error that
    /// stopped it: [`TransportError::WriteRefused`] when the peer's [`WriteGate`] said no,
    /// `Disconnected` when the link broke half-way (then some bytes may have landed: the peer
    /// must not use the blocks, SPEC U7). The caller's source blocks must stay unchanged until
    /// the future ends (P holds its `WriteTicket` until then); a dropped future stops sending.
    fn write<'a>(&'a self, peer: &'a str, op: WriteOp) -> BoxFuture<'a, Result<(), TransportError>>;

    /// Send a notification; queued, never blocks. Fails at once for an unknown peer.
    fn send_notif(&self, peer: &str, bytes: Vec<u8>) -> Result<(), TransportError>;

    /// Whether the serving side's [`ReadGate`] sees (and may refuse) each read.
    fn can_refuse_reads(&self) -> bool;

    /// Whether the receiving side's [`WriteGate`] sees (and may refuse) each write. Where it
    /// does not (NIXL), only the core's deadline rules fence writes (SPEC U8).
    fn can_refuse_writes(&self) -> bool;

    /// Waits until every notification sent so far has been handed to the network (at most
    /// `within`): a stopping engine's last releases go out before the process does. Backends
    /// that deliver at once have nothing to wait for.
    fn flush(&self, within: std::time::Duration) -> BoxFuture<'_, ()> {
        let _ = within;
        Box::pin(async {})
    }

    /// The memory this agent registered.
    fn arena(&self) -> &BlockArena;
}

#[cfg(test)]
mod listen_tests {
    use std::time::Duration;

    /// Issue 27: a burst of connections to a listener not accepting yet (a busy server) all
    /// complete their handshakes: the backlog holds them (tokio's default of 128 dropped the rest,
    /// whose connects then hung in SYN retries). Names and bracketed IPv6 resolve too.
    #[tokio::test]
    async fn a_burst_of_connections_waits_in_the_backlog_instead_of_hanging() {
        let listener = super::listen("127.0.0.1", 0).await.expect("listen");
        let addr = listener.local_addr().expect("address");
        let mut held = Vec::new();
        for i in 0..600 {
            let c = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await;
            held.push(c.unwrap_or_else(|_| panic!("connection {i} not taken into the backlog within 2 s")).expect("connect"));
        }
        assert!(super::listen("localhost", 0).await.is_ok());
        if let Ok(l) = super::listen("[::1]", 0).await {
            assert!(l.local_addr().expect("address").is_ipv6());
        }
        assert!(super::listen("no-such-host.invalid", 0).await.is_err());
    }
}
