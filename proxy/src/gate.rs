//! The admission gate before the engine: the one place an embedding service (a rollout node)
//! can hold new generations during a weight update, apply a task's sampling parameters to
//! its session's calls, and stamp the policy version the call really ran under.

use async_trait::async_trait;
use tokentap_schema::{ChatRequest, Normalization};

/// What the gate decided for one call.
#[derive(Default)]
pub struct Admission {
    /// Changes made to the request, recorded with the call.
    pub normalizations: Vec<Normalization>,
    /// The policy version in effect (None: the proxy's configured one).
    pub policy_version: Option<String>,
    /// Held until the call has been answered (the gate counts calls in flight with it).
    pub permit: Option<Box<dyn Send + Sync>>,
    /// The harness the embedding service knows runs this session (for the metrics; Pi cannot
    /// be told from its requests).
    pub harness: Option<crate::harness::Harness>,
}

#[async_trait]
pub trait CallGate: Send + Sync {
    /// Called once per model call, after the request is parsed and before the engine is
    /// asked; may wait (the harness just sees a slower answer). May change the request's
    /// sampling, model or passthrough fields, never its messages or tools: records rebuild
    /// the conversation from the harness body ([`tokentap_wire::replay`]).
    async fn admit(&self, session: Option<&str>, request: &mut ChatRequest) -> Admission;

    /// Called before a session's other engine requests (`count_tokens`, `/v1/models`): waits
    /// as [`Self::admit`] would while calls are held (a weight update must not see them
    /// either) and returns what to hold until the request is answered. Changes nothing.
    async fn hold(&self, _session: Option<&str>) -> Option<Box<dyn Send + Sync>> {
        None
    }
}
