//! kvlease-sim: deterministic simulation of kvlease's real engines under virtual time.
//!
//! * [`cluster`]: several P and D engines — the real schedulers, lease holders, renewers, pulls
//!   and handshakes — with seeded faults, every invariant checked (`kvlease sim --cluster`).
//! * [`connector`]: the vLLM connector's protocol path — P's `IssuedLeases` and `Issuer`, D's
//!   `Renewer` and `Pull`, wired as `python/kvlease/vllm.py` wires them — under seeded faults,
//!   checked for P5/D6, P2, P3, P4, S5, held messages and liveness (`kvlease sim --connector`).
//! * [`push`]: push mode's core machines (P's `PushSource`, D's `PushSink`) with block memory
//!   modelled, under seeded faults; checked for U2–U10, U12, P3, P4, and vLLM's four push
//!   bugs planted and found (`kvlease sim --push`).
//! * [`seeded`]: what those three share — a run's [`seeded::Outcome`], the loop over seeds
//!   ([`seeded::run_seeds`], [`seeded::search`]), the report of a run, and the event queue of
//!   the discrete-event ones.
//! * [`simulate`]: the policies of SPEC §1 side by side on the same seeded workload, on the same
//!   real engines: `fixed` — P holds blocks until the read or a single timeout (vLLM's old 480 s,
//!   or a short one), D never renews and reads whenever it gets to the request, with reads that,
//!   as NIXL's do, land whatever P did with the blocks meanwhile (vLLM #21570: garbage with
//!   HTTP 200); `vLLM lease` — vLLM's lease as vLLM implements it: D's heartbeats renew P's
//!   leases, but P's expiry sweep is head-only in grant order (vLLM #58222: an expired lease
//!   behind a renewed one waits) and D reads whatever is in the blocks, with no lease-lost
//!   answer acted on and no confirmation; `lease` — kvlease: a short lease, heartbeats from
//!   arrival, acknowledged reads, recompute on a lost lease (`kvlease sim`).
//!
//! Everything is deterministic: the same seed gives the same result, so a failing seed is a
//! test that can be replayed forever.

pub mod cluster;
pub mod connector;
pub mod heartbeat;
pub mod push;
pub mod push_cluster;
pub mod seeded;

use cluster::{collect, collect_timed, request, Answer, Req};
use kvlease_core::config::LeaseConfig;
use kvlease_core::pull::PlantedBug;
use kvlease_engine::{EngineConfig, EngineHandle, ModelConfig, TransportKind};
use kvlease_transport::mem::{Faults, MemNetwork};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// How P keeps blocks for D.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// A single timeout of this many seconds; no renewal; D reads without checking.
    Fixed(f64),
    /// vLLM's lease as vLLM implements it: renewed by heartbeats, but swept head-only in grant
    /// order (vLLM #58222) and read unfenced, with no lease-lost verdict (a planted behaviour
    /// of the engines, simulator only: [`PlantedBug::VllmLease`]).
    VllmLease(f64),
    /// kvlease: a lease of this many seconds, renewed by heartbeats, reads acknowledged.
    Lease(f64),
}

impl Policy {
    pub fn name(&self) -> String {
        match self {
            Policy::Fixed(s) => format!("fixed {s} s"),
            Policy::VllmLease(s) => format!("vLLM lease {s} s"),
            Policy::Lease(s) => format!("lease {s} s"),
        }
    }
}

/// The workload and the faults.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub seed: u64,
    /// Simulated time.
    pub duration: Duration,
    /// Requests per second reaching P (Poisson).
    pub rate: f64,
    /// During `surge`, the rate is multiplied by `surge_factor`.
    pub surge: Option<(Duration, Duration)>,
    pub surge_factor: f64,
    /// KV blocks per request.
    pub blocks: u32,
    /// D's concurrent decode slots and decode time per request.
    pub d_slots: usize,
    pub decode_time: Duration,
    /// One-way network delay and the chance a message is lost.
    pub delay: Duration,
    pub loss: f64,
    /// When D (the first decoder, d0) crashes: it stops everything, for good; no new work is
    /// routed to it.
    pub d_crash: Option<Duration>,
    /// When D stops being heard by P, and for how long (a stalled process, a link flap): every
    /// message between them is lost meanwhile; D keeps its queue.
    pub d_pause: Option<(Duration, Duration)>,
    /// Prefill engines; requests go to them round-robin.
    pub prefills: usize,
    /// Decode engines; the first is the one that crashes (`d_crash`); after the crash the
    /// router sends the others everything.
    pub decoders: usize,
    /// How the router picks a decoder.
    pub routing: Routing,
}

/// How the router picks a decoder for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Routing {
    /// In turn, skipping a crashed decoder.
    #[default]
    RoundRobin,
    /// The live decoder with the fewest requests routed to it and not finished (ties in turn).
    LeastLoaded,
}

impl Scenario {
    /// When requests stop arriving: at the end, or, with a single decoder, at its crash (the
    /// router then has nowhere to send them).
    pub fn arrivals_until(&self) -> Duration {
        if self.decoders > 1 {
            self.duration
        } else {
            self.d_crash.unwrap_or(self.duration).min(self.duration)
        }
    }

    /// The most requests the run may bring, as if it surged throughout: P's pool is sized for
    /// all of them (the simulator never turns a request away).
    pub fn most_requests(&self) -> f64 {
        self.rate * self.surge_factor * self.arrivals_until().as_secs_f64()
    }

    /// Blocks of each P's pool: room for every request the run may bring, and one more; `None`
    /// when that is more than a pool counts (a u32).
    pub fn p_blocks(&self) -> Option<u32> {
        let most = self.most_requests();
        if !(most.is_finite() && most < f64::from(u32::MAX)) {
            return None;
        }
        (most as u32).checked_add(1)?.checked_mul(self.blocks).map(|b| b.max(self.blocks))
    }
}

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            seed: 1,
            duration: Duration::from_secs(600),
            rate: 4.0,
            surge: Some((Duration::from_secs(100), Duration::from_secs(160))),
            surge_factor: 3.0,
            blocks: 64,
            d_slots: 4,
            decode_time: Duration::from_millis(900),
            delay: Duration::from_millis(1),
            loss: 0.01,
            d_crash: Some(Duration::from_secs(400)),
            d_pause: None,
            prefills: 1,
            decoders: 1,
            routing: Routing::RoundRobin,
        }
    }
}

/// What happened under one policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    pub policy: String,
    pub arrived: u64,
    /// Decoded from KV that was live when read.
    pub served: u64,
    /// Decoded from KV read after P had freed (and possibly reused) it: an answer that differs
    /// from a local run's.
    pub garbage: u64,
    /// D found the lease lost, or its transfer failed, and computed the prompt itself.
    pub recomputed: u64,
    /// Block-seconds P kept pinned after D had crashed: memory held for nobody.
    pub dead_block_seconds: f64,
    /// Seconds after D's crash until P held no lease.
    pub reclaim_after_crash: Option<f64>,
    pub peak_leased_blocks: u64,
    /// Time to first token, arrival at P to D's first token, of requests D answered (s).
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    /// Heartbeat messages D sent (the price of a short lease).
    pub heartbeats: u64,
    /// Leases D found lost when it came to read them: KV P freed under a request that still
    /// wanted it, while D was alive (each a prefill wasted). A fixed timeout never checks: its
    /// premature frees are garbage instead.
    pub premature_frees: u64,
    /// KV blocks pinned on the P engines, sampled once per simulated second (for a chart).
    pub pinned: Vec<u64>,
    /// Why the run could not take place (an engine did not start: e.g. a rate so high that P's
    /// pool, sized for every request, does not fit); every figure above is then empty.
    pub failed: Option<String>,
}

/// Tokens per block of the simulated model; a request generates this many tokens.
const BLOCK_SIZE: u32 = 4;
const GENERATED: u32 = 8;

fn engine_config(sc: &Scenario, policy: Policy, net: &MemNetwork, name: &str, port: u16, blocks: u32, slots: usize) -> EngineConfig {
    let secs = match policy {
        Policy::Fixed(s) | Policy::VllmLease(s) | Policy::Lease(s) => s,
    };
    let prompt = sc.blocks * BLOCK_SIZE;
    let mut cfg = EngineConfig {
        engine_id: name.into(),
        kv_port: port,
        transport: TransportKind::Mem(net.clone()),
        num_gpu_blocks: blocks,
        max_num_seqs: slots,
        model: ModelConfig {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 4,
            dtype_bytes: 1,
            block_size: BLOCK_SIZE,
            max_model_len: prompt + GENERATED + BLOCK_SIZE,
            prefill_ms_per_token: 0.0,
            // A decode step per generated token: the request's decode time in all.
            decode_ms_per_token: sc.decode_time.as_secs_f64() * 1e3 / f64::from(GENERATED),
            ..ModelConfig::default()
        },
        incarnation: Some(sc.seed.wrapping_mul(2).wrapping_add(u64::from(port))),
        planted_bug: match policy {
            Policy::Fixed(_) => Some(PlantedBug::FixedTimeout),
            Policy::VllmLease(_) => Some(PlantedBug::VllmLease),
            Policy::Lease(_) => None,
        },
        ..EngineConfig::default()
    };
    let mut lease = LeaseConfig::with_lease_secs(secs).unwrap_or_default();
    if let Policy::Fixed(_) = policy {
        // One timeout, never extended (nothing renews anyway).
        lease.max_lifetime = Some(lease.lease_duration);
    }
    cfg.transfer.lease = lease;
    cfg
}

/// Runs one policy on a scenario, on the real engines (`prefills` P, `decoders` D; one of each
/// by default), under virtual time.
pub fn simulate(sc: &Scenario, policy: Policy) -> Report {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build() {
        Ok(rt) => rt,
        Err(e) => return Report { policy: policy.name(), failed: Some(format!("cannot start the runtime: {e}")), ..Report::default() },
    };
    rt.block_on(run(sc.clone(), policy))
}

#[derive(Default)]
struct Tally {
    arrived: u64,
    correct: u64,
    garbage: u64,
    /// Seconds from arrival to D's first token, per answered request.
    ttft: Vec<f64>,
}

/// The `q` quantile of `xs` (nearest rank), 0 when empty.
fn quantile(xs: &mut [f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let i = ((xs.len() as f64 * q).ceil() as usize).clamp(1, xs.len()) - 1;
    xs[i]
}

/// The blocks a lease's KV params name (`remote_block_ids`, flat or one list per KV group).
fn param_blocks(v: &serde_json::Value) -> u64 {
    match v {
        serde_json::Value::Array(xs) => xs.iter().map(param_blocks).sum(),
        serde_json::Value::Number(_) => 1,
        _ => 0,
    }
}

/// D's counters that the report sums over decoders.
fn d_counters(d: &EngineHandle) -> [u64; 3] {
    let m = d.metrics();
    [m.recomputed_requests.get(), m.heartbeats_sent.get(), m.lease_ended_by_prefill.get()]
}

async fn run(sc: Scenario, policy: Policy) -> Report {
    let mut report = Report { policy: policy.name(), ..Report::default() };
    let (n_p, n_d) = (sc.prefills.max(1), sc.decoders.max(1));
    let net = MemNetwork::new();
    net.set_faults(Faults { seed: sc.seed, loss: sc.loss, delay: (sc.delay, sc.delay), unfenced: true, ..Faults::default() });
    // Each P has room for every request of the run; each D for its slots.
    let stop_arrivals = sc.arrivals_until();
    // (The pool and the arena take memory only for blocks used.)
    let Some(p_blocks) = sc.p_blocks() else {
        let why = format!("P's pool cannot hold the {:.0} requests this traffic may bring", sc.most_requests());
        return Report { failed: Some(why), ..report };
    };
    let d_blocks = (sc.d_slots as u32 + 1) * (sc.blocks + GENERATED.div_ceil(BLOCK_SIZE) + 1);
    // The local reference: same model, no compute time (answers do not depend on it).
    let mut local_cfg = engine_config(&sc, Policy::Lease(30.0), &MemNetwork::new(), "local", 0, 64 * (sc.blocks + 4), 64);
    local_cfg.model.decode_ms_per_token = 0.0;
    let local = match EngineHandle::start(EngineConfig { planted_bug: None, ..local_cfg }).await {
        Ok(e) => e,
        Err(e) => return Report { failed: Some(format!("the reference engine did not start: {e}")), ..report },
    };
    // The first P and D keep the names and ports of the one-P-one-D runs: same seed, same table.
    let mut ps = Vec::new();
    for i in 0..n_p {
        let (name, port) = if i == 0 { ("p".to_string(), 5000) } else { (format!("p{i}"), 5100 + i as u16) };
        match EngineHandle::start(engine_config(&sc, policy, &net, &name, port, p_blocks, 64)).await {
            Ok(p) => ps.push(p),
            Err(e) => return Report { failed: Some(format!("{name} did not start: {e}")), ..report },
        }
    }
    let mut ds = Vec::new();
    for j in 0..n_d {
        let (name, port) = if j == 0 { ("d".to_string(), 5001) } else { (format!("d{j}"), 5200 + j as u16) };
        match EngineHandle::start(engine_config(&sc, policy, &net, &name, port, d_blocks, sc.d_slots)).await {
            Ok(d) => ds.push(Some(d)),
            Err(e) => return Report { failed: Some(format!("{name} did not start: {e}")), ..report },
        }
    }
    let ps = Arc::new(ps);
    let t0 = Instant::now();
    let tally = Arc::new(Mutex::new(Tally::default()));
    // Decoders by index; the crashed one (d0) is taken out.
    let d_slots = Arc::new(Mutex::new(ds));
    // Requests routed to each decoder and not finished (least-loaded routing).
    let load = Arc::new(Mutex::new(vec![0usize; n_d]));
    // Leases P granted for requests routed to the decoder that crashes: (P, lease, blocks).
    let doomed: Arc<Mutex<Vec<(usize, u64, u64)>>> = Arc::new(Mutex::new(Vec::new()));
    let mut rng = cluster::Rng(sc.seed ^ 0x9e37_79b9_7f4a_7c15);
    let (routing, crashes) = (sc.routing, sc.d_crash.is_some());
    // Each request is drawn and its client started when it arrives, so a run holds only the
    // requests in flight, never all those still to come.
    let (ps2, d_slots2, local2, tally2, load2, doomed2) =
        (ps.clone(), d_slots.clone(), local.clone(), tally.clone(), load.clone(), doomed.clone());
    let arrivals = tokio::spawn(async move {
        let (ps, d_slots, local, tally, load, doomed) = (ps2, d_slots2, local2, tally2, load2, doomed2);
        let mut clients = tokio::task::JoinSet::new();
        let mut t = Duration::ZERO;
        let mut n = 0u64;
        loop {
            let surging = sc.surge.is_some_and(|(a, b)| t >= a && t < b);
            let rate = sc.rate * if surging { sc.surge_factor } else { 1.0 };
            t += Duration::from_secs_f64(-(1.0 - rng.unit()).ln() / rate);
            if t >= stop_arrivals {
                break;
            }
            n += 1;
            let r = Req {
                at: t,
                prompt: (0..sc.blocks * BLOCK_SIZE).map(|_| 97 + rng.below(26) as u32).collect(),
                max_tokens: GENERATED,
                ignore_eos: true,
                sampling: kvlease_engine::SamplingParams::default(),
                p: 0,
                d: 0,
                later: Vec::new(),
            };
            tokio::time::sleep_until(t0 + r.at).await;
            while clients.try_join_next().is_some() {}
            let (ps, d_slots, local, tally, load, doomed) =
                (ps.clone(), d_slots.clone(), local.clone(), tally.clone(), load.clone(), doomed.clone());
            clients.spawn(async move {
                tally.lock().unwrap_or_else(|e| e.into_inner()).arrived += 1;
                // The router: P round-robin; D round-robin or least-loaded among those alive.
                let p_idx = (n as usize - 1) % ps.len();
                let p = &ps[p_idx];
                let j = {
                    let alive = d_slots.lock().unwrap_or_else(|e| e.into_inner()).iter().map(Option::is_some).collect::<Vec<_>>();
                    let mut load = load.lock().unwrap_or_else(|e| e.into_inner());
                    let first = (n as usize - 1) % n_d;
                    let pick = match routing {
                        Routing::RoundRobin => (0..n_d).map(|k| (first + k) % n_d).find(|&k| alive[k]),
                        Routing::LeastLoaded => (0..n_d).map(|k| (first + k) % n_d).filter(|&k| alive[k]).min_by_key(|&k| load[k]),
                    };
                    // A single decoder that crashed: the request still reaches P (as before the
                    // router learns of it) and its lease is dead weight.
                    let j = pick.unwrap_or(0);
                    load[j] += 1;
                    j
                };
                let _done = Unload(load, j);
                let Ok((_, Some(params))) = collect(p, request(format!("r{n}"), &r, json!({"do_remote_decode": true}))).await else {
                    return;
                };
                if j == 0 && crashes {
                    let id = params.get("remote_lease_id").and_then(|v| v.as_u64()).unwrap_or(0);
                    let blocks = params.get("remote_block_ids").map_or(0, param_blocks);
                    doomed.lock().unwrap_or_else(|e| e.into_inner()).push((p_idx, id, blocks));
                }
                let Some(d) = d_slots.lock().unwrap_or_else(|e| e.into_inner())[j].clone() else { return };
                let Ok((got, _, first)) = collect_timed(&d, request(format!("r{n}"), &r, params)).await else { return };
                drop(d);
                let ttft = first.map(|f| (f - (t0 + r.at)).as_secs_f64());
                let want: Answer = match collect(&local, request(format!("l{n}"), &r, json!({}))).await {
                    Ok((a, _)) => a,
                    Err(_) => return,
                };
                let mut t = tally.lock().unwrap_or_else(|e| e.into_inner());
                t.ttft.extend(ttft);
                if got == want {
                    t.correct += 1;
                } else {
                    t.garbage += 1;
                }
            });
        }
        // Every client kept running to its end (dropping the set would abort them).
        while clients.join_next().await.is_some() {}
    });
    // The pause: every link between the P and D engines' agents cut, then healed.
    if let Some((at, len)) = sc.d_pause {
        let links: Vec<(String, String)> = {
            let ds = d_slots.lock().unwrap_or_else(|e| e.into_inner());
            let d_agents: Vec<String> = ds.iter().flatten().flat_map(|d| d.agent_names()).collect();
            ps.iter().flat_map(|p| p.agent_names()).flat_map(|a| d_agents.iter().map(move |b| (a.clone(), b.clone()))).collect()
        };
        let net = net.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(t0 + at).await;
            links.iter().for_each(|(a, b)| net.partition(a, b, true));
            tokio::time::sleep(len).await;
            links.iter().for_each(|(a, b)| net.partition(a, b, false));
        });
    }
    // Sample P's pinned blocks every 100 ms; crash D when due.
    let step = Duration::from_millis(100);
    let mut crashed_at: Option<Duration> = None;
    let mut counters = [0u64; 3];
    let mut now = Duration::ZERO;
    while now < sc.duration {
        tokio::time::sleep_until(t0 + now).await;
        if let Some(c) = sc.d_crash.filter(|c| crashed_at.is_none() && now >= *c) {
            if let Some(d) = d_slots.lock().unwrap_or_else(|e| e.into_inner())[0].take() {
                counters = d_counters(&d);
                d.kill();
            }
            crashed_at = Some(c);
        }
        let blocks: u64 = ps.iter().map(|p| p.metrics().leased_blocks.get().max(0) as u64).sum();
        report.peak_leased_blocks = report.peak_leased_blocks.max(blocks);
        if now.subsec_nanos() == 0 {
            report.pinned.push(blocks);
        }
        if let Some(c) = crashed_at {
            // Blocks P still pins for the crashed decoder (a released lease never comes back).
            let mut doomed = doomed.lock().unwrap_or_else(|e| e.into_inner());
            doomed.retain(|(p, id, _)| ps[*p].holds_lease(*id));
            let dead: u64 = doomed.iter().map(|(_, _, b)| b).sum();
            report.dead_block_seconds += dead as f64 * step.as_secs_f64();
            if doomed.is_empty() && report.reclaim_after_crash.is_none() {
                report.reclaim_after_crash = Some((now - c).as_secs_f64());
            }
        }
        now += step;
    }
    arrivals.abort();
    let mut tally = tally.lock().unwrap_or_else(|e| e.into_inner());
    // Requests D decoded from its own recompute are counted there; the rest were pulled.
    for d in d_slots.lock().unwrap_or_else(|e| e.into_inner()).iter().flatten() {
        counters.iter_mut().zip(d_counters(d)).for_each(|(a, b)| *a += b);
    }
    [report.recomputed, report.heartbeats, report.premature_frees] = counters;
    report.ttft_p50 = quantile(&mut tally.ttft, 0.5);
    report.ttft_p99 = quantile(&mut tally.ttft, 0.99);
    report.arrived = tally.arrived;
    report.garbage = tally.garbage;
    report.served = tally.correct.saturating_sub(report.recomputed);
    report
}

/// Takes a finished (or abandoned) request off its decoder's load.
struct Unload(Arc<Mutex<Vec<usize>>>, usize);

impl Drop for Unload {
    fn drop(&mut self) {
        let mut load = self.0.lock().unwrap_or_else(|e| e.into_inner());
        load[self.1] = load[self.1].saturating_sub(1);
    }
}
