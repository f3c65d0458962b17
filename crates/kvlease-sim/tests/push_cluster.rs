//! Push mode's real engines under deterministic simulation (kvlease-sim::push_cluster): seeded
//! clusters of push P and D engines (`NixlPushConnector`), routed by the core's route machine
//! with both legs at once, under faults; checked for D7, P3, P4 (reclaim), blocks, liveness,
//! U5 (transferred only when written), and in runs with no fault nothing recomputed and no
//! lease expired (U2, U9). vLLM's push bugs, planted in the engines' push driver, are found.

mod common;

use kvlease_core::pull::PlantedBug;
use kvlease_sim::push_cluster::PushCluster;
use kvlease_sim::seeded::report;

/// SPEC D7, P3, P4, U5, U2, U9, U10: no seed of the push cluster breaks an invariant.
#[test]
fn d7_p3_p4_u5_every_push_cluster_seed_keeps_every_invariant() {
    common::every_seed_keeps_every_invariant::<PushCluster>(150);
}

/// The simulator is deterministic: one seed, one trace.
#[test]
fn the_same_push_cluster_seed_gives_the_same_run() {
    common::the_same_seed_gives_the_same_run::<PushCluster>();
}

fn names(out: &kvlease_sim::seeded::Outcome<kvlease_sim::push_cluster::PushClusterCounts>, id: &str) -> bool {
    out.violations.iter().any(|v| v.starts_with(id))
}

/// SPEC U2 (vLLM #53095): planted, D's heartbeats name a key P never pairs by; some seed with
/// no fault shows a lease expiring on P while D waited for it, and the prompt recomputed.
#[test]
fn u2_engine_heartbeats_under_the_wrong_key_are_found() {
    let out = common::found::<PushCluster>(PlantedBug::PushHeartbeatWrongKey, 300);
    assert!(names(&out, "U2/U9") || names(&out, "D7/U10"), "{}", report(&out));
}

/// SPEC U9 (vLLM #46283): planted, a request D gives up (its client left) never tells P; some
/// seed with no fault shows P's lease waiting out its expiry.
#[test]
fn u9_engine_aborts_not_sent_are_found() {
    let out = common::found::<PushCluster>(PlantedBug::PushAbortNotSent, 300);
    assert!(names(&out, "U2/U9"), "{}", report(&out));
}

/// SPEC U6 (vLLM #48633): planted, a write that failed is only logged on P; some seed shows
/// its source blocks never back in P's pool (and D waiting out its deadline over them).
#[test]
fn u6_engine_write_failures_only_logged_are_found() {
    let out = common::found::<PushCluster>(PlantedBug::PushFailureOnlyLogged, 300);
    assert!(names(&out, "blocks") || names(&out, "P3") || names(&out, "P4"), "{}", report(&out));
}
