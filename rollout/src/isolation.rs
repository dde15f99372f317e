//! Per-sample resource limits: each agent runs in a cgroup of its own (made under the node's
//! own cgroup) with a memory, CPU and process-count limit. Works on the unified (v2) hierarchy
//! when it has the controllers, else on the v1 per-controller hierarchies (hybrid systems).
//! The agent joins its cgroup between fork and exec, so nothing it starts escapes.

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Limits for one sample's agent (absent: unlimited).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Memory (RSS + page cache) in MiB; the kernel's OOM killer ends the agent past it.
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// CPU time in cores (e.g. 0.5 = half a core), enforced per 100 ms period.
    #[serde(default)]
    pub cpus: Option<f64>,
    /// Processes and threads.
    #[serde(default)]
    pub pids: Option<u64>,
}

impl Limits {
    pub fn is_empty(&self) -> bool {
        self.memory_mb.is_none() && self.cpus.is_none() && self.pids.is_none()
    }

    /// `self` where set, else `fallback`.
    pub fn or(&self, fallback: &Limits) -> Limits {
        Limits {
            memory_mb: self.memory_mb.or(fallback.memory_mb),
            cpus: self.cpus.or(fallback.cpus),
            pids: self.pids.or(fallback.pids),
        }
    }
}

/// A sample's cgroup (one directory per hierarchy it needed); removed on drop once empty.
#[derive(Debug)]
pub struct SampleCgroup {
    dirs: Vec<PathBuf>,
    /// `cgroup.procs` of each, for the child to write itself into before exec.
    procs: Vec<CString>,
    /// Where the memory peak is read.
    memory_peak: Option<PathBuf>,
    /// Its directory on the unified (v2) hierarchy, if it has one.
    v2_dir: Option<PathBuf>,
}

/// A cgroup filesystem mount and the node's own place in it.
struct Hierarchy {
    /// The node's own cgroup directory in this hierarchy.
    own: PathBuf,
    v2: bool,
}

fn own_cgroups() -> io::Result<Vec<(String, String)>> {
    // Lines `ID:controllers:path`; v2 is `0::path`.
    Ok(std::fs::read_to_string("/proc/self/cgroup")?
        .lines()
        .filter_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, ctrls, path) = (p.next()?, p.next()?, p.next()?);
            Some((ctrls.to_owned(), path.to_owned()))
        })
        .collect())
}

/// Mount points of cgroup filesystems: (fstype, mount point, super options).
fn cgroup_mounts() -> io::Result<Vec<(String, PathBuf, String)>> {
    Ok(std::fs::read_to_string("/proc/self/mountinfo")?
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let mount = pre.split(' ').nth(4)?;
            let mut post = post.split(' ');
            let fstype = post.next()?;
            let _source = post.next()?;
            let opts = post.next().unwrap_or("");
            fstype
                .starts_with("cgroup")
                .then(|| (fstype.to_owned(), PathBuf::from(mount), opts.to_owned()))
        })
        .collect())
}

/// Where `controller` can be used: the v2 hierarchy if it offers it, else its v1 mount.
fn hierarchy_for(controller: &str) -> io::Result<Hierarchy> {
    let mounts = cgroup_mounts()?;
    let own = own_cgroups()?;
    if let Some((_, mount, _)) = mounts.iter().find(|(t, _, _)| t == "cgroup2") {
        if let Some((_, path)) = own.iter().find(|(c, _)| c.is_empty()) {
            let dir = mount.join(path.trim_start_matches('/'));
            let available =
                std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
            if available.split_whitespace().any(|c| c == controller) {
                return Ok(Hierarchy { own: dir, v2: true });
            }
        }
    }
    let (_, mount, _) = mounts
        .iter()
        .find(|(t, _, opts)| t == "cgroup" && opts.split(',').any(|o| o == controller))
        .ok_or_else(|| {
            io::Error::other(format!(
                "no cgroup hierarchy offers the {controller} controller"
            ))
        })?;
    let (_, path) = own
        .iter()
        .find(|(c, _)| c.split(',').any(|c| c == controller))
        .ok_or_else(|| io::Error::other(format!("this process is in no {controller} cgroup")))?;
    Ok(Hierarchy {
        own: mount.join(path.trim_start_matches('/')),
        v2: false,
    })
}

fn write(dir: &Path, file: &str, value: &str) -> io::Result<()> {
    std::fs::write(dir.join(file), value)
        .map_err(|e| io::Error::new(e.kind(), format!("{}/{file} = {value}: {e}", dir.display())))
}

/// The `cgroup.procs` file of the cgroup at `dir`, ready for [`join_on_spawn`].
pub fn procs_file(dir: &Path) -> io::Result<CString> {
    CString::new(dir.join("cgroup.procs").as_os_str().as_encoded_bytes()).map_err(io::Error::other)
}

/// Makes `cmd`'s child join the cgroups of `procs` (from [`procs_file`]) between fork and
/// exec, so nothing it starts escapes.
pub fn join_on_spawn(cmd: &mut tokio::process::Command, procs: Vec<CString>) {
    // SAFETY: the closure runs in the forked child before exec; it only formats into a
    // stack buffer and calls open/write/close, which are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            let mut buf = [0u8; 20];
            let mut pid = libc::getpid() as u64;
            let mut i = buf.len();
            loop {
                i -= 1;
                buf[i] = b'0' + (pid % 10) as u8;
                pid /= 10;
                if pid == 0 {
                    break;
                }
            }
            for p in &procs {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let n = libc::write(fd, buf[i..].as_ptr().cast(), buf.len() - i);
                libc::close(fd);
                if n < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Removes the sample cgroups a killed node left under this node's own cgroups (in every
/// hierarchy that offers a controller samples use): those named `tokentap-…-pid<PID>` whose
/// node process is gone. What still runs in them (agents orphaned by the kill) is killed
/// first. Returns the cgroups removed.
pub fn remove_stale() -> Vec<PathBuf> {
    let (Ok(mounts), Ok(own)) = (cgroup_mounts(), own_cgroups()) else {
        return Vec::new();
    };
    let mut parents: Vec<PathBuf> = Vec::new();
    for (fstype, mount, opts) in &mounts {
        let path = own.iter().find(|(ctrls, _)| {
            if fstype == "cgroup2" {
                ctrls.is_empty()
            } else {
                ["memory", "cpu", "pids"]
                    .iter()
                    .any(|c| opts.split(',').any(|o| o == *c) && ctrls.split(',').any(|x| x == *c))
            }
        });
        if let Some((_, path)) = path {
            let dir = mount.join(path.trim_start_matches('/'));
            if !parents.contains(&dir) {
                parents.push(dir);
            }
        }
    }
    let mut removed = Vec::new();
    for parent in parents {
        let Ok(entries) = std::fs::read_dir(&parent) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix("tokentap-")
                .and_then(tokentap_ebpf::creator_pid)
            else {
                continue;
            };
            if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
                continue;
            }
            let stale = SampleCgroup {
                dirs: vec![entry.path()],
                procs: Vec::new(),
                memory_peak: None,
                v2_dir: None,
            };
            // Dropping kills what is left and removes the directory.
            drop(stale);
            if !entry.path().exists() {
                tracing::warn!(cgroup = %entry.path().display(), pid, "removed a sample cgroup left by a killed node");
                removed.push(entry.path());
            }
        }
    }
    removed
}

impl SampleCgroup {
    /// Makes `name`'s cgroup with `limits`; `None` when there is nothing to limit.
    pub fn create(name: &str, limits: &Limits) -> io::Result<Option<SampleCgroup>> {
        if limits.is_empty() {
            return Ok(None);
        }
        let mut cg = SampleCgroup {
            dirs: Vec::new(),
            procs: Vec::new(),
            memory_peak: None,
            v2_dir: None,
        };
        let wanted: Vec<&str> = [
            limits.memory_mb.map(|_| "memory"),
            limits.cpus.map(|_| "cpu"),
            limits.pids.map(|_| "pids"),
        ]
        .into_iter()
        .flatten()
        .collect();
        for controller in wanted {
            let h = hierarchy_for(controller)?;
            // Named after this node process, so a restarted node can tell a killed one's.
            let dir = h
                .own
                .join(format!("tokentap-{name}-pid{}", std::process::id()));
            if !cg.dirs.contains(&dir) {
                if h.v2 {
                    // Children can use a controller only when the parent delegates it.
                    let _ = write(&h.own, "cgroup.subtree_control", &format!("+{controller}"));
                }
                match std::fs::create_dir(&dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                    Err(e) => {
                        return Err(io::Error::new(
                            e.kind(),
                            format!("creating {}: {e}", dir.display()),
                        ))
                    }
                }
                cg.dirs.push(dir.clone());
                if h.v2 {
                    cg.v2_dir = Some(dir.clone());
                }
                cg.procs.push(procs_file(&dir)?);
            }
            match controller {
                "memory" => {
                    let bytes = limits.memory_mb.unwrap_or(0) << 20;
                    if h.v2 {
                        write(&dir, "memory.max", &bytes.to_string())?;
                        let _ = write(&dir, "memory.swap.max", "0");
                        cg.memory_peak = Some(dir.join("memory.peak"));
                    } else {
                        write(&dir, "memory.limit_in_bytes", &bytes.to_string())?;
                        // Swap counts too where the kernel accounts it.
                        let _ = write(&dir, "memory.memsw.limit_in_bytes", &bytes.to_string());
                        cg.memory_peak = Some(dir.join("memory.max_usage_in_bytes"));
                    }
                }
                "cpu" => {
                    let quota = (limits.cpus.unwrap_or(1.0) * 100_000.0).round().max(1000.0) as u64;
                    if h.v2 {
                        write(&dir, "cpu.max", &format!("{quota} 100000"))?;
                    } else {
                        write(&dir, "cpu.cfs_period_us", "100000")?;
                        write(&dir, "cpu.cfs_quota_us", &quota.to_string())?;
                    }
                }
                "pids" => write(&dir, "pids.max", &limits.pids.unwrap_or(0).to_string())?,
                _ => unreachable!(),
            }
        }
        Ok(Some(cg))
    }

    /// Makes `cmd`'s child join this cgroup before it executes anything.
    pub fn enter_on_spawn(&self, cmd: &mut tokio::process::Command) {
        join_on_spawn(cmd, self.procs.clone());
    }

    /// Its directory on the unified (v2) hierarchy: where a connect redirect for the agent
    /// must attach, since a process is in one v2 cgroup only.
    pub fn v2_dir(&self) -> Option<&Path> {
        self.v2_dir.as_deref()
    }

    /// The most memory the agent used (bytes), when the kernel tracks it.
    pub fn memory_peak(&self) -> Option<u64> {
        std::fs::read_to_string(self.memory_peak.as_ref()?)
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Whether the kernel's OOM killer acted in this cgroup.
    pub fn oom_killed(&self) -> bool {
        self.dirs.iter().any(|d| {
            // v2: memory.events `oom_kill N`; v1: memory.oom_control `oom_kill N`.
            ["memory.events", "memory.oom_control"].iter().any(|f| {
                std::fs::read_to_string(d.join(f)).is_ok_and(|t| {
                    t.lines().any(|l| {
                        l.strip_prefix("oom_kill ")
                            .and_then(|n| n.trim().parse::<u64>().ok())
                            .is_some_and(|n| n > 0)
                    })
                })
            })
        })
    }

    /// Kills whatever is still in the cgroup (processes that left the agent's process group).
    pub fn kill_all(&self) {
        for d in &self.dirs {
            if std::fs::write(d.join("cgroup.kill"), "1").is_ok() {
                continue;
            }
            if let Ok(t) = std::fs::read_to_string(d.join("cgroup.procs")) {
                for pid in t.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                    // SAFETY: kill(2) on a process in this sample's cgroup.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
    }
}

impl Drop for SampleCgroup {
    fn drop(&mut self) {
        self.kill_all();
        for d in &self.dirs {
            // Killed processes leave the cgroup asynchronously; retry briefly.
            for _ in 0..50 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node killed with its agents still running left `tokentap-…-pid<dead>`; the next
    /// node's start kills what runs there and removes it, and leaves a live node's alone.
    #[test]
    fn a_killed_nodes_sample_cgroups_are_removed_at_start() {
        if !tokentap_e2e::privileged::runs(tokentap_e2e::privileged::root_with_cgroup2()) {
            return;
        }
        let limits = Limits {
            pids: Some(64),
            ..Limits::default()
        };
        let name = format!("unit-stale-{}", std::process::id());
        let live = SampleCgroup::create(&name, &limits).unwrap().unwrap();
        // The same cgroup as a dead node would have named it: a reaped child's pid.
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        dead.wait().unwrap();
        let live_dir = live.dirs[0].clone();
        let stale_dir = live_dir.with_file_name(format!("tokentap-{name}-pid{dead_pid}"));
        std::fs::create_dir(&stale_dir).unwrap();
        let mut orphan = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        std::fs::write(stale_dir.join("cgroup.procs"), orphan.id().to_string()).unwrap();
        let removed = remove_stale();
        assert!(removed.contains(&stale_dir), "{removed:?}");
        assert!(!stale_dir.exists());
        assert!(live_dir.exists(), "a live node's sample cgroup stays");
        assert!(
            !orphan.wait().unwrap().success(),
            "the orphaned agent was killed"
        );
    }

    #[test]
    fn task_limits_fall_back_to_the_nodes() {
        let node = Limits {
            memory_mb: Some(2048),
            cpus: Some(1.0),
            pids: None,
        };
        let task = Limits {
            memory_mb: Some(512),
            ..Limits::default()
        };
        assert_eq!(
            task.or(&node),
            Limits {
                memory_mb: Some(512),
                cpus: Some(1.0),
                pids: None
            }
        );
        assert!(Limits::default().is_empty());
    }
}
