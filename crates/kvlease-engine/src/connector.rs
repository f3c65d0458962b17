//! The connector: where the engine meets kvlease-core and the transport.
//!
//! P side: grants a lease when a `do_remote_decode` prefill finishes (SPEC P1), serves reads only
//! of live leases through the agents' [`ReadGate`] (P5), hands every message from D to the lease
//! table and sends back its answer (P2, P3, P6, P8), and reaps expired leases from a task of its
//! own that ticks while idle (P4).
//!
//! D side: drives the [`Renewer`](kvlease_core::renewer::Renewer) from a timer task that never
//! waits on the forward loop (D2, D3), runs handshakes in the background (D5), and pulls a
//! request's KV only while its lease is acknowledged live, using the bytes only once P confirms
//! the lease was live when each read completed (D6).
//!
//! Both: the handshake side channel, authenticated with the cluster secret when there is one
//! (SPEC S1, S2).

use crate::engine::{lock, Inner, Peer, Rank};
use crate::kv_params::RemoteKv;
use crate::pool::Blocks;
use crate::scheduler::{PrefillDone, Seq};
use crate::side_channel::{self, write_frame, Side};
use crate::{FinishReason, GenerateEvent, StartError, TransportKind};
use kvlease_core::digest::PromptDigest;
use kvlease_core::lease_table::{ReadTicket, Released};
use kvlease_core::renewer::{Action, ReadCheck, SendKind};
use kvlease_core::wire::{Hello, Message};
use kvlease_transport::{tcp::TcpAgent, Agent, AgentEvent, BlockArena, ReadGate, ReadOp, ReadPermit, Segment};
use serde_json::json;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

/// What P keeps under a lease: the blocks, returned to the pool when the lease ends, and their
/// ids sorted, to check a read's blocks against quickly.
#[derive(Debug)]
pub(crate) struct Lease {
    blocks: Blocks,
    sorted: Vec<u32>,
}

/// How a pull ended.
#[derive(Debug)]
pub(crate) enum PullOutcome {
    /// Every byte is in our blocks and P confirmed the lease was live when the reads completed.
    Pulled,
    /// The lease is gone or the transfer failed: the bytes must not be used.
    Lost(String),
}

pub(crate) async fn start(inner: &Arc<Inner>) -> Result<(), StartError> {
    let cfg = &inner.cfg;
    let hpr = inner.heads_per_rank();
    let block_bytes = cfg.model.block_bytes(hpr);
    let mut ranks = Vec::new();
    for r in 0..cfg.tp_size {
        let arena = BlockArena::new(cfg.num_gpu_blocks, block_bytes);
        let (tx, rx) = mpsc::unbounded_channel();
        let name = format!("{}/{r}", holder_name(&cfg.engine_id, inner.incarnation));
        let gate: Arc<dyn ReadGate> = Arc::new(Gate { inner: Arc::downgrade(inner) });
        let agent: Arc<dyn Agent> = match cfg.transport {
            TransportKind::Tcp => {
                let options =
                    kvlease_transport::tcp::TcpOptions { advertise: cfg.advertise_host, secret: cfg.secret.clone(), ..Default::default() };
                TcpAgent::start_with(name, &cfg.host, arena.clone(), gate, tx, options).await?
            }
            #[cfg(feature = "nixl")]
            TransportKind::Nixl => kvlease_transport::nixl::NixlAgent::start(name, arena.clone(), gate, tx, cfg.secret.clone()).await?,
            #[cfg(not(feature = "nixl"))]
            TransportKind::Nixl => {
                return Err(StartError::Config("this kvlease was built without NIXL support: build it with `--features nixl`".into()))
            }
        };
        tokio::spawn(agent_events(Arc::downgrade(inner), r as usize, rx));
        ranks.push(Rank { heads: r * hpr..(r + 1) * hpr, arena, agent });
    }
    let _ = inner.ranks.set(ranks);
    let addr = format!("{}:{}", cfg.host, cfg.kv_port);
    let listener = TcpListener::bind(&addr).await.map_err(|e| StartError::Bind { addr: addr.clone(), why: e.to_string() })?;
    let local = listener.local_addr().map_err(|e| StartError::Bind { addr, why: e.to_string() })?;
    let _ = inner.kv_addr.set(local);
    tokio::spawn(side_channel_server(Arc::downgrade(inner), listener));
    tokio::spawn(reaper(Arc::downgrade(inner)));
    tokio::spawn(renewer_task(Arc::downgrade(inner)));
    Ok(())
}

/// The name under which an engine holds leases (SPEC S5): its engine id and incarnation. Each
/// rank's transfer agent is named `{holder}/{rank}`, and the transport authenticates that name.
fn holder_name(engine_id: &str, incarnation: u64) -> String {
    format!("{engine_id}/{incarnation:x}")
}

/// The holder an agent, named as in [`holder_name`], acts for: all ranks of one engine are one.
fn agent_holder(agent: &str) -> &str {
    agent.rsplit_once('/').map_or(agent, |(holder, _rank)| holder)
}

/// Releases every lease as `shutdown` and every renewed lease explicitly, then flushes.
pub(crate) async fn shutdown(inner: &Arc<Inner>) {
    let mut released = Vec::new();
    lock(&inner.leases).shutdown(inner.now(), &mut released);
    settle(inner, released);
    drive_renewer(inner);
    // Give the releases a moment on the wire before the process goes.
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Whether our agents refuse reads of dead leases and never touch memory after a read ends
/// (tcp, mem). NIXL cannot: a posted READ lands whatever P thinks of the lease.
pub(crate) fn reads_are_fenced(inner: &Inner) -> bool {
    inner.ranks().iter().all(|r| r.agent.can_refuse_reads())
}

/// Gives blocks back to the pool — at once where reads are fenced, else only after a quarantine
/// long enough that no READ posted for them can still land (SPEC P5, D6).
pub(crate) fn free_after_reads(inner: &Inner, blocks: Blocks) {
    if reads_are_fenced(inner) {
        return drop(blocks);
    }
    let hold = inner.cfg.transfer.lease.quarantine();
    tokio::spawn(async move {
        tokio::time::sleep(hold).await;
        drop(blocks);
    });
}

// ---------------------------------------------------------------- P side

/// SPEC P1: the prefill finished normally; grant the lease and answer with signed params.
/// A request whose client is gone gets no lease: its blocks go back at once.
pub(crate) fn grant_and_finish(inner: &Arc<Inner>, seq: Seq) {
    let done = PrefillDone::from(seq);
    let Some(blocks) = done.blocks else { return };
    if done.tx.is_closed() || blocks.ids().is_empty() {
        return;
    }
    let block_ids = blocks.ids().to_vec();
    let mut sorted = block_ids.clone();
    sorted.sort_unstable();
    let n = block_ids.len() as u32;
    let prompt_digest = PromptDigest::of(&done.prompt);
    let lease_id = {
        let mut table = lock(&inner.leases);
        let id = table.grant(inner.now(), n, prompt_digest, Lease { blocks, sorted });
        inner.metrics.leases_active.store(table.live() as i64, Relaxed);
        inner.metrics.leased_blocks.store(table.leased_blocks() as i64, Relaxed);
        id
    };
    inner.metrics.leases_granted.fetch_add(1, Relaxed);
    let kv = inner.kv_addr.get().copied();
    let remote = RemoteKv {
        engine_id: inner.cfg.engine_id.clone(),
        request_id: done.client_id.clone(),
        block_ids,
        host: match (inner.cfg.advertise_host, kv) {
            (Some(ip), _) => ip.to_string(),
            (None, Some(a)) => a.ip().to_string(),
            (None, None) => inner.cfg.host.clone(),
        },
        port: kv.map(|a| a.port()).unwrap_or(0),
        tp_size: inner.cfg.tp_size,
        num_tokens: done.prompt.len() as u32,
        lease_id,
        incarnation: inner.incarnation,
        prompt_digest,
        signature: None,
    };
    let params = remote.to_json(inner.cfg.secret.as_deref());
    let first = done.first_token;
    if first != crate::model::EOS {
        let _ = done.tx.send(GenerateEvent::Token { id: first, text: crate::model::detokenize(first) });
    }
    let sent = done.tx.send(GenerateEvent::Done {
        finish_reason: FinishReason::Length,
        prompt_tokens: done.prompt.len() as u32,
        completion_tokens: 1,
        kv_transfer_params: Some(params),
    });
    if sent.is_err() {
        // The client left between the check and now: nobody will read; free at once.
        let (mut lost, mut released) = (Vec::new(), Vec::new());
        let mut table = lock(&inner.leases);
        let us = table.holder(&holder_name(&inner.cfg.engine_id, inner.incarnation));
        table.release(us, &[lease_id], inner.now(), &mut lost, &mut released);
        drop(table);
        settle(inner, released);
    }
}

/// Counts released leases and frees their blocks.
fn settle(inner: &Inner, released: Vec<Released<Lease>>) {
    if released.is_empty() {
        return;
    }
    for r in &released {
        inner.metrics.released(r.reason).fetch_add(1, Relaxed);
        inner.metrics.lease_hold.observe(r.held.as_secs_f64());
    }
    let table = lock(&inner.leases);
    inner.metrics.leases_active.store(table.live() as i64, Relaxed);
    inner.metrics.leased_blocks.store(table.leased_blocks() as i64, Relaxed);
    drop(table);
    for r in released {
        match r.payload {
            // Expired, released or shut down: a READ the transport cannot fence may be on its way.
            Some(lease) if r.reason.may_have_readers() => free_after_reads(inner, lease.blocks),
            // All reads completed: nothing can be in flight.
            Some(lease) => drop(lease),
            // A reader holds them; they come back when it ends.
            None => {}
        }
    }
}

/// SPEC P4: tick the lease table every half granularity, busy or idle.
async fn reaper(inner: Weak<Inner>) {
    let period = match inner.upgrade() {
        Some(i) => (i.cfg.transfer.lease.reap_granularity() / 2).max(Duration::from_micros(100)),
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        let mut released = Vec::new();
        lock(&inner.leases).tick(inner.now(), &mut released);
        settle(&inner, released);
    }
}

/// SPEC P5, S2: a read is served only for a live lease, only of that lease's blocks, and the
/// blocks stay out of the pool until the read has been copied out.
struct Gate {
    inner: Weak<Inner>,
}

struct Permit {
    inner: Weak<Inner>,
    ticket: Option<ReadTicket>,
}

impl ReadGate for Gate {
    fn begin_read(&self, peer: &str, lease_id: u64, blocks: &[u32]) -> Option<ReadPermit> {
        let inner = self.inner.upgrade()?;
        let mut released = Vec::new();
        let ticket = {
            let mut table = lock(&inner.leases);
            let owned = table.get(lease_id).is_some_and(|l| blocks.iter().all(|b| l.sorted.binary_search(b).is_ok()));
            if owned {
                let holder = table.holder(agent_holder(peer));
                table.begin_read(holder, lease_id, inner.now(), &mut released)
            } else {
                None
            }
        };
        settle(&inner, released);
        let Some(ticket) = ticket else {
            inner.metrics.reads_refused.fetch_add(1, Relaxed);
            return None;
        };
        Some(Box::new(Permit { inner: Arc::downgrade(&inner), ticket: Some(ticket) }))
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let (Some(inner), Some(ticket)) = (self.inner.upgrade(), self.ticket.take()) else { return };
        // A lease released under this reader hands its blocks back only now.
        let payload = lock(&inner.leases).end_read(ticket);
        drop(payload);
    }
}

/// Every event any rank's agent reports.
async fn agent_events(inner: Weak<Inner>, rank: usize, mut rx: mpsc::UnboundedReceiver<AgentEvent>) {
    while let Some(ev) = rx.recv().await {
        let Some(inner) = inner.upgrade() else { return };
        match ev {
            AgentEvent::Notification { from, bytes } => on_notification(&inner, rank, &from, &bytes),
            AgentEvent::Rejected { reason } => inner.metrics.rejected(reason),
            AgentEvent::Disconnected { peer } => {
                let engine = lock(&inner.agent_engines).get(&peer).cloned();
                let p_engine = engine.filter(|e| lock(&inner.peers).get(e).is_some_and(|p| p.agents.contains(&peer)));
                if let Some(engine) = p_engine {
                    // A P engine we renew leases with: forget its agents, handshake again
                    // before the next heartbeat.
                    tracing::info!(peer = %peer, "transfer agent disconnected; handshake again before the next heartbeat");
                    forget_peer(&inner, &engine);
                    lock(&inner.renewer).disconnected(&engine);
                    inner.renewer_wake.notify_one();
                } else {
                    // A D engine's agent (or one we never knew): it handshakes again if it
                    // comes back.
                    lock(&inner.agent_engines).remove(&peer);
                    for r in inner.ranks() {
                        r.agent.remove_peer(&peer);
                    }
                }
            }
        }
    }
}

fn on_notification(inner: &Arc<Inner>, rank: usize, from: &str, bytes: &[u8]) {
    let msg = match Message::decode(bytes) {
        Ok(m) => m,
        Err(e) => {
            inner.metrics.rejected(e.reason());
            return;
        }
    };
    match msg {
        // For D, from a P engine: the renewer's business.
        Message::HeartbeatAck { .. } | Message::LeaseLost { .. } => {
            let engine = lock(&inner.agent_engines).get(from).cloned();
            let Some(engine) = engine else { return };
            lock(&inner.renewer).on_message(&engine, &msg);
            inner.renewer_wake.notify_one();
            inner.bump_news();
        }
        Message::ReadDoneAck { lease_id, live } => {
            if let Some(tx) = lock(&inner.read_acks).remove(&(rank, from.to_string(), lease_id)) {
                let _ = tx.send(live);
            }
        }
        Message::ClockPong { .. } => {}
        Message::Hello(_) => inner.metrics.rejected("malformed"),
        // For P, from a D engine: the lease table's business; it says what to answer.
        Message::Heartbeat { .. } | Message::Release { .. } | Message::ReadDone { .. } | Message::ClockPing { .. } => {
            if matches!(msg, Message::Heartbeat { .. }) {
                inner.metrics.heartbeats_received.fetch_add(1, Relaxed);
            }
            let mut released = Vec::new();
            let answer = {
                let mut table = lock(&inner.leases);
                let holder = table.holder(agent_holder(from));
                table.on_message(holder, &msg, inner.now(), &mut released)
            };
            settle(inner, released);
            // D sends each heartbeat to every P rank (SPEC D2); all ranks share this table, so
            // only rank 0's copy counts as renewals (one per lease per heartbeat).
            if rank == 0 {
                inner.metrics.lease_renewals.fetch_add(answer.renewed as u64, Relaxed);
            }
            if let (Some(reply), Some(r)) = (answer.reply, inner.ranks().get(rank)) {
                if let Err(e) = r.agent.send_notif(from, reply.encode()) {
                    tracing::debug!("cannot answer {from}: {e}");
                }
            }
        }
    }
}

/// Answers handshakes: checks the peer (its proof of the cluster secret and its signature, then
/// its geometry), replies with our Hello, and introduces its agents to ours.
async fn side_channel_server(inner: Weak<Inner>, listener: TcpListener) {
    let pending = Arc::new(tokio::sync::Semaphore::new(side_channel::MAX_PENDING));
    loop {
        let mut stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!("side channel accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(strong) = inner.upgrade() else { return };
        let Ok(slot) = Arc::clone(&pending).try_acquire_owned() else {
            // A flood of handshakes: close at once rather than hold buffers for them all.
            strong.metrics.rejected("overloaded");
            continue;
        };
        let secret = strong.cfg.secret.clone();
        drop(strong);
        let inner = inner.clone();
        tokio::spawn(async move {
            let _slot = slot;
            stream.set_nodelay(true).ok();
            let got = side_channel::accept(&mut stream, secret.as_deref()).await;
            let Some(inner) = inner.upgrade() else { return };
            let t_recv = inner.now().0;
            let (hello, nonces) = match got {
                Ok(h) => h,
                Err(e) => {
                    if matches!(e, side_channel::HandshakeError::Unauthenticated) {
                        tracing::warn!("handshake refused: the peer does not hold this cluster's secret");
                    }
                    return e.reason().into_iter().for_each(|r| inner.metrics.rejected(r));
                }
            };
            if let Err(e) = check_geometry(&inner, &hello) {
                tracing::warn!(peer = %hello.engine_id, "handshake refused: {e}");
                return;
            }
            // The peer adds our agents only once it has our reply: introduce its agents to
            // ours alongside, not before replying, or each side would wait for the other.
            let (inner2, hello2) = (inner.clone(), hello.clone());
            tokio::spawn(async move {
                if let Err(e) = introduce(&inner2, &hello2).await {
                    tracing::warn!(peer = %hello2.engine_id, "cannot reach the peer's transfer agents: {e}");
                }
            });
            let mut ours = our_hello(&inner);
            ours.echo = (hello.t_send, t_recv);
            side_channel::sign(secret.as_deref(), &nonces, Side::Server, &mut ours);
            let _ = write_frame(&mut stream, &Message::Hello(ours)).await;
        });
    }
}

fn our_hello(inner: &Inner) -> Hello {
    let m = &inner.cfg.model;
    let info = json!({
        "tp_size": inner.cfg.tp_size, "num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim, "dtype_bytes": m.dtype_bytes, "block_size": m.block_size,
    });
    Hello {
        engine_id: inner.cfg.engine_id.clone(),
        incarnation: inner.incarnation,
        agents: inner.ranks().iter().map(|r| r.agent.metadata()).collect(),
        info: info.to_string().into_bytes(),
        t_send: inner.now().0,
        echo: (0, 0),
        // Signed per connection by the side channel (SPEC S1, S2).
        auth: Vec::new(),
    }
}

/// Checks that a peer serves the same model geometry (its TP may differ).
fn check_geometry(inner: &Inner, hello: &Hello) -> Result<(), String> {
    let info: serde_json::Value = serde_json::from_slice(&hello.info).map_err(|e| format!("bad engine info: {e}"))?;
    let m = &inner.cfg.model;
    for (key, ours) in [
        ("num_layers", m.num_layers),
        ("num_kv_heads", m.num_kv_heads),
        ("head_dim", m.head_dim),
        ("dtype_bytes", m.dtype_bytes),
        ("block_size", m.block_size),
    ] {
        let theirs = info.get(key).and_then(|v| v.as_u64());
        if theirs != Some(u64::from(ours)) {
            return Err(format!("{key} differs: ours {ours}, theirs {theirs:?}; P and D must serve the same model geometry"));
        }
    }
    let tp = info.get("tp_size").and_then(|v| v.as_u64()).unwrap_or(0);
    if tp == 0 || tp as usize != hello.agents.len() || u64::from(m.num_kv_heads) % tp != 0 {
        return Err(format!("peer tp_size {tp} does not fit {} agents and {} heads", hello.agents.len(), m.num_kv_heads));
    }
    Ok(())
}

/// Checks a peer's geometry and adds its agents to every rank's agent.
async fn introduce(inner: &Arc<Inner>, hello: &Hello) -> Result<Vec<String>, String> {
    check_geometry(inner, hello)?;
    // All at once: an agent may wait for its peer to have added it too, and the peer adds ours
    // in an order of its own; one at a time, the two sides could wait on each other.
    let mut adds = Vec::new();
    for rank in inner.ranks() {
        for md in &hello.agents {
            let (agent, md) = (rank.agent.clone(), md.clone());
            adds.push(tokio::spawn(async move { agent.add_peer(&md).await }));
        }
    }
    let mut names = Vec::new();
    for (i, add) in adds.into_iter().enumerate() {
        let name = add.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
        if i < hello.agents.len() {
            names.push(name);
        }
    }
    // SPEC S5: leases are held under the agents' names, so an engine may only introduce agents
    // named for itself (`{engine_id}/{incarnation:x}/{rank}`), never another engine's.
    let own = holder_name(&hello.engine_id, hello.incarnation);
    if let Some((rank, bad)) = names.iter().enumerate().find(|(rank, n)| **n != format!("{own}/{rank}")) {
        for r in inner.ranks() {
            for n in &names {
                r.agent.remove_peer(n);
            }
        }
        return Err(format!(
            "{:?} introduced an agent named {bad:?} as its rank {rank}; its agents must be named {own}/<rank>",
            hello.engine_id
        ));
    }
    let mut engines = lock(&inner.agent_engines);
    for n in &names {
        engines.insert(n.clone(), hello.engine_id.clone());
    }
    Ok(names)
}

/// Drops what we know of a P engine's agents, and their connections.
fn forget_peer(inner: &Inner, engine_id: &str) {
    let Some(peer) = lock(&inner.peers).remove(engine_id) else { return };
    let mut engines = lock(&inner.agent_engines);
    for agent in &peer.agents {
        engines.remove(agent);
    }
    drop(engines);
    for r in inner.ranks() {
        for agent in &peer.agents {
            r.agent.remove_peer(agent);
        }
    }
}

// ---------------------------------------------------------------- D side

/// The renewer's driver: polls it when it asks to be polled or when woken, carries out what it
/// says. Runs on its own, so a long forward step delays no heartbeat (SPEC D3).
async fn renewer_task(inner: Weak<Inner>) {
    loop {
        let Some(strong) = inner.upgrade() else { return };
        let next = drive_renewer(&strong);
        let wait = next.map(|t| t.since(strong.now())).unwrap_or(Duration::from_secs(1)).min(Duration::from_secs(1));
        let wake = strong.renewer_wake.clone();
        drop(strong);
        let _ = tokio::time::timeout(wait, wake.notified()).await;
    }
}

/// One poll of the renewer; returns when it next wants to be polled.
fn drive_renewer(inner: &Arc<Inner>) -> Option<kvlease_core::Nanos> {
    let mut actions = Vec::new();
    let next = {
        let mut r = lock(&inner.renewer);
        r.poll(inner.now(), &mut actions);
        r.poll_timeout()
    };
    for a in actions {
        match a {
            Action::Handshake { engine_id, host, port } => {
                tokio::spawn(handshake(inner.clone(), engine_id, host, port));
            }
            Action::Send { engine_id, bytes, kind } => {
                let peer = lock(&inner.peers).get(&engine_id).cloned();
                let Some(peer) = peer else {
                    lock(&inner.renewer).disconnected(&engine_id);
                    continue;
                };
                let Some(rank0) = inner.ranks().first() else { continue };
                let mut ok = true;
                // SPEC D2: to every P rank that holds a shard.
                for agent in &peer.agents {
                    ok &= rank0.agent.send_notif(agent, bytes.clone()).is_ok();
                }
                match kind {
                    SendKind::Heartbeat { lateness } => {
                        inner.metrics.heartbeats_sent.fetch_add(1, Relaxed);
                        inner.metrics.heartbeat_lateness.observe(lateness.as_secs_f64());
                    }
                    SendKind::ReadRenewal => {
                        inner.metrics.heartbeats_sent.fetch_add(1, Relaxed);
                    }
                    SendKind::Release => {}
                }
                if !ok {
                    forget_peer(inner, &engine_id);
                    lock(&inner.renewer).disconnected(&engine_id);
                }
            }
            Action::Lost { request_id, lease_id } => {
                tracing::info!(request = %request_id, lease_id, "lease lost on the prefill engine");
                inner.bump_news();
            }
            Action::Forget { engine_id } => forget_peer(inner, &engine_id),
        }
    }
    next
}

/// SPEC D5: a background handshake with a P engine; reports to the renewer when done.
async fn handshake(inner: Arc<Inner>, engine_id: String, host: String, port: u16) {
    let addr = format!("{host}:{port}");
    let ours = our_hello(&inner);
    let result = async {
        let theirs = side_channel::exchange(&addr, inner.cfg.secret.as_deref(), ours.clone()).await?;
        if theirs.echo.0 != ours.t_send {
            return Err(format!("the engine at {addr} answered another handshake (a replay?)"));
        }
        if theirs.engine_id != engine_id {
            return Err(format!("the engine at {addr} is {:?}, not {engine_id:?}", theirs.engine_id));
        }
        // A previous incarnation's agents are of no more use. The same incarnation's stay: they
        // are re-added as they are (dropping a live connection only to dial it again would make
        // the other side wait for the old one to close).
        let old = lock(&inner.peers).get(&engine_id).map(|p| p.incarnation);
        if old.is_some_and(|i| i != theirs.incarnation) {
            forget_peer(&inner, &engine_id);
        }
        let agents = introduce(&inner, &theirs).await?;
        Ok((theirs.incarnation, agents))
    }
    .await;
    let now = inner.now();
    match result {
        Ok((incarnation, agents)) => {
            // Under the renewer's lock: no pull sees the engine Ready before its agents are
            // known, and a result nobody waits for any more leaves nothing behind.
            let mut renewer = lock(&inner.renewer);
            if renewer.handshake_done(&engine_id, Ok(incarnation), now) {
                lock(&inner.peers).insert(engine_id.clone(), Peer { incarnation, agents });
            } else {
                drop(renewer);
                let mut engines = lock(&inner.agent_engines);
                for agent in &agents {
                    engines.remove(agent);
                }
                drop(engines);
                for r in inner.ranks() {
                    for agent in &agents {
                        r.agent.remove_peer(agent);
                    }
                }
            }
        }
        Err(e) => {
            tracing::warn!(engine = %engine_id, "handshake with {addr} failed: {e}; retrying with back-off");
            lock(&inner.renewer).handshake_done(&engine_id, Err(()), now);
        }
    }
    inner.renewer_wake.notify_one();
    inner.bump_news();
}

/// SPEC D6, T1, T2: pull the prompt's KV of `rk` into `local` blocks, every D rank from every
/// P rank whose heads overlap its own, under the lease; `Pulled` only when P confirmed each
/// completion while the lease was live.
pub(crate) async fn pull(inner: &Arc<Inner>, internal: &str, rk: &RemoteKv, local: &[u32]) -> PullOutcome {
    let lease = &inner.cfg.transfer.lease;
    // 1. Wait until an acknowledged heartbeat covers the read.
    let mut news = inner.news.subscribe();
    let wait = lease.ack_wait();
    let give_up = tokio::time::Instant::now() + wait;
    loop {
        news.borrow_and_update();
        match lock(&inner.renewer).read_check(internal, lease.read_budget(), inner.now()) {
            ReadCheck::Safe => break,
            ReadCheck::Untracked => return PullOutcome::Lost("the prefill engine reported the lease lost".into()),
            ReadCheck::Unreachable => return PullOutcome::Lost(format!("no handshake with the prefill engine {}", rk.engine_id)),
            ReadCheck::RenewFirst => inner.renewer_wake.notify_one(),
        }
        if tokio::time::timeout_at(give_up, news.changed()).await.is_err() {
            return PullOutcome::Lost(format!("no heartbeat acknowledgement from {} within {wait:?}", rk.engine_id));
        }
    }
    if let Some(delay) = inner.cfg.debug_read_delay {
        // Test hook: widen the window between the liveness check and the read.
        tokio::time::sleep(delay).await;
    }
    let Some(peer) = lock(&inner.peers).get(&rk.engine_id).cloned() else {
        return PullOutcome::Lost("no connection to the prefill engine".into());
    };
    if peer.incarnation != rk.incarnation {
        // P restarted after granting: the same lease id may now name another request's blocks.
        return PullOutcome::Lost("the prefill engine restarted since it granted the lease".into());
    }
    // 2. Plan: one read per (D rank, P rank) pair whose heads overlap (SPEC T1, T2).
    let m = &inner.cfg.model;
    let Some(plan) = kvlease_core::tp::read_plan(m.num_kv_heads, peer.agents.len() as u32, inner.cfg.tp_size) else {
        return PullOutcome::Lost(format!("a prefill engine of {} ranks cannot serve {} heads", peer.agents.len(), m.num_kv_heads));
    };
    let hbb = m.head_block_bytes() as u32;
    let n = plan.len() as u32;
    // 3. Read, each with its ReadDone attached; P answers each ReadDone.
    let mut acks = AckWaiters { inner, lease_id: rk.lease_id, keys: Vec::new(), rx: Vec::new() };
    let mut reads = Vec::new();
    for (consumer, pair) in plan.iter().enumerate() {
        let p_agent = peer.agents[pair.p_rank as usize].clone();
        let segments: Vec<Segment> = rk
            .block_ids
            .iter()
            .zip(local)
            .map(|(&remote_block, &local_block)| Segment {
                remote_block,
                remote_offset: pair.p_head_offset * hbb,
                local_block,
                local_offset: pair.d_head_offset * hbb,
                len: (pair.heads.end - pair.heads.start) * hbb,
            })
            .collect();
        acks.expect(pair.d_rank as usize, &p_agent);
        // The digest D checked against its own prompt on arrival (SPEC S4); P checks it again.
        let notif = Message::ReadDone { lease_id: rk.lease_id, consumer_rank: consumer as u32, n, digest: rk.prompt_digest }.encode();
        let agent = inner.ranks()[pair.d_rank as usize].agent.clone();
        let op = ReadOp { lease_id: rk.lease_id, segments, notif: Some(notif) };
        reads.push(async move { agent.read(&p_agent, op).await });
    }
    // Awaited here, not spawned: on timeout they are dropped, which cancels them (a fenced
    // transport then writes nothing more into our blocks).
    match tokio::time::timeout(lease.read_timeout(), futures_util::future::join_all(reads)).await {
        Err(_) => return PullOutcome::Lost("the read timed out".into()),
        Ok(results) => {
            if let Some(e) = results.into_iter().find_map(Result::err) {
                return PullOutcome::Lost(e.to_string());
            }
        }
    }
    // 4. Every completion must have been confirmed while the lease was live.
    let confirmed = tokio::time::timeout(wait, futures_util::future::join_all(acks.rx.drain(..))).await;
    match confirmed {
        Err(_) => PullOutcome::Lost("no read-completion acknowledgement from the prefill engine".into()),
        Ok(answers) if answers.iter().all(|a| matches!(a, Ok(true))) => PullOutcome::Pulled,
        Ok(_) => PullOutcome::Lost("the lease ended before the read completed".into()),
    }
}

/// The `ReadDoneAck`s a pull waits for; whatever is left when the pull ends is unregistered.
struct AckWaiters<'a> {
    inner: &'a Inner,
    lease_id: u64,
    keys: Vec<(usize, String, u64)>,
    rx: Vec<oneshot::Receiver<bool>>,
}

impl AckWaiters<'_> {
    fn expect(&mut self, d_rank: usize, p_agent: &str) {
        let (tx, rx) = oneshot::channel();
        let key = (d_rank, p_agent.to_string(), self.lease_id);
        lock(&self.inner.read_acks).insert(key.clone(), tx);
        self.keys.push(key);
        self.rx.push(rx);
    }
}

impl Drop for AckWaiters<'_> {
    fn drop(&mut self) {
        let mut acks = lock(&self.inner.read_acks);
        for key in &self.keys {
            acks.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EngineConfig, EngineHandle};

    /// A real tcp agent named `name`, holding `secret`, that has added `peer` (so a dial from
    /// `peer` is accepted once proven).
    async fn agent(name: &str, secret: &[u8], peer: Vec<u8>) -> Arc<TcpAgent> {
        // Its events are not looked at: a closed channel drops them.
        let (tx, _) = mpsc::unbounded_channel();
        let options = kvlease_transport::tcp::TcpOptions { secret: Some(secret.to_vec()), ..Default::default() };
        let gate = Arc::new(kvlease_transport::OpenGate);
        let a = TcpAgent::start_with(name.into(), "127.0.0.1", BlockArena::new(4, 4096), gate, tx, options).await.unwrap();
        let a2 = a.clone();
        tokio::spawn(async move { a2.add_peer(&peer).await });
        a
    }

    /// SPEC S5: leases are held under agent names, so an engine of the cluster may introduce only
    /// agents named for itself; agents named for another engine (whose leases it would then hold)
    /// are refused and forgotten.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn s5_an_engine_cannot_introduce_another_engines_agents() {
        let secret = b"cluster".to_vec();
        let p = EngineHandle::start(EngineConfig { secret: Some(secret.clone()), ..EngineConfig::default() }).await.unwrap();
        let inner = p.inner();
        let ours = inner.ranks()[0].agent.metadata();

        let victim = agent("victim/1/0", &secret, ours.clone()).await;
        let mut hello = our_hello(inner);
        hello.engine_id = "mallory".into();
        hello.incarnation = 7;
        hello.agents = vec![victim.metadata()];
        let err = introduce(inner, &hello).await.unwrap_err();
        assert!(err.contains("must be named mallory/7/<rank>"), "{err}");
        assert!(lock(&inner.agent_engines).is_empty(), "nothing of it is kept");

        // The same agent introduced by the engine it is named for is welcome.
        hello.engine_id = "victim".into();
        hello.incarnation = 1;
        let again = agent("victim/1/0", &secret, ours).await;
        hello.agents = vec![again.metadata()];
        assert_eq!(introduce(inner, &hello).await.unwrap(), vec!["victim/1/0".to_string()]);
    }
}
