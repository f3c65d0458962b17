//! `kvlease load`: a small closed-loop HTTP load generator for `/v1/completions`.
//!
//! `--concurrency` workers each send one request, wait for its whole answer, and send the next,
//! until `--requests` have been sent. Prompts are varied but deterministic (a function of the
//! request index), `ignore_eos` is set so every answer has exactly `--max-tokens` tokens, and every
//! request has a timeout, so the run always ends by itself. A request succeeds when the answer is
//! HTTP 200 and complete (a JSON body with `choices`, or an SSE stream that ends with `[DONE]` and
//! carries no error); anything else — another status, a transport error, a timeout — fails.
//!
//! Output: one summary line on stdout,
//! `requests=N ok=N failed=N seconds=S rps=R p50_ms=… p90_ms=… p99_ms=… out_tok_s=…` (rps and
//! output tokens/s count successful requests; latencies are those of successful requests, `NaN` if
//! there were none). With `--stream` the line goes on with the figures vLLM's serving benchmark
//! reports, each as p50/p90/p99: `ttft_*` (time to first token: request sent to the first event
//! carrying text), `itl_*` (inter-token latency: every gap between two events carrying text, all
//! requests pooled) and `tpot_*` (time per output token after the first, per request:
//! `(latency - ttft) / (tokens - 1)`, requests of one token left out). Then a JSON line with the
//! same numbers if `--json`; failures by kind go to stderr. The command fails (exit code 1) if
//! any request failed.
//!
//! While it runs, a terminal on stderr gets a progress line redrawn every second; `--csv FILE`
//! writes the same per-second series to a file.

use crate::InvalidConfig;
use anyhow::Context;
use clap::Args;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct LoadArgs {
    /// Base URL of a `kvlease serve` or `kvlease proxy` (or any vLLM-compatible server):
    /// `http://`, or `https://` with `--cacert`.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// PEM CA certificates (curl's `--cacert`): an `https://` `--url` is trusted if its
    /// certificate chains to one of them, and to nothing else (no built-in roots). Needed for
    /// `https://`, refused for `http://`.
    #[arg(long, value_name = "PATH")]
    cacert: Option<std::path::PathBuf>,
    /// Number of requests to send.
    #[arg(long, default_value_t = 1000)]
    requests: usize,
    /// Requests in flight at once (closed loop: one worker per slot).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// `max_tokens` of each request.
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// Words in each prompt.
    #[arg(long, default_value_t = 32)]
    prompt_words: usize,
    /// Ask for SSE streaming answers.
    #[arg(long)]
    stream: bool,
    /// The `model` field of each request.
    #[arg(long, default_value = "kvlease-synthetic")]
    model: String,
    /// Timeout of each request (connect, send and read the whole answer), in seconds.
    #[arg(long, default_value_t = 30.0)]
    timeout_secs: f64,
    /// Stop starting new requests after this many seconds; requests never started count as failed.
    #[arg(long, default_value_t = 600.0)]
    max_run_secs: f64,
    /// Also print the summary as one JSON line.
    #[arg(long)]
    json: bool,
    /// Write the run's per-second series to this CSV file: `second,ok,failed,rps,out_tok_s,
    /// p50_ms,p99_ms` (requests that ended in that second; latencies of the successful ones).
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
}

/// Words the prompts are made of.
const WORDS: [&str; 16] = [
    "lease",
    "heartbeat",
    "prefill",
    "decode",
    "block",
    "engine",
    "cache",
    "renewal",
    "token",
    "proxy",
    "deadline",
    "transfer",
    "read",
    "pinned",
    "expiry",
    "batch",
];

/// The prompt of request `index`: `words` words picked by a hash of (index, position).
pub fn prompt(index: usize, words: usize) -> String {
    (0..words)
        .map(|j| {
            let h = splitmix64((index as u64) << 20 ^ j as u64);
            WORDS[(h % WORDS.len() as u64) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The certificates of `--cacert PATH`: at least one PEM certificate.
fn cacert(path: &std::path::Path) -> Result<Vec<reqwest::Certificate>, InvalidConfig> {
    let pem = std::fs::read(path).map_err(|e| InvalidConfig(format!("--cacert {}: cannot read it: {e}", path.display())))?;
    match reqwest::Certificate::from_pem_bundle(&pem) {
        Ok(certs) if !certs.is_empty() => Ok(certs),
        Ok(_) => Err(InvalidConfig(format!("--cacert {}: no PEM certificate in it", path.display()))),
        Err(e) => Err(InvalidConfig(format!("--cacert {}: not PEM certificates: {e:#}", path.display()))),
    }
}

/// A finite, positive number of seconds.
fn seconds(flag: &str, v: f64) -> Result<Duration, InvalidConfig> {
    if v.is_finite() && v > 0.0 && v < 1e9 {
        Ok(Duration::from_secs_f64(v))
    } else {
        Err(InvalidConfig(format!("--{flag} must be a positive number of seconds, got {v}")))
    }
}

/// The checked settings of a run.
struct Plan {
    endpoint: String,
    /// `--cacert`'s certificates and its path (for messages): the only roots of an `https://` URL.
    roots: Option<(std::path::PathBuf, Vec<reqwest::Certificate>)>,
    requests: usize,
    concurrency: usize,
    max_tokens: u32,
    prompt_words: usize,
    stream: bool,
    model: String,
    timeout: Duration,
    max_run: Duration,
}

impl Plan {
    fn new(a: &LoadArgs) -> Result<Plan, InvalidConfig> {
        let base = a.url.trim_end_matches('/');
        let parsed = reqwest::Url::parse(base).map_err(|e| InvalidConfig(format!("--url {:?} is not a URL: {e}", a.url)))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() {
            return Err(InvalidConfig(format!("--url {:?} must be an http:// or https:// URL with a host", a.url)));
        }
        let roots = match (&a.cacert, parsed.scheme()) {
            (None, "https") => {
                return Err(InvalidConfig(format!(
                    "--url {:?} is https://: give --cacert, the PEM CA its certificate chains to (no built-in roots are trusted)",
                    a.url
                )))
            }
            (Some(path), "http") => {
                return Err(InvalidConfig(format!("--cacert {} is given but --url {:?} is plain http://", path.display(), a.url)))
            }
            (None, _) => None,
            (Some(path), _) => Some((path.clone(), cacert(path)?)),
        };
        if a.requests == 0 {
            return Err(InvalidConfig("--requests must be at least 1".into()));
        }
        if a.concurrency == 0 {
            return Err(InvalidConfig("--concurrency must be at least 1".into()));
        }
        if a.max_tokens == 0 {
            return Err(InvalidConfig("--max-tokens must be at least 1".into()));
        }
        if a.prompt_words == 0 {
            return Err(InvalidConfig("--prompt-words must be at least 1".into()));
        }
        Ok(Plan {
            endpoint: format!("{base}/v1/completions"),
            roots,
            requests: a.requests,
            concurrency: a.concurrency.min(a.requests),
            max_tokens: a.max_tokens,
            prompt_words: a.prompt_words,
            stream: a.stream,
            model: a.model.clone(),
            timeout: seconds("timeout-secs", a.timeout_secs)?,
            max_run: seconds("max-run-secs", a.max_run_secs)?,
        })
    }

    /// The run's HTTP client; with `--cacert`, trusting its certificates and nothing else.
    fn client(&self) -> Result<reqwest::Client, InvalidConfig> {
        let mut builder = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .timeout(self.timeout)
            .connect_timeout(self.timeout)
            .pool_max_idle_per_host(self.concurrency)
            .tls_built_in_root_certs(false);
        for cert in self.roots.iter().flat_map(|(_, certs)| certs) {
            builder = builder.add_root_certificate(cert.clone());
        }
        builder.build().map_err(|e| match &self.roots {
            // The certificates are parsed here, as the client's roots.
            Some((path, _)) => InvalidConfig(format!("--cacert {}: not a usable CA certificate: {e:#}", path.display())),
            None => InvalidConfig(format!("cannot build the HTTP client: {e:#}")),
        })
    }

    fn body(&self, index: usize) -> Value {
        json!({
            "model": self.model,
            "prompt": prompt(index, self.prompt_words),
            "max_tokens": self.max_tokens,
            "ignore_eos": true,
            "stream": self.stream,
        })
    }
}

/// What one successful request measured.
#[derive(Debug, Default)]
struct Timing {
    latency: Duration,
    /// Output tokens: events carrying text when streamed, else `usage.completion_tokens`.
    tokens: u64,
    /// Streamed only: when the first event carrying text arrived.
    ttft: Option<Duration>,
    /// Streamed only: the gaps between consecutive events carrying text.
    itl: Vec<Duration>,
}

/// How one request ended.
enum Outcome {
    Ok(Timing),
    /// A failure kind: `http_503`, `timeout`, `connect`, `bad_body`, `stream_error`, ….
    Failed(String),
}

/// What ended in the current second, for the progress line and the CSV series.
#[derive(Default)]
struct Live {
    failed: usize,
    tokens: u64,
    latencies: Vec<Duration>,
    /// All requests ended so far.
    ended: usize,
}

impl Live {
    fn record(live: &std::sync::Mutex<Live>, outcome: &Outcome) {
        let mut l = live.lock().unwrap_or_else(|e| e.into_inner());
        l.ended += 1;
        match outcome {
            Outcome::Ok(t) => {
                l.latencies.push(t.latency);
                l.tokens += t.tokens;
            }
            Outcome::Failed(_) => l.failed += 1,
        }
    }
}

/// Every second (and once at the end, for the last part of a second): a row of the CSV series
/// and, on a terminal, the progress line.
async fn report_live(
    live: Arc<std::sync::Mutex<Live>>,
    csv: Option<std::fs::File>,
    requests: usize,
    stop: Arc<tokio::sync::Notify>,
) -> anyhow::Result<()> {
    use std::io::{IsTerminal, Write};
    let mut csv = csv.map(std::io::BufWriter::new);
    if let Some(f) = csv.as_mut() {
        writeln!(f, "second,ok,failed,rps,out_tok_s,p50_ms,p99_ms").context("cannot write the CSV file")?;
    }
    let tty = std::io::stderr().is_terminal();
    let start = Instant::now();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + Duration::from_secs(1), Duration::from_secs(1));
    let mut last = start;
    for second in 1u64.. {
        let done = tokio::select! {
            _ = tick.tick() => false,
            _ = stop.notified() => true,
        };
        let now = Instant::now();
        let span = now.duration_since(last).as_secs_f64().max(1e-9);
        last = now;
        let (mut lat, failed, tokens, ended) = {
            let mut l = live.lock().unwrap_or_else(|e| e.into_inner());
            (std::mem::take(&mut l.latencies), std::mem::take(&mut l.failed), std::mem::take(&mut l.tokens), l.ended)
        };
        lat.sort_unstable();
        let (ok, p50, p99) = (lat.len(), percentile_ms(&lat, 0.5), percentile_ms(&lat, 0.99));
        if let Some(f) = csv.as_mut() {
            let ms = |v: f64| if v.is_nan() { String::new() } else { format!("{v:.2}") };
            writeln!(f, "{second},{ok},{failed},{:.1},{:.1},{},{}", ok as f64 / span, tokens as f64 / span, ms(p50), ms(p99))
                .and_then(|()| f.flush())
                .context("cannot write the CSV file")?;
        }
        if tty {
            let line = format!(
                "{:>5.0} s  {ended}/{requests} done  {:.0} req/s  p50 {p50:.1} ms  failed {failed}",
                start.elapsed().as_secs_f64(),
                ok as f64 / span
            );
            eprint!("\r\x1b[2K{line}");
            if done {
                eprintln!();
            }
        }
        if done {
            break;
        }
    }
    Ok(())
}

/// What every worker reports.
#[derive(Default)]
struct Tally {
    timings: Vec<Timing>,
    failures: BTreeMap<String, usize>,
}

/// Runs the load; fails (exit code 1) if any request failed.
pub async fn run(args: LoadArgs) -> anyhow::Result<()> {
    let plan = Arc::new(Plan::new(&args)?);
    let client = plan.client()?;
    let csv = match &args.csv {
        Some(path) => Some(std::fs::File::create(path).with_context(|| format!("--csv: cannot create {}", path.display()))?),
        None => None,
    };
    let live = Arc::new(std::sync::Mutex::new(Live::default()));
    let stop = Arc::new(tokio::sync::Notify::new());
    let reporter = tokio::spawn(report_live(live.clone(), csv, plan.requests, stop.clone()));
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let deadline = start + plan.max_run;
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..plan.concurrency {
        let (plan, client, next, live) = (plan.clone(), client.clone(), next.clone(), live.clone());
        workers.spawn(async move {
            let mut tally = Tally::default();
            while Instant::now() < deadline {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= plan.requests {
                    break;
                }
                let outcome = one(&client, &plan, i).await;
                Live::record(&live, &outcome);
                match outcome {
                    Outcome::Ok(t) => tally.timings.push(t),
                    Outcome::Failed(kind) => *tally.failures.entry(kind).or_default() += 1,
                }
            }
            tally
        });
    }
    let mut all = Tally::default();
    while let Some(joined) = workers.join_next().await {
        let t = joined.context("a load worker panicked")?;
        all.timings.extend(t.timings);
        for (k, n) in t.failures {
            *all.failures.entry(k).or_default() += n;
        }
    }
    let elapsed = start.elapsed();
    stop.notify_one();
    reporter.await.context("the progress reporter panicked")??;
    let started = next.load(Ordering::Relaxed).min(plan.requests);
    if started < plan.requests {
        all.failures.insert("not_started_run_deadline".into(), plan.requests - started);
    }
    let summary = Summary::new(plan.requests, all.timings, elapsed, plan.stream);
    println!("{}", summary.line());
    if args.json {
        println!("{}", summary.json(&all.failures));
    }
    let failed: usize = all.failures.values().sum();
    if failed > 0 {
        let kinds: Vec<String> = all.failures.iter().map(|(k, n)| format!("{k}={n}")).collect();
        eprintln!("failures: {}", kinds.join(" "));
        anyhow::bail!("{failed} of {} requests failed", plan.requests);
    }
    Ok(())
}

/// Sends request `index` and reads its whole answer.
async fn one(client: &reqwest::Client, plan: &Plan, index: usize) -> Outcome {
    let t0 = Instant::now();
    let mut resp = match client.post(&plan.endpoint).json(&plan.body(index)).send().await {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(transport_kind(&e).into()),
    };
    let status = resp.status().as_u16();
    if !plan.stream || status != 200 {
        let text = match resp.text().await {
            Ok(t) => t,
            Err(e) => return Outcome::Failed(transport_kind(&e).into()),
        };
        if status != 200 {
            return Outcome::Failed(format!("http_{status}"));
        }
        return match json_complete(&text) {
            Ok(tokens) => {
                Outcome::Ok(Timing { latency: t0.elapsed(), tokens: tokens.unwrap_or(plan.max_tokens.into()), ..Timing::default() })
            }
            Err(kind) => Outcome::Failed(kind.into()),
        };
    }
    // Streamed: each event timed as its bytes arrive.
    let mut sse = SseTimer::new(t0);
    loop {
        match resp.chunk().await {
            Ok(Some(bytes)) => {
                if let Err(kind) = sse.feed(&bytes, Instant::now()) {
                    return Outcome::Failed(kind.into());
                }
            }
            Ok(None) => break,
            Err(e) => return Outcome::Failed(transport_kind(&e).into()),
        }
    }
    match sse.finish() {
        Ok(mut timing) => {
            timing.latency = t0.elapsed();
            Outcome::Ok(timing)
        }
        Err(kind) => Outcome::Failed(kind.into()),
    }
}

/// Reads an SSE answer as it arrives: JSON events without an `error`, ending with
/// `data: [DONE]`; times each event that carries text.
struct SseTimer {
    t0: Instant,
    pending: Vec<u8>,
    last: Option<Instant>,
    timing: Timing,
    done: bool,
}

impl SseTimer {
    fn new(t0: Instant) -> SseTimer {
        SseTimer { t0, pending: Vec::new(), last: None, timing: Timing::default(), done: false }
    }

    /// Bytes that arrived at `at`.
    fn feed(&mut self, bytes: &[u8], at: Instant) -> Result<(), &'static str> {
        self.pending.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(nl) = self.pending[start..].iter().position(|&b| b == b'\n') {
            let line = &self.pending[start..start + nl];
            start += nl + 1;
            let Some(data) = line.strip_prefix(b"data:") else { continue };
            let data = data.trim_ascii();
            if data == b"[DONE]" {
                self.done = true;
                continue;
            }
            let event: Event = serde_json::from_slice(data).map_err(|_| "bad_stream")?;
            if event.error.is_some() {
                return Err("stream_error");
            }
            if event.carries_text() {
                self.timing.tokens += 1;
                match self.last {
                    None => self.timing.ttft = Some(at - self.t0),
                    Some(prev) => self.timing.itl.push(at - prev),
                }
                self.last = Some(at);
            }
        }
        self.pending.drain(..start);
        Ok(())
    }

    fn finish(self) -> Result<Timing, &'static str> {
        if self.done {
            Ok(self.timing)
        } else {
            Err("stream_truncated")
        }
    }
}

/// What the load generator reads of an SSE event, borrowed from its bytes (a client that built
/// a whole JSON tree per event spent as much on it as on the rest of the answer): whether it is
/// an error, and its choices' text.
#[derive(serde::Deserialize)]
struct Event<'a> {
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
    #[serde(default, borrow)]
    choices: Option<Vec<EventChoice<'a>>>,
}

#[derive(serde::Deserialize)]
struct EventChoice<'a> {
    /// A completion's.
    #[serde(default, borrow)]
    text: Option<std::borrow::Cow<'a, str>>,
    /// A chat's.
    #[serde(default, borrow)]
    delta: Option<EventDelta<'a>>,
}

#[derive(serde::Deserialize)]
struct EventDelta<'a> {
    #[serde(default, borrow)]
    content: Option<std::borrow::Cow<'a, str>>,
}

impl Event<'_> {
    /// A choice carries text (`text` of a completion, `delta.content` of a chat).
    fn carries_text(&self) -> bool {
        self.choices.iter().flatten().any(|c| {
            let text = c.text.as_deref().or_else(|| c.delta.as_ref().and_then(|d| d.content.as_deref()));
            text.is_some_and(|t| !t.is_empty())
        })
    }
}

fn transport_kind(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect"
    } else {
        "transport"
    }
}

/// A non-streaming answer: a JSON object with at least one choice; its
/// `usage.completion_tokens` if it has one.
fn json_complete(text: &str) -> Result<Option<u64>, &'static str> {
    let v: Value = serde_json::from_str(text).map_err(|_| "bad_body")?;
    match v.get("choices").and_then(Value::as_array) {
        Some(c) if !c.is_empty() => Ok(v.pointer("/usage/completion_tokens").and_then(Value::as_u64)),
        _ => Err("bad_body"),
    }
}

/// p50, p90, p99 of some durations, in milliseconds (NaN when there are none).
#[derive(Debug, Clone, Copy)]
struct Percentiles([f64; 3]);

impl Percentiles {
    const AT: [(f64, &'static str); 3] = [(0.50, "p50"), (0.90, "p90"), (0.99, "p99")];

    fn of(mut xs: Vec<Duration>) -> Percentiles {
        xs.sort_unstable();
        Percentiles(Self::AT.map(|(p, _)| percentile_ms(&xs, p)))
    }

    /// ` {name}_p50_ms=… {name}_p90_ms=… {name}_p99_ms=…`
    fn fields(&self, name: &str) -> String {
        Self::AT.iter().zip(self.0).map(|((_, at), v)| format!(" {name}_{at}_ms={v:.2}")).collect()
    }

    fn json(&self, name: &str, into: &mut serde_json::Map<String, Value>) {
        for ((_, at), v) in Self::AT.iter().zip(self.0) {
            // NaN (no successful request) is not JSON: it becomes null.
            let key = if name.is_empty() { format!("{at}_ms") } else { format!("{name}_{at}_ms") };
            into.insert(key, if v.is_finite() { json!(v) } else { Value::Null });
        }
    }
}

/// The streaming figures of a finished run.
#[derive(Debug)]
struct StreamSummary {
    ttft: Percentiles,
    itl: Percentiles,
    tpot: Percentiles,
}

/// The numbers of a finished run.
#[derive(Debug)]
struct Summary {
    requests: usize,
    ok: usize,
    seconds: f64,
    latency: Percentiles,
    tokens: u64,
    stream: Option<StreamSummary>,
}

impl Summary {
    fn new(requests: usize, timings: Vec<Timing>, elapsed: Duration, stream: bool) -> Summary {
        let stream = stream.then(|| StreamSummary {
            ttft: Percentiles::of(timings.iter().filter_map(|t| t.ttft).collect()),
            itl: Percentiles::of(timings.iter().flat_map(|t| t.itl.iter().copied()).collect()),
            tpot: Percentiles::of(
                timings
                    .iter()
                    .filter(|t| t.tokens > 1)
                    .filter_map(|t| t.ttft.map(|ttft| t.latency.saturating_sub(ttft) / (t.tokens - 1) as u32))
                    .collect(),
            ),
        });
        Summary {
            requests,
            ok: timings.len(),
            seconds: elapsed.as_secs_f64(),
            latency: Percentiles::of(timings.iter().map(|t| t.latency).collect()),
            tokens: timings.iter().map(|t| t.tokens).sum(),
            stream,
        }
    }

    fn failed(&self) -> usize {
        self.requests - self.ok
    }

    fn per_second(&self, n: f64) -> f64 {
        if self.seconds > 0.0 {
            n / self.seconds
        } else {
            0.0
        }
    }

    /// Successful requests per second.
    fn rps(&self) -> f64 {
        self.per_second(self.ok as f64)
    }

    /// Output tokens of successful requests per second.
    fn out_tok_s(&self) -> f64 {
        self.per_second(self.tokens as f64)
    }

    fn line(&self) -> String {
        let [p50, p90, p99] = self.latency.0;
        let mut line = format!(
            "requests={} ok={} failed={} seconds={:.3} rps={:.1} p50_ms={p50:.2} p90_ms={p90:.2} p99_ms={p99:.2} out_tok_s={:.1}",
            self.requests,
            self.ok,
            self.failed(),
            self.seconds,
            self.rps(),
            self.out_tok_s(),
        );
        if let Some(s) = &self.stream {
            line += &(s.ttft.fields("ttft") + &s.itl.fields("itl") + &s.tpot.fields("tpot"));
        }
        line
    }

    fn json(&self, failures: &BTreeMap<String, usize>) -> Value {
        let mut m = serde_json::Map::new();
        m.insert("requests".into(), json!(self.requests));
        m.insert("ok".into(), json!(self.ok));
        m.insert("failed".into(), json!(self.failed()));
        m.insert("seconds".into(), json!(self.seconds));
        m.insert("rps".into(), json!(self.rps()));
        m.insert("output_tokens".into(), json!(self.tokens));
        m.insert("out_tok_s".into(), json!(self.out_tok_s()));
        self.latency.json("", &mut m);
        if let Some(s) = &self.stream {
            s.ttft.json("ttft", &mut m);
            s.itl.json("itl", &mut m);
            s.tpot.json("tpot", &mut m);
        }
        m.insert("failures".into(), json!(failures));
        Value::Object(m)
    }
}

/// Nearest-rank percentile of sorted latencies, in milliseconds; NaN when there are none.
fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_deterministic_varied_and_sized() {
        assert_eq!(prompt(7, 32), prompt(7, 32));
        assert_ne!(prompt(7, 32), prompt(8, 32));
        assert_eq!(prompt(3, 32).split(' ').count(), 32);
        let distinct: std::collections::HashSet<String> = (0..1000).map(|i| prompt(i, 8)).collect();
        assert!(distinct.len() > 990, "{}", distinct.len());
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let l: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile_ms(&l, 0.50), 50.0);
        assert_eq!(percentile_ms(&l, 0.99), 99.0);
        assert_eq!(percentile_ms(&l[..1], 0.99), 1.0);
        assert!(percentile_ms(&[], 0.5).is_nan());
    }

    #[test]
    fn answers_are_checked_for_completeness() {
        assert_eq!(json_complete(r#"{"choices":[{"text":"x"}]}"#), Ok(None));
        assert_eq!(json_complete(r#"{"choices":[{"text":"x"}],"usage":{"completion_tokens":3}}"#), Ok(Some(3)));
        assert_eq!(json_complete(r#"{"choices":[]}"#), Err("bad_body"));
        assert_eq!(json_complete("nope"), Err("bad_body"));
        let stream = |parts: &[&str]| {
            let mut sse = SseTimer::new(Instant::now());
            for p in parts {
                sse.feed(p.as_bytes(), Instant::now())?;
            }
            sse.finish().map(|t| t.tokens)
        };
        assert_eq!(stream(&["data: {\"choices\":[]}\n\ndata: [DONE]\n\n"]), Ok(0));
        assert_eq!(stream(&["data: {\"choices\":[]}\n\n"]), Err("stream_truncated"));
        assert_eq!(stream(&["data: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n"]), Err("stream_error"));
        // Events split anywhere across reads; completion text and chat deltas both count.
        let events = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n\
                      data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n";
        let (a, b) = events.split_at(20);
        assert_eq!(stream(&[a, b]), Ok(2));
        // Escaped text (not borrowable) counts; null choices, text or error do not, and are no
        // error; a field of the wrong type makes the stream malformed.
        assert_eq!(stream(&["data: {\"choices\":[{\"text\":\"\\u00e9\\n\"}]}\n\ndata: [DONE]\n\n"]), Ok(1));
        assert_eq!(stream(&["data: {\"choices\":null}\n\ndata: {\"choices\":[{\"text\":null}]}\n\ndata: [DONE]\n\n"]), Ok(0));
        assert_eq!(stream(&["data: {\"error\":null,\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n"]), Ok(1));
        assert_eq!(stream(&["data: {\"choices\":[{\"text\":7}]}\n\ndata: [DONE]\n\n"]), Err("bad_stream"));
    }

    #[test]
    fn streaming_figures_follow_vllms_definitions() {
        let ms = Duration::from_millis;
        // Two requests: 3 tokens (ttft 10, gaps 2 and 4, latency 20) and 1 token (ttft 5).
        let timings = vec![
            Timing { latency: ms(20), tokens: 3, ttft: Some(ms(10)), itl: vec![ms(2), ms(4)] },
            Timing { latency: ms(6), tokens: 1, ttft: Some(ms(5)), itl: vec![] },
        ];
        let s = Summary::new(2, timings, Duration::from_secs(2), true);
        let st = s.stream.as_ref().expect("streaming figures");
        assert_eq!(st.ttft.0, [5.0, 10.0, 10.0]);
        assert_eq!(st.itl.0, [2.0, 4.0, 4.0]);
        // (20 - 10) / (3 - 1); the one-token request has no TPOT.
        assert_eq!(st.tpot.0, [5.0, 5.0, 5.0]);
        assert_eq!(s.out_tok_s(), 2.0);
        let line = s.line();
        assert!(line.contains(" out_tok_s=2.0 ttft_p50_ms=5.00 ttft_p90_ms=10.00 ttft_p99_ms=10.00 itl_p50_ms=2.00"), "{line}");
        assert!(line.ends_with("tpot_p50_ms=5.00 tpot_p90_ms=5.00 tpot_p99_ms=5.00"), "{line}");
        assert_eq!(s.json(&BTreeMap::new())["tpot_p99_ms"], json!(5.0));
    }

    /// `LoadArgs` from `kvlease load`'s flags, checked into a plan.
    fn plan_of(extra: &[&str]) -> Result<Plan, String> {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            a: LoadArgs,
        }
        let t = T::try_parse_from(std::iter::once("t").chain(extra.iter().copied())).map_err(|e| e.to_string())?;
        Plan::new(&t.a).map_err(|e| e.0)
    }

    #[test]
    fn bad_flags_are_refused() {
        let plan = |extra: &[&str]| plan_of(extra).map(|p| (p.endpoint, p.concurrency));
        assert_eq!(plan(&["--url", "http://127.0.0.1:9/", "--requests", "3"]), Ok(("http://127.0.0.1:9/v1/completions".into(), 3)));
        assert!(plan(&["--concurrency", "0"]).is_err_and(|e| e.contains("--concurrency")));
        assert!(plan(&["--timeout-secs", "0"]).is_err_and(|e| e.contains("--timeout-secs")));
        assert!(plan(&["--url", "localhost:8000"]).is_err_and(|e| e.contains("--url")));
        assert!(plan(&["--url", "ftp://127.0.0.1:9"]).is_err_and(|e| e.contains("--url")));
        assert!(plan(&["--requests", "0"]).is_err_and(|e| e.contains("--requests")));
    }

    /// An `https://` URL needs `--cacert`; a file that is missing, holds no PEM certificate or
    /// a certificate that does not parse is refused naming `--cacert` and the file; `--cacert`
    /// with plain `http://` is refused; a CA certificate makes a client.
    #[test]
    fn https_needs_cacert_and_a_bad_cacert_is_refused_naming_the_flag() {
        let dir = std::env::temp_dir().join(format!("kvlease-load-cacert-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).expect("write");
            path.to_str().expect("utf-8 path").to_string()
        };
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().expect("key");
        let good = file("ca.pem", &ca.self_signed(&key).expect("CA").pem());
        let not_pem = file("not.pem", "this is no certificate\n");
        let broken = file("broken.pem", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
        let missing = dir.join("missing.pem").to_str().expect("utf-8 path").to_string();
        let https = "https://127.0.0.1:9";
        let refused = |extra: &[&str], want: &[&str]| {
            let e = plan_of(extra).and_then(|p| p.client().map_err(|e| e.0)).err().unwrap_or_else(|| panic!("{extra:?} was accepted"));
            assert!(want.iter().all(|w| e.contains(w)), "{extra:?}: {e}");
        };
        refused(&["--url", https], &["--cacert", https]);
        refused(&["--url", https, "--cacert", &missing], &["--cacert", &missing, "cannot read it"]);
        refused(&["--url", https, "--cacert", &not_pem], &["--cacert", &not_pem, "no PEM certificate"]);
        refused(&["--url", https, "--cacert", &broken], &["--cacert", &broken]);
        refused(&["--url", "http://127.0.0.1:9", "--cacert", &good], &["--cacert", "http://"]);
        let plan = plan_of(&["--url", https, "--cacert", &good]).expect("a CA file is accepted");
        assert_eq!(plan.endpoint, "https://127.0.0.1:9/v1/completions");
        plan.client().expect("a client trusting the CA");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
