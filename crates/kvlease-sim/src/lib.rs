//! kvlease-sim: deterministic simulation of kvlease's real engines under virtual time.
//!
//! * [`cluster`]: several P and D engines — the real schedulers, lease holders, renewers, pulls
//!   and handshakes — with seeded faults, every invariant checked (`kvlease sim --cluster`).
//! * [`simulate`]: the policies of SPEC §1 side by side on the same seeded workload, on the same
//!   real engines: `fixed` — P holds blocks until the read or a single timeout (vLLM's old 480 s,
//!   or a short one), D never renews and reads whenever it gets to the request, with reads that,
//!   as NIXL's do, land whatever P did with the blocks meanwhile (vLLM #21570: garbage with
//!   HTTP 200); `lease` — kvlease: a short lease, heartbeats from arrival, acknowledged reads,
//!   recompute on a lost lease (`kvlease sim`).
//!
//! Everything is deterministic: the same seed gives the same result, so a failing seed is a
//! test that can be replayed forever.

pub mod cluster;

use cluster::{collect, collect_timed, request, Answer, Req};
use kvlease_core::config::LeaseConfig;
use kvlease_core::pull::PlantedBug;
use kvlease_engine::{EngineConfig, EngineHandle, ModelConfig, TransportKind};
use kvlease_transport::mem::{Faults, MemNetwork};
use serde_json::json;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// How P keeps blocks for D.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// A single timeout of this many seconds; no renewal; D reads without checking.
    Fixed(f64),
    /// kvlease: a lease of this many seconds, renewed by heartbeats, reads acknowledged.
    Lease(f64),
}

impl Policy {
    pub fn name(&self) -> String {
        match self {
            Policy::Fixed(s) => format!("fixed {s} s"),
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
    /// When D crashes (it stops everything, for good; no new work is routed to it).
    pub d_crash: Option<Duration>,
    /// When D stops being heard by P, and for how long (a stalled process, a link flap): every
    /// message between them is lost meanwhile; D keeps its queue.
    pub d_pause: Option<(Duration, Duration)>,
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
}

/// Tokens per block of the simulated model; a request generates this many tokens.
const BLOCK_SIZE: u32 = 4;
const GENERATED: u32 = 8;

fn engine_config(sc: &Scenario, policy: Policy, net: &MemNetwork, name: &str, port: u16, blocks: u32, slots: usize) -> EngineConfig {
    let secs = match policy {
        Policy::Fixed(s) | Policy::Lease(s) => s,
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
        planted_bug: matches!(policy, Policy::Fixed(_)).then_some(PlantedBug::FixedTimeout),
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

/// Runs one policy on a scenario, on the real engines: one P, one D, under virtual time.
pub fn simulate(sc: &Scenario, policy: Policy) -> Report {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build() {
        Ok(rt) => rt,
        Err(_) => return Report { policy: policy.name(), ..Report::default() },
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

async fn run(sc: Scenario, policy: Policy) -> Report {
    let mut report = Report { policy: policy.name(), ..Report::default() };
    let net = MemNetwork::new();
    net.set_faults(Faults { seed: sc.seed, loss: sc.loss, delay: (sc.delay, sc.delay), unfenced: true, ..Faults::default() });
    // P has room for every request of the run; D for its slots.
    let p_blocks = (sc.rate * sc.surge_factor * sc.duration.as_secs_f64()) as u32 * sc.blocks + sc.blocks;
    let d_blocks = (sc.d_slots as u32 + 1) * (sc.blocks + GENERATED.div_ceil(BLOCK_SIZE) + 1);
    // The local reference: same model, no compute time (answers do not depend on it).
    let mut local_cfg = engine_config(&sc, Policy::Lease(30.0), &MemNetwork::new(), "local", 0, 64 * (sc.blocks + 4), 64);
    local_cfg.model.decode_ms_per_token = 0.0;
    let (Ok(p), Ok(d), Ok(local)) = (
        EngineHandle::start(engine_config(&sc, policy, &net, "p", 5000, p_blocks.max(sc.blocks), 64)).await,
        EngineHandle::start(engine_config(&sc, policy, &net, "d", 5001, d_blocks, sc.d_slots)).await,
        EngineHandle::start(EngineConfig { planted_bug: None, ..local_cfg }).await,
    ) else {
        return report;
    };
    let t0 = Instant::now();
    let tally = Arc::new(Mutex::new(Tally::default()));
    let d_slot = Arc::new(Mutex::new(Some(d.clone())));
    drop(d);
    let mut rng = cluster::Rng(sc.seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut clients = tokio::task::JoinSet::new();
    // Arrivals up to the crash (the router then sends D nothing more) or the end.
    let stop_arrivals = sc.d_crash.unwrap_or(sc.duration).min(sc.duration);
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
        let (p, d_slot, local, tally) = (p.clone(), d_slot.clone(), local.clone(), tally.clone());
        clients.spawn(async move {
            tokio::time::sleep_until(t0 + r.at).await;
            tally.lock().unwrap_or_else(|e| e.into_inner()).arrived += 1;
            let Ok((_, Some(params))) = collect(&p, request(format!("r{n}"), &r, json!({"do_remote_decode": true}))).await else { return };
            let Some(d) = d_slot.lock().unwrap_or_else(|e| e.into_inner()).clone() else { return };
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
    // The pause: every link between P's and D's agents cut, then healed.
    if let Some((at, len)) = sc.d_pause {
        let links: Vec<(String, String)> = {
            let d = d_slot.lock().unwrap_or_else(|e| e.into_inner());
            let ds = d.as_ref().map(|d| d.agent_names()).unwrap_or_default();
            p.agent_names().into_iter().flat_map(|a| ds.iter().map(move |b| (a.clone(), b.clone()))).collect()
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
    let mut now = Duration::ZERO;
    while now < sc.duration {
        tokio::time::sleep_until(t0 + now).await;
        if let Some(c) = sc.d_crash.filter(|c| crashed_at.is_none() && now >= *c) {
            if let Some(d) = d_slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                report.recomputed = d.metrics().recomputed_requests.load(Relaxed);
                report.heartbeats = d.metrics().heartbeats_sent.load(Relaxed);
                report.premature_frees = d.metrics().lease_ended_by_prefill.load(Relaxed);
                d.kill();
            }
            crashed_at = Some(c);
        }
        let blocks = p.metrics().leased_blocks.load(Relaxed).max(0) as u64;
        report.peak_leased_blocks = report.peak_leased_blocks.max(blocks);
        if let Some(c) = crashed_at {
            report.dead_block_seconds += blocks as f64 * step.as_secs_f64();
            if p.live_leases() == 0 && report.reclaim_after_crash.is_none() {
                report.reclaim_after_crash = Some((now - c).as_secs_f64());
            }
        }
        now += step;
    }
    clients.abort_all();
    let mut tally = tally.lock().unwrap_or_else(|e| e.into_inner());
    // Requests D decoded from its own recompute are counted there; the rest were pulled.
    if let Some(d) = d_slot.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
        report.recomputed = d.metrics().recomputed_requests.load(Relaxed);
        report.heartbeats = d.metrics().heartbeats_sent.load(Relaxed);
        report.premature_frees = d.metrics().lease_ended_by_prefill.load(Relaxed);
    }
    report.ttft_p50 = quantile(&mut tally.ttft, 0.5);
    report.ttft_p99 = quantile(&mut tally.ttft, 0.99);
    report.arrived = tally.arrived;
    report.garbage = tally.garbage;
    report.served = tally.correct.saturating_sub(report.recomputed);
    report
}
