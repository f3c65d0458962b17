//! P's side of the lease: grants a lease when a `do_remote_decode` prefill finishes (SPEC P1),
//! serves reads only of live leases through the agents' [`ReadGate`] (P5, S2, S4), hands every
//! message from a D engine to the holder and sends back its answer (P2, P3, P6, P8), and runs
//! the reaper, a task of its own that ticks while idle (P4). Every decision is the core's
//! [`LeaseHolder`]'s (the lease table, the quarantine, the cached turns); this is glue: lock,
//! call, carry out (free blocks, metrics, logs, wake the reaper).

use crate::pool::Blocks;
use crate::state::Inner;
use crate::{FinishReason, GenerateEvent};
use kvlease_core::holder::{Granted, LeaseHolder, Settled};
use kvlease_core::lease_table::{Evicted, ReadTicket, ReleaseReason};
use kvlease_core::params::RemoteKv;
use kvlease_core::peers::agent_holder;
use kvlease_core::wire::Message;
use kvlease_core::Nanos;
use kvlease_transport::{ReadGate, ReadPermit};
use std::sync::{Arc, Weak};
use tokio::sync::mpsc;

/// What a finished `do_remote_decode` prefill hands over.
pub(crate) struct PrefillDone {
    pub client_id: String,
    pub prompt: Vec<u32>,
    pub first_token: u32,
    pub blocks: Option<Blocks>,
    pub tx: mpsc::UnboundedSender<GenerateEvent>,
}

/// Calls `f` on the engine's [`LeaseHolder`] under its lock, at the engine's time, and carries
/// out what the call settled: the gauges (under the lock, so they never go stale), then the
/// counts and log lines of leases that ended, the blocks given back, the reaper woken.
pub(crate) fn with_holder<R>(inner: &Inner, f: impl FnOnce(&mut LeaseHolder<Blocks>, Nanos, &mut Settled<Blocks>) -> R) -> R {
    let mut out = Settled::default();
    let r = {
        let mut holder = inner.holder.lock();
        let r = f(&mut holder, inner.now(), &mut out);
        if out.changed {
            inner.metrics.leases_active.set(holder.live() as i64);
            inner.metrics.leased_blocks.set(holder.leased_blocks() as i64);
        }
        r
    };
    carry_out(inner, out);
    r
}

/// Counts and logs the leases that ended, gives blocks back to the pool, and wakes the reaper
/// when its next wake-up may have moved earlier.
fn carry_out(inner: &Inner, out: Settled<Blocks>) {
    for e in &out.ended {
        inner.metrics.released(e.reason).inc();
        inner.metrics.lease_hold.observe(e.held.as_secs_f64());
        let (request, lease_id, reason, held_s) = (&e.request, e.lease_id, e.reason.as_str(), e.held.as_secs_f64());
        if e.reason == ReleaseReason::Expired {
            // The one release an operator may need to explain: no heartbeat came in time.
            tracing::info!(request = %request, lease_id, reason, held_s, "lease ended");
        } else {
            tracing::debug!(request = %request, lease_id, reason, held_s, "lease ended");
        }
    }
    drop(out.freed);
    if out.rearm {
        inner.holder.wake();
    }
}

/// SPEC P1: the prefill finished normally; grant the lease and answer with signed params.
/// A request whose client is gone gets no lease: its blocks go back at once.
pub(crate) fn grant_and_finish(inner: &Arc<Inner>, mut done: PrefillDone) {
    let Some(blocks) = done.blocks.take() else { return };
    if done.tx.is_closed() {
        return;
    }
    let Ok(granted) = with_holder(inner, |h, now, out| h.grant(now, &done.client_id, blocks, &done.prompt, out)) else { return };
    granted_log(inner, &done.client_id, &granted);
    let remote = remote_kv(inner, &done.client_id, done.prompt.len() as u32, &granted);
    let mut params = remote.to_json(inner.cfg.secret.as_deref());
    // SPEC §10: vLLM's `remote_blocks_expiry_time`, when the lease would lapse without a
    // heartbeat, on this engine's monotonic clock (s); the holder's to say.
    if let serde_json::Value::Object(o) = &mut params {
        o.insert("remote_blocks_expiry_time".into(), serde_json::json!(granted.expiry_secs()));
    }
    let sent = answer_prefill(&done, params);
    if !sent {
        // The client left between the check and now: nobody will read; free at once.
        release_own(inner, granted.lease_id);
    }
}

/// The P leg's answer, as vLLM's: its one token (unless EOS), then `Done` with the params the
/// decode leg takes. Returns whether the client was still there to take it.
pub(crate) fn answer_prefill(done: &PrefillDone, params: serde_json::Value) -> bool {
    let first = done.first_token;
    if first != crate::model::EOS {
        let _ = done.tx.send(GenerateEvent::Token { id: first, text: crate::model::detokenize(first) });
    }
    done.tx
        .send(GenerateEvent::Done {
            finish_reason: FinishReason::Length,
            prompt_tokens: done.prompt.len() as u32,
            completion_tokens: 1,
            kv_transfer_params: Some(params),
        })
        .is_ok()
}

/// SPEC B1: a request this engine decoded finished in bidirectional mode: keep its blocks, the
/// KV of `tokens` (the conversation up to its last generated token), under a cached-turn lease
/// of `decoder_kv_blocks_ttl`, and return the params the next turn's prefill reads them with.
pub(crate) fn keep_turn(inner: &Arc<Inner>, client_id: &str, tokens: &[u32], blocks: Blocks) -> (u64, serde_json::Value) {
    let granted = with_holder(inner, |h, now, out| h.grant_turn(now, client_id, blocks, tokens, out));
    granted_log(inner, client_id, &granted);
    inner.metrics.turns_kept.inc();
    let remote = remote_kv(inner, client_id, tokens.len() as u32, &granted);
    let params = remote.to_turn_json(inner.cfg.secret.as_deref(), granted.expiry_secs(), granted.lifetime.as_secs_f64());
    (granted.lease_id, params)
}

/// The scheduler cannot admit a request for want of `need` free blocks: end cached turns as the
/// holder chooses them (SPEC B1: the oldest nobody claimed, then the oldest a prefill engine
/// renews but is not reading; never one under a read, P5), until `need` blocks are free or
/// coming back, or none is left to end. A conversation whose turn was evicted is recomputed by
/// its next prefill (D7). Returns how many turns ended (evicted, or found expired on the way).
pub(crate) fn evict_turns(inner: &Inner, need: usize) -> usize {
    let free = inner.pool.free() as usize;
    let eviction = with_holder(inner, |h, now, out| h.evict_turns(free, need, now, out));
    for evicted in &eviction.evicted {
        match *evicted {
            Evicted::Unclaimed(lease_id) => tracing::debug!(lease_id, "cached turn evicted: its blocks are needed"),
            Evicted::Claimed(lease_id) => {
                tracing::info!(
                    lease_id,
                    "cached turn evicted while a prefill engine renews it: its blocks are needed; that turn is recomputed"
                )
            }
        }
        inner.metrics.turns_evicted.inc();
    }
    eviction.ended
}

/// Counts and logs a grant.
fn granted_log(inner: &Inner, request: &str, granted: &Granted) {
    inner.metrics.leases_granted.inc();
    let (lease_id, blocks, lifetime_s) = (granted.lease_id, granted.block_ids.len(), granted.lifetime.as_secs_f64());
    tracing::debug!(request = %request, lease_id, blocks, lifetime_s, "lease granted");
}

/// Where the blocks of a lease of ours are, as params say it.
fn remote_kv(inner: &Inner, request_id: &str, num_tokens: u32, granted: &Granted) -> RemoteKv {
    let kv = inner.kv_addr.get().copied();
    RemoteKv {
        engine_id: inner.cfg.engine_id.clone(),
        request_id: request_id.to_string(),
        block_ids: granted.block_ids.clone(),
        host: match (inner.cfg.advertise_host, kv) {
            (Some(ip), _) => ip.to_string(),
            (None, Some(a)) => a.ip().to_string(),
            (None, None) => inner.cfg.host.clone(),
        },
        port: kv.map(|a| a.port()).unwrap_or(0),
        tp_size: inner.cfg.tp_size,
        num_tokens,
        lease_id: granted.lease_id,
        incarnation: inner.incarnation,
        prompt_digest: granted.prompt_digest,
        signature: None,
    }
}

/// SPEC O4: this engine was handed its own params (a `kv_both` engine a router paired with
/// itself): the request takes the lease's blocks instead of reading them over a transfer agent,
/// as the holder allows it ([`LeaseHolder::take_own`]: a read of our own lease, checked like
/// any other, ended at once as `transferred`). Returns the blocks, which the request copies its
/// prompt's KV from; `None` when the lease is not ours to take (another run of this engine
/// granted it, it ended, another holder owns it, or the params do not match it): the request
/// then computes the prompt itself.
pub(crate) fn take_own(inner: &Inner, rk: &RemoteKv) -> Option<Blocks> {
    let blocks = with_holder(inner, |h, now, out| h.take_own(rk, now, out)).ok()?;
    tracing::debug!(lease_id = rk.lease_id, "own params: the prompt's KV is taken from this engine's own lease");
    Some(blocks)
}

/// Releases a lease of ours that nobody will read (its client left, a router handed its params
/// back). Returns whether it was live and is now released.
pub(crate) fn release_own(inner: &Inner, lease_id: u64) -> bool {
    with_holder(inner, |h, now, out| h.release_own(lease_id, now, out))
}

/// Gives blocks back to the pool through the quarantine (SPEC P5, D6): at once where reads are
/// fenced, else once no READ posted for them can still land.
pub(crate) fn free_after_reads(inner: &Inner, blocks: Blocks) {
    with_holder(inner, |h, now, out| {
        if let Some(blocks) = h.quarantine(now, blocks, out) {
            out.freed.push(blocks);
        }
    });
}

/// Releases every lease as `shutdown`; quarantined blocks go back with the process.
pub(crate) fn shutdown(inner: &Inner) {
    with_holder(inner, |h, now, out| h.shutdown(now, out));
}

/// SPEC P4: the reaper. It polls the holder when [`LeaseHolder::poll_timeout`] says (the
/// table's next expiry, a lower bound, or the quarantine's next release) and sleeps in between,
/// so an idle engine has no timer running at all. A poll that left work over (issue #11: at
/// most a budget of leases per hold of the lock, so renewals and reads wait for at most one
/// budget) goes round again at once. A call that may move the wake-up earlier (a grant, blocks
/// quarantined) wakes it.
pub(crate) async fn reaper(inner: Arc<Inner>) {
    crate::state::run_timer(&inner, &inner.holder, || {
        with_holder(&inner, |h, now, out| {
            let more = h.poll(now, out);
            (more, h.poll_timeout(now))
        })
    })
    .await;
}

/// SPEC P5, S2, S4: a read is served only for a live lease, only of that lease's blocks in the
/// order its params name them, only for the params digest it was granted with
/// ([`LeaseHolder::begin_read`]), and the blocks stay out of the pool until the read has been
/// copied out.
pub(crate) struct Gate {
    pub inner: Weak<Inner>,
}

struct Permit {
    inner: Weak<Inner>,
    ticket: Option<ReadTicket>,
}

impl ReadGate for Gate {
    fn begin_read(&self, peer: &str, lease_id: u64, blocks: &[u32], tag: &[u8]) -> Option<ReadPermit> {
        let inner = self.inner.upgrade()?;
        match with_holder(&inner, |h, now, out| h.begin_read(agent_holder(peer), lease_id, blocks, tag, now, out)) {
            Ok(ticket) => Some(Box::new(Permit { inner: Arc::downgrade(&inner), ticket: Some(ticket) })),
            Err(_) => {
                inner.metrics.reads_refused.inc();
                None
            }
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let (Some(inner), Some(ticket)) = (self.inner.upgrade(), self.ticket.take()) else { return };
        // A lease released under this reader hands its blocks back only now.
        let blocks = inner.holder.lock().end_read(ticket);
        drop(blocks);
    }
}

/// A message for P from a D engine's agent `from` (SPEC P2, P3, P6, P8): the holder's business;
/// it says what to answer.
pub(crate) fn on_message(inner: &Inner, rank: usize, from: &str, msg: &Message) {
    if matches!(msg, Message::Heartbeat { .. }) {
        inner.metrics.heartbeats_received.inc();
    }
    let answer = with_holder(inner, |h, now, out| h.on_message(agent_holder(from), msg, now, out));
    // D sends each heartbeat to every P rank (SPEC D2); all ranks share this table, so only
    // rank 0's copy counts as renewals (one per lease per heartbeat).
    if rank == 0 {
        inner.metrics.lease_renewals.inc_by(answer.renewed as u64);
    }
    if let (Some(reply), Some(r)) = (answer.reply, inner.ranks().get(rank)) {
        if let Err(e) = r.agent.send_notif(from, reply.encode()) {
            tracing::debug!("cannot answer {from}: {e}");
        }
    }
}

/// Live leases, pull and push (for the simulator's reclaim check and diagnostics).
pub(crate) fn live_leases(inner: &Inner) -> usize {
    inner.holder.lock().live() + inner.push_source.lock().live()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EngineConfig, EngineHandle, GenerateRequest, Prompt};
    use kvlease_core::digest::PromptDigest;
    use kvlease_core::params::KvRole;
    use serde_json::json;

    /// P's params for a 64-token prompt (four blocks of 16): a prefill for a remote decoder.
    async fn prefilled(p: &EngineHandle) -> RemoteKv {
        let prompt: Vec<u32> = (1..=64).collect();
        let req = GenerateRequest {
            request_id: "r".into(),
            prompt: Prompt::Tokens(prompt),
            max_tokens: 1,
            ignore_eos: true,
            kv_transfer_params: Some(json!({"do_remote_decode": true})),
            sampling: Default::default(),
        };
        let mut stream = p.submit(req).unwrap();
        loop {
            match stream.next().await {
                Some(GenerateEvent::Done { kv_transfer_params: Some(params), .. }) => match KvRole::parse(Some(&params)) {
                    Ok(KvRole::DecodeRemote(rk)) => return rk,
                    other => panic!("{other:?}"),
                },
                Some(GenerateEvent::Failed(e)) => panic!("{e:?}"),
                None => panic!("no answer"),
                Some(_) => {}
            }
        }
    }

    /// SPEC S4, P5 (P's gate, the check over the fenced tcp agent): a read is served only for
    /// exactly the lease's blocks in the order its params name them and for the digest the lease
    /// was granted with. A read naming the blocks sorted, reversed, repeated or truncated, or
    /// showing a bare prompt digest, is refused before a byte is served.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn s4_the_gate_serves_only_the_leases_blocks_in_order() {
        let p = EngineHandle::start(EngineConfig { num_gpu_blocks: 64, ..EngineConfig::default() }).await.unwrap();
        let rk = prefilled(&p).await;
        assert_eq!(rk.block_ids.len(), 4);
        let gate = Gate { inner: Arc::downgrade(p.inner()) };
        let tag = rk.prompt_digest.0;
        let peer = "d/1/0";
        let mut sorted = rk.block_ids.clone();
        sorted.sort_unstable();
        assert_ne!(sorted, rk.block_ids, "P hands blocks out in an order a router could change");
        let reversed: Vec<u32> = rk.block_ids.iter().rev().copied().collect();
        let b0 = rk.block_ids[0];
        for bad in [sorted, reversed, vec![b0; 4], rk.block_ids[..3].to_vec(), rk.block_ids[1..].to_vec()] {
            assert!(gate.begin_read(peer, rk.lease_id, &bad, &tag).is_none(), "{bad:?}");
        }
        let bare = PromptDigest::of(&(1..=64).collect::<Vec<u32>>()).0;
        assert!(gate.begin_read(peer, rk.lease_id, &rk.block_ids, &bare).is_none(), "a digest without the lease's fields");
        assert_eq!(p.metrics().reads_refused.get(), 6);
        let permit = gate.begin_read(peer, rk.lease_id, &rk.block_ids, &tag);
        assert!(permit.is_some(), "the lease's own blocks, in order, for its digest");
    }
}
