//! The node's own files in a sample's directory (logs, traces, the reward it reads back) and
//! in trees task code wrote before (a harness config in a HOME that set-up ran in), opened so
//! that a link task code planted under the name is never followed: a file is removed and
//! created afresh (`O_EXCL | O_NOFOLLOW`, mode 0600), and read with `O_NOFOLLOW` and a size
//! limit. In a task-written tree every directory on the way is opened the same way, one fd at
//! a time ([`write_beneath`]), so no link on the path is followed either.

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

/// Writes `bytes` to `rel` under `root`, a directory task code may have written into (a HOME
/// after set-up). Nothing task code planted is followed: each directory of `rel` is opened
/// from its parent's fd with `O_NOFOLLOW` (a link or a file where a directory belongs is
/// removed and the directory made afresh, 0700), and the file is created afresh in the last
/// one (whatever was there removed first; `O_EXCL | O_NOFOLLOW`, 0600), so the node's write
/// lands inside `root` whatever the tree held. A link raced into place between the removal
/// and the create makes the create fail; it is never followed. `root` itself must be the
/// node's (it is opened with `O_NOFOLLOW` too).
pub fn write_beneath(root: &Path, rel: &Path, bytes: &[u8]) -> io::Result<()> {
    use rustix::fs::{openat, Mode, OFlags, CWD};
    use std::io::Write;
    let names = rel
        .components()
        .map(|c| match c {
            std::path::Component::Normal(n) => Ok(n),
            _ => Err(io::Error::other(format!(
                "{} is not a plain relative path",
                rel.display()
            ))),
        })
        .collect::<io::Result<Vec<_>>>()?;
    let Some((file, dirs)) = names.split_last() else {
        return Err(io::Error::other("an empty path"));
    };
    let context = |e: rustix::io::Errno, what: &Path| {
        io::Error::new(
            io::Error::from(e).kind(),
            format!(
                "writing {} under {}: {what:?}: {e}",
                rel.display(),
                root.display()
            ),
        )
    };
    let mut dir = openat(CWD, root, DIR_FLAGS, Mode::empty()).map_err(|e| context(e, root))?;
    for name in dirs {
        dir = open_fresh_dir(&dir, name).map_err(|e| context(e, Path::new(name)))?;
    }
    remove_entry(&dir, file).map_err(|e| context(e, Path::new(file)))?;
    let fd = openat(
        &dir,
        *file,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| context(e, Path::new(file)))?;
    File::from(fd).write_all(bytes)
}

const DIR_FLAGS: rustix::fs::OFlags = rustix::fs::OFlags::DIRECTORY
    .union(rustix::fs::OFlags::NOFOLLOW)
    .union(rustix::fs::OFlags::CLOEXEC)
    .union(rustix::fs::OFlags::RDONLY);

/// The directory `name` in `parent`, opened without following a link; a link, file or other
/// non-directory there is removed and a directory made in its place.
fn open_fresh_dir(
    parent: &std::os::fd::OwnedFd,
    name: &std::ffi::OsStr,
) -> rustix::io::Result<std::os::fd::OwnedFd> {
    use rustix::fs::{mkdirat, openat, unlinkat, AtFlags, Mode};
    use rustix::io::Errno;
    // Three rounds at most: open, or remove what is there / make the directory, open again
    // (a racing task could swap the entry once more; then the error stands).
    let mut last = Errno::NOENT;
    for _ in 0..3 {
        match openat(parent, name, DIR_FLAGS, Mode::empty()) {
            Ok(fd) => return Ok(fd),
            Err(Errno::NOENT) => match mkdirat(parent, name, Mode::from_raw_mode(0o700)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(e),
            },
            // O_NOFOLLOW on a link is ELOOP (ENOTDIR with O_DIRECTORY on some kernels); a
            // plain file is ENOTDIR: either way not the node's directory.
            Err(e @ (Errno::LOOP | Errno::NOTDIR)) => {
                last = e;
                unlinkat(parent, name, AtFlags::empty())?;
            }
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Removes the entry `name` in `dir` unless it is absent; a directory there is an error (the
/// node's file never replaces a tree).
fn remove_entry(dir: &std::os::fd::OwnedFd, name: &std::ffi::OsStr) -> rustix::io::Result<()> {
    match rustix::fs::unlinkat(dir, name, rustix::fs::AtFlags::empty()) {
        Ok(()) | Err(rustix::io::Errno::NOENT) => Ok(()),
        Err(e) => Err(e),
    }
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
    use std::path::PathBuf;

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

    /// Every path under `dir` with what it holds (a file's text, a link's target).
    fn tree(dir: &Path) -> Vec<(PathBuf, String)> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                out.extend(tree(&p));
            } else if m.file_type().is_symlink() {
                out.push((
                    p.clone(),
                    std::fs::read_link(&p).unwrap().display().to_string(),
                ));
            } else {
                out.push((p.clone(), std::fs::read_to_string(&p).unwrap()));
            }
        }
        out.sort();
        out
    }

    /// A tree as set-up could leave it: links where the node's directories and file go, to a
    /// directory and a file outside that the node must not write.
    #[test]
    fn writes_beneath_a_task_written_tree_never_follow_its_links() {
        let dir = tempfile::tempdir().unwrap();
        let (home, outside) = (dir.path().join("home"), dir.path().join("outside"));
        std::fs::create_dir_all(&home).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        let victim = outside.join("victim");
        std::fs::write(&victim, "root's file").unwrap();
        let rel = Path::new(".pi/agent/models.json");
        let cases: [(&str, &dyn Fn()); 4] = [
            // The first directory a link to a directory outside.
            (".pi -> outside", &|| {
                std::os::unix::fs::symlink(&outside, home.join(".pi")).unwrap();
                std::fs::create_dir_all(outside.join("agent")).unwrap();
                std::os::unix::fs::symlink(&victim, outside.join("agent/models.json")).unwrap();
            }),
            // An inner directory a link.
            ("agent -> outside", &|| {
                std::fs::create_dir_all(home.join(".pi")).unwrap();
                std::os::unix::fs::symlink(&outside, home.join(".pi/agent")).unwrap();
            }),
            // The file itself a link.
            ("models.json -> victim", &|| {
                std::fs::create_dir_all(home.join(".pi/agent")).unwrap();
                std::os::unix::fs::symlink(&victim, home.join(rel)).unwrap();
            }),
            // A plain file where a directory goes.
            (".pi a file", &|| {
                std::fs::write(home.join(".pi"), "x").unwrap()
            }),
        ];
        for (what, plant) in cases {
            let _ = std::fs::remove_dir_all(&home);
            let _ = std::fs::remove_file(outside.join("models.json"));
            let _ = std::fs::remove_dir_all(outside.join("agent"));
            std::fs::create_dir_all(&home).unwrap();
            plant();
            let before = tree(&outside);
            write_beneath(&home, rel, b"{}").unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(
                tree(&outside),
                before,
                "{what}: the node wrote outside HOME"
            );
            assert_eq!(
                std::fs::read_to_string(home.join(rel)).unwrap(),
                "{}",
                "{what}"
            );
            for p in [".pi", ".pi/agent", ".pi/agent/models.json"] {
                let m = std::fs::symlink_metadata(home.join(p)).unwrap();
                assert!(!m.file_type().is_symlink(), "{what}: {p} is still a link");
            }
        }
        // The positive control: the plain write the presets used follows the link.
        let _ = std::fs::remove_dir_all(&home);
        std::fs::create_dir_all(home.join(".pi/agent")).unwrap();
        std::os::unix::fs::symlink(&victim, home.join(rel)).unwrap();
        std::fs::write(home.join(rel), "{}").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "{}");
        // Nothing but a plain relative path.
        for bad in ["/etc/passwd", "../x", ""] {
            assert!(write_beneath(&home, Path::new(bad), b"").is_err(), "{bad}");
        }
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
