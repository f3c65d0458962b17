//! Issue "bounded HTTP": stopping the server does not wait on connections that have no request
//! in flight — a client that opened a connection and sent nothing, or a kept-alive one — while a
//! response in flight is ended properly, never cut.

mod common;

use common::*;
use kvlease_engine::ModelConfig;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_closes_idle_connections_at_once_and_ends_the_response_in_flight() {
    let s = TestServer::with_model(ModelConfig { decode_ms_per_token: 5.0, ..ModelConfig::default() }).await;
    let silent = TcpStream::connect(s.addr).await.expect("connect");
    let mut kept = TcpStream::connect(s.addr).await.expect("connect");
    kept.write_all(b"GET /health HTTP/1.1\r\nhost: kvlease\r\n\r\n").await.expect("request");
    let mut buf = [0u8; 4096];
    let n = kept.read(&mut buf).await.expect("response");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", String::from_utf8_lossy(&buf[..n]));
    // A streamed response in flight (2000 tokens at 5 ms each), its first event read.
    let mut streaming = TcpStream::connect(s.addr).await.expect("connect");
    let body = br#"{"prompt": "a long story", "max_tokens": 2000, "ignore_eos": true, "stream": true}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvlease\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    streaming.write_all(head.as_bytes()).await.expect("head");
    streaming.write_all(body).await.expect("body");
    let mut answer = Vec::new();
    while !answer.windows(6).any(|w| w == b"data: ") {
        let n = tokio::time::timeout(DEADLINE, streaming.read(&mut buf)).await.expect("first event in time").expect("read");
        assert!(n > 0, "closed before the first event");
        answer.extend_from_slice(&buf[..n]);
    }

    let t0 = tokio::time::Instant::now();
    let stopping = tokio::spawn(s.stop());
    for (what, mut c) in [("silent", silent), ("kept alive", kept)] {
        let n = tokio::time::timeout(Duration::from_secs(2), c.read(&mut buf)).await.unwrap_or_else(|_| panic!("{what}: still open"));
        assert!(matches!(n, Ok(0) | Err(_)), "{what}: closed without an answer");
    }
    assert!(t0.elapsed() < Duration::from_secs(2), "idle connections closed at once: {:?}", t0.elapsed());
    tokio::time::timeout(DEADLINE, streaming.read_to_end(&mut answer)).await.expect("the stream ends").expect("read");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 200") && text.contains("transfer-encoding: chunked"), "{text:?}");
    assert!(answer.ends_with(b"0\r\n\r\n"), "the chunked response is ended, not cut: {:?}", &text[text.len().saturating_sub(200)..]);
    tokio::time::timeout(DEADLINE, stopping).await.expect("stopped").expect("stop task");
}
