//! SPEC §10: `/v1/completions` and `/v1/chat/completions`, streaming and not, answer
//! well-formed OpenAI responses, and the streamed text is the non-streamed text.

mod common;

use common::*;
use serde_json::{json, Value};

fn assert_usage(v: &Value) {
    let u = &v["usage"];
    let (p, c, t) = (u["prompt_tokens"].as_u64(), u["completion_tokens"].as_u64(), u["total_tokens"].as_u64());
    assert!(matches!((p, c, t), (Some(p), Some(c), Some(t)) if p > 0 && p + c == t), "usage: {v}");
}

/// Streams a request; returns (concatenated text, finish_reason, every parsed chunk).
async fn stream(url: &str, body: &Value, chat: bool) -> (String, String, Vec<Value>) {
    let r = client().post(url).json(body).send().await.expect("send");
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().expect("ascii").starts_with("text/event-stream"));
    let body = r.text().await.expect("body");
    let events = sse_events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("chunk JSON")).collect();
    let mut text = String::new();
    let mut finish = None;
    for c in &chunks {
        assert!(c.get("error").is_none(), "error chunk: {c}");
        assert_eq!(c["object"], if chat { "chat.completion.chunk" } else { "text_completion" }, "{c}");
        assert!(c["id"].as_str().is_some_and(|id| id.starts_with(if chat { "chatcmpl-" } else { "cmpl-" })));
        for choice in c["choices"].as_array().expect("choices") {
            let piece = if chat { &choice["delta"]["content"] } else { &choice["text"] };
            text.push_str(piece.as_str().unwrap_or_default());
            if let Some(f) = choice["finish_reason"].as_str() {
                assert!(finish.is_none(), "two finish reasons");
                finish = Some(f.to_owned());
            }
        }
    }
    (text, finish.expect("a finish_reason"), chunks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_non_streaming_is_a_well_formed_openai_response() {
    let s = TestServer::start().await;
    let r = client()
        .post(format!("{}/v1/completions", s.url))
        .header("x-request-id", "req-abc")
        .json(&json!({"model": "kvlease-synthetic", "prompt": "Hello lease", "max_tokens": 8, "ignore_eos": true, "temperature": 0}))
        .send()
        .await
        .expect("send");
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-request-id"], "req-abc");
    let v: Value = r.json().await.expect("json");
    assert_eq!(v["id"], "cmpl-req-abc");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "kvlease-synthetic");
    assert!(v["created"].as_u64().is_some_and(|t| t > 1_600_000_000));
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["text"].as_str().is_some_and(|t| !t.is_empty()));
    assert_usage(&v);
    // "Hello" is five byte tokens; " lease" is one of the model's words (model::tokenize).
    assert_eq!(v["usage"]["prompt_tokens"], 6);
    assert_eq!(v["usage"]["completion_tokens"], 8);

    // Token-id prompts and a one-string list are prompts too; without X-Request-Id one is made up and echoed.
    for prompt in [json!([72, 105]), json!(["Hi"])] {
        let r = client()
            .post(format!("{}/v1/completions", s.url))
            .json(&json!({"prompt": prompt, "max_tokens": 2}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200);
        let rid = r.headers()["x-request-id"].to_str().expect("ascii").to_owned();
        let v: Value = r.json().await.expect("json");
        assert_eq!(v["id"], format!("cmpl-{rid}"));
        assert_eq!(v["usage"]["prompt_tokens"], 2);
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_completion_text_equals_non_streamed_text() {
    let s = TestServer::start().await;
    let url = format!("{}/v1/completions", s.url);
    for (prompt, max_tokens) in [("The quiet river", 24), ("x", 1), ("lease renewal under load", 64)] {
        let (status, full) = post(&url, &json!({"prompt": prompt, "max_tokens": max_tokens})).await;
        assert_eq!(status, 200, "{full}");
        let (text, finish, chunks) = stream(
            &url,
            &json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true, "stream_options": {"include_usage": true}}),
            false,
        )
        .await;
        assert_eq!(text, full["choices"][0]["text"].as_str().expect("text"), "prompt {prompt:?}");
        assert_eq!(finish, full["choices"][0]["finish_reason"].as_str().expect("finish"));
        let last = chunks.last().expect("chunks");
        assert_eq!(last["choices"], json!([]), "include_usage: final chunk has no choices");
        assert_eq!(last["usage"], full["usage"]);
    }
    // Without include_usage no chunk carries usage.
    let (_, _, chunks) = stream(&url, &json!({"prompt": "abc", "max_tokens": 3, "stream": true}), false).await;
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_streamed_and_not_are_well_formed_and_agree() {
    let s = TestServer::start().await;
    let url = format!("{}/v1/chat/completions", s.url);
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about leases."}]);
    let (status, full) = post(&url, &json!({"messages": messages, "max_completion_tokens": 20})).await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    assert!(full["id"].as_str().is_some_and(|id| id.starts_with("chatcmpl-")));
    assert_eq!(full["choices"][0]["message"]["role"], "assistant");
    let content = full["choices"][0]["message"]["content"].as_str().expect("content");
    assert!(["stop", "length"].contains(&full["choices"][0]["finish_reason"].as_str().expect("finish")));
    assert_usage(&full);
    let template = kvlease_engine::model::chat_prompt([("system", "Be brief."), ("user", "Tell me about leases.")]);
    assert_eq!(full["usage"]["prompt_tokens"], template.len());

    let (text, finish, chunks) = stream(&url, &json!({"messages": messages, "max_tokens": 20, "stream": true}), true).await;
    assert_eq!(text, content);
    assert_eq!(finish, full["choices"][0]["finish_reason"].as_str().expect("finish"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant", "first chunk announces the role");
    s.stop().await;
}
