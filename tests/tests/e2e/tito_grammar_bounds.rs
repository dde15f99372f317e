//! `--token-mode tito` on llama.cpp builds a GBNF grammar of the offered tools' calls for each
//! request (`tokentap_answer_parse::call_grammar`). Issue 49: a 1.2 KB schema of 18 levels of
//! `{"type": ["object", "object"], …}` made tokentap render its innermost schema 2^18 times
//! (two such requests froze the whole proxy, `/health` included, for over 7 minutes), and
//! 12,000 optional properties asked for a grammar of gigabytes (the process aborted on the
//! allocation). Now the grammar is linear in the schema and bounded, built off the runtime
//! within a deadline, and tools past its bounds refuse the call with a 400.
//!
//! Checked, against a scripted llama-server `/completion` (the tiny reasoning model's real
//! tokenizer; a real llama-server is not needed to see the proxy's side), three requests of one
//! session at once: the 18 levels are answered within seconds, with a grammar of a few KB; 40
//! levels (past the depth bound) and the 12,000 properties (past the rule bound) are answered
//! 400 in the API's error shape naming the bound, within seconds, and never reach the engine;
//! meanwhile an ordinary call with tools of another session gets its answer (with its
//! grammar) and `/health` answers. The positive control: the same ordinary call before.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokentap_chat_template::Tokenizer;
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::procs::serve_on_loopback;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};

const ANSWER: &str = "<think>Check</think>\n\nDone.";

struct Double {
    tokenizer: Tokenizer,
    end_of_turn: u32,
    /// Each `/completion` request's prompt length and grammar size (0: none).
    requests: Mutex<Vec<(usize, usize)>>,
}

/// llama-server's whole `/completion` answer: [`ANSWER`]'s ids and the end of turn, each
/// with its logprob, and the count of the prompt it evaluated.
async fn completion(State(double): State<Arc<Double>>, Json(body): Json<Value>) -> Json<Value> {
    let prompt = body["prompt"].as_array().map_or(0, Vec::len);
    let grammar = body["grammar"].as_str().map_or(0, str::len);
    double.requests.lock().unwrap().push((prompt, grammar));
    let mut tokens = double.tokenizer.encode(ANSWER).expect("encoding");
    tokens.push(double.end_of_turn);
    let probs: Vec<Value> = tokens
        .iter()
        .map(|id| json!({"id": id, "logprob": -0.5}))
        .collect();
    Json(
        json!({"content": ANSWER, "tokens": tokens, "completion_probabilities": probs,
        "stop": true, "stop_type": "eos", "tokens_evaluated": prompt}),
    )
}

fn tool(name: &str, parameters: Value) -> Value {
    json!({"type": "function", "function": {"name": name, "parameters": parameters}})
}

fn request(tools: Vec<Value>) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "Hi."}], "tools": tools,
        "max_tokens": 32})
}

/// An ordinary tool: one required string, one optional integer.
fn bash() -> Value {
    tool(
        "bash",
        json!({"type": "object", "required": ["command"], "properties": {
        "command": {"type": "string"}, "timeout": {"type": "integer"}}}),
    )
}

/// `levels` of `{"type": ["object", "object"], "properties": {"a": <next>}}`.
fn nested(levels: usize) -> Value {
    let mut s = json!({"type": "string"});
    for _ in 0..levels {
        s = json!({"type": ["object", "object"], "properties": {"a": s}});
    }
    s
}

/// An object of `n` optional properties.
fn optional(n: usize) -> Value {
    let props: serde_json::Map<String, Value> = (0..n)
        .map(|i| (format!("p{i}"), json!({"type": "integer"})))
        .collect();
    json!({"type": "object", "properties": props})
}

/// A call of `session`: its status, answer, and how long it took.
async fn call(tokentap: &Tokentap, session: &str, body: &Value) -> (u16, Value, Duration) {
    let started = Instant::now();
    let r = reqwest::Client::new()
        .post(tokentap.chat_url())
        .header("x-tokentap-session", session)
        .json(body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .expect("an answer");
    let status = r.status().as_u16();
    let v: Value = r.json().await.expect("a JSON answer");
    (status, v, started.elapsed())
}

#[tokio::test(flavor = "multi_thread")]
async fn tito_grammar_bounds_refuse_exploding_schemas_while_other_sessions_run() {
    let model = Artefacts::require_think_model();
    let tokenizer = Tokenizer::open(&model).expect("the model's tokenizer");
    let end_of_turn = tokenizer.encode("<|im_end|>").expect("encoding")[0];
    let double = Arc::new(Double {
        tokenizer,
        end_of_turn,
        requests: Mutex::new(Vec::new()),
    });
    let app = Router::new()
        .route("/completion", post(completion))
        .with_state(double.clone());
    let (addr, _server) = serve_on_loopback(app, "the llama.cpp /completion double").await;
    let tokentap = Tokentap::start(
        TokentapConfig::new(format!("http://{addr}"), "llamacpp")
            .arg("--token-mode=tito")
            .arg("--tokenizer")
            .arg(model.display().to_string()),
    )
    .await;

    // The control: an ordinary call with tools is answered, with its grammar.
    let ordinary = request(vec![bash()]);
    let (status, v, _) = call(&tokentap, "victim-0", &ordinary).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Done.", "{v}");
    let grammar = double.requests.lock().unwrap()[0].1;
    assert!(
        grammar > 0,
        "the ordinary call's grammar went to the engine"
    );

    // The attacks of one session and an ordinary call of another, at the same time: the 18
    // levels are within the bounds now (a grammar of a few KB, answered), 40 levels are past
    // the depth bound and 12,000 optional properties past the rule bound (refused).
    let deep = request(vec![tool("deep", nested(18))]);
    let deeper = request(vec![tool("deeper", nested(40))]);
    let wide = request(vec![tool("wide", optional(12_000))]);
    eprintln!(
        "attack bodies: 18 levels {} bytes, 40 levels {} bytes, 12,000 optional properties {} bytes",
        deep.to_string().len(),
        deeper.to_string().len(),
        wide.to_string().len()
    );
    let health = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = Instant::now();
        let r = reqwest::Client::new()
            .get(format!("{}/health", tokentap.url))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .expect("/health answers");
        (r.status().as_u16(), started.elapsed())
    };
    let (deep, deeper, wide, victim, health) = tokio::join!(
        call(&tokentap, "attacker", &deep),
        call(&tokentap, "attacker", &deeper),
        call(&tokentap, "attacker", &wide),
        call(&tokentap, "victim-1", &ordinary),
        health,
    );
    let (status, v, took) = deep;
    eprintln!("18 levels answered {status} in {took:?}");
    assert_eq!(status, 200, "{v}");
    assert!(took < Duration::from_secs(10), "answered in {took:?}");
    for ((status, v, took), bound) in [
        (deeper, "nest deeper than 32 levels"),
        (wide, "call grammar has over 8192 rules"),
    ] {
        eprintln!("attack answered {status} in {took:?}: {v}");
        assert_eq!(status, 400, "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(bound), "{v}");
        // tokentap's own refusal of the request, in the API's shape, not an engine's error.
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(!message.contains("backend answered"), "{v}");
        assert!(took < Duration::from_secs(10), "refused in {took:?}");
    }
    let (status, v, took) = victim;
    eprintln!("the other session's call: {status} in {took:?}; /health {health:?}");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Done.", "{v}");
    assert!(took < Duration::from_secs(10), "answered in {took:?}");
    assert_eq!(health.0, 200);
    assert!(
        health.1 < Duration::from_secs(5),
        "/health in {:?}",
        health.1
    );
    // The refused attacks never reached the engine; the ordinary calls did, each with its
    // grammar, and the 18 levels with a grammar of a few KB (6.5 MB for 14 before).
    let requests = double.requests.lock().unwrap().clone();
    eprintln!("the engine got (prompt ids, grammar bytes): {requests:?}");
    assert_eq!(requests.len(), 3, "{requests:?}");
    assert_eq!(
        requests.iter().filter(|&&(_, g)| g == grammar).count(),
        2,
        "{requests:?}"
    );
    assert!(
        requests.iter().all(|&(_, g)| g > 0 && g < 8 * 1024),
        "{requests:?}"
    );
}
