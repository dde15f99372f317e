//! `tokentap node-agent` with real containers: a dockerd of the test's own on a bridge the
//! test creates, images assembled offline, the real kernel's eBPF redirect, real curl and a
//! real Codex inside containers. Hard-coded endpoints are faked with `--add-host` to the
//! bridge's host address, where the agent listens; the engine is the scripted test double or
//! the tiny model on llama-server, on loopback.

use std::time::Duration;

use serde_json::json;
use tokentap_e2e::checks::{assert_complete_token_data, assert_token_data_present};
use tokentap_e2e::containers::{requirement, Dockerd, BASE_IMAGE};
use tokentap_e2e::node_agent::NodeAgent;
use tokentap_e2e::privileged::runs;
use tokentap_e2e::procs::free_port;
use tokentap_e2e::scripted::{always, Reply, ScriptedBackend, Tokens};

const ENGINE_TEXT: &str = "captured in a container";

/// The capture parent of this test process (a real agent on the machine keeps its own).
fn parent() -> String {
    format!("/tokentap-capture-test-{}", std::process::id())
}

struct Bed {
    dockerd: Dockerd,
    agent: NodeAgent,
    _backend: ScriptedBackend,
    dir: tempfile::TempDir,
    port: u16,
    /// Last: dropped after dockerd and the agent are gone.
    _parent: ParentCgroups,
}

/// Removes the capture parent dockerd made in every cgroup hierarchy (v1 controllers and the
/// unified one) once the containers under it are gone, so a test run leaves no cgroup behind.
struct ParentCgroups;

impl Drop for ParentCgroups {
    fn drop(&mut self) {
        let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else {
            return;
        };
        for h in hierarchies.flatten() {
            // `remove_dir` only: a cgroup with processes or children is left as it is.
            let _ = std::fs::remove_dir(h.path().join(parent().trim_start_matches('/')));
        }
    }
}

async fn bed(extra: &[&str]) -> Bed {
    let dockerd = Dockerd::start().await;
    dockerd.import_base_image();
    let backend = ScriptedBackend::start(Tokens::Fake, always(Reply::text(ENGINE_TEXT))).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut args: Vec<String> = [
        "--source",
        "docker",
        "--docker-host",
        &dockerd.host(),
        "--listen-ip",
        &dockerd.gateway().to_string(),
        "--listen-port",
        &port.to_string(),
        "--backend",
        &backend.url,
        "--backend-kind",
        "vllm",
        "--docker-cgroup-parent",
        &parent(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let agent = NodeAgent::start(dir.path(), "agent.log", &args).await;
    Bed {
        dockerd,
        agent,
        _backend: backend,
        dir,
        port,
        _parent: ParentCgroups,
    }
}

impl Bed {
    /// `docker run --rm` of the base image with the CA and tokentap mounted and
    /// api.openai.com at the agent's address; returns (exit code, stdout, stderr).
    fn run(&self, opts: &[&str], script: &str) -> (i32, String, String) {
        let ca = self.agent.ca_dir.display().to_string();
        let bin = tokentap_e2e::artefacts::tokentap_bin();
        let mut args: Vec<String> = vec![
            "run".into(),
            "--rm".into(),
            "--add-host".into(),
            format!("api.openai.com:{}", self.dockerd.gateway()),
            "-v".into(),
            format!("{ca}:/ca:ro"),
            "-v".into(),
            format!("{}:/usr/local/bin/tokentap:ro", bin.display()),
        ];
        args.extend(opts.iter().map(|s| s.to_string()));
        args.extend([BASE_IMAGE.into(), "sh".into(), "-c".into(), script.into()]);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.dockerd.run(&refs);
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}

/// A chat call to the hard-coded endpoint, trusting the agent's CA; prints the body.
fn curl_chat(key: &str) -> String {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    format!(
        "curl -sS --max-time 20 --cacert /ca/ca.pem https://api.openai.com/v1/chat/completions -H 'content-type: application/json' -H 'authorization: Bearer {key}' -d '{body}'"
    )
}

fn ready() -> bool {
    runs(requirement())
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_node_agent_captures_labelled_containers_and_nothing_else() {
    if !ready() {
        return;
    }
    let bed = bed(&[]).await;
    let pid = std::process::id();
    let key = "sk-e2e-node-agent-5d1e";

    // 1. Under the capture parent: the very first instruction is a model call, and it is
    //    captured (the parent was attached before the container existed).
    let (code, out, err) = bed.run(
        &[
            "--cgroup-parent",
            &parent(),
            "--label",
            "tokentap.io/capture=true",
            "--label",
            &format!("tokentap.io/session=e2e-parent-{pid}"),
        ],
        &curl_chat(key),
    );
    assert_eq!(
        code,
        0,
        "stdout {out}\nstderr {err}\n{}",
        bed.agent.log_tail(20)
    );
    assert!(out.contains(ENGINE_TEXT), "{out}");

    // 2. Labelled, started anywhere: attached on its start event; `tokentap await-capture`
    //    (what the webhook injects) returns once its connects are redirected. Its session is
    //    its name.
    let name = format!("e2e-named-{pid}");
    let (code, out, err) = bed.run(
        &["--name", &name, "--label", "tokentap.io/capture=true"],
        &format!("tokentap await-capture --timeout 20 && {}", curl_chat(key)),
    );
    assert_eq!(
        code,
        0,
        "stdout {out}\nstderr {err}\n{}",
        bed.agent.log_tail(20)
    );
    assert!(
        err.contains(&format!("captured (session \"{name}\")")),
        "{err}"
    );
    assert!(out.contains(ENGINE_TEXT), "{out}");

    // The real api.openai.com of this fake network: a TLS server of the test's own on the
    // bridge address, port 443, that answers "origin".
    let _origin = tokentap_e2e::transparent::OwnTlsServer::start(
        &format!("{}:443", bed.dockerd.gateway()),
        "api.openai.com",
        "origin",
    )
    .await;
    let insecure = curl_chat(key).replace("--cacert /ca/ca.pem", "-k");
    // 3. Unlabelled, outside the parent: not redirected; it reaches the origin.
    let (code, out, err) = bed.run(&[], &insecure);
    assert_eq!((code, out.as_str()), (0, "origin"), "{err}");
    // 4. Unlabelled under the parent: redirected (the parent covers it) but spliced through
    //    untouched to the origin.
    let (code, out, err) = bed.run(&["--cgroup-parent", &parent()], &insecure);
    assert_eq!(
        (code, out.as_str()),
        (0, "origin"),
        "{err}\n{}",
        bed.agent.log_tail(10)
    );

    let records = bed.agent.wait_records(2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let records_now = bed.agent.records();
    assert_eq!(
        records_now.len(),
        2,
        "exactly the two labelled containers' calls"
    );
    let mut sessions: Vec<&str> = records.iter().map(|r| r.session_id.as_str()).collect();
    sessions.sort();
    let mut want = vec![format!("e2e-parent-{pid}"), name.clone()];
    want.sort();
    assert_eq!(sessions, want);
    for r in &records {
        assert_eq!(r.request.headers["host"], "api.openai.com");
        assert_eq!(r.response_status, 200, "{:?}", r.error);
        assert_token_data_present(r);
        let text = serde_json::to_string(r).unwrap();
        assert!(!text.contains(key), "the API key reached a record");
    }
    // Ended containers are detached and forgotten.
    bed.agent
        .wait_workloads("ended containers forgotten", Duration::from_secs(10), |w| {
            w.is_empty()
        })
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_node_agent_killed_detaches_everything_and_a_restart_reattaches_running_containers() {
    if !ready() {
        return;
    }
    let mut bed = bed(&[]).await;
    let pid = std::process::id();
    let name = format!("e2e-long-{pid}");
    bed.dockerd.ok(&[
        "run",
        "-d",
        "--name",
        &name,
        "--label",
        "tokentap.io/capture=true",
        "--add-host",
        &format!("api.openai.com:{}", bed.dockerd.gateway()),
        "-v",
        &format!("{}:/ca:ro", bed.agent.ca_dir.display()),
        BASE_IMAGE,
        "sleep",
        "300",
    ]);
    bed.agent
        .wait_workloads(
            "the running container attached",
            Duration::from_secs(10),
            |w| {
                w.iter()
                    .any(|x| x["display"] == format!("container {name}"))
            },
        )
        .await;
    let exec = |bed: &Bed| {
        let out = bed
            .dockerd
            .run(&["exec", &name, "sh", "-c", &curl_chat("sk-x")]);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    // The original destination (api.openai.com is the bridge's gateway here, port 443): a
    // plain TCP server that counts who reaches it. While attached nothing does.
    let original = tokio::net::TcpListener::bind((bed.dockerd.gateway(), 443))
        .await
        .expect("port 443 on the test's own bridge gateway");
    let reached = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    {
        let reached = reached.clone();
        tokio::spawn(async move {
            while let Ok((c, _)) = original.accept().await {
                reached.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(c);
            }
        });
    }
    let (code, out) = exec(&bed);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(bed.agent.wait_records(1).await.len(), 1);
    assert_eq!(
        reached.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "an attached container's call reached the original destination"
    );

    // kill -9: the links die with the agent's file descriptors; nothing stays attached, and
    // the container's connection reaches where it was addressed (not a dead redirect).
    bed.agent.kill();
    let (code, _) = exec(&bed);
    assert_ne!(code, Some(0), "a plain TCP server cannot answer TLS");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while reached.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the killed agent's container never reached the original destination"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // A new agent (same spool) finds the running container and attaches it again.
    let args: Vec<String> = [
        "--source",
        "docker",
        "--docker-host",
        &bed.dockerd.host(),
        "--listen-ip",
        &bed.dockerd.gateway().to_string(),
        "--listen-port",
        &bed.port.to_string(),
        "--backend",
        &bed._backend.url,
        "--backend-kind",
        "vllm",
        "--docker-cgroup-parent",
        &parent(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    bed.agent = NodeAgent::start(bed.dir.path(), "agent-2.log", &args).await;
    bed.agent
        .wait_workloads("re-attached after restart", Duration::from_secs(10), |w| {
            w.iter()
                .any(|x| x["display"] == format!("container {name}"))
        })
        .await;
    let (code, out) = exec(&bed);
    assert_eq!(code, Some(0), "{out}");
    let records = bed.agent.wait_records(2).await;
    assert!(records.iter().all(|r| r.session_id == name));

    // Removing the container detaches it.
    bed.dockerd.ok(&["rm", "-f", &name]);
    bed.agent
        .wait_workloads(
            "removed container forgotten",
            Duration::from_secs(10),
            |w| w.is_empty(),
        )
        .await;
}

/// The agent's listener sits on an address other networks reach. Attacks: a client that was
/// not redirected (here, the host itself) asks it for an intercepted host; a container asks
/// it, through a redirected connect to its own loopback, for the host's loopback.
#[tokio::test(flavor = "multi_thread")]
async fn heavy_node_agent_listener_serves_only_redirected_connections_and_never_the_hosts_loopback()
{
    if !ready() {
        return;
    }
    // A service on the host's loopback, on a port the agent redirects: it answers, so a
    // container that reached it would print its secret.
    let secret = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let secret_port = secret.local_addr().unwrap().port();
    let bed = bed(&[
        "--redirect-port",
        "443",
        "--redirect-port",
        &secret_port.to_string(),
    ])
    .await;
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    {
        let accepted = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = secret.accept().await {
                use tokio::io::AsyncWriteExt;
                accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let _ = c
                    .write_all(b"HTTP/1.0 200 OK\r\ncontent-length: 11\r\n\r\nhost-secret")
                    .await;
            }
        });
    }
    // Positive control: from the host, the service answers.
    let from_host = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5"])
        .arg(format!("http://127.0.0.1:{secret_port}/"))
        .output()
        .unwrap();
    assert_eq!(
        from_host.stdout, b"host-secret",
        "the host reaches its own service"
    );
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
    // 1. From the host, not redirected: TLS for api.openai.com straight at the listener.
    let gw = bed.dockerd.gateway();
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "-k", "--resolve"])
        .arg(format!("api.openai.com:{}:{gw}", bed.port))
        .arg(format!("https://api.openai.com:{}/v1/models", bed.port))
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "an unredirected client was served: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // 2. A captured container connects to its own loopback on a redirected port.
    let (code, out, err) = bed.run(
        &[
            "--label",
            "tokentap.io/capture=true",
            "--cgroup-parent",
            &parent(),
        ],
        &format!("curl -sS --max-time 5 http://127.0.0.1:{secret_port}/"),
    );
    assert_ne!(code, 0, "the container reached something: {out} {err}");
    assert!(!out.contains("host-secret"), "{out}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "a container reached the host's loopback through the agent"
    );
    assert!(
        bed.agent.records().is_empty(),
        "nothing here is a model call"
    );
}

/// A real harness in a container: Codex (a static binary, bind-mounted from the setup cache)
/// with its default https://api.openai.com, against the tiny model on llama-server.
#[tokio::test(flavor = "multi_thread")]
async fn heavy_node_agent_codex_in_a_container_is_captured_with_token_ids() {
    if !ready() {
        return;
    }
    let llama = tokentap_e2e::llama::LlamaServer::shared().await;
    let (_, codex) = tokentap_e2e::artefacts::Artefacts::require_harness("codex");
    let codex = std::fs::canonicalize(&codex).unwrap();
    // The npm launcher is a node script; the native binary sits beside it in the package.
    let native = codex
        .ancestors()
        .find(|p| p.join("node_modules/@openai").exists())
        .map(|p| p.join("node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| panic!("no native Codex binary near {}", codex.display()));
    // Declared first, dropped last: after dockerd and the agent are gone.
    let _parent = ParentCgroups;
    let dockerd = Dockerd::start().await;
    dockerd.import_base_image();
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let args: Vec<String> = [
        "--source",
        "docker",
        "--docker-host",
        &dockerd.host(),
        "--listen-ip",
        &dockerd.gateway().to_string(),
        "--listen-port",
        &port.to_string(),
        "--backend",
        &llama.url,
        "--backend-kind",
        "llamacpp",
        "--docker-cgroup-parent",
        &parent(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let agent = NodeAgent::start(dir.path(), "agent.log", &args).await;
    let home = dir.path().join("home");
    std::fs::create_dir_all(home.join(".codex")).unwrap();
    std::fs::write(
        home.join(".codex/config.toml"),
        "model = \"m\"\ncheck_for_update_on_startup = false\n",
    )
    .unwrap();
    let session = format!("e2e-codex-container-{}", std::process::id());
    let out = dockerd.run(&[
        "run",
        "--rm",
        "--cgroup-parent",
        &parent(),
        "--label",
        "tokentap.io/capture=true",
        "--label",
        &format!("tokentap.io/session={session}"),
        "--add-host",
        &format!("api.openai.com:{}", dockerd.gateway()),
        "-v",
        &format!("{}:/ca:ro", agent.ca_dir.display()),
        "-v",
        &format!("{}:/codex:ro", native.display()),
        "-v",
        &format!("{}:/home/agent", home.display()),
        "-e",
        "HOME=/home/agent",
        "-e",
        "OPENAI_API_KEY=sk-e2e-codex-container",
        "-e",
        "CODEX_CA_CERTIFICATE=/ca/ca.pem",
        "-e",
        "SSL_CERT_FILE=/ca/ca.pem",
        "-w",
        "/tmp",
        BASE_IMAGE,
        "/codex/bin/codex",
        "exec",
        "--skip-git-repo-check",
        "-s",
        "danger-full-access",
        "say hi",
    ]);
    assert!(
        out.status.success(),
        "codex in a container: {}\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        agent.log_tail(20)
    );
    let records = agent.wait_records(1).await;
    for r in &records {
        assert_eq!(r.session_id, session);
        assert_eq!(r.request.path, "/v1/responses");
        assert_eq!(r.response_status, 200, "{:?}", r.error);
        assert_complete_token_data(r);
    }
}

/// The Kubernetes source end to end: a real container placed in a kubelet-shaped pod cgroup
/// (`--cgroup-parent kubepods/burstable/pod<uid>`, as kubelet's cgroupfs driver lays pods out),
/// the pod served by the named API-server double, and the pod's first step the init container
/// the webhook injects (`tokentap await-capture`), which returns once the agent has attached
/// the pod's cgroup.
#[tokio::test(flavor = "multi_thread")]
async fn heavy_node_agent_kubernetes_pod_is_captured_after_await_capture() {
    if !ready() {
        return;
    }
    use tokentap_e2e::kube_apiserver::KubeApiDouble;
    // Declared first, dropped last: after dockerd and the agent are gone.
    let _parent = ParentCgroups;
    let dockerd = Dockerd::start().await;
    dockerd.import_base_image();
    let backend = ScriptedBackend::start(Tokens::Fake, always(Reply::text(ENGINE_TEXT))).await;
    let api = KubeApiDouble::start().await;
    let dir = tempfile::tempdir().unwrap();
    let pid = std::process::id();
    // A UID of this process's own, so no real kubelet's pod is touched.
    let uid = format!("7e57{:04x}-0000-4000-8000-{:012x}", pid & 0xffff, pid);
    let session = format!("rl/sample-{pid}");
    let port = free_port();
    let args: Vec<String> = [
        "--source",
        "kubernetes",
        "--node-name",
        "test-node",
        "--kubeconfig",
        api.kubeconfig(dir.path()).to_str().unwrap(),
        "--listen-ip",
        &dockerd.gateway().to_string(),
        "--listen-port",
        &port.to_string(),
        "--backend",
        &backend.url,
        "--backend-kind",
        "vllm",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let agent = NodeAgent::start(dir.path(), "agent.log", &args).await;
    api.apply(KubeApiDouble::pod(
        &uid,
        "rl",
        "sample",
        "test-node",
        &[
            ("tokentap.io/capture", "true"),
            ("tokentap.io/session", &session),
        ],
        "Pending",
        "Burstable",
    ));
    let pod_parent = format!("/kubepods/burstable/pod{uid}");
    let out = dockerd.run(&[
        "run",
        "--rm",
        "--cgroup-parent",
        &pod_parent,
        "--add-host",
        &format!("api.openai.com:{}", dockerd.gateway()),
        "-v",
        &format!("{}:/ca:ro", agent.ca_dir.display()),
        "-v",
        &format!(
            "{}:/usr/local/bin/tokentap:ro",
            tokentap_e2e::artefacts::tokentap_bin().display()
        ),
        BASE_IMAGE,
        "sh",
        "-c",
        &format!(
            "tokentap await-capture --timeout 30 && {}",
            curl_chat("sk-pod")
        ),
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "{stdout}\n{stderr}\n{}",
        agent.log_tail(20)
    );
    assert!(
        stderr.contains(&format!("captured (session {session:?})")),
        "{stderr}"
    );
    assert!(stdout.contains(ENGINE_TEXT), "{stdout}");
    let records = agent.wait_records(1).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].session_id, session);
    assert_token_data_present(&records[0]);
    // The pod ends: detached and forgotten.
    api.delete(&uid);
    agent
        .wait_workloads("deleted pod forgotten", Duration::from_secs(10), |w| {
            w.is_empty()
        })
        .await;
    drop(dockerd);
    // The kubelet-shaped cgroups the test's container left.
    let root = tokentap_ebpf_root();
    for d in [
        root.join(format!("kubepods/burstable/pod{uid}")),
        root.join("kubepods/burstable"),
        root.join("kubepods"),
    ] {
        let _ = std::fs::remove_dir(d);
    }
}

fn tokentap_ebpf_root() -> std::path::PathBuf {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"cgroup2")).then(|| std::path::PathBuf::from(f[1]))
        })
        .expect("a cgroup2 mount")
}
