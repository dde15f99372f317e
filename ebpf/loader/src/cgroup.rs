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
    #[error("refusing to capture cgroup {cgroup}: tokentap itself runs in {own}, inside it, so its own connections to the engine and the spool's receiver would be redirected back to itself. Run tokentap outside the captured cgroup (e.g. as a sibling of the pod's cgroup, or from the host's root cgroup)")]
    ContainsSelf { cgroup: String, own: String },
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

/// The cgroup v2 directory this process is in (the `0::` line of `/proc/self/cgroup`).
pub fn own_cgroup() -> Result<PathBuf, CgroupError> {
    let path = Path::new("/proc/self/cgroup");
    let text = std::fs::read_to_string(path).map_err(io("reading", path))?;
    let rel = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or(CgroupError::NoCgroup2)?;
    Ok(cgroup2_mount()?.join(rel.trim().trim_start_matches('/')))
}

/// Removes what a killed run left under `<cgroup2 mount>/tokentap`: cgroups named
/// `...-<pid>` whose process is gone (their processes are killed first). Returns the paths
/// removed. Cgroups of live tokentap processes, and names without a pid, are left alone.
pub fn remove_stale() -> Result<Vec<PathBuf>, CgroupError> {
    let parent = cgroup2_mount()?.join("tokentap");
    let Ok(entries) = std::fs::read_dir(&parent) else {
        return Ok(Vec::new());
    };
    let mut removed = Vec::new();
    for e in entries.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = creator_pid(&name) else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let path = e.path();
        if !path.is_dir() {
            continue;
        }
        let mut stale = Cgroup {
            path: path.clone(),
            owned: true,
        };
        match stale.take_down() {
            Ok(()) => {
                tracing::warn!(cgroup = %path.display(), pid, "removed a cgroup left by a killed tokentap run");
                removed.push(path);
            }
            Err(e) => tracing::warn!(error = %e, "could not remove a stale tokentap cgroup"),
        }
    }
    Ok(removed)
}

/// The pid a cgroup name of [`Cgroup::create_for_this_process`] (or a rollout sample's
/// cgroup) ends in: `…-pid<PID>`.
pub fn creator_pid(name: &str) -> Option<u32> {
    let (_, pid) = name.rsplit_once("-pid")?;
    pid.parse().ok().filter(|&p| p > 1)
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

    /// Makes `<cgroup2 mount>/tokentap/<name>-pid<PID>`: named after this process, so that
    /// [`remove_stale`] at a later start can take it down if this process is killed.
    pub fn create_for_this_process(name: &str) -> Result<Cgroup, CgroupError> {
        Cgroup::create(&format!("{name}-pid{}", std::process::id()))
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

    /// Fails when this process is in this cgroup or one below it: a redirect attached here
    /// would catch tokentap's own connections.
    pub fn ensure_outside(&self) -> Result<(), CgroupError> {
        let own = own_cgroup()?;
        let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned());
        let (own_c, cg_c) = (canon(&own), canon(&self.path));
        if own_c.starts_with(&cg_c) {
            return Err(CgroupError::ContainsSelf {
                cgroup: self.path.display().to_string(),
                own: own.display().to_string(),
            });
        }
        Ok(())
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

    #[test]
    fn stale_names_carry_their_creator_pid() {
        assert_eq!(creator_pid("run-abc-pid1234"), Some(1234));
        assert_eq!(creator_pid("sample-s-1-pid77"), Some(77));
        assert_eq!(creator_pid("run-abc-1234"), None);
        assert_eq!(creator_pid("x-pid1"), None, "never init");
    }
}
