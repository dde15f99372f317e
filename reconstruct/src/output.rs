//! Writing traces: `traces.jsonl` and `sessions.jsonl` (appended as sessions finish) and
//! `parquet/part-NNNNN.parquet` (one file per flush, zstd), in an output directory.
//!
//! Files are `0600` in `0700` directories: traces hold whole conversations.
//!
//! pandas: `pd.read_json("OUT/traces.jsonl", lines=True)` or `pd.read_parquet("OUT/parquet")`;
//! Hugging Face: `load_dataset("parquet", data_files="OUT/parquet/*.parquet")`.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_schema::FieldRef;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};
use serde_arrow::schema::{SchemaLike, TracingOptions};
use tokentap_schema::{SessionReport, Trace};
use tokentap_spool::owner_only;

use crate::error::Error;

pub const TRACES_JSONL: &str = "traces.jsonl";
pub const SESSIONS_JSONL: &str = "sessions.jsonl";
pub const PARQUET_DIR: &str = "parquet";

/// A finished session's traces, each serialized once: the line `traces.jsonl` gets is the same
/// JSON a worker publishes on the bus (`tokentap_bus::partition`), so a trace is encoded once
/// whichever way it leaves.
pub struct EncodedTraces {
    traces: Vec<Trace>,
    lines: Vec<Vec<u8>>,
}

impl EncodedTraces {
    pub fn new(traces: Vec<Trace>) -> serde_json::Result<EncodedTraces> {
        let lines = traces
            .iter()
            .map(serde_json::to_vec)
            .collect::<serde_json::Result<_>>()?;
        Ok(EncodedTraces { traces, lines })
    }

    /// Each trace with its JSON (no newline).
    pub fn iter(&self) -> impl Iterator<Item = (&Trace, &[u8])> {
        self.traces.iter().zip(self.lines.iter().map(Vec::as_slice))
    }

    pub fn len(&self) -> usize {
        self.traces.len()
    }

    pub fn is_empty(&self) -> bool {
        self.traces.is_empty()
    }
}

/// Appends traces and session reports to an output directory.
pub struct TraceSink {
    dir: PathBuf,
    traces: BufWriter<File>,
    sessions: BufWriter<File>,
    /// Bytes in `traces.jsonl` / `sessions.jsonl`, including what is still buffered.
    traces_bytes: u64,
    sessions_bytes: u64,
    /// Traces not yet in a Parquet part.
    pending: Vec<Trace>,
    /// When the oldest of them was written (or reloaded).
    oldest_pending: Option<Instant>,
    /// `traces.jsonl` bytes whose traces are all in Parquet parts.
    parquet_covers: u64,
    fields: Vec<FieldRef>,
    next_part: u32,
}

/// A consistent state of an output directory, saved in a checkpoint: after a crash,
/// [`TraceSink::resume`] cuts the files back to it, so nothing is emitted twice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SinkMark {
    pub traces_bytes: u64,
    pub sessions_bytes: u64,
    /// Parquet parts `part-00000` .. `part-{parts-1}`.
    pub parts: u32,
    /// `traces.jsonl` bytes whose traces are in those parts; the rest are re-read on resume.
    pub parquet_covers: u64,
}

impl TraceSink {
    /// Opens (creating) `dir`; existing files are appended to and new Parquet parts numbered
    /// after the existing ones, so a restarted worker adds to its earlier output.
    pub fn open(dir: &Path) -> Result<TraceSink, Error> {
        owner_only::create_dir_all(dir)?;
        owner_only::create_dir_all(&dir.join(PARQUET_DIR))?;
        let append = |name: &str| -> Result<BufWriter<File>, Error> {
            let f = owner_only::options()
                .create(true)
                .append(true)
                .open(dir.join(name))?;
            Ok(BufWriter::new(f))
        };
        let next_part = std::fs::read_dir(dir.join(PARQUET_DIR))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_prefix("part-")?
                    .strip_suffix(".parquet")?
                    .parse::<u32>()
                    .ok()
            })
            .map(|n| n + 1)
            .max()
            .unwrap_or(0);
        let len = |name: &str| std::fs::metadata(dir.join(name)).map_or(0, |m| m.len());
        let traces_bytes = len(TRACES_JSONL);
        Ok(TraceSink {
            dir: dir.to_path_buf(),
            traces: append(TRACES_JSONL)?,
            sessions: append(SESSIONS_JSONL)?,
            traces_bytes,
            sessions_bytes: len(SESSIONS_JSONL),
            pending: Vec::new(),
            oldest_pending: None,
            parquet_covers: traces_bytes,
            fields: trace_fields()?,
            next_part,
        })
    }

    /// Reopens `dir` at `mark`: JSONL files cut back to the mark's lengths, Parquet parts past
    /// it removed, and the traces after `parquet_covers` reloaded as pending Parquet rows.
    pub fn resume(dir: &Path, mark: &SinkMark) -> Result<TraceSink, Error> {
        owner_only::create_dir_all(dir)?;
        owner_only::create_dir_all(&dir.join(PARQUET_DIR))?;
        for (name, len) in [
            (TRACES_JSONL, mark.traces_bytes),
            (SESSIONS_JSONL, mark.sessions_bytes),
        ] {
            let f = owner_only::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(dir.join(name))?;
            if f.metadata()?.len() > len {
                f.set_len(len)?;
                f.sync_all()?;
            }
        }
        for e in std::fs::read_dir(dir.join(PARQUET_DIR))?.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().into_owned();
            let part = name
                .strip_prefix("part-")
                .and_then(|n| n.split('.').next())
                .and_then(|n| n.parse::<u32>().ok());
            if part.is_some_and(|n| n >= mark.parts) || name.ends_with(".tmp") {
                std::fs::remove_file(e.path())?;
            }
        }
        let mut sink = TraceSink::open(dir)?;
        sink.next_part = mark.parts;
        sink.parquet_covers = mark.parquet_covers;
        let mut f = File::open(dir.join(TRACES_JSONL))?;
        f.seek(SeekFrom::Start(mark.parquet_covers))?;
        let mut rest = String::new();
        f.read_to_string(&mut rest)?;
        for line in rest.lines().filter(|l| !l.trim().is_empty()) {
            sink.pending.push(serde_json::from_str(line)?);
        }
        sink.oldest_pending = (!sink.pending.is_empty()).then(Instant::now);
        Ok(sink)
    }

    /// Writes one finished session: its traces and its report.
    pub fn write_session(
        &mut self,
        traces: EncodedTraces,
        report: &SessionReport,
    ) -> Result<(), Error> {
        for line in &traces.lines {
            self.traces.write_all(line)?;
            self.traces.write_all(b"\n")?;
            self.traces_bytes += line.len() as u64 + 1;
        }
        let mut line = serde_json::to_vec(report)?;
        line.push(b'\n');
        self.sessions.write_all(&line)?;
        self.sessions_bytes += line.len() as u64;
        if !traces.traces.is_empty() {
            self.oldest_pending.get_or_insert_with(Instant::now);
        }
        self.pending.extend(traces.traces);
        Ok(())
    }

    /// Traces written since the last Parquet part.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Whether the pending traces make a Parquet part now: `rows` of them, or the oldest
    /// written `max_age` ago.
    pub fn part_due(&self, rows: usize, max_age: Duration) -> bool {
        self.pending.len() >= rows || self.oldest_pending.is_some_and(|t| t.elapsed() >= max_age)
    }

    /// Flushes the JSONL files and writes the pending traces as a new Parquet part.
    pub fn flush(&mut self) -> Result<SinkMark, Error> {
        self.sync_jsonl()?;
        self.write_part()?;
        Ok(self.mark())
    }

    /// Makes the JSONL files durable; returns the state to checkpoint.
    pub fn sync_jsonl(&mut self) -> Result<SinkMark, Error> {
        self.traces.flush()?;
        self.sessions.flush()?;
        self.traces.get_ref().sync_data()?;
        self.sessions.get_ref().sync_data()?;
        Ok(self.mark())
    }

    /// Writes the pending traces (if any) as the next Parquet part.
    pub fn write_part(&mut self) -> Result<(), Error> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let path = self
            .dir
            .join(PARQUET_DIR)
            .join(format!("part-{:05}.parquet", self.next_part));
        write_parquet(&path, &self.fields, &self.pending)?;
        self.next_part += 1;
        self.pending.clear();
        self.oldest_pending = None;
        self.parquet_covers = self.traces_bytes;
        Ok(())
    }

    fn mark(&self) -> SinkMark {
        SinkMark {
            traces_bytes: self.traces_bytes,
            sessions_bytes: self.sessions_bytes,
            parts: self.next_part,
            parquet_covers: self.parquet_covers,
        }
    }
}

/// The Arrow fields of a trace row (enums as strings).
fn trace_fields() -> Result<Vec<FieldRef>, Error> {
    let options = TracingOptions::default().enums_without_data_as_strings(true);
    Ok(Vec::<FieldRef>::from_type::<Trace>(options)?)
}

fn write_parquet(path: &Path, fields: &[FieldRef], traces: &[Trace]) -> Result<(), Error> {
    let batch = serde_arrow::to_record_batch(fields, &traces)?;
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3)?))
        .build();
    // Written under a temporary name and renamed, so readers never see half a file.
    let tmp = path.with_extension("parquet.tmp");
    let mut w = ArrowWriter::try_new(
        owner_only::options()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?,
        Arc::clone(batch.schema_ref()),
        Some(props),
    )?;
    w.write(&batch)?;
    w.close()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Reads traces back from a `traces.jsonl`.
pub fn read_traces_jsonl(path: &Path) -> Result<Vec<Trace>, Error> {
    let text = std::fs::read_to_string(path)?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).map_err(Error::from))
        .collect()
}

/// Reads traces back from a Parquet file written by [`TraceSink`].
pub fn read_traces_parquet(path: &Path) -> Result<Vec<Trace>, Error> {
    let reader =
        parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(File::open(path)?)?
            .build()?;
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch?;
        let rows: Vec<Trace> = serde_arrow::from_record_batch(&batch)?;
        out.extend(rows);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::LongSession;
    use crate::Reconstructor;
    use tokentap_schema::Strategy;

    #[test]
    fn a_part_is_due_by_rows_or_by_the_age_of_the_oldest_pending_trace() {
        let dir = tempfile::tempdir().unwrap();
        let mut sink = TraceSink::open(dir.path()).unwrap();
        let day = Duration::from_secs(86_400);
        assert!(!sink.part_due(1, Duration::ZERO), "nothing pending");
        let shape = LongSession {
            calls: 2,
            first_prompt: 10,
            last_prompt: 20,
            sampled: 2,
            subagent_every: 0,
            subagent_calls: 0,
            subagent_prompt: 0,
        };
        let mut recon = Reconstructor::new(Strategy::PrefixMerge);
        for r in shape.records("s", 1) {
            recon.push(&r);
        }
        for s in recon.finish_all() {
            sink.write_session(EncodedTraces::new(s.traces).unwrap(), &s.report)
                .unwrap();
        }
        let pending = sink.pending();
        assert!(pending > 0);
        assert!(sink.part_due(pending, day), "by rows");
        assert!(!sink.part_due(pending + 1, day));
        assert!(sink.part_due(pending + 1, Duration::ZERO), "by age");
        sink.write_part().unwrap();
        assert!(
            !sink.part_due(1, Duration::ZERO),
            "written: nothing pending"
        );
    }
}
