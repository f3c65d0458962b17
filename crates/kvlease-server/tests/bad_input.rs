//! SPEC §10: bad input gets a 4xx with an OpenAI-style JSON error naming the problem, never a
//! 5xx or a crash.

mod common;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_completion_bodies_get_openai_4xx_json_naming_the_field_never_5xx() {
    let s = TestServer::start().await;
    let url = format!("{}/v1/completions", s.url);
    let cases: Vec<(Value, u16, Option<&str>)> = vec![
        (json!({}), 400, Some("prompt")),
        (json!({"prompt": ""}), 400, Some("prompt")),
        (json!({"prompt": []}), 400, Some("prompt")),
        (json!({"prompt": 42}), 400, Some("prompt")),
        (json!({"prompt": ["a", ""]}), 400, Some("prompt")),
        (json!({"prompt": [1, -2]}), 400, Some("prompt")),
        (json!({"prompt": [1, "x"]}), 400, Some("prompt")),
        (json!({"prompt": [999_999]}), 400, Some("prompt")),
        (json!({"prompt": [4_294_967_296u64]}), 400, Some("prompt")),
        (json!({"prompt": "hi", "max_tokens": 0}), 400, Some("max_tokens")),
        (json!({"prompt": "hi", "max_tokens": -1}), 400, Some("max_tokens")),
        (json!({"prompt": "hi", "max_tokens": "16"}), 400, Some("max_tokens")),
        (json!({"prompt": "hi", "max_tokens": 1.5}), 400, Some("max_tokens")),
        (json!({"prompt": "hi", "max_tokens": 1_000_000_000}), 400, None),
        (json!({"prompt": "hi", "max_tokens": 1e300}), 400, Some("max_tokens")),
        (json!({"prompt": "hi", "n": 0}), 400, Some("n")),
        (json!({"prompt": "hi", "tools": [{"type": "function"}]}), 400, Some("tools")),
        (json!({"prompt": "hi", "stop": 3}), 400, Some("stop")),
        (json!({"prompt": "hi", "logprobs": 99}), 400, Some("logprobs")),
        (json!({"prompt": "hi", "presence_penalty": 1.0}), 400, Some("presence_penalty")),
        (json!({"prompt": "hi", "stream": "yes"}), 400, Some("stream")),
        (json!({"prompt": "hi", "temperature": "warm"}), 400, Some("temperature")),
        (json!({"prompt": "hi", "stream_options": {"include_usage": true}}), 400, Some("stream_options")),
        (json!({"prompt": "hi", "kv_transfer_params": "x"}), 400, Some("kv_transfer_params")),
        (json!({"prompt": "hi", "model": "gpt-4"}), 404, Some("model")),
        (json!({"prompt": "hi", "model": 7}), 400, Some("model")),
    ];
    for (body, want_status, want_param) in cases {
        let (status, resp) = post(&url, &body).await;
        assert_eq!(status, want_status, "{body} → {resp}");
        let e = assert_openai_error(status, &resp);
        if let Some(p) = want_param {
            assert_eq!(e["param"], p, "{body} → {resp}");
        }
    }
    let (_, resp) = post(&url, &json!({"prompt": "hi", "model": "gpt-4"})).await;
    assert_eq!((resp["error"]["code"].clone(), resp["error"]["type"].clone()), (json!(404), json!("NotFoundError")));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chat_bodies_get_openai_4xx_json_never_5xx() {
    let s = TestServer::start().await;
    let url = format!("{}/v1/chat/completions", s.url);
    for body in [
        json!({}),
        json!({"messages": []}),
        json!({"messages": "hello"}),
        json!({"messages": [{"role": "user"}, 3]}),
        json!({"messages": [{"content": "no role"}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}),
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}),
        json!({"messages": [{"role": "user", "content": "hi"}], "n": -3}),
        json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}),
        json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}),
    ] {
        let (status, resp) = post(&url, &body).await;
        assert_eq!(status, 400, "{body} → {resp}");
        assert_openai_error(status, &resp);
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_content_types_and_huge_bodies_are_4xx_json() {
    let s = TestServer::start().await;
    let url = format!("{}/v1/completions", s.url);
    let raw = |body: Vec<u8>, content_type: &'static str| {
        let url = url.clone();
        async move {
            let r = client().post(&url).header("content-type", content_type).body(body).send().await.expect("send");
            let status = r.status().as_u16();
            let text = r.text().await.expect("body");
            (status, serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}")))
        }
    };
    for bad in [&b"{not json"[..], b"", b"[1,2]", b"\"prompt\"", b"null", b"{\"prompt\": \"a\"", b"\xff\xfe"] {
        let (status, resp) = raw(bad.to_vec(), "application/json").await;
        assert_eq!(status, 400, "{:?} → {resp}", String::from_utf8_lossy(bad));
        assert_openai_error(status, &resp);
    }
    let (status, resp) = raw(b"prompt=hi".to_vec(), "application/x-www-form-urlencoded").await;
    assert_eq!(status, 415, "{resp}");
    assert_openai_error(status, &resp);

    let mut huge = br#"{"prompt": ""#.to_vec();
    huge.resize(kvlease_server::MAX_BODY_BYTES + (1 << 20), b'a');
    huge.extend_from_slice(br#""}"#);
    let (status, resp) = raw(huge, "application/json").await;
    assert_eq!(status, 413, "{resp}");
    assert_openai_error(status, &resp);

    // Unknown paths and methods are JSON errors too.
    let r = client().get(format!("{}/v1/nope", s.url)).send().await.expect("send");
    let status = r.status().as_u16();
    assert_eq!(status, 404);
    assert_openai_error(status, &r.json::<Value>().await.expect("json"));
    let r = client().get(&url).send().await.expect("send");
    let status = r.status().as_u16();
    assert_eq!(status, 405);
    assert_openai_error(status, &r.json::<Value>().await.expect("json"));

    // And the server still serves.
    let (status, resp) = post(&url, &json!({"prompt": "still alive", "max_tokens": 2})).await;
    assert_eq!(status, 200, "{resp}");
    s.stop().await;
}
