//! `kvlease sim`: the policies of SPEC §1 side by side on one seeded, simulated workload — a
//! traffic surge that queues requests on D far longer than a short timeout, then a D crash —
//! driving the same protocol core as `serve` (see kvlease-sim).
//!
//! `kvlease sim --cluster`: the real engines of several P and D under deterministic simulation,
//! faults drawn from each seed, every invariant checked; a failing seed prints its trace and the
//! command that replays it.

use clap::Args;
use kvlease_sim::{simulate, Policy, Scenario};
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
    /// When D crashes, in simulated seconds (0: never).
    #[arg(long, default_value_t = 400)]
    crash_at: u64,
    /// Run the real engines of a seeded cluster under faults instead (seeds --seed.. --seed+--seeds).
    #[arg(long)]
    cluster: bool,
    /// With --cluster: how many seeds, from --seed.
    #[arg(long, default_value_t = 1)]
    seeds: u64,
    /// With --cluster: print each seed's trace, not only a failing one's.
    #[arg(long)]
    trace: bool,
}

/// `--cluster`: runs the seeds; the first that breaks an invariant is reported and fails.
fn cluster(a: &SimArgs) -> anyhow::Result<()> {
    use kvlease_sim::cluster::{report, Cluster};
    let started = std::time::Instant::now();
    let (mut requests, mut turns, mut simulated) = (0u64, 0u64, Duration::ZERO);
    for seed in a.seed..a.seed.saturating_add(a.seeds.max(1)) {
        let out = Cluster::from_seed(seed).run();
        requests += out.requests as u64;
        turns += out.turns as u64;
        simulated += out.simulated;
        if !out.violations.is_empty() {
            eprint!("{}", report(&out));
            anyhow::bail!("seed {seed} broke an invariant");
        }
        if a.trace {
            print!("{}", report(&out));
        }
        println!(
            "seed {seed}: {} conversations, {} turns, {} answered, {} failed cleanly, {} recomputed, {:.1} s simulated: ok",
            out.requests,
            out.turns,
            out.answered,
            out.failed,
            out.recomputed,
            out.simulated.as_secs_f64()
        );
    }
    let wall = started.elapsed().as_secs_f64();
    println!(
        "{} seeds, {requests} conversations, {turns} simulated requests (turns; {:.0} s simulated) in {wall:.2} s of wall time: {:.0} simulated requests/s",
        a.seeds.max(1),
        simulated.as_secs_f64(),
        turns as f64 / wall
    );
    Ok(())
}

pub fn run(a: SimArgs) -> anyhow::Result<()> {
    // Each simulation runs its own single-threaded runtime under virtual time: not inside ours.
    std::thread::scope(|s| s.spawn(|| if a.cluster { cluster(&a) } else { policies(&a) }).join())
        .unwrap_or_else(|_| anyhow::bail!("the simulator panicked"))
}

fn policies(a: &SimArgs) -> anyhow::Result<()> {
    let valid = a.rate > 0.0 && a.rate.is_finite() && (0.0..1.0).contains(&a.loss) && a.seconds > 0;
    if !valid {
        anyhow::bail!("--rate must be > 0, --loss in [0, 1), --seconds ≥ 1");
    }
    let sc = Scenario {
        seed: a.seed,
        duration: Duration::from_secs(a.seconds),
        rate: a.rate,
        loss: a.loss,
        d_crash: (a.crash_at > 0).then(|| Duration::from_secs(a.crash_at)),
        ..Scenario::default()
    };
    println!(
        "{} s simulated, {} req/s (×{} from 100 s to 160 s), {} blocks each, D: {} slots × {:?}, loss {}, D crashes at {}",
        a.seconds,
        a.rate,
        sc.surge_factor,
        sc.blocks,
        sc.d_slots,
        sc.decode_time,
        a.loss,
        if a.crash_at > 0 { format!("{} s", a.crash_at) } else { "never".into() }
    );
    println!(
        "{:<14} {:>8} {:>8} {:>8} {:>10} {:>16} {:>14}",
        "policy", "arrived", "served", "garbage", "recomputed", "reclaimed after", "dead block·s"
    );
    for policy in [Policy::Fixed(480.0), Policy::Fixed(30.0), Policy::Lease(30.0)] {
        let r = simulate(&sc, policy);
        let reclaim = match (sc.d_crash, r.reclaim_after_crash) {
            (None, _) => "-".to_string(),
            (Some(_), Some(s)) => format!("{s:.1} s"),
            (Some(_), None) => "not in time".to_string(),
        };
        println!(
            "{:<14} {:>8} {:>8} {:>8} {:>10} {:>16} {:>14.0}",
            r.policy, r.arrived, r.served, r.garbage, r.recomputed, reclaim, r.dead_block_seconds
        );
    }
    println!("garbage: decoded from KV blocks P had already freed (vLLM #21570); dead block·s: KV pinned for a crashed D");
    Ok(())
}
