//! The Kubernetes API source: pods on this node (field selector `spec.nodeName`) annotated
//! `tokentap.io/capture: "true"`. Session: the annotation `tokentap.io/session`, else
//! `<namespace>/<name>`. Cgroup: found from the pod's UID and QoS class in kubelet's layouts
//! ([`crate::kubelet_cgroup`]); a pod is often seen before kubelet made its cgroup, so each is
//! looked for until it appears (the pod's `tokentap await-capture` init container holds its
//! other containers back meanwhile).
//!
//! The watcher (kube-runtime) lists, then watches from the list's resourceVersion, and
//! relists after a dropped watch; each (re)list becomes a `Synced`.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::kubelet_cgroup::{find_pod_cgroup, QosClass};
use crate::workload::{Workload, WorkloadEvent, WorkloadKey};

pub const CAPTURE_ANNOTATION: &str = "tokentap.io/capture";
pub const SESSION_ANNOTATION: &str = "tokentap.io/session";

/// How often, and how long, a pod's cgroup is looked for after the pod is seen.
const CGROUP_POLL: Duration = Duration::from_millis(100);
const CGROUP_WAIT: Duration = Duration::from_secs(300);

pub struct KubernetesSourceConfig {
    /// Pods with `spec.nodeName` equal to this.
    pub node_name: String,
    /// The host's cgroup2 mount.
    pub cgroup_root: PathBuf,
    /// A kubeconfig file; `None`: the in-cluster service account, else ~/.kube/config.
    pub kubeconfig: Option<PathBuf>,
}

pub struct KubernetesSource {
    client: Client,
    api_url: String,
    node_name: String,
    cgroup_root: PathBuf,
}

/// A captured pod as read from the API.
#[derive(Debug, Clone)]
struct CapturedPod {
    uid: String,
    qos: Option<QosClass>,
    session: String,
    display: String,
}

impl KubernetesSource {
    pub async fn connect(config: KubernetesSourceConfig) -> anyhow::Result<KubernetesSource> {
        let kube_config = match &config.kubeconfig {
            Some(path) => {
                let file = kube::config::Kubeconfig::read_from(path).map_err(|e| {
                    anyhow::anyhow!("reading the kubeconfig {}: {e}", path.display())
                })?;
                kube::Config::from_custom_kubeconfig(file, &Default::default())
                    .await
                    .map_err(|e| anyhow::anyhow!("the kubeconfig {}: {e}", path.display()))?
            }
            None => kube::Config::infer().await.map_err(|e| {
                anyhow::anyhow!("no Kubernetes API configuration (not in a pod, no ~/.kube/config; give --kubeconfig): {e}")
            })?,
        };
        let api_url = kube_config.cluster_url.to_string();
        let client = Client::try_from(kube_config)?;
        Ok(KubernetesSource {
            client,
            api_url,
            node_name: config.node_name,
            cgroup_root: config.cgroup_root,
        })
    }

    /// Watches until `events` is closed. API errors are logged (once per kind of error) and
    /// retried with backoff, never returned.
    pub async fn run(self, events: mpsc::Sender<WorkloadEvent>) -> anyhow::Result<()> {
        let api: Api<Pod> = Api::all(self.client.clone());
        let config =
            watcher::Config::default().fields(&format!("spec.nodeName={}", self.node_name));
        let mut stream = watcher::watcher(api, config).default_backoff().boxed();
        // Pods whose cgroup is still being looked for, by UID.
        let mut pending: HashMap<String, JoinHandle<()>> = HashMap::new();
        let mut init: Vec<CapturedPod> = Vec::new();
        let mut last_error = String::new();
        while let Some(event) = stream.next().await {
            if events.is_closed() {
                break;
            }
            let event = match event {
                Ok(e) => {
                    last_error.clear();
                    e
                }
                Err(e) => {
                    let message = describe(&e, &self.api_url);
                    if message != last_error {
                        tracing::error!("{message}; retrying with backoff");
                        last_error = message;
                    }
                    continue;
                }
            };
            match event {
                Event::Init => init.clear(),
                Event::InitApply(pod) => init.extend(captured(&pod)),
                Event::InitDone => {
                    for (_, task) in pending.drain() {
                        task.abort();
                    }
                    let mut found = Vec::new();
                    for pod in std::mem::take(&mut init) {
                        match self.workload(&pod) {
                            Some(w) => found.push(w),
                            None => {
                                let uid = pod.uid.clone();
                                pending.insert(uid, self.await_cgroup(pod, events.clone()));
                            }
                        }
                    }
                    tracing::info!(pods = found.len(), waiting = pending.len(), node = %self.node_name, "Kubernetes: captured pods on this node");
                    if events.send(WorkloadEvent::Synced(found)).await.is_err() {
                        break;
                    }
                }
                Event::Apply(pod) => {
                    let uid = pod.metadata.uid.clone().unwrap_or_default();
                    pending.retain(|_, t| !t.is_finished());
                    match captured(&pod) {
                        Some(p) => {
                            // A pod whose cgroup is awaited already gets its Started then.
                            if let Entry::Vacant(slot) = pending.entry(uid) {
                                match self.workload(&p) {
                                    // Already-started pods are refreshed by the agent.
                                    Some(w) => {
                                        if events.send(WorkloadEvent::Started(w)).await.is_err() {
                                            break;
                                        }
                                    }
                                    None => {
                                        slot.insert(self.await_cgroup(p, events.clone()));
                                    }
                                }
                            }
                        }
                        None => {
                            if let Some(t) = pending.remove(&uid) {
                                t.abort();
                            }
                            if events
                                .send(WorkloadEvent::Stopped(WorkloadKey::pod(&uid)))
                                .await
                                .is_err()
                            {
                                break;
                            }
                        }
                    }
                }
                Event::Delete(pod) => {
                    let uid = pod.metadata.uid.clone().unwrap_or_default();
                    if let Some(t) = pending.remove(&uid) {
                        t.abort();
                    }
                    if events
                        .send(WorkloadEvent::Stopped(WorkloadKey::pod(&uid)))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        for (_, t) in pending {
            t.abort();
        }
        Ok(())
    }

    /// The workload, if the pod's cgroup exists now.
    fn workload(&self, pod: &CapturedPod) -> Option<Workload> {
        let cgroup = find_pod_cgroup(&self.cgroup_root, &pod.uid, pod.qos).ok()?;
        Some(Workload {
            key: WorkloadKey::pod(&pod.uid),
            cgroup,
            session: pod.session.clone(),
            display: pod.display.clone(),
        })
    }

    /// Looks for the pod's cgroup until it appears (then `Started`) or the wait runs out.
    fn await_cgroup(
        &self,
        pod: CapturedPod,
        events: mpsc::Sender<WorkloadEvent>,
    ) -> JoinHandle<()> {
        let root = self.cgroup_root.clone();
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + CGROUP_WAIT;
            loop {
                match find_pod_cgroup(&root, &pod.uid, pod.qos) {
                    Ok(cgroup) => {
                        let _ = events
                            .send(WorkloadEvent::Started(Workload {
                                key: WorkloadKey::pod(&pod.uid),
                                cgroup,
                                session: pod.session,
                                display: pod.display,
                            }))
                            .await;
                        return;
                    }
                    Err(e) if tokio::time::Instant::now() >= deadline => {
                        tracing::error!(pod = %pod.display, "{e} (waited {} s; is --cgroup-root the host's cgroup2 mount?)", CGROUP_WAIT.as_secs());
                        return;
                    }
                    Err(_) => tokio::time::sleep(CGROUP_POLL).await,
                }
            }
        })
    }
}

/// The pod, if it is to be captured now: annotated, not finished, with a UID.
fn captured(pod: &Pod) -> Option<CapturedPod> {
    let meta = &pod.metadata;
    let annotations = meta.annotations.as_ref();
    if annotations
        .and_then(|a| a.get(CAPTURE_ANNOTATION))
        .map(String::as_str)
        != Some("true")
    {
        return None;
    }
    let status = pod.status.as_ref();
    if matches!(
        status.and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    ) {
        return None;
    }
    let uid = meta.uid.clone()?;
    let namespace = meta.namespace.clone().unwrap_or_else(|| "default".into());
    let name = meta.name.clone().unwrap_or_default();
    let session = annotations
        .and_then(|a| a.get(SESSION_ANNOTATION))
        .filter(|s| !s.trim().is_empty())
        .cloned()
        .unwrap_or_else(|| format!("{namespace}/{name}"));
    Some(CapturedPod {
        uid,
        qos: status
            .and_then(|s| s.qos_class.as_deref())
            .and_then(QosClass::parse),
        session,
        display: format!("pod {namespace}/{name}"),
    })
}

/// One line on why the API could not be watched.
fn describe(e: &watcher::Error, url: &str) -> String {
    let text = e.to_string();
    let inner = match e {
        watcher::Error::InitialListFailed(k)
        | watcher::Error::WatchStartFailed(k)
        | watcher::Error::WatchFailed(k) => Some(k),
        _ => None,
    };
    match inner {
        Some(kube::Error::Api(status)) if status.code == 403 => format!(
            "the Kubernetes API at {url} forbids watching pods ({}): the node agent's service account needs get, list and watch on pods (deploy/kubernetes has the ClusterRole)",
            status.message
        ),
        Some(kube::Error::Api(status)) if status.code == 401 => format!(
            "the Kubernetes API at {url} rejected the agent's credentials ({})",
            status.message
        ),
        _ => format!("the Kubernetes API at {url} is unreachable or failing: {text}"),
    }
}
