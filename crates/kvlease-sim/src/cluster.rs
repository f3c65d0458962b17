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
use kvlease_core::pull::PlantedBug;
use kvlease_core::route::{Action, Answer as RouteAnswer, Candidate, Event, Pool, Pools, PrefillAnswer, Route, TurnCache};
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
    pub prefill_ms: f64,
    /// A bug planted on purpose (the simulator's own tests).
    pub planted: Option<PlantedBug>,
    /// Multi-turn (SPEC B1–B4): decoders keep each turn for `turn_ttl`, conversations continue.
    pub bidirectional: bool,
    pub turn_ttl: Duration,
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
}

impl Counts for ClusterCounts {
    const FLAG: &'static str = "--cluster";
    fn add(&mut self, o: &Self) {
        self.answered += o.answered;
        self.failed += o.failed;
        self.recomputed += o.recomputed;
        self.turns += o.turns;
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
            prefill_ms: r.unit() * 0.5,
            planted: None,
            bidirectional: r.chance(0.5),
            turn_ttl: r.secs(0.5, 20.0),
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

/// The shared state of a run (one thread; `Arc<Mutex>` only because tasks must be `Send`).
struct World {
    start: Instant,
    p: Vec<Option<EngineHandle>>,
    d: Vec<Option<EngineHandle>>,
    /// Every P instance ever started (restarts included), for the end-of-run checks.
    all_p: Vec<(usize, EngineHandle, bool)>,
    trace: Vec<String>,
    violations: Vec<String>,
    answered: usize,
    failed: usize,
    turns: usize,
    /// Leases each D holds on some P, for the reclaim check: (P index, P incarnation, lease id,
    /// when D got the params).
    held: BTreeMap<usize, Vec<(usize, u64, u64, Duration)>>,
    /// Leases the router handed to a second decoder (SPEC O2): that one renews them, so the
    /// first one's crash does not bound them.
    rehanded: BTreeSet<(usize, u64, u64)>,
    /// The router's turn cache (SPEC B1) and its count of legs in flight on each P and D.
    turn_cache: TurnCache,
    p_busy: Vec<usize>,
    d_busy: Vec<usize>,
}

type Shared = Arc<Mutex<World>>;

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
        max_num_seqs: 8,
        model: model(c),
        incarnation: Some(incarnation),
        planted_bug: c.planted,
        ..EngineConfig::default()
    };
    cfg.transfer.lease = lease(c);
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
                w.all_p.push((i, h.clone(), true));
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
        let l = lease.lease_duration;
        faults.spawn(async move {
            tokio::time::sleep_until(t0 + at).await;
            let Some(d) = with(&w, |w| w.d.get_mut(dj).and_then(Option::take)) else { return };
            note(&w, format!("crash d{dj}"));
            d.kill();
            drop(d);
            // P4 reclaim: every lease d held is gone by max(grant + L, crash + delay + E) + tick.
            let crash = t0.elapsed();
            let held = with(&w, |w| w.held.remove(&dj).unwrap_or_default());
            let mut checks: Vec<(Duration, usize, u64, u64)> =
                held.into_iter().map(|(pi, inc, id, got)| ((got + l).max(crash + renewed) + tick, pi, inc, id)).collect();
            checks.sort();
            for (by, pi, inc, id) in checks {
                tokio::time::sleep_until(t0 + by).await;
                let still = with(&w, |w| {
                    !w.rehanded.contains(&(pi, inc, id))
                        && w.all_p.iter().any(|(i, h, alive)| *i == pi && *alive && h.incarnation() == inc && h.holds_lease(id))
                });
                if still {
                    violation(&w, format!("P4: p{pi} still holds lease {id} of crashed d{dj} at {:.3} s", by.as_secs_f64()));
                }
            }
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
            with(&w, |w| w.all_p.iter_mut().filter(|(i, _, _)| *i == pi).for_each(|e| e.2 = false));
            drop(p);
            tokio::time::sleep(down).await;
            let h = start(config(&c2, &net, &format!("p{pi}"), 5000 + pi as u16, inc), &w).await;
            note(&w, format!("p{pi} restarted"));
            with(&w, |w| {
                if let Some(h) = &h {
                    w.all_p.push((pi, h.clone(), true));
                }
                w.p[pi] = h;
            });
        });
    }
    // The workload: each request a task, routed by the proxy's route machine.
    let mut clients = tokio::task::JoinSet::new();
    let limit = lease.lease_duration * 4 + Duration::from_secs(60) + Duration::from_secs_f64(c.decode_ms * 0.01 * 256.0);
    for (i, (r, want)) in reqs.iter().cloned().zip(want).enumerate() {
        let (w, c) = (w.clone(), c.clone());
        clients.spawn(async move {
            tokio::time::sleep_until(t0 + r.at).await;
            if tokio::time::timeout(limit, client(&w, &c, i, &r, want)).await.is_err() {
                violation(&w, format!("liveness: request {i} did not end within {limit:?}"));
            }
        });
    }
    while clients.join_next().await.is_some() {}
    faults.abort_all();
    while faults.join_next().await.is_some() {}
    let busy = t0.elapsed();
    // Quiesce: past every lease, quarantine and back-off.
    tokio::time::sleep(lease.lease_duration.max(c.turn_ttl) + lease.quarantine() + Duration::from_secs(12)).await;
    check_quiescent(&w).await;
    finish(&c, &w, busy.as_nanos() as u64)
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
async fn client(w: &Shared, c: &Cluster, i: usize, r: &Req, want: Vec<Answer>) {
    let mut r = r.clone();
    for (k, want) in want.into_iter().enumerate() {
        if !one_turn(w, c, i, k, &r, &want).await {
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
fn candidates(engines: &[Option<EngineHandle>], busy: &[usize], name: fn(usize) -> Engine) -> Vec<Candidate<Engine>> {
    engines
        .iter()
        .enumerate()
        .map(|(i, h)| Candidate { upstream: name(i), healthy: h.is_some(), outstanding: busy.get(i).copied().unwrap_or(0), push: false })
        .collect()
}

/// One turn, driven by the route machine; `false` if the conversation ends here (it failed
/// cleanly, or a violation).
async fn one_turn(w: &Shared, c: &Cluster, i: usize, k: usize, r: &Req, want: &Answer) -> bool {
    with(w, |w| w.turns += 1);
    let id = format!("req{i}.{k}");
    let t = now(w);
    let mut route: Route<Engine, String> = with(w, |w| Route::new(Some(format!("c{i}")), false, &mut w.turn_cache, t));
    route.planted = c.planted;
    // P's params; what the client got (relayed from every decoder that answered); D's stream.
    let mut params = serde_json::Value::Null;
    let mut got: Answer = (Vec::new(), None);
    let mut stream: Option<(usize, RequestStream)> = None;
    loop {
        let action = with(w, |w| {
            let (pc, dc) = (candidates(&w.p, &w.p_busy, Engine::P), candidates(&w.d, &w.d_busy, Engine::D));
            // Ties start at the workload's engines, so the seeded spread stays.
            route.poll(Pools { prefill: Pool { candidates: &pc, start: r.p }, decode: Pool { candidates: &dc, start: r.d } })
        });
        let Some(action) = action else {
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
                prefill(w, pi, request(id.clone(), r, p_params), &mut params).await
            }
            Action::SendDecode { to: Engine::D(dj), retry } => {
                let Some(Engine::P(pi)) = route.prefiller().copied() else {
                    violation(w, format!("req {i}.{k}: a decode leg with no prefiller"));
                    return false;
                };
                let lease_id = params.get("remote_lease_id").and_then(|v| v.as_u64()).unwrap_or(0);
                let inc = params.get("remote_incarnation").and_then(|v| v.as_str()?.parse().ok()).unwrap_or(0);
                note(w, format!("req {i}.{k}: p{pi} lease {lease_id} → d{dj}{}", if retry { " (retry)" } else { "" }));
                match with(w, |w| w.d.get(dj).cloned().flatten()) {
                    None => Event::DecodeFailed(format!("d{dj} is down")),
                    Some(d) => {
                        with(w, |w| {
                            let got = w.start.elapsed();
                            w.held.entry(dj).or_default().push((pi, inc, lease_id, got));
                            if retry {
                                w.rehanded.insert((pi, inc, lease_id));
                            }
                        });
                        match d.submit(request(id.clone(), r, params.clone())) {
                            Ok(s) => {
                                with(w, |w| w.d_busy[dj] += 1);
                                stream = Some((dj, s));
                                Event::DecodeAnswered(RouteAnswer::Success)
                            }
                            Err(e) => {
                                note(w, format!("req {i}.{k}: d{dj} refused: {}", e.message));
                                Event::DecodeAnswered(RouteAnswer::Refused)
                            }
                        }
                    }
                }
            }
            Action::RelayStream => match stream.take() {
                Some((dj, s)) => relay(w, &mut route, dj, s, &mut got).await,
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
/// byte; the event that ends it.
async fn relay(w: &Shared, route: &mut Route<Engine, String>, dj: usize, mut s: RequestStream, got: &mut Answer) -> Event<String> {
    let event = loop {
        match s.next().await {
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
    event
}

/// The end of the run: no lease left, every lease released once, every block back.
async fn check_quiescent(w: &Shared) {
    let engines: Vec<(String, EngineHandle)> = with(w, |w| {
        let ps = w.all_p.iter().filter(|(_, _, alive)| *alive).map(|(i, h, _)| (format!("p{i}"), h.clone()));
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

fn finish(c: &Cluster, w: &Shared, simulated: u64) -> Outcome {
    with(w, |w| {
        let recomputed = w.d.iter().flatten().map(|d| d.metrics().recomputed_requests.get()).sum();
        Outcome {
            seed: c.seed,
            requests: c.requests,
            counts: ClusterCounts { answered: w.answered, failed: w.failed, recomputed, turns: w.turns },
            violations: std::mem::take(&mut w.violations),
            trace: std::mem::take(&mut w.trace),
            simulated: Duration::from_nanos(simulated),
        }
    })
}
