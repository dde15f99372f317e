//! Prometheus metrics of the capture proxy, served at `GET /metrics`.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

/// Latency buckets from 50 µs to 10 min: proxy overhead lives at the bottom, whole agent
/// calls at the top.
const LATENCY_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

pub struct Metrics {
    registry: Registry,
    pub calls: IntCounterVec,
    pub prompt_tokens: IntCounterVec,
    pub completion_tokens: IntCounterVec,
    pub call_seconds: HistogramVec,
    pub backend_seconds: HistogramVec,
    pub proxy_overhead_seconds: HistogramVec,
    pub ttft_seconds: HistogramVec,
    pub inflight: IntGauge,
    pub spool_bytes: IntGauge,
    pub records_written: IntCounter,
    pub records_lost: IntCounter,
    pub spool_write_errors: IntCounter,
    /// 1 while the spool takes records, 0 after a failed append until one succeeds again.
    pub spool_writable: IntGauge,
    /// Calls refused before the engine, by `reason` (`spool_unwritable`).
    pub calls_refused: IntCounterVec,
    pub websocket_refused: IntCounter,
    pub transparent: IntCounterVec,
    /// Connections closed by a listener limit, by `limit`.
    pub connections_closed: IntCounterVec,
    /// Counted by the shipper (`--ship-to`), which runs beside the proxy.
    pub ship_dead_letter: IntCounter,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let latency = |name: &str, help: &str| {
            let h = HistogramVec::new(
                HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
                &["wire_api"],
            )
            .expect("valid histogram");
            registry
                .register(Box::new(h.clone()))
                .expect("unique metric");
            h
        };
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid counter");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid counter");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric");
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid gauge");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        Metrics {
            calls: counter_vec(
                "tokentap_calls_total",
                "Model calls by wire API and HTTP status",
                &["wire_api", "status"],
            ),
            prompt_tokens: counter_vec(
                "tokentap_prompt_tokens_total",
                "Prompt tokens reported by the engine",
                &["wire_api"],
            ),
            completion_tokens: counter_vec(
                "tokentap_completion_tokens_total",
                "Completion tokens reported by the engine",
                &["wire_api"],
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
            ttft_seconds: latency(
                "tokentap_time_to_first_token_seconds",
                "Request arrival to first content sent to the harness",
            ),
            inflight: gauge("tokentap_inflight_calls", "Model calls in progress"),
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
                "Model calls refused before reaching the engine, by reason (spool_unwritable: --on-spool-error fail-closed while the spool cannot be written); refused calls have no record",
                &["reason"],
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
            registry,
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

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
