//! The node agent's status plane (`tokentap node-agent --status-listen`): the workloads it
//! captures (`/v1/workloads`), its metrics beside the capture's (`/metrics`), both behind the
//! token, and `/health`.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use tokentap_control_plane::bearer::{self, BearerToken};

use crate::agent::Agent;

/// What the status plane reads.
#[derive(Clone)]
pub struct StatusState {
    pub agent: Arc<Agent>,
    pub service: Arc<tokentap_proxy::app::CaptureService>,
    pub metrics: Arc<AgentMetrics>,
}

/// `/v1/workloads` and `/metrics` behind `token`, and `/health`.
pub fn status_router(state: StatusState, token: BearerToken) -> Router {
    let guarded = Router::new()
        .route("/v1/workloads", get(workloads))
        .route("/metrics", get(render_metrics))
        .route_layer(axum::middleware::from_fn_with_state(token, bearer::require));
    Router::new()
        .merge(guarded)
        .route("/health", get(|| async { "ok" }))
        .with_state(state)
}

async fn workloads(State(state): State<StatusState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "workloads": state.agent.workloads() }))
}

async fn render_metrics(State(state): State<StatusState>) -> Response {
    state.metrics.observe(&state.agent);
    let mut body = state.service.metrics().render();
    body.extend(state.metrics.render());
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        body,
    )
        .into_response()
}

/// The agent's own metrics, beside the capture's.
pub struct AgentMetrics {
    registry: prometheus::Registry,
    workloads: prometheus::IntGaugeVec,
    attach_errors: prometheus::IntCounter,
    unattributed: prometheus::IntCounter,
}

impl AgentMetrics {
    pub fn new() -> anyhow::Result<AgentMetrics> {
        let registry = prometheus::Registry::new();
        let workloads = prometheus::IntGaugeVec::new(
            prometheus::Opts::new(
                "tokentap_agent_workloads",
                "Workloads the node agent captures, by how they are attached (own cgroup or the capture parent)",
            ),
            &["attached_via"],
        )?;
        let attach_errors = prometheus::IntCounter::new(
            "tokentap_agent_attach_errors_total",
            "Workloads the agent could not attach (cgroup not found, the kernel refused)",
        )?;
        let unattributed = prometheus::IntCounter::new(
            "tokentap_agent_unattributed_connections_total",
            "Redirected connections from a cgroup no tracked workload held (captured without a workload session)",
        )?;
        registry.register(Box::new(workloads.clone()))?;
        registry.register(Box::new(attach_errors.clone()))?;
        registry.register(Box::new(unattributed.clone()))?;
        Ok(AgentMetrics {
            registry,
            workloads,
            attach_errors,
            unattributed,
        })
    }

    /// Brings the figures up to what `agent` counts and tracks.
    pub fn observe(&self, agent: &Agent) {
        let all = agent.workloads();
        for via in ["own", "capture-parent"] {
            let n = all.iter().filter(|w| w.attached_via == via).count();
            self.workloads.with_label_values(&[via]).set(n as i64);
        }
        let counts = agent.counts();
        // The agent counts; the counters catch up (they only ever grow).
        let catch_up = |c: &prometheus::IntCounter, n: u64| c.inc_by(n.saturating_sub(c.get()));
        catch_up(&self.attach_errors, counts.attach_errors);
        catch_up(&self.unattributed, counts.unattributed);
    }

    /// The metrics in Prometheus's text format.
    pub fn render(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        let _ = prometheus::Encoder::encode(
            &prometheus::TextEncoder::new(),
            &self.registry.gather(),
            &mut buf,
        );
        buf
    }
}
