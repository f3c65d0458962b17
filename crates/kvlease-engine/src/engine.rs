//! The engine's shared state and its public handle: start-up (agents, side channel, tasks),
//! request submission and validation, abort on drop, graceful shutdown.

use crate::connector::{self, Lease};
use crate::kv_params::KvRole;
use crate::metrics::Metrics;
use crate::model::{self, VOCAB_SIZE};
use crate::pool::BlockPool;
use crate::scheduler::{self, SchedMsg, Seq};
use crate::{EngineConfig, GenerateEvent, GenerateRequest, Prompt, RequestError, StartError};
use kvlease_core::config::LoadFailurePolicy;
use kvlease_core::lease_table::LeaseTable;
use kvlease_core::renewer::{Remote, Renewer, Untrack};
use kvlease_core::Nanos;
use kvlease_transport::{Agent, BlockArena};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;
use tokio::sync::{mpsc, watch, Notify};

/// Locks a mutex, riding over poisoning: every critical section leaves its state consistent.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One rank: its shard of the heads, its memory, its agent.
pub(crate) struct Rank {
    pub heads: Range<u32>,
    pub arena: Arc<BlockArena>,
    pub agent: Arc<dyn Agent>,
}

/// A P engine this engine has handshaken with (D side).
#[derive(Debug, Clone)]
pub(crate) struct Peer {
    /// The incarnation these agents belong to: a lease of another is never read from them.
    pub incarnation: u64,
    /// Agent names, one per P rank, in rank order.
    pub agents: Vec<String>,
}

pub(crate) struct Inner {
    pub cfg: EngineConfig,
    pub incarnation: u64,
    pub origin: Instant,
    pub metrics: Arc<Metrics>,
    pub pool: Arc<BlockPool>,
    pub ranks: OnceLock<Vec<Rank>>,
    pub kv_addr: OnceLock<SocketAddr>,
    /// P: leases on our blocks.
    pub leases: Mutex<LeaseTable<Lease>>,
    /// D: renewals of leases on remote blocks.
    pub renewer: Mutex<Renewer>,
    pub renewer_wake: Arc<Notify>,
    /// Bumped on every acknowledgement or lost lease, for tasks waiting to read.
    pub news: watch::Sender<u64>,
    pub peers: Mutex<HashMap<String, Peer>>,
    /// Agent name → the engine id it belongs to (D: routing P's answers to the renewer).
    pub agent_engines: Mutex<HashMap<String, String>>,
    /// D: waiters for `ReadDoneAck`, by (our rank, P agent, lease id).
    pub read_acks: Mutex<HashMap<(usize, String, u64), tokio::sync::oneshot::Sender<bool>>>,
    pub sched: mpsc::UnboundedSender<SchedMsg>,
    pub next_seq: AtomicU64,
    pub shutting_down: AtomicBool,
    pub stopped: watch::Sender<bool>,
}

impl Inner {
    pub fn now(&self) -> Nanos {
        Nanos(self.origin.elapsed().as_nanos() as u64)
    }

    pub fn ranks(&self) -> &[Rank] {
        self.ranks.get().map(Vec::as_slice).unwrap_or(&[])
    }

    /// Heads per rank on this engine.
    pub fn heads_per_rank(&self) -> u32 {
        self.cfg.model.num_kv_heads / self.cfg.tp_size
    }

    pub fn bump_news(&self) {
        self.news.send_modify(|n| *n += 1);
    }
}

/// A running engine; cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
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
        if cfg.transfer.lease.bidirectional {
            return Err(StartError::Config(
                "kv_connector_extra_config.bidirectional_kv_xfer: bidirectional (multi-turn) KV transfer is not implemented yet; remove it or set it to false".into(),
            ));
        }
        if cfg.max_num_seqs == 0 {
            return Err(StartError::Config("--max-num-seqs must be at least 1".into()));
        }
        if cfg.engine_id.is_empty() {
            cfg.engine_id = random_hex(16);
        }
        let incarnation = random_u64() | 1;
        let metrics = Arc::new(Metrics::default());
        let pool = BlockPool::new(cfg.num_gpu_blocks, metrics.clone());
        let (sched_tx, sched_rx) = mpsc::unbounded_channel();
        let lease_cfg = cfg.transfer.lease.clone();
        let inner = Arc::new(Inner {
            incarnation,
            origin: Instant::now(),
            metrics,
            pool,
            ranks: OnceLock::new(),
            kv_addr: OnceLock::new(),
            leases: Mutex::new(LeaseTable::new(&lease_cfg)),
            renewer: Mutex::new(Renewer::new(&lease_cfg)),
            renewer_wake: Arc::new(Notify::new()),
            news: watch::channel(0).0,
            peers: Mutex::new(HashMap::new()),
            agent_engines: Mutex::new(HashMap::new()),
            read_acks: Mutex::new(HashMap::new()),
            sched: sched_tx,
            next_seq: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            stopped: watch::channel(false).0,
            cfg,
        });
        connector::start(&inner).await?;
        tokio::spawn(scheduler::run(inner.clone(), sched_rx));
        Ok(EngineHandle { inner })
    }

    /// Validates and queues a request. For a `do_remote_prefill` request the lease renewal
    /// starts here, before it waits for anything (SPEC D1).
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestStream, RequestError> {
        let inner = &self.inner;
        if inner.shutting_down.load(Ordering::Relaxed) {
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
        if let KvRole::DecodeRemote(rk) = &role {
            // SPEC S1 first: forged or altered params are refused outright.
            if let Some(secret) = &inner.cfg.secret {
                rk.verify(secret).map_err(|e| RequestError::bad_request(Some("kv_transfer_params"), e.to_string()))?;
            }
            // SPEC S4: genuine params of another prompt (a router that mixed requests up) are
            // never read.
            if !rk.describes(&prompt) {
                if inner.cfg.transfer.lease.load_failure_policy == LoadFailurePolicy::Fail {
                    return Err(RequestError::bad_request(
                        Some("kv_transfer_params"),
                        "kv_transfer_params belong to another prompt (kvlease_prompt_digest does not match this prompt); not reading them (kv_load_failure_policy=fail)",
                    ));
                }
                tracing::warn!(
                    request = %req.request_id,
                    "kv_transfer_params belong to another prompt (kvlease_prompt_digest does not match); computing this prompt locally"
                );
                inner.metrics.recomputed_requests.fetch_add(1, Ordering::Relaxed);
                role = KvRole::Local;
            }
        }
        let blocks_needed = scheduler::blocks_needed(&role, prompt.len(), req.max_tokens, m.block_size);
        if blocks_needed > inner.pool.total() as usize {
            return Err(RequestError::bad_request(
                Some("max_tokens"),
                format!("the request needs {blocks_needed} KV blocks; this engine has {}", inner.pool.total()),
            ));
        }
        let id = inner.next_seq.fetch_add(1, Ordering::Relaxed);
        let internal = format!("{}#{id}", req.request_id);
        if let KvRole::DecodeRemote(rk) = &role {
            // `describes` held: the prompt has `remote_num_tokens` tokens.
            let want_blocks = prompt.len().div_ceil(m.block_size as usize);
            if rk.block_ids.len() != want_blocks {
                return Err(RequestError::bad_request(
                    Some("kv_transfer_params"),
                    format!(
                        "kv_transfer_params name {} blocks; this prompt of {} tokens fills {} blocks of {}",
                        rk.block_ids.len(),
                        prompt.len(),
                        want_blocks,
                        m.block_size
                    ),
                ));
            }
            if rk.tp_size == 0 || !m.num_kv_heads.is_multiple_of(rk.tp_size) {
                return Err(RequestError::bad_request(
                    Some("kv_transfer_params"),
                    format!("tp_size {} does not divide {} KV heads", rk.tp_size, m.num_kv_heads),
                ));
            }
            let remote = Remote { engine_id: rk.engine_id.clone(), host: rk.host.clone(), port: rk.port, incarnation: rk.incarnation };
            lock(&inner.renewer).track(&internal, &remote, rk.lease_id, inner.now());
            inner.renewer_wake.notify_one();
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let seq = Seq::new(id, internal.clone(), req.request_id, prompt, req.max_tokens, req.ignore_eos, req.sampling, role, tx);
        if inner.sched.send(SchedMsg::Submit(Box::new(seq))).is_err() {
            lock(&inner.renewer).untrack(&internal, Untrack::Abandoned);
            return Err(RequestError::unavailable("the engine has stopped"));
        }
        Ok(RequestStream { rx, abort: Some((Arc::downgrade(&self.inner), id, internal)), finished: false })
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
        !self.inner.shutting_down.load(Ordering::Relaxed) && self.inner.ranks.get().is_some()
    }

    /// Graceful shutdown: refuse new requests, fail queued and running ones, release every
    /// lease as `shutdown` (P) and every renewed lease explicitly (D).
    pub async fn shutdown(&self) {
        if self.inner.shutting_down.swap(true, Ordering::SeqCst) {
            return;
        }
        let mut stopped = self.inner.stopped.subscribe();
        let _ = self.inner.sched.send(SchedMsg::Shutdown);
        let _ = tokio::time::timeout(std::time::Duration::from_secs(10), stopped.wait_for(|s| *s)).await;
        connector::shutdown(&self.inner).await;
    }
}

/// The events of one request. Dropping it before `Done`/`Failed` aborts the request.
pub struct RequestStream {
    rx: mpsc::UnboundedReceiver<GenerateEvent>,
    abort: Option<(std::sync::Weak<Inner>, u64, String)>,
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
        if let Some((inner, id, internal)) = self.abort.take() {
            if let Some(inner) = inner.upgrade() {
                // SPEC D4: the lease is released now, not after the scheduler's next step.
                lock(&inner.renewer).untrack(&internal, Untrack::Abandoned);
                inner.renewer_wake.notify_one();
                let _ = inner.sched.send(SchedMsg::Abort(id));
            }
        }
    }
}

pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos() ^ u128::from(std::process::id()));
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    h.finish()
}

pub(crate) fn random_hex(bytes: usize) -> String {
    let mut s = String::new();
    while s.len() < bytes * 2 {
        s.push_str(&format!("{:016x}", random_u64()));
    }
    s.truncate(bytes * 2);
    s
}
