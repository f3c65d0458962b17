//! Real processes for the end-to-end and fault tests: `kvlease serve` and `kvlease proxy` started
//! from the built binary on loopback ports, killed when the test ends, with an HTTP client and
//! condition waits with deadlines.
#![allow(dead_code)] // each test binary uses a different subset

pub mod hosts;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const DEADLINE: Duration = Duration::from_secs(30);
pub const SECRET: &str = "e2e-cluster-secret";

/// A child process that is killed (SIGKILL) when dropped.
pub struct Proc {
    pub child: Child,
    pub url: String,
    pub name: String,
}

impl Proc {
    /// `kvlease serve` with these extra flags and the cluster secret [`SECRET`]; waits for its
    /// start-up line.
    pub fn serve(name: &str, extra: &[&str]) -> Proc {
        Proc::serve_with_secret(name, extra, Some(SECRET))
    }

    /// `kvlease serve` with this cluster secret, or none (then it warns and checks nothing).
    pub fn serve_with_secret(name: &str, extra: &[&str], secret: Option<&str>) -> Proc {
        let mut args = vec!["serve", "--port", "0", "--engine-id", name, "--log-level", "warn"];
        args.extend_from_slice(extra);
        Proc::start_with_secret(name, &args, "kvlease serve listening on ", secret)
    }

    pub fn proxy(prefillers: &[&Proc], decoders: &[&Proc]) -> Proc {
        Proc::proxy_with(prefillers, decoders, &[])
    }

    /// `kvlease proxy` in front of these engines, with these extra flags.
    pub fn proxy_with(prefillers: &[&Proc], decoders: &[&Proc], extra: &[&str]) -> Proc {
        Proc::proxy_on(None, "127.0.0.1", prefillers, decoders, extra)
    }

    /// `kvlease proxy` listening on `host`, inside network namespace `netns` if given
    /// (`ip netns exec`, see [`hosts`]), in front of these engines, with these extra flags.
    pub fn proxy_on(netns: Option<&str>, host: &str, prefillers: &[&Proc], decoders: &[&Proc], extra: &[&str]) -> Proc {
        let hp = |ps: &[&Proc]| -> (Vec<String>, Vec<String>) {
            ps.iter()
                .map(|p| {
                    let (h, port) = p.url.trim_start_matches("http://").rsplit_once(':').expect("host:port");
                    (h.to_string(), port.to_string())
                })
                .unzip()
        };
        let (ph, pp) = hp(prefillers);
        let (dh, dp) = hp(decoders);
        let mut args: Vec<String> =
            ["proxy", "--host", host, "--port", "0", "--log-level", "warn", "--prefiller-hosts"].map(String::from).to_vec();
        args.extend(ph);
        args.push("--prefiller-ports".into());
        args.extend(pp);
        args.push("--decoder-hosts".into());
        args.extend(dh);
        args.push("--decoder-ports".into());
        args.extend(dp);
        args.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        Proc::start_in(netns, "proxy", &refs, "kvlease proxy listening on ", Some(SECRET), Stdio::inherit())
    }

    /// `kvlease serve` inside network namespace `netns`, listening on `host` (a non-loopback
    /// address: the cluster secret [`SECRET`] allows it, SPEC S3), with these extra flags.
    pub fn serve_on(netns: &str, host: &str, name: &str, extra: &[&str]) -> Proc {
        let mut args = vec!["serve", "--host", host, "--port", "0", "--engine-id", name, "--log-level", "warn"];
        args.extend_from_slice(extra);
        Proc::start_in(Some(netns), name, &args, "kvlease serve listening on ", Some(SECRET), Stdio::inherit())
    }

    /// `kvlease proxy --etcd URL`: routing to the engines registered in etcd, with these extra
    /// flags, its logs (stderr) going to `logs`.
    pub fn proxy_etcd(etcd: &str, extra: &[&str], logs: Stdio) -> Proc {
        let mut args = vec!["proxy", "--host", "127.0.0.1", "--port", "0", "--etcd", etcd];
        args.extend_from_slice(extra);
        Proc::start_logging_to("proxy", &args, "kvlease proxy listening on ", Some(SECRET), logs)
    }

    /// `kvlease` with exactly these arguments (`serve ...`) and the cluster secret [`SECRET`];
    /// waits for its start-up line.
    pub fn start(name: &str, args: &[&str]) -> Proc {
        Proc::start_with_secret(name, args, "kvlease serve listening on ", Some(SECRET))
    }

    fn start_with_secret(name: &str, args: &[&str], banner: &str, secret: Option<&str>) -> Proc {
        Proc::start_logging_to(name, args, banner, secret, Stdio::inherit())
    }

    /// `kvlease serve` with these extra flags (its log level and format among them) and the
    /// cluster secret, its logs (stderr) going to `logs`.
    pub fn serve_logging_to(name: &str, extra: &[&str], logs: Stdio) -> Proc {
        let mut args = vec!["serve", "--port", "0", "--engine-id", name];
        args.extend_from_slice(extra);
        Proc::start_logging_to(name, &args, "kvlease serve listening on ", Some(SECRET), logs)
    }

    fn start_logging_to(name: &str, args: &[&str], banner: &str, secret: Option<&str>, logs: Stdio) -> Proc {
        Proc::start_in(None, name, args, banner, secret, logs)
    }

    /// Starts the binary, inside network namespace `netns` if given (`ip netns exec` execs it,
    /// so the child's pid is kvlease's own and signals reach it).
    fn start_in(netns: Option<&str>, name: &str, args: &[&str], banner: &str, secret: Option<&str>, logs: Stdio) -> Proc {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_kvlease")]);
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_kvlease")),
        };
        cmd.args(args).env_remove("KVLEASE_TRANSFER_SECRET");
        if let Some(secret) = secret {
            cmd.env("KVLEASE_TRANSFER_SECRET", secret);
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(logs).spawn().expect("spawn kvlease");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let _ = tx.send(line);
            // Keep draining so the child never blocks on a full pipe.
            let mut sink = String::new();
            while reader.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
                sink.clear();
            }
        });
        let line = match rx.recv_timeout(DEADLINE) {
            Ok(l) => l,
            Err(_) => {
                let _ = child.kill();
                panic!("{name}: no start-up line within {DEADLINE:?}");
            }
        };
        let rest = line.strip_prefix(banner).unwrap_or_else(|| panic!("{name}: unexpected start-up line {line:?}"));
        let url = rest.split_whitespace().next().expect("url").to_string();
        Proc { child, url, name: name.to_string() }
    }

    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill").args([&format!("-{sig}"), &self.pid()]).status().expect("kill").success();
        assert!(ok, "kill -{sig} {}", self.name);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A third-party server a test runs (Prometheus, etcd): the binary `env_var` names (set by
/// `scripts/test.sh`, which fetches it with `install`), else `name` on the PATH; without either
/// the test fails and says how to get it.
pub fn server_binary(env_var: &str, name: &str, install: &str) -> String {
    if let Ok(p) = std::env::var(env_var) {
        return p;
    }
    let on_path = Command::new(name).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    assert!(on_path.is_ok_and(|s| s.success()), "no {name} server: run `export {env_var}=$({install})` (scripts/test.sh does)");
    name.into()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().timeout(DEADLINE).build().expect("client")
}

/// POSTs JSON; returns (status, body).
pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).json(body).send().await.expect("send");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}")))
}

/// POSTs a streaming request; returns the concatenated text of the SSE chunks.
pub async fn post_stream(url: &str, body: &Value, chat: bool) -> String {
    post_stream_params(url, body, chat).await.0
}

/// The text of a non-streaming completion or chat completion.
pub fn text_of(body: &Value, chat: bool) -> String {
    let c = &body["choices"][0];
    let t = if chat { c["message"]["content"].as_str() } else { c["text"].as_str() };
    t.unwrap_or_else(|| panic!("no text in {body}")).to_string()
}

/// One sample of a Prometheus metric (with labels as written, e.g. `x{reason="expired"}`).
pub async fn metric(base: &str, name: &str) -> f64 {
    let text = client().get(format!("{base}/metrics")).send().await.expect("metrics").text().await.expect("text");
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).map(|v| v.trim().parse::<f64>().expect("number")))
        .unwrap_or_else(|| panic!("metric {name} not found"))
}

/// Waits until `f` is true, polling, failing after `limit`.
pub async fn until<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = tokio::time::Instant::now();
    while !f().await {
        assert!(t0.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// kv-transfer-config with a lease of `secs`.
pub fn lease_config(secs: f64) -> String {
    format!(r#"{{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{{"kv_lease_duration":{secs}}}}}"#)
}

/// kv-transfer-config for multi-turn (SPEC B1–B4): bidirectional, a cached-turn TTL of `ttl`
/// seconds, a lease of `lease` seconds and this `kv_recompute_threshold`.
/// A push engine's `--kv-transfer-config` (vLLM's `NixlPushConnector`): lease L, D's write
/// wait `wait` (s).
pub fn push_config(lease: f64, wait: f64) -> String {
    format!(
        r#"{{"kv_connector":"NixlPushConnector","kv_role":"kv_both","kv_connector_extra_config":{{"kv_lease_duration":{lease},"push_registration_timeout":{wait}}}}}"#
    )
}

pub fn bidirectional_config(ttl: f64, lease: f64, threshold: u32) -> String {
    format!(
        r#"{{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{{"bidirectional_kv_xfer":true,"decoder_kv_blocks_ttl":{ttl},"kv_recompute_threshold":{threshold},"kv_lease_duration":{lease}}}}}"#
    )
}

/// POSTs a streaming request; returns the concatenated text of the SSE chunks and the last
/// `kv_transfer_params` any chunk carried (top-level or in a choice).
pub async fn post_stream_params(url: &str, body: &Value, chat: bool) -> (String, Option<Value>) {
    let r = client().post(url).json(body).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 200);
    let text = r.text().await.expect("body");
    let (out, params, done) = sse_text(&text, chat).unwrap_or_else(|v| panic!("stream failed: {v}"));
    assert!(done, "stream ended without [DONE]");
    (out, params)
}

/// An SSE answer's text, the last `kv_transfer_params` any chunk carried (top-level or in a
/// choice) and whether `[DONE]` ended it; or the first error event.
pub fn sse_text(text: &str, chat: bool) -> Result<(String, Option<Value>, bool), Value> {
    let mut out = String::new();
    let mut params = None;
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("bad SSE chunk ({e}): {data}"));
        if v.get("error").is_some() {
            return Err(v);
        }
        if let Some(p) = v.get("kv_transfer_params").filter(|p| p.is_object()) {
            params = Some(p.clone());
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            let piece = if chat { c["delta"]["content"].as_str() } else { c["text"].as_str() };
            out.push_str(piece.unwrap_or(""));
            if let Some(p) = c.get("kv_transfer_params").filter(|p| p.is_object()) {
                params = Some(p.clone());
            }
        }
    }
    Ok((out, params, done))
}

/// Waits until the engine at `base` holds no lease and every KV block is free.
pub async fn until_nothing_held(base: &str, limit: Duration) {
    until(&format!("{base}: no lease held and every block free"), limit, || async {
        metric(base, "kvlease_leases_active").await == 0.0
            && metric(base, "kvlease_kv_blocks_free").await == metric(base, "kvlease_kv_blocks_total").await
    })
    .await;
}

/// Occupies `d` with a local request of `tokens` tokens (ignoring EOS), so requests queue behind
/// it on a decoder with one slot; returns once D runs it. Abort the task to end it early (D drops
/// a request whose client left).
pub async fn occupy(d: &Proc, tokens: u64) -> tokio::task::JoinHandle<()> {
    let url = format!("{}/v1/completions", d.url);
    let h = tokio::spawn(async move {
        let _ = client()
            .post(url)
            .json(&json!({"model": "kvlease-synthetic", "prompt": "busy", "max_tokens": tokens, "ignore_eos": true}))
            .send()
            .await;
    });
    let base = d.url.clone();
    until("decoder busy", DEADLINE, || {
        let base = base.clone();
        async move { metric(&base, "kvlease_requests_running").await >= 1.0 }
    })
    .await;
    h
}

/// False (after saying why) when the NIXL library is not on LD_LIBRARY_PATH and not required.
pub fn nixl_or_skip() -> bool {
    if std::env::var("KVLEASE_REQUIRE_NIXL").is_ok_and(|v| v == "1") {
        return true;
    }
    let found = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .any(|d| !d.is_empty() && std::path::Path::new(d).join("libnixl_capi.so").exists());
    if !found {
        eprintln!("!!!!!!!! SKIPPED: libnixl_capi.so is not on LD_LIBRARY_PATH (scripts/install-nixl.sh) !!!!!!!!");
    }
    found
}

/// The OpenAI path of a chat (`chat`) or plain completion.
pub fn completion_path(chat: bool) -> &'static str {
    if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// The answer's text through `base`: `Ok` for a 200 that completed, `Err` (status, what) for
/// anything else — an error status, a body cut short, or a stream that ended with an error
/// event or without `[DONE]`.
pub async fn answer(base: &str, body: &Value, chat: bool, stream: bool) -> Result<String, (u16, String)> {
    let r = client().post(format!("{base}{}", completion_path(chat))).json(body).send().await.map_err(|e| (0, e.to_string()))?;
    let status = r.status().as_u16();
    let text = r.text().await.map_err(|e| (status, format!("body cut: {e}")))?;
    if status != 200 {
        return Err((status, text));
    }
    if stream {
        match sse_text(&text, chat) {
            Ok((out, _, true)) => Ok(out),
            Ok((_, _, false)) => Err((status, format!("stream ended without [DONE]: {text}"))),
            Err(e) => Err((status, e.to_string())),
        }
    } else {
        let v: Value = serde_json::from_str(&text).map_err(|e| (status, format!("not JSON ({e}): {text}")))?;
        Ok(text_of(&v, chat))
    }
}

/// Request `i`'s answer ([`answer`]) and the local run's.
pub type Outcome = (usize, Result<String, (u16, String)>, String);

/// Requests' outcomes, each `(i, answer, local answer)` ([`answer`]): every 200 must carry the
/// local run's answer and every failure must not be a 200 (nothing silently wrong). Returns how
/// many were answered and how many failed.
pub async fn no_wrong_200(tasks: Vec<tokio::task::JoinHandle<Outcome>>) -> (usize, usize) {
    let (mut ok, mut failed) = (0, 0);
    for t in tasks {
        let (i, got, want) = t.await.expect("joins");
        match got {
            Ok(text) => {
                assert_eq!(text, want, "request {i}: a 200 must carry a local run's answer");
                ok += 1;
            }
            Err((status, what)) => {
                assert_ne!(status, 200, "request {i}: {what}");
                failed += 1;
            }
        }
    }
    (ok, failed)
}

/// SPEC D7: `n` completions — plain and chat, streaming and not, prompts of 3 to 19 words —
/// through `proxy`, each equal to the same request run on `local` (a single engine); `batch` at
/// a time.
pub async fn answers_equal_local(proxy: &str, local: &str, n: usize, batch: usize) {
    let words = ["lease", "heartbeat", "prefill", "decode", "block", "engine", "cache", "renewal"];
    let mut jobs = Vec::new();
    for i in 0..n {
        let chat = i % 5 == 4;
        let stream = i % 3 == 0;
        let prompt: String = (0..(3 + i % 17)).map(|j| words[(i * 7 + j * 3) % words.len()]).collect::<Vec<_>>().join(" ");
        let max_tokens = 4 + (i % 13) as u64;
        let (path, body) = if chat {
            (
                "/v1/chat/completions",
                json!({"model": "kvlease-synthetic", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "ignore_eos": true}),
            )
        } else {
            ("/v1/completions", json!({"model": "kvlease-synthetic", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true}))
        };
        let (proxy_url, local_url) = (format!("{proxy}{path}"), format!("{local}{path}"));
        jobs.push(tokio::spawn(async move {
            let (status, want) = post(&local_url, &body).await;
            assert_eq!(status, 200, "{want}");
            let want = text_of(&want, chat);
            let got = if stream {
                let mut b = body.clone();
                b["stream"] = json!(true);
                post_stream(&proxy_url, &b, chat).await
            } else {
                let (status, got) = post(&proxy_url, &body).await;
                assert_eq!(status, 200, "{got}");
                text_of(&got, chat)
            };
            assert!(!want.is_empty());
            assert_eq!(got, want, "request {i} (chat {chat}, stream {stream})");
        }));
        if jobs.len() == batch {
            for j in jobs.drain(..) {
                j.await.expect("request task");
            }
        }
    }
    for j in jobs {
        j.await.expect("request task");
    }
}
