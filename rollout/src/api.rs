//! The node's HTTP control plane (`tokentap serve`): submit, inspect, cancel, and pull results.
//! Every route but `/health` needs `Authorization: Bearer TOKEN` when a token is configured,
//! `/metrics` and `/openapi.json` included: the metrics name rollouts' progress and the node's
//! capture figures, and one rule with one exception is the rule operators can check.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use crate::cluster::{Cluster, ClusterError};
use crate::pipeline::{now_ms, Pipeline};
use crate::store::StoreError;
use crate::task::{Rollout, Sample, TaskSpec};
use tokentap_control_plane::bearer::{self, BearerToken};

#[derive(Clone)]
pub struct ApiState {
    pub pipeline: Arc<Pipeline>,
    pub token: Option<String>,
    /// More Prometheus text for `/metrics` (the node's capture metrics).
    pub extra_metrics: Option<Arc<dyn Fn() -> Vec<u8> + Send + Sync>>,
    /// The cluster this node is part of (`serve --bus`): rollouts, samples, results, events
    /// and the gate are then the cluster's, whichever node runs them.
    pub cluster: Option<Arc<Cluster>>,
}

pub fn router(state: ApiState) -> Router {
    let token = BearerToken::new(state.token.as_deref());
    let guarded = Router::new()
        .route("/v1/rollouts", post(submit))
        .route("/v1/rollouts/{id}", get(show).delete(cancel))
        .route("/v1/rollouts/{id}/events", get(events))
        .route("/v1/samples/{id}/traces", get(sample_traces))
        .route("/v1/results", get(results))
        .route("/v1/admin/pause", post(pause))
        .route("/v1/admin/resume", post(resume))
        .route("/v1/admin/status", get(admin_status))
        .route("/metrics", get(metrics))
        .route(
            "/openapi.json",
            get(|| async { Json(crate::openapi::document()) }),
        )
        .route_layer(middleware::from_fn_with_state(token, bearer::require));
    Router::new()
        .merge(guarded)
        .route("/health", get(|| async { "ok" }))
        .with_state(state)
}

/// Every (method, path) [`router`] serves, `/health` first: what an authentication test must
/// try one by one (kept next to the router so a new route cannot be forgotten there).
pub const ALL_ROUTES: &[(&str, &str)] = &[
    ("GET", "/health"),
    ("POST", "/v1/rollouts"),
    ("GET", "/v1/rollouts/{id}"),
    ("DELETE", "/v1/rollouts/{id}"),
    ("GET", "/v1/rollouts/{id}/events"),
    ("GET", "/v1/samples/{id}/traces"),
    ("GET", "/v1/results"),
    ("POST", "/v1/admin/pause"),
    ("POST", "/v1/admin/resume"),
    ("GET", "/v1/admin/status"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
];

/// An error in one shape for every route: `{"error": {"type", "message"}}`.
fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": {"type": kind, "message": message.into()}})),
    )
        .into_response()
}

fn cluster_error(e: ClusterError) -> Response {
    match e {
        ClusterError::NotFound(what) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no such {what}"),
        ),
        ClusterError::Bus(e) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "bus_unavailable",
            format!("the cluster's bus: {e:#}"),
        ),
    }
}

/// A rollout and its samples, from the cluster when there is one.
async fn rollout_of(state: &ApiState, id: &str) -> Result<(Rollout, Vec<Sample>), Response> {
    match &state.cluster {
        Some(c) => crate::cluster::ledger::rollout(c, id)
            .await
            .map_err(cluster_error),
        None => state.pipeline.store().rollout(id).map_err(store_error),
    }
}

fn store_error(e: StoreError) -> Response {
    match e {
        StoreError::NotFound(what) => error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no such {what}"),
        ),
        other => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "store_error",
            other.to_string(),
        ),
    }
}

async fn submit(State(state): State<ApiState>, body: axum::body::Bytes) -> Response {
    let spec: TaskSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_task", e.to_string()),
    };
    if let Some(why) = state.pipeline.refusal(&spec) {
        return error(StatusCode::BAD_REQUEST, "invalid_task", why);
    }
    let accepted = |rollout: &Rollout, samples: &[Sample]| {
        let body = json!({
            "rollout_id": rollout.rollout_id,
            "samples": samples.iter().map(|s| &s.sample_id).collect::<Vec<_>>(),
        });
        (StatusCode::ACCEPTED, Json(body)).into_response()
    };
    if let Some(c) = &state.cluster {
        return match crate::cluster::ledger::submit(c, spec).await {
            Ok((rollout, samples)) => accepted(&rollout, &samples),
            Err(e) => cluster_error(e),
        };
    }
    match state.pipeline.store().submit(spec, now_ms()) {
        Ok((rollout, samples)) => {
            let response = accepted(&rollout, &samples);
            state.pipeline.submit(rollout, samples);
            response
        }
        Err(e) => store_error(e),
    }
}

async fn show(State(state): State<ApiState>, Path(id): Path<String>) -> Response {
    match rollout_of(&state, &id).await {
        Ok((rollout, samples)) => {
            let done = samples.iter().filter(|s| s.outcome.is_some()).count();
            Json(json!({
                "rollout": rollout,
                "status": if done == samples.len() { "done" } else { "running" },
                "samples": samples,
            }))
            .into_response()
        }
        Err(response) => response,
    }
}

async fn cancel(State(state): State<ApiState>, Path(id): Path<String>) -> Response {
    let cancelled = match &state.cluster {
        Some(c) => crate::cluster::ledger::cancel(c, &id)
            .await
            .map_err(cluster_error),
        None => state.pipeline.cancel(&id).map_err(store_error),
    };
    match cancelled {
        Ok(running) => Json(json!({"rollout_id": id, "stopping": running})).into_response(),
        Err(response) => response,
    }
}

#[derive(Deserialize)]
struct ResultsQuery {
    #[serde(default)]
    after: u64,
    /// Seconds to wait for a result when there is none yet (long poll), at most 60.
    #[serde(default)]
    wait: u64,
    #[serde(default = "default_limit")]
    limit: usize,
}

fn default_limit() -> usize {
    100
}

async fn results(State(state): State<ApiState>, Query(q): Query<ResultsQuery>) -> Response {
    if let Some(c) = &state.cluster {
        let wait = Duration::from_secs(q.wait.min(60));
        return match crate::cluster::results::results_after(
            c,
            q.after,
            q.limit.clamp(1, 1000),
            wait,
        )
        .await
        {
            Ok(page) => results_page(q.after, page),
            Err(e) => cluster_error(e),
        };
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(q.wait.min(60));
    loop {
        // Registered before reading, so a result landing in between still wakes us.
        let notified = state.pipeline.finished.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match state
            .pipeline
            .store()
            .results_after(q.after, q.limit.clamp(1, 1000))
        {
            Ok(page) if !page.is_empty() || tokio::time::Instant::now() >= deadline => {
                return results_page(q.after, page);
            }
            Ok(_) => {
                let _ = tokio::time::timeout_at(deadline, notified).await;
            }
            Err(e) => return store_error(e),
        }
    }
}

fn results_page(after: u64, page: Vec<(u64, Sample)>) -> Response {
    let next = page.last().map_or(after, |(c, _)| *c);
    let items: Vec<_> = page
        .into_iter()
        .map(|(cursor, sample)| json!({"cursor": cursor, "sample": sample}))
        .collect();
    Json(json!({"results": items, "next": next})).into_response()
}

async fn metrics(State(state): State<ApiState>) -> Response {
    let mut body = state.pipeline.render_metrics();
    if let Some(c) = &state.cluster {
        body.extend(c.render_metrics());
    }
    if let Some(extra) = &state.extra_metrics {
        body.extend(extra());
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

/// A sample's trace rows (JSON Lines), once it has ended.
async fn sample_traces(State(state): State<ApiState>, Path(id): Path<String>) -> Response {
    if let Some(c) = &state.cluster {
        // From the bus, wherever it ran (this node's own copy may be of an older attempt).
        return match crate::cluster::ledger::sample_traces(c, &id).await {
            Ok(Some(body)) => ([(header::CONTENT_TYPE, "application/jsonl")], body).into_response(),
            Ok(None) => error(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("sample {id} has no trajectory (yet)"),
            ),
            Err(e) => cluster_error(e),
        };
    }
    let sample = match state.pipeline.store().sample(&id) {
        Ok(s) => s,
        Err(e) => return store_error(e),
    };
    let Some(t) = sample.trajectory else {
        return error(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("sample {id} has no trajectory (yet)"),
        );
    };
    match tokio::fs::read(&t.path).await {
        Ok(body) => ([(header::CONTENT_TYPE, "application/jsonl")], body).into_response(),
        Err(e) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "io_error",
            format!("reading {}: {e}", t.path),
        ),
    }
}

/// Server-sent events for one rollout: a `snapshot` of every sample first, then `stage` and
/// `finished` events as they happen, and `done` when every sample has ended (the stream then
/// closes). A reader that falls behind gets a fresh `snapshot`.
async fn events(State(state): State<ApiState>, Path(id): Path<String>) -> Response {
    use axum::response::sse::{Event as Sse, KeepAlive};
    // Subscribed before the snapshot, so nothing between the two is missed.
    let rx = match &state.cluster {
        Some(c) => c.events(),
        None => state.pipeline.events(),
    };
    let pending = match snapshot(&state, &id).await {
        Ok(p) => p,
        Err(response) => return response,
    };
    struct St {
        state: ApiState,
        id: String,
        rx: tokio::sync::broadcast::Receiver<crate::pipeline::Event>,
        /// Samples not ended yet; None before the first snapshot is sent.
        pending: Option<std::collections::HashSet<String>>,
        first: Option<(serde_json::Value, std::collections::HashSet<String>)>,
        closed: bool,
    }
    let st = St {
        state,
        id,
        rx,
        pending: None,
        first: Some(pending),
        closed: false,
    };
    let stream = futures::stream::unfold(st, |mut st| async move {
        use tokio::sync::broadcast::error::RecvError;
        if st.closed {
            return None;
        }
        if let Some((body, pending)) = st.first.take() {
            st.pending = Some(pending);
            let ev = Sse::default().event("snapshot").data(body.to_string());
            return Some((Ok::<_, std::convert::Infallible>(ev), st));
        }
        if st.pending.as_ref().is_some_and(|p| p.is_empty()) {
            st.closed = true;
            let ev = Sse::default()
                .event("done")
                .data(json!({"rollout_id": st.id}).to_string());
            return Some((Ok(ev), st));
        }
        loop {
            match st.rx.recv().await {
                Ok(ev) if ev.rollout_id() == st.id => {
                    if let crate::pipeline::Event::Finished { sample_id, .. } = &ev {
                        if let Some(p) = st.pending.as_mut() {
                            p.remove(sample_id);
                        }
                    }
                    let name = match &ev {
                        crate::pipeline::Event::Stage { .. } => "stage",
                        crate::pipeline::Event::Finished { .. } => "finished",
                    };
                    let data = serde_json::to_string(&ev).unwrap_or_default();
                    return Some((Ok(Sse::default().event(name).data(data)), st));
                }
                Ok(_) => continue,
                Err(RecvError::Lagged(_)) => match snapshot(&st.state, &st.id).await {
                    Ok((body, pending)) => {
                        st.pending = Some(pending);
                        let ev = Sse::default().event("snapshot").data(body.to_string());
                        return Some((Ok(ev), st));
                    }
                    Err(_) => return None,
                },
                Err(RecvError::Closed) => return None,
            }
        }
    });
    axum::response::Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// The rollout with its samples, and the ids of those not ended yet.
async fn snapshot(
    state: &ApiState,
    id: &str,
) -> Result<(serde_json::Value, std::collections::HashSet<String>), Response> {
    let (rollout, samples) = rollout_of(state, id).await?;
    let pending = samples
        .iter()
        .filter(|s| s.outcome.is_none())
        .map(|s| s.sample_id.clone())
        .collect();
    Ok((json!({"rollout": rollout, "samples": samples}), pending))
}

#[derive(Deserialize)]
struct PauseQuery {
    /// Seconds to wait for calls in flight to finish, at most 600 (default 300).
    #[serde(default = "default_pause_wait")]
    wait: u64,
}

fn default_pause_wait() -> u64 {
    300
}

fn no_gate() -> Response {
    error(
        StatusCode::CONFLICT,
        "no_gate",
        "this node has no capture gate (it runs without capture)",
    )
}

/// Holds new generations; answers once the calls in flight have finished (`in_flight: 0`)
/// or the wait ran out (`in_flight` > 0: ask again).
async fn pause(State(state): State<ApiState>, Query(q): Query<PauseQuery>) -> Response {
    let Some(gate) = state.pipeline.gate() else {
        return no_gate();
    };
    let wait = Duration::from_secs(q.wait.min(600));
    if let Some(c) = &state.cluster {
        return match crate::cluster::gate_sync::pause(c, wait).await {
            Ok(status) => Json(status).into_response(),
            Err(e) => cluster_error(e),
        };
    }
    Json(gate.pause(wait).await).into_response()
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ResumeBody {
    #[serde(default)]
    policy_version: Option<String>,
}

/// Lets generations go on, under a new `policy_version` when given.
async fn resume(State(state): State<ApiState>, body: axum::body::Bytes) -> Response {
    let Some(gate) = state.pipeline.gate() else {
        return no_gate();
    };
    let body: ResumeBody = if body.is_empty() {
        ResumeBody::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(b) => b,
            Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_request", e.to_string()),
        }
    };
    if let Some(c) = &state.cluster {
        return match crate::cluster::gate_sync::resume(c, body.policy_version).await {
            Ok(status) => Json(status).into_response(),
            Err(e) => cluster_error(e),
        };
    }
    Json(gate.resume(body.policy_version)).into_response()
}

async fn admin_status(State(state): State<ApiState>) -> Response {
    let Some(gate) = state.pipeline.gate() else {
        return no_gate();
    };
    if let Some(c) = &state.cluster {
        return match crate::cluster::gate_sync::gate_status(c).await {
            Ok(status) => Json(status).into_response(),
            Err(e) => cluster_error(e),
        };
    }
    Json(gate.status()).into_response()
}
