//! This node's part in the cluster: the state its tasks share (the bus, the pipeline, its
//! claims, the events it relays, its gate and metrics) and the error of the cluster's calls.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use tokio::sync::{broadcast, Notify};

use super::bus::{ClusterBus, QueueOptions};
use super::metrics::ClusterMetrics;
use super::seal::TaskKey;
use super::tickets::Claims;
use crate::pipeline::{Event, Pipeline};

/// What the cluster's API calls can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("no such {0}")]
    NotFound(String),
    #[error("the bus: {0:#}")]
    Bus(anyhow::Error),
}

/// A bus failure as a [`ClusterError`].
pub(crate) fn bus_error<E: Into<anyhow::Error>>(e: E) -> ClusterError {
    ClusterError::Bus(e.into())
}

/// Which gate order this node applied last.
#[derive(Default)]
pub struct GateApplied {
    pub(crate) revision: AtomicU64,
    /// Woken when an order was applied (the heartbeat reports it at once).
    pub(crate) now: Notify,
}

/// This node's part in the cluster.
pub struct Cluster {
    pub node_id: String,
    pub(crate) bus: ClusterBus,
    pub(crate) pipeline: Arc<Pipeline>,
    pub(crate) claims: Claims,
    /// Every rollout's events as the bus carries them (from every node).
    pub(crate) events: broadcast::Sender<Event>,
    pub(crate) gate: GateApplied,
    pub(crate) options: QueueOptions,
    pub(crate) metrics: ClusterMetrics,
    /// Seals the rollouts this node submits or changes; checks those it runs or calls back.
    pub(crate) key: TaskKey,
}

impl Cluster {
    pub(crate) fn new(
        node_id: String,
        bus: ClusterBus,
        pipeline: Arc<Pipeline>,
        options: QueueOptions,
        key: TaskKey,
    ) -> Cluster {
        Cluster {
            node_id,
            bus,
            pipeline,
            claims: Claims::default(),
            events: broadcast::channel(4096).0,
            gate: GateApplied::default(),
            options,
            metrics: ClusterMetrics::new(),
            key,
        }
    }

    /// The node's cluster metrics, in Prometheus text format.
    pub fn render_metrics(&self) -> Vec<u8> {
        self.metrics.render()
    }

    /// Every rollout's progress events, from now on, whichever node runs the samples.
    pub fn events(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }
}
