use tokentap_schema::ErrorKind;
use tokentap_wire::CallError;

pub use tokentap_service_kit::error_chain;

/// What can go wrong talking to an engine.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    #[error("backend timed out: {0}")]
    Timeout(String),
    #[error("the prompt does not fit the model's context: {message}")]
    ContextLengthExceeded { message: String },
    /// The engine answered with an error status.
    #[error("backend answered {status}: {message}")]
    Status { status: u16, message: String },
    /// The engine's answer could not be understood.
    #[error("backend protocol error: {0}")]
    Protocol(String),
    /// tokentap itself refuses the call before the engine sees it (a conversation the model's
    /// template cannot render, tools past the call grammar's bounds): the harness's request is
    /// at fault, so it gets the API's own invalid-request error, not an engine's.
    #[error("{0}")]
    Refused(String),
}

impl BackendError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            BackendError::Unavailable(_) => ErrorKind::BackendUnavailable,
            BackendError::Timeout(_) => ErrorKind::BackendTimeout,
            BackendError::ContextLengthExceeded { .. } => ErrorKind::ContextLengthExceeded,
            BackendError::Status { .. } | BackendError::Protocol(_) => ErrorKind::BackendError,
            BackendError::Refused(_) => ErrorKind::InvalidRequest,
        }
    }

    pub fn backend_status(&self) -> Option<u16> {
        match self {
            BackendError::Status { status, .. } => Some(*status),
            BackendError::ContextLengthExceeded { .. } => Some(400),
            _ => None,
        }
    }

    pub(crate) fn from_reqwest(e: reqwest::Error) -> BackendError {
        if e.is_timeout() {
            BackendError::Timeout(e.to_string())
        } else if e.is_connect() {
            BackendError::Unavailable(error_chain(&e))
        } else if e.is_decode() {
            BackendError::Protocol(error_chain(&e))
        } else {
            BackendError::Unavailable(error_chain(&e))
        }
    }

    /// Classifies an engine's error answer; context overflows get their own kind so each wire
    /// API can answer with what harnesses recognise (and compact instead of crash).
    pub(crate) fn from_status(status: u16, body: &str) -> BackendError {
        let message = serde_json::from_str::<serde_json::Value>(body)
            .ok()
            .and_then(|v| {
                let e = v.get("error").unwrap_or(&v);
                e.get("message")
                    .or_else(|| v.get("message"))
                    .and_then(|m| m.as_str())
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| truncate(body, 2000).to_owned());
        let lower = body.to_ascii_lowercase();
        let overflow = lower.contains("exceed_context_size")
            || lower.contains("context length")
            || lower.contains("context_length_exceeded")
            || lower.contains("exceeds the available context")
            || lower.contains("maximum context length");
        if (400..500).contains(&status) && overflow {
            BackendError::ContextLengthExceeded { message }
        } else {
            BackendError::Status { status, message }
        }
    }
}

/// The status the harness gets for an engine failure: the engine's 429 stays 429, its other
/// 4xx a 400 of the harness's own request, anything else a gateway error.
impl From<&BackendError> for CallError {
    fn from(e: &BackendError) -> Self {
        let status = match e {
            BackendError::Unavailable(_) | BackendError::Protocol(_) => 502,
            BackendError::Timeout(_) => 504,
            BackendError::ContextLengthExceeded { .. } | BackendError::Refused(_) => 400,
            BackendError::Status { status, .. } if *status == 429 => 429,
            BackendError::Status { status, .. } if (400..500).contains(status) => 400,
            BackendError::Status { .. } => 502,
        };
        CallError {
            backend_status: e.backend_status(),
            ..CallError::new(e.kind(), status, e.to_string())
        }
    }
}

pub(crate) fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
