//! SPEC §10: `kvlease proxy` routes like vLLM's toy proxy: `/healthcheck`, P leg then D leg with
//! P's `kv_transfer_params`, P's errors passed through, and an unreachable upstream is a 502 in
//! the OpenAI error shape.

mod common;

use common::*;
use kvlease_server::{ProxyConfig, Upstream};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

struct TestProxy {
    url: String,
    _stop: oneshot::Sender<()>,
}

async fn start_proxy(prefillers: Vec<Upstream>, decoders: Vec<Upstream>) -> TestProxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(kvlease_server::proxy(ProxyConfig::new(prefillers, decoders), listener, Default::default(), async move {
        let _ = rx.await;
    }));
    TestProxy { url, _stop: tx }
}

/// A port nothing listens on.
async fn dead_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    l.local_addr().expect("addr").port()
}

fn upstream(addr: std::net::SocketAddr) -> Upstream {
    Upstream::http(addr.ip().to_string(), addr.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_healthcheck_answers_ok() {
    let dead = Upstream::http("127.0.0.1", dead_port().await);
    let p = start_proxy(vec![dead.clone()], vec![dead]).await;
    let r = client().get(format!("{}/healthcheck", p.url)).send().await.expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.expect("json"), json!({"status": "ok"}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_with_unreachable_upstream_answers_502_openai_json() {
    let dead = Upstream::http("127.0.0.1", dead_port().await);
    let p = start_proxy(vec![dead.clone()], vec![dead]).await;
    let r = client().post(format!("{}/v1/completions", p.url)).json(&json!({"prompt": "hi"})).send().await.expect("send");
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.expect("json");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("unreachable")), "{v}");
    assert_eq!((v["error"]["type"].clone(), v["error"]["code"].clone()), (json!("BadGatewayError"), json!(502)));

    // A reachable P with an unreachable D is a 502 as well.
    let pf = TestServer::start().await;
    let p = start_proxy(vec![upstream(pf.addr)], vec![Upstream::http("127.0.0.1", dead_port().await)]).await;
    let (status, v) = post(&format!("{}/v1/completions", p.url), &json!({"prompt": "hi", "max_tokens": 4})).await;
    assert_eq!(status, 502, "{v}");
    pf.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_passes_prefill_errors_through_unchanged() {
    let pf = TestServer::start().await;
    let dead = Upstream::http("127.0.0.1", dead_port().await);
    let p = start_proxy(vec![upstream(pf.addr)], vec![dead]).await;
    let (status, v) = post(&format!("{}/v1/completions", p.url), &json!({"prompt": ""})).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(assert_openai_error(status, &v)["param"], "prompt");
    pf.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_routes_prefill_then_decode_and_output_equals_a_local_run() {
    let pf = TestServer::start().await;
    let dc = TestServer::start().await;
    let p = start_proxy(vec![upstream(pf.addr)], vec![upstream(dc.addr)]).await;
    let body = json!({"prompt": "disaggregated serving with leases", "max_tokens": 12, "ignore_eos": true});

    let r = client().post(format!("{}/v1/completions", p.url)).header("x-request-id", "px-1").json(&body).send().await.expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-request-id"], "px-1");
    let via_proxy: Value = r.json().await.expect("json");
    assert_eq!(via_proxy["id"], "cmpl-px-1", "D saw the same request id");
    assert_eq!(metric(&pf.url, "kvlease_leases_granted_total").await, 1.0, "P granted a lease for D");
    wait_until("P to release the lease as transferred (D pulled the KV)", || async {
        metric(&pf.url, "kvlease_leases_released_total{reason=\"transferred\"}").await == 1.0
    })
    .await;

    let (status, local) = post(&format!("{}/v1/completions", dc.url), &body).await;
    assert_eq!(status, 200);
    assert_eq!(via_proxy["choices"][0]["text"], local["choices"][0]["text"], "SPEC D7: output independent of where KV came from");

    // Streaming through the proxy arrives as SSE.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = client().post(format!("{}/v1/completions", p.url)).json(&sbody).send().await.expect("send");
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().expect("ascii").starts_with("text/event-stream"));
    let events = sse_events(&r.text().await.expect("text"));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    pf.stop().await;
    dc.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_leaving_the_proxy_aborts_the_decode_request() {
    let slow = kvlease_engine::ModelConfig { decode_ms_per_token: 20.0, ..kvlease_engine::ModelConfig::default() };
    let pf = TestServer::with_model(slow.clone()).await;
    let dc = TestServer::with_model(slow).await;
    let p = start_proxy(vec![upstream(pf.addr)], vec![upstream(dc.addr)]).await;
    stream_then_leave(&p.url, &dc.url).await;
    wait_until("D to abort the request", || async { metric(&dc.url, "kvlease_requests_running").await == 0.0 }).await;
    pf.stop().await;
    dc.stop().await;
}
