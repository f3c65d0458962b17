//! Issue "trust on the wire", bounded HTTP: `kvlease serve` and `kvlease proxy` cut clients that
//! send a head or a body too slowly at their timeouts, keep serving through a flood of idle
//! connections, answer a newcomer 503 when every connection is busy, and keep their memory
//! bounded while a hundred 4 MB bodies stay unfinished. Real processes on loopback; in each
//! test, normal requests during the attack are compared with normal requests before it.

mod common;

use common::*;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// Normal requests per latency sample (the median is compared).
const SAMPLES: usize = 9;

/// Slack for a loaded 2-core machine: a slow client must be cut within its timeout plus this.
const CUT_SLACK: Duration = Duration::from_millis(1500);

/// The listener under attack, and the engines behind it when it is the proxy.
struct Target {
    front: Proc,
    _engines: Vec<Proc>,
}

impl Target {
    fn serve(flags: &[&str]) -> Target {
        Target { front: Proc::serve("limits", flags), _engines: Vec::new() }
    }

    fn proxy(flags: &[&str]) -> Target {
        let p = Proc::serve("limits-p", &[]);
        let d = Proc::serve("limits-d", &[]);
        let front = Proc::proxy_with(&[&p], &[&d], flags);
        Target { front, _engines: vec![p, d] }
    }

    fn addr(&self) -> SocketAddr {
        self.front.url.trim_start_matches("http://").parse().expect("host:port")
    }

    /// VmRSS of the listening process, bytes.
    fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.front.pid())).expect("status");
        let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).expect("VmRSS").trim().trim_end_matches("kB").trim();
        kb.parse::<u64>().expect("kB") * 1024
    }

    /// Open file descriptors of the listening process.
    fn open_files(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.front.pid())).expect("fd").count()
    }

    /// The median latency of [`SAMPLES`] normal completions, each on a new connection.
    async fn median_latency(&self) -> Duration {
        let client = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(0).timeout(DEADLINE).build().expect("client");
        let mut took = Vec::new();
        for _ in 0..SAMPLES {
            let t0 = Instant::now();
            let r = client
                .post(format!("{}/v1/completions", self.front.url))
                .json(&json!({"prompt": "hello", "max_tokens": 2}))
                .send()
                .await
                .expect("a normal request is answered");
            let status = r.status();
            let body = r.text().await.expect("body");
            assert_eq!(status, 200, "a normal request is served: {body}");
            took.push(t0.elapsed());
        }
        took.sort();
        took[SAMPLES / 2]
    }
}

/// Normal requests under attack take at most twice as long as before it (median), plus 50 ms
/// for a noisy machine.
fn assert_latency_kept(what: &str, idle: Duration, attacked: Duration) {
    eprintln!("{what}: median latency idle {idle:?}, under attack {attacked:?}");
    assert!(attacked <= idle * 2 + Duration::from_millis(50), "{what}: idle {idle:?}, under attack {attacked:?}");
}

/// The response's status code, from a raw HTTP/1.1 answer.
fn status_of(raw: &[u8]) -> Option<u16> {
    let text = std::str::from_utf8(raw).ok()?;
    text.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// The JSON body of a raw HTTP/1.1 answer.
fn json_of(raw: &[u8]) -> Value {
    let text = String::from_utf8_lossy(raw);
    let (_, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no body in {text:?}"));
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
}

/// Waits until the listener has at least `n` more open files than `before`: the attackers'
/// connections are in.
async fn until_connected(target: &Target, before: usize, n: usize) {
    until("the attackers' connections", DEADLINE, || async { target.open_files() >= before + n }).await;
}

/// Keeps a connection sending a request head a byte every 100 ms (never finishing it), and a new
/// one whenever the server closes it, until `stop`; returns how long the server let each live.
async fn trickle_heads(addr: SocketAddr, stop: Arc<AtomicBool>) -> Vec<Duration> {
    let head = b"POST /v1/completions HTTP/1.1\r\nhost: kvlease\r\ncontent-type: application/json\r\nx-slow: ";
    let mut lives = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let t0 = Instant::now();
        let mut sent = 0;
        let mut buf = [0u8; 1024];
        loop {
            assert!(t0.elapsed() < DEADLINE, "a slow head was never cut");
            tokio::select! {
                r = s.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(_) => panic!("a head that never ended got an answer: {:?}", String::from_utf8_lossy(&buf)),
                },
                () = tokio::time::sleep(Duration::from_millis(100)) => {
                    let byte = head.get(sent).copied().unwrap_or(b'a');
                    sent += 1;
                    if s.write_all(&[byte]).await.is_err() {
                        break;
                    }
                }
            }
        }
        lives.push(t0.elapsed());
    }
    lives
}

/// Keeps a connection sending a request whose body comes a byte every 100 ms (`trickle`) or
/// stops half-way, and a new one whenever the server answers, until `stop`; returns, for each,
/// how long after its head the answer came, and the answer.
async fn slow_bodies(addr: SocketAddr, trickle: bool, stop: Arc<AtomicBool>) -> Vec<(Duration, Vec<u8>)> {
    let head = b"POST /v1/completions HTTP/1.1\r\nhost: kvlease\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n";
    let mut answers = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(head).await.expect("head");
        let t0 = Instant::now();
        s.write_all(if trickle { br#"{"prompt": ""# } else { &[b' '; 500] }).await.expect("some body");
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            assert!(t0.elapsed() < DEADLINE, "a slow body was never cut");
            tokio::select! {
                r = s.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                },
                () = tokio::time::sleep(Duration::from_millis(100)), if trickle => {
                    // The server may stop reading once it has answered; the answer still counts.
                    let _ = s.write_all(b"a").await;
                }
            }
        }
        answers.push((t0.elapsed(), got));
    }
    answers
}

/// Issue "bounded HTTP" (slowloris): with `--http-header-timeout 1`, connections that trickle a
/// request head are closed within 1 s (+ slack) of opening however steadily they send, and normal
/// requests meanwhile keep their latency (median within 2× of the idle run + 50 ms).
async fn slow_heads_are_cut(target: Target) {
    let idle = target.median_latency().await;
    let files = target.open_files();
    let stop = Arc::new(AtomicBool::new(false));
    let attackers: Vec<_> = (0..50).map(|_| tokio::spawn(trickle_heads(target.addr(), stop.clone()))).collect();
    until_connected(&target, files, 40).await;
    let attacked = target.median_latency().await;
    stop.store(true, Ordering::Relaxed);
    let mut lives = Vec::new();
    for a in attackers {
        lives.extend(a.await.expect("attacker"));
    }
    let longest = lives.iter().max().expect("some connections");
    eprintln!("slow heads: {} connections, lived {:?} to {longest:?}", lives.len(), lives.iter().min().expect("some"));
    assert!(lives.iter().all(|l| *l >= Duration::from_millis(800)), "cut before the header timeout: {lives:?}");
    assert!(*longest <= Duration::from_secs(1) + CUT_SLACK, "a slow head outlived the 1 s header timeout: {longest:?}");
    assert_latency_kept("slow heads", idle, attacked);
}

/// Issue "bounded HTTP" (slowloris) against `serve`: see [`slow_heads_are_cut`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_cuts_slow_heads_at_the_header_timeout() {
    slow_heads_are_cut(Target::serve(&["--http-header-timeout", "1"])).await;
}

/// Issue "bounded HTTP" (slowloris) against `proxy`: see [`slow_heads_are_cut`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_cuts_slow_heads_at_the_header_timeout() {
    slow_heads_are_cut(Target::proxy(&["--http-header-timeout", "1"])).await;
}

/// Issue "bounded HTTP": with `--http-body-timeout 1`, a request whose body trickles or stops
/// half-way is answered 408 (OpenAI error JSON) within 1 s (+ slack) of its head and the
/// connection closed; normal requests meanwhile keep their latency.
async fn slow_bodies_get_408(target: Target) {
    let idle = target.median_latency().await;
    let files = target.open_files();
    let stop = Arc::new(AtomicBool::new(false));
    let attackers: Vec<_> = (0..40).map(|i| tokio::spawn(slow_bodies(target.addr(), i % 2 == 0, stop.clone()))).collect();
    until_connected(&target, files, 30).await;
    let attacked = target.median_latency().await;
    stop.store(true, Ordering::Relaxed);
    let mut answers = Vec::new();
    for a in attackers {
        answers.extend(a.await.expect("attacker"));
    }
    for (took, raw) in &answers {
        assert_eq!(status_of(raw), Some(408), "{:?}", String::from_utf8_lossy(raw));
        assert_eq!(json_of(raw)["error"]["code"], 408);
        assert!(*took >= Duration::from_millis(900), "408 before the body timeout: {took:?}");
        assert!(*took <= Duration::from_secs(1) + CUT_SLACK, "a slow body outlived the 1 s body timeout: {took:?}");
    }
    let longest = answers.iter().map(|(t, _)| *t).max().expect("some answers");
    eprintln!("slow bodies: {} requests answered 408 after at most {longest:?}", answers.len());
    assert_latency_kept("slow bodies", idle, attacked);
}

/// Issue "bounded HTTP" (slow bodies) against `serve`: see [`slow_bodies_get_408`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_slow_bodies_408_at_the_body_timeout() {
    slow_bodies_get_408(Target::serve(&["--http-body-timeout", "1"])).await;
}

/// Issue "bounded HTTP" (slow bodies) against `proxy`: see [`slow_bodies_get_408`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_answers_slow_bodies_408_at_the_body_timeout() {
    slow_bodies_get_408(Target::proxy(&["--http-body-timeout", "1"])).await;
}

/// The soft open-file limit of this process: the flood needs more than a thousand sockets.
fn open_files_limit() -> u64 {
    let limits = std::fs::read_to_string("/proc/self/limits").expect("limits");
    let line = limits.lines().find(|l| l.starts_with("Max open files")).expect("Max open files");
    line.trim_start_matches("Max open files").split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(u64::MAX)
}

/// Issue "bounded HTTP" (connection flood): 1,100 connections that send nothing, against
/// `--http-max-connections 1000`: the listener never holds more than 1,000 of them (its open
/// files stay within 1,000 + what it had before + 16), and normal requests on new connections
/// keep their latency (each new connection closes the idle one nearest its timeout).
async fn flood_keeps_normal_requests_fast(target: Target) {
    assert!(open_files_limit() >= 2500, "the flood needs `ulimit -n` of at least 2500");
    let idle = target.median_latency().await;
    let files_before = target.open_files();
    let mut flood = Vec::new();
    for _ in 0..1100 {
        flood.push(TcpStream::connect(target.addr()).await.expect("connect"));
    }
    let attacked = target.median_latency().await;
    let files = target.open_files();
    eprintln!("flood: the listener had {files_before} open files before, {files} during");
    assert!(files <= files_before + 1000 + 16, "{files} open files during the flood ({files_before} before)");
    // Those beyond the cap were closed: at least 100 of the flood, plus one per normal request.
    let mut buf = [0u8; 1];
    let closed = flood.iter().filter(|s| !matches!(s.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)).count();
    eprintln!("flood: {closed} of 1100 idle connections closed to make room");
    assert!(closed >= 100, "only {closed} idle connections were closed");
    assert_latency_kept("connection flood", idle, attacked);
}

/// Issue "bounded HTTP" (connection flood) against `serve`: see [`flood_keeps_normal_requests_fast`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_keeps_serving_through_a_connection_flood() {
    flood_keeps_normal_requests_fast(Target::serve(&["--http-max-connections", "1000", "--http-header-timeout", "60"])).await;
}

/// Issue "bounded HTTP" (connection flood) against `proxy`: see [`flood_keeps_normal_requests_fast`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_keeps_serving_through_a_connection_flood() {
    flood_keeps_normal_requests_fast(Target::proxy(&["--http-max-connections", "1000", "--http-header-timeout", "60"])).await;
}

/// Opens a connection whose request is in flight (head sent, body stalled half-way).
async fn busy_connection(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let head = b"POST /v1/completions HTTP/1.1\r\nhost: kvlease\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{";
    s.write_all(head).await.expect("head");
    s
}

/// Whether the server answered `s` with a 503 (refused at the cap, never in flight).
fn was_refused(s: &TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(s.try_read(&mut buf), Ok(n) if status_of(&buf[..n]) == Some(503))
}

/// Whether the server has closed (or reset) `s`.
fn is_closed(s: &TcpStream) -> bool {
    let mut buf = [0u8; 64];
    !matches!(s.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

/// Issue "bounded HTTP": with `--http-max-connections 20` and 20 requests in flight, a newcomer is
/// answered 503 (OpenAI error JSON) at once, and no request in flight is cut to make room.
async fn busy_server_refuses_newcomers_fast(target: Target) {
    let client = reqwest::Client::builder().no_proxy().pool_max_idle_per_host(0).timeout(DEADLINE).build().expect("client");
    let mut busy: Vec<TcpStream> = Vec::new();
    let t0 = Instant::now();
    let took = loop {
        assert!(t0.elapsed() < DEADLINE, "never refused");
        // A connection that was still waiting for its head when a newcomer came was closed to
        // make room: replace it, until all 20 are busy.
        busy.retain(|s| !is_closed(s));
        while busy.len() < 20 {
            busy.push(busy_connection(target.addr()).await);
        }
        let sent = Instant::now();
        let r = client
            .post(format!("{}/v1/completions", target.front.url))
            .json(&json!({"prompt": "hello", "max_tokens": 2}))
            .send()
            .await
            .expect("answered");
        if r.status() == 503 {
            let took = sent.elapsed();
            // A "busy" connection opened while the previous newcomer's connection was still
            // counted was itself refused (a 503 waits on it): it never was in flight. Retry.
            if busy.iter().any(was_refused) {
                busy.retain(|s| !is_closed(s));
                continue;
            }
            assert_eq!(r.headers()["retry-after"], "1");
            let body: Value = r.json().await.expect("JSON");
            assert_eq!(body["error"]["type"], "ServiceUnavailableError", "{body}");
            assert_eq!(body["error"]["code"], 503, "{body}");
            assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("connections")), "{body}");
            break took;
        }
        assert_eq!(r.status(), 200);
    };
    eprintln!("busy server: newcomer refused in {took:?}");
    assert!(took < Duration::from_secs(1), "the 503 took {took:?}");
    assert!(busy.iter().all(|s| !is_closed(s)), "a request in flight was cut for a newcomer");
    // The requests in flight are still served: finishing a body gets its answer.
    let mut s = busy.pop().expect("one");
    let mut rest = String::from(r#""prompt": "hi", "max_tokens": 2"#);
    while rest.len() < 998 {
        rest.push(' ');
    }
    rest.push('}');
    s.write_all(rest.as_bytes()).await.expect("rest of the body");
    let mut got = vec![0u8; 4096];
    let n = tokio::time::timeout(DEADLINE, s.read(&mut got)).await.expect("answered in time").expect("read");
    assert_eq!(status_of(&got[..n]), Some(200), "{:?}", String::from_utf8_lossy(&got[..n]));
}

/// Issue "bounded HTTP" (connection cap) against `serve`: see [`busy_server_refuses_newcomers_fast`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_a_newcomer_503_when_every_connection_is_busy() {
    busy_server_refuses_newcomers_fast(Target::serve(&["--http-max-connections", "20"])).await;
}

/// Issue "bounded HTTP" (connection cap) against `proxy`: see [`busy_server_refuses_newcomers_fast`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_refuses_a_newcomer_503_when_every_connection_is_busy() {
    busy_server_refuses_newcomers_fast(Target::proxy(&["--http-max-connections", "20"])).await;
}

/// Sends a 4 MiB request's head and all but 194,304 bytes of its body, then stalls; returns the
/// answer's status and when it came after the head (the writer stops when the answer comes).
/// `settled` is set once it has sent all it will send, or been answered.
async fn unfinished_big_body(addr: SocketAddr, settled: Arc<AtomicBool>) -> (u16, Duration) {
    const CONTENT_LENGTH: usize = 4 << 20;
    const SENT: usize = 4_000_000;
    let s = TcpStream::connect(addr).await.expect("connect");
    let (mut rd, mut wr) = s.into_split();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvlease\r\ncontent-type: application/json\r\ncontent-length: {CONTENT_LENGTH}\r\n\r\n"
    );
    wr.write_all(head.as_bytes()).await.expect("head");
    let t0 = Instant::now();
    let sent_all = settled.clone();
    let writer = tokio::spawn(async move {
        let chunk = vec![b' '; 64 << 10];
        let mut sent = 0;
        while sent < SENT {
            let n = chunk.len().min(SENT - sent);
            if wr.write_all(&chunk[..n]).await.is_err() {
                return;
            }
            sent += n;
        }
        sent_all.store(true, Ordering::Relaxed);
        // Hold the connection open, the body unfinished, until aborted.
        std::future::pending::<()>().await;
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let answered = async {
        while status_of(&got).is_none() {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(DEADLINE, answered).await.expect("every unfinished body is answered");
    let took = t0.elapsed();
    settled.store(true, Ordering::Relaxed);
    writer.abort();
    (status_of(&got).unwrap_or(0), took)
}

/// Issue "bounded HTTP" (memory): 100 connections each send 4,000,000 bytes of a 4 MiB body and
/// stall. With `--http-max-buffered-body-bytes 16 MiB` the listener's VmRSS stays below what it
/// was before + 64 MiB (the budget, 16 KiB uncounted and hyper's 16 KiB buffer per connection,
/// and the allocator's slack), those beyond the budget get a 503, those within it a 408 at the
/// 4 s body timeout, and normal requests keep their latency while the bodies are held.
async fn unfinished_bodies_keep_memory_bounded(target: Target) {
    const ATTACKERS: usize = 100;
    let idle = target.median_latency().await;
    let before = target.rss();
    let settled: Vec<_> = (0..ATTACKERS).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let attackers: Vec<_> = settled.iter().map(|s| tokio::spawn(unfinished_big_body(target.addr(), s.clone()))).collect();
    let done = Arc::new(AtomicBool::new(false));
    let pid = target.front.pid();
    let sampler = {
        let done = done.clone();
        let target_rss = move || {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
            let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).expect("VmRSS").trim().trim_end_matches("kB").trim();
            kb.parse::<u64>().expect("kB") * 1024
        };
        tokio::spawn(async move {
            let mut max = 0;
            while !done.load(Ordering::Relaxed) {
                max = max.max(target_rss());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            max.max(target_rss())
        })
    };
    // Measure while the bodies within the budget are held: once every attacker has sent what it
    // will send or been answered.
    until("the attackers to settle", DEADLINE, || async { settled.iter().all(|s| s.load(Ordering::Relaxed)) }).await;
    let attacked = target.median_latency().await;
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    let mut longest = Duration::ZERO;
    for a in attackers {
        let (status, took) = a.await.expect("attacker");
        *statuses.entry(status).or_default() += 1;
        if status == 408 {
            longest = longest.max(took);
        }
    }
    done.store(true, Ordering::Relaxed);
    let max = sampler.await.expect("sampler");
    let grew = max.saturating_sub(before);
    eprintln!(
        "unfinished bodies: answers {statuses:?}; VmRSS {} MiB before, at most {} MiB during (+{} MiB)",
        before >> 20,
        max >> 20,
        grew >> 20
    );
    assert!(grew < 64 << 20, "VmRSS grew by {} MiB", grew >> 20);
    assert!(statuses.keys().all(|s| [408, 503].contains(s)), "{statuses:?}");
    assert!(statuses.get(&503).is_some_and(|n| *n > 0), "400 MB of bodies never hit the 16 MiB budget: {statuses:?}");
    assert!(longest <= Duration::from_secs(4) + CUT_SLACK, "a held body outlived the 4 s body timeout: {longest:?}");
    assert_latency_kept("unfinished bodies", idle, attacked);
}

const BODY_FLAGS: [&str; 4] = ["--http-max-buffered-body-bytes", "16777216", "--http-body-timeout", "4"];

/// Issue "bounded HTTP" (memory, bound: VmRSS + 64 MiB) against `serve`: see [`unfinished_bodies_keep_memory_bounded`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_memory_stays_bounded_under_unfinished_bodies() {
    unfinished_bodies_keep_memory_bounded(Target::serve(&BODY_FLAGS)).await;
}

/// Issue "bounded HTTP" (memory, bound: VmRSS + 64 MiB) against `proxy`: see [`unfinished_bodies_keep_memory_bounded`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_memory_stays_bounded_under_unfinished_bodies() {
    unfinished_bodies_keep_memory_bounded(Target::proxy(&BODY_FLAGS)).await;
}
