//! What a source reports: one workload to capture, and its lifecycle.

use std::path::PathBuf;

/// Identifies a workload across events: `docker:<container id>` or `pod:<pod uid>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct WorkloadKey(pub String);

impl WorkloadKey {
    pub fn container(id: &str) -> Self {
        WorkloadKey(format!("docker:{id}"))
    }
    pub fn pod(uid: &str) -> Self {
        WorkloadKey(format!("pod:{uid}"))
    }
}

impl std::fmt::Display for WorkloadKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One container or pod to capture.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Workload {
    pub key: WorkloadKey,
    /// Its cgroup v2 directory, as a path relative to the cgroup2 mount (no leading `/`), e.g.
    /// `docker/3f2a…` or `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_….slice`.
    /// The agent joins it to its `--cgroup-root`.
    pub cgroup: PathBuf,
    /// Every call the workload makes is recorded under this session.
    pub session: String,
    /// For people reading logs and `/v1/workloads`: `container <name>`, `pod <ns>/<name>`.
    pub display: String,
}

/// What a source reports. A source sends `Synced` with the full list after each (re)connect to
/// its API, then `Started`/`Stopped` as they happen; the agent detaches whatever a `Synced`
/// list no longer holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkloadEvent {
    Started(Workload),
    Stopped(WorkloadKey),
    Synced(Vec<Workload>),
}
