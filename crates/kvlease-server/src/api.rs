//! `kvlease serve`'s HTTP API: the OpenAI endpoints in front of one [`EngineHandle`], plus
//! `/v1/models`, `/health` and `/metrics` (SPEC §10, §11), served within [`HttpLimits`].
//!
//! A request's [`RequestStream`] is owned by the handler future (non-streaming) or by the
//! response body (streaming). When the client goes away hyper drops both, the stream is dropped
//! and the engine aborts the request: on D that releases P's lease at once (SPEC D4).

use crate::body;
use crate::error::ApiError;
use crate::openai::{self, Completion, Endpoint, ResponseMeta, Usage};
use crate::server::{self, HttpLimits};
use crate::sse;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kvlease_engine::{EngineHandle, GenerateEvent, GenerateRequest, RequestStream};
use serde_json::json;
use std::future::Future;

/// The header that carries a request's id, in and out (and from the proxy to both legs).
pub const REQUEST_ID: &str = "x-request-id";

/// Longest `X-Request-Id` accepted.
const MAX_REQUEST_ID_LEN: usize = 512;

/// How `kvlease serve` exposes its engine over HTTP.
#[derive(Debug, Clone, Default)]
pub struct ServeOptions {
    pub http: HttpLimits,
    /// The engine listens beyond loopback without a cluster secret (`--insecure`, SPEC S3):
    /// `/health` says so.
    pub insecure: bool,
}

#[derive(Clone)]
struct AppState {
    engine: EngineHandle,
    started: u64,
    insecure: bool,
}

/// The router of `kvlease serve`, for tests that want to mount it themselves.
pub fn router(engine: EngineHandle, options: &ServeOptions) -> Router {
    let state = AppState { engine, started: crate::ids::unix_now(), insecure: options.insecure };
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
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
    let app = router(engine.clone(), &options);
    server::run(listener, app, options.http, async move {
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
        None => Ok(crate::ids::random_hex(16)),
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
    let (parts, body) = req.into_parts();
    let rid = match request_id(&parts.headers) {
        Ok(rid) => rid,
        Err(e) => return e.into_response(),
    };
    let resp = match run(&st.engine, &rid, &parts, body, endpoint).await {
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
    with_request_id(resp, &rid)
}

async fn run(engine: &EngineHandle, rid: &str, parts: &Parts, body: Body, endpoint: Endpoint) -> Result<Response, ApiError> {
    let fields = body::json_object(parts, body).await?;
    let c: Completion = match endpoint {
        Endpoint::Completions => openai::parse_completion(&fields)?,
        Endpoint::Chat => openai::parse_chat(&fields)?,
    };
    if let Some(m) = c.model.as_deref() {
        if m != engine.model_name() {
            return Err(ApiError::model_not_found(m));
        }
    }
    let meta = ResponseMeta::new(endpoint, rid, engine.model_name());
    let mut stream = engine.submit(GenerateRequest {
        request_id: rid.to_owned(),
        prompt: c.prompt,
        max_tokens: c.max_tokens,
        ignore_eos: c.ignore_eos,
        kv_transfer_params: c.kv_transfer_params,
    })?;
    if c.stream {
        // Wait for the first event so that a request the engine refuses (e.g. altered
        // kv_transfer_params, SPEC S1) gets its 4xx status rather than a 200 with an error inside.
        let first = match stream.next().await {
            Some(GenerateEvent::Failed(e)) => return Err(e.into()),
            None => return Err(ended_early()),
            Some(ev) => ev,
        };
        let body = sse::body(meta, stream, first, c.include_usage);
        return Ok((
            [
                (header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream")),
                (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            ],
            body,
        )
            .into_response());
    }
    collect(meta, &mut stream).await.map(|v| axum::Json(v).into_response())
}

/// The engine closed the stream without `Done` or `Failed`: it is shutting down.
pub(crate) fn ended_early() -> ApiError {
    ApiError::unavailable("the engine stopped before the request finished")
}

/// Runs a non-streaming request to its end and builds the response.
async fn collect(meta: ResponseMeta, stream: &mut RequestStream) -> Result<serde_json::Value, ApiError> {
    let mut text = String::new();
    loop {
        match stream.next().await {
            Some(GenerateEvent::Token { text: t, .. }) => text.push_str(&t),
            Some(GenerateEvent::Done { finish_reason, prompt_tokens, completion_tokens, kv_transfer_params }) => {
                return Ok(meta.full(&text, finish_reason, Usage { prompt_tokens, completion_tokens }, kv_transfer_params));
            }
            Some(GenerateEvent::Failed(e)) => return Err(e.into()),
            None => return Err(ended_early()),
        }
    }
}

async fn models(State(st): State<AppState>) -> Response {
    let name = st.engine.model_name();
    axum::Json(json!({
        "object": "list",
        "data": [{"id": name, "object": "model", "created": st.started, "owned_by": "kvlease", "root": name, "parent": null}]
    }))
    .into_response()
}

/// 200 with an empty body, as vLLM answers; while the engine listens beyond loopback without a
/// secret, 200 with `{"status":"ok","insecure":true}`, so a probe can tell (SPEC S3).
async fn health(State(st): State<AppState>) -> Response {
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
    ([(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"))], st.engine.metrics().render())
        .into_response()
}
