//! A cgroup with resource limits (memory, CPU, processes) for one process tree: on the unified
//! (v2) hierarchy when this process's cgroup offers the controllers, else on the v1
//! per-controller hierarchies (hybrid hosts). Made under this process's own cgroup and named
//! after it, so a later start removes what a killed one left ([`remove_stale_limited`]).

use std::ffi::CString;
use std::io;
use std::path::{Path, PathBuf};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::dir;
use crate::hierarchy;
use crate::join::{join_on_spawn, procs_file};

/// What limited cgroups are called: `tokentap-<name>-pid<PID>`.
const PREFIX: &str = "tokentap-";

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

/// A limited cgroup (one directory per hierarchy it needed); its processes killed and its
/// directories removed on drop.
#[derive(Debug)]
pub struct LimitedCgroup {
    dirs: Vec<PathBuf>,
    /// `cgroup.procs` of each, for the child to write itself into before exec.
    procs: Vec<CString>,
    /// Where the memory peak is read.
    memory_peak: Option<PathBuf>,
    /// Its directory on the unified (v2) hierarchy, if it has one.
    v2_dir: Option<PathBuf>,
}

fn write(dir: &Path, file: &str, value: &str) -> io::Result<()> {
    std::fs::write(dir.join(file), value)
        .map_err(|e| io::Error::new(e.kind(), format!("{}/{file} = {value}: {e}", dir.display())))
}

/// Removes the limited cgroups a killed process left under this process's own cgroups (in
/// the v2 hierarchy and every v1 one carrying a controller they use): those whose creator is
/// gone. What still runs in them is killed first. Returns the cgroups removed.
pub fn remove_stale_limited() -> Vec<PathBuf> {
    let Ok(parents) = hierarchy::own_dirs(&["memory", "cpu", "pids"]) else {
        return Vec::new();
    };
    parents
        .iter()
        .flat_map(|p| dir::remove_stale_children(p, PREFIX))
        .collect()
}

impl LimitedCgroup {
    /// Makes `name`'s cgroup with `limits`; `None` when there is nothing to limit.
    pub fn create(name: &str, limits: &Limits) -> io::Result<Option<LimitedCgroup>> {
        if limits.is_empty() {
            return Ok(None);
        }
        let mut cg = LimitedCgroup {
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
            let h = hierarchy::hierarchy_for(controller)?;
            // Named after this node process, so a restarted node can tell a killed one's.
            let dir = h
                .own
                .join(dir::name_for_this_process(&format!("{PREFIX}{name}")));
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
                    // Saturating: a shift would wrap a huge ask (2^44 + 1024 MB) to 1 GiB.
                    let bytes = memory_bytes(limits.memory_mb.unwrap_or(0));
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

    /// Whether a fork was refused at this cgroup's process limit (`pids.events` `max N`, v2
    /// and v1 alike).
    pub fn pids_limit_hit(&self) -> bool {
        self.dirs.iter().any(|d| {
            std::fs::read_to_string(d.join("pids.events")).is_ok_and(|t| {
                t.lines().any(|l| {
                    l.strip_prefix("max ")
                        .and_then(|n| n.trim().parse::<u64>().ok())
                        .is_some_and(|n| n > 0)
                })
            })
        })
    }

    /// Kills whatever is still in the cgroup (processes that left the agent's process group).
    pub fn kill_all(&self) {
        for d in &self.dirs {
            dir::kill_all(d);
        }
    }
}

impl Drop for LimitedCgroup {
    fn drop(&mut self) {
        for d in &self.dirs {
            if let Err(e) = dir::take_down(d, dir::TAKE_DOWN_TIMEOUT) {
                tracing::warn!(error = %e, "could not remove a sample's cgroup");
            }
        }
    }
}

/// `mb` megabytes in bytes, `u64::MAX` (no limit the kernel can tell from unlimited) when
/// that does not fit.
fn memory_bytes(mb: u64) -> u64 {
    mb.saturating_mul(1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_memory_ask_saturates_instead_of_wrapping() {
        assert_eq!(memory_bytes(512), 512 << 20);
        // (2^44 + 1024) << 20 wraps to 1 GiB.
        assert_eq!(((1u64 << 44) + 1024).wrapping_shl(20), 1 << 30);
        assert_eq!(memory_bytes((1 << 44) + 1024), u64::MAX);
    }

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
        let live = LimitedCgroup::create(&name, &limits).unwrap().unwrap();
        // The same cgroup as a dead node would have named it: a reaped child's pid.
        let mut dead = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = dead.id();
        dead.wait().unwrap();
        let live_dir = live.dirs[0].clone();
        let stale_dir = live_dir.with_file_name(format!("{PREFIX}{name}-pid{dead_pid}"));
        std::fs::create_dir(&stale_dir).unwrap();
        let mut orphan = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        std::fs::write(stale_dir.join("cgroup.procs"), orphan.id().to_string()).unwrap();
        let removed = remove_stale_limited();
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
