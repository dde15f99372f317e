//! Samples this node runs for the cluster: pulled from the queue only when there is room,
//! claimed by a conditional write of their state, kept alive while they run, their state
//! written through to the bus at every stage, acknowledged once their result is there.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::UpdateErrorKind;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use tokentap_bus::async_nats;
use tokio::sync::{broadcast, OwnedSemaphorePermit, Semaphore};

use super::tickets::Ticket;

use super::bus::{next_message, CANCEL_SUBJECT};
use super::ledger::{self, json_bytes, QueueItem};
use super::node::{Cluster, ClusterError};
use super::seal::{SealError, SealedRollout};
use crate::pipeline::Event;
use crate::store::StoreError;
use crate::task::{Outcome, Sample, Stage};

/// How soon a queue message this node could not settle now is offered again.
const AGAIN_SOON: Duration = Duration::from_millis(500);

/// Pulls samples while this node has room for them (its RUN slots and prewarm).
pub(crate) async fn pull(c: Arc<Cluster>) {
    let room = Arc::new(Semaphore::new(c.pipeline.capacity()));
    loop {
        let Ok(permit) = room.clone().acquire_owned().await else {
            return;
        };
        let Some(message) = next_message(&c.bus.queue).await else {
            continue;
        };
        if let Err(e) = claim(&c, message, permit).await {
            tracing::warn!(error = %e, "claiming a sample");
        }
    }
}

async fn claim(
    c: &Arc<Cluster>,
    message: jetstream::Message,
    room: OwnedSemaphorePermit,
) -> anyhow::Result<()> {
    let item: QueueItem = match serde_json::from_slice(&message.payload) {
        Ok(i) => i,
        Err(e) => {
            let _ = message.ack_with(AckKind::Term).await;
            anyhow::bail!("not a queued sample: {e}");
        }
    };
    let delivered = message
        .info()
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .delivered
        .max(1) as u32;
    let again_soon = AckKind::Nak(Some(AGAIN_SOON));
    // Redelivered to the node that still runs it (its progress acks were late): it keeps
    // running once, and its acks go to this delivery from now on.
    if let Some(t) = c.claims.lock().get_mut(&item.sample_id) {
        tracing::warn!(sample = %item.sample_id, "redelivered while it runs here; keeping it");
        t.message = message;
        return Ok(());
    }
    let (mut sample, revision) =
        settle_unread(ledger::sample(c, item.sample_id.clone()).await, &message).await?;
    let (entry, _) =
        settle_unread(ledger::rollout_entry(c, &item.rollout_id).await, &message).await?;
    // Nothing of a task runs here, nor is anything of it published, before its seal, its
    // sample and this node's ceilings are checked: anyone holding the bus's credential can
    // put a rollout and a queue message there.
    if let Err(refusal) = admissible(c, &entry, &item, &sample) {
        let _ = message.ack_with(AckKind::Term).await;
        c.metrics
            .tasks_refused
            .with_label_values(&[refusal.label()])
            .inc();
        tracing::error!(
            rollout = %item.rollout_id,
            sample = %item.sample_id,
            reason = refusal.label(),
            "refused a task from the bus: {refusal}"
        );
        return Ok(());
    }
    let rollout = entry.rollout;
    if sample.outcome.is_some() {
        // Ended already (a node died between its result and its acknowledgement, or a
        // cancel ended it unclaimed): make sure the result is out, and let it go.
        ledger::publish_end(c, &sample).await?;
        message
            .double_ack()
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        return Ok(());
    }
    let max = c.options.max_attempts;
    let end = if rollout.cancelled {
        Some(Outcome::Cancelled)
    } else if delivered > max {
        Some(Outcome::Error {
            reason: format!("started {max} times; each time its node stopped before it ended"),
        })
    } else {
        None
    };
    if let Some(outcome) = end {
        if ledger::end_unclaimed(c, sample, revision, outcome).await? {
            message
                .double_ack()
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        } else {
            let _ = message.ack_with(again_soon).await;
        }
        return Ok(());
    }
    // A fresh attempt: what an earlier one found is not this one's.
    sample.attempt = delivered - 1;
    sample.stage = Stage::Queued;
    sample.stage_ended_ms = [0; 2];
    sample.trajectory = None;
    sample.evaluation = None;
    sample.agent = None;
    sample.node = Some(c.node_id.clone());
    let revision = match c
        .bus
        .samples
        .update(&sample.sample_id, json_bytes(&sample), revision)
        .await
    {
        Ok(r) => r,
        Err(_) => {
            // Someone wrote it since we read it (a cancel): look again shortly.
            let _ = message.ack_with(again_soon).await;
            return Ok(());
        }
    };
    c.pipeline.store().adopt(&rollout, &sample)?;
    tracing::info!(sample = %sample.sample_id, attempt = delivered, "claimed a sample");
    let held = {
        let mut tickets = c.claims.lock();
        tickets.insert(
            sample.sample_id.clone(),
            Ticket {
                message,
                revision,
                _room: room,
            },
        );
        tickets.len()
    };
    let attempt = if delivered > 1 { "rerun" } else { "first" };
    c.metrics.claims.with_label_values(&[attempt]).inc();
    c.metrics.held.set(held as i64);
    c.pipeline.run_claimed(rollout, sample);
    Ok(())
}

/// What a queued sample names, read from the bus; when it cannot be read, the message is
/// settled: terminated when what it names is not there, offered again soon when the bus
/// failed.
async fn settle_unread<T>(
    read: Result<T, ClusterError>,
    message: &jetstream::Message,
) -> anyhow::Result<T> {
    match read {
        Ok(found) => Ok(found),
        Err(ClusterError::NotFound(what)) => {
            let _ = message.ack_with(AckKind::Term).await;
            anyhow::bail!("queued, but there is no {what}");
        }
        Err(e) => {
            let _ = message.ack_with(AckKind::Nak(Some(AGAIN_SOON))).await;
            Err(e.into())
        }
    }
}

/// Why a queued sample is not run here.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    #[error("{0}")]
    Seal(#[from] SealError),
    #[error("sample {sample} is not one of rollout {rollout}'s samples")]
    ForeignSample { sample: String, rollout: String },
    #[error("over this node's ceilings: {0}")]
    OverCeilings(String),
}

impl Refusal {
    /// The metric label.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Refusal::Seal(SealError::Missing) => "unsealed",
            Refusal::Seal(SealError::Mismatch) => "seal_mismatch",
            Refusal::ForeignSample { .. } => "foreign_sample",
            Refusal::OverCeilings(_) => "over_ceilings",
        }
    }
}

/// Checks a queued sample before anything of it runs: its rollout's seal (the cluster's
/// task key), that the sample is one of that rollout's, and the whole task against this
/// node's own ceilings (the node that sealed it may have had other ones). The node's
/// sandbox policy is applied when the sample runs (`--sandbox` sandboxes every task, and a
/// task asking for a sandbox on a node without one fails).
pub(crate) fn admissible(
    c: &Cluster,
    entry: &SealedRollout,
    item: &QueueItem,
    sample: &Sample,
) -> Result<(), Refusal> {
    c.key.verify(entry)?;
    let rollout = &entry.rollout;
    if !rollout.owns(sample)
        || sample.sample_id != item.sample_id
        || item.rollout_id != rollout.rollout_id
    {
        return Err(Refusal::ForeignSample {
            sample: item.sample_id.clone(),
            rollout: item.rollout_id.clone(),
        });
    }
    if let Some(why) = c.pipeline.refusal(&rollout.spec) {
        return Err(Refusal::OverCeilings(why));
    }
    Ok(())
}

/// Writes each claimed sample's state through to the bus as the pipeline moves it, then
/// publishes the event for every node's readers.
pub(crate) async fn write_through(c: Arc<Cluster>, mut events: broadcast::Receiver<Event>) {
    use broadcast::error::RecvError;
    loop {
        match events.recv().await {
            Ok(event) => {
                let sample_id = match &event {
                    Event::Stage { sample_id, .. } | Event::Finished { sample_id, .. } => {
                        sample_id.clone()
                    }
                };
                sync(&c, &sample_id).await;
                ledger::publish_event(&c, &event).await;
            }
            Err(RecvError::Lagged(_)) => {
                let ids: Vec<String> = c.claims.lock().keys().cloned().collect();
                for id in ids {
                    sync(&c, &id).await;
                }
            }
            Err(RecvError::Closed) => return,
        }
    }
}

/// Sends progress acknowledgements for every claimed sample (so the queue does not give it
/// to another node while it runs here), and finishes what the event stream missed.
pub(crate) async fn keep_alive(c: Arc<Cluster>) {
    let every = (c.options.ack_wait / 3).max(Duration::from_millis(500));
    loop {
        tokio::time::sleep(every).await;
        for (id, message) in c.claims.messages() {
            if let Err(e) = message.ack_with(AckKind::Progress).await {
                tracing::warn!(sample = %id, error = %e, "keeping a claim alive");
                c.metrics.bus_errors.inc();
            }
            if c.pipeline
                .store()
                .sample(&id)
                .is_ok_and(|s| s.outcome.is_some())
            {
                sync(&c, &id).await;
            }
        }
    }
}

/// Writes a claimed sample's state from this node's store to the bus. Once it has ended:
/// its traces, its final state, its result (and callback), then the queue message's
/// acknowledgement (a crash in between leaves the message to be redelivered, and its next
/// claimer finds the sample ended and only makes sure of the result).
async fn sync(c: &Cluster, sample_id: &str) {
    let _one_at_a_time = c.claims.writing.lock().await;
    let Some(revision) = c.claims.revision(sample_id) else {
        return;
    };
    let mut sample = match c.pipeline.store().sample(sample_id) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(sample = sample_id, error = %e, "reading a claimed sample");
            return;
        }
    };
    sample.node = Some(c.node_id.clone());
    let ended = sample.outcome.is_some();
    if ended {
        if let Err(e) = publish_traces(c, &sample).await {
            tracing::warn!(sample = sample_id, error = %e, "putting a sample's traces on the bus (tried again)");
            c.metrics.bus_errors.inc();
            return;
        }
    }
    match write_state(c, &sample, revision).await {
        Ok(revision) => c.claims.set_revision(sample_id, revision),
        Err(Lost) => {
            tracing::warn!(
                sample = sample_id,
                "another node holds this sample now; stopping it here"
            );
            c.pipeline.kill_agent(sample_id);
            c.claims.lock().remove(sample_id);
            c.metrics.claims_lost.inc();
            c.metrics.held.set(c.claims.len() as i64);
            return;
        }
    }
    if ended {
        if let Err(e) = ledger::publish_end(c, &sample).await {
            tracing::warn!(sample = sample_id, error = %e, "publishing a result (tried again)");
            c.metrics.bus_errors.inc();
            return;
        }
        let ticket = c.claims.lock().remove(sample_id);
        c.metrics.held.set(c.claims.len() as i64);
        if let Some(t) = ticket {
            if let Err(e) = t.message.double_ack().await {
                // Redelivered later: its next claimer finds it ended.
                tracing::warn!(sample = sample_id, error = %e, "acknowledging a finished sample");
            }
        }
    }
}

/// The claim is someone else's now.
struct Lost;

/// Writes `sample` conditionally on `revision`; a write that fails because our own previous
/// write landed unacknowledged (a timeout) is retried on the revision it made.
async fn write_state(c: &Cluster, sample: &Sample, revision: u64) -> Result<u64, Lost> {
    let mut revision = revision;
    for _ in 0..5 {
        match c
            .bus
            .samples
            .update(&sample.sample_id, json_bytes(sample), revision)
            .await
        {
            Ok(r) => return Ok(r),
            Err(e) if e.kind() == UpdateErrorKind::WrongLastRevision => {
                match ledger::sample(c, sample.sample_id.clone()).await {
                    Ok((there, r))
                        if there.node == sample.node
                            // Our claim wrote attempt - 1; INIT counted this one.
                            && (there.attempt..=there.attempt + 1).contains(&sample.attempt) =>
                    {
                        if there.outcome.is_some() {
                            // Our final write landed already (a callback may have noted
                            // its delivery since): nothing to add.
                            return Ok(r);
                        }
                        revision = r
                    }
                    Ok(_) => return Err(Lost),
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
            Err(e) => {
                tracing::warn!(sample = %sample.sample_id, error = %e, "writing a sample's state");
                c.metrics.bus_errors.inc();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    // The bus is unreachable: keep the claim; the next event or keep-alive writes again.
    Ok(revision)
}

/// Puts an ended sample's `traces.jsonl` on the bus, for every node's API and callbacks.
async fn publish_traces(c: &Cluster, sample: &Sample) -> anyhow::Result<()> {
    let Some(t) = &sample.trajectory else {
        return Ok(());
    };
    let body = match tokio::fs::read(&t.path).await {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    c.bus
        .traces
        .put(sample.sample_id.as_str(), &mut body.as_slice())
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// Stops this node's samples of a rollout cancelled through any node.
pub(crate) async fn follow_cancellations(c: &Arc<Cluster>) -> anyhow::Result<()> {
    let mut cancels = c.bus.client.subscribe(CANCEL_SUBJECT).await?;
    let c = c.clone();
    tokio::spawn(async move {
        while let Some(m) = cancels.next().await {
            let rollout_id = String::from_utf8_lossy(&m.payload).into_owned();
            match c.pipeline.cancel(&rollout_id) {
                Ok(n) => tracing::info!(rollout = %rollout_id, stopping = n, "cancelled"),
                Err(StoreError::NotFound(_)) => {} // none of its samples ran here
                Err(e) => tracing::warn!(rollout = %rollout_id, error = %e, "cancelling"),
            }
        }
    });
    Ok(())
}
