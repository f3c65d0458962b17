//! Multi-turn (bidirectional) transfer between real engines, under virtual time on the
//! in-memory transport: D keeps each turn (SPEC B1), the next turn's prefill reads the
//! conversation back under a lease both ways (B3, B4), and every answer equals a local run of
//! the whole conversation (D7).

mod common;

use common::*;
use kvlease_core::lease_table::ReleaseReason;
use kvlease_engine::{EngineConfig, EngineHandle, GenerateEvent, GenerateRequest, Prompt};
use kvlease_transport::mem::MemNetwork;
use serde_json::{json, Value};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

fn bidirectional(cfg: EngineConfig, net: &MemNetwork) -> EngineConfig {
    let mut cfg = on_mem(cfg, net);
    cfg.transfer.lease.bidirectional = true;
    cfg.transfer.lease.kv_recompute_threshold = 16;
    cfg
}

/// Runs `tokens` to its end: the generated tokens and the `kv_transfer_params` of `Done`.
async fn tokens(e: &EngineHandle, tokens: &[u32], max_tokens: u32, params: Option<Value>) -> (Vec<u32>, Option<Value>) {
    let req = GenerateRequest {
        request_id: "turn".into(),
        prompt: Prompt::Tokens(tokens.to_vec()),
        max_tokens,
        ignore_eos: true,
        sampling: Default::default(),
        kv_transfer_params: params,
    };
    let mut s = e.submit(req).expect("accepted");
    let mut out = Vec::new();
    loop {
        match s.next().await.expect("an event") {
            GenerateEvent::Token { id, .. } => out.push(id),
            GenerateEvent::Done { kv_transfer_params, .. } => return (out, kv_transfer_params),
            GenerateEvent::Failed(e) => panic!("{e}"),
            GenerateEvent::Logprobs { .. } => {}
        }
    }
}

fn user(turn: usize) -> Vec<u32> {
    kvlease_engine::model::tokenize(&format!("\nuser turn {turn}: tell me more about leases and heartbeats\n"))
}

/// SPEC B1, B3, B4, D7: four turns through P and D. Each turn's answer equals a local run of the
/// whole conversation; from the second turn on, P reads the conversation so far back from D and
/// prefills only the new tokens; D frees each cached turn as `transferred` when P's read
/// completes; nothing is left on either side.
#[tokio::test(start_paused = true)]
async fn b1_b3_b4_each_turn_reads_the_conversation_back_and_answers_as_a_local_run() {
    let net = MemNetwork::new();
    let p = engine(bidirectional(config(30.0, 1), &net)).await;
    let d = engine(bidirectional(config(30.0, 1), &net)).await;
    let local = engine(config(30.0, 1)).await;
    let mut conversation: Vec<u32> = Vec::new();
    let mut turn_params: Option<Value> = None;
    let mut read = 0u64;
    for turn in 0..4 {
        conversation.extend(user(turn));
        let (want, _) = tokens(&local, &conversation, 12, None).await;
        // P leg: a fresh request, or the next turn naming D's cached one.
        let mut p_params = json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null});
        let mut cached = 0;
        if let Some(t) = turn_params.take() {
            assert_eq!(t["do_remote_decode"], true, "{t}");
            assert!(t["remote_blocks_ttl_remaining"].as_f64().is_some_and(|s| s > 0.0), "{t}");
            assert!(t["remote_blocks_expiry_time"].as_f64().is_some(), "{t}");
            cached = t["remote_num_tokens"].as_u64().unwrap();
            read += cached;
            p_params = t;
        }
        let computed_before = p.metrics().prefill_tokens.load(Relaxed);
        let (_, params) = tokens(&p, &conversation, 1, Some(p_params)).await;
        let computed = p.metrics().prefill_tokens.load(Relaxed) - computed_before;
        assert_eq!(p.metrics().turn_tokens_read.load(Relaxed), read, "turn {turn}: P read the conversation so far");
        assert_eq!(computed, conversation.len() as u64 - cached, "turn {turn}: P prefilled only the new tokens");
        let (got, kept) = tokens(&d, &conversation, 12, params).await;
        assert_eq!(got, want, "turn {turn}: D7");
        turn_params = Some(kept.expect("D answers with its cached turn"));
        conversation.extend(&got);
    }
    assert_eq!(d.metrics().turns_kept.load(Relaxed), 4);
    assert_eq!(p.metrics().turns_recomputed.load(Relaxed), 0);
    until("D's read turns are released", Duration::from_secs(5), || d.metrics().released(ReleaseReason::Transferred).load(Relaxed) == 3)
        .await;
    // The last turn is still cached: it expires at its TTL (480 s).
    assert_eq!(d.metrics().leases_active.load(Relaxed), 1);
    tokio::time::sleep(Duration::from_secs(481)).await;
    assert_eq!(d.metrics().leases_active.load(Relaxed), 0);
    assert_eq!(d.metrics().released(ReleaseReason::Expired).load(Relaxed), 1);
    until("every block back", Duration::from_secs(5), || {
        d.metrics().kv_blocks_free.load(Relaxed) == 256 && p.metrics().kv_blocks_free.load(Relaxed) == 256
    })
    .await;
}

/// SPEC B2: with D's clock forty minutes ahead of P's, or behind, P judges D's cached turns on
/// its own clock through the measured offset: a live turn is read (not declined as if expired),
/// and a turn past its TTL is declined before any read (not taken for live), recomputed right.
#[tokio::test(start_paused = true)]
async fn b2_a_skewed_decoder_clock_changes_no_decision() {
    for skew_min in [40i64, -40] {
        let net = MemNetwork::new();
        let mut pcfg = bidirectional(config(30.0, 1), &net);
        pcfg.transfer.lease.decoder_kv_blocks_ttl = Duration::from_secs(20);
        let p = engine(pcfg.clone()).await;
        let mut dcfg = pcfg.clone();
        dcfg.debug_clock_skew = Some(skew_min * 60_000_000_000);
        let d = engine(dcfg).await;
        let local = engine(config(30.0, 1)).await;
        let mut conversation = user(0);
        let (_, params) = tokens(&p, &conversation, 1, Some(json!({"do_remote_decode": true}))).await;
        let (got, mut turn) = tokens(&d, &conversation, 8, params).await;
        // Two more turns: the first read gives P a clock sample of D (its handshake), the second
        // is judged with it.
        for k in 1..3 {
            conversation.extend(&got);
            conversation.extend(user(k));
            let (want, _) = tokens(&local, &conversation, 8, None).await;
            let (_, params) = tokens(&p, &conversation, 1, turn.take()).await;
            let (got2, kept) = tokens(&d, &conversation, 8, params).await;
            assert_eq!(got2, want, "skew {skew_min} min, turn {k}");
            turn = kept;
            conversation.extend(&got2);
        }
        assert_eq!(p.metrics().turns_recomputed.load(Relaxed), 0, "skew {skew_min} min: live turns are read");
        assert!(p.metrics().turn_tokens_read.load(Relaxed) > 0);
        // Past its TTL: declined up front (no read, no lost lease), the prompt prefilled whole.
        tokio::time::sleep(Duration::from_secs(21)).await;
        conversation.extend(user(9));
        let lost = p.metrics().lease_lost.load(Relaxed);
        let (_, params) = tokens(&p, &conversation, 1, turn.take()).await;
        assert_eq!(p.metrics().turns_recomputed.load(Relaxed), 1, "skew {skew_min} min: an expired turn is declined");
        assert_eq!(p.metrics().lease_lost.load(Relaxed), lost, "skew {skew_min} min: declined before any read");
        let (want, _) = tokens(&local, &conversation, 8, None).await;
        assert_eq!(tokens(&d, &conversation, 8, params).await.0, want);
    }
}

/// SPEC B1, D7: cached turns are a cache. When D needs their blocks for a new request, it ends
/// the oldest turns no prefill engine has claimed (`kvlease_turns_evicted_total`) instead of
/// leaving the request waiting out their TTL (480 s); the evicted conversation's next turn is
/// recomputed by P and still answers as a local run.
#[tokio::test(start_paused = true)]
async fn b1_cached_turns_give_their_blocks_to_new_requests() {
    let net = MemNetwork::new();
    let p = engine(bidirectional(config(30.0, 1), &net)).await;
    let per_turn = (user(0).len() + 12).div_ceil(16) as u32;
    let mut dcfg = bidirectional(config(30.0, 1), &net);
    dcfg.num_gpu_blocks = 4 * per_turn - 1; // three cached turns fit, and not a fourth request
    let d = engine(dcfg).await;
    let local = engine(config(30.0, 1)).await;
    let fresh = || json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null});
    let started = tokio::time::Instant::now();
    let mut kept = Vec::new();
    for c in 0..4 {
        let prompt = [user(0), kvlease_engine::model::tokenize(&format!("conversation {c}"))].concat();
        let (want, _) = tokens(&local, &prompt, 12, None).await;
        let (_, params) = tokens(&p, &prompt, 1, Some(fresh())).await;
        let (got, turn) = tokens(&d, &prompt, 12, params).await;
        assert_eq!(got, want, "conversation {c}: D7");
        kept.push((prompt, got, turn.expect("a cached turn")));
    }
    assert!(started.elapsed() < Duration::from_secs(60), "the fourth request waited {:?} for blocks", started.elapsed());
    assert_eq!(d.metrics().turns_kept.load(Relaxed), 4);
    assert_eq!(d.metrics().turns_evicted.load(Relaxed), 1, "the oldest turn made room");
    // The evicted conversation goes on: P cannot read its turn, recomputes, answers right.
    let (prompt, answer, turn) = kept.swap_remove(0);
    let next = [prompt, answer, user(1)].concat();
    let (want, _) = tokens(&local, &next, 12, None).await;
    let (_, params) = tokens(&p, &next, 1, Some(turn)).await;
    assert_eq!(p.metrics().turn_tokens_read.load(Relaxed), 0, "nothing read from an evicted turn");
    let (got, _) = tokens(&d, &next, 12, params).await;
    assert_eq!(got, want, "D7 after an eviction");
    assert!(started.elapsed() < Duration::from_secs(60), "no wait for a TTL: {:?}", started.elapsed());
}
