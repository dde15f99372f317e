//! One cgroup directory: its processes, taking it down, and the names that let a later start
//! tell which cgroups a killed process left behind.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long taking a cgroup down waits for its killed processes to leave.
pub const TAKE_DOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Processes in the cgroup at `dir` now.
pub fn pids(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// Kills every process in the cgroup at `dir`: `cgroup.kill` where the kernel has it (v2,
/// 5.14+), else SIGKILL to each listed process (v1, older kernels).
pub fn kill_all(dir: &Path) {
    if std::fs::write(dir.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    for pid in pids(dir) {
        // SAFETY: kill(2) has no memory preconditions.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    }
}

/// Kills what is in the cgroup at `dir` and removes the directory once it is empty, waiting
/// at most `timeout` for the processes to leave. A directory already gone is fine.
pub fn take_down(dir: &Path, timeout: Duration) -> io::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let deadline = Instant::now() + timeout;
    loop {
        if pids(dir).is_empty() {
            break;
        }
        kill_all(dir);
        if Instant::now() > deadline {
            return Err(io::Error::other(format!(
                "cgroup {} still has processes after they were killed",
                dir.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // rmdir can race the last exit being accounted; retry briefly.
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() < deadline && e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("removing {}: {e}", dir.display()),
                ))
            }
        }
    }
}

/// The name of a cgroup this process makes: `<name>-pid<PID>`, so that a later start can take
/// it down if this process is killed ([`remove_stale_children`]).
pub fn name_for_this_process(name: &str) -> String {
    format!("{name}-pid{}", std::process::id())
}

/// The pid a cgroup name of [`name_for_this_process`] ends in: `…-pid<PID>`.
pub fn creator_pid(name: &str) -> Option<u32> {
    let (_, pid) = name.rsplit_once("-pid")?;
    pid.parse().ok().filter(|&p| p > 1)
}

/// Takes down the cgroups directly under `parent` named `<prefix>…-pid<PID>` whose creator
/// process is gone (killing what still runs in them first). Returns the ones removed; cgroups
/// of live processes, and names without a pid, are left alone.
pub fn remove_stale_children(parent: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(prefix).and_then(creator_pid) else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let path = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        match take_down(&path, TAKE_DOWN_TIMEOUT) {
            Ok(()) => {
                tracing::warn!(cgroup = %path.display(), pid, "removed a cgroup left by a killed tokentap process");
                removed.push(path);
            }
            Err(e) => tracing::warn!(error = %e, "could not remove a stale tokentap cgroup"),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_names_carry_their_creator_pid() {
        assert_eq!(creator_pid("run-abc-pid1234"), Some(1234));
        assert_eq!(creator_pid("sample-s-1-pid77"), Some(77));
        assert_eq!(creator_pid("run-abc-1234"), None);
        assert_eq!(creator_pid("x-pid1"), None, "never init");
        let mine = name_for_this_process("run-x");
        assert_eq!(creator_pid(&mine), Some(std::process::id()));
    }

    /// Plain directories stand in for cgroups here (no processes in them): only a dead
    /// creator's directories with the prefix go.
    #[test]
    fn only_dead_creators_directories_with_the_prefix_are_removed() {
        let parent = tempfile::tempdir().unwrap();
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        dead.wait().unwrap();
        let make = |n: &str| {
            let p = parent.path().join(n);
            std::fs::create_dir(&p).unwrap();
            p
        };
        let stale = make(&format!("tokentap-a-pid{dead_pid}"));
        let live = make(&format!("tokentap-b-pid{}", std::process::id()));
        let other = make(&format!("other-pid{dead_pid}"));
        let unnamed = make("tokentap-c");
        let removed = remove_stale_children(parent.path(), "tokentap-");
        assert_eq!(removed, vec![stale.clone()]);
        assert!(!stale.exists());
        assert!(live.exists() && other.exists() && unnamed.exists());
    }
}
