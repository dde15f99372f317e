//! The Docker Engine API source (Docker, or Podman's compatible socket): running containers
//! labelled `tokentap.io/capture=true`. Session: the label `tokentap.io/session`, else the
//! container's name. Cgroup: the container's init process's cgroup2 path, read from
//! `/proc/<pid>/cgroup` (the agent shares the host's PID namespace), which is exact for every
//! runtime and cgroup driver (`docker/<id>`, `<parent>/<id>`, `…/docker-<id>.scope`,
//! `libpod_parent/libpod-<id>`).
//!
//! It subscribes to the engine's events from just before it lists the running containers, so a
//! container started in between is seen twice (harmless) rather than never.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use async_trait::async_trait;
use bollard::query_parameters::{EventsOptionsBuilder, ListContainersOptionsBuilder};
use bollard::Docker;
use futures::StreamExt;
use tokio::sync::mpsc;

use crate::agent::ContainerLookup;
use crate::workload::{Workload, WorkloadEvent, WorkloadKey};

pub const CAPTURE_LABEL: &str = "tokentap.io/capture";
pub const SESSION_LABEL: &str = "tokentap.io/session";

/// How long one API request may take (not the event stream, which stays open).
const REQUEST_TIMEOUT_S: u64 = 30;
const MAX_BACKOFF: Duration = Duration::from_secs(5);

pub struct DockerSourceConfig {
    /// `unix:///var/run/docker.sock` (or a plain path).
    pub host: String,
    /// Where the host's `/proc` is (the agent's own unless it runs in a container without
    /// the host's PID namespace mounted there).
    pub proc_root: PathBuf,
}

/// The source. Cheap to clone: clones share the engine client.
#[derive(Clone)]
pub struct DockerSource {
    inner: std::sync::Arc<Inner>,
}

struct Inner {
    socket: String,
    proc_root: PathBuf,
    client: Mutex<Option<Docker>>,
}

impl DockerSource {
    pub fn new(config: DockerSourceConfig) -> anyhow::Result<DockerSource> {
        let socket = config
            .host
            .strip_prefix("unix://")
            .unwrap_or(&config.host)
            .to_owned();
        if config.host.contains("://") && !config.host.starts_with("unix://") {
            anyhow::bail!(
                "--docker-host {}: only unix sockets are supported (the agent runs on the host it watches)",
                config.host
            );
        }
        Ok(DockerSource {
            inner: std::sync::Arc::new(Inner {
                socket,
                proc_root: config.proc_root,
                client: Mutex::new(None),
            }),
        })
    }

    /// The engine client, connected and at the API version the engine speaks (Docker 20.10
    /// speaks 1.41; the client's default is newer).
    async fn client(&self) -> anyhow::Result<Docker> {
        if let Some(c) = self
            .inner
            .client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            return Ok(c.clone());
        }
        let socket = &self.inner.socket;
        let why = |e: bollard::errors::Error| anyhow::anyhow!("{}", describe(socket, &e));
        let c = Docker::connect_with_unix(socket, REQUEST_TIMEOUT_S, bollard::API_DEFAULT_VERSION)
            .map_err(why)?
            .negotiate_version()
            .await
            .map_err(why)?;
        *self.inner.client.lock().unwrap_or_else(|e| e.into_inner()) = Some(c.clone());
        Ok(c)
    }

    fn forget_client(&self) {
        *self.inner.client.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Watches until `events` is closed; API errors are logged and retried, never returned.
    pub async fn run(self, events: mpsc::Sender<WorkloadEvent>) -> anyhow::Result<()> {
        let mut backoff = Duration::from_millis(250);
        let mut last_error = String::new();
        while !events.is_closed() {
            match self.watch(&events).await {
                Ok(()) => {
                    backoff = Duration::from_millis(250);
                    tracing::info!(socket = %self.inner.socket, "the Docker event stream ended; reconnecting");
                }
                Err(e) => {
                    let message = format!("{e:#}");
                    if message != last_error {
                        tracing::error!(
                            "the Docker Engine API at unix://{} is unreachable: {message}; retrying every {} s at most",
                            self.inner.socket,
                            MAX_BACKOFF.as_secs()
                        );
                        last_error = message;
                    }
                    self.forget_client();
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        Ok(())
    }

    /// One connection's life: subscribe, list, report, follow.
    async fn watch(&self, events: &mpsc::Sender<WorkloadEvent>) -> anyhow::Result<()> {
        let docker = self.client().await?;
        // Events since a second before the list: nothing started in between is missed.
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs()
            .saturating_sub(1);
        let filters = HashMap::from([("label".to_owned(), vec![format!("{CAPTURE_LABEL}=true")])]);
        let running = docker
            .list_containers(Some(
                ListContainersOptionsBuilder::new()
                    .filters(&filters)
                    .build(),
            ))
            .await
            .context("listing containers")?;
        let mut list = Vec::new();
        for c in running {
            if let Some(id) = c.id {
                if let Some(w) = self.inspect(&docker, &id).await? {
                    list.push(w);
                }
            }
        }
        tracing::info!(
            containers = list.len(),
            "Docker: labelled containers running"
        );
        if events.send(WorkloadEvent::Synced(list)).await.is_err() {
            return Ok(());
        }
        let event_filters = HashMap::from([
            ("type".to_owned(), vec!["container".to_owned()]),
            (
                "event".to_owned(),
                vec!["start".into(), "die".into(), "destroy".into()],
            ),
            ("label".to_owned(), vec![format!("{CAPTURE_LABEL}=true")]),
        ]);
        let mut stream = docker.events(Some(
            EventsOptionsBuilder::new()
                .since(&since.to_string())
                .filters(&event_filters)
                .build(),
        ));
        while let Some(event) = stream.next().await {
            let event = event.context("reading the event stream")?;
            let Some(id) = event.actor.and_then(|a| a.id) else {
                continue;
            };
            let report = match event.action.as_deref() {
                Some("start") => match self.inspect(&docker, &id).await {
                    Ok(Some(w)) => WorkloadEvent::Started(w),
                    // Gone already (it exited at once), or no longer labelled.
                    Ok(None) | Err(_) => WorkloadEvent::Stopped(WorkloadKey::container(&id)),
                },
                Some("die" | "destroy") => WorkloadEvent::Stopped(WorkloadKey::container(&id)),
                _ => continue,
            };
            if events.send(report).await.is_err() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// The workload of a running, labelled container; `None` if it is neither.
    async fn inspect(&self, docker: &Docker, id: &str) -> anyhow::Result<Option<Workload>> {
        let c = match docker.inspect_container(id, None).await {
            Ok(c) => c,
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => return Ok(None),
            Err(e) => return Err(e).context(format!("inspecting container {id}")),
        };
        let labels = c
            .config
            .as_ref()
            .and_then(|c| c.labels.clone())
            .unwrap_or_default();
        if labels.get(CAPTURE_LABEL).map(String::as_str) != Some("true") {
            return Ok(None);
        }
        let state = c.state.as_ref();
        let pid = state.and_then(|s| s.pid).unwrap_or(0);
        if !state.and_then(|s| s.running).unwrap_or(false) || pid <= 0 {
            return Ok(None);
        }
        let Some(cgroup) = cgroup_of(&self.inner.proc_root, pid as u32) else {
            // Exited between the inspect and now.
            return Ok(None);
        };
        let id = c.id.clone().unwrap_or_else(|| id.to_owned());
        let name = c
            .name
            .as_deref()
            .map(|n| n.trim_start_matches('/').to_owned())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| id.chars().take(12).collect());
        let session = labels
            .get(SESSION_LABEL)
            .filter(|s| !s.trim().is_empty())
            .cloned()
            .unwrap_or_else(|| name.clone());
        Ok(Some(Workload {
            key: WorkloadKey::container(&id),
            cgroup,
            session,
            display: format!("container {name}"),
        }))
    }
}

#[async_trait]
impl ContainerLookup for DockerSource {
    fn container_id<'a>(&self, cgroup_name: &'a str) -> Option<&'a str> {
        container_id_from_cgroup_name(cgroup_name)
    }

    async fn identify(&self, container_id: &str) -> anyhow::Result<Option<Workload>> {
        let docker = self.client().await?;
        self.inspect(&docker, container_id).await
    }
}

/// The cgroup2 path (relative to the mount) of a process, from `/proc/<pid>/cgroup`'s `0::`
/// line (present on v2 and v1-hybrid hosts).
pub fn cgroup_of(proc_root: &std::path::Path, pid: u32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("cgroup")).ok()?;
    let membership = tokentap_cgroup::hierarchy::parse_membership(&text);
    let v2 = membership.iter().find(|m| m.is_v2())?;
    let relative = v2.path.trim().trim_start_matches('/');
    (!relative.is_empty()).then(|| PathBuf::from(relative))
}

/// The container id in a runtime's cgroup directory name: `<id>` (Docker, cgroupfs driver),
/// `docker-<id>.scope` (systemd driver), `libpod-<id>` (Podman), `cri-containerd-<id>.scope`,
/// `crio-<id>.scope`. Ids are 64 lowercase hex digits.
pub fn container_id_from_cgroup_name(name: &str) -> Option<&str> {
    let name = name.strip_suffix(".scope").unwrap_or(name);
    let id = ["docker-", "libpod-", "cri-containerd-", "crio-"]
        .iter()
        .find_map(|p| name.strip_prefix(p))
        .unwrap_or(name);
    (id.len() == 64
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    .then_some(id)
}

/// One line on why the engine API could not be used.
fn describe(socket: &str, e: &bollard::errors::Error) -> String {
    use bollard::errors::Error as E;
    match e {
        E::SocketNotFoundError(_) => format!(
            "the socket {socket} does not exist (is dockerd, or `podman system service`, running? --docker-host names another)"
        ),
        other => {
            let text = format!("{other}");
            if text.contains("Permission denied") || text.contains("permission denied") {
                format!("{text} (the agent may not use {socket}: run it as root or in the docker group)")
            } else {
                text
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "3f2a0e6c1b7d4a5f8e9c0b1a2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e";

    #[test]
    fn container_ids_are_found_in_each_runtimes_cgroup_names() {
        for name in [
            ID.to_owned(),
            format!("docker-{ID}.scope"),
            format!("libpod-{ID}"),
            format!("cri-containerd-{ID}.scope"),
            format!("crio-{ID}.scope"),
        ] {
            assert_eq!(container_id_from_cgroup_name(&name), Some(ID), "{name}");
        }
        for bad in [
            "",
            "docker-.scope",
            &ID[..63],
            &format!("{ID}0"),
            &ID.to_uppercase(),
            "kubepods",
            "../../etc",
        ] {
            assert_eq!(container_id_from_cgroup_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_process_cgroup_is_read_from_the_unified_line() {
        let proc_root = tempfile::tempdir().unwrap();
        let dir = proc_root.path().join("42");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("cgroup"),
            format!(
                "12:memory:/docker/{ID}\n1:name=systemd:/docker/{ID}\n0::/tokentap-capture/{ID}\n"
            ),
        )
        .unwrap();
        assert_eq!(
            cgroup_of(proc_root.path(), 42),
            Some(PathBuf::from(format!("tokentap-capture/{ID}")))
        );
        std::fs::write(dir.join("cgroup"), "0::/\n").unwrap();
        assert_eq!(
            cgroup_of(proc_root.path(), 42),
            None,
            "the root is no container's"
        );
        assert_eq!(cgroup_of(proc_root.path(), 43), None);
    }
}
