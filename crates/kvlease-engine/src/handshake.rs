//! The handshake, both ways: answering on our side channel and dialling a P engine's in the
//! background (SPEC D5), then introducing the peer's transfer agents to ours.
//!
//! The side channel ([`crate::side_channel`]) authenticates the bytes with the cluster secret
//! (SPEC S1, S2); what a Hello must say to be accepted — the echo, the engine id, the geometry,
//! agents named for their engine (S5) — is decided in `kvlease_core::peers`, and what a new
//! incarnation means for leases in the renewer. This module moves bytes and agents.

use crate::side_channel::{self, write_frame, Side};
use crate::state::{lock, Inner};
use crate::TransportKind;
use kvlease_core::clock::ClockSample;
use kvlease_core::peers::{check_agent_names, check_reply, Geometry, Refused};
use kvlease_core::renewer::Handshook;
use kvlease_core::wire::{Hello, Message};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;

/// A side-channel connection: a TCP socket, or an in-memory stream under the simulator.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Where the side channel listens.
pub(crate) enum Listener {
    Tcp(TcpListener),
    Mem(kvlease_transport::mem::MemListener),
}

impl Listener {
    /// Binds the side channel for `transport` at `host:port`; returns it and its address.
    pub async fn bind(transport: &TransportKind, host: &str, port: u16) -> Result<(Listener, SocketAddr), String> {
        match transport {
            TransportKind::Mem(net) => {
                let l = net.listen(host, port).map_err(|e| e.to_string())?;
                let addr = l.addr().parse().map_err(|e| format!("{}: {e}", l.addr()))?;
                Ok((Listener::Mem(l), addr))
            }
            _ => {
                let l = TcpListener::bind((host, port)).await.map_err(|e| e.to_string())?;
                let addr = l.local_addr().map_err(|e| e.to_string())?;
                Ok((Listener::Tcp(l), addr))
            }
        }
    }

    async fn accept(&mut self) -> std::io::Result<Box<dyn Stream>> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept().await?;
                s.set_nodelay(true).ok();
                Ok(Box::new(s))
            }
            Listener::Mem(l) => match l.accept().await {
                Some(s) => Ok(Box::new(s)),
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
    }
}

pub(crate) fn our_hello(inner: &Inner) -> Hello {
    Hello {
        engine_id: inner.cfg.engine_id.clone(),
        incarnation: inner.incarnation,
        agents: inner.ranks().iter().map(|r| r.agent.metadata()).collect(),
        info: geometry(inner).to_info(),
        t_send: inner.now().0,
        echo: (0, 0),
        // Signed per connection by the side channel (SPEC S1, S2).
        auth: Vec::new(),
    }
}

/// Answers handshakes: the side channel checks the peer's proof of the cluster secret and its
/// signature, core checks its geometry; we reply with our Hello and introduce its agents.
pub(crate) async fn serve(inner: Arc<Inner>, mut listener: Listener) {
    let pending = Arc::new(tokio::sync::Semaphore::new(side_channel::MAX_PENDING));
    loop {
        let mut stream = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!("side channel accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&pending).try_acquire_owned() else {
            // A flood of handshakes: close at once rather than hold buffers for them all.
            inner.metrics.rejected("overloaded");
            continue;
        };
        let inner2 = inner.clone();
        inner.tasks.spawn(async move {
            let _slot = slot;
            answer(&inner2, &mut stream).await;
        });
    }
}

async fn answer(inner: &Arc<Inner>, stream: &mut Box<dyn Stream>) {
    let secret = inner.cfg.secret.clone();
    let got = side_channel::accept(stream, secret.as_deref()).await;
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
    if let Err(e) = geometry(inner).check_peer(&hello) {
        tracing::warn!(peer = %hello.engine_id, "handshake refused: {e}");
        return;
    }
    // The peer adds our agents only once it has our reply: introduce its agents to ours
    // alongside, not before replying, or each side would wait for the other.
    let (inner2, hello2) = (inner.clone(), hello.clone());
    inner.tasks.spawn(async move {
        match introduce(&inner2, &hello2).await {
            Ok(names) => {
                let old = lock(&inner2.renewer).introduced(&hello2.engine_id, hello2.incarnation, names);
                drop_agents(&inner2, &old);
                inner2.renewer_wake.notify_one();
            }
            Err(e) => tracing::warn!(peer = %hello2.engine_id, "{e}"),
        }
    });
    let mut ours = our_hello(inner);
    ours.echo = (hello.t_send, t_recv);
    side_channel::sign(secret.as_deref(), &nonces, Side::Server, &mut ours);
    let _ = write_frame(stream, &Message::Hello(ours)).await;
}

/// Checks a peer's geometry, adds its agents to every rank's agent, and checks they are named
/// for it (SPEC S5). Returns their names, in rank order.
pub(crate) async fn introduce(inner: &Arc<Inner>, hello: &Hello) -> Result<Vec<String>, HandshakeFailed> {
    geometry(inner).check_peer(hello)?;
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

/// SPEC D5: a background handshake with a P engine; reports to the renewer when done.
pub(crate) async fn dial(inner: Arc<Inner>, engine_id: String, host: String, port: u16) {
    let addr = format!("{host}:{port}");
    let ours = our_hello(&inner);
    let result = async {
        let run = async {
            let stream = connect(&inner.cfg.transport, &addr).await.map_err(|e| HandshakeFailed::Connect(addr.clone(), e))?;
            Ok::<_, HandshakeFailed>(side_channel::exchange(stream, &addr, inner.cfg.secret.as_deref(), ours.clone()).await?)
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
            let taken = {
                let mut renewer = lock(&inner.renewer);
                let taken = renewer.handshake_done(&engine_id, Ok(found), now);
                renewer.clock_sample(&engine_id, sample);
                taken
            };
            drop_agents(&inner, &taken.drop_agents);
        }
        Err(e) => {
            tracing::warn!(engine = %engine_id, "handshake with {addr} failed: {e}; retrying with back-off");
            lock(&inner.renewer).handshake_done(&engine_id, Err(()), now);
        }
    }
    inner.renewer_wake.notify_one();
    inner.bump_news();
}

/// A peer agent's connection broke. A P engine we renew with: forget its agents and handshake
/// again before the next heartbeat. Another engine's agent: it handshakes again if it comes
/// back.
pub(crate) fn disconnected(inner: &Inner, agent: &str) {
    let gone = {
        let mut renewer = lock(&inner.renewer);
        match renewer.peers().engine_of(agent).map(str::to_string) {
            Some(engine) => {
                tracing::info!(peer = %agent, "transfer agent disconnected; handshake again before it is needed");
                renewer.disconnected(&engine)
            }
            None => {
                renewer.agent_gone(agent);
                vec![agent.to_string()]
            }
        }
    };
    drop_agents(inner, &gone);
    inner.renewer_wake.notify_one();
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
        let err = introduce(inner, &hello).await.unwrap_err().to_string();
        assert!(err.contains("must be named mallory/7/<rank>"), "{err}");
        assert!(lock(&inner.renewer).peers().is_empty(), "nothing of it is kept");

        // The same agent introduced by the engine it is named for is welcome.
        hello.engine_id = "victim".into();
        hello.incarnation = 1;
        let again = agent("victim/1/0", &secret, ours).await;
        hello.agents = vec![again.metadata()];
        assert_eq!(introduce(inner, &hello).await.unwrap(), vec!["victim/1/0".to_string()]);
    }
}
