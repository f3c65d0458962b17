//! Reading a request's JSON body ourselves, so that every way a body can be wrong (wrong
//! content type, too large, too slow, not JSON, not an object) becomes an OpenAI-style error,
//! never one of axum's plain-text extractor rejections.
//!
//! Bodies are bounded three ways: each by [`MAX_BODY_BYTES`]; each by a deadline (the server
//! hands it over in [`BodyLimits`], else [`DEFAULT_BODY_TIMEOUT`]), so a client that sends slowly
//! or stops mid-body gets a 408; and all together by a [`BodyBudget`], so that a hundred
//! unfinished large bodies cannot take the process's memory.

use crate::error::ApiError;
use axum::body::Body;
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use futures_util::StreamExt;
use serde_json::{Map, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Largest body accepted. A prompt of `max_model_len` token ids is far smaller.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// How much of an oversized body is read and discarded before answering 413, so that an
/// ordinary client sees the 413 instead of a connection reset; past it the connection is closed.
const DRAIN_LIMIT: usize = 64 << 20;

/// How long a body may take when no server handed its request a [`BodyLimits`] (a router mounted
/// on its own, as some tests do).
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// The first bytes of every body are not counted against the [`BodyBudget`], so that ordinary
/// requests (a prompt of a few thousand tokens) are never refused because large bodies hold the
/// budget. At most `max_connections` × this is buffered outside the budget.
pub const UNCOUNTED_BODY_BYTES: usize = 16 << 10;

/// The bytes buffered for request bodies still being read, across all connections. A body that
/// would take it past its limit is refused with a 503; the bytes come back when the body has
/// been parsed (or refused).
#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    used: AtomicUsize,
}

impl BodyBudget {
    pub fn new(limit: usize) -> BodyBudget {
        BodyBudget { limit, used: AtomicUsize::new(0) }
    }

    /// Bytes currently held.
    #[cfg(test)]
    fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    fn take(&self, n: usize) -> bool {
        self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_add(n).filter(|&t| t <= self.limit)).is_ok()
    }

    fn give_back(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// What the server allows one request's body: a request extension set when its head arrives.
#[derive(Debug, Clone)]
pub struct BodyLimits {
    /// The whole body must have arrived by then: `timeout` after its head.
    pub deadline: Instant,
    pub timeout: Duration,
    /// Shared by every connection of the server.
    pub budget: Arc<BodyBudget>,
}

/// Checks the content type, reads at most [`MAX_BODY_BYTES`] by the request's deadline and within
/// the server's budget, and parses a JSON object.
pub async fn json_object(parts: &Parts, body: Body) -> Result<Map<String, Value>, ApiError> {
    check_content_type(&parts.headers)?;
    let limits = parts.extensions.get::<BodyLimits>();
    let (deadline, timeout) =
        limits.map_or_else(|| (Instant::now() + DEFAULT_BODY_TIMEOUT, DEFAULT_BODY_TIMEOUT), |l| (l.deadline, l.timeout));
    let budget = limits.map(|l| &*l.budget);
    let read = tokio::time::timeout_at(deadline, read_limited(body, MAX_BODY_BYTES, budget)).await;
    let buffered = read.map_err(|_| ApiError::request_timeout(timeout))??;
    parse_object(&buffered.bytes)
}

fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(ct) = headers.get(header::CONTENT_TYPE) else { return Ok(()) };
    let Ok(ct) = ct.to_str() else { return Err(ApiError::unsupported_media_type("<not ASCII>")) };
    let essence = ct.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    if essence == "application/json" || essence.ends_with("+json") {
        Ok(())
    } else {
        Err(ApiError::unsupported_media_type(ct))
    }
}

/// A body read into memory, holding its share of the budget until dropped.
struct Buffered<'a> {
    bytes: Vec<u8>,
    held: Held<'a>,
}

/// Bytes taken from a [`BodyBudget`] (none without one), given back on drop.
struct Held<'a> {
    budget: Option<&'a BodyBudget>,
    bytes: usize,
}

impl Held<'_> {
    /// Accounts for a buffer grown to `capacity` bytes; a 503 if the budget cannot cover it.
    fn grow_to(&mut self, capacity: usize) -> Result<(), ApiError> {
        let counted = capacity.saturating_sub(UNCOUNTED_BODY_BYTES);
        if counted <= self.bytes {
            return Ok(());
        }
        if let Some(budget) = self.budget {
            if !budget.take(counted - self.bytes) {
                return Err(ApiError::overloaded("the server is buffering as many request bodies as it allows: retry shortly"));
            }
        }
        self.bytes = counted;
        Ok(())
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(budget) = self.budget {
            budget.give_back(self.bytes);
        }
    }
}

async fn read_limited<'a>(body: Body, limit: usize, budget: Option<&'a BodyBudget>) -> Result<Buffered<'a>, ApiError> {
    let mut stream = body.into_data_stream();
    let mut out = Buffered { bytes: Vec::new(), held: Held { budget, bytes: 0 } };
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_body(format!("could not read the request body: {e}")))?;
        seen = seen.saturating_add(chunk.len());
        if seen <= limit {
            let buf = &mut out.bytes;
            if seen > buf.capacity() {
                // Grow by doubling, as Vec would, but count every byte reserved before reserving it.
                let capacity = seen.max(buf.capacity().saturating_mul(2)).min(limit);
                out.held.grow_to(capacity)?;
                buf.reserve_exact(capacity - buf.len());
            }
            buf.extend_from_slice(&chunk);
        } else if seen > DRAIN_LIMIT {
            break;
        } else if !out.bytes.is_empty() {
            // Too large: what was kept is of no use, and the budget is better spent elsewhere.
            out = Buffered { bytes: Vec::new(), held: Held { budget, bytes: 0 } };
        }
    }
    if seen > limit {
        return Err(ApiError::too_large(limit));
    }
    Ok(out)
}

/// Parses a JSON object; the message says what was wrong.
pub fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_body("request body is empty: send a JSON object"));
    }
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(ApiError::bad_body(format!("request body must be a JSON object, got {}", kind_of(&other)))),
        Err(e) => Err(ApiError::bad_body(format!("request body is not valid JSON: {e}"))),
    }
}

/// The JSON type of a value, for messages.
pub fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_objects_and_garbage_are_named() {
        assert!(parse_object(b"{\"a\":1}").is_ok());
        assert!(parse_object(b"  ").unwrap_err().message.contains("empty"));
        assert!(parse_object(b"[1]").unwrap_err().message.contains("an array"));
        assert!(parse_object(b"{nope").unwrap_err().message.contains("not valid JSON"));
    }

    #[test]
    fn content_types() {
        let mut h = HeaderMap::new();
        assert!(check_content_type(&h).is_ok());
        h.insert(header::CONTENT_TYPE, "application/json; charset=utf-8".parse().unwrap());
        assert!(check_content_type(&h).is_ok());
        h.insert(header::CONTENT_TYPE, "application/x-www-form-urlencoded".parse().unwrap());
        assert_eq!(check_content_type(&h).unwrap_err().status, 415);
    }

    #[tokio::test]
    async fn oversized_bodies_are_413() {
        let e = read_limited(Body::from(vec![b' '; 100]), 10, None).await.err().unwrap();
        assert_eq!(e.status, 413);
        assert_eq!(read_limited(Body::from("12345"), 10, None).await.unwrap().bytes, b"12345");
    }

    /// Issue "bounded HTTP": bodies beyond the uncounted allowance draw on the shared budget, are
    /// refused with a 503 when it is spent, and give their bytes back when done.
    #[tokio::test]
    async fn bodies_share_one_budget() {
        let budget = BodyBudget::new(100 << 10);
        let big = || Body::from(vec![b' '; 80 << 10]);
        let first = read_limited(big(), MAX_BODY_BYTES, Some(&budget)).await.unwrap();
        assert_eq!(first.bytes.len(), 80 << 10);
        assert!(budget.used() >= (80 << 10) - UNCOUNTED_BODY_BYTES && budget.used() <= 100 << 10);
        let e = read_limited(big(), MAX_BODY_BYTES, Some(&budget)).await.err().unwrap();
        assert_eq!(e.status, 503);
        assert_eq!(e.body()["error"]["type"], "ServiceUnavailableError");
        assert_eq!(e.code.as_deref(), Some("overloaded"));
        // A small body needs nothing from the budget.
        let small = read_limited(Body::from(vec![b' '; UNCOUNTED_BODY_BYTES]), MAX_BODY_BYTES, Some(&budget)).await.unwrap();
        assert_eq!(small.bytes.len(), UNCOUNTED_BODY_BYTES);
        drop((first, small));
        assert_eq!(budget.used(), 0, "every byte given back");
        assert!(read_limited(big(), MAX_BODY_BYTES, Some(&budget)).await.is_ok());
        assert_eq!(budget.used(), 0);
    }

    /// Issue "bounded HTTP": a body that does not arrive by its deadline is a 408, and what it
    /// held of the budget comes back.
    #[tokio::test]
    async fn a_body_that_stalls_is_408() {
        let budget = Arc::new(BodyBudget::new(1 << 20));
        let (mut parts, ()) = axum::http::Request::new(()).into_parts();
        parts.extensions.insert(BodyLimits {
            deadline: Instant::now() + Duration::from_millis(100),
            timeout: Duration::from_millis(100),
            budget: budget.clone(),
        });
        let first = futures_util::stream::once(async { Ok::<_, std::io::Error>(vec![b' '; 64 << 10]) });
        let body = Body::from_stream(first.chain(futures_util::stream::pending()));
        let t0 = Instant::now();
        let e = json_object(&parts, body).await.unwrap_err();
        assert_eq!(e.status, 408);
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(budget.used(), 0);
    }
}
