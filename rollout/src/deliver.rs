//! Callback delivery: every finished sample of a rollout with a `callback_url` is POSTed
//! there as `{"sample": …, "traces": […]}` from the store's outbox. Transient failures
//! (transport errors, 408, 425, 429, 5xx) are retried with exponential backoff and jitter,
//! honouring `Retry-After`; other answers end the delivery with the reason noted on the
//! sample. The outbox row goes only after a 2xx, so a receiver that dedupes by the
//! `Idempotency-Key` header (the sample id) sees each result exactly once, even across node
//! restarts.

use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokentap_proxy::backend::error_chain;

use serde_json::{json, Value};
use tokio::sync::Notify;

use crate::clock::now_ms;
use crate::store::{OutboxEntry, Store};

/// How deliveries are retried.
#[derive(Debug, Clone)]
pub struct DeliveryPolicy {
    pub max_attempts: u32,
    pub first_backoff: Duration,
    pub max_backoff: Duration,
    /// Per attempt.
    pub timeout: Duration,
    /// CA certificates trusted besides the built-in roots (`--ca-file`), for https:// callback
    /// URLs.
    pub ca_roots: Vec<reqwest::Certificate>,
}

impl Default for DeliveryPolicy {
    fn default() -> Self {
        DeliveryPolicy {
            max_attempts: 12,
            first_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(60),
            timeout: Duration::from_secs(30),
            ca_roots: Vec::new(),
        }
    }
}

/// What one attempt came to.
#[derive(Debug, PartialEq)]
pub(crate) enum Attempt {
    Delivered,
    /// Worth trying again (after at least this long, when the receiver said).
    Transient(String, Option<Duration>),
    Refused(String),
}

/// Runs deliveries until the process ends; `wake` is notified whenever a sample finishes.
pub async fn run(store: Arc<Store>, wake: Arc<Notify>, policy: DeliveryPolicy) {
    let client = http_client(&policy);
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let (due, next) = match store.outbox_due(now_ms(), 32) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(error = %e, "reading the callback outbox");
                (Vec::new(), Some(now_ms() + 1000))
            }
        };
        let busy = !due.is_empty();
        for (sample_id, entry) in due {
            deliver(&store, &client, &policy, &sample_id, entry).await;
        }
        if busy {
            continue;
        }
        let wait = next.map_or(Duration::from_secs(5), |n| {
            Duration::from_millis(n.saturating_sub(now_ms())).min(Duration::from_secs(5))
        });
        let _ = tokio::time::timeout(wait, notified).await;
    }
}

/// The client deliveries go out with: rustls with ring; the system's and Mozilla's roots, plus
/// `--ca-file`.
pub(crate) fn http_client(policy: &DeliveryPolicy) -> reqwest::Client {
    let mut builder = reqwest::Client::builder().timeout(policy.timeout);
    for ca in &policy.ca_roots {
        builder = builder.add_root_certificate(ca.clone());
    }
    builder.build().expect("an HTTP client")
}

async fn deliver(
    store: &Store,
    client: &reqwest::Client,
    policy: &DeliveryPolicy,
    sample_id: &str,
    mut entry: OutboxEntry,
) {
    let attempt = match payload(store, sample_id).await {
        Ok(body) => post(client, &entry.url, sample_id, &body).await,
        Err(e) => Attempt::Refused(format!("building the result: {e}")),
    };
    entry.attempts += 1;
    let outcome = match attempt {
        Attempt::Delivered => store.outbox_done(sample_id, entry.attempts, None),
        Attempt::Refused(why) => {
            tracing::warn!(sample = sample_id, url = %entry.url, %why, "callback refused; not retried");
            store.outbox_done(sample_id, entry.attempts, Some(why))
        }
        Attempt::Transient(why, _) if entry.attempts >= policy.max_attempts => {
            let why = format!("gave up after {} attempts: {why}", entry.attempts);
            tracing::warn!(sample = sample_id, url = %entry.url, %why, "callback");
            store.outbox_done(sample_id, entry.attempts, Some(why))
        }
        Attempt::Transient(why, retry_after) => {
            let delay = retry_after
                .unwrap_or_else(|| backoff(policy, entry.attempts))
                .min(policy.max_backoff);
            tracing::debug!(sample = sample_id, %why, ?delay, "callback will be retried");
            entry.next_ms = now_ms() + delay.as_millis() as u64;
            entry.last_error = Some(why);
            store.outbox_retry(sample_id, &entry)
        }
    };
    if let Err(e) = outcome {
        tracing::error!(sample = sample_id, error = %e, "recording a callback attempt");
    }
}

/// Exponential backoff with ±25% jitter, so a receiver coming back is not hit by every
/// node at once.
pub(crate) fn backoff(policy: &DeliveryPolicy, attempts: u32) -> Duration {
    let base = policy
        .first_backoff
        .saturating_mul(1 << attempts.saturating_sub(1).min(16))
        .min(policy.max_backoff);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let jitter = 0.75 + f64::from(nanos % 1000) / 2000.0;
    base.mul_f64(jitter)
}

/// The delivered body: the sample as stored, with its trace rows.
pub async fn payload(store: &Store, sample_id: &str) -> anyhow::Result<Value> {
    let sample = store.sample(sample_id)?;
    let text = match &sample.trajectory {
        Some(t) => match tokio::fs::read_to_string(&t.path).await {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e.into()),
        },
        None => String::new(),
    };
    payload_of(&sample, &text)
}

/// The delivered body of `sample` with its `traces.jsonl` text.
pub(crate) fn payload_of(
    sample: &crate::task::Sample,
    traces_jsonl: &str,
) -> anyhow::Result<Value> {
    let traces: Vec<Value> = traces_jsonl
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    Ok(json!({"sample": sample, "traces": traces}))
}

pub(crate) async fn post(
    client: &reqwest::Client,
    url: &str,
    sample_id: &str,
    body: &Value,
) -> Attempt {
    let sent = client
        .post(url)
        .header("idempotency-key", sample_id)
        .json(body)
        .send()
        .await;
    let response = match sent {
        Ok(r) => r,
        // With its causes: a TLS failure says why (e.g. an unknown issuer) only there.
        Err(e) => return Attempt::Transient(error_chain(&e), None),
    };
    let status = response.status();
    if status.is_success() {
        return Attempt::Delivered;
    }
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_retry_after(v, SystemTime::now()));
    let text = response.text().await.unwrap_or_default();
    let why = format!(
        "HTTP {status}: {}",
        text.chars().take(200).collect::<String>()
    );
    if matches!(status.as_u16(), 408 | 425 | 429) || status.is_server_error() {
        Attempt::Transient(why, retry_after)
    } else {
        Attempt::Refused(why)
    }
}

/// `Retry-After` (RFC 9110 §10.2.3): delay seconds, or an HTTP date (a date already past
/// means now).
fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let p = DeliveryPolicy::default();
        let b1 = backoff(&p, 1);
        let b4 = backoff(&p, 4);
        assert!(b1 >= Duration::from_millis(375) && b1 <= Duration::from_millis(625));
        assert!(b4 >= Duration::from_millis(3000) && b4 <= Duration::from_millis(5000));
        assert!(backoff(&p, 40) <= p.max_backoff.mul_f64(1.25));
    }

    #[test]
    fn retry_after_is_seconds_or_an_http_date() {
        let now = httpdate::parse_http_date("Tue, 24 Nov 2026 08:00:00 GMT").unwrap();
        assert_eq!(parse_retry_after(" 7 ", now), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after("Tue, 24 Nov 2026 08:00:30 GMT", now),
            Some(Duration::from_secs(30)),
            "IMF-fixdate"
        );
        assert_eq!(
            parse_retry_after("Tuesday, 24-Nov-26 08:01:00 GMT", now),
            Some(Duration::from_secs(60)),
            "obsolete RFC 850 form"
        );
        assert_eq!(
            parse_retry_after("Tue, 24 Nov 2026 07:00:00 GMT", now),
            Some(Duration::ZERO),
            "a date in the past means now"
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-5", now), None);
    }
}
