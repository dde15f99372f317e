//! Tool calls that come from the model itself: every real harness, through tokentap, to a real
//! llama-server on the tiny tool-calling model (`scripts/make_tiny_model.py --tools`: Qwen3's
//! tokenizer and chat template, hand-set weights). The model calls the harness's own shell tool
//! with `pwd` (llama-server's grammar shapes the JSON for the tools the harness offered), the
//! harness receives that call streamed in its wire API, runs it and sends the result back, and
//! the model then answers `Done.`, so the run ends by itself. Checked: the streamed tool-call
//! events the harness got, the capture record of the call (its parsed tool call, the sampled
//! ids and logprobs of every token of it), the next call's conversation carrying the tool's
//! output, the next prompt's ids extending the call's prompt and sampled ids, and the final
//! answer. (`tool_calls.rs` scripts the engine instead, for the turns the
//! tokentap side must get right whatever the model does.)

use std::time::Instant;

use serde_json::{json, Value};
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::checks::{assert_complete_token_data, assert_records_match_engine};
use tokentap_e2e::harness::{
    run_claude, run_codex, run_pi, run_qwen, HarnessDirs, HarnessRun, Wire,
};
use tokentap_e2e::llama::{LlamaServer, QWEN3_END_OF_TURN, QWEN3_TOOL_CALL};
use tokentap_e2e::sse::{parse_chat_stream, typed_events};
use tokentap_e2e::tee::{Exchange, TeeProxy};
use tokentap_e2e::tokentap::{tokentap_cli, Tokentap, TokentapConfig};
use tokentap_e2e::{CaptureRecord, SessionSource};
use tokentap_schema::{Continuation, RenderComparison};

const PROMPT: &str = "Where am I? Use the shell.";
/// The tool model's whole answer once a tool result is in the conversation.
const FINAL_TEXT: &str = "Done.";

/// The harness's shell tool, as the model must call it.
struct ToolLoop {
    tool: &'static str,
    /// The tool's (only required) command argument.
    arg: &'static str,
    wire: Wire,
    session: SessionSource,
    /// `--token-mode observe` without `--tokenizer`: the model file llama.cpp's `/props`
    /// names.
    tokenizer_from_engine: bool,
}

/// A tool call as a harness received it on its stream: (name, arguments as one string).
fn streamed_tool_calls(wire: Wire, body: &str) -> Vec<(String, String)> {
    match wire {
        Wire::ChatCompletions => {
            let s = parse_chat_stream(body);
            assert!(s.done && s.errors.is_empty(), "{body}");
            if s.tool_calls.is_empty() {
                return vec![];
            }
            assert_eq!(s.finish_reason.as_deref(), Some("tool_calls"), "{body}");
            s.tool_calls
                .into_iter()
                .map(|(id, name, args)| {
                    assert!(!id.is_empty(), "a streamed tool call without an id: {body}");
                    (name, args)
                })
                .collect()
        }
        Wire::Responses => {
            let events = typed_events(body);
            let mut calls: Vec<(String, String)> = Vec::new();
            for (name, data) in &events {
                match name.as_str() {
                    "response.output_item.added" if data["item"]["type"] == "function_call" => {
                        calls.push((
                            data["item"]["name"].as_str().unwrap().to_owned(),
                            String::new(),
                        ))
                    }
                    "response.function_call_arguments.delta" => calls
                        .last_mut()
                        .expect("arguments before their call")
                        .1
                        .push_str(data["delta"].as_str().unwrap()),
                    "response.function_call_arguments.done" => assert_eq!(
                        Some(
                            calls
                                .last()
                                .expect("arguments before their call")
                                .1
                                .as_str()
                        ),
                        data["arguments"].as_str(),
                        "the deltas add up to the arguments"
                    ),
                    _ => {}
                }
            }
            assert_eq!(
                events.last().map(|e| e.0.as_str()),
                Some("response.completed")
            );
            calls
        }
        Wire::Messages => {
            let events = typed_events(body);
            let mut calls: Vec<(String, String)> = Vec::new();
            for (name, data) in &events {
                match name.as_str() {
                    "content_block_start" if data["content_block"]["type"] == "tool_use" => calls
                        .push((
                            data["content_block"]["name"].as_str().unwrap().to_owned(),
                            String::new(),
                        )),
                    "content_block_delta" if data["delta"]["type"] == "input_json_delta" => calls
                        .last_mut()
                        .expect("input before its tool_use block")
                        .1
                        .push_str(data["delta"]["partial_json"].as_str().unwrap()),
                    "message_delta" if !calls.is_empty() => {
                        assert_eq!(data["delta"]["stop_reason"], "tool_use", "{body}")
                    }
                    _ => {}
                }
            }
            assert_eq!(events.last().map(|e| e.0.as_str()), Some("message_stop"));
            calls
        }
    }
}

/// The text of a tool message (or any message) of an engine request.
fn text_of(m: &Value) -> String {
    tokentap_e2e::scripted::content_text(&m["content"])
}

/// Runs a harness against tokentap in front of llama-server on the tool model (a tee on each
/// side: what the harness got, what the engine said) and checks one whole tool loop.
async fn model_tool_loop(
    what: &str,
    t: ToolLoop,
    run: impl AsyncFnOnce(&HarnessDirs, &str) -> HarnessRun,
) -> (Tokentap, Vec<CaptureRecord>) {
    let llama = LlamaServer::shared_tool_model().await;
    let tok = llama.tokenizer();
    let engine = TeeProxy::start(&llama.url).await;
    // Observe mode on every run: tokentap renders and tokenizes each call with the model's
    // own template and tokenizer (the GGUF), beside the engine.
    let mut config =
        TokentapConfig::new(engine.url.clone(), "llamacpp").arg("--token-mode=observe");
    if !t.tokenizer_from_engine {
        config = config
            .arg("--tokenizer")
            .arg(Artefacts::require_tool_model().display().to_string());
    }
    let tokentap = Tokentap::start(config).await;
    let harness_side = TeeProxy::start(&tokentap.url).await;
    let dirs = HarnessDirs::new();

    let started = Instant::now();
    let out = run(&dirs, &harness_side.url).await;
    let took = started.elapsed();
    out.assert_success(what);
    eprintln!("{what}: the run took {:.1} s", took.as_secs_f64());
    assert!(
        out.stdout.contains(FINAL_TEXT),
        "{what} does not print the model's final answer {FINAL_TEXT:?}:\n{}",
        out.stdout
    );

    let calls = engine.chat_exchanges();
    let records = tokentap.wait_records(calls.len()).await;
    assert_eq!(records.len(), calls.len(), "one record per engine call");
    records.iter().for_each(assert_complete_token_data);
    assert_records_match_engine(&records, &engine, &tok).await;
    for r in &records {
        assert_eq!(r.request.path, t.wire.path(), "{what}");
        eprintln!(
            "{what}: seq {} tools={} prompt={} completion={} finish={:?} tool_calls={:?} content={:?}",
            r.seq,
            r.request.body.as_ref().and_then(|b| b.to_value()["tools"].as_array().map(Vec::len)).unwrap_or(0),
            r.prompt_token_ids.as_ref().map_or(0, Vec::len),
            r.completion_token_ids.as_ref().map_or(0, Vec::len),
            r.finish_reason.map(|f| f.as_openai()),
            r.message.as_ref().map(|m| m.tool_calls.iter().map(|c| (&c.name, &c.arguments)).collect::<Vec<_>>()),
            r.message.as_ref().and_then(|m| m.content.as_deref()),
        );
    }

    // The model's own call, as tokentap recorded it: the harness's shell tool with `pwd`,
    // parsed by the engine from what it sampled.
    let mut with_call: Vec<&CaptureRecord> = records
        .iter()
        .filter(|r| r.message.as_ref().is_some_and(|m| !m.tool_calls.is_empty()))
        .collect();
    with_call.sort_by_key(|r| r.seq);
    let call = *with_call
        .first()
        .unwrap_or_else(|| panic!("{what}: no record holds a tool call from the model"));
    let m = call.message.as_ref().unwrap();
    assert_eq!(m.tool_calls.len(), 1, "{what}: one call per turn");
    let tc = &m.tool_calls[0];
    assert_eq!(
        tc.name, t.tool,
        "{what}: the model called the harness's shell tool"
    );
    let arguments = json!({t.arg: "pwd"});
    assert_eq!(
        serde_json::from_str::<Value>(&tc.arguments).unwrap(),
        arguments
    );
    assert_eq!(
        call.finish_reason.map(|f| f.as_openai()),
        Some("tool_calls")
    );
    // Every token of the call was sampled and recorded with its logprob: `<tool_call>`, the
    // JSON, `</tool_call>` and the end of turn, exactly what llama-server reported
    // (assert_records_match_engine), spelling the Hermes block Qwen3's template writes.
    let ids = call.completion_token_ids.as_ref().unwrap();
    assert_eq!(ids.first(), Some(&QWEN3_TOOL_CALL), "{what}: {ids:?}");
    assert_eq!(ids.last(), Some(&QWEN3_END_OF_TURN), "{what}: {ids:?}");
    assert_eq!(call.logprobs.as_ref().map(Vec::len), Some(ids.len()));
    assert_eq!(
        tok.detokenize(&ids[..ids.len() - 1]).await,
        format!(
            "<tool_call>\n{{\"name\": \"{}\", \"arguments\": {{\"{}\": \"pwd\"}}}}\n</tool_call>",
            t.tool, t.arg
        ),
    );
    assert_eq!(call.session_source, t.session);

    // The harness got that call streamed, in its own wire API.
    let got: Vec<(String, String)> = harness_side
        .exchanges()
        .iter()
        .filter(|e: &&Exchange| e.method == "POST" && e.path == t.wire.path())
        .flat_map(|e| {
            assert!(
                e.complete && e.status == 200,
                "{what}: an incomplete answer to the harness: {e:?}"
            );
            assert_eq!(e.request_json()["stream"], true, "{what} streams");
            streamed_tool_calls(t.wire, &String::from_utf8_lossy(&e.response_body))
        })
        .collect();
    assert!(!got.is_empty(), "{what}: no tool call reached the harness");
    for (name, args) in &got {
        assert_eq!(name, t.tool);
        assert_eq!(serde_json::from_str::<Value>(args).unwrap(), arguments);
    }

    // The harness ran it and sent its output back: a later engine call's conversation holds
    // the tool result (the working directory `pwd` printed), and the model answered it.
    let work = dirs.work();
    let work = work.to_str().unwrap();
    let carries_result = |e: &Exchange| {
        e.request_json()["messages"].as_array().is_some_and(|msgs| {
            msgs.iter()
                .any(|m| m["role"] == "tool" && text_of(m).contains(work))
        })
    };
    let follow_call = calls
        .iter()
        .find(|e| carries_result(e))
        .unwrap_or_else(|| panic!("{what}: no engine call carries the tool's output ({work})"));
    let follow = records
        .iter()
        .filter(|r| r.completion_token_ids.as_ref() == Some(&follow_call.reported_ids()))
        .filter(|r| r.seq > call.seq && r.session_id == call.session_id)
        .min_by_key(|r| r.seq)
        .unwrap_or_else(|| panic!("{what}: no record of the call that carried the result"))
        .clone();
    assert_eq!(
        follow.message.as_ref().and_then(|m| m.content.as_deref()),
        Some(FINAL_TEXT)
    );
    assert!(follow.message.as_ref().unwrap().tool_calls.is_empty());
    assert_eq!(follow.finish_reason.map(|f| f.as_openai()), Some("stop"));
    // The template writes the call back exactly as it was sampled, and every harness keeps its
    // conversation's start: the follow-up's prompt ids are the call's prompt ids, then its
    // sampled ids (the end of turn included), then the tool result.
    let p1 = call.prompt_token_ids.as_ref().unwrap();
    let p2 = follow.prompt_token_ids.as_ref().unwrap();
    assert!(
        p2.starts_with(&[&p1[..], &ids[..]].concat()),
        "{what}: the follow-up's prompt ids do not extend the call's prompt and completion ids"
    );

    // Observe mode: tokentap's own rendering and tokenizing of every call gave llama-server's
    // prompt ids, and it saw the follow-up extend the call (no drift: the template writes the
    // call back as sampled, and there is no reasoning to drop).
    for r in &records {
        let o = r
            .token_observation
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: seq {} has no token observation", r.seq));
        assert_eq!(
            o.render,
            RenderComparison::Equal {
                tokens: r.prompt_token_ids.as_ref().unwrap().len() as u32
            },
            "{what}: seq {}: tokentap's ids are not llama-server's",
            r.seq
        );
    }
    assert_eq!(
        follow.token_observation.as_ref().unwrap().continuation,
        Continuation::Extends {
            record_id: call.record_id.clone(),
            appended: (p2.len() - p1.len() - ids.len()) as u32,
        },
        "{what}"
    );
    assert_eq!(
        tokentap
            .metric("tokentap_token_mode_render_total{result=\"equal\"}")
            .await,
        Some(records.len() as f64),
        "{what}"
    );
    // The same findings in `records summary` and, per session, in sessions.jsonl.
    let spool = tokentap.spool.to_str().unwrap();
    let summary = tokentap_cli(&["records", "summary", "--spool", spool]).await;
    assert!(summary.success, "{}", summary.stderr);
    let n = records.len();
    assert!(
        summary.stdout.contains(&format!(
            "token mode: observed {n}  ids equal to the engine's {n}  differ 0  unavailable 0"
        )),
        "{what}: {}",
        summary.stdout
    );
    let out = tempfile::tempdir().unwrap();
    let cli = tokentap_cli(&[
        "reconstruct",
        "--spool",
        spool,
        "--out",
        out.path().to_str().unwrap(),
    ])
    .await;
    assert!(cli.success, "{}", cli.stderr);
    let sessions = std::fs::read_to_string(out.path().join("sessions.jsonl")).unwrap();
    let observed: u64 = sessions
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|s| s["stats"]["token_mode"]["observed"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(observed as usize, n, "{what}: {sessions}");
    (tokentap, records)
}

fn shell(tool: &'static str, wire: Wire) -> ToolLoop {
    ToolLoop {
        tool,
        arg: "command",
        wire,
        session: SessionSource::ApiKey,
        tokenizer_from_engine: false,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_runs_the_models_own_bash_call_over_chat_completions() {
    let wire = Wire::ChatCompletions;
    let tool_loop = ToolLoop {
        tokenizer_from_engine: true,
        ..shell("bash", wire)
    };
    let (_, records) = model_tool_loop("pi -p", tool_loop, async |d, s| {
        run_pi(d, s, wire, "sk-e2e-pi-model-tools", "m", PROMPT).await
    })
    .await;
    // Pi makes exactly the call and its follow-up.
    assert_eq!(records.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_runs_the_models_own_bash_call_over_responses() {
    let wire = Wire::Responses;
    model_tool_loop(
        "pi -p (openai-responses)",
        shell("bash", wire),
        async |d, s| run_pi(d, s, wire, "sk-e2e-pi-model-tools-resp", "m", PROMPT).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_runs_the_models_own_bash_call_over_messages() {
    let wire = Wire::Messages;
    model_tool_loop(
        "pi -p (anthropic-messages)",
        shell("bash", wire),
        async |d, s| run_pi(d, s, wire, "sk-e2e-pi-model-tools-msg", "m", PROMPT).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_runs_the_models_own_shell_call_over_chat_completions() {
    let wire = Wire::ChatCompletions;
    model_tool_loop("qwen", shell("run_shell_command", wire), async |d, s| {
        run_qwen(d, s, wire, "sk-e2e-qwen-model-tools", "m", PROMPT, true).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_runs_the_models_own_shell_call_over_responses() {
    let wire = Wire::Responses;
    model_tool_loop(
        "qwen (openai-responses)",
        shell("run_shell_command", wire),
        async |d, s| {
            run_qwen(
                d,
                s,
                wire,
                "sk-e2e-qwen-model-tools-resp",
                "m",
                PROMPT,
                true,
            )
            .await
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_runs_the_models_own_shell_call_over_messages() {
    let wire = Wire::Messages;
    model_tool_loop(
        "qwen (anthropic)",
        shell("run_shell_command", wire),
        async |d, s| {
            run_qwen(
                d,
                s,
                wire,
                "sk-ant-e2e-qwen-model-tools-msg",
                "m",
                PROMPT,
                true,
            )
            .await
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_codex_runs_the_models_own_exec_command_call() {
    let t = ToolLoop {
        tool: "exec_command",
        arg: "cmd",
        wire: Wire::Responses,
        session: SessionSource::HarnessHeader,
        tokenizer_from_engine: false,
    };
    model_tool_loop("codex exec", t, async |d, s| {
        run_codex(d, s, "sk-e2e-codex-model-tools", "m", PROMPT).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_claude_code_runs_the_models_own_bash_call() {
    let t = ToolLoop {
        tool: "Bash",
        arg: "command",
        wire: Wire::Messages,
        session: SessionSource::HarnessHeader,
        tokenizer_from_engine: false,
    };
    model_tool_loop("claude -p", t, async |d, s| {
        run_claude(d, s, "sk-ant-e2e-claude-model-tools", "m", PROMPT, true).await
    })
    .await;
}
