//! Push mode (SPEC §13) over real processes: P and D are `kvlease serve` processes started with
//! vLLM's `"kv_connector":"NixlPushConnector"`, P writes the KV into D's registered blocks with
//! one-sided writes of the tcp agent, and a real HTTP client drives them.

mod common;
use common::*;
use serde_json::json;
use std::time::Duration;

/// SPEC U12, U1, U5, P3: push engines behind `kvlease proxy`, which forwards P's push answer to
/// D: every answer — plain and chat, streamed and not — equals a local run; P counts every
/// transfer as `transferred`, nothing is recomputed, and no lease or block is left on P.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u12_push_through_kvlease_proxy_equals_local() {
    push_through_kvlease_proxy("tcp").await;
}

/// The same over NIXL: `--transport nixl` on P and D, P's writes are NIXL WRITEs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_u12_push_through_kvlease_proxy_equals_local() {
    if nixl_or_skip() {
        push_through_kvlease_proxy("nixl").await;
    }
}

async fn push_through_kvlease_proxy(transport: &str) {
    let cfg = push_config(30.0, 30.0);
    let p = Proc::serve(&format!("push-p-{transport}"), &["--kv-transfer-config", &cfg, "--transport", transport]);
    let d = Proc::serve(&format!("push-d-{transport}"), &["--kv-transfer-config", &cfg, "--transport", transport]);
    let local = Proc::serve("push-local", &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let n = 24usize;
    answers_equal_local(&proxy.url, &local.url, n, 6).await;
    until("P holds no lease", Duration::from_secs(10), || async { metric(&p.url, "kvlease_leases_active").await == 0.0 }).await;
    assert_eq!(metric(&p.url, "kvlease_leases_granted_total").await, n as f64);
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, n as f64);
    assert_eq!(metric(&p.url, "kvlease_kv_blocks_free").await, metric(&p.url, "kvlease_kv_blocks_total").await);
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 0.0);
    assert_eq!(metric(&d.url, "kvlease_writes_refused_total").await, 0.0);
}

/// SPEC P4, U3, U10: P holds push leases nobody registers (their decoder was killed with
/// `SIGKILL`): nothing renews them, and P reclaims every one within L, every block back. And a
/// decoder handed vLLM's push router's params for a prefill that never happens computes the
/// prompt itself within `push_registration_timeout`, with the local answer (vLLM #48633 L1:
/// the timeout only dropped state). Fails when D's own write deadline is removed (the
/// timed-out branch of `PushSink::poll`): D never stops waiting and the client gives up at 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u10_p_reclaims_leases_of_a_killed_decoder_and_d_stops_waiting() {
    let lease = 3.0;
    let cfg = push_config(lease, 2.0);
    let p = Proc::serve("push-kill-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("push-kill-d", &["--kv-transfer-config", &cfg]);
    let local = Proc::serve("push-kill-local", &[]);
    // Four prefills whose decode legs never come.
    let mut kv_port = 0;
    for i in 0..4 {
        let leg = json!({"model": "kvlease-synthetic", "prompt": format!("stranded prompt {i}"), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}});
        let (status, body) = post(&format!("{}/v1/completions", p.url), &leg).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["kv_transfer_params"]["transfer_mode"], "push", "{body}");
        kv_port = body["kv_transfer_params"]["remote_port"].as_u64().expect("P's side-channel port");
    }
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 4.0);
    let t0 = std::time::Instant::now();
    d.signal("KILL");
    until("P reclaims every lease", Duration::from_secs_f64(lease * 2.0), || async {
        metric(&p.url, "kvlease_leases_active").await == 0.0
    })
    .await;
    assert!(t0.elapsed() < Duration::from_secs_f64(lease + 2.0), "reclaimed after {:?}", t0.elapsed());
    assert_eq!(metric(&p.url, "kvlease_kv_blocks_free").await, metric(&p.url, "kvlease_kv_blocks_total").await);
    // A decoder waiting for a prefill that never comes computes the prompt itself, in time.
    let d2 = Proc::serve("push-kill-d2", &["--kv-transfer-config", &cfg]);
    let prompt = "a decode leg whose prefill went nowhere";
    let (status, want) = post(
        &format!("{}/v1/completions", local.url),
        &json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 6, "ignore_eos": true}),
    )
    .await;
    assert_eq!(status, 200, "{want}");
    let params = json!({"do_remote_decode": false, "do_remote_prefill": true, "remote_engine_id": "push-kill-p",
        "remote_host": "127.0.0.1", "remote_port": kv_port, "tp_size": 1, "pp_size": 1, "remote_request_id": "nobody-prefilled-this"});
    let t1 = std::time::Instant::now();
    let (status, got) = post(
        &format!("{}/v1/completions", d2.url),
        &json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 6, "ignore_eos": true, "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(text_of(&got, false), text_of(&want, false));
    assert!(t1.elapsed() < Duration::from_secs(10), "waited {:?}", t1.elapsed());
    assert_eq!(metric(&d2.url, "kvlease_recomputed_requests_total").await, 1.0);
}

/// SPEC U2, D1 (vLLM #53095 and the queued decoder of issue 24): a decoder queued for twice
/// L behind a long request, with vLLM's push router's params (both legs at once, paired by the
/// router's request id): its heartbeats renew P's lease from the moment it admitted the
/// request, before it registered anything, so the lease outlives the queue; the KV is written
/// when its blocks come, not recomputed, and the answer is the local one. With renewals keyed
/// by anything but the router's id, or only from registration, P expires the lease at L and D
/// recomputes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u2_a_decoder_queued_past_l_keeps_the_lease_it_will_be_written_under() {
    let lease = 2.0;
    let cfg = push_config(lease, 30.0);
    let p = Proc::serve("push-queue-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("push-queue-d", &["--kv-transfer-config", &cfg, "--max-num-seqs", "1", "--decode-ms-per-token", "10"]);
    let local = Proc::serve("push-queue-local", &[]);
    let prompt = "a request that waits behind a long one";
    let body = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 6, "ignore_eos": true});
    let (status, want) = post(&format!("{}/v1/completions", local.url), &body).await;
    assert_eq!(status, 200, "{want}");
    // P's side-channel port, from a push answer of its own.
    let leg = json!({"model": "kvlease-synthetic", "prompt": "probe", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let (status, probe) = post(&format!("{}/v1/completions", p.url), &leg).await;
    assert_eq!(status, 200, "{probe}");
    let kv_port = probe["kv_transfer_params"]["remote_port"].as_u64().expect("P's side-channel port");
    // 450 tokens at 10 ms: D is busy for about 4.5 s, more than twice L.
    let hog = occupy(&d, 450).await;
    let router_id = "router-id-1";
    let decode = {
        let d_url = format!("{}/v1/completions", d.url);
        let mut b = body.clone();
        b["kv_transfer_params"] = json!({"do_remote_decode": false, "do_remote_prefill": true, "remote_engine_id": "push-queue-p",
            "remote_host": "127.0.0.1", "remote_port": kv_port, "tp_size": 1, "pp_size": 1, "remote_request_id": router_id});
        tokio::spawn(async move { post(&d_url, &b).await })
    };
    let prefill = client()
        .post(format!("{}/v1/completions", p.url))
        .header("X-Request-Id", router_id)
        .json(&json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}))
        .send()
        .await
        .expect("prefill leg");
    assert_eq!(prefill.status(), 200);
    let (status, got) = decode.await.expect("decode leg");
    assert_eq!(status, 200, "{got}");
    assert_eq!(text_of(&got, false), text_of(&want, false));
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 0.0, "written, not recomputed");
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"expired\"}").await, 1.0, "only the probe's lease expired");
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 1.0);
    hog.abort();
}
