//! Transparent capture with the real kernel program, real TLS clients and real harnesses (root;
//! loopback only). Hard-coded endpoints are faked by mapping api.openai.com and friends to
//! 127.0.0.x in a private mount namespace where nothing else resolves; nothing listens on
//! those addresses, so a connect that is not redirected is refused.

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use tokentap_e2e::checks::{assert_complete_token_data, assert_key_absent};
use tokentap_e2e::harness::{harness_command, run, HarnessDirs, HARNESS_LIMIT};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::procs::{spawn_guarded_split, KillScope};
use tokentap_e2e::scripted::{always, Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::read_spool;
use tokentap_e2e::traces::record_ids_in;
use tokentap_e2e::transparent::{
    leftover_cgroups, loaded_bpf_programs, privileged, tokentap_run, FakeNet, OwnTlsServer,
};
use tokentap_e2e::{CaptureRecord, SessionSource};

const ENGINE_TEXT: &str = "hello from the engine";

/// Runs `cmd` to completion with its output in `dir`; returns (exit code, stdout, stderr).
async fn finish(
    cmd: std::process::Command,
    dir: &Path,
    what: &str,
) -> (Option<i32>, String, String) {
    let (out, err) = (
        dir.join(format!("{what}.out")),
        dir.join(format!("{what}.err")),
    );
    let mut child = spawn_guarded_split(cmd, &out, &err, KillScope::Group, what).unwrap();
    let status = child.wait_limited(HARNESS_LIMIT).await;
    (
        status.and_then(|s| s.code()),
        std::fs::read_to_string(&out).unwrap_or_default(),
        std::fs::read_to_string(&err).unwrap_or_default(),
    )
}

fn no_leftovers(session: &str) {
    assert!(
        leftover_cgroups(session).is_empty(),
        "the run's cgroup is still there: {:?}",
        leftover_cgroups(session)
    );
    let progs = loaded_bpf_programs();
    assert!(
        !progs.iter().any(|p| p == "record_client"),
        "tokentap's eBPF program is still loaded: {progs:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_curl_to_a_hard_coded_endpoint_is_captured() {
    curl_is_captured("ebpf").await;
}

/// The nftables fallback (REDIRECT + conntrack), chosen explicitly.
#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_nftables_fallback_captures_the_same_way() {
    curl_is_captured("nft").await;
    let tables = std::process::Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&tables.stdout).contains("tokentap_"),
        "the nftables redirect table was left behind"
    );
}

async fn curl_is_captured(redirect: &str) {
    if !privileged() {
        return;
    }
    let backend = ScriptedBackend::start(Tokens::Fake, always(Reply::text(ENGINE_TEXT))).await;
    let backend_port: u16 = backend.url.rsplit(':').next().unwrap().parse().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (spool, ca) = (dir.path().join("spool"), dir.path().join("ca"));
    let session = format!("e2e-curl-{redirect}-{}", std::process::id());
    let key = "sk-e2e-transparent-curl-0c61";
    let net = FakeNet::new(&[("api.openai.com", "127.0.0.2")]);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    // 1. HTTPS to the hard-coded host (no proxy settings): intercepted and answered.
    // 2. Plain HTTP straight to the engine's port, which is also redirected for this cgroup:
    //    not TLS, so spliced through to where it was going.
    let script = format!(
        "curl -sS --max-time 20 https://api.openai.com/v1/chat/completions -H 'content-type: application/json' -H 'authorization: Bearer {key}' -d '{body}' && echo && \
         curl -sS --max-time 20 -o /dev/null -w 'plain:%{{http_code}}\\n' http://127.0.0.1:{backend_port}/v1/models"
    );
    let extra = vec![
        "--redirect".to_owned(),
        redirect.to_owned(),
        "--session".to_owned(),
        session.clone(),
        "--redirect-port".into(),
        "443".into(),
        // The proxy's own connections to the engine use this port too: they must not be
        // redirected (they come from outside the cgroup).
        "--redirect-port".into(),
        backend_port.to_string(),
    ];
    let cmd = tokentap_run(
        &backend.url,
        "vllm",
        &spool,
        &ca,
        &extra,
        &net,
        &["sh".into(), "-c".into(), script],
    );
    let (code, out, err) = finish(cmd, dir.path(), "tokentap-run").await;
    assert_eq!(code, Some(0), "stdout: {out}\nstderr: {err}");
    let answer: serde_json::Value = serde_json::from_str(out.lines().next().unwrap_or(""))
        .unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    assert_eq!(answer["choices"][0]["message"]["content"], ENGINE_TEXT);
    let plain = out.lines().find(|l| l.starts_with("plain:")).unwrap_or("");
    assert_ne!(
        plain, "plain:000",
        "plain HTTP was not passed through: {out}\n{err}"
    );
    assert_eq!(
        backend.requests().len(),
        1,
        "only the intercepted call reached the engine"
    );

    let records = read_spool(&spool);
    assert_eq!(records.len(), 1, "{records:?}");
    let r = &records[0];
    assert_eq!(r.session_id, session);
    assert_eq!(r.session_source, SessionSource::Run);
    assert_eq!(r.request.path, "/v1/chat/completions");
    assert_eq!(r.request.headers["host"], "api.openai.com");
    assert_eq!(r.request.headers["authorization"], "[redacted]");
    assert_complete_token_data(r);
    assert_key_absent(&std::fs::read(spool_file(&spool)).unwrap(), key);

    // The CA was created on first use, its key private to its owner.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(ca.join("ca-key.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    no_leftovers(&session);
}

fn spool_file(spool: &Path) -> std::path::PathBuf {
    std::fs::read_dir(spool)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "ndjson"))
        .expect("a spool segment")
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_other_hosts_pass_through_and_outsiders_are_not_redirected() {
    if !privileged() {
        return;
    }
    let server = OwnTlsServer::start("127.0.0.3:443", "internal.test", "internal").await;
    let backend = ScriptedBackend::start(Tokens::Fake, always(Reply::text(ENGINE_TEXT))).await;
    let dir = tempfile::tempdir().unwrap();
    let (spool, ca) = (dir.path().join("spool"), dir.path().join("ca"));
    let server_ca = dir.path().join("internal-ca.pem");
    std::fs::write(&server_ca, &server.cert_pem).unwrap();
    let (ready, done) = (dir.path().join("ready"), dir.path().join("done"));
    let session = format!("e2e-pass-{}", std::process::id());
    let net = FakeNet::new(&[
        ("internal.test", "127.0.0.3"),
        ("api.openai.com", "127.0.0.2"),
    ]);
    // Trusting only the server's own certificate: the request succeeds only if the client saw
    // that certificate, i.e. the connection was not intercepted.
    let script = format!(
        "curl -sS --max-time 20 --cacert {} https://internal.test/ && echo && touch {} && \
         for i in $(seq 1 300); do [ -e {} ] && exit 0; sleep 0.1; done; exit 9",
        server_ca.display(),
        ready.display(),
        done.display()
    );
    let cmd = tokentap_run(
        &backend.url,
        "vllm",
        &spool,
        &ca,
        &["--session".to_owned(), session.clone()],
        &net,
        &["sh".into(), "-c".into(), script],
    );
    let (out, err) = (dir.path().join("run.out"), dir.path().join("run.err"));
    let mut child = spawn_guarded_split(cmd, &out, &err, KillScope::Group, "tokentap run").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !ready.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            std::fs::read_to_string(&err).unwrap_or_default()
        );
        if child.try_wait().is_some() {
            panic!(
                "tokentap run ended early:\n{}\n{}",
                std::fs::read_to_string(&out).unwrap_or_default(),
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // While the run is capturing: a process outside its cgroup connecting to the same
    // hard-coded address is not redirected, so its connect is refused.
    let outside = tokio::net::TcpStream::connect("127.0.0.2:443").await;
    assert!(outside.is_err(), "an outside connect was redirected");
    // Nor does one dialling the run's listener itself get in: with the run's CA trusted and
    // an intercepted host's name, its call is dropped unanswered, not sent to the engine.
    let log = std::fs::read_to_string(&err).unwrap_or_default();
    let listener = log
        .split("listener=")
        .nth(1)
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("no listener in the run's log:\n{log}"))
        .to_owned();
    let port = listener.rsplit(':').next().unwrap();
    let direct = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "10", "--cacert"])
        .arg(ca.join("ca.pem"))
        .args(["--resolve", &format!("api.openai.com:{port}:127.0.0.1")])
        .arg(format!("https://api.openai.com:{port}/v1/chat/completions"))
        .args(["-H", "content-type: application/json", "-d"])
        .arg(r#"{"model":"m","messages":[{"role":"user","content":"injected"}]}"#)
        .output()
        .unwrap();
    assert!(
        !direct.status.success() && direct.stdout.is_empty(),
        "a direct dial of the listener was served: {direct:?}"
    );
    std::fs::write(&done, "").unwrap();
    let status = child.wait_limited(Duration::from_secs(30)).await;
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "{stdout}\n{}",
        std::fs::read_to_string(&err).unwrap_or_default()
    );
    assert_eq!(
        stdout.trim(),
        "internal",
        "the client got the server's own answer"
    );
    let records: Vec<CaptureRecord> = if spool.exists() {
        read_spool(&spool)
    } else {
        Vec::new()
    };
    assert!(
        records.is_empty(),
        "a pass-through was recorded: {records:?}"
    );
    assert!(backend.requests().is_empty());
    no_leftovers(&session);
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_run_cleans_up_after_a_failing_command_and_ctrl_c() {
    if !privileged() {
        return;
    }
    let backend = ScriptedBackend::start(Tokens::Fake, always(Reply::text(ENGINE_TEXT))).await;
    let dir = tempfile::tempdir().unwrap();
    let (spool, ca) = (dir.path().join("spool"), dir.path().join("ca"));
    let net = FakeNet::new(&[]);

    // The command fails: tokentap exits with its status, and leaves nothing behind.
    let session = format!("e2e-fail-{}", std::process::id());
    let cmd = tokentap_run(
        &backend.url,
        "vllm",
        &spool,
        &ca,
        &["--session".to_owned(), session.clone()],
        &net,
        &["sh".into(), "-c".into(), "exit 3".into()],
    );
    let (code, _, err) = finish(cmd, dir.path(), "failing").await;
    assert_eq!(code, Some(3), "{err}");
    no_leftovers(&session);

    // Ctrl-C (SIGINT to the foreground process group): the command ends, tokentap cleans up
    // and exits 130.
    let session = format!("e2e-int-{}", std::process::id());
    let cmd = tokentap_run(
        &backend.url,
        "vllm",
        &spool,
        &ca,
        &["--session".to_owned(), session.clone()],
        &net,
        &["sleep".into(), "60".into()],
    );
    let (out, err) = (dir.path().join("int.out"), dir.path().join("int.err"));
    let mut child = spawn_guarded_split(cmd, &out, &err, KillScope::Group, "tokentap run").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while leftover_cgroups(&session).is_empty()
        || !std::fs::read_to_string(&err)
            .unwrap_or_default()
            .contains("transparent capture on")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the run never started: {}",
            std::fs::read_to_string(&err).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await; // let `sleep` start inside
                                                          // SAFETY: kill has no memory preconditions; the guard made the child a group leader.
    unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGINT) };
    let status = child.wait_limited(Duration::from_secs(30)).await;
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(130),
        "{}",
        std::fs::read_to_string(&err).unwrap_or_default()
    );
    no_leftovers(&session);
}

/// A real harness with no base URL anywhere, under `tokentap run`, against llama-server.
async fn harness_without_base_url(
    exe: &str,
    host: &str,
    args: &[&str],
    env: &[(&str, &str)],
    setup: impl FnOnce(&HarnessDirs),
) -> Vec<CaptureRecord> {
    let llama = LlamaServer::shared().await;
    let (a, exe_path) = tokentap_e2e::artefacts::Artefacts::require_harness(exe);
    let dirs = HarnessDirs::new();
    setup(&dirs);
    let spool = dirs.home().join("spool");
    let ca = dirs.home().join("ca");
    let session = format!("e2e-{exe}-{}", std::process::id());
    let net = FakeNet::new(&[(host, "127.0.0.2")]);
    let mut cmd = harness_command(&a, &tokentap_e2e::artefacts::tokentap_bin(), &dirs);
    // Transparent capture needs no proxy settings; the fake network keeps everything local.
    for v in ["HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"] {
        cmd.env_remove(v);
    }
    cmd.envs(env.iter().copied())
        .env("TOKENTAP_CA_DIR", &ca)
        .args(["run", "--backend", &llama.url, "--backend-kind", "llamacpp"])
        .arg("--spool")
        .arg(&spool)
        .args(["--session", &session, "--"])
        .args(net.prefix())
        .arg(&exe_path)
        .args(args)
        .stdin(std::process::Stdio::null());
    let out = run(cmd, &dirs, exe).await;
    out.assert_success(&format!("{exe} under tokentap run"));
    let records = read_spool(&spool);
    assert!(!records.is_empty(), "{exe} made no captured call");
    for r in &records {
        assert_eq!(r.session_id, session);
        assert_eq!(r.request.headers["host"], host);
        assert_eq!(r.response_status, 200, "{:?}", r.error);
        assert_complete_token_data(r);
    }
    // Local mode: `tokentap run` reconstructed the run in-process and, the run being over,
    // wrote every session's traces before exiting.
    let traces =
        tokentap_reconstruct::output::read_traces_jsonl(&spool.join("traces/traces.jsonl"))
            .unwrap_or_else(|e| panic!("{exe}: no traces written by tokentap run: {e}"));
    let digests = records
        .iter()
        .map(|r| {
            (
                r.record_id.clone(),
                tokentap_reconstruct::RecordDigest::of(r),
            )
        })
        .collect();
    let f = tokentap_reconstruct::verify(&traces, &digests);
    assert_eq!(f.violations, 0, "{exe}: {:?}", f.examples);
    let in_traces = record_ids_in(&traces);
    let mut ids: Vec<&str> = records.iter().map(|r| r.record_id.as_str()).collect();
    ids.sort();
    assert_eq!(in_traces, ids, "{exe}: each record in exactly one trace");
    no_leftovers(&session);
    records
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_codex_with_its_default_openai_endpoint() {
    if !privileged() {
        return;
    }
    let records = harness_without_base_url(
        "codex",
        "api.openai.com",
        &[
            "exec",
            "--skip-git-repo-check",
            "-s",
            "danger-full-access",
            "say hi",
        ],
        &[("OPENAI_API_KEY", "sk-e2e-codex-transparent")],
        |d| {
            d.write(
                ".codex/config.toml",
                "model = \"m\"\ncheck_for_update_on_startup = false\n",
            )
        },
    )
    .await;
    assert!(records.iter().all(|r| r.request.path == "/v1/responses"));
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_claude_code_with_its_default_anthropic_endpoint() {
    if !privileged() {
        return;
    }
    let records = harness_without_base_url(
        "claude",
        "api.anthropic.com",
        &["-p", "say hi", "--model", "m"],
        &[
            ("ANTHROPIC_API_KEY", "sk-ant-e2e-claude-transparent"),
            ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
            ("DISABLE_AUTOUPDATER", "1"),
        ],
        |_| {},
    )
    .await;
    assert!(records.iter().all(|r| r.request.path == "/v1/messages"));
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_a_client_that_rejects_the_certificate_fails_visibly_and_is_recorded() {
    if !privileged() {
        return;
    }
    let backend = ScriptedBackend::start(Tokens::Fake, always(Reply::text(ENGINE_TEXT))).await;
    let dir = tempfile::tempdir().unwrap();
    let (spool, ca) = (dir.path().join("spool"), dir.path().join("ca"));
    let session = format!("e2e-pin-{}", std::process::id());
    let net = FakeNet::new(&[("api.openai.com", "127.0.0.2")]);
    // A client pinned to a CA that is not tokentap's (here: an unrelated self-signed one).
    let other = OwnTlsServer::start("127.0.0.1:0", "unrelated.test", "").await;
    let pinned = dir.path().join("pinned.pem");
    std::fs::write(&pinned, &other.cert_pem).unwrap();
    let script = format!(
        "curl -sS --max-time 20 --cacert {} https://api.openai.com/v1/models",
        pinned.display()
    );
    let cmd = tokentap_run(
        &backend.url,
        "vllm",
        &spool,
        &ca,
        &["--session".to_owned(), session.clone()],
        &net,
        &["sh".into(), "-c".into(), script],
    );
    let (code, _out, err) = finish(cmd, dir.path(), "pinned").await;
    assert_eq!(
        code,
        Some(60),
        "curl fails certificate verification (60): {err}"
    );
    let records = read_spool(&spool);
    assert_eq!(records.len(), 1, "{records:?}");
    let r = &records[0];
    let e = r.error.as_ref().expect("an error");
    assert_eq!(e.kind, tokentap_e2e::ErrorKind::TlsHandshakeFailed);
    assert!(
        e.message.contains("api.openai.com") && e.message.contains("intercept list"),
        "{}",
        e.message
    );
    assert_eq!(r.session_id, session);
    assert!(backend.requests().is_empty());
    no_leftovers(&session);
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_run_without_root_says_what_is_missing() {
    if !privileged() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let mut cmd = std::process::Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(tokentap_e2e::artefacts::tokentap_bin())
        .args([
            "run",
            "--backend",
            "http://127.0.0.1:9",
            "--backend-kind",
            "vllm",
        ])
        .arg("--spool")
        .arg(dir.path().join("spool"))
        .args(["--", "true"])
        .env("TOKENTAP_CA_DIR", dir.path().join("ca"));
    let (code, _out, err) = finish(cmd, dir.path(), "unprivileged").await;
    assert_ne!(code, Some(0));
    assert!(
        err.contains("root") && err.contains("nft"),
        "the message names what is missing and the fallback: {err}"
    );
}

/// `tokentap sidecar --cgroup PATH` captures an existing cgroup (a pod's) until SIGTERM.
#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_sidecar_captures_an_existing_cgroup_until_stopped() {
    if !privileged() {
        return;
    }
    let backend = ScriptedBackend::start(Tokens::Fake, always(Reply::text(ENGINE_TEXT))).await;
    let dir = tempfile::tempdir().unwrap();
    let (spool, ca) = (dir.path().join("spool"), dir.path().join("ca"));
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let root = mounts
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[2] == "cgroup2").then(|| std::path::PathBuf::from(f[1]))
        })
        .unwrap();
    let pod = root.join(format!("e2e-pod-{}", std::process::id()));
    std::fs::create_dir(&pod).unwrap();
    let mut sidecar = std::process::Command::new(tokentap_e2e::artefacts::tokentap_bin());
    sidecar
        .args([
            "sidecar",
            "--backend",
            &backend.url,
            "--backend-kind",
            "vllm",
        ])
        .arg("--spool")
        .arg(&spool)
        .arg("--cgroup")
        .arg(&pod)
        .env("TOKENTAP_CA_DIR", &ca);
    let (out, err) = (
        dir.path().join("sidecar.out"),
        dir.path().join("sidecar.err"),
    );
    let mut child = spawn_guarded_split(sidecar, &out, &err, KillScope::Group, "sidecar").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&err)
        .unwrap_or_default()
        .contains("transparent capture on")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            std::fs::read_to_string(&err).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A "pod" process: joins the cgroup, then calls the hard-coded endpoint, trusting the CA
    // the way a pod would have it installed.
    let net = FakeNet::new(&[("api.anthropic.com", "127.0.0.2")]);
    let body =
        json!({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]});
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec {} curl -sS --max-time 20 --cacert {}/ca.pem https://api.anthropic.com/v1/messages -H 'x-api-key: sk-ant-pod' -H 'anthropic-version: 2023-06-01' -H 'content-type: application/json' -d '{}'",
        pod.display(),
        net.prefix().join(" "),
        ca.display(),
        body
    );
    let pod_run = std::process::Command::new("sh")
        .args(["-c", &script])
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&pod_run.stdout);
    assert!(
        pod_run.status.success(),
        "{answer}\n{}",
        String::from_utf8_lossy(&pod_run.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"][0]["text"], ENGINE_TEXT);

    // SAFETY: kill has no memory preconditions.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let status = child.wait_limited(Duration::from_secs(30)).await;
    assert_eq!(status.and_then(|s| s.code()), Some(0));
    let records = read_spool(&spool);
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].request.path, "/v1/messages");
    assert_eq!(records[0].session_source, SessionSource::ApiKey);
    assert!(!loaded_bpf_programs().iter().any(|p| p == "record_client"));
    // The pod's cgroup is the pod's: the sidecar leaves it in place.
    assert!(pod.exists());
    std::fs::remove_dir(&pod).unwrap();
}

/// The cgroup v2 mount.
fn cgroup2_root() -> std::path::PathBuf {
    std::fs::read_to_string("/proc/mounts")
        .unwrap()
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[2] == "cgroup2").then(|| std::path::PathBuf::from(f[1]))
        })
        .expect("a cgroup2 mount")
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_sidecar_refuses_a_cgroup_that_contains_itself() {
    if !privileged() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let pod = cgroup2_root().join(format!("e2e-selfpod-{}", std::process::id()));
    let inner = pod.join("inner");
    std::fs::create_dir_all(&inner).unwrap();
    // tokentap started inside the cgroup it is asked to capture (directly, and one level down).
    for own in [&pod, &inner] {
        let script = format!(
            "echo $$ > {}/cgroup.procs && exec {} sidecar --backend http://127.0.0.1:9 --backend-kind vllm --spool {}/spool --cgroup {}",
            own.display(),
            tokentap_e2e::artefacts::tokentap_bin().display(),
            dir.path().display(),
            pod.display()
        );
        let out = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::process::Command::new("sh")
                .args(["-c", &script])
                .env("TOKENTAP_CA_DIR", dir.path().join("ca"))
                .output(),
        )
        .await
        .expect("the sidecar exits at once")
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "accepted a cgroup holding itself: {err}"
        );
        assert!(err.contains("tokentap itself runs in"), "{err}");
    }
    assert!(!loaded_bpf_programs().iter().any(|p| p == "record_client"));
    let _ = std::fs::remove_dir(&inner);
    let _ = std::fs::remove_dir(&pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_transparent_a_killed_runs_cgroups_and_nft_tables_are_removed_at_start() {
    if !privileged() {
        return;
    }
    // A pid that is gone: a child that has exited and been reaped.
    let dead_pid = {
        let mut c = std::process::Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        pid
    };
    // What a killed `tokentap run` leaves: its cgroup, with an agent still running in it …
    let stale = cgroup2_root()
        .join("tokentap")
        .join(format!("e2e-killed-pid{dead_pid}"));
    std::fs::create_dir_all(&stale).unwrap();
    let mut orphan = std::process::Command::new("sleep")
        .arg("300")
        .spawn()
        .unwrap();
    std::fs::write(stale.join("cgroup.procs"), orphan.id().to_string()).unwrap();
    // … and its nftables redirect (when nft is installed).
    let table = format!("tokentap_e2e_killed_pid{dead_pid}");
    let nft = std::process::Command::new("nft")
        .args(["add", "table", "inet", &table])
        .status()
        .is_ok_and(|s| s.success());

    let backend = ScriptedBackend::start(Tokens::Fake, always(Reply::text(ENGINE_TEXT))).await;
    let dir = tempfile::tempdir().unwrap();
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(tokentap_e2e::artefacts::tokentap_bin())
            .args(["run", "--backend", &backend.url, "--backend-kind", "vllm"])
            .arg("--spool")
            .arg(dir.path().join("spool"))
            .args(["--", "true"])
            .env("TOKENTAP_CA_DIR", dir.path().join("ca"))
            .output(),
    )
    .await
    .expect("tokentap run finishes")
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stale.exists(), "the killed run's cgroup is still there");
    let status = orphan.wait().unwrap();
    assert!(
        !status.success(),
        "the orphaned agent was killed with its cgroup"
    );
    if nft {
        let listing = std::process::Command::new("nft")
            .args(["list", "tables"])
            .output()
            .unwrap();
        assert!(
            !String::from_utf8_lossy(&listing.stdout).contains(&table),
            "the killed run's nftables table is still there"
        );
    } else {
        // Reported like any test that cannot run its real parts (a failure in CI).
        tokentap_e2e::privileged::runs(Err(
            "needs nft to check the nftables clean-up (only the cgroups' was checked)".into(),
        ));
    }
}
