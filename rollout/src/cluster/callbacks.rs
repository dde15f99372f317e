//! Callback deliveries for the whole cluster. Each owed callback is one message of a work
//! queue (the sample id as message id, so it is queued once); whichever node pulls it POSTs
//! the result with the sample id as `Idempotency-Key` and acknowledges it only after a 2xx,
//! so a result is delivered once however many nodes there are and whichever of them dies.
//! Transient failures are retried by the queue itself (a negative acknowledgement with the
//! backoff, or the receiver's `Retry-After`, as the delay).

use std::sync::Arc;

use async_nats::jetstream::AckKind;
use tokentap_bus::async_nats;

use super::bus::next_message;
use super::ledger::{self, json_bytes, CallbackJob};
use super::node::{Cluster, ClusterError};
use crate::deliver::{backoff, http_client, payload_of, post, Attempt};
use crate::task::CallbackStatus;

pub(crate) async fn deliver(c: Arc<Cluster>) {
    let policy = c.pipeline.delivery().clone();
    let client = http_client(&policy);
    loop {
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
                continue;
            }
            Err(e) => {
                tracing::debug!(error = %e, "reading a callback's rollout (tried again)");
                let _ = message
                    .ack_with(AckKind::Nak(Some(std::time::Duration::from_secs(1))))
                    .await;
                continue;
            }
        }
        let attempts = message.info().map_or(1, |i| i.delivered.max(1) as u32);
        let attempt = match body(&c, &job.sample_id).await {
            Ok(body) => post(&client, &job.url, &job.sample_id, &body).await,
            // The bus answers again soon; the receiver has not been bothered.
            Err(e) => Attempt::Transient(format!("reading the result from the bus: {e:#}"), None),
        };
        let sample = job.sample_id.as_str();
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
                message.ack_with(AckKind::Nak(Some(delay))).await
            }
        };
        if let Err(e) = acked {
            tracing::warn!(sample, error = %e, "acknowledging a callback job");
        }
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
