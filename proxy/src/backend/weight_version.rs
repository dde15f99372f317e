//! `--engine-weight-version`: the engine's own weight version, read just before each call is
//! sent and once its answer has ended (vLLM's `GET /weight_info`), so each record says which
//! weights the engine served beside the `policy_version` the trainer told tokentap, and a call
//! the weights changed under (a trainer that updated without pausing the node, or paused only
//! the engine) is seen as one: [`EngineWeightVersion::straddles_update`].
//!
//! A decorator around any adapter, so the engines' own code paths stay as they are and a
//! service without the flag pays nothing. The second read follows the answer's last event:
//! the harness already has its answer unless `--durable-answers` holds the end for the record.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use tokentap_schema::{BackendKind, EngineWeightVersion};

use super::error::BackendError;
use super::interface::{Backend, CallMode, CallScope, GenerationStream};
use super::openai_compat::EngineClient;
use tokentap_wire::canonical::{ChatRequest, GenerationEvent};
use tokentap_wire::normalize::ProbeOutcome;

/// vLLM's RL route that names the weights it serves (`{"weight_version": …}`).
const WEIGHT_INFO: &str = "/weight_info";
/// A read that takes longer leaves the version unknown for that side of the call.
const READ_BOUND: Duration = Duration::from_secs(2);

/// `inner` with the engine's weight version read around each generation.
pub(crate) struct EngineVersioned {
    inner: Arc<dyn Backend>,
    client: EngineClient,
}

impl EngineVersioned {
    pub(crate) fn new(inner: Arc<dyn Backend>, client: EngineClient) -> Self {
        EngineVersioned { inner, client }
    }

    fn around(&self, at_start: Option<String>, events: GenerationStream) -> GenerationStream {
        let client = self.client.clone();
        let end = futures::stream::once(async move {
            let at_end = read(&client).await;
            Ok(GenerationEvent::EngineWeightVersion(EngineWeightVersion {
                at_start,
                at_end,
            }))
        });
        Box::pin(events.chain(end))
    }
}

/// The engine's weight version now, or `None` when it does not say in time (logged: a
/// trainer that asked for versions should see why its records have none).
async fn read(client: &EngineClient) -> Option<String> {
    let answer = tokio::time::timeout(READ_BOUND, client.get_json(WEIGHT_INFO)).await;
    let v = match answer {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "--engine-weight-version: the engine's {WEIGHT_INFO} did not answer");
            return None;
        }
        Err(_) => {
            tracing::warn!(
                "--engine-weight-version: the engine's {WEIGHT_INFO} took over {READ_BOUND:?}"
            );
            return None;
        }
    };
    match v.get("weight_version") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Null) | None => None,
        // A number or anything else: its JSON text, so it still compares.
        Some(other) => Some(other.to_string()),
    }
}

#[async_trait]
impl Backend for EngineVersioned {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }

    fn url(&self) -> &str {
        self.inner.url()
    }

    fn call_mode(
        &self,
        request: &ChatRequest,
        wanted: CallMode,
    ) -> (CallMode, Option<&'static str>) {
        self.inner.call_mode(request, wanted)
    }

    async fn generate(
        &self,
        request: &ChatRequest,
        mode: CallMode,
    ) -> Result<GenerationStream, BackendError> {
        let at_start = read(&self.client).await;
        let events = self.inner.generate(request, mode).await?;
        Ok(self.around(at_start, events))
    }

    async fn generate_call(
        &self,
        request: &ChatRequest,
        mode: CallMode,
        call: CallScope<'_>,
    ) -> Result<GenerationStream, BackendError> {
        let at_start = read(&self.client).await;
        let events = self.inner.generate_call(request, mode, call).await?;
        Ok(self.around(at_start, events))
    }

    async fn count_prompt_tokens(
        &self,
        request: &ChatRequest,
        session: Option<&str>,
    ) -> Result<u64, BackendError> {
        self.inner.count_prompt_tokens(request, session).await
    }

    async fn probe_template(&self, probe: &ChatRequest) -> ProbeOutcome {
        self.inner.probe_template(probe).await
    }

    async fn models(&self) -> Result<serde_json::Value, BackendError> {
        self.inner.models().await
    }

    async fn model_file(&self) -> Option<String> {
        self.inner.model_file().await
    }
}
