//! The real engines under deterministic simulation (kvlease-sim::cluster): seeded clusters of
//! P and D engines, faults and all, checked for D7, P3, P4 (reclaim), blocks and liveness.

mod common;

use kvlease_core::pull::PlantedBug;
use kvlease_sim::cluster::Cluster;
use kvlease_sim::seeded::{report, Seeded};
use std::time::{Duration, Instant};

/// SPEC D7, P3, P4, P5, D6: no seed of the cluster breaks an invariant.
#[test]
fn d7_p3_p4_every_seed_keeps_every_invariant() {
    common::every_seed_keeps_every_invariant::<Cluster>(300);
}

/// The simulator is deterministic: one seed, one trace.
#[test]
fn the_same_seed_gives_the_same_run() {
    common::the_same_seed_gives_the_same_run::<Cluster>();
}

/// The simulator finds what it claims to: with the pull's fencing verdict ignored (D decodes
/// from blocks whose pull failed), some seed answers differently from a local run (D7); the seed
/// replays to the same violations.
#[test]
fn d6_a_planted_bug_is_found() {
    let found = common::found::<Cluster>(PlantedBug::IgnoreVerdict, 2_000);
    assert!(found.violations.iter().any(|v| v.starts_with("D7")), "{}", report(&found));
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
    let found = common::found::<Cluster>(PlantedBug::RetryAfterFirstByte, 2_000);
    assert!(found.violations.iter().any(|v| v.starts_with("D7") && v.contains("the client got")), "{}", report(&found));
    assert!(found.trace.iter().any(|l| l.contains("(retry)")), "{}", report(&found));
}
