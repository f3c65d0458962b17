//! `kvlease serve`'s HTTP API: the OpenAI endpoints in front of one [`EngineHandle`], plus
//! `/v1/models`, `/health` and `/metrics` (SPEC §10, §11), served within [`HttpLimits`].
//!
//! A request's [`RequestStream`] is owned by the handler future (non-streaming) or by the
//! response body's producer (streaming, [`crate::outbox::Outbox`]). When the client goes away, or stops taking
//! its answer (`--http-write-timeout`, `--http-max-buffered-stream-bytes`), both are dropped, the
//! stream with them, and the engine aborts the request: on D that releases P's lease at once
//! (SPEC D4).

use crate::body;
use crate::choice::{self, Choice, Out, StopRules};
use crate::drain::Drain;
use crate::error::ApiError;
use crate::openai::{self, Completion, Endpoint, ResponseMeta, Usage};
use crate::server::{self, HttpLimits, HttpMetrics};
use crate::sse;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kvlease_engine::metrics::{self, Registry};
use kvlease_engine::{EngineHandle, GenerateRequest};
use serde_json::json;
use std::future::Future;
use std::sync::Arc;

pub use crate::ids::REQUEST_ID;

/// Longest `X-Request-Id` accepted.
const MAX_REQUEST_ID_LEN: usize = 512;

/// Bytes of a streamed answer produced and not yet taken by its client, at most, by default
/// (`--http-max-buffered-stream-bytes`): some answers of the longest the default
/// `--max-model-len` allows, so a client that reads is never near it.
pub const DEFAULT_MAX_BUFFERED_STREAM_BYTES: usize = 4 << 20;

/// The smallest bound a stream may have: one SSE chunk at its largest.
pub const MIN_BUFFERED_STREAM_BYTES: usize = crate::sse::MAX_CHUNK_BYTES;

/// How `kvlease serve` exposes its engine over HTTP.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub http: HttpLimits,
    /// A streamed answer whose client leaves more than this produced and untaken is cut, and its
    /// request aborted (issue 22).
    pub max_buffered_stream_bytes: usize,
    /// The engine listens beyond loopback without a cluster secret (`--insecure`, SPEC S3):
    /// `/health` says so.
    pub insecure: bool,
    /// SPEC O1: started on SIGTERM; new requests get 503 while those in flight finish.
    pub drain: Arc<Drain>,
    /// The names requests may use (vLLM's `--served-model-name`); empty: the engine's model name.
    pub served_model_names: Vec<String>,
    /// vLLM's `--api-key`: `/v1/*` requires `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// vLLM's `--ssl-certfile` and the rest (SPEC S6): the listener speaks HTTPS.
    pub tls: Option<crate::tls::ServerTls>,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            http: HttpLimits::default(),
            max_buffered_stream_bytes: DEFAULT_MAX_BUFFERED_STREAM_BYTES,
            insecure: false,
            drain: Arc::default(),
            served_model_names: Vec::new(),
            api_key: None,
            tls: None,
        }
    }
}

#[derive(Clone)]
struct AppState {
    engine: EngineHandle,
    started: u64,
    insecure: bool,
    drain: Arc<Drain>,
    names: Arc<Vec<String>>,
    api_key: Option<Arc<str>>,
    max_stream_bytes: usize,
    /// The engine's metrics and the listener's, for `/metrics`.
    registry: Arc<Registry>,
}

impl AppState {
    /// vLLM's `--api-key` on `/v1/*`.
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else { return Ok(()) };
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        // Compared in full whatever the first difference, so timing says nothing of the key.
        let ok = given.is_some_and(|g| g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0);
        if ok {
            Ok(())
        } else {
            Err(ApiError::unauthorized())
        }
    }

    /// Whether a request's `model` is one this server answers to.
    fn serves(&self, model: &str) -> bool {
        self.names.iter().any(|n| n == model)
    }
}

/// The router of `kvlease serve`, for tests that want to mount it themselves.
pub fn router(engine: EngineHandle, options: &ServeOptions) -> Router {
    app(engine, options, Arc::default())
}

/// The router, counting into `http` what the listener under it counts.
fn app(engine: EngineHandle, options: &ServeOptions, http: Arc<HttpMetrics>) -> Router {
    let names =
        if options.served_model_names.is_empty() { vec![engine.model_name().to_owned()] } else { options.served_model_names.clone() };
    let mut registry = Registry::default();
    engine.metrics().register(&mut registry);
    http.register(&mut registry);
    let state = AppState {
        engine,
        started: crate::ids::unix_now(),
        insecure: options.insecure,
        drain: options.drain.clone(),
        names: Arc::new(names),
        api_key: options.api_key.as_deref().map(Arc::from),
        max_stream_bytes: options.max_buffered_stream_bytes,
        registry: Arc::new(registry),
    };
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/kvlease/release", post(release))
        .route("/ping", get(health).post(health))
        .route("/version", get(|| async { axum::Json(json!({"version": env!("CARGO_PKG_VERSION")})) }))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Serves the OpenAI API for `engine` on `listener` until `shutdown` resolves; then stops
/// accepting, shuts the engine down (in-flight requests are aborted, leases released as
/// `shutdown`) and waits for open connections to finish.
pub async fn serve(
    engine: EngineHandle,
    listener: tokio::net::TcpListener,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let metrics = Arc::<HttpMetrics>::default();
    let app = app(engine.clone(), &options, metrics.clone());
    server::run(listener, app, options.http, options.tls, metrics, async move {
        shutdown.await;
        tracing::info!("shutting down: aborting in-flight requests");
        engine.shutdown().await;
    })
    .await
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

async fn completions(State(st): State<AppState>, req: Request) -> Response {
    generate(st, req, Endpoint::Completions).await
}

async fn chat_completions(State(st): State<AppState>, req: Request) -> Response {
    generate(st, req, Endpoint::Chat).await
}

/// The request's id: the client's `X-Request-Id` when it sent a usable one, else a random one.
pub(crate) fn request_id(headers: &HeaderMap) -> Result<String, ApiError> {
    match headers.get(REQUEST_ID) {
        None => Ok(crate::ids::random_uuid_hex()),
        Some(v) => match v.to_str() {
            Ok(s) if !s.is_empty() && s.len() <= MAX_REQUEST_ID_LEN => Ok(s.to_owned()),
            _ => {
                Err(ApiError::invalid("X-Request-Id", format!("`X-Request-Id` must be 1 to {MAX_REQUEST_ID_LEN} visible ASCII characters")))
            }
        },
    }
}

/// Sets `X-Request-Id` on a response (ids are header-safe: they came from a header or are hex).
pub(crate) fn with_request_id(mut resp: Response, request_id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(request_id) {
        resp.headers_mut().insert(REQUEST_ID, v);
    }
    resp
}

async fn generate(st: AppState, req: Request, endpoint: Endpoint) -> Response {
    let Some(inflight) = st.drain.admit() else { return Drain::refusal() };
    let (parts, body) = req.into_parts();
    if let Err(e) = st.authorize(&parts.headers) {
        return e.into_response();
    }
    let rid = match request_id(&parts.headers) {
        Ok(rid) => rid,
        Err(e) => return e.into_response(),
    };
    let resp = match run(&st, &rid, &parts, body, endpoint).await {
        Ok(resp) => resp,
        Err(e) => {
            if e.is_server_fault() {
                tracing::warn!(request_id = %rid, status = %e.status, "{}", e.message);
            } else {
                tracing::debug!(request_id = %rid, status = %e.status, "refused: {}", e.message);
            }
            e.into_response()
        }
    };
    inflight.hold(with_request_id(resp, &rid))
}

async fn run(st: &AppState, rid: &str, parts: &Parts, body: Body, endpoint: Endpoint) -> Result<Response, ApiError> {
    let engine = &st.engine;
    let fields = body::json_object(parts, body).await?;
    // SPEC O3: a request that carries P's params and is refused before admission (bad field,
    // wrong model, over length, bad params) releases P's lease at once. Params that do not
    // verify (forged, S1) never cause a release: `release_refused` checks the signature; nor do
    // params that are not the request's own (another prompt's, S4, or a replay).
    let refused = |e: ApiError| {
        if engine.release_refused(fields.get("kv_transfer_params"), e.refusal) {
            tracing::info!(request_id = %rid, "refused before admission: released the prefill engine's lease");
        }
        e
    };
    let parsed = match endpoint {
        Endpoint::Completions => openai::parse_completion(&fields),
        Endpoint::Chat => openai::parse_chat(&fields),
    };
    let c: Completion = parsed.map_err(refused)?;
    if !c.ignored.is_empty() {
        // vLLM's behaviour for fields it does not know: accepted, and named in the log.
        tracing::warn!(request_id = %rid, "The following fields were present in the request but ignored: {:?}", c.ignored);
    }
    if let Some(m) = c.model.as_deref() {
        if !st.serves(m) {
            return Err(refused(ApiError::model_not_found(m)));
        }
    }
    let meta = ResponseMeta::new(endpoint, rid, &st.names[0]);
    let mut choices = submit_choices(engine, rid, &c).map_err(refused)?;
    // Wait for each choice's first event so that a request the engine refuses (e.g. altered
    // kv_transfer_params, SPEC S1) gets its 4xx status rather than a 200 with an error inside.
    for ch in &mut choices {
        if let Some(e) = ch.first_failure().await {
            return Err(e);
        }
    }
    if c.stream {
        return Ok(sse::response(meta, choices, c.include_usage, c.n, c.logprobs.is_some(), st.max_stream_bytes));
    }
    collect(meta, choices, c.n, c.logprobs.is_some()).await.map(|v| axum::Json(v).into_response())
}

/// Submits every choice: each prompt `n` times. Only the first carries `kv_transfer_params`: a
/// prefill leg (do_remote_decode) runs once whatever `n` says, and on a decoder the other
/// choices compute the prompt locally, which gives the same KV (SPEC D7).
fn submit_choices(engine: &EngineHandle, rid: &str, c: &Completion) -> Result<Vec<Choice>, ApiError> {
    let prefill_leg =
        c.kv_transfer_params.as_ref().and_then(|p| p.get("do_remote_decode")).and_then(serde_json::Value::as_bool) == Some(true);
    let n = if prefill_leg { 1 } else { c.n };
    let rules = StopRules {
        stop: c.stop.clone(),
        include_stop_str_in_output: c.include_stop_str_in_output,
        min_tokens: c.min_tokens,
        stop_token_ids: c.stop_token_ids.clone(),
    };
    let mut choices = Vec::with_capacity(c.prompts.len() * n as usize);
    for (i, prompt) in c.prompts.iter().enumerate() {
        for j in 0..n {
            let index = i as u32 * c.n + j;
            let first = index == 0;
            // vLLM's chat default: up to the rest of the context (at least one token; a prompt
            // that fills the context is refused by the engine naming its length).
            let max_tokens = match c.max_tokens_to_context {
                true => engine.max_model_len().saturating_sub(choice::prompt_len(prompt)).max(1),
                false => c.max_tokens,
            };
            let stream = engine.submit(GenerateRequest {
                request_id: if first { rid.to_owned() } else { format!("{rid}-{index}") },
                prompt: prompt.clone(),
                max_tokens,
                ignore_eos: c.ignore_eos,
                kv_transfer_params: if first { c.kv_transfer_params.clone() } else { None },
                sampling: c.sampling(j),
            })?;
            let echo = c.echo.then(|| choice::prompt_text(prompt));
            choices.push(Choice::new(index, stream, rules.clone(), echo, choice::prompt_len(prompt)));
        }
    }
    Ok(choices)
}

/// Runs every choice of a non-streaming request to its end and builds the response.
async fn collect(meta: ResponseMeta, choices: Vec<Choice>, n: u32, logprobs: bool) -> Result<serde_json::Value, ApiError> {
    let meta = &meta;
    let done = futures_util::future::join_all(choices.into_iter().map(|mut ch| async move {
        let mut text = String::new();
        let mut lps = Vec::new();
        while let Some(out) = ch.next().await {
            match out {
                Out::Text { text: t, logprobs, .. } => {
                    text.push_str(&t);
                    lps.extend(logprobs);
                }
                Out::Finish(f) => return Ok((ch.index, text, lps, f)),
                Out::Failed(e) => return Err(e),
            }
        }
        Err(ApiError::ended_early())
    }))
    .await;
    let mut usage = Usage { prompt_tokens: 0, completion_tokens: 0 };
    let mut kv = None;
    let mut out = Vec::with_capacity(done.len());
    for d in done {
        let (index, text, lps, f) = d?;
        if index % n.max(1) == 0 {
            usage.prompt_tokens += f.prompt_tokens;
        }
        usage.completion_tokens += f.completion_tokens;
        if index == 0 {
            kv = f.kv_transfer_params.clone();
        }
        let lp = if logprobs { meta.logprobs(&lps, 0) } else { serde_json::Value::Null };
        out.push(meta.full_choice(index, &text, lp, &f));
    }
    Ok(meta.full(out, usage, kv))
}

/// `POST /kvlease/release` on P: ends the lease the posted `kv_transfer_params` describe (the
/// object P answered with, or `{"kv_transfer_params": {...}}`), for a router whose decode leg
/// failed before the decoder took the request. `{"released": true}` if it was live and no decoder
/// held it; `false` if it had already ended or a decoder holds it.
async fn release(State(st): State<AppState>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let result = async {
        let fields = body::json_object(&parts, body).await?;
        let params = match fields.get("kv_transfer_params") {
            Some(p) => p.clone(),
            None => serde_json::Value::Object(fields),
        };
        Ok::<_, ApiError>(st.engine.release_by_params(&params)?)
    }
    .await;
    match result {
        Ok(released) => axum::Json(json!({"released": released})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn models(State(st): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    let root = st.engine.model_name();
    let data: Vec<_> = st
        .names
        .iter()
        .map(|name| {
            json!({"id": name, "object": "model", "created": st.started, "owned_by": "kvlease", "root": root,
                   "parent": null, "max_model_len": st.engine.max_model_len()})
        })
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

impl AppState {
    /// A `model` field, if any, must name a model this engine serves (404 otherwise).
    fn check_model(&self, fields: &serde_json::Map<String, serde_json::Value>) -> Result<(), ApiError> {
        match fields.get("model").and_then(serde_json::Value::as_str) {
            Some(m) if !self.serves(m) => Err(ApiError::model_not_found(m)),
            _ => Ok(()),
        }
    }
}

/// vLLM's `POST /tokenize`: `{prompt}` or `{messages}` (the chat template applied) →
/// `{count, max_model_len, tokens, token_strs}`.
async fn tokenize(State(st): State<AppState>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let result = async {
        let fields = body::json_object(&parts, body).await?;
        st.check_model(&fields)?;
        let tokens: Vec<u32> = if fields.contains_key("messages") {
            let mut chat = fields.clone();
            chat.remove("model");
            match openai::parse_chat(&chat)?.prompts.first() {
                Some(kvlease_engine::Prompt::Text(t)) => kvlease_engine::model::tokenize(t),
                _ => Vec::new(),
            }
        } else {
            match fields.get("prompt") {
                Some(serde_json::Value::String(t)) => kvlease_engine::model::tokenize(t),
                Some(v) => return Err(ApiError::invalid("prompt", format!("`prompt` must be a string, got {}", body::kind_of(v)))),
                None => return Err(ApiError::invalid("prompt", "`prompt` (or `messages`) is required")),
            }
        };
        let strs: Vec<String> = tokens.iter().map(|&t| kvlease_engine::model::detokenize(t)).collect();
        let want_strs = fields.get("return_token_strs").and_then(serde_json::Value::as_bool) == Some(true);
        Ok(json!({"count": tokens.len(), "max_model_len": st.engine.max_model_len(), "tokens": tokens, "token_strs": if want_strs { json!(strs) } else { json!(null) }}))
    }
    .await;
    result.map(|v| axum::Json(v).into_response()).unwrap_or_else(IntoResponse::into_response)
}

/// vLLM's `POST /detokenize`: `{tokens}` → `{prompt}`.
async fn detokenize(State(st): State<AppState>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let result = async {
        let fields = body::json_object(&parts, body).await?;
        st.check_model(&fields)?;
        let bad =
            || ApiError::invalid("tokens", format!("`tokens` must be a list of token ids in 0..{}", kvlease_engine::model::VOCAB_SIZE));
        let ids = fields.get("tokens").and_then(serde_json::Value::as_array).ok_or_else(bad)?;
        // Byte tokens are gathered first, so a character of several bytes reads back whole.
        let mut bytes = Vec::new();
        for id in ids {
            let t = id.as_u64().and_then(|t| u32::try_from(t).ok()).filter(|t| *t < kvlease_engine::model::VOCAB_SIZE).ok_or_else(bad)?;
            match u8::try_from(t) {
                Ok(b) => bytes.push(b),
                Err(_) => bytes.extend_from_slice(kvlease_engine::model::detokenize(t).as_bytes()),
            }
        }
        Ok::<_, ApiError>(json!({"prompt": String::from_utf8_lossy(&bytes)}))
    }
    .await;
    result.map(|v| axum::Json(v).into_response()).unwrap_or_else(IntoResponse::into_response)
}

/// 200 with an empty body, as vLLM answers; while the engine listens beyond loopback without a
/// secret, 200 with `{"status":"ok","insecure":true}`, so a probe can tell (SPEC S3).
async fn health(State(st): State<AppState>) -> Response {
    if st.drain.is_draining() {
        return ApiError::unavailable("draining: shutting down").into_response();
    }
    if st.engine.is_healthy() {
        if st.insecure {
            axum::Json(json!({"status": "ok", "insecure": true})).into_response()
        } else {
            StatusCode::OK.into_response()
        }
    } else {
        ApiError::unavailable("engine is not healthy").into_response()
    }
}

async fn metrics(State(st): State<AppState>) -> Response {
    ([(header::CONTENT_TYPE, HeaderValue::from_static(metrics::CONTENT_TYPE))], metrics::exposition(&st.registry)).into_response()
}
