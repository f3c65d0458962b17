//! Issue 9: `kvlease serve` takes vLLM's command line and endpoints — positional MODEL,
//! `--served-model-name`, `-tp`/`--tensor-parallel-size`, `--api-key` (and the proxy forwards
//! `Authorization`), `VLLM_NIXL_SIDE_CHANNEL_PORT`, `/version` `/ping` `/tokenize` `/detokenize`
//! — and vLLM flags that mean nothing here are accepted with one warning each, never silently.

mod common;
use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

/// `kvlease serve` with these arguments and environment; its URL, start-up line and stderr.
struct Serve {
    child: Child,
    url: String,
    banner: String,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Serve {
    fn start(args: &[&str], env: &[(&str, &str)]) -> Serve {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvlease"));
        cmd.args(["serve", "--port", "0", "--log-level", "warn"])
            .args(args)
            .env("KVLEASE_TRANSFER_SECRET", SECRET)
            .env_remove("VLLM_API_KEY");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (kept, err) = (stderr.clone(), child.stderr.take().expect("stderr"));
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                kept.lock().expect("stderr").push(l);
            }
        });
        let mut banner = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut banner).expect("start-up line");
        let Some(url) = banner.split_whitespace().find(|w| w.starts_with("http://")).map(str::to_string) else {
            // It stopped before its start-up line: say why (its stderr, read to its end).
            let status = child.wait().expect("wait");
            let t0 = std::time::Instant::now();
            while t0.elapsed() < std::time::Duration::from_secs(5) && stderr.lock().expect("stderr").is_empty() {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            panic!("no url in {banner:?}; serve exited with {status}: {:?}", stderr.lock().expect("stderr"));
        };
        Serve { child, url, banner, stderr }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn get(url: &str, key: Option<&str>) -> (u16, Value) {
    let mut r = client().get(url);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.expect("send");
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

async fn post_key(url: &str, body: &Value, key: Option<&str>) -> (u16, Value) {
    let mut r = client().post(url).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.expect("send");
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_command_line_endpoints_and_api_key() {
    // Below Linux's ephemeral range (32768–60999), so no outgoing connection of another test
    // takes it between this check and the engine's bind.
    let start = 20_000 + (std::process::id() % 10_000) as u16;
    let free = (start..32_768).chain(20_000..start).find(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok()).expect("a free port");
    let s = Serve::start(
        &[
            "org/some-model",
            "-tp",
            "2",
            "--served-model-name",
            "alpha",
            "beta",
            "--api-key",
            "k3y",
            "--dtype",
            "bfloat16",
            "--gpu-memory-utilization",
            "0.9",
            "--enforce-eager",
            "--max-num-batched-tokens",
            "2048",
            "--pipeline-parallel-size",
            "1",
        ],
        &[("VLLM_NIXL_SIDE_CHANNEL_PORT", &free.to_string())],
    );
    assert!(s.banner.contains(&format!(":{free})")), "VLLM_NIXL_SIDE_CHANNEL_PORT is the side channel's port: {}", s.banner);
    let (st, v) = get(&format!("{}/v1/models", s.url), None).await;
    assert_eq!((st, v["error"]["code"].clone()), (401, json!(401)), "{v}");
    let (st, v) = get(&format!("{}/v1/models", s.url), Some("k3y")).await;
    assert_eq!(st, 200);
    let ids: Vec<&str> = v["data"].as_array().expect("data").iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, ["alpha", "beta"]);
    let url = format!("{}/v1/completions", s.url);
    let (st, v) = post_key(&url, &json!({"model": "beta", "prompt": "hi", "max_tokens": 2}), Some("wrong")).await;
    assert_eq!(st, 401, "{v}");
    let (st, v) = post_key(&url, &json!({"model": "beta", "prompt": "hi", "max_tokens": 2}), Some("k3y")).await;
    assert_eq!((st, v["model"].clone()), (200, json!("alpha")), "{v}");
    let (st, _) = post_key(&url, &json!({"model": "org/some-model", "prompt": "hi"}), Some("k3y")).await;
    assert_eq!(st, 404, "--served-model-name replaces the positional name");
    let (st, v) = get(&format!("{}/version", s.url), None).await;
    assert!(st == 200 && v["version"].is_string(), "{v}");
    assert_eq!(client().get(format!("{}/ping", s.url)).send().await.expect("ping").status(), 200);
    let (st, v) = post_key(&format!("{}/tokenize", s.url), &json!({"model": "alpha", "prompt": "héllo"}), None).await;
    assert_eq!((st, v["count"].clone(), v["max_model_len"].clone()), (200, json!(6), json!(4096)), "{v}");
    let (st, back) = post_key(&format!("{}/detokenize", s.url), &json!({"tokens": v["tokens"]}), None).await;
    assert_eq!((st, back["prompt"].clone()), (200, json!("héllo")));
    let (st, v) = post_key(&format!("{}/tokenize", s.url), &json!({"messages": [{"role": "user", "content": "hi"}]}), None).await;
    assert_eq!((st, v["count"].clone()), (200, json!(kvlease_engine::model::chat_prompt([("user", "hi")]).len())));
    let (st, v) = post_key(&format!("{}/detokenize", s.url), &json!({"tokens": [999999]}), None).await;
    assert_eq!((st, v["error"]["param"].clone()), (400, json!("tokens")));
    let warnings = s.stderr.lock().expect("stderr").clone();
    for flag in ["--dtype bfloat16", "--gpu-memory-utilization 0.9", "--enforce-eager", "--max-num-batched-tokens 2048"] {
        assert_eq!(
            warnings.iter().filter(|l| l.contains(&format!("vLLM flag {flag}"))).count(),
            1,
            "one warning for {flag}: {warnings:#?}"
        );
    }
}

/// Parallelism kvlease does not have is refused at start-up (exit 2), naming the flag.
#[test]
fn pipeline_parallelism_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvlease")).args(["serve", "m", "-pp", "2"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("-pp 2"));
}

/// The proxy forwards `Authorization` to both legs: engines with `--api-key` behind it work for
/// a client that has the key, and refuse one that has not (401 passed through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_forwards_the_api_key() {
    let cfg = lease_config(30.0);
    let p = Proc::serve("key-p", &["--kv-transfer-config", &cfg, "--api-key", "k"]);
    let d = Proc::serve("key-d", &["--kv-transfer-config", &cfg, "--api-key", "k"]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let url = format!("{}/v1/completions", proxy.url);
    let body = json!({"prompt": "behind a key", "max_tokens": 3});
    assert_eq!(post_key(&url, &body, None).await.0, 401);
    let (st, v) = post_key(&url, &body, Some("k")).await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = get(&format!("{}/v1/models", proxy.url), Some("k")).await;
    assert_eq!((st, v["data"][0]["id"].clone()), (200, json!("kvlease-synthetic")));
}
