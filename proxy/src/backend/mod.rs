//! Inference backends behind one trait. Each adapter knows one engine's protocol and how to
//! get token-level data out of it; none sees a provider wire shape.
//!
//! All three engines speak OpenAI Chat Completions; `openai_compat` holds what they share
//! (request body, SSE decoding, delta parsing) and each engine module adds its token-data
//! dialect.

#[cfg(test)]
mod contract_tests;
mod error;
mod interface;
mod llamacpp;
mod openai_compat;
mod sglang;
mod vllm;

pub use error::{error_chain, BackendError};
pub use interface::{Backend, BackendConfig, CallMode, GenerationStream};
pub use llamacpp::LlamaCppBackend;
/// Public for the wire round-trip property tests (proxy/tests/properties_wire.rs): the
/// engine request every wire API's canonical request becomes.
pub use openai_compat::chat_body;
pub use sglang::SglangBackend;
pub use tokentap_schema::BackendKind;
pub use vllm::VllmBackend;

/// Builds the adapter for `config.kind`.
pub fn build(config: BackendConfig) -> Result<Box<dyn Backend>, BackendError> {
    let client = openai_compat::EngineClient::new(&config)?;
    Ok(match config.kind {
        BackendKind::Vllm => Box::new(VllmBackend::new(client)),
        BackendKind::Sglang => Box::new(SglangBackend::new(client)),
        BackendKind::Llamacpp => Box::new(LlamaCppBackend::new(client)),
    })
}
