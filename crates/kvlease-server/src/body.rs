//! Reading a request's JSON body ourselves, so that every way a body can be wrong (wrong
//! content type, too large, not JSON, not an object) becomes an OpenAI-style error, never one of
//! axum's plain-text extractor rejections.

use crate::error::ApiError;
use axum::body::Body;
use axum::http::{header, HeaderMap};
use futures_util::StreamExt;
use serde_json::{Map, Value};

/// Largest body accepted. A prompt of `max_model_len` token ids is far smaller.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// How much of an oversized body is read and discarded before answering 413, so that an
/// ordinary client sees the 413 instead of a connection reset; past it the connection is closed.
const DRAIN_LIMIT: usize = 64 << 20;

/// Checks the content type, reads at most [`MAX_BODY_BYTES`], and parses a JSON object.
pub async fn json_object(headers: &HeaderMap, body: Body) -> Result<Map<String, Value>, ApiError> {
    check_content_type(headers)?;
    let bytes = read_limited(body, MAX_BODY_BYTES).await?;
    parse_object(&bytes)
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

async fn read_limited(body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_body(format!("could not read the request body: {e}")))?;
        seen = seen.saturating_add(chunk.len());
        if seen <= limit {
            buf.extend_from_slice(&chunk);
        } else if seen > DRAIN_LIMIT {
            break;
        }
    }
    if seen > limit {
        return Err(ApiError::too_large(limit));
    }
    Ok(buf)
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
        let e = read_limited(Body::from(vec![b' '; 100]), 10).await.unwrap_err();
        assert_eq!(e.status, 413);
        assert_eq!(read_limited(Body::from("12345"), 10).await.unwrap(), b"12345");
    }
}
