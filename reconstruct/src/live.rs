//! Live reconstruction: follow a spool as it is written, finish sessions once they go idle,
//! write their traces, and checkpoint so that a restart neither loses nor repeats a trace.
//!
//! Used in-process by `tokentap proxy`/`tokentap run` (on the proxy's own spool) and by
//! `tokentap worker` (on the spool it writes received records to).
//!
//! The output directory holds, next to the sink's files:
//! - `checkpoint.json`: where to resume reading the spool (the first record of the oldest
//!   session still open), the sink's consistent lengths ([`SinkMark`]) and the length of
//!   `finished.jsonl`, all written together after the files they describe are synced;
//! - `finished.jsonl`: one line per finished session: the spool position just past its last
//!   record, and the index its next trace would get.
//!
//! On open, files are cut back to the checkpoint, and records at or before a finished
//! session's position are skipped while the spool is replayed from `resume_from`.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokentap_schema::{CaptureRecord, Strategy};
use tokentap_spool::{owner_only, Handoff, SpoolItem, SpoolPosition, SpoolReader};

use crate::error::Error;
use crate::output::{SinkMark, TraceSink};
use crate::reconstructor::{FinishedSession, Reconstructor};

pub const CHECKPOINT_JSON: &str = "checkpoint.json";
pub const FINISHED_JSONL: &str = "finished.jsonl";

/// How a [`LiveReconstructor`] behaves.
#[derive(Debug, Clone)]
pub struct LiveOptions {
    pub strategy: Strategy,
    /// A session is finished once no record of it has ended for this long.
    pub session_idle: Duration,
    /// How often [`LiveReconstructor::run`] checkpoints.
    pub checkpoint_every: Duration,
    /// A Parquet part is written once this many traces are pending …
    pub part_rows: usize,
    /// … or the oldest pending trace is this old (checked at checkpoints).
    pub part_max_age: Duration,
}

impl Default for LiveOptions {
    fn default() -> Self {
        LiveOptions {
            strategy: Strategy::PrefixMerge,
            session_idle: Duration::from_secs(60),
            checkpoint_every: Duration::from_secs(2),
            part_rows: 10_000,
            part_max_age: Duration::from_secs(60),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct Checkpoint {
    resume_from: SpoolPosition,
    sink: SinkMark,
    finished_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct FinishedMark {
    session_id: String,
    /// Spool position just past the session's last record when it was finished.
    upto: SpoolPosition,
    next_index: u32,
}

/// Running totals, for metrics and logs.
#[derive(Debug, Clone, Copy, Default)]
pub struct LiveStats {
    /// Records reconstructed (replayed records of finished sessions not counted).
    pub records: u64,
    /// Records skipped on replay because their session's traces were already written.
    pub replayed_skipped: u64,
    /// Corrupt spool lines skipped.
    pub unreadable: u64,
    pub sessions_finished: u64,
    pub traces_emitted: u64,
    /// Calls with token data in the finished sessions (request-level traces they would make).
    pub calls_with_tokens: u64,
    pub violations: u64,
    /// `ended_at_unix_ms` of the newest record read.
    pub newest_record_ms: u64,
    pub open_sessions: u64,
}

impl LiveStats {
    /// Request-level traces per emitted trace (the paper's merge ratio).
    pub fn merge_ratio(&self) -> f64 {
        if self.traces_emitted == 0 {
            0.0
        } else {
            self.calls_with_tokens as f64 / self.traces_emitted as f64
        }
    }
}

/// Follows one spool and writes traces to one output directory.
pub struct LiveReconstructor {
    out: PathBuf,
    options: LiveOptions,
    reader: SpoolReader,
    /// Records the spool's writer in this process handed over decoded (`tokentap worker`).
    handoff: Option<Handoff>,
    recon: Reconstructor,
    sink: TraceSink,
    /// Finished sessions: position past their last record; only those past the last
    /// checkpoint's replay point (older ones can never be replayed).
    finished: HashMap<String, SpoolPosition>,
    finished_log: File,
    finished_bytes: u64,
    /// Open sessions: position of their first record (the replay point if we crash).
    first_position: HashMap<String, SpoolPosition>,
    last_checkpoint: Instant,
    stats: LiveStats,
}

impl LiveReconstructor {
    /// Opens `out` (creating it) and resumes from its checkpoint, if any.
    pub fn open(spool: &Path, out: &Path, options: LiveOptions) -> Result<Self, Error> {
        owner_only::create_dir_all(out)?;
        let checkpoint: Checkpoint = match std::fs::read(out.join(CHECKPOINT_JSON)) {
            Ok(bytes) => serde_json::from_slice(&bytes)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Checkpoint::default(),
            Err(e) => return Err(e.into()),
        };
        let sink = TraceSink::resume(out, &checkpoint.sink)?;
        let finished_log = owner_only::options()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(out.join(FINISHED_JSONL))?;
        finished_log.set_len(checkpoint.finished_bytes)?;
        let mut recon = Reconstructor::new(options.strategy);
        let mut finished = HashMap::new();
        for line in BufReader::new(&finished_log).lines() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            let mark: FinishedMark = serde_json::from_str(&line)?;
            recon.continue_session(&mark.session_id, mark.next_index);
            // Only a session whose records can be replayed needs its skip mark.
            if mark.upto > checkpoint.resume_from {
                finished.insert(mark.session_id, mark.upto);
            }
        }
        drop(finished_log);
        let reader = SpoolReader::open_at(spool, checkpoint.resume_from)?;
        Ok(LiveReconstructor {
            out: out.to_path_buf(),
            options,
            reader,
            handoff: None,
            recon,
            sink,
            finished,
            finished_log: append_at_end(out.join(FINISHED_JSONL))?,
            finished_bytes: checkpoint.finished_bytes,
            first_position: HashMap::new(),
            last_checkpoint: Instant::now(),
            stats: LiveStats::default(),
        })
    }

    /// Takes records from `handoff` when the spool's writer handed them over for exactly the
    /// line being read, instead of decoding the line again ([`Handoff`]).
    pub fn with_handoff(mut self, handoff: Handoff) -> Self {
        self.handoff = Some(handoff);
        self
    }

    pub fn stats(&self) -> LiveStats {
        LiveStats {
            open_sessions: self.recon.open_sessions() as u64,
            ..self.stats
        }
    }

    pub fn out_dir(&self) -> &Path {
        &self.out
    }

    /// Reads up to `max` new records, then finishes the sessions that have gone idle.
    /// Returns the records read and whether the reader reached the end of the spool.
    pub fn poll(&mut self, max: usize) -> Result<(usize, bool), Error> {
        let mut read = 0;
        let mut caught_up = false;
        while read < max {
            let item = match &self.handoff {
                Some(h) => self.reader.next_available_with(|line| h.take(line))?,
                None => self.reader.next_available()?,
            };
            let Some(item) = item else {
                caught_up = true;
                break;
            };
            read += 1;
            match item {
                SpoolItem::Record(entry) => self.push(entry.position, &entry.record),
                SpoolItem::Corrupt { .. } | SpoolItem::Torn { .. } => self.stats.unreadable += 1,
            }
        }
        // Idle is judged by the clock while live, and by record time while replaying a
        // backlog, so a session is not cut just because its later records are unread.
        let now = if caught_up {
            unix_ms_now()
        } else {
            self.stats.newest_record_ms
        };
        let idle_ms = self.options.session_idle.as_millis() as u64;
        let done = self.recon.finish_idle(now.saturating_sub(idle_ms));
        self.emit(done)?;
        Ok((read, caught_up))
    }

    fn push(&mut self, position: SpoolPosition, r: &CaptureRecord) {
        if self
            .finished
            .get(&r.session_id)
            .is_some_and(|upto| position < *upto)
        {
            self.stats.replayed_skipped += 1;
            return;
        }
        self.stats.records += 1;
        self.stats.newest_record_ms = self.stats.newest_record_ms.max(r.ended_at_unix_ms);
        self.first_position
            .entry(r.session_id.clone())
            .or_insert(position);
        self.recon.push(r);
    }

    /// Finishes every open session now (end of a local run, or `--finish-on-exit`).
    pub fn finish_all(&mut self) -> Result<(), Error> {
        let done = self.recon.finish_all();
        self.emit(done)
    }

    /// Finishes one session now, if open (a rollout that knows its episode ended).
    pub fn finish_session(&mut self, session_id: &str) -> Result<bool, Error> {
        let done: Vec<FinishedSession> = self.recon.finish(session_id).into_iter().collect();
        let any = !done.is_empty();
        self.emit(done)?;
        Ok(any)
    }

    fn emit(&mut self, done: Vec<FinishedSession>) -> Result<(), Error> {
        if done.is_empty() {
            return Ok(());
        }
        let upto = self.reader.position();
        for s in done {
            let id = s.report.session_id.clone();
            self.stats.sessions_finished += 1;
            self.stats.traces_emitted += s.traces.len() as u64;
            self.stats.calls_with_tokens +=
                u64::from(s.report.stats.calls - s.report.stats.calls_without_tokens);
            self.stats.violations += s.report.faithfulness.violations;
            let next_index = s.traces.iter().map(|t| t.index + 1).max().unwrap_or(0);
            self.sink
                .write_session(crate::EncodedTraces::new(s.traces)?, &s.report)?;
            let mut line = serde_json::to_vec(&FinishedMark {
                session_id: id.clone(),
                upto,
                next_index,
            })?;
            line.push(b'\n');
            self.finished_log.write_all(&line)?;
            self.finished_bytes += line.len() as u64;
            self.first_position.remove(&id);
            self.finished.insert(id, upto);
        }
        Ok(())
    }

    /// Makes everything emitted so far durable and records where to resume. With
    /// `final_part`, pending traces go to a Parquet part whatever their number.
    pub fn checkpoint(&mut self, final_part: bool) -> Result<(), Error> {
        let part_due = self
            .sink
            .part_due(self.options.part_rows, self.options.part_max_age);
        let mark = self.sink.sync_jsonl()?;
        let mark = if (final_part || part_due) && self.sink.pending() > 0 {
            self.sink.write_part()?;
            self.sink.sync_jsonl()?
        } else {
            mark
        };
        self.finished_log.sync_data()?;
        let resume_from = self
            .first_position
            .values()
            .min()
            .copied()
            .unwrap_or_else(|| self.reader.position());
        // Replay after a crash starts at `resume_from`: marks of sessions that ended before it
        // can never be needed again (this keeps the map as small as the open window).
        self.finished.retain(|_, upto| *upto > resume_from);
        let checkpoint = Checkpoint {
            resume_from,
            sink: mark,
            finished_bytes: self.finished_bytes,
        };
        let tmp = self.out.join(format!("{CHECKPOINT_JSON}.tmp"));
        let mut f = owner_only::options()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(&checkpoint)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, self.out.join(CHECKPOINT_JSON))?;
        File::open(&self.out)?.sync_all()?;
        self.last_checkpoint = Instant::now();
        Ok(())
    }

    /// Follows the spool until `stop` returns true and everything written so far is read,
    /// checkpointing as it goes; then checkpoints once more, writing pending Parquet rows
    /// (open sessions stay open: they resume after a restart).
    pub fn run(
        &mut self,
        mut stop: impl FnMut(&LiveStats) -> bool,
        mut on_progress: impl FnMut(&LiveStats),
    ) -> Result<(), Error> {
        loop {
            let (read, caught_up) = self.poll(4096)?;
            if read > 0 || caught_up {
                on_progress(&self.stats());
            }
            if self.last_checkpoint.elapsed() >= self.options.checkpoint_every {
                self.checkpoint(false)?;
            }
            if caught_up && stop(&self.stats()) {
                return self.checkpoint(true);
            }
            if caught_up {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn append_at_end(path: PathBuf) -> Result<File, Error> {
    Ok(OpenOptions::new().append(true).open(path)?)
}

fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
