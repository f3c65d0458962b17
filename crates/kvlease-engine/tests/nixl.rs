//! The lease protocol over NIXL (UCX over TCP on loopback), the engine production deployments
//! use: the same end-to-end checks as over the tcp agent. NIXL cannot refuse a read of a dead
//! lease, so the read-under-expiry test proves the engine's own safety: D uses bytes only after
//! P confirms the lease was live when the read completed (SPEC D6), and P quarantines blocks a
//! READ may still be reading (P5).
//!
//! Run with the library on `LD_LIBRARY_PATH` (scripts/install-nixl.sh prints its folder) and
//! one test at a time. Without the library each test says so loudly and passes, unless
//! `KVLEASE_REQUIRE_NIXL=1`, as in scripts/test.sh, where it fails.
#![cfg(feature = "nixl")]

mod common;
use common::*;
use kvlease_engine::TransportKind;

/// SPEC D7, P1, P3, P8 over NIXL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_d7_disaggregated_output_equals_local_and_lease_is_transferred() {
    if nixl_or_skip() {
        disaggregated_output_equals_local(TransportKind::Nixl).await;
    }
}

/// SPEC P5, D6, D7 over NIXL: P cannot refuse the READ of reused blocks; D must still never
/// use those bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_d6_lease_ending_under_a_read_never_yields_stale_bytes() {
    if nixl_or_skip() {
        lease_ending_under_a_read(TransportKind::Nixl).await;
    }
}
