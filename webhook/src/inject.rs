//! Which pods are injected, and the JSONPatch (RFC 6902) that injects them. Pure functions of
//! the pod as the API server sent it.
//!
//! Modes (pod annotation `tokentap.io/mode`, else the webhook's default):
//! - `transparent`: the pod is marked for the node agent (`tokentap.io/capture: "true"`), the
//!   CA ConfigMap is mounted into every container with the trust variables `tokentap run`
//!   sets, and `tokentap await-capture` runs first, so no container starts before the agent
//!   redirects the pod. No base URL changes: hard-coded endpoints are captured.
//! - `sidecar`: the tokentap proxy runs as a native sidecar (an init container with
//!   `restartPolicy: Always`, Kubernetes ≥ 1.29) that every container reaches on loopback
//!   through `OPENAI_BASE_URL` / `ANTHROPIC_BASE_URL` (a value the pod set itself is kept).
//!
//! A pod already carrying `tokentap.io/injected` is left alone (re-admission injects nothing
//! twice); a pod annotated or labelled `tokentap.io/inject: "false"` opts out.

use serde_json::{json, Map, Value};

pub const INJECTED: &str = "tokentap.io/injected";
pub const INJECT: &str = "tokentap.io/inject";
pub const MODE: &str = "tokentap.io/mode";
pub const CAPTURE: &str = "tokentap.io/capture";
pub const SESSION: &str = "tokentap.io/session";
pub const BACKEND: &str = "tokentap.io/backend";
pub const BACKEND_KIND: &str = "tokentap.io/backend-kind";

/// Where the CA bundle is mounted in injected containers.
pub const CA_MOUNT: &str = "/etc/tokentap/ca";
/// The sidecar proxy's loopback port.
pub const SIDECAR_PORT: u16 = 15080;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Transparent,
    Sidecar,
}

impl Mode {
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "transparent" => Some(Mode::Transparent),
            "sidecar" => Some(Mode::Sidecar),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Transparent => "transparent",
            Mode::Sidecar => "sidecar",
        }
    }
}

/// What the webhook injects (its flags).
#[derive(Debug, Clone)]
pub struct InjectConfig {
    /// The tokentap image for the injected containers.
    pub image: String,
    pub default_mode: Mode,
    /// The ConfigMap with `ca.pem` and `ca-bundle.pem` (transparent mode).
    pub ca_configmap: String,
    /// The port the node agent redirects (await-capture probes it).
    pub redirect_port: u16,
    /// The engine the sidecar proxy calls (sidecar mode).
    pub backend: Option<String>,
    pub backend_kind: Option<String>,
    /// Where the sidecar ships records, and the Secret (key `token`) with the worker's token.
    pub ship_to: Option<String>,
    pub ship_token_secret: Option<String>,
}

/// The patch, and warnings for the person creating the pod.
#[derive(Debug, Default)]
pub struct Plan {
    pub patch: Vec<Value>,
    pub warnings: Vec<String>,
}

/// RFC 6901: `~` → `~0`, `/` → `~1`.
pub fn pointer_escape(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

fn meta_str<'a>(pod: &'a Value, field: &str, key: &str) -> Option<&'a str> {
    pod["metadata"][field][key].as_str()
}

/// The JSONPatch for `pod`.
pub fn plan(pod: &Value, config: &InjectConfig) -> Plan {
    let mut out = Plan::default();
    if meta_str(pod, "annotations", INJECTED).is_some() {
        return out;
    }
    let opted_out = meta_str(pod, "annotations", INJECT) == Some("false")
        || meta_str(pod, "labels", INJECT) == Some("false");
    if opted_out {
        return out;
    }
    let mode = match meta_str(pod, "annotations", MODE) {
        None => config.default_mode,
        Some(m) => match Mode::parse(m) {
            Some(m) => m,
            None => {
                out.warnings.push(format!(
                    "tokentap: unknown {MODE} {m:?} (transparent or sidecar); the pod was not injected"
                ));
                return out;
            }
        },
    };
    let mut patch = Patch::new(pod);
    match mode {
        Mode::Transparent => transparent(&mut patch, config),
        Mode::Sidecar => {
            let backend = meta_str(pod, "annotations", BACKEND)
                .map(str::to_owned)
                .or_else(|| config.backend.clone());
            let kind = meta_str(pod, "annotations", BACKEND_KIND)
                .map(str::to_owned)
                .or_else(|| config.backend_kind.clone());
            let (Some(backend), Some(kind)) = (backend, kind) else {
                out.warnings.push(format!(
                    "tokentap: sidecar mode needs an engine: the webhook has no --backend/--backend-kind and the pod no {BACKEND}/{BACKEND_KIND} annotations; the pod was not injected"
                ));
                return out;
            };
            sidecar(&mut patch, pod, config, &backend, &kind);
        }
    }
    patch.annotation(INJECTED, mode.as_str());
    out.patch = patch.ops;
    out
}

fn transparent(patch: &mut Patch, config: &InjectConfig) {
    patch.annotation(CAPTURE, "true");
    patch.volume(json!({
        "name": "tokentap-ca",
        "configMap": {"name": config.ca_configmap},
    }));
    let bundle = format!("{CA_MOUNT}/ca-bundle.pem");
    let ca = format!("{CA_MOUNT}/ca.pem");
    let env = [
        ("SSL_CERT_FILE", bundle.as_str()),
        ("REQUESTS_CA_BUNDLE", bundle.as_str()),
        ("CURL_CA_BUNDLE", bundle.as_str()),
        ("NODE_EXTRA_CA_CERTS", ca.as_str()),
        ("NODE_USE_SYSTEM_CA", "1"),
        ("CODEX_CA_CERTIFICATE", ca.as_str()),
    ];
    let mount = json!({"name": "tokentap-ca", "mountPath": CA_MOUNT, "readOnly": true});
    patch.every_container(&env, Some(&mount));
    patch.first_init_container(json!({
        "name": "tokentap-await-capture",
        "image": config.image,
        "command": ["tokentap", "await-capture", "--probe", format!("127.0.0.1:{}", config.redirect_port), "--timeout", "300"],
        "resources": {
            "requests": {"cpu": "10m", "memory": "16Mi"},
            "limits": {"cpu": "100m", "memory": "32Mi"},
        },
        "securityContext": restricted(),
    }));
}

fn sidecar(patch: &mut Patch, pod: &Value, config: &InjectConfig, backend: &str, kind: &str) {
    patch.volume(json!({"name": "tokentap-spool", "emptyDir": {}}));
    let session = meta_str(pod, "annotations", SESSION)
        .map(str::to_owned)
        .unwrap_or_else(|| "$(TOKENTAP_POD_NAMESPACE)/$(TOKENTAP_POD_NAME)".to_owned());
    let mut args = vec![
        "proxy".to_owned(),
        "--listen".into(),
        format!("127.0.0.1:{SIDECAR_PORT}"),
        "--backend".into(),
        backend.into(),
        "--backend-kind".into(),
        kind.into(),
        "--spool".into(),
        "/var/lib/tokentap/spool".into(),
        "--session".into(),
        session,
    ];
    let mut env = vec![
        json!({"name": "TOKENTAP_POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}),
        json!({"name": "TOKENTAP_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
    ];
    if let Some(to) = &config.ship_to {
        args.extend(["--ship-to".into(), to.clone()]);
        if let Some(secret) = &config.ship_token_secret {
            env.push(json!({"name": "TOKENTAP_WORKER_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "token"}}}));
        }
    }
    // Env first: its paths index init containers as the pod sent them, before one is prepended.
    let openai = format!("http://127.0.0.1:{SIDECAR_PORT}/v1");
    let anthropic = format!("http://127.0.0.1:{SIDECAR_PORT}");
    patch.every_container(
        &[
            ("OPENAI_BASE_URL", openai.as_str()),
            ("ANTHROPIC_BASE_URL", anthropic.as_str()),
        ],
        None,
    );
    let health = vec![
        "tokentap".to_owned(),
        "health".into(),
        format!("http://127.0.0.1:{SIDECAR_PORT}/health"),
    ];
    patch.first_init_container(json!({
        "name": "tokentap-proxy",
        "image": config.image,
        "restartPolicy": "Always",
        "args": args,
        "env": env,
        "volumeMounts": [{"name": "tokentap-spool", "mountPath": "/var/lib/tokentap"}],
        // The proxy listens on loopback only (no token): the kubelet's probes run inside.
        "startupProbe": {"exec": {"command": health}, "periodSeconds": 1, "failureThreshold": 60},
        "readinessProbe": {"exec": {"command": health}, "periodSeconds": 5},
        "resources": {
            "requests": {"cpu": "100m", "memory": "64Mi"},
            "limits": {"memory": "512Mi"},
        },
        "securityContext": restricted(),
    }));
}

/// The injected containers' security context: no root, no privileges, nothing writable but
/// their volumes.
fn restricted() -> Value {
    json!({
        "runAsNonRoot": true,
        "runAsUser": 65532,
        "allowPrivilegeEscalation": false,
        "readOnlyRootFilesystem": true,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    })
}

/// Patch operations against one pod, adding to arrays that may not exist yet.
struct Patch<'a> {
    pod: &'a Value,
    ops: Vec<Value>,
    /// Whether an op already created `/metadata/annotations` or `/spec/volumes`.
    made_annotations: bool,
    made_volumes: bool,
}

impl<'a> Patch<'a> {
    fn new(pod: &'a Value) -> Patch<'a> {
        Patch {
            pod,
            ops: Vec::new(),
            made_annotations: false,
            made_volumes: false,
        }
    }

    fn annotation(&mut self, key: &str, value: &str) {
        if self.pod["metadata"]["annotations"].is_object() || self.made_annotations {
            self.ops.push(json!({"op": "add", "path": format!("/metadata/annotations/{}", pointer_escape(key)), "value": value}));
        } else {
            let mut m = Map::new();
            m.insert(key.into(), value.into());
            self.ops
                .push(json!({"op": "add", "path": "/metadata/annotations", "value": m}));
            self.made_annotations = true;
        }
    }

    fn volume(&mut self, volume: Value) {
        if self.pod["spec"]["volumes"].is_array() || self.made_volumes {
            self.ops
                .push(json!({"op": "add", "path": "/spec/volumes/-", "value": volume}));
        } else {
            self.ops
                .push(json!({"op": "add", "path": "/spec/volumes", "value": [volume]}));
            self.made_volumes = true;
        }
    }

    /// Puts `container` first among the init containers (they run in order).
    fn first_init_container(&mut self, container: Value) {
        if self.pod["spec"]["initContainers"].is_array() {
            self.ops
                .push(json!({"op": "add", "path": "/spec/initContainers/0", "value": container}));
        } else {
            self.ops
                .push(json!({"op": "add", "path": "/spec/initContainers", "value": [container]}));
        }
    }

    /// Adds `env` (where the container does not set the name already) and `mount` to every
    /// container and init container the pod came with. Paths index the pod as sent; ops on
    /// init containers are emitted before one is prepended, so indices still hold.
    fn every_container(&mut self, env: &[(&str, &str)], mount: Option<&Value>) {
        for list in ["initContainers", "containers"] {
            let Some(containers) = self.pod["spec"][list].as_array() else {
                continue;
            };
            for (i, c) in containers.iter().enumerate() {
                let base = format!("/spec/{list}/{i}");
                let have: Vec<&str> = c["env"]
                    .as_array()
                    .map(|e| e.iter().filter_map(|v| v["name"].as_str()).collect())
                    .unwrap_or_default();
                let add: Vec<Value> = env
                    .iter()
                    .filter(|(k, _)| !have.contains(k))
                    .map(|(k, v)| json!({"name": k, "value": v}))
                    .collect();
                if c["env"].is_array() {
                    for e in add {
                        self.ops.push(
                            json!({"op": "add", "path": format!("{base}/env/-"), "value": e}),
                        );
                    }
                } else if !add.is_empty() {
                    self.ops
                        .push(json!({"op": "add", "path": format!("{base}/env"), "value": add}));
                }
                if let Some(m) = mount {
                    let path = m["mountPath"].as_str().unwrap_or_default();
                    let mounted = c["volumeMounts"]
                        .as_array()
                        .is_some_and(|v| v.iter().any(|x| x["mountPath"] == path));
                    if mounted {
                        continue;
                    }
                    if c["volumeMounts"].is_array() {
                        self.ops.push(json!({"op": "add", "path": format!("{base}/volumeMounts/-"), "value": m}));
                    } else {
                        self.ops.push(json!({"op": "add", "path": format!("{base}/volumeMounts"), "value": [m]}));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> InjectConfig {
        InjectConfig {
            image: "tokentap:0.1.0".into(),
            default_mode: Mode::Transparent,
            ca_configmap: "tokentap-ca".into(),
            redirect_port: 443,
            backend: Some("http://vllm.rl:8000".into()),
            backend_kind: Some("vllm".into()),
            ship_to: None,
            ship_token_secret: None,
        }
    }

    #[test]
    fn keys_are_escaped_per_rfc_6901() {
        assert_eq!(
            pointer_escape("tokentap.io/injected"),
            "tokentap.io~1injected"
        );
        assert_eq!(pointer_escape("a~b/c"), "a~0b~1c");
    }

    #[test]
    fn injected_or_opted_out_pods_get_no_patch() {
        for pod in [
            json!({"metadata": {"annotations": {INJECTED: "transparent"}}, "spec": {"containers": [{"name": "a"}]}}),
            json!({"metadata": {"annotations": {INJECT: "false"}}, "spec": {"containers": [{"name": "a"}]}}),
            json!({"metadata": {"labels": {INJECT: "false"}}, "spec": {"containers": [{"name": "a"}]}}),
        ] {
            assert!(plan(&pod, &config()).patch.is_empty(), "{pod}");
        }
    }

    #[test]
    fn missing_arrays_are_created_and_existing_ones_appended() {
        let bare = json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "a", "image": "x"}]}});
        let p = plan(&bare, &config()).patch;
        let paths: Vec<&str> = p.iter().map(|o| o["path"].as_str().unwrap()).collect();
        assert!(paths.contains(&"/metadata/annotations"), "{paths:?}");
        assert!(paths.contains(&"/spec/volumes"), "{paths:?}");
        assert!(paths.contains(&"/spec/initContainers"), "{paths:?}");
        assert!(paths.contains(&"/spec/containers/0/env"), "{paths:?}");
        let full = json!({"metadata": {"annotations": {"x": "y"}}, "spec": {
            "volumes": [], "initContainers": [{"name": "i", "env": [{"name": "SSL_CERT_FILE", "value": "/mine"}]}],
            "containers": [{"name": "a", "env": [], "volumeMounts": []}]}});
        let p = plan(&full, &config()).patch;
        let paths: Vec<&str> = p.iter().map(|o| o["path"].as_str().unwrap()).collect();
        assert!(
            paths.contains(&"/metadata/annotations/tokentap.io~1capture"),
            "{paths:?}"
        );
        assert!(paths.contains(&"/spec/volumes/-"));
        assert!(paths.contains(&"/spec/initContainers/0"));
        // The user's own SSL_CERT_FILE is kept.
        assert!(
            !p.iter().any(|o| o["path"] == "/spec/initContainers/0/env/-"
                && o["value"]["name"] == "SSL_CERT_FILE")
        );
    }

    #[test]
    fn an_unknown_mode_or_a_sidecar_without_an_engine_is_not_injected_and_says_why() {
        let pod = json!({"metadata": {"annotations": {MODE: "weird"}}, "spec": {"containers": [{"name": "a"}]}});
        let p = plan(&pod, &config());
        assert!(p.patch.is_empty() && p.warnings[0].contains("weird"));
        let mut c = config();
        c.backend = None;
        let pod = json!({"metadata": {"annotations": {MODE: "sidecar"}}, "spec": {"containers": [{"name": "a"}]}});
        let p = plan(&pod, &c);
        assert!(p.patch.is_empty() && p.warnings[0].contains("--backend"));
    }
}
