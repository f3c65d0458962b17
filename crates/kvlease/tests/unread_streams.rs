//! Issue 22, clients that stop reading: a streamed answer whose client never reads was buffered in
//! full and its connection never dropped, for `kvlease serve` and `kvlease proxy`. Here the
//! clients are raw sockets with a 4 KiB receive buffer that send a streamed request and read
//! nothing (or read a little at a time); the servers are real processes on loopback.
//!
//! * `--http-write-timeout`: a connection whose client takes nothing for the timeout is reset,
//!   its request ends (aborted in the engine; on the proxy, the upstream request dropped, so D
//!   aborts and P keeps no lease), its slot returns, and a newcomer is served meanwhile.
//! * `--http-max-buffered-stream-bytes`: a stream whose client leaves more than the bound untaken
//!   is cut before the timeout, and the engine's memory stays within the bounds.
//! * A client that reads slowly but steadily is never cut, however long it takes.

mod common;

use common::*;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

/// The write timeout the tests give the servers, seconds.
const WRITE_TIMEOUT: f64 = 2.0;

/// Never-reading clients per test.
const CLIENTS: usize = 8;

/// A client's receive buffer: the kernel doubles it; a few SSE events fill it.
const CLIENT_RCVBUF: u32 = 4096;

/// Slack for a loaded 2-core machine on top of the write timeout and its quarter-timeout looks.
const CUT_SLACK: Duration = Duration::from_millis(2500);

fn addr_of(p: &Proc) -> SocketAddr {
    p.url.trim_start_matches("http://").parse().expect("host:port")
}

/// Opens a connection with a small receive buffer and sends a streamed completion on it.
async fn send_stream(addr: SocketAddr, body: &Value) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(CLIENT_RCVBUF).expect("SO_RCVBUF");
    let mut s = socket.connect(addr).await.expect("connect");
    let body = body.to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvlease\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.expect("head");
    s.write_all(body.as_bytes()).await.expect("body");
    s
}

/// A streamed completion of `tokens` tokens.
fn stream_of(tokens: u64) -> Value {
    json!({"prompt": "hello", "max_tokens": tokens, "ignore_eos": true, "stream": true})
}

/// Whether the server reset `s` (found without reading from it: the socket's pending error).
fn was_reset(s: &TcpStream) -> bool {
    matches!(s.take_error(), Ok(Some(_)))
}

/// Waits until every client was reset; returns how long after `sent` each was, failing after
/// `limit`.
async fn until_reset(clients: &[TcpStream], sent: Instant, limit: Duration) -> Vec<Duration> {
    let mut cut: Vec<Option<Duration>> = vec![None; clients.len()];
    while cut.iter().any(Option::is_none) {
        for (c, s) in cut.iter_mut().zip(clients) {
            if c.is_none() && was_reset(s) {
                *c = Some(sent.elapsed());
            }
        }
        let done = cut.iter().filter(|c| c.is_some()).count();
        assert!(sent.elapsed() < limit, "after {limit:?}, {done} of {} never-reading clients were cut", clients.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cut.into_iter().flatten().collect()
}

/// One sample of `kvlease_http_responses_aborted_total{reason}`.
async fn aborted(base: &str, reason: &str) -> f64 {
    metric(base, &format!("kvlease_http_responses_aborted_total{{reason=\"{reason}\"}}")).await
}

/// A normal request on a new connection is answered 200. A 503 for a full server (or for a
/// connection it evicted meanwhile) is retried for a second: a connection the test's own metric reads just closed may not be gone yet, and it is
/// not evicted while its answer is still being written; the never-reading clients' slots would
/// stay taken. So is a connection closed before any answer within that second (seen once in a
/// clean-clone CI run on a loaded 2-core machine, `IncompleteMessage`; not understood yet): a
/// newcomer that is not served within the second still fails the test.
async fn newcomer_is_served(base: &str) {
    let client = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(0).timeout(DEADLINE).build().expect("client");
    let t0 = Instant::now();
    loop {
        let sent = client.post(format!("{base}/v1/completions")).json(&json!({"prompt": "newcomer", "max_tokens": 2})).send().await;
        let r = match sent {
            Err(e) if e.is_request() && t0.elapsed() < Duration::from_secs(1) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            other => other.expect("the newcomer is answered"),
        };
        let status = r.status();
        let body = r.text().await.unwrap_or_default();
        // At its cap a server evicts an idle connection for a new one; a request that races
        // that eviction is told "the connection is closing: retry on a new one" (seen in a
        // clean-clone run with the one-thread proxy, whose accepts of nine newcomers at once can
        // come before it reads their heads), and is retried like the full server's 503.
        let turned_away = body.contains("connections open") || body.contains("retry on a new one");
        if status == 503 && turned_away && t0.elapsed() < Duration::from_secs(1) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        assert_eq!(status, 200, "a newcomer is served: {body}");
        return;
    }
}

/// Every connection slot of a server capped at `cap` is free: `cap` normal requests at once, each
/// on its own connection, are all served.
async fn every_slot_is_free(base: &str, cap: usize) {
    let waits: Vec<_> = (0..cap)
        .map(|_| {
            let base = base.to_string();
            tokio::spawn(async move { newcomer_is_served(&base).await })
        })
        .collect();
    for w in waits {
        w.await.expect("newcomer");
    }
}

/// Decode time per token on the engine that streams: 4,000 tokens take at least 12 s, so a
/// request that ends before that was aborted (and KV blocks for 8 of them).
const SLOW_DECODE: [&str; 4] = ["--decode-ms-per-token", "3", "--num-gpu-blocks", "4096"];
const SLOW_TOKENS: u64 = 4000;
const SLOW_NATURAL_END: Duration = Duration::from_secs(12);

/// Issue 22 against `serve`: 8 clients that never read their 4,000-token streams are reset
/// within the 2 s write timeout (+ a quarter, + slack) of their request, never before it; the
/// engine aborts their requests (nothing running and every KV block free well before the 12 s
/// they would take), a newcomer is served meanwhile (the 9th slot of `--http-max-connections 9`)
/// and all 9 slots are free afterwards. `kvlease_http_responses_aborted_total{reason=
/// "write_timeout"}` counts the 8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_cuts_streams_whose_clients_never_read_at_the_write_timeout() {
    let t = WRITE_TIMEOUT.to_string();
    let mut flags = vec!["--http-write-timeout", &t, "--http-max-connections", "9"];
    flags.extend(SLOW_DECODE);
    let serve = Proc::serve("unread", &flags);
    let sent = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(send_stream(addr_of(&serve), &stream_of(SLOW_TOKENS)).await);
    }
    until("every stream running", DEADLINE, || async { metric(&serve.url, "kvlease_requests_running").await == CLIENTS as f64 }).await;
    newcomer_is_served(&serve.url).await;
    let limit = Duration::from_secs_f64(WRITE_TIMEOUT * 1.25) + CUT_SLACK;
    let cuts = until_reset(&clients, sent, limit).await;
    eprintln!("serve: never-reading streams reset after {cuts:?}");
    assert!(cuts.iter().all(|c| c.as_secs_f64() >= WRITE_TIMEOUT), "cut before the write timeout: {cuts:?}");
    until_nothing_held(&serve.url, SLOW_NATURAL_END.saturating_sub(sent.elapsed())).await;
    assert_eq!(metric(&serve.url, "kvlease_requests_running").await, 0.0);
    assert_eq!(aborted(&serve.url, "write_timeout").await, CLIENTS as f64);
    assert_eq!(aborted(&serve.url, "buffer_full").await, 0.0);
    every_slot_is_free(&serve.url, 9).await;
}

/// Issue 22 against `proxy` (P and D behind it, D decoding 4,000 tokens in at least 12 s): the
/// proxy resets its 8 never-reading clients within its 2 s write timeout (+ a quarter, + slack),
/// drops their upstream requests so D aborts them (nothing running on D, every block free on P
/// and D, no lease on P, before the 12 s they would take), serves a newcomer meanwhile and has
/// its 9 slots free afterwards; it counts the 8 as `write_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_cuts_streams_whose_clients_never_read_at_the_write_timeout() {
    let p = Proc::serve("unread-p", &[]);
    let d = Proc::serve("unread-d", &SLOW_DECODE);
    let t = WRITE_TIMEOUT.to_string();
    let proxy = Proc::proxy_with(&[&p], &[&d], &["--http-write-timeout", &t, "--http-max-connections", "9"]);
    let sent = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(send_stream(addr_of(&proxy), &stream_of(SLOW_TOKENS)).await);
    }
    until("every stream decoding on D", DEADLINE, || async { metric(&d.url, "kvlease_requests_running").await == CLIENTS as f64 }).await;
    newcomer_is_served(&proxy.url).await;
    let limit = Duration::from_secs_f64(WRITE_TIMEOUT * 1.25) + CUT_SLACK;
    let cuts = until_reset(&clients, sent, limit).await;
    eprintln!("proxy: never-reading streams reset after {cuts:?}");
    assert!(cuts.iter().all(|c| c.as_secs_f64() >= WRITE_TIMEOUT), "cut before the write timeout: {cuts:?}");
    let left = SLOW_NATURAL_END.saturating_sub(sent.elapsed());
    until_nothing_held(&d.url, left).await;
    until_nothing_held(&p.url, left).await;
    assert_eq!(metric(&d.url, "kvlease_requests_running").await, 0.0);
    assert_eq!(aborted(&proxy.url, "write_timeout").await, CLIENTS as f64);
    every_slot_is_free(&proxy.url, 9).await;
}

/// VmRSS of a process, bytes.
fn rss(p: &Proc) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", p.pid())).expect("status");
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).expect("VmRSS").trim().trim_end_matches("kB").trim();
    kb.parse::<u64>().expect("kB") * 1024
}

/// Issue 22 (memory): 8 never-reading clients of 150,000-token streams (about 30 MB each) from
/// an engine that produces them as fast as it can, with `--http-max-buffered-stream-bytes 1 MiB`
/// and the default 30 s write timeout: each stream is reset once its client leaves more than
/// 1 MiB untaken, long before the write timeout; the engine's VmRSS grows by less than 32 MiB
/// (8 × 1 MiB and the allocator's slack; it grew by the whole answers before), it aborts the
/// requests and counts the 8 as `buffer_full`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_cuts_a_stream_its_client_leaves_over_the_bound() {
    // A small KV geometry, so 8 long sequences fit in a small pool.
    let serve = Proc::serve(
        "unread-bound",
        &[
            "--http-max-buffered-stream-bytes",
            "1048576",
            "--num-layers",
            "1",
            "--num-kv-heads",
            "1",
            "--head-dim",
            "1",
            "--dtype-bytes",
            "1",
            "--block-size",
            "1024",
            "--max-model-len",
            "200000",
            "--num-gpu-blocks",
            "2000",
        ],
    );
    let before = rss(&serve);
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (done, pid) = (done.clone(), serve.pid());
        tokio::spawn(async move {
            // `None` once the process is gone (the test failed).
            let rss = || {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse::<u64>().ok()?;
                Some(kb * 1024)
            };
            let mut max = 0;
            while !done.load(Ordering::Relaxed) {
                let Some(now) = rss() else { break };
                max = max.max(now);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            max
        })
    };
    let sent = Instant::now();
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(send_stream(addr_of(&serve), &stream_of(150_000)).await);
    }
    let cuts = until_reset(&clients, sent, Duration::from_secs(25)).await;
    done.store(true, Ordering::Relaxed);
    let grew = sampler.await.expect("sampler").saturating_sub(before);
    eprintln!("bound: never-reading streams reset after {cuts:?}; VmRSS {} MiB before, +{} MiB at most", before >> 20, grew >> 20);
    assert!(grew < 32 << 20, "VmRSS grew by {} MiB", grew >> 20);
    assert_eq!(aborted(&serve.url, "buffer_full").await, CLIENTS as f64);
    assert_eq!(aborted(&serve.url, "write_timeout").await, 0.0);
    until_nothing_held(&serve.url, DEADLINE).await;
    assert_eq!(metric(&serve.url, "kvlease_requests_running").await, 0.0);
}

/// Reads `s` 4 KiB at a time, one read every 250 ms, until `[DONE]`; returns what it read and how
/// long it took. Fails if the server closes the connection first.
async fn read_slowly(mut s: TcpStream) -> (String, Duration) {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    while !got.windows(12).any(|w| w == b"data: [DONE]") {
        assert!(t0.elapsed() < DEADLINE * 2, "the slow stream never ended");
        tokio::time::sleep(Duration::from_millis(250)).await;
        match s.read(&mut buf).await {
            Ok(0) => panic!("the server closed a slowly read stream after {:?} ({} bytes)", t0.elapsed(), got.len()),
            Err(e) => panic!("the server cut a slowly read stream after {:?} ({} bytes): {e}", t0.elapsed(), got.len()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), t0.elapsed())
}

/// The SSE events of a raw HTTP/1.1 answer with a chunked body.
fn body_of(raw: &str) -> String {
    let (_, mut rest) = raw.split_once("\r\n\r\n").expect("a head");
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size, 16).unwrap_or_else(|e| panic!("chunk size {size:?}: {e}"));
        if size == 0 || after.len() < size {
            break;
        }
        body.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    body
}

/// A client that reads 16 KiB/s from a stream produced faster: the server's socket always holds
/// bytes for it, for much longer than the write timeout, but the client takes some within every
/// quarter of it.
async fn slow_reader_is_never_cut(front: &Proc, others: &[&Proc]) {
    // About 140 KB of events, read in about 9 s.
    let mut request = stream_of(700);
    request["stream_options"] = json!({"include_usage": true});
    let s = send_stream(addr_of(front), &request).await;
    let (raw, took) = read_slowly(s).await;
    assert!(raw.starts_with("HTTP/1.1 200"), "{}", &raw[..raw.len().min(200)]);
    let body = body_of(&raw);
    eprintln!("slow reader: {} bytes in {took:?}", raw.len());
    let (_, _, done) = sse_text(&body, false).unwrap_or_else(|e| panic!("the stream failed: {e}"));
    assert!(done, "no [DONE]");
    let usage = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
        .expect("a usage event");
    assert_eq!(usage["completion_tokens"], 700, "every token arrived: {usage}");
    assert!(took.as_secs_f64() >= 3.0 * WRITE_TIMEOUT, "read in {took:?}: not slower than the write timeout, proves nothing");
    for p in std::iter::once(front).chain(others.iter().copied()) {
        assert_eq!(aborted(&p.url, "write_timeout").await, 0.0, "{}", p.name);
    }
}

/// Issue 22: with `--http-write-timeout 2`, a client that reads a 700-token stream 4 KiB every
/// 250 ms (about 9 s, while `serve` produces it in under 1 s) gets all of it: healthy streams are
/// never cut, however long the socket stays full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_never_cuts_a_client_that_reads_slowly() {
    let t = WRITE_TIMEOUT.to_string();
    let serve = Proc::serve("slow-reader", &["--http-write-timeout", &t, "--decode-ms-per-token", "1"]);
    slow_reader_is_never_cut(&serve, &[]).await;
}

/// Issue 22: the same slow reader through `proxy`, the proxy and D both with
/// `--http-write-timeout 2`: the proxy reads D's answer as its client takes it, and neither cuts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_never_cuts_a_client_that_reads_slowly() {
    let t = WRITE_TIMEOUT.to_string();
    let p = Proc::serve("slow-reader-p", &["--http-write-timeout", &t]);
    let d = Proc::serve("slow-reader-d", &["--http-write-timeout", &t, "--decode-ms-per-token", "1"]);
    let proxy = Proc::proxy_with(&[&p], &[&d], &["--http-write-timeout", &t]);
    slow_reader_is_never_cut(&proxy, &[&p, &d]).await;
}
