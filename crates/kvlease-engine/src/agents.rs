//! The engine's transfer agents, one per rank, on the configured transport (tcp, NIXL, or the
//! in-memory network of the simulator), and the dispatch of everything they report: messages for
//! P's lease table, for D's renewer, for a pull waiting on `ReadDoneAck`s; rejections; and
//! broken connections.

use crate::state::{Inner, Rank};
use crate::{handshake, lease_holder, pull, push, renewal, ConfigError, StartError, TransportKind};
use kvlease_core::wire::Message;
use kvlease_transport::{tcp::TcpAgent, Agent, AgentEvent, BlockArena, ReadGate};
use std::sync::Arc;
use tokio::sync::mpsc;

/// Starts one agent per rank, each serving reads through P's gate, and a task for its events.
pub(crate) async fn start(inner: &Arc<Inner>) -> Result<Vec<Rank>, StartError> {
    let cfg = &inner.cfg;
    let hpr = inner.heads_per_rank();
    let block_bytes = cfg.model.block_bytes(hpr);
    let mut ranks = Vec::new();
    for r in 0..cfg.tp_size {
        let arena = BlockArena::try_new(cfg.num_gpu_blocks, block_bytes)
            .map_err(|why| StartError::Config(ConfigError::Arena { blocks: cfg.num_gpu_blocks, why }))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let name = kvlease_core::peers::agent_name(&cfg.engine_id, inner.incarnation, r as usize);
        let gate: Arc<dyn ReadGate> = Arc::new(lease_holder::Gate { inner: Arc::downgrade(inner) });
        // SPEC U4: every agent refuses writes into its memory unless this engine takes pushed KV.
        let push = cfg.transfer.push_mode();
        let write_gate: Arc<dyn kvlease_transport::WriteGate> = Arc::new(push::Gate { inner: Arc::downgrade(inner) });
        let agent: Arc<dyn Agent> = match &cfg.transport {
            TransportKind::Tcp => {
                let options = kvlease_transport::tcp::TcpOptions {
                    advertise: cfg.advertise_host,
                    secret: cfg.secret.clone(),
                    tls: cfg.transfer_tls.clone(),
                    ..Default::default()
                };
                let agent = TcpAgent::start_with(name, &cfg.host, arena.clone(), gate, tx, options).await?;
                if push {
                    agent.set_write_gate(write_gate);
                }
                agent
            }
            TransportKind::Mem(net) => {
                let agent = net.agent(name, arena.clone(), gate, tx);
                if push {
                    agent.set_write_gate(write_gate);
                }
                agent
            }
            #[cfg(feature = "nixl")]
            TransportKind::Nixl => {
                let options = kvlease_transport::nixl::NixlOptions {
                    secret: cfg.secret.clone(),
                    peer_keys: inner.peer_keys.clone(),
                    ..Default::default()
                };
                kvlease_transport::nixl::NixlAgent::start_with(name, arena.clone(), gate, tx, options).await?
            }
            #[cfg(not(feature = "nixl"))]
            TransportKind::Nixl => return Err(StartError::Config(ConfigError::NoNixl)),
        };
        let inner2 = inner.clone();
        inner.tasks.spawn(events(inner2, r as usize, rx));
        ranks.push(Rank { heads: r * hpr..(r + 1) * hpr, arena, agent });
    }
    Ok(ranks)
}

/// Every event rank `rank`'s agent reports.
async fn events(inner: Arc<Inner>, rank: usize, mut rx: mpsc::UnboundedReceiver<AgentEvent>) {
    while let Some(ev) = rx.recv().await {
        match ev {
            AgentEvent::Notification { from, bytes } => on_notification(&inner, rank, &from, &bytes),
            AgentEvent::Rejected { reason } => inner.metrics.rejected(reason),
            AgentEvent::Disconnected { peer } => handshake::disconnected(&inner, &peer),
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
        // For D, from a P engine.
        Message::HeartbeatAck { .. } | Message::LeaseLost { .. } | Message::ClockPong { .. } => renewal::on_message(inner, from, &msg),
        Message::ReadDoneAck { lease_id, live } => pull::on_read_done_ack(inner, rank, from, lease_id, live),
        // Side-channel messages have no business on a transfer agent.
        Message::Hello(_) | Message::Refused { .. } | Message::SideRelease(_) | Message::SideReleaseAck { .. } => {
            inner.metrics.rejected("malformed")
        }
        // Push mode (SPEC §13), either way: the engine's push machines.
        Message::PushRegister(_)
        | Message::PushRegisterAck { .. }
        | Message::PushHeartbeat { .. }
        | Message::PushRelease { .. }
        | Message::PushLost { .. }
        | Message::PushWriteDone { .. }
        | Message::PushWriteFailed { .. } => push::on_message(inner, from, &msg),
        // For P, from a D engine.
        Message::Heartbeat { .. } | Message::Release { .. } | Message::ReadDone { .. } | Message::ClockPing { .. } => {
            lease_holder::on_message(inner, rank, from, &msg)
        }
    }
}
