//! The JSON the page reads: sessions, one session's calls and traces, one record, one trace
//! with its tokens' text. Read-only; every id arrives as a query parameter (session ids hold
//! `/`), is bounded in length, and is only ever looked up in the indexes, never used as a path.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::calls::{SessionSummary, SpoolCalls};
use crate::token_text::TokenText;
use crate::traces::{read_trace, TraceIndex};

/// Longest id accepted in a query.
const MAX_ID: usize = 1024;
/// Sessions listed by default, and at most.
const DEFAULT_SESSIONS: usize = 500;
const MAX_SESSIONS: usize = 10_000;

/// What the viewer reads, shared by its handlers.
pub struct Sources {
    pub calls: Option<Mutex<SpoolCalls>>,
    pub traces: Option<Mutex<TraceIndex>>,
    pub text: TokenText,
}

type Shared = Arc<Sources>;

/// Every data route, below the prefix: what an authentication test must try one by one (kept
/// next to the router so a new route cannot be forgotten there).
pub const ROUTES: &[&str] = &[
    "/api/overview",
    "/api/sessions",
    "/api/session",
    "/api/record",
    "/api/trace",
];

/// `PREFIX/api/*`.
pub fn router(prefix: &str, sources: Arc<Sources>) -> Router {
    Router::new()
        .route(&format!("{prefix}/api/overview"), get(overview))
        .route(&format!("{prefix}/api/sessions"), get(sessions))
        .route(&format!("{prefix}/api/session"), get(session))
        .route(&format!("{prefix}/api/record"), get(record))
        .route(&format!("{prefix}/api/trace"), get(trace))
        .with_state(sources)
}

/// A refusal or failure, answered as `{"error": {"type", "message"}}` like every control plane.
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(json!({"error": {"type": self.kind, "message": self.message}})),
        )
            .into_response()
    }
}

fn not_found(message: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "not_found",
        message: message.to_owned(),
    }
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        kind: "read_error",
        message: e.to_string(),
    }
}

type Answer = Result<Response, ApiError>;

fn invalid(message: String) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        kind: "invalid_request",
        message,
    }
}

/// Parameters are taken as strings and checked here, so a bad one gets this API's JSON error
/// rather than the framework's plain-text rejection.
#[derive(Deserialize)]
struct IdQuery {
    id: Option<String>,
}

impl IdQuery {
    fn checked(&self) -> Result<&str, ApiError> {
        match self.id.as_deref() {
            Some(id) if !id.is_empty() && id.len() <= MAX_ID => Ok(id),
            _ => Err(invalid(format!("?id= must be 1 to {MAX_ID} bytes"))),
        }
    }
}

/// Brings the indexes up to date with what was written since (blocking file reads, so off the
/// async threads).
async fn refresh(s: &Shared) -> Result<(), ApiError> {
    let s = s.clone();
    tokio::task::spawn_blocking(move || {
        if let Some(t) = &s.traces {
            t.lock().unwrap().refresh();
        }
        match &s.calls {
            Some(c) => c.lock().unwrap().refresh().map_err(internal),
            None => Ok(()),
        }
    })
    .await
    .map_err(internal)?
}

async fn overview(State(s): State<Shared>) -> Answer {
    refresh(&s).await?;
    let calls = s.calls.as_ref().map(|c| c.lock().unwrap().corrupt_lines);
    let traces = s
        .traces
        .as_ref()
        .map(|t| t.lock().unwrap().unreadable_lines);
    Ok(Json(json!({
        "spool": s.calls.is_some(),
        "traces": s.traces.is_some(),
        "token_text": s.text.describe(),
        "corrupt_spool_lines": calls,
        "unreadable_trace_lines": traces,
    }))
    .into_response())
}

#[derive(Deserialize)]
struct ListQuery {
    limit: Option<String>,
}

#[derive(Serialize)]
struct SessionRow {
    #[serde(flatten)]
    summary: SessionSummary,
    traces: usize,
}

async fn sessions(State(s): State<Shared>, Query(q): Query<ListQuery>) -> Answer {
    let limit = match q.limit.as_deref() {
        None => DEFAULT_SESSIONS,
        Some(n) => n
            .parse::<usize>()
            .map_err(|_| invalid(format!("?limit= must be a count, not {n:?}")))?
            .min(MAX_SESSIONS),
    };
    refresh(&s).await?;
    let mut rows: HashMap<String, SessionRow> = HashMap::new();
    if let Some(c) = &s.calls {
        for summary in c.lock().unwrap().sessions() {
            rows.insert(
                summary.session_id.clone(),
                SessionRow { summary, traces: 0 },
            );
        }
    }
    if let Some(t) = &s.traces {
        let t = t.lock().unwrap();
        for id in t.sessions() {
            rows.entry(id.to_owned())
                .or_insert_with(|| SessionRow {
                    summary: SessionSummary::empty(id),
                    traces: 0,
                })
                .traces = t.count(id);
        }
    }
    let total = rows.len();
    let mut rows: Vec<SessionRow> = rows.into_values().collect();
    // Most recent first.
    rows.sort_by(|a, b| {
        (b.summary.last_ended_at_unix_ms, &a.summary.session_id)
            .cmp(&(a.summary.last_ended_at_unix_ms, &b.summary.session_id))
    });
    rows.truncate(limit);
    Ok(Json(json!({"total": total, "sessions": rows})).into_response())
}

async fn session(State(s): State<Shared>, Query(q): Query<IdQuery>) -> Answer {
    let id = q.checked()?;
    refresh(&s).await?;
    let (summary, calls) = s
        .calls
        .as_ref()
        .and_then(|c| {
            let c = c.lock().unwrap();
            c.session(id)
                .map(|(summary, calls)| (summary, calls.to_vec()))
        })
        .unwrap_or_else(|| (SessionSummary::empty(id), Vec::new()));
    let traces = s
        .traces
        .as_ref()
        .map(|t| t.lock().unwrap().of_session(id).to_vec())
        .unwrap_or_default();
    if calls.is_empty() && traces.is_empty() {
        return Err(not_found("no such session"));
    }
    Ok(Json(json!({"session": summary, "calls": calls, "traces": traces})).into_response())
}

async fn record(State(s): State<Shared>, Query(q): Query<IdQuery>) -> Answer {
    let id = q.checked()?.to_owned();
    if s.calls.is_none() {
        return Err(not_found("no spool is being viewed"));
    }
    refresh(&s).await?;
    let shared = s.clone();
    let found = tokio::task::spawn_blocking(move || match &shared.calls {
        Some(c) => c.lock().unwrap().record(&id),
        None => Ok(None),
    })
    .await
    .map_err(internal)?
    .map_err(internal)?;
    match found {
        // Token data as plain arrays for the page (the spool keeps it compact).
        Some(r) => Ok(Json(tokentap_schema::compact::expand_token_fields(
            serde_json::to_value(&r).map_err(internal)?,
        ))
        .into_response()),
        None => Err(not_found(
            "no such record in the spool (shipped segments are deleted once acknowledged)",
        )),
    }
}

async fn trace(State(s): State<Shared>, Query(q): Query<IdQuery>) -> Answer {
    let id = q.checked()?.to_owned();
    refresh(&s).await?;
    let located = s
        .traces
        .as_ref()
        .and_then(|t| t.lock().unwrap().locate(&id));
    let (file, offset, len) = located.ok_or_else(|| not_found("no such trace"))?;
    let trace = tokio::task::spawn_blocking(move || read_trace(&file, offset, len, &id))
        .await
        .map_err(internal)?
        .map_err(internal)?
        .ok_or_else(|| not_found("the trace's file changed; reload"))?;
    let ids: BTreeSet<u32> = trace
        .prompt_ids
        .iter()
        .chain(&trace.response_ids)
        .copied()
        .collect();
    let pieces = s.text.pieces(&ids).await;
    Ok(Json(json!({"trace": trace, "pieces": pieces})).into_response())
}
