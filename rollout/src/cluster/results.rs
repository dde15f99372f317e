//! What every node reads back: the results log (`GET /v1/results`, its cursor the log's
//! sequence number) and every rollout's events.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, DeliverPolicy};
use futures::StreamExt;
use tokentap_bus::async_nats;

use super::ledger;
use super::node::{bus_error, Cluster, ClusterError};
use crate::task::Sample;

/// How long a page waits for the rest of results known to be there.
const PAGE_READ: Duration = Duration::from_secs(10);

/// Ended samples after the cursor `after`, oldest first, at most `limit`; when there are
/// none yet, waits up to `wait` for the first.
pub async fn results_after(
    c: &Cluster,
    after: u64,
    limit: usize,
    wait: Duration,
) -> Result<Vec<(u64, Sample)>, ClusterError> {
    let last = c
        .bus
        .results
        .get_info()
        .await
        .map_err(bus_error)?
        .state
        .last_sequence;
    if last <= after && wait.is_zero() {
        return Ok(Vec::new());
    }
    let consumer = c
        .bus
        .results
        .create_consumer(pull::OrderedConfig {
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: after + 1,
            },
            ..Default::default()
        })
        .await
        .map_err(bus_error)?;
    let mut messages = consumer.messages().await.map_err(bus_error)?;
    let first_by = tokio::time::Instant::now() + if last > after { PAGE_READ } else { wait };
    let mut out = Vec::new();
    let mut by = first_by;
    while out.len() < limit {
        let message = match tokio::time::timeout_at(by, messages.next()).await {
            Ok(Some(Ok(m))) => m,
            Ok(Some(Err(e))) => return Err(bus_error(e)),
            Ok(None) | Err(_) => break,
        };
        let info = message
            .info()
            .map_err(|e| bus_error(anyhow::anyhow!("{e}")))?;
        let (seq, pending) = (info.stream_sequence, info.pending);
        match serde_json::from_slice::<Sample>(&message.payload) {
            Ok(sample) => out.push((seq, sample)),
            Err(e) => tracing::warn!(seq, error = %e, "an unreadable result on the bus"),
        }
        if pending == 0 {
            break;
        }
        by = tokio::time::Instant::now() + PAGE_READ;
    }
    // Each as it is now (its callback's delivery is noted after it ended).
    let now = futures::future::join_all(
        out.iter()
            .map(|(_, s)| ledger::sample(c, s.sample_id.clone())),
    )
    .await;
    for ((_, logged), current) in out.iter_mut().zip(now) {
        if let Ok((current, _)) = current {
            if current.outcome.is_some() {
                *logged = current;
            }
        }
    }
    Ok(out)
}

/// Feeds every rollout's events on the bus, from now on, to this node's event readers.
pub(crate) async fn follow_events(c: &Arc<Cluster>) -> anyhow::Result<()> {
    let consumer = c
        .bus
        .events
        .create_consumer(pull::OrderedConfig {
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let events = c.events.clone();
    tokio::spawn(async move {
        while let Some(m) = messages.next().await {
            match m {
                Ok(m) => match serde_json::from_slice(&m.payload) {
                    Ok(event) => {
                        let _ = events.send(event);
                    }
                    Err(e) => tracing::warn!(error = %e, "an unreadable event on the bus"),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "reading events (the reader recovers by itself)")
                }
            }
        }
    });
    Ok(())
}
