//! Push mode through `kvlease proxy` (SPEC §13, issue 24): push engines (`NixlPushConnector`)
//! behind the proxy, which sends both legs of a request at once once it knows a prefiller is a
//! push engine. Real processes on loopback; each test names the SPEC ids it proves.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn push_engine(name: &str, lease: f64, extra: &[&str]) -> Proc {
    // D waits 10 s for writes: more than P's write margin (E/4, at most 5 s), so P posts them.
    let cfg = push_config(lease, 10.0);
    let mut args = vec!["--kv-transfer-config", cfg.as_str()];
    args.extend_from_slice(extra);
    Proc::serve(name, &args)
}

/// Request `i` of a mix: plain or chat, streamed or not, each with its own prompt.
fn request(i: usize) -> (Value, bool, bool) {
    let (chat, stream) = (i % 2 == 1, i % 4 >= 2);
    let prompt = format!("request {i}: the lease is renewed while the decoder waits for the pushed blocks");
    let mut body = if chat {
        json!({"model": "kvlease-synthetic", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "ignore_eos": true})
    } else {
        json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 12, "ignore_eos": true})
    };
    body["stream"] = json!(stream);
    (body, chat, stream)
}

/// What a local engine (no transfer at all) answers to each request of the mix.
async fn local_answers(n: usize) -> Vec<String> {
    let local = Proc::serve("push-local", &[]);
    let mut want = Vec::new();
    for i in 0..n {
        let (body, chat, stream) = request(i);
        want.push(answer(&local.url, &body, chat, stream).await.unwrap_or_else(|e| panic!("local run {i}: {e:?}")));
    }
    want
}

/// SPEC U1, U2, U12, D7: push P and D behind the proxy, which learns from P's first answer
/// that P is a push engine and from then on sends both legs at once (P's leg with a fresh
/// `transfer_id`, D's with P's coordinates and the same id). 24 requests, plain and chat,
/// streamed and not, each equal to a local engine's answer; every one of P's leases ends as
/// `transferred`, D recomputes nothing, and nothing is left leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u12_push_through_the_proxy_with_both_legs_at_once_equals_local() {
    const N: usize = 24;
    let want = local_answers(N).await;
    let p = push_engine("pp-p", 30.0, &[]);
    let d = push_engine("pp-d", 30.0, &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    for (i, want) in want.iter().enumerate() {
        let (body, chat, stream) = request(i);
        let got = answer(&proxy.url, &body, chat, stream).await.unwrap_or_else(|e| panic!("request {i}: {e:?}"));
        assert_eq!(&got, want, "request {i} (chat {chat}, stream {stream})");
    }
    until("P's leases all transferred", DEADLINE, || async {
        metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await == N as f64
    })
    .await;
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 0.0, "every prompt's KV was pushed, none recomputed");
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 0.0);
    for reason in ["released", "expired"] {
        assert_eq!(metric(&p.url, &format!("kvlease_leases_released_total{{reason=\"{reason}\"}}")).await, 0.0, "{reason}");
    }
    // The first request taught the proxy P's coordinates (legs one after the other); every
    // other one went out at once.
    assert_eq!(metric(&proxy.url, "kvlease_proxy_push_dispatches_total").await, (N - 1) as f64);
}

/// SPEC O2, O4, U9, U12: a prefill engine killed (SIGKILL) while requests are going through
/// the proxy to it and another push prefiller: no request answers 200 with output other than a
/// local run's. A prefill leg that fails drops its decode leg (D releases, U9) and is tried
/// again on the other prefiller; a request whose KV never comes is recomputed by D (U10) or
/// fails with an error — never a wrong answer. Afterwards nothing stays leased on the survivor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o2_a_prefill_engine_killed_under_load_gives_no_wrong_200() {
    const N: usize = 32;
    let want = local_answers(N).await;
    let p1 = push_engine("pk-p1", 30.0, &["--prefill-ms-per-token", "2"]);
    let p2 = push_engine("pk-p2", 30.0, &["--prefill-ms-per-token", "2"]);
    let d = push_engine("pk-d", 30.0, &[]);
    let proxy = Proc::proxy(&[&p1, &p2], &[&d]);
    // Both prefillers learnt as push engines first.
    for (i, want) in want.iter().enumerate().take(4) {
        let (body, chat, stream) = request(i);
        assert_eq!(answer(&proxy.url, &body, chat, stream).await.as_ref(), Ok(want), "warm-up {i}");
    }
    let want = std::sync::Arc::new(want);
    let mut tasks = Vec::new();
    let t0 = Instant::now();
    for i in 0..N {
        let (url, want) = (proxy.url.clone(), want.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(15 * i as u64)).await;
            let (body, chat, stream) = request(i);
            (i, answer(&url, &body, chat, stream).await, want[i].clone())
        }));
    }
    tokio::time::sleep(Duration::from_millis(15 * N as u64 / 2)).await;
    p1.signal("KILL");
    let killed_at = t0.elapsed();
    let (ok, failed) = no_wrong_200(tasks).await;
    eprintln!("p1 killed at {killed_at:?}: {ok} answered, {failed} failed");
    assert!(ok >= N / 2, "most requests still answered ({ok} of {N})");
    // The survivor holds nothing once the load is over.
    until("nothing leased on p2", Duration::from_secs(10), || async { metric(&p2.url, "kvlease_leases_active").await == 0.0 }).await;
    assert_eq!(metric(&p2.url, "kvlease_leases_released_total{reason=\"expired\"}").await, 0.0);
    let (body, chat, stream) = request(0);
    assert_eq!(answer(&proxy.url, &body, chat, stream).await.as_ref(), Ok(&want[0]), "still serving on p2");
}

/// SPEC O3, O4, U9: a decode leg refused by D (a request only D refuses: over its
/// `--max-model-len`) or that reaches no decoder (D killed) leaves no lease on P: the proxy
/// releases P's lease by the dispatch's key at once (one P grants after that is refused at
/// its grant), well within L, never by expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o3_o4_a_refused_or_unreached_decode_leg_leaves_no_lease_on_p() {
    const LEASE: f64 = 3.0;
    let p = push_engine("pr-p", LEASE, &["--prefill-ms-per-token", "5"]);
    let d = push_engine("pr-d", LEASE, &["--max-model-len", "64"]);
    let proxy = Proc::proxy_with(&[&p], &[&d], &["--health-interval", "0.2"]);
    let url = format!("{}/v1/completions", proxy.url);
    let fits = json!({"model": "kvlease-synthetic", "prompt": "a short prompt", "max_tokens": 4});
    let (s, v) = post(&url, &fits).await;
    assert_eq!(s, 200, "{v}");
    let too_long = json!({"model": "kvlease-synthetic", "prompt": "a prompt of forty bytes, more or less...", "max_tokens": 100});
    for i in 0..3 {
        let (s, v) = post(&url, &too_long).await;
        assert_eq!(s, 400, "D refuses it: {v}");
        let t0 = Instant::now();
        until("P holds no lease", Duration::from_secs(1), || async { metric(&p.url, "kvlease_leases_active").await == 0.0 }).await;
        assert!(t0.elapsed() < Duration::from_secs_f64(LEASE / 3.0), "refusal {i}: {:?}", t0.elapsed());
    }
    assert!(metric(&proxy.url, "kvlease_proxy_push_dispatches_total").await >= 3.0, "the refused legs went at once");

    // D gone: the decode leg reaches nobody; P's lease is released at once too.
    d.signal("KILL");
    let (s, v) = post(&url, &fits).await;
    assert!(s >= 500, "no decoder: {s} {v}");
    let t0 = Instant::now();
    until("P holds no lease", Duration::from_secs(1), || async { metric(&p.url, "kvlease_leases_active").await == 0.0 }).await;
    assert!(t0.elapsed() < Duration::from_secs_f64(LEASE / 3.0), "{:?}", t0.elapsed());
    // Let a lease that was wrongly left run out, then make sure none did.
    tokio::time::sleep(Duration::from_secs_f64(LEASE + 1.0)).await;
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"expired\"}").await, 0.0, "no lease waited for expiry");
}

/// SPEC U2, U10, D5 (liveness after a restart): a push prefiller killed (SIGKILL) and started
/// again at the same addresses, as a supervisor restarts it, serves push transfers again at
/// once. D's link to the dead incarnation breaks with the process; it handshakes with the new
/// one before it registers (the proxy's decode legs name no incarnation, so nothing else tells
/// it), and no request waits out D's `push_registration_timeout` (10 s) to be recomputed. Fails
/// with D's handling of a broken link removed (request 3 takes 10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u10_a_prefill_engine_restarted_in_place_serves_push_again_at_once() {
    restarted_in_place("tcp").await;
}

/// The same over NIXL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_u10_a_prefill_engine_restarted_in_place_serves_push_again_at_once() {
    if nixl_or_skip() {
        restarted_in_place("nixl").await;
    }
}

/// `kvlease serve` args for a push prefiller `name` on fixed ports (HTTP and side channel), so a
/// restart takes the same addresses, as a supervisor's would.
fn fixed_push_prefiller(name: &str, transport: &str) -> Vec<String> {
    let free_port = || std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
    let (http, kv) = (free_port().to_string(), free_port().to_string());
    let args = ["serve", "--port", &http, "--kv-port", &kv, "--engine-id", name, "--log-level", "warn", "--transport", transport];
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.extend(["--kv-transfer-config".to_string(), push_config(30.0, 10.0)]);
    args
}

fn start_args(name: &str, args: &[String]) -> Proc {
    Proc::start(name, &args.iter().map(String::as_str).collect::<Vec<_>>())
}

async fn restarted_in_place(transport: &str) {
    const N: usize = 8;
    let want = local_answers(N).await;
    let name = format!("pr-p-{transport}");
    let args = fixed_push_prefiller(&name, transport);
    let p = start_args(&name, &args);
    let d = push_engine(&format!("pr-d-{transport}"), 30.0, &["--transport", transport]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    for (i, want) in want.iter().enumerate().take(3) {
        let (body, chat, stream) = request(i);
        assert_eq!(answer(&proxy.url, &body, chat, stream).await.as_ref(), Ok(want), "before the restart, request {i}");
    }
    p.signal("KILL");
    drop(p);
    let p = start_args(&name, &args);
    let recomputed = metric(&d.url, "kvlease_recomputed_requests_total").await;
    for (i, want) in want.iter().enumerate().skip(3) {
        let (body, chat, stream) = request(i);
        let t = Instant::now();
        assert_eq!(answer(&proxy.url, &body, chat, stream).await.as_ref(), Ok(want), "after the restart, request {i}");
        assert!(t.elapsed() < Duration::from_secs(5), "request {i} after the restart took {:?}", t.elapsed());
    }
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, recomputed, "D recomputed a request after the restart");
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, (N - 3) as f64);
}

/// SPEC D5, §3 (liveness): a request whose prefill P answered, waiting on D behind a busy slot,
/// when P is killed and restarted in place. Its lease and key died with the old incarnation; the
/// new one would keep its registration pending, waiting for a prefill that will not come. The
/// registration says how long ago D admitted the request, longer than the new P has lived: P
/// answers it lost at once, so D computes the prompt itself (answer equal to local) as soon as
/// it has a slot, instead of waiting out `push_registration_timeout` (10 s). Fails with
/// `PushSource::before_my_time` always false.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d5_a_request_whose_prefill_died_with_p_fails_over_when_d_links_to_the_restarted_p() {
    let want = local_answers(3).await;
    let args = fixed_push_prefiller("rs-p", "tcp");
    let p = start_args("rs-p", &args);
    let d = push_engine("rs-d", 30.0, &["--max-num-seqs", "1", "--decode-ms-per-token", "20"]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    for (i, want) in want.iter().enumerate().take(2) {
        let (body, chat, stream) = request(i);
        assert_eq!(answer(&proxy.url, &body, chat, stream).await.as_ref(), Ok(want), "warm-up {i}");
    }
    let busy = occupy(&d, 1000).await;
    let (url, (body, chat, stream)) = (proxy.url.clone(), request(2));
    let waiting = tokio::spawn(async move { answer(&url, &body, chat, stream).await });
    until("its lease granted on P", DEADLINE, || async { metric(&p.url, "kvlease_leases_active").await == 1.0 }).await;
    let recomputed = metric(&d.url, "kvlease_recomputed_requests_total").await;
    // The request waits on D for a while, as behind a long decode (more than the second a
    // prefill leg may trail its decode leg), then P dies and comes back.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    p.signal("KILL");
    drop(p);
    let _p = start_args("rs-p", &args);
    // D links to the new incarnation (its renewals of the waiting request want the link).
    tokio::time::sleep(Duration::from_millis(500)).await;
    busy.abort();
    let t = Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(30), waiting).await.expect("answered").expect("task");
    assert_eq!(got.as_ref(), Ok(&want[2]), "computed by D itself, the same answer");
    assert!(t.elapsed() < Duration::from_secs(5), "the request waited {:?} once D had a slot", t.elapsed());
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, recomputed + 1.0);
}
