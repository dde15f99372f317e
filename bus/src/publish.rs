//! A spool's records → the records stream, at least once: each record goes to its session's
//! partition under this publisher's name (`tokentap.records.<bus user>.<partition>`, the only
//! records subjects the bus lets that user publish to) with its record id as `Nats-Msg-Id` (the stream drops a republished one as
//! a duplicate), up to [`MAX_IN_FLIGHT`] unacknowledged at a time, and the cursor file next to
//! the spool moves only past records the server acknowledged. A bus that is down holds the
//! records in the spool, where they were written anyway; they go out when it is back.
//!
//! What the bus will never take (a record over the server's `max_payload`, a spool line that is
//! not a record, one over the records stream's `max_msg_size`) goes to [`DEAD_LETTER_FILE`] next to the cursor, loudly and counted, before
//! the cursor moves past it.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use tokentap_schema::ndjson::encode_line;
use tokentap_spool::downstream::{self, DownstreamMetrics};
use tokentap_spool::{SpoolItem, SpoolPosition, SpoolReader};

use crate::topology::{publisher_name, record_subject, PublishTopology};

/// Next to the spool's segments (the spool reader ignores other files).
pub const CURSOR_FILE: &str = "bus-cursor.json";
/// Records the bus will never take, one JSON object a line; created 0600.
pub const DEAD_LETTER_FILE: &str = "bus-dead-letter.ndjson";
/// Publishes awaiting their ack at once.
pub const MAX_IN_FLIGHT: usize = 256;

/// When the publisher stops.
#[derive(Clone)]
pub struct PublishStop {
    /// Set: publish what is in the spool, then return.
    pub drain: Arc<AtomicBool>,
    /// After `drain` is set, give up this long after it if the bus is unreachable (the cursor
    /// is saved: the next start resumes).
    pub drain_deadline: Duration,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct PublishTotals {
    pub records: u64,
    pub duplicates: u64,
    pub dead_lettered: u64,
    pub retries: u64,
}

/// A spool line read and sent (or settled here), not yet past the cursor.
struct InFlight {
    end: SpoolPosition,
    /// `None`: settled without the bus (dead-lettered).
    ack: Option<PublishAckFuture>,
}

/// Publishes `spool` to the bus at `url` until the spool is drained and `stop.drain` is set.
pub async fn publish_spool(
    spool: &Path,
    bus: &crate::BusConnect,
    partitions: u32,
    stop: &PublishStop,
    metrics: DownstreamMetrics,
) -> anyhow::Result<PublishTotals> {
    let url = bus.url.as_str();
    let publisher = publisher_name(bus)?;
    let cursor_path = spool.join(CURSOR_FILE);
    let start = downstream::load_cursor(&cursor_path, url);
    let mut totals = PublishTotals::default();
    let mut drain_since: Option<Instant> = None;
    let gave_up = |drain_since: &mut Option<Instant>| {
        if stop.drain.load(Ordering::Relaxed) {
            let since = *drain_since.get_or_insert_with(Instant::now);
            since.elapsed() >= stop.drain_deadline
        } else {
            false
        }
    };
    // The first connection: waited for (a bus down at start is like one down later), but not
    // past a drain's deadline.
    let client = crate::connect(bus, "tokentap publisher");
    tokio::pin!(client);
    let client = loop {
        tokio::select! {
            c = &mut client => break c.context("connecting to the bus")?,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                if gave_up(&mut drain_since) {
                    tracing::warn!(bus = %url, "bus unreachable while stopping: records stay in the spool for the next start");
                    return Ok(totals);
                }
            }
        }
    };
    let topology = match crate::topology::until_reachable(
        || PublishTopology::open(crate::jetstream(client.clone()), partitions),
        || {
            metrics.errors.inc();
            gave_up(&mut drain_since)
        },
    )
    .await
    {
        Some(t) => t,
        None => return Ok(totals),
    };
    let dead_letters = spool.join(DEAD_LETTER_FILE);
    let mut cursor = start;
    let mut saved = start;
    let mut last_save = Instant::now();
    let mut reader = SpoolReader::open_at(spool, start)
        .with_context(|| format!("opening the spool at {}", spool.display()))?;
    let mut in_flight: VecDeque<InFlight> = VecDeque::new();
    let mut backlog_measured: Option<Instant> = None;
    let mut backoff = Duration::from_millis(200);
    tracing::info!(spool = %spool.display(), bus = %url, partitions = topology.partitions, from = %start, "publishing records");
    loop {
        if backlog_measured.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            backlog_measured = Some(Instant::now());
            if let Ok(unsent) = tokentap_spool::bytes_after(spool, cursor) {
                metrics.backlog_bytes.set(unsent as i64);
            }
        }
        let mut failed = false;
        // Whether the spool had nothing more to read this time round: a drain ends only then.
        let mut read_all = false;
        while in_flight.len() < MAX_IN_FLIGHT {
            let (position, line) = match reader.next_available()? {
                Some(SpoolItem::Record(e)) => {
                    let mut line = Vec::new();
                    encode_line(&e.record, &mut line)?;
                    line.pop(); // the newline: a message is one record
                    (
                        e.position,
                        Ok((e.record.record_id, e.record.session_id, line)),
                    )
                }
                Some(SpoolItem::Corrupt { position, error }) => (position, Err(error)),
                Some(SpoolItem::Torn { .. }) => continue, // never from next_available
                None => {
                    read_all = true;
                    break;
                }
            };
            let end = reader.position();
            let (id, session, line) = match line {
                Ok(l) => l,
                Err(error) => {
                    let reason = format!("the spool line is not a record: {error}");
                    dead_letter(
                        &dead_letters,
                        url,
                        position,
                        &reason,
                        None,
                        &metrics,
                        &mut totals,
                    )?;
                    in_flight.push_back(InFlight { end, ack: None });
                    continue;
                }
            };
            let subject = record_subject(&publisher, topology.partition_of(&session));
            // What the stream stores is the payload and the header carrying the message id.
            let stored = line.len() + "NATS/1.0\r\nNats-Msg-Id: \r\n\r\n".len() + id.len();
            if let Some(limit) = topology.max_msg_size.filter(|&limit| stored > limit) {
                let reason = format!(
                    "the record is {stored} bytes with its header, over the records stream's max_msg_size of {limit} (TOKENTAP_BUS_RECORDS_MAX_MSG_SIZE where the worker group runs)"
                );
                dead_letter(
                    &dead_letters,
                    url,
                    position,
                    &reason,
                    Some(line.as_slice()),
                    &metrics,
                    &mut totals,
                )?;
                in_flight.push_back(InFlight { end, ack: None });
                continue;
            }
            // Shared, not copied: kept for the dead-letter file should the bus refuse it.
            let line = Bytes::from(line);
            let message = PublishMessage::build()
                .payload(line.clone())
                .message_id(&id);
            match topology.js.send_publish(subject, message).await {
                Ok(ack) => in_flight.push_back(InFlight {
                    end,
                    ack: Some(ack),
                }),
                Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                    let reason = format!(
                        "the record is {} bytes, over the bus's max_payload (raise it in nats-server's configuration)",
                        line.len()
                    );
                    dead_letter(
                        &dead_letters,
                        url,
                        position,
                        &reason,
                        Some(&line),
                        &metrics,
                        &mut totals,
                    )?;
                    in_flight.push_back(InFlight { end, ack: None });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "publishing a record failed");
                    failed = true;
                    break;
                }
            }
        }
        // Settle the acknowledged front; the cursor moves past it.
        while !failed {
            let Some(front) = in_flight.front_mut() else {
                break;
            };
            match front.ack.take() {
                None => {}
                Some(ack) => match ack.await {
                    Ok(a) => {
                        totals.records += 1;
                        totals.duplicates += u64::from(a.duplicate);
                        metrics.records.inc();
                        metrics.last_ack.set(unix_s());
                        backoff = Duration::from_millis(200);
                    }
                    Err(e) => {
                        if stream_is_full(&e.to_string()) {
                            tracing::error!(bus = %url, error = %e, "the records stream is full (its max_bytes or max_msgs, or its account's JetStream limit): records wait in the spool and go out once it has room (docs/scale-out.md, \"Limits\")");
                        } else {
                            tracing::warn!(error = %e, "the bus did not acknowledge a record");
                        }
                        failed = true;
                        break;
                    }
                },
            }
            cursor = in_flight.pop_front().expect("front exists").end;
        }
        if failed {
            // Start again from the cursor: whatever was in flight is republished (and dropped
            // by the bus as a duplicate if it had arrived).
            metrics.errors.inc();
            totals.retries += 1;
            in_flight.clear();
            downstream::save_cursor(&cursor_path, url, cursor)?;
            saved = cursor;
            if gave_up(&mut drain_since) {
                tracing::warn!(bus = %url, "bus unreachable while stopping: records stay in the spool for the next start");
                return Ok(totals);
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
            reader = SpoolReader::open_at(spool, cursor)?;
            continue;
        }
        if cursor != saved
            && (in_flight.is_empty() || last_save.elapsed() >= Duration::from_millis(200))
        {
            downstream::save_cursor(&cursor_path, url, cursor)?;
            saved = cursor;
            last_save = Instant::now();
        }
        if in_flight.is_empty() && read_all {
            if stop.drain.load(Ordering::Relaxed) {
                if let Ok(unsent) = tokentap_spool::bytes_after(spool, cursor) {
                    metrics.backlog_bytes.set(unsent as i64);
                }
                tracing::info!(?totals, "publisher drained");
                return Ok(totals);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether an acknowledgement's error says the stream (or its account) has no room: the
/// server's "maximum bytes/messages exceeded" of a stream that discards new messages, or
/// "insufficient resources" (10023) of an account at its JetStream limit.
pub fn stream_is_full(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    e.contains("maximum bytes exceeded")
        || e.contains("maximum messages exceeded")
        || e.contains("insufficient resources")
        || e.contains("resource limits exceeded")
}

/// Keeps a record the bus will never take: said in the log, written to the dead-letter file,
/// counted.
fn dead_letter(
    path: &Path,
    bus: &str,
    position: SpoolPosition,
    reason: &str,
    record_line: Option<&[u8]>,
    metrics: &DownstreamMetrics,
    totals: &mut PublishTotals,
) -> anyhow::Result<()> {
    tracing::error!(%position, reason, file = %path.display(), "a record will never reach the bus: kept in the dead-letter file");
    downstream::append_dead_letter(path, ("bus", bus), position, reason, record_line)
        .with_context(|| format!("writing the dead-letter file {}", path.display()))?;
    metrics.dead_letters.inc();
    totals.dead_lettered += 1;
    Ok(())
}

fn unix_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
