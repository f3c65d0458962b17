//! kvlease-engine: one serving engine (one `kvlease serve` process).
//!
//! It owns a paged KV block pool of real bytes (one [`BlockArena`] per rank, each holding its
//! shard of the KV heads), a scheduler with a waiting queue and a running set, the synthetic
//! model, and the connector that drives kvlease-core: P's lease table and D's renewer. It reaches
//! other engines only through the transport's [`Agent`]s and its own handshake side channel.
//!
//! A request's path: [`EngineHandle::submit`] → (D: the renewer starts tracking at once, SPEC D1)
//! → waiting queue → admitted when blocks and a running slot are free → P or local: prefill;
//! D: pull the prompt's KV from P under its lease, verified → decode → events to the caller.
//! Dropping the [`RequestStream`] aborts the request (D: releases P's lease at once, SPEC D4).
//!
//! [`BlockArena`]: kvlease_transport::BlockArena
//! [`Agent`]: kvlease_transport::Agent

mod agents;
mod engine;
mod handshake;
pub mod ids;
mod lease_holder;
pub mod metrics;
pub mod model;
mod pool;
mod pull;
mod push;
mod release;
mod renewal;
mod scheduler;
/// Public for tests that play a hostile engine on the side channel (SPEC S2, S6).
#[doc(hidden)]
pub mod side_channel;
mod state;

pub use engine::{EngineHandle, RequestStream};
pub use handshake::BindError;
pub use kvlease_core::params::{KvRole, ParamError, Refusal, RemoteKv};
pub use metrics::Metrics;
pub use model::{ConfigError, ModelConfig};

use kvlease_core::config::KvTransferConfig;
use thiserror::Error;

/// Which transfer agent the engine's ranks use, and where its handshake side channel listens.
#[derive(Debug, Clone)]
pub enum TransportKind {
    /// kvlease's own agent over TCP: refuses reads of dead leases itself.
    Tcp,
    /// NIXL over UCX (needs the `nixl` feature and libnixl_capi.so at run time).
    Nixl,
    /// In-process agents and side channel on one network (the simulator, tests).
    Mem(kvlease_transport::mem::MemNetwork),
}

impl PartialEq for TransportKind {
    fn eq(&self, other: &TransportKind) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

/// Everything `kvlease serve` configures.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Unique per engine (a random one when not given).
    pub engine_id: String,
    /// Where the handshake side channel and the agents listen (SPEC S3: 127.0.0.1 by default).
    pub host: String,
    /// Side-channel port; 0 picks a free one (it is advertised in `kv_transfer_params`).
    pub kv_port: u16,
    /// The address other engines reach this one at (`remote_host` in `kv_transfer_params`, and
    /// the transfer agents' address), when it is not `host`: e.g. `host` 0.0.0.0.
    pub advertise_host: Option<std::net::IpAddr>,
    pub transfer: KvTransferConfig,
    pub tp_size: u32,
    pub num_gpu_blocks: u32,
    pub max_num_seqs: usize,
    pub model: ModelConfig,
    pub transport: TransportKind,
    /// SPEC S1: the cluster's shared secret for signing `kv_transfer_params`.
    pub secret: Option<Vec<u8>>,
    /// SPEC S6 (`--kv-transfer-tls-*`): this engine's certificate, its key and the cluster CA.
    /// The side channel and the tcp agents then run mutual TLS, and a peer is the engine its
    /// certificate names. The engine id is the certificate's (`engine_id` may be empty, or must
    /// equal it).
    pub transfer_tls: Option<kvlease_transport::tls::TransferTls>,
    /// Test hook: D waits this long between finding its lease safe to read and reading, so
    /// tests can make a lease end under a read. Never set in production.
    pub debug_read_delay: Option<std::time::Duration>,
    /// The engine's incarnation (a random one when not given; the simulator seeds it).
    pub incarnation: Option<u64>,
    /// Test hook: this engine's monotonic clock reads this many nanoseconds off (±50 min), to
    /// prove cross-engine decisions (SPEC B2) do not assume synchronized clocks. Never set in
    /// production.
    pub debug_clock_skew: Option<i64>,
    /// Simulator only: a bug planted on purpose, to prove the simulator finds it.
    #[doc(hidden)]
    pub planted_bug: Option<kvlease_core::pull::PlantedBug>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            engine_id: String::new(),
            host: "127.0.0.1".into(),
            kv_port: 0,
            advertise_host: None,
            transfer: KvTransferConfig::default(),
            tp_size: 1,
            num_gpu_blocks: 1024,
            max_num_seqs: 64,
            model: ModelConfig::default(),
            transport: TransportKind::Tcp,
            secret: None,
            transfer_tls: None,
            debug_read_delay: None,
            incarnation: None,
            debug_clock_skew: None,
            planted_bug: None,
        }
    }
}

/// The prompt of a request: text (tokenized by [`model::tokenize`]) or token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// One completion request, as the HTTP layer hands it over.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// The client's id (`X-Request-Id` or generated); shown in logs and in `kv_transfer_params`.
    pub request_id: String,
    pub prompt: Prompt,
    pub max_tokens: u32,
    /// Generate exactly `max_tokens`, ignoring the model's end-of-sequence token.
    pub ignore_eos: bool,
    /// The request's `kv_transfer_params`, unparsed (the engine validates them).
    pub kv_transfer_params: Option<serde_json::Value>,
    /// How tokens are chosen and when the request stops (vLLM's `SamplingParams`).
    pub sampling: SamplingParams,
}

/// How the next token is chosen and when a request stops, with vLLM's meanings. Stop strings are
/// text, so the HTTP layer applies them; everything about token ids happens here.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 is greedy (the synthetic model's default, as a model's `generation_config` sets it).
    pub temperature: f64,
    /// In (0, 1]; 1 keeps every token.
    pub top_p: f64,
    /// 0 keeps every token.
    pub top_k: u32,
    /// The sampler's seed: the token at position i is a function of (seed, i, the KV read back),
    /// so a prefill engine and a decoder, or two runs, agree (SPEC D7).
    pub seed: u64,
    /// EOS and `stop_token_ids` cannot be chosen before this many tokens.
    pub min_tokens: u32,
    /// Tokens that end the request (they are part of the output, as in vLLM).
    pub stop_token_ids: Vec<u32>,
    /// Send a [`GenerateEvent::Logprobs`] before each token, with this many alternatives.
    pub logprobs: Option<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0, min_tokens: 0, stop_token_ids: Vec::new(), logprobs: None }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What a request produces, in order: tokens, then exactly one `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerateEvent {
    Token {
        id: u32,
        text: String,
    },
    /// Sent just before the `Token` it describes, when the request asked for logprobs: the
    /// token's log-probability under the model's distribution, and the `top` most likely
    /// tokens (most likely first).
    Logprobs {
        id: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
    },
    Done {
        finish_reason: FinishReason,
        prompt_tokens: u32,
        completion_tokens: u32,
        kv_transfer_params: Option<serde_json::Value>,
    },
    Failed(RequestError),
}

/// A request refused or failed: the HTTP status, an OpenAI error `type`/`code`, and a message
/// that says what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{message}")]
pub struct RequestError {
    pub status: u16,
    pub code: &'static str,
    pub param: Option<&'static str>,
    pub message: String,
    /// Whether the refusal says the request's params are another request's, so that refusing it
    /// keeps the lease they name (SPEC O3 releases only a refused request's own lease).
    pub refusal: Refusal,
}

impl RequestError {
    pub fn new(status: u16, code: &'static str, param: Option<&'static str>, message: impl Into<String>) -> RequestError {
        RequestError { status, code, param, message: message.into(), refusal: Refusal::Request }
    }

    pub fn bad_request(param: Option<&'static str>, message: impl Into<String>) -> RequestError {
        RequestError::new(400, "invalid_request_error", param, message)
    }

    /// A 400 naming `kv_transfer_params` that belong to another request (SPEC S4: another
    /// prompt's; or a replay of params another request here is reading with): the lease they
    /// name is not this request's to release.
    pub fn not_its_params(message: impl Into<String>) -> RequestError {
        RequestError {
            code: "kv_transfer_params_not_this_requests",
            refusal: Refusal::NotItsParams,
            ..RequestError::bad_request(Some("kv_transfer_params"), message)
        }
    }

    pub fn unavailable(message: impl Into<String>) -> RequestError {
        RequestError::new(503, "service_unavailable", None, message)
    }
}

/// Why an engine did not start.
#[derive(Debug, Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(ConfigError),
    #[error("cannot listen on {addr}: {why}")]
    Bind { addr: String, why: BindError },
    #[error("transport: {0}")]
    Transport(#[from] kvlease_transport::TransportError),
}
