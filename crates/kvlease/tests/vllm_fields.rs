//! SPEC §10 (issue 9): request fields behave as in vLLM — over real processes (P, D, the proxy,
//! and a local engine) and a real HTTP client — and a disaggregated answer equals the local one
//! for every sampling setting (SPEC D7, with a seed).

mod common;
use common::*;
use kvlease_engine::model;
use serde_json::{json, Value};
use std::time::Duration;

struct Cluster {
    p: Proc,
    _d: Proc,
    local: Proc,
    proxy: Proc,
}

fn cluster() -> Cluster {
    let cfg = lease_config(30.0);
    let p = Proc::serve("f-p", &["--kv-transfer-config", &cfg]);
    let d = Proc::serve("f-d", &["--kv-transfer-config", &cfg]);
    let local = Proc::serve("f-local", &[]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    Cluster { p, _d: d, local, proxy }
}

/// Every SSE event's JSON (without `[DONE]`, which must be last).
async fn sse(url: &str, body: &Value) -> Vec<Value> {
    let r = client().post(url).json(body).send().await.expect("send");
    assert_eq!(r.status().as_u16(), 200);
    let text = r.text().await.expect("body");
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).expect("chunk JSON")).collect()
}

/// The text of choice `index` across stream chunks (completions).
fn streamed_text(chunks: &[Value], index: u64) -> String {
    chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
        .filter(|c| c["index"] == index)
        .filter_map(|c| c["text"].as_str().map(str::to_owned))
        .collect()
}

fn finish_of(chunks: &[Value], index: u64) -> Value {
    chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
        .find(|c| c["index"] == index && !c["finish_reason"].is_null())
        .unwrap_or_else(|| panic!("no finish chunk for choice {index}"))
}

/// `stop` (excluded, across tokens and chunks, `finish_reason` stop), `stop_token_ids`,
/// `min_tokens`, `echo`, `stream_options.include_usage`, `max_completion_tokens`, through the
/// proxy and locally, equal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_stop_ids_min_tokens_echo_and_usage_behave_as_in_vllm() {
    let c = cluster();
    let prompt = "The lease on the prefill engine's blocks";
    let cmpl = |base: &str| format!("{base}/v1/completions");
    let (s, base) = post(&cmpl(&c.local.url), &json!({"prompt": prompt, "max_tokens": 12, "ignore_eos": true})).await;
    assert_eq!(s, 200);
    let full = text_of(&base, false);
    let words: Vec<&str> = full.split(' ').filter(|w| !w.is_empty()).collect();
    assert!(words.len() >= 6, "{full}");
    // A stop string that spans two tokens: the end of word 3 and the start of word 4.
    let (w3, w4) = (words[3], words[4]);
    let stop = format!("{} {}", &w3[w3.len() - 2..], &w4[..2]);
    let want = &full[..full.find(&stop).expect("stop in text")];
    for url in [cmpl(&c.proxy.url), cmpl(&c.local.url)] {
        let body = json!({"prompt": prompt, "max_tokens": 12, "ignore_eos": true, "stop": ["zzz-never", stop]});
        let (s, v) = post(&url, &body).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(text_of(&v, false), want, "stop string excluded, nothing after it");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["choices"][0]["stop_reason"], json!(stop));
        let mut stream_body = body.clone();
        stream_body["stream"] = json!(true);
        stream_body["stream_options"] = json!({"include_usage": true});
        let chunks = sse(&url, &stream_body).await;
        assert_eq!(streamed_text(&chunks, 0), want, "streamed: the same text");
        let pieces: Vec<String> = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
            .filter_map(|c| c["text"].as_str().map(str::to_owned))
            .collect();
        assert!(pieces.len() >= 3, "the text came in several chunks: {pieces:?}");
        assert_eq!(finish_of(&chunks, 0)["finish_reason"], "stop");
        let usage = chunks.last().expect("usage chunk");
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"]["prompt_tokens"], model::tokenize(prompt).len());
        assert_eq!(usage["usage"]["completion_tokens"], v["usage"]["completion_tokens"]);

        // include_stop_str_in_output keeps it.
        let (_, v) =
            post(&url, &json!({"prompt": prompt, "max_tokens": 12, "ignore_eos": true, "stop": stop, "include_stop_str_in_output": true}))
                .await;
        assert_eq!(text_of(&v, false), format!("{want}{stop}"));

        // min_tokens: no stop before it.
        let (_, v) = post(&url, &json!({"prompt": prompt, "max_tokens": 12, "ignore_eos": true, "stop": stop, "min_tokens": 8})).await;
        assert_eq!(text_of(&v, false), full, "the stop string fell under min_tokens");

        // stop_token_ids: the id of word 2 ends the completion with that word, stop_reason the id.
        let id = (model::FIRST_WORD..model::EOS).find(|&t| model::detokenize(t) == format!(" {}", words[2])).expect("word id");
        let (_, v) = post(&url, &json!({"prompt": prompt, "max_tokens": 12, "ignore_eos": true, "stop_token_ids": [id]})).await;
        let upto: String = words.iter().take_while(|w| **w != words[2]).map(|w| format!(" {w}")).collect::<String>() + " " + words[2];
        assert_eq!(text_of(&v, false), upto);
        assert_eq!((v["choices"][0]["finish_reason"].clone(), v["choices"][0]["stop_reason"].clone()), (json!("stop"), json!(id)));

        // echo: the prompt, then the completion.
        let (_, v) = post(&url, &json!({"prompt": prompt, "max_tokens": 12, "ignore_eos": true, "echo": true})).await;
        assert_eq!(text_of(&v, false), format!("{prompt}{full}"));
    }
    // max_completion_tokens (chat) counts as max_tokens.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "ignore_eos": true});
    for base in [&c.proxy.url, &c.local.url] {
        let (_, v) = post(&format!("{base}/v1/chat/completions"), &chat).await;
        assert_eq!((v["usage"]["completion_tokens"].clone(), v["choices"][0]["finish_reason"].clone()), (json!(3), json!("length")));
    }
    // A list of prompts (and token-id prompts) through the proxy: one choice per prompt, each
    // equal to the local answer.
    let batch = json!({"prompt": ["first prompt of a batch", [84, 104, 101]], "max_tokens": 4, "ignore_eos": true});
    let (s, local) = post(&cmpl(&c.local.url), &batch).await;
    let (s2, disagg) = post(&cmpl(&c.proxy.url), &batch).await;
    assert_eq!((s, s2), (200, 200), "{disagg}");
    assert_eq!(local["choices"].as_array().map(Vec::len), Some(2));
    assert_eq!(disagg["choices"], local["choices"]);
    until("P holds no lease", Duration::from_secs(5), || async { metric(&c.p.url, "kvlease_leased_blocks").await == 0.0 }).await;
}

/// `n`, `seed`, `temperature`/`top_p`/`top_k` and `logprobs`/`top_logprobs` in both endpoints'
/// shapes: through the proxy equal to local for the same seed (SPEC D7), seeded sampling differs
/// from greedy, and every lease is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_sampling_n_and_logprobs_disaggregated_equal_local() {
    let c = cluster();
    let prompt = "Sampling over the synthetic model's distribution";
    let mut differs_from_greedy = false;
    for (i, knobs) in [
        json!({"temperature": 0}),
        json!({"temperature": 1.0, "seed": 1}),
        json!({"temperature": 1.5, "top_p": 0.9, "seed": 2}),
        json!({"temperature": 0.8, "top_k": 5, "seed": 3}),
    ]
    .into_iter()
    .enumerate()
    {
        let mut body = json!({"prompt": prompt, "max_tokens": 10, "ignore_eos": true, "n": 3, "logprobs": 2});
        body.as_object_mut().expect("object").extend(knobs.as_object().expect("object").clone());
        let (s, local) = post(&format!("{}/v1/completions", c.local.url), &body).await;
        assert_eq!(s, 200, "{local}");
        let (s, disagg) = post(&format!("{}/v1/completions", c.proxy.url), &body).await;
        assert_eq!(s, 200, "{disagg}");
        let choices = local["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), 3);
        for (j, ch) in choices.iter().enumerate() {
            assert_eq!(ch["index"], j);
            let lp = &ch["logprobs"];
            assert_eq!(lp["tokens"].as_array().map(Vec::len), Some(10), "{lp}");
            assert!(lp["token_logprobs"][0].as_f64().is_some_and(|l| l <= 0.0), "{lp}");
            assert!(lp["top_logprobs"][0].as_object().is_some_and(|m| (2..=3).contains(&m.len())), "{lp}");
            assert_eq!(lp["text_offset"][0], 0);
        }
        assert_eq!(local["usage"]["completion_tokens"], 30);
        assert_eq!(local["usage"]["prompt_tokens"], model::tokenize(prompt).len(), "each prompt counted once, whatever n");
        let texts = |v: &Value| v["choices"].as_array().expect("choices").iter().map(|c| c["text"].clone()).collect::<Vec<_>>();
        assert_eq!(texts(&disagg), texts(&local), "D7: disaggregated == local for {body}");
        assert_eq!(disagg["choices"][1]["logprobs"], local["choices"][1]["logprobs"]);
        if i > 0 {
            differs_from_greedy |= texts(&local)[0] != texts(&local)[1];
            // Streaming gives the same choices.
            body["stream"] = json!(true);
            let chunks = sse(&format!("{}/v1/completions", c.proxy.url), &body).await;
            for j in 0..3u64 {
                assert_eq!(json!(streamed_text(&chunks, j)), texts(&local)[j as usize], "streamed choice {j}");
            }
        }
    }
    assert!(differs_from_greedy, "seed + j gives the n choices different samples");

    // Chat: logprobs: true, top_logprobs: 2, in the chat shape; seeded, equal through the proxy.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": true,
                      "temperature": 1.0, "seed": 9, "logprobs": true, "top_logprobs": 2});
    let (_, local) = post(&format!("{}/v1/chat/completions", c.local.url), &chat).await;
    let (_, disagg) = post(&format!("{}/v1/chat/completions", c.proxy.url), &chat).await;
    assert_eq!(disagg["choices"], local["choices"]);
    let content = local["choices"][0]["logprobs"]["content"].as_array().expect("chat logprobs content");
    assert_eq!(content.len(), 5);
    assert!(content[0]["token"].is_string() && content[0]["logprob"].is_number() && content[0]["bytes"].is_array());
    assert_eq!(content[0]["top_logprobs"].as_array().map(Vec::len), Some(2));
    until("P holds no lease", Duration::from_secs(5), || async { metric(&c.p.url, "kvlease_leased_blocks").await == 0.0 }).await;
}

/// SPEC §10, as vLLM: a chat without `max_tokens` generates up to the rest of the context
/// (`--max-model-len` minus the prompt), not 16 tokens; completions keep OpenAI's 16; through
/// the proxy the answer equals the local one (D7).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_without_max_tokens_runs_to_the_end_of_the_context_as_in_vllm() {
    let cfg = lease_config(30.0);
    let short = ["--max-model-len", "96", "--kv-transfer-config", &cfg];
    let p = Proc::serve("ctx-p", &short);
    let d = Proc::serve("ctx-d", &short);
    let local = Proc::serve("ctx-local", &["--max-model-len", "96"]);
    let proxy = Proc::proxy(&[&p], &[&d]);
    let chat = json!({"model": "kvlease-synthetic", "messages": [{"role": "user", "content": "tell me about leases"}], "ignore_eos": true});
    let (status, want) = post(&format!("{}/v1/chat/completions", local.url), &chat).await;
    assert_eq!(status, 200, "{want}");
    let (prompt, completion) =
        (want["usage"]["prompt_tokens"].as_u64().expect("prompt"), want["usage"]["completion_tokens"].as_u64().expect("completion"));
    assert_eq!(prompt + completion, 96, "up to the end of the context: {want}");
    assert_eq!(want["choices"][0]["finish_reason"], "length");
    let (status, got) = post(&format!("{}/v1/chat/completions", proxy.url), &chat).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["choices"][0]["message"]["content"], want["choices"][0]["message"]["content"]);
    let completion = json!({"model": "kvlease-synthetic", "prompt": "tell me about leases", "ignore_eos": true});
    let (status, body) = post(&format!("{}/v1/completions", local.url), &completion).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 16, "completions keep OpenAI's default");
}
