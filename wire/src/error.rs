//! Errors as the harness sees them: typed here, rendered once by the wire module in its
//! provider's own shape.

use tokentap_schema::ErrorKind;

/// A request the wire module could not accept.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct WireError {
    pub message: String,
    /// The offending field path, e.g. `messages[2].role`.
    pub param: Option<String>,
}

impl WireError {
    pub fn new(message: impl Into<String>) -> Self {
        WireError {
            message: message.into(),
            param: None,
        }
    }

    pub fn at(param: impl Into<String>, message: impl Into<String>) -> Self {
        WireError {
            message: message.into(),
            param: Some(param.into()),
        }
    }
}

/// Why a call failed, with the HTTP status the harness gets.
#[derive(Debug, Clone)]
pub struct CallError {
    pub kind: ErrorKind,
    pub status: u16,
    pub message: String,
    pub param: Option<String>,
    pub backend_status: Option<u16>,
}

impl CallError {
    pub fn new(kind: ErrorKind, status: u16, message: impl Into<String>) -> Self {
        CallError {
            kind,
            status,
            message: message.into(),
            param: None,
            backend_status: None,
        }
    }

    pub fn not_found(method: &str, path: &str) -> Self {
        CallError::new(
            ErrorKind::InvalidRequest,
            404,
            format!("Unknown route {method} {path}. tokentap serves POST /v1/chat/completions, POST /v1/responses, POST /v1/messages, POST /v1/messages/count_tokens, GET /v1/models, GET /health and GET /metrics."),
        )
    }

    pub fn body_too_large(limit: usize) -> Self {
        CallError::new(
            ErrorKind::BodyTooLarge,
            413,
            format!("Request body exceeds the limit of {limit} bytes (tokentap proxy --max-body-bytes)."),
        )
    }
}

#[cfg(test)]
impl CallError {
    /// A context overflow as the proxy makes it from its engine's answer (the codecs' tests).
    pub(crate) fn context_overflow(message: impl std::fmt::Display) -> Self {
        CallError {
            backend_status: Some(400),
            ..CallError::new(
                ErrorKind::ContextLengthExceeded,
                400,
                format!("the prompt does not fit the model's context: {message}"),
            )
        }
    }
}

impl From<WireError> for CallError {
    fn from(e: WireError) -> Self {
        CallError {
            param: e.param.clone(),
            ..CallError::new(ErrorKind::InvalidRequest, 400, e.message)
        }
    }
}
