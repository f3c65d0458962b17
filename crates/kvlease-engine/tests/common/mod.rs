//! Shared by the engine tests: engines in one test process, on loopback, with either transport.
#![allow(dead_code)] // each test binary uses a different subset

use kvlease_core::config::KvTransferConfig;
use kvlease_engine::{EngineConfig, EngineHandle, GenerateEvent, GenerateRequest, ModelConfig, Prompt, TransportKind};
use serde_json::{json, Value};
use std::time::Duration;

pub fn config(lease_secs: f64, tp: u32) -> EngineConfig {
    let transfer =
        KvTransferConfig { lease: kvlease_core::config::LeaseConfig::with_lease_secs(lease_secs).unwrap(), ..Default::default() };
    EngineConfig { transfer, tp_size: tp, num_gpu_blocks: 256, model: ModelConfig::default(), ..EngineConfig::default() }
}

/// The config on `net`, an in-memory network: for tests under virtual time
/// (`#[tokio::test(start_paused = true)]`), where timing bounds are exact rather than padded
/// for a loaded machine.
pub fn on_mem(cfg: EngineConfig, net: &kvlease_transport::mem::MemNetwork) -> EngineConfig {
    EngineConfig { transport: TransportKind::Mem(net.clone()), ..cfg }
}

pub async fn engine(cfg: EngineConfig) -> EngineHandle {
    EngineHandle::start(cfg).await.expect("engine starts")
}

/// Runs a request to its end: (text, kv_transfer_params) or the error.
pub async fn run(
    e: &EngineHandle,
    prompt: &str,
    max_tokens: u32,
    params: Option<Value>,
) -> Result<(String, Option<Value>), kvlease_engine::RequestError> {
    run_as(e, "t", prompt, max_tokens, params).await
}

/// [`run`] under request id `request_id` (the client's `X-Request-Id`).
pub async fn run_as(
    e: &EngineHandle,
    request_id: &str,
    prompt: &str,
    max_tokens: u32,
    params: Option<Value>,
) -> Result<(String, Option<Value>), kvlease_engine::RequestError> {
    finish(e.submit(request(request_id, prompt, max_tokens, params))?).await
}

/// A request under id `request_id` for `max_tokens` tokens (EOS ignored) with these params.
pub fn request(request_id: &str, prompt: &str, max_tokens: u32, params: Option<Value>) -> GenerateRequest {
    GenerateRequest {
        request_id: request_id.into(),
        prompt: Prompt::Text(prompt.into()),
        max_tokens,
        ignore_eos: true,
        kv_transfer_params: params,
        sampling: Default::default(),
    }
}

/// Reads a submitted request's stream to its end: (text, kv_transfer_params) or the error.
pub async fn finish(mut s: kvlease_engine::RequestStream) -> Result<(String, Option<Value>), kvlease_engine::RequestError> {
    let mut text = String::new();
    let deadline = Duration::from_secs(30);
    loop {
        match tokio::time::timeout(deadline, s.next()).await.expect("request finishes in time") {
            Some(GenerateEvent::Token { text: t, .. }) => text.push_str(&t),
            Some(GenerateEvent::Done { kv_transfer_params, .. }) => return Ok((text, kv_transfer_params)),
            Some(GenerateEvent::Failed(e)) => return Err(e),
            Some(GenerateEvent::Logprobs { .. }) => {}
            None => panic!("stream ended without Done"),
        }
    }
}

pub fn prefill_params() -> Option<Value> {
    Some(json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null}))
}

/// Waits for a condition, polling, with a deadline.
pub async fn until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let t0 = tokio::time::Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// False (after saying why) when NIXL's library is missing and not required.
#[cfg(feature = "nixl")]
pub fn nixl_or_skip() -> bool {
    if kvlease_transport::nixl::available() {
        return true;
    }
    if std::env::var("KVLEASE_REQUIRE_NIXL").is_ok_and(|v| v == "1") {
        panic!("KVLEASE_REQUIRE_NIXL=1 but {}", kvlease_transport::nixl::UNAVAILABLE);
    }
    eprintln!("!!!!!!!! SKIPPED: {} !!!!!!!!", kvlease_transport::nixl::UNAVAILABLE);
    false
}

pub const PROMPT: &str = "In disaggregated serving a prefill engine computes the KV cache of a prompt";

/// The config on another transport.
pub fn on(cfg: EngineConfig, transport: TransportKind) -> EngineConfig {
    EngineConfig { transport, ..cfg }
}

/// SPEC D7, P1, P3, P8: P prefills and leases, D pulls and decodes; the output equals a local
/// run, and the lease is released once, as transferred, freeing P's blocks.
pub async fn disaggregated_output_equals_local(transport: TransportKind) {
    let local = engine(config(30.0, 1)).await;
    let (p, d) = (engine(on(config(30.0, 1), transport.clone())).await, engine(on(config(30.0, 1), transport.clone())).await);
    let (want, _) = run(&local, PROMPT, 24, None).await.unwrap();
    assert!(!want.is_empty());
    for _ in 0..3 {
        let (_, params) = run(&p, PROMPT, 1, prefill_params()).await.unwrap();
        let params = params.expect("P returns kv_transfer_params");
        assert_eq!(params["do_remote_prefill"], true);
        assert_eq!(p.metrics().leases_active.get(), 1);
        let (got, _) = run(&d, PROMPT, 24, Some(params)).await.unwrap();
        assert_eq!(got, want);
        until("P releases the lease", Duration::from_secs(5), || p.metrics().leases_active.get() == 0).await;
    }
    let m = p.metrics();
    assert_eq!(m.leases_granted.get(), 3);
    assert_eq!(m.released(kvlease_core::lease_table::ReleaseReason::Transferred).get(), 3);
    assert_eq!(m.kv_blocks_free.get(), 256, "every block back on P");
    assert_eq!(d.metrics().recomputed_requests.get(), 0);
    // kvlease_read_seconds: each request's reads, posted to landed, once.
    assert_eq!(d.metrics().read_time.count(), 3, "every transfer timed");
}

/// SPEC P5, D6, D7: the lease ends while D is about to read (capped by kv_lease_max_lifetime
/// while D waits between its liveness check and its read) and P reuses the blocks for another
/// prompt; D never uses what it could read, recomputes, and the answer is still the local one.
pub async fn lease_ending_under_a_read(transport: TransportKind) {
    let mut pcfg = config(0.6, 1);
    pcfg.transfer.lease.max_lifetime = Some(Duration::from_secs(1));
    let p = engine(on(pcfg, transport.clone())).await;
    let mut dcfg = config(0.6, 1);
    dcfg.debug_read_delay = Some(Duration::from_millis(1500));
    let d = engine(on(dcfg, transport.clone())).await;
    let local = engine(config(30.0, 1)).await;
    let (want, _) = run(&local, PROMPT, 8, None).await.unwrap();
    let (_, params) = run(&p, PROMPT, 1, prefill_params()).await.unwrap();
    let pull = {
        let d = d.clone();
        tokio::spawn(async move { run(&d, PROMPT, 8, params).await })
    };
    until("the lease expires at its lifetime cap", Duration::from_secs(5), || p.metrics().leases_active.get() == 0).await;
    // The same number of blocks: the pool hands the freed ones out again.
    let other: String = PROMPT.chars().rev().collect();
    run(&p, &other, 1, prefill_params()).await.unwrap();
    let (got, _) = pull.await.unwrap().unwrap();
    assert_eq!(got, want);
    assert_eq!(d.metrics().recomputed_requests.get(), 1);
    if transport == TransportKind::Tcp {
        // The tcp agent asked P, which refused: the gate itself was exercised (SPEC P5).
        assert!(p.metrics().reads_refused.get() >= 1);
    }
    assert_eq!(p.metrics().released(kvlease_core::lease_table::ReleaseReason::Expired).get(), 1);
    assert_eq!(p.metrics().released(kvlease_core::lease_table::ReleaseReason::Transferred).get(), 0);
}
