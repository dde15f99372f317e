//! The Kubernetes source against the named API-server double (tests/src/kube_apiserver.rs),
//! with a temporary directory standing for the host's cgroup2 mount in kubelet's layouts.

use std::path::PathBuf;
use std::time::Duration;

use tokentap_e2e::kube_apiserver::KubeApiDouble;
use tokentap_node_agent::kubernetes::{KubernetesSource, KubernetesSourceConfig};
use tokentap_node_agent::{WorkloadEvent, WorkloadKey};
use tokio::sync::mpsc;

const NODE: &str = "node-a";
const UID_A: &str = "0b6f1d1e-2a3b-4c5d-8e9f-a0b1c2d3e4f5";
const UID_B: &str = "1c7e2f2e-3b4c-4d5e-9f0a-b1c2d3e4f5a6";
const UID_ELSEWHERE: &str = "2d8f3a3f-4c5d-4e6f-a0b1-c2d3e4f5a6b7";
const UID_PLAIN: &str = "3e9a4b4a-5d6e-4f7a-b1c2-d3e4f5a6b7c8";

fn captured(uid: &str, name: &str, node: &str, session: Option<&str>) -> serde_json::Value {
    let mut ann = vec![("tokentap.io/capture", "true")];
    if let Some(s) = session {
        ann.push(("tokentap.io/session", s));
    }
    KubeApiDouble::pod(uid, "rl", name, node, &ann, "Running", "Burstable")
}

struct Bed {
    api: Option<KubeApiDouble>,
    root: tempfile::TempDir,
    events: mpsc::Receiver<WorkloadEvent>,
    task: tokio::task::JoinHandle<()>,
}

impl Bed {
    fn api(&self) -> &KubeApiDouble {
        self.api.as_ref().unwrap()
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn bed(api: KubeApiDouble, root: tempfile::TempDir) -> Bed {
    let kubeconfig = api.kubeconfig(root.path());
    let source = KubernetesSource::connect(KubernetesSourceConfig {
        node_name: NODE.into(),
        cgroup_root: root.path().join("cgroup"),
        kubeconfig: Some(kubeconfig),
    })
    .await
    .unwrap();
    let (tx, events) = mpsc::channel(64);
    let task = tokio::spawn(async move {
        let _ = source.run(tx).await;
    });
    Bed {
        api: Some(api),
        root,
        events,
        task,
    }
}

fn make_pod_cgroup(root: &tempfile::TempDir, uid: &str) -> PathBuf {
    let rel = PathBuf::from(format!("kubepods/burstable/pod{uid}"));
    std::fs::create_dir_all(root.path().join("cgroup").join(&rel)).unwrap();
    rel
}

async fn next(bed: &mut Bed) -> WorkloadEvent {
    tokio::time::timeout(Duration::from_secs(10), bed.events.recv())
        .await
        .expect("an event within 10 s")
        .expect("the source is running")
}

async fn no_event(bed: &mut Bed) {
    if let Ok(e) = tokio::time::timeout(Duration::from_millis(500), bed.events.recv()).await {
        panic!("unexpected event {e:?}");
    }
}

#[tokio::test]
async fn captured_pods_on_this_node_are_reported_with_their_cgroup_and_session() {
    let api = KubeApiDouble::start().await;
    let root = tempfile::tempdir().unwrap();
    let rel_a = make_pod_cgroup(&root, UID_A);
    api.apply(captured(UID_A, "agent-a", NODE, Some("task-7/sample-3")));
    api.apply(captured(UID_ELSEWHERE, "agent-x", "node-b", None));
    api.apply(KubeApiDouble::pod(
        UID_PLAIN,
        "rl",
        "plain",
        NODE,
        &[],
        "Running",
        "Burstable",
    ));
    let mut bed = bed(api, root).await;

    let WorkloadEvent::Synced(list) = next(&mut bed).await else {
        panic!("a Synced first")
    };
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0].key, WorkloadKey::pod(UID_A));
    assert_eq!(list[0].cgroup, rel_a);
    assert_eq!(list[0].session, "task-7/sample-3");
    assert_eq!(list[0].display, "pod rl/agent-a");

    // A new pod whose cgroup kubelet makes 300 ms later: Started once it exists; the default
    // session is namespace/name.
    bed.api().apply(captured(UID_B, "agent-b", NODE, None));
    let root = bed.root.path().to_owned();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        std::fs::create_dir_all(root.join(format!("cgroup/kubepods/burstable/pod{UID_B}")))
            .unwrap();
    });
    let WorkloadEvent::Started(b) = next(&mut bed).await else {
        panic!("Started for b")
    };
    assert_eq!(b.session, "rl/agent-b");
    assert_eq!(
        b.cgroup,
        PathBuf::from(format!("kubepods/burstable/pod{UID_B}"))
    );

    // Finished → Stopped; deleted → Stopped; another node's and unannotated pods: nothing.
    bed.api().apply(KubeApiDouble::pod(
        UID_A,
        "rl",
        "agent-a",
        NODE,
        &[("tokentap.io/capture", "true")],
        "Succeeded",
        "Burstable",
    ));
    assert_eq!(
        next(&mut bed).await,
        WorkloadEvent::Stopped(WorkloadKey::pod(UID_A))
    );
    bed.api().delete(UID_B);
    assert_eq!(
        next(&mut bed).await,
        WorkloadEvent::Stopped(WorkloadKey::pod(UID_B))
    );
    bed.api()
        .apply(captured(UID_ELSEWHERE, "agent-x", "node-b", Some("s")));
    no_event(&mut bed).await;
}

#[tokio::test]
async fn an_api_server_that_comes_back_empty_gives_a_fresh_synced_list() {
    let api = KubeApiDouble::start().await;
    let addr = api.addr;
    let root = tempfile::tempdir().unwrap();
    make_pod_cgroup(&root, UID_A);
    api.apply(captured(UID_A, "agent-a", NODE, None));
    let mut bed = bed(api, root).await;
    assert!(matches!(next(&mut bed).await, WorkloadEvent::Synced(l) if l.len() == 1));

    // The API server goes away and comes back empty (a new one on the same address): the
    // watch resumes from a version it never issued, gets 410, and lists again.
    bed.api.take().unwrap().stop();
    tokio::time::sleep(Duration::from_millis(500)).await;
    bed.api = Some(KubeApiDouble::start_at(addr).await);
    match next(&mut bed).await {
        WorkloadEvent::Synced(l) => assert!(l.is_empty(), "{l:?}"),
        other => panic!("{other:?} before a fresh Synced"),
    }
}

#[tokio::test]
async fn an_api_unreachable_at_start_is_retried_until_it_answers() {
    let port = tokentap_e2e::procs::free_port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let root = tempfile::tempdir().unwrap();
    make_pod_cgroup(&root, UID_A);
    // A double whose address is noted, then stopped: the source starts against nothing.
    let placeholder = KubeApiDouble::start_at(addr).await;
    let kubeconfig = placeholder.kubeconfig(root.path());
    placeholder.stop();
    let source = KubernetesSource::connect(KubernetesSourceConfig {
        node_name: NODE.into(),
        cgroup_root: root.path().join("cgroup"),
        kubeconfig: Some(kubeconfig),
    })
    .await
    .unwrap();
    let (tx, mut events) = mpsc::channel(64);
    let task = tokio::spawn(async move {
        let _ = source.run(tx).await;
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let api = KubeApiDouble::start_at(addr).await;
    api.apply(captured(UID_A, "agent-a", NODE, None));
    let e = tokio::time::timeout(Duration::from_secs(30), events.recv())
        .await
        .expect("connected once the API came up")
        .unwrap();
    assert!(matches!(e, WorkloadEvent::Synced(_)), "{e:?}");
    task.abort();
}
