//! Starts the node agent's workload sources (Docker Engine API, Kubernetes API), each feeding
//! one channel of (source, event).

use std::path::PathBuf;
use std::sync::Arc;

use crate::agent::ContainerLookup;
use crate::docker::{DockerSource, DockerSourceConfig};
use crate::kubernetes::{KubernetesSource, KubernetesSourceConfig};
use crate::WorkloadEvent;

/// Where workloads come from (with the `clap` feature, `--source`'s values).
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Containers labelled tokentap.io/capture=true (Docker Engine API; Podman's socket too).
    Docker,
    /// Pods on this node annotated tokentap.io/capture: "true".
    Kubernetes,
}

/// What the sources need to know of the host.
pub struct SourceOptions {
    pub docker_host: String,
    pub node_name: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub cgroup_root: PathBuf,
}

/// The running sources; stopped when dropped.
pub struct Sources {
    /// The Docker source's lookup, for containers under the capture parent.
    pub container_lookup: Option<Arc<dyn ContainerLookup>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Sources {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Starts `sources`, each feeding `events`.
pub async fn start(
    sources: &[Source],
    options: &SourceOptions,
    events: tokio::sync::mpsc::Sender<(Source, WorkloadEvent)>,
) -> anyhow::Result<Sources> {
    let mut started = Sources {
        container_lookup: None,
        tasks: Vec::new(),
    };
    for &source in sources {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<WorkloadEvent>(256);
        match source {
            Source::Docker => {
                let docker = DockerSource::new(DockerSourceConfig {
                    host: options.docker_host.clone(),
                    proc_root: "/proc".into(),
                })?;
                started.container_lookup = Some(Arc::new(docker.clone()));
                started.tasks.push(tokio::spawn(async move {
                    let _ = docker.run(tx).await;
                }));
            }
            Source::Kubernetes => {
                let node_name = options.node_name.clone().ok_or_else(|| {
                    anyhow::anyhow!("--source kubernetes needs --node-name (or NODE_NAME)")
                })?;
                let kube = KubernetesSource::connect(KubernetesSourceConfig {
                    node_name,
                    cgroup_root: options.cgroup_root.clone(),
                    kubeconfig: options.kubeconfig.clone(),
                })
                .await?;
                started.tasks.push(tokio::spawn(async move {
                    let _ = kube.run(tx).await;
                }));
            }
        }
        let events = events.clone();
        started.tasks.push(tokio::spawn(async move {
            while let Some(e) = rx.recv().await {
                if events.send((source, e)).await.is_err() {
                    return;
                }
            }
        }));
    }
    Ok(started)
}
