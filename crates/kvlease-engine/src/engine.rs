//! The engine's public handle: start-up (agents, side channel, tasks), request submission and
//! validation, abort on drop, graceful shutdown, and the simulator's crash.

use crate::handshake::{self, Listener};
use crate::metrics::Metrics;
use crate::model::{self, VOCAB_SIZE};
use crate::pool::BlockPool;
use crate::scheduler::{self, SchedMsg, Seq};
use crate::state::{Inner, Tasks, Woken};
use crate::{agents, lease_holder, push, renewal};
use crate::{EngineConfig, GenerateEvent, GenerateRequest, Prompt, RequestError, StartError};
use kvlease_core::holder::LeaseHolder;
use kvlease_core::params::{Admit, KvRole, NotRead, RemoteKv, TurnKv, Whose};
use kvlease_core::pull::PlantedBug;
use kvlease_core::push::sink::PushSink;
use kvlease_core::push::source::PushSource;
use kvlease_core::renewer::{Renewer, Untrack};
use kvlease_core::turn::{self, CachedTurn, TurnPlan};
use kvlease_core::wire::PushKey;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;
use tokio::sync::{mpsc, watch, Notify};

/// A running engine; cheap to clone. When the last clone goes, the engine's tasks stop.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
    owner: Arc<Owner>,
}

/// Shared by every clone of a handle: the scheduler's inbox, and the stop on last drop.
struct Owner {
    inner: Arc<Inner>,
    sched: mpsc::UnboundedSender<SchedMsg>,
    next_seq: AtomicU64,
    shutting_down: AtomicBool,
    stopped: watch::Sender<bool>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.inner.tasks.abort();
    }
}

impl EngineHandle {
    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }
}

impl EngineHandle {
    /// Starts the engine: agents per rank, the handshake side channel, the scheduler, the reaper
    /// and the renewer, each its own task.
    pub async fn start(mut cfg: EngineConfig) -> Result<EngineHandle, StartError> {
        cfg.model.validate(cfg.tp_size).map_err(StartError::Config)?;
        if cfg.num_gpu_blocks == 0 {
            return Err(StartError::Config("--num-gpu-blocks must be at least 1".into()));
        }
        if cfg.max_num_seqs == 0 {
            return Err(StartError::Config("--max-num-seqs must be at least 1".into()));
        }
        if let Some(tls) = &cfg.transfer_tls {
            // SPEC S6: peers know this engine by its certificate, so that is its id.
            let cert = tls.engine_id();
            if cfg.engine_id.is_empty() {
                cfg.engine_id = cert;
            } else if cfg.engine_id != cert {
                return Err(StartError::Config(crate::ConfigError::EngineIdNotCert { engine_id: cfg.engine_id, cert }));
            }
        }
        if cfg.engine_id.is_empty() {
            cfg.engine_id = crate::ids::random_uuid_hex();
        }
        let incarnation = cfg.incarnation.unwrap_or_else(crate::ids::random_u64) | 1;
        let peer_keys = match cfg.transfer_tls.is_some() {
            true => Some(Arc::new(kvlease_transport::auth::PeerKeys::new(&cfg.engine_id)?)),
            false => None,
        };
        let metrics = Arc::new(Metrics::default());
        let pool = BlockPool::new(cfg.num_gpu_blocks, metrics.clone());
        let (sched_tx, sched_rx) = mpsc::unbounded_channel();
        let lease_cfg = cfg.transfer.lease.clone();
        let mut holder = LeaseHolder::new(&lease_cfg, &cfg.engine_id, incarnation, cfg.model.block_size);
        if cfg.planted_bug == Some(PlantedBug::VllmLease) {
            // Simulator only (`kvlease sim`'s vLLM lease): vLLM's head-only sweep (#58222).
            holder.sweep_head_only();
        }
        // An hour from 0, moved by the test-only skew: engines' clocks never agree anyway.
        let clock_base = (3_600_000_000_000i64 + cfg.debug_clock_skew.unwrap_or(0).clamp(-3_000_000_000_000, 3_000_000_000_000)) as u64;
        let inner = Arc::new(Inner {
            incarnation,
            origin: tokio::time::Instant::now(),
            clock_base,
            metrics,
            pool,
            ranks: OnceLock::new(),
            kv_addr: OnceLock::new(),
            peer_keys,
            holder: Woken::new(holder),
            renewer: Woken::new(Renewer::new(&lease_cfg)),
            news: Notify::new(),
            read_acks: Mutex::new(BTreeMap::new()),
            // SPEC D5: its clock reads `clock_base` as it starts (`Inner::now`).
            push_source: Woken::new(PushSource::new(&lease_cfg, incarnation).started_at(kvlease_core::Nanos(clock_base))),
            push_sink: Woken::new(PushSink::new(&lease_cfg)),
            push_actions: OnceLock::new(),
            push_parked: Mutex::new(BTreeMap::new()),
            push_linked: Mutex::new(BTreeMap::new()),
            push_prefills: Mutex::new(Default::default()),
            tasks: Tasks::default(),
            cfg,
        });
        let (push_tx, push_rx) = mpsc::unbounded_channel();
        let _ = inner.push_actions.set(push_tx);
        let owner = Arc::new(Owner {
            inner: inner.clone(),
            sched: sched_tx.clone(),
            next_seq: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            stopped: watch::channel(false).0,
        });
        // From here on, a failed start stops whatever was started (the owner's drop).
        let ranks = agents::start(&inner).await?;
        let fenced = crate::pull::reads_are_fenced(&ranks);
        inner.holder.lock().set_fenced_reads(fenced);
        inner.renewer.lock().set_fenced_reads(fenced);
        // SPEC U4, U8: whether a write given up on stops (tcp, mem) or runs on (NIXL).
        let fenced_writes = crate::push::writes_are_fenced(&ranks);
        inner.push_source.lock().set_fenced_writes(fenced_writes);
        inner.push_sink.lock().set_fenced_writes(fenced_writes);
        let _ = inner.ranks.set(ranks);
        let cfg = &inner.cfg;
        let (listener, local) = Listener::bind(&cfg.transport, &cfg.host, cfg.kv_port)
            .await
            .map_err(|why| StartError::Bind { addr: format!("{}:{}", cfg.host, cfg.kv_port), why })?;
        let _ = inner.kv_addr.set(local);
        inner.tasks.spawn(handshake::serve(inner.clone(), listener));
        inner.tasks.spawn(lease_holder::reaper(inner.clone()));
        inner.tasks.spawn(renewal::run(inner.clone()));
        if cfg.transfer.push_mode() {
            inner.tasks.spawn(push::source_reaper(inner.clone()));
            inner.tasks.spawn(push::sink_driver(inner.clone()));
        }
        inner.tasks.spawn(scheduler::run(inner.clone(), sched_rx, sched_tx, push_rx, owner.stopped.clone()));
        Ok(EngineHandle { inner, owner })
    }

    /// Validates and queues a request. For a `do_remote_prefill` request the lease renewal
    /// starts here, before it waits for anything (SPEC D1).
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, RequestError> {
        let inner = &self.inner;
        if self.owner.shutting_down.load(Ordering::Relaxed) {
            return Err(RequestError::unavailable("the engine is shutting down"));
        }
        let prompt = match req.prompt {
            Prompt::Text(t) => model::tokenize(&t),
            Prompt::Tokens(t) => t,
        };
        if prompt.is_empty() {
            return Err(RequestError::bad_request(Some("prompt"), "the prompt is empty"));
        }
        if let Some(bad) = prompt.iter().find(|t| **t >= VOCAB_SIZE) {
            return Err(RequestError::bad_request(
                Some("prompt"),
                format!("token id {bad} is out of range (vocabulary size {VOCAB_SIZE})"),
            ));
        }
        if req.max_tokens == 0 {
            return Err(RequestError::bad_request(Some("max_tokens"), "max_tokens must be at least 1"));
        }
        let m = &inner.cfg.model;
        let total = prompt.len() as u64 + u64::from(req.max_tokens);
        if total > u64::from(m.max_model_len) {
            return Err(RequestError::bad_request(
                Some("max_tokens"),
                format!(
                    "prompt ({} tokens) + max_tokens ({}) exceeds the model's maximum length {}",
                    prompt.len(),
                    req.max_tokens,
                    m.max_model_len
                ),
            ));
        }
        let mut role = KvRole::parse(req.kv_transfer_params.as_ref())
            .map_err(|e| RequestError::bad_request(Some("kv_transfer_params"), e.to_string()))?;
        let blocks_needed = scheduler::blocks_needed(&role, prompt.len(), req.max_tokens, m.block_size);
        if blocks_needed > inner.pool.total() as usize {
            return Err(RequestError::bad_request(
                Some("max_tokens"),
                format!("the request needs {blocks_needed} KV blocks; this engine has {}", inner.pool.total()),
            ));
        }
        let id = self.owner.next_seq.fetch_add(1, Ordering::Relaxed);
        let internal = format!("{}#{id}", req.request_id);
        // SPEC §13: push and pull engines do not mix; each side says which it is.
        let push_mode = inner.cfg.transfer.push_mode();
        let connector = &inner.cfg.transfer.kv_connector;
        match (&role, push_mode) {
            (KvRole::DecodePush(_), false) => {
                return Err(RequestError::bad_request(
                    Some("kv_transfer_params"),
                    format!(
                        "push-mode params (transfer_mode \"push\", or no remote_block_ids) but this engine runs pull mode \
                         (kv_connector {connector:?}); run P and D with NixlPushConnector for push"
                    ),
                ))
            }
            (KvRole::DecodeRemote(_), true) => {
                return Err(RequestError::bad_request(
                    Some("kv_transfer_params"),
                    "pull-mode params (remote_block_ids of a lease) but this engine runs push mode (kv_connector \"NixlPushConnector\"); \
                     run P and D with the same kv_connector",
                ))
            }
            (KvRole::DecodePush(pr), true) if pr.pp_size != 1 => {
                return Err(RequestError::bad_request(
                    Some("kv_transfer_params"),
                    format!("pp_size {} names pipeline stages kvlease's engines do not run (pp_size must be 1)", pr.pp_size),
                ))
            }
            (KvRole::DecodePush(pr), true) => {
                if push::admit(inner, &internal, pr) {
                    tracing::debug!(request = %req.request_id, engine = %pr.engine_id, key = %pr.key, "waiting for the prefill engine's writes");
                } else {
                    tracing::warn!(request = %req.request_id, key = %pr.key, "another request here already waits for this transfer (SPEC U1); computing this prompt locally");
                    inner.metrics.recomputed_requests.inc();
                    role = KvRole::Local;
                }
            }
            _ => {}
        }
        // SPEC U1: the key P pairs a push lease by: the router's transfer id, else the request's id.
        let push_key = match (&role, push_mode) {
            (KvRole::PrefillForRemote(_), true) => {
                let transfer_id = KvRole::transfer_id(req.kv_transfer_params.as_ref())
                    .map_err(|e| RequestError::bad_request(Some("kv_transfer_params"), e.to_string()))?;
                PushKey::choose(transfer_id.as_deref(), Some(&req.request_id), None)
            }
            _ => None,
        };
        // SPEC S1, S4, O4: whether this request reads P's KV, its own engine's, or computes the
        // prompt itself — decided by the core's admission; here only what it asks done.
        let mut own_kv = None;
        if let KvRole::DecodeRemote(rk) = &role {
            let admission = inner.admission();
            let mut verdict = admission.admit(rk, &prompt);
            if verdict == Admit::Own {
                match lease_holder::take_own(inner, rk) {
                    Some(blocks) => own_kv = Some(blocks),
                    None => verdict = admission.not_read(NotRead::OwnLeaseEnded),
                }
            }
            if verdict == Admit::Pull {
                // Checked and tracked in one step, so racing replays cannot both pass.
                if inner.renewer.with(|r| r.track_first(&internal, &rk.remote(), rk.lease_id, inner.now())) {
                    tracing::debug!(request = %req.request_id, lease_id = rk.lease_id, engine = %rk.engine_id, "renewing the prefill engine's lease");
                } else {
                    verdict = admission.not_read(NotRead::Replay);
                }
            }
            match verdict {
                Admit::Pull | Admit::Own => {}
                Admit::Invalid(e) => return Err(RequestError::bad_request(Some("kv_transfer_params"), e.to_string())),
                Admit::NotRead { why, release, refuse } => {
                    if let Some(whose) = release {
                        self.forgo(rk, whose);
                    }
                    if refuse {
                        return Err(RequestError::not_its_params(format!("{why}; not reading them (kv_load_failure_policy=fail)")));
                    }
                    tracing::warn!(request = %req.request_id, "{why}; computing this prompt locally");
                    inner.metrics.recomputed_requests.inc();
                    role = KvRole::Local;
                }
            }
        }
        // Multi-turn (SPEC B2, B3, B4): the decoder's cached turn, read if it covers a prefix of
        // this prompt and will outlive the read; renewed from now until the read completes.
        let read_turn = match &role {
            KvRole::PrefillForRemote(Some(turn)) => self.plan_turn(turn, &prompt, &internal)?,
            _ => None,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let mut seq = Seq::new(id, internal.clone(), req.request_id, prompt, req.max_tokens, req.ignore_eos, req.sampling, role, tx);
        if let Some((rk, tokens)) = read_turn {
            seq = seq.read_turn(rk, tokens);
        }
        if let Some(blocks) = own_kv {
            seq = seq.own_kv(blocks);
        }
        if let Some(key) = push_key {
            seq = seq.push_key(key);
        }
        let pushed = matches!(seq.role(), KvRole::DecodePush(_));
        if self.owner.sched.send(SchedMsg::Submit(Box::new(seq))).is_err() {
            inner.renewer.lock().untrack(&internal, Untrack::Abandoned);
            if pushed {
                push::abort_sink(inner, &internal);
            }
            return Err(RequestError::unavailable("the engine has stopped"));
        }
        let abort = Abort { inner: Arc::downgrade(&self.inner), sched: self.owner.sched.clone(), id, internal };
        Ok(RequestStream { rx, abort: Some(abort), finished: false })
    }

    /// SPEC B2, B3, B4: whether this prefill reads the conversation so far from the decoder
    /// that keeps it: the blocks to read and how many tokens they cover, tracked by the renewer
    /// from now on (B3). A turn not read is recomputed; one too short to be worth reading, or not
    /// of this prompt, is released at once, as the router hands a turn's params out once.
    fn plan_turn(&self, turn: &TurnKv, prompt: &[u32], internal: &str) -> Result<Option<(RemoteKv, usize)>, RequestError> {
        let inner = &self.inner;
        let rk = &turn.kv;
        // SPEC S1: forged or altered params are refused outright; then their shape.
        let admission = inner.admission();
        admission
            .verify(rk)
            .and_then(|()| admission.fits(rk))
            .map_err(|e| RequestError::bad_request(Some("kv_transfer_params"), e.to_string()))?;
        let m = &inner.cfg.model;
        let lease = &inner.cfg.transfer.lease;
        let cached = CachedTurn {
            num_tokens: rk.num_tokens,
            digest: rk.prompt_digest,
            fields: rk.bound(),
            expiry_ns: turn.expiry_time.map(|s| (s * 1e9) as u64),
            ttl_remaining: turn.ttl_remaining.map(Duration::from_secs_f64),
        };
        let clock = inner.renewer.lock().peer(&rk.engine_id).map(|p| p.clock.clone());
        let now = inner.now();
        let plan = turn::plan(prompt, &cached, m.block_size, lease.kv_recompute_threshold, clock.as_ref(), now, now, lease.read_budget());
        let remote = rk.remote();
        match plan {
            TurnPlan::Read { tokens, blocks } if blocks as usize <= rk.block_ids.len() => {
                let mut read = rk.clone();
                read.block_ids.truncate(blocks as usize);
                inner.renewer.with(|r| r.track(internal, &remote, rk.lease_id, now));
                Ok(Some((read, tokens as usize)))
            }
            TurnPlan::Read { .. } => {
                inner.metrics.turns_recomputed.inc();
                Err(RequestError::bad_request(
                    Some("kv_transfer_params"),
                    format!("remote_block_ids names {} blocks, too few for remote_num_tokens {}", rk.block_ids.len(), rk.num_tokens),
                ))
            }
            TurnPlan::Recompute(why) => {
                tracing::info!(engine = %rk.engine_id, "not reading the cached turn ({why}); prefilling the whole prompt");
                inner.metrics.turns_recomputed.inc();
                if why.releases_turn() {
                    inner.renewer.with(|r| r.release(&remote, rk.lease_id, now));
                }
                Ok(None)
            }
        }
    }

    /// SPEC O4: this engine will not read the lease `rk` names (its params do not describe the
    /// request, S4): release it at once rather than leave it pinned until it expires.
    fn forgo(&self, rk: &RemoteKv, whose: Whose) {
        let inner = &self.inner;
        match whose {
            Whose::Ours => {
                lease_holder::release_own(inner, rk.lease_id);
            }
            Whose::Theirs => {
                inner.renewer.with(|r| r.release(&rk.remote(), rk.lease_id, inner.now()));
                tracing::info!(engine = %rk.engine_id, lease_id = rk.lease_id, "released the prefill engine's lease: its params are not read here (O4)");
            }
        }
    }

    /// The model's context length (`--max-model-len`): prompt plus generated tokens.
    pub fn max_model_len(&self) -> u32 {
        self.inner.cfg.model.max_model_len
    }

    pub fn model_name(&self) -> &str {
        &self.inner.cfg.model.name
    }

    pub fn engine_id(&self) -> &str {
        &self.inner.cfg.engine_id
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The handshake side channel's address (`remote_host`/`remote_port` in params).
    pub fn kv_addr(&self) -> SocketAddr {
        self.inner.kv_addr.get().copied().unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    pub fn is_healthy(&self) -> bool {
        !self.owner.shutting_down.load(Ordering::Relaxed) && !self.inner.tasks.is_stopped() && self.inner.ranks.get().is_some()
    }

    /// Whether P still holds lease `lease_id` (the simulator's reclaim check).
    pub fn holds_lease(&self, lease_id: u64) -> bool {
        self.inner.holder.lock().is_live(lease_id)
    }

    /// Whether P still holds a push lease under the key decode-leg `params` name (the
    /// simulator's reclaim check in push mode, where D's params name no lease id).
    pub fn holds_push_lease(&self, params: &serde_json::Value) -> bool {
        match kvlease_core::params::KvRole::parse(Some(params)) {
            Ok(kvlease_core::params::KvRole::DecodePush(pr)) => self.inner.push_source.lock().lease_of(&pr.key).is_some(),
            _ => false,
        }
    }

    /// Live leases on this engine's blocks.
    pub fn live_leases(&self) -> usize {
        lease_holder::live_leases(&self.inner)
    }

    /// Free blocks of the pool, quarantined ones not counted.
    pub fn free_blocks(&self) -> u32 {
        self.inner.pool.free()
    }

    /// Blocks of the pool.
    pub fn total_blocks(&self) -> u32 {
        self.inner.pool.total()
    }

    /// This run of the engine: leases of another incarnation are never read (SPEC §3).
    pub fn incarnation(&self) -> u64 {
        self.inner.incarnation
    }

    /// The names of the engine's transfer agents, one per rank.
    pub fn agent_names(&self) -> Vec<String> {
        self.inner.ranks().iter().map(|r| r.agent.name().to_string()).collect()
    }

    /// Graceful shutdown: refuse new requests, fail queued and running ones, release every
    /// lease as `shutdown` (P, pull and push: every D that renewed or registered a push lease is
    /// told, U6) and every renewed lease explicitly (D), then stop every task.
    pub async fn shutdown(&self) {
        if self.owner.shutting_down.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut stopped = self.owner.stopped.subscribe();
        let _ = self.owner.sched.send(SchedMsg::Shutdown);
        let _ = tokio::time::timeout(Duration::from_secs(10), stopped.wait_for(|s| *s)).await;
        lease_holder::shutdown(&self.inner);
        push::shutdown_source(&self.inner);
        renewal::release_all(&self.inner);
        // The releases go out before the process does.
        for r in self.inner.ranks() {
            r.agent.flush(Duration::from_secs(1)).await;
        }
        self.inner.tasks.stop(Duration::from_secs(1)).await;
    }

    /// Stops the engine at once, as `SIGKILL` would: no lease is released, nothing is sent;
    /// its agents and side channel go when the last handle does (the simulator's crash).
    pub fn kill(&self) {
        self.owner.shutting_down.store(true, Ordering::SeqCst);
        self.inner.tasks.abort();
    }
}

/// What dropping an unfinished [`RequestStream`] must undo.
struct Abort {
    inner: Weak<Inner>,
    sched: mpsc::UnboundedSender<SchedMsg>,
    id: u64,
    internal: String,
}

/// The events of one request. Dropping it before `Done`/`Failed` aborts the request.
pub struct RequestStream {
    rx: mpsc::UnboundedReceiver<GenerateEvent>,
    abort: Option<Abort>,
    finished: bool,
}

impl RequestStream {
    pub async fn next(&mut self) -> Option<GenerateEvent> {
        let ev = self.rx.recv().await;
        if matches!(ev, None | Some(GenerateEvent::Done { .. }) | Some(GenerateEvent::Failed(_))) {
            self.finished = true;
        }
        ev
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if let Some(Abort { inner, sched, id, internal }) = self.abort.take() {
            if let Some(inner) = inner.upgrade() {
                // SPEC D4: the lease is released now, not after the scheduler's next step.
                inner.renewer.with(|r| r.untrack(&internal, Untrack::Abandoned));
                // SPEC O4: P answered (its lease granted) but the answer was never read: nobody
                // holds its params, so the lease ends now, as a router's release would end it
                // (never one a decoder holds), not at its expiry.
                while let Ok(event) = self.rx.try_recv() {
                    if let GenerateEvent::Done { kv_transfer_params: Some(params), .. } = event {
                        let _ = crate::release::by_params(&inner, &params);
                    }
                }
            }
            let _ = sched.send(SchedMsg::Abort(id));
        }
    }
}
