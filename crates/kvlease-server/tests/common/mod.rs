//! Shared by the HTTP tests: an in-process `serve` on 127.0.0.1:0 with a real engine, a client,
//! SSE parsing, metric reading, and waiting on conditions with deadlines.
#![allow(dead_code)] // each test binary uses a different subset

use kvlease_engine::{EngineConfig, EngineHandle, ModelConfig};
use serde_json::Value;
use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub const DEADLINE: Duration = Duration::from_secs(20);

pub struct TestServer {
    pub url: String,
    pub addr: std::net::SocketAddr,
    pub engine: EngineHandle,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl TestServer {
    pub async fn start() -> TestServer {
        TestServer::with_model(ModelConfig::default()).await
    }

    pub async fn with_model(model: ModelConfig) -> TestServer {
        let cfg = EngineConfig { engine_id: format!("test-{}", kvlease_server::ids::random_hex(4)), model, ..EngineConfig::default() };
        let engine = EngineHandle::start(cfg).await.expect("engine starts");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(kvlease_server::serve(engine.clone(), listener, Default::default(), async move {
            let _ = rx.await;
        }));
        TestServer { url: format!("http://{addr}"), addr, engine, stop: Some(tx), task: Some(task) }
    }

    /// Sends the shutdown signal and waits for `serve` to return.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(DEADLINE, task).await.expect("serve returns after shutdown").expect("serve task").expect("serve ok");
        }
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().expect("client")
}

/// Posts JSON, returns (status, parsed body).
pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).json(body).send().await.expect("send");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}")))
}

/// The `data:` payloads of an SSE body, in order (`[DONE]` included as a string).
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("SSE event without `data: `: {e:?}")).to_owned())
        .collect()
}

/// Asserts vLLM's error envelope and returns the error object.
pub fn assert_openai_error(status: u16, body: &Value) -> &Value {
    assert!((400..500).contains(&status), "expected a 4xx, got {status}: {body}");
    let e = &body["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "error.message: {body}");
    assert!(e["type"].as_str().is_some_and(|t| t.ends_with("Error")), "vLLM's error type: {body}");
    assert_eq!(e["code"], status, "vLLM's envelope: code is the status as an integer: {body}");
    assert!(e.get("param").is_some(), "param present: {body}");
    e
}

/// The value of an unlabelled metric in `/metrics`.
pub async fn metric(url: &str, name: &str) -> f64 {
    let text = client().get(format!("{url}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// Polls `cond` until it holds, failing after [`DEADLINE`].
pub async fn wait_until<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let polled = async {
        while !cond().await {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(DEADLINE, polled).await.unwrap_or_else(|_| panic!("timed out waiting for {what}"));
}

/// Starts a long streamed completion at `url`, waits for its first chunk while `running_at`
/// shows it running, then goes away (drops the body): the disconnect tests' client.
pub async fn stream_then_leave(url: &str, running_at: &str) {
    let r = client()
        .post(format!("{url}/v1/completions"))
        .json(&serde_json::json!({"prompt": "a long story", "max_tokens": 2000, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let first = tokio::time::timeout(DEADLINE, futures_util::StreamExt::next(&mut body)).await.expect("first chunk in time");
    assert!(first.is_some_and(|c| c.is_ok()));
    assert_eq!(metric(running_at, "kvlease_requests_running").await, 1.0);
    drop(body);
}
