//! Dashboards and logs (issue 13, SPEC §11): a real Prometheus server scrapes a running P and D
//! while they serve, expire a lease, lose one and reject junk; through Prometheus's HTTP API, every
//! query of the Grafana dashboard (`dashboards/grafana-kvlease.json`) evaluates, and every metric
//! it uses exists and moves. And `--log-format json` writes one JSON object per line, each lease
//! line carrying the request id and the lease id.
//!
//! The Prometheus binary comes from `KVLEASE_PROMETHEUS` (set by `scripts/test.sh`, which fetches
//! it with `scripts/install-prometheus.sh`) or `prometheus` on the PATH; without either, the test
//! fails and says how to get it.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

const DASHBOARD: &str = include_str!("../../../dashboards/grafana-kvlease.json");
/// The one dashboard metric that is a constant: the pool's size.
const CONSTANT: &str = "kvlease_kv_blocks_total";

/// A Prometheus server, killed when dropped, with its data directory.
struct Prometheus {
    child: Child,
    url: String,
    dir: std::path::PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Starts Prometheus scraping `targets` (base URLs) every second.
fn prometheus(targets: &[&str]) -> Prometheus {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let dir = std::env::temp_dir().join(format!("kvlease-prometheus-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("data dir");
    let list: Vec<String> = targets.iter().map(|t| format!("\"{}\"", t.trim_start_matches("http://"))).collect();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: kvlease\n    static_configs:\n      - targets: [{}]\n",
        list.join(", ")
    );
    let config_file = dir.join("prometheus.yml");
    std::fs::write(&config_file, config).expect("config");
    let child = Command::new(server_binary("KVLEASE_PROMETHEUS", "prometheus", "scripts/install-prometheus.sh"))
        .arg(format!("--config.file={}", config_file.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn prometheus");
    Prometheus { child, url: format!("http://127.0.0.1:{port}"), dir }
}

/// An instant query; the result vector (empty when nothing matches). Panics on a query error.
async fn query(prom: &str, q: &str) -> Vec<Value> {
    let r = client().get(format!("{prom}/api/v1/query")).query(&[("query", q)]).send().await.expect("query");
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["status"], "success", "{q}: {v}");
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

/// Every PromQL expression of the dashboard, with the engine variable set to all engines.
fn dashboard_queries() -> Vec<String> {
    let dash: Value = serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for t in panel["targets"].as_array().expect("targets") {
            out.push(t["expr"].as_str().expect("expr").replace("$instance", ".*"));
        }
    }
    out
}

/// The metric names those expressions use.
fn dashboard_metrics(queries: &[String]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for q in queries {
        let mut rest = q.as_str();
        while let Some(i) = rest.find("kvlease_") {
            let tail = &rest[i..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            names.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    names
}

/// A disaggregated request's P leg: its params (the lease is granted).
async fn prefill(p: &str, prompt: &str) -> Value {
    let leg = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}});
    let (status, body) = post(&format!("{p}/v1/completions"), &leg).await;
    assert_eq!(status, 200, "{body}");
    body["kv_transfer_params"].clone()
}

/// The D leg with those params.
async fn decode(d: &str, prompt: &str, params: Value) {
    let leg = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params});
    let (status, body) = post(&format!("{d}/v1/completions"), &leg).await;
    assert_eq!(status, 200, "{body}");
}

/// SPEC §11 through Prometheus: the dashboard's queries evaluate and its metrics exist and move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_metrics_exist_and_move_in_a_real_prometheus() {
    let cfg = lease_config(3.0);
    let p = Proc::serve("obs-p", &["--kv-transfer-config", &cfg]);
    // One slot and a decode cost, so a request can be made to wait (and renew) behind another.
    let d = Proc::serve("obs-d", &["--kv-transfer-config", &cfg, "--max-num-seqs", "1", "--decode-ms-per-token", "10"]);
    let prom = prometheus(&[&p.url, &d.url]);
    until("Prometheus ready", DEADLINE, || async {
        client().get(format!("{}/-/ready", prom.url)).send().await.is_ok_and(|r| r.status().is_success())
    })
    .await;
    until("both engines scraped", DEADLINE, || async { query(&prom.url, "up == 1").await.len() == 2 }).await;

    // Leases granted, seen pinned by a scrape, then read by D (transferred, renewed, held).
    let prompts: Vec<String> = (0..6).map(|i| format!("observability prompt number {i} of the dashboard test")).collect();
    let mut params = Vec::new();
    for prompt in &prompts {
        params.push(prefill(&p.url, prompt).await);
    }
    until("a scrape sees the leases", DEADLINE, || async {
        !query(&prom.url, "max_over_time(kvlease_leases_active[1m]) > 0").await.is_empty()
    })
    .await;
    // The first decode waits behind a 1 s request, longer than the heartbeat interval (0.5 s):
    // D renews its lease (a read that follows at once needs no renewal, so without the wait
    // whether one happened was a race).
    let busy = occupy(&d, 100).await;
    for (prompt, params) in prompts.iter().zip(params) {
        decode(&d.url, prompt, params).await;
    }
    busy.await.expect("the busy request");
    assert!(metric(&p.url, "kvlease_lease_renewals_total").await >= 1.0, "D renewed while it waited");
    // A lease nobody renews expires (P4); D then finds it lost and recomputes (D3).
    let late = "a prompt whose decoder comes too late";
    let params = prefill(&p.url, late).await;
    until("the lease expired", DEADLINE, || async { metric(&p.url, "kvlease_leases_released_total{reason=\"expired\"}").await >= 1.0 })
        .await;
    decode(&d.url, late, params.clone()).await;
    // Junk on P's side channel is rejected and counted.
    let side = format!("{}:{}", params["remote_host"].as_str().expect("host"), params["remote_port"]);
    let mut s = tokio::net::TcpStream::connect(&side).await.expect("connect side channel");
    s.write_all(&[0xff; 64]).await.expect("write");
    let _ = s.shutdown().await;

    let queries = dashboard_queries();
    for q in &queries {
        query(&prom.url, q).await; // evaluates, or panics naming it
    }
    let metrics = dashboard_metrics(&queries);
    assert!(metrics.len() >= 14, "the dashboard covers SPEC §11: {metrics:?}");
    // Prometheus sees a move a scrape or two after it happened: wait, with a deadline.
    let mut missing: Vec<String> = metrics.into_iter().collect();
    let t0 = tokio::time::Instant::now();
    loop {
        missing = not_moving(&prom.url, missing).await;
        if missing.is_empty() {
            break;
        }
        assert!(t0.elapsed() < DEADLINE, "dashboard metrics that did not exist or move in Prometheus: {missing:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Those of `metrics` Prometheus has not seen existing (the constant) or moving (the rest).
async fn not_moving(prom: &str, metrics: Vec<String>) -> Vec<String> {
    let mut still = Vec::new();
    for m in metrics {
        let ok = if m == CONSTANT {
            !query(prom, &format!("{m} > 0")).await.is_empty()
        } else {
            // A histogram moves through its count.
            let series = m.strip_suffix("_bucket").map_or(m.clone(), |h| format!("{h}_count"));
            !query(prom, &format!("max_over_time({series}[10m]) - min_over_time({series}[10m]) > 0")).await.is_empty()
        };
        if !ok {
            still.push(m);
        }
    }
    still
}

/// `--log-format json`: every line is one JSON object; P's lease lines (granted, ended — an
/// expiry among them) and D's tracking line carry `request` and `lease_id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_put_request_and_lease_id_on_every_lease_line() {
    let dir = std::env::temp_dir().join(format!("kvlease-json-logs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = |n: &str| std::fs::File::create(dir.join(n)).expect("log file");
    let cfg = lease_config(2.0);
    let json_logs = ["--log-level", "debug", "--log-format", "json", "--kv-transfer-config", &cfg];
    let p = Proc::serve_logging_to("jl-p", &json_logs, file("p.log").into());
    let d = Proc::serve_logging_to("jl-d", &json_logs, file("d.log").into());
    let prompt = "a prompt whose lease is logged";
    let params = prefill(&p.url, prompt).await;
    decode(&d.url, prompt, params).await;
    let params = prefill(&p.url, "a lease left to expire").await;
    let lease = params["remote_lease_id"].as_u64().expect("lease id");
    until("the lease expired", DEADLINE, || async { metric(&p.url, "kvlease_leases_released_total{reason=\"expired\"}").await >= 1.0 })
        .await;
    let read = |n: &str| std::fs::read_to_string(dir.join(n)).expect("log");
    let lines = |text: String| -> Vec<Value> {
        text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"))).collect()
    };
    let (p_lines, d_lines) = (lines(read("p.log")), lines(read("d.log")));
    drop((p, d));
    let _ = std::fs::remove_dir_all(&dir);
    let lease_lines = |ls: &[Value], msg: &str| -> Vec<Value> { ls.iter().filter(|l| l["message"] == msg).cloned().collect() };
    let granted = lease_lines(&p_lines, "lease granted");
    let ended = lease_lines(&p_lines, "lease ended");
    let tracked = lease_lines(&d_lines, "renewing the prefill engine's lease");
    assert_eq!(granted.len(), 2, "{p_lines:#?}");
    assert_eq!(ended.len(), 2, "{p_lines:#?}");
    assert_eq!(tracked.len(), 1, "{d_lines:#?}");
    for l in granted.iter().chain(&ended).chain(&tracked) {
        assert!(l["request"].as_str().is_some_and(|r| !r.is_empty()), "request id: {l}");
        assert!(l["lease_id"].as_u64().is_some(), "lease id: {l}");
        assert!(l["timestamp"].is_string() && l["level"].is_string(), "{l}");
    }
    let expired = ended.iter().find(|l| l["reason"] == "expired").expect("the expiry is logged");
    assert_eq!(expired["lease_id"].as_u64(), Some(lease));
    assert_eq!(expired["level"], "INFO");
    assert!(ended.iter().any(|l| l["reason"] == "transferred"));
}
