//! The node's own files in a sample's directory (logs, traces, the reward it reads back),
//! opened so that a link task code planted under the name is never followed: a file is
//! removed and created afresh (`O_EXCL | O_NOFOLLOW`, mode 0600), and read with `O_NOFOLLOW`
//! and a size limit.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Creates `path` afresh for writing: whatever was there (a file, a link) is removed first,
/// and the create fails rather than follow a link raced into its place.
pub fn create_fresh(path: &Path) -> io::Result<File> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err(io::Error::other(format!(
                "{} is a directory, not the node's file",
                path.display()
            )))
        }
        Ok(_) => std::fs::remove_file(path)?,
        Err(_) => {}
    }
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("creating {}: {e}", path.display())))
}

/// Writes `bytes` to a fresh `path` (see [`create_fresh`]).
pub fn write_fresh(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    create_fresh(path)?.write_all(bytes)
}

/// The text of `path`, at most `limit` bytes of it; None when there is no such file. A link
/// or anything but a regular file is refused.
pub fn read_limited(path: &Path, limit: u64) -> io::Result<Option<String>> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("reading {} (not a plain file?): {e}", path.display()),
            ))
        }
    };
    if !file.metadata()?.is_file() {
        return Err(io::Error::other(format!(
            "{} is not a plain file",
            path.display()
        )));
    }
    let mut text = String::new();
    file.take(limit).read_to_string(&mut text)?;
    Ok(Some(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planted_link_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "node secret").unwrap();
        let log = dir.path().join("eval.log");
        std::os::unix::fs::symlink(&victim, &log).unwrap();
        write_fresh(&log, b"log").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "node secret");
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "log");
        assert!(!std::fs::symlink_metadata(&log)
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[test]
    fn a_linked_or_special_reward_file_is_refused_and_a_big_one_cut() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "0.75").unwrap();
        let reward = dir.path().join("reward");
        std::os::unix::fs::symlink(&secret, &reward).unwrap();
        assert!(read_limited(&reward, 100).is_err());
        std::fs::remove_file(&reward).unwrap();
        assert_eq!(read_limited(&reward, 100).unwrap(), None);
        std::fs::write(&reward, "1".repeat(10_000)).unwrap();
        assert_eq!(read_limited(&reward, 100).unwrap().unwrap().len(), 100);
        std::fs::remove_file(&reward).unwrap();
        let fifo = std::ffi::CString::new(reward.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo on a path in our temp dir.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        assert!(
            read_limited(&reward, 100).is_err(),
            "a fifo would block the node"
        );
    }
}
