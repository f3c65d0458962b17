//! SPEC D4 (HTTP half): a client that goes away aborts its request in the engine, streaming or
//! not, because hyper drops the handler future or the response body that owns the
//! `RequestStream`. On D this is what releases P's lease at once.

mod common;

use common::*;
use kvlease_engine::ModelConfig;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A slow model, so that a request is still running when the client leaves.
fn slow() -> ModelConfig {
    ModelConfig { decode_ms_per_token: 20.0, ..ModelConfig::default() }
}

async fn running(url: &str) -> f64 {
    metric(url, "kvlease_requests_running").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_aborts_the_request() {
    let s = TestServer::with_model(slow()).await;
    stream_then_leave(&s.url, &s.url).await;
    wait_until("the engine to abort the streamed request", || async { running(&s.url).await == 0.0 }).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_before_a_non_streaming_response_aborts_the_request() {
    let s = TestServer::with_model(slow()).await;
    let body = json!({"prompt": "a long story", "max_tokens": 2000, "ignore_eos": true}).to_string();
    let mut conn = tokio::net::TcpStream::connect(s.addr).await.expect("connect");
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        s.addr,
        body.len()
    );
    conn.write_all(head.as_bytes()).await.expect("write head");
    conn.write_all(body.as_bytes()).await.expect("write body");
    wait_until("the request to run", || async { running(&s.url).await == 1.0 }).await;
    // Nothing has been answered yet: the response comes only at the end.
    let mut buf = [0u8; 1];
    assert!(tokio::time::timeout(std::time::Duration::from_millis(100), conn.read(&mut buf)).await.is_err());
    drop(conn);
    wait_until("the engine to abort the non-streaming request", || async { running(&s.url).await == 0.0 }).await;
    s.stop().await;
}
