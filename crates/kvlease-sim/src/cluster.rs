//! Deterministic simulation of the real engines: several P and D engines — their real
//! schedulers, lease holders, renewers, pulls and handshakes — in one thread, under virtual time
//! (a paused tokio runtime), talking over the `mem` transport with faults drawn from one seed.
//!
//! A seed decides everything: how many engines, the workload (arrivals with bursts, prompts,
//! lengths), and the faults — notifications lost, duplicated and reordered; slow reads;
//! handshakes refused or hanging; partitions and heals; D crashes; P crashes and restarts under
//! the same engine id; long forward steps. Every request is routed by the proxy's own rules
//! ([`kvlease_core::route`]: P with `do_remote_decode`, then D with P's params, O2 retries, O3/O4
//! releases, the turn cache), and the run checks:
//! * **D7**: every answer equals a local run of the same request;
//! * **P3**: every lease is released exactly once (granted = released, summed over reasons);
//! * **blocks**: every block of every engine is back in its pool at the end;
//! * **P4 reclaim**: after a D crash, P drops each lease that D held by its deadline bound —
//!   `max(grant + L, crash + delay + E)` plus the reaper's granularity;
//! * **liveness**: every request ends (answer or clean failure) within its deadline.
//!
//! The same seed gives the same trace, so a failing seed is a test kept forever:
//! `kvlease sim --cluster --seed N` replays it and prints what happened.

use crate::seeded::{Counts, Seeded};
use kvlease_core::config::{LeaseConfig, LoadFailurePolicy};
use kvlease_core::lease_table::ReleaseReason;
use kvlease_core::pull::PlantedBug;
use kvlease_core::route::{Action, Answer as RouteAnswer, Candidate, Event, Pool, Pools, PrefillAnswer, PushPeer, Route, TurnCache};
use kvlease_core::Nanos;
use kvlease_engine::{
    EngineConfig, EngineHandle, FinishReason, GenerateEvent, GenerateRequest, ModelConfig, Prompt, RequestStream, SamplingParams,
    TransportKind,
};
use kvlease_transport::mem::{Faults, MemNetwork};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// One simulated cluster and its faults, all drawn from `seed` by [`Cluster::from_seed`].
#[derive(Debug, Clone)]
pub struct Cluster {
    pub seed: u64,
    pub p_engines: usize,
    pub d_engines: usize,
    pub requests: usize,
    /// Mean arrivals per simulated second (bursts go ×5).
    pub rate: f64,
    pub lease_secs: f64,
    pub policy: LoadFailurePolicy,
    pub faults: Faults,
    /// Link cuts between a P and a D engine: (start, length) in simulated time.
    pub partitions: Vec<(Duration, Duration, usize, usize)>,
    /// D crashes (for good): (when, which D).
    pub d_crashes: Vec<(Duration, usize)>,
    /// P crashes and restarts under the same id: (when, which P, down for).
    pub p_restarts: Vec<(Duration, usize, Duration)>,
    /// Per-token emulated compute (ms): long forward steps when large.
    pub decode_ms: f64,
    /// Requests each engine runs at once (`max_num_seqs`): fewer queue longer.
    pub max_num_seqs: usize,
    pub prefill_ms: f64,
    /// A bug planted on purpose (the simulator's own tests).
    pub planted: Option<PlantedBug>,
    /// Multi-turn (SPEC B1–B4): decoders keep each turn for `turn_ttl`, conversations continue.
    pub bidirectional: bool,
    pub turn_ttl: Duration,
    /// Push mode (SPEC §13, [`crate::push_cluster`]): the engines run `NixlPushConnector` and
    /// the router sends both legs at once to a prefiller it learnt is a push engine.
    pub push_engines: bool,
    /// With `push_engines`: D's `push_registration_timeout`.
    pub push_timeout: Duration,
    /// With `push_engines`: a client's chance to leave before its answer ends (SPEC U9: D's
    /// abort must free P's lease at once), and the longest it stays.
    pub leave: (f64, Duration),
}

/// A cluster run's own counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ClusterCounts {
    /// Answered by D (from pulled KV or recomputed).
    pub answered: usize,
    /// Failed cleanly (an engine crashed under it, or `kv_load_failure_policy: fail`).
    pub failed: usize,
    pub recomputed: u64,
    /// Turns of conversations started (a single-turn request is one).
    pub turns: usize,
    /// Push mode: leases P ended as `transferred` (every write landed), and requests whose
    /// client left before the answer ended.
    pub transferred: u64,
    pub left: usize,
    /// Push mode: blocks P wrote into D's registration while its prefill computed the rest (U4).
    pub early_blocks: u64,
}

impl Counts for ClusterCounts {
    const FLAG: &'static str = "--cluster";
    fn add(&mut self, o: &Self) {
        self.answered += o.answered;
        self.failed += o.failed;
        self.recomputed += o.recomputed;
        self.turns += o.turns;
        self.transferred += o.transferred;
        self.left += o.left;
        self.early_blocks += o.early_blocks;
    }
}

/// What one run found (`requests`: the conversations).
pub type Outcome = crate::seeded::Outcome<ClusterCounts>;

/// splitmix64: the simulator's one source of randomness.
#[derive(Debug, Clone)]
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
    pub(crate) fn secs(&mut self, lo: f64, hi: f64) -> Duration {
        Duration::from_secs_f64(lo + (hi - lo) * self.unit())
    }
}

impl Cluster {
    /// A run with no fault at all: nothing lost, duplicated, cut, refused or crashed, no write
    /// failing or stalling (long forward steps, clients that leave, and messages delayed and so
    /// reordered are not faults). Push mode's runs then recompute nothing and let no lease
    /// expire — also when an answer overtakes a `PushWriteDone` P sent before it (seeds 25 and
    /// 162 found D recomputing KV written whole; P now tells a late renewal or registration of
    /// a transferred key the writes again, U5).
    pub fn fault_free(&self) -> bool {
        let f = &self.faults;
        f.loss == 0.0
            && f.duplicate == 0.0
            && f.refuse_handshake == 0.0
            && f.hang_handshake == 0.0
            && f.write_fail == 0.0
            && f.write_delay.1 <= Duration::from_millis(100)
            && self.partitions.is_empty()
            && self.d_crashes.is_empty()
            && self.p_restarts.is_empty()
    }
}

impl Seeded for Cluster {
    type Planted = PlantedBug;
    type Counts = ClusterCounts;

    /// A cluster, workload and fault plan drawn from `seed`.
    fn from_seed(seed: u64) -> Cluster {
        let mut r = Rng(seed ^ 0x5eed_cafe);
        let lease_secs = [3.0, 6.0, 30.0][r.below(3)];
        let p_engines = 1 + r.below(3);
        let d_engines = 1 + r.below(3);
        let requests = 8 + r.below(40);
        let rate = 2.0 + r.unit() * 20.0;
        let span = requests as f64 / rate;
        let noisy = r.chance(0.7);
        let faults = Faults {
            seed: r.next(),
            loss: if noisy { r.unit() * 0.1 } else { 0.0 },
            duplicate: if noisy { r.unit() * 0.1 } else { 0.0 },
            delay: (Duration::ZERO, if noisy { r.secs(0.0, 0.05) } else { Duration::ZERO }),
            read_delay: (Duration::ZERO, if r.chance(0.3) { r.secs(0.0, 0.8) } else { Duration::ZERO }),
            refuse_handshake: if r.chance(0.3) { r.unit() * 0.3 } else { 0.0 },
            hang_handshake: if r.chance(0.2) { r.unit() * 0.1 } else { 0.0 },
            unfenced: r.chance(0.3),
            ..Faults::default()
        };
        let mut partitions = Vec::new();
        for _ in 0..r.below(3) {
            partitions.push((r.secs(0.0, span + 1.0), r.secs(0.1, lease_secs * 1.5), r.below(p_engines), r.below(d_engines)));
        }
        let mut d_crashes = Vec::new();
        if d_engines > 1 && r.chance(0.3) {
            d_crashes.push((r.secs(0.0, span + 1.0), r.below(d_engines)));
        }
        let mut p_restarts = Vec::new();
        if r.chance(0.3) {
            p_restarts.push((r.secs(0.0, span + 1.0), r.below(p_engines), r.secs(0.0, 3.0)));
        }
        let slow = r.chance(0.2);
        Cluster {
            seed,
            p_engines,
            d_engines,
            requests,
            rate,
            lease_secs,
            policy: if r.chance(0.2) { LoadFailurePolicy::Fail } else { LoadFailurePolicy::Recompute },
            faults,
            partitions,
            d_crashes,
            p_restarts,
            decode_ms: if slow { r.unit() * 400.0 } else { r.unit() * 5.0 },
            max_num_seqs: 8,
            prefill_ms: r.unit() * 0.5,
            planted: None,
            bidirectional: r.chance(0.5),
            turn_ttl: r.secs(0.5, 20.0),
            push_engines: false,
            push_timeout: Duration::ZERO,
            leave: (0.0, Duration::ZERO),
        }
    }

    fn plant(&mut self, bug: Option<PlantedBug>) {
        self.planted = bug;
    }

    /// Runs the cluster to the end of its workload and checks every invariant.
    fn run(&self) -> Outcome {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build() {
            Ok(rt) => rt,
            Err(e) => return Outcome { seed: self.seed, violations: vec![format!("no runtime: {e}")], ..Outcome::default() },
        };
        rt.block_on(run(self.clone()))
    }
}

/// One request of the workload.
#[derive(Debug, Clone)]
pub(crate) struct Req {
    pub(crate) at: Duration,
    pub(crate) prompt: Vec<u32>,
    pub(crate) max_tokens: u32,
    pub(crate) ignore_eos: bool,
    /// Greedy or seeded sampling: either way the answer must equal a local run's (D7).
    pub(crate) sampling: SamplingParams,
    pub(crate) p: usize,
    pub(crate) d: usize,
    /// The user's tokens of each later turn of the conversation (multi-turn only).
    pub(crate) later: Vec<Vec<u32>>,
}

/// What a request produced: its tokens and how it finished.
pub(crate) type Answer = (Vec<u32>, Option<FinishReason>);

/// A P instance the run started (P `index`): live, its handle; crashed, what it had counted
/// when it died. A crashed instance's handle is dropped with its last clone, so its agents and
/// side channel close, as a killed process's sockets do: its peers see the link break.
struct PInstance {
    index: usize,
    live: Option<EngineHandle>,
    died_with: PCounts,
}

/// What the end-of-run checks read of a P instance.
#[derive(Debug, Clone, Copy, Default)]
struct PCounts {
    released: [u64; ReleaseReason::ALL.len()],
    early_blocks: u64,
}

impl PInstance {
    fn new(index: usize, h: &EngineHandle) -> PInstance {
        PInstance { index, live: Some(h.clone()), died_with: PCounts::default() }
    }

    fn counts(&self) -> PCounts {
        match &self.live {
            Some(h) => PCounts {
                released: ReleaseReason::ALL.map(|r| h.metrics().released(r).get()),
                early_blocks: h.metrics().push_early_blocks.get(),
            },
            None => self.died_with,
        }
    }

    /// The instance was killed: its counts are kept, its handle goes.
    fn die(&mut self) {
        self.died_with = self.counts();
        self.live = None;
    }
}

/// The shared state of a run (one thread; `Arc<Mutex>` only because tasks must be `Send`).
struct World {
    start: Instant,
    p: Vec<Option<EngineHandle>>,
    d: Vec<Option<EngineHandle>>,
    /// Every P instance ever started (restarts included), for the end-of-run checks.
    all_p: Vec<PInstance>,
    trace: Vec<String>,
    violations: Vec<String>,
    answered: usize,
    failed: usize,
    turns: usize,
    /// Leases each D holds on some P, for the reclaim check.
    held: BTreeMap<usize, Vec<Held>>,
    /// Leases the router handed to a second decoder (SPEC O2): that one renews them, so the
    /// first one's crash does not bound them. (P index, P incarnation, lease.)
    rehanded: BTreeSet<(usize, u64, String)>,
    /// When each crashed D crashed; the reclaim bound's terms: L, E plus the longest delay of a
    /// renewal, the reaper's granularity.
    crashed_at: BTreeMap<usize, Duration>,
    reclaim: (Duration, Duration, Duration),
    /// Push mode: each P's coordinates once the router learnt them from an answer (then both
    /// legs go at once, as `kvlease proxy` does); what crashed D engines had recomputed;
    /// requests whose client left.
    push_peers: Vec<Option<PushPeer>>,
    crashed_recomputed: u64,
    left: usize,
    /// The router's turn cache (SPEC B1) and its count of legs in flight on each P and D.
    turn_cache: TurnCache,
    p_busy: Vec<usize>,
    d_busy: Vec<usize>,
}

type Shared = Arc<Mutex<World>>;

/// A lease a D holds on P `pi` (incarnation `inc`), for the reclaim check: `got` is when D got
/// params P had already answered with (no earlier than the grant); `label` names the lease (its
/// id; in push mode its key); push mode's `params` name the key P holds it under.
#[derive(Debug, Clone)]
struct Held {
    pi: usize,
    inc: u64,
    id: u64,
    label: String,
    got: Duration,
    params: Option<serde_json::Value>,
}

impl Held {
    /// How [`World::rehanded`] names it: a push lease by its key alone (a decode leg's params
    /// name no incarnation; the key is one dispatch's).
    fn rehand_key(&self) -> (usize, u64, String) {
        (self.pi, if self.params.is_some() { 0 } else { self.inc }, self.label.clone())
    }
}

fn with<T>(w: &Shared, f: impl FnOnce(&mut World) -> T) -> T {
    f(&mut w.lock().unwrap_or_else(|e| e.into_inner()))
}

fn note(w: &Shared, what: String) {
    with(w, |w| {
        let t = w.start.elapsed();
        w.trace.push(format!("{:>14.9} s  {what}", t.as_secs_f64()));
    });
}

fn violation(w: &Shared, what: String) {
    note(w, format!("VIOLATION {what}"));
    with(w, |w| w.violations.push(what));
}

fn model(c: &Cluster) -> ModelConfig {
    ModelConfig {
        num_layers: 1,
        num_kv_heads: 2,
        head_dim: 4,
        dtype_bytes: 1,
        block_size: 4,
        max_model_len: 256,
        prefill_ms_per_token: c.prefill_ms,
        decode_ms_per_token: c.decode_ms,
        ..ModelConfig::default()
    }
}

fn lease(c: &Cluster) -> LeaseConfig {
    let mut l = LeaseConfig::with_lease_secs(c.lease_secs).unwrap_or_default();
    l.load_failure_policy = c.policy;
    l.bidirectional = c.bidirectional;
    l.decoder_kv_blocks_ttl = c.turn_ttl;
    l.kv_recompute_threshold = 8;
    l
}

/// Engine `name`'s config on `net`; P engines listen on a fixed port so a restart takes it over.
fn config(c: &Cluster, net: &MemNetwork, name: &str, port: u16, incarnation: u64) -> EngineConfig {
    let mut cfg = EngineConfig {
        engine_id: name.into(),
        kv_port: port,
        transport: TransportKind::Mem(net.clone()),
        num_gpu_blocks: 256,
        max_num_seqs: c.max_num_seqs,
        model: model(c),
        incarnation: Some(incarnation),
        planted_bug: c.planted,
        ..EngineConfig::default()
    };
    cfg.transfer.lease = lease(c);
    if c.push_engines {
        cfg.transfer.kv_connector = kvlease_core::config::PUSH_CONNECTOR.into();
        cfg.transfer.lease.push_registration_timeout = c.push_timeout;
    }
    cfg
}

async fn start(cfg: EngineConfig, w: &Shared) -> Option<EngineHandle> {
    let name = cfg.engine_id.clone();
    match EngineHandle::start(cfg).await {
        Ok(h) => Some(h),
        Err(e) => {
            violation(w, format!("{name} did not start: {e}"));
            None
        }
    }
}

/// Everything a request produces on one engine.
pub(crate) async fn collect(engine: &EngineHandle, req: GenerateRequest) -> Result<(Answer, Option<serde_json::Value>), String> {
    collect_timed(engine, req).await.map(|(answer, params, _)| (answer, params))
}

/// [`collect`], with when the first token came (virtual time).
pub(crate) async fn collect_timed(
    engine: &EngineHandle,
    req: GenerateRequest,
) -> Result<(Answer, Option<serde_json::Value>, Option<Instant>), String> {
    let mut stream = engine.submit(req).map_err(|e| e.message)?;
    let mut tokens = Vec::new();
    let mut first = None;
    while let Some(ev) = stream.next().await {
        match ev {
            GenerateEvent::Token { id, .. } => {
                first.get_or_insert_with(Instant::now);
                tokens.push(id)
            }
            GenerateEvent::Done { finish_reason, kv_transfer_params, .. } => {
                return Ok(((tokens, Some(finish_reason)), kv_transfer_params, first))
            }
            GenerateEvent::Failed(e) => return Err(e.message),
            GenerateEvent::Logprobs { .. } => {}
        }
    }
    Err("the engine went away".into())
}

pub(crate) fn request(id: String, r: &Req, params: serde_json::Value) -> GenerateRequest {
    GenerateRequest {
        request_id: id,
        prompt: Prompt::Tokens(r.prompt.clone()),
        max_tokens: r.max_tokens,
        ignore_eos: r.ignore_eos,
        sampling: r.sampling.clone(),
        kv_transfer_params: Some(params),
    }
}

fn workload(c: &Cluster) -> Vec<Req> {
    let mut r = Rng(c.seed ^ 0xa11_5eed);
    let mut t = 0.0;
    (0..c.requests)
        .map(|_| {
            // Bursts: one arrival in four comes at five times the rate.
            let rate = if r.chance(0.25) { c.rate * 5.0 } else { c.rate };
            t += -(1.0 - r.unit()).ln() / rate;
            let len = 1 + r.below(40);
            Req {
                at: Duration::from_secs_f64(t),
                prompt: (0..len).map(|_| 97 + r.below(26) as u32).collect(),
                max_tokens: 1 + r.below(8) as u32,
                ignore_eos: r.chance(0.5),
                sampling: if r.chance(0.5) {
                    SamplingParams {
                        temperature: 0.5 + r.unit(),
                        top_p: 0.5 + r.unit() / 2.0,
                        top_k: r.below(20) as u32,
                        seed: r.next(),
                        ..SamplingParams::default()
                    }
                } else {
                    SamplingParams::default()
                },
                p: r.below(c.p_engines),
                d: r.below(c.d_engines),
                later: if c.bidirectional {
                    (0..r.below(4)).map(|_| (0..1 + r.below(12)).map(|_| 97 + r.below(26) as u32).collect()).collect()
                } else {
                    Vec::new()
                },
            }
        })
        .collect()
}

/// The local answers to every turn of every conversation, from an engine of its own (no
/// network, no faults). Turn k+1's prompt is turn k's, its answer, and the user's next words.
async fn expected(c: &Cluster, reqs: &[Req], w: &Shared) -> Vec<Vec<Answer>> {
    let mut cfg = config(c, &MemNetwork::new(), "local", 0, 1);
    cfg.model.prefill_ms_per_token = 0.0;
    cfg.model.decode_ms_per_token = 0.0;
    cfg.planted_bug = None;
    cfg.transfer.lease.bidirectional = false;
    cfg.transfer.kv_connector = EngineConfig::default().transfer.kv_connector;
    let Some(local) = start(cfg, w).await else { return Vec::new() };
    let mut out = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        let mut turns = Vec::new();
        let mut r = r.clone();
        for k in 0..=r.later.len() {
            match collect(&local, request(format!("ref{i}.{k}"), &r, json!({}))).await {
                Ok((answer, _)) => {
                    if let Some(next) = r.later.get(k) {
                        r.prompt.extend(&answer.0);
                        r.prompt.extend(next);
                    }
                    turns.push(answer);
                }
                Err(e) => {
                    violation(w, format!("the local run of request {i} turn {k} failed: {e}"));
                    turns.push((Vec::new(), None));
                }
            }
        }
        out.push(turns);
    }
    local.shutdown().await;
    out
}

async fn run(c: Cluster) -> Outcome {
    let w: Shared = Arc::new(Mutex::new(World {
        start: Instant::now(),
        p: Vec::new(),
        d: Vec::new(),
        all_p: Vec::new(),
        trace: Vec::new(),
        violations: Vec::new(),
        answered: 0,
        failed: 0,
        turns: 0,
        held: BTreeMap::new(),
        rehanded: BTreeSet::new(),
        crashed_at: BTreeMap::new(),
        reclaim: (Duration::ZERO, Duration::ZERO, Duration::ZERO),
        push_peers: vec![None; c.p_engines],
        crashed_recomputed: 0,
        left: 0,
        turn_cache: TurnCache::default(),
        p_busy: vec![0; c.p_engines],
        d_busy: vec![0; c.d_engines],
    }));
    let reqs = workload(&c);
    let want = expected(&c, &reqs, &w).await;
    if want.len() != reqs.len() {
        return finish(&c, &w, 0);
    }
    let net = MemNetwork::new();
    net.set_faults(c.faults.clone());
    let mut rng = Rng(c.seed ^ 0x1ca4_aa7e);
    for i in 0..c.p_engines {
        let h = start(config(&c, &net, &format!("p{i}"), 5000 + i as u16, rng.next()), &w).await;
        with(&w, |w| {
            if let Some(h) = &h {
                w.all_p.push(PInstance::new(i, h));
            }
            w.p.push(h);
        });
    }
    for j in 0..c.d_engines {
        let h = start(config(&c, &net, &format!("d{j}"), 0, rng.next()), &w).await;
        with(&w, |w| w.d.push(h));
    }
    let t0 = Instant::now();
    with(&w, |w| w.start = t0);
    note(&w, format!("{c:?}"));
    let lease = lease(&c);
    // Faults, each a task of its own at its time.
    let mut faults = tokio::task::JoinSet::new();
    for &(at, len, pi, dj) in &c.partitions {
        let (w, net) = (w.clone(), net.clone());
        faults.spawn(async move {
            tokio::time::sleep_until(t0 + at).await;
            let links = links(&w, pi, dj);
            note(&w, format!("partition p{pi} | d{dj} for {:.2} s", len.as_secs_f64()));
            for (a, b) in &links {
                net.partition(a, b, true);
            }
            tokio::time::sleep(len).await;
            note(&w, format!("heal p{pi} | d{dj}"));
            for (a, b) in &links {
                net.partition(a, b, false);
            }
        });
    }
    for &(at, dj) in &c.d_crashes {
        let w = w.clone();
        // A lease's deadline is the later of its grant + L and its last renewal + E, renewals
        // being applied when they reach P (up to the largest delay after D sent them); the
        // reaper drops it within its granularity after.
        let (renewed, tick) = (lease.extension + c.faults.delay.1, lease.reap_granularity() + Duration::from_millis(1));
        with(&w, |w| w.reclaim = (lease.lease_duration, renewed, tick));
        faults.spawn(async move {
            tokio::time::sleep_until(t0 + at).await;
            let Some(d) = with(&w, |w| w.d.get_mut(dj).and_then(Option::take)) else { return };
            note(&w, format!("crash d{dj}"));
            d.kill();
            let crash = t0.elapsed();
            let held = with(&w, |w| {
                w.crashed_recomputed += d.metrics().recomputed_requests.get();
                w.crashed_at.insert(dj, crash);
                w.held.remove(&dj).unwrap_or_default()
            });
            drop(d);
            reclaim(w, dj, crash, held).await;
        });
    }
    for &(at, pi, down) in &c.p_restarts {
        let (w, net, c2) = (w.clone(), net.clone(), c.clone());
        let inc = rng.next();
        faults.spawn(async move {
            tokio::time::sleep_until(t0 + at).await;
            let Some(p) = with(&w, |w| w.p.get_mut(pi).and_then(Option::take)) else { return };
            note(&w, format!("crash p{pi}; back in {:.2} s", down.as_secs_f64()));
            p.kill();
            with(&w, |w| w.all_p.iter_mut().filter(|x| x.index == pi).for_each(PInstance::die));
            drop(p);
            tokio::time::sleep(down).await;
            let h = start(config(&c2, &net, &format!("p{pi}"), 5000 + pi as u16, inc), &w).await;
            note(&w, format!("p{pi} restarted"));
            with(&w, |w| {
                if let Some(h) = &h {
                    w.all_p.push(PInstance::new(pi, h));
                }
                w.p[pi] = h;
            });
        });
    }
    // The workload: each request a task, routed by the proxy's route machine.
    let mut clients = tokio::task::JoinSet::new();
    let limit =
        lease.lease_duration * 4 + Duration::from_secs(60) + Duration::from_secs_f64(c.decode_ms * 0.01 * 256.0) + c.push_timeout * 2;
    let leaves = leaves(&c, &reqs);
    for (i, (r, want)) in reqs.iter().cloned().zip(want).enumerate() {
        let (w, c, leave) = (w.clone(), c.clone(), leaves[i].map(|after| t0 + r.at + after));
        clients.spawn(async move {
            tokio::time::sleep_until(t0 + r.at).await;
            if tokio::time::timeout(limit, client(&w, &c, i, &r, want, leave)).await.is_err() {
                violation(&w, format!("liveness: request {i} did not end within {limit:?}"));
            }
        });
    }
    while clients.join_next().await.is_some() {}
    faults.abort_all();
    while faults.join_next().await.is_some() {}
    let busy = t0.elapsed();
    // Quiesce: past every lease, quarantine and back-off.
    tokio::time::sleep(lease.lease_duration.max(c.turn_ttl) + lease.quarantine() + c.push_timeout + Duration::from_secs(12)).await;
    check_quiescent(&w).await;
    if c.push_engines {
        check_push(&c, &w, net.writes_landed());
    }
    finish(&c, &w, busy.as_nanos() as u64)
}

/// SPEC P4 reclaim: every lease crashed D `dj` held is gone from its P by
/// `max(grant + L, crash + delay + E)` plus the reaper's granularity.
async fn reclaim(w: Shared, dj: usize, crash: Duration, held: Vec<Held>) {
    let (t0, (l, renewed, tick)) = with(&w, |w| (w.start, w.reclaim));
    let mut checks: Vec<(Duration, Held)> = held.into_iter().map(|h| ((h.got + l).max(crash + renewed) + tick, h)).collect();
    checks.sort_by_key(|a| (a.0, a.1.pi, a.1.inc, a.1.id));
    for (by, h) in checks {
        tokio::time::sleep_until(t0 + by).await;
        let still = with(&w, |w| {
            !w.rehanded.contains(&h.rehand_key())
                && w.all_p.iter().filter(|x| x.index == h.pi).filter_map(|x| x.live.as_ref()).any(|p| {
                    p.incarnation() == h.inc
                        && match &h.params {
                            Some(v) => p.holds_push_lease(v),
                            None => p.holds_lease(h.id),
                        }
                })
        });
        if still {
            violation(&w, format!("P4: p{} still holds lease {} of crashed d{dj} at {:.3} s", h.pi, h.label, by.as_secs_f64()));
        }
    }
}

/// D `dj` got lease `h`: it bounds its reclaim from now, or at once if D crashed already.
fn hand(w: &Shared, dj: usize, h: Held) {
    let crashed = with(w, |w| match w.crashed_at.get(&dj) {
        Some(&at) => Some(at),
        None => {
            w.held.entry(dj).or_default().push(h.clone());
            None
        }
    });
    if let Some(at) = crashed {
        tokio::spawn(reclaim(w.clone(), dj, at, vec![h]));
    }
}

/// Push mode: when each request's client leaves, after its arrival (`None`: it stays).
fn leaves(c: &Cluster, reqs: &[Req]) -> Vec<Option<Duration>> {
    let mut r = Rng(c.seed ^ 0x001e_a7e5);
    reqs.iter().map(|_| (c.push_engines && r.chance(c.leave.0)).then(|| r.secs(0.0, c.leave.1.as_secs_f64()))).collect()
}

/// The agent links between P `pi` and D `dj` as they are now.
fn links(w: &Shared, pi: usize, dj: usize) -> Vec<(String, String)> {
    with(w, |w| {
        let (Some(Some(p)), Some(Some(d))) = (w.p.get(pi), w.d.get(dj)) else { return Vec::new() };
        vec![(p.agent_names()[0].clone(), d.agent_names()[0].clone())]
    })
}

/// One conversation, as the routing proxy runs it ([`kvlease_core::route`]): each turn P (with
/// the conversation's cached decoder turn when there is one, SPEC B4), then D; every answer
/// checked against the local run (D7).
async fn client(w: &Shared, c: &Cluster, i: usize, r: &Req, want: Vec<Answer>, leave: Option<Instant>) {
    let mut r = r.clone();
    for (k, want) in want.into_iter().enumerate() {
        if !one_turn(w, c, i, k, &r, &want, leave).await {
            return;
        }
        let Some(next) = r.later.get(k).cloned() else { return };
        r.prompt.extend(&want.0);
        r.prompt.extend(next);
    }
}

/// An engine of the cluster, as the route machine names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    P(usize),
    D(usize),
}

/// Simulated time as the core takes it.
fn now(w: &Shared) -> Nanos {
    with(w, |w| Nanos(u64::try_from(w.start.elapsed().as_nanos()).unwrap_or(u64::MAX)))
}

/// The engines as the router sees them now: the live ones healthy, with their legs outstanding.
/// `push`: which of them the router knows to be push engines.
fn candidates(
    engines: &[Option<EngineHandle>],
    busy: &[usize],
    name: fn(usize) -> Engine,
    push: &[Option<PushPeer>],
) -> Vec<Candidate<Engine>> {
    engines
        .iter()
        .enumerate()
        .map(|(i, h)| Candidate {
            upstream: name(i),
            healthy: h.is_some(),
            outstanding: busy.get(i).copied().unwrap_or(0),
            push: push.get(i).is_some_and(Option::is_some),
        })
        .collect()
}

/// One turn, driven by the route machine; `false` if the conversation ends here (it failed
/// cleanly, its client left, or a violation). In push mode the legs go as `kvlease proxy`
/// sends them: the first request to a prefiller one after the other (P's answer teaches the
/// router its coordinates), later ones both at once (SPEC §13, U1, U2).
async fn one_turn(w: &Shared, c: &Cluster, i: usize, k: usize, r: &Req, want: &Answer, leave: Option<Instant>) -> bool {
    with(w, |w| w.turns += 1);
    let id = format!("req{i}.{k}");
    let t = now(w);
    let mut route: Route<Engine, String> = with(w, |w| Route::new(Some(format!("c{i}")), false, &mut w.turn_cache, t));
    route.planted = c.planted;
    // P's params (in push mode: the decode leg's, naming the transfer's key); what the client
    // got (relayed from every decoder that answered); D's stream.
    let mut params = serde_json::Value::Null;
    let mut got: Answer = (Vec::new(), None);
    let mut stream: Option<(usize, RequestStream)> = None;
    // Push mode: the prefill leg out (P's answer to come), whether it went with the decode leg
    // (both at once), whether P answered with its params, the decoder holding the decode leg
    // while P has not answered yet, and the dispatches made.
    let mut p_leg: Option<(usize, PrefillLeg)> = None;
    let (mut both, mut p_answered, mut waiting_d, mut dispatches) = (false, false, None::<usize>, 0);
    loop {
        let action = with(w, |w| {
            let (pc, dc) = (candidates(&w.p, &w.p_busy, Engine::P, &w.push_peers), candidates(&w.d, &w.d_busy, Engine::D, &[]));
            // Ties start at the workload's engines, so the seeded spread stays.
            route.poll(Pools { prefill: Pool { candidates: &pc, start: r.p }, decode: Pool { candidates: &dc, start: r.d } })
        });
        let Some(action) = action else {
            // Push mode: waiting for P's answer (or the client's leaving).
            if let Some((pi, mut task)) = p_leg.take() {
                let answer = tokio::select! {
                    biased;
                    a = &mut task => a,
                    _ = until(leave) => {
                        task.abort();
                        return left(w, &mut route, &params, &mut stream, i, k);
                    }
                };
                let (event, answered) =
                    answer.unwrap_or_else(|_| (Event::PrefillFailed(format!("p{pi}'s leg went away")), serde_json::Value::Null));
                if let Some(peer) = PushPeer::from_answer(&answered) {
                    with(w, |w| w.push_peers[pi] = Some(peer));
                }
                if matches!(event, Event::PrefillAnswered(PrefillAnswer::Params { .. })) {
                    p_answered = true;
                    if both {
                        // The lease was granted before P answered: the decoder holding the
                        // decode leg bounds its reclaim from now.
                        if let Some(dj) = waiting_d.take() {
                            hand(w, dj, held(pi, &answered, &params, w));
                        }
                    } else {
                        params = answered;
                    }
                }
                if let Err(e) = route.handle(event) {
                    violation(w, format!("req {i}.{k}: {e}"));
                    return false;
                }
                continue;
            }
            if !route.is_done() {
                violation(w, format!("req {i}.{k}: the route stalled"));
                return false;
            }
            break;
        };
        let event = match action {
            Action::SendPrefill { to: Engine::P(pi), turn, retry } => {
                if retry {
                    note(w, format!("req {i}.{k}: prefill leg retried on p{pi}"));
                }
                let p_params = turn.unwrap_or_else(|| json!({"do_remote_decode": true}));
                if c.push_engines {
                    (both, p_answered, waiting_d) = (false, false, None);
                    p_leg = Some((pi, spawn_prefill(w, pi, request(id.clone(), r, p_params))));
                    continue;
                }
                prefill(w, pi, request(id.clone(), r, p_params), &mut params).await
            }
            // SPEC §13, U1, U2: both legs at once, paired by a transfer id of this dispatch.
            Action::SendBoth { prefill: Engine::P(pi), decode: Engine::D(dj), retry } => {
                let Some(peer) = with(w, |w| w.push_peers[pi].clone()) else {
                    violation(w, format!("req {i}.{k}: both legs to p{pi}, whose coordinates the router never learnt"));
                    return false;
                };
                dispatches += 1;
                let transfer_id = format!("sim-{i}.{k}.{dispatches}");
                params = peer.decode_params(&transfer_id);
                note(w, format!("req {i}.{k}: both legs, p{pi} and d{dj}, transfer {transfer_id}{}", if retry { " (retry)" } else { "" }));
                (both, p_answered) = (true, false);
                p_leg = Some((pi, spawn_prefill(w, pi, request(id.clone(), r, PushPeer::prefill_params(&transfer_id)))));
                let event = send_decode(w, i, k, dj, request(id.clone(), r, params.clone()), &mut stream);
                waiting_d = stream.as_ref().map(|(dj, _)| *dj);
                event
            }
            Action::SendDecode { to: Engine::D(dj), retry } => {
                let Some(Engine::P(pi)) = route.prefiller().copied() else {
                    violation(w, format!("req {i}.{k}: a decode leg with no prefiller"));
                    return false;
                };
                let lease_id = params.get("remote_lease_id").and_then(|v| v.as_u64()).unwrap_or(0);
                let inc = params.get("remote_incarnation").and_then(|v| v.as_str()?.parse().ok()).unwrap_or(0);
                note(w, format!("req {i}.{k}: p{pi} lease {lease_id} → d{dj}{}", if retry { " (retry)" } else { "" }));
                if with(w, |w| w.d.get(dj).is_some_and(Option::is_some)) {
                    let h = match c.push_engines {
                        true => held(pi, &params, &params, w),
                        false => {
                            Held { pi, inc, id: lease_id, label: lease_id.to_string(), got: with(w, |w| w.start.elapsed()), params: None }
                        }
                    };
                    if retry {
                        with(w, |w| w.rehanded.insert(h.rehand_key()));
                    }
                    if p_answered || !c.push_engines {
                        hand(w, dj, h);
                    }
                }
                let event = send_decode(w, i, k, dj, request(id.clone(), r, params.clone()), &mut stream);
                if c.push_engines && !p_answered {
                    waiting_d = stream.as_ref().map(|(dj, _)| *dj);
                }
                event
            }
            // SPEC U9: the decode leg dropped; D aborts it and releases P's lease itself.
            Action::CancelDecode => {
                if let Some((dj, s)) = stream.take() {
                    note(w, format!("req {i}.{k}: decode leg on d{dj} dropped"));
                    drop(s);
                    with(w, |w| w.d_busy[dj] -= 1);
                }
                waiting_d = None;
                continue;
            }
            Action::RelayStream => match stream.take() {
                Some((dj, s)) => match relay(w, &mut route, dj, s, &mut got, leave).await {
                    Some(event) => event,
                    None => return left(w, &mut route, &params, &mut stream, i, k),
                },
                None => {
                    violation(w, format!("req {i}.{k}: nothing to relay"));
                    return false;
                }
            },
            Action::Release { on: Engine::P(pi) } => {
                let released = with(w, |w| w.p.get(pi).cloned().flatten()).map(|p| p.release_by_params(&params));
                note(w, format!("req {i}.{k}: released the lease on p{pi}: {released:?}"));
                continue;
            }
            Action::GiveBack { conversation, turn } => {
                with(w, |w| w.turn_cache.give_back(conversation, turn));
                continue;
            }
            Action::KeepTurn { conversation, params } => {
                let t = now(w);
                let kept = with(w, |w| w.turn_cache.keep(conversation, params, t));
                note(w, format!("req {i}.{k}: turn {}", if kept { "kept" } else { "not kept (too short a TTL)" }));
                continue;
            }
            Action::RelayWhole { .. } | Action::Fail { .. } => {
                note(w, format!("req {i}.{k}: failed: {action:?}"));
                with(w, |w| w.failed += 1);
                if let Some((pi, task)) = p_leg.take() {
                    violation(w, format!("req {i}.{k}: the route ended with p{pi}'s leg still out"));
                    task.abort();
                }
                return false;
            }
            other => {
                violation(w, format!("req {i}.{k}: the route asked for {other:?}"));
                return false;
            }
        };
        if let Err(e) = route.handle(event) {
            violation(w, format!("req {i}.{k}: {e}"));
            return false;
        }
    }
    if got == *want {
        note(w, format!("req {i}.{k}: answered ({} tokens)", got.0.len()));
        with(w, |w| w.answered += 1);
        true
    } else {
        violation(w, format!("D7: req {i}.{k}: the client got {got:?}; a local run answers {want:?}"));
        false
    }
}

/// Sleeps until `at`; never, without one.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Push mode: the lease P `pi` granted under the key `params` name (for the reclaim check),
/// its incarnation from P's own answer `answered`.
fn held(pi: usize, answered: &serde_json::Value, params: &serde_json::Value, w: &Shared) -> Held {
    let inc = answered.get("remote_incarnation").and_then(|v| v.as_str()?.parse().ok()).unwrap_or(0);
    let label = ["transfer_id", "remote_request_id", "remote_lease_id"]
        .iter()
        .find_map(|k| params.get(*k).map(|v| v.to_string()))
        .unwrap_or_default();
    Held { pi, inc, id: 0, label, got: with(w, |w| w.start.elapsed()), params: Some(params.clone()) }
}

/// The decode leg to D `dj`: its stream into `stream` if D took it.
fn send_decode(
    w: &Shared,
    i: usize,
    k: usize,
    dj: usize,
    req: GenerateRequest,
    stream: &mut Option<(usize, RequestStream)>,
) -> Event<String> {
    let Some(d) = with(w, |w| w.d.get(dj).cloned().flatten()) else { return Event::DecodeFailed(format!("d{dj} is down")) };
    match d.submit(req) {
        Ok(s) => {
            with(w, |w| w.d_busy[dj] += 1);
            *stream = Some((dj, s));
            Event::DecodeAnswered(RouteAnswer::Success)
        }
        Err(e) => {
            note(w, format!("req {i}.{k}: d{dj} refused: {}", e.message));
            Event::DecodeAnswered(RouteAnswer::Refused)
        }
    }
}

/// Push mode: a prefill leg out in the background; its event and P's params to come.
type PrefillLeg = tokio::task::JoinHandle<(Event<String>, serde_json::Value)>;

/// Push mode: the prefill leg on P `pi` in the background; its event and P's params.
fn spawn_prefill(w: &Shared, pi: usize, req: GenerateRequest) -> PrefillLeg {
    let w = w.clone();
    tokio::spawn(async move {
        let mut params = serde_json::Value::Null;
        let event = prefill(&w, pi, req, &mut params).await;
        (event, params)
    })
}

/// The client left (SPEC U9, D4): the route is told and carries out what it asks (a release
/// of P's lease while no decoder holds it); the legs out are dropped, so each engine aborts.
fn left(
    w: &Shared,
    route: &mut Route<Engine, String>,
    params: &serde_json::Value,
    stream: &mut Option<(usize, RequestStream)>,
    i: usize,
    k: usize,
) -> bool {
    note(w, format!("req {i}.{k}: the client left"));
    if let Some((dj, s)) = stream.take() {
        drop(s);
        with(w, |w| w.d_busy[dj] -= 1);
    }
    if let Err(e) = route.handle(Event::ClientGone) {
        violation(w, format!("req {i}.{k}: {e}"));
    }
    while let Some(action) = route.poll(Pools::EMPTY) {
        match action {
            Action::Release { on: Engine::P(pi) } => {
                let released = with(w, |w| w.p.get(pi).cloned().flatten()).map(|p| p.release_by_params(params));
                note(w, format!("req {i}.{k}: released the lease on p{pi}: {released:?}"));
            }
            Action::GiveBack { conversation, turn } => with(w, |w| w.turn_cache.give_back(conversation, turn)),
            other => violation(w, format!("req {i}.{k}: the route asked for {other:?} after the client left")),
        }
    }
    with(w, |w| w.left += 1);
    false
}

/// The prefill leg on P `pi`: its params into `params`. An engine that is down or went away
/// mid-request never answered (a retry may go elsewhere); one that failed the request answered
/// an error.
async fn prefill(w: &Shared, pi: usize, req: GenerateRequest, params: &mut serde_json::Value) -> Event<String> {
    let Some(p) = with(w, |w| w.p.get(pi).cloned().flatten()) else {
        return Event::PrefillFailed(format!("p{pi} is down"));
    };
    let mut s = match p.submit(req) {
        Ok(s) => s,
        Err(e) => {
            note(w, format!("p{pi} refused: {}", e.message));
            return Event::PrefillAnswered(PrefillAnswer::Other(RouteAnswer::Refused));
        }
    };
    with(w, |w| w.p_busy[pi] += 1);
    let event = loop {
        match s.next().await {
            Some(GenerateEvent::Done { kv_transfer_params: Some(p), .. }) => {
                *params = p;
                break Event::PrefillAnswered(PrefillAnswer::Params { lease: params.is_object() });
            }
            Some(GenerateEvent::Done { kv_transfer_params: None, .. }) => {
                violation(w, format!("p{pi} answered without kv_transfer_params"));
                break Event::PrefillAnswered(PrefillAnswer::Unreadable(format!("p{pi} named no params")));
            }
            Some(GenerateEvent::Failed(e)) => {
                note(w, format!("p{pi} failed: {}", e.message));
                break Event::PrefillAnswered(PrefillAnswer::Other(RouteAnswer::Refused));
            }
            Some(_) => {}
            None => break Event::PrefillFailed(format!("p{pi} went away")),
        }
    };
    with(w, |w| w.p_busy[pi] -= 1);
    event
}

/// D `dj`'s answer relayed to the client (`got`) as it streams, the route told of its first
/// byte; the event that ends it, or `None` if the client left first (at `leave`).
async fn relay(
    w: &Shared,
    route: &mut Route<Engine, String>,
    dj: usize,
    mut s: RequestStream,
    got: &mut Answer,
    leave: Option<Instant>,
) -> Option<Event<String>> {
    let event = loop {
        let next = tokio::select! {
            biased;
            ev = s.next() => ev,
            _ = until(leave) => {
                with(w, |w| w.d_busy[dj] -= 1);
                return None;
            }
        };
        match next {
            Some(GenerateEvent::Token { id, .. }) => {
                if got.0.is_empty() {
                    let _ = route.handle(Event::FirstByteRelayed);
                }
                got.0.push(id);
            }
            Some(GenerateEvent::Done { finish_reason, kv_transfer_params, .. }) => {
                got.1 = Some(finish_reason);
                break Event::DecodeDone { turn: kv_transfer_params };
            }
            Some(GenerateEvent::Failed(e)) => break Event::DecodeFailed(format!("d{dj} failed: {}", e.message)),
            Some(GenerateEvent::Logprobs { .. }) => {}
            None => break Event::DecodeFailed(format!("d{dj} went away")),
        }
    };
    with(w, |w| w.d_busy[dj] -= 1);
    if let Event::DecodeFailed(why) = &event {
        note(w, why.clone());
    }
    Some(event)
}

/// The end of the run: no lease left, every lease released once, every block back.
async fn check_quiescent(w: &Shared) {
    let engines: Vec<(String, EngineHandle)> = with(w, |w| {
        let ps = w.all_p.iter().filter_map(|x| x.live.as_ref().map(|h| (format!("p{}", x.index), h.clone())));
        let ds = w.d.iter().enumerate().filter_map(|(j, h)| h.clone().map(|h| (format!("d{j}"), h)));
        ps.chain(ds).collect()
    });
    for (name, e) in engines {
        let m = e.metrics();
        let granted = m.leases_granted.get();
        let released: u64 = m.leases_released.iter().map(|c| c.get()).sum();
        if e.live_leases() != 0 {
            violation(w, format!("P4: {name} still holds {} leases at the end", e.live_leases()));
        }
        if granted != released {
            violation(w, format!("P3: {name} granted {granted} leases and released {released}"));
        }
        if e.free_blocks() != e.total_blocks() {
            violation(w, format!("blocks: {name} has {} of {} blocks free at the end", e.free_blocks(), e.total_blocks()));
        }
    }
}

/// Push mode's own checks at the end of a run.
/// * **U5, P3**: a lease ends as `transferred` only when its writes landed: no more leases
///   ended so on all P than writes that landed whole on the network (`landed`);
/// * **nothing recomputed without a fault** (D7, U10): in a run with no fault, no request is
///   recomputed;
/// * **U2, U9** (vLLM #53095, #46283): in a run with no fault, no lease expires on P — D's
///   renewals keep every lease it waits on, and every request D gives up (its client left)
///   releases P's lease at once.
fn check_push(c: &Cluster, w: &Shared, landed: u64) {
    let (transferred, expired, recomputed) =
        with(w, |w| (released(w, ReleaseReason::Transferred), released(w, ReleaseReason::Expired), recomputed(w)));
    if transferred > landed {
        violation(w, format!("U5: P ended {transferred} leases as transferred, but only {landed} writes landed whole"));
    }
    if c.fault_free() {
        if recomputed > 0 {
            violation(w, format!("D7/U10: {recomputed} requests recomputed in a run with no fault"));
        }
        if expired > 0 {
            violation(w, format!("U2/U9: {expired} leases expired on P in a run with no fault (not renewed while D waited, or not released when D gave up)"));
        }
    }
}

/// Leases every P (every incarnation) ended for `reason`.
fn released(w: &World, reason: ReleaseReason) -> u64 {
    w.all_p.iter().map(|x| x.counts().released[reason as usize]).sum()
}

/// Requests recomputed on every D, crashed ones included.
fn recomputed(w: &World) -> u64 {
    w.d.iter().flatten().map(|d| d.metrics().recomputed_requests.get()).sum::<u64>() + w.crashed_recomputed
}

fn finish(c: &Cluster, w: &Shared, simulated: u64) -> Outcome {
    with(w, |w| {
        let recomputed = recomputed(w);
        let transferred = released(w, ReleaseReason::Transferred);
        let early_blocks = w.all_p.iter().map(|x| x.counts().early_blocks).sum();
        Outcome {
            seed: c.seed,
            requests: c.requests,
            counts: ClusterCounts {
                answered: w.answered,
                failed: w.failed,
                recomputed,
                turns: w.turns,
                transferred,
                left: w.left,
                early_blocks,
            },
            violations: std::mem::take(&mut w.violations),
            trace: std::mem::take(&mut w.trace),
            simulated: Duration::from_nanos(simulated),
        }
    })
}
