//! Pause and resume for the whole cluster. The order is one value on the bus (`gate` in the
//! control bucket, carrying the policy version in effect); every node watches it and applies
//! it to its own admission gate, and reports in its heartbeat which order it applied and how
//! many calls it still has in flight. `pause` answers once every live node has applied it
//! and has nothing in flight (or the wait ran out).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::bus::{GATE_KEY, NODES_BUCKET};
use super::ledger::json_bytes;
use super::node::{bus_error, Cluster, ClusterError};

/// The cluster's gate order.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct GateOrder {
    pub paused: bool,
    /// The policy version in effect (carried from order to order, so that a node joining
    /// later stamps calls as the others do).
    pub policy_version: Option<String>,
}

/// One node as its heartbeat describes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct NodeStatus {
    pub node_id: String,
    pub paused: bool,
    pub in_flight: usize,
    pub policy_version: Option<String>,
    /// The gate order (its revision on the bus) this node applied last.
    pub applied_order: u64,
    /// Samples it holds claims on now, and how many it takes at most.
    pub claimed: usize,
    pub capacity: usize,
}

/// The cluster's gate as `/v1/admin/*` reports it: the sums, and each live node.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
pub struct ClusterGateStatus {
    pub paused: bool,
    pub in_flight: usize,
    pub policy_version: Option<String>,
    pub nodes: Vec<NodeStatus>,
}

/// Applies every gate order to this node's gate, the current one first.
pub(crate) async fn follow(c: &Arc<Cluster>) -> anyhow::Result<()> {
    let mut orders = c.bus.control.watch_with_history(GATE_KEY).await?;
    let c = c.clone();
    tokio::spawn(async move {
        while let Some(entry) = orders.next().await {
            let entry = match entry {
                Ok(e) => e,
                Err(e) => {
                    tracing::warn!(error = %e, "following the cluster's gate");
                    continue;
                }
            };
            let order: GateOrder = match serde_json::from_slice(&entry.value) {
                Ok(o) => o,
                Err(e) => {
                    tracing::warn!(error = %e, "an unreadable gate order");
                    continue;
                }
            };
            if let Some(gate) = c.pipeline.gate() {
                if order.paused {
                    // Holds new generations now, without waiting for the drain here: the
                    // heartbeat reports the calls still in flight.
                    gate.pause(Duration::ZERO).await;
                } else {
                    gate.resume(order.policy_version.clone());
                }
            }
            c.gate.revision.store(entry.revision, Ordering::SeqCst);
            c.gate.now.notify_one();
            tracing::info!(
                paused = order.paused,
                revision = entry.revision,
                "applied the cluster's gate order"
            );
        }
    });
    Ok(())
}

/// Puts this node's status on the bus every second (and at once after an order), so that
/// the others know it is alive, what it holds, and where its gate is.
pub(crate) async fn heartbeat(c: Arc<Cluster>) {
    loop {
        if let Err(e) = c
            .bus
            .nodes
            .put(&c.node_id, json_bytes(&node_status(&c)))
            .await
        {
            tracing::warn!(error = %e, "the node's heartbeat");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = c.gate.now.notified() => {}
        }
    }
}

fn node_status(c: &Cluster) -> NodeStatus {
    let gate = c.pipeline.gate().map(|g| g.status());
    NodeStatus {
        node_id: c.node_id.clone(),
        paused: gate.as_ref().is_some_and(|g| g.paused),
        in_flight: gate.as_ref().map_or(0, |g| g.in_flight),
        policy_version: gate.and_then(|g| g.policy_version),
        applied_order: c.gate.revision.load(Ordering::SeqCst),
        claimed: c.claims.len(),
        capacity: c.pipeline.capacity(),
    }
}

/// Holds new generations on every node; answers once none has a call in flight, or the
/// wait ran out (`in_flight` > 0: ask again).
pub async fn pause(c: &Cluster, wait: Duration) -> Result<ClusterGateStatus, ClusterError> {
    order(c, true, None, wait).await
}

/// Lets generations go on everywhere, under a new `policy_version` when given.
pub async fn resume(
    c: &Cluster,
    policy_version: Option<String>,
) -> Result<ClusterGateStatus, ClusterError> {
    order(c, false, policy_version, Duration::from_secs(10)).await
}

/// The cluster's gate: the order in effect, and every live node's part.
pub async fn gate_status(c: &Cluster) -> Result<ClusterGateStatus, ClusterError> {
    let order = current_order(c).await?;
    Ok(summary(&order, nodes(c).await?))
}

async fn current_order(c: &Cluster) -> Result<GateOrder, ClusterError> {
    Ok(
        match c.bus.control.get(GATE_KEY).await.map_err(bus_error)? {
            Some(v) => serde_json::from_slice(&v).map_err(bus_error)?,
            None => GateOrder::default(),
        },
    )
}

async fn order(
    c: &Cluster,
    paused: bool,
    policy_version: Option<String>,
    wait: Duration,
) -> Result<ClusterGateStatus, ClusterError> {
    let order = GateOrder {
        paused,
        policy_version: policy_version.or(current_order(c).await?.policy_version),
    };
    let revision = c
        .bus
        .control
        .put(GATE_KEY, json_bytes(&order))
        .await
        .map_err(bus_error)?;
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let nodes = nodes(c).await?;
        let settled = nodes
            .iter()
            .all(|n| n.applied_order >= revision && (!paused || n.in_flight == 0));
        if settled || tokio::time::Instant::now() >= deadline {
            return Ok(summary(&order, nodes));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every node whose heartbeat is recent.
pub async fn nodes(c: &Cluster) -> Result<Vec<NodeStatus>, ClusterError> {
    // The bucket's subjects, from one snapshot of its stream (a key listing through a
    // consumer can miss a key whose value is replaced while it runs: heartbeats are).
    let prefix = format!("$KV.{NODES_BUCKET}.");
    let stream = c
        .bus
        .js
        .get_stream(format!("KV_{NODES_BUCKET}"))
        .await
        .map_err(bus_error)?;
    let mut subjects = stream
        .info_with_subjects(format!("{prefix}>"))
        .await
        .map_err(bus_error)?;
    let mut keys = std::collections::BTreeSet::new();
    while let Some(subject) = subjects.next().await {
        let (subject, _) = subject.map_err(bus_error)?;
        if let Some(key) = subject.strip_prefix(&prefix) {
            keys.insert(key.to_owned());
        }
    }
    let mut nodes = Vec::with_capacity(keys.len());
    for key in keys {
        if let Some(v) = c.bus.nodes.get(&key).await.map_err(bus_error)? {
            if let Ok(n) = serde_json::from_slice::<NodeStatus>(&v) {
                nodes.push(n);
            }
        }
    }
    Ok(nodes)
}

fn summary(order: &GateOrder, nodes: Vec<NodeStatus>) -> ClusterGateStatus {
    ClusterGateStatus {
        paused: order.paused,
        in_flight: nodes.iter().map(|n| n.in_flight).sum(),
        policy_version: order.policy_version.clone(),
        nodes,
    }
}
