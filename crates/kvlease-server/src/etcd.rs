//! Cluster membership through etcd (issue 12 part 3): `kvlease serve --etcd` registers the
//! engine under an etcd lease and keeps it alive ([`Registrar`]); `kvlease proxy --etcd` follows
//! the registrations under the prefix ([`follow`]: a read, then a watch) and routes to them.
//!
//! The client speaks etcd v3's JSON gateway (`POST /v3/...`, keys and values in base64, 64-bit
//! numbers as strings, a watch as one JSON message per line) over the reqwest client the proxy
//! already has, rather than the gRPC API: the `etcd-client` crate brings tonic and prost and
//! compiles etcd's protos at build time (so needs `protoc`), for six calls. Everything etcd answers is outside input: nothing from
//! it is unwrapped, and a registration that does not parse is skipped with a warning naming its
//! key.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};
use std::fmt;
use std::time::Duration;

/// Where registrations live unless `--etcd-prefix` says otherwise.
pub const DEFAULT_PREFIX: &str = "/kvlease/";

/// How long one etcd call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// An etcd call that failed: unreachable, an error answer, or an answer that does not parse.
#[derive(Debug, Clone)]
pub struct EtcdError(pub String);

impl fmt::Display for EtcdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for EtcdError {}

/// Why a registration read back from etcd is skipped: the proxy logs it with the key.
#[derive(Debug, thiserror::Error)]
pub enum RegistrationError {
    #[error("not JSON: {0}")]
    NotJson(#[from] serde_json::Error),
    #[error("no string `{0}`")]
    NoString(&'static str),
    #[error("role {0:?} is none of prefill, decode, both")]
    Role(String),
    #[error("no positive `tp_size`")]
    TpSize,
    #[error(transparent)]
    Url(#[from] UrlError),
}

/// Why an engine's registered URL is not one the proxy can send legs to.
#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    #[error("url {url:?}: {why}")]
    Unparsable { url: String, why: <reqwest::Url as std::str::FromStr>::Err },
    #[error("url {0:?} is not http:// or https://")]
    Scheme(String),
    #[error("url {0:?} has no host")]
    NoHost(String),
    #[error("url {0:?} has no port")]
    NoPort(String),
}

/// A client for an etcd cluster's JSON gateway, through one member at a time: the one that last
/// answered, the next one when it cannot be reached.
#[derive(Clone, Debug)]
pub struct Etcd {
    client: reqwest::Client,
    members: Vec<String>,
    /// Index in `members` of the one to try first.
    current: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    list: String,
}

impl Etcd {
    /// `urls`: the members' client URLs (`--advertise-client-urls`), comma-separated, e.g.
    /// `http://10.0.0.1:2379,http://10.0.0.2:2379`.
    pub fn new(urls: &str) -> Result<Etcd, EtcdError> {
        let mut members = Vec::new();
        for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            let parsed = reqwest::Url::parse(url).map_err(|e| EtcdError(format!("--etcd {url:?} is not a URL: {e}")))?;
            if parsed.scheme() != "http" || parsed.host_str().is_none() {
                return Err(EtcdError(format!("--etcd {url:?} must be an http:// URL with a host (TLS to etcd is not supported)")));
            }
            members.push(url.trim_end_matches('/').to_string());
        }
        if members.is_empty() {
            return Err(EtcdError(format!("--etcd {urls:?} names no URL")));
        }
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(CALL_TIMEOUT)
            .build()
            .map_err(|e| EtcdError(format!("cannot build the HTTP client: {e}")))?;
        Ok(Etcd { client, list: members.join(","), members, current: Default::default() })
    }

    /// The members, comma-separated.
    pub fn url(&self) -> &str {
        &self.list
    }

    /// One gateway call: the answer's JSON, or the error it names.
    async fn call(&self, path: &str, body: Value) -> Result<Value, EtcdError> {
        let r = self.send(path, &body, Some(CALL_TIMEOUT)).await?;
        let status = r.status();
        let v: Value = r.json().await.map_err(|e| EtcdError(format!("etcd {path} answered {status} with no JSON: {e}")))?;
        match v.get("error").or_else(|| v.get("message")) {
            Some(e) => Err(EtcdError(format!("etcd {path}: {}", e.as_str().map_or_else(|| e.to_string(), str::to_owned)))),
            None if !status.is_success() => Err(EtcdError(format!("etcd {path} answered {status}"))),
            None => Ok(v),
        }
    }

    /// POSTs `body` to a member, as long as `timeout` (the whole answer) if given. A member that
    /// cannot be reached, or answers 5xx (e.g. it has no leader), is skipped for the next; the one
    /// that answers is tried first from then on.
    async fn send(&self, path: &str, body: &Value, timeout: Option<Duration>) -> Result<reqwest::Response, EtcdError> {
        use std::sync::atomic::Ordering;
        let first = self.current.load(Ordering::Relaxed);
        let mut unreachable = Vec::new();
        let mut answer = None;
        for k in 0..self.members.len() {
            let i = (first + k) % self.members.len();
            let member = &self.members[i];
            let mut req = self.client.post(format!("{member}{path}")).json(body);
            if let Some(t) = timeout {
                req = req.timeout(t);
            }
            // A member that accepts but does not answer (hung, or partitioned after the
            // connect) is given up on after CALL_TIMEOUT for the answer's head, so the next is
            // tried; a watch's body streams on after that, with no timeout.
            let sent = match tokio::time::timeout(CALL_TIMEOUT, req.send()).await {
                Ok(sent) => sent,
                Err(_) => {
                    unreachable.push(format!("{member}: no answer within {CALL_TIMEOUT:?}"));
                    continue;
                }
            };
            match sent {
                Ok(r) if r.status().is_server_error() && k + 1 < self.members.len() => {
                    unreachable.push(format!("{member}: answered {}", r.status()));
                }
                Ok(r) => {
                    self.current.store(i, Ordering::Relaxed);
                    answer = Some(r);
                    break;
                }
                Err(e) => unreachable.push(format!("{member}: {}", crate::error::cause(&e))),
            }
        }
        answer.ok_or_else(|| EtcdError(format!("etcd unreachable ({})", unreachable.join("; "))))
    }

    /// A new lease of `ttl` (whole seconds, at least 1): its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, EtcdError> {
        let v = self.call("/v3/lease/grant", json!({"TTL": ttl.as_secs().max(1)})).await?;
        int(&v["ID"]).filter(|id| *id != 0).ok_or_else(|| EtcdError(format!("etcd granted no lease id: {v}")))
    }

    /// Renews the lease once: `true` while it lives, `false` if etcd no longer knows it (it
    /// expired, or etcd lost its data).
    pub async fn keep_alive(&self, id: i64) -> Result<bool, EtcdError> {
        let v = self.call("/v3/lease/keepalive", json!({"ID": id.to_string()})).await?;
        Ok(int(&v["result"]["TTL"]).is_some_and(|ttl| ttl > 0))
    }

    /// Ends the lease now, and with it every key put under it.
    pub async fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        self.call("/v3/lease/revoke", json!({"ID": id.to_string()})).await.map(drop)
    }

    pub async fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<(), EtcdError> {
        let body = json!({"key": B64.encode(key), "value": B64.encode(value), "lease": lease.to_string()});
        self.call("/v3/kv/put", body).await.map(drop)
    }

    /// Every key under `prefix`, with its value, and the revision they were read at; a key or
    /// value that is not base64 is skipped with a warning.
    pub async fn range_prefix(&self, prefix: &str) -> Result<(Vec<(String, Vec<u8>)>, i64), EtcdError> {
        let v = self.call("/v3/kv/range", json!({"key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix))})).await?;
        let revision = int(&v["header"]["revision"]).ok_or_else(|| EtcdError(format!("etcd range answered no revision: {v}")))?;
        let kvs = match v.get("kvs") {
            None | Some(Value::Null) => return Ok((Vec::new(), revision)),
            Some(Value::Array(kvs)) => kvs,
            Some(other) => return Err(EtcdError(format!("etcd range answered kvs {other}"))),
        };
        let kvs = kvs
            .iter()
            .filter_map(|kv| {
                let key = decode(&kv["key"]).map(|k| String::from_utf8_lossy(&k).into_owned());
                match (key, kv.get("value").map_or(Some(Vec::new()), decode)) {
                    (Some(k), Some(v)) => Some((k, v)),
                    (k, _) => {
                        tracing::warn!(key = %k.as_deref().unwrap_or("?"), "etcd: skipping an entry that is not base64");
                        None
                    }
                }
            })
            .collect();
        Ok((kvs, revision))
    }

    /// How many keys are under `prefix` (a quorum read: also proves etcd answers).
    pub async fn count_prefix(&self, prefix: &str) -> Result<usize, EtcdError> {
        let body = json!({"key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)), "count_only": true});
        let v = self.call("/v3/kv/range", body).await?;
        Ok(int(&v["count"]).and_then(|n| usize::try_from(n).ok()).unwrap_or(0))
    }

    /// Watches the keys under `prefix` from `revision` on.
    pub async fn watch_prefix(&self, prefix: &str, revision: i64) -> Result<Watch, EtcdError> {
        let body = json!({"create_request": {"key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix)), "start_revision": revision.to_string()}});
        // The answer streams for as long as the watch lives: no timeout on it, only on its start
        // (each member's, in `send`).
        let r = self.send("/v3/watch", &body, None).await?;
        if !r.status().is_success() {
            return Err(EtcdError(format!("etcd /v3/watch answered {}", r.status())));
        }
        Ok(Watch { body: Box::pin(r.bytes_stream()), buf: Vec::new() })
    }
}

fn decode(f: &Value) -> Option<Vec<u8>> {
    f.as_str().and_then(|s| B64.decode(s).ok())
}

/// A change under a watched prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Put(String, Vec<u8>),
    Delete(String),
}

/// Longest watch message accepted (a message lists one revision's events).
const MAX_WATCH_MESSAGE: usize = 4 << 20;

/// An etcd watch: the gateway streams one JSON message per line.
pub struct Watch {
    body: std::pin::Pin<Box<dyn futures_util::Stream<Item = reqwest::Result<axum::body::Bytes>> + Send>>,
    buf: Vec<u8>,
}

impl Watch {
    /// The next changes. An error ends the watch (etcd gone, the watch cancelled or compacted
    /// past, a message that does not parse): read the keys again and watch anew. Cancel-safe.
    pub async fn next(&mut self) -> Result<Vec<Change>, EtcdError> {
        use futures_util::StreamExt;
        loop {
            while let Some(end) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=end).collect();
                let changes = watch_message(&line)?;
                if !changes.is_empty() {
                    return Ok(changes);
                }
            }
            if self.buf.len() > MAX_WATCH_MESSAGE {
                return Err(EtcdError(format!("etcd sent a watch message over {MAX_WATCH_MESSAGE} bytes")));
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(e)) => return Err(EtcdError(format!("etcd watch broke: {}", crate::error::cause(&e)))),
                None => return Err(EtcdError("etcd closed the watch".into())),
            }
        }
    }
}

/// The changes one watch message carries (none for a blank line, the watch's creation or a
/// progress notice).
fn watch_message(line: &[u8]) -> Result<Vec<Change>, EtcdError> {
    if line.trim_ascii().is_empty() {
        return Ok(Vec::new());
    }
    let v: Value = serde_json::from_slice(line).map_err(|e| EtcdError(format!("etcd watch message is not JSON: {e}")))?;
    if let Some(e) = v.get("error") {
        return Err(EtcdError(format!("etcd watch: {e}")));
    }
    let r = &v["result"];
    if r["canceled"] == true || int(&r["compact_revision"]).is_some_and(|c| c > 0) {
        return Err(EtcdError(format!("etcd cancelled the watch: {r}")));
    }
    let mut changes = Vec::new();
    for e in r["events"].as_array().into_iter().flatten() {
        let Some(key) = decode(&e["kv"]["key"]).map(|k| String::from_utf8_lossy(&k).into_owned()) else {
            tracing::warn!("etcd: skipping a watch event whose key is not base64");
            continue;
        };
        if e["type"] == "DELETE" {
            changes.push(Change::Delete(key));
            continue;
        }
        match e["kv"].get("value").map_or(Some(Vec::new()), decode) {
            Some(value) => changes.push(Change::Put(key, value)),
            None => tracing::warn!(%key, "etcd: skipping a watch event whose value is not base64"),
        }
    }
    Ok(changes)
}

/// What [`follow`] reports.
pub enum Seen<'a> {
    /// Every key under the prefix now, with its value.
    Keys(&'a std::collections::BTreeMap<String, Vec<u8>>),
    /// etcd could not be read; the last keys reported are all that is known.
    Unreachable(&'a EtcdError),
}

/// Follows the keys under `prefix`: reads them all, then watches from that revision, reporting
/// the whole set at each change. Every `interval` a count of the keys (a quorum read) checks that
/// etcd still answers, even when a watch just stalls, and that the watch missed nothing (else the
/// keys are read again); the set is reported then too. Unreachable: reported, retried every
/// `interval`. Ends when `report` returns false.
pub async fn follow(etcd: &Etcd, prefix: &str, interval: Duration, mut report: impl FnMut(Seen<'_>) -> bool) {
    loop {
        let started = async {
            let (kvs, revision) = etcd.range_prefix(prefix).await?;
            Ok::<_, EtcdError>((kvs, etcd.watch_prefix(prefix, revision + 1).await?))
        };
        let (mut keys, mut watch) = match started.await {
            Ok((kvs, watch)) => {
                let keys: std::collections::BTreeMap<String, Vec<u8>> = kvs.into_iter().collect();
                if !report(Seen::Keys(&keys)) {
                    return;
                }
                (keys, watch)
            }
            Err(e) => {
                if !report(Seen::Unreachable(&e)) {
                    return;
                }
                tokio::time::sleep(interval).await;
                continue;
            }
        };
        let mut probe = tokio::time::interval(interval);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        probe.tick().await;
        loop {
            tokio::select! {
                changes = watch.next() => match changes {
                    Ok(changes) => {
                        for c in changes {
                            match c {
                                Change::Put(k, v) => keys.insert(k, v),
                                Change::Delete(k) => keys.remove(&k),
                            };
                        }
                        if !report(Seen::Keys(&keys)) {
                            return;
                        }
                    }
                    Err(e) => {
                        tracing::debug!("{e}: reading the keys again");
                        break;
                    }
                },
                _ = probe.tick() => match etcd.count_prefix(prefix).await {
                    Ok(n) if n == keys.len() => {
                        if !report(Seen::Keys(&keys)) {
                            return;
                        }
                    }
                    Ok(n) => {
                        tracing::debug!(watched = keys.len(), counted = n, "etcd: the watch and a count disagree: reading the keys again");
                        break;
                    }
                    Err(e) => {
                        if !report(Seen::Unreachable(&e)) {
                            return;
                        }
                        tokio::time::sleep(interval).await;
                        break;
                    }
                },
            }
        }
    }
}

/// A gateway int64: a JSON string of digits (or a number).
fn int(v: &Value) -> Option<i64> {
    v.as_str().and_then(|s| s.parse().ok()).or_else(|| v.as_i64())
}

/// The end of the range of keys starting with `prefix` (etcd's `--prefix`): the prefix with its
/// last byte below 0xff incremented.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

/// What an engine registers: enough for a router to reach it and pair it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// `prefill`, `decode` or `both` (from `kv_role`: producer, consumer, both).
    pub role: Role,
    /// The engine's OpenAI API, e.g. `http://10.0.0.5:8100`.
    pub url: String,
    pub engine_id: String,
    /// The KV side channel, `host:port`.
    pub kv_addr: String,
    pub tp_size: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }

    pub fn prefills(self) -> bool {
        self != Role::Decode
    }

    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }
}

impl Registration {
    pub fn to_json(&self) -> Vec<u8> {
        json!({"role": self.role.as_str(), "url": self.url, "engine_id": self.engine_id, "kv_addr": self.kv_addr, "tp_size": self.tp_size})
            .to_string()
            .into_bytes()
    }

    /// A registration as read back from etcd; why not, if it does not parse.
    pub fn parse(raw: &[u8]) -> Result<Registration, RegistrationError> {
        let v: Value = serde_json::from_slice(raw)?;
        let text = |f: &'static str| v.get(f).and_then(Value::as_str).filter(|s| !s.is_empty()).ok_or(RegistrationError::NoString(f));
        let role = match text("role")? {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            "both" => Role::Both,
            other => return Err(RegistrationError::Role(other.to_string())),
        };
        let url = text("url")?.to_string();
        upstream_of(&url)?;
        let tp_size = v.get("tp_size").and_then(Value::as_u64).and_then(|t| u32::try_from(t).ok()).filter(|t| *t > 0);
        Ok(Registration {
            role,
            url,
            engine_id: text("engine_id")?.to_string(),
            kv_addr: text("kv_addr")?.to_string(),
            tp_size: tp_size.ok_or(RegistrationError::TpSize)?,
        })
    }

    /// Where the proxy sends this engine's legs.
    pub fn upstream(&self) -> Result<crate::Upstream, UrlError> {
        upstream_of(&self.url)
    }
}

fn upstream_of(url: &str) -> Result<crate::Upstream, UrlError> {
    let u = reqwest::Url::parse(url).map_err(|why| UrlError::Unparsable { url: url.to_string(), why })?;
    let https = match u.scheme() {
        "http" => false,
        "https" => true,
        _ => return Err(UrlError::Scheme(url.to_string())),
    };
    let host = u.host_str().ok_or_else(|| UrlError::NoHost(url.to_string()))?;
    let port = u.port_or_known_default().ok_or_else(|| UrlError::NoPort(url.to_string()))?;
    Ok(crate::Upstream { host: host.trim_start_matches('[').trim_end_matches(']').to_string(), port, https })
}

/// Keeps one engine registered: a lease of `ttl`, renewed every third of it; the registration put
/// again under a new lease whenever etcd no longer knows the old one (it expired while etcd was
/// unreachable, or etcd came back without its data). [`Registrar::deregister`] ends it.
pub struct Registrar {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Option<i64>>,
    etcd: Etcd,
}

impl Registrar {
    pub fn start(etcd: Etcd, key: String, registration: &Registration, ttl: Duration) -> Registrar {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let value = registration.to_json();
        let client = etcd.clone();
        let task = tokio::spawn(async move {
            let renew = (ttl / 3).max(Duration::from_millis(100));
            let mut lease: Option<i64> = None;
            let mut failing = false;
            loop {
                let step = async {
                    match lease {
                        Some(id) => match client.keep_alive(id).await {
                            Ok(true) => Ok(Some(id)),
                            Ok(false) => {
                                tracing::warn!(%key, "etcd no longer knows this engine's lease: registering again");
                                register(&client, &key, &value, ttl).await.map(Some)
                            }
                            Err(e) => Err((Some(id), e)),
                        },
                        None => register(&client, &key, &value, ttl).await.map(Some),
                    }
                };
                // Each step runs to its end (its calls are bounded), so a lease granted just before
                // a deregistration is known, and revoked, rather than left to expire.
                let wait = match step.await {
                    Ok(id) => {
                        if failing || lease != id {
                            tracing::info!(%key, etcd = %client.url(), "registered in etcd");
                        }
                        failing = false;
                        lease = id;
                        renew
                    }
                    Err((kept, e)) => {
                        if !failing {
                            tracing::warn!(%key, "{e}; still serving, retrying");
                        }
                        failing = true;
                        lease = kept;
                        renew.min(Duration::from_secs(1))
                    }
                };
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    _ = stopped.changed() => return lease,
                }
            }
        });
        Registrar { stop, task, etcd }
    }

    /// Removes the registration now (the lease revoked), so routers stop sending new requests
    /// before the engine drains. If etcd cannot be reached, the registration ends with its lease.
    pub async fn deregister(self) {
        let _ = self.stop.send(true);
        let Ok(Some(lease)) = self.task.await else { return };
        match self.etcd.revoke(lease).await {
            Ok(()) => tracing::info!("deregistered from etcd"),
            Err(e) => tracing::warn!("could not deregister from etcd ({e}): the registration ends with its lease"),
        }
    }
}

/// A fresh lease and the registration put under it.
async fn register(etcd: &Etcd, key: &str, value: &[u8], ttl: Duration) -> Result<i64, (Option<i64>, EtcdError)> {
    let id = etcd.grant(ttl).await.map_err(|e| (None, e))?;
    match etcd.put(key, value, id).await {
        Ok(()) => Ok(id),
        Err(e) => {
            let _ = etcd.revoke(id).await;
            Err((None, e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Membership through etcd: a member that accepts connections but never answers (hung, or
    /// cut off after the connect) does not use up a watch's start: the next member is tried
    /// after CALL_TIMEOUT and the watch starts there.
    #[tokio::test]
    async fn a_hung_member_is_passed_over_for_the_next() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let live = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let urls = format!("http://{},http://{}", hung.local_addr().unwrap(), live.local_addr().unwrap());
        let held = tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok((c, _)) = hung.accept().await {
                kept.push(c);
            }
        });
        let answering = tokio::spawn(async move {
            let (mut c, _) = live.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = c.read(&mut buf).await;
            let body = b"{\"result\":{\"events\":[{\"kv\":{\"key\":\"L2t2bGVhc2UveA==\",\"value\":\"dg==\"}}]}}\n";
            let head =
                format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n", body.len());
            c.write_all(head.as_bytes()).await.unwrap();
            c.write_all(body).await.unwrap();
            c.write_all(b"\r\n").await.unwrap();
            // The watch stays open.
            tokio::time::sleep(Duration::from_secs(30)).await;
        });
        let etcd = Etcd::new(&urls).unwrap();
        let started = std::time::Instant::now();
        let mut watch = tokio::time::timeout(Duration::from_secs(20), etcd.watch_prefix("/kvlease/", 1))
            .await
            .expect("the watch start is bounded")
            .expect("the second member answers the watch");
        assert!(started.elapsed() >= CALL_TIMEOUT, "the hung member was waited on for its head");
        let changes = watch.next().await.expect("the watch streams");
        assert!(matches!(&changes[..], [Change::Put(k, v)] if k == "/kvlease/x" && v == b"v"), "the second member's change arrives");
        held.abort();
        answering.abort();
    }

    #[test]
    fn prefix_end_increments_the_last_byte() {
        assert_eq!(prefix_end("/kvlease/"), b"/kvlease0");
        assert_eq!(prefix_end("a"), b"b");
    }

    #[test]
    fn registrations_round_trip_and_malformed_ones_say_why() {
        let r = Registration {
            role: Role::Decode,
            url: "http://[::1]:8200".into(),
            engine_id: "d1".into(),
            kv_addr: "[::1]:5600".into(),
            tp_size: 2,
        };
        assert_eq!(Registration::parse(&r.to_json()).unwrap(), r);
        assert_eq!(r.upstream().unwrap(), crate::Upstream::http("::1", 8200));
        for (raw, why) in [
            (&b"nope"[..], "not JSON"),
            (br#"{"role":"router","url":"http://a:1","engine_id":"e","kv_addr":"a:2","tp_size":1}"#, "role"),
            (br#"{"role":"prefill","url":"ftp://a:1","engine_id":"e","kv_addr":"a:2","tp_size":1}"#, "http"),
            (br#"{"role":"prefill","url":"http://a:1","engine_id":"e","kv_addr":"a:2","tp_size":0}"#, "tp_size"),
            (br#"{"role":"prefill","url":"http://a:1","kv_addr":"a:2","tp_size":1}"#, "engine_id"),
        ] {
            let e = Registration::parse(raw).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    /// The gateway's watch messages (etcd 3.4's, as captured): creation and progress carry no
    /// change; a lease that expires is a DELETE; a cancelled or compacted watch ends it.
    #[test]
    fn watch_messages_become_changes() {
        let created = br#"{"result":{"header":{"revision":"1"},"created":true}}"#;
        assert_eq!(watch_message(created).unwrap(), []);
        assert_eq!(watch_message(b"\n").unwrap(), []);
        let put = br#"{"result":{"header":{"revision":"2"},"events":[{"kv":{"key":"L2t2bGVhc2UvYQ==","mod_revision":"2","value":"aGk=","lease":"7"}}]}}"#;
        assert_eq!(watch_message(put).unwrap(), [Change::Put("/kvlease/a".into(), b"hi".to_vec())]);
        let del =
            br#"{"result":{"header":{"revision":"3"},"events":[{"type":"DELETE","kv":{"key":"L2t2bGVhc2UvYQ==","mod_revision":"3"}}]}}"#;
        assert_eq!(watch_message(del).unwrap(), [Change::Delete("/kvlease/a".into())]);
        let bad_key = br#"{"result":{"events":[{"kv":{"key":"%%%","value":"aGk="}}]}}"#;
        assert_eq!(watch_message(bad_key).unwrap(), [], "skipped, not fatal");
        for end in [
            &br#"{"result":{"canceled":true,"cancel_reason":"x"}}"#[..],
            br#"{"result":{"compact_revision":"9"}}"#,
            br#"{"error":{"grpc_code":14}}"#,
            b"{nope",
        ] {
            assert!(watch_message(end).is_err(), "{}", String::from_utf8_lossy(end));
        }
    }

    #[test]
    fn gateway_numbers_are_strings() {
        assert_eq!(int(&json!("4111120361763744773")), Some(4111120361763744773));
        assert_eq!(int(&json!(5)), Some(5));
        assert_eq!(int(&Value::Null), None);
    }
}
