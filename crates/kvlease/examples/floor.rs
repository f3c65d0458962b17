//! The floor of a disaggregated request on this HTTP stack (issue 15): what three HTTP hops and
//! one transfer cost with no engine in them, next to what one hop costs.
//!
//! Null processes built from what `kvlease serve` and `kvlease proxy` are built from (tokio's
//! default runtime for an engine and one thread for the proxy; axum on hyper with
//! `TCP_NODELAY`; the proxy's keep-alive hyper client; a kept-open TCP connection for the
//! transfer), with every engine part left out: no tokenizer, no scheduler, no KV written or
//! checked, no lease, no signature, no metrics.
//!
//! * `floor engine`: answers `POST /v1/completions` with a fixed completion. Asked to prefill
//!   for a remote decoder (`kv_transfer_params.do_remote_decode`), it answers with the address
//!   of its transfer agent; given `remote_agent`, it first reads `--kv-bytes` from that agent
//!   (one request, the bytes back) and then tells it the read is done, without waiting.
//! * `floor proxy --prefill URL --decode URL`: vLLM's toy proxy, as `kvlease proxy` does it:
//!   the request to P with `max_tokens` 1 and `do_remote_decode`, P's `kv_transfer_params`
//!   into the request to D, D's answer back.
//!
//! Each prints `floor … listening on http://ADDR` and serves until killed; part 4 of
//! `scripts/bench-proxy.sh` starts them and measures them with `kvlease load`. A benchmark for
//! loopback: a decoder reads from whatever agent address it is given, without a timeout.
use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::http::{StatusCode, Uri};
use axum::routing::post;
use axum::serve::ListenerExt;
use axum::{Json, Router};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const READ: u8 = b'R';
const DONE: u8 = b'D';

type HttpClient = hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // As `kvlease proxy` (one thread) and `kvlease serve` (tokio's default) run.
    let runtime = match args.first().map(String::as_str) {
        Some("proxy") => tokio::runtime::Builder::new_current_thread().enable_all().build()?,
        _ => tokio::runtime::Runtime::new()?,
    };
    runtime.block_on(run(args))
}

async fn run(args: Vec<String>) -> anyhow::Result<()> {
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    // Flags and their values after the role; `--log-level` (which `launch` adds) is accepted
    // and has no effect: these servers log nothing but errors.
    let known: &[&str] = match args.first().map(String::as_str) {
        Some("engine") => &["--kv-bytes", "--log-level"],
        Some("proxy") => &["--prefill", "--decode", "--log-level"],
        _ => &[],
    };
    for pair in args.get(1..).unwrap_or_default().chunks(2) {
        if !known.contains(&pair[0].as_str()) || pair.len() < 2 {
            anyhow::bail!("unknown flag or flag without a value: {}", pair[0]);
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = match args.first().map(String::as_str) {
        Some("engine") => {
            let kv_bytes = match args.iter().position(|a| a == "--kv-bytes") {
                None => 16 << 10,
                Some(_) => {
                    flag("--kv-bytes").and_then(|v| v.parse().ok()).ok_or_else(|| anyhow::anyhow!("--kv-bytes needs a byte count"))?
                }
            };
            let agent = TcpListener::bind("127.0.0.1:0").await?;
            let agent_addr = agent.local_addr()?;
            tokio::spawn(serve_agent(agent, kv_bytes));
            let engine = Arc::new(Engine { agent: agent_addr, kv_bytes, pulls: Mutex::new(Vec::new()) });
            Router::new().route("/v1/completions", post(engine_answer)).with_state(engine)
        }
        Some("proxy") => {
            let (Some(prefill), Some(decode)) = (flag("--prefill"), flag("--decode")) else {
                anyhow::bail!("usage: floor proxy --prefill URL --decode URL");
            };
            let mut http = HttpConnector::new();
            http.set_nodelay(true);
            let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(http);
            let proxy = Arc::new(Proxy {
                client,
                prefill: format!("{prefill}/v1/completions").parse()?,
                decode: format!("{decode}/v1/completions").parse()?,
            });
            Router::new().route("/v1/completions", post(proxy_answer)).with_state(proxy)
        }
        _ => anyhow::bail!("usage: floor engine [--kv-bytes N] | floor proxy --prefill URL --decode URL"),
    };
    println!("floor {} listening on http://{addr}", args[0]);
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router).await?;
    Ok(())
}

struct Engine {
    agent: SocketAddr,
    kv_bytes: usize,
    /// Kept-open connections to transfer agents, as a decoder keeps its agents connected.
    pulls: Mutex<Vec<(SocketAddr, TcpStream)>>,
}

/// The agent: for each `READ`, `kv_bytes` bytes back; a `DONE` is read and nothing answered.
async fn serve_agent(listener: TcpListener, kv_bytes: usize) {
    let kv = Arc::new(vec![7u8; kv_bytes]);
    loop {
        let mut stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // E.g. out of file descriptors: keep serving the connections there are.
                eprintln!("floor agent: accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let kv = kv.clone();
        tokio::spawn(async move {
            let mut op = [0u8; 1];
            while stream.read_exact(&mut op).await.is_ok() {
                if op[0] == READ && stream.write_all(&kv).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// A failed request: its status and why.
type Failed = (StatusCode, String);

async fn engine_answer(State(e): State<Arc<Engine>>, Json(req): Json<Value>) -> Result<Json<Value>, Failed> {
    let params = req.get("kv_transfer_params");
    let mut kv_transfer_params = Value::Null;
    if params.and_then(|p| p.get("do_remote_decode")).and_then(Value::as_bool) == Some(true) {
        kv_transfer_params = json!({"do_remote_prefill": true, "remote_agent": e.agent.to_string()});
    } else if let Some(agent) = params.and_then(|p| p.get("remote_agent")).and_then(Value::as_str) {
        let agent: SocketAddr = agent.parse().map_err(|_| (StatusCode::BAD_REQUEST, format!("bad remote_agent {agent:?}")))?;
        e.pull(agent).await.map_err(|err| (StatusCode::BAD_GATEWAY, format!("pull from {agent}: {err}")))?;
    }
    Ok(Json(json!({
        "id": "cmpl-floor", "object": "text_completion", "created": 0, "model": "floor",
        "choices": [{"index": 0, "text": " lease block cache decode prefill engine token model", "logprobs": null, "finish_reason": "length", "stop_reason": null}],
        "usage": {"prompt_tokens": 32, "completion_tokens": 8, "total_tokens": 40},
        "kv_transfer_params": kv_transfer_params,
    })))
}

impl Engine {
    /// One read of the KV from `agent`, then the completion, not waited for.
    async fn pull(&self, agent: SocketAddr) -> std::io::Result<()> {
        let kept = {
            let mut pulls = self.pulls.lock().unwrap_or_else(|p| p.into_inner());
            pulls.iter().position(|(a, _)| *a == agent).map(|i| pulls.swap_remove(i).1)
        };
        let mut stream = match kept {
            Some(s) => s,
            None => {
                let s = TcpStream::connect(agent).await?;
                s.set_nodelay(true)?;
                s
            }
        };
        let mut kv = vec![0u8; self.kv_bytes];
        stream.write_all(&[READ]).await?;
        stream.read_exact(&mut kv).await?;
        stream.write_all(&[DONE]).await?;
        self.pulls.lock().unwrap_or_else(|p| p.into_inner()).push((agent, stream));
        Ok(())
    }
}

struct Proxy {
    client: HttpClient,
    prefill: Uri,
    decode: Uri,
}

async fn proxy_answer(State(p): State<Arc<Proxy>>, Json(req): Json<serde_json::Map<String, Value>>) -> Result<Json<Value>, Failed> {
    let mut to_p = req.clone();
    to_p.insert("max_tokens".into(), json!(1));
    to_p.insert("stream".into(), json!(false));
    to_p.insert("kv_transfer_params".into(), json!({"do_remote_decode": true, "do_remote_prefill": false}));
    let from_p = post_json(&p.client, &p.prefill, &to_p).await?;
    let mut to_d = req;
    to_d.insert("kv_transfer_params".into(), from_p.get("kv_transfer_params").cloned().unwrap_or(Value::Null));
    Ok(Json(post_json(&p.client, &p.decode, &to_d).await?))
}

/// One leg: the upstream's JSON answer, or a 502 saying why there is none.
async fn post_json(client: &HttpClient, url: &Uri, body: &serde_json::Map<String, Value>) -> Result<Value, Failed> {
    let bad_gateway = |e: String| (StatusCode::BAD_GATEWAY, format!("{url}: {e}"));
    let body = serde_json::to_vec(body).map_err(|e| bad_gateway(e.to_string()))?;
    let req = axum::http::Request::post(url.clone())
        .header(CONTENT_TYPE, "application/json")
        .body(Full::from(body))
        .map_err(|e| bad_gateway(e.to_string()))?;
    let resp = client.request(req).await.map_err(|e| bad_gateway(e.to_string()))?;
    if !resp.status().is_success() {
        return Err(bad_gateway(resp.status().to_string()));
    }
    let bytes = resp.into_body().collect().await.map_err(|e| bad_gateway(e.to_string()))?.to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| bad_gateway(e.to_string()))
}
