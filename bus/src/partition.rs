//! One partition owned by this worker: its records, read in stream order from where the
//! partition's checkpoint says, become traces the way a local worker builds them (sessions
//! finish when idle), which are published to the traces stream (the trace id as `Nats-Msg-Id`)
//! and written to this worker's output. The checkpoint lives in the progress bucket, so the
//! next owner — after a kill, or a rebalance — resumes exactly here:
//!
//! - `resume_seq`: the stream sequence of the first record of the oldest session still open
//!   (everything before it is in finished sessions' traces);
//! - a mark for each session finished past `resume_seq` (its last sequence, its next trace
//!   index), so a replay skips its records and late records continue its numbering.
//!
//! Each record's subject names its publisher (the bus user the server let publish there). A
//! session belongs to the publisher of its first record read here (stream order, the same for
//! every owner of the partition); a record of that session from any other publisher is dropped
//! and counted (`tokentap_worker_bus_foreign_records_dropped_total`), so one agent host's
//! credential cannot write into another's sessions. The owner is kept in the finished marks,
//! so a session's late records are held to it too.
//!
//! The checkpoint is written with the revision it was read at: an owner that lost its lease
//! without knowing (paused, partitioned) fails its next checkpoint and stops, instead of
//! overwriting its successor's. Traces it published meanwhile are dropped by the stream as
//! duplicates, and a session whose traces the stream already had is not written again here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::{pull, DeliverPolicy};
use async_nats::jetstream::message::PublishMessage;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokentap_reconstruct::{
    EncodedTraces, FinishedSession, LiveOptions, RecentIds, Reconstructor, TraceSink,
};
use tokentap_schema::CaptureRecord;
use tokio::sync::watch;

use crate::topology::{partition_records, publisher_of, trace_subject, Topology};

/// How often a partition checkpoints (and syncs this worker's output).
const CHECKPOINT_EVERY: Duration = Duration::from_secs(2);
/// Record ids remembered per partition to drop redelivered records.
const RECENT_IDS: usize = 200_000;
/// Finished sessions a checkpoint remembers beyond those it needs to skip a replay: a session
/// that gets records again after it was finished continues its trace numbering (a restart
/// from 0 would reuse trace ids the traces stream already has).
const FINISHED_KEPT: usize = 1024;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Checkpoint {
    resume_seq: u64,
    finished: Vec<FinishedMark>,
    owner: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct FinishedMark {
    session_id: String,
    upto: u64,
    next_index: u32,
    /// The publisher the session belongs to (absent in checkpoints of earlier versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    publisher: Option<String>,
}

/// A session finished past the checkpoint's `resume_seq`.
#[derive(Debug, Clone)]
struct Finished {
    /// Its last record's sequence.
    upto: u64,
    next_index: u32,
    publisher: Option<String>,
}

pub fn checkpoint_key(partition: u32) -> String {
    format!("partition.{partition}")
}

/// What a worker counts over all its partitions.
#[derive(Clone)]
pub struct GroupMetrics {
    pub records: prometheus::IntCounter,
    pub duplicates: prometheus::IntCounter,
    pub unreadable: prometheus::IntCounter,
    pub sessions_finished: prometheus::IntCounter,
    pub traces: prometheus::IntCounter,
    pub traces_already_published: prometheus::IntCounter,
    pub violations: prometheus::IntCounter,
    /// Records dropped because their session belongs to another publisher.
    pub foreign_records: prometheus::IntCounter,
    /// Members of the group this worker sees.
    pub members: prometheus::IntGauge,
    /// Partitions this worker holds.
    pub partitions_owned: prometheus::IntGauge,
    /// Partitions taken by this worker (at start, after a member left, on a rebalance).
    pub takeovers: prometheus::IntCounter,
}

impl GroupMetrics {
    /// The group's series, made by `counter` and `gauge` (which register them where the caller
    /// serves them). Under the local worker's names where they mean the same.
    pub fn new(
        counter: impl Fn(&str, &str) -> prometheus::IntCounter,
        gauge: impl Fn(&str, &str) -> prometheus::IntGauge,
    ) -> GroupMetrics {
        GroupMetrics {
            records: counter(
                "tokentap_worker_records_reconstructed_total",
                "Records fed to reconstruction",
            ),
            duplicates: counter(
                "tokentap_worker_duplicates_dropped_total",
                "Records whose id the worker already had",
            ),
            unreadable: counter(
                "tokentap_worker_rejected_lines_total",
                "Messages on the records stream that were not valid records",
            ),
            sessions_finished: counter(
                "tokentap_worker_sessions_finished_total",
                "Sessions whose traces were written",
            ),
            traces: counter("tokentap_worker_traces_emitted_total", "Traces written"),
            traces_already_published: counter(
                "tokentap_worker_bus_traces_already_published_total",
                "Traces a previous owner of their partition had published (not written again)",
            ),
            violations: counter(
                "tokentap_worker_faithfulness_violations_total",
                "Faithfulness violations found in written traces (should stay 0)",
            ),
            foreign_records: counter(
                "tokentap_worker_bus_foreign_records_dropped_total",
                "Records dropped because their session belongs to another publisher (the bus user that published its first record)",
            ),
            members: gauge(
                "tokentap_worker_bus_members",
                "Workers in the group, as this one sees it",
            ),
            partitions_owned: gauge(
                "tokentap_worker_bus_partitions_owned",
                "Record partitions this worker holds",
            ),
            takeovers: counter(
                "tokentap_worker_bus_partitions_taken_total",
                "Partitions taken by this worker (at start, from a member that left, on a rebalance)",
            ),
        }
    }
}

/// This worker's trace output, shared by its partitions.
pub type LocalOutput = Arc<Mutex<TraceSink>>;

#[derive(Debug, thiserror::Error)]
pub enum PartitionError {
    #[error("partition {0}: another worker checkpointed it (this worker lost its lease)")]
    Fenced(u32),
    #[error("partition {partition}: {source}")]
    Bus {
        partition: u32,
        source: anyhow::Error,
    },
}

/// What all of a worker's partitions share.
#[derive(Clone)]
pub struct WorkerContext {
    pub topology: Topology,
    /// This worker's member id (written into its checkpoints).
    pub member: String,
    pub options: LiveOptions,
    pub out: LocalOutput,
    pub metrics: GroupMetrics,
}

/// Runs partition `partition` until `stop` turns true (then checkpoints and returns).
pub async fn run_partition(
    worker: WorkerContext,
    partition: u32,
    mut stop: watch::Receiver<bool>,
) -> Result<(), PartitionError> {
    let bus = |e: anyhow::Error| PartitionError::Bus {
        partition,
        source: e,
    };
    let mut p = Partition::open(worker, partition).await.map_err(bus)?;
    let consumer =
        p.w.topology
            .records
            .create_consumer(pull::OrderedConfig {
                filter_subject: partition_records(partition),
                deliver_policy: if p.resume_seq > 1 {
                    DeliverPolicy::ByStartSequence {
                        start_sequence: p.resume_seq,
                    }
                } else {
                    DeliverPolicy::All
                },
                ..Default::default()
            })
            .await
            .map_err(|e| bus(e.into()))?;
    let mut messages = consumer.messages().await.map_err(|e| bus(e.into()))?;
    tracing::info!(partition, from = p.resume_seq, "partition taken");
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut last_checkpoint = Instant::now();
    loop {
        tokio::select! {
            _ = stop.changed() => {
                if *stop.borrow() {
                    p.checkpoint().await?;
                    tracing::info!(partition, "partition released");
                    return Ok(());
                }
            }
            m = messages.next() => match m {
                Some(Ok(message)) => {
                    let info = message.info().map_err(|e| bus(anyhow::anyhow!(e)))?;
                    let (seq, pending) = (info.stream_sequence, info.pending);
                    p.push(seq, &message.subject, &message.payload);
                    p.caught_up = pending == 0;
                }
                Some(Err(e)) => {
                    tracing::warn!(partition, error = %e, "reading the partition (the consumer recovers by itself)");
                    p.caught_up = false;
                }
                None => return Err(bus(anyhow::anyhow!("the partition's consumer ended"))),
            },
            _ = tick.tick() => {
                p.finish_idle().await?;
                if last_checkpoint.elapsed() >= CHECKPOINT_EVERY {
                    p.checkpoint().await?;
                    last_checkpoint = Instant::now();
                }
            }
        }
    }
}

struct Partition {
    w: WorkerContext,
    partition: u32,
    recon: Reconstructor,
    recent: RecentIds,
    /// Open sessions' first record's sequence.
    first_seq: HashMap<String, u64>,
    /// Sessions finished past `resume_seq`.
    finished: HashMap<String, Finished>,
    /// Open sessions' publisher (that of their first record).
    owners: HashMap<String, String>,
    resume_seq: u64,
    last_seq: u64,
    newest_record_ms: u64,
    caught_up: bool,
    revision: Option<u64>,
}

impl Partition {
    async fn open(w: WorkerContext, partition: u32) -> anyhow::Result<Partition> {
        let entry = w.topology.progress.entry(checkpoint_key(partition)).await?;
        let (checkpoint, revision) = match entry {
            Some(e) if e.operation == async_nats::jetstream::kv::Operation::Put => (
                serde_json::from_slice::<Checkpoint>(&e.value)?,
                Some(e.revision),
            ),
            _ => (Checkpoint::default(), None),
        };
        let mut recon = Reconstructor::new(w.options.strategy);
        let mut finished = HashMap::new();
        for m in checkpoint.finished {
            recon.continue_session(&m.session_id, m.next_index);
            finished.insert(
                m.session_id,
                Finished {
                    upto: m.upto,
                    next_index: m.next_index,
                    publisher: m.publisher,
                },
            );
        }
        Ok(Partition {
            w,
            partition,
            recon,
            recent: RecentIds::with_window(RECENT_IDS),
            first_seq: HashMap::new(),
            finished,
            owners: HashMap::new(),
            resume_seq: checkpoint.resume_seq,
            last_seq: checkpoint.resume_seq.saturating_sub(1),
            newest_record_ms: 0,
            caught_up: false,
            revision,
        })
    }

    fn push(&mut self, seq: u64, subject: &str, payload: &[u8]) {
        self.last_seq = self.last_seq.max(seq);
        let Some(publisher) = publisher_of(subject) else {
            self.w.metrics.unreadable.inc();
            tracing::warn!(
                partition = self.partition,
                seq,
                subject,
                "a message on the records stream names no publisher; skipped"
            );
            return;
        };
        let record: CaptureRecord = match serde_json::from_slice(payload) {
            Ok(r) => r,
            Err(e) => {
                self.w.metrics.unreadable.inc();
                tracing::warn!(partition = self.partition, seq, error = %e, "a message on the records stream is not a record; skipped");
                return;
            }
        };
        // Already in a finished session's traces (a replay after a takeover).
        let finished = self.finished.get(&record.session_id);
        if finished.is_some_and(|f| seq <= f.upto) {
            return;
        }
        let owner = self
            .owners
            .get(&record.session_id)
            .or(finished.and_then(|f| f.publisher.as_ref()));
        if let Some(owner) = owner.filter(|o| *o != publisher) {
            self.w.metrics.foreign_records.inc();
            let dropped = self.w.metrics.foreign_records.get();
            // Said for the first ones, then now and then: the publisher decides how many.
            if dropped <= 16 || dropped.is_power_of_two() {
                tracing::warn!(
                    partition = self.partition, seq, session = %record.session_id,
                    record = %record.record_id, publisher, owner = %owner, dropped,
                    "a record for a session another publisher owns: dropped (a forged record, or one session shared between bus users)"
                );
            }
            return;
        }
        if !self.recent.insert(record.record_id.clone()) {
            self.w.metrics.duplicates.inc();
            return;
        }
        self.w.metrics.records.inc();
        self.newest_record_ms = self.newest_record_ms.max(record.ended_at_unix_ms);
        self.first_seq
            .entry(record.session_id.clone())
            .or_insert(seq);
        self.owners
            .entry(record.session_id.clone())
            .or_insert_with(|| publisher.to_owned());
        self.recon.push(&record);
    }

    /// Finishes sessions gone idle: by the clock once caught up, by record time while a
    /// backlog is replayed (a session is not cut because its later records are unread).
    async fn finish_idle(&mut self) -> Result<(), PartitionError> {
        let now = if self.caught_up {
            unix_ms_now()
        } else {
            self.newest_record_ms
        };
        let idle = self.w.options.session_idle.as_millis() as u64;
        let done = self.recon.finish_idle(now.saturating_sub(idle));
        for s in done {
            self.emit(s).await?;
        }
        Ok(())
    }

    async fn emit(&mut self, s: FinishedSession) -> Result<(), PartitionError> {
        let session = s.report.session_id.clone();
        let next_index = s.traces.iter().map(|t| t.index + 1).max().unwrap_or(0);
        let traces = EncodedTraces::new(s.traces).map_err(|e| self.bus(e.into()))?;
        let mut acks = Vec::with_capacity(traces.len());
        for (t, json) in traces.iter() {
            let message = PublishMessage::build()
                .payload(json.to_vec().into())
                .message_id(&t.trace_id);
            let ack = self
                .w
                .topology
                .js
                .send_publish(trace_subject(self.partition), message)
                .await
                .map_err(|e| self.bus(e.into()))?;
            acks.push(ack);
        }
        let mut duplicates = 0;
        for ack in acks {
            let a = ack.await.map_err(|e| self.bus(e.into()))?;
            duplicates += usize::from(a.duplicate);
        }
        let count = traces.len() as u64;
        // Every trace already on the stream: a previous owner finished this session and wrote
        // it before it could checkpoint. Written once is enough.
        if count > 0 && duplicates == traces.len() {
            self.w.metrics.traces_already_published.inc_by(count);
        } else {
            self.w.metrics.sessions_finished.inc();
            self.w.metrics.traces.inc_by(count);
            self.w
                .metrics
                .violations
                .inc_by(s.report.faithfulness.violations);
            self.w
                .out
                .lock()
                .unwrap()
                .write_session(traces, &s.report)
                .map_err(|e| self.bus(e.into()))?;
        }
        self.first_seq.remove(&session);
        let publisher = self.owners.remove(&session);
        self.finished.insert(
            session,
            Finished {
                upto: self.last_seq,
                next_index,
                publisher,
            },
        );
        Ok(())
    }

    /// Syncs this worker's output (with a Parquet part when one is due), then records where the
    /// next owner resumes.
    async fn checkpoint(&mut self) -> Result<(), PartitionError> {
        {
            // The Parquet part, when due, is written by whichever partition checkpoints first:
            // pending rows are held in memory until then.
            let mut out = self.w.out.lock().unwrap();
            let (rows, max_age) = (self.w.options.part_rows, self.w.options.part_max_age);
            let synced = out.sync_jsonl().and_then(|_| {
                if out.part_due(rows, max_age) {
                    out.write_part()
                } else {
                    Ok(())
                }
            });
            synced.map_err(|e| self.bus(e.into()))?;
        }
        let resume_seq = self
            .first_seq
            .values()
            .min()
            .copied()
            .unwrap_or(self.last_seq + 1);
        if self.finished.len() > FINISHED_KEPT {
            let mut uptos: Vec<u64> = self.finished.values().map(|f| f.upto).collect();
            uptos.sort_unstable();
            let oldest_kept = uptos[uptos.len() - FINISHED_KEPT].min(resume_seq);
            self.finished.retain(|_, f| f.upto >= oldest_kept);
        }
        let checkpoint = Checkpoint {
            resume_seq,
            finished: self
                .finished
                .iter()
                .map(|(s, f)| FinishedMark {
                    session_id: s.clone(),
                    upto: f.upto,
                    next_index: f.next_index,
                    publisher: f.publisher.clone(),
                })
                .collect(),
            owner: self.w.member.clone(),
        };
        let bytes = serde_json::to_vec(&checkpoint).map_err(|e| self.bus(e.into()))?;
        let key = checkpoint_key(self.partition);
        let written = match self.revision {
            Some(r) => self
                .w
                .topology
                .progress
                .update(&key, bytes.into(), r)
                .await
                .map_err(|e| e.to_string()),
            None => self
                .w
                .topology
                .progress
                .create(&key, bytes.into())
                .await
                .map_err(|e| e.to_string()),
        };
        match written {
            Ok(revision) => {
                self.revision = Some(revision);
                self.resume_seq = resume_seq;
                Ok(())
            }
            Err(e) => {
                tracing::warn!(partition = self.partition, error = %e, "checkpoint refused");
                Err(PartitionError::Fenced(self.partition))
            }
        }
    }

    fn bus(&self, e: anyhow::Error) -> PartitionError {
        PartitionError::Bus {
            partition: self.partition,
            source: e,
        }
    }
}

fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
