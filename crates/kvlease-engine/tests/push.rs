//! Push mode through real engines on loopback (SPEC §13): P writes the prompt's KV into blocks
//! D allocated and registered, over the tcp agent's one-sided writes, under the same leases.
//! Each test names the SPEC ids it proves.

mod common;

use common::*;
use kvlease_core::lease_table::ReleaseReason;
use kvlease_engine::{EngineConfig, EngineHandle, GenerateRequest, Prompt, TransportKind};
use serde_json::{json, Value};
use std::time::Duration;

/// A push engine (`kv_connector: NixlPushConnector`) with lease L and D's write wait.
fn push_config(lease_secs: f64, tp: u32, wait_secs: f64) -> EngineConfig {
    let mut cfg = config(lease_secs, tp);
    cfg.transfer.kv_connector = kvlease_core::config::PUSH_CONNECTOR.into();
    cfg.transfer.lease.push_registration_timeout = Duration::from_secs_f64(wait_secs);
    cfg
}

/// What vLLM's push router hands D before P has answered: P's coordinates and the shared
/// request id, no blocks.
fn router_params(p: &EngineHandle, request_id: &str) -> Value {
    json!({"do_remote_decode": false, "do_remote_prefill": true, "remote_engine_id": p.engine_id(),
        "remote_host": "127.0.0.1", "remote_port": p.kv_addr().port(), "tp_size": 1, "pp_size": 1,
        "remote_request_id": request_id})
}

/// D's leg of a dispatch that sends both legs at once (vLLM's push router): started now, it waits
/// for P's writes under `request_id`.
fn decode_leg(
    d: &EngineHandle,
    p: &EngineHandle,
    request_id: &str,
    prompt: &str,
    max_tokens: u32,
) -> tokio::task::JoinHandle<Result<(String, Option<Value>), kvlease_engine::RequestError>> {
    let (d, params, prompt) = (d.clone(), router_params(p, request_id), prompt.to_owned());
    tokio::spawn(async move { run_as(&d, "decode-leg", &prompt, max_tokens, Some(params)).await })
}

async fn local_answer(max_tokens: u32) -> String {
    let local = engine(config(30.0, 1)).await;
    run(&local, PROMPT, max_tokens, None).await.expect("local run").0
}

/// SPEC U1, U5, P1, P3, D7: a sequential router forwards P's push answer to D: D registers its
/// blocks, P writes into them and ends the lease as `transferred` on the last write; the answer
/// equals a local run, nothing is recomputed, and every block is back on P.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u1_u5_push_through_a_sequential_router_equals_local() {
    push_through_a_sequential_router(TransportKind::Tcp).await;
}

/// The same over NIXL (UCX over TCP): P's writes are NIXL WRITEs of its descriptors into D's.
/// NIXL's WRITE cannot be refused by D's gate: what fences it is P's gate (U4, U8: no write
/// posted for a lease not live, or near D's deadline) and D reusing the blocks only once every
/// write stopped or the deadline and a grace passed.
#[cfg(feature = "nixl")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_u1_u5_push_through_a_sequential_router_equals_local() {
    if nixl_or_skip() {
        push_through_a_sequential_router(TransportKind::Nixl).await;
    }
}

async fn push_through_a_sequential_router(transport: TransportKind) {
    let want = local_answer(24).await;
    let (p, d) = (engine(on(push_config(30.0, 1, 30.0), transport.clone())).await, engine(on(push_config(30.0, 1, 30.0), transport)).await);
    for i in 0..3 {
        let id = format!("seq-{i}");
        let (_, params) = run_as(&p, &id, PROMPT, 1, prefill_params()).await.expect("prefill");
        let params = params.expect("P answers with params");
        assert_eq!(params["transfer_mode"], "push", "{params}");
        assert_eq!(params["remote_request_id"], id.as_str(), "{params}");
        assert!(params.get("remote_block_ids").is_none(), "P names no blocks in push mode: {params}");
        let (got, _) = run_as(&d, &format!("d-{i}"), PROMPT, 24, Some(params)).await.expect("decode");
        assert_eq!(got, want, "request {i}");
        // The count moves (and the blocks come back) just after the table lets the lease go.
        let n = i as u64 + 1;
        until("P ends the lease", Duration::from_secs(5), || {
            p.live_leases() == 0 && p.metrics().released(ReleaseReason::Transferred).get() >= n && p.metrics().kv_blocks_free.get() == 256
        })
        .await;
    }
    assert_eq!(p.metrics().released(ReleaseReason::Transferred).get(), 3, "every transfer counted as transferred");
    assert_eq!(d.metrics().recomputed_requests.get(), 0);
    assert_eq!(p.metrics().kv_blocks_free.get(), 256, "every block back on P");
    assert_eq!(d.metrics().writes_refused.get(), 0);
}

/// SPEC U1, U2: vLLM's push router sends both legs at once: D admits the request and registers
/// before P has even started its prefill; P pairs the registration with the lease it grants at
/// the end of its prefill, by the router's request id, and writes. The answer equals local.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u2_both_legs_at_once_pair_by_the_routers_id() {
    let want = local_answer(16).await;
    let mut pcfg = push_config(30.0, 1, 30.0);
    // A prefill that takes a while, so D's registration certainly comes first.
    pcfg.model.prefill_ms_per_token = 5.0;
    let (p, d) = (engine(pcfg).await, engine(push_config(30.0, 1, 30.0)).await);
    for i in 0..3 {
        let id = format!("both-{i}");
        let decode = decode_leg(&d, &p, &id, PROMPT, 16);
        let (_, params) = run_as(&p, &id, PROMPT, 1, prefill_params()).await.expect("prefill");
        assert_eq!(params.expect("params")["transfer_mode"], "push");
        let (got, _) = decode.await.expect("joins").expect("decode");
        assert_eq!(got, want, "request {i}");
    }
    until("P ends the leases", Duration::from_secs(5), || {
        p.live_leases() == 0 && p.metrics().released(ReleaseReason::Transferred).get() >= 3
    })
    .await;
    assert_eq!(p.metrics().released(ReleaseReason::Transferred).get(), 3);
    assert_eq!(d.metrics().recomputed_requests.get(), 0);
}

/// SPEC U4 (early writes), U5, D7: both legs at once and a prefill that takes time: P writes
/// each block into D's registration as its prefill computes it, the last one too (as the
/// prefill ends and P grants, before P computes its own first token), so the transfer's writes
/// after the grant carry no byte, only the completion. The answer equals local, and so does P's
/// first token (computed from its blocks while the lease may already have ended), every lease
/// ends `transferred`, nothing is recomputed, D refuses no write, every block is back on P.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_early_writes_overlap_the_prefill_and_the_answer_equals_local() {
    for (p_tp, d_tp) in [(1, 1), (2, 1), (1, 2)] {
        early_writes_overlap_the_prefill(TransportKind::Tcp, p_tp, d_tp).await;
    }
}

/// The same over NIXL: early writes are NIXL WRITEs of the computed blocks.
#[cfg(feature = "nixl")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_u4_early_writes_overlap_the_prefill_and_the_answer_equals_local() {
    if nixl_or_skip() {
        early_writes_overlap_the_prefill(TransportKind::Nixl, 1, 1).await;
    }
}

async fn early_writes_overlap_the_prefill(transport: TransportKind, p_tp: u32, d_tp: u32) {
    // Several blocks (16 tokens each), so there is something to write before the last.
    let prompt = [PROMPT; 4].join(" ");
    let want = run(&engine(config(30.0, 1)).await, &prompt, 16, None).await.expect("local run").0;
    let mut pcfg = on(push_config(30.0, p_tp, 30.0), transport.clone());
    pcfg.model.prefill_ms_per_token = 4.0;
    let (p, d) = (engine(pcfg).await, engine(on(push_config(30.0, d_tp, 30.0), transport)).await);
    for i in 0..3 {
        let id = format!("early-{p_tp}-{d_tp}-{i}");
        let decode = decode_leg(&d, &p, &id, &prompt, 16);
        let (first, params) = run_as(&p, &id, &prompt, 1, prefill_params()).await.expect("prefill");
        assert_eq!(params.expect("params")["transfer_mode"], "push");
        assert!(
            !first.is_empty() && want.starts_with(&first),
            "P tp {p_tp}, D tp {d_tp}, request {i}: P's first token {first:?}, local {want:?}"
        );
        let (got, _) = decode.await.expect("joins").expect("decode");
        assert_eq!(got, want, "P tp {p_tp}, D tp {d_tp}, request {i}");
    }
    until("P ends the leases and has every block back", Duration::from_secs(5), || {
        p.live_leases() == 0 && p.metrics().released(ReleaseReason::Transferred).get() >= 3 && p.metrics().kv_blocks_free.get() == 256
    })
    .await;
    assert_eq!(p.metrics().released(ReleaseReason::Transferred).get(), 3);
    // D registers long before the 4 ms a token prefill ends: every block of the three prompts
    // goes early (16 tokens a block).
    let blocks = 3 * (p.metrics().prefill_tokens.get() / 3).div_ceil(16);
    assert_eq!(p.metrics().push_early_blocks.get(), blocks, "P tp {p_tp}, D tp {d_tp}: blocks written before the grant");
    assert_eq!(d.metrics().recomputed_requests.get(), 0);
    assert_eq!(d.metrics().writes_refused.get(), 0);
}

/// SPEC U1, U4 (a router's mistake): two prefill legs under one key reach P at once while D
/// waits with its registration; they prefill in one step, one of them writing early. Exactly one
/// is granted; the other is refused with 409 naming the key (or finds the key's transfer ended
/// already); D's answer equals local, nothing is recomputed, and P ends with no lease and every
/// block back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u1_u4_two_prefills_under_one_key_give_one_grant_and_a_right_answer() {
    let prompt = [PROMPT; 4].join(" ");
    let want = run(&engine(config(30.0, 1)).await, &prompt, 8, None).await.expect("local run").0;
    let mut pcfg = push_config(30.0, 1, 30.0);
    pcfg.model.prefill_ms_per_token = 2.0;
    let (p, d) = (engine(pcfg).await, engine(push_config(30.0, 1, 30.0)).await);
    for i in 0..4 {
        let id = format!("dup-{i}");
        let decode = decode_leg(&d, &p, &id, &prompt, 8);
        // A local prefill holds P's scheduler while both legs queue: they prefill in one step.
        let hog = {
            let (p, prompt) = (p.clone(), [PROMPT; 2].join(" "));
            tokio::spawn(async move { run(&p, &prompt, 1, None).await })
        };
        until("P computes", Duration::from_secs(5), || p.metrics().requests_running.get() == 1).await;
        // Both submitted here, back to back (microseconds apart, not as tasks a loaded machine
        // may run late), while the local prefill's step (about 100 tokens at 2 ms: some 200 ms)
        // holds the scheduler: they wait for the same next step.
        let legs: Vec<_> = (0..2)
            .map(|_| {
                let stream = p.submit(request(&id, &prompt, 1, prefill_params())).expect("submitted");
                tokio::spawn(finish(stream))
            })
            .collect();
        hog.await.expect("joins").expect("the local request");
        let mut refused = 0;
        for leg in legs {
            if let Err(e) = leg.await.expect("joins") {
                assert_eq!((e.status, e.code), (409, "transfer_key_in_use"), "request {i}: {e:?}");
                refused += 1;
            }
        }
        // The second grant finds the key taken (409), or, when the first transfer already
        // ended (every block was written early: its completion can land while the second
        // prefill computes its first token), the key ended: answered, no lease granted. Either
        // way one grant a key (below).
        assert!(refused <= 1, "request {i}: both legs refused");
        let (got, _) = decode.await.expect("joins").expect("decode");
        assert_eq!(got, want, "request {i}");
        assert_eq!(p.metrics().leases_granted.get(), i + 1, "request {i}: one grant a key");
    }
    until("P ends the leases and has every block back", Duration::from_secs(5), || {
        p.live_leases() == 0 && p.metrics().kv_blocks_free.get() == 256
    })
    .await;
    assert_eq!(p.metrics().released(ReleaseReason::Transferred).get(), 4);
    assert_eq!(d.metrics().recomputed_requests.get(), 0);
}

/// SPEC U4, U6, U7: P's client leaves while its prefill writes early: D hears the transfer
/// failed (once no early write is in flight) and computes the prompt itself (the default
/// policy), with the answer equal to local; P grants nothing and has every block back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u4_u6_a_prefill_abandoned_while_it_writes_early_fails_over_d_and_frees_p() {
    let prompt = [PROMPT; 4].join(" ");
    let want = run(&engine(config(30.0, 1)).await, &prompt, 8, None).await.expect("local run").0;
    let mut pcfg = push_config(30.0, 1, 30.0);
    pcfg.model.prefill_ms_per_token = 20.0;
    let (p, d) = (engine(pcfg).await, engine(push_config(30.0, 1, 30.0)).await);
    let decode = decode_leg(&d, &p, "left", &prompt, 8);
    let prefill = {
        let (p, prompt) = (p.clone(), prompt.clone());
        tokio::spawn(async move { run_as(&p, "left", &prompt, 1, prefill_params()).await })
    };
    until("P writes a block early", Duration::from_secs(10), || p.metrics().push_early_blocks.get() > 0).await;
    prefill.abort();
    let (got, _) = decode.await.expect("joins").expect("D computes the prompt itself");
    assert_eq!(got, want);
    assert_eq!(d.metrics().recomputed_requests.get(), 1);
    until("P has every block back", Duration::from_secs(10), || p.metrics().kv_blocks_free.get() == 256).await;
    assert_eq!(p.metrics().leases_granted.get(), 0, "nobody takes the KV: no lease");
    assert_eq!(p.live_leases(), 0);
}

/// SPEC T1 with push: P and D of different TP sizes; each D rank is written by every P rank
/// whose heads overlap its own, and the answer equals local.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t1_push_across_tp_sizes_equals_local() {
    let want = local_answer(12).await;
    for (p_tp, d_tp) in [(2, 1), (1, 2), (2, 4)] {
        let (p, d) = (engine(push_config(30.0, p_tp, 30.0)).await, engine(push_config(30.0, d_tp, 30.0)).await);
        let id = format!("tp-{p_tp}-{d_tp}");
        let (_, params) = run_as(&p, &id, PROMPT, 1, prefill_params()).await.expect("prefill");
        let (got, _) = run_as(&d, "d", PROMPT, 12, params).await.expect("decode");
        assert_eq!(got, want, "P tp {p_tp}, D tp {d_tp}");
        assert_eq!(
            d.metrics().recomputed_requests.get(),
            0,
            "P tp {p_tp}, D tp {d_tp}: written, not recomputed (D refused {} writes; P ended {} leases as released)",
            d.metrics().writes_refused.get(),
            p.metrics().released(ReleaseReason::Released).get()
        );
        until("P ends the lease", Duration::from_secs(5), || {
            p.live_leases() == 0 && p.metrics().released(ReleaseReason::Transferred).get() >= 1
        })
        .await;
        assert_eq!(p.metrics().released(ReleaseReason::Transferred).get(), 1);
    }
}

/// SPEC U9, D4: D gives a request up while P holds its lease (the client went away): P is
/// told at once and frees its blocks long before the lease would expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u9_an_abort_on_d_frees_p_at_once() {
    let p = engine(push_config(30.0, 1, 30.0)).await;
    let (_, params) = run_as(&p, "abort-me", PROMPT, 1, prefill_params()).await.expect("prefill");
    assert_eq!(p.live_leases(), 1);
    // D's own queue is full, so the request waits unregistered; then its client leaves.
    let mut dcfg = push_config(30.0, 1, 30.0);
    dcfg.max_num_seqs = 1;
    // The hog runs for 20 s (a release build decodes 2,000 tokens of no compute in a blink).
    dcfg.model.decode_ms_per_token = 10.0;
    let busy = engine(dcfg).await;
    let hog = {
        let busy = busy.clone();
        tokio::spawn(async move { run(&busy, PROMPT, 2000, None).await })
    };
    until("the hog runs", Duration::from_secs(5), || busy.metrics().requests_running.get() == 1).await;
    let req = GenerateRequest {
        request_id: "waiting".into(),
        prompt: Prompt::Text(PROMPT.into()),
        max_tokens: 4,
        ignore_eos: true,
        kv_transfer_params: params,
        sampling: Default::default(),
    };
    let stream = busy.submit(req).expect("admitted");
    // Given up before its blocks were allocated, before D's link to P is even up: the release
    // waits for the link, then goes.
    drop(stream);
    until("P frees the lease at D's release", Duration::from_secs(3), || {
        p.live_leases() == 0 && p.metrics().released(ReleaseReason::Released).get() >= 1 && p.metrics().kv_blocks_free.get() == 256
    })
    .await;
    assert_eq!(p.metrics().released(ReleaseReason::Released).get(), 1);
    assert_eq!(p.metrics().kv_blocks_free.get(), 256);
    hog.abort();
}

/// SPEC U10, D7: P never writes (the router's prefill leg went nowhere): D waits no longer than
/// `push_registration_timeout`, then computes the prompt itself (the default policy) — or fails
/// the request with a clear error under `kv_load_failure_policy=fail`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u10_d_stops_waiting_for_writes_that_never_come() {
    let want = local_answer(8).await;
    let p = engine(push_config(30.0, 1, 30.0)).await;
    let d = engine(push_config(30.0, 1, 1.0)).await;
    let t0 = std::time::Instant::now();
    let (got, _) = run_as(&d, "never", PROMPT, 8, Some(router_params(&p, "never-prefilled"))).await.expect("recomputed");
    assert_eq!(got, want);
    assert!(t0.elapsed() < Duration::from_secs(10), "waited {:?}", t0.elapsed());
    assert_eq!(d.metrics().recomputed_requests.get(), 1);
    let mut fcfg = push_config(30.0, 1, 1.0);
    fcfg.transfer.lease.load_failure_policy = kvlease_core::config::LoadFailurePolicy::Fail;
    let f = engine(fcfg).await;
    let err = run_as(&f, "never", PROMPT, 8, Some(router_params(&p, "never-2"))).await.expect_err("fails");
    assert_eq!(err.status, 503, "{err:?}");
    assert!(err.message.contains("not written"), "{}", err.message);
}

/// SPEC §13: push and pull do not mix: each engine refuses the other mode's params with a 400
/// naming both modes (and their handshakes refuse each other, peers.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_and_pull_params_are_refused_by_the_other_mode() {
    let (pull_p, pull_d) = (engine(config(30.0, 1)).await, engine(config(30.0, 1)).await);
    let push_d = engine(push_config(30.0, 1, 30.0)).await;
    let (_, pull_params) = run(&pull_p, PROMPT, 1, prefill_params()).await.expect("prefill");
    let err = run_as(&push_d, "x", PROMPT, 4, pull_params).await.expect_err("refused");
    assert_eq!(err.status, 400);
    assert!(err.message.contains("push mode") && err.message.contains("pull-mode"), "{}", err.message);
    let err = run_as(&pull_d, "x", PROMPT, 4, Some(router_params(&pull_p, "x"))).await.expect_err("refused");
    assert_eq!(err.status, 400);
    assert!(err.message.contains("pull mode") && err.message.contains("NixlPushConnector"), "{}", err.message);
}

/// SPEC U4, U8, D7 (vLLM #55470 over NIXL, with the mem transport's unfenced writes standing in
/// for NIXL's: a write once posted runs to its end whatever its caller does): P's write outlives
/// P's write timeout (2 s at L = 12 s; the write takes 5 s). P gives it up — D hears at once and
/// recomputes, into other blocks — but P's source blocks stay out of its pool until the write
/// ended (it reads them until then), and D's registered blocks out of its own until P says so.
/// The answer equals a local run. Fails with the source told writes are fenced (P's blocks all
/// free while the write still reads them), and with D's sink deaf to `TimedOut` (D's registered
/// blocks free while the write may still land in them).
#[tokio::test(start_paused = true)]
async fn u4_u8_an_uncancellable_write_given_up_on_holds_both_sides_blocks_until_it_ends() {
    let net = kvlease_transport::mem::MemNetwork::default();
    let local = engine(on_mem(config(12.0, 1), &net)).await;
    let want = run(&local, PROMPT, 8, None).await.expect("local run").0;
    slow_uncancellable_writes(&net);
    let p = engine(on_mem(push_config(12.0, 1, 30.0), &net)).await;
    let d = engine(on_mem(push_config(12.0, 1, 30.0), &net)).await;
    let (_, params) = run_as(&p, "u4m", PROMPT, 1, prefill_params()).await.expect("prefill");
    let t0 = tokio::time::Instant::now();
    let (got, _) = run_as(&d, "d-u4m", PROMPT, 8, params).await.expect("recomputed");
    failed_over_and_held_until_the_write_ended(&p, &d, &got, &want, t0).await;
}

/// Every write takes 5 s and cannot be cancelled (the mem transport standing in for NIXL).
fn slow_uncancellable_writes(net: &kvlease_transport::mem::MemNetwork) {
    net.set_faults(kvlease_transport::mem::Faults {
        unfenced: true,
        write_delay: (Duration::from_secs(5), Duration::from_secs(5)),
        ..Default::default()
    });
}

/// SPEC U4, U8, after P (L = 12 s) gave up on a write of [`slow_uncancellable_writes`] that
/// started about `t0`: D answered the local run's `want` by computing the prompt itself as soon
/// as P gave up, not when the write ended; both sides' blocks stayed out of their pools until
/// the write ended, and came back then, not only when the quarantine's bound passed.
async fn failed_over_and_held_until_the_write_ended(p: &EngineHandle, d: &EngineHandle, got: &str, want: &str, t0: tokio::time::Instant) {
    assert_eq!(got, want, "recomputed: the local run's answer");
    assert!(t0.elapsed() < Duration::from_secs(5), "D failed over when P gave up, not when the write ended: {:?}", t0.elapsed());
    assert_eq!(d.metrics().recomputed_requests.get(), 1);
    assert!(p.metrics().kv_blocks_free.get() < 256, "P's source blocks are held while the write still reads them");
    assert!(d.metrics().kv_blocks_free.get() < 256, "D's registered blocks are held while the write may still land");
    until("both sides' blocks come back once the write ended", Duration::from_secs(10), || {
        p.metrics().kv_blocks_free.get() == 256 && d.metrics().kv_blocks_free.get() == 256
    })
    .await;
    assert!(t0.elapsed() >= Duration::from_secs(5), "not before the write ended: {:?}", t0.elapsed());
    let lease = kvlease_core::config::LeaseConfig::with_lease_secs(12.0).unwrap();
    assert!(t0.elapsed() < lease.read_timeout() + lease.quarantine(), "{:?}", t0.elapsed());
}

/// SPEC U4, U6, U8 with early writes, over a transport that cannot cancel a write (the mem
/// transport standing in for NIXL): P's first early write (a block its prefill computed, both
/// legs at once) outlives P's write timeout (2 s at L = 12 s; the write takes 5 s). P gives it up:
/// D hears `TimedOut` at once and computes the prompt itself into other blocks, and the answer
/// equals local; P's source blocks and D's registered ones stay out of their pools until the
/// write ended, not longer (the quarantine's bound is not waited out).
#[tokio::test(start_paused = true)]
async fn u4_u8_an_uncancellable_early_write_given_up_on_holds_both_sides_blocks_until_it_ends() {
    let net = kvlease_transport::mem::MemNetwork::default();
    let prompt = [PROMPT; 4].join(" ");
    let want = run(&engine(on_mem(config(12.0, 1), &net)).await, &prompt, 8, None).await.expect("local run").0;
    slow_uncancellable_writes(&net);
    let mut pcfg = on_mem(push_config(12.0, 1, 30.0), &net);
    pcfg.model.prefill_ms_per_token = 20.0;
    let p = engine(pcfg).await;
    let d = engine(on_mem(push_config(12.0, 1, 30.0), &net)).await;
    let t0 = tokio::time::Instant::now();
    let decode = {
        let (d, params, prompt) = (d.clone(), router_params(&p, "u4e"), prompt.clone());
        tokio::spawn(async move { run_as(&d, "d-u4e", &prompt, 8, Some(params)).await })
    };
    let (_, params) = run_as(&p, "u4e", &prompt, 1, prefill_params()).await.expect("prefill");
    assert_eq!(params.expect("params")["transfer_mode"], "push");
    let (got, _) = decode.await.expect("joins").expect("recomputed");
    failed_over_and_held_until_the_write_ended(&p, &d, &got, &want, t0).await;
    assert_eq!(p.live_leases(), 0);
}

/// SPEC U3, U6, D7: P loses the transfer's key (it shuts down, telling D at once) while D's
/// request still waits unregistered behind a busy slot. Under `kv_load_failure_policy=fail` the
/// request fails at once with a clear error, as a registered one would; under the default it
/// is recomputed (answer equal to local) once D has a slot, and registers nothing. Before, the
/// verdict for an unregistered request was dropped and the request was recomputed whatever the
/// policy, after the hog's 20 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u3_d7_a_key_lost_before_d_registered_applies_the_policy_at_once() {
    let want = local_answer(4).await;
    for policy in [kvlease_core::config::LoadFailurePolicy::Fail, kvlease_core::config::LoadFailurePolicy::Recompute] {
        let p = engine(push_config(30.0, 1, 30.0)).await;
        let mut dcfg = push_config(30.0, 1, 30.0);
        dcfg.max_num_seqs = 1;
        dcfg.model.decode_ms_per_token = 10.0;
        dcfg.transfer.lease.load_failure_policy = policy;
        let d = engine(dcfg).await;
        let hog = {
            let d = d.clone();
            tokio::spawn(async move { run(&d, PROMPT, 2000, None).await })
        };
        until("the hog runs", Duration::from_secs(5), || d.metrics().requests_running.get() == 1).await;
        let waiting = decode_leg(&d, &p, "lost-early", PROMPT, 4);
        run_as(&p, "lost-early", PROMPT, 1, prefill_params()).await.expect("prefill");
        until("D renews the key", Duration::from_secs(10), || p.metrics().heartbeats_received.get() >= 1).await;
        p.shutdown().await;
        let t0 = std::time::Instant::now();
        match policy {
            kvlease_core::config::LoadFailurePolicy::Fail => {
                let err = waiting.await.expect("task").expect_err("failed by the policy");
                assert_eq!((err.status, err.code), (503, "kv_load_failed"), "{err:?}");
                assert!(t0.elapsed() < Duration::from_secs(5), "failed after {:?}, behind the hog", t0.elapsed());
                assert_eq!(d.metrics().recomputed_requests.get(), 0);
            }
            kvlease_core::config::LoadFailurePolicy::Recompute => {
                until("recompute decided", Duration::from_secs(5), || d.metrics().recomputed_requests.get() == 1).await;
                hog.abort();
                let (got, _) = waiting.await.expect("task").expect("recomputed");
                assert_eq!(got, want);
                assert_eq!(d.metrics().recomputed_requests.get(), 1, "counted once");
            }
        }
        hog.abort();
    }
}
