//! The cluster's rollouts and samples as any node's API sees them: submitted to the bus,
//! read from its buckets, cancelled everywhere.

use async_nats::jetstream::message::PublishMessage;
use serde::{Deserialize, Serialize};
use tokentap_bus::async_nats;
use tokio::io::AsyncReadExt;

use super::bus::{
    events_subject, CALLBACK_SUBJECT, CANCEL_SUBJECT, QUEUE_SUBJECT, RESULTS_SUBJECT,
};
use super::node::{bus_error, Cluster, ClusterError};
use super::seal::SealedRollout;
use crate::clock::now_ms;
use crate::pipeline::Event;
use crate::store::new_rollout;
use crate::task::{Outcome, Rollout, Sample, Stage, TaskSpec};

/// One queued sample.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct QueueItem {
    pub rollout_id: String,
    pub sample_id: String,
}

/// One callback owed.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct CallbackJob {
    pub sample_id: String,
    pub url: String,
}

/// A value as the bus stores it (JSON).
pub(crate) fn json_bytes<T: Serialize>(value: &T) -> bytes::Bytes {
    serde_json::to_vec(value)
        .expect("plain data serializes")
        .into()
}

/// Accepts a task for the whole cluster: the rollout and its samples' state first, then
/// one queue message per sample (the sample id as its message id: a retried submit
/// queues nothing twice).
pub async fn submit(c: &Cluster, spec: TaskSpec) -> Result<(Rollout, Vec<Sample>), ClusterError> {
    let (rollout, samples) = new_rollout(spec, now_ms());
    // Sealed: a node runs a rollout only when the seal of the cluster's task key holds.
    let sealed = c.key.seal(rollout);
    c.bus
        .rollouts
        .put(&sealed.rollout.rollout_id, json_bytes(&sealed))
        .await
        .map_err(bus_error)?;
    let rollout = sealed.rollout;
    for s in &samples {
        c.bus
            .samples
            .put(&s.sample_id, json_bytes(s))
            .await
            .map_err(bus_error)?;
    }
    let mut acks = Vec::with_capacity(samples.len());
    for s in &samples {
        let item = QueueItem {
            rollout_id: rollout.rollout_id.clone(),
            sample_id: s.sample_id.clone(),
        };
        let message = PublishMessage::build()
            .payload(json_bytes(&item))
            .message_id(&s.sample_id);
        acks.push(
            c.bus
                .js
                .send_publish(QUEUE_SUBJECT, message)
                .await
                .map_err(bus_error)?,
        );
    }
    for ack in acks {
        ack.await.map_err(bus_error)?;
    }
    Ok((rollout, samples))
}

/// A rollout and its samples, as the bus has them now.
pub async fn rollout(
    c: &Cluster,
    rollout_id: &str,
) -> Result<(Rollout, Vec<Sample>), ClusterError> {
    let (entry, _) = rollout_entry(c, rollout_id).await?;
    let rollout = entry.rollout;
    let samples = futures::future::try_join_all(
        (0..rollout.spec.num_samples).map(|i| sample(c, format!("{rollout_id}-{i}"))),
    )
    .await?;
    Ok((rollout, samples.into_iter().map(|(s, _)| s).collect()))
}

/// A rollout as the bucket holds it (its seal not yet checked: [`super::seal::TaskKey::verify`]).
pub(crate) async fn rollout_entry(
    c: &Cluster,
    rollout_id: &str,
) -> Result<(SealedRollout, u64), ClusterError> {
    entry(&c.bus.rollouts, rollout_id, "rollout").await
}

/// A sample's state and its revision in the bucket.
pub async fn sample(c: &Cluster, sample_id: String) -> Result<(Sample, u64), ClusterError> {
    entry(&c.bus.samples, &sample_id, "sample").await
}

/// Cancels a rollout on every node: marks it cancelled, ends its samples no node has
/// claimed, and tells every node to stop those it runs (they end `cancelled` after
/// POST_RUN keeps what they captured). Returns how many were claimed and running.
pub async fn cancel(c: &Cluster, rollout_id: &str) -> Result<usize, ClusterError> {
    let rollout = loop {
        let (entry, revision) = rollout_entry(c, rollout_id).await?;
        let sealed_here = c.key.verify(&entry).is_ok();
        let mut rollout = entry.rollout;
        rollout.cancelled = true;
        // Sealed again only if it was sealed: a cancel never gives a forged rollout a seal
        // (unsealed, it stays one that no node runs).
        let value = if sealed_here {
            c.key.seal(rollout.clone())
        } else {
            SealedRollout {
                rollout: rollout.clone(),
                seal: None,
            }
        };
        // Conditional, so a concurrent cancel of the same rollout does not fail either.
        if c.bus
            .rollouts
            .update(rollout_id, json_bytes(&value), revision)
            .await
            .is_ok()
        {
            break rollout;
        }
    };
    let mut running = 0;
    for i in 0..rollout.spec.num_samples {
        let (sample, revision) = sample(c, format!("{rollout_id}-{i}")).await?;
        if sample.outcome.is_some() {
            continue;
        }
        // A claim made before this write loses to it; one made after sees the rollout
        // cancelled and ends the sample itc.
        if sample.node.is_none() && end_unclaimed(c, sample, revision, Outcome::Cancelled).await? {
            continue;
        }
        running += 1;
    }
    c.bus
        .client
        .publish(CANCEL_SUBJECT, rollout_id.to_owned().into())
        .await
        .map_err(bus_error)?;
    c.bus.client.flush().await.map_err(bus_error)?;
    Ok(running)
}

/// An ended sample's trace rows (`traces.jsonl`), whichever node ran it; None while it
/// has none.
pub async fn sample_traces(c: &Cluster, sample_id: &str) -> Result<Option<Vec<u8>>, ClusterError> {
    let (sample, _) = sample(c, sample_id.to_owned()).await?;
    if sample.trajectory.is_none() {
        return Ok(None);
    }
    let mut object = match c.bus.traces.get(sample_id).await {
        Ok(o) => o,
        Err(e) if e.kind() == async_nats::jetstream::object_store::GetErrorKind::NotFound => {
            return Ok(None)
        }
        Err(e) => return Err(bus_error(e)),
    };
    let mut body = Vec::new();
    object.read_to_end(&mut body).await.map_err(bus_error)?;
    Ok(Some(body))
}

/// Ends a sample no node runs (cancelled before anyone claimed it, or out of attempts):
/// its state (conditional on `revision`: false when someone else wrote first), its
/// result and its event.
pub(crate) async fn end_unclaimed(
    c: &Cluster,
    mut sample: Sample,
    revision: u64,
    outcome: Outcome,
) -> Result<bool, ClusterError> {
    sample.stage = Stage::Done;
    sample.stage_started_ms[3] = now_ms();
    sample.outcome = Some(outcome.clone());
    if c.bus
        .samples
        .update(&sample.sample_id, json_bytes(&sample), revision)
        .await
        .is_err()
    {
        return Ok(false);
    }
    publish_end(c, &sample).await?;
    publish_event(
        c,
        &Event::Finished {
            rollout_id: sample.rollout_id.clone(),
            sample_id: sample.sample_id.clone(),
            outcome,
        },
    )
    .await;
    Ok(true)
}

/// Puts an ended sample in the results log and, when its rollout has a callback URL, in
/// the callback queue; both under the sample id as message id, so that doing it again
/// (a node that died between this and acknowledging the sample's queue message) stores
/// nothing twice.
pub(crate) async fn publish_end(c: &Cluster, sample: &Sample) -> Result<(), ClusterError> {
    let message = PublishMessage::build()
        .payload(json_bytes(sample))
        .message_id(&sample.sample_id);
    c.bus
        .js
        .send_publish(RESULTS_SUBJECT, message)
        .await
        .map_err(bus_error)?
        .await
        .map_err(bus_error)?;
    let (entry, _) = rollout_entry(c, &sample.rollout_id).await?;
    if let Err(why) = c.key.verify(&entry) {
        // Its claim refused it already; a sample ended unclaimed (cancelled, out of
        // attempts) can still belong to one: no callback to a URL nobody sealed.
        tracing::warn!(sample = %sample.sample_id, %why, "no callback for a rollout without a valid seal");
        return Ok(());
    }
    if let Some(url) = entry.rollout.spec.callback_url {
        let job = CallbackJob {
            sample_id: sample.sample_id.clone(),
            url,
        };
        let message = PublishMessage::build()
            .payload(json_bytes(&job))
            .message_id(&sample.sample_id);
        c.bus
            .js
            .send_publish(CALLBACK_SUBJECT, message)
            .await
            .map_err(bus_error)?
            .await
            .map_err(bus_error)?;
    }
    Ok(())
}

/// Publishes a progress event for every node's event streams (best effort: an event
/// lost here leaves the snapshot a reader takes right).
pub(crate) async fn publish_event(c: &Cluster, event: &Event) {
    let published = c
        .bus
        .js
        .publish(events_subject(event.rollout_id()), json_bytes(event))
        .await;
    if let Err(e) = published {
        tracing::warn!(error = %e, "publishing an event");
    }
}

/// A value of `bucket` with its revision; `what` names it in a not-found error.
async fn entry<T: serde::de::DeserializeOwned>(
    bucket: &async_nats::jetstream::kv::Store,
    key: &str,
    what: &str,
) -> Result<(T, u64), ClusterError> {
    let not_found = || ClusterError::NotFound(format!("{what} {key}"));
    // Keys are ids we made (letters, digits, '-'); anything else cannot be one.
    if key.is_empty()
        || !key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(not_found());
    }
    match bucket.entry(key).await.map_err(bus_error)? {
        Some(e) if e.operation == async_nats::jetstream::kv::Operation::Put => Ok((
            serde_json::from_slice(&e.value).map_err(bus_error)?,
            e.revision,
        )),
        _ => Err(not_found()),
    }
}
