//! Prometheus metrics of the capture proxy, served at `GET /metrics`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use prometheus::{
    CounterVec, Encoder, Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use tokentap_schema::CaptureRecord;
pub use tokentap_service_kit::metrics::{counter_in, gauge_in, registered};

use crate::activity::SessionActivity;
use crate::harness::Harness;

/// Latency buckets from 50 µs to 10 min: proxy overhead lives at the bottom, whole agent
/// calls at the top.
const LATENCY_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Labels every series of a call's tokens and time carries, so throughput and time can be
/// joined per engine, model and harness.
pub const CALL_LABELS: &[&str] = &["engine", "model", "harness"];

pub struct Metrics {
    registry: Registry,
    pub calls: IntCounterVec,
    /// By engine, model, harness and policy version.
    pub prompt_tokens: IntCounterVec,
    pub completion_tokens: IntCounterVec,
    /// Where calls' time goes, by [`CALL_LABELS`]: the engine answering, the proxy, and the
    /// harness between a session's calls (counted by `activity`).
    pub engine_seconds: CounterVec,
    pub proxy_seconds: CounterVec,
    pub harness_seconds: CounterVec,
    /// Sessions per engine, model and harness; `tokentap_sessions_active` when gathered.
    pub activity: Arc<SessionActivity>,
    pub call_errors: IntCounterVec,
    pub call_seconds: HistogramVec,
    pub backend_seconds: HistogramVec,
    pub proxy_overhead_seconds: HistogramVec,
    /// By engine, model and wire API.
    pub ttft_seconds: HistogramVec,
    /// By engine and model.
    pub inflight: IntGaugeVec,
    /// Calls the admission gate holds now (a rollout node during a weight update), and how
    /// long it held each; by engine and model.
    pub gate_waiting: IntGaugeVec,
    pub gate_hold_seconds: HistogramVec,
    /// Bounds on label values a client or a task chooses (model names, policy versions).
    pub models: LabelCap,
    pub policy_versions: LabelCap,
    pub spool_bytes: IntGauge,
    pub records_written: IntCounter,
    pub records_lost: IntCounter,
    pub spool_write_errors: IntCounter,
    /// 1 while the spool takes records, 0 after a failed append until one succeeds again.
    pub spool_writable: IntGauge,
    /// Calls refused before the engine, by `reason` (`spool_unwritable`).
    pub calls_refused: IntCounterVec,
    /// Calls refused for an engine option out of its bounds, and options left out of engine
    /// requests (not allowed on the listener), by `option` (`engine_options`' names, `other`).
    pub engine_options_refused: IntCounterVec,
    pub engine_options_dropped: IntCounterVec,
    pub websocket_refused: IntCounter,
    pub transparent: IntCounterVec,
    /// Connections closed by a listener limit, by `limit`.
    pub connections_closed: IntCounterVec,
    /// Counted by the shipper (`--ship-to`), which runs beside the proxy.
    pub ship_dead_letter: IntCounter,
    /// Spool bytes written and not yet acked by the worker.
    pub ship_backlog_bytes: IntGauge,
    pub ship_records: IntCounter,
    pub ship_last_ack: Gauge,
    pub ship_errors: IntCounter,
    /// `--token-mode observe`: tokentap's ids against the engine's, by `result`; each call's
    /// prompt against the session's earlier calls, by `kind`; drift spans by `cause`; the
    /// time to render and tokenize; the token ids the observer holds.
    pub token_mode_render: IntCounterVec,
    pub token_mode_continuations: IntCounterVec,
    pub token_mode_drift_spans: IntCounterVec,
    pub token_mode_render_seconds: HistogramVec,
    pub token_mode_held_tokens: IntGauge,
    /// `--token-mode tito`: calls whose prompt tito built, by `continuation` (`extends`,
    /// `branch`) and the branch's `cause` (empty for `extends`); the time to build a prompt.
    pub token_mode_tito_calls: IntCounterVec,
    pub token_mode_tito_build_seconds: HistogramVec,
    /// `--token-verify`: verified calls by result, and the drift spans found by kind.
    pub token_mode_tito_verify: IntCounterVec,
    pub token_mode_tito_verify_spans: IntCounterVec,
}

impl Metrics {
    /// The `tokentap_ship_*` series, for whichever downstream this proxy's spool has.
    pub fn downstream(&self) -> tokentap_spool::downstream::DownstreamMetrics {
        tokentap_spool::downstream::DownstreamMetrics {
            records: self.ship_records.clone(),
            dead_letters: self.ship_dead_letter.clone(),
            backlog_bytes: self.ship_backlog_bytes.clone(),
            last_ack: self.ship_last_ack.clone(),
            errors: self.ship_errors.clone(),
        }
    }

    pub fn new() -> Metrics {
        let registry = Registry::new();
        let histogram = |name: &str, help: &str, labels: &[&str]| {
            let opts = HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec());
            registered(
                &registry,
                HistogramVec::new(opts, labels).expect("valid histogram"),
            )
        };
        let latency = |name: &str, help: &str| histogram(name, help, &["wire_api"]);
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            registered(
                &registry,
                IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter"),
            )
        };
        let counter = |name: &str, help: &str| {
            registered(
                &registry,
                IntCounter::new(name, help).expect("valid counter"),
            )
        };
        let gauge = |name: &str, help: &str| {
            registered(&registry, IntGauge::new(name, help).expect("valid gauge"))
        };
        let float_counter = |name: &str, help: &str, labels: &[&str]| {
            registered(
                &registry,
                CounterVec::new(Opts::new(name, help), labels).expect("valid counter"),
            )
        };
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            registered(
                &registry,
                IntGaugeVec::new(Opts::new(name, help), labels).expect("valid gauge"),
            )
        };
        let token_labels = &["engine", "model", "harness", "policy_version"];
        let harness_seconds = float_counter(
            "tokentap_harness_seconds_total",
            "Time sessions spent in their harness and its tools: from a call's end to the same session's next call (gaps over 300 s are rest, not counted)",
            CALL_LABELS,
        );
        let activity = Arc::new(SessionActivity::new(harness_seconds.clone()));
        registry
            .register(Box::new(ActivityCollector(activity.clone())))
            .expect("unique metric");
        Metrics {
            calls: counter_vec(
                "tokentap_calls_total",
                "Model calls by wire API and HTTP status",
                &["wire_api", "status"],
            ),
            prompt_tokens: counter_vec(
                "tokentap_prompt_tokens_total",
                "Prompt tokens reported by the engine",
                token_labels,
            ),
            completion_tokens: counter_vec(
                "tokentap_completion_tokens_total",
                "Completion (generated) tokens reported by the engine",
                token_labels,
            ),
            engine_seconds: float_counter(
                "tokentap_engine_seconds_total",
                "Time the engine spent answering calls",
                CALL_LABELS,
            ),
            proxy_seconds: float_counter(
                "tokentap_proxy_seconds_total",
                "Time calls spent in the proxy, not waiting on the engine",
                CALL_LABELS,
            ),
            harness_seconds,
            activity,
            call_errors: counter_vec(
                "tokentap_call_errors_total",
                "Calls that ended in an error, by kind (invalid_request, body_too_large, backend_unavailable, backend_error, backend_timeout, context_length_exceeded, client_disconnected, internal, tls_handshake_failed)",
                &["engine", "model", "kind"],
            ),
            call_seconds: latency(
                "tokentap_call_duration_seconds",
                "Whole call, request arrival to end of answer",
            ),
            backend_seconds: latency(
                "tokentap_backend_duration_seconds",
                "Time spent waiting on the backend",
            ),
            proxy_overhead_seconds: latency(
                "tokentap_proxy_overhead_seconds",
                "Call time not spent waiting on the backend",
            ),
            ttft_seconds: histogram(
                "tokentap_time_to_first_token_seconds",
                "Request arrival to first content sent to the harness",
                &["engine", "model", "wire_api"],
            ),
            inflight: gauge_vec(
                "tokentap_inflight_calls",
                "Model calls in progress",
                &["engine", "model"],
            ),
            gate_waiting: gauge_vec(
                "tokentap_gate_waiting_calls",
                "Calls the admission gate holds before the engine now (a rollout node during a weight update)",
                &["engine", "model"],
            ),
            gate_hold_seconds: histogram(
                "tokentap_gate_hold_seconds",
                "Time the admission gate held a call before the engine",
                &["engine", "model"],
            ),
            models: LabelCap::new(MODEL_LABELS_CAP),
            policy_versions: LabelCap::new(POLICY_LABELS_CAP),
            spool_bytes: gauge("tokentap_spool_bytes", "Bytes in the spool's segment files"),
            records_written: counter(
                "tokentap_records_written_total",
                "Capture records appended to the spool",
            ),
            records_lost: counter(
                "tokentap_records_lost_total",
                "Capture records that could not be written (see logs)",
            ),
            spool_write_errors: counter(
                "tokentap_spool_write_errors_total",
                "Failed spool appends and fsyncs (each retry counts)",
            ),
            spool_writable: {
                let g = gauge(
                    "tokentap_spool_writable",
                    "1 while the capture spool takes records, 0 while appends fail (disk full, read-only, I/O errors)",
                );
                // Writable until an append says otherwise (also without a spool: nothing fails).
                g.set(1);
                g
            },
            calls_refused: counter_vec(
                "tokentap_calls_refused_total",
                "Requests refused before reaching the engine, by reason (spool_unwritable: --on-spool-error fail-closed while the spool cannot be written; unknown_session: a rollout node's capture without a known sample secret); refused requests have no record",
                &["reason"],
            ),
            engine_options_refused: counter_vec(
                "tokentap_engine_options_refused_total",
                "Calls refused (400, recorded with the error) for an engine option out of its bounds (logit_bias entries, chat_template_kwargs keys, response_format size, ...), by option",
                &["option"],
            ),
            engine_options_dropped: counter_vec(
                "tokentap_engine_options_dropped_total",
                "Engine options left out of engine requests because the listener does not let callers set them (--engine-option; noted on the record), by option",
                &["option"],
            ),
            websocket_refused: counter(
                "tokentap_websocket_upgrades_refused_total",
                "WebSocket upgrades on /v1/responses answered 426 (Codex then falls back to SSE)",
            ),
            transparent: counter_vec(
                "tokentap_transparent_connections_total",
                "Redirected connections by outcome (intercepted, passed_through, tls_failed, dropped)",
                &["outcome"],
            ),
            connections_closed: counter_vec(
                "tokentap_connections_closed_total",
                "Connections closed by a listener limit (max_connections, header_timeout, body_timeout, tls_handshake_timeout)",
                &["limit"],
            ),
            ship_dead_letter: counter(
                "tokentap_ship_dead_letter_total",
                "Records the worker will never take (rejected, or over its body limit), kept in SPOOL/dead-letter.ndjson",
            ),
            ship_backlog_bytes: gauge(
                "tokentap_ship_backlog_bytes",
                "Spool bytes written and not yet acked by the worker (--ship-to)",
            ),
            ship_records: counter(
                "tokentap_ship_records_total",
                "Records the worker acked (--ship-to)",
            ),
            ship_last_ack: registered(
                &registry,
                Gauge::new(
                    "tokentap_ship_last_ack_timestamp_seconds",
                    "When the worker last acked a shipment, seconds since the epoch (--ship-to)",
                )
                .expect("valid gauge"),
            ),
            ship_errors: counter(
                "tokentap_ship_errors_total",
                "Shipments that failed (worker unreachable, refused, or an unreadable ack); retried",
            ),
            token_mode_render: counter_vec(
                "tokentap_token_mode_render_total",
                "--token-mode observe: calls whose conversation tokentap rendered and tokenized itself, by result against the engine's prompt ids (equal, differs, unavailable)",
                &["result"],
            ),
            token_mode_continuations: counter_vec(
                "tokentap_token_mode_continuations_total",
                "--token-mode observe: how each call's prompt continues its session (first, extends, repeats, diverges: re-rendered where the model sampled, new_prefix: history changed, unavailable)",
                &["kind"],
            ),
            token_mode_drift_spans: counter_vec(
                "tokentap_token_mode_drift_spans_total",
                "--token-mode observe: spans where a prompt parts from the ids the model sampled earlier in its session, by cause (reasoning_dropped, boundary_token, merge_difference, content_changed)",
                &["cause"],
            ),
            token_mode_render_seconds: histogram(
                "tokentap_token_mode_render_seconds",
                "--token-mode observe: time to render and tokenize a call's conversation",
                &[],
            ),
            token_mode_held_tokens: gauge(
                "tokentap_token_mode_held_tokens",
                "--token-mode observe: token ids held for the sessions' last calls (4 bytes each)",
            ),
            token_mode_tito_calls: counter_vec(
                "tokentap_token_mode_tito_calls_total",
                "--token-mode tito: calls whose prompt ids tokentap built, by continuation (extends: the conversation's earlier prompt + sampled ids + the new messages; branch: rendered whole) and the branch's cause (first, edited, compacted, new_system, tools_changed, unknown_history, no_new_message, template_construct; empty for extends)",
                &["continuation", "cause"],
            ),
            token_mode_tito_build_seconds: histogram(
                "tokentap_token_mode_tito_build_seconds",
                "--token-mode tito: time to build a call's prompt ids",
                &[],
            ),
            token_mode_tito_verify: counter_vec(
                "tokentap_token_mode_tito_verify_total",
                "--token-verify: tito calls also rendered in full, by result (equal: the same ids; content_drift: differences inside sampled tokens only, what tito keeps on purpose; boundary_drift: tito wrote the template's frame other than the full render, a bug)",
                &["result"],
            ),
            token_mode_tito_verify_spans: counter_vec(
                "tokentap_token_mode_tito_verify_spans_total",
                "--token-verify: spans where a tito prompt differs from the full render, by kind (content, boundary)",
                &["kind"],
            ),
            registry,
        }
    }

    /// A call's `--token-mode observe` findings.
    pub fn record_token_observation(&self, o: &tokentap_schema::TokenObservation) {
        self.token_mode_render
            .with_label_values(&[o.render.result()])
            .inc();
        self.token_mode_continuations
            .with_label_values(&[o.continuation.kind()])
            .inc();
        if let tokentap_schema::Continuation::Diverges { spans, .. } = &o.continuation {
            for s in spans {
                self.token_mode_drift_spans
                    .with_label_values(&[s.cause.as_str()])
                    .inc();
            }
        }
        self.token_mode_render_seconds
            .with_label_values::<&str>(&[])
            .observe(o.render_us as f64 / 1e6);
    }

    /// How `--token-mode tito` built a call's prompt.
    pub fn record_token_in(&self, t: &tokentap_schema::TokenIn) {
        let (continuation, cause) = match &t.continuation {
            tokentap_schema::TitoContinuation::Extends { .. } => ("extends", ""),
            tokentap_schema::TitoContinuation::Branch { cause, .. } => ("branch", cause.as_str()),
        };
        self.token_mode_tito_calls
            .with_label_values(&[continuation, cause])
            .inc();
        self.token_mode_tito_build_seconds
            .with_label_values::<&str>(&[])
            .observe(t.build_us as f64 / 1e6);
        if let Some(v) = &t.verify {
            let result = match (v.boundary_spans, v.content_spans) {
                (0, 0) => "equal",
                (0, _) => "content_drift",
                _ => "boundary_drift",
            };
            self.token_mode_tito_verify
                .with_label_values(&[result])
                .inc();
            self.token_mode_tito_verify_spans
                .with_label_values(&["content"])
                .inc_by(v.content_spans.into());
            self.token_mode_tito_verify_spans
                .with_label_values(&["boundary"])
                .inc_by(v.boundary_spans.into());
        }
    }

    /// A finished call, from its record. `harness`: as the admission gate knows it (else from
    /// the request); `in_activity`: its session's activity counted its start.
    pub fn record_call(&self, record: &CaptureRecord, harness: Option<Harness>, in_activity: bool) {
        let api = record.wire_api.as_str();
        let engine = record.backend.kind.as_str();
        // The model as sent to the engine: the configured one, or (without one) whatever the
        // harness asked for, kept bounded.
        let model = self.models.label(if record.backend.model.is_empty() {
            "any"
        } else {
            &record.backend.model
        });
        let harness = harness
            .unwrap_or_else(|| Harness::from_headers(&record.request.headers))
            .as_str();
        let policy = self
            .policy_versions
            .label(record.backend.policy_version.as_deref().unwrap_or("none"));
        self.calls
            .with_label_values(&[api, &record.response_status.to_string()])
            .inc();
        if let Some(o) = &record.token_observation {
            self.record_token_observation(o);
        }
        if let Some(t) = &record.token_in {
            self.record_token_in(t);
        }
        if let Some(u) = record.usage {
            self.prompt_tokens
                .with_label_values(&[engine, model, harness, policy])
                .inc_by(u.prompt_tokens);
            self.completion_tokens
                .with_label_values(&[engine, model, harness, policy])
                .inc_by(u.completion_tokens);
        }
        if let Some(e) = &record.error {
            self.call_errors
                .with_label_values(&[engine, model, e.kind.as_str()])
                .inc();
        }
        let t = &record.timings;
        self.engine_seconds
            .with_label_values(&[engine, model, harness])
            .inc_by(t.backend_ms / 1000.0);
        self.proxy_seconds
            .with_label_values(&[engine, model, harness])
            .inc_by(t.proxy_overhead_ms.max(0.0) / 1000.0);
        if in_activity {
            self.activity.end(
                &record.session_id,
                [engine.into(), model.into(), harness.into()],
                record.started_at_unix_ms,
                record.ended_at_unix_ms,
            );
        }
        self.call_seconds
            .with_label_values(&[api])
            .observe(t.total_ms / 1000.0);
        self.backend_seconds
            .with_label_values(&[api])
            .observe(t.backend_ms / 1000.0);
        self.proxy_overhead_seconds
            .with_label_values(&[api])
            .observe(t.proxy_overhead_ms / 1000.0);
        if let Some(ttft) = t.time_to_first_token_ms {
            self.ttft_seconds
                .with_label_values(&[engine, model, api])
                .observe(ttft / 1000.0);
        }
    }

    /// The text exposition format.
    pub fn render(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("encoding metrics to memory");
        buf
    }
}

/// Distinct model names kept as label values; later ones are `other`.
const MODEL_LABELS_CAP: usize = 16;
/// Distinct policy versions kept as label values (a run moves through a few at a time).
const POLICY_LABELS_CAP: usize = 64;

/// A label whose values someone else chooses, kept bounded: the first `cap` distinct values
/// are themselves, later ones `other`.
pub struct LabelCap {
    cap: usize,
    seen: Mutex<HashSet<String>>,
}

impl LabelCap {
    pub fn new(cap: usize) -> LabelCap {
        LabelCap {
            cap,
            seen: Mutex::new(HashSet::new()),
        }
    }

    /// `value`, or `other` once `cap` other values have been seen.
    pub fn label<'a>(&self, value: &'a str) -> &'a str {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(value) {
            return value;
        }
        if seen.len() < self.cap {
            seen.insert(value.to_owned());
            return value;
        }
        "other"
    }
}

/// Registers [`SessionActivity`] (shared with the proxy) as a collector.
struct ActivityCollector(Arc<SessionActivity>);

impl prometheus::core::Collector for ActivityCollector {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.0.desc()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.0.collect()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokentap_schema::{TitoBranchCause, TitoContinuation, TokenIn};

    #[test]
    fn tito_calls_are_counted_by_continuation_and_cause_and_timed() {
        let metrics = Metrics::new();
        let token_in = |continuation, build_us| TokenIn {
            continuation,
            origins: vec![],
            build_us,
            verify: None,
        };
        let extends = TitoContinuation::Extends {
            record_id: "r0".into(),
            appended: 7,
        };
        let branch = |cause| TitoContinuation::Branch {
            cause,
            detail: None,
        };
        metrics.record_token_in(&token_in(branch(TitoBranchCause::First), 1_000));
        metrics.record_token_in(&token_in(extends.clone(), 500));
        metrics.record_token_in(&token_in(extends, 500));
        metrics.record_token_in(&token_in(branch(TitoBranchCause::Edited), 2_000));
        let text = String::from_utf8(metrics.render()).unwrap();
        for series in [
            r#"tokentap_token_mode_tito_calls_total{cause="",continuation="extends"} 2"#,
            r#"tokentap_token_mode_tito_calls_total{cause="first",continuation="branch"} 1"#,
            r#"tokentap_token_mode_tito_calls_total{cause="edited",continuation="branch"} 1"#,
            "tokentap_token_mode_tito_build_seconds_count 4",
            "tokentap_token_mode_tito_build_seconds_sum 0.004",
            r#"tokentap_token_mode_tito_build_seconds_bucket{le="0.0005"} 2"#,
        ] {
            assert!(text.lines().any(|l| l == series), "no {series} in:\n{text}");
        }
    }

    #[test]
    fn verified_calls_are_counted_by_result_and_their_spans_by_kind() {
        let metrics = Metrics::new();
        let verified = |content_spans, boundary_spans| TokenIn {
            continuation: TitoContinuation::Branch {
                cause: TitoBranchCause::First,
                detail: None,
            },
            origins: vec![],
            build_us: 1,
            verify: Some(tokentap_schema::TitoVerify {
                rendered_tokens: 10,
                content_spans,
                boundary_spans,
                examples: vec![],
            }),
        };
        metrics.record_token_in(&verified(0, 0));
        metrics.record_token_in(&verified(2, 0));
        metrics.record_token_in(&verified(1, 1));
        let text = String::from_utf8(metrics.render()).unwrap();
        for series in [
            r#"tokentap_token_mode_tito_verify_total{result="equal"} 1"#,
            r#"tokentap_token_mode_tito_verify_total{result="content_drift"} 1"#,
            r#"tokentap_token_mode_tito_verify_total{result="boundary_drift"} 1"#,
            r#"tokentap_token_mode_tito_verify_spans_total{kind="content"} 3"#,
            r#"tokentap_token_mode_tito_verify_spans_total{kind="boundary"} 1"#,
        ] {
            assert!(text.contains(series), "{series} not in\n{text}");
        }
    }
}
