//! End to end over real processes and sockets: P, D and the proxy as separate `kvlease`
//! processes, a real HTTP client, KV pulled by one-sided reads over the TCP transport.

mod common;
use common::*;
use serde_json::json;
use std::time::Duration;

/// SPEC D7, P3, S1, §10: 50 completions through the proxy — plain and chat, streaming and not —
/// each equal to the same request run locally on a single engine; afterwards P holds no lease
/// and every lease was released as `transferred`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_requests_through_the_proxy_match_local_and_release_every_lease() {
    fifty_requests_through_the_proxy("tcp").await;
}

/// The same over NIXL (UCX over TCP): `--transport nixl` on P and D, nothing else changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_fifty_requests_through_the_proxy_match_local_and_release_every_lease() {
    if nixl_or_skip() {
        fifty_requests_through_the_proxy("nixl").await;
    }
}

/// `kvlease proxy --threads 2` (the relaying spread over two threads, not the one-thread
/// default every other test runs): the same answers as a single engine, every lease
/// `transferred` (SPEC D7, P3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_on_two_threads_answers_as_local() {
    let p = Proc::serve("threads-p", &[]);
    let d = Proc::serve("threads-d", &[]);
    let local = Proc::serve("threads-local", &[]);
    let proxy = Proc::proxy_with(&[&p], &[&d], &["--threads", "2"]);
    answers_equal_local(&proxy.url, &local.url, 16, 8).await;
    until("P holds no lease", Duration::from_secs(10), || async { metric(&p.url, "kvlease_leases_active").await == 0.0 }).await;
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 16.0);
}

/// Without libnixl_capi.so, `serve --transport nixl` stops at start-up saying how to get it:
/// no silent fallback to tcp, no abort from inside the library.
#[test]
fn nixl_missing_library_is_a_clear_start_up_error() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["serve", "--port", "0", "--transport", "nixl"])
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("run kvlease");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert_ne!(out.status.code(), None, "killed by a signal (an abort inside NIXL?): {stderr}");
    assert!(stderr.contains("install-nixl.sh"), "{stderr}");
}

async fn fifty_requests_through_the_proxy(transport: &str) {
    let cfg = lease_config(30.0);
    let p = Proc::serve("e2e-p", &["--kv-transfer-config", &cfg, "--transport", transport]);
    let d = Proc::serve("e2e-d", &["--kv-transfer-config", &cfg, "--transport", transport]);
    let local = Proc::serve("e2e-local", &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    answers_equal_local(&proxy.url, &local.url, 50, 8).await;
    until("P holds no lease", Duration::from_secs(10), || async { metric(&p.url, "kvlease_leases_active").await == 0.0 }).await;
    assert_eq!(metric(&p.url, "kvlease_leases_granted_total").await, 50.0);
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 50.0);
    for reason in ["released", "expired", "shutdown"] {
        assert_eq!(metric(&p.url, &format!("kvlease_leases_released_total{{reason=\"{reason}\"}}")).await, 0.0, "{reason}");
    }
    assert_eq!(metric(&p.url, "kvlease_leased_blocks").await, 0.0);
    assert_eq!(metric(&p.url, "kvlease_kv_blocks_free").await, metric(&p.url, "kvlease_kv_blocks_total").await);
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 0.0);
    assert_eq!(metric(&d.url, "kvlease_lease_lost_total").await, 0.0);
}

/// SPEC S1, S4: with a secret configured on both, D refuses altered or unsigned params with a
/// 400 naming kv_transfer_params, and P's lease stays untouched; params of another prompt are
/// computed locally (S4), and the lease they name is released at once (O4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s1_altered_or_unsigned_params_get_400_and_nothing_is_read() {
    let p = Proc::serve("s1-p", &[]);
    let d = Proc::serve("s1-d", &[]);
    let prompt = "the lease is signed by the prefill engine";
    let leg = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}});
    let (status, body) = post(&format!("{}/v1/completions", p.url), &leg).await;
    assert_eq!(status, 200, "{body}");
    let params = body["kv_transfer_params"].clone();
    assert!(params["kvlease_signature"].is_string(), "{params}");
    // SPEC §10: vLLM's field names, so a router written for vLLM passes them through.
    for key in ["remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port", "tp_size", "remote_num_tokens"] {
        assert!(!params[key].is_null(), "{key} missing: {params}");
    }
    assert!(params["remote_blocks_expiry_time"].as_f64().is_some_and(|t| t > 0.0), "{params}");
    let mut altered = params.clone();
    altered["remote_lease_id"] = json!(params["remote_lease_id"].as_u64().unwrap_or(0) + 1);
    let mut unsigned = params.clone();
    unsigned.as_object_mut().expect("object").remove("kvlease_signature");
    let mut other_prompt =
        json!({"model": "kvlease-synthetic", "prompt": "another prompt of mine", "max_tokens": 4, "kv_transfer_params": params.clone()});
    for (what, body) in [
        ("altered", json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 4, "kv_transfer_params": altered})),
        ("unsigned", json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 4, "kv_transfer_params": unsigned})),
    ] {
        let (status, err) = post(&format!("{}/v1/completions", d.url), &body).await;
        assert_eq!(status, 400, "{what}: {err}");
        assert_eq!(err["error"]["param"], "kv_transfer_params", "{what}: {err}");
    }
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 1.0, "refused params released nothing");
    // The genuine params still pull.
    let good = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params.clone()});
    let (status, body) = post(&format!("{}/v1/completions", d.url), &good).await;
    assert_eq!(status, 200, "{body}");
    until("transferred", Duration::from_secs(10), || async {
        metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await == 1.0
    })
    .await;
    // Genuine params of another prompt are computed locally, never read (S4), and the lease they
    // name is released at once (O4).
    let (status, body) = post(&format!("{}/v1/completions", p.url), &leg).await;
    assert_eq!(status, 200, "{body}");
    other_prompt["kv_transfer_params"] = body["kv_transfer_params"].clone();
    let (status, body) = post(&format!("{}/v1/completions", d.url), &other_prompt.take()).await;
    assert_eq!(status, 200, "another prompt is computed locally: {body}");
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 1.0);
    until("the other prompt's lease released (O4)", Duration::from_secs(2), || async {
        metric(&p.url, "kvlease_leases_released_total{reason=\"released\"}").await == 1.0
    })
    .await;
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 0.0);
}

/// SPEC P7, S2: junk on P's handshake side channel — an oversized frame header, a well-framed
/// message that is not a proof, vLLM's text heartbeat — is refused before P reads a frame and
/// counted (no proof of the secret: `unauthenticated`; a proof cut short: `malformed`), and P
/// goes on serving disaggregated requests. Junk after a valid proof: `side_channel` unit tests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p7_junk_on_the_side_channel_is_counted_and_harmless() {
    use tokio::io::AsyncWriteExt;
    let p = Proc::serve("p7-p", &[]);
    let d = Proc::serve("p7-d", &[]);
    let leg = json!({"model": "kvlease-synthetic", "prompt": "junk first", "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}});
    let (_, body) = post(&format!("{}/v1/completions", p.url), &leg).await;
    let params = body["kv_transfer_params"].clone();
    let side = format!("{}:{}", params["remote_host"].as_str().expect("host"), params["remote_port"]);
    let mut oversized = vec![0xff, 0xff, 0xff, 0xff];
    oversized.resize(64, 7); // a length far over the limit, and as long as a proof
    let junk: [&[u8]; 3] = [
        &oversized,
        &[0, 0, 0, 6, b'K', b'L', 2, 5, 0, 0], // a well-framed LeaseLost: cut short
        &[0, 0, 0, 8, b'H', b'B', b':', b'1', b',', b'2', b',', b'3'], // vLLM's text heartbeat: cut short
    ];
    for bytes in junk {
        let mut s = tokio::net::TcpStream::connect(&side).await.expect("connect side channel");
        s.write_all(bytes).await.expect("write");
        let _ = s.shutdown().await;
    }
    until("junk counted", Duration::from_secs(10), || async {
        metric(&p.url, "kvlease_messages_rejected_total{reason=\"unauthenticated\"}").await >= 1.0
            && metric(&p.url, "kvlease_messages_rejected_total{reason=\"malformed\"}").await >= 2.0
    })
    .await;
    let good = json!({"model": "kvlease-synthetic", "prompt": "junk first", "max_tokens": 3, "kv_transfer_params": params});
    let (status, body) = post(&format!("{}/v1/completions", d.url), &good).await;
    assert_eq!(status, 200, "{body}");
    until("transferred", Duration::from_secs(10), || async {
        metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await == 1.0
    })
    .await;
}
