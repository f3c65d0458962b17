//! The vLLM connector's protocol path under deterministic simulation (kvlease-sim::connector):
//! P's `IssuedLeases` and `Issuer`, D's `Renewer` and `Pull`, wired as `python/kvlease/vllm.py`
//! wires them, under seeded faults; checked for P5/D6, P2/D6, P3, P4, held messages, S5 and
//! liveness.

use kvlease_core::pull::PlantedBug;
use kvlease_sim::connector::{report, search, Connector};
use std::time::Instant;

/// Seeds per run of the test command; `KVLEASE_SIM_SEEDS` raises it, `KVLEASE_SIM_SEED` replays one.
fn seeds() -> u64 {
    std::env::var("KVLEASE_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(200)
}

/// SPEC P5, D6, P2, P3, P4, S5: no seed of the connector's path breaks an invariant, nor
/// leaves a message held past E or a request unended.
#[test]
fn p5_d6_p3_p4_s5_every_connector_seed_keeps_every_invariant() {
    if let Some(seed) = std::env::var("KVLEASE_SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        let out = Connector::from_seed(seed).run();
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
fn the_same_connector_seed_gives_the_same_run() {
    for seed in 1..=20 {
        let (a, b) = (Connector::from_seed(seed).run(), Connector::from_seed(seed).run());
        let first = a.trace.iter().zip(&b.trace).position(|(x, y)| x != y);
        assert!(
            first.is_none() && a.trace.len() == b.trace.len(),
            "seed {seed} diverges at {first:?}: {:?}",
            first.map(|i| (&a.trace[i], &b.trace[i]))
        );
        assert_eq!((a.used, a.recomputed, a.failed, a.aborted), (b.used, b.recomputed, b.failed, b.aborted));
    }
}

/// Runs the seeds with `bug` planted until one breaks an invariant; that seed replays to the same
/// violations, and keeps every invariant without the bug.
fn found(bug: PlantedBug, within: u64) -> kvlease_sim::connector::Outcome {
    let found = search(1, within, Some(bug)).expect_err("no seed found the planted bug");
    let mut again = Connector::from_seed(found.seed);
    again.planted = Some(bug);
    assert_eq!(again.run().violations, found.violations, "the seed replays");
    let clean = Connector::from_seed(found.seed).run();
    assert!(clean.violations.is_empty(), "{}", report(&clean));
    println!("seed {} finds {bug:?}: {:?}", found.seed, found.violations);
    found
}

/// SPEC P2, D6 (the bug fixed in 6ee67ac): planted, a renewal that overtakes its lease's grant on
/// a vLLM P is answered "not lost" and dropped, not applied at the grant; some seed shows P
/// expiring a lease before the E its acknowledgement promised D.
#[test]
fn p2_d6_a_planted_dropped_early_renewal_is_found() {
    let out = found(PlantedBug::EarlyRenewalDropped, 500);
    assert!(out.violations.iter().any(|v| v.starts_with("P2/D6")), "{}", report(&out));
}

/// SPEC P5, D6: planted, P confirms a `ReadDone` of a lease that expired as if it had ended by its
/// read; some seed shows D decoding from blocks P had reused.
#[test]
fn p5_d6_a_planted_confirmation_after_expiry_is_found() {
    let out = found(PlantedBug::ConfirmExpiredRead, 500);
    assert!(out.violations.iter().any(|v| v.starts_with("P5/D6")), "{}", report(&out));
}
