//! P's side of the lease: grants a lease when a `do_remote_decode` prefill finishes (SPEC P1),
//! serves reads only of live leases through the agents' [`ReadGate`] (P5, S2), hands every
//! message from a D engine to the lease table and sends back its answer (P2, P3, P6, P8), and
//! reaps expired leases and quarantined blocks from a task of its own that ticks while idle
//! (P4). The rules are the lease table's and the quarantine's, in kvlease-core; this is glue.

use crate::pool::Blocks;
use crate::state::{lock, Inner, Lease};
use crate::{FinishReason, GenerateEvent};
use kvlease_core::digest::{reads_lease_blocks, Bound, PromptDigest};
use kvlease_core::lease_table::{Evicted, ReadTicket, ReleaseReason, Released, REAP_BUDGET};
use kvlease_core::params::RemoteKv;
use kvlease_core::peers::agent_holder;
use kvlease_core::pull::PlantedBug;
use kvlease_core::wire::Message;
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

/// SPEC P1: the prefill finished normally; grant the lease and answer with signed params.
/// A request whose client is gone gets no lease: its blocks go back at once.
pub(crate) fn grant_and_finish(inner: &Arc<Inner>, done: PrefillDone) {
    let Some(blocks) = done.blocks else { return };
    if done.tx.is_closed() || blocks.ids().is_empty() {
        return;
    }
    let block_ids = blocks.ids().to_vec();
    let (lease_id, prompt_digest) = grant(inner, &done.client_id, blocks, block_ids.len(), &done.prompt, None);
    let remote = remote_kv(inner, &done.client_id, block_ids, done.prompt.len() as u32, lease_id, prompt_digest);
    let mut params = remote.to_json(inner.cfg.secret.as_deref());
    // SPEC §10: vLLM's `remote_blocks_expiry_time`, when the lease would lapse without a
    // heartbeat, on this engine's monotonic clock (s). Informational: D keeps the lease alive by
    // heartbeats and learns of its loss from `LeaseLost`, never from this time.
    if let serde_json::Value::Object(o) = &mut params {
        let expiry = (inner.now() + inner.cfg.transfer.lease.lease_duration).0 as f64 / 1e9;
        o.insert("remote_blocks_expiry_time".into(), serde_json::json!(expiry));
    }
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
        release_own(inner, lease_id);
    }
}

/// SPEC B1: a request this engine decoded finished in bidirectional mode: keep its blocks, the
/// KV of `tokens` (the conversation up to its last generated token), under a cached-turn lease
/// of `decoder_kv_blocks_ttl`, and return the params the next turn's prefill reads them with.
pub(crate) fn keep_turn(inner: &Arc<Inner>, client_id: &str, tokens: &[u32], blocks: Blocks) -> (u64, serde_json::Value) {
    let bs = inner.cfg.model.block_size as usize;
    let used = tokens.len().div_ceil(bs).min(blocks.ids().len());
    let block_ids = blocks.ids()[..used].to_vec();
    let ttl = inner.cfg.transfer.lease.decoder_kv_blocks_ttl;
    let (lease_id, digest) = grant(inner, client_id, blocks, used, tokens, Some(ttl));
    inner.metrics.turns_kept.inc();
    let remote = remote_kv(inner, client_id, block_ids, tokens.len() as u32, lease_id, digest);
    let expiry = (inner.now() + ttl).0 as f64 / 1e9;
    (lease_id, remote.to_turn_json(inner.cfg.secret.as_deref(), expiry, ttl.as_secs_f64()))
}

/// The scheduler cannot admit a request for want of `need` free blocks: end cached turns, in
/// the lease table's order (SPEC B1: the oldest nobody claimed, then the oldest a prefill engine
/// renews but is not reading; never one under a read, P5), until `need` blocks are free or none
/// is left to end. A cached turn is a cache: its blocks go to new requests rather than leaving
/// them waiting out the TTL; a conversation whose turn was evicted is recomputed by its next
/// prefill (D7). Returns how many turns ended (evicted, or found expired on the way).
pub(crate) fn evict_turns(inner: &Inner, need: usize) -> usize {
    // Blocks come back at once where reads are fenced, after the quarantine otherwise: count
    // what the quarantine and the evictions will give back, not only what the pool has now, or
    // each pass during a quarantine would evict more turns.
    let mut coming = inner.pool.free() as usize + lock(&inner.quarantine).iter().map(|b| b.ids().len()).sum::<usize>();
    let mut ended = 0;
    while coming < need {
        let mut released = Vec::new();
        let evicted = lock(&inner.leases).evict_turn(inner.now(), &mut released);
        coming += released.iter().filter_map(|r| r.payload.as_ref()).map(|l| l.blocks.ids().len()).sum::<usize>();
        ended += released.len();
        match evicted {
            Some(Evicted::Unclaimed(lease_id)) => tracing::debug!(lease_id, "cached turn evicted: its blocks are needed"),
            Some(Evicted::Claimed(lease_id)) => {
                tracing::info!(
                    lease_id,
                    "cached turn evicted while a prefill engine renews it: its blocks are needed; that turn is recomputed"
                )
            }
            None => {}
        }
        if evicted.is_some() {
            inner.metrics.turns_evicted.inc();
        }
        settle(inner, released);
        if evicted.is_none() {
            break;
        }
    }
    ended
}

/// Grants a lease on `blocks` (the first `n` of them named in the params) for `lifetime` (L
/// when `None`; a cached turn's TTL otherwise, B1), over the KV of `tokens`. Returns the lease id
/// and the params digest (S4) that binds `tokens` to this engine, incarnation, lease and blocks.
fn grant(
    inner: &Inner,
    request: &str,
    blocks: Blocks,
    n: usize,
    tokens: &[u32],
    lifetime: Option<std::time::Duration>,
) -> (u64, PromptDigest) {
    let named = blocks.ids()[..n].to_vec();
    let (lease_id, digest) = {
        let mut table = lock(&inner.leases);
        let lease =
            Lease { blocks, named, prefix_reads: lifetime.is_some(), request: request.to_owned(), prompt_digest: PromptDigest::default() };
        let id = match lifetime {
            Some(t) => table.grant_turn(inner.now(), t, n as u32, lease),
            None => table.grant(inner.now(), n as u32, lease),
        };
        // The digest binds the lease id, which the table has only now given out.
        let mut digest = PromptDigest::default();
        if let Some(lease) = table.get_mut(id) {
            let fields = Bound { engine_id: &inner.cfg.engine_id, incarnation: inner.incarnation, lease_id: id, block_ids: &lease.named };
            digest = PromptDigest::bound(tokens, &fields);
            lease.prompt_digest = digest;
        }
        inner.metrics.leases_active.set(table.live() as i64);
        inner.metrics.leased_blocks.set(table.leased_blocks() as i64);
        (id, digest)
    };
    // The new deadline may come before whatever the reaper sleeps until.
    inner.reaper_wake.notify_one();
    inner.metrics.leases_granted.inc();
    let lifetime_s = lifetime.unwrap_or(inner.cfg.transfer.lease.lease_duration).as_secs_f64();
    tracing::debug!(request = %request, lease_id, blocks = n, lifetime_s, "lease granted");
    (lease_id, digest)
}

/// Where the blocks of a lease of ours are, as params say it.
fn remote_kv(
    inner: &Inner,
    request_id: &str,
    block_ids: Vec<u32>,
    num_tokens: u32,
    lease_id: u64,
    prompt_digest: PromptDigest,
) -> RemoteKv {
    let kv = inner.kv_addr.get().copied();
    RemoteKv {
        engine_id: inner.cfg.engine_id.clone(),
        request_id: request_id.to_string(),
        block_ids,
        host: match (inner.cfg.advertise_host, kv) {
            (Some(ip), _) => ip.to_string(),
            (None, Some(a)) => a.ip().to_string(),
            (None, None) => inner.cfg.host.clone(),
        },
        port: kv.map(|a| a.port()).unwrap_or(0),
        tp_size: inner.cfg.tp_size,
        num_tokens,
        lease_id,
        incarnation: inner.incarnation,
        prompt_digest,
        signature: None,
    }
}

/// SPEC O4: this engine was handed its own params (a `kv_both` engine a router paired with
/// itself): the lease's blocks are here, so the request takes them instead of reading them over a
/// transfer agent — a read of our own lease, checked like any other (live, the digest it was
/// granted with, its blocks in order: S4, S5) and ended at once as `transferred`. Returns the
/// blocks, which the request copies its prompt's KV from; `None` when the lease is not ours to
/// take (another run of this engine granted it, it ended, another holder owns it, or the params
/// do not match it): the request then computes the prompt itself.
pub(crate) fn take_own(inner: &Inner, rk: &RemoteKv) -> Option<Blocks> {
    if rk.incarnation != inner.incarnation {
        return None;
    }
    let mut released = Vec::new();
    let lease = {
        let mut table = lock(&inner.leases);
        if !table.get(rk.lease_id).is_some_and(|l| reads_lease_blocks(&l.named, &rk.block_ids, false)) {
            return None;
        }
        let us = table.holder(&inner.holder_name());
        let now = inner.now();
        let ticket = table.begin_read(us, rk.lease_id, Some(rk.prompt_digest), now, &mut released)?;
        table.complete(us, rk.lease_id, 0, 1, rk.prompt_digest, now, &mut released);
        // The read "ends" now: the lease's payload comes back to us, not to the pool.
        table.end_read(ticket)
    };
    settle(inner, released);
    tracing::debug!(lease_id = rk.lease_id, "own params: the prompt's KV is taken from this engine's own lease");
    lease.map(|l| l.blocks)
}

/// Releases a lease of ours that nobody will read (its client left).
pub(crate) fn release_own(inner: &Inner, lease_id: u64) {
    let (mut lost, mut released) = (Vec::new(), Vec::new());
    let mut table = lock(&inner.leases);
    let us = table.holder(&inner.holder_name());
    table.release(us, &[lease_id], inner.now(), &mut lost, &mut released);
    drop(table);
    settle(inner, released);
}

/// Counts released leases and frees their blocks.
pub(crate) fn settle(inner: &Inner, released: Vec<Released<Lease>>) {
    if released.is_empty() {
        return;
    }
    // Under the table's lock only what needs it (a parked lease's request name, the gauges); the
    // log lines are written after, so a long reaper tick does not hold renewals and reads.
    let parked: Vec<Option<String>> = {
        let table = lock(&inner.leases);
        inner.metrics.leases_active.set(table.live() as i64);
        inner.metrics.leased_blocks.set(table.leased_blocks() as i64);
        released
            .iter()
            .map(|r| r.payload.is_none().then(|| table.parked_payload(r.lease_id).map(|l| l.request.clone())).flatten())
            .collect()
    };
    for (r, parked) in released.iter().zip(&parked) {
        inner.metrics.released(r.reason).inc();
        inner.metrics.lease_hold.observe(r.held.as_secs_f64());
        // The payload, or, while a reader still holds the blocks, the table's parked copy.
        let request = r.payload.as_ref().map(|l| l.request.as_str()).or(parked.as_deref()).unwrap_or("");
        let (lease_id, reason, held_s) = (r.lease_id, r.reason.as_str(), r.held.as_secs_f64());
        if r.reason == ReleaseReason::Expired {
            // The one release an operator may need to explain: no heartbeat came in time.
            tracing::info!(request = %request, lease_id, reason, held_s, "lease ended");
        } else {
            tracing::debug!(request = %request, lease_id, reason, held_s, "lease ended");
        }
    }
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

/// Gives blocks back to the pool through the quarantine (SPEC P5, D6): at once where reads are
/// fenced, else once no READ posted for them can still land.
pub(crate) fn free_after_reads(inner: &Inner, blocks: Blocks) {
    let held = lock(&inner.quarantine).hold(inner.now(), blocks);
    match held {
        Some(blocks) => drop(blocks),
        None => inner.reaper_wake.notify_one(),
    }
}

/// Releases every lease as `shutdown`; quarantined blocks go back with the process.
pub(crate) fn shutdown(inner: &Inner) {
    let mut released = Vec::new();
    lock(&inner.leases).shutdown(inner.now(), &mut released);
    settle(inner, released);
    lock(&inner.quarantine).drain().for_each(drop);
}

/// SPEC P4: the reaper. It ticks the lease table, [`REAP_BUDGET`] leases at a time, when the
/// table's next expiry is due (a lower bound, never later than the truth) and hands back quarantined blocks when their hold ends;
/// between the two it sleeps, so an idle engine has no timer running at all. A grant wakes it
/// (the new deadline may be the earliest); renewals only move deadlines later.
pub(crate) async fn reaper(inner: Arc<Inner>) {
    let granularity = inner.cfg.transfer.lease.reap_granularity();
    loop {
        let now = inner.now();
        let mut released = Vec::new();
        // A bounded tick (issue #11): at most REAP_BUDGET leases per hold of the table's lock,
        // so renewals and reads wait for at most one budget; what is left carries over to the
        // next round of this loop, at once.
        let (more, next_expiry) = {
            let mut table = lock(&inner.leases);
            if inner.cfg.planted_bug == Some(PlantedBug::VllmLease) {
                // Simulator only (`kvlease sim`'s vLLM lease): vLLM's head-only sweep (#58222),
                // run at least every granularity (the head may be released before its deadline).
                (false, table.tick_head_only(now, &mut released).map(|d| d.min(now + granularity)))
            } else {
                let more = table.tick_budget(now, REAP_BUDGET, &mut released);
                (more, table.next_expiry())
            }
        };
        settle(&inner, released);
        let mut out = Vec::new();
        let next_release = {
            let mut q = lock(&inner.quarantine);
            q.poll(now, &mut out);
            q.next_release()
        };
        drop(out);
        if more {
            tokio::task::yield_now().await;
            continue;
        }
        let next = match (next_expiry, next_release) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // Registered before sleeping: a grant between the tick and here is not missed.
        let woken = inner.reaper_wake.notified();
        match next {
            // Never sooner than a quarter of the granularity P4 allows: no spinning on a lower
            // bound that is due but expires nothing (a renewed lease), and never later than P4.
            Some(t) => {
                let at = inner.instant(t.max(now + granularity / 4));
                let _ = tokio::time::timeout_at(at, woken).await;
            }
            None => woken.await,
        }
    }
}

/// SPEC P5, S2, S4: a read is served only for a live lease, only of that lease's blocks in the
/// order its params name them, only for the params digest it was granted with, and the blocks
/// stay out of the pool until the read has been copied out.
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
        // Every kvlease reader shows its prompt's digest (S4): over a fenced transport this check
        // is the only one before D uses the bytes, so a read without it is refused.
        let Ok(digest) = <[u8; 16]>::try_from(tag) else {
            inner.metrics.reads_refused.inc();
            return None;
        };
        let digest = Some(PromptDigest(digest));
        let mut released = Vec::new();
        let ticket = {
            let mut table = lock(&inner.leases);
            // SPEC S4: exactly the lease's blocks, in the order its params name them.
            let owned = table.get(lease_id).is_some_and(|l| reads_lease_blocks(&l.named, blocks, l.prefix_reads));
            if owned {
                let holder = table.holder(agent_holder(peer));
                table.begin_read(holder, lease_id, digest, inner.now(), &mut released)
            } else {
                None
            }
        };
        settle(&inner, released);
        let Some(ticket) = ticket else {
            inner.metrics.reads_refused.inc();
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

/// A message for P from a D engine's agent `from` (SPEC P2, P3, P6, P8): the lease table's
/// business; it says what to answer.
pub(crate) fn on_message(inner: &Inner, rank: usize, from: &str, msg: &Message) {
    if matches!(msg, Message::Heartbeat { .. }) {
        inner.metrics.heartbeats_received.inc();
    }
    let mut released = Vec::new();
    let answer = {
        let mut table = lock(&inner.leases);
        let holder = table.holder(agent_holder(from));
        table.on_message(holder, msg, inner.now(), &mut released)
    };
    settle(inner, released);
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

/// Live leases per holder (for the simulator's reclaim check and diagnostics).
pub(crate) fn live_leases(inner: &Inner) -> usize {
    lock(&inner.leases).live()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EngineConfig, EngineHandle, GenerateRequest, Prompt};
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
