//! Samples under capture: the `command` preset's agent talks to the node's in-process capture
//! through its per-sample base URL (here with curl, to the scripted-turn backend as the
//! engine); POST_RUN reconstructs the sample's calls into traces carrying its reward. A sample
//! that runs over its budget keeps its trajectory, with reward 0 and nothing trainable.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokentap_e2e::node_api::stored_results;
use tokentap_e2e::scripted::{
    counting_replies, curl_agent, ScriptedBackend, Tokens, SCRIPTED_MODEL,
};
use tokentap_proxy::app::TextModeSessions;
use tokentap_proxy::backend::{self, BackendConfig, BackendKind};
use tokentap_proxy::metrics::Metrics;
use tokentap_proxy::normalize::SystemLayout;
use tokentap_proxy::{CaptureService, ProxyConfig};
use tokentap_reconstruct::output::read_traces_jsonl;
use tokentap_rollout::capture::{sink, NodeCapture, SessionIndex, TextModeSamples};
use tokentap_rollout::gate::{Gate, NodeGate};
use tokentap_rollout::pipeline::{now_ms, Pipeline, PipelineConfig};
use tokentap_rollout::store::Store;
use tokentap_rollout::task::{Outcome, TaskSpec};
use tokentap_spool::{SpoolConfig, SpoolWriter};

fn task(project: &std::path::Path, id: &str, script: &str, agent_s: u64) -> TaskSpec {
    serde_json::from_value(json!({
        "task_id": id,
        "instruction": "chat",
        "workspace": {"dir": {"path": project}},
        "harness": {"name": "command", "argv": ["sh", "-c", script]},
        "evaluator": {"kind": "session-completed"},
        "budgets": {"agent_s": agent_s}
    }))
    .unwrap()
}

/// The engine at `url`, as the capture calls it (vLLM's API).
fn engine_backend(url: &str) -> Arc<dyn backend::Backend> {
    Arc::from(
        backend::build(BackendConfig {
            kind: BackendKind::Vllm,
            url: url.to_owned(),
            api_key: None,
            ca_roots: Vec::new(),
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            max_answer_bytes: tokentap_proxy::backend::DEFAULT_MAX_ANSWER_BYTES,
        })
        .unwrap(),
    )
}

/// A node with in-process capture in front of `engine`, optionally behind `gate`.
async fn node(
    dir: &std::path::Path,
    engine: &str,
    gate: Option<Arc<NodeGate>>,
) -> (Arc<Store>, Pipeline) {
    let (store, pipeline, _) = node_with_text_engine(dir, engine, None, gate).await;
    (store, pipeline)
}

/// [`node`], and with `text_engine` the samples of tasks asking for `"token_mode": "off"` have
/// their calls sent there, as a node started in a token mode sends them to the engine called
/// with text; its capture too.
async fn node_with_text_engine(
    dir: &std::path::Path,
    engine: &str,
    text_engine: Option<&str>,
    gate: Option<Arc<NodeGate>>,
) -> (Arc<Store>, Pipeline, Arc<NodeCapture>) {
    let metrics = Arc::new(Metrics::new());
    let index = Arc::new(SessionIndex::of_spool(&dir.join("spool")));
    let writer = SpoolWriter::open(&dir.join("spool"), SpoolConfig::default()).unwrap();
    let (record_sink, _spool_thread) = sink(writer, metrics.clone(), index.clone());
    let mut service = CaptureService::new(
        ProxyConfig {
            max_body_bytes: 1 << 20,
            synthetic_stream: false,
            backend_model: Some(SCRIPTED_MODEL.into()),
            policy_version: None,
            system_layout: SystemLayout::AsSent,
            fixed_session: None,
            ..ProxyConfig::default()
        },
        engine_backend(engine),
        record_sink,
        metrics,
    );
    if let Some(g) = &gate {
        service = service.with_gate(Arc::new(Gate(g.clone())));
    }
    let text_mode = Arc::new(TextModeSamples::default());
    if let Some(url) = text_engine {
        service = service.with_text_mode_sessions(engine_backend(url), text_mode.clone());
    }
    let capture = Arc::new(NodeCapture::start(service, index, text_mode).await.unwrap());
    let store = Arc::new(Store::open(&dir.join("node.redb")).unwrap());
    let config = PipelineConfig {
        init_workers: 1,
        run_workers: 2,
        post_workers: 1,
        max_attempts: 2,
        capture: Some(capture.clone()),
        gate,
        ..PipelineConfig::new(dir.join("data"))
    };
    let pipeline = Pipeline::start(store.clone(), config).await.unwrap();
    (store, pipeline, capture)
}

/// An agent that holds two unrelated one-turn conversations (two traces).
fn two_conversations() -> String {
    ["first question", "an unrelated one"]
        .iter()
        .map(|q| {
            let body = json!({"model": "m", "messages": [{"role": "user", "content": q}]});
            format!("curl -sS --max-time 20 \"$OPENAI_BASE_URL/chat/completions\" -H 'content-type: application/json' -d '{body}' > /dev/null")
        })
        .collect::<Vec<_>>()
        .join(" && ")
}

async fn wait_file(path: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A weight update mid-sample: pause waits for nothing in flight, holds the agent's next call
/// until resume, which sets the new policy version; the sample's trace says which call ran
/// under which version and that it spans two. The task's sampling parameters reach the
/// engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_holds_calls_and_resume_changes_the_policy_version() {
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    let gate = NodeGate::new(Some("v1".into()));
    let (store, pipeline) = node(dir.path(), &engine.url, Some(gate.clone())).await;
    // One call, a sign, a wait for the go-ahead, a second call.
    let script = curl_agent(
        1,
        "touch ../called && while [ ! -f ../go ]; do sleep 0.05; done && ",
    ) + &curl_agent(2, "true").replacen("curl", "true", 1);
    let mut spec = task(&project, "spans", &script, 60);
    spec.sampling.temperature = Some(0.25);
    let (rollout, samples) = store.submit(spec, now_ms()).unwrap();
    let sample_dir = dir.path().join("data/samples").join(&samples[0].sample_id);
    pipeline.submit(rollout, samples.clone());

    wait_file(&sample_dir.join("called")).await;
    let status = gate.pause(Duration::from_secs(10)).await;
    assert_eq!((status.paused, status.in_flight), (true, 0));
    std::fs::write(sample_dir.join("go"), "").unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        engine.requests().len(),
        1,
        "the second call is held while paused"
    );
    gate.resume(Some("v2".into()));

    let deadline = Instant::now() + Duration::from_secs(30);
    let s = loop {
        let s = store.sample(&samples[0].sample_id).unwrap();
        if s.outcome.is_some() {
            break s;
        }
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(s.outcome, Some(Outcome::Completed { reward: 1.0 }));
    let t = s.trajectory.unwrap();
    let traces = read_traces_jsonl(std::path::Path::new(&t.path)).unwrap();
    assert_eq!(traces.len(), 1, "{traces:?}");
    let versions: Vec<Option<&str>> = traces[0]
        .calls
        .iter()
        .map(|c| c.policy_version.as_deref())
        .collect();
    assert_eq!(versions, [Some("v1"), Some("v2")]);
    assert!(traces[0].spans_policy_versions);
    for r in engine.requests() {
        assert_eq!(
            r["temperature"], 0.25,
            "the task's sampling reaches the engine"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_come_back_with_rewarded_traces() {
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    let (store, pipeline) = node(dir.path(), &engine.url, None).await;
    for spec in [
        task(&project, "talks", &curl_agent(2, "true"), 60),
        task(&project, "overruns", &curl_agent(1, "sleep 30"), 2),
        TaskSpec {
            incomplete: tokentap_rollout::task::Incomplete::Keep,
            ..task(&project, "overruns-kept", &curl_agent(1, "sleep 30"), 2)
        },
        TaskSpec {
            evaluator: serde_json::from_value(json!({
                "kind": "command",
                "command": "true",
                // Rewards the second trace of $TOKENTAP_TRACES alone; the outcome is 1.
                "reward_command": r#"id=$(sed -n '2s/.*"trace_id":"\([^"]*\)".*/\1/p' "$TOKENTAP_TRACES")
            printf '{"reward": 1, "traces": {"%s": 0.25}}' "$id" > "$TOKENTAP_REWARD_FILE""#
            }))
            .unwrap(),
            ..task(&project, "per-trace", &two_conversations(), 60)
        },
    ] {
        let (rollout, samples) = store.submit(spec, now_ms()).unwrap();
        pipeline.submit(rollout, samples);
    }
    for s in stored_results(&store, 4, Duration::from_secs(60)).await {
        let task = store.rollout(&s.rollout_id).unwrap().0.spec.task_id;
        let t = s
            .trajectory
            .clone()
            .unwrap_or_else(|| panic!("{task}: no trajectory"));
        assert!(t.complete, "{task}: {t:?}");
        assert_eq!(t.faithfulness_violations, 0, "{task}");
        let traces = read_traces_jsonl(std::path::Path::new(&t.path)).unwrap();
        match task.as_str() {
            "talks" => {
                assert_eq!(s.outcome, Some(Outcome::Completed { reward: 1.0 }));
                assert_eq!((t.calls, t.traces), (2, 1), "the two turns merge");
                assert_eq!(traces[0].reward, Some(1.0));
                assert_eq!(traces[0].calls.len(), 2);
                let sampled: u64 = traces[0]
                    .calls
                    .iter()
                    .map(|c| u64::from(c.sampled_len))
                    .sum();
                assert_eq!(t.trainable_tokens, sampled);
                assert_eq!(
                    traces[0].session_id, s.sample_id,
                    "the sample is the session"
                );
            }
            "overruns" => {
                assert!(
                    matches!(s.outcome, Some(Outcome::Timeout { reward, .. }) if reward == 0.0)
                );
                assert_eq!((t.calls, t.traces, t.trainable_tokens), (1, 1, 0));
                assert_eq!(traces[0].reward, Some(0.0));
                assert!(traces[0].loss_mask.iter().all(|m| *m == 0));
                assert!(
                    !traces[0].response_ids.is_empty(),
                    "what was captured is kept"
                );
            }
            "per-trace" => {
                assert_eq!(s.outcome, Some(Outcome::Completed { reward: 1.0 }));
                assert_eq!(t.traces, 2, "two unrelated conversations");
                let rewards: Vec<Option<f64>> = traces.iter().map(|t| t.reward).collect();
                assert_eq!(
                    rewards,
                    [Some(1.0), Some(0.25)],
                    "the evaluator's own for one"
                );
                let e = s.evaluation.clone().unwrap();
                assert_eq!(e.trace_rewards.get(&traces[1].trace_id), Some(&0.25));
            }
            "overruns-kept" => {
                assert!(matches!(s.outcome, Some(Outcome::Timeout { .. })));
                assert_eq!(traces[0].reward, Some(0.0));
                assert!(t.trainable_tokens > 0, "`keep` leaves the mask as sampled");
            }
            other => panic!("{other}"),
        }
    }
}

/// A node without transparent capture (not root, or built without the eBPF program) says so
/// on each sample that asks for it, and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transparent_task_on_a_node_without_it_fails_with_the_reason() {
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    let (store, pipeline) = node(dir.path(), &engine.url, None).await;
    let spec = TaskSpec {
        capture: tokentap_rollout::task::CaptureMode::Transparent,
        ..task(&project, "closed", &curl_agent(1, "true"), 60)
    };
    let (rollout, samples) = store.submit(spec, now_ms()).unwrap();
    pipeline.submit(rollout, samples);
    let s = stored_results(&store, 1, Duration::from_secs(30))
        .await
        .remove(0);
    match s.outcome {
        Some(Outcome::Error { reason }) => {
            assert!(reason.contains("transparent capture"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(engine.requests().is_empty(), "the agent never ran");
}

/// On a node started in a token mode, a task asking for `"token_mode": "off"` has its samples'
/// calls sent to the engine called with text, and only those; a task that names no mode runs
/// in the node's. A sample's session leaves the text-mode set once its records are collected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_mode_tasks_calls_go_to_the_text_engine_alone() {
    let own = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let text = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    let (store, pipeline, capture) =
        node_with_text_engine(dir.path(), &own.url, Some(&text.url), None).await;
    let off = TaskSpec {
        token_mode: Some(tokentap_rollout::task::TokenMode::Off),
        ..task(&project, "text", &curl_agent(1, "true"), 60)
    };
    let node_mode = task(&project, "node-mode", &curl_agent(2, "true"), 60);
    let mut sessions = Vec::new();
    for spec in [off, node_mode] {
        let (rollout, samples) = store.submit(spec, now_ms()).unwrap();
        sessions.push(samples[0].capture_session());
        pipeline.submit(rollout, samples);
    }
    let done = stored_results(&store, 2, Duration::from_secs(30)).await;
    let calls = |task_id: &str| {
        let s = done.iter().find(|s| s.task_id == task_id).unwrap();
        assert_eq!(s.outcome, Some(Outcome::Completed { reward: 1.0 }), "{s:?}");
        s.trajectory.as_ref().unwrap().calls
    };
    assert_eq!((calls("text"), calls("node-mode")), (1, 2));
    assert_eq!(text.requests().len(), 1, "the text-mode sample's one call");
    assert_eq!(own.requests().len(), 2, "the other sample's two calls");
    for session in &sessions {
        assert!(!capture.text_mode.in_text_mode(session), "{session}");
    }
}
