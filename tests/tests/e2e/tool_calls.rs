//! Tool-call round trips through tokentap (`--backend-kind vllm`) and the ScriptedBackend test
//! double (a tiny random model never emits a tool call on its own): every real harness, in
//! every wire API it speaks, really runs the scripted shell call, sends its result back, and
//! both turns are recorded in one session with turn 2's prompt ids extending turn 1's.

use serde_json::{json, Value};
use tokentap_e2e::checks::assert_complete_token_data;
use tokentap_e2e::fixtures::{post_chat, post_stream, scripted_tokentap};
use tokentap_e2e::harness::{
    run_claude, run_codex, run_pi, run_qwen, HarnessDirs, HarnessRun, Wire,
};
use tokentap_e2e::llama::{LlamaServer, END_OF_TURN};
use tokentap_e2e::scripted::{
    always, tool_call_text, tool_round_trip, Reply, ScriptedBackend, Tokens,
};
use tokentap_e2e::sse::parse_chat_stream;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::{CaptureRecord, SessionSource};

const MARKER_FILE: &str = "tokentap_tool_ran.txt";
const FINAL_TEXT: &str = "Done: the file is written.";
const PROMPT: &str = "Write hi to a file";

fn command() -> Value {
    json!({"command": format!("echo hi > {MARKER_FILE}")})
}

/// One scripted shell-tool round trip: the tool's name and arguments in the harness's terms.
struct ToolLoop {
    tool: &'static str,
    arguments: Value,
    wire: Wire,
    /// Where the harness's session comes from (its own id, else its key).
    session: SessionSource,
}

/// Runs a harness against tokentap in front of a scripted tool round trip and checks what
/// every harness must get right; returns the records of the tool call and of its follow-up.
async fn round_trip(
    what: &str,
    t: ToolLoop,
    run: impl AsyncFnOnce(&HarnessDirs, &str) -> HarnessRun,
) -> (
    ScriptedBackend,
    Tokentap,
    HarnessRun,
    CaptureRecord,
    CaptureRecord,
) {
    let llama = LlamaServer::shared().await;
    let tok = llama.tokenizer();
    let backend = ScriptedBackend::start(
        Tokens::Llama(tok.clone()),
        tool_round_trip(t.tool, t.arguments.clone(), FINAL_TEXT, "ok"),
    )
    .await;
    let tokentap = Tokentap::start(TokentapConfig::new(backend.url.clone(), "vllm")).await;
    let dirs = HarnessDirs::new();
    let out = run(&dirs, &tokentap.url).await;
    out.assert_success(what);

    // The harness really ran the tool, in its working directory.
    let marker = dirs.work().join(MARKER_FILE);
    assert_eq!(
        std::fs::read_to_string(&marker).ok().as_deref(),
        Some("hi\n"),
        "{what}: the scripted tool call did not run ({})",
        marker.display()
    );

    let requests = backend.requests();
    let records = tokentap.wait_records(requests.len()).await;
    assert_eq!(records.len(), requests.len(), "one record per engine call");
    for r in &records {
        assert_eq!(r.request.path, t.wire.path(), "{what}");
    }
    // Records are found by content, not position: calls may end in another order than they
    // began (and a harness may overlap side calls).
    let with_call: Vec<&CaptureRecord> = records
        .iter()
        .filter(|r| r.message.as_ref().is_some_and(|m| !m.tool_calls.is_empty()))
        .collect();
    assert_eq!(
        with_call.len(),
        1,
        "exactly one record holds the scripted tool call"
    );
    let call = with_call[0].clone();

    // Turn 1: the scripted call, as the engine sampled it.
    let m = call.message.as_ref().unwrap();
    assert_eq!(m.tool_calls.len(), 1);
    let tc = &m.tool_calls[0];
    assert_eq!(tc.name, t.tool);
    assert_eq!(
        serde_json::from_str::<Value>(&tc.arguments).unwrap(),
        t.arguments
    );
    // The scripted backend names each call after the engine request it answered.
    let k: usize = tc
        .id
        .strip_prefix("call_scripted_")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("tool call id {:?} is not the engine's", tc.id));
    assert!(requests[k]["tools"].is_array());
    assert_eq!(
        call.finish_reason.map(|f| f.as_openai()),
        Some("tool_calls")
    );
    let mut sampled = tok
        .tokenize_with_pieces(&tool_call_text(t.tool, &t.arguments), false)
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect::<Vec<_>>();
    sampled.push(END_OF_TURN);
    assert_eq!(call.completion_token_ids.as_ref(), Some(&sampled));

    // Turn 2: the harness sent the tool result back for the call it got, after echoing the
    // call itself. Ids may be re-spelled for the harness's API (`toolu_…`), so the engine sees
    // the id the harness used, consistently in the echoed call and in the result.
    let result_id = |msgs: &Value| -> Option<String> {
        msgs.as_array()?
            .iter()
            .find(|m| m["role"] == "tool")
            .and_then(|m| m["tool_call_id"].as_str().map(str::to_owned))
    };
    let j = requests
        .iter()
        .position(|r| result_id(&r["messages"]).is_some())
        .expect("an engine request carrying the tool result");
    assert!(j > k, "the result came back after the call");
    let rid = result_id(&requests[j]["messages"]).unwrap();
    assert!(rid.contains(&tc.id), "result for {rid}, call was {}", tc.id);
    let sent = requests[j]["messages"].as_array().unwrap();
    let echoed = sent
        .iter()
        .find(|m| m["role"] == "assistant" && m["tool_calls"].is_array())
        .expect("the assistant tool call is echoed back");
    assert_eq!(echoed["tool_calls"][0]["id"], rid.as_str());
    assert_eq!(echoed["tool_calls"][0]["function"]["name"], t.tool);
    // Its record: the first call of the session whose backend request carries the result.
    let follow = records
        .iter()
        .filter(|r| {
            r.session_id == call.session_id
                && tokentap_proxy::replay::backend_request(r)
                    .expect("the backend request replays from the record")
                    .is_some_and(|b| {
                        b.messages
                            .iter()
                            .any(|m| m.tool_call_id.as_deref() == Some(rid.as_str()))
                    })
        })
        .min_by_key(|r| r.seq)
        .expect("a record of the follow-up call")
        .clone();
    assert_eq!(
        follow.message.as_ref().and_then(|m| m.content.as_deref()),
        Some(FINAL_TEXT)
    );

    for r in [&call, &follow] {
        assert_complete_token_data(r);
        assert_eq!(
            r.token_provenance.prompt,
            tokentap_e2e::TokenSource::EngineResponse
        );
    }
    // Turn 2's prompt extends turn 1's: the same conversation, token for token.
    let (p1, p2) = (
        call.prompt_token_ids.as_ref().unwrap(),
        follow.prompt_token_ids.as_ref().unwrap(),
    );
    assert!(
        p2.len() > p1.len() && p2[..p1.len()] == p1[..],
        "{what}: turn 2's prompt ids do not start with turn 1's"
    );
    assert_eq!(call.session_source, t.session);
    assert!(follow.seq > call.seq);
    assert!(
        out.stdout.contains(FINAL_TEXT),
        "{what} prints the final answer: {}",
        out.stdout
    );
    (backend, tokentap, out, call, follow)
}

fn pi_loop(wire: Wire) -> ToolLoop {
    ToolLoop {
        tool: "bash",
        arguments: command(),
        wire,
        session: SessionSource::ApiKey,
    }
}

fn qwen_loop(wire: Wire) -> ToolLoop {
    ToolLoop {
        tool: "run_shell_command",
        arguments: command(),
        wire,
        session: SessionSource::ApiKey,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_runs_a_scripted_bash_call_over_chat_completions() {
    let wire = Wire::ChatCompletions;
    let (backend, tokentap, _out, call, follow) =
        round_trip("pi -p", pi_loop(wire), async |d, s| {
            run_pi(d, s, wire, "sk-e2e-pi-tools", "m", PROMPT).await
        })
        .await;
    // Pi makes exactly these two calls, in one session.
    assert_eq!(backend.requests().len(), 2);
    assert_eq!((call.seq, follow.seq), (0, 1));
    assert_eq!(call.session_id, follow.session_id);
    assert_eq!(tokentap.records().len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_runs_a_scripted_bash_call_over_responses() {
    let wire = Wire::Responses;
    round_trip("pi -p (openai-responses)", pi_loop(wire), async |d, s| {
        run_pi(d, s, wire, "sk-e2e-pi-tools-resp", "m", PROMPT).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_runs_a_scripted_bash_call_over_messages() {
    let wire = Wire::Messages;
    round_trip("pi -p (anthropic-messages)", pi_loop(wire), async |d, s| {
        run_pi(d, s, wire, "sk-e2e-pi-tools-msg", "m", PROMPT).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_runs_a_scripted_shell_call_over_chat_completions() {
    let wire = Wire::ChatCompletions;
    round_trip("qwen", qwen_loop(wire), async |d, s| {
        run_qwen(d, s, wire, "sk-e2e-qwen-tools", "m", PROMPT, true).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_runs_a_scripted_shell_call_over_responses() {
    let wire = Wire::Responses;
    round_trip("qwen (openai-responses)", qwen_loop(wire), async |d, s| {
        run_qwen(d, s, wire, "sk-e2e-qwen-tools-resp", "m", PROMPT, true).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_runs_a_scripted_shell_call_over_messages() {
    let wire = Wire::Messages;
    round_trip("qwen (anthropic)", qwen_loop(wire), async |d, s| {
        run_qwen(d, s, wire, "sk-ant-e2e-qwen-tools-msg", "m", PROMPT, true).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_codex_runs_a_scripted_exec_command_call() {
    let t = ToolLoop {
        tool: "exec_command",
        arguments: json!({"cmd": format!("echo hi > {MARKER_FILE}")}),
        wire: Wire::Responses,
        session: SessionSource::HarnessHeader,
    };
    round_trip("codex exec", t, async |d, s| {
        run_codex(d, s, "sk-e2e-codex-tools", "m", PROMPT).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_claude_code_runs_a_scripted_bash_call() {
    let t = ToolLoop {
        tool: "Bash",
        arguments: command(),
        wire: Wire::Messages,
        session: SessionSource::HarnessHeader,
    };
    round_trip("claude -p", t, async |d, s| {
        run_claude(d, s, "sk-ant-e2e-claude-tools", "m", PROMPT, true).await
    })
    .await;
}

fn tool_request(stream: bool) -> Value {
    json!({
        "model": "m",
        "messages": [{"role": "user", "content": "Write hi to a file"}],
        "tools": [{"type": "function", "function": {"name": "bash", "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}],
        "stream": stream,
        "stream_options": {"include_usage": true}
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_tool_call_reaches_the_harness_as_openai_tool_call_deltas() {
    let (backend, tokentap) =
        scripted_tokentap(always(Reply::tool_call("bash", command())), &[]).await;
    let (status, sse) = post_stream(&tokentap.chat_url(), &[], &tool_request(true)).await;
    assert_eq!(status, 200, "{sse}");
    let s = parse_chat_stream(&sse);
    assert!(s.done && s.errors.is_empty(), "{sse}");
    assert_eq!(s.finish_reason.as_deref(), Some("tool_calls"));
    assert_eq!(s.content, "");
    assert_eq!(
        s.tool_calls,
        vec![(
            "call_scripted_0".to_owned(),
            "bash".to_owned(),
            command().to_string()
        )]
    );
    // The first tool-call delta opens the call: index, id, type, name.
    let first = s
        .chunks
        .iter()
        .find_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().cloned())
        .expect("a tool_calls delta");
    assert_eq!(first[0]["index"], 0);
    assert_eq!(first[0]["id"], "call_scripted_0");
    assert_eq!(first[0]["type"], "function");
    assert_eq!(first[0]["function"]["name"], "bash");

    let r = tokentap.wait_record(1).await;
    assert_complete_token_data(&r);
    let m = r.message.as_ref().unwrap();
    assert_eq!(m.tool_calls.len(), 1);
    assert_eq!(
        (m.tool_calls[0].id.as_str(), m.tool_calls[0].name.as_str()),
        ("call_scripted_0", "bash")
    );
    assert_eq!(m.tool_calls[0].arguments, command().to_string());
    let mut expect: Vec<u32> = tool_call_text("bash", &command())
        .chars()
        .map(|c| c as u32 + 3)
        .collect();
    expect.push(END_OF_TURN);
    assert_eq!(
        r.completion_token_ids,
        Some(expect),
        "the ids of both tool-call chunks and the end of turn"
    );
    // The tools reached the engine.
    assert_eq!(
        backend.requests()[0]["tools"][0]["function"]["name"],
        "bash"
    );

    // The whole (non-streamed) form of the same answer.
    let (status, v) = post_chat(&tokentap, &[], &tool_request(false)).await;
    assert_eq!(status, 200, "{v}");
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["content"], Value::Null);
    assert_eq!(
        msg["tool_calls"][0]["function"]["arguments"],
        command().to_string()
    );
    assert_eq!(msg["tool_calls"][0]["type"], "function");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
}
