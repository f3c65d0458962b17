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
//! `requests=N ok=N failed=N seconds=S rps=R p50_ms=… p99_ms=…` (rps counts successful requests;
//! latencies are those of successful requests, `NaN` if there were none), then a JSON line with
//! the same numbers if `--json`; failures by kind go to stderr. The command fails (exit code 1)
//! if any request failed.

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
    /// Base URL of a `kvlease serve` or `kvlease proxy` (or any vLLM-compatible server).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
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
        if parsed.scheme() != "http" || parsed.host().is_none() {
            return Err(InvalidConfig(format!("--url {:?} must be an http:// URL with a host", a.url)));
        }
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

/// How one request ended.
enum Outcome {
    Ok(Duration),
    /// A failure kind: `http_503`, `timeout`, `connect`, `bad_body`, `stream_error`, ….
    Failed(String),
}

/// What every worker reports.
#[derive(Default)]
struct Tally {
    latencies: Vec<Duration>,
    failures: BTreeMap<String, usize>,
}

/// Runs the load; fails (exit code 1) if any request failed.
pub async fn run(args: LoadArgs) -> anyhow::Result<()> {
    let plan = Arc::new(Plan::new(&args)?);
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(plan.timeout)
        .connect_timeout(plan.timeout)
        .pool_max_idle_per_host(plan.concurrency)
        .build()
        .context("cannot build the HTTP client")?;
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let deadline = start + plan.max_run;
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..plan.concurrency {
        let (plan, client, next) = (plan.clone(), client.clone(), next.clone());
        workers.spawn(async move {
            let mut tally = Tally::default();
            while Instant::now() < deadline {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= plan.requests {
                    break;
                }
                match one(&client, &plan, i).await {
                    Outcome::Ok(d) => tally.latencies.push(d),
                    Outcome::Failed(kind) => *tally.failures.entry(kind).or_default() += 1,
                }
            }
            tally
        });
    }
    let mut all = Tally::default();
    while let Some(joined) = workers.join_next().await {
        let t = joined.context("a load worker panicked")?;
        all.latencies.extend(t.latencies);
        for (k, n) in t.failures {
            *all.failures.entry(k).or_default() += n;
        }
    }
    let elapsed = start.elapsed();
    let started = next.load(Ordering::Relaxed).min(plan.requests);
    if started < plan.requests {
        all.failures.insert("not_started_run_deadline".into(), plan.requests - started);
    }
    let summary = Summary::new(plan.requests, all.latencies, elapsed);
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
    let resp = match client.post(&plan.endpoint).json(&plan.body(index)).send().await {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(transport_kind(&e).into()),
    };
    let status = resp.status().as_u16();
    let text = match resp.text().await {
        Ok(t) => t,
        Err(e) => return Outcome::Failed(transport_kind(&e).into()),
    };
    if status != 200 {
        return Outcome::Failed(format!("http_{status}"));
    }
    let complete = if plan.stream { stream_complete(&text) } else { json_complete(&text) };
    match complete {
        Ok(()) => Outcome::Ok(t0.elapsed()),
        Err(kind) => Outcome::Failed(kind.into()),
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

/// A non-streaming answer: a JSON object with at least one choice.
fn json_complete(text: &str) -> Result<(), &'static str> {
    let v: Value = serde_json::from_str(text).map_err(|_| "bad_body")?;
    match v.get("choices").and_then(Value::as_array) {
        Some(c) if !c.is_empty() => Ok(()),
        _ => Err("bad_body"),
    }
}

/// A streamed answer: JSON chunks without an `error`, ending with `data: [DONE]`.
fn stream_complete(text: &str) -> Result<(), &'static str> {
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).map_err(|_| "bad_stream")?;
        if v.get("error").is_some() {
            return Err("stream_error");
        }
    }
    if done {
        Ok(())
    } else {
        Err("stream_truncated")
    }
}

/// The numbers of a finished run.
#[derive(Debug)]
struct Summary {
    requests: usize,
    ok: usize,
    seconds: f64,
    p50_ms: f64,
    p99_ms: f64,
}

impl Summary {
    fn new(requests: usize, mut latencies: Vec<Duration>, elapsed: Duration) -> Summary {
        latencies.sort_unstable();
        Summary {
            requests,
            ok: latencies.len(),
            seconds: elapsed.as_secs_f64(),
            p50_ms: percentile_ms(&latencies, 0.50),
            p99_ms: percentile_ms(&latencies, 0.99),
        }
    }

    fn failed(&self) -> usize {
        self.requests - self.ok
    }

    /// Successful requests per second.
    fn rps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.ok as f64 / self.seconds
        } else {
            0.0
        }
    }

    fn line(&self) -> String {
        format!(
            "requests={} ok={} failed={} seconds={:.3} rps={:.1} p50_ms={:.2} p99_ms={:.2}",
            self.requests,
            self.ok,
            self.failed(),
            self.seconds,
            self.rps(),
            self.p50_ms,
            self.p99_ms
        )
    }

    fn json(&self, failures: &BTreeMap<String, usize>) -> Value {
        // NaN (no successful request) is not JSON: it becomes null.
        let num = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({
            "requests": self.requests,
            "ok": self.ok,
            "failed": self.failed(),
            "seconds": self.seconds,
            "rps": self.rps(),
            "p50_ms": num(self.p50_ms),
            "p99_ms": num(self.p99_ms),
            "failures": failures,
        })
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
        assert!(json_complete(r#"{"choices":[{"text":"x"}]}"#).is_ok());
        assert_eq!(json_complete(r#"{"choices":[]}"#), Err("bad_body"));
        assert_eq!(json_complete("nope"), Err("bad_body"));
        assert!(stream_complete("data: {\"choices\":[]}\n\ndata: [DONE]\n\n").is_ok());
        assert_eq!(stream_complete("data: {\"choices\":[]}\n\n"), Err("stream_truncated"));
        assert_eq!(stream_complete("data: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n"), Err("stream_error"));
    }

    #[test]
    fn summary_line_and_json() {
        let s = Summary::new(4, vec![Duration::from_millis(2), Duration::from_millis(4)], Duration::from_secs(2));
        assert_eq!(s.line(), "requests=4 ok=2 failed=2 seconds=2.000 rps=1.0 p50_ms=2.00 p99_ms=4.00");
        let none = Summary::new(1, vec![], Duration::from_secs(1));
        assert!(none.line().ends_with("p50_ms=NaN p99_ms=NaN"), "{}", none.line());
        assert_eq!(none.json(&BTreeMap::new())["p50_ms"], Value::Null);
    }

    #[test]
    fn bad_flags_are_refused() {
        use clap::Parser;
        #[derive(Parser)]
        struct T {
            #[command(flatten)]
            a: LoadArgs,
        }
        let plan = |extra: &[&str]| {
            let t = T::try_parse_from(std::iter::once("t").chain(extra.iter().copied())).map_err(|e| e.to_string())?;
            Plan::new(&t.a).map(|p| (p.endpoint, p.concurrency)).map_err(|e| e.0)
        };
        assert_eq!(plan(&["--url", "http://127.0.0.1:9/", "--requests", "3"]), Ok(("http://127.0.0.1:9/v1/completions".into(), 3)));
        assert!(plan(&["--concurrency", "0"]).is_err_and(|e| e.contains("--concurrency")));
        assert!(plan(&["--timeout-secs", "0"]).is_err_and(|e| e.contains("--timeout-secs")));
        assert!(plan(&["--url", "localhost:8000"]).is_err_and(|e| e.contains("--url")));
        assert!(plan(&["--requests", "0"]).is_err_and(|e| e.contains("--requests")));
    }
}
