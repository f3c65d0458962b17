//! D's pull of a request's KV from P, under its lease (SPEC D6, T1, T2): the waits and reads of
//! a [`kvlease_core::pull::Pull`], carried out. Every decision — what to wait for and until when,
//! whether P's incarnation still matches, whether the bytes may be used — is the core's.

use crate::pool::Blocks;
use crate::state::{lock, AckKey, Inner};
use kvlease_core::params::RemoteKv;
use kvlease_core::pull::{AfterReads, Pull, ReadFailure, Step, Verdict};
use kvlease_core::wire::Message;
use kvlease_transport::{ReadOp, Segment};
use std::sync::Arc;
use tokio::sync::oneshot;

/// Pulls the prompt's KV of `rk` into `local` blocks, every D rank from every P rank whose heads
/// overlap its own; returns what the request does next. `own`: the blocks of this engine's own
/// lease the params named (SPEC O4), copied rank by rank instead of read.
pub(crate) async fn pull(inner: &Arc<Inner>, internal: &str, rk: &RemoteKv, local: &[u32], own: Option<Blocks>) -> Verdict {
    if let Some(own) = own {
        copy_own(inner, &own, local);
        return Verdict::Use;
    }
    let cfg = &inner.cfg.transfer.lease;
    let fenced = reads_are_fenced(inner.ranks());
    let mut pull = Pull::new(cfg, &rk.engine_id, rk.incarnation, fenced, inner.now());
    pull.planted = inner.cfg.planted_bug;
    // 1. Wait until an acknowledged heartbeat covers the read.
    loop {
        // Registered before the check, so news between the check and the wait is not missed.
        let news = inner.news.notified();
        tokio::pin!(news);
        news.as_mut().enable();
        let answer = {
            let mut renewer = inner.renewer.lock();
            if let Some(rtt) = renewer.round_trip(&rk.engine_id) {
                pull.measured_round_trip(rtt);
            }
            renewer.read_check(internal, pull.read_budget(), pull.fenced(), inner.now())
        };
        match pull.check(answer, inner.now()) {
            Step::Read => break,
            Step::Lost(lost) => return pull.finish(Err(lost)),
            Step::Wait { until, renew } => {
                if renew {
                    inner.renewer.wake();
                }
                // On the deadline, the next check decides.
                let _ = tokio::time::timeout_at(inner.instant(until), news).await;
            }
        }
    }
    if let Some(delay) = inner.cfg.debug_read_delay {
        // Test hook: widen the window between the liveness check and the read.
        tokio::time::sleep(delay).await;
    }
    // 2. P's incarnation must still be the one that granted the lease; plan the reads.
    let peer = inner.renewer.lock().peer(&rk.engine_id).map(|p| (p.incarnation, p.agents.clone()));
    let m = &inner.cfg.model;
    let (plan, read_until) =
        match pull.begin_read(peer.as_ref().map(|(i, a)| (*i, a.len() as u32)), m.num_kv_heads, inner.cfg.tp_size, inner.now()) {
            Ok(p) => p,
            Err(lost) => return pull.finish(Err(lost)),
        };
    let p_agents = peer.map(|(_, a)| a).unwrap_or_default();
    let hbb = m.head_block_bytes() as u32;
    let n = plan.len() as u32;
    // 3. Read, each with its ReadDone attached; P answers each ReadDone. Each read shows P's gate
    // the prompt's digest (S4, checked before a byte is served over a fenced transport).
    let mut acks = AckWaiters { inner, keys: Vec::new(), rx: Vec::new() };
    let mut reads = Vec::new();
    for (consumer, pair) in plan.iter().enumerate() {
        let Some(p_agent) = p_agents.get(pair.p_rank as usize).cloned() else {
            return pull.finish(Err(kvlease_core::pull::PullLost::NoPeer));
        };
        let Some(rank) = inner.ranks().get(pair.d_rank as usize) else {
            return pull.finish(Err(kvlease_core::pull::PullLost::NoPeer));
        };
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
        if !fenced {
            acks.expect((pair.d_rank as usize, p_agent.clone(), rk.lease_id));
        }
        // The digest D checked against its own prompt on arrival (SPEC S4); P checks it again.
        let notif = Message::ReadDone { lease_id: rk.lease_id, consumer_rank: consumer as u32, n, digest: rk.prompt_digest }.encode();
        let agent = rank.agent.clone();
        let op = ReadOp { lease_id: rk.lease_id, segments, notif: Some(notif), tag: rk.prompt_digest.0.to_vec() };
        reads.push(async move { agent.read(&p_agent, op).await });
    }
    // Awaited here, not spawned: on timeout they are dropped, which cancels them (a fenced
    // transport then writes nothing more into our blocks).
    let posted = tokio::time::Instant::now();
    let done = tokio::time::timeout_at(inner.instant(read_until), futures_util::future::join_all(reads)).await;
    let result = match &done {
        Err(_) => Ok(n),
        Ok(results) => match results.iter().find_map(|r| r.as_ref().err()) {
            Some(e) => Err(ReadFailure::Transport(e.to_string())),
            None => {
                inner.metrics.read_time.observe(posted.elapsed().as_secs_f64());
                Ok(n)
            }
        },
    };
    let acks_until = match pull.reads_done(result, done.is_err(), inner.now()) {
        AfterReads::AwaitAcks { until } => until,
        AfterReads::Decided(verdict) => return verdict,
    };
    // 4. Every completion must have been confirmed while the lease was live.
    let deadline = inner.instant(acks_until);
    for rx in acks.rx.drain(..) {
        if !pull.awaits_acks() {
            break;
        }
        let live = match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(live)) => live,
            // Deadline passed, or the waiter was dropped (the engine is stopping).
            _ => return pull.on_deadline(),
        };
        if let Some(verdict) = pull.on_read_done_ack(live) {
            return verdict;
        }
    }
    pull.on_deadline()
}

/// Whether our agents refuse reads of dead leases and never touch memory after a read ends
/// (tcp, mem). NIXL cannot: a posted READ lands whatever P thinks of the lease.
pub(crate) fn reads_are_fenced(ranks: &[crate::state::Rank]) -> bool {
    ranks.iter().all(|r| r.agent.can_refuse_reads())
}

/// SPEC O4: the prompt's KV from this engine's own blocks `own` (taken from its lease) into the
/// request's `local` blocks, whole blocks on every rank.
fn copy_own(inner: &Inner, own: &Blocks, local: &[u32]) {
    for rank in inner.ranks() {
        let arena = &rank.arena;
        let len = arena.block_bytes();
        for (&src, &dst) in own.ids().iter().zip(local) {
            // SAFETY: both blocks are in the arena (the pool hands out only its blocks); `own`
            // holds the source (nobody writes a leased block) and the request owns `dst`;
            // they are different blocks, both held at once.
            unsafe { arena.read_in_place(src, 0, len, |from| arena.write_in_place(dst, 0, len, |to| to.copy_from_slice(from))) }
        }
    }
}

/// The `ReadDoneAck`s a pull waits for; whatever is left when the pull ends is unregistered.
struct AckWaiters<'a> {
    inner: &'a Inner,
    keys: Vec<AckKey>,
    rx: Vec<oneshot::Receiver<bool>>,
}

impl AckWaiters<'_> {
    fn expect(&mut self, key: AckKey) {
        let (tx, rx) = oneshot::channel();
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

/// A `ReadDoneAck` from P's agent `from` to our rank `rank`.
pub(crate) fn on_read_done_ack(inner: &Inner, rank: usize, from: &str, lease_id: u64, live: bool) {
    if let Some(tx) = lock(&inner.read_acks).remove(&(rank, from.to_string(), lease_id)) {
        let _ = tx.send(live);
    }
}
