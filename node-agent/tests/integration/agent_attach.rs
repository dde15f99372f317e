//! The agent against the real kernel (root): one loaded program attached to several cgroups,
//! connects from nested cgroups attributed to their workload, the capture parent covering
//! cgroups made after it, detach on stop, and nothing redirected outside tracked cgroups.
//! Connections are made by real `bash` processes placed in the cgroups; the "listener" is a
//! plain TCP listener standing where the transparent listener would.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokentap_cgroup::cgroup2_mount;
use tokentap_ebpf::{Redirect, RedirectConfig};
use tokentap_node_agent::agent::{Agent, ContainerLookup};
use tokentap_node_agent::{Workload, WorkloadEvent, WorkloadKey};
use tokentap_proxy::transparent::{Attribution, Redirections};

/// The port connects are made to (and redirected from): nothing listens on it.
const PORT: u16 = 18443;

/// Cgroups made under the cgroup2 root for one test; removed deepest first.
struct TestTree {
    root: PathBuf,
    top: PathBuf,
}

impl TestTree {
    fn new(name: &str) -> TestTree {
        let root = cgroup2_mount().unwrap();
        let top = root.join(format!("tokentap-agent-test-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&top).unwrap();
        TestTree { root, top }
    }

    fn make(&self, rel: &str) -> PathBuf {
        let d = self.top.join(rel);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// `rel` relative to the cgroup2 root, as sources report it.
    fn relative(&self, rel: &str) -> PathBuf {
        self.top
            .join(rel)
            .strip_prefix(&self.root)
            .unwrap()
            .to_owned()
    }
}

impl Drop for TestTree {
    fn drop(&mut self) {
        let mut dirs: Vec<PathBuf> = walk(&self.top);
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for d in dirs {
            let _ = std::fs::remove_dir(d);
        }
    }
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut out = vec![d.to_owned()];
    for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(walk(&e.path()));
        }
    }
    out
}

/// A `bash` in `cgroup` that connects to 127.0.0.1:PORT and writes a line; killed on drop.
struct Connector(std::process::Child);

impl Drop for Connector {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn connect_from(cgroup: &Path) -> Connector {
    use std::os::unix::process::CommandExt;
    let procs = cgroup.join("cgroup.procs");
    let mut cmd = std::process::Command::new("bash");
    cmd.arg("-c").arg(format!(
        "exec 3<>/dev/tcp/127.0.0.1/{PORT} && echo hello >&3 && sleep 2"
    ));
    cmd.stderr(std::process::Stdio::null());
    // SAFETY: writes one file between fork and exec.
    unsafe {
        cmd.pre_exec(move || std::fs::write(&procs, "0"));
    }
    Connector(cmd.spawn().unwrap())
}

fn workload(key: &str, cgroup: PathBuf, session: &str) -> Workload {
    Workload {
        key: WorkloadKey::pod(key),
        cgroup,
        session: session.into(),
        display: format!("pod test/{key}"),
    }
}

struct Setup {
    agent: Arc<Agent>,
    listener: tokio::net::TcpListener,
}

async fn setup(root: &Path, parent: Option<(&Path, Arc<dyn ContainerLookup>)>) -> Setup {
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let redirect = Redirect::load(&RedirectConfig {
        listener: SocketAddrV4::new(Ipv4Addr::LOCALHOST, port),
        listener_v6: None,
        ports: vec![PORT],
    })
    .unwrap();
    let mut agent = Agent::new(redirect, root.to_owned());
    if let Some((rel, lookup)) = parent {
        agent = agent.with_capture_parent(rel, lookup).unwrap();
    }
    Setup {
        agent: Arc::new(agent),
        listener,
    }
}

/// The next redirected connection's attribution, or None if none arrives in time.
async fn next_attribution(s: &Setup) -> Option<Attribution> {
    let (conn, peer) = tokio::time::timeout(Duration::from_secs(3), s.listener.accept())
        .await
        .ok()?
        .unwrap();
    let r = s.agent.redirection(&conn, peer).await?;
    assert_eq!(
        r.destination,
        SocketAddr::from((Ipv4Addr::LOCALHOST, PORT)),
        "the original destination"
    );
    Some(r.attribution)
}

/// Asserts the connect from `c` was not redirected: it went to 127.0.0.1:PORT, where nothing
/// listens, so bash failed at once; and nothing reached the listener.
async fn assert_not_redirected(s: &Setup, mut c: Connector, why: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let status = loop {
        if let Some(status) = c.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{why}: the connect was not refused"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(!status.success(), "{why}: the connect succeeded");
    let pending = tokio::time::timeout(Duration::from_millis(50), s.listener.accept()).await;
    assert!(pending.is_err(), "{why}: a connection reached the listener");
}

fn privileged() -> bool {
    tokentap_e2e::privileged::runs(tokentap_e2e::privileged::root_with_cgroup2())
}

#[tokio::test]
async fn connects_from_a_workload_and_its_sub_cgroups_carry_its_session_until_it_stops() {
    if !privileged() {
        return;
    }
    let tree = TestTree::new("own");
    let s = setup(&tree.root, None).await;
    let pod_a = tree.make("kubepods/burstable/poda");
    let container_a = tree.make("kubepods/burstable/poda/c1");
    let pod_b = tree.make("kubepods/burstable/podb");
    let outside = tree.make("not-tracked");
    s.agent.apply(
        "pod:",
        WorkloadEvent::Synced(vec![
            workload("a", tree.relative("kubepods/burstable/poda"), "ns/a"),
            workload("b", tree.relative("kubepods/burstable/podb"), "ns/b"),
        ]),
    );
    assert_eq!(s.agent.workloads().len(), 2);

    let c = connect_from(&container_a);
    assert_eq!(
        next_attribution(&s).await,
        Some(Attribution::Session("ns/a".into())),
        "a container cgroup below the pod's"
    );
    drop(c);
    let c = connect_from(&pod_b);
    assert_eq!(
        next_attribution(&s).await,
        Some(Attribution::Session("ns/b".into()))
    );
    drop(c);
    assert_not_redirected(&s, connect_from(&outside), "an untracked cgroup").await;

    // A Synced list without b detaches b; Stopped detaches a.
    s.agent.apply(
        "pod:",
        WorkloadEvent::Synced(vec![workload(
            "a",
            tree.relative("kubepods/burstable/poda"),
            "ns/a",
        )]),
    );
    assert_not_redirected(&s, connect_from(&pod_b), "b, detached").await;
    s.agent
        .apply("pod:", WorkloadEvent::Stopped(WorkloadKey::pod("a")));
    assert_not_redirected(&s, connect_from(&pod_a), "a, detached").await;
    assert!(s.agent.workloads().is_empty());
}

#[tokio::test]
async fn a_missing_cgroup_or_one_outside_the_root_is_refused_and_counted() {
    if !privileged() {
        return;
    }
    let tree = TestTree::new("missing");
    let s = setup(&tree.root, None).await;
    s.agent
        .start(workload("gone", tree.relative("no-such-pod"), "x"));
    s.agent
        .start(workload("escape", PathBuf::from("../../etc"), "x"));
    assert!(s.agent.workloads().is_empty());
    assert_eq!(s.agent.counts().attach_errors, 2);
}

/// A named test double of the Docker source's lookup: containers `cap…` are labelled for
/// capture (session `from-label`), others are not.
struct LookupDouble;

#[async_trait::async_trait]
impl ContainerLookup for LookupDouble {
    fn container_id<'a>(&self, cgroup_name: &'a str) -> Option<&'a str> {
        Some(cgroup_name)
    }
    async fn identify(&self, id: &str) -> anyhow::Result<Option<Workload>> {
        Ok(id.starts_with("cap").then(|| Workload {
            key: WorkloadKey::container(id),
            cgroup: PathBuf::new(),
            session: "from-label".into(),
            display: format!("container {id}"),
        }))
    }
}

#[tokio::test]
async fn the_capture_parent_redirects_cgroups_made_after_it_and_names_them_by_lookup() {
    if !privileged() {
        return;
    }
    let tree = TestTree::new("parent");
    let parent = tree.relative("capture");
    let s = setup(&tree.root, Some((&parent, Arc::new(LookupDouble)))).await;
    // Made after the parent was attached, and never reported by a source.
    let captured = tree.make("capture/cap1");
    let ignored = tree.make("capture/plain1");
    let c = connect_from(&captured);
    assert_eq!(
        next_attribution(&s).await,
        Some(Attribution::Session("from-label".into()))
    );
    drop(c);
    let c = connect_from(&ignored);
    assert_eq!(
        next_attribution(&s).await,
        Some(Attribution::NotCaptured),
        "redirected (below the parent), but passed through"
    );
    drop(c);
}
