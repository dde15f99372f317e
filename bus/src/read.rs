//! Reading what the bus holds: every trace on the traces stream, for a trainer that takes its
//! trajectories from the bus rather than from the workers' files (and for the tests, which
//! compare them with an offline reconstruction).

use async_nats::jetstream::consumer::{pull, DeliverPolicy};
use futures::StreamExt;
use tokentap_schema::Trace;

use crate::topology::Topology;

/// The traces on the stream now, in stream order (each trace id once: the stream dropped
/// republished ones).
pub async fn traces_on_the_bus(topology: &Topology) -> anyhow::Result<Vec<Trace>> {
    let mut info = topology.traces.clone();
    let last = info.info().await?.state.last_sequence;
    if last == 0 {
        return Ok(Vec::new());
    }
    let consumer = topology
        .traces
        .create_consumer(pull::OrderedConfig {
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut traces = Vec::new();
    while let Some(m) = messages.next().await {
        let m = m?;
        let seq = m.info().map_err(|e| anyhow::anyhow!(e))?.stream_sequence;
        traces.push(serde_json::from_slice(&m.payload)?);
        if seq >= last {
            break;
        }
    }
    Ok(traces)
}
