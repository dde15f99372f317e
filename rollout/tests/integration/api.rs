//! The control plane over HTTP: bearer token, submit, long-poll results, show, cancel, and
//! errors in one JSON shape.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokentap_e2e::node_api::{get_json, results_within};
use tokentap_rollout::api::{router, ApiState};
use tokentap_rollout::pipeline::{Pipeline, PipelineConfig};
use tokentap_rollout::store::Store;

const TOKEN: &str = "node-secret";

async fn node(dir: &std::path::Path) -> String {
    let store = Arc::new(Store::open(&dir.join("node.redb")).unwrap());
    let config = PipelineConfig {
        data_dir: dir.join("data"),
        init_workers: 1,
        run_workers: 2,
        post_workers: 1,
        max_attempts: 2,
        capture: None,
        ..PipelineConfig::new(std::path::PathBuf::new())
    };
    let pipeline = Arc::new(Pipeline::start(store, config.clone()).await.unwrap());
    let app = router(ApiState {
        pipeline,
        extra_metrics: None,
        cluster: None,
        token: Some(TOKEN.into()),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

fn task(dir: &std::path::Path, script: &str) -> Value {
    std::fs::create_dir_all(dir.join("project")).unwrap();
    json!({
        "task_id": "t",
        "instruction": "write ok",
        "workspace": {"dir": {"path": dir.join("project")}},
        "harness": {"name": "command", "argv": ["sh", "-c", script]},
        "evaluator": {"kind": "command", "command": "test -f ok"},
        "num_samples": 2
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_poll_show_and_cancel_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let url = node(dir.path()).await;
    let http = reqwest::Client::builder().no_proxy().build().unwrap();

    let r = http
        .post(format!("{url}/v1/rollouts"))
        .json(&task(dir.path(), "touch ok"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "unauthorized");

    let r = http
        .post(format!("{url}/v1/rollouts"))
        .bearer_auth(TOKEN)
        .json(&json!({"task_id": "t"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["type"], "invalid_task");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("missing field"),
        "{e}"
    );

    let r = http
        .post(format!("{url}/v1/rollouts"))
        .bearer_auth(TOKEN)
        .json(&task(dir.path(), "touch ok"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let accepted: Value = r.json().await.unwrap();
    let id = accepted["rollout_id"].as_str().unwrap().to_owned();
    assert_eq!(accepted["samples"].as_array().unwrap().len(), 2);

    // Long poll until both samples are in.
    let seen = results_within(&url, TOKEN, 0, 2, 20, Duration::from_secs(60)).await;
    for s in &seen {
        assert_eq!(
            s["outcome"],
            json!({"status": "completed", "reward": 1.0}),
            "{s}"
        );
    }
    let shown = get_json(&format!("{url}/v1/rollouts/{id}"), TOKEN).await;
    assert_eq!(shown["status"], "done");

    // A rollout that hangs is cancelled: its running agents are killed, all samples end.
    let mut hang = task(dir.path(), "sleep 60");
    hang["task_id"] = json!("hang");
    let r: Value = http
        .post(format!("{url}/v1/rollouts"))
        .bearer_auth(TOKEN)
        .json(&hang)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let hang_id = r["rollout_id"].as_str().unwrap().to_owned();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = http
        .delete(format!("{url}/v1/rollouts/{hang_id}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Both samples end (one cancelled while queued or in INIT, one killed while running).
    let ended = results_within(&url, TOKEN, 2, 2, 5, Duration::from_secs(20)).await;
    let outcomes: Vec<&Value> = ended.iter().map(|s| &s["outcome"]).collect();
    assert_eq!(outcomes, vec![&json!({"status": "cancelled"}); 2]);

    let r = http
        .get(format!("{url}/v1/rollouts/ro-nope"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

/// Every route the OpenAPI document lists is served (a missing one would answer axum's bare
/// 404 or 405, not the node's JSON).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_matches_the_router() {
    let dir = tempfile::tempdir().unwrap();
    let url = node(dir.path()).await;
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let doc: Value = http
        .get(format!("{url}/openapi.json"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(doc["openapi"], "3.0.3");
    for (method, path) in tokentap_rollout::openapi::ROUTES {
        let path = path.replace("{id}", "no-such-id");
        let r = http
            .request(
                method.to_uppercase().parse().unwrap(),
                format!("{url}{path}?wait=0"),
            )
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let body = r.text().await.unwrap();
        assert_ne!(status, 405, "{method} {path}");
        if status == 404 {
            assert!(body.contains("\"error\""), "{method} {path}: not routed");
        }
    }
}
