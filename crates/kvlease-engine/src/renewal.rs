//! D's side of the lease: drives the [`Renewer`](kvlease_core::renewer::Renewer) from a timer
//! task that never waits on the forward loop (SPEC D2, D3), starts handshakes in the background
//! (D5), carries its messages to P engines, and hands it P's answers. The rules are the
//! renewer's, in kvlease-core; this is glue.

use crate::handshake;
use crate::state::Inner;
use kvlease_core::pull::PlantedBug;
use kvlease_core::renewer::{Action, SendKind};
use kvlease_core::wire::Message;
use kvlease_core::Nanos;
use std::sync::Arc;

/// The renewer's driver: polls it when it asks to be polled or when woken, carries out what it
/// says. Runs on its own, so a long forward step delays no heartbeat (SPEC D3).
pub(crate) async fn run(inner: Arc<Inner>) {
    loop {
        // Every change to the renewer from outside this task wakes it; otherwise it sleeps until
        // the renewer's own next deadline — or for good, when nothing is tracked.
        let woken = inner.renewer.woken();
        match drive(&inner) {
            Some(t) => {
                let _ = tokio::time::timeout_at(inner.instant(t), woken).await;
            }
            None => woken.await,
        }
    }
}

/// One poll of the renewer; returns when it next wants to be polled.
pub(crate) fn drive(inner: &Arc<Inner>) -> Option<Nanos> {
    let mut actions = Vec::new();
    let next = {
        let mut r = inner.renewer.lock();
        r.poll(inner.now(), &mut actions);
        r.poll_timeout()
    };
    for a in actions {
        match a {
            Action::Handshake { engine_id, host, port } => {
                let inner2 = inner.clone();
                inner.tasks.spawn(async move { handshake::dial(inner2, engine_id, host, port).await });
            }
            // The simulator's `fixed` policy (vLLM before leases): nothing renews.
            Action::Send { kind: SendKind::Heartbeat { .. } | SendKind::ReadRenewal, .. }
                if inner.cfg.planted_bug == Some(PlantedBug::FixedTimeout) => {}
            Action::Send { engine_id, bytes, kind } => send(inner, &engine_id, bytes, kind),
            Action::Lost { request_id, lease_id } => {
                tracing::info!(request = %request_id, lease_id, "lease lost on the prefill engine");
                inner.bump_news();
            }
            Action::Forget { agents, .. } => handshake::drop_agents(inner, &agents),
            Action::ReleaseOverSideChannel(batch) => {
                let inner2 = inner.clone();
                inner.tasks.spawn(async move { handshake::release_over_side_channel(inner2, batch).await });
            }
            Action::DuplicateEngine { engine_id, kept, other } => {
                tracing::warn!(
                    engine = %engine_id,
                    "two live engines claim engine id {engine_id:?}: incarnation {:x} at {}:{}, which this engine is linked to, and \
                     incarnation {:x} at {}:{}; reading from the first only, recomputing the other's requests and releasing their \
                     leases at once (SPEC O4); give each engine its own --engine-id",
                    kept.incarnation, kept.host, kept.port, other.incarnation, other.host, other.port
                );
                inner.metrics.handshake_refused("duplicate_engine_id");
            }
        }
    }
    next
}

/// SPEC D2: a renewer message goes to every P rank that holds a shard.
fn send(inner: &Inner, engine_id: &str, bytes: Vec<u8>, kind: SendKind) {
    let agents = inner.renewer.lock().peer(engine_id).map(|p| p.agents.clone());
    let Some(agents) = agents else {
        let gone = inner.renewer.lock().disconnected(engine_id);
        handshake::drop_agents(inner, &gone);
        return;
    };
    let Some(rank0) = inner.ranks().first() else { return };
    let mut ok = true;
    for agent in &agents {
        ok &= rank0.agent.send_notif(agent, bytes.clone()).is_ok();
    }
    match kind {
        SendKind::Heartbeat { lateness } => {
            inner.metrics.heartbeats_sent.inc();
            inner.metrics.heartbeat_lateness.observe(lateness.as_secs_f64());
        }
        SendKind::ReadRenewal => {
            inner.metrics.heartbeats_sent.inc();
        }
        SendKind::Release | SendKind::ClockProbe => {}
    }
    if !ok {
        let gone = inner.renewer.lock().disconnected(engine_id);
        handshake::drop_agents(inner, &gone);
    }
}

/// A message for D from a P engine's agent `from`: acknowledgements and lost leases.
pub(crate) fn on_message(inner: &Inner, from: &str, msg: &Message) {
    let known = inner.renewer.with(|renewer| {
        let Some(engine) = renewer.peers().engine_of(from).map(str::to_string) else { return false };
        renewer.on_message(&engine, msg, inner.now());
        true
    });
    if known {
        inner.bump_news();
    }
}

/// Stops renewing everything, releasing each renewed lease explicitly (shutdown), and sends it.
pub(crate) fn release_all(inner: &Arc<Inner>) {
    drive(inner);
}
