//! `kvlease proxy`: routes each completion through a prefill engine (P) and then a decode engine
//! (D), as vLLM's toy proxy (`toy_proxy_server.py`) does, with the same flags, so either proxy
//! drives either server (SPEC §10).
//!
//! The request is validated first, with the same parser the engines use, so a request D would
//! refuse never reaches P (no lease is granted for it) and errors name the client's values.
//! P leg: the client's request with `n = 1`, `stream = false`, `max_tokens = 1` and
//! `do_remote_decode = true`, as vLLM's toy proxy sends it (a vLLM P decodes up to `max_tokens`
//! and then names its answer's blocks too);
//! P's response carries the `kv_transfer_params` that the D leg then sends unchanged. D's response
//! is streamed back as it comes, read from D only as fast as the client takes it (so the proxy
//! holds at most a chunk of it, and a client that stops reading stops D's writes too). Beyond the
//! toy: a client that disconnects, or takes nothing for `--http-write-timeout`, drops the
//! upstream request and its body stream, so P or D sees the connection close and aborts (SPEC
//! D4), and an unreachable upstream is a 502 in the OpenAI error shape.
//!
//! The D leg carries P's `kv_transfer_params` or none, never the client's: the proxy is the
//! cluster's front door, and a client must not steer D's reads through it (SPEC S1, S3).
//!
//! Push mode (SPEC §13, [`TransferMode`]): a prefiller known to be a push engine — its
//! coordinates learnt from one of its answers (`transfer_mode: "push"`), or with
//! `--transfer-mode push` from its etcd registration — gets both legs at once: the P leg with a
//! fresh random `transfer_id`, the D leg with P's coordinates and the same `transfer_id`
//! ([`route::PushPeer`]). D's answer is relayed once P has answered; a P leg that fails drops
//! the D leg (D releases, U9), a D leg that fails or is refused releases P's lease by its key
//! (O3, O4). The decisions are the core's [`route::Route`]; this carries them out.

use crate::api::{request_id, with_request_id, REQUEST_ID};
use crate::body;
use crate::error::{cause, ApiError};
use crate::server::{self, HttpLimits, HttpMetrics};
use axum::body::Body;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::future::BoxFuture;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kvlease_core::route::{self, Action, Answer, Candidate, Event, Leg, PrefillAnswer, PushPeer, RouteError, TurnCache};
use kvlease_core::Nanos;
use kvlease_engine::metrics::{self, Registry};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One upstream engine's HTTP address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub host: String,
    pub port: u16,
    /// SPEC S6: the engine speaks HTTPS (`https://host` in `--*-hosts`, or registered so).
    pub https: bool,
}

impl Upstream {
    /// Plain HTTP at `host:port`.
    pub fn http(host: impl Into<String>, port: u16) -> Upstream {
        Upstream { host: host.into(), port, https: false }
    }

    fn url(&self, path: &str) -> String {
        let scheme = if self.https { "https" } else { "http" };
        if self.host.contains(':') && !self.host.starts_with('[') {
            format!("{scheme}://[{}]:{}{path}", self.host, self.port)
        } else {
            format!("{scheme}://{}:{}{path}", self.host, self.port)
        }
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.url(""))
    }
}

/// The prefill and decode engines to route over (least outstanding requests among the healthy
/// ones), and how the proxy watches them.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub prefillers: Vec<Upstream>,
    pub decoders: Vec<Upstream>,
    /// A request (both legs, the answer streamed to its end) that takes longer fails: 504
    /// before the first byte, an SSE error event after it.
    pub request_timeout: Duration,
    /// How often every upstream's `/health` is probed; an upstream that fails a probe (or a
    /// connection) is out of rotation until a probe succeeds.
    pub health_interval: Duration,
    /// SPEC O1: started on SIGTERM; new requests get 503 while those in flight finish.
    pub drain: Arc<crate::drain::Drain>,
    /// Engines found through etcd (`--etcd`) rather than listed: `prefillers` and `decoders`
    /// then start empty and follow the registrations.
    pub membership: Option<Membership>,
    /// SPEC S6: HTTPS on the proxy's listener, and what its client trusts (`--ssl-ca-certs`) and
    /// presents to `https://` upstreams.
    pub tls: crate::tls::Tls,
    /// SPEC §13: whether both legs may go at once to push prefillers (`--transfer-mode`).
    pub transfer_mode: TransferMode,
}

/// How the proxy sends a request's two legs (`--transfer-mode`, SPEC §13).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TransferMode {
    /// Learn each prefiller's mode from its answers: legs one after the other until a prefiller
    /// answers as a push engine (`transfer_mode: "push"`, with its coordinates); from then on
    /// both legs go to it at once. A prefiller that answers as a pull engine is pull again.
    #[default]
    Learn,
    /// As `Learn`, and with `--etcd` a prefiller's coordinates come from its registration, so
    /// even its first request sends both legs at once.
    Push,
    /// Always one leg after the other (pull engines, or push engines driven sequentially).
    Pull,
}

/// Where the proxy finds the engines it routes to: the registrations under `prefix` in etcd,
/// watched (and checked every `--health-interval`). While etcd cannot be reached the last set
/// read is kept.
#[derive(Debug, Clone)]
pub struct Membership {
    pub etcd: crate::etcd::Etcd,
    pub prefix: String,
}

impl ProxyConfig {
    /// Defaults: 600 s per request, a probe every 0.5 s (an instance that fails is out within
    /// 2 s: the interval plus the probe's 1 s timeout).
    pub fn new(prefillers: Vec<Upstream>, decoders: Vec<Upstream>) -> ProxyConfig {
        ProxyConfig {
            prefillers,
            decoders,
            request_timeout: Duration::from_secs(600),
            health_interval: Duration::from_millis(500),
            drain: Arc::default(),
            membership: None,
            tls: crate::tls::Tls::default(),
            transfer_mode: TransferMode::default(),
        }
    }

    /// What [`router`] would refuse, checked before anything starts.
    pub fn check(&self) -> Result<(), ProxyError> {
        if self.membership.is_none() && (self.prefillers.is_empty() || self.decoders.is_empty()) {
            return Err(ProxyError("the proxy needs at least one prefiller and one decoder".into()));
        }
        if self.request_timeout.is_zero() || self.health_interval.is_zero() {
            return Err(ProxyError("--request-timeout and --health-interval must be above 0".into()));
        }
        // SPEC S6: the proxy trusts only --ssl-ca-certs.
        if let Some(up) = self.prefillers.iter().chain(&self.decoders).find(|u| u.https && !self.tls.client.has_roots()) {
            return Err(ProxyError(format!(
                "upstream {up} speaks HTTPS: give --ssl-ca-certs, the CA that signed the engines' certificates (the proxy trusts no other)"
            )));
        }
        Ok(())
    }

    /// Pairs `--*-hosts` with `--*-ports` as the toy proxy does; one host may serve many ports.
    /// A host may be written `https://host` (SPEC S6: the engine speaks HTTPS) or `http://host`.
    pub fn pair(what: &str, hosts: &[String], ports: &[u16]) -> Result<Vec<Upstream>, ProxyError> {
        if hosts.is_empty() || ports.is_empty() {
            return Err(ProxyError(format!("--{what}-hosts and --{what}-ports need at least one value each")));
        }
        if hosts.len() != ports.len() && hosts.len() != 1 {
            return Err(ProxyError(format!(
                "--{what}-hosts has {} values but --{what}-ports has {}: give one port per host (or a single host)",
                hosts.len(),
                ports.len()
            )));
        }
        let hosts = hosts
            .iter()
            .map(|h| {
                let (https, host) = match (h.strip_prefix("https://"), h.strip_prefix("http://")) {
                    (Some(host), _) => (true, host),
                    (None, Some(host)) => (false, host),
                    (None, None) => (false, h.as_str()),
                };
                let host = host.strip_suffix('/').unwrap_or(host);
                let port_in_it = host.contains(':') && host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::Ipv6Addr>().is_err();
                if host.is_empty() || host.contains(['/', '?', '#', '@']) || port_in_it {
                    return Err(ProxyError(format!(
                        "--{what}-hosts {h:?} is not a host: give a name or address, optionally as https://host (the port goes in --{what}-ports)"
                    )));
                }
                Ok((https, host.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ports
            .iter()
            .enumerate()
            .map(|(i, &port)| {
                let (https, host) = hosts[if hosts.len() == 1 { 0 } else { i }].clone();
                Upstream { host, port, https }
            })
            .collect())
    }
}

/// One upstream engine as the proxy sees it.
struct Instance {
    up: Upstream,
    healthy: AtomicBool,
    outstanding: AtomicUsize,
    requests: AtomicU64,
    failures: AtomicU64,
    /// SPEC §13: a push prefiller's coordinates, once known: both legs then go at once.
    push: std::sync::Mutex<Option<PushPeer>>,
    /// The legs' URLs on it, parsed once (issue 27).
    legs: [(&'static str, Option<Uri>); 2],
}

impl Instance {
    fn push_peer(&self) -> Option<PushPeer> {
        self.push.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What P's answer says of its mode: a push answer's coordinates, or none (pull).
    fn learn(&self, params: &PParams) {
        let peer = params.push_peer();
        let mut known = self.push.lock().unwrap_or_else(|e| e.into_inner());
        if *known != peer {
            match &peer {
                Some(peer) => {
                    tracing::info!(upstream = %self.up, engine = %peer.engine_id, "a push prefiller: both legs go at once from now on")
                }
                None => tracing::info!(upstream = %self.up, "answered as a pull engine: legs one after the other"),
            }
            *known = peer;
        }
    }
}

impl Instance {
    /// In rotation, nothing counted yet.
    fn new(up: Upstream) -> Arc<Instance> {
        Arc::new(Instance {
            healthy: AtomicBool::new(true),
            outstanding: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            push: std::sync::Mutex::new(None),
            legs: LEG_PATHS.map(|path| (path, Uri::try_from(up.url(path)).ok())),
            up,
        })
    }

    /// A request for `path` on this engine (its URL parsed already when it is a leg's): a POST
    /// of `json`, or a GET without; with the request's id and the client's `Authorization`.
    fn request(&self, path: &str, json: Option<Bytes>, rid: Option<&str>, auth: Option<&HeaderValue>) -> Result<UpRequest, ApiError> {
        let parsed = self.legs.iter().find(|(p, _)| *p == path).and_then(|(_, uri)| uri.as_ref());
        self.up.request(parsed, path, json, rid, auth)
    }
}

impl Upstream {
    /// [`Instance::request`], with `path`'s URL parsed here unless `parsed`.
    fn request(
        &self,
        parsed: Option<&Uri>,
        path: &str,
        json: Option<Bytes>,
        rid: Option<&str>,
        auth: Option<&HeaderValue>,
    ) -> Result<UpRequest, ApiError> {
        let uri = match parsed {
            Some(uri) => uri.clone(),
            None => Uri::try_from(self.url(path))
                .map_err(|e| ApiError::bad_gateway(format!("upstream {self} has no valid URL for {path}: {e}")))?,
        };
        let mut req = axum::http::Request::builder().uri(uri);
        if let Some(rid) = rid {
            req = req.header(HeaderName::from_static(REQUEST_ID), rid);
        }
        if let Some(a) = auth {
            req = req.header(header::AUTHORIZATION, a.clone());
        }
        let req = match json {
            Some(body) => {
                req.method(Method::POST).header(header::CONTENT_TYPE, HeaderValue::from_static("application/json")).body(Full::from(body))
            }
            None => req.method(Method::GET).body(Full::default()),
        };
        req.map_err(|e| ApiError::bad_gateway(format!("upstream {self}: cannot make the request: {e}")))
    }
}

/// The paths the proxy relays (its routes to [`forward`]).
const LEG_PATHS: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

/// The route machine tells engines apart by address: an engine in both pools (`kv_both`) is one
/// engine (SPEC O4).
impl PartialEq for Instance {
    fn eq(&self, other: &Instance) -> bool {
        self.up == other.up
    }
}

/// Counts a request against its instance while alive (least-outstanding routing).
struct Outstanding(Arc<Instance>);

impl Outstanding {
    fn new(i: Arc<Instance>) -> Outstanding {
        i.outstanding.fetch_add(1, Ordering::AcqRel);
        i.requests.fetch_add(1, Ordering::Relaxed);
        Outstanding(i)
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One role's upstreams. The set is the one thing that changes when engines come and go
/// ([`Pool::set`], from etcd); requests and probes work on a snapshot of it.
struct Pool {
    role: &'static str,
    instances: std::sync::RwLock<Arc<Vec<Arc<Instance>>>>,
    next: AtomicUsize,
}

impl Pool {
    fn new(role: &'static str, upstreams: Vec<Upstream>) -> Pool {
        let instances = upstreams.into_iter().map(Instance::new).collect();
        Pool { role, instances: std::sync::RwLock::new(Arc::new(instances)), next: AtomicUsize::new(0) }
    }

    /// The upstreams now.
    fn instances(&self) -> Arc<Vec<Arc<Instance>>> {
        self.instances.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Routes to exactly `upstreams` from now on: those already known keep their health and
    /// counters, new ones start in rotation (an engine registers once it listens), the others
    /// leave (their requests in flight finish).
    fn set(&self, upstreams: Vec<Upstream>) {
        let mut cur = self.instances.write().unwrap_or_else(|e| e.into_inner());
        if cur.len() == upstreams.len() && cur.iter().zip(&upstreams).all(|(i, up)| i.up == *up) {
            return;
        }
        let next: Vec<Arc<Instance>> =
            upstreams.into_iter().map(|up| cur.iter().find(|i| i.up == up).cloned().unwrap_or_else(|| Instance::new(up))).collect();
        for gone in cur.iter().filter(|i| !next.iter().any(|n| n.up == i.up)) {
            tracing::info!(role = self.role, upstream = %gone.up, "left the routing set");
        }
        for new in next.iter().filter(|n| !cur.iter().any(|i| i.up == n.up)) {
            tracing::info!(role = self.role, upstream = %new.up, "joined the routing set");
        }
        *cur = Arc::new(next);
    }

    /// The upstreams as the route machine picks among them now, ties starting from the next
    /// in turn.
    fn view(&self, mode: TransferMode) -> (Vec<Candidate<Arc<Instance>>>, usize) {
        let candidates = self
            .instances()
            .iter()
            .map(|i| Candidate {
                upstream: i.clone(),
                healthy: i.healthy.load(Ordering::Acquire),
                outstanding: i.outstanding.load(Ordering::Acquire),
                push: mode != TransferMode::Pull && i.push_peer().is_some(),
            })
            .collect();
        (candidates, self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// The healthy instance with the fewest requests outstanding (ties in turn); when none is
    /// healthy, the least busy of all ([`route::pick`]).
    fn pick(&self) -> Option<Arc<Instance>> {
        let (candidates, start) = self.view(TransferMode::Pull);
        route::pick(route::Pool { candidates: &candidates, start }, None, None).cloned()
    }

    fn any_healthy(&self) -> bool {
        self.instances().iter().any(|i| i.healthy.load(Ordering::Acquire))
    }
}

/// Marks an instance out of rotation after a failure the proxy saw itself.
fn mark_down(i: &Instance, why: &str) {
    i.failures.fetch_add(1, Ordering::Relaxed);
    if i.healthy.swap(false, Ordering::AcqRel) {
        tracing::warn!(upstream = %i.up, "out of rotation: {why}");
    }
}

/// The HTTP client to the engines, built again once `--enable-ssl-refresh` read new files
/// ([`crate::tls::Tls::refresh_on_change`]): new connections then trust the new CAs and
/// present the new certificate; pooled ones keep theirs until they close.
struct UpstreamClient {
    tls: crate::tls::ClientTls,
    /// The client, and the generation of the files it was built from.
    built: std::sync::RwLock<(u64, HttpClient)>,
}

impl UpstreamClient {
    fn new(tls: crate::tls::ClientTls) -> Result<UpstreamClient, ProxyError> {
        let generation = tls.generation();
        let client = Self::build(&tls).map_err(ProxyError)?;
        Ok(UpstreamClient { tls, built: std::sync::RwLock::new((generation, client)) })
    }

    fn build(tls: &crate::tls::ClientTls) -> Result<HttpClient, String> {
        let config = tls.config().map_err(|e| e.to_string())?;
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(Duration::from_secs(5)));
        http.enforce_http(false);
        let https = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(config).https_or_http().enable_http1().wrap_connector(http);
        Ok(hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_timer(TokioTimer::new())
            .build(https))
    }

    /// The client for the next request (a handle: cloning it is cheap).
    fn get(&self) -> HttpClient {
        let generation = self.tls.generation();
        {
            let built = self.built.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            if built.0 == generation {
                return built.1.clone();
            }
        }
        let mut built = self.built.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if built.0 != generation {
            match Self::build(&self.tls) {
                Ok(client) => *built = (generation, client),
                // Checked when the files were read, so not expected: keep the client we have.
                Err(e) => tracing::error!("--enable-ssl-refresh: {e}; the proxy keeps its client to the engines"),
            }
            built.0 = generation;
        }
        built.1.clone()
    }
}

/// The proxy's HTTP client to its engines: hyper's, pooled and kept alive, `TCP_NODELAY`, HTTPS
/// through rustls for `https://` upstreams. No proxy from the environment is used.
type HttpClient = hyper_util::client::legacy::Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;
type UpRequest = axum::http::Request<Full<Bytes>>;
type UpResponse = axum::http::Response<hyper::body::Incoming>;

/// Sends `req` and waits for the answer's head, within `limit` (none: the caller bounds it);
/// why not, worded to follow the upstream's name ("is unreachable: …").
async fn exchange(client: &HttpClient, req: UpRequest, limit: Option<Duration>) -> Result<UpResponse, String> {
    let sent = client.request(req);
    let answered = match limit {
        Some(limit) => tokio::time::timeout(limit, sent).await,
        None => Ok(sent.await),
    };
    match answered {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) if e.is_connect() => Err(format!("is unreachable: {}", cause(&e))),
        Ok(Err(e)) => Err(format!("failed: {}", cause(&e))),
        Err(_) => Err(format!("timed out ({:.1} s)", limit.unwrap_or_default().as_secs_f64())),
    }
}

/// An answer's whole body.
async fn read_whole(from: &Upstream, resp: UpResponse) -> Result<Bytes, ApiError> {
    match resp.into_body().collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(ApiError::bad_gateway(format!("upstream {from} broke off its answer: {}", cause(&e)))),
    }
}

/// What the proxy reads of P's answer ([`PAnswer`]), or why it cannot.
async fn read_p_answer(from: &Upstream, resp: UpResponse) -> Result<PParams, ApiError> {
    let bytes = read_whole(from, resp).await?;
    match serde_json::from_slice::<PAnswer>(&bytes) {
        Ok(v) => Ok(PParams(v.kv_transfer_params)),
        Err(e) => Err(ApiError::bad_gateway(format!("prefiller {from} answered with invalid JSON: {e}"))),
    }
}

struct Proxy {
    client: UpstreamClient,
    prefill: Pool,
    decode: Pool,
    request_timeout: Duration,
    drain: Arc<crate::drain::Drain>,
    requests: Counter,
    retries: Counter,
    failed: Counter,
    timeouts: Counter,
    released: Counter,
    turns: Turns,
    turns_used: Counter,
    transfer_mode: TransferMode,
    /// Requests whose legs went to a push prefiller and a decoder at once.
    pushed: Counter,
    /// With `--etcd`: whether the last read of the registrations succeeded.
    etcd: Option<EtcdState>,
    /// The counters above, the upstreams' ([`UpstreamMetrics`]) and the listener's, for
    /// `/metrics`.
    registry: Registry,
}

/// The proxy's view of etcd.
struct EtcdState {
    url: String,
    up: AtomicBool,
    failures: Counter,
}

/// Multi-turn (SPEC B1, B4): each conversation's last decoder turn ([`TurnCache`]), on the
/// proxy's clock.
struct Turns {
    cache: std::sync::Mutex<TurnCache>,
    origin: tokio::time::Instant,
}

impl Turns {
    fn new() -> Turns {
        Turns { cache: std::sync::Mutex::default(), origin: tokio::time::Instant::now() }
    }

    /// Now, for the cache.
    fn now(&self) -> Nanos {
        Nanos(u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, TurnCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
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
    app(cfg, Arc::default())
}

/// The router, counting into `http` what the listener under it counts.
fn app(cfg: ProxyConfig, http: Arc<HttpMetrics>) -> Result<Router, ProxyError> {
    cfg.check()?;
    let client = UpstreamClient::new(cfg.tls.client.clone())?;
    let proxy = Arc::new_cyclic(|me| {
        let mut registry = Registry::default();
        let proxy = Proxy {
            client,
            prefill: Pool::new("prefill", cfg.prefillers),
            decode: Pool::new("decode", cfg.decoders),
            request_timeout: cfg.request_timeout,
            drain: cfg.drain.clone(),
            requests: Counter::default(),
            retries: Counter::default(),
            failed: Counter::default(),
            timeouts: Counter::default(),
            released: Counter::default(),
            turns: Turns::new(),
            turns_used: Counter::default(),
            transfer_mode: cfg.transfer_mode,
            pushed: Counter::default(),
            etcd: cfg.membership.as_ref().map(|m| EtcdState {
                url: m.etcd.url().to_string(),
                up: AtomicBool::new(false),
                failures: Counter::default(),
            }),
            registry: Registry::default(),
        };
        for (name, help, c) in [
            ("kvlease_proxy_requests", "Completion requests received", &proxy.requests),
            ("kvlease_proxy_retries", "Legs retried on another instance after failing before their first byte", &proxy.retries),
            ("kvlease_proxy_failed", "Requests answered with a 5xx the proxy made", &proxy.failed),
            ("kvlease_proxy_timeouts", "Requests cut by --request-timeout", &proxy.timeouts),
            ("kvlease_proxy_leases_released", "P leases released because the decode leg failed", &proxy.released),
            ("kvlease_proxy_turns_used", "Prefill legs sent with the conversation's cached decoder turn (multi-turn)", &proxy.turns_used),
            ("kvlease_proxy_push_dispatches", "Both legs sent at once to a push prefiller and a decoder (push mode)", &proxy.pushed),
        ] {
            registry.register(name, help, c.clone());
        }
        if let Some(e) = &proxy.etcd {
            registry.register("kvlease_proxy_etcd_failures", "Reads of the registrations in etcd that failed", e.failures.clone());
        }
        registry.register_collector(Box::new(UpstreamMetrics(me.clone())));
        http.register(&mut registry);
        Proxy { registry, ..proxy }
    });
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(health_checks(Arc::downgrade(&proxy), cfg.health_interval));
        if let Some(m) = cfg.membership {
            rt.spawn(follow_etcd(Arc::downgrade(&proxy), m, cfg.health_interval));
        }
    }
    Ok(Router::new()
        .route(LEG_PATHS[0], post(forward))
        .route(LEG_PATHS[1], post(forward))
        .route("/healthcheck", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
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
    let metrics = Arc::<HttpMetrics>::default();
    let tls = cfg.tls.server.clone();
    let app = app(cfg, metrics.clone()).map_err(std::io::Error::other)?;
    server::run(listener, app, limits, tls, metrics, shutdown).await
}

/// Probes every upstream's `/health` each `interval` (1 s timeout): out of rotation on a failed
/// probe, back in on a good one. Ends with the proxy.
async fn health_checks(p: std::sync::Weak<Proxy>, interval: Duration) {
    loop {
        // Instances start in rotation; the first probe comes one interval in.
        tokio::time::sleep(interval).await;
        let Some(proxy) = p.upgrade() else { return };
        let (prefill, decode) = (proxy.prefill.instances(), proxy.decode.instances());
        let probes: Vec<_> = prefill
            .iter()
            .chain(decode.iter())
            .map(|i| {
                let (client, i) = (proxy.client.get(), i.clone());
                async move {
                    let probe = match i.request("/health", None, None, None) {
                        Ok(req) => exchange(&client, req, Some(Duration::from_secs(1))).await,
                        Err(e) => Err(e.message),
                    };
                    match probe {
                        Ok(r) if r.status().is_success() => {
                            if !i.healthy.swap(true, Ordering::AcqRel) {
                                tracing::info!(upstream = %i.up, "back in rotation");
                            }
                        }
                        Ok(r) => mark_down(&i, &format!("/health answered {}", r.status())),
                        Err(why) => mark_down(&i, &format!("/health {why}")),
                    }
                }
            })
            .collect();
        drop(proxy);
        futures_util::future::join_all(probes).await;
    }
}

/// How long after etcd answers again the proxy lets engines join but not leave.
const ETCD_RECOVERY_GRACE: Duration = Duration::from_secs(3);

/// Follows the registrations under the prefix ([`crate::etcd::follow`]: a watch, checked every
/// `interval`) and routes to them: prefill and both-role engines as prefillers, decode and
/// both-role ones as decoders. A registration that does not parse is skipped with a warning
/// naming its key (once per value). While etcd cannot be read the last set is kept, and
/// `/health` and `kvlease_proxy_etcd_up` say so; for [`ETCD_RECOVERY_GRACE`] after it answers
/// again, engines join but none leaves (an etcd that came back without its data is empty until
/// the engines, retrying every second, register again). Ends with the proxy.
async fn follow_etcd(p: std::sync::Weak<Proxy>, m: Membership, interval: Duration) {
    let mut warned: std::collections::HashSet<(String, Vec<u8>)> = Default::default();
    let mut was_down = false;
    let mut grace_until: Option<tokio::time::Instant> = None;
    crate::etcd::follow(&m.etcd, &m.prefix, interval, |seen| {
        let Some(proxy) = p.upgrade() else { return false };
        let Some(state) = &proxy.etcd else { return false };
        match seen {
            crate::etcd::Seen::Keys(keys) => {
                let (mut prefill, mut decode) = (Vec::new(), Vec::new());
                for (key, raw) in keys {
                    match crate::etcd::Registration::parse(raw).and_then(|r| Ok((r.upstream()?, r))) {
                        Ok((up, r)) => {
                            if r.role.prefills() && !prefill.contains(&up) {
                                prefill.push(up.clone());
                            }
                            if r.role.decodes() && !decode.contains(&up) {
                                decode.push(up);
                            }
                        }
                        Err(why) => {
                            if warned.insert((key.clone(), raw.clone())) {
                                tracing::warn!(%key, "etcd: skipping a malformed registration: {why}");
                            }
                        }
                    }
                }
                if std::mem::take(&mut was_down) {
                    grace_until = Some(tokio::time::Instant::now() + ETCD_RECOVERY_GRACE);
                }
                if grace_until.is_some_and(|t| tokio::time::Instant::now() < t) {
                    for (pool, read) in [(&proxy.prefill, &mut prefill), (&proxy.decode, &mut decode)] {
                        let kept: Vec<Upstream> = pool.instances().iter().map(|i| i.up.clone()).filter(|up| !read.contains(up)).collect();
                        read.extend(kept);
                    }
                }
                proxy.prefill.set(prefill);
                proxy.decode.set(decode);
                if proxy.transfer_mode == TransferMode::Push {
                    seed_push_peers(&proxy.prefill, keys);
                }
                if !state.up.swap(true, Ordering::AcqRel) {
                    tracing::info!(etcd = %state.url, prefix = %m.prefix, "following the registrations in etcd");
                }
            }
            crate::etcd::Seen::Unreachable(e) => {
                was_down = true;
                state.failures.inc();
                if state.up.swap(false, Ordering::AcqRel) {
                    tracing::warn!(
                        "{e}: keeping the last known set ({} prefillers, {} decoders)",
                        proxy.prefill.instances().len(),
                        proxy.decode.instances().len()
                    );
                }
            }
        }
        true
    })
    .await;
}

/// `--transfer-mode push` with `--etcd` (SPEC §13): a prefiller whose coordinates are not known
/// yet takes them from its registration (engine id, side channel, TP size), so that its first
/// request already sends both legs at once. Its answers correct them ([`Instance::learn`]).
fn seed_push_peers(pool: &Pool, keys: &std::collections::BTreeMap<String, Vec<u8>>) {
    let instances = pool.instances();
    for raw in keys.values() {
        let Ok(r) = crate::etcd::Registration::parse(raw) else { continue };
        let Ok(up) = r.upstream() else { continue };
        let Some(i) = instances.iter().find(|i| i.up == up) else { continue };
        let Some((host, port)) = r.kv_addr.rsplit_once(':') else { continue };
        let (Ok(port), host) = (port.parse::<u16>(), host.trim_start_matches('[').trim_end_matches(']')) else { continue };
        let mut known = i.push.lock().unwrap_or_else(|e| e.into_inner());
        if known.is_none() && port != 0 && !host.is_empty() {
            *known = Some(PushPeer { engine_id: r.engine_id.clone(), host: host.to_owned(), port, tp_size: r.tp_size.max(1) });
        }
    }
}

/// 200 while at least one prefiller and one decoder are healthy; else 503 saying which is missing.
/// With `--etcd`, the body says whether etcd is reachable (unreachable: the last known set is
/// routed to, and that alone does not make the proxy unhealthy).
async fn health(State(p): State<Arc<Proxy>>) -> Response {
    if p.drain.is_draining() {
        return ApiError::unavailable("draining: shutting down").into_response();
    }
    let etcd = p.etcd.as_ref().map(|e| {
        let (np, nd) = (p.prefill.instances().len(), p.decode.instances().len());
        if e.up.load(Ordering::Acquire) {
            json!({"url": e.url, "status": "ok", "prefillers": np, "decoders": nd})
        } else {
            json!({"url": e.url, "status": format!("unreachable: routing to the last known set ({np} prefillers, {nd} decoders)"), "prefillers": np, "decoders": nd})
        }
    });
    match (p.prefill.any_healthy(), p.decode.any_healthy(), etcd) {
        (true, true, None) => StatusCode::OK.into_response(),
        (true, true, Some(etcd)) => Json(json!({"status": "ok", "etcd": etcd})).into_response(),
        (pf, _, etcd) => {
            let mut why = format!("no healthy {}", if pf { "decoder" } else { "prefiller" });
            if let Some(etcd) = etcd {
                let field = |f: &str| etcd[f].as_str().unwrap_or_default().to_owned();
                why.push_str(&format!(" (etcd {}: {})", field("url"), field("status")));
            }
            ApiError::unavailable(why).into_response()
        }
    }
}

/// A healthy decoder's `/v1/models`.
async fn models(State(p): State<Arc<Proxy>>, headers: axum::http::HeaderMap) -> Response {
    let Some(d) = p.decode.pick() else { return ApiError::unavailable("no decoder").into_response() };
    let req = match d.request("/v1/models", None, None, headers.get(header::AUTHORIZATION)) {
        Ok(req) => req,
        Err(e) => return e.into_response(),
    };
    let resp = match exchange(&p.client.get(), req, Some(Duration::from_secs(5))).await {
        Ok(r) => relay_whole(&d.up, r).await,
        Err(why) => Err(ApiError::bad_gateway(format!("upstream {} {why}", d.up))),
    };
    resp.unwrap_or_else(IntoResponse::into_response)
}

/// The proxy's own counters, every upstream's health and the listener's counters.
async fn metrics(State(p): State<Arc<Proxy>>) -> Response {
    ([(header::CONTENT_TYPE, HeaderValue::from_static(metrics::CONTENT_TYPE))], metrics::exposition(&p.registry)).into_response()
}

/// What changes with the set of upstreams and etcd's state, read when scraped: each upstream's
/// health and counts by `role` and `upstream`, and `kvlease_proxy_etcd_up`.
struct UpstreamMetrics(std::sync::Weak<Proxy>);

impl fmt::Debug for UpstreamMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UpstreamMetrics")
    }
}

impl Collector for UpstreamMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let Some(p) = self.0.upgrade() else { return Ok(()) };
        if let Some(e) = &p.etcd {
            let up = ConstGauge::new(i64::from(e.up.load(Ordering::Relaxed)));
            up.encode(encoder.encode_descriptor(
                "kvlease_proxy_etcd_up",
                "1 while the last read of the registrations in etcd succeeded; 0: routing to the last known set.",
                None,
                MetricType::Gauge,
            )?)?;
        }
        let pools = [(&p.prefill, p.prefill.instances()), (&p.decode, p.decode.instances())];
        let each = |encoder: &mut DescriptorEncoder, name: &str, kind: MetricType, help: &str, f: &dyn Fn(&Instance) -> u64| {
            let mut family = encoder.encode_descriptor(name, help, None, kind)?;
            for (pool, instances) in &pools {
                for i in instances.iter() {
                    let upstream = i.up.to_string();
                    let labels = [("role", pool.role), ("upstream", upstream.as_str())];
                    let sample = family.encode_family(&labels)?;
                    match kind {
                        MetricType::Counter => ConstCounter::new(f(i)).encode(sample)?,
                        _ => ConstGauge::new(f(i)).encode(sample)?,
                    }
                }
            }
            Ok::<(), fmt::Error>(())
        };
        each(&mut encoder, "kvlease_proxy_upstream_healthy", MetricType::Gauge, "1 while the upstream is in rotation.", &|i| {
            u64::from(i.healthy.load(Ordering::Relaxed))
        })?;
        each(&mut encoder, "kvlease_proxy_upstream_outstanding", MetricType::Gauge, "Legs in flight on the upstream.", &|i| {
            i.outstanding.load(Ordering::Relaxed) as u64
        })?;
        each(&mut encoder, "kvlease_proxy_upstream_requests", MetricType::Counter, "Legs sent to the upstream.", &|i| {
            i.requests.load(Ordering::Relaxed)
        })?;
        each(
            &mut encoder,
            "kvlease_proxy_upstream_failures",
            MetricType::Counter,
            "Legs that could not reach the upstream, and failed probes.",
            &|i| i.failures.load(Ordering::Relaxed),
        )
    }
}

async fn forward(State(p): State<Arc<Proxy>>, req: Request) -> Response {
    let Some(inflight) = p.drain.admit() else { return crate::drain::Drain::refusal() };
    let (parts, body) = req.into_parts();
    let rid = match request_id(&parts.headers) {
        Ok(rid) => rid,
        Err(e) => return e.into_response(),
    };
    p.requests.inc();
    let deadline = tokio::time::Instant::now() + p.request_timeout;
    let resp = match route(&p, &rid, &parts, body, deadline).await {
        Ok(r) => r,
        Err(e) => {
            if e.status.is_server_error() {
                p.failed.inc();
            }

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

/// One request through [`route::Route`]: the machine picks the legs' engines and decides
/// retries, releases and the turn cache, and what the request's deadline passing means; this
/// sends the legs, reads their answers (each within the deadline) and relays.
async fn route(p: &Arc<Proxy>, rid: &str, parts: &Parts, body: Body, deadline: tokio::time::Instant) -> Result<Response, ApiError> {
    let Some(request) = within(deadline, body::json_object(parts, body)).await else { return Err(timed_out(p)) };
    let mut request = request?;
    // Multi-turn: the conversation this request continues (the legs do not carry it).
    let conversation = match request.remove("conversation_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(c)) if !c.is_empty() => Some(c),
        Some(v) => return Err(ApiError::invalid("conversation_id", format!("`conversation_id` must be a non-empty string, got {v}"))),
    };
    let auth = parts.headers.get(header::AUTHORIZATION);
    let path = parts.uri.path();
    // The engines' own checks, before anything is leased.
    if path.ends_with("/chat/completions") {
        crate::openai::parse_chat(&request)?;
    } else {
        crate::openai::parse_completion(&request)?;
    }
    // A list of prompts has no single KV to hand over: the decoder computes it (same answers).
    let batched =
        request.get("prompt").and_then(Value::as_array).is_some_and(|a| a.len() > 1 && a.iter().all(|p| p.is_string() || p.is_array()));
    let route = route::Route::new(conversation, batched, &mut p.turns.cache(), p.turns.now());
    if route.has_turn() {
        p.turns_used.inc();
    }
    let mut routed = Routed { route, p: Arc::clone(p), rid: rid.to_owned(), p_params: PParams::default() };
    // The decode leg built from P's answer; the answers relayed whole, by leg; D's answer to
    // stream; why the last prefill leg went wrong (for the log).
    let mut d_request: Option<Bytes> = None;
    let mut held_prefill: Option<(Upstream, UpResponse)> = None;
    let mut held_decode: Option<(Upstream, UpResponse)> = None;
    let mut answer: Option<(Outstanding, UpResponse)> = None;
    let mut prefill_trouble = String::new();
    loop {
        let ((prefill, ps), (decode, ds)) = (p.prefill.view(p.transfer_mode), p.decode.view(p.transfer_mode));
        let pools = route::Pools {
            prefill: route::Pool { candidates: &prefill, start: ps },
            decode: route::Pool { candidates: &decode, start: ds },
        };
        let Some(action) = routed.route.poll(pools) else {
            return Err(ApiError::bad_gateway("the proxy lost track of the request (a bug: please report it)"));
        };
        let Some(action) = routed.settle(action) else { continue };
        let event = match action {
            Action::SendPrefill { to, turn, retry } => {
                if retry {
                    p.retries.inc();
                    tracing::info!(request_id = %rid, "{prefill_trouble}; retrying on {}", to.up);
                }
                let leg = prefill_leg(&request, turn.as_ref());
                let _busy = Outstanding::new(to.clone());
                match within(deadline, send(p, &to, path, rid, auth, leg)).await {
                    None => Event::DeadlinePassed,
                    Some(Ok(r)) if r.status().is_success() => match within(deadline, read_p_answer(&to.up, r)).await {
                        None => Event::DeadlinePassed,
                        Some(Ok(params)) => {
                            let lease = params.object().is_some();
                            if p.transfer_mode != TransferMode::Pull {
                                to.learn(&params);
                            }
                            routed.p_params = params;
                            Event::PrefillAnswered(PrefillAnswer::Params { lease })
                        }
                        Some(Err(e)) => Event::PrefillAnswered(PrefillAnswer::Unreadable(e)),
                    },
                    Some(Ok(r)) => {
                        let answer = classify(&r);
                        prefill_trouble = format!("{} turned the prefill leg away (503)", to.up);
                        held_prefill = Some((to.up.clone(), r));
                        Event::PrefillAnswered(PrefillAnswer::Other(answer))
                    }
                    Some(Err(e)) => {
                        prefill_trouble = format!("prefill leg failed before its first byte ({})", e.message);
                        Event::PrefillFailed(e)
                    }
                }
            }
            Action::SendDecode { to, retry } => {
                if retry {
                    p.retries.inc();
                    tracing::info!(request_id = %rid, "decode leg failed before its first byte; retrying on {}", to.up);
                }
                let leg = d_request.get_or_insert_with(|| decode_leg(&request, &routed.p_params)).clone();
                let busy = Outstanding::new(to.clone());
                match within(deadline, send(p, &to, path, rid, auth, leg)).await {
                    None => Event::DeadlinePassed,
                    Some(Ok(r)) => {
                        let answer_was = classify(&r);
                        if answer_was == Answer::Success {
                            answer = Some((busy, r));
                        } else {
                            held_decode = Some((to.up.clone(), r));
                        }
                        Event::DecodeAnswered(answer_was)
                    }
                    Some(Err(e)) => Event::DecodeFailed(e),
                }
            }
            // SPEC §13: from here on both legs are out at once; an event loop carries it on.
            Action::SendBoth { prefill, decode, retry } => {
                let legs = Legs { p, rid, path, auth, deadline };
                return legs.both(std::mem::take(&mut request), routed, (prefill, decode, retry)).await;
            }
            // Only a push dispatch has a decode leg out alongside the prefill leg.
            Action::CancelDecode => continue,
            Action::SendLocal { to } => {
                let whole = LegBody { request: &request, over: &[], omit: &["kv_transfer_params"] }.to_bytes();
                let busy = Outstanding::new(to.clone());
                match within(deadline, send(p, &to, path, rid, auth, whole)).await {
                    None => Event::DeadlinePassed,
                    // Whatever it answers is the answer.
                    Some(Ok(r)) => {
                        answer = Some((busy, r));
                        Event::DecodeAnswered(Answer::Success)
                    }
                    Some(Err(e)) => Event::DecodeFailed(e),
                }
            }
            // Bounded by its own timeout, and carried out even when the deadline has passed: the
            // lease ends now rather than at its expiry.
            Action::Release { on } => {
                release_on_p(p, &on.up, rid, &routed.p_params).await;
                continue;
            }
            // Carried out by `settle`.
            Action::GiveBack { .. } | Action::KeepTurn { .. } => continue,
            Action::RelayStream => {
                let Some((busy, resp)) = answer.take() else {
                    return Err(ApiError::bad_gateway("the proxy lost the decoder's answer (a bug: please report it)"));
                };
                // The answer's head goes to the client now: from here on nothing is retried.
                routed.handle(Event::FirstByteRelayed);
                return Ok(relay_stream(resp, busy, deadline, routed));
            }
            Action::RelayWhole { leg } => {
                let held = match leg {
                    Leg::Prefill => held_prefill.take(),
                    Leg::Decode => held_decode.take(),
                };
                let Some((from, resp)) = held else {
                    return Err(ApiError::bad_gateway("the proxy lost an upstream's answer (a bug: please report it)"));
                };
                return within(deadline, relay_whole(&from, resp)).await.unwrap_or_else(|| Err(timed_out(p)));
            }
            Action::Fail { error, .. } => return Err(route_error(p, error)),
        };
        routed.handle(event);
    }
}

/// What the prefill leg came to.
enum PrefillOutcome {
    /// 2xx, its body read.
    Json(PParams),
    Unreadable(ApiError),
    /// Any other answer, held to be relayed whole.
    Other(Answer, UpResponse),
    Failed(ApiError),
}

/// A leg in flight: its engine, its count on it, and the answer to come.
struct InFlight<T> {
    to: Arc<Instance>,
    busy: Outstanding,
    answer: BoxFuture<'static, T>,
}

/// What sending a request's legs needs.
struct Legs<'a> {
    p: &'a Arc<Proxy>,
    rid: &'a str,
    path: &'a str,
    auth: Option<&'a HeaderValue>,
    deadline: tokio::time::Instant,
}

impl Legs<'_> {
    /// Sends `body` to `to` in the background of the caller's loop: the answer's head (and,
    /// with `json`, its body) when polled.
    fn send(&self, to: Arc<Instance>, body: Bytes) -> BoxFuture<'static, Result<UpResponse, ApiError>> {
        let (p, rid, path, auth) = (Arc::clone(self.p), self.rid.to_owned(), self.path.to_owned(), self.auth.cloned());
        Box::pin(async move { send(&p, &to, &path, &rid, auth.as_ref(), body).await })
    }

    fn prefill(&self, to: Arc<Instance>, body: Bytes) -> InFlight<PrefillOutcome> {
        let sent = self.send(to.clone(), body);
        let up = to.up.clone();
        let answer = Box::pin(async move {
            match sent.await {
                Ok(r) if r.status().is_success() => match read_p_answer(&up, r).await {
                    Ok(v) => PrefillOutcome::Json(v),
                    Err(e) => PrefillOutcome::Unreadable(e),
                },
                Ok(r) => PrefillOutcome::Other(classify(&r), r),
                Err(e) => PrefillOutcome::Failed(e),
            }
        });
        InFlight { busy: Outstanding::new(to.clone()), to, answer }
    }

    /// SPEC §13, O2–O4, U9: a request whose legs went out at once (`first`: the prefiller, the
    /// decoder, whether a retry), to its end: the route's actions carried out, and what happens
    /// to either leg — whichever comes first — reported to it, until an answer is relayed.
    async fn both(
        &self,
        request: Map<String, Value>,
        mut routed: Routed,
        first: (Arc<Instance>, Arc<Instance>, bool),
    ) -> Result<Response, ApiError> {
        let p = self.p;
        let mut next = Some(Action::SendBoth { prefill: first.0, decode: first.1, retry: first.2 });
        let mut prefill: Option<InFlight<PrefillOutcome>> = None;
        let mut decode: Option<InFlight<Result<UpResponse, ApiError>>> = None;
        // The decode leg's body (the same for its retry); whether the prefill leg out is a push
        // dispatch's; the answers held.
        let mut d_request: Option<Bytes> = None;
        let mut pushed = false;
        let mut held_prefill: Option<(Upstream, UpResponse)> = None;
        let mut held_decode: Option<(Upstream, UpResponse)> = None;
        let mut answer: Option<(Outstanding, UpResponse)> = None;
        loop {
            loop {
                let action = match next.take() {
                    Some(a) => a,
                    None => {
                        let ((pf, ps), (dc, ds)) = (p.prefill.view(p.transfer_mode), p.decode.view(p.transfer_mode));
                        let pools = route::Pools {
                            prefill: route::Pool { candidates: &pf, start: ps },
                            decode: route::Pool { candidates: &dc, start: ds },
                        };
                        match routed.route.poll(pools) {
                            Some(a) => a,
                            None => break,
                        }
                    }
                };
                let Some(action) = routed.settle(action) else { continue };
                match action {
                    Action::SendBoth { prefill: to_p, decode: to_d, retry } => {
                        p.pushed.inc();
                        if retry {
                            p.retries.inc();
                            tracing::info!(request_id = %self.rid, "prefill leg failed; both legs again, on {} and {}", to_p.up, to_d.up);
                        }
                        let Some(peer) = to_p.push_peer() else {
                            // Its coordinates were dropped meanwhile (it answered as pull).
                            return Err(ApiError::bad_gateway(format!("prefiller {} is no longer a push engine; try again", to_p.up)));
                        };
                        // SPEC U1: one random key per dispatch, named by both legs.
                        let transfer_id = format!("kvlease-{}", crate::ids::random_uuid_hex());
                        routed.p_params = PParams::of(&peer.decode_params(&transfer_id));
                        let d_leg = decode_leg(&request, &routed.p_params);
                        let p_leg = prefill_leg(&request, Some(&PushPeer::prefill_params(&transfer_id)));
                        prefill = Some(self.prefill(to_p, p_leg));
                        decode = Some(InFlight {
                            busy: Outstanding::new(to_d.clone()),
                            answer: self.send(to_d.clone(), d_leg.clone()),
                            to: to_d,
                        });
                        d_request = Some(d_leg);
                        pushed = true;
                        answer = None;
                    }
                    Action::SendPrefill { to, turn, retry } => {
                        if retry {
                            p.retries.inc();
                        }
                        prefill = Some(self.prefill(to, prefill_leg(&request, turn.as_ref())));
                        d_request = None;
                        pushed = false;
                    }
                    Action::SendDecode { to, retry } => {
                        if retry {
                            p.retries.inc();
                            tracing::info!(request_id = %self.rid, "decode leg failed before its first byte; retrying on {}", to.up);
                        }
                        let leg = d_request.get_or_insert_with(|| decode_leg(&request, &routed.p_params)).clone();
                        decode = Some(InFlight { busy: Outstanding::new(to.clone()), answer: self.send(to.clone(), leg), to });
                    }
                    // SPEC U9: the decode leg's request (and its answer, if held) dropped: D sees
                    // its connection close and releases what it renewed.
                    Action::CancelDecode => {
                        decode = None;
                        answer = None;
                    }
                    Action::Release { on } => release_on_p(p, &on.up, self.rid, &routed.p_params).await,
                    Action::RelayStream => {
                        let Some((busy, resp)) = answer.take() else {
                            return Err(ApiError::bad_gateway("the proxy lost the decoder's answer (a bug: please report it)"));
                        };
                        routed.handle(Event::FirstByteRelayed);
                        return Ok(relay_stream(resp, busy, self.deadline, routed));
                    }
                    Action::RelayWhole { leg } => {
                        let held = match leg {
                            Leg::Prefill => held_prefill.take(),
                            Leg::Decode => held_decode.take(),
                        };
                        let Some((from, resp)) = held else {
                            return Err(ApiError::bad_gateway("the proxy lost an upstream's answer (a bug: please report it)"));
                        };
                        return within(self.deadline, relay_whole(&from, resp)).await.unwrap_or_else(|| Err(timed_out(p)));
                    }
                    Action::Fail { error, .. } => return Err(route_error(p, error)),
                    Action::SendLocal { .. } | Action::GiveBack { .. } | Action::KeepTurn { .. } => {
                        return Err(ApiError::bad_gateway("the route asked for a batch's leg in push mode (a bug: please report it)"));
                    }
                }
            }
            if prefill.is_none() && decode.is_none() {
                return Err(ApiError::bad_gateway("the proxy lost track of the request (a bug: please report it)"));
            }
            // Whichever leg answers first (or the deadline). Polled prefill first: the legs go
            // out as they are first polled, and the prefill leg is the one the first token waits
            // on (random order sent D's leg first half the time).
            let event = tokio::select! {
                biased;
                outcome = async { prefill.as_mut().expect("guarded").answer.as_mut().await }, if prefill.is_some() => {
                    let Some(InFlight { to, .. }) = prefill.take() else { unreachable!() };
                    match outcome {
                        PrefillOutcome::Json(params) => {
                            let lease = params.object().is_some();
                            if p.transfer_mode != TransferMode::Pull {
                                to.learn(&params);
                            }
                            if !pushed {
                                routed.p_params = params;
                                Event::PrefillAnswered(PrefillAnswer::Params { lease })
                            } else if lease && params.push_peer().is_none() {
                                // It answered a push dispatch as a pull engine: its lease is
                                // released with its own params, and D's leg dropped (the route).
                                release_on_p(p, &to.up, self.rid, &params).await;
                                Event::PrefillAnswered(PrefillAnswer::Unreadable(ApiError::bad_gateway(format!(
                                    "prefiller {} answered a push dispatch as a pull engine; try again",
                                    to.up
                                ))))
                            } else {
                                Event::PrefillAnswered(PrefillAnswer::Params { lease: true })
                            }
                        }
                        PrefillOutcome::Unreadable(e) => Event::PrefillAnswered(PrefillAnswer::Unreadable(e)),
                        PrefillOutcome::Other(a, r) => {
                            held_prefill = Some((to.up.clone(), r));
                            Event::PrefillAnswered(PrefillAnswer::Other(a))
                        }
                        PrefillOutcome::Failed(e) => Event::PrefillFailed(e),
                    }
                }
                sent = async { decode.as_mut().expect("guarded").answer.as_mut().await }, if decode.is_some() => {
                    let Some(InFlight { to, busy, .. }) = decode.take() else { unreachable!() };
                    match sent {
                        Ok(r) => {
                            let was = classify(&r);
                            if was == Answer::Success {
                                answer = Some((busy, r));
                            } else {
                                held_decode = Some((to.up.clone(), r));
                            }
                            Event::DecodeAnswered(was)
                        }
                        Err(e) => Event::DecodeFailed(e),
                    }
                }
                _ = tokio::time::sleep_until(self.deadline) => Event::DeadlinePassed,
            };
            routed.handle(event);
        }
    }
}

/// The proxy's route machine: engines by their [`Instance`], leg failures as the client's error.
type Route = route::Route<Arc<Instance>, ApiError>;

/// `leg` (a wait on an upstream or the client) unless the request's deadline passes first.
async fn within<T>(deadline: tokio::time::Instant, leg: impl Future<Output = T>) -> Option<T> {
    tokio::time::timeout_at(deadline, leg).await.ok()
}

/// The answer to a request whose deadline passed before its answer began (counted).
fn timed_out(p: &Proxy) -> ApiError {
    p.timeouts.inc();
    ApiError::gateway_timeout(format!("no answer within the proxy's --request-timeout ({} s)", p.request_timeout.as_secs_f64()))
}

/// The client's error for a route that failed.
fn route_error(p: &Proxy, error: RouteError<ApiError>) -> ApiError {
    match error {
        RouteError::NoPrefiller => ApiError::unavailable("no prefiller"),
        RouteError::NoDecoder => ApiError::unavailable("no decoder"),
        RouteError::TimedOut => timed_out(p),
        RouteError::Leg(e) => e,
    }
}

/// One request's route machine and what carrying out its actions needs, from the request's
/// arrival to the end of its answer (it goes into the relayed body). Dropped before the route is
/// done — the client went away and hyper dropped the request, or its answer's body — it tells the
/// machine (`ClientGone`) and carries out what the machine asks.
struct Routed {
    route: Route,
    p: Arc<Proxy>,
    rid: String,
    /// P's params, which a release names.
    p_params: PParams,
}

impl Routed {
    /// Feeds the machine an event; one it does not expect is a bug of this driver, logged.
    fn handle(&mut self, event: Event<ApiError>) {
        if let Err(e) = self.route.handle(event) {
            tracing::warn!(request_id = %self.rid, "{e} (a bug: please report it)");
        }
    }

    /// Carries out an action on the turn cache; any other is handed back.
    fn settle(&self, action: Action<Arc<Instance>, ApiError>) -> Option<Action<Arc<Instance>, ApiError>> {
        match action {
            Action::GiveBack { conversation, turn } => self.p.turns.cache().give_back(conversation, turn),
            Action::KeepTurn { conversation, params } => {
                self.p.turns.cache().keep(conversation, params, self.p.turns.now());
            }
            other => return Some(other),
        }
        None
    }
}

impl Drop for Routed {
    fn drop(&mut self) {
        if self.route.is_done() {
            return;
        }
        self.handle(Event::ClientGone);
        while let Some(action) = self.route.poll(route::Pools::EMPTY) {
            match self.settle(action) {
                None => {}
                // The request is gone; the release outlives it, bounded by its own timeout.
                Some(Action::Release { on }) => {
                    let (p, rid, p_params) = (Arc::clone(&self.p), self.rid.clone(), std::mem::take(&mut self.p_params));
                    if let Ok(rt) = tokio::runtime::Handle::try_current() {
                        rt.spawn(async move { release_on_p(&p, &on.up, &rid, &p_params).await });
                    }
                }
                Some(_) => {
                    tracing::warn!(request_id = %self.rid, "the route asked for a leg after its client left (a bug: please report it)")
                }
            }
        }
    }
}

/// What an upstream's answer head says, for the route machine.
fn classify(resp: &UpResponse) -> Answer {
    if resp.status().is_success() {
        Answer::Success
    } else if turned_away_unread(resp) {
        Answer::TurnedAwayUnread
    } else {
        Answer::Refused
    }
}

/// A 503 with `Retry-After`: the server turned the request away without reading it (draining,
/// SPEC O1, or at its connection cap).
fn turned_away_unread(resp: &UpResponse) -> bool {
    resp.status() == StatusCode::SERVICE_UNAVAILABLE && resp.headers().contains_key(header::RETRY_AFTER)
}

/// Ends P's lease at once through P's `POST /kvlease/release` (no lease held to expiry because
/// the decode leg failed): named by P's params, or in push mode by the dispatch's decode-leg
/// params (P's coordinates and the transfer's key, SPEC U1). A failure here is logged: the
/// lease then ends at its expiry.
async fn release_on_p(p: &Proxy, prefiller: &Upstream, rid: &str, p_params: &PParams) {
    let Some(params) = p_params.object() else { return };
    let body = Bytes::from(format!("{{\"kv_transfer_params\":{}}}", params.get()));
    let sent = match prefiller.request(None, "/kvlease/release", Some(body), Some(rid), None) {
        Ok(req) => exchange(&p.client.get(), req, Some(Duration::from_secs(2))).await,
        Err(e) => Err(e.message),
    };
    match sent {
        Ok(r) if r.status().is_success() => {
            p.released.inc();
            tracing::info!(request_id = %rid, "no decoder takes it: released the lease on {prefiller}")
        }
        Ok(r) => tracing::warn!(request_id = %rid, status = %r.status(), "no decoder takes it, and {prefiller} did not release the lease"),
        Err(why) => {
            tracing::warn!(request_id = %rid, "no decoder takes it, and the lease on {prefiller} could not be released: {prefiller} {why}")
        }
    }
}

/// What the proxy reads of P's answer: its `kv_transfer_params`. The rest (the token, usage) is
/// checked to be JSON and skipped, not built into a tree (issue 27).
#[derive(serde::Deserialize)]
struct PAnswer {
    #[serde(default)]
    kv_transfer_params: Option<Box<RawValue>>,
}

/// P's `kv_transfer_params` as P wrote them: relayed to D as they are rather than parsed into a
/// tree and written out again (issue 27); parsed only where the proxy needs what they say.
#[derive(Debug, Default)]
struct PParams(Option<Box<RawValue>>);

impl PParams {
    fn of(params: &Value) -> PParams {
        PParams(RawValue::from_string(params.to_string()).ok())
    }

    /// The params if they are a JSON object (P leased the KV).
    fn object(&self) -> Option<&RawValue> {
        self.0.as_deref().filter(|r| r.get().starts_with('{'))
    }

    /// The params if they are an object with fields (a decoder can use them).
    fn fields(&self) -> Option<&RawValue> {
        self.object().filter(|r| r.get().len() > 2 && !r.get()[1..r.get().len() - 1].trim().is_empty())
    }

    /// SPEC §13: a push prefiller's coordinates, if these are a push engine's.
    fn push_peer(&self) -> Option<PushPeer> {
        /// Only the mode, read without building the rest.
        #[derive(serde::Deserialize)]
        struct Mode<'a> {
            #[serde(borrow, default)]
            transfer_mode: Option<std::borrow::Cow<'a, str>>,
        }
        let raw = self.object()?;
        // A pull engine's params do not name the field at all: no need to read them for it.
        if !raw.get().contains("\"transfer_mode\"") {
            return None;
        }
        let mode = serde_json::from_str::<Mode>(raw.get()).ok()?;
        if mode.transfer_mode.as_deref() != Some("push") {
            return None;
        }
        serde_json::from_str::<Value>(raw.get()).ok().as_ref().and_then(PushPeer::from_answer)
    }
}

/// A field a leg writes over the client's: a value, or P's params as P wrote them.
#[derive(Clone, Copy)]
enum Field<'a> {
    Json(&'a Value),
    Raw(&'a RawValue),
}

impl serde::Serialize for Field<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Field::Json(v) => v.serialize(s),
            Field::Raw(r) => r.serialize(s),
        }
    }
}

/// A leg's body: the client's request with `over` written over it and `omit` left out,
/// serialized from the request as it is rather than from a copy of it (issue 27).
struct LegBody<'a> {
    request: &'a Map<String, Value>,
    over: &'a [(&'a str, Field<'a>)],
    omit: &'a [&'a str],
}

impl serde::Serialize for LegBody<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        for (k, v) in self.request {
            if !self.omit.contains(&k.as_str()) && !self.over.iter().any(|(o, _)| o == k) {
                map.serialize_entry(k, v)?;
            }
        }
        for (k, v) in self.over {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl LegBody<'_> {
    fn to_bytes(&self) -> Bytes {
        let mut out = Vec::with_capacity(1024);
        // JSON values with string keys always serialize; an empty body would be refused by the
        // engine as invalid JSON, never taken for a request.
        match serde_json::to_writer(&mut out, self) {
            Ok(()) => Bytes::from(out),
            Err(_) => Bytes::new(),
        }
    }
}

/// The P leg's `kv_transfer_params` when the route gives none: keep the KV for a remote decoder.
/// Written out once (the unit tests read them back).
static PREFILL_PARAMS: std::sync::LazyLock<Box<RawValue>> = std::sync::LazyLock::new(|| {
    let text = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;
    RawValue::from_string(text.to_owned()).expect("a constant that is JSON")
});

/// The P leg: one choice, not streamed, asking P to keep the KV for a remote decoder (or with
/// `params`: the route's turn, a push dispatch's key).
fn prefill_leg(request: &Map<String, Value>, params: Option<&Value>) -> Bytes {
    let (one, no) = (Value::from(1), Value::Bool(false));
    // P prefills and answers one token, as vLLM's toy proxy asks: a vLLM P generates up to
    // max_tokens before handing its blocks over, and then names the blocks of the prompt *and*
    // its answer, which a vLLM D reads as the prompt's (a wrong answer with HTTP 200). A request
    // D would refuse for its length is refused there, and P's lease released (O3).
    let over = [
        ("kv_transfer_params", params.map_or(Field::Raw(&PREFILL_PARAMS), Field::Json)),
        ("stream", Field::Json(&no)),
        ("n", Field::Json(&one)),
        ("max_tokens", Field::Json(&one)),
        ("max_completion_tokens", Field::Json(&one)),
    ];
    let over = if request.contains_key("max_completion_tokens") { &over[..] } else { &over[..4] };
    LegBody { request, over, omit: &["min_tokens", "best_of", "stream_options"] }.to_bytes()
}

/// The D leg: the client's request with P's `kv_transfer_params` (none if P gave none: D then
/// runs the request itself).
fn decode_leg(request: &Map<String, Value>, p_params: &PParams) -> Bytes {
    match p_params.fields() {
        Some(params) => LegBody { request, over: &[("kv_transfer_params", Field::Raw(params))], omit: &[] }.to_bytes(),
        None => LegBody { request, over: &[], omit: &["kv_transfer_params"] }.to_bytes(),
    }
}

async fn send(p: &Proxy, to: &Instance, path: &str, rid: &str, auth: Option<&HeaderValue>, body: Bytes) -> Result<UpResponse, ApiError> {
    let req = to.request(path, Some(body), Some(rid), auth)?;
    exchange(&p.client.get(), req, None).await.map_err(|why| {
        mark_down(to, &why);
        ApiError::bad_gateway(format!("upstream {} {why}", to.up))
    })
}

/// The upstream's status, content type and whole body (P's errors).
async fn relay_whole(from: &Upstream, resp: UpResponse) -> Result<Response, ApiError> {
    let status = resp.status();
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let bytes = read_whole(from, resp).await?;
    let mut out = (status, bytes).into_response();
    if let Some(ct) = content_type {
        out.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    Ok(out)
}

/// The upstream's status, content type and body, streamed chunk by chunk. The body owns the
/// upstream response and the route: dropping it (client gone) closes the upstream connection,
/// and the route hears so. How the answer ends — its end (with the turn D keeps, read as it
/// passes), the upstream breaking off, the request's deadline — goes to the route; when it says
/// fail (after the first byte), an SSE stream ends with an error event and `[DONE]`, so the
/// client sees a clean failure rather than a cut.
fn relay_stream(resp: UpResponse, busy: Outstanding, deadline: tokio::time::Instant, routed: Routed) -> Response {
    let status = resp.status();
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let sse = content_type.as_ref().and_then(|c| c.to_str().ok()).is_some_and(|c| c.starts_with("text/event-stream"));
    // What the answer says, read (within a bound) while it passes, when the route keeps turns.
    let reader = routed.route.keeps_turn().then(|| TurnReader::new(sse));
    let deadline = Box::pin(tokio::time::sleep_until(deadline));
    let relay = Relay { up: Some(resp.into_body()), busy, routed, reader, deadline, sse };
    let mut out = (status, Body::new(relay)).into_response();
    if let Some(ct) = content_type {
        out.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    out
}

/// A relayed answer's body: the upstream's bytes as they come, the leg's count on its engine,
/// the route, the reader of D's cached turn and the request's deadline.
struct Relay {
    up: Option<hyper::body::Incoming>,
    busy: Outstanding,
    routed: Routed,
    reader: Option<TurnReader>,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    sse: bool,
}

impl http_body::Body for Relay {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        use std::task::Poll;
        let st = &mut *self;
        let Some(up) = st.up.as_mut() else { return Poll::Ready(None) };
        let event = loop {
            match std::pin::Pin::new(&mut *up).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(b) => {
                        if let Some(reader) = &mut st.reader {
                            reader.feed(&b);
                        }
                        return Poll::Ready(Some(Ok(http_body::Frame::data(b))));
                    }
                    // Trailers: none are relayed.
                    Err(_) => continue,
                },
                Poll::Ready(None) => break Event::DecodeDone { turn: st.reader.take().and_then(TurnReader::finish) },
                Poll::Ready(Some(Err(e))) => {
                    let from = &st.busy.0.up;
                    break Event::DecodeFailed(ApiError::bad_gateway(format!("upstream {from} broke off its answer: {}", cause(&e))));
                }
                Poll::Pending if st.deadline.as_mut().poll(cx).is_ready() => break Event::DeadlinePassed,
                Poll::Pending => return Poll::Pending,
            }
        };
        st.up = None;
        st.routed.handle(event);
        let mut failed = None;
        while let Some(action) = st.routed.route.poll(route::Pools::EMPTY) {
            match st.routed.settle(action) {
                None => {}
                Some(Action::Fail { error, .. }) => failed = Some(error),
                Some(_) => {
                    tracing::warn!(request_id = %st.routed.rid, "the route asked for a leg after the first byte (a bug: please report it)")
                }
            }
        }
        let Some(failed) = failed else { return Poll::Ready(None) };
        let from = &st.busy.0.up;
        let e = match failed {
            RouteError::Leg(e) => e,
            RouteError::TimedOut => {
                ApiError::bad_gateway(format!("upstream {from} broke off its answer: the proxy's --request-timeout passed"))
            }
            other => route_error(&st.routed.p, other),
        };
        tracing::warn!(upstream = %from, "answer broken off after its first byte: {}", e.message);
        Poll::Ready(Some(if st.sse {
            Ok(http_body::Frame::data(crate::sse::framed([crate::sse::json(&e.body()), crate::sse::done()])))
        } else {
            Err(std::io::Error::other(e.message))
        }))
    }

    // No `size_hint` from the upstream's `Content-Length`: hyper would stop polling once that
    // many bytes went out, and the answer's end (D's cached turn with it) would go unseen — the
    // multi-turn tests failed so.
    fn is_end_stream(&self) -> bool {
        self.up.is_none()
    }
}

/// Bytes of a whole answer kept to search for its cached turn, and of one event of a stream: an
/// answer (or event) longer than this is relayed but not searched.
const MAX_CAPTURED: usize = 4 << 20;

/// Reads D's answer as it passes for the `kv_transfer_params` it names (its cached turn, SPEC
/// B1): a whole JSON answer is kept (up to [`MAX_CAPTURED`]) and read at its end; a stream is
/// parsed event by event ([`sse_parse`]: any chunking, `data:` with or without its space,
/// each event bounded), and the last event that names params wins (D names them in its last
/// chunk). Only an event that mentions `kv_transfer_params` is parsed as JSON.
enum TurnReader {
    Whole(Option<Vec<u8>>),
    Stream { parser: Box<sse_parse::SseParser>, params: Option<Value> },
}

impl TurnReader {
    fn new(sse: bool) -> TurnReader {
        if sse {
            TurnReader::Stream { parser: Box::new(sse_parse::SseParser::new().max_buffer(MAX_CAPTURED)), params: None }
        } else {
            TurnReader::Whole(Some(Vec::new()))
        }
    }

    /// The next piece of the answer.
    fn feed(&mut self, piece: &[u8]) {
        match self {
            TurnReader::Whole(kept) => {
                if kept.as_ref().is_some_and(|k| k.len() + piece.len() > MAX_CAPTURED) {
                    *kept = None;
                }
                if let Some(k) = kept {
                    k.extend_from_slice(piece);
                }
            }
            TurnReader::Stream { parser, params } => {
                parser.feed(piece);
                Self::drain(parser, params);
            }
        }
    }

    /// The answer ended: the params it named, if any.
    fn finish(self) -> Option<Value> {
        match self {
            TurnReader::Whole(kept) => kept.and_then(|k| serde_json::from_slice::<Value>(&k).ok()).and_then(turn_of),
            TurnReader::Stream { mut parser, mut params } => {
                parser.finish();
                Self::drain(&mut parser, &mut params);
                params
            }
        }
    }

    fn drain(parser: &mut sse_parse::SseParser, params: &mut Option<Value>) {
        while let Some(event) = parser.next_event() {
            if event.data.contains("kv_transfer_params") {
                if let Some(p) = serde_json::from_str::<Value>(&event.data).ok().and_then(turn_of) {
                    *params = Some(p);
                }
            }
        }
    }
}

/// The `kv_transfer_params` object of an answer or chunk.
fn turn_of(v: Value) -> Option<Value> {
    v.get("kv_transfer_params").filter(|p| p.is_object()).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a [`TurnReader`] finds in `pieces` of an answer.
    fn read(sse: bool, pieces: &[&[u8]]) -> Option<Value> {
        let mut r = TurnReader::new(sse);
        for p in pieces {
            r.feed(p);
        }
        r.finish()
    }

    /// SPEC B1: the proxy finds D's cached turn in a whole answer or in the last SSE chunk that
    /// names it, however the stream is cut into pieces.
    #[test]
    fn b1_the_cached_turn_is_found_in_either_answer_shape() {
        let params = json!({"do_remote_decode": true, "remote_lease_id": 4});
        let whole = serde_json::to_vec(&json!({"choices": [], "kv_transfer_params": params})).unwrap();
        assert_eq!(read(false, &[&whole[..9], &whole[9..]]), Some(params.clone()));
        let stream = format!(
            "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
            json!({"choices": [{"text": "a"}]}),
            json!({"choices": [{"text": "", "finish_reason": "stop"}], "kv_transfer_params": params})
        );
        let b = stream.as_bytes();
        for cut in [1, 7, b.len() / 2, b.len() - 3] {
            assert_eq!(read(true, &[&b[..cut], &b[cut..]]), Some(params.clone()), "cut at {cut}");
        }
        assert_eq!(read(true, &[b"data:{\"kv_transfer_params\": {\"a\": 1}}\n\n"]), Some(json!({"a": 1})), "no space");
        assert_eq!(read(true, &[b"data: {\"kv_transfer_params\": null}\n\n"]), None);
        assert_eq!(read(true, &[b"data: {\"kv_transfer_params\": {\"a\": 1}}\n"]), None, "an event never ended");
    }

    /// SPEC B1: a stream of any length still has its cached turn found (in its last chunk), past
    /// an event over the bound; a whole answer over the bound is not searched.
    #[test]
    fn b1_a_long_stream_still_names_its_cached_turn() {
        let params = json!({"do_remote_decode": true, "remote_lease_id": 9});
        let token = format!("data: {}\n\n", json!({"choices": [{"text": " lease"}]})).repeat(1000);
        let huge = format!("data: {}\n\n", json!({"kv_transfer_params": {"x": " ".repeat(MAX_CAPTURED)}}));
        let last = format!("data: {}\n\ndata: [DONE]\n\n", json!({"choices": [], "kv_transfer_params": params}));
        let mut pieces: Vec<&[u8]> = vec![token.as_bytes(); 2 * MAX_CAPTURED / token.len() + 1];
        pieces.push(huge.as_bytes());
        pieces.push(last.as_bytes());
        assert_eq!(read(true, &pieces), Some(params));
        let over = vec![b' '; MAX_CAPTURED];
        assert_eq!(read(false, &[&over, b"{}"]), None, "a whole answer over the bound is not kept");
    }

    /// The P leg as vLLM's toy proxy sends it: one choice, not streamed, one token
    /// (`max_tokens` and `max_completion_tokens` 1, no `min_tokens`), `do_remote_decode`. A vLLM P
    /// given the client's max_tokens decodes them all and names the blocks of its answer too,
    /// which a vLLM D reads as the prompt's: a wrong answer with HTTP 200 (issue 25).
    #[test]
    fn prefill_leg_is_one_unstreamed_token_with_remote_decode_as_vllms_toy_proxy_sends_it() {
        let Value::Object(req) =
            json!({"prompt": "x", "max_tokens": 50, "min_tokens": 5, "stream": true, "stream_options": {"include_usage": true}})
        else {
            unreachable!()
        };
        let leg = parsed(prefill_leg(&req, None));
        assert_eq!(leg["max_tokens"], 1);
        assert_eq!((leg["stream"].clone(), leg["n"].clone()), (json!(false), json!(1)));
        assert!(!leg.contains_key("stream_options") && !leg.contains_key("max_completion_tokens") && !leg.contains_key("min_tokens"));
        assert_eq!(leg["kv_transfer_params"]["do_remote_decode"], true);
        assert_eq!(leg["kv_transfer_params"]["remote_engine_id"], Value::Null);
        let Value::Object(chat) = json!({"messages": [], "max_completion_tokens": 9}) else { unreachable!() };
        assert_eq!(parsed(prefill_leg(&chat, None))["max_completion_tokens"], 1);
        let turn = json!({"remote_lease_id": 4});
        assert_eq!(parsed(prefill_leg(&chat, Some(&turn)))["kv_transfer_params"], turn);
    }

    fn parsed(leg: Bytes) -> Map<String, Value> {
        serde_json::from_slice(&leg).expect("a leg is a JSON object")
    }

    /// SPEC S1 through the proxy: D gets P's params or none, never what the client sent.
    #[test]
    fn decode_leg_carries_p_params_never_the_clients() {
        let Value::Object(req) = json!({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [7]}}) else {
            unreachable!()
        };
        let answer = |a: &str| PParams(serde_json::from_str::<PAnswer>(a).expect("an answer").kv_transfer_params);
        let p = answer(r#"{"kv_transfer_params": {"remote_lease_id": 3}}"#);
        assert_eq!(parsed(decode_leg(&req, &p))["kv_transfer_params"], json!({"remote_lease_id": 3}));
        for a in [r#"{}"#, r#"{"kv_transfer_params": null}"#, r#"{"kv_transfer_params": {}}"#, r#"{"kv_transfer_params": { }}"#] {
            let p = answer(a);
            let leg = parsed(decode_leg(&req, &p));
            assert!(!leg.contains_key("kv_transfer_params"), "{a}: {leg:?}");
            assert_eq!(leg["prompt"], "x");
        }
    }

    #[test]
    fn hosts_pair_with_ports() {
        let h = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let two = ProxyConfig::pair("prefiller", &h(&["a", "b"]), &[1, 2]).unwrap();
        assert_eq!(two[1], Upstream::http("b", 2));
        let one_host = ProxyConfig::pair("decoder", &h(&["a"]), &[1, 2]).unwrap();
        assert_eq!(one_host[1].host, "a");
        assert!(ProxyConfig::pair("decoder", &h(&["a", "b"]), &[1, 2, 3]).unwrap_err().0.contains("--decoder-hosts"));
        assert_eq!(Upstream::http("::1", 8).url("/x"), "http://[::1]:8/x");
        // SPEC S6: https://host is an HTTPS upstream, on the port given beside it.
        let tls = ProxyConfig::pair("prefiller", &h(&["https://a", "http://b/", "https://[::1]"]), &[1, 2, 3]).unwrap();
        assert_eq!(tls[..2], [Upstream { host: "a".into(), port: 1, https: true }, Upstream::http("b", 2)]);
        assert_eq!(tls[2].url("/x"), "https://[::1]:3/x");
        assert_eq!(tls[0].url("/health"), "https://a:1/health");
        for bad in ["https://", "https://a:1/x", "ftp://a", "https://a:1"] {
            let e = ProxyConfig::pair("prefiller", &h(&[bad]), &[1]).unwrap_err();
            assert!(e.0.starts_with("--prefiller-hosts"), "{bad}: {e}");
        }
    }
}
