//! Traces (`traces.jsonl` rows) by session: each file indexed once by line, then only what was
//! appended; a file that was replaced or shrank is indexed again. A trace is parsed in full
//! only when the page asks for it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use tokentap_schema::Trace;

/// Longest `traces.jsonl` line indexed (a trace of a few million tokens); longer ones are
/// counted as unreadable.
const MAX_LINE: u64 = 256 << 20;
/// Deepest a `traces.jsonl` is looked for below `--traces` (OUT/traces.jsonl is depth 1).
const MAX_DEPTH: usize = 4;
/// Most `traces.jsonl` files indexed.
const MAX_FILES: usize = 100_000;

/// A trace as the session page lists it.
#[derive(Debug, Clone, Serialize)]
pub struct TraceSummary {
    pub trace_id: String,
    pub calls: usize,
    pub prompt_tokens: usize,
    pub response_tokens: usize,
    pub trainable_tokens: usize,
    pub reward: Option<f64>,
    pub gaps: usize,
    #[serde(skip)]
    at: LineRef,
}

#[derive(Debug, Clone)]
struct LineRef {
    file: Arc<PathBuf>,
    offset: u64,
    len: u64,
}

/// What an indexed file looked like: the same inode grown means appended lines.
struct FileState {
    inode: (u64, u64),
    indexed: u64,
}

/// Where the traces files are: found below a directory the operator named, or listed by a
/// rollout node's store (whose sample directories also hold agent-written files, which must
/// never be taken for traces).
pub enum TraceFiles {
    Below(PathBuf),
    Listed(Box<dyn Fn() -> Vec<PathBuf> + Send + Sync>),
}

impl TraceFiles {
    fn list(&self) -> Vec<PathBuf> {
        match self {
            TraceFiles::Below(dir) => {
                let mut found = Vec::new();
                walk(dir, 0, &mut found);
                found
            }
            TraceFiles::Listed(f) => f(),
        }
    }
}

/// Files named `traces.jsonl` below `dir`, symbolic links not followed.
fn walk(dir: &Path, depth: usize, found: &mut Vec<PathBuf>) {
    if depth > MAX_DEPTH || found.len() >= MAX_FILES {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let Ok(kind) = e.file_type() else { continue };
        if kind.is_dir() {
            walk(&e.path(), depth + 1, found);
        } else if kind.is_file() && e.file_name() == tokentap_reconstruct::output::TRACES_JSONL {
            found.push(e.path());
        }
    }
}

pub struct TraceIndex {
    files: TraceFiles,
    state: HashMap<PathBuf, FileState>,
    by_session: HashMap<String, Vec<TraceSummary>>,
    by_id: HashMap<String, (String, usize)>,
    /// Lines that could not be read as traces.
    pub unreadable_lines: u64,
}

impl TraceIndex {
    pub fn new(files: TraceFiles) -> TraceIndex {
        TraceIndex {
            files,
            state: HashMap::new(),
            by_session: HashMap::new(),
            by_id: HashMap::new(),
            unreadable_lines: 0,
        }
    }

    pub fn refresh(&mut self) {
        for path in self.files.list() {
            if let Err(e) = self.index_file(&path) {
                tracing::debug!(file = %path.display(), error = %e, "traces file not indexed");
            }
        }
    }

    fn index_file(&mut self, path: &Path) -> std::io::Result<()> {
        let mut file = open_no_follow(path)?;
        let meta = file.metadata()?;
        if !meta.is_file() {
            return Ok(());
        }
        let inode = (meta.dev(), meta.ino());
        let from = match self.state.get(path) {
            Some(s) if s.inode == inode && meta.len() == s.indexed => return Ok(()),
            Some(s) if s.inode == inode && meta.len() > s.indexed => s.indexed,
            Some(_) => {
                self.forget_file(path);
                0
            }
            None => 0,
        };
        file.seek(SeekFrom::Start(from))?;
        let shared = Arc::new(path.to_owned());
        let mut reader = BufReader::new(file.take(meta.len() - from));
        let mut offset = from;
        let mut line = Vec::new();
        loop {
            line.clear();
            let n = (&mut reader)
                .take(MAX_LINE + 1)
                .read_until(b'\n', &mut line)? as u64;
            if n == 0 || line.last() != Some(&b'\n') {
                if n > MAX_LINE {
                    // Skip the rest of an over-long line.
                    self.unreadable_lines += 1;
                    let mut rest = Vec::new();
                    let more = reader.read_until(b'\n', &mut rest)? as u64;
                    if rest.last() == Some(&b'\n') {
                        offset += n + more;
                        continue;
                    }
                }
                break; // an unfinished last line: indexed once it is complete
            }
            match serde_json::from_slice::<Trace>(&line) {
                Ok(t) => self.add(
                    t,
                    LineRef {
                        file: shared.clone(),
                        offset,
                        len: n,
                    },
                ),
                Err(_) => self.unreadable_lines += 1,
            }
            offset += n;
        }
        self.state.insert(
            path.to_owned(),
            FileState {
                inode,
                indexed: offset,
            },
        );
        Ok(())
    }

    fn add(&mut self, t: Trace, at: LineRef) {
        // A trace id seen again (a file rewritten under a new name, a re-run) shows its latest.
        if let Some((session, i)) = self.by_id.get(&t.trace_id) {
            self.by_session.get_mut(session).expect("indexed")[*i].at = at;
            return;
        }
        let summary = TraceSummary {
            trace_id: t.trace_id.clone(),
            calls: t.calls.len(),
            prompt_tokens: t.prompt_ids.len(),
            response_tokens: t.response_ids.len(),
            trainable_tokens: t.trainable_tokens(),
            reward: t.reward,
            gaps: t.gaps.len(),
            at,
        };
        let list = self.by_session.entry(t.session_id.clone()).or_default();
        self.by_id.insert(t.trace_id, (t.session_id, list.len()));
        list.push(summary);
    }

    fn forget_file(&mut self, path: &Path) {
        for list in self.by_session.values_mut() {
            list.retain(|t| t.at.file.as_path() != path);
        }
        self.by_session.retain(|_, l| !l.is_empty());
        self.by_id.clear();
        for (session, list) in &self.by_session {
            for (i, t) in list.iter().enumerate() {
                self.by_id.insert(t.trace_id.clone(), (session.clone(), i));
            }
        }
        self.state.remove(path);
    }

    pub fn count(&self, session: &str) -> usize {
        self.by_session.get(session).map_or(0, Vec::len)
    }

    pub fn of_session(&self, session: &str) -> &[TraceSummary] {
        self.by_session.get(session).map_or(&[], Vec::as_slice)
    }

    /// Sessions that have traces (some may have no calls in the spool: shipped elsewhere).
    pub fn sessions(&self) -> impl Iterator<Item = &str> {
        self.by_session.keys().map(String::as_str)
    }

    /// Where trace `id` is, to be read with [`read_trace`] outside any lock.
    pub fn locate(&self, id: &str) -> Option<(Arc<PathBuf>, u64, u64)> {
        let (session, i) = self.by_id.get(id)?;
        let at = &self.by_session[session][*i].at;
        Some((at.file.clone(), at.offset, at.len))
    }
}

/// Reads the trace at `offset..offset+len` of `file`; `None` if it is no longer there.
pub fn read_trace(file: &Path, offset: u64, len: u64, id: &str) -> std::io::Result<Option<Trace>> {
    let mut f = open_no_follow(file)?;
    f.seek(SeekFrom::Start(offset))?;
    let mut line = vec![0u8; len as usize];
    f.read_exact(&mut line)?;
    Ok(serde_json::from_slice::<Trace>(&line)
        .ok()
        .filter(|t| t.trace_id == id))
}

fn open_no_follow(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
}
