//! Wire round trips of the three provider APIs, against a model of a conversation:
//!
//! - requests: a random conversation (system prompt, text and multi-part user turns,
//!   assistant text, reasoning, tool calls and their results, tools, sampling parameters,
//!   extra fields) rendered as each API's request, parsed by the proxy's codec, gives exactly
//!   the canonical request the model says; the engine request the proxy renders from it
//!   (`backend::chat_body`) parses back (as Chat Completions) to the same canonical request;
//! - answers: a random generation (reasoning, text, tool calls, finish reason, usage) split
//!   into random deltas, rendered whole and as an SSE stream by each codec and read back with
//!   the tests' SSE parser (`tokentap_e2e::sse`), gives the generation back, and the stream
//!   says what the whole answer says.

use proptest::prelude::{
    any, prop, prop_assert, prop_assert_eq, prop_oneof, proptest, Just, ProptestConfig, Strategy,
};
use serde_json::{json, Map, Value};
use tokentap_e2e::sse;
use tokentap_proxy::backend::{chat_body, CallMode};
use tokentap_proxy::canonical::{
    ChatMessage, ChatRequest, ContentPart, Delta, FinishReason, GenerationAccumulator,
    GenerationEvent, Role, SamplingParams, ToolCall, ToolCallDelta, ToolSpec, Usage,
};
use tokentap_proxy::wire::chat_completions::ChatCompletions;
use tokentap_proxy::wire::messages::Messages;
use tokentap_proxy::wire::responses::Responses;
use tokentap_proxy::wire::{ResponseMeta, WireCodec};
use tokentap_schema::RawJson;

// ---------------------------------------------------------------------------------------
// The model of a request.

#[derive(Debug, Clone)]
enum Turn {
    /// A user turn: text parts, sent as a plain string when there is one and `as_string`.
    User { parts: Vec<String>, as_string: bool },
    /// An assistant turn and the results of its calls.
    Assistant {
        text: Option<String>,
        reasoning: Option<String>,
        /// (id suffix, name, arguments object)
        calls: Vec<(String, Value)>,
        results: Vec<String>,
    },
}

#[derive(Debug, Clone)]
struct Conversation {
    system: Option<String>,
    turns: Vec<Turn>,
    tools: Vec<(String, Option<String>)>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    max_tokens: u64,
    stop: Vec<String>,
    seed: Option<i64>,
    stream: bool,
}

/// Text with what JSON and SSE make interesting: quotes, newlines, unicode, `data:` lines.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9 ]{1,20}",
        "[a-z ]{0,8}(\n|\"|\\\\|data: |é|日本|🙂|\r\n|\t)[a-z ]{0,8}",
    ]
    .prop_filter("non-empty", |s| !s.is_empty())
}

fn args() -> impl Strategy<Value = Value> {
    prop::collection::btree_map(
        "[a-z]{1,6}",
        prop_oneof![
            text().prop_map(Value::from),
            any::<i32>().prop_map(Value::from),
            any::<bool>().prop_map(Value::from),
        ],
        0..3,
    )
    .prop_map(|m| Value::Object(m.into_iter().collect()))
}

fn turn() -> impl Strategy<Value = Turn> {
    prop_oneof![
        (prop::collection::vec(text(), 1..3), any::<bool>())
            .prop_map(|(parts, as_string)| Turn::User { parts, as_string }),
        (
            prop::option::of(text()),
            prop::option::of(text()),
            prop::collection::vec(("[a-z_]{1,8}", args()), 0..3),
            prop::collection::vec(text(), 3),
        )
            .prop_map(|(text, reasoning, calls, results)| {
                let n = calls.len();
                Turn::Assistant {
                    // An assistant turn says or calls something.
                    text: if calls.is_empty() && text.is_none() {
                        Some("ok".into())
                    } else {
                        text
                    },
                    reasoning,
                    calls,
                    results: results.into_iter().take(n).collect(),
                }
            }),
    ]
}

fn conversation() -> impl Strategy<Value = Conversation> {
    (
        prop::option::of(text()),
        prop::collection::vec(turn(), 0..5),
        text(),
        prop::collection::vec(("[a-z_]{1,8}", prop::option::of(text())), 0..3),
        (
            // Any float in range, to the last digit: the workspace's serde_json reads floats
            // exactly (`float_roundtrip`; without it a 17-digit top_p came back one ULP off).
            prop::option::of(0.0f64..2.0),
            prop::option::of(0.0f64..1.0),
            prop::option::of(1i64..100),
        ),
        (
            1u64..100_000,
            prop::collection::vec("[a-z]{1,5}", 0..3),
            prop::option::of(any::<i64>()),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                system,
                mut turns,
                last,
                tools,
                (temperature, top_p, top_k),
                (max_tokens, stop, seed, stream),
            )| {
                // Turns alternate: a user turn between two assistant turns (Responses joins an
                // assistant message with the calls after it, as documented, so two assistant
                // turns in a row are one turn there).
                let mut alternating: Vec<Turn> = Vec::new();
                for t in turns.drain(..) {
                    if matches!(t, Turn::Assistant { .. })
                        && matches!(alternating.last(), Some(Turn::Assistant { .. }))
                    {
                        alternating.push(Turn::User {
                            parts: vec!["go on".into()],
                            as_string: true,
                        });
                    }
                    alternating.push(t);
                }
                turns = alternating;
                // Every API wants the conversation to end with the user.
                turns.push(Turn::User {
                    parts: vec![last],
                    as_string: true,
                });
                // Tool names are unique (a tool list is a set).
                let mut seen = std::collections::BTreeSet::new();
                let tools = tools
                    .into_iter()
                    .filter(|(n, _)| seen.insert(n.clone()))
                    .collect();
                Conversation {
                    system,
                    turns,
                    tools,
                    temperature,
                    top_p,
                    top_k,
                    max_tokens,
                    stop,
                    seed,
                    stream,
                }
            },
        )
}

fn call_id(api: &str, t: usize, k: usize) -> String {
    match api {
        "messages" => format!("toolu_{t}_{k}"),
        _ => format!("call_{t}_{k}"),
    }
}

fn schema() -> Value {
    json!({"type": "object", "properties": {"command": {"type": "string"}}})
}

fn msg(role: Role, content: Vec<ContentPart>, was_string: bool) -> ChatMessage {
    ChatMessage {
        role,
        content,
        reasoning: None,
        tool_calls: vec![],
        tool_call_id: None,
        name: None,
        content_was_string: was_string,
    }
}

fn texts(parts: &[String]) -> Vec<ContentPart> {
    parts
        .iter()
        .map(|t| ContentPart::Text { text: t.clone() })
        .collect()
}

/// The conversation as `api`'s request, and the canonical request the proxy must make of it.
fn render(c: &Conversation, api: &str) -> (Value, ChatRequest) {
    let mut wire = Vec::new();
    let mut expected = Vec::new();
    if let Some(s) = &c.system {
        expected.push(msg(Role::System, texts(std::slice::from_ref(s)), true));
        if api == "chat" {
            wire.push(json!({"role": "system", "content": s}));
        }
    }
    for (t, turn) in c.turns.iter().enumerate() {
        match turn {
            Turn::User { parts, as_string } => {
                let as_string = *as_string && parts.len() == 1;
                let content = if as_string {
                    json!(parts[0])
                } else {
                    let kind = if api == "responses" {
                        "input_text"
                    } else {
                        "text"
                    };
                    Value::Array(
                        parts
                            .iter()
                            .map(|p| json!({"type": kind, "text": p}))
                            .collect(),
                    )
                };
                let role_msg = json!({"role": "user", "content": content});
                wire.push(if api == "responses" {
                    json!({"type": "message", "role": "user", "content": content})
                } else {
                    role_msg
                });
                expected.push(msg(Role::User, texts(parts), as_string));
            }
            Turn::Assistant {
                text,
                reasoning,
                calls,
                results,
            } => {
                let ids: Vec<String> = (0..calls.len()).map(|k| call_id(api, t, k)).collect();
                let tool_calls: Vec<ToolCall> = calls
                    .iter()
                    .zip(&ids)
                    .map(|((name, a), id)| ToolCall {
                        id: id.clone(),
                        name: name.clone(),
                        arguments: a.to_string(),
                    })
                    .collect();
                let mut m = msg(
                    Role::Assistant,
                    text.iter()
                        .map(|t| ContentPart::Text { text: t.clone() })
                        .collect(),
                    false,
                );
                m.reasoning = reasoning.clone();
                m.tool_calls = tool_calls.clone();
                match api {
                    "chat" => {
                        m.content_was_string = text.is_some();
                        let mut o = json!({"role": "assistant", "content": text});
                        if let Some(r) = reasoning {
                            o["reasoning_content"] = json!(r);
                        }
                        if !calls.is_empty() {
                            o["tool_calls"] = Value::Array(tool_calls.iter().map(|c| json!(
                                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})).collect());
                        }
                        wire.push(o);
                        for (id, r) in ids.iter().zip(results) {
                            wire.push(json!({"role": "tool", "tool_call_id": id, "content": r}));
                        }
                    }
                    "responses" => {
                        if let Some(r) = reasoning {
                            wire.push(json!({"type": "reasoning", "summary": [{"type": "summary_text", "text": r}]}));
                        }
                        if let Some(t) = text {
                            wire.push(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": t}]}));
                        }
                        for c in &tool_calls {
                            wire.push(json!({"type": "function_call", "call_id": c.id, "name": c.name, "arguments": c.arguments}));
                        }
                        for (id, r) in ids.iter().zip(results) {
                            wire.push(
                                json!({"type": "function_call_output", "call_id": id, "output": r}),
                            );
                        }
                    }
                    _ => {
                        let mut blocks = Vec::new();
                        if let Some(r) = reasoning {
                            blocks.push(
                                json!({"type": "thinking", "thinking": r, "signature": "sig"}),
                            );
                        }
                        if let Some(t) = text {
                            blocks.push(json!({"type": "text", "text": t}));
                        }
                        for ((name, a), id) in calls.iter().zip(&ids) {
                            blocks.push(
                                json!({"type": "tool_use", "id": id, "name": name, "input": a}),
                            );
                        }
                        wire.push(json!({"role": "assistant", "content": blocks}));
                        if !results.is_empty() {
                            wire.push(json!({"role": "user", "content": ids.iter().zip(results).map(|(id, r)|
                                json!({"type": "tool_result", "tool_use_id": id, "content": r})).collect::<Vec<_>>()}));
                        }
                    }
                }
                expected.push(m);
                for (id, r) in ids.iter().zip(results) {
                    let mut tm = msg(Role::Tool, texts(std::slice::from_ref(r)), true);
                    tm.tool_call_id = Some(id.clone());
                    expected.push(tm);
                }
            }
        }
    }
    let tools: Vec<ToolSpec> = c
        .tools
        .iter()
        .map(|(n, d)| ToolSpec {
            name: n.clone(),
            description: d.clone(),
            parameters: Some(RawJson::from_value(&schema())),
            strict: None,
        })
        .collect();
    let mut extra = Map::new();
    let mut sampling = SamplingParams {
        temperature: c.temperature,
        top_p: c.top_p,
        max_tokens: Some(c.max_tokens),
        ..SamplingParams::default()
    };
    let mut body = json!({"model": "some-model", "stream": c.stream});
    let b = body.as_object_mut().unwrap();
    if let Some(v) = c.temperature {
        b.insert("temperature".into(), json!(v));
    }
    if let Some(v) = c.top_p {
        b.insert("top_p".into(), json!(v));
    }
    let tool_choice = (!tools.is_empty()).then(|| json!("auto"));
    match api {
        "chat" => {
            b.insert("messages".into(), Value::Array(wire));
            b.insert("max_completion_tokens".into(), json!(c.max_tokens));
            if let Some(v) = c.top_k {
                b.insert("top_k".into(), json!(v));
                sampling.top_k = Some(v);
            }
            if let Some(v) = c.seed {
                b.insert("seed".into(), json!(v));
                sampling.seed = Some(v);
            }
            if !c.stop.is_empty() {
                b.insert("stop".into(), json!(c.stop));
                sampling.stop = c.stop.clone();
            }
            if !tools.is_empty() {
                b.insert(
                    "tools".into(),
                    Value::Array(
                        tools
                            .iter()
                            .map(|t| {
                                let mut f = json!({"name": t.name, "parameters": schema()});
                                if let Some(d) = &t.description {
                                    f["description"] = json!(d);
                                }
                                json!({"type": "function", "function": f})
                            })
                            .collect(),
                    ),
                );
                b.insert("tool_choice".into(), json!("auto"));
            }
            // Passed through to the engine unchanged, whatever is inside.
            let kwargs = json!({"enable_thinking": c.stream, "nested": {"x": [1, "y"]}});
            b.insert("chat_template_kwargs".into(), kwargs.clone());
            extra.insert("chat_template_kwargs".into(), kwargs);
            b.insert("parallel_tool_calls".into(), json!(false));
            extra.insert("parallel_tool_calls".into(), json!(false));
            // Not forwarded (noted).
            b.insert("store".into(), json!(false));
        }
        "responses" => {
            if let Some(s) = &c.system {
                b.insert("instructions".into(), json!(s));
            }
            b.insert("input".into(), Value::Array(wire));
            b.insert("max_output_tokens".into(), json!(c.max_tokens));
            if !tools.is_empty() {
                b.insert("tools".into(), Value::Array(tools.iter().map(|t| {
                    let mut f = json!({"type": "function", "name": t.name, "parameters": schema()});
                    if let Some(d) = &t.description { f["description"] = json!(d); }
                    f
                }).collect()));
                b.insert("tool_choice".into(), json!("auto"));
            }
            b.insert("parallel_tool_calls".into(), json!(true));
            extra.insert("parallel_tool_calls".into(), json!(true));
            b.insert("reasoning".into(), json!({"effort": "high"}));
            extra.insert("reasoning_effort".into(), json!("high"));
            b.insert("store".into(), json!(false));
        }
        _ => {
            if let Some(s) = &c.system {
                b.insert("system".into(), json!(s));
            }
            b.insert("messages".into(), Value::Array(wire));
            b.insert("max_tokens".into(), json!(c.max_tokens));
            if let Some(v) = c.top_k {
                b.insert("top_k".into(), json!(v));
                sampling.top_k = Some(v);
            }
            if !c.stop.is_empty() {
                b.insert("stop_sequences".into(), json!(c.stop));
                sampling.stop = c.stop.clone();
            }
            if !tools.is_empty() {
                b.insert(
                    "tools".into(),
                    Value::Array(
                        tools
                            .iter()
                            .map(|t| {
                                let mut f = json!({"name": t.name, "input_schema": schema()});
                                if let Some(d) = &t.description {
                                    f["description"] = json!(d);
                                }
                                f
                            })
                            .collect(),
                    ),
                );
                b.insert(
                    "tool_choice".into(),
                    json!({"type": "auto", "disable_parallel_tool_use": true}),
                );
                extra.insert("parallel_tool_calls".into(), json!(false));
            }
            b.insert("metadata".into(), json!({"user_id": "u"}));
        }
    }
    let request = ChatRequest {
        model: "some-model".into(),
        messages: expected,
        tools,
        tool_choice,
        sampling,
        stream: c.stream,
        extra,
    };
    (body, request)
}

fn codec(api: &str) -> &'static dyn WireCodec {
    match api {
        "chat" => &ChatCompletions,
        "responses" => &Responses,
        _ => &Messages,
    }
}

// ---------------------------------------------------------------------------------------
// The model of an answer.

#[derive(Debug, Clone)]
struct Generation {
    reasoning: String,
    content: String,
    /// (engine id, name, arguments object)
    calls: Vec<(String, String, Value)>,
    finish: FinishReason,
    usage: Usage,
}

fn generation() -> impl Strategy<Value = Generation> {
    (
        prop_oneof![Just(String::new()), text()],
        prop_oneof![Just(String::new()), text()],
        prop::collection::vec(("[a-z0-9]{1,8}", "[a-z_]{1,8}", args()), 0..3),
        prop::sample::select(vec![
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::ToolCalls,
            FinishReason::ContentFilter,
        ]),
        (0u64..100_000, 0u64..10_000),
    )
        .prop_map(|(reasoning, content, calls, finish, (p, c))| Generation {
            reasoning,
            content,
            calls: calls
                .into_iter()
                .map(|(id, n, a)| (format!("call{id}"), n, a))
                .collect(),
            finish,
            usage: Usage {
                prompt_tokens: p,
                completion_tokens: c,
                total_tokens: p + c,
                reasoning_tokens: None,
            },
        })
}

/// Splits `s` at the char boundaries nearest to `cuts`.
fn pieces(s: &str, cuts: &[prop::sample::Index]) -> Vec<String> {
    let bounds: Vec<usize> = s.char_indices().map(|(i, _)| i).skip(1).collect();
    let mut at: Vec<usize> = cuts
        .iter()
        .filter(|_| !bounds.is_empty())
        .map(|c| bounds[c.index(bounds.len())])
        .collect();
    at.sort();
    at.dedup();
    let mut out = Vec::new();
    let mut from = 0;
    for a in at {
        out.push(s[from..a].to_owned());
        from = a;
    }
    out.push(s[from..].to_owned());
    out.retain(|p| !p.is_empty());
    out
}

/// The generation as an engine streams it: reasoning, then text, then each call (id and name
/// first, then argument fragments), in random pieces.
fn deltas(g: &Generation, cuts: &[prop::sample::Index]) -> Vec<Delta> {
    let mut out = Vec::new();
    for r in pieces(&g.reasoning, cuts) {
        out.push(Delta {
            reasoning: Some(r),
            ..Default::default()
        });
    }
    for c in pieces(&g.content, cuts) {
        out.push(Delta {
            content: Some(c),
            ..Default::default()
        });
    }
    for (i, (id, name, a)) in g.calls.iter().enumerate() {
        out.push(Delta {
            tool_calls: vec![ToolCallDelta {
                index: i as u32,
                id: Some(id.clone()),
                name: Some(name.clone()),
                arguments: None,
            }],
            ..Default::default()
        });
        for p in pieces(&a.to_string(), cuts) {
            out.push(Delta {
                tool_calls: vec![ToolCallDelta {
                    index: i as u32,
                    arguments: Some(p),
                    ..Default::default()
                }],
                ..Default::default()
            });
        }
    }
    out
}

fn meta(api: &str) -> ResponseMeta {
    let prefix = match api {
        "chat" => "chatcmpl-",
        "responses" => "resp_",
        _ => "msg_",
    };
    ResponseMeta::new(format!("{prefix}0123abcd"), 1_700_000_000, "some-model")
}

/// What a client reads out of an answer: (reasoning, text, calls as (name, arguments JSON),
/// finish as the API says it, (prompt, completion) tokens).
type Read = (String, String, Vec<(String, Value)>, String, (u64, u64));

fn read_chat_whole(v: &Value) -> Read {
    let m = &v["choices"][0]["message"];
    (
        m["reasoning_content"].as_str().unwrap_or("").into(),
        m["content"].as_str().unwrap_or("").into(),
        m["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                (
                    c["function"]["name"].as_str().unwrap().into(),
                    serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap(),
                )
            })
            .collect(),
        v["choices"][0]["finish_reason"].as_str().unwrap().into(),
        (
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
            v["usage"]["completion_tokens"].as_u64().unwrap(),
        ),
    )
}

fn read_chat_stream(body: &str) -> Read {
    let s = sse::parse_chat_stream(body);
    assert!(s.done && s.errors.is_empty(), "{body}");
    let reasoning: String = s
        .chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
        .collect();
    let u = s.usage.expect("usage chunk");
    (
        reasoning,
        s.content,
        s.tool_calls
            .into_iter()
            .map(|(_, n, a)| (n, serde_json::from_str(&a).unwrap()))
            .collect(),
        s.finish_reason.unwrap(),
        (
            u["prompt_tokens"].as_u64().unwrap(),
            u["completion_tokens"].as_u64().unwrap(),
        ),
    )
}

fn read_messages_whole(v: &Value) -> Read {
    let mut r = (
        String::new(),
        String::new(),
        Vec::new(),
        String::new(),
        (0, 0),
    );
    for b in v["content"].as_array().unwrap() {
        match b["type"].as_str().unwrap() {
            "thinking" => r.0.push_str(b["thinking"].as_str().unwrap()),
            "text" => r.1.push_str(b["text"].as_str().unwrap()),
            "tool_use" => {
                r.2.push((b["name"].as_str().unwrap().into(), b["input"].clone()))
            }
            other => panic!("block {other}"),
        }
    }
    r.3 = v["stop_reason"].as_str().unwrap().into();
    r.4 = (
        v["usage"]["input_tokens"].as_u64().unwrap(),
        v["usage"]["output_tokens"].as_u64().unwrap(),
    );
    r
}

/// Folds a Messages stream into the message it describes, as an Anthropic client does.
fn fold_messages_stream(body: &str) -> Value {
    let mut message = Value::Null;
    for (event, d) in sse::typed_events(body) {
        match event.as_str() {
            "message_start" => message = d["message"].clone(),
            "content_block_start" => {
                let mut b = d["content_block"].clone();
                if b["type"] == "tool_use" {
                    b["partial"] = json!("");
                }
                message["content"].as_array_mut().unwrap().push(b);
                assert_eq!(
                    d["index"].as_u64().unwrap() as usize + 1,
                    message["content"].as_array().unwrap().len()
                );
            }
            "content_block_delta" => {
                let b = &mut message["content"][d["index"].as_u64().unwrap() as usize];
                let delta = &d["delta"];
                match delta["type"].as_str().unwrap() {
                    "text_delta" => {
                        b["text"] = json!(format!(
                            "{}{}",
                            b["text"].as_str().unwrap(),
                            delta["text"].as_str().unwrap()
                        ))
                    }
                    "thinking_delta" => {
                        b["thinking"] = json!(format!(
                            "{}{}",
                            b["thinking"].as_str().unwrap(),
                            delta["thinking"].as_str().unwrap()
                        ))
                    }
                    "signature_delta" => b["signature"] = delta["signature"].clone(),
                    "input_json_delta" => {
                        b["partial"] = json!(format!(
                            "{}{}",
                            b["partial"].as_str().unwrap(),
                            delta["partial_json"].as_str().unwrap()
                        ))
                    }
                    other => panic!("delta {other}"),
                }
            }
            "content_block_stop" => {
                let b = &mut message["content"][d["index"].as_u64().unwrap() as usize];
                if b["type"] == "tool_use" {
                    let p = b["partial"].as_str().unwrap().to_owned();
                    b["input"] = if p.is_empty() {
                        json!({})
                    } else {
                        serde_json::from_str(&p).unwrap()
                    };
                    b.as_object_mut().unwrap().remove("partial");
                }
            }
            "message_delta" => {
                for (k, v) in d["delta"].as_object().unwrap() {
                    message[k] = v.clone();
                }
                for (k, v) in d["usage"].as_object().unwrap() {
                    message["usage"][k] = v.clone();
                }
            }
            "message_stop" | "ping" => {}
            other => panic!("event {other}"),
        }
    }
    message
}

fn read_responses(v: &Value) -> Read {
    let mut r = (
        String::new(),
        String::new(),
        Vec::new(),
        String::new(),
        (0, 0),
    );
    for item in v["output"].as_array().unwrap() {
        match item["type"].as_str().unwrap() {
            "reasoning" => {
                for s in item["summary"].as_array().unwrap() {
                    r.0.push_str(s["text"].as_str().unwrap())
                }
            }
            "message" => {
                for p in item["content"].as_array().unwrap() {
                    r.1.push_str(p["text"].as_str().unwrap())
                }
            }
            "function_call" => r.2.push((
                item["name"].as_str().unwrap().into(),
                serde_json::from_str(item["arguments"].as_str().unwrap()).unwrap(),
            )),
            other => panic!("item {other}"),
        }
    }
    r.3 = format!(
        "{} {}",
        v["status"].as_str().unwrap(),
        v["incomplete_details"]
    );
    r.4 = (
        v["usage"]["input_tokens"].as_u64().unwrap(),
        v["usage"]["output_tokens"].as_u64().unwrap(),
    );
    r
}

/// The terminal response of a Responses stream, with the text deltas checked against it.
fn fold_responses_stream(body: &str) -> Value {
    let events = sse::typed_events(body);
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut arguments = String::new();
    for (i, (event, d)) in events.iter().enumerate() {
        assert_eq!(d["sequence_number"].as_u64(), Some(i as u64), "{event}");
        match event.as_str() {
            "response.output_text.delta" => text.push_str(d["delta"].as_str().unwrap()),
            "response.reasoning_summary_text.delta" => {
                reasoning.push_str(d["delta"].as_str().unwrap())
            }
            "response.function_call_arguments.delta" => {
                arguments.push_str(d["delta"].as_str().unwrap())
            }
            _ => {}
        }
    }
    let (last, d) = events.last().unwrap();
    assert!(
        last == "response.completed" || last == "response.incomplete",
        "{last}"
    );
    let response = d["response"].clone();
    let r = read_responses(&response);
    assert_eq!(
        (reasoning, text),
        (r.0.clone(), r.1.clone()),
        "deltas and the final response differ"
    );
    let all_args: String = response["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| i["arguments"].as_str())
        .collect();
    assert_eq!(arguments, all_args);
    response
}

fn expected_finish(api: &str, f: FinishReason) -> String {
    match api {
        "chat" => f.as_openai().into(),
        "messages" => match f {
            FinishReason::Stop | FinishReason::Abort => "end_turn",
            FinishReason::Length => "max_tokens",
            FinishReason::ToolCalls => "tool_use",
            FinishReason::ContentFilter => "refusal",
        }
        .into(),
        _ => match f {
            FinishReason::Length => "incomplete {\"reason\":\"max_output_tokens\"}".into(),
            FinishReason::ContentFilter => "incomplete {\"reason\":\"content_filter\"}".into(),
            _ => "completed null".into(),
        },
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Request → canonical is what the model says, for each API; the engine request rendered
    /// from the canonical request parses back (as Chat Completions) to the same one; a Chat
    /// Completions request is a fixed point of parse ∘ render.
    #[test]
    fn requests_parse_to_the_modelled_canonical_request(c in conversation()) {
        for api in ["chat", "responses", "messages"] {
            let (body, expected) = render(&c, api);
            let parsed = codec(api).parse(&serde_json::to_vec(&body).unwrap())
                .unwrap_or_else(|e| panic!("{api}: {e}\n{body:#}"));
            prop_assert_eq!(&parsed.request, &expected, "{}: {:#}", api, body);
            // Fields the proxy does not forward are noted, never silently lost.
            let dropped = if api == "messages" { "metadata" } else { "store" };
            prop_assert!(parsed.normalizations.iter().any(|n| n.kind == "dropped_field" && n.detail.contains(dropped)),
                "{}: {:?}", api, parsed.normalizations);

            let engine = chat_body(&parsed.request, if c.stream { CallMode::Streaming } else { CallMode::Whole });
            let shown = String::from_utf8_lossy(&engine);
            let again = ChatCompletions.parse(&engine)
                .unwrap_or_else(|e| panic!("{api}: engine request rejected: {e}\n{shown}"));
            prop_assert_eq!(&again.request, &parsed.request, "{}: engine request {}", api, shown);
            if api == "chat" {
                let twice = chat_body(&again.request, CallMode::Whole);
                let thrice = ChatCompletions.parse(&twice).unwrap();
                prop_assert_eq!(chat_body(&thrice.request, CallMode::Whole), twice);
            }
        }
    }

    /// An answer read back from each API's whole JSON and SSE stream is the generation, and
    /// the stream says what the whole answer says.
    #[test]
    fn answers_round_trip_whole_and_streamed(
        g in generation(),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let ds = deltas(&g, &cuts);
        let mut acc = GenerationAccumulator::default();
        for d in &ds {
            acc.push(GenerationEvent::Delta(d.clone()));
        }
        acc.push(GenerationEvent::Finished { finish_reason: g.finish, usage: Some(g.usage) });
        let calls: Vec<(String, Value)> = g.calls.iter().map(|(_, n, a)| (n.clone(), a.clone())).collect();

        for api in ["chat", "responses", "messages"] {
            let codec = codec(api);
            let whole: Value = serde_json::from_slice(&codec.render_whole(&meta(api), &acc)).unwrap();
            let mut out = Vec::new();
            let mut r = codec.stream_renderer(meta(api), true);
            r.start(&mut out);
            for d in &ds {
                r.delta(d, &mut out);
            }
            r.finish(g.finish, Some(g.usage), &mut out);
            let stream = String::from_utf8(out).unwrap();

            let want: Read = (g.reasoning.clone(), g.content.clone(), calls.clone(), expected_finish(api, g.finish),
                (g.usage.prompt_tokens, g.usage.completion_tokens));
            let (from_whole, from_stream) = match api {
                "chat" => (read_chat_whole(&whole), read_chat_stream(&stream)),
                "messages" => {
                    let folded = fold_messages_stream(&stream);
                    // The folded stream is the whole message, block for block.
                    prop_assert_eq!(&folded["content"], &whole["content"], "stream {}", stream);
                    (read_messages_whole(&whole), read_messages_whole(&folded))
                }
                _ => {
                    let folded = fold_responses_stream(&stream);
                    prop_assert_eq!(&folded, &whole, "stream {}", stream);
                    (read_responses(&whole), read_responses(&folded))
                }
            };
            prop_assert_eq!(&from_whole, &want, "{} whole {:#}", api, whole);
            prop_assert_eq!(&from_stream, &want, "{} stream {}", api, stream);
        }
    }
}
