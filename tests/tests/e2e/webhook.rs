//! `tokentap webhook` over real HTTPS (its own certificate from `tokentap webhook cert`, a
//! rustls client trusting only that CA, the Service name resolved to 127.0.0.1): AdmissionReview
//! requests for real-shaped pods; each returned JSONPatch applied with a JSON-Patch library and
//! the patched pod validated against Kubernetes' own schemas, strict, for 1.29 and 1.37.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};
use tokentap_e2e::artefacts::tokentap_bin;
use tokentap_e2e::kube_validate::{validate, VERSIONS};
use tokentap_e2e::procs::{free_port, spawn_guarded, wait_healthy_tls, ChildGuard, KillScope};

const HOST: &str = "tokentap-webhook.tokentap.svc";
const TOKEN: &str = "webhook-e2e-token-4f1a";

struct Webhook {
    _child: ChildGuard,
    client: reqwest::Client,
    url: String,
    _dir: tempfile::TempDir,
}

async fn start() -> Webhook {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let out = Command::new(tokentap_bin())
        .args(["webhook", "cert", "--out"])
        .arg(&certs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ca_bundle = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let ca_pem = std::fs::read(certs.join("ca.crt")).unwrap();
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(&ca_bundle)
            .unwrap(),
        ca_pem,
        "stdout is the caBundle"
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(certs.join("tls.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the key is owner-only");
    let port = free_port();
    let mut cmd = Command::new(tokentap_bin());
    cmd.args(["webhook", "serve", "--listen", &format!("127.0.0.1:{port}")])
        .arg("--tls-cert")
        .arg(certs.join("tls.crt"))
        .arg("--tls-key")
        .arg(certs.join("tls.key"))
        .args(["--image", "ghcr.io/tokentap/tokentap:0.1.0"])
        .args([
            "--backend",
            "http://vllm.rl.svc:8000",
            "--backend-kind",
            "vllm",
        ])
        .args(["--ship-to", "http://tokentap-worker.tokentap.svc:8900"])
        .args(["--ship-token-secret", "tokentap-ship-token"])
        .env("TOKENTAP_WEBHOOK_TOKEN", TOKEN);
    let mut child = spawn_guarded(
        cmd,
        &dir.path().join("webhook.log"),
        KillScope::Process,
        "webhook",
    )
    .unwrap();
    let client = reqwest::Client::builder()
        .no_proxy()
        .add_root_certificate(reqwest::Certificate::from_pem(&ca_pem).unwrap())
        .tls_built_in_root_certs(false)
        .resolve(HOST, format!("127.0.0.1:{port}").parse().unwrap())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let url = format!("https://{HOST}:{port}");
    wait_healthy_tls(
        &client,
        &format!("{url}/health"),
        &mut child,
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    Webhook {
        _child: child,
        client,
        url,
        _dir: dir,
    }
}

fn review(uid: &str, pod: &Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": pod["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        }
    })
}

impl Webhook {
    async fn post(&self, body: Vec<u8>, token: Option<&str>) -> reqwest::Response {
        self.try_post(body, token).await.unwrap()
    }

    async fn try_post(
        &self,
        body: Vec<u8>,
        token: Option<&str>,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let mut r = self
            .client
            .post(format!("{}/mutate", self.url))
            .header("content-type", "application/json")
            .body(body);
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send().await
    }

    /// The patched pod (the pod itself when no patch came back).
    async fn admit(&self, pod: &Value) -> (Value, bool) {
        let r = self
            .post(review("uid-1", pod).to_string().into_bytes(), Some(TOKEN))
            .await;
        assert_eq!(r.status(), 200);
        let answer: Value = r.json().await.unwrap();
        assert_eq!(answer["kind"], "AdmissionReview");
        assert_eq!(answer["response"]["uid"], "uid-1");
        assert_eq!(answer["response"]["allowed"], true);
        let Some(patch) = answer["response"]["patch"].as_str() else {
            return (pod.clone(), false);
        };
        assert_eq!(answer["response"]["patchType"], "JSONPatch");
        let ops: json_patch::Patch = serde_json::from_slice(
            &base64::engine::general_purpose::STANDARD
                .decode(patch)
                .unwrap(),
        )
        .unwrap();
        let mut patched = pod.clone();
        json_patch::patch(&mut patched, &ops)
            .unwrap_or_else(|e| panic!("patch does not apply: {e}"));
        (patched, true)
    }
}

fn pod(name: &str, extra_spec: Value, annotations: Value) -> Value {
    let mut spec = json!({
        "containers": [{
            "name": "agent",
            "image": "registry.example/agents/codex:1",
            "command": ["codex", "exec", "fix the test"],
            "ports": [{"containerPort": 8080, "protocol": "TCP"}],
            "env": [{"name": "OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {"name": "k", "key": "key"}}}],
        }],
        "priorityClassName": "rollout",
        "restartPolicy": "Never",
    });
    for (k, v) in extra_spec.as_object().unwrap() {
        spec[k] = v.clone();
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "rl", "labels": {"app": "rollout"}, "annotations": annotations},
        "spec": spec,
    })
}

fn validate_all(p: &Value) {
    for v in VERSIONS {
        validate(std::slice::from_ref(p), v).unwrap_or_else(|e| panic!("{e}\n{p:#}"));
    }
}

fn names(list: &Value) -> Vec<&str> {
    list.as_array()
        .map(|a| a.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn transparent_and_sidecar_pods_are_patched_into_valid_pods_once() {
    let w = start().await;
    // 1. One container, transparent (the default mode).
    let one = pod(
        "one",
        json!({}),
        json!({"tokentap.io/session": "task-1/sample-0"}),
    );
    let (p, patched) = w.admit(&one).await;
    assert!(patched);
    validate_all(&p);
    let ann = &p["metadata"]["annotations"];
    assert_eq!(ann["tokentap.io/capture"], "true");
    assert_eq!(ann["tokentap.io/injected"], "transparent");
    assert_eq!(ann["tokentap.io/session"], "task-1/sample-0");
    assert_eq!(
        names(&p["spec"]["initContainers"]),
        ["tokentap-await-capture"]
    );
    let env = &p["spec"]["containers"][0]["env"];
    for var in [
        "SSL_CERT_FILE",
        "NODE_EXTRA_CA_CERTS",
        "NODE_USE_SYSTEM_CA",
        "CODEX_CA_CERTIFICATE",
        "REQUESTS_CA_BUNDLE",
    ] {
        assert!(names(env).contains(&var), "{var} in {env}");
    }
    assert!(
        !names(env).contains(&"OPENAI_BASE_URL"),
        "transparent mode changes no base URL"
    );
    // What the webhook does not know passes through untouched.
    assert_eq!(p["spec"]["priorityClassName"], "rollout");
    assert_eq!(
        p["spec"]["containers"][0]["ports"],
        one["spec"]["containers"][0]["ports"]
    );
    assert_eq!(
        p["spec"]["containers"][0]["env"][0],
        one["spec"]["containers"][0]["env"][0]
    );
    // 2. Re-admitted: nothing twice.
    let (again, patched) = w.admit(&p).await;
    assert!(!patched, "a re-admitted pod was injected again");
    assert_eq!(again, p);

    // 3. With init containers, volumes, and a user's own SSL_CERT_FILE (kept).
    let busy = pod(
        "busy",
        json!({
            "initContainers": [{"name": "fetch", "image": "busybox", "env": [{"name": "SSL_CERT_FILE", "value": "/mine.pem"}]}],
            "volumes": [{"name": "work", "emptyDir": {}}],
        }),
        json!({}),
    );
    let (p, _) = w.admit(&busy).await;
    validate_all(&p);
    assert_eq!(
        names(&p["spec"]["initContainers"]),
        ["tokentap-await-capture", "fetch"]
    );
    let fetch_env = &p["spec"]["initContainers"][1]["env"];
    assert_eq!(fetch_env[0]["value"], "/mine.pem");
    assert_eq!(
        names(fetch_env)
            .iter()
            .filter(|n| **n == "SSL_CERT_FILE")
            .count(),
        1
    );
    assert_eq!(names(&p["spec"]["volumes"]), ["work", "tokentap-ca"]);

    // 4. Sidecar mode: a native sidecar first, base URLs to it, the ship token from a Secret.
    let side = pod(
        "side",
        json!({"initContainers": [{"name": "fetch", "image": "busybox"}]}),
        json!({"tokentap.io/mode": "sidecar"}),
    );
    let (p, _) = w.admit(&side).await;
    validate_all(&p);
    let proxy = &p["spec"]["initContainers"][0];
    assert_eq!(proxy["name"], "tokentap-proxy");
    assert_eq!(proxy["restartPolicy"], "Always");
    assert!(proxy["readinessProbe"].is_object() && proxy["startupProbe"].is_object());
    let args: Vec<&str> = proxy["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        args.windows(2)
            .any(|w| w == ["--listen", "127.0.0.1:15080"]),
        "{args:?}"
    );
    assert!(args.windows(2).any(|w| w
        == [
            "--session",
            "$(TOKENTAP_POD_NAMESPACE)/$(TOKENTAP_POD_NAME)"
        ]));
    assert!(proxy["env"].to_string().contains("tokentap-ship-token"));
    for list in ["containers", "initContainers"] {
        for c in p["spec"][list].as_array().unwrap() {
            if c["name"] == "tokentap-proxy" {
                continue;
            }
            assert!(names(&c["env"]).contains(&"OPENAI_BASE_URL"), "{c}");
            assert!(names(&c["env"]).contains(&"ANTHROPIC_BASE_URL"), "{c}");
        }
    }
    assert!(
        !w.admit(&p).await.1,
        "sidecar pods are not injected twice either"
    );

    // 5. Opted out, by annotation or label: untouched.
    for opted_out in [
        pod("out-a", json!({}), json!({"tokentap.io/inject": "false"})),
        {
            let mut p = pod("out-l", json!({}), json!({}));
            p["metadata"]["labels"]["tokentap.io/inject"] = json!("false");
            p
        },
    ] {
        assert!(!w.admit(&opted_out).await.1);
    }

    // 6. Not a pod create (an update): allowed, untouched.
    let mut update = review("uid-2", &one);
    update["request"]["operation"] = json!("UPDATE");
    let r: Value = w
        .post(update.to_string().into_bytes(), Some(TOKEN))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["response"]["allowed"], true);
    assert!(r["response"]["patch"].is_null());
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_reviews_missing_tokens_and_huge_bodies_are_refused_clearly() {
    let w = start().await;
    let one = review("u", &pod("one", json!({}), json!({})))
        .to_string()
        .into_bytes();
    let refused = w.post(one.clone(), None).await;
    assert_eq!(refused.status(), 401);
    // Refused before its body was read: the connection is not for reuse.
    assert_eq!(refused.headers()["connection"], "close");
    assert_eq!(w.post(one.clone(), Some("wrong-token")).await.status(), 401);
    let r = w.post(b"{not json".to_vec(), Some(TOKEN)).await;
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert!(
        e["error"]["message"].as_str().unwrap().contains("not JSON"),
        "{e}"
    );
    let r = w
        .post(
            json!({"apiVersion": "v1", "kind": "Pod"})
                .to_string()
                .into_bytes(),
            Some(TOKEN),
        )
        .await;
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("AdmissionReview"));
    // Over the limit: a 413 before the body is read (the client, still sending, may see the
    // connection close before it reads the answer).
    let huge = vec![b' '; 4 << 20];
    match w.try_post(huge, Some(TOKEN)).await {
        Ok(r) => {
            assert_eq!(r.status(), 413);
            // The body is left unread: the connection is not for reuse.
            assert_eq!(r.headers()["connection"], "close");
        }
        Err(e) => assert!(e.is_request(), "{e}"),
    }
    // Still serving.
    assert_eq!(w.post(one, Some(TOKEN)).await.status(), 200);
}

fn write_expired_cert(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec![HOST.to_owned()]).unwrap();
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    let cert = params.self_signed(&key).unwrap();
    let (c, k) = (dir.join("old.crt"), dir.join("old.key"));
    std::fs::write(&c, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    (c, k)
}

#[tokio::test]
async fn an_expired_certificate_or_an_open_listener_without_a_token_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (c, k) = write_expired_cert(dir.path());
    let out = Command::new(tokentap_bin())
        .args([
            "webhook",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--image",
            "x",
            "--token",
            "t",
        ])
        .arg("--tls-cert")
        .arg(&c)
        .arg("--tls-key")
        .arg(&k)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("expired on") && err.contains("old.crt"),
        "{err}"
    );

    let certs = dir.path().join("certs");
    assert!(Command::new(tokentap_bin())
        .args(["webhook", "cert", "--out"])
        .arg(&certs)
        .output()
        .unwrap()
        .status
        .success());
    let out = Command::new(tokentap_bin())
        .args(["webhook", "serve", "--listen", "0.0.0.0:0", "--image", "x"])
        .arg("--tls-cert")
        .arg(certs.join("tls.crt"))
        .arg("--tls-key")
        .arg(certs.join("tls.key"))
        .env_remove("TOKENTAP_WEBHOOK_TOKEN")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("without a token") && err.contains("--allow-unauthenticated"),
        "{err}"
    );
}
