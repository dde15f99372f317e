//! Inference backends behind one trait. Each adapter knows one engine's protocol and how to
//! get token-level data out of it; none sees a provider wire shape.
//!
//! All three engines speak OpenAI Chat Completions; `openai_compat` holds what they share
//! (posting the request, SSE decoding, delta parsing) and each engine module adds its
//! token-data dialect. The request is serialized straight from the canonical request
//! (`engine_request`) and the answer decoded straight from its bytes into typed structs
//! (`answer`): neither passes through a `serde_json::Value`, the proxy's main JSON cost.

mod answer;
mod answer_body;
#[cfg(test)]
mod answer_lane_tests;
#[cfg(test)]
mod contract_tests;
mod engine_request;
mod error;
mod http1_engine;
mod interface;
mod json_lane;
mod llamacpp;
mod openai_compat;
mod sglang;
#[cfg(test)]
mod sse_reader_tests;
mod vllm;

pub use answer_body::DEFAULT_MAX_ANSWER_BYTES;
pub use error::{error_chain, BackendError};
pub use interface::{Backend, BackendConfig, CallMode, GenerationStream};
pub use llamacpp::LlamaCppBackend;
/// Public for the wire round-trip property tests (proxy/tests/properties_wire.rs): the
/// engine request every wire API's canonical request becomes.
pub use openai_compat::chat_body;
pub use sglang::SglangBackend;
pub use tokentap_schema::BackendKind;
pub use vllm::VllmBackend;

/// Public for fuzzing (fuzz/): each engine's answer decoders without the HTTP around them, as
/// the adapters run them on an engine's whole answer or streamed body.
#[doc(hidden)]
pub mod decode {
    use std::time::Duration;

    use serde_json::Value;

    use super::answer::{self, Answer, Ids, Message};
    use super::llamacpp::LlamaCppDialect;
    use super::openai_compat::{self, TokenDialect};
    use super::sglang::SglangDialect;
    use super::vllm::VllmDialect;
    use super::{BackendError, BackendKind, GenerationStream};
    use crate::canonical::{Delta, GenerationEvent, Usage};

    /// The events of a whole answer body (what `CallMode::Whole` yields, minus llama.cpp's
    /// template-rendered prompt ids, which come from another endpoint).
    pub fn whole(kind: BackendKind, body: &[u8]) -> Result<Vec<GenerationEvent>, BackendError> {
        match kind {
            BackendKind::Vllm => openai_compat::whole_answer_events(body, &VllmDialect),
            BackendKind::Sglang => openai_compat::whole_answer_events(body, &SglangDialect),
            BackendKind::Llamacpp => openai_compat::whole_answer_events(body, &LlamaCppDialect),
        }
    }

    /// The events of a streamed (SSE) answer body arriving in `chunks`. Needs a Tokio runtime
    /// with timers (the idle timeout).
    pub fn stream(kind: BackendKind, chunks: Vec<Vec<u8>>) -> GenerationStream {
        fn with<D: TokenDialect>(d: D, chunks: Vec<Vec<u8>>) -> GenerationStream {
            let body = futures::stream::iter(
                chunks
                    .into_iter()
                    .map(|c| Ok::<_, std::io::Error>(bytes::Bytes::from(c))),
            );
            openai_compat::stream_events(Box::pin(body), d, Duration::from_secs(3600))
        }
        match kind {
            BackendKind::Vllm => with(VllmDialect, chunks),
            BackendKind::Sglang => with(SglangDialect, chunks),
            BackendKind::Llamacpp => with(LlamaCppDialect, chunks),
        }
    }

    /// A whole answer's `message` (`whole`) or a stream chunk's `delta`, read as the
    /// decoders read it from an answer's bytes.
    pub fn delta(v: &Value, whole: bool) -> Delta {
        openai_compat::parse_delta(answer::from_value::<Message>(v), whole)
    }

    /// The `usage` object of an answer or chunk.
    pub fn usage(v: &Value) -> Option<Usage> {
        openai_compat::parse_usage(&answer::from_value::<Answer>(v).usage)
    }

    /// Token ids from a JSON array of integers (`None` unless every element is one).
    pub fn id_array(v: Option<&Value>) -> Option<Vec<u32>> {
        answer::from_value::<Ids>(v?).0
    }

    /// Whether an answer or chunk `json` decodes the same with the fast lane as by serde_json
    /// alone (the same fields and ids, or the same error): the lane's one promise.
    pub fn lane_agrees(json: &[u8]) -> bool {
        fn shown<T: std::fmt::Debug>(r: serde_json::Result<T>) -> String {
            match r {
                Ok(v) => format!("{v:?}"),
                Err(e) => format!("error: {e}"),
            }
        }
        shown(answer::decode::<Answer>(json)) == shown(answer::decode_by_serde::<Answer>(json))
    }
}

/// Builds the adapter for `config.kind`.
pub fn build(config: BackendConfig) -> Result<Box<dyn Backend>, BackendError> {
    let client = openai_compat::EngineClient::new(&config)?;
    Ok(match config.kind {
        BackendKind::Vllm => Box::new(VllmBackend::new(client)),
        BackendKind::Sglang => Box::new(SglangBackend::new(client)),
        BackendKind::Llamacpp => Box::new(LlamaCppBackend::new(client)),
    })
}
