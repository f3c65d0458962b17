//! Draining on SIGTERM (SPEC O1): once [`Drain::start`] is called, new completion requests are
//! answered 503 with `Retry-After` (and `/health` 503, so routers take the instance out), while
//! the requests in flight — counted from their arrival to the last byte of their answer — run to
//! their end. [`Drain::idle`] resolves when none is left.

use crate::error::ApiError;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::Notify;

/// Shared by a server's handlers and whoever decides to drain it.
#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
    inflight: AtomicUsize,
    changed: Notify,
}

impl Drain {
    /// Stop taking new requests; those in flight go on.
    pub fn start(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    /// Resolves once no request is in flight.
    pub async fn idle(&self) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.in_flight() == 0 {
                return;
            }
            changed.await;
        }
    }

    /// Admits a new request; `None` while draining (answer it with [`Drain::refusal`]).
    pub(crate) fn admit(self: &Arc<Self>) -> Option<InFlight> {
        if self.is_draining() {
            return None;
        }
        self.inflight.fetch_add(1, Ordering::SeqCst);
        Some(InFlight(self.clone()))
    }

    /// 503 with `Retry-After: 1`, for a request that comes while draining.
    pub(crate) fn refusal() -> Response {
        let mut r = ApiError::unavailable("the server is draining (shutting down): retry on another instance").into_response();
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r
    }
}

/// One request in flight; dropping it (the answer's last byte sent, or the client gone) ends it.
pub(crate) struct InFlight(Arc<Drain>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.changed.notify_waiters();
        }
    }
}

impl InFlight {
    /// The response, holding the request in flight until its body has been sent (or dropped).
    /// The body keeps its size, so a whole answer keeps its `Content-Length`.
    pub(crate) fn hold(self, resp: Response) -> Response {
        let (parts, body) = resp.into_parts();
        Response::from_parts(parts, Body::new(Held { body, _inflight: self }))
    }
}

/// A body that holds its request in flight.
struct Held {
    body: Body,
    _inflight: InFlight,
}

impl http_body::Body for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
