//! The simulator's speed (issue #11): `simulate(Policy::Lease(30.0))` with no D crash, at
//! `--rate R` for `--seconds S` simulated, printing simulated requests per second of wall time.
//!
//! `cargo run --release -p kvlease-sim --example sim_rate -- 400 600`

use kvlease_sim::{simulate, Policy, Scenario};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<f64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let rate = args.first().copied().unwrap_or(400.0);
    let seconds = args.get(1).copied().unwrap_or(600.0);
    let sc = Scenario { rate, duration: Duration::from_secs_f64(seconds), d_crash: None, ..Scenario::default() };
    let started = Instant::now();
    let r = simulate(&sc, Policy::Lease(30.0));
    if let Some(why) = &r.failed {
        eprintln!("error: the run could not take place: {why}");
        std::process::exit(1);
    }
    let wall = started.elapsed().as_secs_f64();
    println!(
        "rate {rate}, {seconds} s simulated: {} arrived, {} served, {} recomputed, {} garbage in {wall:.2} s wall: {:.0} simulated requests/s",
        r.arrived,
        r.served,
        r.recomputed,
        r.garbage,
        r.arrived as f64 / wall
    );
}
