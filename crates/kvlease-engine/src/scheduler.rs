//! The scheduler: one task owning the waiting queue and the running set, stepping the synthetic
//! model the way a GPU engine's busy loop does.
//!
//! Admission is first-come first-served, bounded by `--max-num-seqs` and by free blocks (a
//! request holds all the blocks it can need from admission on). A `do_remote_prefill` request is
//! admitted into a loading state: its pull runs as a task of its own and reports back, so the
//! loop keeps stepping others. Forward steps take emulated time; nothing lease-related runs in
//! this loop (SPEC D3): heartbeats and the reaper have their own tasks.

use crate::lease_holder::{self, PrefillDone};
use crate::model::{self, EOS};
use crate::pool::Blocks;
use crate::pull::pull;
use crate::push;
use crate::state::{Inner, Rank};
use crate::{FinishReason, GenerateEvent, RequestError, SamplingParams};
use futures_util::FutureExt;
use kvlease_core::params::{KvRole, RemoteKv};
use kvlease_core::pull::{PullLost, ReadFailure, Verdict};
use kvlease_core::push::sink::{PushAction, PushVerdict, WriteLost};
use kvlease_core::renewer::Untrack;
use kvlease_core::wire::PushKey;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

pub(crate) enum SchedMsg {
    Submit(Box<Seq>),
    Abort(u64),
    Loaded { id: u64, blocks: Blocks, verdict: Verdict },
    Shutdown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Prefill,
    Decoding,
}

/// One request inside the engine.
pub(crate) struct Seq {
    id: u64,
    /// The renewer's key: the client's id made unique.
    internal: String,
    client_id: String,
    prompt: Vec<u32>,
    max_tokens: u32,
    ignore_eos: bool,
    sampling: SamplingParams,
    role: KvRole,
    tx: mpsc::UnboundedSender<GenerateEvent>,
    blocks: Option<Blocks>,
    state: State,
    /// Prefix hash of every token whose KV is in the pool.
    prefix: u64,
    /// Digest of the KV read back so far; the next token is a function of it.
    digest: u64,
    last_token: u32,
    generated: u32,
    /// The remote KV was lost: compute the prompt here instead of pulling it.
    recompute: bool,
    /// Multi-turn (P): the decoder's cached turn to read the prompt's first tokens from, with
    /// how many tokens it covers (SPEC B4). Its `block_ids` are the blocks to read.
    read_turn: Option<(RemoteKv, usize)>,
    /// D handed its own params (SPEC O4): the blocks of this engine's lease that hold the
    /// prompt's KV, copied into the request's own blocks instead of a read.
    own_kv: Option<Blocks>,
    /// Prompt tokens whose KV was read back rather than prefilled.
    reused: usize,
    /// The tokens generated so far (a decoder's cached turn keeps their KV, SPEC B1).
    output: Vec<u32>,
    /// P, push mode (SPEC U1): the key D's registration pairs this prefill's lease by.
    push_key: Option<PushKey>,
    /// P, push mode (SPEC U4): where this prefill tells its early writer when its blocks are
    /// computed, while it may write early.
    push_progress: Option<tokio::sync::watch::Sender<push::KvTimes>>,
    /// D, push mode: the sink is done with this request (ready, or failed over).
    push_done: bool,
}

impl Seq {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: u64,
        internal: String,
        client_id: String,
        prompt: Vec<u32>,
        max_tokens: u32,
        ignore_eos: bool,
        sampling: SamplingParams,
        role: KvRole,
        tx: mpsc::UnboundedSender<GenerateEvent>,
    ) -> Seq {
        Seq {
            id,
            internal,
            client_id,
            prompt,
            max_tokens,
            ignore_eos,
            sampling,
            role,
            tx,
            blocks: None,
            state: State::Prefill,
            prefix: model::PREFIX_SEED,
            digest: 0,
            last_token: 0,
            generated: 0,
            recompute: false,
            read_turn: None,
            own_kv: None,
            reused: 0,
            output: Vec::new(),
            push_key: None,
            push_progress: None,
            push_done: false,
        }
    }

    /// SPEC U1: P in push mode grants this prefill's lease under `key`.
    pub fn push_key(mut self, key: PushKey) -> Seq {
        self.push_key = Some(key);
        self
    }

    pub fn role(&self) -> &KvRole {
        &self.role
    }

    /// D, push mode: the P engine writing this request's KV, while it waits for it.
    fn push_from(&self) -> Option<&str> {
        match &self.role {
            KvRole::DecodePush(pr) if !self.recompute && !self.push_done => Some(&pr.engine_id),
            _ => None,
        }
    }

    /// SPEC B4: prefill after reading the first `tokens` tokens' KV from the cached turn `rk`.
    pub fn read_turn(mut self, rk: RemoteKv, tokens: usize) -> Seq {
        self.read_turn = Some((rk, tokens));
        self
    }

    /// SPEC O4: the prompt's KV is in `blocks`, taken from this engine's own lease.
    pub fn own_kv(mut self, blocks: Blocks) -> Seq {
        self.own_kv = Some(blocks);
        self
    }

    fn fail(&self, err: RequestError) {
        let _ = self.tx.send(GenerateEvent::Failed(err));
    }
}

/// Blocks a request holds from admission: the prompt's, plus room for every generated token
/// unless the request only prefills for a remote decoder.
pub(crate) fn blocks_needed(role: &KvRole, prompt_len: usize, max_tokens: u32, block_size: u32) -> usize {
    let tokens = match role {
        KvRole::PrefillForRemote(_) => prompt_len,
        _ => prompt_len + max_tokens as usize,
    };
    tokens.div_ceil(block_size as usize)
}

/// The scheduler's loop. `tx` is its own inbox (pulls report there); `stopped` is set once a
/// shutdown has failed every request.
pub(crate) async fn run(
    inner: Arc<Inner>,
    mut rx: mpsc::UnboundedReceiver<SchedMsg>,
    tx: mpsc::UnboundedSender<SchedMsg>,
    mut push_rx: mpsc::UnboundedReceiver<PushAction>,
    stopped: watch::Sender<bool>,
) {
    let mut waiting: VecDeque<Seq> = VecDeque::new();
    let mut running: Vec<Seq> = Vec::new();
    let mut loading: BTreeMap<u64, Seq> = BTreeMap::new();
    let mut aborted_loads: BTreeSet<u64> = BTreeSet::new();
    let mut pushed = Pushed::default();
    let mut pace = Pace { due: None, yielded: Instant::now() };
    loop {
        // D, push mode: what the sink decided (SPEC U7, U8, U10).
        while let Ok(action) = push_rx.try_recv() {
            pushed.on_action(&inner, action, &mut loading, &mut running, &mut waiting);
        }
        // Take every message that is already here.
        loop {
            let msg = match rx.try_recv() {
                Ok(m) => m,
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => return,
            };
            match msg {
                SchedMsg::Submit(seq) => waiting.push_back(*seq),
                SchedMsg::Abort(id) => {
                    let mut gone: Vec<Seq> = Vec::new();
                    if let Some(i) = waiting.iter().position(|s| s.id == id) {
                        gone.extend(waiting.remove(i));
                    }
                    if let Some(i) = running.iter().position(|s| s.id == id) {
                        gone.push(running.remove(i));
                    }
                    if let Some(seq) = loading.remove(&id) {
                        if seq.push_from().is_some() {
                            gone.push(seq);
                        } else {
                            aborted_loads.insert(id);
                        }
                    }
                    for seq in gone {
                        pushed.abort(&inner, seq);
                    }
                }
                SchedMsg::Loaded { id, blocks, verdict } => {
                    if aborted_loads.remove(&id) {
                        if verdict == Verdict::Use {
                            drop(blocks);
                        } else {
                            lease_holder::free_after_reads(&inner, blocks);
                        }
                        continue;
                    }
                    if let Some(seq) = loading.remove(&id) {
                        finish_load(&inner, seq, blocks, verdict, &mut running, &mut waiting);
                    }
                }
                SchedMsg::Shutdown => {
                    let err = RequestError::unavailable("the engine is shutting down");
                    for seq in waiting.drain(..).chain(running.drain(..)).chain(std::mem::take(&mut loading).into_values()) {
                        if matches!(seq.role, KvRole::DecodeRemote(_)) || seq.read_turn.is_some() {
                            inner.renewer.lock().untrack(&seq.internal, Untrack::Abandoned);
                        }
                        seq.fail(err.clone());
                        pushed.abort(&inner, seq);
                    }
                    inner.renewer.wake();
                    stopped.send_replace(true);
                    return;
                }
            }
        }
        admit(&inner, &tx, &mut waiting, &mut running, &mut loading, &mut pushed);
        inner.metrics.requests_waiting.set(waiting.len() as i64);
        inner.metrics.requests_running.set((running.len() + loading.len()) as i64);
        if running.is_empty() {
            pace.due = None;
            // Biased: the simulator needs the same choice every run.
            tokio::select! {
                biased;
                msg = rx.recv() => match msg {
                    Some(m) => {
                        // Put it back through the drain at the top of the loop.
                        if tx.send(m).is_err() {
                            return;
                        }
                    }
                    None => return,
                },
                _ = inner.pool.freed.notified(), if !waiting.is_empty() => {}
                action = push_rx.recv() => if let Some(action) = action {
                    pushed.on_action(&inner, action, &mut loading, &mut running, &mut waiting);
                },
            }
            pace.yielded = Instant::now();
            continue;
        }
        step(&inner, &mut running, &mut pace).await;
    }
}

fn admit(
    inner: &Arc<Inner>,
    tx: &mpsc::UnboundedSender<SchedMsg>,
    waiting: &mut VecDeque<Seq>,
    running: &mut Vec<Seq>,
    loading: &mut BTreeMap<u64, Seq>,
    pushed: &mut Pushed,
) {
    let bs = inner.cfg.model.block_size;
    while let Some(front) = waiting.front() {
        if front.tx.is_closed() {
            if let Some(seq) = waiting.pop_front() {
                pushed.abort(inner, seq);
            }
            continue;
        }
        if running.len() + loading.len() >= inner.cfg.max_num_seqs {
            return;
        }
        let need = blocks_needed(&front.role, front.prompt.len(), front.max_tokens, bs);
        let blocks = match inner.pool.alloc(need) {
            Some(b) => b,
            // Cached turns nobody continues give their blocks back first (SPEC B1).
            None if lease_holder::evict_turns(inner, need) > 0 => match inner.pool.alloc(need) {
                Some(b) => b,
                None => return,
            },
            None => return,
        };
        let Some(mut seq) = waiting.pop_front() else { return };
        if let (KvRole::DecodePush(pr), false) = (&seq.role, seq.recompute) {
            // SPEC U1, U8: register the prompt's blocks with P, and wait for its writes.
            let n = seq.prompt.len().div_ceil(bs as usize).min(blocks.ids().len());
            match push::register(inner, &seq.internal, pr, &seq.prompt, blocks.ids()[..n].to_vec()) {
                Some(attempt) => {
                    pushed.waiting.insert(seq.internal.clone(), (seq.id, attempt));
                    seq.blocks = Some(blocks);
                    loading.insert(seq.id, seq);
                }
                None => {
                    push::abort_sink(inner, &seq.internal);
                    inner.metrics.recomputed_requests.inc();
                    seq.recompute = true;
                    seq.blocks = Some(blocks);
                    seq.state = State::Prefill;
                    running.push(seq);
                }
            }
            continue;
        }
        // D: the prompt's KV from P; P (multi-turn): the conversation so far from a decoder.
        let source = match &seq.role {
            KvRole::DecodeRemote(rk) => Some(rk.clone()),
            _ => seq.read_turn.as_ref().map(|(rk, _)| rk.clone()),
        };
        match source {
            Some(rk) if !seq.recompute => {
                let (inner2, internal, id, tx) = (inner.clone(), seq.internal.clone(), seq.id, tx.clone());
                let own = seq.own_kv.take();
                inner.tasks.spawn(async move {
                    let ids = blocks.ids().to_vec();
                    // Whatever happens to the pull, the scheduler hears back: a request is never
                    // left loading forever.
                    let verdict = std::panic::AssertUnwindSafe(pull(&inner2, &internal, &rk, &ids, own))
                        .catch_unwind()
                        .await
                        .unwrap_or(Verdict::Recompute(PullLost::ReadFailed(ReadFailure::Panicked)));
                    let _ = tx.send(SchedMsg::Loaded { id, blocks, verdict });
                });
                loading.insert(seq.id, seq);
            }
            _ => {
                seq.blocks = Some(blocks);
                seq.state = State::Prefill;
                running.push(seq);
            }
        }
    }
}

/// D, push mode (SPEC §13): requests waiting for P's writes, and destination blocks P may still
/// write into.
#[derive(Default)]
struct Pushed {
    /// Internal request id → (its id here, its registration's attempt), while it waits in
    /// `loading`.
    waiting: BTreeMap<String, (u64, u32)>,
    /// SPEC U8: destination blocks of requests that gave up, kept out of the pool until the sink
    /// says no write can land in them any more.
    held: BTreeMap<(String, u32), Blocks>,
}

impl Pushed {
    /// The request is given up (its client left, the engine stops): P is told at once (U9, U6),
    /// and blocks it registered wait until no write can land in them (U8).
    fn abort(&mut self, inner: &Arc<Inner>, mut seq: Seq) {
        if let Some(key) = seq.push_key.take() {
            push::abort_prefill(inner, &key, &seq.client_id, seq.push_progress.take().is_some(), seq.blocks.take());
        }
        if seq.push_from().is_none() {
            return;
        }
        if let (Some((_, attempt)), Some(blocks)) = (self.waiting.remove(&seq.internal), seq.blocks.take()) {
            self.held.insert((seq.internal.clone(), attempt), blocks);
        }
        push::abort_sink(inner, &seq.internal);
    }

    /// What the sink decided: decode from the pushed KV (U7), fail over (U7, U10), or give
    /// destination blocks back (U8).
    fn on_action(
        &mut self,
        inner: &Arc<Inner>,
        action: PushAction,
        loading: &mut BTreeMap<u64, Seq>,
        running: &mut Vec<Seq>,
        waiting: &mut VecDeque<Seq>,
    ) {
        match action {
            PushAction::Ready { request_id } => {
                let Some((id, _)) = self.waiting.remove(&request_id) else { return };
                let Some(mut seq) = loading.remove(&id) else { return };
                push::finish_sink(inner, &seq.internal);
                seq.push_done = true;
                prompt_ready(inner, &mut seq);
                match finish_reason(&seq) {
                    Some(reason) => complete(inner, seq, reason),
                    None => running.push(seq),
                }
            }
            PushAction::Failed { request_id, verdict, blocks_reusable } => {
                let Some((id, attempt)) = self.waiting.remove(&request_id) else {
                    // Not registered yet (it waits for blocks, SPEC U3: P lost the key first):
                    // the policy applies now all the same, never a registration P would refuse.
                    if let Some(i) = waiting.iter().position(|s| s.internal == request_id && !s.recompute) {
                        unregistered_failed(inner, i, verdict, waiting);
                    }
                    return;
                };
                let Some(mut seq) = loading.remove(&id) else { return };
                seq.push_done = true;
                inner.metrics.lease_lost.inc();
                let mut blocks = seq.blocks.take();
                if !blocks_reusable {
                    // SPEC U8: a write may still land in them: they wait for the sink's word.
                    if let Some(b) = blocks.take() {
                        self.held.insert((request_id, attempt), b);
                    }
                }
                if seq.tx.is_closed() {
                    // The client left (its abort is on its way, behind this verdict): nobody
                    // waits for the prompt, so it is neither recomputed nor failed.
                    return;
                }
                match verdict {
                    PushVerdict::Recompute(why) => {
                        tracing::warn!(request = %seq.client_id, "pushed KV not usable ({why}); recomputing the prompt locally");
                        inner.metrics.recomputed_requests.inc();
                        seq.recompute = true;
                        match blocks {
                            Some(b) => {
                                seq.blocks = Some(b);
                                seq.state = State::Prefill;
                                running.push(seq);
                            }
                            None => waiting.push_front(seq),
                        }
                    }
                    PushVerdict::Fail(why) => {
                        drop(blocks);
                        push_failed(seq, &why);
                    }
                }
            }
            PushAction::BlocksFree { request_id, attempt } => {
                self.held.remove(&(request_id, attempt));
            }
            // Carried out by the push driver.
            PushAction::Send { .. } => {}
        }
    }
}

/// SPEC U3, D7: P lost the key of push request `waiting[i]` before D registered its blocks:
/// `kv_load_failure_policy` applies at once. Recomputed, it stays in the queue and computes its
/// prompt when admitted (it registers nothing); failed, it leaves the queue with the error. A
/// request whose client left is its abort's to end.
fn unregistered_failed(inner: &Arc<Inner>, i: usize, verdict: PushVerdict, waiting: &mut VecDeque<Seq>) {
    if waiting[i].tx.is_closed() {
        return;
    }
    inner.metrics.lease_lost.inc();
    match verdict {
        PushVerdict::Recompute(why) => {
            let seq = &mut waiting[i];
            tracing::warn!(request = %seq.client_id, "pushed KV not usable ({why}); recomputing the prompt locally");
            inner.metrics.recomputed_requests.inc();
            seq.recompute = true;
        }
        PushVerdict::Fail(why) => {
            if let Some(seq) = waiting.remove(i) {
                push_failed(seq, &why);
            }
        }
    }
}

/// SPEC D7 under `kv_load_failure_policy=fail`: push request `seq` ends with the error, P's KV
/// not written (`why`).
fn push_failed(seq: Seq, why: &WriteLost) {
    tracing::warn!(request = %seq.client_id, "pushed KV not usable ({why}); failing the request (kv_load_failure_policy=fail)");
    seq.fail(RequestError::new(503, "kv_load_failed", None, format!("the prompt's KV cache was not written by the prefill engine: {why}")));
}

/// The pull finished: decode from the pulled KV, or apply the load failure policy (SPEC D6).
fn finish_load(inner: &Arc<Inner>, mut seq: Seq, blocks: Blocks, verdict: Verdict, running: &mut Vec<Seq>, waiting: &mut VecDeque<Seq>) {
    // A cached turn is only worth reading: whatever the policy, a turn not read is recomputed.
    let verdict = match (verdict, seq.read_turn.is_some()) {
        (Verdict::Fail(why), true) => Verdict::Recompute(why),
        (v, _) => v,
    };
    match verdict {
        Verdict::Use if seq.read_turn.is_some() => {
            // SPEC B4: the conversation so far is in our blocks; prefill only the rest.
            seq.blocks = Some(blocks);
            inner.renewer.lock().untrack(&seq.internal, Untrack::Transferred);
            seq.reused = seq.read_turn.take().map_or(0, |(_, tokens)| tokens);
            inner.metrics.turn_tokens_read.inc_by(seq.reused as u64);
            seq.state = State::Prefill;
            running.push(seq);
        }
        Verdict::Use => {
            seq.blocks = Some(blocks);
            inner.renewer.lock().untrack(&seq.internal, Untrack::Transferred);
            prompt_ready(inner, &mut seq);
            match finish_reason(&seq) {
                Some(reason) => complete(inner, seq, reason),
                None => running.push(seq),
            }
        }
        Verdict::Recompute(why) => {
            lost(inner, &seq, &why);
            if seq.read_turn.take().is_some() {
                tracing::info!(request = %seq.client_id, "cached turn not usable ({why}); prefilling the whole prompt");
                inner.metrics.turns_recomputed.inc();
            } else {
                tracing::warn!(request = %seq.client_id, "remote KV not usable ({why}); recomputing the prompt locally");
                inner.metrics.recomputed_requests.inc();
            }
            seq.recompute = true;
            // A READ that failed or timed out may still land in these blocks where the transport
            // cannot fence it: then they sit out in quarantine and the prompt is computed into
            // fresh ones; else they are used at once.
            match lease_holder::with_holder(inner, |h, now, out| h.quarantine(now, blocks, out)) {
                Some(blocks) => {
                    seq.blocks = Some(blocks);
                    seq.state = State::Prefill;
                    running.push(seq);
                }
                None => waiting.push_front(seq),
            }
        }
        Verdict::Fail(why) => {
            lost(inner, &seq, &why);
            tracing::warn!(request = %seq.client_id, "remote KV not usable ({why}); failing the request (kv_load_failure_policy=fail)");
            lease_holder::free_after_reads(inner, blocks);
            seq.fail(RequestError::new(
                503,
                "kv_load_failed",
                None,
                format!("the prompt's KV cache could not be loaded from the prefill engine: {why}"),
            ));
        }
    }
}

/// The request's remote KV will not be used: stop renewing (releasing P's lease) and count it.
fn lost(inner: &Inner, seq: &Seq, why: &PullLost) {
    inner.renewer.with(|r| r.untrack(&seq.internal, Untrack::Abandoned));
    inner.metrics.lease_lost.inc();
    if matches!(why, PullLost::LeaseLost | PullLost::EndedUnderRead) {
        inner.metrics.lease_ended_by_prefill.inc();
    }
}

/// One forward step: every request waiting for prefill is prefilled, every decoding request
/// produces one token. Emulated compute time is slept once per step.
///
/// Decode steps are paced like a GPU's back-to-back steps: each one ends `decode_time` after the
/// previous one was due (`pace.due`), not `decode_time` after the previous sleep happened to end,
/// so the step's own work, the timer's millisecond rounding and a late wake-up do not add up
/// across tokens: a client sees inter-token gaps of `--decode-ms-per-token` (issue 15). A step
/// that falls a whole step behind starts the pace again from now.
async fn step(inner: &Arc<Inner>, running: &mut Vec<Seq>, pace: &mut Pace) {
    let m = &inner.cfg.model;
    let mut i = 0;
    while i < running.len() {
        if !running[i].tx.is_closed() {
            i += 1;
            continue;
        }
        // The client left. A push prefill's decoder is told, and its blocks wait for any early
        // write still reading them (SPEC U4, U6).
        let mut seq = running.remove(i);
        if let Some(key) = seq.push_key.take() {
            push::abort_prefill(inner, &key, &seq.client_id, seq.push_progress.take().is_some(), seq.blocks.take());
        }
    }
    let prefilling = running.iter().any(|s| s.state == State::Prefill);
    if prefilling {
        // Tokens whose KV was read back from a cached turn are not computed again (SPEC B4).
        let prefill_tokens: usize =
            running.iter().filter(|s| s.state == State::Prefill).map(|s| s.prompt.len() - s.reused.min(s.prompt.len())).sum();
        inner.metrics.prefill_tokens.inc_by(prefill_tokens as u64);
        // The emulated compute counts from here: writing the KV is part of it (below).
        let started = tokio::time::Instant::now();
        for seq in running.iter_mut().filter(|s| s.state == State::Prefill) {
            let Some(blocks) = &seq.blocks else { continue };
            let mut prefix = model::PREFIX_SEED;
            for (pos, &tok) in seq.prompt.iter().enumerate() {
                prefix = model::extend_prefix(prefix, tok);
                if pos >= seq.reused {
                    write_kv(inner.ranks(), m, blocks, pos, prefix);
                }
            }
            // SPEC U4: a push prefill's blocks may go to D as they are computed.
            if let (KvRole::PrefillForRemote(_), Some(key), None) = (&seq.role, &seq.push_key, &seq.push_progress) {
                seq.push_progress = push::prefill_started(inner, key, &seq.client_id, &seq.prompt, blocks);
            }
        }
        prefill_compute(running, m, pace, started).await;
        pace.due = None;
        let mut pushed = Vec::new();
        let mut i = 0;
        while i < running.len() {
            if running[i].state != State::Prefill {
                i += 1;
                continue;
            }
            let mut seq = running.swap_remove(i);
            if let (KvRole::PrefillForRemote(_), Some(key)) = (&seq.role, seq.push_key.take()) {
                // SPEC U4: the KV is computed: the lease is granted and the writes go on now.
                // D decodes once they land and does not wait for P's own first token, computed
                // below from the blocks, pinned until then.
                let wrote_early = seq.push_progress.take().is_some();
                let Some(blocks) = seq.blocks.take() else { continue };
                let pin = blocks.pin();
                if let Some(granted) = push::grant(inner, &seq.client_id, &seq.prompt, &seq.tx, blocks, key, wrote_early) {
                    seq.blocks = Some(pin);
                    pushed.push((seq, granted));
                }
                continue;
            }
            prompt_ready(inner, &mut seq);
            if matches!(seq.role, KvRole::PrefillForRemote(_)) {
                lease_holder::grant_and_finish(inner, PrefillDone::from(seq));
            } else {
                match finish_reason(&seq) {
                    Some(reason) => complete(inner, seq, reason),
                    None => running.push(seq),
                }
            }
        }
        if !pushed.is_empty() {
            // What the grants woke (the writes, the agent's sends) sits in this worker's LIFO
            // slot, which no other worker may take: it runs before P's first tokens, not after,
            // and they are computed off the worker, so the transfer's tasks keep running.
            tokio::task::yield_now().await;
            for (mut seq, granted) in pushed {
                let kv_bytes = seq.prompt.len().div_ceil(m.block_size.max(1) as usize) * m.block_bytes(m.num_kv_heads);
                off_the_worker(kv_bytes >= OFF_THE_WORKER_BYTES, || prompt_ready(inner, &mut seq));
                push::answer(inner, PrefillDone::from(seq), granted);
            }
        }
        return;
    }
    let mut tokens = Vec::with_capacity(running.len());
    for seq in running.iter_mut() {
        let Some(blocks) = &seq.blocks else {
            tokens.push(None);
            continue;
        };
        let pos = seq.prompt.len() + seq.generated as usize - 1;
        seq.prefix = model::extend_prefix(seq.prefix, seq.last_token);
        write_kv(inner.ranks(), m, blocks, pos, seq.prefix);
        seq.digest = digest_positions(inner.ranks(), m, blocks, pos, pos + 1, seq.digest);
        tokens.push(Some(choose(seq)));
    }
    let d = m.decode_time();
    if d.is_zero() {
        pace.zero().await;
    } else {
        let now = Instant::now();
        let due = pace.due.map_or(now + d, |last| (last + d).max(now));
        pace.due = Some(due);
        tokio::time::sleep_until(due).await;
        pace.yielded = Instant::now();
    }
    // The step's tokens come out when its compute is done, as on a GPU.
    for (seq, tok) in running.iter_mut().zip(tokens) {
        if let Some(tok) = tok {
            emit(seq, tok);
        }
    }
    let mut i = 0;
    while i < running.len() {
        match finish_reason(&running[i]) {
            Some(reason) => {
                let seq = running.swap_remove(i);
                complete(inner, seq, reason);
            }
            None => i += 1,
        }
    }
}

/// The prompt's KV is in our blocks (prefilled or pulled): read it back and produce the first
/// token from it.
fn prompt_ready(inner: &Arc<Inner>, seq: &mut Seq) {
    let Some(blocks) = &seq.blocks else { return };
    seq.prefix = seq.prompt.iter().fold(model::PREFIX_SEED, |h, &t| model::extend_prefix(h, t));
    seq.digest = digest_positions(inner.ranks(), &inner.cfg.model, blocks, 0, seq.prompt.len(), 0);
    seq.state = State::Decoding;
    let tok = choose(seq);
    emit(seq, tok);
}

/// A prompt's KV from which P's first token is computed off the worker ([`off_the_worker`]):
/// below it the digest takes less than handing the worker's queue to another thread does.
const OFF_THE_WORKER_BYTES: usize = 1 << 20;

/// Runs `f`, if `heavy` CPU work of a millisecond or so, without holding up the tasks this
/// worker has queued: on a multi-thread runtime the worker's queue (its LIFO slot too) moves to
/// another thread meanwhile (`block_in_place`); light work, and any on a single thread (the
/// simulator), runs in place. Measured (push, 16 MiB of KV, c=1): P's lease hold after its grant
/// 0.72–0.80 ms this way, 1.07–1.25 ms with the digest on the worker, the transfer's tasks
/// waiting behind it.
fn off_the_worker<R>(heavy: bool, f: impl FnOnce() -> R) -> R {
    if heavy && tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
        tokio::task::block_in_place(f)
    } else {
        f()
    }
}

/// The request's next token from the KV digest, under its sampling parameters: below
/// `min_tokens`, EOS and the stop ids cannot be chosen.
fn choose(seq: &Seq) -> u32 {
    let s = &seq.sampling;
    let sampler = model::Sampler { temperature: s.temperature, top_p: s.top_p, top_k: s.top_k, seed: s.seed };
    let early = seq.generated < s.min_tokens;
    model::choose(seq.digest, &sampler, seq.generated, |t| early && ((t == EOS && !seq.ignore_eos) || s.stop_token_ids.contains(&t)))
}

fn emit(seq: &mut Seq, tok: u32) {
    seq.last_token = tok;
    seq.generated += 1;
    seq.output.push(tok);
    if tok == EOS && !seq.ignore_eos {
        return;
    }
    if matches!(seq.role, KvRole::PrefillForRemote(_)) {
        // The P leg's token goes out with its Done, after the lease is granted.
        return;
    }
    if let Some(k) = seq.sampling.logprobs {
        let lp = model::log_softmax(&model::logits(seq.digest));
        let mut ranked: Vec<(u32, f32)> = lp.iter().enumerate().map(|(i, &l)| (model::FIRST_WORD + i as u32, l as f32)).collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let logprob = lp.get((tok.saturating_sub(model::FIRST_WORD)) as usize).map_or(f32::NEG_INFINITY, |&l| l as f32);
        ranked.truncate(k as usize);
        let _ = seq.tx.send(GenerateEvent::Logprobs { id: tok, logprob, top: ranked });
    }
    let _ = seq.tx.send(GenerateEvent::Token { id: tok, text: model::detokenize(tok) });
}

/// How the request ends now, if it does.
fn finish_reason(seq: &Seq) -> Option<FinishReason> {
    if (seq.last_token == EOS && !seq.ignore_eos) || seq.sampling.stop_token_ids.contains(&seq.last_token) {
        Some(FinishReason::Stop)
    } else if seq.generated >= seq.max_tokens {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// Sends `Done`. In bidirectional mode a request this engine decoded for a remote prefill
/// keeps its blocks as a cached turn, and `Done` carries the params that name it (SPEC B1).
fn complete(inner: &Arc<Inner>, mut seq: Seq, reason: FinishReason) {
    // As in vLLM, the EOS or stop token that ended the request is counted.
    let completion_tokens = seq.generated;
    let keep = inner.cfg.transfer.lease.bidirectional && matches!(seq.role, KvRole::DecodeRemote(_)) && !seq.tx.is_closed();
    let turn = match seq.blocks.take() {
        Some(blocks) if keep => {
            // Our blocks hold the KV of the prompt and of every generated token but the last.
            let mut tokens = std::mem::take(&mut seq.prompt);
            let prompt_tokens = tokens.len() as u32;
            tokens.extend_from_slice(&seq.output[..seq.output.len().saturating_sub(1)]);
            let (lease_id, params) = lease_holder::keep_turn(inner, &seq.client_id, &tokens, blocks);
            Some((lease_id, params, prompt_tokens))
        }
        other => {
            drop(other);
            None
        }
    };
    let prompt_tokens = turn.as_ref().map_or(seq.prompt.len() as u32, |t| t.2);
    let sent = seq.tx.send(GenerateEvent::Done {
        finish_reason: reason,
        prompt_tokens,
        completion_tokens,
        kv_transfer_params: turn.as_ref().map(|t| t.1.clone()),
    });
    if let (Err(_), Some((lease_id, _, _))) = (sent, turn) {
        // The client left: nobody will read the turn.
        lease_holder::release_own(inner, lease_id);
    }
}

impl From<Seq> for PrefillDone {
    fn from(seq: Seq) -> PrefillDone {
        PrefillDone { client_id: seq.client_id, prompt: seq.prompt, first_token: seq.last_token, blocks: seq.blocks, tx: seq.tx }
    }
}

/// How long zero-time steps may run back to back before the scheduler gives its thread back.
/// Far under D3's I/10 (heartbeats), P4's granularity (the reaper) and anything HTTP notices.
const ZERO_STEPS_SLICE: std::time::Duration = std::time::Duration::from_micros(500);

/// When the scheduler's steps run, on the runtime's clock.
struct Pace {
    /// When the last decode step's tokens were due: steps are paced from it, not from when the
    /// previous sleep happened to end (see `step`).
    due: Option<Instant>,
    /// When the scheduler last gave its thread back to the runtime.
    yielded: Instant,
}

impl Pace {
    /// The emulated compute of a prefill step.
    async fn compute(&mut self, d: std::time::Duration) {
        if d.is_zero() {
            self.zero().await;
        } else {
            tokio::time::sleep(d).await;
            self.yielded = Instant::now();
        }
    }

    /// A step with no compute time. It still never keeps the runtime from heartbeats, the
    /// reaper and HTTP (SPEC D3, P4), even on one thread: it gives the thread back once zero-time
    /// steps have run for [`ZERO_STEPS_SLICE`], and in any case when the task's cooperative
    /// budget is spent (tokio's 128 units a poll; under the simulator's paused clock no time
    /// passes between steps). It does not yield after every step: a GPU step is never that
    /// short, and a yield per step woke each stream's reader once per token, a write and a
    /// wake-up a token at zero compute (issue 15), where the steps' tokens, all ready within
    /// microseconds, now leave together.
    async fn zero(&mut self) {
        if self.yielded.elapsed() >= ZERO_STEPS_SLICE {
            tokio::task::yield_now().await;
            self.yielded = Instant::now();
        } else {
            tokio::task::coop::consume_budget().await;
        }
    }
}

/// The emulated compute of a prefill step that `started` (before its KV was written): the
/// prefilling requests' tokens, one request after the other. The step lasts the compute's time
/// from `started`, writing the KV included (or as long as that took, if longer), so what the
/// emulation costs the CPU does not add to the configured time. A push prefill that may write
/// early (SPEC U4) is told when each of its blocks is computed (the compute passes the block's
/// last token; never before now, when every block's KV is written), so its early writer sends
/// it to D while the rest is computed (chunked prefill).
async fn prefill_compute(running: &[Seq], m: &model::ModelConfig, pace: &mut Pace, started: tokio::time::Instant) {
    let prefilling = || running.iter().filter(|s| s.state == State::Prefill);
    let total = m.prefill_time(prefilling().map(|s| s.prompt.len() - s.reused.min(s.prompt.len())).sum());
    let written = tokio::time::Instant::now();
    let mut before = 0;
    for seq in prefilling() {
        let computed = |end: usize| before + end.saturating_sub(seq.reused);
        if let Some(progress) = &seq.push_progress {
            let (len, piece) = (seq.prompt.len(), push::early_piece(m.block_size));
            let at = |end: usize| ((started + m.prefill_time(computed(end))).max(written), end);
            progress.send_replace((piece..len).step_by(piece).chain([len]).map(at).collect());
        }
        before = computed(seq.prompt.len());
    }
    pace.compute(total.saturating_sub(written - started)).await
}

/// Writes the KV of the token at `pos` (prefix hash `prefix`) into every rank's shard.
fn write_kv(ranks: &[Rank], m: &model::ModelConfig, blocks: &Blocks, pos: usize, prefix: u64) {
    let Some(&block) = blocks.ids().get(pos / m.block_size as usize) else { return };
    let slot = (pos % m.block_size as usize) as u32;
    let hb = m.head_bytes();
    for rank in ranks {
        for head in rank.heads.clone() {
            let local = head - rank.heads.start;
            for layer in 0..m.num_layers {
                for kv in 0..2 {
                    let off = m.kv_offset(local, layer, kv, slot);
                    // SAFETY: the request owns `block` (its guard is alive) and the range is in
                    // bounds by construction of the geometry.
                    unsafe { rank.arena.write_in_place(block, off, hb, |out| model::kv_bytes(prefix, head, layer, kv, out)) };
                }
            }
        }
    }
}

/// Digest of the KV of positions `start..end` as held in the pool, chained from `seed`. Each
/// (global head, layer, K/V) of each block is digested on its own, keyed by where it sits
/// ([`model::piece_seed`]), and the pieces are summed: the pool is read in its memory order, a
/// block front to back as an attention kernel streams it (a walk in position order would jump
/// between blocks every few KiB, a cold page each time, and take 2-4x as long), and any TP
/// split sums to the same digest.
pub(crate) fn digest_positions(ranks: &[Rank], m: &model::ModelConfig, blocks: &Blocks, start: usize, end: usize, seed: u64) -> u64 {
    let bs = m.block_size as usize;
    let hb = m.head_bytes();
    let mut sum = 0u64;
    let mut pos = start;
    while pos < end {
        let Some(&block) = blocks.ids().get(pos / bs) else { break };
        let slot = pos % bs;
        let n = (bs - slot).min(end - pos);
        for rank in ranks {
            for head in rank.heads.clone() {
                let local = head - rank.heads.start;
                for layer in 0..m.num_layers {
                    for kv in 0..2 {
                        let off = m.kv_offset(local, layer, kv, slot as u32);
                        let piece = model::piece_seed(seed, head, layer, kv, pos);
                        // SAFETY: as in `write_kv`; nobody writes the request's blocks meanwhile.
                        let d = unsafe { rank.arena.read_in_place(block, off, n * hb, |kv| model::digest(piece, kv)) };
                        sum = sum.wrapping_add(d);
                    }
                }
            }
        }
        pos += n;
    }
    model::fold_pieces(seed, sum)
}
