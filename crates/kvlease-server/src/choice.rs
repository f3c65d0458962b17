//! One choice of a completion: the engine's events turned into the text a client sees, with
//! vLLM's stop-string rules (the stop string ends the choice and is not in the output unless
//! `include_stop_str_in_output`; it is found across token boundaries, so text that could be the
//! start of a stop string is held back until it is known not to be; no stop string is looked
//! for before `min_tokens`).
//!
//! Dropping a [`Choice`] drops its engine stream, which aborts the request in the engine: a stop
//! string ends generation at once.

use crate::error::ApiError;
use crate::openai::{Finish, TokenLogprobs};
use kvlease_engine::{model, FinishReason, GenerateEvent, Prompt, RequestStream};
use serde_json::{json, Value};
use std::collections::VecDeque;

/// What a choice produces, in order: pieces of text, then one `Finish` or `Failed`.
#[derive(Debug)]
pub enum Out {
    /// Text released to the client, with the logprobs of the tokens it completes, and where
    /// in the choice's text it starts.
    Text {
        text: String,
        logprobs: Vec<TokenLogprobs>,
        offset: usize,
    },
    Finish(Finish),
    Failed(ApiError),
}

/// The stop rules of a choice.
#[derive(Debug, Clone, Default)]
pub struct StopRules {
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub min_tokens: u32,
    pub stop_token_ids: Vec<u32>,
}

pub struct Choice {
    pub index: u32,
    stream: Option<RequestStream>,
    first: Option<GenerateEvent>,
    rules: StopRules,
    /// The prompt's text to send first (`echo`).
    echo: Option<String>,
    prompt_tokens: u32,
    held: String,
    held_logprobs: Vec<TokenLogprobs>,
    next_logprobs: Option<TokenLogprobs>,
    /// Bytes of text released so far.
    released: usize,
    tokens: u32,
    last_token: Option<u32>,
    out: VecDeque<Out>,
    done: bool,
}

/// The text of a prompt, as `echo` shows it.
pub fn prompt_text(p: &Prompt) -> String {
    match p {
        Prompt::Text(t) => t.clone(),
        Prompt::Tokens(ids) => ids.iter().map(|&t| model::detokenize(t)).collect(),
    }
}

/// Tokens in a prompt, as the model tokenizes it.
pub fn prompt_len(p: &Prompt) -> u32 {
    match p {
        Prompt::Text(t) => model::tokenize(t).len() as u32,
        Prompt::Tokens(ids) => ids.len() as u32,
    }
}

impl Choice {
    pub fn new(index: u32, stream: RequestStream, rules: StopRules, echo: Option<String>, prompt_tokens: u32) -> Choice {
        Choice {
            index,
            stream: Some(stream),
            first: None,
            rules,
            echo,
            prompt_tokens,
            held: String::new(),
            held_logprobs: Vec::new(),
            next_logprobs: None,
            released: 0,
            tokens: 0,
            last_token: None,
            out: VecDeque::new(),
            done: false,
        }
    }

    /// Waits for the engine's first event: the engine's refusal, if it refuses, so that the
    /// client gets its status code rather than a 200 with an error inside.
    pub async fn first_failure(&mut self) -> Option<ApiError> {
        let ev = match self.stream.as_mut() {
            Some(s) => s.next().await,
            None => return None,
        };
        match ev {
            Some(GenerateEvent::Failed(e)) => Some(e.into()),
            None => Some(ApiError::ended_early()),
            Some(ev) => {
                self.first = Some(ev);
                None
            }
        }
    }

    /// The next output; `None` once the choice has finished or failed.
    pub async fn next(&mut self) -> Option<Out> {
        loop {
            if let Some(o) = self.out.pop_front() {
                return Some(o);
            }
            if self.done {
                return None;
            }
            if let Some(text) = self.echo.take() {
                self.release(text, Vec::new());
                continue;
            }
            let ev = match self.first.take() {
                Some(ev) => Some(ev),
                None => match self.stream.as_mut() {
                    Some(s) => s.next().await,
                    None => None,
                },
            };
            self.on_event(ev);
        }
    }

    fn on_event(&mut self, ev: Option<GenerateEvent>) {
        match ev {
            Some(GenerateEvent::Logprobs { id, logprob, top }) => self.next_logprobs = Some(TokenLogprobs { id, logprob, top }),
            Some(GenerateEvent::Token { id, text }) => {
                self.tokens += 1;
                self.last_token = Some(id);
                if let Some(lp) = self.next_logprobs.take() {
                    self.held_logprobs.push(lp);
                }
                self.held.push_str(&text);
                self.check_stop();
            }
            Some(GenerateEvent::Done { finish_reason, prompt_tokens, completion_tokens, kv_transfer_params }) => {
                self.flush();
                let stop_reason = match (finish_reason, self.last_token) {
                    (FinishReason::Stop, Some(t)) if self.rules.stop_token_ids.contains(&t) => json!(t),
                    _ => Value::Null,
                };
                self.finish(Finish { reason: finish_reason, stop_reason, prompt_tokens, completion_tokens, kv_transfer_params });
            }
            Some(GenerateEvent::Failed(e)) => {
                self.out.push_back(Out::Failed(e.into()));
                self.end();
            }
            None => {
                self.out.push_back(Out::Failed(ApiError::ended_early()));
                self.end();
            }
        }
    }

    /// Looks for a stop string in the held text; releases what cannot be part of one.
    fn check_stop(&mut self) {
        if self.rules.stop.is_empty() || self.tokens < self.rules.min_tokens {
            self.flush();
            return;
        }
        let hit = self.rules.stop.iter().filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s))).min_by_key(|(at, _)| *at);
        if let Some((at, s)) = hit {
            let s = s.clone();
            let end = if self.rules.include_stop_str_in_output { at + s.len() } else { at };
            let text = self.held[..end].to_owned();
            let lps = std::mem::take(&mut self.held_logprobs);
            self.held.clear();
            self.release(text, lps);
            let f = Finish {
                reason: FinishReason::Stop,
                stop_reason: json!(s),
                prompt_tokens: self.prompt_tokens,
                completion_tokens: self.tokens,
                kv_transfer_params: None,
            };
            self.finish(f);
            return;
        }
        // Keep the longest tail that could still grow into a stop string.
        let longest = self.rules.stop.iter().map(String::len).max().unwrap_or(1);
        let mut keep_from = self.held.len().saturating_sub(longest - 1);
        while !self.held.is_char_boundary(keep_from) {
            keep_from -= 1;
        }
        if keep_from > 0 {
            let rest = self.held.split_off(keep_from);
            let text = std::mem::replace(&mut self.held, rest);
            let lps = std::mem::take(&mut self.held_logprobs);
            self.release(text, lps);
        }
    }

    fn flush(&mut self) {
        let text = std::mem::take(&mut self.held);
        let lps = std::mem::take(&mut self.held_logprobs);
        self.release(text, lps);
    }

    fn release(&mut self, text: String, logprobs: Vec<TokenLogprobs>) {
        if text.is_empty() && logprobs.is_empty() {
            return;
        }
        let offset = self.released;
        self.released += text.len();
        self.out.push_back(Out::Text { text, logprobs, offset });
    }

    fn finish(&mut self, f: Finish) {
        self.out.push_back(Out::Finish(f));
        self.end();
    }

    /// No more events are wanted: dropping the stream aborts the engine request if it runs on.
    fn end(&mut self) {
        self.done = true;
        self.stream = None;
    }
}
