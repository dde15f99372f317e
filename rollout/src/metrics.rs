//! Per-stage metrics of a rollout node: queue depth, samples in and time in each stage, time
//! waiting, samples ended by outcome, and rewards by task (Prometheus, served on the node's
//! `/metrics`).

use std::time::Instant;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder,
};
use tokentap_proxy::metrics::LabelCap;

use crate::task::{Outcome, Stage};

pub struct StageMetrics {
    registry: Registry,
    /// Samples waiting before a stage: `init` (queued), `run` (prepared, prewarmed), `post_run`.
    queue_depth: IntGaugeVec,
    waiting_seconds: HistogramVec,
    stage_seconds: HistogramVec,
    in_stage: IntGaugeVec,
    ended: IntCounterVec,
    reward: HistogramVec,
    /// Task ids are the submitter's: the first [`TASK_LABELS_CAP`] are labels, later ones
    /// `other`.
    tasks: LabelCap,
}

/// Distinct task ids kept as `task` label values.
pub const TASK_LABELS_CAP: usize = 200;

/// Rewards are usually in [0, 1] (pass/fail, partial credit); a few wider buckets catch
/// shaped rewards.
const REWARD_BUCKETS: &[f64] = &[
    -1.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0, 2.0, 5.0, 10.0,
];

/// A sample in a stage: counted in `tokentap_rollout_samples_in_stage` until
/// [`StageTimer::done`] (or drop), which also observes the stage's time.
pub struct StageTimer<'a> {
    metrics: &'a StageMetrics,
    stage: Stage,
    since: Instant,
    done: bool,
}

impl StageTimer<'_> {
    pub fn done(mut self) {
        self.finish();
    }

    fn finish(&mut self) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let stage = stage_name(self.stage);
        self.metrics.in_stage.with_label_values(&[stage]).dec();
        self.metrics
            .stage_seconds
            .with_label_values(&[stage])
            .observe(self.since.elapsed().as_secs_f64());
    }
}

impl Drop for StageTimer<'_> {
    fn drop(&mut self) {
        self.finish();
    }
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
        let in_stage = IntGaugeVec::new(
            Opts::new(
                "tokentap_rollout_samples_in_stage",
                "Samples in a stage now (init, run, post_run)",
            ),
            &["stage"],
        )
        .expect("metric");
        let reward = HistogramVec::new(
            HistogramOpts::new(
                "tokentap_rollout_reward",
                "Rewards of ended samples (completed and timed out), by task (the first 200 task ids, then other)",
            )
            .buckets(REWARD_BUCKETS.to_vec()),
            &["task"],
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
            Box::new(in_stage.clone()),
            Box::new(reward.clone()),
        ] {
            registry.register(m).expect("registering a metric");
        }
        StageMetrics {
            registry,
            queue_depth,
            waiting_seconds,
            stage_seconds,
            in_stage,
            ended,
            reward,
            tasks: LabelCap::new(TASK_LABELS_CAP),
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

    /// A sample enters `stage`; the timer counts it there until done.
    pub fn enter(&self, stage: Stage) -> StageTimer<'_> {
        self.in_stage.with_label_values(&[stage_name(stage)]).inc();
        StageTimer {
            metrics: self,
            stage,
            since: Instant::now(),
            done: false,
        }
    }

    /// A sample of task `task_id` ended with `outcome`.
    pub fn ended(&self, task_id: &str, outcome: &Outcome) {
        let (label, reward) = match outcome {
            Outcome::Completed { reward } => ("completed", Some(*reward)),
            Outcome::Timeout { reward, .. } => ("timeout", Some(*reward)),
            Outcome::Error { .. } => ("error", None),
            Outcome::Cancelled => ("cancelled", None),
        };
        self.ended.with_label_values(&[label]).inc();
        if let Some(r) = reward.filter(|r| r.is_finite()) {
            self.reward
                .with_label_values(&[self.tasks.label(task_id)])
                .observe(r);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(m: &StageMetrics) -> String {
        String::from_utf8(m.render()).unwrap()
    }

    #[test]
    fn a_sample_counts_in_its_stage_until_done_or_dropped() {
        let m = StageMetrics::new();
        let run = m.enter(Stage::Run);
        let init = m.enter(Stage::Init);
        assert_eq!(m.in_stage.with_label_values(&["run"]).get(), 1);
        run.done();
        drop(init); // a task that panicked or returned early
        assert_eq!(m.in_stage.with_label_values(&["run"]).get(), 0);
        assert_eq!(m.in_stage.with_label_values(&["init"]).get(), 0);
        assert!(rendered(&m).contains("tokentap_rollout_stage_seconds_count{stage=\"run\"} 1"));
    }

    #[test]
    fn rewards_are_observed_by_task_and_task_labels_stay_bounded() {
        let m = StageMetrics::new();
        m.ended("t1", &Outcome::Completed { reward: 1.0 });
        m.ended(
            "t1",
            &Outcome::Timeout {
                reward: 0.0,
                reason: "slow".into(),
            },
        );
        m.ended("t1", &Outcome::Error { reason: "x".into() });
        let text = rendered(&m);
        assert!(
            text.contains("tokentap_rollout_reward_count{task=\"t1\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("tokentap_rollout_reward_sum{task=\"t1\"} 1"),
            "{text}"
        );
        for i in 0..TASK_LABELS_CAP + 10 {
            m.ended(&format!("task-{i}"), &Outcome::Completed { reward: 0.5 });
        }
        let text = rendered(&m);
        let tasks = text
            .lines()
            .filter(|l| l.starts_with("tokentap_rollout_reward_count"))
            .count();
        assert_eq!(tasks, TASK_LABELS_CAP + 1, "the cap, and other");
        assert!(text.contains("tokentap_rollout_reward_count{task=\"other\"} 11"));
    }
}
