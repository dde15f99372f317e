//! cgroup v2 directories for runs: find the unified hierarchy, make a child, put processes in
//! it, and take it down (killing what is left) when the run ends.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no cgroup v2 hierarchy is mounted (looked for a cgroup2 entry in /proc/mounts); mount one (mount -t cgroup2 none /sys/fs/cgroup) or use the nftables fallback")]
    NoCgroup2,
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("cgroup {0} still has processes after they were killed")]
    Busy(String),
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.display().to_string();
    move |source| CgroupError::Io { what, path, source }
}

/// Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on
/// hybrid hosts).
pub fn cgroup2_mount() -> Result<PathBuf, CgroupError> {
    let mounts = std::fs::read_to_string("/proc/mounts")
        .map_err(io("reading", Path::new("/proc/mounts")))?;
    mounts
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, dir, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "cgroup2").then(|| PathBuf::from(dir))
        })
        .ok_or(CgroupError::NoCgroup2)
}

/// A cgroup this process made; removed (after killing what is left in it) on drop.
#[derive(Debug)]
pub struct Cgroup {
    path: PathBuf,
    owned: bool,
}

impl Cgroup {
    /// Makes `<cgroup2 mount>/tokentap/<name>`.
    pub fn create(name: &str) -> Result<Cgroup, CgroupError> {
        let parent = cgroup2_mount()?.join("tokentap");
        std::fs::create_dir_all(&parent).map_err(io("creating", &parent))?;
        let path = parent.join(name);
        std::fs::create_dir(&path).map_err(io("creating", &path))?;
        Ok(Cgroup { path, owned: true })
    }

    /// An existing cgroup (a pod's), never removed by this process.
    pub fn existing(path: &Path) -> Result<Cgroup, CgroupError> {
        let procs = path.join("cgroup.procs");
        std::fs::metadata(&procs).map_err(io("opening", &procs))?;
        Ok(Cgroup {
            path: path.to_owned(),
            owned: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file a process writes `0` to (from `pre_exec`) to move itself in.
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    /// Processes in this cgroup now.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.procs_file())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// Kills every process in the cgroup (`cgroup.kill` where the kernel has it) and removes
    /// the directory once it is empty.
    pub fn remove(mut self) -> Result<(), CgroupError> {
        self.take_down()
    }

    fn take_down(&mut self) -> Result<(), CgroupError> {
        if !self.owned || !self.path.exists() {
            return Ok(());
        }
        self.owned = false;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            if std::fs::write(self.path.join("cgroup.kill"), "1").is_err() {
                for pid in pids {
                    // SAFETY: kill has no memory preconditions.
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                }
            }
            if Instant::now() > deadline {
                return Err(CgroupError::Busy(self.path.display().to_string()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // rmdir can race the last exit being accounted; retry briefly.
        loop {
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() < deadline && e.raw_os_error() == Some(libc::EBUSY) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => return Err(io("removing", &self.path)(e)),
            }
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if let Err(e) = self.take_down() {
            tracing::warn!(error = %e, "could not remove the run's cgroup");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cgroup_is_made_filled_emptied_and_removed() {
        if !tokentap_e2e::privileged::runs(tokentap_e2e::privileged::root_with_cgroup2()) {
            return;
        }
        let cg = Cgroup::create(&format!("unit-{}", std::process::id())).unwrap();
        let path = cg.path().to_owned();
        assert!(path.join("cgroup.procs").exists());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        std::fs::write(cg.procs_file(), child.id().to_string()).unwrap();
        assert_eq!(cg.pids(), vec![child.id()]);
        cg.remove().unwrap();
        assert!(!path.exists());
        // The process was killed with the cgroup.
        let status = child.wait().unwrap();
        assert!(!status.success());
    }
}
