//! What a node's part in the cluster looks like from Prometheus (on the node's `/metrics`):
//! samples claimed (first attempts and re-runs of samples another node left), claims lost to
//! another node, samples held now, callbacks by outcome, bus errors, and tasks refused.

use prometheus::{Encoder, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};
use tokentap_proxy::metrics::{counter_in, gauge_in, registered};

pub struct ClusterMetrics {
    registry: Registry,
    /// `attempt`: `first`, or `rerun` (the queue redelivered it: its node stopped).
    pub claims: IntCounterVec,
    pub claims_lost: IntCounter,
    pub held: IntGauge,
    /// `outcome`: `delivered`, `retried`, `refused`, `gave_up`; `deferred` (not an attempt:
    /// its receiver had this node's most in flight).
    pub callbacks: IntCounterVec,
    pub bus_errors: IntCounter,
    /// `reason`: `unsealed`, `seal_mismatch`, `foreign_sample`, `over_ceilings`,
    /// `callback_unsealed`.
    pub tasks_refused: IntCounterVec,
}

impl ClusterMetrics {
    pub fn new() -> ClusterMetrics {
        let registry = Registry::new();
        let vec = |name: &str, help: &str, label: &str| {
            registered(
                &registry,
                IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid counter"),
            )
        };
        ClusterMetrics {
            claims: vec(
                "tokentap_cluster_claims_total",
                "Samples this node claimed from the cluster's queue, by attempt (first, or rerun after another node stopped)",
                "attempt",
            ),
            claims_lost: counter_in(
                &registry,
                "tokentap_cluster_claims_lost_total",
                "Samples this node stopped because another node had claimed them (it missed the queue's ack wait)",
            ),
            held: gauge_in(
                &registry,
                "tokentap_cluster_samples_held",
                "Samples this node holds claims on now (RUN slots plus prewarm at most)",
            ),
            callbacks: vec(
                "tokentap_cluster_callbacks_total",
                "Callback jobs this node handled for the cluster, by outcome (deferred: not attempted, its receiver had this node's most callbacks in flight)",
                "outcome",
            ),
            bus_errors: counter_in(
                &registry,
                "tokentap_cluster_bus_errors_total",
                "Failed requests to the cluster's bus (each retried)",
            ),
            tasks_refused: vec(
                "tokentap_cluster_tasks_refused_total",
                "Tasks from the bus this node refused to run or call back, by reason (a rollout without the cluster's seal, one altered since, a sample not of its rollout, over this node's ceilings)",
                "reason",
            ),
            registry,
        }
    }

    /// Prometheus text.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

impl Default for ClusterMetrics {
    fn default() -> Self {
        ClusterMetrics::new()
    }
}
