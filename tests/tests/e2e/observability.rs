//! The dashboards and rules of deploy/ against a real Prometheus (Debian's, started here on
//! loopback). It scrapes a real `tokentap proxy` in front of a real llama-server (`--metrics`)
//! while Claude Code runs through it, a `tokentap serve` node running a small rollout, a
//! `tokentap worker` the proxy ships to, and named doubles of the exporters that need a GPU
//! (vLLM, SGLang, DCGM: tokentap_e2e::exporter_doubles). Every expression of every dashboard
//! panel and every recording rule must return data. promtool checks the configuration and
//! runs the alert rules' unit tests.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_e2e::exporter_doubles::{Exporter, ExporterDouble};
use tokentap_e2e::harness::{run_claude, HarnessDirs};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::node_api;
use tokentap_e2e::procs::{
    free_port, http_client, spawn_guarded, wait_healthy, ChildGuard, KillScope,
};
use tokentap_e2e::scripted::curl_agent;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::worker::Worker;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(deploy().join("prometheus"))
        .output()
        .expect("promtool (Debian package prometheus; scripts/setup installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

#[test]
fn promtool_accepts_the_configuration_and_every_alert_behaves_as_its_unit_tests_say() {
    let text = promtool(&["check", "config", "prometheus.yml"]);
    assert!(text.contains("SUCCESS"), "{text}");
    let text = promtool(&["check", "rules", "rules/recording.yml", "rules/alerts.yml"]);
    assert!(text.contains("SUCCESS: 8 rules found"), "{text}");
    let text = promtool(&["test", "rules", "tests/alerts_test.yml"]);
    assert!(text.contains("SUCCESS"), "{text}");
}

/// Every alert in alerts.yml has a unit test that shows it firing.
#[test]
fn every_alert_has_a_unit_test_that_fires_it() {
    let alerts = std::fs::read_to_string(deploy().join("prometheus/rules/alerts.yml")).unwrap();
    let tests = std::fs::read_to_string(deploy().join("prometheus/tests/alerts_test.yml")).unwrap();
    for line in alerts.lines() {
        if let Some(name) = line.trim().strip_prefix("- alert: ") {
            assert!(
                tests.contains(&format!(
                    "alertname: {name}\n        exp_alerts:\n          - exp_labels"
                )),
                "{name} has no test that fires it"
            );
        }
    }
}

/// Every panel's expressions, with the dashboards' variables as "All".
fn panel_exprs() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(deploy().join("grafana/dashboards")).unwrap() {
        let path = entry.unwrap().path();
        let board: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(board["schemaVersion"], 39, "{}", path.display());
        let vars: Vec<&str> = board["templating"]["list"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap())
            .collect();
        assert!(vars.contains(&"datasource") && vars.contains(&"namespace"));
        for panel in board["panels"].as_array().unwrap() {
            for t in panel["targets"].as_array().into_iter().flatten() {
                let expr = t["expr"]
                    .as_str()
                    .unwrap()
                    .replace("$__rate_interval", "1m")
                    .replace("$__interval", "1m")
                    .replace("$__range", "10m")
                    .replace("$namespace", ".*")
                    .replace("$engine", ".*")
                    .replace("$model", ".*");
                out.push((
                    format!(
                        "{} / {}",
                        board["title"].as_str().unwrap(),
                        panel["title"].as_str().unwrap()
                    ),
                    expr,
                ));
            }
        }
    }
    out
}

/// Every dashboard's query variables (`label_values(METRIC{…}, LABEL)`), as PromQL that
/// returns the values Grafana would offer: `count by (LABEL) (METRIC{…})`.
fn variable_queries() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(deploy().join("grafana/dashboards")).unwrap() {
        let board: Value =
            serde_json::from_slice(&std::fs::read(entry.unwrap().path()).unwrap()).unwrap();
        for var in board["templating"]["list"].as_array().unwrap() {
            if var["type"] != "query" {
                continue;
            }
            let def = var["definition"].as_str().unwrap();
            let args = def
                .strip_prefix("label_values(")
                .and_then(|a| a.strip_suffix(')'))
                .unwrap_or_else(|| panic!("variable {}: {def}", var["name"]));
            let (metric, label) = args.rsplit_once(',').unwrap();
            let metric = metric.replace("$engine", ".*").replace("$model", ".*");
            out.push((
                format!(
                    "{} / variable {}",
                    board["title"].as_str().unwrap(),
                    var["name"]
                ),
                format!("count by ({}) ({metric})", label.trim()),
            ));
        }
    }
    out
}

fn recording_rules() -> Vec<String> {
    std::fs::read_to_string(deploy().join("prometheus/rules/recording.yml"))
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record: ").map(str::to_owned))
        .collect()
}

async fn query(prometheus: &str, expr: &str) -> Value {
    let r: Value = http_client()
        .get(format!("{prometheus}/api/v1/query"))
        .query(&[("query", expr)])
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["status"], "success", "{expr}: {r}");
    r["data"]["result"].clone()
}

/// The expressions (of `all`) that return no number now: no series at all, or only NaN (a
/// quantile of a histogram nothing was observed in lately, 0/0).
async fn without_numbers(prometheus: &str, all: &[(String, String)]) -> Vec<String> {
    let mut out = Vec::new();
    for (what, expr) in all {
        let result = query(prometheus, expr).await;
        let series = result.as_array().map_or(0, Vec::len);
        let numbers = result.as_array().into_iter().flatten().any(|s| {
            s["value"][1]
                .as_str()
                .is_some_and(|v| v.parse::<f64>().is_ok_and(f64::is_finite))
        });
        if series == 0 {
            out.push(format!("{what} (no data): {expr}"));
        } else if !numbers {
            out.push(format!("{what} (only NaN): {expr}"));
        }
    }
    out
}

/// A real Prometheus on loopback with `config` (YAML), ready to answer queries.
async fn start_prometheus(dir: &Path, port: u16, config: &str) -> (ChildGuard, String) {
    let config_path = dir.join("prometheus.yml");
    std::fs::write(&config_path, config).unwrap();
    let mut cmd = Command::new("prometheus");
    cmd.arg(format!("--config.file={}", config_path.display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ));
    let mut child = spawn_guarded(
        cmd,
        &dir.join("prometheus.log"),
        KillScope::Process,
        "prometheus",
    )
    .expect("prometheus (Debian package; scripts/setup installs it)");
    let url = format!("http://127.0.0.1:{port}");
    if let Err(e) = wait_healthy(
        &format!("{url}/-/ready"),
        &mut child,
        Duration::from_secs(60),
    )
    .await
    {
        panic!("prometheus not ready: {e}\n{}", child.log_tail(20));
    }
    (child, url)
}

/// prometheus-kubernetes.yml's relabeling on a real Prometheus. Debian's build has no
/// Kubernetes discovery, so the pods come from a file with the `__meta_kubernetes_*` labels
/// Kubernetes discovery sets: an annotated pod is scraped on its annotated port with
/// `namespace`, `pod`, `node` and `container`, and a pod without the annotation is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_discovery_relabeling_keeps_annotated_pods_with_namespace_pod_and_node() {
    let dir = tempfile::tempdir().unwrap();
    let vllm = ExporterDouble::start(Exporter::Vllm, "Qwen/Qwen3-8B", "rl", "vllm-0").await;
    let pod = |name: &str, scrape: Option<&str>| {
        let mut labels = json!({
            "__meta_kubernetes_namespace": "rl",
            "__meta_kubernetes_pod_name": name,
            "__meta_kubernetes_pod_node_name": "gpu-node-1",
            "__meta_kubernetes_pod_container_name": "engine",
            "__meta_kubernetes_pod_label_app_kubernetes_io_name": "vllm",
            "__meta_kubernetes_pod_annotation_prometheus_io_port": vllm.addr.port().to_string(),
            "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
        });
        if let Some(v) = scrape {
            labels["__meta_kubernetes_pod_annotation_prometheus_io_scrape"] = json!(v);
        }
        // The pod's IP and container port as discovery gives them; the annotation's port wins.
        json!({"targets": ["127.0.0.1:8000"], "labels": labels})
    };
    let pods = dir.path().join("pods.json");
    std::fs::write(
        &pods,
        serde_json::to_vec(&json!([pod("vllm-0", Some("true")), pod("vllm-1", None)])).unwrap(),
    )
    .unwrap();
    let config = std::fs::read_to_string(deploy().join("prometheus/prometheus-kubernetes.yml"))
        .unwrap()
        .replace("scrape_interval: 15s", "scrape_interval: 1s")
        .replace(
            "- rules/",
            &format!("- {}/", deploy().join("prometheus/rules").display()),
        );
    let discovery = "    kubernetes_sd_configs:\n      - role: pod\n";
    assert!(config.contains(discovery), "{config}");
    let config = config.replace(
        discovery,
        &format!(
            "    file_sd_configs:\n      - files: [{}]\n",
            pods.display()
        ),
    );
    let (mut prom, prometheus) = start_prometheus(dir.path(), free_port(), &config).await;

    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let up = query(
            &prometheus,
            r#"up{job="vllm", namespace="rl", pod="vllm-0", node="gpu-node-1", container="engine"} == 1"#,
        )
        .await;
        let gen = query(
            &prometheus,
            r#"vllm:generation_tokens_total{namespace="rl", pod="vllm-0", node="gpu-node-1"}"#,
        )
        .await;
        if !up.as_array().unwrap().is_empty() && !gen.as_array().unwrap().is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the annotated pod is not scraped with its labels: up {up}, vllm {gen}\n{}",
            prom.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let targets: Value = http_client()
        .get(format!("{prometheus}/api/v1/targets"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let active = targets["data"]["activeTargets"].as_array().unwrap();
    assert_eq!(active.len(), 1, "only the annotated pod: {targets}");
    assert_eq!(
        active[0]["scrapeUrl"],
        format!("http://127.0.0.1:{}/metrics", vllm.addr.port())
    );
    assert!(prom.try_wait().is_none(), "prometheus exited");
}

const NODE_TOKEN: &str = "observability-node-token";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_every_dashboard_panel_and_recording_rule_returns_data_from_a_real_prometheus() {
    let dir = tempfile::tempdir().unwrap();
    let llama = LlamaServer::start_with(8192, &["--metrics"]).await;
    let vllm = ExporterDouble::start(Exporter::Vllm, "Qwen/Qwen3-8B", "rl", "vllm-0").await;
    let sglang = ExporterDouble::start(Exporter::Sglang, "Qwen/Qwen3-8B", "rl", "sglang-0").await;
    let dcgm = ExporterDouble::start(Exporter::Dcgm, "", "rl", "vllm-0").await;
    let mut worker = Worker::start(&dir.path().join("worker"), &["--session-idle", "2"]).await;
    let proxy = Tokentap::start(
        TokentapConfig::new(&llama.url, "llamacpp")
            .arg("--ship-to")
            .arg(&worker.url)
            .arg("--policy-version")
            .arg("step-1"),
    )
    .await;
    let node_port = free_port();
    std::fs::create_dir_all(dir.path().join("project")).unwrap();
    let _node = node_api::start_serve(dir.path(), node_port, &llama.url, NODE_TOKEN, &[]).await;

    // A real Prometheus scraping all of it every second, with deploy's rules.
    let prom_port = free_port();
    let rules = deploy().join("prometheus/rules");
    let config = json!({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [rules.join("recording.yml"), rules.join("alerts.yml")],
        "scrape_configs": [
            {"job_name": "tokentap", "static_configs": [{"targets": [proxy.url.trim_start_matches("http://")]}]},
            {"job_name": "tokentap-node", "authorization": {"credentials": NODE_TOKEN},
             "static_configs": [{"targets": [format!("127.0.0.1:{node_port}")]}]},
            {"job_name": "tokentap-worker", "static_configs": [{"targets": [worker.url.trim_start_matches("http://")]}]},
            {"job_name": "engines", "static_configs": [
                {"targets": [format!("127.0.0.1:{}", llama.port)]},
                // As Kubernetes discovery would label the engine pods.
                {"targets": [vllm.target()], "labels": {"namespace": "rl", "pod": "vllm-0"}},
                {"targets": [sglang.target()], "labels": {"namespace": "rl", "pod": "sglang-0"}},
            ]},
            {"job_name": "dcgm", "honor_labels": true, "static_configs": [{"targets": [dcgm.target()]}]},
        ],
    });
    // Prometheus reads YAML, and JSON is YAML.
    let (prom_child, prometheus) = start_prometheus(
        dir.path(),
        prom_port,
        &serde_json::to_string_pretty(&config).unwrap(),
    )
    .await;

    // Traffic: Claude Code through the proxy (twice), a bad request, and a rollout of two
    // samples of two calls each (whose gaps are harness time).
    let dirs = HarnessDirs::new();
    for _ in 0..2 {
        run_claude(&dirs, &proxy.url, "sk-ant-obs-1", "m", "Say hi.", false)
            .await
            .assert_success("claude -p");
    }
    let bad = http_client()
        .post(proxy.chat_url())
        .body("{not json")
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    // Each sample: a call, a second of harness work, a call. Two rollouts one after the
    // other, so the second moves counters Prometheus has already seen (a rate needs that).
    let task = json!({
        "task_id": "observability",
        "instruction": "chat",
        "workspace": {"dir": {"path": dir.path().join("project")}},
        "harness": {"name": "command", "argv": ["sh", "-c", format!("{}{}", curl_agent(1, "sleep 1 && "), curl_agent(1, "true"))]},
        "evaluator": {"kind": "command", "command": "true"},
        "num_samples": 2,
    });
    for round in 1..=2 {
        let r = http_client()
            .post(format!("http://127.0.0.1:{node_port}/v1/rollouts"))
            .bearer_auth(NODE_TOKEN)
            .json(&task)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202, "{}", r.text().await.unwrap_or_default());
        let results = node_api::results_within(
            &format!("http://127.0.0.1:{node_port}"),
            NODE_TOKEN,
            0,
            2 * round,
            10,
            Duration::from_secs(120),
        )
        .await;
        assert_eq!(results.len(), 2 * round);
        for sample in &results {
            assert_eq!(sample["outcome"]["status"], "completed", "{sample}");
        }
        // Two scrapes between the rounds.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }

    // One more call through the shipping proxy now that Prometheus knows the worker's
    // series, so the worker's ingest lag has a rate (a first scrape after the Claude runs
    // would see its histogram only with its final counts).
    let late = http_client()
        .post(proxy.chat_url())
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        late.status(),
        200,
        "{}",
        late.text().await.unwrap_or_default()
    );

    // Every target up, then every panel and rule with a number (rates need two scrapes after
    // the traffic; the worker's traces a session-idle after it).
    let panels = [panel_exprs(), variable_queries()].concat();
    let records: Vec<(String, String)> = recording_rules()
        .into_iter()
        .map(|r| (format!("recording rule {r}"), r))
        .collect();
    assert!(panels.len() >= 40, "{} panel expressions", panels.len());
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let down = query(&prometheus, "up == 0").await;
        let missing = [
            without_numbers(&prometheus, &panels).await,
            without_numbers(&prometheus, &records).await,
        ]
        .concat();
        if missing.is_empty() && down.as_array().unwrap().is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "targets down: {down}\n{} expressions without a number:\n{}\nprometheus log:\n{}",
            missing.len(),
            missing.join("\n"),
            prom_child.log_tail(20)
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // The numbers mean what they say: Claude Code's calls are counted under its harness.
    let claude = query(
        &prometheus,
        "sum(tokentap_completion_tokens_total{harness=\"claude_code\",policy_version=\"step-1\"})",
    )
    .await;
    assert!(
        claude[0]["value"][1]
            .as_str()
            .unwrap()
            .parse::<f64>()
            .unwrap()
            > 0.0,
        "{claude}"
    );
    // The rollout's harness slept a second between its calls: its share of the session's
    // time is a real fraction, not 0/0.
    let share = query(&prometheus, "tokentap:harness_time_share:ratio_rate5m").await;
    eprintln!("harness time share: {share}");
    assert!(
        share.as_array().unwrap().iter().any(|s| {
            let v: f64 = s["value"][1].as_str().unwrap().parse().unwrap();
            v > 0.0 && v <= 1.0
        }),
        "no session with a harness time share in (0, 1]: {share}"
    );
    eprintln!(
        "{} panel and variable expressions and {} recording rules returned numbers",
        panels.len(),
        records.len()
    );
    assert!(worker.terminate().await);
}
