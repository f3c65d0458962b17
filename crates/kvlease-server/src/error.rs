//! vLLM's error envelope: every failure the HTTP layer reports, as
//! `{"error":{"message","type","param","code"}}` with a 4xx/5xx status, `code` the status as an
//! integer and `type` its name as vLLM spells it (`BadRequestError`, `NotFoundError`, …).
//!
//! One type so that no path (body extraction, validation, the engine, the proxy's upstreams)
//! can answer with axum's plain-text rejections or an empty 500.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvlease_engine::{Refusal, RequestError};
use serde_json::{json, Value};

/// An error answered to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    /// vLLM's `type`: the status's name (`BadRequestError`, `ServiceUnavailableError`, …).
    pub kind: &'static str,
    /// kvlease's own reason (`overloaded`, `kv_load_failed`, …): in logs, not in the body.
    pub code: Option<String>,
    pub param: Option<String>,
    pub message: String,
    /// For a request carrying P's params: whether refusing it releases their lease (SPEC O3).
    pub refusal: Refusal,
}

impl ApiError {
    fn new(status: StatusCode, code: Option<&str>, param: Option<&str>, message: impl Into<String>) -> ApiError {
        let kind = error_type(status);
        ApiError {
            status,
            kind,
            code: code.map(str::to_owned),
            param: param.map(str::to_owned),
            message: message.into(),
            refusal: Refusal::Request,
        }
    }

    /// 400, naming the offending field.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, Some("invalid_value"), Some(param), message)
    }

    /// 400 about the body as a whole.
    pub fn bad_body(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, Some("invalid_json"), None, message)
    }

    pub fn model_not_found(model: &str) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, Some("model_not_found"), Some("model"), format!("The model `{model}` does not exist."))
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, Some("request_too_large"), None, format!("request body exceeds {limit} bytes"))
    }

    /// 408: the request body did not arrive within `timeout` of its head.
    pub fn request_timeout(timeout: std::time::Duration) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            Some("request_timeout"),
            None,
            format!("the request body did not arrive within {:.3} s of its head", timeout.as_secs_f64()),
        )
    }

    pub fn unsupported_media_type(got: &str) -> ApiError {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Some("unsupported_media_type"),
            None,
            format!("Content-Type `{got}` is not supported: send `application/json`"),
        )
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, Some("not_found"), None, format!("no route for `{path}`"))
    }

    pub fn method_not_allowed() -> ApiError {
        ApiError::new(StatusCode::METHOD_NOT_ALLOWED, Some("method_not_allowed"), None, "method not allowed on this path")
    }

    /// The engine closed a choice's stream without `Done` or `Failed`: it is shutting down.
    pub(crate) fn ended_early() -> ApiError {
        ApiError::unavailable("the engine stopped before the request finished")
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, Some("service_unavailable"), None, message)
    }

    /// 503 shedding load the server was told to bound (connections, buffered bodies): expected
    /// under attack or overload, so not worth a warning per request.
    pub fn overloaded(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, Some("overloaded"), None, message)
    }

    /// Whether this is worth a warning in the log: a server error that is not load shedding.
    pub fn is_server_fault(&self) -> bool {
        self.status.is_server_error() && self.code.as_deref() != Some("overloaded")
    }

    /// 502: the proxy could not get an answer from an upstream engine.
    pub fn bad_gateway(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_GATEWAY, Some("bad_gateway"), None, message)
    }

    /// 401: `--api-key` is set and the request did not carry it.
    pub fn unauthorized() -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, Some("unauthorized"), None, "Unauthorized: send `Authorization: Bearer <api key>`")
    }

    /// 504: the proxy's per-request timeout passed.
    pub fn gateway_timeout(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::GATEWAY_TIMEOUT, Some("timeout"), None, message)
    }

    /// The JSON body: `{"error":{…}}`, `code` the HTTP status as an integer (vLLM).
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status.as_u16()}})
    }
}

/// vLLM's error `type` for a status: its reason phrase without spaces, ending in `Error`.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "BadRequestError",
        401 => "UnauthorizedError",
        403 => "ForbiddenError",
        404 => "NotFoundError",
        405 => "MethodNotAllowedError",
        408 => "RequestTimeoutError",
        413 => "PayloadTooLargeError",
        415 => "UnsupportedMediaTypeError",
        429 => "TooManyRequestsError",
        502 => "BadGatewayError",
        503 => "ServiceUnavailableError",
        504 => "GatewayTimeoutError",
        s if (400..500).contains(&s) => "BadRequestError",
        _ => "InternalServerError",
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> ApiError {
        // An engine status outside 400..=599 would be an engine bug; report it as a server error.
        let status = StatusCode::from_u16(e.status).ok().filter(|s| s.is_client_error() || s.is_server_error());
        ApiError {
            refusal: e.refusal,
            ..ApiError::new(status.unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), Some(e.code), e.param, e.message)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// An error with its whole chain of causes: "error sending request … : Too many open files
/// (os error 24)", not just the outermost "error sending request".
pub(crate) fn cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_keep_status_code_and_param() {
        let e: ApiError = RequestError::bad_request(Some("prompt"), "token id 999 out of range").into();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let b = e.body();
        assert_eq!(b["error"]["type"], "BadRequestError");
        assert_eq!(b["error"]["param"], "prompt");
        assert_eq!(b["error"]["code"], 400, "vLLM's envelope: the status as an integer");
        let e: ApiError = RequestError::unavailable("queue full").into();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.body()["error"]["type"], "ServiceUnavailableError");
        assert_eq!(e.body()["error"]["code"], 503);
        let e: ApiError = RequestError::new(42, "x", None, "?").into();
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
