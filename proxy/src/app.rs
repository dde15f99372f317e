//! The capture service: a Pingora HTTP application that answers harnesses itself.
//!
//! A model call's life, top to bottom in [`CaptureService::handle_call`]: identify the session,
//! read the body, parse the provider request, prepare the backend request, generate, answer in
//! the provider's shape (streamed or whole), and record what happened — on every path,
//! including failures, so nothing already captured is lost.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ReusedHttpStream};
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use pingora::server::ShutdownWatch;
use serde_json::json;
use tokentap_schema::{
    BackendInfo, CaptureRecord, ErrorKind, HarnessRequest, Normalization, SessionSource, WireApi,
};

use crate::backend::{Backend, BackendError, CallMode, CallScope, GenerationStream};
use crate::capture::{CallCapture, RecordSink};
use crate::gate::CallGate;
use crate::harness::Harness;
use crate::metrics::Metrics;
use crate::redact;
use crate::relay::{collect_events, relay_stream, relay_stream_holding_end, AnswerSink};
use crate::session::{
    self, SessionCounters, SessionHints, SessionResolver, HARNESS_SESSION_HEADERS, SESSION_HEADER,
};
use tokentap_service_kit::limits::{ConnectionGate, ConnectionPermit, ListenerLimits};
use tokentap_wire::canonical::GenerationEvent;
use tokentap_wire::chat_completions::ChatCompletions;
use tokentap_wire::engine_options::{self, EngineOptionPolicy};
use tokentap_wire::messages::Messages;
use tokentap_wire::normalize::{
    drop_orphan_tool_choice, fold_system_messages, layout_from_probe, layout_probe, SystemLayout,
};
use tokentap_wire::responses::Responses;
use tokentap_wire::{CallError, ParsedCall, ResponseMeta, WireCodec, WireError};

/// Proxy behaviour that is policy, not mechanism.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Call the backend non-streaming and play its answer back as a stream.
    pub synthetic_stream: bool,
    /// Model name sent to the backend instead of the harness's (engines serve one name).
    pub backend_model: Option<String>,
    /// Policy (weights) version recorded with each call.
    pub policy_version: Option<String>,
    /// How system and developer messages reach the engine's chat template.
    pub system_layout: SystemLayout,
    /// Every call belongs to this session (a `tokentap run`'s), whatever the request says.
    pub fixed_session: Option<String>,
    /// Deadlines and the connection cap of every listener serving this service.
    pub limits: ListenerLimits,
    /// Write each answered call's record (synced per the spool's fsync policy) before the
    /// harness gets the last bytes of its answer, so no answer a harness has seen can be
    /// missing from the spool after a crash. On with `--fsync always`.
    pub durable_answers: bool,
    /// The key every client must present (`Authorization: Bearer KEY` or `x-api-key: KEY`,
    /// as harnesses send their API key) on every route but `/health`; None: the listener is
    /// open, which only a loopback listener may be.
    pub client_token: Option<String>,
    /// The most a session may use (calls, request bytes) before its calls are refused; only
    /// where sessions are authenticated (a rollout node's samples).
    pub session_budget: session::SessionBudget,
    /// The engine options callers may set (`--engine-option`); every option is held to its
    /// bounds whatever this allows.
    pub engine_options: EngineOptionPolicy,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            max_body_bytes: 32 << 20,
            synthetic_stream: false,
            backend_model: None,
            policy_version: None,
            system_layout: SystemLayout::Auto,
            fixed_session: None,
            limits: ListenerLimits::default(),
            durable_answers: false,
            client_token: None,
            session_budget: session::SessionBudget::default(),
            engine_options: EngineOptionPolicy::default(),
        }
    }
}

/// What a request path leads to.
enum Route {
    Call(&'static dyn WireCodec),
    /// Anthropic `POST /v1/messages/count_tokens`.
    CountTokens,
    Models,
    Health,
    /// Claude Code's connectivity probe, `HEAD /api/hello`.
    Hello,
    Metrics,
    /// Codex's WebSocket attempt on `GET /v1/responses`: answered 426 so it falls back to SSE
    /// at once instead of retrying.
    WebSocketRefused,
    NotFound,
}

static CHAT_COMPLETIONS: ChatCompletions = ChatCompletions;
static RESPONSES: Responses = Responses;
static MESSAGES: Messages = Messages;

/// Splits an optional `/s/{session}` prefix off `path` and picks the route.
fn route<'p>(method: &str, path: &'p str) -> (Route, Option<&'p str>) {
    let (session, rest) = match path.strip_prefix("/s/") {
        Some(after) => match after.split_once('/') {
            Some((s, rest)) => (Some(s), &after[s.len()..][..rest.len() + 1]),
            None => (Some(after), ""),
        },
        None => (None, path),
    };
    let rest = rest.trim_end_matches('/');
    let r = match (method, rest) {
        ("POST", "/v1/chat/completions" | "/chat/completions") => Route::Call(&CHAT_COMPLETIONS),
        // The last one is Codex signed in with ChatGPT (chatgpt.com, intercepted transparently).
        ("POST", "/v1/responses" | "/responses" | "/backend-api/codex/responses") => {
            Route::Call(&RESPONSES)
        }
        ("GET", "/v1/responses" | "/responses") => Route::WebSocketRefused,
        ("POST", "/v1/messages" | "/messages") => Route::Call(&MESSAGES),
        ("POST", "/v1/messages/count_tokens" | "/messages/count_tokens") => Route::CountTokens,
        ("GET", "/v1/models" | "/models") => Route::Models,
        ("GET" | "HEAD", "/health" | "/healthz") => Route::Health,
        ("GET" | "HEAD", "/api/hello") => Route::Hello,
        ("GET", "/metrics") => Route::Metrics,
        _ => Route::NotFound,
    };
    (r, session)
}

/// The session a request names (header, path prefix, query, the harness's own id, the API
/// key), on a listener that neither fixes nor resolves sessions; else `fresh`, a session of
/// this request alone.
fn attribute_session(
    head: &pingora::http::RequestHeader,
    path_session: Option<&str>,
    fresh: impl FnOnce() -> String,
) -> Result<session::Session, CallError> {
    let header_session = head
        .headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok());
    let query_session = head.uri.query().and_then(query_param_session);
    let api_key = api_key(head);
    let harness = HARNESS_SESSION_HEADERS.iter().find_map(|(name, prefix)| {
        let v = head.headers.get(*name)?.to_str().ok()?;
        Some((*prefix, v))
    });
    let hints = SessionHints {
        header: header_session,
        path_prefix: path_session,
        query: query_session.as_deref(),
        harness,
        api_key: api_key.as_deref(),
    };
    session::attribute(&hints, fresh).map_err(CallError::from)
}

/// The session tito may keep a call's conversation in: none for a session of one call.
fn token_session(session: &session::Session) -> Option<&str> {
    (session.source != SessionSource::Generated).then_some(session.id.as_str())
}

/// The id of the session a request was admitted under, if any.
fn session_id(session: &Option<session::Session>) -> Option<&str> {
    session.as_ref().map(|s| s.id.as_str())
}

/// How much of a request body a record keeps when it keeps no whole body: one that is not
/// JSON, or one no call was made of.
pub const BODY_EXCERPT_BYTES: usize = 64 << 10;

/// The start of `body` as text, at most [`BODY_EXCERPT_BYTES`]: redacted whole, then cut (a
/// cut first could leave half a secret unrecognised).
fn body_excerpt(body: &[u8]) -> String {
    let mut shown = redact::text(&String::from_utf8_lossy(body)).into_owned();
    let mut cut = shown.len().min(BODY_EXCERPT_BYTES);
    while !shown.is_char_boundary(cut) {
        cut -= 1;
    }
    shown.truncate(cut);
    shown
}

/// The size of a request's head as a listener limits it: the target and every header's name
/// and value (with the `: ` and line end each takes on the wire).
fn header_bytes(head: &pingora::http::RequestHeader) -> usize {
    let target = head.uri.path_and_query().map_or(0, |p| p.as_str().len());
    head.headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum::<usize>()
        + target
}

pub struct CaptureService {
    config: ProxyConfig,
    backend: Arc<dyn Backend>,
    sink: RecordSink,
    metrics: Arc<Metrics>,
    sessions: SessionCounters,
    /// The layout `Auto` resolved to, once the engine answered the probe.
    resolved_layout: std::sync::OnceLock<SystemLayout>,
    /// Admission before the engine (a rollout node's pause, sampling and policy version).
    gate: Option<Arc<dyn CallGate>>,
    /// The connection cap, over every listener of this service.
    connections: ConnectionGate,
    /// Sessions only from the path prefix, through this map (a rollout node's capture).
    resolver: Option<Arc<dyn SessionResolver>>,
    /// `--token-mode observe`: each finished call rendered and tokenized by tokentap too.
    token_observer: Option<Arc<tokentap_token_mode::Observer>>,
    /// Text mode for the sessions that ask for it, on a service built in a token mode.
    text_mode: Option<TextMode>,
}

/// The sessions that run in text mode (as `--token-mode off` runs every call) on a service
/// built in a token mode (`--token-mode observe|tito`): a rollout node's samples whose task
/// asks for `"token_mode": "off"`.
pub trait TextModeSessions: Send + Sync {
    /// Asked as each call (or token count) of the session begins; the answer holds for that
    /// call's whole life.
    fn in_text_mode(&self, session: &str) -> bool;
}

/// What a service built in a token mode keeps to run some sessions in text mode.
struct TextMode {
    /// The engine called with text (a `tito` service's own backend sends ids).
    backend: Arc<dyn Backend>,
    /// The layout `Auto` resolved to for this backend (a tito backend renders prompts itself,
    /// so the service's own resolution says nothing of the engine's template).
    resolved_layout: std::sync::OnceLock<SystemLayout>,
    sessions: Arc<dyn TextModeSessions>,
}

/// How one call reaches the engine, chosen once from its session ([`CaptureService::token_path`]):
/// the backend, the system-message layout resolved for it, and tokentap's observer of the call
/// (`--token-mode observe`).
struct TokenPath<'a> {
    backend: &'a Arc<dyn Backend>,
    resolved_layout: &'a std::sync::OnceLock<SystemLayout>,
    observer: Option<&'a Arc<tokentap_token_mode::Observer>>,
}

/// What a kept-alive connection carries from one request to the next.
struct OpenConnection {
    _permit: ConnectionPermit,
}

#[async_trait]
impl HttpServerApp for CaptureService {
    async fn process_new_http(
        self: &Arc<Self>,
        http: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        self.process(http, shutdown, self.fixed_session(None), None)
            .await
    }
}

impl CaptureService {
    /// Reads and answers one request; `fixed`: the connection's session, if it has one.
    /// `admitted`: the connection's permit if the listener took one already; a new connection
    /// without one takes one here, and is closed when the cap is reached.
    async fn process(
        &self,
        mut http: ServerSession,
        shutdown: &ShutdownWatch,
        fixed: Option<&str>,
        admitted: Option<ConnectionPermit>,
    ) -> Option<ReusedHttpStream> {
        let limits = &self.config.limits;
        // A kept-alive connection carries its permit from request to request.
        let reused = http
            .take_connection_user_context()
            .and_then(|c| c.downcast::<OpenConnection>().ok());
        let (permit, wait, fresh) = match reused {
            Some(open) => (open._permit, limits.idle_timeout, false),
            None => match admitted.or_else(|| self.connections.admit()) {
                Some(p) => (p, limits.header_timeout, true),
                None => {
                    self.closed_by("max_connections");
                    tracing::warn!(
                        max = limits.max_connections,
                        "connection closed: the proxy is at its connection limit (--max-connections)"
                    );
                    return None;
                }
            },
        };
        // The whole head within the deadline: a client trickling bytes cannot hold it open.
        match tokio::time::timeout(wait, http.read_request()).await {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => return None,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "reading a request head failed");
                return None;
            }
            Err(_) => {
                if fresh {
                    self.closed_by("header_timeout");
                }
                tracing::debug!(?wait, "no complete request head in time; connection closed");
                return None;
            }
        }
        http.set_keepalive(if *shutdown.borrow() {
            None
        } else {
            Some(limits.idle_timeout.as_secs().max(1))
        });
        if !self.serve(&mut http, fixed).await {
            return None;
        }
        let mut settings = HttpPersistentSettings::for_session(&http);
        settings.set_user_context(Box::new(OpenConnection { _permit: permit }));
        match http.finish().await {
            Ok(stream) => stream.map(|s| ReusedHttpStream::from_reusable_stream(s, settings)),
            Err(_) => None,
        }
    }

    pub fn new(
        config: ProxyConfig,
        backend: Arc<dyn Backend>,
        sink: RecordSink,
        metrics: Arc<Metrics>,
    ) -> Self {
        let connections = ConnectionGate::new(config.limits.max_connections);
        CaptureService {
            config,
            backend,
            sink,
            metrics,
            sessions: SessionCounters::default(),
            resolved_layout: std::sync::OnceLock::new(),
            gate: None,
            connections,
            resolver: None,
            token_observer: None,
            text_mode: None,
        }
    }

    /// Calls without a fixed session get theirs from `resolver` and their `/s/{prefix}` alone
    /// (see [`session::resolve`]); what else the request names is ignored.
    pub fn with_session_resolver(mut self, resolver: Arc<dyn SessionResolver>) -> Self {
        self.resolver = Some(resolver);
        self
    }

    /// `--token-mode observe` with `observer`: every finished call's record gets its
    /// `token_observation`.
    pub fn with_token_observer(mut self, observer: Arc<tokentap_token_mode::Observer>) -> Self {
        self.token_observer = Some(observer);
        self
    }

    /// Runs the calls of the sessions `sessions` names in text mode whatever token mode the
    /// service was built in: to `backend` (the engine called with text, as `--token-mode off`
    /// calls it), unobserved. Only a session the listener vouches for (fixed or resolved) can;
    /// one a request names for itself runs in the service's own mode.
    pub fn with_text_mode_sessions(
        mut self,
        backend: Arc<dyn Backend>,
        sessions: Arc<dyn TextModeSessions>,
    ) -> Self {
        self.text_mode = Some(TextMode {
            backend,
            resolved_layout: std::sync::OnceLock::new(),
            sessions,
        });
        self
    }

    /// The way a call of `session` (the one the listener fixed or resolved) reaches the engine:
    /// in text mode when the service runs that session so, else in the service's own mode.
    fn token_path(&self, session: Option<&str>) -> TokenPath<'_> {
        match (&self.text_mode, session) {
            (Some(text), Some(id)) if text.sessions.in_text_mode(id) => TokenPath {
                backend: &text.backend,
                resolved_layout: &text.resolved_layout,
                observer: None,
            },
            _ => TokenPath {
                backend: &self.backend,
                resolved_layout: &self.resolved_layout,
                observer: self.token_observer.as_ref(),
            },
        }
    }

    /// Requires `token` of every client (see [`ProxyConfig::client_token`]).
    pub fn with_client_token(mut self, token: Option<String>) -> Self {
        self.config.client_token = token;
        self
    }

    /// Puts `gate` in front of every engine call.
    pub fn with_gate(mut self, gate: Arc<dyn CallGate>) -> Self {
        self.gate = Some(gate);
        self
    }

    /// Bounds what each session may use ([`session::SessionBudget`]).
    pub fn with_session_budget(mut self, budget: session::SessionBudget) -> Self {
        self.config.session_budget = budget;
        self
    }

    /// Lets callers set only the engine options `policy` allows.
    pub fn with_engine_options(mut self, policy: EngineOptionPolicy) -> Self {
        self.config.engine_options = policy;
        self
    }

    /// The system-message layout for this engine on `path`; `Auto` asks the engine's template
    /// once per path.
    async fn system_layout(&self, path: &TokenPath<'_>, model: &str) -> SystemLayout {
        if self.config.system_layout != SystemLayout::Auto {
            return self.config.system_layout;
        }
        if let Some(l) = path.resolved_layout.get() {
            return *l;
        }
        let outcome = path.backend.probe_template(&layout_probe(model)).await;
        match layout_from_probe(&outcome) {
            Some(l) => {
                tracing::info!(?outcome, layout = ?l, "system-message layout chosen from the engine's chat template");
                *path.resolved_layout.get_or_init(|| l)
            }
            None => SystemLayout::AsSent,
        }
    }

    /// Answers one request; returns whether the connection may be reused.
    async fn serve(&self, http: &mut ServerSession, fixed: Option<&str>) -> bool {
        let method = http.req_header().method.as_str().to_owned();
        let path = http.req_header().uri.path().to_owned();
        let (route, path_session) = route(&method, &path);
        let session = match self.admit_request(http.req_header(), &route, fixed, path_session) {
            Ok(session) => session,
            Err(err) => {
                // Refused before any body is read, any engine is called or anything is
                // recorded, in the caller's shape; the connection is closed after the answer
                // (its body was never read).
                let codec = match &route {
                    Route::Call(codec) => *codec,
                    Route::CountTokens => &MESSAGES,
                    _ => caller_codec(http.req_header()),
                };
                self.write_error(http, codec, &err).await;
                return false;
            }
        };
        match route {
            Route::Call(codec) => {
                let hints = path_session.map(str::to_owned);
                self.handle_call(http, codec, hints, session).await
            }
            Route::CountTokens => {
                let hints = path_session.map(str::to_owned);
                self.count_tokens(http, hints, session).await
            }
            Route::Health => write_json(http, 200, &json!({"status": "ok"})).await,
            Route::Hello => write_body(http, 200, "application/json", Vec::new()).await,
            Route::WebSocketRefused => {
                self.metrics.websocket_refused.inc();
                let err = CallError::new(
                    ErrorKind::InvalidRequest,
                    426,
                    "tokentap answers the Responses API over HTTP (SSE), not WebSocket; POST /v1/responses instead.",
                );
                self.write_error(http, &RESPONSES, &err).await
            }
            Route::Metrics => {
                write_body(
                    http,
                    200,
                    "text/plain; version=0.0.4",
                    self.metrics.render(),
                )
                .await
            }
            Route::Models => match self.models(session_id(&session)).await {
                Ok(models) => write_json(http, 200, &models).await,
                Err(e) => {
                    self.write_error(http, &CHAT_COMPLETIONS, &CallError::from(&e))
                        .await
                }
            },
            Route::NotFound => {
                let _ = http.drain_request_body().await;
                let codec = caller_codec(http.req_header());
                self.write_error(http, codec, &CallError::not_found(&method, &path))
                    .await
            }
        }
    }

    /// Checks a request's head before anything else happens to it: its size, the listener's
    /// client token, and on a listener that resolves sessions (a rollout node's capture) the
    /// session, for every route that reaches the engine or shows what the capture holds
    /// (calls, `count_tokens`, `/v1/models`, `/metrics`, anything unknown). The session it
    /// knows for the request (fixed or resolved; None: a call is attributed from what it
    /// says), or the refusal, counted and never recorded.
    fn admit_request(
        &self,
        head: &pingora::http::RequestHeader,
        route: &Route,
        fixed: Option<&str>,
        path_session: Option<&str>,
    ) -> Result<Option<session::Session>, CallError> {
        let limit = self.config.limits.max_header_bytes;
        let size = header_bytes(head);
        if size > limit {
            self.closed_by("header_bytes");
            return Err(CallError::new(
                ErrorKind::InvalidRequest,
                431,
                format!("the request's head is {size} bytes; this listener takes at most {limit}"),
            ));
        }
        // `/health` needs no token (probes have none) and names no session, but its head is
        // bounded like every other route's.
        if matches!(route, Route::Health) {
            return Ok(None);
        }
        if !self.client_admitted(head) {
            self.closed_by("client_token");
            return Err(CallError::new(
                ErrorKind::InvalidRequest,
                401,
                "this tokentap listener needs its client token as the API key (Authorization: Bearer TOKEN or x-api-key: TOKEN)",
            ));
        }
        let admitted = match (fixed, &self.resolver) {
            (Some(id), _) => session::Session {
                id: id.to_owned(),
                source: SessionSource::Run,
            },
            // Claude Code's connectivity probe reaches nothing.
            (None, Some(_)) if matches!(route, Route::Hello) => return Ok(None),
            (None, Some(r)) => match session::resolve(r.as_ref(), path_session) {
                Ok(s) => s,
                Err(e) => {
                    self.metrics
                        .calls_refused
                        .with_label_values(&["unknown_session"])
                        .inc();
                    return Err(e);
                }
            },
            (None, None) => return Ok(None),
        };
        // Refused before the body is read, and not recorded: a session past its budget
        // costs the node nothing more (and its trajectory ends with its last admitted call).
        let used = self.sessions.used(&admitted.id);
        if let Some(why) = self.config.session_budget.spent(used) {
            self.metrics
                .calls_refused
                .with_label_values(&["session_budget"])
                .inc();
            if self.sessions.note_refused(&admitted.id) == 1 {
                tracing::warn!(session = %admitted.id, calls = used.calls, request_bytes = used.request_bytes, "{why}; its further calls are refused");
            }
            return Err(CallError::new(ErrorKind::InvalidRequest, 400, why));
        }
        Ok(Some(admitted))
    }

    /// The engine's model list, held like a call while the gate holds calls.
    async fn models(
        &self,
        session: Option<&str>,
    ) -> Result<serde_json::Value, crate::backend::BackendError> {
        let _held = match &self.gate {
            Some(gate) => gate.hold(session).await,
            None => None,
        };
        self.backend.models().await
    }

    /// Whether the request carries the listener's client token (always, when it has none).
    fn client_admitted(&self, head: &pingora::http::RequestHeader) -> bool {
        use subtle::ConstantTimeEq;
        let Some(token) = &self.config.client_token else {
            return true;
        };
        api_key(head).is_some_and(|key| bool::from(key.as_bytes().ct_eq(token.as_bytes())))
    }

    /// The session every call on a connection belongs to, if any: the connection's own (a
    /// rollout sample's interception), else the proxy's (a `tokentap run`'s).
    fn fixed_session<'a>(&'a self, connection: Option<&'a str>) -> Option<&'a str> {
        connection.or(self.config.fixed_session.as_deref())
    }

    /// Calls begun so far in `session` (each ends in exactly one record).
    pub fn session_calls(&self, session: &str) -> u64 {
        self.sessions.calls(session)
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn limits(&self) -> &ListenerLimits {
        &self.config.limits
    }

    /// A place under the connection cap for a connection a listener just accepted, or `None`
    /// at the cap (the listener closes it; counted in `tokentap_connections_closed_total`).
    pub fn admit_connection(&self) -> Option<ConnectionPermit> {
        let p = self.connections.admit();
        if p.is_none() {
            self.closed_by("max_connections");
        }
        p
    }

    /// Counts a connection a listener limit closed.
    pub fn closed_by(&self, limit: &str) {
        self.metrics
            .connections_closed
            .with_label_values(&[limit])
            .inc();
    }

    /// Serves HTTP/1.1 requests on a connection accepted elsewhere (an intercepted TLS
    /// connection from the transparent listener) until it closes. `session`: every call on
    /// the connection belongs to it (a rollout sample's interception), whatever the request
    /// says; else the proxy's fixed session or per-call attribution.
    pub async fn serve_stream(
        &self,
        stream: pingora::protocols::Stream,
        shutdown: &ShutdownWatch,
        session: Option<&str>,
    ) {
        let Some(permit) = self.admit_connection() else {
            return;
        };
        self.serve_admitted_stream(stream, shutdown, session, permit)
            .await
    }

    /// [`Self::serve_stream`] for a connection its listener already admitted under the cap.
    pub async fn serve_admitted_stream(
        &self,
        stream: pingora::protocols::Stream,
        shutdown: &ShutdownWatch,
        session: Option<&str>,
        permit: ConnectionPermit,
    ) {
        let fixed = self.fixed_session(session);
        let mut next = Some((stream, None));
        let mut admitted = Some(permit);
        while let Some((stream, settings)) = next.take() {
            let mut http = ServerSession::new_http1(stream);
            if let Some(settings) = settings {
                HttpPersistentSettings::apply_to_session(settings, &mut http);
            }
            if let Some(reused) = self.process(http, shutdown, fixed, admitted.take()).await {
                next = Some(reused.consume());
            }
        }
    }

    /// Records a connection that failed before any request could be read (a TLS handshake the
    /// client aborted), so the failure is visible in the spool, not only in logs.
    pub async fn record_connection_failure(
        &self,
        host: &str,
        kind: ErrorKind,
        message: String,
        session: Option<&str>,
    ) {
        let request = HarnessRequest::bare("CONNECT", host);
        let mut backend = self.backend_info();
        backend.synthetic_stream = false;
        let mut call = CallCapture::new(WireApi::Unparsed, request, backend);
        call.error = Some(CallError::new(kind, 0, message));
        let session = match self.fixed_session(session) {
            Some(id) => session::Session {
                id: id.to_owned(),
                source: tokentap_schema::SessionSource::Run,
            },
            None => session::Session {
                id: format!("call-{}", call.record_id),
                source: tokentap_schema::SessionSource::Generated,
            },
        };
        let seq = self.sessions.next_seq(&session);
        call.session = Some((session, seq));
        // No request was read: nothing for an observer.
        self.end_call(call, None).await;
    }

    /// The request body within the size limit and `--body-timeout` (counted when it times out).
    async fn read_body(&self, http: &mut ServerSession) -> Result<Vec<u8>, BodyError> {
        let limits = &self.config.limits;
        let r = read_body(http, self.config.max_body_bytes, limits.body_timeout).await;
        if matches!(r, Err(BodyError::TimedOut(_))) {
            self.closed_by("body_timeout");
        }
        r
    }

    /// Anthropic token counting: the engine's own count of the prompt it would see. Not a model
    /// call, so no record; errors come back in the Messages shape. Work done for the session
    /// all the same (tito renders and tokenizes the whole request): it counts against the
    /// session's budget like a call, its bytes as they are read.
    async fn count_tokens(
        &self,
        http: &mut ServerSession,
        path_session: Option<String>,
        admitted: Option<session::Session>,
    ) -> bool {
        // The session the listener vouches for (fixed or resolved) picks the token path and
        // the gate's hold, as for a call.
        let admitted_id = admitted.as_ref().map(|s| s.id.clone());
        let attributed = match admitted {
            Some(s) => Ok(s),
            None => attribute_session(http.req_header(), path_session.as_deref(), || {
                format!("count-{}", uuid::Uuid::now_v7())
            }),
        };
        let session = match attributed {
            Ok(s) => s,
            Err(e) => {
                let _ = http.drain_request_body().await;
                return self.write_error(http, &MESSAGES, &e).await;
            }
        };
        if session.source != SessionSource::Generated {
            self.sessions.add_token_count(&session.id);
        }
        let body = match self.read_body(http).await {
            Ok(b) => b,
            Err(BodyError::TooLarge) => {
                let err = CallError::body_too_large(self.config.max_body_bytes);
                let _ = self.write_error(http, &MESSAGES, &err).await;
                return false;
            }
            Err(BodyError::TimedOut(_)) | Err(BodyError::Io(_)) => return false,
        };
        if session.source != SessionSource::Generated {
            self.sessions
                .add_request_bytes(&session.id, body.len() as u64);
        }
        let screened = MESSAGES
            .parse_count_tokens(&body)
            .map_err(CallError::from)
            .and_then(|p| self.screen_engine_options(&MESSAGES, p));
        let mut request = match screened {
            Ok(p) => p.request,
            Err(e) => return self.write_error(http, &MESSAGES, &e).await,
        };
        if let Some(model) = &self.config.backend_model {
            request.model = model.clone();
        }
        let admitted_id = admitted_id.as_deref();
        let _held = match &self.gate {
            Some(gate) => gate.hold(admitted_id).await,
            None => None,
        };
        // The count of the prompt this session's calls send: tito's own ids (from this
        // session's conversations only), or the engine's.
        let backend = self.token_path(admitted_id).backend;
        match backend
            .count_prompt_tokens(&request, token_session(&session))
            .await
        {
            Ok(n) => write_json(http, 200, &json!({"input_tokens": n})).await,
            Err(e) => {
                self.write_error(http, &MESSAGES, &CallError::from(&e))
                    .await
            }
        }
    }

    /// One model call, from arrival to record.
    async fn handle_call(
        &self,
        http: &mut ServerSession,
        codec: &dyn WireCodec,
        path_session: Option<String>,
        admitted: Option<session::Session>,
    ) -> bool {
        if let Some(cause) = self.sink.refusal() {
            return self.refuse_unwritable_spool(http, codec, &cause).await;
        }
        let mut call = self.begin_call(http, codec.api());
        let path = self.token_path(session_id(&admitted));
        let inflight = self
            .metrics
            .inflight
            .with_label_values(&self.engine_labels());
        inflight.inc();
        let reusable = self
            .run_call(http, codec, path_session, admitted, &path, &mut call)
            .await;
        inflight.dec();
        self.end_call(call, path.observer).await;
        reusable
    }

    /// `--on-spool-error fail-closed` while the spool cannot be written: the call is refused
    /// before anything else happens (no session, no engine, no record — there would be nowhere
    /// to put it), in the provider's shape with a 503, which harnesses retry.
    async fn refuse_unwritable_spool(
        &self,
        http: &mut ServerSession,
        codec: &dyn WireCodec,
        cause: &str,
    ) -> bool {
        self.metrics
            .calls_refused
            .with_label_values(&["spool_unwritable"])
            .inc();
        // Read (bounded) what the harness sends, so the connection can carry its retry.
        let drained =
            tokio::time::timeout(self.config.limits.body_timeout, http.drain_request_body())
                .await
                .is_ok_and(|r| r.is_ok());
        let err = CallError::new(
            ErrorKind::Internal,
            503,
            format!(
                "tokentap cannot write its capture spool ({cause}); the call was not sent to the engine. It is answered again as soon as the spool is writable (--on-spool-error fail-closed)."
            ),
        );
        self.write_error(http, codec, &err).await && drained
    }

    fn begin_call(&self, http: &ServerSession, wire_api: WireApi) -> CallCapture {
        let head = http.req_header();
        let request = HarnessRequest {
            method: head.method.as_str().to_owned(),
            path: self.recorded_path(head.uri.path()),
            query: head.uri.query().map(redact::query),
            headers: redact::headers(head.headers.iter().map(|(k, v)| (k.as_str(), v.as_bytes()))),
            body_bytes: 0,
            body: None,
            body_text: None,
        };
        CallCapture::new(wire_api, request, self.backend_info())
    }

    /// The request's path as records keep it: on a listener that resolves sessions the
    /// `/s/{prefix}` is a sample's secret (its session is in the record already), so it is
    /// not kept.
    fn recorded_path(&self, path: &str) -> String {
        match (&self.resolver, path.strip_prefix("/s/")) {
            (Some(_), Some(after)) => match after.find('/') {
                Some(i) => format!("/s/{}{}", redact::REDACTED, &after[i..]),
                None => format!("/s/{}", redact::REDACTED),
            },
            _ => path.to_owned(),
        }
    }

    /// The engine as the records describe it.
    fn backend_info(&self) -> BackendInfo {
        BackendInfo {
            kind: self.backend.kind(),
            url: self.backend.url().to_owned(),
            model: String::new(),
            policy_version: self.config.policy_version.clone(),
            engine_weight_version: None,
            synthetic_stream: self.config.synthetic_stream,
        }
    }

    async fn run_call(
        &self,
        http: &mut ServerSession,
        codec: &dyn WireCodec,
        path_session: Option<String>,
        admitted: Option<session::Session>,
        path: &TokenPath<'_>,
        call: &mut CallCapture,
    ) -> bool {
        // Identify the session: the one the listener fixed or resolved, else from what the
        // request says.
        let attributed = match admitted {
            Some(s) => Ok(s),
            None => attribute_session(http.req_header(), path_session.as_deref(), || {
                format!("call-{}", call.record_id)
            }),
        };
        let session = match attributed {
            Ok(s) => s,
            Err(e) => {
                let _ = http.drain_request_body().await;
                return self.fail(http, codec, call, e).await;
            }
        };
        let seq = self.sessions.next_seq(&session);
        // Classified once; the admission gate may know better (Pi on a rollout node).
        let harness = Harness::from_headers(&call.request.headers);
        call.harness = Some(harness);
        if session.source != SessionSource::Generated {
            // A generated session holds one call: it has no harness time between calls.
            let [engine, model] = self.engine_labels();
            self.metrics.activity.begin(
                &session.id,
                [engine.into(), model.into(), harness.as_str().into()],
            );
            call.in_activity = true;
        }
        call.session = Some((session, seq));

        // Read the body, within the limit.
        let body = match self.read_body(http).await {
            Ok(b) => b,
            Err(BodyError::TooLarge) => {
                let err = CallError::body_too_large(self.config.max_body_bytes);
                self.fail(http, codec, call, err).await;
                // Discard what the harness is still sending (bounded): closing with unread
                // data resets the connection, and the harness would lose the 413 it was sent.
                let drain = std::time::Duration::from_secs(5);
                let _ = tokio::time::timeout(drain, http.drain_request_body()).await;
                return false; // the connection is not reused after an oversized body
            }
            Err(BodyError::TimedOut(d)) => {
                let err = CallError::new(
                    ErrorKind::ClientDisconnected,
                    408,
                    format!(
                        "the request body did not arrive within {d:?} (the proxy's --body-timeout)"
                    ),
                );
                self.fail(http, codec, call, err).await;
                return false;
            }
            Err(BodyError::Io(e)) => {
                call.error = Some(CallError::new(
                    ErrorKind::ClientDisconnected,
                    499,
                    format!("reading the request body: {e}"),
                ));
                call.response_status = 499;
                return false;
            }
        };
        call.request.body_bytes = body.len() as u64;
        if let Some((session, _)) = &call.session {
            self.sessions
                .add_request_bytes(&session.id, call.request.body_bytes);
        }
        // Under --no-capture nothing is built for a record that goes nowhere.
        match self
            .sink
            .keeps_records()
            .then(|| redact::recorded_body(&body))
        {
            None => {}
            Some(Some(kept)) => {
                call.request.body = Some(kept.body);
                call.body_verbatim = kept.verbatim;
            }
            Some(None) => call.request.body_text = Some(body_excerpt(&body)),
        }

        // Parse the provider request into the canonical one, its engine options screened.
        let parsed = codec
            .parse(&body)
            .map_err(CallError::from)
            .and_then(|p| self.screen_engine_options(codec, p));
        let parsed = match parsed {
            Ok(p) => p,
            Err(e) => {
                // A body no call was made of is kept as an excerpt past 64 KiB, so refused
                // calls cannot fill the spool (nor a watched session's records) at the rate
                // the harness sends bytes.
                if body.len() > BODY_EXCERPT_BYTES && call.request.body.take().is_some() {
                    call.request.body_text = Some(body_excerpt(&body));
                    call.body_verbatim = false;
                }
                return self.fail(http, codec, call, e).await;
            }
        };
        let meta = ResponseMeta {
            id: format!("{}{}", codec.id_prefix(), call.record_id.replace('-', "")),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: parsed.request.model.clone(),
            echo: parsed.echo,
        };
        call.normalizations = parsed.normalizations;

        // Prepare the backend request.
        let mut request = parsed.request;
        if let Some(model) = &self.config.backend_model {
            if &request.model != model {
                call.normalizations.push(Normalization {
                    kind: "model_override".into(),
                    detail: format!("model '{}' sent to the backend as '{model}'", request.model),
                });
                request.model = model.clone();
            }
        }
        call.normalizations
            .extend(drop_orphan_tool_choice(&mut request));
        if self.system_layout(path, &request.model).await == SystemLayout::Single {
            call.normalizations
                .extend(fold_system_messages(&mut request));
        }
        call.backend.model = request.model.clone();
        let stream_to_harness = request.stream;
        let wanted = if stream_to_harness && !self.config.synthetic_stream {
            CallMode::Streaming
        } else {
            CallMode::Whole
        };
        let (mode, why_whole) = path.backend.call_mode(&request, wanted);
        if let Some(reason) = why_whole {
            call.normalizations.push(Normalization {
                kind: "synthetic_stream".into(),
                detail: format!("called the backend non-streaming and replayed the answer as a stream: {reason}"),
            });
        }
        call.backend.synthetic_stream = stream_to_harness && mode == CallMode::Whole;
        // Held until this call is answered.
        let _permit = match &self.gate {
            Some(gate) => {
                let session = call.session.as_ref().map(|(s, _)| s.id.clone());
                let labels = self.engine_labels();
                let waiting = self.metrics.gate_waiting.with_label_values(&labels);
                waiting.inc();
                let held = Instant::now();
                let admission = gate.admit(session.as_deref(), &mut request).await;
                waiting.dec();
                self.metrics
                    .gate_hold_seconds
                    .with_label_values(&labels)
                    .observe(held.elapsed().as_secs_f64());
                call.harness = admission.harness.or(call.harness);
                call.normalizations.extend(admission.normalizations);
                if admission.policy_version.is_some() {
                    call.backend.policy_version = admission.policy_version;
                }
                admission.permit
            }
            None => None,
        };
        call.backend_request = Some(request);

        // Generate.
        let t = Instant::now();
        let started = path
            .backend
            .generate_call(
                call.backend_request.as_ref().expect("set above"),
                mode,
                CallScope {
                    record_id: &call.record_id,
                    session: call.session.as_ref().and_then(|(s, _)| token_session(s)),
                },
            )
            .await;
        call.backend_time += t.elapsed();
        let mut events = match started {
            Ok(events) => events,
            Err(e) => return self.fail(http, codec, call, CallError::from(&e)).await,
        };

        // Answer in the provider's shape.
        match (stream_to_harness, mode) {
            (true, mode) => {
                let mut renderer = codec.stream_renderer(meta, parsed.include_usage);
                let events = match mode {
                    CallMode::Streaming => events,
                    CallMode::Whole => {
                        let replay = collect_events(&mut events, call).await;
                        // The whole answer is known: its prompt size goes in the opening event
                        // even when the engine reports it last (in its usage).
                        if let Some(n) = prompt_size(&replay) {
                            renderer.prompt_tokens(n);
                        }
                        Box::pin(futures::stream::iter(replay))
                    }
                };
                if !self.config.durable_answers {
                    return relay_stream(http, renderer, events, call).await;
                }
                match relay_stream_holding_end(http, renderer, events, call).await {
                    (reusable, Some(end)) => {
                        self.commit(call, path.observer).await;
                        // The record stands as answered even if these last bytes find the
                        // harness gone: the engine generated it and it was sent.
                        http.send_body(end, true).await && reusable
                    }
                    (reusable, None) => reusable,
                }
            }
            (false, _) => {
                self.respond_whole(http, codec, &meta, events, path.observer, call)
                    .await
            }
        }
    }

    async fn respond_whole(
        &self,
        http: &mut ServerSession,
        codec: &dyn WireCodec,
        meta: &ResponseMeta,
        mut events: GenerationStream,
        observer: Option<&Arc<tokentap_token_mode::Observer>>,
        call: &mut CallCapture,
    ) -> bool {
        for event in collect_events(&mut events, call).await {
            match event {
                Ok(e) => call.generation.push(e),
                Err(e) => return self.fail(http, codec, call, CallError::from(&e)).await,
            }
        }
        let body = codec.render_whole(meta, &call.generation);
        call.first_content_at = Some(Instant::now());
        call.response_status = 200;
        if self.config.durable_answers {
            self.commit(call, observer).await;
        }
        let ok = write_body(http, 200, "application/json", body).await;
        if !ok {
            call.error = Some(CallError::new(
                ErrorKind::ClientDisconnected,
                499,
                "the harness went away before the answer was written",
            ));
        }
        ok
    }

    /// Holds a parsed call's engine options to their bounds (a refusal: a 400 naming the
    /// parameter) and leaves out those this listener does not let callers set (each noted on
    /// the record); both counted by option.
    fn screen_engine_options(
        &self,
        codec: &dyn WireCodec,
        mut parsed: ParsedCall,
    ) -> Result<ParsedCall, CallError> {
        let policy = &self.config.engine_options;
        match engine_options::screen(&mut parsed.request, policy, |o| {
            codec.engine_option_param(o)
        }) {
            Ok(dropped) => {
                for d in dropped {
                    self.metrics
                        .engine_options_dropped
                        .with_label_values(&[d.label])
                        .inc();
                    parsed.normalizations.push(d.normalization());
                }
                Ok(parsed)
            }
            Err(refusal) => {
                self.metrics
                    .engine_options_refused
                    .with_label_values(&[refusal.label])
                    .inc();
                Err(WireError::at(refusal.param, refusal.message).into())
            }
        }
    }

    /// Answers with an error in the provider's shape and notes it on the record.
    async fn fail(
        &self,
        http: &mut ServerSession,
        codec: &dyn WireCodec,
        call: &mut CallCapture,
        err: CallError,
    ) -> bool {
        call.response_status = err.status;
        let ok = self.write_error(http, codec, &err).await;
        call.error = Some(err);
        ok
    }

    async fn write_error(
        &self,
        http: &mut ServerSession,
        codec: &dyn WireCodec,
        err: &CallError,
    ) -> bool {
        let (status, body) = codec.render_error(err);
        write_body(http, status, "application/json", body).await
    }

    /// Records the call (unless committed already), observed by `observer` when given.
    async fn end_call(
        &self,
        call: CallCapture,
        observer: Option<&Arc<tokentap_token_mode::Observer>>,
    ) {
        if call.committed {
            return;
        }
        let (harness, in_activity) = (call.harness, call.in_activity);
        let request = observed_request(observer, &call);
        let record = self
            .observe_tokens(observer, request, call.into_record())
            .await;
        self.count(&record, harness, in_activity);
        self.sink.send(record, &self.metrics).await;
    }

    /// `--token-mode observe`: the call rendered and tokenized by tokentap, compared with the
    /// engine's prompt ids and the session's earlier calls, on the record. On a blocking
    /// thread: a long conversation takes milliseconds (docs/benchmarks.md), which must not
    /// hold up the other calls this worker thread serves.
    async fn observe_tokens(
        &self,
        observer: Option<&Arc<tokentap_token_mode::Observer>>,
        request: Option<tokentap_schema::ChatRequest>,
        mut record: CaptureRecord,
    ) -> CaptureRecord {
        let (Some(observer), Some(request)) = (observer.cloned(), request) else {
            return record;
        };
        // The record stays here whatever happens to the observation: copies of what it needs
        // go to the blocking thread (ids: 4 bytes each, microseconds to copy).
        let session_id = record.session_id.clone();
        let record_id = record.record_id.clone();
        let prompt = record.prompt_token_ids.clone();
        let completion = record.completion_token_ids.clone();
        let reasoning = record.message.as_ref().and_then(|m| m.reasoning.clone());
        let observed = tokio::task::spawn_blocking(move || {
            let observation = observer.observe(tokentap_token_mode::CallView {
                session_id: &session_id,
                record_id: &record_id,
                request: &request,
                engine_prompt: prompt.as_deref(),
                completion: completion.as_deref(),
                reasoning: reasoning.as_deref(),
            });
            (observation, observer.held_tokens())
        })
        .await;
        match observed {
            Ok((observation, held)) => {
                self.metrics.token_mode_held_tokens.set(held as i64);
                record.token_observation = Some(observation);
            }
            // A panic in the observer (never expected) costs the observation,
            // not the record.
            Err(e) => {
                tracing::error!(error = %e, record = %record.record_id, "token mode observer failed")
            }
        }
        record
    }

    /// Durable answers: the call's record, written before the harness gets its answer's end.
    async fn commit(
        &self,
        call: &mut CallCapture,
        observer: Option<&Arc<tokentap_token_mode::Observer>>,
    ) {
        let (harness, in_activity) = (call.harness, call.in_activity);
        let request = observed_request(observer, call);
        let record = self
            .observe_tokens(observer, request, call.take_record())
            .await;
        self.count(&record, harness, in_activity);
        // Under fail-closed this waits while the spool fails (the record is retried, never
        // dropped). Not written (fail-open, or the proxy stopping): the writer counted it
        // lost; the answer still goes.
        self.sink.commit(record, &self.metrics).await;
    }

    /// The engine and model labels of this proxy's calls before a request names its model:
    /// the configured model (engines serve one name), else `any`.
    fn engine_labels(&self) -> [&str; 2] {
        let model = match &self.config.backend_model {
            Some(m) => self.metrics.models.label(m),
            None => "any",
        };
        [self.backend.kind().as_str(), model]
    }

    /// A finished call in the metrics.
    fn count(&self, record: &CaptureRecord, harness: Option<Harness>, in_activity: bool) {
        self.metrics.record_call(record, harness, in_activity);
    }
}

/// The conversation the engine rendered, when `observer` watches the call's token drift.
fn observed_request(
    observer: Option<&Arc<tokentap_token_mode::Observer>>,
    call: &CallCapture,
) -> Option<tokentap_schema::ChatRequest> {
    observer?;
    call.backend_request.clone()
}

enum BodyError {
    TooLarge,
    Io(String),
    /// Not all of it arrived within `--body-timeout`.
    TimedOut(std::time::Duration),
}

/// The whole request body, at most `limit` bytes, arriving within `deadline`.
async fn read_body(
    http: &mut ServerSession,
    limit: usize,
    deadline: std::time::Duration,
) -> Result<Vec<u8>, BodyError> {
    tokio::time::timeout(deadline, read_body_unbounded(http, limit))
        .await
        .unwrap_or(Err(BodyError::TimedOut(deadline)))
}

async fn read_body_unbounded(http: &mut ServerSession, limit: usize) -> Result<Vec<u8>, BodyError> {
    let declared = http
        .req_header()
        .headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(BodyError::TooLarge);
    }
    let mut body = Vec::with_capacity(declared.unwrap_or(0) as usize);
    loop {
        match http.read_request_body().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > limit {
                    return Err(BodyError::TooLarge);
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body),
            Err(e) => return Err(BodyError::Io(e.to_string())),
        }
    }
}

/// The prompt's token count in a whole generation: its prompt ids (or size), else the engine's
/// usage.
fn prompt_size(events: &[Result<GenerationEvent, BackendError>]) -> Option<u64> {
    let ids = events.iter().find_map(|e| match e {
        Ok(GenerationEvent::PromptTokens { ids, .. }) => Some(ids.len() as u64),
        Ok(GenerationEvent::PromptSize(n)) => Some(*n),
        _ => None,
    });
    ids.or_else(|| {
        events.iter().find_map(|e| match e {
            Ok(GenerationEvent::Finished { usage: Some(u), .. }) => Some(u.prompt_tokens),
            _ => None,
        })
    })
}

/// The `session` query parameter, percent-decoded (`?session=team%2Fa%20b` is `team/a b`).
/// The API whose error shape answers a request that no wire API's route names: Anthropic
/// clients send a version header, everything else gets OpenAI's shape.
fn caller_codec(head: &pingora::http::RequestHeader) -> &'static dyn WireCodec {
    if head.headers.contains_key("anthropic-version") {
        &MESSAGES
    } else {
        &CHAT_COMPLETIONS
    }
}

fn query_param_session(q: &str) -> Option<String> {
    form_urlencoded::parse(q.as_bytes())
        .find(|(k, _)| k == "session")
        .map(|(_, v)| v.into_owned())
}

fn api_key(head: &pingora::http::RequestHeader) -> Option<String> {
    let h = |n: &str| head.headers.get(n).and_then(|v| v.to_str().ok());
    h("authorization")
        .map(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
                .unwrap_or(v)
                .trim()
                .to_owned()
        })
        .or_else(|| h("x-api-key").map(str::to_owned))
}

async fn write_json(http: &mut ServerSession, status: u16, v: &serde_json::Value) -> bool {
    write_body(
        http,
        status,
        "application/json",
        serde_json::to_vec(v).expect("JSON values always serialize"),
    )
    .await
}

async fn write_body(
    http: &mut ServerSession,
    status: u16,
    content_type: &str,
    body: Vec<u8>,
) -> bool {
    let mut head = ResponseHeader::build(status, Some(3)).expect("valid status");
    let _ = head.insert_header("content-type", content_type);
    let _ = head.insert_header("content-length", body.len().to_string());
    if http.write_response_header(Box::new(head)).await.is_err() {
        return false;
    }
    http.write_response_body(Bytes::from(body), true)
        .await
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_strip_a_session_prefix() {
        let (r, s) = route("POST", "/s/run-7/v1/chat/completions");
        assert!(matches!(r, Route::Call(_)));
        assert_eq!(s, Some("run-7"));
        let (r, s) = route("POST", "/v1/chat/completions");
        assert!(matches!(r, Route::Call(_)) && s.is_none());
        assert!(matches!(route("GET", "/v1/models").0, Route::Models));
        assert!(matches!(route("GET", "/health").0, Route::Health));
        assert!(matches!(route("GET", "/metrics").0, Route::Metrics));
        assert!(matches!(
            route("GET", "/v1/chat/completions").0,
            Route::NotFound
        ));
        assert!(matches!(route("POST", "/v2/whatever").0, Route::NotFound));
        assert!(matches!(route("POST", "/s/x").0, Route::NotFound));
        let api = |m, p| match route(m, p).0 {
            Route::Call(c) => Some(c.api()),
            _ => None,
        };
        assert_eq!(api("POST", "/v1/responses"), Some(WireApi::Responses));
        assert_eq!(api("POST", "/s/a/v1/messages"), Some(WireApi::Messages));
        assert_eq!(
            api("POST", "/v1/chat/completions/"),
            Some(WireApi::ChatCompletions)
        );
        assert!(matches!(
            route("GET", "/v1/responses").0,
            Route::WebSocketRefused
        ));
        assert!(matches!(
            route("POST", "/v1/messages/count_tokens").0,
            Route::CountTokens
        ));
        assert!(matches!(route("HEAD", "/api/hello").0, Route::Hello));
    }

    #[test]
    fn query_session_and_api_key_are_found() {
        assert_eq!(
            query_param_session("beta=true&session=abc"),
            Some("abc".into())
        );
        assert_eq!(query_param_session("beta=true"), None);
        assert_eq!(
            query_param_session("session=team%2Fsample%201&beta=true"),
            Some("team/sample 1".into()),
            "percent-decoded"
        );
        assert_eq!(
            query_param_session("session=a+b%2Bc"),
            Some("a b+c".into()),
            "form encoding: + is a space"
        );
    }

    /// A service built in a token mode runs the sessions its owner names in text mode, on the
    /// engine called with text; every other session, and a call no listener vouched for, in
    /// the service's own mode.
    #[test]
    fn a_text_mode_session_takes_the_text_backend() {
        struct Named(&'static str);
        impl TextModeSessions for Named {
            fn in_text_mode(&self, session: &str) -> bool {
                session == self.0
            }
        }
        let engine = |url: &str| -> Arc<dyn Backend> {
            let config = crate::backend::BackendConfig {
                kind: tokentap_schema::BackendKind::Llamacpp,
                url: url.into(),
                api_key: None,
                ca_roots: Vec::new(),
                connect_timeout: std::time::Duration::from_secs(1),
                idle_timeout: std::time::Duration::from_secs(1),
                max_answer_bytes: crate::backend::DEFAULT_MAX_ANSWER_BYTES,
            };
            Arc::from(crate::backend::build(config).unwrap())
        };
        let service = CaptureService::new(
            ProxyConfig::default(),
            engine("http://own:1"),
            RecordSink::Discard,
            Arc::new(Metrics::new()),
        );
        assert_eq!(service.token_path(Some("s")).backend.url(), "http://own:1");
        let service =
            service.with_text_mode_sessions(engine("http://text:2"), Arc::new(Named("off")));
        let text = service.token_path(Some("off"));
        assert_eq!(text.backend.url(), "http://text:2");
        assert!(text.observer.is_none());
        assert!(!std::ptr::eq(
            text.resolved_layout,
            service.token_path(Some("other")).resolved_layout
        ));
        for other in [Some("other"), None] {
            assert_eq!(service.token_path(other).backend.url(), "http://own:1");
        }
    }
}
