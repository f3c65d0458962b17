//! What the seeded simulators' tests share (tests/cluster.rs, connector.rs, push.rs).

use kvlease_sim::seeded::{report, search, Outcome, Seeded};
use std::time::Instant;

/// Seeds per run of the test command (`default`); `KVLEASE_SIM_SEEDS` raises it.
fn seeds(default: u64) -> u64 {
    std::env::var("KVLEASE_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// No seed of `S` breaks an invariant: seeds 1 to `default` (see [`seeds`]), or the one seed
/// `KVLEASE_SIM_SEED` replays, its report printed.
pub fn every_seed_keeps_every_invariant<S: Seeded>(default: u64) {
    if let Some(seed) = std::env::var("KVLEASE_SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        let out = S::from_seed(seed).run();
        println!("{}", report(&out));
        assert!(out.violations.is_empty());
        return;
    }
    let started = Instant::now();
    match search::<S>(1, seeds(default), None) {
        Ok(requests) => println!("{} seeds, {requests} simulated requests in {:?}", seeds(default), started.elapsed()),
        Err(out) => panic!("{}", report(&out)),
    }
}

/// The simulator is deterministic: one seed, one trace (and the same counts).
pub fn the_same_seed_gives_the_same_run<S: Seeded>() {
    for seed in 1..=20 {
        let (a, b) = (S::from_seed(seed).run(), S::from_seed(seed).run());
        let first = a.trace.iter().zip(&b.trace).position(|(x, y)| x != y);
        assert!(
            first.is_none() && a.trace.len() == b.trace.len(),
            "seed {seed} diverges at {first:?}: {:?}",
            first.map(|i| (&a.trace[i], &b.trace[i]))
        );
        assert_eq!(a.counts, b.counts);
    }
}

/// Runs the seeds of `S` with `bug` planted until one breaks an invariant; that seed replays to
/// the same violations, and keeps every invariant without the bug.
pub fn found<S: Seeded>(bug: S::Planted, within: u64) -> Outcome<S::Counts> {
    let found = search::<S>(1, within, Some(bug)).expect_err("no seed found the planted bug");
    let mut again = S::from_seed(found.seed);
    again.plant(Some(bug));
    assert_eq!(again.run().violations, found.violations, "the seed replays");
    let clean = S::from_seed(found.seed).run();
    assert!(clean.violations.is_empty(), "{}", report(&clean));
    println!("seed {} finds {bug:?}: {:?}", found.seed, found.violations);
    *found
}
