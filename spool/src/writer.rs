//! The single writer of a spool: appends records as NDJSON lines, rolls segments, fsyncs per
//! policy, and repairs a torn tail left by a crash.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use tokentap_schema::ndjson::encode_line;
use tokentap_schema::CaptureRecord;

use crate::lock::SpoolLock;
use crate::owner_only;
use crate::recovery::truncate_torn_tail;
use crate::segment::{list_segments, segment_path};
use crate::{FsyncPolicy, SpoolError, SpoolPosition};

/// Default size past which the writer starts a new segment: 64 MiB.
pub const DEFAULT_SEGMENT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// Writer settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolConfig {
    /// A new segment is started when an append would take the current one past this size.
    /// A single record (or batch) larger than this gets a segment of its own.
    pub segment_max_bytes: u64,
    /// When to fsync; see [`FsyncPolicy`].
    pub fsync: FsyncPolicy,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            segment_max_bytes: DEFAULT_SEGMENT_MAX_BYTES,
            fsync: FsyncPolicy::default(),
        }
    }
}

/// Appends capture records to a spool directory. Synchronous (std::fs): run it on a dedicated
/// thread. Exactly one per directory, enforced with a lock on `spool.lock`.
///
/// Each append is a single `write` of complete lines on an unbuffered file, so a crash leaves
/// at most one torn line at the end of the last segment, which [`SpoolWriter::open`] removes.
#[derive(Debug)]
pub struct SpoolWriter {
    dir: PathBuf,
    config: SpoolConfig,
    segment: u64,
    file: File,
    segment_len: u64,
    total_bytes: u64,
    /// `file` has bytes not yet fsynced.
    unsynced: bool,
    last_sync: Instant,
    /// Finished segments not fsynced yet (only under `Never`), so `sync()` can still cover them.
    closed_unsynced: Vec<u64>,
    /// A segment was created without fsyncing the directory (only under `Never`).
    dir_unsynced: bool,
    torn_bytes_dropped: u64,
    poisoned: bool,
    /// Reused encoding buffer: one allocation for the writer's lifetime, not one per record.
    buf: Vec<u8>,
    _lock: SpoolLock,
}

impl SpoolWriter {
    /// Opens (creating if needed) the spool in `dir` for appending, taking the writer lock.
    ///
    /// Resumes the last segment; if it ends in a torn line (a crash mid-append) that line is
    /// truncated away, logged as a warning, and counted in [`Self::torn_bytes_dropped`].
    pub fn open(dir: &Path, config: SpoolConfig) -> Result<SpoolWriter, SpoolError> {
        let durable = config.fsync != FsyncPolicy::Never;
        create_dir(dir, durable)?;
        let lock = SpoolLock::acquire(dir)?;
        let seqs = list_segments(dir)?;

        let mut dir_unsynced = false;
        let (segment, file, torn_bytes_dropped) = match seqs.last() {
            Some(&seq) => {
                let path = segment_path(dir, seq);
                let mut file = OpenOptions::new()
                    .read(true)
                    .append(true)
                    .open(&path)
                    .map_err(SpoolError::io("open segment", &path))?;
                let dropped = truncate_torn_tail(&mut file, &path, durable)?;
                (seq, file, dropped)
            }
            None => (0, create_segment(dir, 0, durable, &mut dir_unsynced)?, 0),
        };

        let path = segment_path(dir, segment);
        let segment_len = file
            .metadata()
            .map_err(SpoolError::io("stat segment", &path))?
            .len();
        let mut total_bytes = segment_len;
        for &seq in seqs.iter().filter(|&&s| s != segment) {
            let path = segment_path(dir, seq);
            match fs::metadata(&path) {
                Ok(m) => total_bytes += m.len(),
                // Deleted since the listing (e.g. by a shipper that is done with it).
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(SpoolError::io("stat segment", path)(e)),
            }
        }

        Ok(SpoolWriter {
            dir: dir.to_owned(),
            config,
            segment,
            file,
            segment_len,
            total_bytes,
            unsynced: false,
            last_sync: Instant::now(),
            closed_unsynced: Vec::new(),
            dir_unsynced,
            torn_bytes_dropped,
            poisoned: false,
            buf: Vec::new(),
            _lock: lock,
        })
    }

    /// Appends one record as one line; returns the bytes written (including the newline).
    /// With [`FsyncPolicy::Always`] the record is on disk when this returns.
    pub fn append(&mut self, record: &CaptureRecord) -> Result<u64, SpoolError> {
        self.append_batch(std::slice::from_ref(record))
    }

    /// Appends several records with a single `write` and at most one fsync (group commit).
    /// All lines go to the same segment. Returns the bytes written.
    pub fn append_batch(&mut self, records: &[CaptureRecord]) -> Result<u64, SpoolError> {
        if self.poisoned {
            return Err(SpoolError::Poisoned {
                dir: self.dir.clone(),
            });
        }
        // Encode everything first: a record that fails to serialize writes nothing.
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        for record in records {
            if let Err(source) = encode_line(record, &mut buf) {
                self.buf = buf;
                return Err(SpoolError::Serialize {
                    dir: self.dir.clone(),
                    record_id: record.record_id.clone(),
                    source,
                });
            }
        }
        let result = self.write_lines(&buf);
        self.buf = buf;
        result
    }

    fn write_lines(&mut self, lines: &[u8]) -> Result<u64, SpoolError> {
        let len = lines.len() as u64;
        if len == 0 {
            return Ok(0);
        }
        if self.segment_len > 0 && self.segment_len + len > self.config.segment_max_bytes {
            self.roll()?;
        }
        if let Err(e) = self.file.write_all(lines) {
            // Part of the batch may have landed; cut it so the next append starts on a line
            // boundary. If even that fails, refuse further appends rather than corrupt them.
            if self.file.set_len(self.segment_len).is_err() {
                self.poisoned = true;
            }
            return Err(SpoolError::io("write segment", self.segment_path())(e));
        }
        self.segment_len += len;
        self.total_bytes += len;
        self.unsynced = true;
        match self.config.fsync {
            FsyncPolicy::Always => self.sync_current()?,
            FsyncPolicy::Interval(_) => {
                self.sync_if_due()?;
            }
            FsyncPolicy::Never => {}
        }
        Ok(len)
    }

    /// Closes the current segment and starts the next one.
    fn roll(&mut self) -> Result<(), SpoolError> {
        let durable = self.config.fsync != FsyncPolicy::Never;
        if self.unsynced {
            // Under Always/Interval a finished segment is complete on disk before its successor
            // exists, so readers and recovery only ever see a torn line in the last segment.
            if durable {
                self.sync_current()?;
            } else {
                self.closed_unsynced.push(self.segment);
            }
        }
        let next = self.segment + 1;
        self.file = create_segment(&self.dir, next, durable, &mut self.dir_unsynced)?;
        self.segment = next;
        self.segment_len = 0;
        self.unsynced = false;
        Ok(())
    }

    /// Makes everything appended so far durable (all segments and the directory entries),
    /// whatever the policy. Call it on shutdown; drop does it too except under `Never`.
    pub fn sync(&mut self) -> Result<(), SpoolError> {
        while let Some(&seq) = self.closed_unsynced.first() {
            let path = segment_path(&self.dir, seq);
            match File::open(&path).and_then(|f| f.sync_data()) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(SpoolError::io("fsync", path)(e)),
            }
            self.closed_unsynced.remove(0);
        }
        if self.unsynced {
            self.sync_current()?;
        }
        if self.dir_unsynced {
            sync_dir(&self.dir)?;
            self.dir_unsynced = false;
        }
        Ok(())
    }

    /// Under [`FsyncPolicy::Interval`], fsyncs if there are unsynced bytes and the interval
    /// since the last fsync has passed; returns whether it did. Call this when idle (e.g. on a
    /// channel receive timeout of [`Self::sync_deadline`]) so the last records before a lull
    /// do not stay unsynced until the next append.
    pub fn sync_if_due(&mut self) -> Result<bool, SpoolError> {
        match self.sync_deadline() {
            Some(deadline) if Instant::now() >= deadline => {
                self.sync_current()?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// When [`Self::sync_if_due`] will next have work: `Some` only under `Interval` with
    /// unsynced bytes.
    pub fn sync_deadline(&self) -> Option<Instant> {
        match self.config.fsync {
            FsyncPolicy::Interval(d) if self.unsynced => {
                Some(self.last_sync.checked_add(d).unwrap_or_else(Instant::now))
            }
            _ => None,
        }
    }

    fn sync_current(&mut self) -> Result<(), SpoolError> {
        // fdatasync: the file size is data for this purpose, timestamps are not worth a flush.
        self.file
            .sync_data()
            .map_err(SpoolError::io("fsync", self.segment_path()))?;
        self.unsynced = false;
        self.last_sync = Instant::now();
        Ok(())
    }

    fn segment_path(&self) -> PathBuf {
        segment_path(&self.dir, self.segment)
    }

    /// The spool directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The settings the writer was opened with.
    pub fn config(&self) -> &SpoolConfig {
        &self.config
    }

    /// Bytes in all segments (as found at open plus everything appended since), for a metric.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Where the next byte would go if no roll happens: the current segment and its length.
    pub fn position(&self) -> SpoolPosition {
        SpoolPosition {
            segment: self.segment,
            offset: self.segment_len,
        }
    }

    /// Bytes of a torn final line removed by crash recovery in [`Self::open`] (0 if none).
    pub fn torn_bytes_dropped(&self) -> u64 {
        self.torn_bytes_dropped
    }

    /// Whether anything appended is still waiting for an fsync.
    pub fn has_unsynced(&self) -> bool {
        self.unsynced || !self.closed_unsynced.is_empty()
    }
}

impl Drop for SpoolWriter {
    fn drop(&mut self) {
        if self.config.fsync != FsyncPolicy::Never {
            if let Err(e) = self.sync() {
                tracing::warn!(error = %e, "fsync of spool on close failed");
            }
        }
    }
}

/// Creates the spool directory if missing (`0700`, or tightens an existing one of ours); fsyncs its parent so the directory itself survives.
fn create_dir(dir: &Path, durable: bool) -> Result<(), SpoolError> {
    if dir.is_dir() {
        return owner_only::tighten_dir(dir)
            .map_err(SpoolError::io("tighten spool directory", dir));
    }
    owner_only::create_dir_all(dir).map_err(SpoolError::io("create spool directory", dir))?;
    if durable {
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
    }
    Ok(())
}

/// Creates segment `seq` (it must not exist) and makes its directory entry durable, without
/// which a power loss could lose the whole file even after its data was fsynced.
fn create_segment(
    dir: &Path,
    seq: u64,
    durable: bool,
    dir_unsynced: &mut bool,
) -> Result<File, SpoolError> {
    let path = segment_path(dir, seq);
    let file = owner_only::options()
        .read(true)
        .append(true)
        .create_new(true)
        .open(&path)
        .map_err(SpoolError::io("create segment", &path))?;
    if durable {
        sync_dir(dir)?;
    } else {
        *dir_unsynced = true;
    }
    Ok(file)
}

fn sync_dir(dir: &Path) -> Result<(), SpoolError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(SpoolError::io("fsync directory", dir))
}
