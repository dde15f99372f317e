//! Per-stage metrics of a rollout node: queue depth, time waiting and time in each stage,
//! and samples ended by outcome (Prometheus, served on the node's `/metrics`).

use std::time::Instant;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::task::{Outcome, Stage};

pub struct StageMetrics {
    registry: Registry,
    /// Samples waiting before a stage: `init` (queued), `run` (prepared, prewarmed), `post_run`.
    queue_depth: IntGaugeVec,
    waiting_seconds: HistogramVec,
    stage_seconds: HistogramVec,
    ended: IntCounterVec,
}

/// The stage a queue feeds.
fn next_stage(after: Stage) -> &'static str {
    match after {
        Stage::Queued => "init",
        Stage::Init => "run",
        Stage::Run => "post_run",
        Stage::PostRun | Stage::Done => "done",
    }
}

fn stage_name(s: Stage) -> &'static str {
    match s {
        Stage::Queued => "queued",
        Stage::Init => "init",
        Stage::Run => "run",
        Stage::PostRun => "post_run",
        Stage::Done => "done",
    }
}

const BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
];

impl StageMetrics {
    pub fn new() -> StageMetrics {
        let registry = Registry::new();
        let queue_depth = IntGaugeVec::new(
            Opts::new(
                "tokentap_rollout_queue_depth",
                "Samples waiting for a stage (run: prepared ahead, i.e. prewarmed)",
            ),
            &["stage"],
        )
        .expect("metric");
        let waiting_seconds = HistogramVec::new(
            HistogramOpts::new(
                "tokentap_rollout_waiting_seconds",
                "Time a sample waited for a stage",
            )
            .buckets(BUCKETS.to_vec()),
            &["stage"],
        )
        .expect("metric");
        let stage_seconds = HistogramVec::new(
            HistogramOpts::new(
                "tokentap_rollout_stage_seconds",
                "Time a sample spent in a stage",
            )
            .buckets(BUCKETS.to_vec()),
            &["stage"],
        )
        .expect("metric");
        let ended = IntCounterVec::new(
            Opts::new(
                "tokentap_rollout_samples_total",
                "Samples ended, by outcome",
            ),
            &["outcome"],
        )
        .expect("metric");
        for m in [
            Box::new(queue_depth.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(waiting_seconds.clone()),
            Box::new(stage_seconds.clone()),
            Box::new(ended.clone()),
        ] {
            registry.register(m).expect("registering a metric");
        }
        StageMetrics {
            registry,
            queue_depth,
            waiting_seconds,
            stage_seconds,
            ended,
        }
    }

    /// The queue after `stage` now holds `n`.
    pub fn depth(&self, after: Stage, n: usize) {
        self.queue_depth
            .with_label_values(&[next_stage(after)])
            .set(n as i64);
    }

    pub fn inc_depth(&self, after: Stage) {
        self.queue_depth
            .with_label_values(&[next_stage(after)])
            .inc();
    }

    pub fn dec_depth(&self, after: Stage) {
        self.queue_depth
            .with_label_values(&[next_stage(after)])
            .dec();
    }

    /// A sample waited since `since` in the queue after `stage`.
    pub fn waited(&self, after: Stage, since: Instant) {
        self.waiting_seconds
            .with_label_values(&[next_stage(after)])
            .observe(since.elapsed().as_secs_f64());
    }

    /// A sample spent since `since` in `stage`.
    pub fn took(&self, stage: Stage, since: Instant) {
        self.stage_seconds
            .with_label_values(&[stage_name(stage)])
            .observe(since.elapsed().as_secs_f64());
    }

    pub fn ended(&self, outcome: &Outcome) {
        let label = match outcome {
            Outcome::Completed { .. } => "completed",
            Outcome::Timeout { .. } => "timeout",
            Outcome::Error { .. } => "error",
            Outcome::Cancelled => "cancelled",
        };
        self.ended.with_label_values(&[label]).inc();
    }

    pub fn render(&self) -> Vec<u8> {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        buf
    }
}

impl Default for StageMetrics {
    fn default() -> Self {
        StageMetrics::new()
    }
}
