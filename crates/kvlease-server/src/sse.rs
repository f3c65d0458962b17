//! Server-sent events for streaming completions: one `data: {json}\n\n` per token, the finish
//! chunk, the optional usage chunk, then `data: [DONE]`.
//!
//! The [`RequestStream`] lives inside the response body, so a client that disconnects drops the
//! body, the stream with it, and the engine aborts the request (SPEC D4).

use crate::error::ApiError;
use crate::openai::{ResponseMeta, Usage};
use axum::body::{Body, Bytes};
use kvlease_engine::{GenerateEvent, RequestStream};
use serde_json::Value;
use std::collections::VecDeque;
use std::convert::Infallible;

struct SseState {
    meta: ResponseMeta,
    stream: RequestStream,
    first: Option<GenerateEvent>,
    include_usage: bool,
    out: VecDeque<Bytes>,
    finished: bool,
}

/// The SSE body of a request whose first event (`first`, not `Failed`) has already arrived.
pub fn body(meta: ResponseMeta, stream: RequestStream, first: GenerateEvent, include_usage: bool) -> Body {
    let mut out = VecDeque::new();
    if meta.endpoint == crate::openai::Endpoint::Chat {
        out.push_back(data(&meta.role_chunk()));
    }
    let st = SseState { meta, stream, first: Some(first), include_usage, out, finished: false };
    Body::from_stream(futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(b) = st.out.pop_front() {
                return Some((Ok::<Bytes, Infallible>(b), st));
            }
            if st.finished {
                return None;
            }
            let ev = match st.first.take() {
                Some(ev) => Some(ev),
                None => st.stream.next().await,
            };
            st.push(ev);
        }
    }))
}

impl SseState {
    fn push(&mut self, ev: Option<GenerateEvent>) {
        match ev {
            Some(GenerateEvent::Token { text, .. }) => {
                let chunk = self.meta.text_chunk(&text);
                self.out.push_back(data(&chunk));
            }
            Some(GenerateEvent::Done { finish_reason, prompt_tokens, completion_tokens, kv_transfer_params }) => {
                let chunk = self.meta.finish_chunk(finish_reason, kv_transfer_params);
                self.out.push_back(data(&chunk));
                if self.include_usage {
                    let chunk = self.meta.usage_chunk(Usage { prompt_tokens, completion_tokens });
                    self.out.push_back(data(&chunk));
                }
                self.finish();
            }
            Some(GenerateEvent::Failed(e)) => self.fail(e.into()),
            None => self.fail(crate::api::ended_early()),
        }
    }

    fn fail(&mut self, e: ApiError) {
        tracing::warn!(id = %self.meta.id, "request failed mid-stream: {}", e.message);
        self.out.push_back(data(&e.body()));
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
