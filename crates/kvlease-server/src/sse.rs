//! Server-sent events for streaming completions: the chunks of every choice as they come
//! (interleaved, each with its `index`), each choice's finish chunk, the optional usage chunk,
//! then `data: [DONE]`. A failure after the first byte is an error event, then `[DONE]`.
//!
//! Events are axum's [`Event`]s and their framing (`data: {json}\n\n`, no comments, no
//! keep-alives) and the response's headers are axum's [`Sse`]. Its body is not served as it is:
//! its bytes go through [`crate::outbox`] (the bound on what a client leaves untaken, issue 22),
//! and events that are ready together are written together, in one HTTP chunk.
//!
//! The choices (and their engine streams) live inside the response body's producer, so a client
//! that disconnects, or stops reading for too long, drops them and the engine aborts them (SPEC
//! D4).

use crate::choice::{Choice, Out};
use crate::error::ApiError;
use crate::openai::{Endpoint, ResponseMeta, Usage};
use crate::outbox::{Outbox, Producer};
use axum::body::Bytes;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, SelectAll, StreamExt};
use futures_util::{FutureExt, Stream};
use serde_json::Value;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;

/// Bytes of ready events one HTTP chunk gathers at most.
pub(crate) const MAX_CHUNK_BYTES: usize = 64 << 10;

type Outs = Pin<Box<dyn Stream<Item = (u32, Out)> + Send>>;

struct SseState {
    meta: ResponseMeta,
    outs: SelectAll<Outs>,
    include_usage: bool,
    logprobs: bool,
    n: u32,
    usage: Usage,
    out: VecDeque<Event>,
    finished: bool,
}

/// The streamed answer of a request whose choices have all passed their first event: axum's
/// SSE response, its body held to `max_stream_bytes` untaken by an [`Outbox`] (attached to the
/// response for the connection to drive).
pub fn response(
    meta: ResponseMeta,
    choices: Vec<Choice>,
    include_usage: bool,
    n: u32,
    logprobs: bool,
    max_stream_bytes: usize,
) -> Response {
    let (parts, body) = Sse::new(events(meta, choices, include_usage, n, logprobs)).into_response().into_parts();
    let (body, outbox) = Outbox::new(chunks(body.into_data_stream()), max_stream_bytes);
    let mut resp = Response::from_parts(parts, body);
    resp.extensions_mut().insert(outbox);
    resp
}

/// `events` framed as [`Sse`] frames them, in one piece: for the few events written outside an
/// event stream (the proxy's end of a relayed answer that broke off).
pub(crate) fn framed(events: impl IntoIterator<Item = Event>) -> Bytes {
    let events: Vec<Result<Event, Infallible>> = events.into_iter().map(Ok).collect();
    let mut data = Sse::new(stream::iter(events)).into_response().into_body().into_data_stream();
    let mut out = Vec::new();
    // The events are all here: every poll is ready, until the end.
    while let Some(Some(Ok(b))) = data.next().now_or_never() {
        out.extend_from_slice(&b);
    }
    Bytes::from(out)
}

/// An event carrying `v` as its data.
pub(crate) fn json(v: &Value) -> Event {
    // A `Value` always serialises (its keys are strings); the fallback is never written.
    Event::default().json_data(v).unwrap_or_else(|_| Event::default().data(v.to_string()))
}

/// The event that ends every stream.
pub(crate) fn done() -> Event {
    Event::default().data("[DONE]")
}

/// The framed events as HTTP chunks: whatever else is already framed goes out with the first,
/// so events that are ready together (one step's tokens of `n` choices, or steps that took no
/// time) leave in one write and the client reads them in one go. Nothing waits for an event
/// that is not here yet, and a chunk stops growing at [`MAX_CHUNK_BYTES`], so a long backlog is
/// still written as it is read.
fn chunks(framed: impl Stream<Item = Result<Bytes, axum::Error>> + Send + 'static) -> Producer {
    // The events' stream cannot fail (its error is `Infallible`).
    let framed = Box::pin(framed.filter_map(|b| std::future::ready(b.ok())).fuse());
    Box::pin(stream::unfold(framed, |mut framed| async move {
        let first = framed.next().await?;
        let Some(Some(second)) = framed.next().now_or_never() else { return Some((first, framed)) };
        let mut chunk = Vec::with_capacity(first.len() + second.len());
        chunk.extend_from_slice(&first);
        chunk.extend_from_slice(&second);
        while chunk.len() < MAX_CHUNK_BYTES {
            match framed.next().now_or_never() {
                Some(Some(b)) => chunk.extend_from_slice(&b),
                _ => break,
            }
        }
        Some((Bytes::from(chunk), framed))
    }))
}

/// The events, one at a time, as the choices produce them.
fn events(
    meta: ResponseMeta,
    choices: Vec<Choice>,
    include_usage: bool,
    n: u32,
    logprobs: bool,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let mut out = VecDeque::new();
    if meta.endpoint == Endpoint::Chat {
        for ch in &choices {
            out.push_back(json(&meta.role_chunk(ch.index)));
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
    stream::unfold(st, |mut st| async move {
        loop {
            if let Some(event) = st.out.pop_front() {
                return Some((Ok(event), st));
            }
            if st.finished {
                return None;
            }
            let next = st.outs.next().await;
            st.push(next);
        }
    })
}

impl SseState {
    fn push(&mut self, next: Option<(u32, Out)>) {
        match next {
            Some((index, Out::Text { text, logprobs, offset })) => {
                let lp = if self.logprobs { self.meta.logprobs(&logprobs, offset) } else { Value::Null };
                let chunk = self.meta.text_chunk(index, &text, &lp);
                self.out.push_back(Event::default().data(chunk));
            }
            Some((index, Out::Finish(f))) => {
                if index % self.n == 0 {
                    self.usage.prompt_tokens += f.prompt_tokens;
                }
                self.usage.completion_tokens += f.completion_tokens;
                let chunk = self.meta.finish_chunk(index, &f);
                self.out.push_back(json(&chunk));
            }
            Some((_, Out::Failed(e))) => self.fail(e),
            None => {
                if self.include_usage {
                    let chunk = self.meta.usage_chunk(self.usage);
                    self.out.push_back(json(&chunk));
                }
                self.finish();
            }
        }
    }

    fn fail(&mut self, e: ApiError) {
        tracing::warn!(id = %self.meta.id, "request failed mid-stream: {}", e.message);
        self.out.push_back(json(&e.body()));
        // The other choices are dropped with the body's state: their engine requests abort.
        self.outs = SelectAll::new();
        self.finish();
    }

    fn finish(&mut self) {
        self.out.push_back(done());
        self.finished = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The framing vLLM's clients read: `data: {json}\n\n` per event, no space lost, no
    /// comments or keep-alives, and `data: [DONE]\n\n` last.
    #[test]
    fn events_are_framed_as_vllm_writes_them() {
        let v = json!({"choices": [{"text": "a\nb"}], "id": "cmpl-1"});
        let bytes = framed([json(&v), done()]);
        assert_eq!(&bytes[..], format!("data: {v}\n\ndata: [DONE]\n\n").as_bytes());
    }

    /// Events ready together leave in one chunk; a chunk stops growing at the bound.
    #[tokio::test]
    async fn ready_events_are_gathered_into_one_chunk_up_to_the_bound() {
        let piece = Bytes::from(vec![b'x'; MAX_CHUNK_BYTES / 4]);
        let pieces: Vec<Result<Bytes, axum::Error>> = (0..6).map(|_| Ok(piece.clone())).collect();
        let lens: Vec<usize> = chunks(stream::iter(pieces)).map(|c| c.len()).collect().await;
        assert_eq!(lens, [MAX_CHUNK_BYTES, MAX_CHUNK_BYTES / 2]);
    }
}
