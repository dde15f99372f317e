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
mod tito;
mod vllm;
mod weight_version;

pub use answer_body::DEFAULT_MAX_ANSWER_BYTES;
pub use error::{error_chain, BackendError};
pub use interface::{Backend, BackendConfig, CallMode, CallScope, GenerationStream};
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
    use tokentap_wire::canonical::{Delta, GenerationEvent, Usage};

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

    /// One chunk of a tito answer as [`ids_answer`] reads it: its text, ids, logprob slots, and
    /// whether it ends the answer.
    pub type IdsAnswerChunk = (String, Vec<u32>, Vec<Option<f32>>, bool);

    /// `--token-mode tito`'s answer decoders (llama.cpp `/completion`, vLLM
    /// `/v1/completions`, SGLang `/generate`): a whole answer's body (`whole`), or each stream
    /// event's data in order. Per chunk: its text, ids, logprob slots, and whether it ends the
    /// answer.
    pub fn ids_answer(
        kind: BackendKind,
        whole: bool,
        events: &[&[u8]],
    ) -> Vec<Result<IdsAnswerChunk, BackendError>> {
        use super::tito::{IdsDecoder, IdsEngine, LlamaCppIds, SglangIds, VllmIds};
        fn with<D: IdsDecoder>(
            mut d: D,
            whole: bool,
            events: &[&[u8]],
        ) -> Vec<Result<IdsAnswerChunk, BackendError>> {
            events
                .iter()
                .filter_map(|e| {
                    let chunk = if whole {
                        d.whole(e).map(Some)
                    } else {
                        d.event(e)
                    };
                    chunk
                        .transpose()
                        .map(|c| c.map(|c| (c.text, c.tokens, c.logprobs, c.end.is_some())))
                })
                .collect()
        }
        match kind {
            BackendKind::Llamacpp => with(LlamaCppIds.decoder(), whole, events),
            BackendKind::Vllm => with(VllmIds.decoder(), whole, events),
            BackendKind::Sglang => with(SglangIds.decoder(), whole, events),
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
/// `--token-mode tito`: the engine called with tokentap's prompt ids, on its ids-in endpoint
/// (llama.cpp's `/completion`, vLLM's `/v1/completions`, SGLang's `/generate`).
pub fn build_tito(
    config: BackendConfig,
    tito: std::sync::Arc<tokentap_token_mode::Tito>,
    verify: tokentap_token_mode::TokenVerify,
) -> Result<Box<dyn Backend>, BackendError> {
    let client = openai_compat::EngineClient::new(&config)?;
    Ok(match config.kind {
        BackendKind::Llamacpp => Box::new(tito::TitoBackend::new(
            client,
            tito,
            tito::LlamaCppIds,
            verify,
        )),
        BackendKind::Vllm => Box::new(tito::TitoBackend::new(client, tito, tito::VllmIds, verify)),
        BackendKind::Sglang => Box::new(tito::TitoBackend::new(
            client,
            tito,
            tito::SglangIds,
            verify,
        )),
    })
}

pub fn build(config: BackendConfig) -> Result<Box<dyn Backend>, BackendError> {
    let client = openai_compat::EngineClient::new(&config)?;
    Ok(match config.kind {
        BackendKind::Vllm => Box::new(VllmBackend::new(client)),
        BackendKind::Sglang => Box::new(SglangBackend::new(client)),
        BackendKind::Llamacpp => Box::new(LlamaCppBackend::new(client)),
    })
}

/// `--engine-weight-version`: `backend` with the engine's weight version read around each
/// call (vLLM's `/weight_info`; the other engines name none).
pub fn with_engine_weight_version(
    backend: std::sync::Arc<dyn Backend>,
    config: &BackendConfig,
) -> Result<std::sync::Arc<dyn Backend>, BackendError> {
    if config.kind != BackendKind::Vllm {
        return Err(BackendError::Protocol(format!(
            "--engine-weight-version reads vLLM's /weight_info; a {} engine names no weight version",
            config.kind.as_str()
        )));
    }
    let client = openai_compat::EngineClient::new(config)?;
    Ok(std::sync::Arc::new(weight_version::EngineVersioned::new(
        backend, client,
    )))
}

/// Runs one start-up question to the engine, bounded by 5 s, on a runtime of its own (call
/// it outside one); `None` if it took longer.
pub fn block_on_engine<T>(f: impl std::future::Future<Output = T>) -> Option<T> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    rt.block_on(async { tokio::time::timeout(std::time::Duration::from_secs(5), f).await })
        .ok()
}

/// Asks the engine which model it serves (within 5 s, on a runtime of its own: call it
/// outside one); the model when there is exactly one, else the harness's name goes through.
pub fn served_model(backend: &dyn Backend) -> Option<String> {
    match block_on_engine(backend.models()).ok_or(()) {
        Ok(Ok(v)) => {
            let ids: Vec<String> = v
                .get("data")
                .and_then(|d| d.as_array())
                .map(|d| {
                    d.iter()
                        .filter_map(|m| m.get("id")?.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            match ids.as_slice() {
                [one] => {
                    tracing::info!(model = %one, "using the engine's only served model");
                    Some(one.clone())
                }
                _ => {
                    tracing::info!(models = ?ids, "engine serves several models; passing the harness's model name through");
                    None
                }
            }
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "could not ask the engine for its models; passing the harness's model name through");
            None
        }
        Err(_) => {
            tracing::warn!("the engine did not list its models in time; passing the harness's model name through");
            None
        }
    }
}

#[cfg(test)]
mod served_model_tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::Duration;

    /// An engine at a loopback port that answers its first request with `models`.
    fn engine(models: &'static str) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            let mut head = [0u8; 4096];
            let _ = c.read(&mut head);
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{models}",
                models.len()
            );
            let _ = c.write_all(answer.as_bytes());
        });
        url
    }

    fn asked(url: String) -> Option<String> {
        let backend = build(BackendConfig {
            kind: BackendKind::Vllm,
            url,
            api_key: None,
            ca_roots: Vec::new(),
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
            max_answer_bytes: DEFAULT_MAX_ANSWER_BYTES,
        })
        .unwrap();
        served_model(backend.as_ref())
    }

    #[test]
    fn only_an_engine_serving_one_model_names_it() {
        let one = engine(r#"{"data": [{"id": "qwen3-8b"}]}"#);
        assert_eq!(asked(one).as_deref(), Some("qwen3-8b"));
        let two = engine(r#"{"data": [{"id": "a"}, {"id": "b"}]}"#);
        assert_eq!(asked(two), None);
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let gone = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        assert_eq!(asked(gone), None);
    }
}
