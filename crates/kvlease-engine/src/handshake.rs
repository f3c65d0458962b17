//! The handshake, both ways: answering on our side channel and dialling a P engine's in the
//! background (SPEC D5), then introducing the peer's transfer agents to ours. And releases over
//! the side channel (SPEC O4), both ways: D delivers those no transfer link can carry, P applies
//! them as the same release over the agents.
//!
//! The side channel ([`crate::side_channel`]) authenticates the bytes with the cluster secret
//! (SPEC S1, S2) and admits strangers so that they never keep a peer out (issue 22); what a Hello
//! must say to be accepted — the echo, the engine id, the geometry, agents named for their engine
//! (S5) — is decided in `kvlease_core::peers`, and what a new incarnation, a failed handshake or
//! a duplicate engine id means for leases in the renewer. This module moves bytes and agents.
//!
//! With per-engine certificates (SPEC S6, [`kvlease_transport::tls`]) every side-channel
//! connection runs mutual TLS first, and the peer is the engine its certificate names: a dialer
//! checks that the engine it meant answers, and we refuse a Hello or a release that claims
//! another engine than the dialer's certificate, naming both. The secret's proofs still run
//! inside (under the empty key without a secret).

use crate::lease_holder::with_holder;
use crate::side_channel::{self, write_frame, DialError, Request};
use crate::state::Inner;
use crate::TransportKind;
use kvlease_core::auth::{ClusterKey, Nonces, Side};
use kvlease_core::clock::ClockSample;
use kvlease_core::peers::{check_agent_names, check_reply, holder_name, notif_key, Geometry, Refused};
use kvlease_core::renewer::{Handshook, NotRead, SideChannelRelease};
use kvlease_core::wire::{Hello, Message, SideRelease};
use kvlease_transport::admission::{Admission, Unproven};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// A side-channel connection: a TCP socket, or an in-memory stream under the simulator.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Where the side channel listens.
pub(crate) enum Listener {
    Tcp(TcpListener),
    Mem(kvlease_transport::mem::MemListener),
}

/// Why the side channel could not listen.
#[derive(Debug, Error)]
pub enum BindError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Mem(#[from] kvlease_transport::TransportError),
    #[error("{addr}: {why}")]
    MemAddr { addr: String, why: std::net::AddrParseError },
}

impl Listener {
    /// Binds the side channel for `transport` at `host:port`; returns it and its address.
    pub async fn bind(transport: &TransportKind, host: &str, port: u16) -> Result<(Listener, SocketAddr), BindError> {
        match transport {
            TransportKind::Mem(net) => {
                let l = net.listen(host, port)?;
                let addr = l.addr().parse().map_err(|why| BindError::MemAddr { addr: l.addr().to_string(), why })?;
                Ok((Listener::Mem(l), addr))
            }
            _ => {
                let l = kvlease_transport::listen(host, port).await?;
                let addr = l.local_addr()?;
                Ok((Listener::Tcp(l), addr))
            }
        }
    }

    /// The next connection, and the address it comes from.
    async fn accept(&mut self) -> std::io::Result<(Box<dyn Stream>, IpAddr)> {
        match self {
            Listener::Tcp(l) => {
                let (s, peer) = l.accept().await?;
                s.set_nodelay(true).ok();
                Ok((Box::new(s), peer.ip()))
            }
            Listener::Mem(l) => match l.accept().await {
                Some(s) => Ok((Box::new(s), IpAddr::V4(Ipv4Addr::LOCALHOST))),
                None => Err(std::io::ErrorKind::NotConnected.into()),
            },
        }
    }
}

async fn connect(transport: &TransportKind, addr: &str) -> std::io::Result<Box<dyn Stream>> {
    match transport {
        TransportKind::Mem(net) => Ok(Box::new(net.connect(addr).await?)),
        _ => {
            let s = tokio::net::TcpStream::connect(addr).await?;
            s.set_nodelay(true).ok();
            Ok(Box::new(s))
        }
    }
}

/// A side-channel connection to the engine `engine_id` at `addr`: with certificates (SPEC S6),
/// inside mutual TLS with that engine's certificate.
async fn connect_to(inner: &Inner, addr: &str, engine_id: &str) -> Result<Box<dyn Stream>, HandshakeFailed> {
    let stream = connect(&inner.cfg.transport, addr).await.map_err(|e| HandshakeFailed::Connect(addr.to_string(), e))?;
    match &inner.cfg.transfer_tls {
        None => Ok(stream),
        Some(tls) => match tls.connect(stream, engine_id).await {
            Ok(s) => Ok(Box::new(s)),
            Err(e) => {
                inner.metrics.handshake_refused("certificate");
                Err(HandshakeFailed::Certificate(addr.to_string(), e))
            }
        },
    }
}

/// Why a handshake did not complete.
#[derive(Debug, Error)]
pub(crate) enum HandshakeFailed {
    #[error("connect {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("handshake with {0} timed out")]
    TimedOut(String),
    #[error("{0}")]
    Channel(#[from] side_channel::DialError),
    #[error("{0}")]
    Refused(#[from] Refused),
    #[error("cannot reach the peer's transfer agents: {0}")]
    Agents(String),
    /// SPEC S6.
    #[error("refusing the engine at {0}: {1}")]
    Certificate(String, kvlease_transport::tls::PeerError),
}

/// Our engine's geometry, as handshakes compare it (SPEC T1).
pub(crate) fn geometry(inner: &Inner) -> Geometry {
    let m = &inner.cfg.model;
    Geometry {
        tp_size: inner.cfg.tp_size,
        num_layers: m.num_layers,
        num_kv_heads: m.num_kv_heads,
        head_dim: m.head_dim,
        dtype_bytes: m.dtype_bytes,
        block_size: m.block_size,
        push: inner.cfg.transfer.push_mode(),
    }
}

/// Our Hello to engine `peer` (whose certificate the side channel checked, SPEC S6).
pub(crate) fn our_hello(inner: &Inner, peer: &str) -> Hello {
    Hello {
        engine_id: inner.cfg.engine_id.clone(),
        incarnation: inner.incarnation,
        agents: inner.ranks().iter().map(|r| r.agent.metadata()).collect(),
        info: geometry(inner).to_info(),
        t_send: inner.now().0,
        echo: (0, 0),
        // Signed per connection by the side channel (SPEC S1, S2).
        auth: Vec::new(),
        // SPEC S6: for `peer` only, inside mutual TLS.
        notif_key: inner.peer_keys.as_ref().map(|k| k.ours_for(peer).to_vec()).unwrap_or_default(),
    }
}

/// The key of every proof and signature on the side channel (SPEC S1, S2).
fn cluster_key(inner: &Inner) -> ClusterKey {
    ClusterKey::new(inner.cfg.secret.as_deref())
}

/// Answers handshakes and releases: the side channel checks the peer's proof of the cluster
/// secret and its signature, core checks its geometry; we reply with our Hello (or say why not)
/// and introduce its agents. Every connection is admitted: one that has proven nothing yet is
/// evicted by newcomers once too many wait (oldest first), so strangers never keep a member of
/// the cluster out (issue 22), and proven ones share a few places of their own.
pub(crate) async fn serve(inner: Arc<Inner>, mut listener: Listener) {
    let unproven = Admission::new(side_channel::MAX_UNPROVEN, side_channel::MAX_UNPROVEN_PER_SOURCE);
    let proven = Arc::new(Semaphore::new(side_channel::MAX_PROVEN));
    let key = Arc::new(cluster_key(&inner));
    loop {
        let (stream, source) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!("side channel accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (place, evicted) = unproven.admit(source);
        for _ in 0..evicted {
            inner.metrics.rejected("overloaded");
        }
        let (inner2, key, proven) = (inner.clone(), key.clone(), proven.clone());
        inner.tasks.spawn(async move { answer(&inner2, &key, stream, place, &proven).await });
    }
}

async fn answer(inner: &Arc<Inner>, key: &ClusterKey, stream: Box<dyn Stream>, mut place: Unproven, proven: &Arc<Semaphore>) {
    // SPEC S6: mutual TLS first; the dialer is then the engine its certificate names.
    let (mut stream, cert) = match &inner.cfg.transfer_tls {
        None => (stream, None),
        Some(tls) => {
            let accepted = tokio::select! {
                _ = place.evicted() => return,
                r = tokio::time::timeout(side_channel::PROOF_TIMEOUT, tls.accept(stream)) => r,
            };
            match accepted {
                // Silent past the deadline, or closed without a word: a probe, nothing to count.
                Err(_) => return,
                Ok(Err(e)) if e.is_silent_close() => return,
                Ok(Err(e)) => {
                    tracing::warn!("handshake refused: {e}");
                    inner.metrics.rejected("unauthenticated");
                    inner.metrics.handshake_refused("certificate");
                    return;
                }
                Ok(Ok((s, id))) => (Box::new(s) as Box<dyn Stream>, Some(id)),
            }
        }
    };
    let stream = &mut stream;
    let proof = tokio::select! {
        // A newcomer took its place (counted then).
        _ = place.evicted() => return,
        r = tokio::time::timeout(side_channel::PROOF_TIMEOUT, side_channel::challenge(stream, key)) => r,
    };
    let dialer = match proof {
        // Silent past the deadline: a probe or a stranger, nothing to count.
        Err(_) => return,
        Ok(Err(e)) => return refused(inner, &e),
        Ok(Ok(dialer)) => dialer,
    };
    place.proven();
    // A member of the cluster: it waits for one of the few places for proven handshakes.
    let Ok(Ok(_permit)) = tokio::time::timeout(side_channel::HANDSHAKE_TIMEOUT, proven.clone().acquire_owned()).await else { return };
    let request = match tokio::time::timeout(side_channel::HANDSHAKE_TIMEOUT, side_channel::request(stream, key, &dialer)).await {
        Err(_) => return,
        Ok(Err(e)) => return refused(inner, &e),
        Ok(Ok(r)) => r,
    };
    let t_recv = inner.now().0;
    let claimed = match &request {
        Request::Hello(h) => &h.engine_id,
        Request::Release(r) => &r.engine_id,
    };
    if let Some(Err(e)) = cert.as_deref().map(|id| kvlease_transport::tls::check_claim(id, claimed)) {
        // SPEC S6, S5 against insiders: a certificate speaks for its own engine only.
        let reason = format!("engine {:?} refuses the peer: {e}", inner.cfg.engine_id);
        tracing::warn!(peer = %claimed, "handshake refused: {reason}");
        inner.metrics.rejected("unauthenticated");
        inner.metrics.handshake_refused("certificate");
        let _ = write_frame(stream, &Message::Refused { what: "certificate".into(), reason }).await;
        return;
    }
    match request {
        Request::Hello(hello) => answer_hello(inner, key, stream, hello, &dialer.nonces, t_recv).await,
        Request::Release(release) => {
            let ack = apply_side_release(inner, &release);
            let _ = write_frame(stream, &ack).await;
        }
    }
}

/// A side-channel connection closed for `e`: counted, and logged when the peer lacks the secret.
fn refused(inner: &Inner, e: &side_channel::HandshakeError) {
    if matches!(e, side_channel::HandshakeError::Unauthenticated) {
        tracing::warn!("handshake refused: the peer does not hold this cluster's secret");
    }
    if let Some(r) = e.reason() {
        inner.metrics.rejected(r);
    }
}

async fn answer_hello(inner: &Arc<Inner>, key: &ClusterKey, stream: &mut Box<dyn Stream>, hello: Hello, nonces: &Nonces, t_recv: u64) {
    let acceptable = geometry(inner).check_peer(&hello).and_then(|_| notif_key(&hello, inner.peer_keys.is_some()));
    if let Err(e) = acceptable {
        // Said in both logs, in the same words: the field, its flag and both values.
        let reason = e.between(&inner.cfg.engine_id, &hello.engine_id);
        tracing::warn!(peer = %hello.engine_id, "handshake refused: {reason}");
        inner.metrics.handshake_refused(e.label());
        let _ = write_frame(stream, &Message::Refused { what: e.label().into(), reason }).await;
        return;
    }
    // The peer adds our agents only once it has our reply: introduce its agents to ours
    // alongside, not before replying, or each side would wait for the other.
    let (inner2, hello2) = (inner.clone(), hello.clone());
    inner.tasks.spawn(async move {
        match introduce(&inner2, &hello2).await {
            Ok(names) => {
                let old = inner2.renewer.with(|r| r.introduced(&hello2.engine_id, hello2.incarnation, names));
                drop_agents(&inner2, &old);
                // Push mode: P's writes wait for D's agents to be known here.
                inner2.bump_news();
            }
            Err(e) => tracing::warn!(peer = %hello2.engine_id, "{e}"),
        }
    });
    let mut ours = our_hello(inner, &hello.engine_id);
    ours.echo = (hello.t_send, t_recv);
    let mut ours = Message::Hello(ours);
    side_channel::sign(key, nonces, Side::Acceptor, &mut ours);
    let _ = write_frame(stream, &ours).await;
}

/// P, SPEC O4: D releases leases over our side channel, since no transfer link can carry it.
/// Applied to the lease table as the same `Release` from that holder (D's engine id and
/// incarnation) over the agents would be: only the lease's holder, or anyone for a lease nobody
/// claimed yet (SPEC S5). Leases of another incarnation of ours are not touched. Returns the
/// answer.
fn apply_side_release(inner: &Inner, r: &SideRelease) -> Message {
    let lost = if r.granted_by != 0 && r.granted_by != inner.incarnation {
        r.lease_ids.clone()
    } else {
        let release = Message::Release { lease_ids: r.lease_ids.clone() };
        let answer = with_holder(inner, |h, now, out| h.on_message(&holder_name(&r.engine_id, r.incarnation), &release, now, out));
        match answer.reply {
            Some(Message::LeaseLost { lease_ids }) => lease_ids,
            _ => Vec::new(),
        }
    };
    let n = r.lease_ids.len() - lost.len().min(r.lease_ids.len());
    if r.what == "duplicate_engine_id" {
        // The operator's mistake, named in our log too (D names it in its own).
        tracing::warn!(peer = %r.engine_id, released = n, "leases released unread over the side channel: {}", r.why);
        inner.metrics.handshake_refused("duplicate_engine_id");
    } else {
        tracing::info!(peer = %r.engine_id, released = n, "leases released unread over the side channel: {}", r.why);
    }
    Message::SideReleaseAck { incarnation: inner.incarnation, lost_ids: lost }
}

/// Checks a peer's geometry, adds its agents to every rank's agent, and checks they are named
/// for it (SPEC S5). Returns their names, in rank order.
pub(crate) async fn introduce(inner: &Arc<Inner>, hello: &Hello) -> Result<Vec<String>, HandshakeFailed> {
    geometry(inner).check_peer(hello)?;
    // SPEC S6: the key our notifications to it are tagged under, before any can be sent.
    if let (Some(keys), Some(theirs)) = (&inner.peer_keys, notif_key(hello, inner.peer_keys.is_some())?) {
        keys.learn(&hello.engine_id, theirs);
    }
    // All at once: an agent may wait for its peer to have added it too, and the peer adds ours
    // in an order of its own; one at a time, the two sides could wait on each other.
    let mut adds = Vec::new();
    for rank in inner.ranks() {
        for md in &hello.agents {
            let agent = rank.agent.clone();
            adds.push(async move { agent.add_peer(md).await });
        }
    }
    let results = futures_util::future::join_all(adds).await;
    let mut names = Vec::new();
    let mut failed = None;
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(name) if i < hello.agents.len() => names.push(name),
            Ok(_) => {}
            Err(e) => failed = failed.or(Some(e.to_string())),
        }
    }
    if let Some(e) = failed {
        drop_agents(inner, &names);
        return Err(HandshakeFailed::Agents(e));
    }
    if let Err(e) = check_agent_names(hello, &names) {
        drop_agents(inner, &names);
        return Err(e.into());
    }
    Ok(names)
}

/// Drops the connections of every rank's agent to these agents.
pub(crate) fn drop_agents(inner: &Inner, agents: &[String]) {
    for r in inner.ranks() {
        for agent in agents {
            r.agent.remove_peer(agent);
        }
    }
}

/// SPEC D5: a background handshake with a P engine; reports to the renewer when done. One that
/// fails or is refused says why, and what happens to the requests waiting for it (SPEC O4).
pub(crate) async fn dial(inner: Arc<Inner>, engine_id: String, host: String, port: u16) {
    let addr = format!("{host}:{port}");
    let ours = our_hello(&inner, &engine_id);
    let key = cluster_key(&inner);
    let result = async {
        let run = async {
            let stream = connect_to(&inner, &addr, &engine_id).await?;
            Ok::<_, HandshakeFailed>(side_channel::exchange(stream, &addr, &key, ours.clone()).await?)
        };
        let theirs =
            tokio::time::timeout(side_channel::HANDSHAKE_TIMEOUT, run).await.map_err(|_| HandshakeFailed::TimedOut(addr.clone()))??;
        check_reply(&engine_id, ours.t_send, &theirs)?;
        let sample = ClockSample { t0: ours.t_send, t1: theirs.echo.1, t2: theirs.t_send, t3: inner.now().0 };
        let agents = introduce(&inner, &theirs).await?;
        Ok::<_, HandshakeFailed>((Handshook { incarnation: theirs.incarnation, agents }, sample))
    }
    .await;
    let now = inner.now();
    match result {
        Ok((found, sample)) => {
            // Under the renewer's lock: no pull sees the engine Ready before its agents are
            // known, and a result nobody waits for any more leaves nothing behind.
            let taken = inner.renewer.with(|renewer| {
                let taken = renewer.handshake_done(&engine_id, Ok(found), now);
                renewer.clock_sample(&engine_id, sample);
                taken
            });
            drop_agents(&inner, &taken.drop_agents);
            if taken.taken {
                crate::push::link_ready(&inner, &engine_id);
            }
        }
        Err(e) => {
            let why = match &e {
                HandshakeFailed::Refused(r) => {
                    inner.metrics.handshake_refused(r.label());
                    format!("refused: {}", r.between(&inner.cfg.engine_id, &engine_id))
                }
                HandshakeFailed::Channel(DialError::Refused { what, .. }) => {
                    inner.metrics.handshake_refused(match what.as_str() {
                        "geometry" => "geometry",
                        "certificate" => "certificate",
                        "mode" => "mode",
                        _ => "other",
                    });
                    e.to_string()
                }
                e => e.to_string(),
            };
            let waiting = inner.renewer.with(|renewer| {
                renewer.handshake_done(&engine_id, Err(()), now);
                renewer.tracked_toward(&engine_id)
            });
            // Push messages parked for it do not keep a failing engine dialled: its leases end
            // at their expiry (SPEC P4) if it lives.
            crate::push::link_failed(&inner, &engine_id);
            tracing::warn!(
                engine = %engine_id,
                waiting,
                "handshake with {addr} failed: {why}; the requests waiting for it are recomputed locally and their leases \
                 released over its side channel (SPEC O4); retrying with back-off"
            );
        }
    }
    inner.bump_news();
}

/// D, SPEC O4: releases no transfer link can carry, delivered over the P engine's side channel;
/// reports to the renewer, which retries a failure while it can still matter.
pub(crate) async fn release_over_side_channel(inner: Arc<Inner>, batch: SideChannelRelease) {
    let addr = format!("{}:{}", batch.host, batch.port);
    let why = match &batch.why {
        NotRead::NoLink => format!(
            "engine {:?} has no transfer link to engine {:?} (its handshake failed or was refused) and recomputes these requests locally",
            inner.cfg.engine_id, batch.engine_id
        ),
        NotRead::Duplicate { kept } => format!(
            "two live engines claim engine id {:?}: engine {:?} reads from incarnation {:x} at {}:{} and will not read the leases of \
             incarnation {:x} at {addr}; give each engine its own --engine-id",
            batch.engine_id, inner.cfg.engine_id, kept.incarnation, kept.host, kept.port, batch.granted_by
        ),
    };
    let release = SideRelease {
        engine_id: inner.cfg.engine_id.clone(),
        incarnation: inner.incarnation,
        granted_by: batch.granted_by,
        lease_ids: batch.lease_ids.clone(),
        what: batch.why.label().into(),
        why: why.clone(),
        auth: Vec::new(),
    };
    let key = cluster_key(&inner);
    let run = async {
        let stream = connect_to(&inner, &addr, &batch.engine_id).await?;
        Ok::<_, HandshakeFailed>(side_channel::release(stream, &addr, &key, release).await?)
    };
    let result = tokio::time::timeout(side_channel::HANDSHAKE_TIMEOUT, run).await.map_err(|_| HandshakeFailed::TimedOut(addr.clone()));
    let now = inner.now();
    let n = batch.lease_ids.len();
    let outcome = match result.and_then(|r| r) {
        Ok((incarnation, lost)) => {
            let released = batch.released_by(incarnation, &lost);
            inner.metrics.side_channel_releases.inc_by(released as u64);
            tracing::info!(engine = %batch.engine_id, "released {released} of {n} leases over the side channel at {addr}: {why}");
            Ok(incarnation)
        }
        Err(e) => {
            tracing::warn!(engine = %batch.engine_id, "cannot release {n} leases over the side channel at {addr}: {e}; retrying");
            Err(())
        }
    };
    inner.renewer.with(|r| r.side_release_done(&batch, outcome, now));
}

/// A peer agent's connection broke. A P engine we renew with: forget its agents and handshake
/// again before the next heartbeat. Another engine's agent: it handshakes again if it comes
/// back.
pub(crate) fn disconnected(inner: &Inner, agent: &str) {
    let gone = inner.renewer.with(|renewer| match renewer.peers().engine_of(agent).map(str::to_string) {
        Some(engine) => {
            tracing::info!(peer = %agent, "transfer agent disconnected; handshake again before it is needed");
            renewer.disconnected(&engine)
        }
        None => {
            renewer.agent_gone(agent);
            vec![agent.to_string()]
        }
    });
    drop_agents(inner, &gone);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EngineConfig, EngineHandle};
    use kvlease_transport::tcp::TcpAgent;
    use kvlease_transport::{Agent, BlockArena};
    use tokio::sync::mpsc;

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

    /// Grants a lease on one block of `inner`'s pool, as a prefill would.
    fn lease(inner: &Inner) -> u64 {
        let blocks = inner.pool.alloc(1).expect("a free block");
        with_holder(inner, |h, now, out| h.grant(now, "r", blocks, &[1], out)).expect("a lease on one block").lease_id
    }

    fn release_from(engine_id: &str, incarnation: u64, granted_by: u64, lease_ids: Vec<u64>) -> SideRelease {
        SideRelease {
            engine_id: engine_id.into(),
            incarnation,
            granted_by,
            lease_ids,
            what: "no_handshake".into(),
            why: String::new(),
            auth: vec![],
        }
    }

    /// SPEC O4, S5: P applies a release over its side channel as the same release from that
    /// holder over the agents: a lease nobody claimed yet, or the holder's own, ends at once as
    /// `released`; another engine's lease is untouched and answered as lost; ids granted by
    /// another incarnation of P are not touched at all.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn o4_s5_a_release_over_the_side_channel_acts_as_the_holders_release() {
        let p = EngineHandle::start(EngineConfig::default()).await.unwrap();
        let inner = p.inner();
        let (unclaimed, held) = (lease(inner), lease(inner));
        // `held` is claimed by another decoder ("d2"), as a heartbeat over its agents would.
        let heartbeat = Message::Heartbeat { seq: 1, lease_ids: vec![held] };
        with_holder(inner, |h, now, out| h.on_message(&holder_name("d2", 5), &heartbeat, now, out));
        let other_incarnation = inner.incarnation.wrapping_add(1);
        let ack = apply_side_release(inner, &release_from("d", 7, other_incarnation, vec![unclaimed]));
        assert_eq!(ack, Message::SideReleaseAck { incarnation: inner.incarnation, lost_ids: vec![unclaimed] });
        assert!(p.holds_lease(unclaimed), "ids of another incarnation name other leases: untouched");
        let ack = apply_side_release(inner, &release_from("d", 7, inner.incarnation, vec![unclaimed, held]));
        assert_eq!(ack, Message::SideReleaseAck { incarnation: inner.incarnation, lost_ids: vec![held] });
        assert!(!p.holds_lease(unclaimed), "an unclaimed lease ends at once");
        assert!(p.holds_lease(held), "another holder's lease is untouched (S5)");
        let ack = apply_side_release(inner, &release_from("d2", 5, 0, vec![held]));
        assert_eq!(ack, Message::SideReleaseAck { incarnation: inner.incarnation, lost_ids: vec![] });
        assert!(!p.holds_lease(held), "its holder's release ends it");
        assert_eq!(inner.metrics.released(kvlease_core::lease_table::ReleaseReason::Released).get(), 2);
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
        let mut hello = our_hello(inner, "mallory");
        hello.engine_id = "mallory".into();
        hello.incarnation = 7;
        hello.agents = vec![victim.metadata()];
        let err = introduce(inner, &hello).await.unwrap_err().to_string();
        assert!(err.contains("must be named mallory/7/<rank>"), "{err}");
        assert!(inner.renewer.lock().peers().is_empty(), "nothing of it is kept");

        // The same agent introduced by the engine it is named for is welcome.
        hello.engine_id = "victim".into();
        hello.incarnation = 1;
        let again = agent("victim/1/0", &secret, ours).await;
        hello.agents = vec![again.metadata()];
        assert_eq!(introduce(inner, &hello).await.unwrap(), vec!["victim/1/0".to_string()]);
    }
}
