//! deploy/kubernetes: each kustomization renders with `kubectl kustomize`, every object passes
//! Kubernetes' own schemas (strict, 1.29 and 1.37), and the privileges are the least the node
//! agent and the webhook need. cert-manager's objects are custom resources the schemas do not
//! cover; they are checked by shape.

use std::process::Command;

use serde_json::Value;
use tokentap_e2e::artefacts::{workspace_root, Artefacts};
use tokentap_e2e::kube_validate::{validate, VERSIONS};

/// `kubectl kustomize deploy/kubernetes/NAME`, as JSON objects.
fn render(name: &str) -> Vec<Value> {
    let dir = workspace_root().join("deploy/kubernetes").join(name);
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&dir)
        .output()
        .unwrap_or_else(|e| panic!("kubectl (needed to render deploy/kubernetes): {e}"));
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    // PyYAML ships with kubernetes-validate in the setup venv.
    let mut py = Command::new(Artefacts::require_python())
        .args(["-c", "import sys, json, yaml; json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(py.stdin.as_mut().unwrap(), &out.stdout).unwrap();
    drop(py.stdin.take());
    let json = py.wait_with_output().unwrap();
    assert!(json.status.success());
    serde_json::from_slice(&json.stdout).unwrap()
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind}/{name}"))
}

fn is_cert_manager(o: &Value) -> bool {
    o["apiVersion"]
        .as_str()
        .unwrap_or("")
        .starts_with("cert-manager.io/")
}

#[test]
fn every_rendered_object_passes_kubernetes_schemas_strict() {
    for name in ["default", "cert-manager", "bus"] {
        let objs = render(name);
        assert!(objs.len() >= 10, "{name}: {} objects", objs.len());
        let core: Vec<Value> = objs
            .iter()
            .filter(|o| !is_cert_manager(o))
            .cloned()
            .collect();
        for v in VERSIONS {
            validate(&core, v).unwrap_or_else(|e| panic!("deploy/kubernetes/{name}: {e}"));
        }
    }
}

#[test]
fn the_node_agent_and_the_webhook_get_the_least_they_need() {
    let objs = render("default");
    let ds = find(&objs, "DaemonSet", "tokentap-node-agent");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    let mut add: Vec<&str> = sc["capabilities"]["add"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    add.sort();
    assert_eq!(add, ["BPF", "NET_ADMIN", "SYS_RESOURCE"]);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(
        pod["hostNetwork"], true,
        "the listener must be on the node IP"
    );
    assert!(
        pod["hostPID"].is_null(),
        "the Kubernetes source needs no host PID namespace"
    );
    let args = c["args"].to_string();
    for flag in [
        "--source=kubernetes",
        "--node-name=$(NODE_NAME)",
        "--listen-ip=$(NODE_IP)",
        "--cgroup-root=/host/cgroup",
    ] {
        assert!(args.contains(flag), "{flag} in {args}");
    }
    // A status plane off loopback carries a token.
    assert!(c["env"].to_string().contains("TOKENTAP_AGENT_TOKEN"));
    assert_eq!(
        ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"],
        "true"
    );

    let role = find(&objs, "ClusterRole", "tokentap-node-agent");
    assert_eq!(
        role["rules"],
        serde_json::json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}])
    );

    let web = find(&objs, "Deployment", "tokentap-webhook");
    let wpod = &web["spec"]["template"]["spec"];
    assert_eq!(wpod["automountServiceAccountToken"], false);
    let wsc = &wpod["containers"][0]["securityContext"];
    assert_eq!(wsc["runAsNonRoot"], true);
    assert_eq!(wsc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert!(wpod["containers"][0]["env"]
        .to_string()
        .contains("TOKENTAP_WEBHOOK_TOKEN"));

    let mwc = find(&objs, "MutatingWebhookConfiguration", "tokentap");
    let webhooks = mwc["webhooks"].as_array().unwrap();
    assert!(
        !webhooks.is_empty(),
        "a webhook configuration without webhooks"
    );
    for w in webhooks {
        assert_eq!(w["admissionReviewVersions"], serde_json::json!(["v1"]));
        assert_eq!(w["sideEffects"], "None");
        assert_eq!(w["failurePolicy"], "Fail");
        assert!(w["namespaceSelector"].is_object());
        assert_eq!(w["clientConfig"]["service"]["path"], "/mutate");
        assert!(!w["clientConfig"]["caBundle"].as_str().unwrap().is_empty());
    }
}

/// The bus install: node agents publish to the JetStream server as its `publisher` user,
/// workers join the group as `worker`, each password from its own key of a Secret (never a
/// literal), the server's configuration is deploy's nats.conf (the users and permissions
/// bus_roles.rs attacks), and nothing of the bus runs as root or writable.
#[test]
fn the_bus_variant_wires_agents_and_workers_to_one_authenticated_jetstream() {
    let objs = render("bus");
    let env_secret = |c: &Value, name: &str| -> String {
        let e = c["env"]
            .as_array()
            .and_then(|env| env.iter().find(|e| e["name"] == name))
            .unwrap_or_else(|| panic!("{} has no {name}", c["name"]));
        assert!(e.get("value").is_none(), "{name} is a literal");
        e["valueFrom"]["secretKeyRef"]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("{name} not from a Secret"))
            .to_owned()
    };
    let args = |c: &Value| -> Vec<String> {
        c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect()
    };
    let bus_url = "--bus=nats://tokentap-bus.tokentap.svc:4222".to_owned();
    let agent = &find(&objs, "DaemonSet", "tokentap-node-agent")["spec"]["template"]["spec"]
        ["containers"][0];
    assert!(args(agent).contains(&bus_url), "{:?}", args(agent));
    let env_value = |c: &Value, name: &str| -> String {
        c["env"]
            .as_array()
            .and_then(|env| env.iter().find(|e| e["name"] == name))
            .unwrap_or_else(|| panic!("{} has no {name}", c["name"]))["value"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let secret_key = |c: &Value, name: &str| -> String {
        c["env"]
            .as_array()
            .and_then(|env| env.iter().find(|e| e["name"] == name))
            .unwrap()["valueFrom"]["secretKeyRef"]["key"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(env_value(agent, "TOKENTAP_BUS_USER"), "publisher");
    assert_eq!(
        env_secret(agent, "TOKENTAP_BUS_PASSWORD"),
        "tokentap-bus-users"
    );
    assert_eq!(secret_key(agent, "TOKENTAP_BUS_PASSWORD"), "publisher");

    let worker = &find(&objs, "StatefulSet", "tokentap-worker")["spec"]["template"]["spec"];
    let w = &worker["containers"][0];
    assert_eq!(args(w)[0], "worker");
    assert!(args(w).contains(&bus_url), "{:?}", args(w));
    assert_eq!(env_value(w, "TOKENTAP_BUS_USER"), "worker");
    assert_eq!(env_secret(w, "TOKENTAP_BUS_PASSWORD"), "tokentap-bus-users");
    assert_eq!(secret_key(w, "TOKENTAP_BUS_PASSWORD"), "worker");
    // Listening beyond loopback: the worker refuses to start without its token.
    assert!(args(w).contains(&"--listen=0.0.0.0:8900".to_owned()));
    assert_eq!(
        env_secret(w, "TOKENTAP_WORKER_TOKEN"),
        "tokentap-worker-token"
    );

    let nats = &find(&objs, "StatefulSet", "tokentap-bus")["spec"]["template"]["spec"];
    let n = &nats["containers"][0];
    for role in tokentap_e2e::nats::ROLES {
        let var = format!("TOKENTAP_BUS_{}_PASSWORD", role.to_uppercase());
        assert_eq!(env_secret(n, &var), "tokentap-bus-users");
        assert_eq!(secret_key(n, &var), role);
    }
    let conf = find(&objs, "ConfigMap", "tokentap-bus")["data"]["nats.conf"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        conf,
        std::fs::read_to_string(tokentap_e2e::nats::deployed_conf()).unwrap()
    );
    assert!(!conf.contains("token:"), "{conf}");
    assert!(conf.contains("jetstream"), "{conf}");
    for spec in [worker, nats] {
        assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
        let sc = &spec["containers"][0]["securityContext"];
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["readOnlyRootFilesystem"], true);
        assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    }
}

#[test]
fn the_cert_manager_variant_issues_the_webhook_certificate_and_injects_its_ca() {
    let objs = render("cert-manager");
    let cert = find(&objs, "Certificate", "tokentap-webhook");
    assert_eq!(cert["spec"]["secretName"], "tokentap-webhook-tls");
    let dns = cert["spec"]["dnsNames"].to_string();
    assert!(dns.contains("tokentap-webhook.tokentap.svc"), "{dns}");
    assert_eq!(cert["spec"]["issuerRef"]["name"], "tokentap-selfsigned");
    find(&objs, "Issuer", "tokentap-selfsigned");
    let mwc = find(&objs, "MutatingWebhookConfiguration", "tokentap");
    assert_eq!(
        mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
        "tokentap/tokentap-webhook"
    );
}

/// deploy/image/build-offline assembles a working image from the built binary: it runs
/// `tokentap --version` and `tokentap node-agent --help` in a real container (so every library
/// the binary needs is in it), as the non-root user by default.
#[tokio::test(flavor = "multi_thread")]
async fn heavy_deploy_offline_image_runs_the_binary() {
    use tokentap_e2e::containers::{requirement, Dockerd};
    if !tokentap_e2e::privileged::runs(requirement()) {
        return;
    }
    let dockerd = Dockerd::start().await;
    let tag = format!("tokentap-offline-test:{}", std::process::id());
    let out = Command::new(workspace_root().join("deploy/image/build-offline"))
        .arg("--binary")
        .arg(tokentap_e2e::artefacts::tokentap_bin())
        .args(["--tag", &tag, "--docker-host", &dockerd.host()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "build-offline: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let version = dockerd.ok(&["run", "--rm", &tag, "--version"]);
    assert!(version.starts_with("tokentap "), "{version}");
    let help = dockerd.ok(&["run", "--rm", &tag, "node-agent", "--help"]);
    assert!(help.contains("--source"), "{help}");
    assert_eq!(
        dockerd.ok(&["inspect", "-f", "{{.Config.User}}", &tag]),
        "65532:65532"
    );
    let whoami = dockerd.ok(&[
        "run",
        "--rm",
        "--entrypoint",
        "/usr/local/bin/tokentap",
        &tag,
        "ca",
        "--help",
    ]);
    assert!(whoami.contains("bundle"), "{whoami}");
}
