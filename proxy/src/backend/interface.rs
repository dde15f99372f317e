//! What every engine adapter is: the [`Backend`] trait, how a call is made ([`CallMode`]),
//! what it streams back, and the settings all adapters are built from.

use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use tokentap_schema::BackendKind;

use super::error::BackendError;
use tokentap_wire::canonical::{ChatRequest, GenerationEvent};
use tokentap_wire::normalize::ProbeOutcome;

/// A stream of generation events; an `Err` ends it.
pub type GenerationStream = BoxStream<'static, Result<GenerationEvent, BackendError>>;

/// How to call the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallMode {
    /// Ask the engine to stream; events arrive as tokens are sampled.
    Streaming,
    /// One non-streaming call; all events arrive when it completes.
    Whole,
}

/// Which call a generation is for: its record, and its session (`None`: a call no session
/// claims, which shares nothing with any other call).
#[derive(Debug, Clone, Copy, Default)]
pub struct CallScope<'a> {
    pub record_id: &'a str,
    pub session: Option<&'a str>,
}

/// An inference engine that can generate with token-level data.
#[async_trait]
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;

    /// Base URL of the engine as records and logs show it: a password in its userinfo
    /// redacted (`redact::url`; the engine is still called with it).
    fn url(&self) -> &str;

    /// How this engine can serve a call the harness wants answered in `wanted` mode. An engine
    /// that cannot return token data when streaming some request answers `Whole` with the
    /// reason, and the proxy plays the whole answer back as a stream.
    fn call_mode(
        &self,
        _request: &ChatRequest,
        wanted: CallMode,
    ) -> (CallMode, Option<&'static str>) {
        (wanted, None)
    }

    /// Starts a generation. Errors before the first event (connection refused, an error status)
    /// come back as `Err` here so the harness gets a proper error status.
    async fn generate(
        &self,
        request: &ChatRequest,
        mode: CallMode,
    ) -> Result<GenerationStream, BackendError>;

    /// [`Backend::generate`] for the call `call` names (an adapter that keeps state per
    /// session, tito's, keeps it in the call's session and names the record it came from).
    async fn generate_call(
        &self,
        request: &ChatRequest,
        mode: CallMode,
        _call: CallScope<'_>,
    ) -> Result<GenerationStream, BackendError> {
        self.generate(request, mode).await
    }

    /// How many prompt tokens the engine would see for `request` (Anthropic `count_tokens`) as
    /// a call of `session` would send it. By default a one-token generation whose reported
    /// prompt size is the answer; engines with a tokenizer endpoint override this with
    /// something cheaper.
    async fn count_prompt_tokens(
        &self,
        request: &ChatRequest,
        _session: Option<&str>,
    ) -> Result<u64, BackendError> {
        let mut probe = request.clone();
        probe.stream = false;
        probe.sampling.max_tokens = Some(1);
        let mut events = self.generate(&probe, CallMode::Whole).await?;
        while let Some(event) = futures::StreamExt::next(&mut events).await {
            if let GenerationEvent::Finished { usage: Some(u), .. } = event? {
                return Ok(u.prompt_tokens);
            }
        }
        Err(BackendError::Protocol(
            "the engine reported no prompt size".into(),
        ))
    }

    /// Renders `probe` with the engine's chat template, without generating, so the proxy can
    /// learn which system-message layouts the template takes.
    async fn probe_template(&self, _probe: &ChatRequest) -> ProbeOutcome {
        ProbeOutcome::Unsupported
    }

    /// The engine's `GET /v1/models` answer, as JSON.
    async fn models(&self) -> Result<serde_json::Value, BackendError>;

    /// The path of the model file the engine serves, when it says (llama.cpp's `/props`
    /// `model_path`): its tokenizer and chat template, for `--token-mode` without
    /// `--tokenizer` when engine and tokentap share a file system.
    async fn model_file(&self) -> Option<String> {
        None
    }
}

/// What a template probe's failure says: an engine that answered with an error rejected it.
pub(crate) fn probe_failure(e: BackendError) -> ProbeOutcome {
    match e {
        // No such endpoint on this engine (version): nothing learned.
        BackendError::Status {
            status: 404 | 405 | 501,
            ..
        } => ProbeOutcome::Unsupported,
        BackendError::Status { message, .. } => ProbeOutcome::Rejected(message),
        BackendError::ContextLengthExceeded { message } | BackendError::Refused(message) => {
            ProbeOutcome::Rejected(message)
        }
        BackendError::Unavailable(_) | BackendError::Timeout(_) | BackendError::Protocol(_) => {
            ProbeOutcome::Unreachable
        }
    }
}

/// Connection settings shared by all adapters.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    pub kind: BackendKind,
    /// Base URL, e.g. `http://127.0.0.1:8080` (a trailing `/v1` is accepted and removed).
    pub url: String,
    /// Bearer token for the engine, if it wants one. Never recorded.
    pub api_key: Option<String>,
    /// CA certificates trusted besides the built-in roots (`--ca-file`), for HTTPS engines.
    pub ca_roots: Vec<reqwest::Certificate>,
    pub connect_timeout: Duration,
    /// Longest wait for the first byte and between two chunks of a stream.
    pub idle_timeout: Duration,
    /// The most of one answer read (streamed or whole); past it the call ends in an error
    /// (`--max-answer-bytes`, [`super::DEFAULT_MAX_ANSWER_BYTES`] by default).
    pub max_answer_bytes: usize,
}

impl BackendConfig {
    /// The URL request paths (`/v1/...`) go under: `url` without a trailing `/` or `/v1`.
    pub(crate) fn base_url(&self) -> &str {
        let base = self.url.trim_end_matches('/');
        base.strip_suffix("/v1").unwrap_or(base)
    }
}
