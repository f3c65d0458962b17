//! The vLLM connector's protocol path under deterministic simulation (kvlease-sim::connector):
//! P's `IssuedLeases` and `Issuer`, D's `Renewer` and `Pull`, wired as `python/kvlease/vllm.py`
//! wires them, under seeded faults; checked for P5/D6, P2/D6, P3, P4, held messages, S5 and
//! liveness.

mod common;

use kvlease_core::pull::PlantedBug;
use kvlease_sim::connector::Connector;
use kvlease_sim::seeded::report;

/// SPEC P5, D6, P2, P3, P4, S5: no seed of the connector's path breaks an invariant, nor
/// leaves a message held past E or a request unended.
#[test]
fn p5_d6_p3_p4_s5_every_connector_seed_keeps_every_invariant() {
    common::every_seed_keeps_every_invariant::<Connector>(200);
}

/// The simulator is deterministic: one seed, one trace.
#[test]
fn the_same_connector_seed_gives_the_same_run() {
    common::the_same_seed_gives_the_same_run::<Connector>();
}

/// SPEC P2, D6 (the bug fixed in 6ee67ac): planted, a renewal that overtakes its lease's grant on
/// a vLLM P is answered "not lost" and dropped, not applied at the grant; some seed shows P
/// expiring a lease before the E its acknowledgement promised D.
#[test]
fn p2_d6_a_planted_dropped_early_renewal_is_found() {
    let out = common::found::<Connector>(PlantedBug::EarlyRenewalDropped, 500);
    assert!(out.violations.iter().any(|v| v.starts_with("P2/D6")), "{}", report(&out));
}

/// SPEC P5, D6: planted, P confirms a `ReadDone` of a lease that expired as if it had ended by its
/// read; some seed shows D decoding from blocks P had reused.
#[test]
fn p5_d6_a_planted_confirmation_after_expiry_is_found() {
    let out = common::found::<Connector>(PlantedBug::ConfirmExpiredRead, 500);
    assert!(out.violations.iter().any(|v| v.starts_with("P5/D6")), "{}", report(&out));
}
