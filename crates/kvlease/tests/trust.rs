//! Trust on the wire (SPEC §8), attacked for real: real `kvlease` processes on loopback, params
//! moved between prompts and engines the way a buggy router or a hostile engine would.

mod common;
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// Two prompts of the same length in tokens (bytes), so only their content tells them apart.
const PROMPT_A: &str = "alpha beta gamma delta";
const PROMPT_B: &str = "delta gamma beta alpha";

fn completion(prompt: &str, max_tokens: u32, params: Option<&Value>) -> Value {
    let mut body = json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true});
    if let Some(p) = params {
        body["kv_transfer_params"] = p.clone();
    }
    body
}

/// The prefill leg, as vLLM's proxy sends it: P's `kv_transfer_params` for `prompt`.
async fn prefill(p: &Proc, prompt: &str) -> Value {
    let (status, body) = post(&format!("{}/v1/completions", p.url), &completion(prompt, 1, Some(&json!({"do_remote_decode": true})))).await;
    assert_eq!(status, 200, "{body}");
    body["kv_transfer_params"].clone()
}

async fn text(url: &str, body: &Value) -> String {
    let (status, got) = post(&format!("{url}/v1/completions"), body).await;
    assert_eq!(status, 200, "{got}");
    text_of(&got, false)
}

/// SPEC S4, O4, D7 (vLLM #52234): without a cluster secret, a router hands D prompt A with the
/// params P returned for prompt B (same length). D must not read B's KV: it computes A itself and
/// answers A's right output, and releases B's lease at once (nobody will read it through params
/// that went to another prompt): B's own request afterwards recomputes, still right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_o4_params_of_another_prompt_are_recomputed_and_released() {
    let cfg = lease_config(30.0);
    let p = Proc::serve_with_secret("s4-p", &["--kv-transfer-config", &cfg], None);
    let d = Proc::serve_with_secret("s4-d", &["--kv-transfer-config", &cfg], None);
    let local = Proc::serve_with_secret("s4-local", &[], None);
    let want_a = text(&local.url, &completion(PROMPT_A, 8, None)).await;
    let want_b = text(&local.url, &completion(PROMPT_B, 8, None)).await;
    assert_ne!(want_a, want_b, "the prompts must differ in output for the test to mean anything");

    let params_a = prefill(&p, PROMPT_A).await;
    let params_b = prefill(&p, PROMPT_B).await;
    assert!(params_b["kvlease_prompt_digest"].is_string(), "{params_b}");

    assert_eq!(text(&d.url, &completion(PROMPT_A, 8, Some(&params_b))).await, want_a, "A with B's params");
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 1.0);
    assert_eq!(metric(&p.url, "kvlease_reads_refused_total").await, 0.0, "D did not even try to read");
    until("B's lease released at once (O4), A's kept", Duration::from_secs(2), || async {
        metric(&p.url, "kvlease_leases_released_total{reason=\"released\"}").await == 1.0
    })
    .await;
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 1.0, "A's lease is untouched");

    assert_eq!(text(&d.url, &completion(PROMPT_B, 8, Some(&params_b))).await, want_b, "B, its lease gone, recomputes");
    assert_eq!(text(&d.url, &completion(PROMPT_A, 8, Some(&params_a))).await, want_a, "A pulls its own KV");
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 2.0, "A pulled");
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 1.0);
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 0.0);
}

/// SPEC S4 binds the fields, not only the prompt: params of prompt B with their digest and token
/// count forged to prompt A's (no cluster secret, so nothing is signed) still name B's lease and
/// blocks, which A's digest does not cover: D finds it before reading, computes A's right answer,
/// and releases B's lease (O4). P's gate, which would refuse the read too, is never asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_a_digest_moved_to_another_lease_is_not_read() {
    let cfg = lease_config(30.0);
    let p = Proc::serve_with_secret("s4g-p", &["--kv-transfer-config", &cfg], None);
    let d = Proc::serve_with_secret("s4g-d", &["--kv-transfer-config", &cfg], None);
    let local = Proc::serve_with_secret("s4g-local", &[], None);
    let want_a = text(&local.url, &completion(PROMPT_A, 8, None)).await;
    let params_a = prefill(&p, PROMPT_A).await;
    let mut forged = prefill(&p, PROMPT_B).await;
    forged["kvlease_prompt_digest"] = params_a["kvlease_prompt_digest"].clone();
    forged["remote_num_tokens"] = params_a["remote_num_tokens"].clone();
    assert_eq!(text(&d.url, &completion(PROMPT_A, 8, Some(&forged))).await, want_a, "A with B's lease, A's digest");
    assert_eq!(metric(&p.url, "kvlease_reads_refused_total").await, 0.0, "D never read");
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 1.0);
    until("B's lease released (O4)", Duration::from_secs(2), || async { metric(&p.url, "kvlease_leases_active").await == 1.0 }).await;
    assert_eq!(text(&d.url, &completion(PROMPT_A, 8, Some(&params_a))).await, want_a, "A's own params still pull");
    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 1.0);
}

/// SPEC S4 under `kv_load_failure_policy: fail`: params of another prompt are a clear 400 naming
/// `kv_transfer_params`, never a read; the lease they name is released at once (O4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_o4_params_of_another_prompt_fail_clearly_under_fail_policy() {
    let fail = r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_load_failure_policy":"fail"}"#;
    let p = Proc::serve_with_secret("s4f-p", &[], None);
    let d = Proc::serve_with_secret("s4f-d", &["--kv-transfer-config", fail], None);
    let params_b = prefill(&p, PROMPT_B).await;
    let (status, body) = post(&format!("{}/v1/completions", d.url), &completion(PROMPT_A, 8, Some(&params_b))).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "kv_transfer_params", "{body}");
    assert!(body["error"]["message"].as_str().unwrap_or("").contains("another prompt"), "{body}");
    until("the lease released at once (O4)", Duration::from_secs(2), || async { metric(&p.url, "kvlease_leases_active").await == 0.0 })
        .await;
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"released\"}").await, 1.0);
}

/// A prompt of 69 tokens: five blocks of 16, so a block list can be reordered.
const LONG_PROMPT: &str = "the lease holds the blocks of this prompt until the decoder reads them in order.";

/// SPEC S4, O4, D7 (issue 22): genuine params whose `remote_block_ids` a router mangled — sorted
/// (P hands blocks out in descending order), reversed, rotated, repeated, truncated, extended —
/// are never read: no wrong answer with a 200, D recomputes the right one, and the lease they name
/// is released at once (none left on P within 2 s). The same params unmangled are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s4_o4_mangled_block_lists_never_give_a_wrong_answer_nor_strand_a_lease() {
    mangled_block_lists("tcp").await;
}

/// The same over NIXL, whose READs P's gate does not see: D's check before it posts the read is
/// what keeps a mangled list from being read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_s4_o4_mangled_block_lists_never_give_a_wrong_answer_nor_strand_a_lease() {
    if nixl_or_skip() {
        mangled_block_lists("nixl").await;
    }
}

async fn mangled_block_lists(transport: &str) {
    let cfg = lease_config(30.0);
    let args = ["--kv-transfer-config", &cfg, "--transport", transport];
    let p = Proc::serve_with_secret("s4m-p", &args, None);
    let d = Proc::serve_with_secret("s4m-d", &args, None);
    let local = Proc::serve_with_secret("s4m-local", &[], None);
    let want = text(&local.url, &completion(LONG_PROMPT, 8, None)).await;
    type Mangle = fn(&mut Vec<u64>);
    let mangles: [(&str, Mangle); 6] = [
        ("sorted", |b| b.sort_unstable()),
        ("reversed", |b| b.reverse()),
        ("rotated", |b| b.rotate_left(1)),
        ("repeated", |b| {
            let b0 = b[0];
            b.iter_mut().for_each(|x| *x = b0)
        }),
        ("truncated", |b| b.truncate(b.len() - 1)),
        ("extended", |b| b.push(b[0])),
    ];
    for (i, (how, mangle)) in mangles.iter().enumerate() {
        let mut params = prefill(&p, LONG_PROMPT).await;
        let mut blocks: Vec<u64> = params["remote_block_ids"].as_array().expect("block ids").iter().filter_map(Value::as_u64).collect();
        assert_eq!(blocks.len(), 5);
        let before = blocks.clone();
        mangle(&mut blocks);
        assert_ne!(blocks, before, "{how}");
        params["remote_block_ids"] = json!(blocks);
        let (status, body) = post(&format!("{}/v1/completions", d.url), &completion(LONG_PROMPT, 8, Some(&params))).await;
        assert!(status == 200 && text_of(&body, false) == want || status >= 400, "{how}: a wrong answer with {status}: {body}");
        assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, (i + 1) as f64, "{how}: recomputed, not read");
        until(&format!("{how}: no lease left on P"), Duration::from_secs(2), || async {
            metric(&p.url, "kvlease_leases_active").await == 0.0
        })
        .await;
    }
    assert_eq!(metric(&p.url, "kvlease_reads_refused_total").await, 0.0, "D never tried a mangled read");
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 0.0);
    let params = prefill(&p, LONG_PROMPT).await;
    assert_eq!(text(&d.url, &completion(LONG_PROMPT, 8, Some(&params))).await, want, "unmangled params are read");
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 1.0);
}

/// SPEC O4, D7 (issue 22, self-pairing): a `kv_both` engine handed its own params — directly, and
/// through `kvlease proxy` with it as the only prefiller and decoder — takes the prompt's KV from
/// its own lease: the right answer, nothing recomputed, no handshake with itself, and the lease
/// ends at once as `transferred`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o4_an_engine_paired_with_itself_serves_from_its_own_blocks() {
    let cfg = lease_config(30.0);
    let e = Proc::serve_with_secret("self-e", &["--kv-transfer-config", &cfg], None);
    let local = Proc::serve_with_secret("self-local", &[], None);
    let want = text(&local.url, &completion(LONG_PROMPT, 8, None)).await;
    let params = prefill(&e, LONG_PROMPT).await;
    assert_eq!(text(&e.url, &completion(LONG_PROMPT, 8, Some(&params))).await, want);
    assert_eq!(metric(&e.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 1.0);
    assert_eq!(metric(&e.url, "kvlease_leases_active").await, 0.0);
    // The same params again: the lease has ended, so the prompt is computed here, still right.
    assert_eq!(text(&e.url, &completion(LONG_PROMPT, 8, Some(&params))).await, want);
    assert_eq!(metric(&e.url, "kvlease_recomputed_requests_total").await, 1.0);

    let proxy = Proc::proxy(&[&e], &[&e]);
    for _ in 0..3 {
        assert_eq!(text(&proxy.url, &completion(LONG_PROMPT, 8, None)).await, want, "through the proxy");
    }
    assert_eq!(metric(&e.url, "kvlease_recomputed_requests_total").await, 1.0, "nothing recomputed through the proxy");
    assert_eq!(metric(&e.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 4.0);
    until_nothing_held(&e.url, Duration::from_secs(2)).await;
}

/// SPEC S5: a lease belongs to the first engine that renews it. D1 holds a request queued behind
/// a long one, heartbeating its lease; a second engine of the cluster (same secret) is handed the
/// same params. Its heartbeats are answered lost, so it never reads, and its release changes
/// nothing; it recomputes the right answer. D1's request then pulls its KV untouched: no
/// recompute on D1, the lease released once, as `transferred`. (Reads and completions by a
/// non-holder are refused in the core: `s5_a_lease_belongs_to_its_first_holder`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s5_another_decoder_cannot_renew_read_or_release_a_held_lease() {
    let cfg = lease_config(3.0); // I = 0.5 s: D1 claims the lease within a second of arrival
    let p = Proc::serve("s5-p", &["--kv-transfer-config", &cfg]);
    let d1 = Proc::serve("s5-d1", &["--kv-transfer-config", &cfg, "--max-num-seqs", "1", "--decode-ms-per-token", "100"]);
    let d2 = Proc::serve("s5-d2", &["--kv-transfer-config", &cfg]);
    let local = Proc::serve("s5-local", &[]);
    let want = text(&local.url, &completion(PROMPT_A, 4, None)).await;
    let params = prefill(&p, PROMPT_A).await;

    // D1 is busy for ~3 s; the request waits in its queue, renewing.
    let busy = tokio::spawn({
        let url = d1.url.clone();
        async move { text(&url, &completion(PROMPT_B, 30, None)).await }
    });
    until("D1 to run its long request", DEADLINE, || async { metric(&d1.url, "kvlease_requests_running").await == 1.0 }).await;
    let held = tokio::spawn({
        let (url, body) = (d1.url.clone(), completion(PROMPT_A, 4, Some(&params)));
        async move { text(&url, &body).await }
    });
    until("D1 to renew the lease", DEADLINE, || async { metric(&p.url, "kvlease_lease_renewals_total").await >= 1.0 }).await;

    // The second decoder: it handshakes (it holds the secret), heartbeats, reads, releases.
    assert_eq!(text(&d2.url, &completion(PROMPT_A, 4, Some(&params))).await, want);
    assert_eq!(metric(&d2.url, "kvlease_recomputed_requests_total").await, 1.0, "D2 could not use D1's lease");
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 1.0, "D2 neither completed nor released it");
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"released\"}").await, 0.0);

    assert_eq!(held.await.expect("D1's request"), want);
    busy.await.expect("the long request");
    assert_eq!(metric(&d1.url, "kvlease_recomputed_requests_total").await, 0.0, "D1 pulled its KV");
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 1.0);
    assert_eq!(metric(&p.url, "kvlease_leases_active").await, 0.0);
}

/// The TCP ports a process listens on, from /proc: how an outsider who can reach the machine finds
/// the transfer agents' ports (a port scan would do the same).
fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(String::from))
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let listening = f.get(3) == Some(&"0A") && f.get(9).is_some_and(|i| inodes.iter().any(|x| x == i));
            let port = f.get(1)?.rsplit_once(':')?.1;
            listening.then(|| u16::from_str_radix(port, 16).ok()).flatten()
        })
        .collect()
}

/// Agent name of rank 0 of the engine that issued these params, as any HTTP client learns it:
/// `{remote_engine_id}/{remote_incarnation:x}/0`.
fn agent_name(params: &Value) -> String {
    let engine = params["remote_engine_id"].as_str().expect("engine id");
    let inc: u64 = params["remote_incarnation"].as_str().and_then(|s| s.parse().ok()).expect("incarnation");
    format!("{engine}/{inc:x}/0")
}

/// An impostor: a real tcp transfer agent named as `claimed`, holding a guessed secret, that dials
/// every port of `victim_pid` claiming to be `claimed` to the agent `victim_agent`. Returns how
/// many dials the victim accepted.
async fn impostor_dials(claimed: &str, victim_agent: &str, victim_pid: u32) -> usize {
    use kvlease_transport::{tcp, Agent, BlockArena, OpenGate};
    let (events, _rx) = tokio::sync::mpsc::unbounded_channel();
    let options = tcp::TcpOptions { secret: Some(b"a guess".to_vec()), connect_timeout: Duration::from_secs(1), ..Default::default() };
    let arena = BlockArena::new(64, 4096);
    let agent = tcp::TcpAgent::start_with(claimed.to_string(), "127.0.0.1", arena, std::sync::Arc::new(OpenGate), events, options)
        .await
        .expect("impostor agent");
    let mut accepted = 0;
    for port in listening_ports(victim_pid) {
        let md = tcp::metadata(victim_agent, std::net::SocketAddr::from(([127, 0, 0, 1], port)));
        if agent.add_peer(&md).await.is_ok() {
            accepted += 1;
            // Had it worked, this is what the attacks of the issue did next.
            let _ = agent.send_notif(victim_agent, kvlease_core::wire::Message::Release { lease_ids: (1..200).collect() }.encode());
        }
        agent.remove_peer(victim_agent);
    }
    accepted
}

/// SPEC S2 (the impersonation attacks of issue "Trust on the wire"), with a cluster secret the
/// attacker does not hold. Knowing P's and D's agent names (learned from kv_transfer_params
/// over HTTP) and their ports, an impostor dials D's agents as P's agent (to answer D's
/// heartbeats and serve it zeros) and P's agents as D's agent (to read KV and release leases),
/// before and during traffic through the proxy. Every dial is refused and counted as
/// `unauthenticated`; the real connections survive; every answer equals a local run, nothing is
/// recomputed, and no lease is released by anyone but its holder's reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s2_impostor_agents_without_the_secret_change_nothing() {
    let cfg = lease_config(30.0);
    let p = Proc::serve("imp-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("imp-d", &["--kv-transfer-config", &cfg]);
    let local = Proc::serve("imp-local", &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let (p_pid, d_pid) = (p.child.id(), d.child.id());

    // What any HTTP client can learn: both engines' agent names.
    let p_agent = agent_name(&prefill(&p, PROMPT_A).await);
    let d_agent = agent_name(&prefill(&d, PROMPT_A).await);
    // One request through the proxy so that the real P–D connections exist.
    let want = text(&local.url, &completion(PROMPT_B, 6, None)).await;
    assert_eq!(text(&proxy.url, &completion(PROMPT_B, 6, None)).await, want);

    assert_eq!(impostor_dials(&p_agent, &d_agent, d_pid).await, 0, "D accepted an impostor as P");
    assert_eq!(impostor_dials(&d_agent, &p_agent, p_pid).await, 0, "P accepted an impostor as D");

    // Traffic, with the impostors dialing all the while.
    let attack = tokio::spawn(async move {
        let mut accepted = 0;
        for _ in 0..3 {
            accepted += impostor_dials(&p_agent, &d_agent, d_pid).await;
            accepted += impostor_dials(&d_agent, &p_agent, p_pid).await;
        }
        accepted
    });
    for i in 0..10 {
        let prompt = format!("{PROMPT_A} {i}");
        let want = text(&local.url, &completion(&prompt, 6, None)).await;
        assert_eq!(text(&proxy.url, &completion(&prompt, 6, None)).await, want, "request {i}");
    }
    assert_eq!(attack.await.expect("attack"), 0, "an impostor was accepted during traffic");

    assert_eq!(metric(&d.url, "kvlease_recomputed_requests_total").await, 0.0, "every request pulled its KV from P");
    assert_eq!(metric(&d.url, "kvlease_lease_lost_total").await, 0.0);
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"transferred\"}").await, 11.0);
    assert_eq!(metric(&p.url, "kvlease_leases_released_total{reason=\"released\"}").await, 0.0);
    let unread = metric(&p.url, "kvlease_leases_active").await + metric(&p.url, "kvlease_leases_released_total{reason=\"expired\"}").await;
    assert_eq!(unread, 1.0, "the lease nobody was asked to read is live or expired, not released");
    let unauthenticated = "kvlease_messages_rejected_total{reason=\"unauthenticated\"}";
    assert!(metric(&p.url, unauthenticated).await >= 1.0, "P counted the impostor");
    assert!(metric(&d.url, unauthenticated).await >= 1.0, "D counted the impostor");
}
