//! `kvlease sim`: the policies of SPEC §1 side by side on one seeded, simulated workload — a
//! traffic surge that queues requests on D far longer than a short timeout, then a D crash —
//! driving the same protocol core as `serve` (see kvlease-sim).

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
}

pub fn run(a: SimArgs) -> anyhow::Result<()> {
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
