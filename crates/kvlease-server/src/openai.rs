//! The OpenAI request and response shapes of `/v1/completions` and `/v1/chat/completions`.
//!
//! Requests are read field by field from a JSON object rather than through serde derive, so that
//! each wrong field gets a message and a `param` naming it. Unknown fields and sampling knobs the
//! synthetic model has no use for (temperature, top_p, seed, …) are accepted and ignored, as
//! vLLM does; the ones whose meaning we could not honour (n > 1, echo) are refused.

use crate::body::kind_of;
use crate::error::ApiError;
use kvlease_engine::{model, FinishReason, Prompt};
use serde_json::{json, Map, Value};

/// Default `max_tokens` when the request gives none (OpenAI's default for completions).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// Which endpoint a request came in on: decides the prompt field and the response shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A validated completion request, either endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: u32,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    pub kv_transfer_params: Option<Value>,
}

/// Typed access to the request's fields; every error names the field.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    /// The field, with JSON `null` read as absent.
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid(name, format!("`{name}` must be a boolean, got {}", kind_of(v)))),
        }
    }

    fn string(&self, name: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::invalid(name, format!("`{name}` must be a string, got {}", kind_of(v)))),
        }
    }

    /// An integer; a float with no fraction (`16.0`) is accepted as pydantic does.
    fn int(&self, name: &str) -> Result<Option<i128>, ApiError> {
        let Some(v) = self.get(name) else { return Ok(None) };
        let bad = || ApiError::invalid(name, format!("`{name}` must be an integer, got {v}"));
        match v {
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Ok(Some(i128::from(i)))
                } else if let Some(u) = n.as_u64() {
                    Ok(Some(i128::from(u)))
                } else {
                    match n.as_f64() {
                        Some(f) if f.fract() == 0.0 && f.abs() < 1e30 => Ok(Some(f as i128)),
                        _ => Err(bad()),
                    }
                }
            }
            _ => Err(bad()),
        }
    }

    fn number(&self, name: &str) -> Result<Option<f64>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(v) => Err(ApiError::invalid(name, format!("`{name}` must be a number, got {}", kind_of(v)))),
        }
    }
}

/// A `max_tokens`-like field: at least 1 and fitting the engine's u32.
fn max_tokens(f: &Fields, name: &str) -> Result<Option<u32>, ApiError> {
    match f.int(name)? {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::invalid(name, format!("`{name}` must be at least 1, got {n}"))),
        Some(n) => u32::try_from(n)
            .map(Some)
            .map_err(|_| ApiError::invalid(name, format!("`{name}` = {n} is too large: it must fit in the model's context length"))),
    }
}

/// The fields both endpoints share.
fn common(f: &Fields, endpoint: Endpoint, prompt: Prompt, max: Option<u32>) -> Result<Completion, ApiError> {
    let model = f.string("model")?.map(str::to_owned);
    if let Some(n) = f.int("n")? {
        if n != 1 {
            return Err(ApiError::invalid("n", format!("only `n` = 1 is supported, got {n}")));
        }
    }
    if let Some(b) = f.int("best_of")? {
        if b != 1 {
            return Err(ApiError::invalid("best_of", format!("only `best_of` = 1 is supported, got {b}")));
        }
    }
    // Type-check the sampling knobs we ignore, so that a wrong type is still a 400.
    for knob in ["temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty"] {
        f.number(knob)?;
    }
    f.int("seed")?;
    f.int("top_k")?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid("stream_options", "`stream_options` is only allowed when `stream` is true"));
            }
            Fields(o)
                .bool("include_usage")
                .map_err(|_| ApiError::invalid("stream_options", "`include_usage` must be a boolean"))?
                .unwrap_or(false)
        }
        Some(v) => return Err(ApiError::invalid("stream_options", format!("`stream_options` must be an object, got {}", kind_of(v)))),
    };
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    let kv_transfer_params = match f.get("kv_transfer_params") {
        None => None,
        Some(v @ Value::Object(_)) => Some(v.clone()),
        Some(v) => {
            return Err(ApiError::invalid("kv_transfer_params", format!("`kv_transfer_params` must be an object, got {}", kind_of(v))))
        }
    };
    Ok(Completion {
        endpoint,
        model,
        prompt,
        max_tokens: max.unwrap_or(DEFAULT_MAX_TOKENS),
        stream,
        include_usage,
        ignore_eos,
        kv_transfer_params,
    })
}

/// `POST /v1/completions`.
pub fn parse_completion(body: &Map<String, Value>) -> Result<Completion, ApiError> {
    let f = Fields(body);
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::invalid("echo", "`echo` is not supported"));
    }
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid("suffix", "`suffix` is not supported"));
    }
    let prompt = parse_prompt(f.get("prompt"))?;
    let max = max_tokens(&f, "max_tokens")?;
    common(&f, Endpoint::Completions, prompt, max)
}

/// A prompt: a string, a list of token ids, or a list holding exactly one of either.
fn parse_prompt(v: Option<&Value>) -> Result<Prompt, ApiError> {
    let missing = || ApiError::invalid("prompt", "`prompt` is required: a string or a list of token ids");
    match v {
        None => Err(missing()),
        Some(Value::String(s)) if s.is_empty() => Err(ApiError::invalid("prompt", "`prompt` must not be empty")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Err(ApiError::invalid("prompt", "`prompt` must not be empty")),
            [one @ (Value::String(_) | Value::Array(_))] => parse_prompt(Some(one)),
            [_, _, ..] if items.iter().all(|i| i.is_string() || i.is_array()) => {
                Err(ApiError::invalid("prompt", "batched prompts are not supported: send one prompt per request"))
            }
            ids => ids.iter().map(token_id).collect::<Result<Vec<u32>, ApiError>>().map(Prompt::Tokens),
        },
        Some(v) => Err(ApiError::invalid("prompt", format!("`prompt` must be a string or a list of token ids, got {}", kind_of(v)))),
    }
}

fn token_id(v: &Value) -> Result<u32, ApiError> {
    let bad = || ApiError::invalid("prompt", format!("`prompt` token ids must be integers in 0..{}, got {v}", model::VOCAB_SIZE));
    v.as_u64().and_then(|u| u32::try_from(u).ok()).ok_or_else(bad)
}

/// `POST /v1/chat/completions`: the messages become a prompt through the model's chat template.
pub fn parse_chat(body: &Map<String, Value>) -> Result<Completion, ApiError> {
    let f = Fields(body);
    let messages = match f.get("messages") {
        None => return Err(ApiError::invalid("messages", "`messages` is required: a non-empty list of {role, content}")),
        Some(Value::Array(m)) if m.is_empty() => return Err(ApiError::invalid("messages", "`messages` must not be empty")),
        Some(Value::Array(m)) => m,
        Some(v) => return Err(ApiError::invalid("messages", format!("`messages` must be a list, got {}", kind_of(v)))),
    };
    let mut turns = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(ApiError::invalid("messages", format!("`messages[{i}]` must be an object, got {}", kind_of(m))));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) if !r.is_empty() => r.as_str(),
            _ => return Err(ApiError::invalid("messages", format!("`messages[{i}].role` must be a non-empty string"))),
        };
        turns.push((role, message_content(i, m.get("content"))?));
    }
    let text = model::chat_prompt(turns.iter().map(|(r, c)| (*r, c.as_str())));
    let max = match max_tokens(&f, "max_completion_tokens")? {
        Some(m) => Some(m),
        None => max_tokens(&f, "max_tokens")?,
    };
    common(&f, Endpoint::Chat, Prompt::Text(text), max)
}

/// A message's text: a string, a list of `{type: "text", text}` parts, or null (assistant turns).
fn message_content(i: usize, v: Option<&Value>) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!("`messages[{i}].content`: only parts of type `text` with a string `text` are supported"),
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(v) => {
            Err(ApiError::invalid("messages", format!("`messages[{i}].content` must be a string or a list of parts, got {}", kind_of(v))))
        }
    }
}

/// What every response of one request shares.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub endpoint: Endpoint,
    /// `cmpl-<request id>` or `chatcmpl-<request id>`, as vLLM names them.
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    pub fn new(endpoint: Endpoint, request_id: &str, model: &str) -> ResponseMeta {
        let prefix = match endpoint {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        ResponseMeta { endpoint, id: format!("{prefix}-{request_id}"), created: crate::ids::unix_now(), model: model.to_owned() }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!(self.object(chunk)));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m.insert("choices".into(), choices);
        m
    }

    /// The whole non-streaming response. `kv_transfer_params` sits at the top level, as in vLLM.
    pub fn full(&self, text: &str, finish: FinishReason, usage: Usage, kv_transfer_params: Option<Value>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish.as_str(), "stop_reason": null})
            }
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish.as_str(),
                "stop_reason": null
            }),
        };
        let mut m = self.envelope(false, json!([choice]));
        m.insert("usage".into(), usage.json());
        m.insert("kv_transfer_params".into(), kv_transfer_params.unwrap_or(Value::Null));
        Value::Object(m)
    }

    /// The chat stream's opening chunk, announcing the assistant role.
    pub fn role_chunk(&self) -> Value {
        Value::Object(
            self.envelope(
                true,
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
            ),
        )
    }

    /// One streamed piece of text.
    pub fn text_chunk(&self, text: &str) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": null}),
            Endpoint::Chat => json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": null}),
        };
        Value::Object(self.envelope(true, json!([choice])))
    }

    /// The chunk that carries the finish reason (and, on a P leg, `kv_transfer_params`).
    pub fn finish_chunk(&self, finish: FinishReason, kv_transfer_params: Option<Value>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => {
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": finish.as_str(), "stop_reason": null})
            }
            Endpoint::Chat => {
                json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish.as_str(), "stop_reason": null})
            }
        };
        let mut m = self.envelope(true, json!([choice]));
        if let Some(p) = kv_transfer_params {
            m.insert("kv_transfer_params".into(), p);
        }
        Value::Object(m)
    }

    /// `stream_options.include_usage`: the last chunk, with no choices.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut m = self.envelope(true, json!([]));
        m.insert("usage".into(), usage.json());
        Value::Object(m)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

impl Usage {
    fn json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": u64::from(self.prompt_tokens) + u64::from(self.completion_tokens)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!("test bodies are objects"),
        }
    }

    fn err(v: Value) -> ApiError {
        parse_completion(&obj(v)).unwrap_err()
    }

    #[test]
    fn prompt_forms() {
        let p = |v: Value| parse_completion(&obj(json!({"prompt": v}))).map(|c| c.prompt);
        assert_eq!(p(json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(p(json!([1, 2])).unwrap(), Prompt::Tokens(vec![1, 2]));
        assert_eq!(p(json!([[1, 2]])).unwrap(), Prompt::Tokens(vec![1, 2]));
        for bad in [json!(""), json!([]), json!(["a", "b"]), json!([1, "a"]), json!([-1]), json!([1.5]), json!(7), json!([4294967296u64])] {
            assert_eq!(p(bad.clone()).unwrap_err().param.as_deref(), Some("prompt"), "{bad}");
        }
    }

    #[test]
    fn defaults_and_knobs() {
        let c = parse_completion(&obj(json!({"prompt": "x", "temperature": 0.7, "top_p": 1, "n": 1, "user": "u"}))).unwrap();
        assert_eq!(c.max_tokens, DEFAULT_MAX_TOKENS);
        assert!(!c.stream && !c.include_usage && !c.ignore_eos && c.kv_transfer_params.is_none());
        let c =
            parse_completion(&obj(json!({"prompt": "x", "max_tokens": 5.0, "stream": true, "stream_options": {"include_usage": true}})))
                .unwrap();
        assert_eq!((c.max_tokens, c.stream, c.include_usage), (5, true, true));
    }

    #[test]
    fn bad_fields_are_named() {
        for (body, param) in [
            (json!({}), "prompt"),
            (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": -3}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 1e12}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": "5"}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 2.5}), "max_tokens"),
            (json!({"prompt": "x", "n": 2}), "n"),
            (json!({"prompt": "x", "stream": "yes"}), "stream"),
            (json!({"prompt": "x", "stream_options": {"include_usage": true}}), "stream_options"),
            (json!({"prompt": "x", "temperature": "hot"}), "temperature"),
            (json!({"prompt": "x", "model": 3}), "model"),
            (json!({"prompt": "x", "kv_transfer_params": [1]}), "kv_transfer_params"),
            (json!({"prompt": "x", "echo": true}), "echo"),
        ] {
            let e = err(body.clone());
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn chat_messages_become_the_template() {
        let c = parse_chat(&obj(json!({
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 3, "max_completion_tokens": 4
        })))
        .unwrap();
        assert_eq!(c.prompt, Prompt::Text(model::chat_prompt([("system", "be brief"), ("user", "hi")])));
        assert_eq!(c.max_tokens, 4);
        for bad in [json!({}), json!({"messages": []}), json!({"messages": "hi"}), json!({"messages": [{"content": "x"}]})] {
            assert_eq!(parse_chat(&obj(bad)).unwrap_err().param.as_deref(), Some("messages"));
        }
    }

    #[test]
    fn response_shapes() {
        let m = ResponseMeta::new(Endpoint::Chat, "r1", "m");
        let full = m.full("ab", FinishReason::Length, Usage { prompt_tokens: 2, completion_tokens: 3 }, None);
        assert_eq!(full["id"], "chatcmpl-r1");
        assert_eq!(full["object"], "chat.completion");
        assert_eq!(full["choices"][0]["message"]["content"], "ab");
        assert_eq!(full["usage"]["total_tokens"], 5);
        assert_eq!(m.text_chunk("x")["choices"][0]["delta"]["content"], "x");
        let m = ResponseMeta::new(Endpoint::Completions, "r1", "m");
        assert_eq!(m.finish_chunk(FinishReason::Stop, Some(json!({"a": 1})))["kv_transfer_params"]["a"], 1);
        assert_eq!(m.usage_chunk(Usage { prompt_tokens: 1, completion_tokens: 1 })["choices"], json!([]));
    }
}
