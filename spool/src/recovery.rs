//! Crash recovery for the segment a writer resumes: cut a torn final line.
//!
//! A writer that dies mid-`write` (or a power loss before writeback) can leave bytes after the
//! last `\n`. Appending after them would glue the next record onto garbage and lose it too, so
//! the writer truncates back to the last newline before appending.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use crate::SpoolError;

/// Scans backwards in chunks so that a huge segment costs one small read in the common case.
const CHUNK: u64 = 64 * 1024;

/// Offset just past the last `\n` in `file` (0 if there is none), given its length.
pub(crate) fn end_of_last_line(file: &mut File, len: u64, path: &Path) -> Result<u64, SpoolError> {
    let mut buf = vec![0u8; CHUNK as usize];
    let mut end = len;
    while end > 0 {
        let start = end.saturating_sub(CHUNK);
        let chunk = &mut buf[..(end - start) as usize];
        file.seek(SeekFrom::Start(start))
            .and_then(|_| file.read_exact(chunk))
            .map_err(SpoolError::io("read segment", path))?;
        if let Some(i) = chunk.iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}

/// Truncates a torn final line off `file` and returns how many bytes were dropped.
/// `sync` makes the truncation durable before anything is appended after it.
pub(crate) fn truncate_torn_tail(
    file: &mut File,
    path: &Path,
    sync: bool,
) -> Result<u64, SpoolError> {
    let len = file
        .metadata()
        .map_err(SpoolError::io("stat segment", path))?
        .len();
    let keep = end_of_last_line(file, len, path)?;
    if keep == len {
        return Ok(0);
    }
    file.set_len(keep)
        .map_err(SpoolError::io("truncate torn tail of", path))?;
    if sync {
        file.sync_all().map_err(SpoolError::io("fsync", path))?;
    }
    let dropped = len - keep;
    tracing::warn!(
        segment = %path.display(),
        dropped_bytes = dropped,
        "spool segment ended with a torn (unterminated) line, probably from a crash mid-append; truncated it"
    );
    Ok(dropped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;
    use std::io::Write;

    fn with_contents(contents: &[u8]) -> (tempfile::TempDir, File, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        f.write_all(contents).unwrap();
        (dir, f, path)
    }

    #[test]
    fn finds_the_last_newline_across_chunks() {
        let mut data = b"a\nb\n".to_vec();
        data.extend(std::iter::repeat_n(b'x', 3 * CHUNK as usize + 17));
        let (_d, mut f, path) = with_contents(&data);
        assert_eq!(
            end_of_last_line(&mut f, data.len() as u64, &path).unwrap(),
            4
        );
        assert_eq!(
            truncate_torn_tail(&mut f, &path, false).unwrap(),
            data.len() as u64 - 4
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"a\nb\n");
    }

    #[test]
    fn leaves_complete_and_empty_files_alone() {
        for contents in [&b""[..], b"a\n", b"{}\n{}\n"] {
            let (_d, mut f, path) = with_contents(contents);
            assert_eq!(truncate_torn_tail(&mut f, &path, false).unwrap(), 0);
            assert_eq!(std::fs::read(&path).unwrap(), contents);
        }
    }

    #[test]
    fn a_file_without_any_newline_is_emptied() {
        let (_d, mut f, path) = with_contents(b"{\"half");
        assert_eq!(truncate_torn_tail(&mut f, &path, false).unwrap(), 6);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    }
}
