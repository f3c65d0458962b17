//! The thread that owns one [`super::NixlAgent`]'s NIXL agent. NIXL wants one driver per agent
//! (every call takes the agent's one lock, and nixl-sys's own tests run single-threaded), and
//! its notifications and transfer completions can only be polled; so this thread does all NIXL
//! calls, takes the API's commands from a channel, and polls in between, sleeping briefly.
//!
//! It never unloads a peer's NIXL metadata while reads from (or writes to) that peer are in
//! flight (their requests refer to its connection): removals and re-adds wait for them to end.
//!
//! It seals every notification it sends and opens every one it receives (SPEC S2; see the nixl
//! module doc): it owns the counters and replay windows, so they need no lock.

use super::envelope::{self, PeerMd, NOTIF_TRAILER};
use super::{lock, NixlOptions, Peer, Shared};
use crate::auth::{NotifKey, ReplayWindow};
use crate::{AgentEvent, BlockArena, TransportError};
use kvlease_core::auth::ClusterKey;
use nixl_sys::{
    Agent as Nixl, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs, RegistrationHandle, XferDescList,
    XferOp, XferRequest, XferStatus,
};
use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};

/// Commands handled per wake-up before the thread polls again.
const MAX_BATCH: usize = 256;

/// What the API asks of the thread.
pub(super) enum Cmd {
    AddPeer {
        md: PeerMd,
        reply: oneshot::Sender<Result<String, TransportError>>,
    },
    RemovePeer {
        peer: String,
    },
    Notif {
        peer: String,
        bytes: Vec<u8>,
    },
    /// A READ (pull) or WRITE (push) of `(local address, remote address, len)` descriptors,
    /// checked by the API: the same NIXL transfer, the other way round.
    Xfer {
        op: XferOp,
        peer: String,
        descs: Vec<(usize, usize, usize)>,
        notif: Option<Vec<u8>>,
        reply: oneshot::Sender<Result<(), TransportError>>,
    },
    Shutdown,
}

/// What the thread starts from.
pub(super) struct Setup {
    pub name: String,
    pub arena: Arc<BlockArena>,
    pub options: NixlOptions,
    pub shared: Arc<Shared>,
    pub events: mpsc::UnboundedSender<AgentEvent>,
    pub cmds: Receiver<Cmd>,
    /// Our metadata envelope once the agent is up, or why it is not.
    pub ready: oneshot::Sender<Result<Vec<u8>, TransportError>>,
    pub exited: watch::Sender<bool>,
}

/// The arena as NIXL sees it: one DRAM region. Holds the arena alive while registered.
#[derive(Debug)]
struct ArenaRegion(Arc<BlockArena>);

impl MemoryRegion for ArenaRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }

    fn size(&self) -> usize {
        self.0.len()
    }
}

impl NixlDescriptor for ArenaRegion {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

/// The arena's registration. Fields drop in order: deregistered first, then the arena may go.
struct Registered {
    _handle: RegistrationHandle,
    _region: ArenaRegion,
}

struct InFlight {
    peer: String,
    req: XferRequest,
    /// NIXL sends the READ's notification when the READ is over.
    notifies: bool,
    reply: oneshot::Sender<Result<(), TransportError>>,
}

/// The notifications we send one peer: its key, and the counter of the next one. Kept for the
/// agent's life, also when the peer is removed: the peer keeps its replay window for us, so
/// counters must go on rising if it is added again.
struct Outbound {
    key: NotifKey,
    next: u64,
}

/// The notifications one sender sent us: its key, and the counters taken. Kept for the agent's
/// life (created only by an authentic notification), so a notification recorded before the
/// sender was removed is still a replay after it is added again.
struct Inbound {
    key: NotifKey,
    window: ReplayWindow,
}

/// A notification from an agent not (yet) added; authentic, its trailer removed.
struct Held {
    at: Instant,
    from: String,
    bytes: Vec<u8>,
}

struct Worker {
    name: String,
    options: NixlOptions,
    key: ClusterKey,
    outbound: HashMap<String, Outbound>,
    inbound: HashMap<String, Inbound>,
    shared: Arc<Shared>,
    events: mpsc::UnboundedSender<AgentEvent>,
    inflight: Vec<InFlight>,
    /// NIXL metadata loaded, by agent name.
    loaded: HashMap<String, Vec<u8>>,
    /// Removed peers whose metadata is unloaded once their reads end.
    unload_pending: HashSet<String>,
    /// Re-adds that must unload the peer's old metadata first, waiting for its reads to end.
    deferred_adds: Vec<(PeerMd, oneshot::Sender<Result<String, TransportError>>)>,
    held: VecDeque<Held>,
    /// Peers we just sent a notification, until when we poll fast for their answer.
    awaiting_reply: HashMap<String, Instant>,
    last_activity: Instant,
    registered: Option<Registered>,
    _backend: Backend,
    agent: Nixl,
}

fn io(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Io(format!("NIXL: {what}: {e}"))
}

/// The thread's timer slack, in ns. Its sleeps are its poll intervals, and Linux lets a
/// normal thread's timed sleep overshoot by its slack, 50 µs by default: every poll came up to
/// 50 µs late (twice per notification round trip; BENCHMARKS.md, issue 15).
const TIMER_SLACK_NS: u64 = 1_000;

/// Sets the calling thread's timer slack to [`TIMER_SLACK_NS`]. Threads it starts afterwards
/// (NIXL's progress thread) inherit it; that one sleeps in `poll` on UCX's event fd, which
/// wakes on traffic whatever the slack.
fn tighten_timer_slack() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK only reads its integer argument and changes the calling
    // thread's slack; it fails harmlessly (left at the default) if refused.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, TIMER_SLACK_NS as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong);
    }
}

pub(super) fn run(setup: Setup) {
    let Setup { name, arena, options, shared, events, cmds, ready, exited } = setup;
    tighten_timer_slack();
    match Worker::start(name, arena, options, shared, events) {
        Err(e) => {
            let _ = ready.send(Err(e));
        }
        Ok((mut worker, md)) => {
            if ready.send(Ok(md)).is_ok() {
                worker.serve(&cmds);
            }
            // Commands still queued are dropped with `cmds`: their callers see `Disconnected`.
            worker.teardown();
        }
    }
    drop(cmds);
    exited.send_replace(true);
}

impl Worker {
    fn start(
        name: String,
        arena: Arc<BlockArena>,
        options: NixlOptions,
        shared: Arc<Shared>,
        events: mpsc::UnboundedSender<AgentEvent>,
    ) -> Result<(Worker, Vec<u8>), TransportError> {
        // Without the progress thread, reads over UCX's TCP transport never complete.
        let cfg = AgentConfig { enable_prog_thread: true, pthr_delay_us: options.progress_delay_us, ..AgentConfig::default() };
        let agent = Nixl::new_configured(&name, &cfg).map_err(|e| io(&format!("cannot create agent {name:?}"), e))?;
        let (_mems, params) = agent.get_plugin_params("UCX").map_err(|e| io("no UCX plugin", e))?;
        let backend = agent.create_backend("UCX", &params).map_err(|e| io("cannot create the UCX backend", e))?;
        let region = ArenaRegion(arena);
        let handle = agent.register_memory(&region, None).map_err(|e| io("cannot register the arena", e))?;
        let nixl_md = agent.get_local_md().map_err(|e| io("no local metadata", e))?;
        let envelope = envelope::encode(&PeerMd {
            name: name.clone(),
            base: region.0.as_ptr() as u64,
            num_blocks: region.0.num_blocks(),
            block_bytes: region.0.block_bytes() as u64,
            nixl_md,
        });
        let key = ClusterKey::new(options.secret.as_deref());
        let worker = Worker {
            name,
            options,
            key,
            outbound: HashMap::new(),
            inbound: HashMap::new(),
            shared,
            events,
            inflight: Vec::new(),
            loaded: HashMap::new(),
            unload_pending: HashSet::new(),
            deferred_adds: Vec::new(),
            held: VecDeque::new(),
            awaiting_reply: HashMap::new(),
            last_activity: Instant::now(),
            registered: Some(Registered { _handle: handle, _region: region }),
            _backend: backend,
            agent,
        };
        Ok((worker, envelope))
    }

    fn serve(&mut self, cmds: &Receiver<Cmd>) {
        loop {
            match cmds.recv_timeout(self.wait()) {
                Ok(cmd) => {
                    if !self.handle(cmd) {
                        return;
                    }
                    for _ in 0..MAX_BATCH {
                        let Ok(cmd) = cmds.try_recv() else { break };
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            self.poll_xfers();
            self.poll_notifs();
            self.expire_held(Instant::now());
        }
    }

    /// How long to sleep before the next poll.
    fn wait(&mut self) -> Duration {
        if !self.awaiting_reply.is_empty() {
            let now = Instant::now();
            self.awaiting_reply.retain(|_, until| *until > now);
        }
        if !self.inflight.is_empty() {
            self.options.xfer_poll
        } else if !self.awaiting_reply.is_empty() {
            self.options.reply_poll
        } else if self.last_activity.elapsed() < self.options.active_linger {
            self.options.active_poll
        } else {
            self.options.idle_poll
        }
    }

    /// Carries out one command; false to stop.
    fn handle(&mut self, cmd: Cmd) -> bool {
        self.last_activity = Instant::now();
        match cmd {
            Cmd::AddPeer { md, reply } => self.add_peer(md, reply),
            Cmd::RemovePeer { peer } => {
                // The API already forgot it (unless it was added again since: then keep it).
                if !lock(&self.shared.peers).contains_key(&peer) {
                    self.unload_when_idle(&peer);
                    // A re-add still waiting is overtaken by the removal.
                    let (gone, waiting): (Vec<_>, Vec<_>) =
                        std::mem::take(&mut self.deferred_adds).into_iter().partition(|(md, _)| md.name == peer);
                    self.deferred_adds = waiting;
                    for (_, reply) in gone {
                        let _ = reply.send(Err(TransportError::UnknownPeer(peer.clone())));
                    }
                }
            }
            Cmd::Notif { peer, bytes } => {
                if self.usable(&peer).is_ok() {
                    let Ok(sealed) = self.seal(&peer, bytes) else { return true };
                    if self.agent.send_notification(&peer, &sealed, None).is_err() {
                        self.broke(&peer);
                    } else {
                        self.await_reply(&peer);
                    }
                }
            }
            Cmd::Xfer { op, peer, descs, notif, reply } => self.start_xfer(op, peer, &descs, notif, reply),
            Cmd::Shutdown => return false,
        }
        true
    }

    /// We sent `peer` a notification: poll at `reply_poll` until it answers or the window ends.
    fn await_reply(&mut self, peer: &str) {
        if self.options.reply_window.is_zero() {
            return;
        }
        self.awaiting_reply.insert(peer.to_owned(), Instant::now() + self.options.reply_window);
    }

    fn reject(&self, reason: &'static str) {
        let _ = self.events.send(AgentEvent::Rejected { reason });
    }

    fn inflight_to(&self, peer: &str) -> bool {
        self.inflight.iter().any(|f| f.peer == peer)
    }

    /// Whether `peer` is added and healthy.
    fn usable(&self, peer: &str) -> Result<(), TransportError> {
        match lock(&self.shared.peers).get(peer) {
            None => Err(TransportError::UnknownPeer(peer.to_owned())),
            Some(p) if p.broken => Err(TransportError::Disconnected(peer.to_owned())),
            Some(_) => Ok(()),
        }
    }

    /// A transfer or notification to `peer` failed: it is disconnected until added again.
    fn broke(&self, peer: &str) {
        let newly = match lock(&self.shared.peers).get_mut(peer) {
            Some(p) if !p.broken => {
                p.broken = true;
                true
            }
            _ => false,
        };
        if newly {
            let _ = self.events.send(AgentEvent::Disconnected { peer: peer.to_owned() });
        }
    }

    // ---- peers ----

    fn add_peer(&mut self, md: PeerMd, reply: oneshot::Sender<Result<String, TransportError>>) {
        let name = md.name.clone();
        let broken = lock(&self.shared.peers).get(&name).is_some_and(|p| p.broken);
        let reload = self.loaded.contains_key(&name) && (broken || self.loaded.get(&name) != Some(&md.nixl_md));
        if reload && self.inflight_to(&name) {
            // Its reads refer to the old connection: unload it once they are over.
            self.deferred_adds.push((md, reply));
            return;
        }
        let _ = reply.send(self.add_peer_now(md, reload));
    }

    fn add_peer_now(&mut self, md: PeerMd, reload: bool) -> Result<String, TransportError> {
        let name = md.name.clone();
        if reload {
            self.unload(&name);
        }
        if !self.loaded.contains_key(&name) {
            self.load(&md)?;
        }
        self.unload_pending.remove(&name);
        lock(&self.shared.peers).insert(name.clone(), Peer { md, broken: false });
        // Starts wiring up the connection now rather than at the first READ; failures show
        // at the first transfer.
        let _ = self.agent.make_connection(&name, None);
        self.release_held(&name);
        Ok(name)
    }

    fn load(&mut self, md: &PeerMd) -> Result<(), TransportError> {
        let agent = &self.agent;
        // nixl-sys panics (outside its lock) on a non-UTF-8 agent name in the metadata.
        let loaded = std::panic::catch_unwind(AssertUnwindSafe(|| agent.load_remote_md(&md.nixl_md)));
        let bad = |msg: String| Err(TransportError::BadMetadata(format!("NIXL agent metadata of {:?}: {msg}", md.name)));
        match loaded {
            Err(_) => bad("NIXL cannot read the agent name in it".into()),
            Ok(Err(e)) => bad(format!("refused by NIXL: {e}")),
            Ok(Ok(n)) if n != md.name => {
                // Unload what it added, unless that agent was loaded already (then NIXL only
                // accepted it because it is the very same metadata).
                if !self.loaded.contains_key(&n) && n != self.name {
                    let _ = agent.invalidate_remote_md(&n);
                }
                bad(format!("its NIXL part is the metadata of {n:?}"))
            }
            Ok(Ok(_)) => {
                self.loaded.insert(md.name.clone(), md.nixl_md.clone());
                Ok(())
            }
        }
    }

    fn unload(&mut self, peer: &str) {
        self.unload_pending.remove(peer);
        if self.loaded.remove(peer).is_some() {
            let _ = self.agent.invalidate_remote_md(peer);
        }
    }

    fn unload_when_idle(&mut self, peer: &str) {
        if self.inflight_to(peer) {
            self.unload_pending.insert(peer.to_owned());
        } else {
            self.unload(peer);
        }
    }

    /// Unloads and re-adds what waited for a peer's reads to end.
    fn after_reads_of(&mut self, peer: &str) {
        if self.inflight_to(peer) {
            return;
        }
        if self.unload_pending.contains(peer) {
            self.unload(peer);
        }
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.deferred_adds).into_iter().partition(|(md, _)| md.name == peer);
        self.deferred_adds = waiting;
        for (md, reply) in ready {
            let _ = reply.send(self.add_peer_now(md, true));
        }
    }

    // ---- reads and writes ----

    /// Posts a READ or a WRITE; a WRITE is tracked as a read is (its peer's metadata stays
    /// loaded until it ends).
    fn start_xfer(
        &mut self,
        op: XferOp,
        peer: String,
        descs: &[(usize, usize, usize)],
        notif: Option<Vec<u8>>,
        reply: oneshot::Sender<Result<(), TransportError>>,
    ) {
        if let Err(e) = self.usable(&peer) {
            let _ = reply.send(Err(e));
            return;
        }
        // Sealed now, sent by NIXL when the data has landed (here for a READ, at the peer for a
        // WRITE): later notifications may overtake it.
        let notif = match notif.map(|n| self.seal(&peer, n)).transpose() {
            Ok(n) => n,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        if descs.is_empty() {
            // Nothing to move (NIXL refuses empty transfers): the notification goes alone.
            if let Some(n) = notif {
                if self.agent.send_notification(&peer, &n, None).is_err() {
                    self.broke(&peer);
                    let _ = reply.send(Err(TransportError::Disconnected(peer)));
                    return;
                }
                self.await_reply(&peer);
            }
            let _ = reply.send(Ok(()));
            return;
        }
        let notifies = notif.is_some();
        let req = match self.create_xfer(op, &peer, descs, notif.as_deref()) {
            Ok(req) => req,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        match self.agent.post_xfer_req(&req, None) {
            Ok(false) => {
                if notifies {
                    self.await_reply(&peer);
                }
                let _ = reply.send(Ok(()));
            }
            Ok(true) => self.inflight.push(InFlight { peer, req, notifies, reply }),
            Err(_) => {
                self.broke(&peer);
                let _ = reply.send(Err(TransportError::Disconnected(peer)));
            }
        }
    }

    fn create_xfer(
        &self,
        op: XferOp,
        peer: &str,
        descs: &[(usize, usize, usize)],
        notif: Option<&[u8]>,
    ) -> Result<XferRequest, TransportError> {
        let mut local = XferDescList::new(MemType::Dram).map_err(|e| io("descriptor list", e))?;
        let mut remote = XferDescList::new(MemType::Dram).map_err(|e| io("descriptor list", e))?;
        for &(l, r, len) in descs {
            local.add_desc(l, len, 0);
            remote.add_desc(r, len, 0);
        }
        let mut args = OptArgs::new().map_err(|e| io("transfer arguments", e))?;
        if let Some(n) = notif {
            // Sent by NIXL once the data has landed (here for a READ, at the peer for a WRITE).
            args.set_has_notification(true).map_err(|e| io("transfer arguments", e))?;
            args.set_notification_message(n).map_err(|e| io("transfer arguments", e))?;
        }
        let what = match op {
            XferOp::Read => format!("cannot create a READ from {peer}"),
            XferOp::Write => format!("cannot create a WRITE to {peer}"),
        };
        self.agent.create_xfer_req(op, &local, &remote, peer, Some(&args)).map_err(|e| io(&what, e))
    }

    fn poll_xfers(&mut self) {
        let mut i = 0;
        while i < self.inflight.len() {
            let status = self.agent.get_xfer_status(&self.inflight[i].req);
            let result = match status {
                Ok(XferStatus::InProgress) => {
                    i += 1;
                    continue;
                }
                Ok(XferStatus::Success) => Ok(()),
                Err(_) => {
                    self.broke(&self.inflight[i].peer);
                    Err(TransportError::Disconnected(self.inflight[i].peer.clone()))
                }
            };
            let done = self.inflight.swap_remove(i);
            // The request is released before the caller hears of it.
            let InFlight { peer, req, notifies, reply } = done;
            drop(req);
            if notifies && result.is_ok() {
                self.await_reply(&peer);
            }
            let _ = reply.send(result);
            self.last_activity = Instant::now();
            self.after_reads_of(&peer);
        }
    }

    // ---- notifications ----

    fn poll_notifs(&mut self) {
        // A fresh map each time: NIXL appends to a map and nixl-sys cannot clear one.
        let Ok(mut map) = NotificationMap::new() else { return };
        // On an error (a peer gone), what was gathered is still in the map.
        let _ = self.agent.get_notifications(&mut map, None);
        let mut senders = Vec::new();
        for name in map.agents() {
            match name {
                Ok(n) => senders.push(n.to_owned()),
                // A sender name that is not UTF-8 cannot be a peer of ours.
                Err(_) => self.reject("unknown_agent"),
            }
        }
        if senders.is_empty() {
            return;
        }
        self.last_activity = Instant::now();
        for from in senders {
            let known = lock(&self.shared.peers).contains_key(&from);
            let count = map.get_notifications_size(&from).unwrap_or(0);
            for i in 0..count {
                let Ok(bytes) = map.get_notification_bytes(&from, i) else {
                    self.reject("malformed");
                    continue;
                };
                if bytes.len() > self.options.max_notif.saturating_add(NOTIF_TRAILER) {
                    self.reject("oversized");
                    continue;
                }
                let Some(bytes) = self.open(&from, bytes) else {
                    self.reject("unauthenticated");
                    continue;
                };
                // Its answer, or as good as one: back to the usual polling.
                self.awaiting_reply.remove(&from);
                if known {
                    let _ = self.events.send(AgentEvent::Notification { from: from.clone(), bytes });
                } else {
                    self.hold(from.clone(), bytes);
                }
            }
        }
    }

    /// Seals a notification to `peer` with the next counter (SPEC S2); with certificates under
    /// the key `peer`'s engine handed us (S6), and not at all before it did.
    fn seal(&mut self, peer: &str, payload: Vec<u8>) -> Result<Vec<u8>, TransportError> {
        if !self.outbound.contains_key(peer) {
            let key = match &self.options.peer_keys {
                None => NotifKey::new(&self.key, &self.name, peer),
                Some(keys) => match keys.outbound(peer) {
                    Some(base) => NotifKey::new(&base, &self.name, peer),
                    None => {
                        tracing::warn!(peer, "notification not sent: the peer's engine handed no notification key (SPEC S6)");
                        return Err(TransportError::UnknownPeer(peer.to_owned()));
                    }
                },
            };
            self.outbound.insert(peer.to_owned(), Outbound { key, next: 1 });
        }
        let Some(out) = self.outbound.get_mut(peer) else { return Err(TransportError::UnknownPeer(peer.to_owned())) };
        let counter = out.next;
        out.next += 1;
        Ok(envelope::seal_notif(payload, counter, &out.key))
    }

    /// The payload of a notification from `from` if its tag is `from`'s and its counter was not
    /// taken before (SPEC S2); `None` for a forgery or a replay. The tag is checked first: only
    /// an authentic counter may move the window.
    fn open(&mut self, from: &str, mut bytes: Vec<u8>) -> Option<Vec<u8>> {
        let (len, counter, tag) = envelope::split_notif(&bytes)?;
        match self.inbound.get_mut(from) {
            Some(inbound) => {
                if !inbound.key.verify(counter, &bytes[..len], tag) || !inbound.window.accept(counter) {
                    return None;
                }
            }
            None => {
                let key = match &self.options.peer_keys {
                    None => NotifKey::new(&self.key, from, &self.name),
                    Some(keys) => NotifKey::new(&keys.inbound(from), from, &self.name),
                };
                if !key.verify(counter, &bytes[..len], tag) {
                    return None;
                }
                let mut window = ReplayWindow::default();
                if !window.accept(counter) {
                    return None;
                }
                self.inbound.insert(from.to_owned(), Inbound { key, window });
            }
        }
        bytes.truncate(len);
        Some(bytes)
    }

    fn hold(&mut self, from: String, bytes: Vec<u8>) {
        if self.options.hold_unknown.is_zero() || self.options.max_held == 0 {
            return self.reject("unknown_agent");
        }
        if self.held.len() >= self.options.max_held {
            self.held.pop_front();
            self.reject("unknown_agent");
        }
        self.held.push_back(Held { at: Instant::now(), from, bytes });
    }

    fn expire_held(&mut self, now: Instant) {
        while self.held.front().is_some_and(|h| now.duration_since(h.at) >= self.options.hold_unknown) {
            self.held.pop_front();
            self.reject("unknown_agent");
        }
    }

    /// Hands on, in order, what `peer` sent before it was added.
    fn release_held(&mut self, peer: &str) {
        let (mine, others): (VecDeque<Held>, VecDeque<Held>) = std::mem::take(&mut self.held).into_iter().partition(|h| h.from == peer);
        self.held = others;
        for h in mine {
            let _ = self.events.send(AgentEvent::Notification { from: h.from, bytes: h.bytes });
        }
    }

    // ---- the end ----

    fn teardown(mut self) {
        // The NIC writes our blocks until a READ ends: give reads in flight a moment.
        let deadline = Instant::now() + self.options.shutdown_grace;
        while !self.inflight.is_empty() && Instant::now() < deadline {
            std::thread::sleep(self.options.xfer_poll);
            self.poll_xfers();
        }
        for InFlight { peer, req, reply, .. } in self.inflight.drain(..) {
            drop(req);
            let _ = reply.send(Err(TransportError::Disconnected(peer)));
        }
        for (md, reply) in self.deferred_adds.drain(..) {
            let _ = reply.send(Err(TransportError::Disconnected(md.name)));
        }
        for _ in self.held.drain(..) {
            let _ = self.events.send(AgentEvent::Rejected { reason: "unknown_agent" });
        }
        lock(&self.shared.peers).clear();
        // Deregister (then release the arena) before the agent is destroyed; the agent
        // unloads its peers' metadata and destroys the backend itself.
        drop(self.registered.take());
        // `self.agent` goes last, here (the backend is the agent's: a handle without drop).
    }
}
