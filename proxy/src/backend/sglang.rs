//! SGLang's OpenAI-compatible server: `return_prompt_token_ids` and `return_meta_info` make it
//! report prompt ids and, in `meta_info.output_token_logprobs`, `[logprob, token_id, text]`
//! for each sampled token. Talk to workers directly: its router may drop token metadata.

use async_trait::async_trait;
use serde_json::{json, Map, Value};

use super::openai_compat::{self, id_array, EngineClient, TokenDialect};
use super::{Backend, BackendError, BackendKind, CallMode, GenerationStream};
use crate::canonical::ChatRequest;

pub struct SglangBackend {
    client: EngineClient,
}

impl SglangBackend {
    pub(crate) fn new(client: EngineClient) -> Self {
        SglangBackend { client }
    }
}

pub(crate) struct SglangDialect;

impl TokenDialect for SglangDialect {
    fn request_token_data(&self, body: &mut Map<String, Value>) {
        body.insert("logprobs".into(), json!(true));
        body.insert("top_logprobs".into(), json!(0));
        body.insert("return_prompt_token_ids".into(), json!(true));
        body.insert("return_meta_info".into(), json!(true));
    }

    fn sampled_tokens(&self, choice: &Value) -> Option<(Vec<u32>, Vec<Option<f32>>)> {
        let entries = choice
            .get("meta_info")?
            .get("output_token_logprobs")?
            .as_array()?;
        let mut ids = Vec::with_capacity(entries.len());
        let mut logprobs = Vec::with_capacity(entries.len());
        for e in entries {
            ids.push(e.get(1)?.as_u64()? as u32);
            logprobs.push(e.get(0).and_then(Value::as_f64).map(|x| x as f32));
        }
        Some((ids, logprobs))
    }

    fn prompt_tokens(&self, response: &Value, choice: Option<&Value>) -> Option<Vec<u32>> {
        id_array(response.get("prompt_token_ids"))
            .or_else(|| id_array(choice?.get("prompt_token_ids")))
    }
}

#[async_trait]
impl Backend for SglangBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Sglang
    }

    fn url(&self) -> &str {
        self.client.base()
    }

    async fn generate(
        &self,
        request: &ChatRequest,
        mode: CallMode,
    ) -> Result<GenerationStream, BackendError> {
        openai_compat::generate(&self.client, SglangDialect, request, mode).await
    }

    async fn models(&self) -> Result<Value, BackendError> {
        self.client.get_json("/v1/models").await
    }
}
