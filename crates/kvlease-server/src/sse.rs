//! Server-sent events for streaming completions: the chunks of every choice as they come
//! (interleaved, each with its `index`), each choice's finish chunk, the optional usage chunk,
//! then `data: [DONE]`. A failure after the first byte is an error event, then `[DONE]`.
//! Events that are ready together are written together, in one HTTP chunk.
//!
//! The choices (and their engine streams) live inside the response body's producer
//! ([`crate::outbox`]), so a client that disconnects, or stops reading for too long, drops them
//! and the engine aborts them (SPEC D4).

use crate::choice::{Choice, Out};
use crate::error::ApiError;
use crate::openai::{Endpoint, ResponseMeta, Usage};
use crate::outbox::Producer;
use axum::body::Bytes;
use futures_util::stream::{self, SelectAll, StreamExt};
use futures_util::FutureExt;
use serde_json::Value;
use std::collections::VecDeque;
use std::pin::Pin;

/// Bytes of ready events one HTTP chunk gathers at most.
pub(crate) const MAX_CHUNK_BYTES: usize = 64 << 10;

type Outs = Pin<Box<dyn futures_util::Stream<Item = (u32, Out)> + Send>>;

struct SseState {
    meta: ResponseMeta,
    outs: SelectAll<Outs>,
    include_usage: bool,
    logprobs: bool,
    n: u32,
    usage: Usage,
    out: VecDeque<Bytes>,
    finished: bool,
}

/// The SSE events of a request whose choices have all passed their first event, a chunk at a time.
pub fn events(meta: ResponseMeta, choices: Vec<Choice>, include_usage: bool, n: u32, logprobs: bool) -> Producer {
    let mut out = VecDeque::new();
    if meta.endpoint == Endpoint::Chat {
        for ch in &choices {
            out.push_back(data(&meta.role_chunk(ch.index)));
        }
    }
    let outs = stream::select_all(
        choices
            .into_iter()
            .map(|ch| -> Outs { Box::pin(stream::unfold(ch, |mut ch| async move { ch.next().await.map(|o| ((ch.index, o), ch)) })) }),
    );
    let st = SseState {
        meta,
        outs,
        include_usage,
        logprobs,
        n: n.max(1),
        usage: Usage { prompt_tokens: 0, completion_tokens: 0 },
        out,
        finished: false,
    };
    Box::pin(stream::unfold(st, |mut st| async move {
        loop {
            if !st.out.is_empty() {
                // Whatever else is already here goes out in the same chunk: events that are
                // ready together (one step's tokens of `n` choices, or steps that took no
                // time) leave in one write, and the client reads them in one go. Nothing waits
                // for an event that is not here yet, and a chunk stops growing at
                // `MAX_CHUNK_BYTES`, so a long backlog is still written as it is read.
                let mut bytes: usize = st.out.iter().map(Bytes::len).sum();
                while !st.finished && bytes < MAX_CHUNK_BYTES {
                    let queued = st.out.len();
                    match st.outs.next().now_or_never() {
                        Some(next) => st.push(next),
                        None => break,
                    }
                    bytes += st.out.iter().skip(queued).map(Bytes::len).sum::<usize>();
                }
                return Some((st.take_out(), st));
            }
            if st.finished {
                return None;
            }
            let next = st.outs.next().await;
            st.push(next);
        }
    }))
}

impl SseState {
    /// Every event queued, as one chunk.
    fn take_out(&mut self) -> Bytes {
        if self.out.len() == 1 {
            return self.out.pop_front().unwrap_or_default();
        }
        let mut chunk = Vec::with_capacity(self.out.iter().map(Bytes::len).sum());
        for b in self.out.drain(..) {
            chunk.extend_from_slice(&b);
        }
        Bytes::from(chunk)
    }

    fn push(&mut self, next: Option<(u32, Out)>) {
        match next {
            Some((index, Out::Text { text, logprobs, offset })) => {
                let lp = if self.logprobs { self.meta.logprobs(&logprobs, offset) } else { Value::Null };
                let chunk = self.meta.text_chunk(index, &text, &lp);
                self.out.push_back(Bytes::from(format!("data: {chunk}\n\n")));
            }
            Some((index, Out::Finish(f))) => {
                if index % self.n == 0 {
                    self.usage.prompt_tokens += f.prompt_tokens;
                }
                self.usage.completion_tokens += f.completion_tokens;
                let chunk = self.meta.finish_chunk(index, &f);
                self.out.push_back(data(&chunk));
            }
            Some((_, Out::Failed(e))) => self.fail(e),
            None => {
                if self.include_usage {
                    let chunk = self.meta.usage_chunk(self.usage);
                    self.out.push_back(data(&chunk));
                }
                self.finish();
            }
        }
    }

    fn fail(&mut self, e: ApiError) {
        tracing::warn!(id = %self.meta.id, "request failed mid-stream: {}", e.message);
        self.out.push_back(data(&e.body()));
        // The other choices are dropped with the body's state: their engine requests abort.
        self.outs = SelectAll::new();
        self.finish();
    }

    fn finish(&mut self) {
        self.out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.finished = true;
    }
}

fn data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}
