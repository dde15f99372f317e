//! The agent: one loaded redirect program, attached to the cgroup of every workload the sources
//! report (and, for containers, in advance to the capture parent), detached when the workload
//! ends; and the answer to the shared listener's question "whose connection is this?".
//!
//! An attachment is a set of BPF links owned by this process: dropping it detaches, and so
//! does the kernel when the agent dies, so a killed agent leaves nothing attached behind it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use tokentap_ebpf::{Attachment, Redirect};
use tokentap_proxy::transparent::{Attribution, Redirection, Redirections};

use tokentap_cgroup::walk::{cgroup_id, find_below};

use crate::attribution::{CgroupIds, Owner};
use crate::workload::{Workload, WorkloadEvent, WorkloadKey};

/// Looks up a container by id, for a cgroup that appears under the capture parent before its
/// source reported it (the Docker source).
#[async_trait]
pub trait ContainerLookup: Send + Sync + 'static {
    /// The container's id from its cgroup directory's name (`<id>`, `docker-<id>.scope`, …).
    fn container_id<'a>(&self, cgroup_name: &'a str) -> Option<&'a str>;
    /// The workload, if the container is labelled for capture; `Ok(None)` if it is not.
    async fn identify(&self, container_id: &str) -> anyhow::Result<Option<Workload>>;
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cgroup not found for {display}: {path} does not exist (is --cgroup-root the host's cgroup2 mount, and the runtime's cgroup driver the one the source assumed?)")]
    CgroupNotFound { display: String, path: String },
    #[error("attaching the redirect to {path} for {display}: {source}")]
    Attach {
        display: String,
        path: String,
        source: tokentap_ebpf::RedirectError,
    },
    #[error("the capture parent {path}: {source}")]
    Parent {
        path: String,
        source: std::io::Error,
    },
}

/// The cgroup below which containers are redirected from their first connect.
struct CaptureParent {
    dir: PathBuf,
    lookup: std::sync::Arc<dyn ContainerLookup>,
    _attachment: Attachment,
}

struct Tracked {
    workload: Workload,
    cgroup_id: u64,
    /// `None` when the capture parent's attachment already covers it.
    attachment: Option<Attachment>,
    since: SystemTime,
}

/// What `/v1/workloads` shows of one workload.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorkloadStatus {
    #[serde(flatten)]
    pub workload: Workload,
    pub cgroup_id: u64,
    /// `own` (attached to its cgroup) or `capture-parent` (covered since before it started).
    pub attached_via: &'static str,
    pub attached_at_ms: u64,
}

#[derive(Default)]
struct State {
    tracked: BTreeMap<WorkloadKey, Tracked>,
    ids: CgroupIds,
}

/// Counters the command exposes as metrics.
#[derive(Debug, Default, Clone, Copy)]
pub struct AgentCounts {
    pub attach_errors: u64,
    pub unattributed: u64,
}

pub struct Agent {
    redirect: Redirect,
    root: PathBuf,
    parent: Option<CaptureParent>,
    state: Mutex<State>,
    counts: Mutex<AgentCounts>,
}

impl Agent {
    /// An agent whose workloads' cgroup paths are relative to `root` (the host's cgroup2 mount).
    pub fn new(redirect: Redirect, root: PathBuf) -> Agent {
        Agent {
            redirect,
            root,
            parent: None,
            state: Mutex::new(State::default()),
            counts: Mutex::new(AgentCounts::default()),
        }
    }

    /// Creates (if needed) and attaches the capture parent `relative` under the root: every
    /// container started below it is redirected from its first instruction, because cgroup
    /// programs apply to the cgroups created below later. `lookup` names them afterwards.
    pub fn with_capture_parent(
        mut self,
        relative: &Path,
        lookup: std::sync::Arc<dyn ContainerLookup>,
    ) -> Result<Agent, AgentError> {
        let dir = self
            .root
            .join(relative.strip_prefix("/").unwrap_or(relative));
        let parent_err = |source| AgentError::Parent {
            path: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(parent_err)?;
        let attachment =
            self.redirect
                .attach_cgroup(&dir)
                .map_err(|source| AgentError::Attach {
                    display: "the capture parent".into(),
                    path: dir.display().to_string(),
                    source,
                })?;
        self.parent = Some(CaptureParent {
            dir,
            lookup,
            _attachment: attachment,
        });
        Ok(self)
    }

    /// The capture parent's directory, if there is one.
    pub fn capture_parent(&self) -> Option<&Path> {
        self.parent.as_ref().map(|p| p.dir.as_path())
    }

    /// Applies one source event. `kind` is the key prefix of the source's workloads
    /// (`docker:`, `pod:`), which a `Synced` list replaces.
    pub fn apply(&self, kind: &str, event: WorkloadEvent) {
        match event {
            WorkloadEvent::Started(w) => self.start(w),
            WorkloadEvent::Stopped(key) => self.stop(&key),
            WorkloadEvent::Synced(list) => {
                let keep: std::collections::HashSet<_> = list.iter().map(|w| &w.key).collect();
                let gone: Vec<WorkloadKey> = self
                    .lock()
                    .tracked
                    .keys()
                    .filter(|k| k.0.starts_with(kind) && !keep.contains(k))
                    .cloned()
                    .collect();
                for key in gone {
                    self.stop(&key);
                }
                for w in list {
                    self.start(w);
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attaches (unless the capture parent covers it) and tracks a workload. A workload
    /// already tracked in the same cgroup only has its session and name refreshed.
    pub fn start(&self, workload: Workload) {
        if let Err(e) = self.try_start(workload) {
            self.counts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .attach_errors += 1;
            tracing::error!("{e}");
        }
    }

    fn try_start(&self, workload: Workload) -> Result<(), AgentError> {
        let relative = workload
            .cgroup
            .strip_prefix("/")
            .unwrap_or(&workload.cgroup);
        let dir = self.root.join(relative);
        // Sources give paths from their APIs and /proc; none may point outside the root.
        // Nor be the root itself: that would capture the whole host.
        let escapes = relative.as_os_str().is_empty()
            || relative
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)));
        let id = match cgroup_id(&dir) {
            Ok(id) if !escapes => id,
            _ => {
                return Err(AgentError::CgroupNotFound {
                    display: workload.display.clone(),
                    path: dir.display().to_string(),
                })
            }
        };
        {
            let mut state = self.lock();
            if let Some(t) = state.tracked.get_mut(&workload.key) {
                if t.cgroup_id == id {
                    t.workload = workload;
                    return Ok(());
                }
            }
        }
        let covered = self
            .parent
            .as_ref()
            .is_some_and(|p| dir.starts_with(&p.dir));
        let attachment = if covered {
            None
        } else {
            Some(
                self.redirect
                    .attach_cgroup(&dir)
                    .map_err(|source| AgentError::Attach {
                        display: workload.display.clone(),
                        path: dir.display().to_string(),
                        source,
                    })?,
            )
        };
        tracing::info!(
            workload = %workload.display,
            session = %workload.session,
            cgroup = %dir.display(),
            via = if covered { "capture-parent" } else { "own" },
            "capturing"
        );
        let mut state = self.lock();
        let key = workload.key.clone();
        state.ids.forget(&key);
        state.ids.insert(id, Owner::Workload(key.clone()));
        state.tracked.insert(
            key,
            Tracked {
                workload,
                cgroup_id: id,
                attachment,
                since: SystemTime::now(),
            },
        );
        Ok(())
    }

    /// Detaches and forgets a workload.
    pub fn stop(&self, key: &WorkloadKey) {
        let mut state = self.lock();
        if let Some(t) = state.tracked.remove(key) {
            tracing::info!(workload = %t.workload.display, "ended; detached and forgotten");
        }
        state.ids.forget(key);
    }

    /// Every tracked workload.
    pub fn workloads(&self) -> Vec<WorkloadStatus> {
        self.lock()
            .tracked
            .values()
            .map(|t| WorkloadStatus {
                workload: t.workload.clone(),
                cgroup_id: t.cgroup_id,
                attached_via: if t.attachment.is_some() {
                    "own"
                } else {
                    "capture-parent"
                },
                attached_at_ms: t
                    .since
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or(Duration::ZERO)
                    .as_millis() as u64,
            })
            .collect()
    }

    pub fn counts(&self) -> AgentCounts {
        *self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whose the connecting task's cgroup is.
    pub async fn attribute(&self, id: u64) -> Attribution {
        let started = Instant::now();
        let attribution = self.owner_of(id).await;
        tracing::debug!(cgroup_id = id, ?attribution, took = ?started.elapsed(), "attributed");
        attribution
    }

    async fn owner_of(&self, id: u64) -> Attribution {
        if let Some(a) = self.cached(id) {
            return a;
        }
        // Below a tracked workload's cgroup (a pod's containers, sub-cgroups).
        let tops: Vec<(WorkloadKey, PathBuf)> = self
            .lock()
            .tracked
            .values()
            .map(|t| (t.workload.key.clone(), self.root.join(&t.workload.cgroup)))
            .collect();
        for (key, top) in tops {
            if find_below(&top, id).is_some() {
                self.lock().ids.insert(id, Owner::Workload(key));
                return self.cached(id).unwrap_or(Attribution::Listener);
            }
        }
        // A container below the capture parent that its source has not reported yet.
        if let Some(parent) = &self.parent {
            if let Some((first, _)) = find_below(&parent.dir, id) {
                return self.identify_below_parent(parent, &first, id).await;
            }
        }
        // Redirected, so from an attached cgroup, but gone before it could be named (a
        // workload that just ended): captured, attributed per call.
        self.counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unattributed += 1;
        tracing::warn!(
            cgroup_id = id,
            "a redirected connection from a cgroup no tracked workload holds; captured without a workload session"
        );
        Attribution::Listener
    }

    fn cached(&self, id: u64) -> Option<Attribution> {
        let state = self.lock();
        Some(match state.ids.get(id)? {
            Owner::NotCaptured => Attribution::NotCaptured,
            Owner::Workload(key) => match state.tracked.get(key) {
                Some(t) => Attribution::Session(t.workload.session.clone()),
                None => return None,
            },
        })
    }

    async fn identify_below_parent(
        &self,
        parent: &CaptureParent,
        first: &Path,
        id: u64,
    ) -> Attribution {
        let name = first
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let Some(container) = parent.lookup.container_id(&name) else {
            self.lock().ids.insert(id, Owner::NotCaptured);
            return Attribution::NotCaptured;
        };
        match parent.lookup.identify(container).await {
            Ok(Some(mut workload)) => {
                // The directory the connection came from is the truth; the lookup's path is
                // at best the same.
                if let Ok(relative) = first.strip_prefix(&self.root) {
                    workload.cgroup = relative.to_owned();
                }
                let session = workload.session.clone();
                let key = workload.key.clone();
                self.start(workload);
                self.lock().ids.insert(id, Owner::Workload(key));
                Attribution::Session(session)
            }
            Ok(None) => {
                self.lock().ids.insert(id, Owner::NotCaptured);
                Attribution::NotCaptured
            }
            Err(e) => {
                // Not cached: the next connection asks again. The container is below the
                // parent the operator reserved for capture, so its calls are captured.
                tracing::warn!(error = %e, container, "could not identify a container below the capture parent; its call is captured without a workload session");
                Attribution::Listener
            }
        }
    }
}

#[async_trait]
impl Redirections for Agent {
    async fn redirection(
        &self,
        _conn: &tokio::net::TcpStream,
        peer: std::net::SocketAddr,
    ) -> Option<Redirection> {
        let origin = self.redirect.origin(peer)?;
        Some(Redirection {
            destination: origin.destination,
            attribution: self.attribute(origin.cgroup_id).await,
        })
    }
}
