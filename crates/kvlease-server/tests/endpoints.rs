//! SPEC §10 and §11: `/v1/models`, `/health` and `/metrics` (every contract metric name).

mod common;

use common::*;
use serde_json::Value;

/// SPEC §11: the metric names are part of the contract.
const SPEC_METRICS: [&str; 17] = [
    "kvlease_leases_active",
    "kvlease_leased_blocks",
    "kvlease_leases_granted_total",
    "kvlease_lease_renewals_total",
    "kvlease_leases_released_total",
    "kvlease_lease_lost_total",
    "kvlease_heartbeats_sent_total",
    "kvlease_heartbeats_received_total",
    "kvlease_heartbeat_lateness_seconds",
    "kvlease_lease_hold_seconds",
    "kvlease_messages_rejected_total",
    "kvlease_kv_blocks_free",
    "kvlease_kv_blocks_total",
    "kvlease_requests_waiting",
    "kvlease_requests_running",
    "kvlease_recomputed_requests_total",
    "kvlease_leases_released_total{reason=\"transferred\"}",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics_endpoints() {
    let s = TestServer::start().await;
    let c = client();

    let v: Value = c.get(format!("{}/v1/models", s.url)).send().await.expect("models").json().await.expect("json");
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "kvlease-synthetic");
    assert_eq!(v["data"][0]["object"], "model");

    let r = c.get(format!("{}/health", s.url)).send().await.expect("health");
    assert_eq!(r.status(), 200);

    let r = c.get(format!("{}/metrics", s.url)).send().await.expect("metrics");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/openmetrics-text; version=1.0.0; charset=utf-8");
    let text = r.text().await.expect("text");
    for name in SPEC_METRICS {
        assert!(text.contains(name), "/metrics lacks {name}:\n{text}");
    }
    for reason in ["transferred", "released", "expired", "shutdown"] {
        assert!(text.contains(&format!("kvlease_leases_released_total{{reason=\"{reason}\"}}")), "reason {reason}");
    }
    assert!(metric(&s.url, "kvlease_kv_blocks_total").await > 0.0);
    s.stop().await;
}
