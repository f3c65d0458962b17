//! The OpenAI request and response shapes of `/v1/completions` and `/v1/chat/completions`.
//!
//! Requests are read field by field from a JSON object rather than through serde derive, so that
//! each wrong field gets a message and a `param` naming it. Every field vLLM knows is either
//! honoured with vLLM's meaning or refused with a 400 naming it (SPEC §10); a field vLLM does not
//! know either is accepted and named in a warning line, as vLLM does.

use crate::body::kind_of;
use crate::error::ApiError;
use kvlease_engine::{model, FinishReason, Prompt, SamplingParams};
use serde_json::{json, Map, Value};

/// Default `max_tokens` when the request gives none (OpenAI's default for completions).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// Most `logprobs`/`top_logprobs` (vLLM's default `--max-logprobs`).
pub const MAX_LOGPROBS: u32 = 20;

/// Most choices per request (`n` × prompts).
pub const MAX_CHOICES: usize = 128;

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
    /// One or more prompts (completions accepts a list; chat has one).
    pub prompts: Vec<Prompt>,
    pub max_tokens: u32,
    /// Chat without `max_tokens`/`max_completion_tokens`: as in vLLM, up to the rest of the
    /// model's context (`--max-model-len` minus the prompt) rather than `max_tokens`.
    pub max_tokens_to_context: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    pub n: u32,
    /// The client's seed; none: each choice draws its own.
    pub seed: Option<u64>,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: u32,
    pub min_tokens: u32,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub include_stop_str_in_output: bool,
    /// Alternatives per token, when logprobs were asked for.
    pub logprobs: Option<u32>,
    pub echo: bool,
    pub kv_transfer_params: Option<Value>,
    /// Fields vLLM does not know either: accepted, and named in a warning.
    pub ignored: Vec<String>,
}

impl Completion {
    /// The engine's sampling parameters for choice `j` of a prompt: with a seed, choice j uses
    /// seed + j (as vLLM's parallel sampling does); without, a random one.
    pub fn sampling(&self, j: u32) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed.map_or_else(crate::ids::random_u64, |s| s.wrapping_add(u64::from(j))),
            min_tokens: self.min_tokens,
            stop_token_ids: self.stop_token_ids.clone(),
            logprobs: self.logprobs,
        }
    }
}

/// Typed access to the request's fields; every error names the field.
struct Fields<'a> {
    body: &'a Map<String, Value>,
    /// Bit `n` set: some field's name is `n` bytes long (`n` < 64; bit 63 for longer ones). Most
    /// of the dozens of names looked up are absent, and this answers most of those without a
    /// search of the map (issue 27: the lookups were 5 % of the proxy's instructions).
    lengths: u64,
}

impl<'a> Fields<'a> {
    fn new(body: &'a Map<String, Value>) -> Fields<'a> {
        Fields { body, lengths: body.keys().fold(0, |bits, k| bits | Fields::bit(k)) }
    }

    fn bit(name: &str) -> u64 {
        1 << name.len().min(63)
    }

    /// The field, with JSON `null` read as absent.
    fn get(&self, name: &str) -> Option<&'a Value> {
        if self.lengths & Fields::bit(name) == 0 {
            return None;
        }
        self.body.get(name).filter(|v| !v.is_null())
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

/// Fields both endpoints honour (each endpoint adds its own).
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "seed",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "length_penalty",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logit_bias",
    "user",
    "kv_transfer_params",
    "conversation_id",
    "priority",
    "response_format",
    "use_beam_search",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "echo",
    "logprobs",
];

/// Fields vLLM knows that kvlease does not implement: a value other than the neutral one is a
/// 400 naming the field, never ignored.
const REFUSED_FIELDS: &[&str] = &[
    "tools",
    "functions",
    "function_call",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structured_outputs",
    "structural_tag",
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
    "truncate_prompt_tokens",
    "prompt_embeds",
    "cache_salt",
    "vllm_xargs",
    "mm_processor_kwargs",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "audio",
    "modalities",
    "prediction",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "web_search_options",
    "logprob_token_ids",
    "suffix",
];

/// Fields vLLM knows whose neutral value is accepted (anything else is refused, see
/// [`refuse_unless_neutral`]).
const NEUTRAL_FIELDS: &[&str] = &[
    "tool_choice",
    "parallel_tool_calls",
    "store",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "top_logprobs",
    "messages",
    "prompt",
    "max_completion_tokens",
];

fn refused(name: &str, why: &str) -> ApiError {
    ApiError::invalid(name, format!("`{name}` is not supported by kvlease{why}: remove it"))
}

/// Refuses every refused field that carries a value other than its neutral one.
fn refuse_unimplemented(f: &Fields) -> Result<(), ApiError> {
    for &name in REFUSED_FIELDS {
        let Some(v) = f.get(name) else { continue };
        let neutral = match v {
            Value::String(s) => s.is_empty(),
            Value::Array(a) => a.is_empty(),
            Value::Object(o) => o.is_empty(),
            _ => false,
        };
        if !neutral {
            return Err(refused(name, ""));
        }
    }
    let neutral_num = |name: &str, neutral: f64| -> Result<(), ApiError> {
        match f.number(name)? {
            Some(v) if v != neutral => Err(refused(name, &format!(" (only {neutral} is accepted)"))),
            _ => Ok(()),
        }
    };
    neutral_num("min_p", 0.0)?;
    neutral_num("frequency_penalty", 0.0)?;
    neutral_num("presence_penalty", 0.0)?;
    neutral_num("repetition_penalty", 1.0)?;
    neutral_num("length_penalty", 1.0)?;
    if f.int("priority")?.is_some_and(|p| p != 0) {
        return Err(refused("priority", " (only 0 is accepted)"));
    }
    for name in ["use_beam_search", "return_tokens_as_token_ids", "return_token_ids", "continue_final_message", "store"] {
        if f.bool(name)? == Some(true) {
            return Err(refused(name, " (only false is accepted)"));
        }
    }
    for name in ["skip_special_tokens", "spaces_between_special_tokens", "add_generation_prompt"] {
        if f.bool(name)? == Some(false) {
            return Err(refused(name, " (only true is accepted)"));
        }
    }
    f.bool("add_special_tokens")?;
    f.bool("parallel_tool_calls")?;
    match f.get("tool_choice") {
        None => {}
        Some(Value::String(s)) if s == "none" || s == "auto" => {}
        Some(_) => return Err(refused("tool_choice", " (only \"none\" or \"auto\" without tools)")),
    }
    match f.get("response_format") {
        None => {}
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("text") && o.len() == 1 => {}
        Some(_) => return Err(refused("response_format", " (only {\"type\": \"text\"})")),
    }
    match f.get("logit_bias") {
        None => {}
        Some(Value::Object(o)) if o.is_empty() => {}
        Some(_) => return Err(refused("logit_bias", "")),
    }
    if let Some(u) = f.get("user") {
        if !u.is_string() {
            return Err(ApiError::invalid("user", format!("`user` must be a string, got {}", kind_of(u))));
        }
    }
    Ok(())
}

/// `stop`: a string or a list of non-empty strings.
fn stop_strings(f: &Fields) -> Result<Vec<String>, ApiError> {
    let bad = |what: String| ApiError::invalid("stop", what);
    match f.get("stop") {
        None => Ok(Vec::new()),
        Some(Value::String(s)) if s.is_empty() => Err(bad("`stop` strings must not be empty".into())),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| match i {
                Value::String(s) if !s.is_empty() => Ok(s.clone()),
                Value::String(_) => Err(bad("`stop` strings must not be empty".into())),
                v => Err(bad(format!("`stop` must be a string or a list of strings, got an item that is {}", kind_of(v)))),
            })
            .collect(),
        Some(v) => Err(bad(format!("`stop` must be a string or a list of strings, got {}", kind_of(v)))),
    }
}

/// The fields both endpoints share.
fn common(
    f: &Fields,
    endpoint: Endpoint,
    prompts: Vec<Prompt>,
    max: Option<u32>,
    logprobs: Option<u32>,
    echo: bool,
) -> Result<Completion, ApiError> {
    refuse_unimplemented(f)?;
    let model = f.string("model")?.map(str::to_owned);
    let n = match f.int("n")? {
        None => 1,
        Some(n) if n < 1 => return Err(ApiError::invalid("n", format!("`n` must be at least 1, got {n}"))),
        Some(n) if n as usize * prompts.len() > MAX_CHOICES => {
            return Err(ApiError::invalid("n", format!("`n` = {n} over {} prompt(s) exceeds {MAX_CHOICES} choices", prompts.len())))
        }
        Some(n) => n as u32,
    };
    if let Some(b) = f.int("best_of")? {
        if b != i128::from(n) {
            return Err(ApiError::invalid("best_of", format!("`best_of` = {b} is not supported: only `best_of` equal to `n` ({n})")));
        }
    }
    let seed = match f.int("seed")? {
        None => None,
        Some(s) if s < i128::from(i64::MIN) || s > i128::from(u64::MAX) => {
            return Err(ApiError::invalid("seed", format!("`seed` = {s} does not fit in 64 bits")))
        }
        Some(s) => Some(s as u64),
    };
    let temperature = f.number("temperature")?.unwrap_or(0.0);
    if !(temperature >= 0.0 && temperature.is_finite()) {
        return Err(ApiError::invalid("temperature", format!("`temperature` must be a finite number ≥ 0, got {temperature}")));
    }
    let top_p = f.number("top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p", format!("`top_p` must be in (0, 1], got {top_p}")));
    }
    let top_k = match f.int("top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k < -1 => return Err(ApiError::invalid("top_k", format!("`top_k` must be -1 (disabled) or at least 1, got {k}"))),
        Some(k) => u32::try_from(k).unwrap_or(u32::MAX),
    };
    let max_tokens_to_context = max.is_none() && endpoint == Endpoint::Chat;
    let max_tokens = max.unwrap_or(DEFAULT_MAX_TOKENS);
    let min_tokens = match f.int("min_tokens")? {
        None => 0,
        Some(m) if m < 0 => return Err(ApiError::invalid("min_tokens", format!("`min_tokens` must be at least 0, got {m}"))),
        Some(m) if m > i128::from(max_tokens) && !max_tokens_to_context => {
            return Err(ApiError::invalid("min_tokens", format!("`min_tokens` ({m}) must be at most `max_tokens` ({max_tokens})")))
        }
        Some(m) => m as u32,
    };
    let stop = stop_strings(f)?;
    let stop_token_ids = match f.get("stop_token_ids") {
        None => Vec::new(),
        Some(Value::Array(ids)) => ids
            .iter()
            .map(|v| {
                v.as_u64().and_then(|u| u32::try_from(u).ok()).filter(|&t| t < model::VOCAB_SIZE).ok_or_else(|| {
                    ApiError::invalid("stop_token_ids", format!("`stop_token_ids` must be token ids in 0..{}, got {v}", model::VOCAB_SIZE))
                })
            })
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(ApiError::invalid("stop_token_ids", format!("`stop_token_ids` must be a list of integers, got {}", kind_of(v))))
        }
    };
    let include_stop_str_in_output = f.bool("include_stop_str_in_output")?.unwrap_or(false);
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid("stream_options", "`stream_options` is only allowed when `stream` is true"));
            }
            if let Some(k) = o.keys().find(|k| *k != "include_usage" && *k != "continuous_usage_stats") {
                return Err(ApiError::invalid("stream_options", format!("`stream_options.{k}` is not supported")));
            }
            let so = Fields::new(o);
            if so
                .bool("continuous_usage_stats")
                .map_err(|_| ApiError::invalid("stream_options", "`continuous_usage_stats` must be a boolean"))?
                == Some(true)
            {
                return Err(ApiError::invalid("stream_options", "`stream_options.continuous_usage_stats` is not supported"));
            }
            so.bool("include_usage").map_err(|_| ApiError::invalid("stream_options", "`include_usage` must be a boolean"))?.unwrap_or(false)
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
    if kv_transfer_params.is_some() && prompts.len() > 1 {
        return Err(ApiError::invalid(
            "kv_transfer_params",
            "`kv_transfer_params` cannot go with a list of prompts: send one prompt per request",
        ));
    }
    if let Some(c) = f.get("conversation_id") {
        if !c.is_string() {
            return Err(ApiError::invalid("conversation_id", format!("`conversation_id` must be a string, got {}", kind_of(c))));
        }
    }
    let ignored = f
        .body
        .keys()
        .filter(|k| !COMMON_FIELDS.contains(&k.as_str()) && !REFUSED_FIELDS.contains(&k.as_str()) && !NEUTRAL_FIELDS.contains(&k.as_str()))
        .cloned()
        .collect();
    Ok(Completion {
        endpoint,
        model,
        prompts,
        max_tokens,
        max_tokens_to_context,
        stream,
        include_usage,
        ignore_eos,
        n,
        seed,
        temperature,
        top_p,
        top_k,
        min_tokens,
        stop,
        stop_token_ids,
        include_stop_str_in_output,
        logprobs,
        echo,
        kv_transfer_params,
        ignored,
    })
}

/// A `logprobs`-like count: 0..=MAX_LOGPROBS.
fn logprob_count(f: &Fields, name: &str) -> Result<Option<u32>, ApiError> {
    match f.int(name)? {
        None => Ok(None),
        Some(k) if (0..=i128::from(MAX_LOGPROBS)).contains(&k) => Ok(Some(k as u32)),
        Some(k) => Err(ApiError::invalid(name, format!("`{name}` must be in 0..={MAX_LOGPROBS}, got {k}"))),
    }
}

/// `POST /v1/completions`.
pub fn parse_completion(body: &Map<String, Value>) -> Result<Completion, ApiError> {
    let f = Fields::new(body);
    let echo = f.bool("echo")?.unwrap_or(false);
    let logprobs = logprob_count(&f, "logprobs")?;
    if echo && logprobs.is_some() {
        return Err(ApiError::invalid("echo", "`echo` together with `logprobs` (prompt logprobs) is not supported"));
    }
    if f.get("max_completion_tokens").is_some() {
        return Err(ApiError::invalid(
            "max_completion_tokens",
            "`max_completion_tokens` is a chat field: use `max_tokens` on /v1/completions",
        ));
    }
    if f.get("top_logprobs").is_some() {
        return Err(ApiError::invalid("top_logprobs", "`top_logprobs` is a chat field: use `logprobs` (an integer) on /v1/completions"));
    }
    if f.get("messages").is_some() {
        return Err(ApiError::invalid("messages", "`messages` belongs to /v1/chat/completions"));
    }
    let prompts = parse_prompts(f.get("prompt"))?;
    let max = max_tokens(&f, "max_tokens")?;
    common(&f, Endpoint::Completions, prompts, max, logprobs, echo)
}

/// `prompt`: a string, a list of token ids, or a list of either (a batch).
fn parse_prompts(v: Option<&Value>) -> Result<Vec<Prompt>, ApiError> {
    match v {
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(|i| i.is_string() || i.is_array()) => {
            items.iter().map(|i| parse_prompt(Some(i))).collect()
        }
        _ => parse_prompt(v).map(|p| vec![p]),
    }
}

/// One prompt: a string or a list of token ids.
fn parse_prompt(v: Option<&Value>) -> Result<Prompt, ApiError> {
    let missing = || ApiError::invalid("prompt", "`prompt` is required: a string or a list of token ids");
    match v {
        None => Err(missing()),
        Some(Value::String(s)) if s.is_empty() => Err(ApiError::invalid("prompt", "`prompt` must not be empty")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Err(ApiError::invalid("prompt", "`prompt` must not be empty")),
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
    let f = Fields::new(body);
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
    let logprobs = match f.get("logprobs") {
        None | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(logprob_count(&f, "top_logprobs")?.unwrap_or(0)),
        Some(v) => {
            return Err(ApiError::invalid("logprobs", format!("`logprobs` must be a boolean on chat completions, got {}", kind_of(v))))
        }
    };
    if logprobs.is_none() && f.get("top_logprobs").is_some() {
        logprob_count(&f, "top_logprobs")?;
        return Err(ApiError::invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
    }
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::invalid("echo", "`echo` on chat completions is not supported"));
    }
    if f.get("prompt").is_some() {
        return Err(ApiError::invalid("prompt", "`prompt` belongs to /v1/completions: send `messages`"));
    }
    common(&f, Endpoint::Chat, vec![Prompt::Text(text)], max, logprobs, false)
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
    pub fn full(&self, choices: Vec<Value>, usage: Usage, kv_transfer_params: Option<Value>) -> Value {
        let mut m = self.envelope(false, Value::Array(choices));
        m.insert("usage".into(), usage.json());
        m.insert("kv_transfer_params".into(), kv_transfer_params.unwrap_or(Value::Null));
        Value::Object(m)
    }

    /// One finished choice of a non-streaming response.
    pub fn full_choice(&self, index: u32, text: &str, logprobs: Value, finish: &Finish) -> Value {
        match self.endpoint {
            Endpoint::Completions => json!({
                "index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish.reason.as_str(), "stop_reason": finish.stop_reason
            }),
            Endpoint::Chat => json!({
                "index": index,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish.reason.as_str(),
                "stop_reason": finish.stop_reason
            }),
        }
    }

    /// The chat stream's opening chunk of a choice, announcing the assistant role.
    pub fn role_chunk(&self, index: u32) -> Value {
        Value::Object(self.envelope(
            true,
            json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
        ))
    }

    /// One streamed piece of a choice's text, as JSON text. The most frequent event of a stream
    /// is written straight from borrowed fields, building no map; its keys come in the order
    /// serde_json gives every other object here (sorted), so it reads like the rest.
    pub fn text_chunk(&self, index: u32, text: &str, logprobs: &Value) -> String {
        #[derive(serde::Serialize)]
        struct Chunk<'a, C> {
            choices: [C; 1],
            created: u64,
            id: &'a str,
            model: &'a str,
            object: &'static str,
        }
        #[derive(serde::Serialize)]
        struct TextChoice<'a> {
            finish_reason: (),
            index: u32,
            logprobs: &'a Value,
            text: &'a str,
        }
        #[derive(serde::Serialize)]
        struct Delta<'a> {
            content: &'a str,
        }
        #[derive(serde::Serialize)]
        struct DeltaChoice<'a> {
            delta: Delta<'a>,
            finish_reason: (),
            index: u32,
            logprobs: &'a Value,
        }
        fn json<C: serde::Serialize>(m: &ResponseMeta, choice: C) -> serde_json::Result<String> {
            serde_json::to_string(&Chunk { choices: [choice], created: m.created, id: &m.id, model: &m.model, object: m.object(true) })
        }
        let json = match self.endpoint {
            Endpoint::Completions => json(self, TextChoice { finish_reason: (), index, logprobs, text }),
            Endpoint::Chat => json(self, DeltaChoice { delta: Delta { content: text }, finish_reason: (), index, logprobs }),
        };
        // Serialising these fields cannot fail (string keys, no maps of ours).
        json.unwrap_or_default()
    }

    /// The chunk that carries a choice's finish reason (and, on a P leg, `kv_transfer_params`).
    pub fn finish_chunk(&self, index: u32, finish: &Finish) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": index, "text": "", "logprobs": null,
                "finish_reason": finish.reason.as_str(), "stop_reason": finish.stop_reason
            }),
            Endpoint::Chat => json!({
                "index": index, "delta": {}, "logprobs": null,
                "finish_reason": finish.reason.as_str(), "stop_reason": finish.stop_reason
            }),
        };
        let mut m = self.envelope(true, json!([choice]));
        if let Some(p) = &finish.kv_transfer_params {
            m.insert("kv_transfer_params".into(), p.clone());
        }
        Value::Object(m)
    }

    /// `stream_options.include_usage`: the last chunk, with no choices.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut m = self.envelope(true, json!([]));
        m.insert("usage".into(), usage.json());
        Value::Object(m)
    }

    /// The `logprobs` of some tokens in this endpoint's shape (`null` when none were asked for).
    /// `offset` is where the first token's text starts in the choice's text (completions'
    /// `text_offset`).
    pub fn logprobs(&self, lps: &[TokenLogprobs], offset: usize) -> Value {
        let name = |id: u32| model::detokenize(id);
        match self.endpoint {
            Endpoint::Completions => {
                let mut text_offset = Vec::new();
                let mut at = offset;
                for lp in lps {
                    text_offset.push(at);
                    at += name(lp.id).len();
                }
                let top: Vec<Value> = lps
                    .iter()
                    .map(|lp| {
                        let mut m = Map::new();
                        m.insert(name(lp.id), json!(lp.logprob));
                        for (t, l) in &lp.top {
                            m.entry(name(*t)).or_insert(json!(l));
                        }
                        Value::Object(m)
                    })
                    .collect();
                json!({
                    "text_offset": text_offset,
                    "token_logprobs": lps.iter().map(|lp| lp.logprob).collect::<Vec<_>>(),
                    "tokens": lps.iter().map(|lp| name(lp.id)).collect::<Vec<_>>(),
                    "top_logprobs": top
                })
            }
            Endpoint::Chat => {
                let entry = |id: u32, lp: f32| json!({"token": name(id), "logprob": lp, "bytes": name(id).into_bytes()});
                let content: Vec<Value> = lps
                    .iter()
                    .map(|lp| {
                        let mut e = entry(lp.id, lp.logprob);
                        e["top_logprobs"] = Value::Array(lp.top.iter().map(|(t, l)| entry(*t, *l)).collect());
                        e
                    })
                    .collect();
                json!({"content": content})
            }
        }
    }
}

/// One token's logprobs, as the engine reported them.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// How a choice ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    pub reason: FinishReason,
    /// vLLM's `stop_reason`: the stop string or stop token id that ended it, else null.
    pub stop_reason: Value,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub kv_transfer_params: Option<Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

impl Usage {
    pub fn json(self) -> Value {
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
        let p = |v: Value| parse_completion(&obj(json!({"prompt": v}))).map(|c| c.prompts);
        assert_eq!(p(json!("hi")).unwrap(), vec![Prompt::Text("hi".into())]);
        assert_eq!(p(json!(["hi"])).unwrap(), vec![Prompt::Text("hi".into())]);
        assert_eq!(p(json!([1, 2])).unwrap(), vec![Prompt::Tokens(vec![1, 2])]);
        assert_eq!(p(json!([[1, 2]])).unwrap(), vec![Prompt::Tokens(vec![1, 2])]);
        assert_eq!(p(json!(["a", [3]])).unwrap(), vec![Prompt::Text("a".into()), Prompt::Tokens(vec![3])]);
        for bad in [json!(""), json!([]), json!(["a", ""]), json!([1, "a"]), json!([-1]), json!([1.5]), json!(7), json!([4294967296u64])] {
            assert_eq!(p(bad.clone()).unwrap_err().param.as_deref(), Some("prompt"), "{bad}");
        }
    }

    #[test]
    fn defaults_and_knobs() {
        let c = parse_completion(&obj(json!({"prompt": "x", "user": "u", "some_future_field": 1}))).unwrap();
        assert_eq!(c.max_tokens, DEFAULT_MAX_TOKENS);
        assert_eq!((c.n, c.temperature, c.top_p, c.top_k, c.seed), (1, 0.0, 1.0, 0, None));
        assert_eq!(c.ignored, vec!["some_future_field".to_string()], "unknown fields are named, as vLLM logs them");
        assert!(!c.stream && !c.include_usage && !c.ignore_eos && c.kv_transfer_params.is_none());
        let c = parse_completion(&obj(json!({
            "prompt": "x", "max_tokens": 5.0, "stream": true, "stream_options": {"include_usage": true},
            "n": 3, "seed": 7, "temperature": 0.8, "top_p": 0.9, "top_k": 5, "stop": "jade", "stop_token_ids": [300],
            "min_tokens": 2, "logprobs": 2, "frequency_penalty": 0, "repetition_penalty": 1
        })))
        .unwrap();
        assert_eq!((c.max_tokens, c.stream, c.include_usage, c.n, c.seed), (5, true, true, 3, Some(7)));
        assert_eq!((c.stop.clone(), c.stop_token_ids.clone(), c.min_tokens, c.logprobs), (vec!["jade".to_string()], vec![300], 2, Some(2)));
        assert_eq!((c.sampling(0).seed, c.sampling(2).seed), (7, 9), "choice j samples with seed + j");
        assert!(c.ignored.is_empty());
    }

    /// SPEC §10: every field is honoured or refused with a 400 naming it.
    #[test]
    fn bad_and_unsupported_fields_are_named() {
        for (body, param) in [
            (json!({}), "prompt"),
            (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": -3}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 1e12}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": "5"}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 2.5}), "max_tokens"),
            (json!({"prompt": "x", "n": 0}), "n"),
            (json!({"prompt": "x", "n": 1000}), "n"),
            (json!({"prompt": "x", "best_of": 3}), "best_of"),
            (json!({"prompt": "x", "stream": "yes"}), "stream"),
            (json!({"prompt": "x", "stream_options": {"include_usage": true}}), "stream_options"),
            (json!({"prompt": "x", "stream": true, "stream_options": {"continuous_usage_stats": true}}), "stream_options"),
            (json!({"prompt": "x", "temperature": "hot"}), "temperature"),
            (json!({"prompt": "x", "temperature": -1}), "temperature"),
            (json!({"prompt": "x", "top_p": 0}), "top_p"),
            (json!({"prompt": "x", "top_k": -2}), "top_k"),
            (json!({"prompt": "x", "min_tokens": 20, "max_tokens": 5}), "min_tokens"),
            (json!({"prompt": "x", "stop": ""}), "stop"),
            (json!({"prompt": "x", "stop": [1]}), "stop"),
            (json!({"prompt": "x", "stop_token_ids": [999999]}), "stop_token_ids"),
            (json!({"prompt": "x", "logprobs": 21}), "logprobs"),
            (json!({"prompt": "x", "logprobs": 1, "echo": true}), "echo"),
            (json!({"prompt": "x", "model": 3}), "model"),
            (json!({"prompt": "x", "kv_transfer_params": [1]}), "kv_transfer_params"),
            (json!({"prompt": ["a", "b"], "kv_transfer_params": {}}), "kv_transfer_params"),
            (json!({"prompt": "x", "frequency_penalty": 0.5}), "frequency_penalty"),
            (json!({"prompt": "x", "min_p": 0.1}), "min_p"),
            (json!({"prompt": "x", "suffix": "s"}), "suffix"),
            (json!({"prompt": "x", "logit_bias": {"5": 1}}), "logit_bias"),
            (json!({"prompt": "x", "guided_json": {"type": "object"}}), "guided_json"),
            (json!({"prompt": "x", "response_format": {"type": "json_object"}}), "response_format"),
            (json!({"prompt": "x", "use_beam_search": true}), "use_beam_search"),
        ] {
            let e = err(body.clone());
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        let chat = |v: Value| parse_chat(&obj(v)).unwrap_err().param;
        let m = json!([{"role": "user", "content": "hi"}]);
        assert_eq!(chat(json!({"messages": m, "tools": [{"type": "function"}]})).as_deref(), Some("tools"));
        assert_eq!(chat(json!({"messages": m, "tool_choice": "required"})).as_deref(), Some("tool_choice"));
        assert_eq!(chat(json!({"messages": m, "top_logprobs": 2})).as_deref(), Some("top_logprobs"));
        assert_eq!(chat(json!({"messages": m, "logprobs": 3})).as_deref(), Some("logprobs"));
        assert_eq!(chat(json!({"messages": m, "echo": true})).as_deref(), Some("echo"));
        let c = parse_chat(&obj(json!({"messages": m, "logprobs": true, "top_logprobs": 3, "tool_choice": "none", "tools": []}))).unwrap();
        assert_eq!(c.logprobs, Some(3));
    }

    #[test]
    fn chat_messages_become_the_template() {
        let c = parse_chat(&obj(json!({
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 3, "max_completion_tokens": 4
        })))
        .unwrap();
        assert_eq!(c.prompts, vec![Prompt::Text(model::chat_prompt([("system", "be brief"), ("user", "hi")]))]);
        assert_eq!(c.max_tokens, 4);
        for bad in [json!({}), json!({"messages": []}), json!({"messages": "hi"}), json!({"messages": [{"content": "x"}]})] {
            assert_eq!(parse_chat(&obj(bad)).unwrap_err().param.as_deref(), Some("messages"));
        }
    }

    #[test]
    fn response_shapes() {
        let fin = Finish {
            reason: FinishReason::Stop,
            stop_reason: json!("jade"),
            prompt_tokens: 2,
            completion_tokens: 3,
            kv_transfer_params: None,
        };
        let m = ResponseMeta::new(Endpoint::Chat, "r1", "m");
        let full = m.full(vec![m.full_choice(0, "ab", Value::Null, &fin)], Usage { prompt_tokens: 2, completion_tokens: 3 }, None);
        assert_eq!(full["id"], "chatcmpl-r1");
        assert_eq!(full["object"], "chat.completion");
        assert_eq!(full["choices"][0]["message"]["content"], "ab");
        assert_eq!(full["choices"][0]["stop_reason"], "jade");
        assert_eq!(full["usage"]["total_tokens"], 5);
        // The same text as the object the other events are built as.
        assert_eq!(
            m.text_chunk(1, "x\"y", &json!({"content": []})),
            serde_json::to_string(
                &m.envelope(true, json!([{"index": 1, "delta": {"content": "x\"y"}, "logprobs": {"content": []}, "finish_reason": null}]))
            )
            .unwrap()
        );
        let lps =
            [TokenLogprobs { id: model::FIRST_WORD, logprob: -0.5, top: vec![(model::FIRST_WORD, -0.5), (model::FIRST_WORD + 1, -1.0)] }];
        let chat_lp = m.logprobs(&lps, 0);
        assert_eq!(chat_lp["content"][0]["token"], " the");
        assert_eq!(chat_lp["content"][0]["top_logprobs"][1]["token"], " lease");
        let m = ResponseMeta::new(Endpoint::Completions, "r1", "m");
        let lp = m.logprobs(&lps, 4);
        assert_eq!(
            m.text_chunk(0, " the", &lp),
            serde_json::to_string(&m.envelope(true, json!([{"index": 0, "text": " the", "logprobs": lp, "finish_reason": null}]))).unwrap()
        );
        assert_eq!(
            (lp["tokens"][0].clone(), lp["text_offset"][0].clone(), lp["token_logprobs"][0].clone()),
            (json!(" the"), json!(4), json!(-0.5))
        );
        let fin = Finish { kv_transfer_params: Some(json!({"a": 1})), ..fin };
        assert_eq!(m.finish_chunk(0, &fin)["kv_transfer_params"]["a"], 1);
        assert_eq!(m.usage_chunk(Usage { prompt_tokens: 1, completion_tokens: 1 })["choices"], json!([]));
    }
}
