//! Issue 9, SPEC O2: `kvlease proxy` in front of two P and three D survives instances failing.
//! Under load (`kvlease load` plus verifying clients), one D is killed and one P paused mid-run:
//! no client sees a wrong answer, every failure is a clean error, the dead D is out of rotation
//! within 2 s, decode legs that hit it are retried, and afterwards no P holds a lease.

mod common;
use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Tally {
    right: AtomicUsize,
    clean_failures: AtomicUsize,
    wrong: Mutex<Vec<String>>,
}

/// One request through the proxy, checked against the local engine's answer for the same body.
async fn check(proxy: &str, local: &str, i: usize, cache: &Mutex<HashMap<usize, String>>, tally: &Tally) {
    let stream = i % 2 == 1;
    let body = json!({"prompt": format!("request {} of the survival run: lease {}", i % 23, i % 7), "max_tokens": 8, "ignore_eos": true});
    let want = {
        let known = cache.lock().expect("cache").get(&(i % 161)).cloned();
        match known {
            Some(w) => w,
            None => {
                let (s, v) = post(&format!("{local}/v1/completions"), &body).await;
                assert_eq!(s, 200, "local: {v}");
                let w = text_of(&v, false);
                cache.lock().expect("cache").insert(i % 161, w.clone());
                w
            }
        }
    };
    let mut b = body.clone();
    b["stream"] = json!(stream);
    let r = match client().post(format!("{proxy}/v1/completions")).json(&b).send().await {
        Ok(r) => r,
        Err(e) => {
            tally.wrong.lock().expect("tally").push(format!("the proxy itself failed: {e}"));
            return;
        }
    };
    let status = r.status().as_u16();
    let text = r.text().await.unwrap_or_default();
    if status != 200 {
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        if v["error"]["code"] == status && v["error"]["message"].is_string() {
            tally.clean_failures.fetch_add(1, Ordering::Relaxed);
        } else {
            tally.wrong.lock().expect("tally").push(format!("unclean {status}: {text}"));
        }
        return;
    }
    let got = if stream {
        let mut out = String::new();
        let mut done = false;
        for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            if v.get("error").is_some() {
                // A clean failure after the first byte: an error event, then [DONE].
                tally.clean_failures.fetch_add(1, Ordering::Relaxed);
                return;
            }
            out.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        }
        if !done {
            tally.wrong.lock().expect("tally").push(format!("stream cut without [DONE]: {text}"));
            return;
        }
        out
    } else {
        serde_json::from_str::<Value>(&text).map(|v| text_of(&v, false)).unwrap_or_default()
    };
    if got == want {
        tally.right.fetch_add(1, Ordering::Relaxed);
    } else {
        tally.wrong.lock().expect("tally").push(format!("wrong answer for {b}: {got:?} (want {want:?})"));
    }
}

async fn upstream_healthy(proxy: &Proc, d: &str) -> f64 {
    metric(&proxy.url, &format!("kvlease_proxy_upstream_healthy{{role=\"decode\",upstream=\"{d}\"}}")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_p_three_d_one_d_killed_one_p_paused_no_wrong_answer_no_stranded_lease() {
    let cfg = lease_config(3.0);
    let slow = ["--kv-transfer-config", &cfg, "--decode-ms-per-token", "5"];
    let p0 = Proc::serve("sv-p0", &slow);
    let p1 = Proc::serve("sv-p1", &slow);
    let d0 = Proc::serve("sv-d0", &slow);
    let d1 = Proc::serve("sv-d1", &slow);
    let d2 = Proc::serve("sv-d2", &slow);
    let local = Proc::serve("sv-local", &[]);
    let proxy = Proc::proxy_with(&[&p0, &p1], &[&d0, &d1, &d2], &["--request-timeout", "10", "--health-interval", "0.3"]);

    // Background load from the load generator itself.
    let mut load = Command::new(env!("CARGO_BIN_EXE_kvlease"))
        .args(["load", "--url", &proxy.url, "--requests", "300", "--concurrency", "4", "--max-tokens", "8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvlease load");

    let tally = Arc::new(Tally::default());
    let cache = Arc::new(Mutex::new(HashMap::new()));
    let next = Arc::new(AtomicUsize::new(0));
    const TOTAL: usize = 240;
    let workers: Vec<_> = (0..6)
        .map(|_| {
            let (proxy, local, tally, cache, next) = (proxy.url.clone(), local.url.clone(), tally.clone(), cache.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= TOTAL {
                        return;
                    }
                    check(&proxy, &local, i, &cache, &tally).await;
                }
            })
        })
        .collect();

    until("a third of the run", DEADLINE, || async { next.load(Ordering::Relaxed) >= TOTAL / 3 }).await;
    let dead = d1.url.clone();
    drop(d1); // SIGKILL
    let t0 = Instant::now();
    until("the dead decoder out of rotation", Duration::from_secs(3), || async { upstream_healthy(&proxy, &dead).await == 0.0 }).await;
    let out_after = t0.elapsed();
    assert!(out_after < Duration::from_secs(2), "out of rotation after {out_after:?}");
    p1.signal("STOP");
    until("two thirds of the run", Duration::from_secs(60), || async { next.load(Ordering::Relaxed) >= 2 * TOTAL / 3 }).await;
    p1.signal("CONT");
    for w in workers {
        tokio::time::timeout(Duration::from_secs(120), w).await.expect("workers finish").expect("worker");
    }
    let _ = tokio::task::spawn_blocking(move || load.wait()).await;

    let wrong = tally.wrong.lock().expect("tally").clone();
    let (right, failed) = (tally.right.load(Ordering::Relaxed), tally.clean_failures.load(Ordering::Relaxed));
    eprintln!("survival run: {right} right, {failed} clean failures, {} wrong", wrong.len());
    assert!(wrong.is_empty(), "no client sees a wrong or unclean answer: {wrong:#?}");
    assert_eq!(right + failed, TOTAL);
    assert!(right >= TOTAL * 3 / 4, "most requests still succeed: {right} of {TOTAL}");
    let health = client().get(format!("{}/health", proxy.url)).send().await.expect("health");
    assert_eq!(health.status(), 200, "the proxy is healthy with two decoders and two prefillers");
    let models: Value = client().get(format!("{}/v1/models", proxy.url)).send().await.expect("models").json().await.expect("json");
    assert_eq!(models["data"][0]["id"], "kvlease-synthetic");
    for p in [&p0, &p1] {
        until(&format!("{} holds no lease", p.name), Duration::from_secs(15), || async {
            metric(&p.url, "kvlease_leased_blocks").await == 0.0
        })
        .await;
        // No lease held to expiry because a leg was refused: a lease expires only when its
        // decoder died holding it — at most one per request in flight at the kill (4 + 6).
        let expired = metric(&p.url, "kvlease_leases_released_total{reason=\"expired\"}").await;
        assert!(expired <= 10.0, "{}: {expired} leases expired; only the killed decoder's in-flight ones may", p.name);
    }
}

/// A decode leg whose decoder is unreachable is retried once on another decoder: the client
/// gets the right answer, and the proxy counts the retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_leg_retried_on_another_decoder_before_its_first_byte() {
    let cfg = lease_config(30.0);
    let p = Proc::serve("rt-p", &["--kv-transfer-config", &cfg]);
    let d0 = Proc::serve("rt-d0", &["--kv-transfer-config", &cfg]);
    let d1 = Proc::serve("rt-d1", &["--kv-transfer-config", &cfg]);
    let local = Proc::serve("rt-local", &[]);
    // A long health interval: the dead decoder stays in rotation, so requests do hit it.
    let proxy = Proc::proxy_with(&[&p], &[&d0, &d1], &["--health-interval", "60"]);
    drop(d1);
    let body = json!({"prompt": "retried on the live decoder", "max_tokens": 6, "ignore_eos": true});
    let (_, want) = post(&format!("{}/v1/completions", local.url), &body).await;
    for _ in 0..4 {
        let (s, v) = post(&format!("{}/v1/completions", proxy.url), &body).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(text_of(&v, false), text_of(&want, false));
    }
    assert!(metric(&proxy.url, "kvlease_proxy_retries_total").await >= 1.0);
    until("P holds no lease", Duration::from_secs(5), || async { metric(&p.url, "kvlease_leased_blocks").await == 0.0 }).await;
}

/// `--request-timeout`: a request that outlives it fails cleanly — 504 in vLLM's envelope before
/// the first byte, an SSE error event and `[DONE]` after it — and the decoder's request is
/// aborted, so P's lease does not wait for its expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_is_a_504_before_the_first_byte_and_an_sse_error_after() {
    let cfg = lease_config(30.0);
    let p = Proc::serve("to-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("to-d", &["--kv-transfer-config", &cfg, "--decode-ms-per-token", "100"]);
    let proxy = Proc::proxy_with(&[&p], &[&d], &["--request-timeout", "1"]);
    let url = format!("{}/v1/completions", proxy.url);
    let (s, v) = post(&url, &json!({"prompt": "too slow", "max_tokens": 40, "ignore_eos": true})).await;
    assert_eq!((s, v["error"]["code"].clone()), (504, json!(504)), "{v}");
    let r = client()
        .post(&url)
        .json(&json!({"prompt": "too slow, streamed", "max_tokens": 40, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    let text = r.text().await.expect("body");
    let events: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert!(events.len() >= 3, "some tokens came first: {text}");
    assert_eq!(events.last(), Some(&"[DONE]"));
    let err: Value = serde_json::from_str(events[events.len() - 2]).expect("error event");
    assert!(err["error"]["message"].as_str().is_some_and(|m| m.contains("request-timeout")), "{err}");
    until("D aborted both", Duration::from_secs(5), || async { metric(&d.url, "kvlease_requests_running").await == 0.0 }).await;
    until("P holds no lease", Duration::from_secs(5), || async { metric(&p.url, "kvlease_leased_blocks").await == 0.0 }).await;
    assert_eq!(metric(&proxy.url, "kvlease_proxy_timeouts_total").await, 1.0);
}

/// The proxy raises its soft open-file limit to the hard limit at start-up (a proxy out of
/// descriptors failed hundreds of requests).
#[test]
fn proxy_raises_its_open_file_limit_to_the_hard_limit() {
    let bin = env!("CARGO_BIN_EXE_kvlease");
    let mut child = Command::new("sh")
        .args(["-c", &format!("ulimit -S -n 256 && exec {bin} proxy --port 0 --log-level warn")])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().expect("stdout")), &mut line).expect("banner");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).expect("limits");
    let _ = child.kill();
    let _ = child.wait();
    let row = limits.lines().find(|l| l.starts_with("Max open files")).expect("row");
    let nums: Vec<&str> = row.trim_start_matches("Max open files").split_whitespace().collect();
    assert_eq!(nums[0], nums[1], "soft = hard after start-up: {row}");
    assert_ne!(nums[0], "256");
}
