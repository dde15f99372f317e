//! Callback deliveries for the whole cluster. Each owed callback is one message of a work
//! queue (the sample id as message id, so it is queued once); whichever node pulls it POSTs
//! the result with the sample id as `Idempotency-Key` and acknowledges it only after a 2xx,
//! so a result is delivered once however many nodes there are and whichever of them dies.
//! Transient failures are retried by the queue itself (a negative acknowledgement with the
//! backoff, or the receiver's `Retry-After`, as the delay).
//!
//! A node POSTs several at once, within its delivery policy's limits in all and per receiver
//! ([`InFlight`]). It pulls only while it has room in all; a job whose receiver has this
//! node's most in flight is deferred (a negative acknowledgement, about as long as that
//! receiver's oldest delivery has taken so far) rather than waited for, so the jobs behind it
//! for other receivers are not held. A deferral is not an attempt: attempts are counted in
//! their own bucket, not by the queue's deliveries.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{AckKind, Message};
use tokentap_bus::async_nats;

use super::bus::next_message;
use super::ledger::{self, json_bytes, CallbackJob};
use super::node::{Cluster, ClusterError};
use crate::deliver::{
    backoff, http_client, jittered, payload_of, post, Attempt, DeliveryPolicy, InFlight, Slot,
};
use crate::task::CallbackStatus;

pub(crate) async fn deliver(c: Arc<Cluster>) {
    let policy = Arc::new(c.pipeline.delivery().clone());
    let client = http_client(&policy);
    let in_flight = Arc::new(InFlight::new(&policy));
    loop {
        in_flight.room().await;
        let Some(message) = next_message(&c.bus.callbacks).await else {
            continue;
        };
        let job: CallbackJob = match serde_json::from_slice(&message.payload) {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(error = %e, "not a callback job; dropped");
                let _ = message.ack_with(AckKind::Term).await;
                continue;
            }
        };
        match in_flight.try_take(&job.sample_id, &job.url) {
            Some(slot) => {
                tokio::spawn(attempt(
                    c.clone(),
                    client.clone(),
                    policy.clone(),
                    message,
                    job,
                    slot,
                ));
            }
            None => {
                let delay = jittered(in_flight.oldest_to(&job.url).clamp(
                    Duration::from_secs(1),
                    policy.timeout.max(Duration::from_secs(1)),
                ));
                tracing::debug!(sample = %job.sample_id, url = %job.url, ?delay, "callback deferred: its receiver has this node's most in flight");
                c.metrics.callbacks.with_label_values(&["deferred"]).inc();
                if let Err(e) = message.ack_with(AckKind::Nak(Some(delay))).await {
                    tracing::warn!(sample = %job.sample_id, error = %e, "deferring a callback job");
                }
            }
        }
    }
}

/// One attempt at `job`, in `slot`: the sealed-URL check, the POST, and what the queue and
/// the sample are told of it.
async fn attempt(
    c: Arc<Cluster>,
    client: reqwest::Client,
    policy: Arc<DeliveryPolicy>,
    message: Message,
    job: CallbackJob,
    slot: Slot,
) {
    // The job names a URL, but only the URL of a sealed rollout is called: anyone with
    // the bus's credential can queue a job.
    match sealed_url(&c, &job.sample_id).await {
        Ok(Some(url)) if url == job.url => {}
        Ok(_) => {
            tracing::error!(sample = %job.sample_id, url = %job.url, "refused a callback job whose URL is not its sealed rollout's");
            c.metrics
                .tasks_refused
                .with_label_values(&["callback_unsealed"])
                .inc();
            let _ = message.ack_with(AckKind::Term).await;
            return;
        }
        Err(e) => {
            tracing::debug!(error = %e, "reading a callback's rollout (tried again)");
            let _ = message
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
            return;
        }
    }
    let sample = job.sample_id.as_str();
    let attempts = match attempts_made(&c, sample).await {
        Ok(made) => made + 1,
        // The queue's deliveries (deferrals too) are never fewer than the attempts: the job
        // gives up no later than it should.
        Err(e) => {
            tracing::debug!(sample, error = %e, "reading a callback's attempts; counting the queue's deliveries");
            message.info().map_or(1, |i| i.delivered.max(1) as u32)
        }
    };
    let attempt = match body(&c, sample).await {
        Ok(body) => post(&client, &job.url, sample, &body).await,
        // The bus answers again soon; the receiver has not been bothered.
        Err(e) => Attempt::Transient(format!("reading the result from the bus: {e:#}"), None),
    };
    // The receiver is done with; the slot goes back before the bus is told.
    drop(slot);
    let outcome = match &attempt {
        Attempt::Delivered => "delivered",
        Attempt::Refused(_) => "refused",
        Attempt::Transient(..) if attempts >= policy.max_attempts => "gave_up",
        Attempt::Transient(..) => "retried",
    };
    c.metrics.callbacks.with_label_values(&[outcome]).inc();
    let acked = match attempt {
        Attempt::Delivered => {
            note(&c, sample, attempts, None).await;
            message.double_ack().await
        }
        Attempt::Refused(why) => {
            tracing::warn!(sample, url = %job.url, %why, "callback refused; not retried");
            note(&c, sample, attempts, Some(why)).await;
            message.ack_with(AckKind::Term).await
        }
        Attempt::Transient(why, _) if attempts >= policy.max_attempts => {
            let why = format!("gave up after {attempts} attempts: {why}");
            tracing::warn!(sample, url = %job.url, %why, "callback");
            note(&c, sample, attempts, Some(why)).await;
            message.ack_with(AckKind::Term).await
        }
        Attempt::Transient(why, retry_after) => {
            let delay = retry_after
                .unwrap_or_else(|| backoff(&policy, attempts))
                .min(policy.max_backoff);
            tracing::debug!(sample, %why, ?delay, "callback will be retried");
            if let Err(e) = c
                .bus
                .callback_attempts
                .put(sample, attempts.to_string().into())
                .await
            {
                tracing::warn!(sample, error = %e, "counting a callback attempt");
            }
            message.ack_with(AckKind::Nak(Some(delay))).await
        }
    };
    if let Err(e) = acked {
        tracing::warn!(sample, error = %e, "acknowledging a callback job");
    }
    if attempts > 1 && outcome != "retried" {
        // Ended: its count is of no more use (the bucket's retention would drop it too).
        let _ = c.bus.callback_attempts.purge(sample).await;
    }
}

/// The attempts made at a sample's callback so far (by any node).
async fn attempts_made(c: &Cluster, sample_id: &str) -> anyhow::Result<u32> {
    match c.bus.callback_attempts.get(sample_id).await? {
        Some(count) => Ok(std::str::from_utf8(&count)?.parse()?),
        None => Ok(0),
    }
}

/// The callback URL of the sample's rollout, if that rollout's seal holds (None: it has
/// none, or its seal does not hold).
async fn sealed_url(c: &Cluster, sample_id: &str) -> anyhow::Result<Option<String>> {
    let read = async {
        let (sample, _) = ledger::sample(c, sample_id.to_owned()).await?;
        let (entry, _) = ledger::rollout_entry(c, &sample.rollout_id).await?;
        Ok::<_, ClusterError>((sample, entry))
    };
    let (sample, entry) = match read.await {
        Ok(found) => found,
        Err(ClusterError::NotFound(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if c.key.verify(&entry).is_err() || !entry.rollout.owns(&sample) {
        return Ok(None);
    }
    Ok(entry.rollout.spec.callback_url)
}

/// The body a callback delivers: the sample as the bus has it, with its trace rows.
async fn body(c: &Cluster, sample_id: &str) -> anyhow::Result<serde_json::Value> {
    let (sample, _) = ledger::sample(c, sample_id.to_owned()).await?;
    let traces = ledger::sample_traces(c, sample_id)
        .await?
        .unwrap_or_default();
    payload_of(&sample, std::str::from_utf8(&traces)?)
}

/// Notes how a delivery ended on the sample's state.
async fn note(c: &Cluster, sample_id: &str, attempts: u32, error: Option<String>) {
    for _ in 0..5 {
        let Ok((mut sample, revision)) = ledger::sample(c, sample_id.to_owned()).await else {
            return;
        };
        sample.callback = Some(CallbackStatus {
            delivered: error.is_none(),
            attempts,
            error: error.clone(),
        });
        if c.bus
            .samples
            .update(sample_id, json_bytes(&sample), revision)
            .await
            .is_ok()
        {
            return;
        }
    }
}
