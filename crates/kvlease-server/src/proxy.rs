//! `kvlease proxy`: routes each completion through a prefill engine (P) and then a decode engine
//! (D), as vLLM's toy proxy (`toy_proxy_server.py`) does, with the same flags, so either proxy
//! drives either server (SPEC §10).
//!
//! The request is validated first, with the same parser the engines use, so a request D would
//! refuse never reaches P (no lease is granted for it) and errors name the client's values.
//! P leg: the client's request with `n = 1`, `stream = false` and `do_remote_decode = true`
//! (its own `max_tokens`, so P's length checks see the client's numbers: P prefills only);
//! P's response carries the `kv_transfer_params` that the D leg then sends unchanged. D's response
//! is streamed back as it comes. Beyond the toy: a client that disconnects drops the upstream
//! request and its body stream, so P or D sees the connection close and aborts (SPEC D4), and an
//! unreachable upstream is a 502 in the OpenAI error shape.
//!
//! The D leg carries P's `kv_transfer_params` or none, never the client's: the proxy is the
//! cluster's front door, and a client must not steer D's reads through it (SPEC S1, S3).

use crate::api::{request_id, with_request_id, REQUEST_ID};
use crate::body;
use crate::error::ApiError;
use crate::server::{self, HttpLimits};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One upstream engine's HTTP address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub host: String,
    pub port: u16,
}

impl Upstream {
    fn url(&self, path: &str) -> String {
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("http://[{}]:{}{path}", self.host, self.port)
        } else {
            format!("http://{}:{}{path}", self.host, self.port)
        }
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.url(""))
    }
}

/// The prefill and decode engines to route over (round-robin over each list).
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub prefillers: Vec<Upstream>,
    pub decoders: Vec<Upstream>,
}

impl ProxyConfig {
    /// Pairs `--*-hosts` with `--*-ports` as the toy proxy does; one host may serve many ports.
    pub fn pair(what: &str, hosts: &[String], ports: &[u16]) -> Result<Vec<Upstream>, String> {
        if hosts.is_empty() || ports.is_empty() {
            return Err(format!("--{what}-hosts and --{what}-ports need at least one value each"));
        }
        if hosts.len() != ports.len() && hosts.len() != 1 {
            return Err(format!(
                "--{what}-hosts has {} values but --{what}-ports has {}: give one port per host (or a single host)",
                hosts.len(),
                ports.len()
            ));
        }
        Ok(ports
            .iter()
            .enumerate()
            .map(|(i, &port)| Upstream { host: hosts[if hosts.len() == 1 { 0 } else { i }].clone(), port })
            .collect())
    }
}

struct Pool {
    upstreams: Vec<Upstream>,
    next: AtomicUsize,
}

impl Pool {
    fn pick(&self) -> &Upstream {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.upstreams.len();
        &self.upstreams[i]
    }
}

struct Proxy {
    client: reqwest::Client,
    prefill: Pool,
    decode: Pool,
}

/// Why the proxy could not start.
#[derive(Debug)]
pub struct ProxyError(pub String);

impl fmt::Display for ProxyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ProxyError {}

/// The proxy's router.
pub fn router(cfg: ProxyConfig) -> Result<Router, ProxyError> {
    if cfg.prefillers.is_empty() || cfg.decoders.is_empty() {
        return Err(ProxyError("the proxy needs at least one prefiller and one decoder".into()));
    }
    let client = reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| ProxyError(format!("cannot build the HTTP client: {e}")))?;
    let proxy = Arc::new(Proxy {
        client,
        prefill: Pool { upstreams: cfg.prefillers, next: AtomicUsize::new(0) },
        decode: Pool { upstreams: cfg.decoders, next: AtomicUsize::new(0) },
    });
    Ok(Router::new()
        .route("/v1/completions", post(forward))
        .route("/v1/chat/completions", post(forward))
        .route("/healthcheck", get(|| async { Json(json!({"status": "ok"})) }))
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .with_state(proxy))
}

/// Runs the proxy on `listener` within `limits` until `shutdown` resolves.
pub async fn proxy(
    cfg: ProxyConfig,
    listener: tokio::net::TcpListener,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(cfg).map_err(std::io::Error::other)?;
    server::run(listener, app, limits, shutdown).await
}

async fn forward(State(p): State<Arc<Proxy>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let rid = match request_id(&parts.headers) {
        Ok(rid) => rid,
        Err(e) => return e.into_response(),
    };
    let resp = match route(&p, &rid, &parts, body).await {
        Ok(r) => r,
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

async fn route(p: &Proxy, rid: &str, parts: &Parts, body: Body) -> Result<Response, ApiError> {
    let request = body::json_object(parts, body).await?;
    let auth = parts.headers.get(header::AUTHORIZATION);
    let path = parts.uri.path();
    // The engines' own checks, before anything is leased.
    if path.ends_with("/chat/completions") {
        crate::openai::parse_chat(&request)?;
    } else {
        crate::openai::parse_completion(&request)?;
    }

    let prefiller = p.prefill.pick();
    let p_resp = send(p, prefiller, path, rid, auth, &prefill_leg(&request)).await?;
    if !p_resp.status().is_success() {
        return relay_whole(prefiller, p_resp).await;
    }
    let p_json: Value =
        p_resp.json().await.map_err(|e| ApiError::bad_gateway(format!("prefiller {prefiller} answered with invalid JSON: {e}")))?;

    let d_request = decode_leg(request, &p_json);
    let decoder = p.decode.pick();
    match send(p, decoder, path, rid, auth, &d_request).await {
        Ok(d_resp) if d_resp.status().is_success() => Ok(relay_stream(d_resp)),
        Ok(d_resp) => {
            // D refused before taking the request (it releases P's lease itself, SPEC O3); the
            // proxy makes sure, and relays D's answer.
            release_on_p(p, prefiller, rid, &p_json).await;
            relay_whole(decoder, d_resp).await
        }
        Err(e) => {
            // D never got the request: nobody will read P's blocks.
            release_on_p(p, prefiller, rid, &p_json).await;
            Err(e)
        }
    }
}

/// Ends P's lease at once through P's `POST /kvlease/release` (no lease held to expiry because
/// the decode leg failed). A failure here is logged: the lease then ends at its expiry.
async fn release_on_p(p: &Proxy, prefiller: &Upstream, rid: &str, p_response: &Value) {
    let Some(params) = p_response.get("kv_transfer_params").filter(|v| v.is_object()) else { return };
    let sent = p
        .client
        .post(prefiller.url("/kvlease/release"))
        .header(REQUEST_ID, rid)
        .timeout(Duration::from_secs(2))
        .json(&json!({"kv_transfer_params": params}))
        .send()
        .await;
    match sent {
        Ok(r) if r.status().is_success() => tracing::info!(request_id = %rid, "decode leg failed: released the lease on {prefiller}"),
        Ok(r) => tracing::warn!(request_id = %rid, status = %r.status(), "decode leg failed and {prefiller} did not release the lease"),
        Err(e) => tracing::warn!(request_id = %rid, "decode leg failed and the lease on {prefiller} could not be released: {}", cause(&e)),
    }
}

/// An error with its whole chain of causes: "error sending request … : Too many open files
/// (os error 24)", not just the outermost "error sending request".
pub(crate) fn cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

/// The P leg: one choice, not streamed, asking P to keep the KV for a remote decoder.
fn prefill_leg(request: &Map<String, Value>) -> Map<String, Value> {
    let mut r = request.clone();
    r.insert(
        "kv_transfer_params".into(),
        json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null
        }),
    );
    r.insert("stream".into(), Value::Bool(false));
    r.insert("n".into(), json!(1));
    r.remove("best_of");
    r.remove("stream_options");
    r
}

/// The D leg: the client's request with P's `kv_transfer_params` (none if P gave none: D then
/// runs the request itself).
fn decode_leg(mut request: Map<String, Value>, p_response: &Value) -> Map<String, Value> {
    match p_response.get("kv_transfer_params").filter(|v| v.as_object().is_some_and(|o| !o.is_empty())) {
        Some(params) => request.insert("kv_transfer_params".into(), params.clone()),
        None => request.remove("kv_transfer_params"),
    };
    request
}

async fn send(
    p: &Proxy,
    to: &Upstream,
    path: &str,
    rid: &str,
    auth: Option<&HeaderValue>,
    body: &Map<String, Value>,
) -> Result<reqwest::Response, ApiError> {
    let mut req = p.client.post(to.url(path)).header(REQUEST_ID, rid).json(body);
    if let Some(a) = auth {
        req = req.header(header::AUTHORIZATION, a.clone());
    }
    req.send().await.map_err(|e| {
        let what = if e.is_connect() {
            "is unreachable"
        } else if e.is_timeout() {
            "timed out"
        } else {
            "failed"
        };
        ApiError::bad_gateway(format!("upstream {to} {what}: {}", cause(&e)))
    })
}

/// The upstream's status, content type and whole body (P's errors).
async fn relay_whole(from: &Upstream, resp: reqwest::Response) -> Result<Response, ApiError> {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let bytes = resp.bytes().await.map_err(|e| ApiError::bad_gateway(format!("upstream {from} broke off its answer: {e}")))?;
    let mut out = (status, bytes).into_response();
    if let Some(ct) = content_type {
        out.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    Ok(out)
}

/// The upstream's status, content type and body, streamed chunk by chunk. The body owns the
/// upstream response: dropping it (client gone) closes the upstream connection.
fn relay_stream(resp: reqwest::Response) -> Response {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let mut out = (status, Body::from_stream(resp.bytes_stream())).into_response();
    if let Some(ct) = content_type {
        out.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_leg_is_one_choice_unstreamed_with_remote_decode_and_the_clients_max_tokens() {
        let Value::Object(req) = json!({"prompt": "x", "max_tokens": 50, "stream": true, "stream_options": {"include_usage": true}}) else {
            unreachable!()
        };
        let leg = prefill_leg(&req);
        assert_eq!(leg["max_tokens"], 50, "P's length checks see the client's value");
        assert_eq!((leg["stream"].clone(), leg["n"].clone()), (json!(false), json!(1)));
        assert!(!leg.contains_key("stream_options") && !leg.contains_key("max_completion_tokens"));
        assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(leg["kv_transfer_params"]["remote_engine_id"], Value::Null);
        let Value::Object(chat) = json!({"messages": [], "max_completion_tokens": 9}) else { unreachable!() };
        assert_eq!(prefill_leg(&chat)["max_completion_tokens"], 9);
    }

    /// SPEC S1 through the proxy: D gets P's params or none, never what the client sent.
    #[test]
    fn decode_leg_carries_p_params_never_the_clients() {
        let Value::Object(req) = json!({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [7]}}) else {
            unreachable!()
        };
        let p = json!({"kv_transfer_params": {"remote_lease_id": 3}});
        assert_eq!(decode_leg(req.clone(), &p)["kv_transfer_params"], json!({"remote_lease_id": 3}));
        for p in [json!({}), json!({"kv_transfer_params": null}), json!({"kv_transfer_params": {}})] {
            let leg = decode_leg(req.clone(), &p);
            assert!(!leg.contains_key("kv_transfer_params"), "{p}: {leg:?}");
            assert_eq!(leg["prompt"], "x");
        }
    }

    #[test]
    fn hosts_pair_with_ports() {
        let h = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let two = ProxyConfig::pair("prefiller", &h(&["a", "b"]), &[1, 2]).unwrap();
        assert_eq!(two[1], Upstream { host: "b".into(), port: 2 });
        let one_host = ProxyConfig::pair("decoder", &h(&["a"]), &[1, 2]).unwrap();
        assert_eq!(one_host[1].host, "a");
        assert!(ProxyConfig::pair("decoder", &h(&["a", "b"]), &[1, 2, 3]).unwrap_err().contains("--decoder-hosts"));
        assert_eq!(Upstream { host: "::1".into(), port: 8 }.url("/x"), "http://[::1]:8/x");
    }
}
