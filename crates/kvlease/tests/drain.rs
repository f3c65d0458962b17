//! SPEC O1 (issue 9): SIGTERM drains `kvlease serve` and `kvlease proxy`: new requests get 503
//! with `Retry-After`, the requests in flight complete, leases are released as `shutdown`, and
//! the process exits 0. Real processes, a real HTTP client.

mod common;
use common::*;
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A `kvlease` process whose stdout lines are all kept.
struct Watched {
    child: Child,
    url: String,
    lines: Arc<Mutex<Vec<String>>>,
    /// Reads stdout into `lines` until the process closes it.
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Watched {
    fn start(args: &[&str]) -> Watched {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvlease"))
            .args(args)
            .env("KVLEASE_TRANSFER_SECRET", SECRET)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kvlease");
        let stdout = child.stdout.take().expect("stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let kept = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line.clone());
                kept.lock().expect("lines").push(line);
            }
        });
        let first = rx.recv_timeout(DEADLINE).expect("start-up line");
        let url = first.split_whitespace().find(|w| w.starts_with("http://")).expect("url in the start-up line").to_string();
        Watched { child, url, lines, reader: Some(reader) }
    }

    fn sigterm(&self) {
        assert!(Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status().expect("kill").success());
    }

    /// Waits for the process to exit, and for its last line to be read; its exit code.
    async fn exit_code(&mut self) -> Option<i32> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                // The reader may still hold the last lines: it ends at the pipe's end of file.
                if let Some(r) = self.reader.take() {
                    r.join().expect("stdout reader");
                }
                return st.code();
            }
            assert!(t0.elapsed() < DEADLINE, "did not exit");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `serve`: requests in flight complete, a new one gets 503 + Retry-After, `/health` 503, the
/// lease P still held is released as `shutdown`, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_serve_in_flight_complete_new_ones_503_leases_released_exit_0() {
    let cfg = lease_config(30.0);
    let mut s = Watched::start(&[
        "serve",
        "--port",
        "0",
        "--engine-id",
        "drain-s",
        "--log-level",
        "warn",
        "--kv-transfer-config",
        &cfg,
        "--decode-ms-per-token",
        "40",
    ]);
    let url = format!("{}/v1/completions", s.url);
    // A lease P holds for a decoder that never comes.
    let (st, v) = post(&url, &json!({"prompt": "held", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}})).await;
    assert_eq!(st, 200, "{v}");
    let in_flight: Vec<_> = (0..4)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(
                async move { post(&url, &json!({"prompt": format!("in flight {i}"), "max_tokens": 25, "ignore_eos": true})).await },
            )
        })
        .collect();
    until("requests running", DEADLINE, || async { metric(&s.url, "kvlease_requests_running").await >= 4.0 }).await;
    s.sigterm();
    until("draining", DEADLINE, || async { client().get(format!("{}/health", s.url)).send().await.is_ok_and(|r| r.status() == 503) }).await;
    let r = client().post(&url).json(&json!({"prompt": "late", "max_tokens": 2})).send().await.expect("answered");
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    for t in in_flight {
        let (st, v) = t.await.expect("task");
        assert_eq!(st, 200, "an in-flight request completes: {v}");
        assert_eq!(v["usage"]["completion_tokens"], 25);
    }
    assert_eq!(s.exit_code().await, Some(0));
    let lines = s.lines.lock().expect("lines").clone();
    assert!(lines.iter().any(|l| l == "kvlease serve stopped: 1 leases released at shutdown"), "{lines:?}");
}

/// `proxy`: a streaming request in flight completes through the drain, a new one gets 503 +
/// Retry-After, exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_proxy() {
    let cfg = lease_config(30.0);
    let p = Proc::serve("drain-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("drain-d", &["--kv-transfer-config", &cfg, "--decode-ms-per-token", "40"]);
    let hp = |u: &str| u.trim_start_matches("http://").rsplit_once(':').map(|(h, p)| (h.to_string(), p.to_string())).expect("host:port");
    let ((ph, pp), (dh, dp)) = (hp(&p.url), hp(&d.url));
    let mut proxy = Watched::start(&[
        "proxy",
        "--port",
        "0",
        "--log-level",
        "warn",
        "--prefiller-hosts",
        &ph,
        "--prefiller-ports",
        &pp,
        "--decoder-hosts",
        &dh,
        "--decoder-ports",
        &dp,
    ]);
    let url = format!("{}/v1/completions", proxy.url);
    // It asks for the usage chunk: a stream that completed counts all 25 tokens (an EOS it
    // went past under `ignore_eos` is a token with no text, so words do not count them).
    let streaming = {
        let url = url.clone();
        tokio::spawn(async move {
            let body = json!({"prompt": "streamed through a drain", "max_tokens": 25, "ignore_eos": true, "stream": true,
                              "stream_options": {"include_usage": true}});
            let r = client().post(&url).json(&body).send().await.expect("send");
            assert_eq!(r.status().as_u16(), 200);
            r.text().await.expect("body")
        })
    };
    until("D decoding", DEADLINE, || async { metric(&d.url, "kvlease_requests_running").await >= 1.0 }).await;
    proxy.sigterm();
    until("draining", DEADLINE, || async { client().get(format!("{}/health", proxy.url)).send().await.is_ok_and(|r| r.status() == 503) })
        .await;
    let r = client().post(&url).json(&json!({"prompt": "late", "max_tokens": 2})).send().await.expect("answered");
    assert_eq!((r.status().as_u16(), r.headers()["retry-after"].to_str().ok()), (503, Some("1")));
    let sse = streaming.await.expect("task");
    let (_, _, done) = sse_text(&sse, false).unwrap_or_else(|e| panic!("stream failed: {e}"));
    let tokens = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find_map(|v| v["usage"]["completion_tokens"].as_u64());
    assert!(done && tokens == Some(25), "the stream in flight completed: {sse}");
    assert_eq!(proxy.exit_code().await, Some(0));
}

/// SPEC O1 + O2: a decoder that is draining turns new requests away unread (503 +
/// Retry-After); the proxy sends the decode leg to another decoder with the same params, and
/// the client never sees the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_routes_around_a_draining_decoder() {
    let cfg = lease_config(30.0);
    let p = Proc::serve("dr-p", &["--kv-transfer-config", &cfg]);
    let d0 = Proc::serve("dr-d0", &["--kv-transfer-config", &cfg, "--decode-ms-per-token", "40"]);
    let d1 = Proc::serve("dr-d1", &["--kv-transfer-config", &cfg]);
    let local = Proc::serve("dr-local", &[]);
    // Probes far apart: the draining decoder stays in rotation, so legs do reach it.
    let proxy = Proc::proxy_with(&[&p], &[&d0, &d1], &["--health-interval", "60"]);
    let keep_busy = {
        let url = format!("{}/v1/completions", d0.url);
        tokio::spawn(async move { post(&url, &json!({"prompt": "keeps d0 draining", "max_tokens": 60, "ignore_eos": true})).await })
    };
    until("d0 busy", DEADLINE, || async { metric(&d0.url, "kvlease_requests_running").await >= 1.0 }).await;
    d0.signal("TERM");
    until("d0 draining", DEADLINE, || async { client().get(format!("{}/health", d0.url)).send().await.is_ok_and(|r| r.status() == 503) })
        .await;
    let body = json!({"prompt": "routed around the drain", "max_tokens": 5, "ignore_eos": true});
    let (_, want) = post(&format!("{}/v1/completions", local.url), &body).await;
    for _ in 0..4 {
        let (s, v) = post(&format!("{}/v1/completions", proxy.url), &body).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(text_of(&v, false), text_of(&want, false));
    }
    assert!(metric(&proxy.url, "kvlease_proxy_retries_total").await >= 1.0, "some leg met the draining decoder and was retried");
    until("P holds no lease", Duration::from_secs(5), || async { metric(&p.url, "kvlease_leased_blocks").await == 0.0 }).await;
    let (s, _) = keep_busy.await.expect("task");
    assert_eq!(s, 200, "the request in flight on the draining decoder completed");
}
