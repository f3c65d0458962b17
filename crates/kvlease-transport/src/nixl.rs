//! The nixl backend: the [`Agent`] trait over NIXL (ai-dynamo/nixl), the transfer library
//! vLLM, SGLang, TensorRT-LLM and Dynamo use, so kvlease moves KV cache the way those engines
//! do (UCX: RDMA where there is a NIC, TCP on loopback here).
//!
//! Built with the cargo feature `nixl`. nixl-sys's `stub-api` loads `libnixl_capi.so` at run
//! time: without it [`NixlAgent::start`] fails cleanly (see [`available`]); it never calls
//! into the stub, which would abort the process. `scripts/install-nixl.sh` installs the library.
//!
//! How it maps onto NIXL:
//! * one OS thread per agent owns the NIXL agent and its UCX backend (NIXL takes one lock per
//!   call and is not meant to be driven from several threads); it registers the whole
//!   [`BlockArena`] once, and serves the API's commands from a channel, polling transfers and
//!   notifications in between (a very short sleep while it awaits a peer's answer to a
//!   notification it sent, a short one while reads are in flight or soon after traffic, a
//!   longer one when idle: see [`NixlOptions`]);
//! * [`Agent::metadata`] is NIXL's agent metadata plus our arena's address and geometry
//!   (`envelope`), which the reader needs to address the peer's blocks; [`Agent::add_peer`]
//!   is `load_remote_md`, [`Agent::remove_peer`] is `invalidate_remote_md`;
//! * [`Agent::read`] is one NIXL READ of all the op's segments, with the op's notification
//!   attached, so the peer gets it after the data has landed here.
//! * [`Agent::write`] (push mode, SPEC §13) is one NIXL WRITE of our blocks into the peer's
//!   registered arena, at the blocks the op names, with its notification attached, so the peer
//!   gets it after the data has landed there.
//!
//! **Reads cannot be refused** ([`Agent::can_refuse_reads`] is false): the NIC reads P's
//! memory without asking P, so P's [`ReadGate`] is never consulted, and any agent that holds
//! P's metadata can read P's whole arena. NIXL does not enforce revocation either (a READ of
//! memory P deregistered and reused succeeds and returns the new bytes). The engine must
//! therefore never trust bytes it has not verified against a live lease: P acknowledges the
//! READ's notification (`ReadDone`) with ok or lost (SPEC P5, D6), and P does not reuse a
//! block a reader may still be reading.
//!
//! **Writes cannot be refused either** ([`Agent::can_refuse_writes`] is false): the NIC writes
//! D's registered memory without asking D, so D's [`crate::WriteGate`] is never consulted and
//! the op's key and tag travel nowhere. What fences a write over NIXL is the core's deadline
//! rules (SPEC U8): P posts a write only while its lease is live and before the registration's
//! write deadline (less a margin), and D reuses a destination block only after its writes
//! finished or failed, P acknowledged a `Release`, or that deadline passed. Like a read, a
//! dropped write future does not stop its WRITE (the source blocks stay P's until it ends).
//!
//! Who talks to us (SPEC S2, P7): NIXL delivers notifications from any agent that loaded our
//! metadata, named by the name *that agent* gave itself, and a UCX connection carries no proof
//! of ours; agent names are public. So every notification, standalone or attached to a READ,
//! carries a trailer: the sender's counter for this receiver and HMAC-SHA256(K, counter ·
//! payload), under a key per ordered pair of agents derived from the cluster secret
//! ([`NixlOptions::secret`]): K = HMAC(secret, "kvlease-nixl-notif-v1" · sender · receiver).
//! One whose tag does not verify, or whose counter was taken before (a replay), is dropped and
//! reported as `Rejected { reason: "unauthenticated" }`. Counters are checked against a sliding
//! window (IPsec's anti-replay window) of 4096 per sender rather than required in order: a
//! READ's notification is sealed when the READ is posted and sent by NIXL only once its data
//! has landed, so standalone notifications (heartbeats, other reads' `ReadDone`s) posted later
//! overtake it; the window takes each counter once in any order within it, and refuses anything
//! older (a `ReadDone` overtaken by more than 4096 notifications to the same peer is lost: D
//! recomputes, as for any lost `ReadDone`). Without a secret, K derives from the empty key and
//! proves nothing: listen on loopback only (SPEC S3). Every member holds the secret, so every
//! member can derive every pair's key: against insiders, engines hold certificates (SPEC S6),
//! and then the base of each pair's key is not the secret but a key the receiving engine handed
//! the sending engine in its Hello, inside the side channel's mutual TLS ([`NixlOptions::peer_keys`],
//! [`PeerKeys`]): only that engine has it. Authentic notifications from an agent not
//! added by [`Agent::add_peer`] are held for [`NixlOptions::hold_unknown`] (the other side may be
//! adding us right now: either side may add the other first), then dropped and reported as
//! `Rejected { reason: "unknown_agent" }`.
//!
//! What NIXL still trusts, and what bounds it. A one-sided READ cannot be authenticated by us:
//! UCX and NIXL serve a READ of any registered address to any agent that loaded our metadata,
//! without asking us. Our metadata goes only to engines that passed the engine's signed
//! handshake (SPEC S1, S2), but it holds no secret, so an outsider who got it some other way
//! could read our arena: over NIXL the confidentiality of KV in registered memory rests on the
//! metadata staying in the cluster and on the network. What such a reader cannot do is make an
//! engine act on it: releases, heartbeats and `ReadDone`s are notifications, which it cannot
//! forge or replay, and D never uses the bytes of a READ that P did not confirm: P answers each
//! authentic `ReadDone` with `ReadDoneAck { live }` (SPEC P5, D6), so bytes read from a lease
//! that is gone, or served by anyone but P, are never used.
//!
//! A dead peer shows up on the next transfer or notification to it (not before: NIXL has no
//! connection events, and a hung peer shows nothing at all; the lease catches that): its reads
//! fail with `Disconnected`, one [`AgentEvent::Disconnected`] is reported, and it stays
//! disconnected until added again. Other peers are not affected.
//!
//! Unlike the tcp backend, a read future dropped before it resolves does not stop its READ:
//! NIXL cannot cancel one, so the NIC may still write the op's local blocks until the thread
//! sees the READ end. A caller that gives up on a read must not reuse its local blocks for a
//! while (or at all, if the peer hangs).

mod envelope;
mod worker;

use crate::auth::PeerKeys;
use crate::{Agent, AgentEvent, BlockArena, BoxFuture, ReadGate, ReadOp, Segment, TransportError, WriteOp};
use envelope::PeerMd;
use std::collections::HashMap;
use std::sync::{mpsc as std_mpsc, Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};

/// The error [`NixlAgent::start`] returns when NIXL's library is missing.
pub const UNAVAILABLE: &str =
    "libnixl_capi.so could not be loaded: run scripts/install-nixl.sh and set LD_LIBRARY_PATH=<the dir it prints>";

/// Whether NIXL's library could be loaded; when false, [`NixlAgent::start`] fails with
/// [`UNAVAILABLE`]. Safe to call any time.
pub fn available() -> bool {
    !nixl_sys::is_stub()
}

/// Tunables of a [`NixlAgent`].
#[derive(Clone)]
pub struct NixlOptions {
    /// The cluster secret (`--kv-transfer-secret-file`): every notification carries a tag under
    /// a key derived from it (SPEC S2; see the module doc). `None`: the empty key, which proves
    /// nothing, so listen on loopback only (SPEC S3).
    pub secret: Option<Vec<u8>>,
    /// With per-engine certificates (SPEC S6): notifications are tagged under the keys the
    /// two engines handed each other inside mutual TLS instead of keys derived from the
    /// secret, so a member of the cluster cannot tag one as another engine (see [`PeerKeys`]).
    /// A notification to an agent whose engine handed no key is not sent.
    pub peer_keys: Option<Arc<PeerKeys>>,
    /// How long a notification from an agent not (yet) added is held waiting for `add_peer`
    /// before it is dropped as `unknown_agent`. Zero drops at once.
    pub hold_unknown: Duration,
    /// At most this many such notifications are held; beyond, the oldest is dropped.
    pub max_held: usize,
    /// The largest notification sent or accepted; larger incoming ones are dropped as
    /// `oversized`.
    pub max_notif: usize,
    /// The thread's poll interval while reads are in flight. Polling much faster takes the
    /// CPU and the agent's lock from UCX's progress thread and lowers throughput.
    pub xfer_poll: Duration,
    /// The poll interval while an answer is awaited: after the thread sends a peer a
    /// notification (standalone, or a READ's when the READ is over), until a notification
    /// from that peer arrives or `reply_window` passes (reads in flight take `xfer_poll`).
    /// Notifications can only be polled, so this is how late the answer of a round trip
    /// (heartbeat, `ReadDone`) may be seen; each poll costs ~4–6 µs of CPU here.
    pub reply_poll: Duration,
    /// How long after sending a peer a notification the thread polls at `reply_poll` if that
    /// peer sends nothing back (an acknowledgement, which is not answered, costs the whole
    /// window: ~20 polls). Zero: never.
    pub reply_window: Duration,
    /// The poll interval for `active_linger` after a command or a notification.
    pub active_poll: Duration,
    /// How long after the last activity the thread keeps polling at `active_poll`.
    pub active_linger: Duration,
    /// The poll interval when idle (no command or notification for `active_linger`): bounds
    /// the extra latency of the first notification after a quiet spell. 2 ms keeps an idle
    /// engine's agent at ~1.5 % of a core (500 µs: 2.3–3 %; issue 15, BENCHMARKS.md).
    pub idle_poll: Duration,
    /// Delay of NIXL's progress thread, in µs. NIXL 1.5's thread waits in `poll` on UCX's
    /// event fd, so traffic wakes it at once; the delay is only that poll's timeout, rounded
    /// up to whole milliseconds (100 µs gives 1 ms: ~1 % of a core per idle agent here). NIXL
    /// keeps the timeout because UCX does not always wake the poll. 0 makes the thread spin
    /// (measured ~8 ms per notification on this 2-core machine).
    pub progress_delay_us: u64,
    /// How long the thread lets reads in flight finish at shutdown before it drops them.
    pub shutdown_grace: Duration,
}

impl std::fmt::Debug for NixlOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlOptions")
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("peer_keys", &self.peer_keys)
            .field("hold_unknown", &self.hold_unknown)
            .field("max_held", &self.max_held)
            .field("max_notif", &self.max_notif)
            .field("xfer_poll", &self.xfer_poll)
            .field("reply_poll", &self.reply_poll)
            .field("reply_window", &self.reply_window)
            .field("active_poll", &self.active_poll)
            .field("active_linger", &self.active_linger)
            .field("idle_poll", &self.idle_poll)
            .field("progress_delay_us", &self.progress_delay_us)
            .field("shutdown_grace", &self.shutdown_grace)
            .finish()
    }
}

impl Default for NixlOptions {
    fn default() -> Self {
        NixlOptions {
            secret: None,
            peer_keys: None,
            hold_unknown: Duration::from_secs(5),
            max_held: 4096,
            max_notif: 16 * 1024 * 1024,
            xfer_poll: Duration::from_micros(200),
            reply_poll: Duration::from_micros(20),
            reply_window: Duration::from_micros(500),
            active_poll: Duration::from_micros(100),
            active_linger: Duration::from_millis(20),
            idle_poll: Duration::from_millis(2),
            progress_delay_us: 100,
            shutdown_grace: Duration::from_secs(2),
        }
    }
}

/// A transfer agent over NIXL (UCX backend). Dropping the last `Arc` (or
/// [`NixlAgent::shutdown`]) stops its thread, which deregisters the arena and destroys the
/// NIXL agent; the drop waits for that (a few ms, see `Drop`).
pub struct NixlAgent {
    name: String,
    arena: Arc<BlockArena>,
    /// Kept for the API's sake: NIXL never asks it (see the module doc).
    _gate: Arc<dyn ReadGate>,
    metadata: Vec<u8>,
    options: NixlOptions,
    shared: Arc<Shared>,
    cmds: std_mpsc::Sender<worker::Cmd>,
    exited: watch::Receiver<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent").field("name", &self.name).field("arena", &self.arena).finish()
    }
}

/// What the API and the thread share: the peers added and not removed.
#[derive(Default)]
struct Shared {
    peers: Mutex<HashMap<String, Peer>>,
}

struct Peer {
    md: PeerMd,
    /// A transfer or notification to it failed; reset by adding it again.
    broken: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl NixlAgent {
    /// Starts an agent (about half a second: UCX start-up) and registers `arena` with NIXL;
    /// `secret` is the cluster secret its notifications prove (see [`NixlOptions::secret`]).
    pub async fn start(
        name: String,
        arena: Arc<BlockArena>,
        gate: Arc<dyn ReadGate>,
        events: mpsc::UnboundedSender<AgentEvent>,
        secret: Option<Vec<u8>>,
    ) -> Result<Arc<NixlAgent>, TransportError> {
        Self::start_with(name, arena, gate, events, NixlOptions { secret, ..NixlOptions::default() }).await
    }

    /// [`NixlAgent::start`] with explicit tunables.
    pub async fn start_with(
        name: String,
        arena: Arc<BlockArena>,
        gate: Arc<dyn ReadGate>,
        events: mpsc::UnboundedSender<AgentEvent>,
        options: NixlOptions,
    ) -> Result<Arc<NixlAgent>, TransportError> {
        // Every other nixl-sys call aborts the process when the library is missing.
        if !available() {
            return Err(TransportError::Io(UNAVAILABLE.to_owned()));
        }
        if !envelope::valid_name(&name) {
            return Err(TransportError::BadMetadata(format!(
                "agent names are 1 to {} bytes without NUL, got {} bytes",
                envelope::MAX_NAME,
                name.len()
            )));
        }
        let shared = Arc::new(Shared::default());
        let (cmds, cmd_rx) = std_mpsc::channel();
        let (ready_tx, ready_rx) = oneshot::channel();
        let (exited_tx, exited) = watch::channel(false);
        let setup = worker::Setup {
            name: name.clone(),
            arena: Arc::clone(&arena),
            options: options.clone(),
            shared: Arc::clone(&shared),
            events,
            cmds: cmd_rx,
            ready: ready_tx,
            exited: exited_tx,
        };
        let thread = std::thread::Builder::new()
            .name(format!("nixl-{}", name.chars().take(10).collect::<String>()))
            .spawn(move || worker::run(setup))
            .map_err(|e| TransportError::Io(format!("cannot start the NIXL thread: {e}")))?;
        let metadata = ready_rx.await.map_err(|_| TransportError::Io("the NIXL thread died during start-up".into()))??;
        Ok(Arc::new(NixlAgent { name, arena, _gate: gate, metadata, options, shared, cmds, exited, thread: Some(thread) }))
    }

    /// Stops the agent's thread: reads in flight get [`NixlOptions::shutdown_grace`] to finish,
    /// then fail with `Disconnected`; the arena is deregistered and the NIXL agent destroyed.
    /// Idempotent; also done when the last `Arc` is dropped.
    pub fn shutdown(&self) {
        let _ = self.cmds.send(worker::Cmd::Shutdown);
    }

    /// Resolves once the agent's thread has exited (after [`NixlAgent::shutdown`]).
    pub async fn closed(&self) {
        let mut rx = self.exited.clone();
        // An error means the thread is gone too.
        let _ = rx.wait_for(|done| *done).await;
    }

    fn peer_state(&self, peer: &str) -> Result<PeerMd, TransportError> {
        match lock(&self.shared.peers).get(peer) {
            None => Err(TransportError::UnknownPeer(peer.to_owned())),
            Some(p) if p.broken => Err(TransportError::Disconnected(peer.to_owned())),
            Some(p) => Ok(p.md.clone()),
        }
    }

    fn check_notif_size(&self, len: usize) -> Result<(), TransportError> {
        if len > self.options.max_notif {
            return Err(TransportError::Io(format!("a notification of {len} bytes exceeds the limit of {}", self.options.max_notif)));
        }
        Ok(())
    }

    /// Checks `op` against our arena and the peer's, and turns it into address triples
    /// `(local, remote, len)`, empty segments left out.
    fn descriptors(&self, peer: &PeerMd, segments: &[Segment]) -> Result<Vec<(usize, usize, usize)>, TransportError> {
        let arena = &self.arena;
        let base = arena.as_ptr() as usize;
        let mut descs = Vec::with_capacity(segments.len());
        for s in segments {
            arena.check(s.local_block, s.local_offset, s.len, "our")?;
            let Some(remote) = peer.addr(s.remote_block, s.remote_offset, s.len).and_then(|a| usize::try_from(a).ok()) else {
                return Err(crate::arena::OutOfRange {
                    block: s.remote_block,
                    offset: s.remote_offset,
                    len: s.len,
                    whose: peer.name.clone(),
                    num_blocks: peer.num_blocks,
                    block_bytes: peer.block_bytes as usize,
                }
                .into());
            };
            if s.len > 0 {
                let local = base + s.local_block as usize * arena.block_bytes() + s.local_offset as usize;
                descs.push((local, remote, s.len as usize));
            }
        }
        Ok(descs)
    }
}

impl Drop for NixlAgent {
    /// Stops the thread and waits for it (~10–20 ms; up to [`NixlOptions::shutdown_grace`]
    /// if abandoned reads are still in flight): UCX aborts the process if it exits while an
    /// agent is being destroyed, so the agent is gone when the last `Arc` is.
    fn drop(&mut self) {
        self.shutdown();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Agent for NixlAgent {
    fn name(&self) -> &str {
        &self.name
    }

    fn metadata(&self) -> Vec<u8> {
        self.metadata.clone()
    }

    fn add_peer<'a>(&'a self, metadata: &'a [u8]) -> BoxFuture<'a, Result<String, TransportError>> {
        Box::pin(async move {
            let md = envelope::decode(metadata)?;
            if md.name == self.name {
                return Err(TransportError::BadMetadata(format!("{:?} is this agent's own metadata", md.name)));
            }
            let name = md.name.clone();
            let (reply, done) = oneshot::channel();
            self.cmds.send(worker::Cmd::AddPeer { md, reply }).map_err(|_| TransportError::Disconnected(name.clone()))?;
            done.await.unwrap_or(Err(TransportError::Disconnected(name)))
        })
    }

    fn remove_peer(&self, peer: &str) {
        // Refused from now on; the thread unloads its metadata once its reads are over.
        if lock(&self.shared.peers).remove(peer).is_some() {
            let _ = self.cmds.send(worker::Cmd::RemovePeer { peer: peer.to_owned() });
        }
    }

    fn read<'a>(&'a self, peer: &'a str, op: ReadOp) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let md = self.peer_state(peer)?;
            let descs = self.descriptors(&md, &op.segments)?;
            if let Some(n) = &op.notif {
                self.check_notif_size(n.len())?;
            }
            let (reply, done) = oneshot::channel();
            let cmd = worker::Cmd::Xfer { op: nixl_sys::XferOp::Read, peer: peer.to_owned(), descs, notif: op.notif, reply };
            self.cmds.send(cmd).map_err(|_| TransportError::Disconnected(peer.to_owned()))?;
            // If this future is dropped, the READ still runs to its end (NIXL cannot cancel
            // it): the caller must keep the local blocks until then (see the module doc).
            done.await.unwrap_or_else(|_| Err(TransportError::Disconnected(peer.to_owned())))
        })
    }

    /// A NIXL WRITE of our blocks into the peer's registered arena, at the addresses of the
    /// blocks the segments name (checked against the geometry the peer's metadata announced);
    /// `key` and `tag` travel nowhere: D cannot refuse a NIXL WRITE ([`Agent::can_refuse_writes`]).
    fn write<'a>(&'a self, peer: &'a str, op: WriteOp) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let md = self.peer_state(peer)?;
            let descs = self.descriptors(&md, &op.segments)?;
            if let Some(n) = &op.notif {
                self.check_notif_size(n.len())?;
            }
            let (reply, done) = oneshot::channel();
            let cmd = worker::Cmd::Xfer { op: nixl_sys::XferOp::Write, peer: peer.to_owned(), descs, notif: op.notif, reply };
            self.cmds.send(cmd).map_err(|_| TransportError::Disconnected(peer.to_owned()))?;
            // If this future is dropped, the WRITE still runs to its end (NIXL cannot cancel
            // it): the caller must keep its source blocks until then, as for a read.
            done.await.unwrap_or_else(|_| Err(TransportError::Disconnected(peer.to_owned())))
        })
    }

    fn send_notif(&self, peer: &str, bytes: Vec<u8>) -> Result<(), TransportError> {
        self.check_notif_size(bytes.len())?;
        self.peer_state(peer)?;
        self.cmds.send(worker::Cmd::Notif { peer: peer.to_owned(), bytes }).map_err(|_| TransportError::Disconnected(peer.to_owned()))
    }

    /// False: NIXL's READ is one-sided, P's [`ReadGate`] never sees it. The engine relies on
    /// the `ReadDone` acknowledgement instead (SPEC D6).
    fn can_refuse_reads(&self) -> bool {
        false
    }

    /// False: NIXL's WRITE is one-sided, D's [`crate::WriteGate`] never sees it. What fences a
    /// write is the core's deadline rules (SPEC U8): P posts no write once the registration's
    /// deadline is near, and D reuses its destination blocks only after every write finished or
    /// failed, P acknowledged a release, or that deadline passed.
    fn can_refuse_writes(&self) -> bool {
        false
    }

    fn arena(&self) -> &BlockArena {
        &self.arena
    }
}
