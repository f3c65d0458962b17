//! Issue 9, SPEC O3: no lease is held to expiry because a leg failed. Over real processes: invalid
//! fields through the proxy never reach P; a dead decoder and a decoder's refusals release P's
//! lease at once (within a second, with a 30 s lease); errors name the client's own values.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const LEASE_S: f64 = 30.0;

async fn prefill(p: &Proc, prompt: &str) -> Value {
    let leg = json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}});
    let (status, body) = post(&format!("{}/v1/completions", p.url), &leg).await;
    assert_eq!(status, 200, "{body}");
    body["kv_transfer_params"].clone()
}

/// P's leased blocks are back to 0 within a second, released (not expired).
async fn released_within_a_second(p: &Proc, what: &str) {
    let t0 = Instant::now();
    until(what, Duration::from_secs(1), || async { metric(&p.url, "kvlease_leased_blocks").await == 0.0 }).await;
    assert!(t0.elapsed() < Duration::from_secs(1), "{what}: took {:?}", t0.elapsed());
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"expired\"}").await, 0.0, "{what}: nothing waited for expiry");
}

/// Invalid fields through the proxy are refused before the P leg (P grants nothing; a prompt
/// too long for the client's max_tokens is refused by D and P's lease released at once, O3), and
/// the error names the client's value, not one the proxy made up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_fields_through_the_proxy_never_lease_and_name_the_clients_value() {
    let cfg = lease_config(LEASE_S);
    let p = Proc::serve("inv-p", &["--kv-transfer-config", &cfg, "--max-model-len", "64"]);
    let d = Proc::serve("inv-d", &["--kv-transfer-config", &cfg, "--max-model-len", "64"]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let url = format!("{}/v1/completions", proxy.url);
    for (body, param, names) in [
        (json!({"prompt": "hi", "max_tokens": -1}), "max_tokens", "-1"),
        (json!({"prompt": "hi", "stream_options": {"include_usage": true}}), "stream_options", "stream"),
        (json!({"prompt": "hi", "stop": [""]}), "stop", "empty"),
        (json!({"prompt": "hi", "tools": [{"type": "function"}]}), "tools", "tools"),
        (json!({"prompt": "a prompt of forty bytes, more or less...", "max_tokens": 100}), "max_tokens", "max_tokens (100)"),
    ] {
        let (status, v) = post(&url, &body).await;
        assert_eq!(status, 400, "{body} → {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        assert_eq!(v["error"]["code"], 400, "{v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(names), "{body}: the error names the client's value ({names}): {msg}");
        assert!(!msg.contains("max_tokens (1)"), "{msg}");
        released_within_a_second(&p, &format!("after {body}")).await;
    }
    // Only the over-length request reached P: the P leg asks for one token (as vLLM's toy proxy
    // does, so a vLLM P hands over the prompt's blocks only), so D's length check refuses it,
    // and the proxy released P's lease at once (checked in the loop).
    assert_eq!(metric(&p.url, "kvlease_leases_granted_total").await, 1.0, "no other invalid request reached P's lease table");
}

/// SPEC O3: a decoder that refuses a request carrying P's params before admitting it releases
/// P's lease at once, whoever sent it (here the client itself, no proxy involved).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoder_refusing_before_admission_releases_ps_lease_at_once() {
    let cfg = lease_config(LEASE_S);
    let p = Proc::serve("ref-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("ref-d", &["--kv-transfer-config", &cfg, "--max-model-len", "64"]);
    let prompt = "a prompt that P prefills and D then refuses";
    let url = format!("{}/v1/completions", d.url);
    for (extra, status) in [
        (json!({"max_tokens": 500}), 400),                 // over D's --max-model-len
        (json!({"max_tokens": 4, "model": "gpt-4"}), 404), // another model
        (json!({"max_tokens": 4, "logprobs": 99}), 400),   // a bad field
    ] {
        let params = prefill(&p, prompt).await;
        assert!(metric(&p.url, "kvlease_leased_blocks").await > 0.0);
        let mut body = json!({"prompt": prompt, "kv_transfer_params": params});
        body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        let (s, v) = post(&url, &body).await;
        assert_eq!(s, status, "{v}");
        released_within_a_second(&p, &format!("D refused {extra}")).await;
    }
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"released\"}").await, 3.0);
}

/// A dead decoder behind the proxy: the client gets a 502 saying what failed, and P's lease is
/// released at once through P's release endpoint. A decoder's refusal through the proxy too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_or_refusing_decoder_behind_the_proxy_strands_no_lease() {
    let cfg = lease_config(LEASE_S);
    let p = Proc::serve("dead-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("dead-d", &["--kv-transfer-config", &cfg, "--max-model-len", "64"]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let url = format!("{}/v1/completions", proxy.url);
    // D's max-model-len is smaller than P's: P prefills, D refuses.
    let (s, v) = post(&url, &json!({"prompt": "refused by the decoder only", "max_tokens": 200})).await;
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("200")), "{v}");
    released_within_a_second(&p, "D refused through the proxy").await;
    drop(d); // SIGKILL: D is gone
    let (s, v) = post(&url, &json!({"prompt": "the decoder is dead", "max_tokens": 4})).await;
    assert_eq!(s, 502, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("unreachable") && msg.contains("onnection refused"), "the real cause: {msg}");
    released_within_a_second(&p, "D dead").await;
    assert_eq!(metric(&p.url, "kvlease_leases_granted_total").await, 2.0);
}

/// P's `POST /kvlease/release` ends a lease given its signed params, once; altered params are
/// refused (SPEC S1) and leave the lease alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_endpoint_ends_a_lease_given_its_signed_params() {
    let p = Proc::serve("rel-p", &["--kv-transfer-config", &lease_config(LEASE_S)]);
    let params = prefill(&p, "a lease a router gives back").await;
    let url = format!("{}/kvlease/release", p.url);
    let mut forged = params.clone();
    forged["remote_lease_id"] = json!(params["remote_lease_id"].as_u64().unwrap_or(0) + 1);
    let (s, v) = post(&url, &json!({"kv_transfer_params": forged})).await;
    assert_eq!(s, 400, "{v}");
    assert!(metric(&p.url, "kvlease_leased_blocks").await > 0.0, "a forged release changes nothing");
    let (s, v) = post(&url, &params).await;
    assert_eq!((s, v["released"].clone()), (200, json!(true)), "{v}");
    released_within_a_second(&p, "release endpoint").await;
    let (s, v) = post(&url, &json!({"kv_transfer_params": params})).await;
    assert_eq!((s, v["released"].clone()), (200, json!(false)), "already ended: {v}");
}
