//! Multi-turn (bidirectional) transfer between real engines, under virtual time on the
//! in-memory transport: D keeps each turn (SPEC B1), the next turn's prefill reads the
//! conversation back under a lease both ways (B3, B4), and every answer equals a local run of
//! the whole conversation (D7).

mod common;

use common::*;
use kvlease_core::lease_table::ReleaseReason;
use kvlease_engine::{EngineConfig, EngineHandle, GenerateEvent, GenerateRequest, Prompt};
use kvlease_transport::mem::{Faults, MemNetwork};
use serde_json::{json, Value};
use std::time::Duration;
use tokio::task::JoinHandle;

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
        let computed_before = p.metrics().prefill_tokens.get();
        let (_, params) = tokens(&p, &conversation, 1, Some(p_params)).await;
        let computed = p.metrics().prefill_tokens.get() - computed_before;
        assert_eq!(p.metrics().turn_tokens_read.get(), read, "turn {turn}: P read the conversation so far");
        assert_eq!(computed, conversation.len() as u64 - cached, "turn {turn}: P prefilled only the new tokens");
        let (got, kept) = tokens(&d, &conversation, 12, params).await;
        assert_eq!(got, want, "turn {turn}: D7");
        turn_params = Some(kept.expect("D answers with its cached turn"));
        conversation.extend(&got);
    }
    assert_eq!(d.metrics().turns_kept.get(), 4);
    assert_eq!(p.metrics().turns_recomputed.get(), 0);
    until("D's read turns are released", Duration::from_secs(5), || d.metrics().released(ReleaseReason::Transferred).get() == 3).await;
    // The last turn is still cached: it expires at its TTL (480 s).
    assert_eq!(d.metrics().leases_active.get(), 1);
    tokio::time::sleep(Duration::from_secs(481)).await;
    assert_eq!(d.metrics().leases_active.get(), 0);
    assert_eq!(d.metrics().released(ReleaseReason::Expired).get(), 1);
    until("every block back", Duration::from_secs(5), || {
        d.metrics().kv_blocks_free.get() == 256 && p.metrics().kv_blocks_free.get() == 256
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
        assert_eq!(p.metrics().turns_recomputed.get(), 0, "skew {skew_min} min: live turns are read");
        assert!(p.metrics().turn_tokens_read.get() > 0);
        // Past its TTL: declined up front (no read, no lost lease), the prompt prefilled whole.
        tokio::time::sleep(Duration::from_secs(21)).await;
        conversation.extend(user(9));
        let lost = p.metrics().lease_lost.get();
        let (_, params) = tokens(&p, &conversation, 1, turn.take()).await;
        assert_eq!(p.metrics().turns_recomputed.get(), 1, "skew {skew_min} min: an expired turn is declined");
        assert_eq!(p.metrics().lease_lost.get(), lost, "skew {skew_min} min: declined before any read");
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
    assert_eq!(d.metrics().turns_kept.get(), 4);
    assert_eq!(d.metrics().turns_evicted.get(), 1, "the oldest turn made room");
    // The evicted conversation goes on: P cannot read its turn, recomputes, answers right.
    let (prompt, answer, turn) = kept.swap_remove(0);
    let next = [prompt, answer, user(1)].concat();
    let (want, _) = tokens(&local, &next, 12, None).await;
    let (_, params) = tokens(&p, &next, 1, Some(turn)).await;
    assert_eq!(p.metrics().turn_tokens_read.get(), 0, "nothing read from an evicted turn");
    let (got, _) = tokens(&d, &next, 12, params).await;
    assert_eq!(got, want, "D7 after an eviction");
    assert!(started.elapsed() < Duration::from_secs(60), "no wait for a TTL: {:?}", started.elapsed());
}

/// A fresh P leg: no cached turn to read.
fn fresh() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null})
}

/// Conversation `c`'s first prompt.
fn opening(c: &str) -> Vec<u32> {
    [user(0), kvlease_engine::model::tokenize(&format!("conversation {c}"))].concat()
}

/// Blocks of `tokens` tokens (16 a block).
/// What a local run answers, for the eviction tests: conversation A's opening `a0`, its next turn
/// `a1` with its answer, and a request of D's own with its answer.
struct Expected {
    a0: Vec<u32>,
    a1: Vec<u32>,
    a1_ans: Vec<u32>,
    own: Vec<u32>,
    own_ans: Vec<u32>,
}

async fn expected(max: u32) -> Expected {
    let local = engine(config(30.0, 1)).await;
    let a0 = opening("A");
    let a_ans = tokens(&local, &a0, max, None).await.0;
    let a1 = [a0.clone(), a_ans, user(1)].concat();
    let a1_ans = tokens(&local, &a1, max, None).await.0;
    let own: Vec<u32> = [user(7), user(8)].concat();
    let own_ans = tokens(&local, &own, max, None).await.0;
    Expected { a0, a1, a1_ans, own, own_ans }
}

fn blocks_of(tokens: usize) -> u32 {
    tokens.div_ceil(16) as u32
}

/// A turn through P (prefill, with `params`) then D (decode), as a task: D's answer and params.
fn spawn_turn(
    p: &EngineHandle,
    d: &EngineHandle,
    prompt: Vec<u32>,
    params: Value,
    max_tokens: u32,
) -> JoinHandle<(Vec<u32>, Option<Value>)> {
    let (p, d) = (p.clone(), d.clone());
    tokio::spawn(async move {
        let (_, params) = tokens(&p, &prompt, 1, Some(params)).await;
        tokens(&d, &prompt, max_tokens, params).await
    })
}

/// A request of D's own (no P involved), as a task.
fn spawn_local(d: &EngineHandle, prompt: Vec<u32>, max_tokens: u32) -> JoinHandle<Vec<u32>> {
    let d = d.clone();
    tokio::spawn(async move { tokens(&d, &prompt, max_tokens, None).await.0 })
}

/// SPEC B1, B3, D7: P and D waiting on each other. D's pool holds the cached turns of
/// conversations A and B; P's pool holds its lease on request C's prompt, which C's decode leg on
/// D needs blocks to pull. A's and B's next turns wait on P for blocks, renewing their cached
/// turns on D all the while (B3), and C's decode leg waits on D for blocks, renewing P's lease
/// (D1): neither side would ever free anything (before: no request finished; only turns nobody
/// claimed were evicted). D evicts the oldest claimed turn instead; C is served, P's blocks come
/// back, and A's next turn, its cached turn gone (`LeaseLost`), is recomputed by P: every answer
/// is the local one.
#[tokio::test(start_paused = true)]
async fn b1_b3_d7_turns_renewed_by_a_waiting_prefill_do_not_hold_d_forever() {
    const MAX: u32 = 12;
    let net = MemNetwork::new();
    let local = engine(config(30.0, 1)).await;
    let (a0, b0, c0) = (opening("A"), opening("B"), opening("C"));
    let (a_ans, b_ans, c_ans) =
        (tokens(&local, &a0, MAX, None).await.0, tokens(&local, &b0, MAX, None).await.0, tokens(&local, &c0, MAX, None).await.0);
    let a1 = [a0.clone(), a_ans.clone(), user(1)].concat();
    let b1 = [b0.clone(), b_ans.clone(), user(1)].concat();
    let (a1_ans, b1_ans) = (tokens(&local, &a1, MAX, None).await.0, tokens(&local, &b1, MAX, None).await.0);
    let decode = |prompt: &[u32]| blocks_of(prompt.len() + MAX as usize);
    let mut pcfg = bidirectional(config(30.0, 1), &net);
    // C's lease, and one block short of either next turn.
    pcfg.num_gpu_blocks = blocks_of(c0.len()) + blocks_of(a1.len()).min(blocks_of(b1.len())) - 1;
    let p = engine(pcfg).await;
    let mut dcfg = bidirectional(config(30.0, 1), &net);
    // A's and B's cached turns, and one block short of C's decode.
    dcfg.num_gpu_blocks = decode(&a0) + decode(&b0) + decode(&c0) - 1;
    let d = engine(dcfg).await;
    let mut turns = Vec::new();
    for (prompt, want) in [(&a0, &a_ans), (&b0, &b_ans)] {
        let (_, params) = tokens(&p, prompt, 1, Some(fresh())).await;
        let (got, turn) = tokens(&d, prompt, MAX, params).await;
        assert_eq!(&got, want);
        turns.push(turn.expect("a cached turn"));
    }
    let (_, c_params) = tokens(&p, &c0, 1, Some(fresh())).await;
    let next_b = spawn_turn(&p, &d, b1.clone(), turns.pop().unwrap(), MAX);
    let next_a = spawn_turn(&p, &d, a1.clone(), turns.pop().unwrap(), MAX);
    until("P renews both cached turns (B3)", Duration::from_secs(30), || d.metrics().lease_renewals.get() >= 2).await;
    assert_eq!(p.metrics().requests_waiting.get(), 2, "both next turns wait for P's blocks");
    let started = tokio::time::Instant::now();
    let c = {
        let d = d.clone();
        tokio::spawn(async move { tokens(&d, &c0, MAX, c_params).await.0 })
    };
    let all = async { (c.await.unwrap(), next_a.await.unwrap().0, next_b.await.unwrap().0) };
    let (c_got, a1_got, b1_got) =
        tokio::time::timeout(Duration::from_secs(120), all).await.expect("P and D wait on each other's blocks: stalled");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    assert_eq!((c_got, a1_got, b1_got), (c_ans, a1_ans, b1_ans), "D7");
    assert!(d.metrics().turns_evicted.get() >= 1);
    assert!(p.metrics().turns_recomputed.get() >= 1, "the evicted turn's conversation was recomputed");
}

/// SPEC B1, B3, D7: A's next turn waits in a busy P's queue (`max_num_seqs` 1, a slow request
/// holding the slot), P renewing A's cached turn (B3). D needs the turn's blocks for a request
/// of its own: it evicts the turn at once, claimed as it is (no unclaimed one is left), rather
/// than leaving its request waiting on P. When P gets to A's turn, its heartbeat is answered
/// `LeaseLost`: it reads nothing, prefills the whole conversation, and D's answer is the local one.
#[tokio::test(start_paused = true)]
async fn b1_d7_a_claimed_turn_is_evicted_and_its_next_turn_recomputed() {
    const MAX: u32 = 12;
    let net = MemNetwork::new();
    let Expected { a0, a1, a1_ans, own, own_ans } = expected(MAX).await;
    let mut pcfg = bidirectional(config(30.0, 1), &net);
    pcfg.max_num_seqs = 1;
    pcfg.model.decode_ms_per_token = 1000.0;
    let p = engine(pcfg).await;
    let mut dcfg = bidirectional(config(30.0, 1), &net);
    dcfg.num_gpu_blocks = blocks_of(a0.len() + MAX as usize) + blocks_of(own.len() + MAX as usize) - 1;
    let d = engine(dcfg).await;
    let (_, params) = tokens(&p, &a0, 1, Some(fresh())).await;
    let turn = tokens(&d, &a0, MAX, params).await.1.expect("a cached turn");
    // A request of P's own holds its only slot for 60 s.
    let busy = spawn_local(&p, user(3), 60);
    until("P is busy", Duration::from_secs(5), || p.metrics().requests_running.get() == 1).await;
    let next = spawn_turn(&p, &d, a1, turn, MAX);
    until("P renews A's cached turn (B3)", Duration::from_secs(30), || d.metrics().lease_renewals.get() >= 1).await;
    let started = tokio::time::Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(10), spawn_local(&d, own, MAX))
        .await
        .expect("D's request waited on P's queue for the claimed turn's blocks")
        .unwrap();
    assert_eq!(got, own_ans);
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert_eq!(d.metrics().turns_evicted.get(), 1);
    assert_eq!(d.metrics().released(ReleaseReason::Released).get(), 1, "evicted as `released`");
    busy.await.unwrap();
    assert_eq!(next.await.unwrap().0, a1_ans, "D7 after the eviction");
    assert_eq!(p.metrics().turns_recomputed.get(), 1);
    assert_eq!(p.metrics().turn_tokens_read.get(), 0, "nothing read from an evicted turn");
}

/// SPEC B1, P5: a cached turn a prefill engine is reading is not evicted under the read. Reads
/// here hold P's permit for 5 s; D gets a request it can admit only with the turn's blocks while
/// P reads the turn: the request waits for the read, the turn ends as `transferred` (not
/// evicted), its blocks come back, and the request is served then. P's read stands (nothing
/// recomputed) and its turn answers as a local run (D7).
#[tokio::test(start_paused = true)]
async fn b1_p5_a_turn_under_a_read_is_not_evicted_until_the_read_ends() {
    const MAX: u32 = 12;
    const HOLD: Duration = Duration::from_secs(5);
    let net = MemNetwork::new();
    let Expected { a0, a1, a1_ans, own, own_ans } = expected(MAX).await;
    let p = engine(bidirectional(config(30.0, 1), &net)).await;
    let mut dcfg = bidirectional(config(30.0, 1), &net);
    dcfg.num_gpu_blocks = blocks_of(a0.len() + MAX as usize) + blocks_of(own.len() + MAX as usize) - 1;
    let d = engine(dcfg).await;
    let (_, params) = tokens(&p, &a0, 1, Some(fresh())).await;
    let (_, turn) = tokens(&d, &a0, MAX, params).await;
    let turn = turn.expect("a cached turn");
    let cached = turn["remote_num_tokens"].as_u64().unwrap();
    net.set_faults(Faults { read_hold: (HOLD, HOLD), ..Faults::default() });
    let next = spawn_turn(&p, &d, a1, turn, MAX);
    // P's read follows the acknowledgement of its first heartbeat at once (virtual time).
    until("P renews A's cached turn (B3)", Duration::from_secs(30), || d.metrics().lease_renewals.get() >= 1).await;
    let read_began = tokio::time::Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(30), spawn_local(&d, own, MAX)).await.expect("served").unwrap();
    assert_eq!(got, own_ans);
    assert!(read_began.elapsed() >= HOLD - Duration::from_millis(100), "served after {:?}, under the read", read_began.elapsed());
    assert_eq!(d.metrics().turns_evicted.get(), 0, "not evicted under the read");
    assert_eq!(d.metrics().released(ReleaseReason::Transferred).get(), 1, "the turn ended as read");
    assert_eq!(next.await.unwrap().0, a1_ans, "D7");
    assert_eq!(p.metrics().turns_recomputed.get(), 0);
    assert_eq!(p.metrics().turn_tokens_read.get(), cached);
}
