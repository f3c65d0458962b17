//! The policies of SPEC §1 side by side on the same seeded workload (a surge that queues
//! requests on D far longer than 30 s, then D crashes): only leases with heartbeats are both
//! safe (no garbage) and frugal (P reclaims within seconds of the crash).

use kvlease_sim::{simulate, Policy, Scenario};
use std::time::Duration;

/// Deterministic: a seed is a replayable test.
#[test]
fn same_seed_same_report() {
    let sc = Scenario { duration: Duration::from_secs(200), ..Scenario::default() };
    assert_eq!(simulate(&sc, Policy::Lease(30.0)), simulate(&sc, Policy::Lease(30.0)));
    assert_ne!(simulate(&sc, Policy::Lease(30.0)), simulate(&Scenario { seed: 2, ..sc }, Policy::Lease(30.0)));
}

/// SPEC §1, D1, D6, P4: under a surge a short fixed timeout serves garbage (vLLM #21570); a long
/// one pins a dead decoder's blocks for minutes; the lease does neither.
#[test]
fn leases_are_safe_under_surge_and_reclaim_after_a_crash() {
    let sc = Scenario::default();
    let short = simulate(&sc, Policy::Fixed(30.0));
    let long = simulate(&sc, Policy::Fixed(480.0));
    let lease = simulate(&sc, Policy::Lease(30.0));
    for r in [&short, &long, &lease] {
        println!("{r:?}");
    }
    assert!(short.garbage > 50, "a 30 s timeout frees blocks of requests still queued: {short:?}");
    assert_eq!(long.garbage, 0, "{long:?}");
    assert!(long.reclaim_after_crash.is_none_or(|s| s > 400.0), "480 s keeps dead blocks pinned: {long:?}");
    assert_eq!(lease.garbage, 0, "never decodes freed blocks: {lease:?}");
    assert!(lease.served > short.served, "the surge's requests keep their KV: {lease:?}");
    let reclaim = lease.reclaim_after_crash.expect("P reclaims");
    assert!(reclaim <= 31.0, "within L of the crash: {reclaim} s");
    assert!(lease.dead_block_seconds < long.dead_block_seconds / 5.0, "{lease:?} vs {long:?}");
}

/// Loss of 20 % of messages: whatever transfer is lost is recomputed, never decoded as garbage,
/// and most requests still get their KV from P (three lost heartbeats in a row are survived).
#[test]
fn lossy_network_costs_recomputes_never_garbage() {
    let sc = Scenario { loss: 0.2, d_crash: None, duration: Duration::from_secs(300), ..Scenario::default() };
    let lease = simulate(&sc, Policy::Lease(30.0));
    assert_eq!(lease.garbage, 0, "{lease:?}");
    assert!(lease.served > lease.recomputed, "{lease:?}");
    let short = simulate(&sc, Policy::Fixed(30.0));
    assert!(short.garbage > 0, "{short:?}");
}

/// vLLM's lease (no lease-lost answer, unfenced reads): when D falls silent longer than the
/// lease, P frees the queued requests' blocks and D later decodes whatever is in them; kvlease's
/// D finds those leases lost (SPEC D6) and recomputes instead.
#[test]
fn vllm_lease_decodes_garbage_where_kvlease_recomputes_after_a_long_silence() {
    let sc = Scenario { d_pause: Some((Duration::from_secs(250), Duration::from_secs(45))), ..Scenario::default() };
    let vllm = simulate(&sc, Policy::VllmLease(30.0));
    let lease = simulate(&sc, Policy::Lease(30.0));
    println!("{vllm:?}\n{lease:?}");
    assert!(vllm.garbage > 20, "vLLM's D reads freed blocks unconfirmed: {vllm:?}");
    assert_eq!(vllm.premature_frees, 0, "vLLM's D never learns of a lost lease: {vllm:?}");
    assert_eq!(lease.garbage, 0, "{lease:?}");
    assert!(lease.premature_frees > 0 && lease.recomputed >= lease.premature_frees, "lost leases recomputed: {lease:?}");
}

/// vLLM #58222: P's head-only expiry sweep stops at the first unexpired lease in grant order.
/// Two decoders, a surge that queues each far past L, then d0 crashes: d1 keeps renewing the
/// oldest leases, and the crashed decoder's expired leases behind them stay pinned until d1
/// has read everything granted before them; kvlease's reaper frees them within L.
#[test]
fn vllm_head_only_sweep_frees_a_crashed_decoders_blocks_late_behind_a_renewed_head() {
    let sc = Scenario {
        decoders: 2,
        surge: Some((Duration::from_secs(200), Duration::from_secs(400))),
        duration: Duration::from_secs(500),
        ..Scenario::default()
    };
    let vllm = simulate(&sc, Policy::VllmLease(30.0));
    let lease = simulate(&sc, Policy::Lease(30.0));
    println!("{vllm:?}\n{lease:?}");
    let (v, l) = (vllm.reclaim_after_crash.expect("vLLM reclaims in the end"), lease.reclaim_after_crash.expect("P reclaims"));
    assert!(l <= 31.0, "kvlease frees a crashed decoder's blocks within L: {lease:?}");
    assert!(v > l + 20.0, "the head-only sweep waits for the renewed head: {v} s vs {l} s");
    assert!(vllm.dead_block_seconds > 1.5 * lease.dead_block_seconds, "{vllm:?} vs {lease:?}");
    assert_eq!(lease.garbage, 0, "{lease:?}");
}

/// Bad input gets a clear error and loses nothing: traffic whose every request P's pool (a u32
/// count of blocks, sized for all of them) cannot hold is a failed run saying why, not a pool
/// silently too small (a saturated count) or a table of zeros.
#[test]
fn traffic_p_cannot_hold_is_a_failed_run_saying_why() {
    let sc = Scenario { rate: 1e6, duration: Duration::from_secs(86_400), ..Scenario::default() };
    assert_eq!(sc.p_blocks(), None);
    let r = simulate(&sc, Policy::Lease(30.0));
    assert!(r.failed.as_deref().is_some_and(|w| w.contains("cannot hold")), "{:?}", r.failed);
    assert_eq!(r.arrived, 0);
    // Just under the bound at 64 blocks a request, and the same traffic with bigger requests.
    let fits = Scenario { rate: 100.0, duration: Duration::from_secs(600), ..Scenario::default() };
    assert!(fits.p_blocks().is_some_and(|b| b as f64 >= fits.most_requests() * f64::from(fits.blocks)));
    assert_eq!(Scenario { blocks: u32::MAX / 2, ..fits }.p_blocks(), None, "a saturated count is refused");
}
