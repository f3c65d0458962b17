//! Push mode (SPEC §13) under the faults of the vLLM push-mode issues (issue 24), between real
//! `kvlease serve` processes driven by a real HTTP client: a decode leg given up on D (vLLM
//! #46283), a write that fails between the processes (#48633 C2, #50754), P shutting down under
//! a transfer, a P killed under a registered request (SPEC D5), leases ending while writes are
//! in flight (#55470). Each test says which protection it proves: with that protection removed
//! (a temporary local edit), the test was run and failed — except the soak of #55470 under
//! pauses, which says why not.
//!
//! #55470's protections stack, so each is proven where the others do not apply, across real
//! hosts (network namespaces, `common::hosts`) with P's sending throttled so a write of a long
//! prompt stays in flight for seconds while D runs and can give its request up: P's posting gate
//! (`u4_no_write_is_posted_after_the_lease_ended`, over tcp and NIXL: over NIXL it is the only
//! fence), a write in flight holding its source blocks
//! (`u4_a_lease_released_under_a_write_keeps_its_blocks_until_the_write_ends`, tcp and NIXL),
//! and D's write gate (`u8_d_refuses_a_write_for_blocks_it_gave_up`, tcp: NIXL has none); over
//! NIXL, where a write P gave up on runs on, its source blocks held until it ends
//! (`nixl_u4_a_write_given_up_on_p_reads_no_freed_block`). Another, a completion of a lease that
//! ended counted failed (`PushSource::end_write`), has no test of its own that fails without
//! it: such a completion's bytes were read from source blocks its ticket kept out of P's pool
//! (the second protection) for a registration whose digest P checked (U11), so they are the
//! prompt's KV, and taking them as done would still give the right answer: the rule only matters
//! when the second protection is gone. (Besides, a lease ends under a write while D still waits
//! for it only at P's shutdown: after D's release D waits for nothing, and expiry cannot come
//! first, D renewing and P's write timeout being < L.)

mod common;
use common::hosts::{available, Net};
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// `kvlease_leases_released_total` for `reason` on `base`.
async fn released(base: &str, reason: &str) -> f64 {
    metric(base, &format!("kvlease_leases_released_total{{reason=\"{reason}\"}}")).await
}

/// A prompt of `n` tokens (bytes outside the model's words: one token each).
fn long_prompt(tag: &str, n: usize) -> String {
    let mut s = format!("{tag}:");
    while s.len() < n {
        s.push('x');
    }
    s
}

/// P's push answer to a prefill of `prompt` (a sequential router's first leg): its
/// `kv_transfer_params`, which carry P's side-channel port and the transfer's key.
async fn prefill(p: &Proc, prompt: &str) -> Value {
    let leg = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}});
    let (status, body) = post(&format!("{}/v1/completions", p.url), &leg).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["kv_transfer_params"]["transfer_mode"], "push", "{body}");
    body["kv_transfer_params"].clone()
}

/// vLLM's push router's params for D (both legs at once): P's coordinates, the router's request
/// id, no blocks.
fn router_params(p_name: &str, kv_port: u64, router_id: &str) -> Value {
    router_params_at(p_name, "127.0.0.1", kv_port, router_id)
}

/// [`router_params`] for a P reached at `host`.
fn router_params_at(p_name: &str, host: &str, kv_port: u64, router_id: &str) -> Value {
    json!({"do_remote_decode": false, "do_remote_prefill": true, "remote_engine_id": p_name, "remote_host": host,
        "remote_port": kv_port, "tp_size": 1, "pp_size": 1, "remote_request_id": router_id})
}

/// A streamed decode leg to D whose client can leave (abort the task): D notices at once.
fn decode_leg(d: &Proc, prompt: &str, max_tokens: u64, params: Value) -> tokio::task::JoinHandle<()> {
    let url = format!("{}/v1/completions", d.url);
    let body = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true,
        "stream": true, "kv_transfer_params": params});
    tokio::spawn(async move {
        if let Ok(r) = client().post(url).json(&body).send().await {
            let _ = r.text().await;
        }
    })
}

/// Whether `f` becomes true within `limit` (polled, as [`until`], without failing).
async fn within<F, Fut>(limit: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !f().await {
        if t0.elapsed() >= limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// The prefill leg of `prompt` on P, under the router's request id `router_id` (the key D's
/// params name, U1): its status once P answered.
fn prefill_leg(p: &Proc, prompt: &str, router_id: &'static str) -> tokio::task::JoinHandle<u16> {
    let (url, prompt) = (format!("{}/v1/completions", p.url), prompt.to_string());
    tokio::spawn(async move {
        client()
            .post(url)
            .header("X-Request-Id", router_id)
            .json(
                &json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
            )
            .send()
            .await
            .expect("prefill leg")
            .status()
            .as_u16()
    })
}

/// What the local engine answers to `prompt` with `max_tokens`.
async fn local_text(local: &Proc, prompt: &str, max_tokens: u64) -> String {
    let body = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true});
    let (status, want) = post(&format!("{}/v1/completions", local.url), &body).await;
    assert_eq!(status, 200, "{want}");
    text_of(&want, false)
}

/// SPEC U9, U2, D4 (vLLM #46283, "an abort before allocation never tells P"): a decode leg
/// queued on a busy D (no blocks allocated, nothing registered) whose client leaves: D tells P
/// at once, and P frees the lease and its blocks as `released` within a second or two, not at
/// L = 30 s. Fails when D's abort does not send `PushRelease` (the `PushRelease` of
/// `PushSink::abort` removed): P holds the lease to expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u9_a_decode_leg_given_up_before_its_blocks_frees_p_at_once() {
    let cfg = push_config(30.0, 30.0);
    let p = Proc::serve("u9a-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("u9a-d", &["--kv-transfer-config", &cfg, "--max-num-seqs", "1", "--decode-ms-per-token", "10"]);
    let prompt = "a decode leg whose client gives up while it queues";
    let params = prefill(&p, prompt).await;
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 1.0);
    let hog = occupy(&d, 1500).await;
    let leg = decode_leg(&d, prompt, 4, params);
    // Queued behind the hog, renewed from admission (U2): P hears D's heartbeats.
    until("D queues the leg and renews P's lease", DEADLINE, || async {
        metric(&d.url, "kvlease_requests_waiting").await == 1.0 && metric(&p.url, "kvlease_heartbeats_received_total").await >= 1.0
    })
    .await;
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 1.0, "still held while D queues the leg");
    leg.abort(); // the client goes away
    let t0 = Instant::now();
    until_nothing_held(&p.url, Duration::from_secs(5)).await;
    assert!(t0.elapsed() < Duration::from_secs(3), "P freed after {:?}; its lease had 30 s", t0.elapsed());
    assert_eq!(released(&p.url, "released").await, 1.0);
    assert_eq!(released(&p.url, "expired").await, 0.0);
    hog.abort();
}

/// SPEC U9, O3 (vLLM #46283, an abort after registration): both legs at once, as vLLM's push
/// router sends them; D allocates and registers its blocks while P still prefills, then the
/// decode leg's client leaves. P hears it before its prefill ends: it grants no lease for the
/// transfer, posts no write into the aborted request's blocks (D refuses none), and every block
/// is free the moment the prefill ends. Fails when D's abort does not send `PushRelease` (the
/// `PushRelease` of `PushSink::abort` removed): P grants, and writes into the blocks D gave up
/// (refused by D's write gate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u9_a_decode_leg_given_up_after_registering_leaves_p_nothing_to_grant() {
    let cfg = push_config(30.0, 30.0);
    let p = Proc::serve("u9b-p", &["--kv-transfer-config", &cfg, "--prefill-ms-per-token", "30"]);
    let d = Proc::serve("u9b-d", &["--kv-transfer-config", &cfg]);
    // P's side-channel port from a probe, whose lease the router's release ends at once.
    let probe = prefill(&p, "probe").await;
    let (status, body) = post(&format!("{}/kvlease/release", p.url), &json!({"kv_transfer_params": probe})).await;
    assert_eq!(status, 200, "{body}");
    let kv_port = probe["remote_port"].as_u64().expect("P's side-channel port");
    until_nothing_held(&p.url, Duration::from_secs(5)).await;
    let (granted0, released0) = (metric(&p.url, "kvlease_leases_granted_total").await, released(&p.url, "released").await);

    // About 100 tokens at 30 ms: P prefills for about 3 s.
    let prompt = long_prompt("registered, then given up", 100);
    let router_id = "u9b-router-id";
    let leg = decode_leg(&d, &prompt, 4, router_params("u9b-p", kv_port, router_id));
    let p_leg = prefill_leg(&p, &prompt, router_id);
    // D allocated the blocks and registered them (the request waits for writes: `loading`).
    until("D registers and waits for P's writes", DEADLINE, || async { metric(&d.url, "kvlease_requests_running").await == 1.0 }).await;
    assert_eq!(metric(&p.url, "kvlease_requests_running").await, 1.0, "P is still prefilling");
    leg.abort(); // the decode leg's client goes away
    assert_eq!(p_leg.await.expect("prefill leg"), 200);
    until_nothing_held(&p.url, Duration::from_secs(2)).await;
    assert_eq!(metric(&p.url, "kvlease_leases_granted_total").await, granted0, "no lease granted for a transfer D gave up");
    assert_eq!(metric(&d.url, "kvlease_writes_refused_total").await, 0.0, "no write aimed at the given-up blocks");
    assert_eq!(released(&p.url, "released").await, released0);
    assert_eq!(released(&p.url, "expired").await, 0.0);
    until_nothing_held(&d.url, Duration::from_secs(5)).await;
}

/// SPEC U6, U7, U10 (vLLM #48633 C2, #50754: a failed write is only logged, D waits over
/// half-written blocks): both legs at once; D registers, then is stopped (`SIGSTOP`) before
/// P's prefill ends, so P's write into D's blocks is posted and never answered: it outlives
/// P's write timeout (1 s at L = 6 s) and is cancelled. P ends the lease as `released` (not
/// `expired`, not `transferred`) and tells D; D, resumed, fails over to
/// `kv_load_failure_policy` (recompute) at once — not at the end of its 20 s wait — and answers
/// with the local run's text. Fails when P's failed write is only logged (in
/// `kvlease-engine`'s `push::write`, a failed write's ticket not handed to `end_write`): D waits
/// its full 20 s and P's lease is not ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u6_a_write_that_fails_between_processes_fails_d_over_at_once() {
    // L = 6 s: D heartbeats every 1 s, P keeps a key D registered for E = 4 s before its grant.
    let cfg = push_config(6.0, 20.0);
    let p = Proc::serve("c2-p", &["--kv-transfer-config", &cfg, "--prefill-ms-per-token", "20"]);
    let d = Proc::serve("c2-d", &["--kv-transfer-config", &cfg]);
    let local = Proc::serve("c2-local", &[]);
    let prompt = long_prompt("a write that never lands", 100);
    let want = local_text(&local, &prompt, 6).await;
    let probe = prefill(&p, "probe").await;
    let (status, body) = post(&format!("{}/kvlease/release", p.url), &json!({"kv_transfer_params": probe})).await;
    assert_eq!(status, 200, "{body}");
    let kv_port = probe["remote_port"].as_u64().expect("P's side-channel port");
    until_nothing_held(&p.url, Duration::from_secs(5)).await;
    let released0 = released(&p.url, "released").await;

    let router_id = "c2-router-id";
    let decode = {
        let url = format!("{}/v1/completions", d.url);
        let body = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 6, "ignore_eos": true,
            "kv_transfer_params": router_params("c2-p", kv_port, router_id)});
        tokio::spawn(async move {
            let r = client().post(url).json(&body).send().await.expect("decode leg");
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.expect("JSON"), Instant::now())
        })
    };
    let p_leg = prefill_leg(&p, &prompt, router_id);
    // About 100 tokens at 20 ms: P prefills for about 2 s. D registered (waits for writes)
    // and P heard it (D's first heartbeat, after 1 s, follows the registration).
    until("D registers with P", DEADLINE, || async {
        metric(&d.url, "kvlease_requests_running").await == 1.0 && metric(&p.url, "kvlease_heartbeats_received_total").await >= 1.0
    })
    .await;
    assert_eq!(metric(&p.url, "kvlease_requests_running").await, 1.0, "P is still prefilling");
    d.signal("STOP");
    // P's prefill ends, it posts the write, the write outlives its timeout: P ends the lease.
    assert_eq!(p_leg.await.expect("prefill leg"), 200);
    // (Checked once D answered, so a broken build shows what D does too.)
    let ended = within(Duration::from_secs(5), || async { released(&p.url, "released").await == released0 + 1.0 }).await;
    d.signal("CONT");
    let resumed = Instant::now();
    recomputed_soon(decode, &d.url, &want, resumed, Duration::from_secs(4), "after it resumed; its wait was 20 s").await;
    assert!(ended, "P ended the lease of the failed write while D was stopped");
    assert_eq!(released(&p.url, "released").await, released0 + 1.0);
    until_nothing_held(&p.url, Duration::from_secs(2)).await;
    assert_eq!(released(&p.url, "expired").await, 0.0);
    assert_eq!(released(&p.url, "transferred").await, 0.0);
    until_nothing_held(&d.url, Duration::from_secs(10)).await;
}

/// Request `i` of a mix through the proxy: plain or chat, streamed or not, its own prompt.
fn request(i: usize) -> (Value, bool, bool) {
    let (chat, stream) = (i % 2 == 1, i % 4 >= 2);
    let prompt = format!("request {i}: whose KV is this {}", "z".repeat(20 + (i * 7) % 40));
    let mut body = if chat {
        json!({"model": "kvlease-synthetic", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "ignore_eos": true})
    } else {
        json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 8, "ignore_eos": true})
    };
    body["stream"] = json!(stream);
    (body, chat, stream)
}

/// SPEC U4, U8, P3, D7 (vLLM #55470: a write posted after P retired its request, a lease
/// expired with its write in flight — HTTP 200 built from another request's KV): requests flow
/// through `kvlease proxy` (both legs at once) to a push P with a small block pool, so every
/// freed block is soon another prompt's, while D is paused (`SIGSTOP`) twice for longer than
/// L = 2 s — its writes posted and unanswered, its renewals stopped, its leases expiring on P
/// with writes in flight or about to be posted, the blocks going to the next prompts. Every
/// answer is a local run's or a clean error, never a wrong 200; every lease P granted ended
/// exactly once (P3) and nothing is left held. A soak of the layers together, not the proof of
/// any one (early writes included: P's prefills write their computed blocks into D's
/// registrations while D is paused under them): run with P's posting gate (a write refused as `NotLive` by
/// `PushSource::begin_write` posted anyway) and D's write gate (`push::Gate` allowing every
/// write) both removed, it still passed (39 of 39 answered right, 2 leases expired, 9 released):
/// P's write timeout (at least 1 s, less than L) cancels every write before its lease can
/// expire, so no write here outlives its lease or posts from reused blocks. Each protection is
/// proven alone by the tests across hosts below (see the module's documentation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_leases_ending_under_writes_never_give_a_wrong_200() {
    const N: usize = 40;
    let local = Proc::serve("u4-local", &[]);
    let mut want = Vec::new();
    for i in 0..N {
        let (body, chat, stream) = request(i);
        want.push(answer(&local.url, &body, chat, stream).await.unwrap_or_else(|e| panic!("local run {i}: {e:?}")));
    }
    let cfg = push_config(2.0, 3.0);
    let p = Proc::serve("u4-p", &["--kv-transfer-config", &cfg, "--num-gpu-blocks", "24", "--prefill-ms-per-token", "2"]);
    let d = Proc::serve("u4-d", &["--kv-transfer-config", &cfg, "--max-num-seqs", "16"]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    // P's first answer teaches the proxy that P is a push engine; from then on both legs at once.
    let (body, chat, stream) = request(0);
    assert_eq!(answer(&proxy.url, &body, chat, stream).await.as_ref(), Ok(&want[0]), "warm-up");
    let want = std::sync::Arc::new(want);
    let mut tasks = Vec::new();
    for i in 1..N {
        let (url, want) = (proxy.url.clone(), want.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(120 * i as u64)).await;
            let (body, chat, stream) = request(i);
            (i, answer(&url, &body, chat, stream).await, want[i].clone())
        }));
    }
    for pause in [300u64, 1500] {
        tokio::time::sleep(Duration::from_millis(pause)).await;
        d.signal("STOP");
        tokio::time::sleep(Duration::from_millis(2600)).await;
        d.signal("CONT");
    }
    let (ok, failed) = no_wrong_200(tasks).await;
    let reasons = ["transferred", "released", "expired"];
    let mut ended = Vec::new();
    for r in reasons {
        ended.push(released(&p.url, r).await);
    }
    let early = metric(&p.url, "kvlease_push_early_blocks_total").await;
    eprintln!(
        "D paused twice past L: {ok} answered, {failed} failed; P's leases ended {:?} as {reasons:?}; {early} blocks written early",
        ended
    );
    assert!(ok >= N / 2, "most requests still answered ({ok} of {N})");
    // SPEC U4: P's prefills wrote blocks into D's registrations as they computed them, under
    // the pauses too (early writes are part of what this soaks).
    assert!(early > 0.0, "no block was written early");
    until_nothing_held(&p.url, Duration::from_secs(10)).await;
    let mut total = 0.0;
    for r in reasons {
        total += released(&p.url, r).await;
    }
    assert_eq!(total, metric(&p.url, "kvlease_leases_granted_total").await, "every lease ended exactly once (P3)");
    until_nothing_held(&d.url, Duration::from_secs(10)).await;
}

/// One sample of each of `names` from a single scrape of `base`'s `/metrics` (one instant's).
async fn scrape(base: &str, names: &[&str]) -> Vec<f64> {
    let text = client().get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).map(|v| v.trim().parse::<f64>().expect("number")))
            .unwrap_or_else(|| panic!("metric {name} not found"))
    };
    names.iter().map(|n| value(n)).collect()
}

/// 8 layers, head_dim 64: 8 KiB of KV a token (P and D must agree).
const SLOW_MODEL: [&str; 4] = ["--num-layers", "8", "--head-dim", "64"];
const KV_PER_TOKEN: u64 = 8 * 1024;
/// The prompt of [`SlowLink::give_up_under_the_write`]: 600 digits, a token each (38 blocks,
/// about 5 MB of KV).
const SLOW_TOKENS: usize = 600;

/// A push P on host `p1` whose sending is throttled to 16 Mbit/s, and a push D on host `d1`
/// (real network namespaces, `common::hosts`): P's write of a long prompt's KV takes seconds,
/// so D can give the request up while the write is in flight. L = 24 s: P's write timeout is
/// E/4 = 4 s, longer than the write.
struct SlowLink {
    p: Proc,
    d: Proc,
    kv_port: u64,
    net: Net,
}

impl SlowLink {
    /// Over `transport` (`tcp` or `nixl`).
    async fn start(tag: &str, transport: &str, p_flags: &[&str], d_flags: &[&str]) -> SlowLink {
        let net = Net::new(&["p1", "d1"]);
        let cfg = push_config(24.0, 30.0);
        let engine = |host: &str, extra: &[&str]| {
            let mut args = vec!["--kv-transfer-config", &cfg, "--transport", transport];
            args.extend_from_slice(&SLOW_MODEL);
            args.extend_from_slice(extra);
            let h = net.host(host);
            Proc::serve_on(&h.ns, &h.addr, &format!("{tag}-{host}"), &args)
        };
        let (p, d) = (engine("p1", p_flags), engine("d1", d_flags));
        // P's side-channel port from a probe, whose lease the router's release ends at once.
        let probe = prefill(&p, "probe").await;
        let (status, body) = post(&format!("{}/kvlease/release", p.url), &json!({"kv_transfer_params": probe})).await;
        assert_eq!(status, 200, "{body}");
        let kv_port = probe["remote_port"].as_u64().expect("P's side-channel port");
        until_nothing_held(&p.url, Duration::from_secs(5)).await;
        net.throttle("p1", 16);
        SlowLink { p, d, kv_port, net }
    }

    /// Both legs of a [`SLOW_TOKENS`]-token prompt at once, as vLLM's push router sends them;
    /// once P's write into D's blocks is under way (P sent 300 KB of it), the decode leg's client
    /// leaves: D releases the lease (U9) with the write in flight. Returns P's bytes sent before
    /// the write, and the prefill leg.
    async fn give_up_under_the_write(&self, router_id: &'static str) -> (u64, tokio::task::JoinHandle<u16>) {
        let prompt = format!("{router_id}: {}", (0..SLOW_TOKENS).map(|k| char::from(b'0' + (k % 10) as u8)).collect::<String>());
        let p_name = self.p.name.clone();
        let params = router_params_at(&p_name, &self.net.host("p1").addr, self.kv_port, router_id);
        let base = self.net.tx_bytes("p1");
        let leg = decode_leg(&self.d, &prompt, 4, params);
        let p_leg = prefill_leg(&self.p, &prompt, router_id);
        until("P's write into D's blocks is under way (P sent 300 KB)", DEADLINE, || async { self.net.tx_bytes("p1") > base + 300_000 })
            .await;
        leg.abort(); // the decode leg's client goes away: D aborts and releases the lease
        (base, p_leg)
    }
}

/// SPEC U4 (second sentence), P5 with the roles swapped (vLLM #55470: "the reaper can expire a
/// lease whose write is in flight", P's source blocks reused under the write): a lease that ends
/// while P's write of its blocks is in flight keeps those blocks out of P's pool until the write
/// has completed or failed. P's sending is throttled so its write of a 600-token prompt (5 MB)
/// takes seconds; D's client leaves half-way, D releases the lease (U9), and P ends it as
/// `released` at once — but in the same scrape of P's metrics its blocks are still held, while
/// D (scraped after) still waits for P's word that the write stopped, so the write was in
/// flight. Every block comes back once it ends. The lease here ends by D's release, not by
/// expiry, so P's write timeout (< L) does not come first; D's gate does not apply (the write
/// was admitted before D gave up), nor does the dead-lease completion rule (D gave the request
/// up and uses nothing of it: what is at stake is P's pool, whose freed blocks the next prompt
/// would take and overwrite under the write). Fails with the table's parking removed (in
/// `LeaseTable`'s release, a payload whose lease still has readers given back at once, as if it
/// had none): 48 of P's 48 blocks free at the release, under the write (9 with the parking).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_a_lease_released_under_a_write_keeps_its_blocks_until_the_write_ends() {
    if available() {
        blocks_held_under_the_write("tcp").await;
    }
}

/// The same over NIXL (UCX over TCP between the hosts). Fails the same way with the parking
/// removed (48 of 48 blocks free at the release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_u4_a_lease_released_under_a_write_keeps_its_blocks_until_the_write_ends() {
    if available() && nixl_or_skip() {
        blocks_held_under_the_write("nixl").await;
    }
}

async fn blocks_held_under_the_write(transport: &str) {
    let s = SlowLink::start(&format!("u4b-{transport}"), transport, &["--num-gpu-blocks", "48"], &[]).await;
    let released0 = released(&s.p.url, "released").await;
    let router_id = if transport == "nixl" { "u4b-nixl-router-id" } else { "u4b-tcp-router-id" };
    let (_, p_leg) = s.give_up_under_the_write(router_id).await;
    let names = [
        "kvlease_leases_released_total{reason=\"released\"}",
        "kvlease_kv_blocks_free",
        "kvlease_kv_blocks_total",
        "kvlease_leases_active",
    ];
    let t0 = Instant::now();
    let at_release = loop {
        let now = scrape(&s.p.url, &names).await;
        if now[0] == released0 + 1.0 {
            break now;
        }
        assert!(t0.elapsed() < DEADLINE, "P never ended the lease D released");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // D frees its blocks only once P said no write of them is in flight any more (U8): D still
    // holding them now means the write had not ended when P was scraped.
    let d_now = scrape(&s.d.url, &["kvlease_kv_blocks_free", "kvlease_kv_blocks_total"]).await;
    assert!(d_now[0] < d_now[1], "the write had already ended when P ended the lease: make it longer (D's blocks {d_now:?})");
    let (free, total) = (at_release[1], at_release[2]);
    eprintln!("{transport}: lease released under its write: P's blocks {free} free of {total}, leases active {}", at_release[3]);
    assert_eq!(at_release[3], 0.0, "the lease is ended");
    assert!(
        total - free >= (SLOW_TOKENS / 16) as f64,
        "P's blocks came back while its write of them was in flight: {free} free of {total}"
    );
    assert_eq!(p_leg.await.expect("prefill leg"), 200);
    until_nothing_held(&s.p.url, Duration::from_secs(15)).await;
    until_nothing_held(&s.d.url, Duration::from_secs(15)).await;
    assert_eq!(released(&s.p.url, "released").await, released0 + 1.0);
    assert_eq!(released(&s.p.url, "expired").await, 0.0);
    assert_eq!(released(&s.p.url, "transferred").await, 0.0);
}

/// SPEC U4 (first sentence: P posts a write only while the lease is live, checked at the moment
/// of posting; vLLM #55470: a write posted after P retired the request): D runs two ranks
/// (`--tp-size 2`), so P writes each half of the heads in turn, one write after the other, over
/// a link throttled so each takes a second. D's client leaves during the first write: D releases
/// the lease (U9). P ends it (held by the first write's blocks until that write ends) and must
/// not post the second write: P sends no more than the first write's bytes, and D refuses no
/// write. P's write timeout (< L) plays no part (the lease ends by D's release), nor does the
/// dead-lease completion rule (the first write was posted live). Fails with P's posting gate
/// removed (in `kvlease-engine`'s `push::write`, a write that `PushSource::begin_write`
/// refuses as `NotLive` posted anyway): P posts the second write into the blocks of a request
/// D gave up, and sends its bytes (on tcp D's own gate refuses it, and P stops part-way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_no_write_is_posted_after_the_lease_ended() {
    if available() {
        no_write_after_the_lease_ended("tcp").await;
    }
}

/// The same over NIXL (UCX over TCP between the hosts), whose WRITE D cannot refuse: P's gate
/// is the only fence there. Fails the same way with it removed: P sent 5.2 MB where the first
/// write is 2.5 MB, the second write sent whole into blocks D had already given back to its pool
/// (over tcp, 3.7 MB: D refused it and P stopped part-way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_u4_no_write_is_posted_after_the_lease_ended() {
    if available() && nixl_or_skip() {
        no_write_after_the_lease_ended("nixl").await;
    }
}

async fn no_write_after_the_lease_ended(transport: &str) {
    let s = SlowLink::start(&format!("u4a-{transport}"), transport, &[], &["--tp-size", "2"]).await;
    let released0 = released(&s.p.url, "released").await;
    let router_id = if transport == "nixl" { "u4a-nixl-router-id" } else { "u4a-tcp-router-id" };
    let (base, p_leg) = s.give_up_under_the_write(router_id).await;
    until("P ends the lease D released", DEADLINE, || async { released(&s.p.url, "released").await == released0 + 1.0 }).await;
    assert_eq!(p_leg.await.expect("prefill leg"), 200);
    // Every write stopped: P told D (PushLost), D freed its blocks.
    until_nothing_held(&s.d.url, Duration::from_secs(15)).await;
    until_nothing_held(&s.p.url, Duration::from_secs(15)).await;
    // P's link quiet (under 20 KB in half a second): a write posted late has been sent whole.
    let t0 = Instant::now();
    let mut last = s.net.tx_bytes("p1");
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = s.net.tx_bytes("p1");
        if now - last < 20_000 {
            break;
        }
        assert!(t0.elapsed() < DEADLINE, "P's link never went quiet");
        last = now;
    }
    let sent = s.net.tx_bytes("p1") - base;
    let kv = (SLOW_TOKENS as u64).div_ceil(16) * 16 * KV_PER_TOKEN;
    eprintln!("{transport}: P sent {sent} bytes after the legs started; one rank's write is {} bytes", kv / 2);
    // The first write whole, and the answers and metrics P sent (about 100 KB); a second write
    // refused by D still sends part of its bytes before P hears the refusal.
    assert!(sent < kv / 2 + 500_000, "P sent {sent} bytes: more than the first write (of {} bytes): it posted the second", kv / 2);
    assert_eq!(metric(&s.d.url, "kvlease_writes_refused_total").await, 0.0, "a write posted after the lease ended reached D");
    assert_eq!(released(&s.p.url, "expired").await, 0.0);
    assert_eq!(released(&s.p.url, "transferred").await, 0.0);
}

/// SPEC U6, P3 (vLLM #48633's "D is left to wait a failure out", for P's shutdown): P answers a
/// prefill (a sequential router's first leg: the lease is granted), and the decode leg queues on
/// a busy D, which renews P's lease from admission (U2) but has registered nothing yet. P is
/// then stopped gracefully (SIGTERM: it drains, then shuts down): it ends the lease as `shutdown`
/// and tells D the key is gone, so D, once its slot frees, recomputes at once — not after its
/// 10 s wait for writes from a P that is gone (U10). Fails without `push::shutdown_source` in
/// `Engine::shutdown` (as it was: P never ended its push leases at shutdown, D was never told):
/// D registers with the dead P and waits out its 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u6_p_shutting_down_tells_d_at_once() {
    let cfg = push_config(6.0, 10.0);
    let mut p = Proc::serve("u6s-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("u6s-d", &["--kv-transfer-config", &cfg, "--max-num-seqs", "1", "--decode-ms-per-token", "10"]);
    let local = Proc::serve("u6s-local", &[]);
    let prompt = "a decode leg whose prefill engine shuts down";
    let want = local_text(&local, prompt, 4).await;
    let params = prefill(&p, prompt).await;
    let hog = occupy(&d, 3000).await;
    let leg = {
        let url = format!("{}/v1/completions", d.url);
        let body =
            json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 4, "ignore_eos": true, "kv_transfer_params": params});
        tokio::spawn(async move {
            let r = client().post(url).json(&body).send().await.expect("decode leg");
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.expect("JSON"), Instant::now())
        })
    };
    until("D queues the leg and renews P's lease", DEADLINE, || async {
        metric(&d.url, "kvlease_requests_waiting").await == 1.0 && metric(&p.url, "kvlease_heartbeats_received_total").await >= 1.0
    })
    .await;
    p.signal("TERM");
    let t0 = Instant::now();
    while p.child.try_wait().expect("P's status").is_none() {
        assert!(t0.elapsed() < DEADLINE, "P did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    hog.abort(); // D's slot frees: the leg is scheduled
    let freed = Instant::now();
    recomputed_soon(leg, &d.url, &want, freed, Duration::from_secs(5), "after its slot freed; its wait for writes was 10 s").await;
    until_nothing_held(&d.url, Duration::from_secs(10)).await;
}

/// SPEC U8, U4 (D's write gate: not a byte lands outside the newest live registration; vLLM
/// #55470's write landing where nobody waits for it any more): P's write of a long prompt `x`
/// keeps its throttled link to D busy for seconds; meanwhile D registers a second request `y`,
/// P prefills it and posts its write at once (P's gate passes: the lease is live), but that
/// write's request waits behind `x`'s bytes already on the wire. The `y` decode leg's client
/// leaves as soon as P answered its prefill: D gives `y` up before `y`'s write arrives, and
/// refuses it (`kvlease_writes_refused_total` 1); every block comes back. Fails with D's gate
/// removed (`push::Gate` allowing every write): the count stays 0. What that removal costs is
/// not a wrong answer: D keeps the blocks of a request it gave up until P says its writes
/// stopped (U8), so the bytes land in blocks nobody reads; the gate is D's own fence, the only
/// one over a write P posted in good faith.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u8_d_refuses_a_write_for_blocks_it_gave_up() {
    if !available() {
        return;
    }
    let s = SlowLink::start("u8g", "tcp", &[], &[]).await;
    let host = s.net.host("p1").addr.clone();
    let x = format!("u8g-x: {}", (0..SLOW_TOKENS).map(|k| char::from(b'0' + (k % 10) as u8)).collect::<String>());
    let base = s.net.tx_bytes("p1");
    let x_leg = decode_leg(&s.d, &x, 4, router_params_at(&s.p.name, &host, s.kv_port, "u8g-x"));
    let x_p = prefill_leg(&s.p, &x, "u8g-x");
    until("P's write of x is under way (P sent 300 KB)", DEADLINE, || async { s.net.tx_bytes("p1") > base + 300_000 }).await;
    let y = "u8g-y: a short prompt whose write waits behind x's";
    let y_leg = decode_leg(&s.d, y, 4, router_params_at(&s.p.name, &host, s.kv_port, "u8g-y"));
    until("D registers y (x and y wait for writes)", DEADLINE, || async { metric(&s.d.url, "kvlease_requests_running").await == 2.0 })
        .await;
    // P answers y's prefill once it granted y's lease and posted y's write (D registered first).
    assert_eq!(prefill_leg(&s.p, y, "u8g-y").await.expect("prefill leg"), 200);
    y_leg.abort(); // y's client leaves: D gives y up, its write still on the wire
    assert_eq!(x_p.await.expect("prefill leg"), 200);
    until_nothing_held(&s.p.url, Duration::from_secs(15)).await;
    until_nothing_held(&s.d.url, Duration::from_secs(15)).await;
    x_leg.await.expect("x's decode leg");
    assert_eq!(metric(&s.d.url, "kvlease_writes_refused_total").await, 1.0, "D refuses y's write, which arrived after D gave y up");
    assert_eq!(released(&s.p.url, "transferred").await, 1.0, "x's write landed");
    assert_eq!(released(&s.p.url, "expired").await, 0.0);
}

/// SPEC U4 (second sentence) and U8 over NIXL (vLLM #55470: source blocks reused under a write
/// in flight): a NIXL WRITE cannot be cancelled (its dropped future does not stop it), so a
/// write P's timeout gives up on (`PushSource::abandon_write`) keeps its source blocks out of
/// P's pool — held by the quarantine — until NIXL says the transfer ended or the quarantine
/// passes; D, told `TimedOut`, recomputes into other blocks and reuses the registered ones only
/// once P says nothing more lands. Here D is stopped past P's write timeout (2 s at L = 12 s)
/// under a 16 MB WRITE and resumed 4 s later: P's blocks are still held when D resumes, and the
/// WRITE then sends its bytes from them. Failed before that fix (the write's ticket ended at the
/// timeout): P's 126 blocks were back in its pool before D resumed (another prompt could take
/// them, and did in a manual run), then P sent the whole 16 MB of the WRITE from them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_u4_a_write_given_up_on_p_reads_no_freed_block() {
    if !(available() && nixl_or_skip()) {
        return;
    }
    let net = Net::new(&["p1", "d1"]);
    let cfg = push_config(12.0, 30.0);
    let engine = |host: &str, extra: &[&str]| {
        let mut args = vec!["--kv-transfer-config", &cfg, "--transport", "nixl"];
        args.extend_from_slice(&SLOW_MODEL);
        args.extend_from_slice(extra);
        let h = net.host(host);
        Proc::serve_on(&h.ns, &h.addr, &format!("u4n-{host}"), &args)
    };
    let (p, d) = (engine("p1", &["--num-gpu-blocks", "160"]), engine("d1", &[]));
    let probe = prefill(&p, "probe").await;
    let (status, body) = post(&format!("{}/kvlease/release", p.url), &json!({"kv_transfer_params": probe})).await;
    assert_eq!(status, 200, "{body}");
    let kv_port = probe["remote_port"].as_u64().expect("P's side-channel port");
    until_nothing_held(&p.url, Duration::from_secs(5)).await;
    let prompt = format!("u4n: {}", (0..2000).map(|k| char::from(b'0' + (k % 10) as u8)).collect::<String>());
    let router_id = "u4n-router-id";
    let leg = decode_leg(&d, &prompt, 4, router_params_at(&p.name, &net.host("p1").addr, kv_port, router_id));
    // D registered (waits for writes) and P heard it (D's heartbeat follows the registration).
    until("D registers with P", DEADLINE, || async {
        metric(&d.url, "kvlease_requests_running").await == 1.0 && metric(&p.url, "kvlease_heartbeats_received_total").await >= 1.0
    })
    .await;
    d.signal("STOP");
    assert_eq!(prefill_leg(&p, &prompt, router_id).await.expect("prefill leg"), 200);
    tokio::time::sleep(Duration::from_secs(4)).await; // the pause's length: past P's 2 s write timeout
    let [free, total] = scrape(&p.url, &["kvlease_kv_blocks_free", "kvlease_kv_blocks_total"]).await[..] else { unreachable!() };
    let before = net.tx_bytes("p1");
    d.signal("CONT");
    until_nothing_held(&d.url, Duration::from_secs(20)).await;
    leg.abort();
    let after = net.tx_bytes("p1") - before;
    eprintln!("D resumed with {free} of P's {total} blocks free; P then sent {after} bytes");
    assert!(
        free < total || after < 1_000_000,
        "P's blocks were back in its pool while its NIXL WRITE still read them: {after} bytes sent from them"
    );
    // Held, not leaked: back once NIXL said the WRITE ended; D answered from its own prefill.
    until_nothing_held(&p.url, Duration::from_secs(15)).await;
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 1.0);
}

/// SPEC D5, O4: P is killed (`SIGKILL`) while D holds a request registered with it and waiting
/// for its writes (the router's prefill leg not sent yet), and P does not come back. D's link
/// to P breaks, its next handshake fails, and the request fails over then (recomputed: the local
/// run's answer), not at the end of its 30 s wait for writes (U10). Fails when a failed
/// handshake does not reach D's push machine (`PushSink::link_failed` not called from the
/// engine's `push::link_failed`): D answers after its full wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d5_o4_p_killed_under_a_registered_request_fails_it_over_at_the_next_handshake() {
    let cfg = push_config(30.0, 30.0);
    let p = Proc::serve("d5k-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("d5k-d", &["--kv-transfer-config", &cfg]);
    let local = Proc::serve("d5k-local", &[]);
    let kv_port = prefill(&p, "probe").await["remote_port"].as_u64().expect("P's side-channel port");
    let prompt = "a request registered with a prefill engine that dies";
    let want = local_text(&local, prompt, 4).await;
    let leg = {
        let url = format!("{}/v1/completions", d.url);
        let body = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": 4, "ignore_eos": true,
            "kv_transfer_params": router_params("d5k-p", kv_port, "d5k-router-id")});
        tokio::spawn(async move {
            let r = client().post(url).json(&body).send().await.expect("decode leg");
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.expect("JSON"), Instant::now())
        })
    };
    until("D registers and waits for P's writes", DEADLINE, || async { metric(&d.url, "kvlease_requests_running").await == 1.0 }).await;
    p.signal("KILL");
    let killed = Instant::now();
    recomputed_soon(leg, &d.url, &want, killed, Duration::from_secs(15), "after P died; its wait for writes was 30 s").await;
    // Its registered blocks stay held to the end of the write window (U8: D cannot know that no
    // write P posted is still on its way), as `u8_d_refuses_a_write_for_blocks_it_gave_up` shows.
}

/// D's leg (status, body, when it ended) answered 200 with the local run's answer, recomputed
/// (D's only recompute), within `limit` of `since` rather than at the end of its wait (`wait`).
async fn recomputed_soon(
    leg: tokio::task::JoinHandle<(u16, Value, Instant)>,
    d_url: &str,
    want: &str,
    since: Instant,
    limit: Duration,
    wait: &str,
) {
    let (status, got, at) = leg.await.expect("decode leg");
    assert_eq!(status, 200, "{got}");
    assert_eq!(text_of(&got, false), want, "recomputed: the local run's answer");
    assert!(at - since < limit, "D answered {:?} {wait}", at - since);
    assert_eq!(metric(d_url, "kvlease_recomputed_requests_total").await, 1.0);
}
