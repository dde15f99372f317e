//! Rollout nodes sharing one bus (`tokentap serve --bus`): any node's API answers for all.
//!
//! A submitted rollout's samples go to a JetStream work queue; a node pulls one only when it
//! has room for it (RUN slots plus prewarm), claims it by a conditional write of the sample's
//! state, keeps the queue message alive with progress acknowledgements while it runs, and
//! acknowledges it once the result is on the bus. A node that stops acknowledging (killed,
//! cut off) loses the message after the queue's ack wait: another node claims it as a new
//! attempt, under a new capture session. Each state write of a claimed sample is
//! conditional on the revision its node wrote last, so a node that lost its claim finds out
//! at its next write and stops that sample.
//!
//! - [`bus`]: the names and shapes on the bus.
//! - [`seal`]: the task key's seals on rollouts, checked before anything of theirs runs.
//! - [`node`]: this node's part (the state its tasks share) and the calls' error.
//! - [`tickets`]: the samples this node holds claims on.
//! - [`ledger`]: submit, show, cancel and a sample's traces, from the bus (any node).
//! - [`claims`]: pulling, claiming and running samples here; their state written through.
//! - [`results`]: the results log and the rollouts' events.
//! - [`callbacks`]: callback deliveries from the bus's queue, once across nodes.
//! - [`gate_sync`]: pause and resume on every node; the nodes' heartbeats.
//! - [`metrics`]: the node's part in the cluster, for Prometheus.

pub mod bus;
pub mod callbacks;
pub mod claims;
pub mod gate_sync;
pub mod ledger;
pub mod metrics;
pub mod node;
pub mod results;
pub mod seal;
pub mod tickets;

use std::sync::Arc;

use crate::pipeline::Pipeline;
pub use bus::{ClusterBus, QueueOptions};
pub use gate_sync::{ClusterGateStatus, NodeStatus};
pub use node::{Cluster, ClusterError};
pub use seal::TaskKey;

/// Joins the cluster on `client`: opens (creating) its streams and buckets, then starts
/// pulling samples, writing their state through, delivering callbacks, following the gate and
/// the cancellations, and beating the node's heart.
pub async fn join(
    client: tokentap_bus::async_nats::Client,
    node_id: String,
    pipeline: Arc<Pipeline>,
    options: QueueOptions,
    key: TaskKey,
) -> anyhow::Result<Arc<Cluster>> {
    let bus = ClusterBus::open(client, &options).await?;
    let cluster = Arc::new(Cluster::new(node_id, bus, pipeline, options, key));
    // Subscribed before anything is claimed, so no event of ours is missed.
    let local_events = cluster.pipeline.events();
    results::follow_events(&cluster).await?;
    gate_sync::follow(&cluster).await?;
    claims::follow_cancellations(&cluster).await?;
    tokio::spawn(claims::write_through(cluster.clone(), local_events));
    tokio::spawn(claims::keep_alive(cluster.clone()));
    tokio::spawn(claims::pull(cluster.clone()));
    tokio::spawn(callbacks::deliver(cluster.clone()));
    tokio::spawn(gate_sync::heartbeat(cluster.clone()));
    tracing::info!(node = %cluster.node_id, "joined the cluster");
    Ok(cluster)
}
