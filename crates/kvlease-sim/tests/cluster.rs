//! The real engines under deterministic simulation (kvlease-sim::cluster): seeded clusters of
//! P and D engines, faults and all, checked for D7, P3, P4 (reclaim), blocks and liveness.

use kvlease_core::pull::PlantedBug;
use kvlease_sim::cluster::{report, search, Cluster};
use std::time::{Duration, Instant};

/// Seeds per run of the test command; `KVLEASE_SIM_SEEDS` raises it, `KVLEASE_SIM_SEED` replays one.
fn seeds() -> u64 {
    std::env::var("KVLEASE_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(300)
}

/// SPEC D7, P3, P4, P5, D6: no seed of the cluster breaks an invariant.
#[test]
fn d7_p3_p4_every_seed_keeps_every_invariant() {
    if let Some(seed) = std::env::var("KVLEASE_SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        let out = Cluster::from_seed(seed).run();
        println!("{}", report(&out));
        assert!(out.violations.is_empty());
        return;
    }
    let started = Instant::now();
    match search(1, seeds(), None) {
        Ok(requests) => println!("{} seeds, {requests} simulated requests in {:?}", seeds(), started.elapsed()),
        Err(out) => panic!("{}", report(&out)),
    }
}

/// The simulator is deterministic: one seed, one trace.
#[test]
fn the_same_seed_gives_the_same_run() {
    for seed in 1..=20 {
        let (a, b) = (Cluster::from_seed(seed).run(), Cluster::from_seed(seed).run());
        let first = a.trace.iter().zip(&b.trace).position(|(x, y)| x != y);
        assert!(
            first.is_none() && a.trace.len() == b.trace.len(),
            "seed {seed} diverges at {first:?}: {:?}",
            first.map(|i| (&a.trace[i], &b.trace[i]))
        );
        assert_eq!((a.answered, a.failed, a.recomputed), (b.answered, b.failed, b.recomputed));
    }
}

/// The simulator finds what it claims to: with the pull's fencing verdict ignored (D decodes
/// from blocks whose pull failed), some seed answers differently from a local run (D7).
#[test]
fn d6_a_planted_bug_is_found() {
    let found = search(1, 2_000, Some(PlantedBug::IgnoreVerdict)).expect_err("no seed found the planted bug");
    assert!(found.violations.iter().any(|v| v.starts_with("D7")), "{}", report(&found));
    // And the seed replays to the same violation.
    let mut again = Cluster::from_seed(found.seed);
    again.planted = Some(PlantedBug::IgnoreVerdict);
    assert_eq!(again.run().violations, found.violations);
}

/// The simulation is fast enough for thousands of seeds in the test budget.
#[test]
fn a_seed_runs_in_milliseconds() {
    let started = Instant::now();
    let out = Cluster::from_seed(7).run();
    assert!(out.violations.is_empty(), "{}", report(&out));
    // Not a speed assertion (that is BENCHMARKS.md): a guard against a run that waits on real time.
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
}

/// SPEC O2 under the seeded faults, through the proxy's own route machine: planted, a decode leg
/// retried on another decoder after the first byte of its answer reached the client (a decoder
/// crashed mid-answer) gives the client part of one answer and then all of another — some seed
/// shows it (D7); the correct machine keeps every invariant on that same seed.
#[test]
fn o2_a_planted_retry_after_the_first_byte_is_found() {
    let found = search(1, 2_000, Some(PlantedBug::RetryAfterFirstByte)).expect_err("no seed found the planted bug");
    assert!(found.violations.iter().any(|v| v.starts_with("D7") && v.contains("the client got")), "{}", report(&found));
    assert!(found.trace.iter().any(|l| l.contains("(retry)")), "{}", report(&found));
    let clean = Cluster::from_seed(found.seed).run();
    assert!(clean.violations.is_empty(), "{}", report(&clean));
    println!("seed {} finds it: {:?}", found.seed, found.violations);
}
