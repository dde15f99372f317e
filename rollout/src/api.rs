//! The node's HTTP control plane (`tokentap serve`): submit, inspect, cancel, and pull results.
//! Every route but `/health` needs `Authorization: Bearer TOKEN` when a token is configured.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use crate::pipeline::{now_ms, Pipeline};
use crate::store::StoreError;
use crate::task::TaskSpec;

#[derive(Clone)]
pub struct ApiState {
    pub pipeline: Arc<Pipeline>,
    pub data_dir: PathBuf,
    pub token: Option<String>,
}

pub fn router(state: ApiState) -> Router {
    let guarded = Router::new()
        .route("/v1/rollouts", post(submit))
        .route("/v1/rollouts/{id}", get(show).delete(cancel))
        .route("/v1/results", get(results))
        .route_layer(middleware::from_fn_with_state(state.clone(), bearer));
    Router::new()
        .merge(guarded)
        .route("/health", get(|| async { "ok" }))
        .with_state(state)
}

/// An error in one shape for every route: `{"error": {"type", "message"}}`.
fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": {"type": kind, "message": message.into()}})),
    )
        .into_response()
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

async fn bearer(State(state): State<ApiState>, req: Request, next: Next) -> Response {
    if let Some(token) = &state.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(token.as_str()) {
            return error(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "a valid bearer token is required",
            );
        }
    }
    next.run(req).await
}

async fn submit(State(state): State<ApiState>, body: axum::body::Bytes) -> Response {
    let spec: TaskSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, "invalid_task", e.to_string()),
    };
    if spec.num_samples == 0 {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_task",
            "num_samples must be at least 1",
        );
    }
    match state.pipeline.store().submit(spec, now_ms()) {
        Ok((rollout, samples)) => {
            let body = json!({
                "rollout_id": rollout.rollout_id,
                "samples": samples.iter().map(|s| &s.sample_id).collect::<Vec<_>>(),
            });
            state
                .pipeline
                .submit(rollout, samples, &state.data_dir)
                .await;
            (StatusCode::ACCEPTED, Json(body)).into_response()
        }
        Err(e) => store_error(e),
    }
}

async fn show(State(state): State<ApiState>, Path(id): Path<String>) -> Response {
    match state.pipeline.store().rollout(&id) {
        Ok((rollout, samples)) => {
            let done = samples.iter().filter(|s| s.outcome.is_some()).count();
            Json(json!({
                "rollout": rollout,
                "status": if done == samples.len() { "done" } else { "running" },
                "samples": samples,
            }))
            .into_response()
        }
        Err(e) => store_error(e),
    }
}

async fn cancel(State(state): State<ApiState>, Path(id): Path<String>) -> Response {
    match state.pipeline.store().cancel(&id, now_ms()) {
        Ok(running) => {
            state.pipeline.cancel_running(&running);
            Json(json!({"rollout_id": id, "stopping": running.len()})).into_response()
        }
        Err(e) => store_error(e),
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
    let deadline = tokio::time::Instant::now() + Duration::from_secs(q.wait.min(60));
    loop {
        // Registered before reading, so a result landing in between still wakes us.
        let notified = state.pipeline.finished.notified();
        match state
            .pipeline
            .store()
            .results_after(q.after, q.limit.clamp(1, 1000))
        {
            Ok(page) if !page.is_empty() || tokio::time::Instant::now() >= deadline => {
                let next = page.last().map_or(q.after, |(c, _)| *c);
                let items: Vec<_> = page
                    .into_iter()
                    .map(|(cursor, sample)| json!({"cursor": cursor, "sample": sample}))
                    .collect();
                return Json(json!({"results": items, "next": next})).into_response();
            }
            Ok(_) => {
                let _ = tokio::time::timeout_at(deadline, notified).await;
            }
            Err(e) => return store_error(e),
        }
    }
}
