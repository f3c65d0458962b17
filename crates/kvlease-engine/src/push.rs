//! Push mode (SPEC §13): P writes a request's KV into blocks D allocated and registered. The
//! rules are kvlease-core's [`PushSource`] (P) and [`PushSink`] (D); this is glue: lock, call,
//! carry out (send, write, free, tell the scheduler), and the two timers.
//!
//! * P: [`grant`] when a `do_remote_decode` prefill has computed its KV and [`answer`] once P
//!   has its first token (P1, U1, U2), the messages from D ([`on_message`]), one task per
//!   transfer ready to write ([`write`]: each write asks the source's gate right before it is
//!   posted, U4, U8, U11), and the reaper ([`source_reaper`], P4).
//! * D: [`admit`] as the request arrives (D1, U2: renewed from then on), [`register`] once its
//!   blocks are allocated (U1), the messages from P ([`on_message`]), the sink's timer
//!   ([`sink_driver`], D3: not the forward loop), and the write gate ([`Gate`]: not a byte lands
//!   outside the newest live registration of those blocks, for that prompt, from that engine).
//!   The sink's verdicts go to the scheduler ([`crate::state::Inner::push_actions`]).
//!
//! Messages travel as transfer-agent notifications between the engines' rank-0 agents (one
//! source and one sink per engine); the writes go from every P rank to the D ranks whose heads
//! overlap its own (T1), each a one-sided write of the transport.

use crate::lease_holder::PrefillDone;
use crate::pool::Blocks;
use crate::state::{lock, Inner};
use crate::{GenerateEvent, RequestError};
use kvlease_core::digest::PromptDigest;
use kvlease_core::params::{PushAnswer, PushRemote};
use kvlease_core::peers::{agent_holder, holder_agent};
use kvlease_core::pull::PlantedBug;
use kvlease_core::push::sink::{PushAction, PushSink};
use kvlease_core::push::source::{EarlyJob, PushGrantError, PushSettled, PushSource, WriteJob};
use kvlease_core::push::PushFailure;
use kvlease_core::wire::{Message, PushKey, PushRenewal};
use kvlease_core::Nanos;
use kvlease_transport::{Segment, WriteGate, WriteOp, WritePermit};
use std::sync::{Arc, Weak};
use tokio::sync::{oneshot, watch};

/// Messages kept per P engine while its handshake is under way.
const PARKED_PER_ENGINE: usize = 4096;

// ---------------------------------------------------------------------------------------------
// P: the source.

/// Calls `f` on the engine's [`PushSource`] under its lock, at the engine's time, and carries
/// out what it settled: messages to D, leases that ended, blocks back, writes to post.
pub(crate) fn with_source<R>(inner: &Arc<Inner>, f: impl FnOnce(&mut PushSource<Blocks>, Nanos, &mut PushSettled<Blocks>) -> R) -> R {
    let mut out = PushSettled::default();
    let r = {
        let mut source = inner.push_source.lock();
        let r = f(&mut source, inner.now(), &mut out);
        inner.metrics.leases_active.set(source.live() as i64);
        r
    };
    carry_out_source(inner, out);
    r
}

fn carry_out_source(inner: &Arc<Inner>, out: PushSettled<Blocks>) {
    for o in out.send {
        send_to_holder(inner, &o.to, &o.msg);
    }
    for e in &out.ended {
        inner.metrics.released(e.reason).inc();
        inner.metrics.lease_hold.observe(e.held.as_secs_f64());
        tracing::debug!(request = %e.request, lease_id = e.lease_id, reason = e.reason.as_str(), "push lease ended");
    }
    drop(out.freed);
    for job in out.ready {
        spawn_write(inner, job);
    }
    for job in out.early {
        spawn_early(inner, job);
    }
    if out.rearm {
        inner.push_source.wake();
    }
}

/// Starts the writes of one transfer ([`write`]) as a task of their own.
fn spawn_write(inner: &Arc<Inner>, job: WriteJob) {
    let inner2 = inner.clone();
    inner.tasks.spawn(async move { write(inner2, job, 0).await });
}

/// When a prefill's KV is computed: `(at, end)`, in order, says the positions before `end` are
/// computed at `at`, a piece of [`EARLY_PIECES`] per block at a time (empty until its step
/// starts). The scheduler says it once, as the step starts; the early writer waits on its own
/// timers, so no piece's write waits for the scheduler's thread (a task the scheduler woke would
/// sit in its worker's LIFO slot, which no other worker may take, until the step's end).
pub(crate) type KvTimes = Vec<(tokio::time::Instant, usize)>;

/// Pieces a block is written early in (SPEC U4): each piece goes to D once the prefill has
/// computed its positions, so what is left to write when the prefill ends is at most a piece,
/// not a block (a block is 1 MiB in a large model, and its write was on the transfer's path).
pub(crate) const EARLY_PIECES: usize = 4;

/// The positions in one early piece of a block of `block_size` positions.
pub(crate) fn early_piece(block_size: u32) -> usize {
    (block_size as usize).div_ceil(EARLY_PIECES).max(1)
}

/// What one write carries of one block: its source block, D's block, and the positions in
/// the block (the whole block, or part of it for an early piece).
struct Span {
    src: u32,
    dst: u32,
    slots: std::ops::Range<u32>,
}

/// The spans of positions `range` of a prompt held in `src`, written into `dst` (SPEC U4).
fn spans(src: &[u32], dst: &[u32], block_size: u32, range: std::ops::Range<usize>) -> Vec<Span> {
    let bs = block_size.max(1) as usize;
    let mut out = Vec::new();
    let mut pos = range.start;
    while pos < range.end {
        let b = pos / bs;
        let (Some(&s), Some(&d)) = (src.get(b), dst.get(b)) else { break };
        let end = range.end.min((b + 1) * bs);
        out.push(Span { src: s, dst: d, slots: (pos - b * bs) as u32..(end - b * bs) as u32 });
        pos = end;
    }
    out
}

/// P, push mode: a prefill running under a push key (SPEC U4, early writes): when its blocks
/// are computed, its source blocks, and the early writer waiting for the transfer's
/// [`WriteJob`] (the one of D's newest registration), to write what is left.
pub(crate) struct Prefilling {
    progress: watch::Receiver<KvTimes>,
    src: Vec<u32>,
    writer: Option<oneshot::Sender<WriteJob>>,
}

/// P: the prefill of `request` under `key` starts (SPEC U4): from now on a registration from D
/// starts an early writer ([`write_early`]), which writes each block into D's blocks as the
/// prefill computes it. Returns where the scheduler tells when the blocks are computed; `None`
/// when this prefill may not write early (another one here runs under the same key, or the key
/// ended or is granted).
pub(crate) fn prefill_started(
    inner: &Arc<Inner>,
    key: &PushKey,
    request: &str,
    prompt: &[u32],
    src: &Blocks,
) -> Option<watch::Sender<KvTimes>> {
    let (tx, progress) = watch::channel(Vec::new());
    {
        let mut prefills = lock(&inner.push_prefills);
        if prefills.contains_key(key) {
            return None;
        }
        prefills.insert(key.clone(), Prefilling { progress, src: src.ids().to_vec(), writer: None });
    }
    if with_source(inner, |s, _, out| s.prefill_started(key, request, prompt, src.ids(), out)) {
        Some(tx)
    } else {
        lock(&inner.push_prefills).remove(key);
        None
    }
}

/// P: a prefill that may write early (it got a progress sender from [`prefill_started`]) is
/// over: its early writer, if any, is handed the transfer's writes (or, dropped, stops).
fn prefill_over(inner: &Inner, key: &PushKey) -> Option<oneshot::Sender<WriteJob>> {
    lock(&inner.push_prefills).remove(key).and_then(|p| p.writer)
}

/// P: the prefill under `key` was aborted (its client left, the engine stops): D is told, and
/// its source blocks go back once no early write reads them (SPEC U4, U6).
pub(crate) fn abort_prefill(inner: &Arc<Inner>, key: &PushKey, request: &str, wrote_early: bool, blocks: Option<Blocks>) {
    if wrote_early {
        drop(prefill_over(inner, key));
    }
    with_source(inner, |s, now, out| s.abort_prefill(key, request, blocks, now, out));
}

/// Starts the early writer of a registration that came while P prefills (SPEC U4). A newer
/// registration's writer replaces an older one's, which then stops.
fn spawn_early(inner: &Arc<Inner>, job: EarlyJob) {
    let (tx, final_job) = oneshot::channel();
    let (progress, src) = {
        let mut prefills = lock(&inner.push_prefills);
        let Some(p) = prefills.get_mut(&job.key) else { return };
        p.writer = Some(tx);
        (p.progress.clone(), p.src.clone())
    };
    let inner2 = inner.clone();
    inner.tasks.spawn(async move { write_early(inner2, job, progress, src, final_job).await });
}

/// SPEC U4 (early writes): while P prefills, writes each piece of a block it computed into
/// D's registration, each write through the source's early gate — the last one too, as the
/// prefill ends and P grants; then, handed the transfer's [`WriteJob`], writes
/// the rest ([`write`]): nothing when every block landed early (the transfer's completion is
/// then reported right after the grant), everything from the first block not wholly landed if
/// an early write failed, or everything if D registered again meanwhile. An early write that
/// fails or is refused only stops the early writes.
async fn write_early(
    inner: Arc<Inner>,
    job: EarlyJob,
    mut progress: watch::Receiver<KvTimes>,
    src: Vec<u32>,
    mut final_job: oneshot::Receiver<WriteJob>,
) {
    let bs = inner.cfg.model.block_size.max(1) as usize;
    let all = src.len().min(job.block_ids.len());
    // Blocks wholly landed once the positions before `landed` did, of a prompt of `len`.
    let whole = |landed: usize, len: usize| if landed >= len { len.div_ceil(bs) } else { landed / bs }.min(all);
    // `open`: the scheduler may still say when the blocks are computed (the times it said stay
    // true once it is gone: the source's gate refuses what the prefill's end made too late).
    // `landed`, `upto`: positions.
    let (mut landed, mut early, mut open) = (0, true, true);
    loop {
        let (upto, len, next) = {
            let times = progress.borrow_and_update();
            let now = tokio::time::Instant::now();
            let len = times.last().map_or(0, |&(_, end)| end).min(all * bs);
            let upto = times.iter().take_while(|&&(t, _)| t <= now).last().map_or(0, |&(_, end)| end).min(len);
            let next = times.iter().map(|&(t, _)| t).find(|&t| t > now).filter(|_| early && upto < len);
            (upto, len, next)
        };
        if early && upto > landed {
            early = write_early_piece(&inner, &job, &src, landed..upto).await;
            if early {
                inner.metrics.push_early_blocks.inc_by((whole(upto, len) - whole(landed, len)) as u64);
                landed = upto;
            }
            continue;
        }
        tokio::select! {
            // Blocks computed go first: the last one is computed as the grant hands the job
            // over, and written early it needs no second look at what is left.
            biased;
            changed = progress.changed(), if open => open = changed.is_ok(),
            () = sleep_until(next), if next.is_some() => {}
            w = &mut final_job => {
                if let Ok(w) = w {
                    let same = w.attempt == job.attempt && w.block_ids == job.block_ids && w.src_blocks == src;
                    let from = if same { whole(landed, len) } else { 0 };
                    write(inner, w, from).await;
                }
                return;
            }
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One early write of the KV of positions `range` into D's blocks at the same places, to every
/// D rank (each from the P ranks whose heads overlap its own, T1). Whether every write landed.
async fn write_early_piece(inner: &Arc<Inner>, job: &EarlyJob, src: &[u32], range: std::ops::Range<usize>) -> bool {
    let Some(plan) = kvlease_core::tp::read_plan(inner.cfg.model.num_kv_heads, inner.cfg.tp_size, job.dst_ranks) else { return false };
    let timeout = inner.cfg.transfer.lease.read_timeout();
    let until = tokio::time::Instant::now() + timeout;
    let key = job.key.write_key(job.attempt);
    for dst_rank in 0..job.dst_ranks {
        let to = holder_agent(&job.to, dst_rank as usize);
        if !introduced(inner, &to, until).await {
            return false;
        }
        let Ok(ticket) = with_source(inner, |s, now, out| s.begin_early_write(&job.key, job.attempt, now, out)) else { return false };
        let spans = spans(src, &job.block_ids, inner.cfg.model.block_size, range.clone());
        let writes = rank_writes(inner, &plan, dst_rank, &to, &key, &job.digest, &spans);
        let mut all = futures_util::future::join_all(writes);
        let ok = match tokio::time::timeout(timeout, &mut all).await {
            Ok(results) => !results.is_empty() && results.iter().all(Result::is_ok),
            Err(_) if writes_are_fenced(inner.ranks()) => {
                drop(all);
                false
            }
            Err(_) => {
                // SPEC U4: it runs on; D fails over now, the blocks stay held until it ends (or
                // the quarantine passes).
                tracing::info!(key = %job.key, "an early push write outlived {timeout:?}; given up on, its source blocks held until it ends");
                if let Some(id) = with_source(inner, |s, now, out| s.abandon_early_write(ticket, now, out)) {
                    let inner2 = inner.clone();
                    inner.tasks.spawn(async move {
                        all.await;
                        with_source(&inner2, |s, _, out| s.abandoned_write_ended(id, out));
                    });
                }
                return false;
            }
        };
        with_source(inner, |s, _, out| s.end_early_write(ticket, out));
        if !ok {
            return false;
        }
    }
    true
}

/// The writes to D rank `dst_rank` of `spans`: one per P rank whose heads overlap that D rank's
/// (T1), each its heads' part of every span: of a whole block one segment, of part of a block
/// one per head, layer and K/V.
#[allow(clippy::too_many_arguments)]
fn rank_writes(
    inner: &Inner,
    plan: &[kvlease_core::tp::ReadPair],
    dst_rank: u32,
    to: &str,
    key: &[u8],
    digest: &PromptDigest,
    spans: &[Span],
) -> Vec<impl std::future::Future<Output = Result<(), kvlease_transport::TransportError>>> {
    let m = &inner.cfg.model;
    let (hbb, hb, bs) = (m.head_block_bytes() as u32, m.head_bytes() as u32, m.block_size);
    let mut writes = Vec::new();
    for pair in plan.iter().filter(|p| p.d_rank == dst_rank) {
        let Some(rank) = inner.ranks().get(pair.p_rank as usize) else { continue };
        let heads = pair.heads.end - pair.heads.start;
        let mut segments = Vec::new();
        for span in spans {
            if span.slots == (0..bs) {
                segments.push(Segment {
                    remote_block: span.dst,
                    remote_offset: pair.d_head_offset * hbb,
                    local_block: span.src,
                    local_offset: pair.p_head_offset * hbb,
                    len: heads * hbb,
                });
                continue;
            }
            for head in 0..heads {
                for lkv in 0..2 * m.num_layers {
                    let at = (lkv * bs + span.slots.start) * hb;
                    segments.push(Segment {
                        remote_block: span.dst,
                        remote_offset: (pair.d_head_offset + head) * hbb + at,
                        local_block: span.src,
                        local_offset: (pair.p_head_offset + head) * hbb + at,
                        len: (span.slots.end - span.slots.start) * hb,
                    });
                }
            }
        }
        let op = WriteOp { key: key.to_vec(), segments, notif: None, tag: digest.0.to_vec() };
        let (agent, to) = (rank.agent.clone(), to.to_owned());
        writes.push(async move { agent.write(&to, op).await });
    }
    writes
}

/// A message for the engine whose holder name (as the transport authenticated it) is `holder`:
/// from our rank 0 to its rank 0.
fn send_to_holder(inner: &Inner, holder: &str, msg: &Message) {
    let Some(rank0) = inner.ranks().first() else { return };
    let to = holder_agent(holder, 0);
    if let Err(e) = rank0.agent.send_notif(&to, msg.encode()) {
        tracing::debug!("cannot send a push message to {to}: {e}");
    }
}

/// A push prefill's lease, granted as its compute ended ([`grant`]); P answers once it has its
/// own first token ([`answer`]).
pub(crate) struct Granted {
    key: PushKey,
    /// The lease's deadline; `None` when D gave the transfer up before the grant.
    expiry: Option<Nanos>,
}

/// SPEC P1, U1, U2, U4: a `do_remote_decode` prefill of a push engine has computed its KV:
/// grant the lease under the transfer's key. A registration D sent before is paired now and the
/// writes go on at once (the early writer, if any, writes what is left): D decodes once they
/// land, and it does not wait for P's own first token, which P computes afterwards (from
/// blocks it keeps a [`crate::pool::Blocks::pin`] on) and sends with [`answer`]. `None`: the
/// request is over (its client left, or the grant failed and the request was failed).
pub(crate) fn grant(
    inner: &Arc<Inner>,
    request: &str,
    prompt: &[u32],
    tx: &tokio::sync::mpsc::UnboundedSender<GenerateEvent>,
    blocks: Blocks,
    key: PushKey,
    wrote_early: bool,
) -> Option<Granted> {
    if tx.is_closed() {
        abort_prefill(inner, &key, request, wrote_early, Some(blocks));
        return None;
    }
    // SPEC U4: the early writer, if this prefill had one, writes what is left.
    let mut early_writer = if wrote_early { prefill_over(inner, &key) } else { None };
    let mut ready = Vec::new();
    let granted = with_source(inner, |s, now, out| {
        let granted = s.grant(now, Some(key.clone()), request, blocks, prompt, out);
        ready = std::mem::take(&mut out.ready);
        granted
    });
    let expiry = match granted {
        Ok(g) => {
            inner.metrics.leases_granted.inc();
            tracing::debug!(%request, lease_id = g.lease_id, %key, "push lease granted");
            Some(g.expiry)
        }
        // D gave the transfer up before the prefill ended: nobody will take the KV; the
        // answer still names the key, and a decoder that registers later hears it is lost.
        Err(PushGrantError::Released(_)) => None,
        Err(PushGrantError::KeyTaken(k)) => {
            let _ = tx.send(GenerateEvent::Failed(RequestError::new(
                409,
                "transfer_key_in_use",
                Some("kv_transfer_params"),
                format!("another request on this prefill engine is already paired by {k} (SPEC U1); give each request its own X-Request-Id or transfer_id"),
            )));
            return None;
        }
        Err(PushGrantError::Grant(e)) => {
            let _ = tx.send(GenerateEvent::Failed(RequestError::unavailable(format!("no lease granted: {e}"))));
            return None;
        }
    };
    for job in ready {
        match early_writer.take() {
            Some(writer) if job.key == key => {
                if let Err(job) = writer.send(job) {
                    spawn_write(inner, job);
                }
            }
            _ => spawn_write(inner, job),
        }
    }
    Some(Granted { key, expiry })
}

/// SPEC P1: P's answer to a push prefill [`grant`]ed before: its first token, P's coordinates
/// and the key (no blocks: D registers its own).
pub(crate) fn answer(inner: &Arc<Inner>, done: PrefillDone, granted: Granted) {
    let Granted { key, expiry } = granted;
    let kv = inner.kv_addr.get().copied();
    let host = match (inner.cfg.advertise_host, kv) {
        (Some(ip), _) => ip.to_string(),
        (None, Some(a)) => a.ip().to_string(),
        (None, None) => inner.cfg.host.clone(),
    };
    let answer = PushAnswer {
        engine_id: &inner.cfg.engine_id,
        host: &host,
        port: kv.map_or(0, |a| a.port()),
        tp_size: inner.cfg.tp_size,
        num_tokens: Some(done.prompt.len() as u32),
        incarnation: Some(inner.incarnation),
        key: &key,
    };
    let mut params = answer.to_json();
    if let (Some(at), serde_json::Value::Object(o)) = (expiry, &mut params) {
        o.insert("remote_blocks_expiry_time".into(), serde_json::json!(at.0 as f64 / 1e9));
    }
    if !crate::lease_holder::answer_prefill(&done, params) {
        // The client left meanwhile: nobody will read; D is told.
        with_source(inner, |s, now, out| s.abort(&key, now, out));
    }
}

/// Whether our agents stop a write whose future is dropped: read none of its source blocks and
/// land no byte more after that (tcp: under the write's cancel lock, then `WriteCancel`; mem).
/// NIXL cannot: a posted WRITE runs to its end, whatever its caller does (SPEC U4).
pub(crate) fn writes_are_fenced(ranks: &[crate::state::Rank]) -> bool {
    ranks.iter().all(|r| r.agent.can_refuse_writes())
}

/// SPEC U4, U5, U6, U8, T1: the writes of one transfer, one per destination rank and
/// pipeline stage, each from every P rank whose heads overlap that D rank's. Each asks the
/// source's gate right before it is posted; a write that outlives the read timeout is given up
/// on ([`PushSource::abandon_write`]): D is told at once. On a fenced transport dropping it
/// cancels it; on NIXL it runs on, so it is awaited in the background and the source learns
/// when it ended (its source blocks held until then, or until the quarantine passes). Blocks
/// before `from` landed already by early writes ([`write_early`]), which ended before this
/// runs; when that is all of them, each write is done as soon as the gate lets it be posted
/// (it carries no byte: U5 counts it after the grant, as any write).
async fn write(inner: Arc<Inner>, job: WriteJob, from: usize) {
    let m = &inner.cfg.model;
    let Some(plan) = kvlease_core::tp::read_plan(m.num_kv_heads, inner.cfg.tp_size, job.dst_ranks) else {
        with_source(&inner, |s, now, out| s.fail_writes(&job.key, PushFailure::NotPosted, now, out));
        return;
    };
    let key = job.key.write_key(job.attempt);
    let timeout = inner.cfg.transfer.lease.read_timeout();
    // D's agents reach ours by the handshake D made; ours may still be adding them (it answers
    // the handshake and adds them alongside): wait for that, within the write's own time.
    let until = tokio::time::Instant::now() + timeout;
    for dst_rank in 0..job.dst_ranks {
        if !introduced(&inner, &holder_agent(&job.to, dst_rank as usize), until).await {
            tracing::info!(request = %job.request, "D's agents were never introduced here; its writes are not posted");
            if planted(&inner, PlantedBug::PushFailureOnlyLogged) {
                return;
            }
            with_source(&inner, |s, now, out| s.fail_writes(&job.key, PushFailure::NotPosted, now, out));
            return;
        }
    }
    for dst_rank in 0..job.dst_ranks {
        for stage in 0..job.stages {
            let Ok(ticket) = with_source(&inner, |s, now, out| s.begin_write(&job.key, job.attempt, dst_rank, stage, now, out)) else {
                continue;
            };
            if from >= job.src_blocks.len() && !job.src_blocks.is_empty() {
                // Every block landed early, into this registration (U4): nothing left to post.
                with_source(&inner, |s, now, out| s.end_write(ticket, true, now, out));
                continue;
            }
            let to = holder_agent(&job.to, dst_rank as usize);
            let whole: Vec<Span> = job
                .src_blocks
                .iter()
                .zip(&job.block_ids)
                .skip(from)
                .map(|(&src, &dst)| Span { src, dst, slots: 0..m.block_size })
                .collect();
            let writes = rank_writes(&inner, &plan, dst_rank, &to, &key, &job.digest, &whole);
            if writes.is_empty() {
                if planted(&inner, PlantedBug::PushFailureOnlyLogged) {
                    drop(ticket);
                } else {
                    with_source(&inner, |s, now, out| s.end_write(ticket, false, now, out));
                }
                continue;
            }
            let mut all = futures_util::future::join_all(writes);
            let ok = match tokio::time::timeout(timeout, &mut all).await {
                Ok(results) => match results.iter().find_map(|r| r.as_ref().err()) {
                    Some(e) => {
                        tracing::info!(request = %job.request, "a push write to {to} failed: {e}");
                        false
                    }
                    None => true,
                },
                Err(_) if planted(&inner, PlantedBug::PushFailureOnlyLogged) => false,
                Err(_) => {
                    // SPEC U4: given up on. Over a fenced transport dropping the write stops it
                    // (so it is dropped before its source blocks may go back); else it runs on,
                    // and its source blocks stay held until it ends (or the quarantine passes).
                    let running = if writes_are_fenced(inner.ranks()) {
                        drop(all);
                        None
                    } else {
                        Some(all)
                    };
                    let held = with_source(&inner, |s, now, out| s.abandon_write(ticket, now, out));
                    match (held, running) {
                        (Some(id), Some(all)) => {
                            tracing::info!(request = %job.request, "a push write to {to} outlived {timeout:?}; given up on, its source blocks held until it ends");
                            let inner2 = inner.clone();
                            inner.tasks.spawn(async move {
                                all.await;
                                with_source(&inner2, |s, _, out| s.abandoned_write_ended(id, out));
                            });
                        }
                        // Stopped already (dropped above).
                        (Some(id), None) => with_source(&inner, |s, _, out| s.abandoned_write_ended(id, out)),
                        (None, _) => tracing::info!(request = %job.request, "a push write to {to} outlived {timeout:?}; cancelled"),
                    }
                    continue;
                }
            };
            if !ok && planted(&inner, PlantedBug::PushFailureOnlyLogged) {
                // vLLM #48633, planted: the failure above was only logged.
                drop(ticket);
                continue;
            }
            with_source(&inner, |s, now, out| s.end_write(ticket, ok, now, out));
        }
    }
}

/// Whether agent `agent` is (or becomes, before `until`) one our agents know.
async fn introduced(inner: &Inner, agent: &str, until: tokio::time::Instant) -> bool {
    loop {
        // Registered before the check, so an introduction between the two is not missed.
        let news = inner.news.notified();
        tokio::pin!(news);
        news.as_mut().enable();
        if inner.renewer.lock().peers().engine_of(agent).is_some() {
            return true;
        }
        if tokio::time::timeout_at(until, news).await.is_err() {
            return false;
        }
    }
}

/// SPEC P4: the push source's reaper, as [`crate::lease_holder::reaper`] is the pull holder's.
pub(crate) async fn source_reaper(inner: Arc<Inner>) {
    crate::state::run_timer(&inner, &inner.push_source, || {
        with_source(&inner, |s, now, out| {
            let more = s.poll(now, out);
            (more, s.poll_timeout(now))
        })
    })
    .await;
}

/// SPEC U6, P3: engine shutdown: every push lease ends as `shutdown`, and every D that renewed
/// or registered one is told at once (not left to wait out `push_registration_timeout`). Writes
/// still in flight stop with the engine's tasks; D's blocks under them wait for its deadline (U8).
pub(crate) fn shutdown_source(inner: &Arc<Inner>) {
    with_source(inner, |s, now, out| s.shutdown(now, out));
}

// ---------------------------------------------------------------------------------------------
// D: the sink.

/// Calls `f` on the engine's [`PushSink`] under its lock and carries out what it decided:
/// messages to P now (or once the handshake is done), verdicts to the scheduler.
/// `subject`: the request the call is about (it may be forgotten without an action).
pub(crate) fn with_sink<R>(inner: &Inner, subject: Option<&str>, f: impl FnOnce(&mut PushSink, Nanos, &mut Vec<PushAction>) -> R) -> R {
    let mut out = Vec::new();
    let r = {
        let mut sink = inner.push_sink.lock();
        let before = sink.poll_timeout();
        let r = f(&mut sink, inner.now(), &mut out);
        // The timer sleeps until `before` at the latest (every change comes through here, or
        // wakes it): it is woken only when the call moved its next deadline earlier, and before
        // the actions are carried out, so a verdict's wake-up of the scheduler is the last one
        // and runs next on this thread, not behind the timer's poll.
        if sink.poll_timeout().is_some_and(|next| before.is_none_or(|b| next < b)) {
            inner.push_sink.wake();
        }
        r
    };
    carry_out_sink(inner, out, subject);
    r
}

/// Carries out the sink's actions; then a request the sink forgot (the actions', or
/// `subject`) no longer keeps the link to its P engine up.
fn carry_out_sink(inner: &Inner, actions: Vec<PushAction>, subject: Option<&str>) {
    let mut seen: Vec<String> = subject.map(str::to_owned).into_iter().collect();
    for a in &actions {
        match a {
            PushAction::Ready { request_id } | PushAction::Failed { request_id, .. } | PushAction::BlocksFree { request_id, .. } => {
                seen.push(request_id.clone())
            }
            PushAction::Send { .. } => {}
        }
    }
    for a in actions {
        match a {
            PushAction::Send { engine_id, msg } => send_to_engine(inner, &engine_id, msg),
            other => {
                if let Some(tx) = inner.push_actions.get() {
                    let _ = tx.send(other);
                }
            }
        }
    }
    let gone: Vec<String> = {
        let sink = inner.push_sink.lock();
        seen.into_iter().filter(|id| !sink.is_tracked(id)).collect()
    };
    let engines: Vec<String> = {
        let mut linked = lock(&inner.push_linked);
        gone.iter().filter_map(|id| linked.remove(id)).collect()
    };
    if !engines.is_empty() {
        inner.renewer.with(|r| engines.iter().for_each(|e| r.push_unlink(e)));
    }
}

/// A message for P engine `engine_id`, to its rank 0 from ours; parked while the handshake
/// with it is under way (SPEC D5). The link is looked up under the parking lot's lock, so a
/// handshake completing meanwhile ([`link_ready`]) finds the message parked, or it finds the
/// link.
fn send_to_engine(inner: &Inner, engine_id: &str, msg: Message) {
    let agent = {
        let mut parked = lock(&inner.push_parked);
        let agent = inner.renewer.lock().peer(engine_id).and_then(|p| p.agents.first().cloned());
        if agent.is_none() {
            let queue = parked.entry(engine_id.to_owned()).or_default();
            // A parked message keeps the link wanted until it goes (a request given up before
            // the handshake even started would otherwise leave its release here for good).
            if queue.len() < PARKED_PER_ENGINE && inner.renewer.with(|r| r.push_hold(engine_id)) {
                queue.push(msg);
            }
            return;
        }
        agent
    };
    if let Some(agent) = agent {
        send_to_agent(inner, engine_id, &agent, &msg);
    }
}

fn send_to_agent(inner: &Inner, engine_id: &str, agent: &str, msg: &Message) {
    let Some(rank0) = inner.ranks().first() else { return };
    if matches!(msg, Message::PushHeartbeat { .. }) {
        inner.metrics.heartbeats_sent.inc();
    }
    let bytes = match msg {
        // vLLM #53095, planted: each renewal names a key P never pairs by.
        Message::PushHeartbeat { seq, renewals } if planted(inner, PlantedBug::PushHeartbeatWrongKey) => {
            let renewals = renewals.iter().map(|r| PushRenewal { key: PushKey::Request(format!("d:{}", r.key)), window_ns: r.window_ns });
            Message::PushHeartbeat { seq: *seq, renewals: renewals.collect() }.encode()
        }
        _ => msg.encode(),
    };
    if let Err(e) = rank0.agent.send_notif(agent, bytes) {
        tracing::debug!(engine = %engine_id, "cannot send a push message: {e}");
    }
}

/// The handshake with P engine `engine_id` completed: what waited for it goes out.
pub(crate) fn link_ready(inner: &Inner, engine_id: &str) {
    let parked = lock(&inner.push_parked).remove(engine_id).unwrap_or_default();
    let agent = inner.renewer.lock().peer(engine_id).and_then(|p| p.agents.first().cloned());
    if let Some(agent) = agent {
        for msg in &parked {
            send_to_agent(inner, engine_id, &agent, msg);
        }
    }
    // Each parked message held the link (send_to_engine): it went.
    if !parked.is_empty() {
        inner.renewer.with(|r| parked.iter().for_each(|_| r.push_unlink(engine_id)));
    }
}

/// The handshake with P engine `engine_id` failed: what was parked for it is dropped, and no
/// longer holds the link (requests not registered yet still do, and retry with back-off); the
/// requests registered with it fail over now (SPEC D5, O4: [`PushSink::link_failed`]).
pub(crate) fn link_failed(inner: &Inner, engine_id: &str) {
    let parked = lock(&inner.push_parked).remove(engine_id).unwrap_or_default();
    if !parked.is_empty() {
        tracing::debug!(engine = %engine_id, dropped = parked.len(), "push messages parked for a failed handshake dropped");
        inner.renewer.with(|r| parked.iter().for_each(|_| r.push_unlink(engine_id)));
    }
    if inner.cfg.transfer.push_mode() {
        with_sink(inner, None, |s, now, out| s.link_failed(engine_id, now, out));
    }
}

/// SPEC D1, U2: a push request arrived: renewed from now on, and the link to P made in the
/// background. `false` if another request here already waits under the same key (U1): this
/// one must not take the transfer over, and computes its prompt itself.
pub(crate) fn admit(inner: &Inner, internal: &str, pr: &PushRemote) -> bool {
    let taken = {
        let mut sink = inner.push_sink.lock();
        let taken = sink.key_taken(&pr.engine_id, &pr.key);
        if !taken {
            sink.admit(internal, &pr.engine_id, pr.key.clone(), inner.now());
        }
        taken
    };
    if !taken {
        inner.push_sink.wake();
        lock(&inner.push_linked).insert(internal.to_owned(), pr.engine_id.clone());
        inner.renewer.with(|r| r.push_link(&pr.remote(), inner.now()));
    }
    !taken
}

/// SPEC U1, U8: the request's destination blocks are allocated: register them with P (the
/// prompt's blocks only, the ones P writes). Returns the registration's attempt.
pub(crate) fn register(inner: &Inner, internal: &str, pr: &PushRemote, prompt: &[u32], block_ids: Vec<u32>) -> Option<u32> {
    let (incarnation, tp) = (inner.incarnation, inner.cfg.tp_size);
    let digest = PromptDigest::of(prompt);
    with_sink(inner, Some(internal), |s, now, out| {
        match s.register(internal, incarnation, pr.incarnation, digest, tp, pr.pp_size, block_ids, now) {
            Ok(action) => {
                let attempt = match &action {
                    PushAction::Send { msg: Message::PushRegister(reg), .. } => Some(reg.attempt),
                    _ => None,
                };
                out.push(action);
                attempt
            }
            Err(e) => {
                tracing::warn!(request = %internal, "push registration not made: {e}");
                None
            }
        }
    })
}

/// SPEC U9: D gives the request up (aborted, refused, shut down): P is told at once.
pub(crate) fn abort_sink(inner: &Inner, internal: &str) {
    let not_sent = planted(inner, PlantedBug::PushAbortNotSent);
    with_sink(inner, Some(internal), |s, now, out| {
        s.abort(internal, now, out);
        if not_sent {
            // vLLM #46283, planted: P is never told.
            out.retain(|a| !matches!(a, PushAction::Send { msg: Message::PushRelease { .. }, .. }));
        }
    });
}

/// The request is decoding from the pushed KV: nothing of the transfer is left to track.
pub(crate) fn finish_sink(inner: &Inner, internal: &str) {
    with_sink(inner, Some(internal), |s, now, out| s.finish(internal, now, out));
}

/// SPEC D2, D3, U2, U10: the sink's timer: heartbeats, D's write deadlines, block reuse. Runs
/// on its own, never on the forward loop.
pub(crate) async fn sink_driver(inner: Arc<Inner>) {
    crate::state::run_timer(&inner, &inner.push_sink, || {
        let mut out = Vec::new();
        let next = {
            let mut sink = inner.push_sink.lock();
            sink.poll(inner.now(), &mut out);
            sink.poll_timeout()
        };
        carry_out_sink(&inner, out, None);
        (false, next)
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Both: messages, and D's write gate.

/// Whether the simulator planted `bug` in this engine (its own tests only; never from config).
fn planted(inner: &Inner, bug: PlantedBug) -> bool {
    inner.cfg.planted_bug == Some(bug)
}

/// A push message from agent `from`: for P's source (from a D engine) or D's sink (from a P
/// engine whose handshake we made). A message for the other side's machine is dropped.
pub(crate) fn on_message(inner: &Arc<Inner>, from: &str, msg: &Message) {
    if !inner.cfg.transfer.push_mode() {
        tracing::debug!(from, "push-mode message on a pull engine, dropped");
        inner.metrics.rejected("malformed");
        return;
    }
    match msg {
        Message::PushRegister(_) | Message::PushHeartbeat { .. } | Message::PushRelease { .. } => {
            if matches!(msg, Message::PushHeartbeat { .. }) {
                inner.metrics.heartbeats_received.inc();
            }
            with_source(inner, |s, now, out| s.on_message(agent_holder(from), msg, now, out));
        }
        _ => {
            let engine = inner.renewer.lock().peers().engine_of(from).map(str::to_owned);
            match engine {
                Some(engine) => with_sink(inner, None, |s, now, out| s.on_message(&engine, msg, now, out)),
                None => inner.metrics.rejected("unknown_agent"),
            }
        }
    }
}

/// SPEC U4, U8, U11, S4: D's say over P's writes into its blocks: only into the newest live
/// registration of exactly those blocks, for that prompt, from the engine it was registered
/// with, before the deadline P was told.
pub(crate) struct Gate {
    pub inner: Weak<Inner>,
}

impl WriteGate for Gate {
    fn begin_write(&self, peer: &str, key: &[u8], blocks: &[u32], tag: &[u8]) -> Option<WritePermit> {
        let inner = self.inner.upgrade()?;
        let allowed = PushKey::from_write_key(key).is_some_and(|(key, attempt)| {
            let engine = inner.renewer.lock().peers().engine_of(peer).map(str::to_owned);
            engine.is_some_and(|e| inner.push_sink.lock().may_write(&e, &key, attempt, blocks, tag, inner.now()))
        });
        if allowed {
            Some(Box::new(()))
        } else {
            inner.metrics.writes_refused.inc();
            None
        }
    }
}
