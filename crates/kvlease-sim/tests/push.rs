//! Push mode's core machines under deterministic simulation (kvlease-sim::push): P's
//! `PushSource` and D's `PushSink` exchanging encoded messages through a seeded network, block
//! memory modelled; checked for U2, U4–U10, U12, P3, P4; each of vLLM's push bugs planted and
//! found.

mod common;

use kvlease_sim::push::{PlantedPushBug, Push};
use kvlease_sim::seeded::report;

/// SPEC U7, U4, U5, P3, U8, U2, P2, P4, U6, U9, U10: no seed of push mode breaks an
/// invariant, leaves a block out of its pool or a request unended.
#[test]
fn u7_u4_u5_u8_u9_u10_every_push_seed_keeps_every_invariant() {
    common::every_seed_keeps_every_invariant::<Push>(500);
}

/// The simulator is deterministic: one seed, one trace.
#[test]
fn the_same_push_seed_gives_the_same_run() {
    common::the_same_seed_gives_the_same_run::<Push>();
}

fn names(out: &kvlease_sim::push::Outcome, id: &str) -> bool {
    out.violations.iter().any(|v| v.starts_with(id))
}

/// SPEC U2, P2 (vLLM #53095): planted, D's heartbeats name D's own request id, which P never
/// matches; some seed shows a push lease expiring although D's renewals of it kept reaching P.
#[test]
fn u2_p2_push_heartbeats_under_the_wrong_key_are_found() {
    let out = common::found::<Push>(PlantedPushBug::HeartbeatWrongKey, 200);
    assert!(names(&out, "U2/P2"), "{}", report(&out));
}

/// SPEC U6 (vLLM #48633): planted, a push write that failed or could not be posted is only
/// logged on P; some seed shows D's tally never closed by P.
#[test]
fn u6_push_failures_only_logged_are_found() {
    let out = common::found::<Push>(PlantedPushBug::FailureOnlyLogged, 200);
    assert!(names(&out, "U6"), "{}", report(&out));
}

/// SPEC U9 (vLLM #46283): planted, an abort on D never sends P its `PushRelease`; some seed
/// shows P's lease waiting for expiry after the abort.
#[test]
fn u9_push_aborts_not_sent_are_found() {
    let out = common::found::<Push>(PlantedPushBug::AbortNotSent, 200);
    assert!(names(&out, "U9"), "{}", report(&out));
}

/// SPEC U4 (vLLM #55470): planted, P posts a write its gate refused (the lease ended) and the
/// transport reports it done; some seed shows a write posted after its lease ended, landing in
/// blocks D reused (U8) or scheduled over (U7).
#[test]
fn u4_push_writes_posted_without_the_gate_are_found() {
    let out = common::found::<Push>(PlantedPushBug::WriteWithoutGate, 200);
    assert!(names(&out, "U4"), "{}", report(&out));
    assert!(names(&out, "U8") || names(&out, "U7/U12"), "and the write lands where it must not: {}", report(&out));
}
