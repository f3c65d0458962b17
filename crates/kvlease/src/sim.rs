//! `kvlease sim`: the policies of SPEC §1 (and vLLM's lease as vLLM implements it) side by side
//! on one seeded, simulated workload — a traffic surge that queues requests on D far longer than
//! a short timeout, a silence, then a D crash — driving the same protocol core as `serve` (see
//! kvlease-sim).
//!
//! `kvlease sim --cluster`: the real engines of several P and D under deterministic simulation,
//! faults drawn from each seed, every invariant checked; a failing seed prints its trace and the
//! command that replays it.
//!
//! `kvlease sim --cluster --push-engines`: the same with every engine in push mode
//! (`NixlPushConnector`), both legs sent at once as `kvlease proxy` sends them, push mode's own
//! faults and checks added (kvlease-sim's `push_cluster`).
//!
//! `kvlease sim --connector`: the vLLM connector's protocol path (P's `IssuedLeases`, D's
//! `Renewer` and `Pull`, wired as `python/kvlease/vllm.py` wires them) under deterministic
//! simulation, the same way.
//!
//! `kvlease sim --push`: push mode's core machines (P's `PushSource`, D's `PushSink`) with
//! block memory modelled, under deterministic simulation, the same way.

use clap::Args;
use kvlease_sim::cluster::Cluster;
use kvlease_sim::connector::Connector;
use kvlease_sim::push::Push;
use kvlease_sim::push_cluster::PushCluster;
use kvlease_sim::seeded::{report, run_seeds, Outcome, Seeded};
use kvlease_sim::{simulate, Policy, Report, Routing, Scenario};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct SimArgs {
    /// Seed of the arrivals and losses: the same seed gives the same table.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Simulated seconds.
    #[arg(long, default_value_t = 600)]
    seconds: u64,
    /// Requests per second reaching P (tripled during the surge, from 100 s to 160 s).
    #[arg(long, default_value_t = 4.0)]
    rate: f64,
    /// Chance that any message between P and D is lost.
    #[arg(long, default_value_t = 0.01)]
    loss: f64,
    /// When D crashes, in simulated seconds (0: never). A crashed decoder's leases are dead
    /// weight: P keeps their blocks pinned until they time out ("dead block·s"). With several
    /// decoders only the first (d0) crashes and the router sends the others everything after.
    #[arg(long, default_value_t = 400)]
    crash_at: u64,
    /// When P stops hearing D, in simulated seconds (0: never): a stalled decoder process or a
    /// flapping link, `--pause-secs` long (every P–D link is cut). D keeps its queue; a lease must outlive the silence
    /// (its extension E = 2L/3 must exceed the pause) or the request's prefill is wasted.
    #[arg(long, default_value_t = 250)]
    pause_at: u64,
    /// How long the pause lasts, seconds.
    #[arg(long, default_value_t = 12.0)]
    pause_secs: f64,
    /// Prefill engines; the router sends them requests in turn. --rate is the total.
    #[arg(long, default_value_t = 1)]
    prefills: usize,
    /// Decode engines (each with 4 slots of 0.9 s); the first is the one that crashes. --rate
    /// is the total, so more decoders means shorter queues at the same rate.
    #[arg(long, default_value_t = 1)]
    decoders: usize,
    /// How the router picks a decoder: in turn (round-robin) or the one with the fewest
    /// requests not yet finished (least-loaded).
    #[arg(long, value_enum, default_value_t = RoutingArg::RoundRobin)]
    routing: RoutingArg,
    /// Sweep kvlease's lease over these `kv_lease_duration` values (seconds, comma-separated;
    /// a default list without values), print the trade-off and recommend a value for this
    /// traffic: the shortest lease that served no wrong answer and freed the KV of at most
    /// --max-premature of the requests under a live decoder.
    #[arg(long, num_args = 0..=1, value_delimiter = ',', default_missing_value = "2,5,10,15,20,30,60,120,240,480")]
    sweep: Option<Vec<f64>>,
    /// With --sweep: the share of requests whose KV may be freed under a live decoder (and
    /// recomputed) for a lease to be recommended; stragglers of a partition's reconnection.
    #[arg(long, default_value_t = 0.0)]
    max_premature: f64,
    /// Also write an SVG chart to this file: with --sweep the trade-off, else the KV blocks each
    /// policy pins on P over the run, side by side, the surge, the silence and the crash marked.
    #[arg(long)]
    chart: Option<std::path::PathBuf>,
    /// Print one JSON object per policy (and the recommendation) instead of the table.
    #[arg(long)]
    json: bool,
    /// Run the real engines of a seeded cluster under faults instead (seeds --seed.. --seed+--seeds).
    #[arg(long, conflicts_with_all = ["connector", "heartbeat_scale"])]
    cluster: bool,
    /// With --cluster: every engine in push mode (`kv_connector: NixlPushConnector`), the router
    /// sending both legs at once to a prefiller it learnt is a push engine; adds write failures,
    /// a decoder silenced past E and clients that leave to the faults, and push mode's checks.
    #[arg(long, requires = "cluster")]
    push_engines: bool,
    /// Run the vLLM connector's protocol path under seeded faults instead: P's IssuedLeases, D's
    /// Renewer and Pull, as python/kvlease/vllm.py wires them (seeds --seed.. --seed+--seeds).
    #[arg(long, conflicts_with = "heartbeat_scale")]
    connector: bool,
    /// Run push mode's core machines under seeded faults instead: P's PushSource and D's
    /// PushSink, block memory modelled (seeds --seed.. --seed+--seeds).
    #[arg(long, conflicts_with_all = ["cluster", "connector", "heartbeat_scale"])]
    push: bool,
    /// With --cluster or --connector: how many seeds, from --seed.
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// With --cluster or --connector: print each seed's trace, not only a failing one's.
    #[arg(long)]
    trace: bool,
    /// Measure lease-renewal traffic at scale instead, at these live leases per P
    /// (comma-separated; 10000,100000 without values): D's renewers and P's lease tables only,
    /// exchanging real encoded messages under virtual time, against vLLM's text heartbeat for the
    /// same leases (see kvlease-sim's `heartbeat`). Uses --seed.
    #[arg(long, num_args = 0..=1, value_delimiter = ',', default_missing_value = "10000,100000")]
    heartbeat_scale: Option<Vec<usize>>,
    /// With --heartbeat-scale: P engines.
    #[arg(long, default_value_t = 64)]
    scale_prefills: usize,
    /// With --heartbeat-scale: D engines.
    #[arg(long, default_value_t = 256)]
    scale_decoders: usize,
    /// With --heartbeat-scale: simulated seconds measured (after a warm-up of two intervals).
    #[arg(long, default_value_t = 60)]
    scale_seconds: u64,
    /// With --heartbeat-scale: seconds a lease lives before D reads it and P releases it (a new
    /// grant replaces it at once); 0: no churn.
    #[arg(long, default_value_t = 30.0)]
    scale_hold_secs: f64,
    /// With --heartbeat-scale: `kv_lease_duration` (the heartbeat interval is a sixth of it).
    #[arg(long, default_value_t = 30.0)]
    scale_lease_secs: f64,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum RoutingArg {
    RoundRobin,
    LeastLoaded,
}

/// `--cluster`, `--connector`, `--push`: runs the seeds of `S`, one `line` each (and its report
/// with `--trace`), then the `total` (given the wall time); the first that breaks an invariant is
/// reported and fails.
fn seeds<S: Seeded>(
    a: &SimArgs,
    line: impl Fn(&Outcome<S::Counts>) -> String,
    total: impl Fn(&Outcome<S::Counts>, f64) -> String,
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let ran = run_seeds::<S>(a.seed, a.seeds.max(1), None, |out| {
        if a.trace {
            print!("{}", report(out));
        }
        println!("seed {}: {}: ok", out.seed, line(out));
    });
    let all = match ran {
        Ok(all) => all,
        Err(out) => {
            eprint!("{}", report(&out));
            anyhow::bail!("seed {} broke an invariant", out.seed);
        }
    };
    println!("{} seeds, {}", a.seeds.max(1), total(&all, started.elapsed().as_secs_f64()));
    Ok(())
}

fn cluster(a: &SimArgs) -> anyhow::Result<()> {
    if a.push_engines {
        return push_cluster(a);
    }
    seeds::<Cluster>(
        a,
        |out| {
            let n = &out.counts;
            format!(
                "{} conversations, {} turns, {} answered, {} failed cleanly, {} recomputed, {:.1} s simulated",
                out.requests,
                n.turns,
                n.answered,
                n.failed,
                n.recomputed,
                out.simulated.as_secs_f64()
            )
        },
        |all, wall| {
            format!(
                "{} conversations, {} simulated requests (turns; {:.0} s simulated) in {wall:.2} s of wall time: {:.0} simulated requests/s",
                all.requests,
                all.counts.turns,
                all.simulated.as_secs_f64(),
                all.counts.turns as f64 / wall
            )
        },
    )
}

fn push_cluster(a: &SimArgs) -> anyhow::Result<()> {
    seeds::<PushCluster>(
        a,
        |out| {
            let n = &out.counts.0;
            format!(
                "{} requests, {} answered, {} failed cleanly, {} left by their client, {} recomputed, {} transferred, {} blocks written early; {:.1} s simulated",
                out.requests,
                n.answered,
                n.failed,
                n.left,
                n.recomputed,
                n.transferred,
                n.early_blocks,
                out.simulated.as_secs_f64()
            )
        },
        |all, wall| {
            format!(
                "{} simulated requests ({} transferred, {} recomputed, {} blocks written early; {:.0} s simulated) in {wall:.2} s of wall time",
                all.requests,
                all.counts.0.transferred,
                all.counts.0.recomputed,
                all.counts.0.early_blocks,
                all.simulated.as_secs_f64()
            )
        },
    )
}

fn connector(a: &SimArgs) -> anyhow::Result<()> {
    seeds::<Connector>(
        a,
        |out| {
            let n = &out.counts;
            format!(
                "{} requests ({} handed to two decoders); on the decoders {} used, {} recomputed, {} failed cleanly, {} aborted; {:.1} s simulated",
                out.requests,
                n.strays,
                n.used,
                n.recomputed,
                n.failed,
                n.aborted,
                out.simulated.as_secs_f64()
            )
        },
        |all, wall| {
            format!("{} simulated requests ({:.0} s simulated) in {wall:.2} s of wall time", all.requests, all.simulated.as_secs_f64())
        },
    )
}

fn push(a: &SimArgs) -> anyhow::Result<()> {
    seeds::<Push>(
        a,
        |out| {
            let n = &out.counts;
            format!(
                "{} requests, {} writes; on the decoders {} used, {} recomputed, {} failed cleanly, {} aborted, {} lost with a killed decoder; {:.1} s simulated",
                out.requests,
                n.writes,
                n.used,
                n.recomputed,
                n.failed,
                n.aborted,
                n.lost_with_d,
                out.simulated.as_secs_f64()
            )
        },
        |all, wall| {
            format!(
                "{} simulated requests, {} writes ({:.0} s simulated) in {wall:.2} s of wall time",
                all.requests,
                all.counts.writes,
                all.simulated.as_secs_f64()
            )
        },
    )
}

pub fn run(a: SimArgs) -> anyhow::Result<()> {
    // Each simulation runs its own single-threaded runtime under virtual time: not inside ours.
    if a.heartbeat_scale.is_some() {
        return heartbeat_scale(&a);
    }
    if a.connector {
        return connector(&a);
    }
    if a.push {
        return push(&a);
    }
    std::thread::scope(|s| s.spawn(|| if a.cluster { cluster(&a) } else { policies(&a) }).join())
        .unwrap_or_else(|_| anyhow::bail!("the simulator panicked"))
}

/// `--heartbeat-scale`: lease-renewal messages and bytes per second per P, kvlease and vLLM.
fn heartbeat_scale(a: &SimArgs) -> anyhow::Result<()> {
    use kvlease_sim::heartbeat::{run, Scale};
    let sizes = a.heartbeat_scale.clone().unwrap_or_default();
    if sizes.is_empty() || sizes.iter().any(|&n| n == 0 || n > 10_000_000) {
        anyhow::bail!("--heartbeat-scale takes live leases per P, each in [1, 10^7]");
    }
    if !(1..=4096).contains(&a.scale_prefills) || !(1..=4096).contains(&a.scale_decoders) || a.scale_seconds == 0 {
        anyhow::bail!("--scale-prefills and --scale-decoders take 1 to 4096 engines, --scale-seconds ≥ 1");
    }
    if !(a.scale_hold_secs.is_finite() && a.scale_hold_secs >= 0.0) {
        anyhow::bail!("--scale-hold-secs must be a number of seconds ≥ 0");
    }
    let lease = kvlease_core::config::LeaseConfig::with_lease_secs(a.scale_lease_secs)?;
    println!(
        "{} P, {} D, requests routed to D at random; L = {} s (I = {:?}, notifications ≤ {} B); leases held {} s then read and replaced; {} s measured after {:?} of warm-up; seed {}",
        a.scale_prefills,
        a.scale_decoders,
        a.scale_lease_secs,
        lease.heartbeat_interval,
        lease.max_notif_bytes,
        a.scale_hold_secs,
        a.scale_seconds,
        lease.heartbeat_interval * 2,
        a.seed
    );
    println!("per P, mean over P engines (most loaded P in brackets); bytes are notification payloads");
    println!(
        "{:>9} | {:>18} {:>20} | {:>12} {:>16} | {:>11} {:>9} | {:>20} {:>22} | {:>13} | {:>8}",
        "live/P",
        "kvlease HB msg/s",
        "kvlease HB B/s",
        "ack msg/s",
        "ack B/s",
        "other msg/s",
        "other B/s",
        "vLLM HB msg/s",
        "vLLM HB B/s",
        "vLLM ÷ kvlease",
        "wall s"
    );
    for &live in &sizes {
        let sc = Scale {
            seed: a.seed,
            lease: lease.clone(),
            hold: (a.scale_hold_secs > 0.0).then(|| Duration::from_secs_f64(a.scale_hold_secs)),
            window: Duration::from_secs(a.scale_seconds),
            ..Scale::new(a.scale_prefills, a.scale_decoders, live)
        };
        let started = std::time::Instant::now();
        let r = run(&sc);
        let wall = started.elapsed().as_secs_f64();
        let both = |f: fn(&kvlease_sim::heartbeat::PerP) -> u64| format!("{:.0} ({:.0})", r.per_sec(f), r.max_per_sec(f));
        let kv_bytes = r.per_sec(|p| p.heartbeats.bytes + p.acks.bytes + p.other.bytes);
        let vllm_bytes = r.per_sec(|p| p.vllm.bytes);
        println!(
            "{:>9} | {:>18} {:>20} | {:>12} {:>16} | {:>11.1} {:>9.0} | {:>20} {:>22} | {:>12.1}× | {:>8.1}",
            live,
            both(|p| p.heartbeats.msgs),
            both(|p| p.heartbeats.bytes),
            both(|p| p.acks.msgs),
            both(|p| p.acks.bytes),
            r.per_sec(|p| p.other.msgs),
            r.per_sec(|p| p.other.bytes),
            both(|p| p.vllm.msgs),
            both(|p| p.vllm.bytes),
            vllm_bytes / kv_bytes.max(1.0),
            wall
        );
        if r.lost > 0 || r.live_min != live || r.live_max != live {
            anyhow::bail!("{} leases lost, live per P {}..{}: the run is not steady", r.lost, r.live_min, r.live_max);
        }
        println!(
            "{:>9}   kvlease bytes per lease per second (HB + ack + other): {:.3}; vLLM: {:.3}; {} grants",
            "",
            kv_bytes / live as f64,
            vllm_bytes / live as f64,
            r.grants
        );
    }
    Ok(())
}

/// The most requests a `kvlease sim` run may bring (rate × surge × arrival window): P's pool,
/// sized for all of them at 64 blocks each, counts blocks in a u32.
const MAX_SIM_REQUESTS: f64 = 60_000_000.0;

fn policies(a: &SimArgs) -> anyhow::Result<()> {
    let valid = a.rate > 0.0 && a.rate.is_finite() && (0.0..1.0).contains(&a.loss) && a.seconds > 0;
    if !valid {
        anyhow::bail!("--rate must be > 0, --loss in [0, 1), --seconds ≥ 1");
    }
    if !(a.pause_secs.is_finite() && a.pause_secs >= 0.0) {
        anyhow::bail!("--pause-secs must be a number of seconds ≥ 0");
    }
    if !(1..=64).contains(&a.prefills) || !(1..=64).contains(&a.decoders) {
        anyhow::bail!("--prefills and --decoders take 1 to 64 engines");
    }
    if !(0.0..=1.0).contains(&a.max_premature) {
        anyhow::bail!("--max-premature must be a fraction in [0, 1]");
    }
    if let Some(values) = &a.sweep {
        if values.is_empty() || values.iter().any(|v| !(v.is_finite() && *v >= 1.0 && *v <= 86_400.0)) {
            anyhow::bail!("--sweep takes kv_lease_duration values in seconds, each in [1, 86400]");
        }
    }
    let sc = Scenario {
        seed: a.seed,
        duration: Duration::from_secs(a.seconds),
        rate: a.rate,
        loss: a.loss,
        d_crash: (a.crash_at > 0).then(|| Duration::from_secs(a.crash_at)),
        d_pause: (a.pause_at > 0 && a.pause_secs > 0.0).then(|| (Duration::from_secs(a.pause_at), Duration::from_secs_f64(a.pause_secs))),
        prefills: a.prefills,
        decoders: a.decoders,
        routing: match a.routing {
            RoutingArg::RoundRobin => Routing::RoundRobin,
            RoutingArg::LeastLoaded => Routing::LeastLoaded,
        },
        ..Scenario::default()
    };
    // P's pool holds every request of the run (the simulator never turns one away), a u32 count
    // of blocks: refuse up front what it cannot hold rather than fail at start or run for days.
    let most = sc.most_requests();
    if most > MAX_SIM_REQUESTS {
        anyhow::bail!(
            "--rate {} over {:.0} s of arrivals may bring {most:.0} requests, more than the simulator holds ({MAX_SIM_REQUESTS:.0}): lower --rate or --seconds",
            a.rate,
            sc.arrivals_until().as_secs_f64()
        );
    }
    let policies: Vec<Policy> = match &a.sweep {
        Some(values) => values.iter().map(|v| Policy::Lease(*v)).collect(),
        None => vec![Policy::Fixed(480.0), Policy::Fixed(30.0), Policy::VllmLease(30.0), Policy::Lease(30.0)],
    };
    let at = |t: u64| if t > 0 { format!("{t} s") } else { "never".into() };
    if !a.json {
        let engines = if a.prefills == 1 && a.decoders == 1 {
            String::new()
        } else {
            let routing = match a.routing {
                RoutingArg::RoundRobin => "round-robin",
                RoutingArg::LeastLoaded => "least-loaded",
            };
            format!("{} P, {} D ({routing} routing; the crash is d0's), ", a.prefills, a.decoders)
        };
        println!(
            "{engines}{} s simulated, {} req/s (×{} from 100 s to 160 s), {} blocks each, D: {} slots × {:?}, loss {}, D silent for {} s at {}, D crashes at {}",
            a.seconds,
            a.rate,
            sc.surge_factor,
            sc.blocks,
            sc.d_slots,
            sc.decode_time,
            a.loss,
            a.pause_secs,
            at(a.pause_at),
            at(a.crash_at)
        );
        println!(
            "{:<16} {:>8} {:>8} {:>8} {:>10} {:>10} {:>16} {:>13} {:>9} {:>9} {:>11}",
            "policy",
            "arrived",
            "served",
            "garbage",
            "premature",
            "recomputed",
            "reclaimed after",
            "dead block·s",
            "TTFT p50",
            "TTFT p99",
            "heartbeats"
        );
    }
    let mut reports = Vec::new();
    for policy in policies {
        let r = simulate(&sc, policy);
        if let Some(why) = &r.failed {
            anyhow::bail!("the {} run could not take place: {why}", r.policy);
        }
        let reclaim = match (sc.d_crash, r.reclaim_after_crash) {
            (None, _) => "-".to_string(),
            (Some(_), Some(s)) => format!("{s:.1} s"),
            (Some(_), None) => "not in time".to_string(),
        };
        if a.json {
            println!("{}", report_json(&r));
        } else {
            println!(
                "{:<16} {:>8} {:>8} {:>8} {:>10} {:>10} {:>16} {:>13.0} {:>7.2} s {:>7.2} s {:>11}",
                r.policy,
                r.arrived,
                r.served,
                r.garbage,
                r.premature_frees,
                r.recomputed,
                reclaim,
                r.dead_block_seconds,
                r.ttft_p50,
                r.ttft_p99,
                r.heartbeats
            );
        }
        reports.push((policy, r));
    }
    if a.sweep.is_some() {
        let pick = recommend(&reports, a.max_premature);
        if a.json {
            println!("{}", serde_json::json!({"recommended_kv_lease_duration": pick}));
        } else {
            match pick {
                Some(l) => println!(
                    "recommended kv_lease_duration: {l} (the shortest lease that served no wrong answer and freed the KV of at most {} % of requests under a live decoder on this traffic; \
                     keep E = 2L/3 = {:.1} s above the longest silence you expect from a live decoder)",
                    a.max_premature * 100.0,
                    l * 2.0 / 3.0
                ),
                None => println!("no swept value kept every live decoder's KV: sweep longer leases"),
            }
        }
        if let Some(path) = &a.chart {
            std::fs::write(path, sweep_chart(&reports, pick))?;
            if !a.json {
                println!("chart: {}", path.display());
            }
        }
    } else if let Some(path) = &a.chart {
        std::fs::write(path, timeline_chart(&reports, &sc))?;
        if !a.json {
            println!("chart: {}", path.display());
        }
    }
    if !a.json {
        println!("garbage: decoded from KV blocks P had already freed (vLLM #21570); premature: leases D found lost when it came to read");
        println!(
            "(KV P freed under a live decoder's request); recomputed: prompts D computed itself (a premature free, or a lost message);"
        );
        println!("dead block·s: KV pinned for a crashed D; TTFT: arrival at P to D's first token; vLLM lease: renewed by heartbeats,");
        println!("but P's expiry sweep is head-only in grant order (vLLM #58222) and D reads unconfirmed, with no lease-lost answer");
    }
    Ok(())
}

/// The shortest swept lease that served no wrong answer and freed the KV of at most
/// `max_premature` of the requests under a live decoder.
fn recommend(reports: &[(Policy, Report)], max_premature: f64) -> Option<f64> {
    reports
        .iter()
        .filter(|(_, r)| r.garbage == 0 && r.premature_frees as f64 <= max_premature * r.arrived as f64)
        .filter_map(|(p, _)| match p {
            Policy::Lease(l) => Some(*l),
            Policy::Fixed(_) | Policy::VllmLease(_) => None,
        })
        .min_by(f64::total_cmp)
}

fn report_json(r: &Report) -> serde_json::Value {
    serde_json::json!({
        "policy": r.policy, "arrived": r.arrived, "served": r.served, "garbage": r.garbage,
        "premature_frees": r.premature_frees, "recomputed": r.recomputed, "reclaim_after_crash_s": r.reclaim_after_crash,
        "dead_block_seconds": r.dead_block_seconds, "peak_leased_blocks": r.peak_leased_blocks,
        "ttft_p50_s": r.ttft_p50, "ttft_p99_s": r.ttft_p99, "heartbeats": r.heartbeats,
    })
}

/// The sweep as an SVG chart: dead block·s (after the crash) and premature frees (during the
/// pause) against the lease, on a log axis, the recommendation marked.
fn sweep_chart(reports: &[(Policy, Report)], pick: Option<f64>) -> String {
    let pts: Vec<(f64, f64, f64)> = reports
        .iter()
        .filter_map(|(p, r)| match p {
            Policy::Lease(l) => Some((*l, r.dead_block_seconds, (r.premature_frees + r.garbage) as f64)),
            Policy::Fixed(_) | Policy::VllmLease(_) => None,
        })
        .collect();
    let (w, h, l, r, t, b) = (760.0, 380.0, 80.0, 80.0, 50.0, 60.0);
    let (lo, hi) = pts.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
    let span = (hi.ln() - lo.ln()).max(1e-9);
    let x = |v: f64| l + (w - l - r) * (v.ln() - lo.ln()) / span;
    let max_dead = pts.iter().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let max_wasted = pts.iter().map(|p| p.2).fold(1.0, f64::max) * 1.1;
    let yd = |v: f64| h - b - (h - t - b) * v / max_dead;
    let yw = |v: f64| h - b - (h - t - b) * v / max_wasted;
    let mut o = String::new();
    use std::fmt::Write as _;
    let _ = write!(
        o,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12"><rect width="{w}" height="{h}" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">kv_lease_duration: dead blocks after a crash against KV freed under a live decoder</text>"##,
        w / 2.0
    );
    let _ = write!(o, r##"<line x1="{l}" y1="{}" x2="{}" y2="{}" stroke="black"/>"##, h - b, w - r, h - b);
    let _ = write!(
        o,
        r##"<line x1="{l}" y1="{t}" x2="{l}" y2="{}" stroke="#1f5fbf"/><line x1="{}" y1="{t}" x2="{}" y2="{}" stroke="#b00020"/>"##,
        h - b,
        w - r,
        w - r,
        h - b
    );
    for p in &pts {
        let _ = write!(o, r##"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"##, x(p.0), h - b + 16.0, p.0);
    }
    let _ = write!(
        o,
        r##"<text x="{}" y="{}" text-anchor="middle">kv_lease_duration L, seconds (log scale)</text>"##,
        (l + w - r) / 2.0,
        h - b + 36.0
    );
    for i in 0..=4 {
        let (d, wv) = (max_dead * f64::from(i) / 4.0, max_wasted * f64::from(i) / 4.0);
        let label = if max_dead >= 1e6 { format!("{:.1}M", d / 1e6) } else { format!("{d:.0}") };
        let _ = write!(o, r##"<text x="{}" y="{:.1}" text-anchor="end" fill="#1f5fbf">{label}</text>"##, l - 6.0, yd(d) + 4.0);
        let _ = write!(o, r##"<text x="{}" y="{:.1}" fill="#b00020">{wv:.0}</text>"##, w - r + 6.0, yw(wv) + 4.0);
    }
    let mid = (t + h - b) / 2.0;
    let _ = write!(
        o,
        r##"<text x="18" y="{mid}" transform="rotate(-90 18 {mid})" text-anchor="middle" fill="#1f5fbf">dead block·s after the crash</text>"##
    );
    let _ = write!(
        o,
        r##"<text x="{}" y="{mid}" transform="rotate(90 {} {mid})" text-anchor="middle" fill="#b00020">premature frees (live decoder)</text>"##,
        w - 18.0,
        w - 18.0
    );
    let line = |ys: Vec<f64>| pts.iter().zip(ys).map(|(p, y)| format!("{:.1},{y:.1}", x(p.0))).collect::<Vec<_>>().join(" ");
    let dead = line(pts.iter().map(|p| yd(p.1)).collect());
    let freed = line(pts.iter().map(|p| yw(p.2)).collect());
    let _ = write!(o, r##"<polyline points="{dead}" fill="none" stroke="#1f5fbf" stroke-width="2"/>"##);
    let _ = write!(o, r##"<polyline points="{freed}" fill="none" stroke="#b00020" stroke-width="2" stroke-dasharray="6,3"/>"##);
    if let Some(pick) = pick {
        let _ = write!(
            o,
            r##"<line x1="{0:.1}" y1="{t}" x2="{0:.1}" y2="{1}" stroke="#070" stroke-dasharray="3,3"/><text x="{2:.1}" y="{3}" fill="#070">recommended: {pick} s</text>"##,
            x(pick),
            h - b,
            x(pick) + 4.0,
            t + 14.0
        );
    }
    o.push_str("</svg>\n");
    o
}

/// The policies' runs as an SVG chart: one panel per policy, the KV blocks pinned on P each
/// simulated second, on a common scale, with the surge, the decoder's silence and its crash marked.
fn timeline_chart(reports: &[(Policy, Report)], sc: &Scenario) -> String {
    use std::fmt::Write as _;
    let (w, l, r, top, ph, gap) = (900.0, 70.0, 20.0, 60.0, 110.0, 34.0);
    let h = top + reports.len() as f64 * (ph + gap) + 30.0;
    let t_end = sc.duration.as_secs_f64().max(1.0);
    let max = reports.iter().flat_map(|(_, r)| r.pinned.iter().copied()).max().unwrap_or(1).max(1) as f64 * 1.1;
    let x = |t: f64| l + (w - l - r) * t / t_end;
    let mut o = String::new();
    let _ = write!(
        o,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12"><rect width="{w}" height="{h}" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15" font-weight="bold">KV blocks pinned on P, same traffic, each policy (seed {})</text>"##,
        w / 2.0,
        sc.seed
    );
    for (k, (_, rep)) in reports.iter().enumerate() {
        let y0 = top + k as f64 * (ph + gap);
        let y = |v: f64| y0 + ph - ph * v / max;
        let band = |o: &mut String, a: f64, b: f64, colour: &str, label: &str| {
            let _ = write!(o, r##"<rect x="{:.1}" y="{y0}" width="{:.1}" height="{ph}" fill="{colour}"/>"##, x(a), (x(b) - x(a)).max(1.0));
            if k == 0 {
                let _ = write!(o, r##"<text x="{:.1}" y="{}" fill="#555">{label}</text>"##, x(a) + 3.0, y0 + 12.0);
            }
        };
        if let Some((a, b)) = sc.surge {
            band(&mut o, a.as_secs_f64(), b.as_secs_f64(), "#fff3d6", "surge");
        }
        if let Some((at, len)) = sc.d_pause {
            band(&mut o, at.as_secs_f64(), (at + len).as_secs_f64(), "#e0e8ff", "D silent");
        }
        if let Some(c) = sc.d_crash {
            let xc = x(c.as_secs_f64());
            let _ = write!(o, r##"<line x1="{xc:.1}" y1="{y0}" x2="{xc:.1}" y2="{}" stroke="#c00" stroke-dasharray="5,3"/>"##, y0 + ph);
            if k == 0 {
                let _ = write!(o, r##"<text x="{:.1}" y="{}" fill="#c00">D crashes</text>"##, xc + 3.0, y0 + 12.0);
            }
        }
        let _ = write!(o, r##"<line x1="{l}" y1="{}" x2="{}" y2="{}" stroke="black"/>"##, y0 + ph, w - r, y0 + ph);
        let _ = write!(o, r##"<line x1="{l}" y1="{y0}" x2="{l}" y2="{}" stroke="black"/>"##, y0 + ph);
        let _ = write!(o, r##"<text x="{}" y="{}" text-anchor="end">{:.0}</text>"##, l - 5.0, y0 + 4.0, max);
        let _ = write!(o, r##"<text x="{}" y="{}" text-anchor="end">0</text>"##, l - 5.0, y0 + ph + 4.0);
        let pts: Vec<String> = rep.pinned.iter().enumerate().map(|(i, v)| format!("{:.1},{:.1}", x(i as f64), y(*v as f64))).collect();
        let _ = write!(o, r##"<polyline points="{}" fill="none" stroke="#1f5fbf" stroke-width="1.5"/>"##, pts.join(" "));
        let dead = format!("{:.1}M dead block·s", rep.dead_block_seconds / 1e6);
        let _ = write!(
            o,
            r##"<text x="{}" y="{}" font-weight="bold">{}</text><text x="{}" y="{}" text-anchor="end" fill="#444">{} garbage, {} premature, {dead}</text>"##,
            l,
            y0 - 6.0,
            rep.policy,
            w - r,
            y0 - 6.0,
            rep.garbage,
            rep.premature_frees
        );
    }
    let axis = top + reports.len() as f64 * (ph + gap) - gap;
    let step = if t_end > 300.0 { 60 } else { 20 };
    for t in (0..=t_end as u64).step_by(step) {
        let _ = write!(o, r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#444">{t}</text>"##, x(t as f64), axis + 16.0);
    }
    let _ = write!(o, r##"<text x="{}" y="{}" text-anchor="end" fill="#444">simulated seconds</text>"##, w - r, axis + 30.0);
    o.push_str("</svg>\n");
    o
}
