//! vLLM's OpenAI-compatible server: `return_token_ids` puts `prompt_token_ids` on the answer
//! (the first chunk when streaming) and `token_ids` on each choice; `logprobs` with
//! `top_logprobs: 0` gives the sampled token's logprob without alternatives.

use async_trait::async_trait;
use serde_json::{json, Map, Value};

use super::openai_compat::{self, content_logprobs, id_array, EngineClient, TokenDialect};
use super::{Backend, BackendError, BackendKind, CallMode, GenerationStream};
use crate::canonical::ChatRequest;

pub struct VllmBackend {
    client: EngineClient,
}

impl VllmBackend {
    pub(crate) fn new(client: EngineClient) -> Self {
        VllmBackend { client }
    }
}

pub(crate) struct VllmDialect;

impl TokenDialect for VllmDialect {
    fn request_token_data(&self, body: &mut Map<String, Value>) {
        body.insert("logprobs".into(), json!(true));
        body.insert("top_logprobs".into(), json!(0));
        body.insert("return_token_ids".into(), json!(true));
    }

    fn sampled_tokens(&self, choice: &Value) -> Option<(Vec<u32>, Vec<Option<f32>>)> {
        let ids = id_array(choice.get("token_ids"))?;
        let logprobs = content_logprobs(choice).unwrap_or_else(|| vec![None; ids.len()]);
        Some((ids, logprobs))
    }

    fn prompt_tokens(&self, response: &Value, _choice: Option<&Value>) -> Option<Vec<u32>> {
        id_array(response.get("prompt_token_ids"))
    }
}

#[async_trait]
impl Backend for VllmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vllm
    }

    fn url(&self) -> &str {
        self.client.base()
    }

    async fn generate(
        &self,
        request: &ChatRequest,
        mode: CallMode,
    ) -> Result<GenerationStream, BackendError> {
        openai_compat::generate(&self.client, VllmDialect, request, mode).await
    }

    async fn models(&self) -> Result<Value, BackendError> {
        self.client.get_json("/v1/models").await
    }
}
