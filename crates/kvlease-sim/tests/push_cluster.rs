//! Push mode's real engines under deterministic simulation (kvlease-sim::push_cluster): seeded
//! clusters of push P and D engines (`NixlPushConnector`), routed by the core's route machine
//! with both legs at once, under faults; checked for D7, P3, P4 (reclaim), blocks, liveness,
//! U5 (transferred only when written), and in runs with no fault nothing recomputed and no
//! lease expired (U2, U9). vLLM's push bugs, planted in the engines' push driver, are found.

mod common;

use kvlease_core::pull::PlantedBug;
use kvlease_sim::push_cluster::PushCluster;
use kvlease_sim::seeded::{report, Seeded};

/// SPEC D7, P3, P4, U5, U2, U9, U10: no seed of the push cluster breaks an invariant.
#[test]
fn d7_p3_p4_u5_every_push_cluster_seed_keeps_every_invariant() {
    common::every_seed_keeps_every_invariant::<PushCluster>(150);
}

/// Seeds that found faults, each fixed since, keep every invariant: 20,231 (the simulator's
/// crash kept a killed P's agents open: every request to the restarted P waited out
/// `push_registration_timeout`), 3,099 (a restarted P kept the registrations of requests whose
/// prefill died with its previous life: SPEC D5), 21,836 (an answer nobody read kept its lease
/// to expiry: O4) and 10,809 (a failover verdict that beat the client's abort recomputed a
/// prompt nobody waited for). Since P grants a push lease before computing its own first token
/// (its steps now yield once between the two), 3,099 and 10,809 were checked to fail again with
/// their fix removed; 21,836 no longer does, and its fix is proven by the engine test
/// `disagg.rs` `o4_an_answer_nobody_read_releases_its_lease_at_once`; a failed handshake's
/// failover (also found by 3,099) is proven between processes (`push_faults.rs`,
/// `d5_o4_p_killed_under_a_registered_request_…`).
#[test]
fn the_seeds_that_found_push_faults_keep_every_invariant() {
    for seed in [3_099, 10_809, 20_231, 21_836] {
        let out = PushCluster::from_seed(seed).run();
        assert!(out.violations.is_empty(), "{}", report(&out));
    }
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
