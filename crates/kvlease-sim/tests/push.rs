//! Push mode's core machines under deterministic simulation (kvlease-sim::push): P's
//! `PushSource` and D's `PushSink` exchanging encoded messages through a seeded network, block
//! memory modelled; checked for U2, U4–U10, U12, P3, P4; each of vLLM's push bugs planted and
//! found.

use kvlease_sim::push::{report, search, PlantedPushBug, Push};
use std::time::Instant;

/// Seeds per run of the test command; `KVLEASE_SIM_SEEDS` raises it, `KVLEASE_SIM_SEED` replays one.
fn seeds() -> u64 {
    std::env::var("KVLEASE_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(500)
}

/// SPEC U7, U4, U5, P3, U8, U2, P2, P4, U6, U9, U10: no seed of push mode breaks an
/// invariant, leaves a block out of its pool or a request unended.
#[test]
fn u7_u4_u5_u8_u9_u10_every_push_seed_keeps_every_invariant() {
    if let Some(seed) = std::env::var("KVLEASE_SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        let out = Push::from_seed(seed).run();
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
fn the_same_push_seed_gives_the_same_run() {
    for seed in 1..=20 {
        let (a, b) = (Push::from_seed(seed).run(), Push::from_seed(seed).run());
        let first = a.trace.iter().zip(&b.trace).position(|(x, y)| x != y);
        assert!(
            first.is_none() && a.trace.len() == b.trace.len(),
            "seed {seed} diverges at {first:?}: {:?}",
            first.map(|i| (&a.trace[i], &b.trace[i]))
        );
        assert_eq!((a.used, a.recomputed, a.failed, a.aborted, a.writes), (b.used, b.recomputed, b.failed, b.aborted, b.writes));
    }
}

/// Runs the seeds with `bug` planted until one breaks an invariant; that seed replays to the same
/// violations, and keeps every invariant without the bug.
fn found(bug: PlantedPushBug, within: u64) -> kvlease_sim::push::Outcome {
    let found = search(1, within, Some(bug)).expect_err("no seed found the planted bug");
    let mut again = Push::from_seed(found.seed);
    again.planted = Some(bug);
    assert_eq!(again.run().violations, found.violations, "the seed replays");
    let clean = Push::from_seed(found.seed).run();
    assert!(clean.violations.is_empty(), "{}", report(&clean));
    println!("seed {} finds {bug:?}: {:?}", found.seed, found.violations);
    *found
}

fn names(out: &kvlease_sim::push::Outcome, id: &str) -> bool {
    out.violations.iter().any(|v| v.starts_with(id))
}

/// SPEC U2, P2 (vLLM #53095): planted, D's heartbeats name D's own request id, which P never
/// matches; some seed shows a push lease expiring although D's renewals of it kept reaching P.
#[test]
fn u2_p2_push_heartbeats_under_the_wrong_key_are_found() {
    let out = found(PlantedPushBug::HeartbeatWrongKey, 200);
    assert!(names(&out, "U2/P2"), "{}", report(&out));
}

/// SPEC U6 (vLLM #48633): planted, a push write that failed or could not be posted is only
/// logged on P; some seed shows D's tally never closed by P.
#[test]
fn u6_push_failures_only_logged_are_found() {
    let out = found(PlantedPushBug::FailureOnlyLogged, 200);
    assert!(names(&out, "U6"), "{}", report(&out));
}

/// SPEC U9 (vLLM #46283): planted, an abort on D never sends P its `PushRelease`; some seed
/// shows P's lease waiting for expiry after the abort.
#[test]
fn u9_push_aborts_not_sent_are_found() {
    let out = found(PlantedPushBug::AbortNotSent, 200);
    assert!(names(&out, "U9"), "{}", report(&out));
}

/// SPEC U4 (vLLM #55470): planted, P posts a write its gate refused (the lease ended) and the
/// transport reports it done; some seed shows a write posted after its lease ended, landing in
/// blocks D reused (U8) or scheduled over (U7).
#[test]
fn u4_push_writes_posted_without_the_gate_are_found() {
    let out = found(PlantedPushBug::WriteWithoutGate, 200);
    assert!(names(&out, "U4"), "{}", report(&out));
    assert!(names(&out, "U8") || names(&out, "U7/U12"), "and the write lands where it must not: {}", report(&out));
}
