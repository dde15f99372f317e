//! Callback delivery: every finished sample of a rollout with a `callback_url` is POSTed
//! there as `{"sample": …, "traces": […]}` from the store's outbox. Transient failures
//! (transport errors, 408, 425, 429, 5xx) are retried with exponential backoff and jitter,
//! honouring `Retry-After`; other answers end the delivery with the reason noted on the
//! sample. The outbox row goes only after a 2xx, so a receiver that dedupes by the
//! `Idempotency-Key` header (the sample id) sees each result exactly once, even across node
//! restarts.
//!
//! Deliveries run side by side, at most [`DeliveryPolicy::max_in_flight`] at once and
//! [`DeliveryPolicy::max_per_receiver`] to one receiver (host and port), so a receiver that is
//! slow or never answers holds only its own few slots for its timeout while every other
//! receiver's callbacks go out. A receiver's answer is read to at most
//! [`MAX_BODY_READ`](tokentap_proxy::capped_body::MAX_BODY_READ) (its error message).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokentap_proxy::backend::error_chain;
use tokentap_proxy::capped_body::{self, MAX_BODY_READ};

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
    /// Deliveries in flight at once, to all receivers.
    pub max_in_flight: usize,
    /// Deliveries in flight at once to one receiver (host and port).
    pub max_per_receiver: usize,
}

impl Default for DeliveryPolicy {
    fn default() -> Self {
        DeliveryPolicy {
            max_attempts: 12,
            first_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(60),
            timeout: Duration::from_secs(30),
            ca_roots: Vec::new(),
            max_in_flight: 32,
            max_per_receiver: 4,
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
    let in_flight = Arc::new(InFlight::new(&policy));
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let mut slots = HashMap::new();
        // Only what can start now: not in flight already, its receiver and the node with room.
        let due = store.outbox_due(now_ms(), policy.max_in_flight, |sample_id, entry| {
            in_flight
                .try_take(sample_id, &entry.url)
                .map(|slot| slots.insert(sample_id.to_owned(), slot))
                .is_some()
        });
        let (due, next) = match due {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(error = %e, "reading the callback outbox");
                (Vec::new(), Some(now_ms() + 1000))
            }
        };
        let started = !due.is_empty();
        for (sample_id, entry) in due {
            let Some(slot) = slots.remove(&sample_id) else {
                continue;
            };
            let (store, client, policy, wake) =
                (store.clone(), client.clone(), policy.clone(), wake.clone());
            tokio::spawn(async move {
                deliver(&store, &client, &policy, &sample_id, entry).await;
                drop(slot);
                // What waited for this slot (or its receiver's) may start.
                wake.notify_one();
            });
        }
        if started {
            continue;
        }
        let wait = next.map_or(Duration::from_secs(5), |n| {
            Duration::from_millis(n.saturating_sub(now_ms())).min(Duration::from_secs(5))
        });
        let _ = tokio::time::timeout(wait, notified).await;
    }
}

/// The deliveries a node has in flight, within its policy's limits: in all, and to each
/// receiver.
pub(crate) struct InFlight {
    max_total: usize,
    max_per_receiver: usize,
    state: Mutex<InFlightState>,
    /// Notified whenever a slot is given back.
    freed: Notify,
}

#[derive(Default)]
struct InFlightState {
    samples: HashSet<String>,
    /// When each delivery in flight to a receiver started.
    receivers: HashMap<String, Vec<Instant>>,
}

/// One delivery in flight; its slot is given back when it is dropped.
pub(crate) struct Slot {
    in_flight: Arc<InFlight>,
    sample_id: String,
    receiver: String,
    started: Instant,
}

impl InFlight {
    pub(crate) fn new(policy: &DeliveryPolicy) -> InFlight {
        InFlight {
            max_total: policy.max_in_flight.max(1),
            max_per_receiver: policy.max_per_receiver.max(1),
            state: Mutex::default(),
            freed: Notify::new(),
        }
    }

    /// A slot for delivering `sample_id` to `url`, unless that sample is in flight already,
    /// its receiver has its most or the node its most.
    pub(crate) fn try_take(self: &Arc<Self>, sample_id: &str, url: &str) -> Option<Slot> {
        let receiver = receiver_of(url);
        let mut state = self.state.lock().expect("not poisoned");
        let to_receiver = state.receivers.get(&receiver).map_or(0, Vec::len);
        if state.samples.len() >= self.max_total
            || to_receiver >= self.max_per_receiver
            || state.samples.contains(sample_id)
        {
            return None;
        }
        let started = Instant::now();
        state.samples.insert(sample_id.to_owned());
        state
            .receivers
            .entry(receiver.clone())
            .or_default()
            .push(started);
        Some(Slot {
            in_flight: self.clone(),
            sample_id: sample_id.to_owned(),
            receiver,
            started,
        })
    }

    /// Returns once the node has room for another delivery (to some receiver).
    pub(crate) async fn room(&self) {
        loop {
            let freed = self.freed.notified();
            if self.state.lock().expect("not poisoned").samples.len() < self.max_total {
                return;
            }
            freed.await;
        }
    }

    /// How long the oldest delivery in flight to `url`'s receiver has taken so far (zero
    /// when there is none): about how long that receiver takes to free a slot.
    pub(crate) fn oldest_to(&self, url: &str) -> Duration {
        let state = self.state.lock().expect("not poisoned");
        state
            .receivers
            .get(&receiver_of(url))
            .and_then(|starts| starts.iter().min())
            .map_or(Duration::ZERO, Instant::elapsed)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut state = self.in_flight.state.lock().expect("not poisoned");
        state.samples.remove(&self.sample_id);
        if let Some(starts) = state.receivers.get_mut(&self.receiver) {
            if let Some(i) = starts.iter().position(|s| *s == self.started) {
                starts.swap_remove(i);
            }
            if starts.is_empty() {
                state.receivers.remove(&self.receiver);
            }
        }
        drop(state);
        self.in_flight.freed.notify_one();
    }
}

/// Who a callback URL is delivered to, for the per-receiver limit: its host and port (the
/// URL itself when it is not one; its delivery fails anyway).
fn receiver_of(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(u) => format!(
            "{}:{}",
            u.host_str().unwrap_or_default(),
            u.port_or_known_default().unwrap_or_default()
        ),
        Err(_) => url.to_owned(),
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
    jittered(base)
}

/// `base` ±25%.
pub(crate) fn jittered(base: Duration) -> Duration {
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
    // The receiver's message, for the note on the sample: however much it sends, the node
    // reads a bounded start of it.
    let excerpt = capped_body::read(response, MAX_BODY_READ)
        .await
        .unwrap_or_default();
    let why = format!(
        "HTTP {status}: {}",
        excerpt.text().chars().take(200).collect::<String>()
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
    fn slots_are_bounded_in_all_per_receiver_and_per_sample() {
        let in_flight = Arc::new(InFlight::new(&DeliveryPolicy {
            max_in_flight: 3,
            max_per_receiver: 2,
            ..DeliveryPolicy::default()
        }));
        let a1 = in_flight.try_take("s1", "http://a:9000/results").unwrap();
        assert!(
            in_flight.try_take("s1", "http://b/").is_none(),
            "a sample in flight"
        );
        // The same host and port, however the URL goes on.
        let a2 = in_flight.try_take("s2", "http://a:9000/other?x").unwrap();
        assert!(in_flight.try_take("s3", "http://a:9000/results").is_none());
        let b = in_flight.try_take("s3", "http://a:9001/results").unwrap();
        assert!(
            in_flight.try_take("s4", "https://c/").is_none(),
            "3 in flight in all"
        );
        drop(a1);
        let c = in_flight.try_take("s4", "https://c/").unwrap();
        assert!(in_flight.oldest_to("http://a:9000/") > Duration::ZERO);
        assert_eq!(in_flight.oldest_to("http://d/"), Duration::ZERO);
        drop((a2, b, c));
        let state = in_flight.state.lock().unwrap();
        assert!(state.samples.is_empty() && state.receivers.is_empty());
    }

    #[test]
    fn a_receiver_is_its_host_and_port() {
        assert_eq!(
            receiver_of("https://Trainer.example/cb"),
            "trainer.example:443"
        );
        assert_eq!(receiver_of("http://[::1]:9000/cb"), "[::1]:9000");
        assert_eq!(receiver_of("not a url"), "not a url");
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
