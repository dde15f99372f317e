//! Record-level redaction: a credential planted anywhere in a harness request (headers, query
//! string, nested body fields, passthrough fields, tool schemas, message text, tool arguments,
//! system prompt) of any of the three wire APIs never reaches the capture record, as JSON or
//! as the spool's NDJSON, except where docs/security.md says redaction does not reach: the
//! conversation itself (message text, tool calls and results, system prompt and the tools
//! offered are what the engine is sent and what the prompt token ids encode, so
//! `backend_request` keeps them as sent; `request.body` never does).
//!
//! The record is built the way `CaptureService` builds it (app.rs `begin_call` and
//! `run_call`): headers and query through `redact::headers`/`redact::query`, the JSON body
//! through `redact::recorded_body`, the canonical request from the codec's `parse`, then
//! `CallCapture::into_record`. That glue needs a Pingora session, so it is restated here in
//! its three lines; everything it calls is the proxy's own.

use proptest::prelude::{prop, prop_assert, prop_oneof, proptest, Just, ProptestConfig, Strategy};
use serde_json::{json, Value};
use tokentap_proxy::canonical::{Delta, FinishReason, GenerationEvent, ToolCallDelta, Usage};
use tokentap_proxy::capture::CallCapture;
use tokentap_proxy::redact;
use tokentap_proxy::session::Session;
use tokentap_proxy::wire::chat_completions::ChatCompletions;
use tokentap_proxy::wire::messages::Messages;
use tokentap_proxy::wire::responses::Responses;
use tokentap_proxy::wire::WireCodec;
use tokentap_schema::{BackendInfo, BackendKind, HarnessRequest, SessionSource, WireApi};
use tokentap_spool::{FsyncPolicy, SpoolConfig, SpoolWriter};

/// A credential as planted (`planted`) and the part of it that must never be stored.
#[derive(Debug, Clone)]
struct Secret {
    planted: String,
    distinctive: String,
}

fn alnum(n: std::ops::Range<usize>) -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(
            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
                .chars()
                .collect::<Vec<_>>(),
        ),
        n,
    )
    .prop_map(|c| c.into_iter().collect())
}

/// The credential shapes redact.rs knows, each with a random distinctive part.
fn secret() -> impl Strategy<Value = Secret> {
    let s = |p: &'static str, tail: String| Secret {
        planted: format!("{p}{tail}"),
        distinctive: tail,
    };
    prop_oneof![
        alnum(20..40).prop_map(move |t| s("Bearer ", t)),
        alnum(20..40).prop_map(move |t| s("Basic ", t)),
        alnum(20..40).prop_map(move |t| s("sk-", t)),
        alnum(20..40).prop_map(move |t| s("sk-ant-api03-", t)),
        alnum(20..40).prop_map(move |t| s("sk-proj-", t)),
        alnum(24..40).prop_map(move |t| s("ghp_", t)),
        alnum(24..40).prop_map(move |t| s("github_pat_", t)),
        prop::collection::vec(
            prop::sample::select(
                "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
                    .chars()
                    .collect::<Vec<_>>()
            ),
            16
        )
        .prop_map(move |c| s("AKIA", c.into_iter().collect())),
        (alnum(12..30), alnum(12..30), alnum(12..40)).prop_map(|(a, b, c)| Secret {
            planted: format!("eyJ{a}.{b}.{c}"),
            distinctive: format!("{b}.{c}"),
        }),
        (alnum(30..60), alnum(30..60)).prop_map(|(a, b)| Secret {
            planted: format!(
                "-----BEGIN RSA PRIVATE KEY-----\n{a}\n{b}\n-----END RSA PRIVATE KEY-----"
            ),
            distinctive: a,
        }),
    ]
}

/// Where the secret is planted.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Spot {
    /// A credential header (`authorization`, `x-api-key`, …) by name.
    SecretHeader(&'static str),
    /// An ordinary header whose value has a credential's shape.
    OrdinaryHeader,
    /// `?api_key=…` and friends.
    SecretQuery(&'static str),
    /// An ordinary query parameter with a credential-shaped value.
    OrdinaryQuery,
    /// A credential-named field deep in a field the engine is not sent (an MCP config).
    DroppedNestedField,
    /// A credential-named field in a field passed through to the engine.
    PassthroughField,
    /// Credential-shaped text in a field passed through to the engine.
    PassthroughText,
    /// The conversation: a user message's text.
    MessageText,
    /// The conversation: an assistant tool call's arguments.
    ToolArguments,
    /// The conversation: a tool result.
    ToolResult,
    /// The conversation: the system prompt.
    SystemPrompt,
    /// The tools offered (rendered into the prompt by the chat template): a description.
    ToolDescription,
}

impl Spot {
    /// Inside what docs/security.md calls the conversation (kept in `backend_request`).
    fn in_conversation(self) -> bool {
        matches!(
            self,
            Spot::MessageText
                | Spot::ToolArguments
                | Spot::ToolResult
                | Spot::SystemPrompt
                | Spot::ToolDescription
        )
    }
}

fn spot() -> impl Strategy<Value = Spot> {
    prop_oneof![
        prop::sample::select(vec![
            "authorization",
            "Authorization",
            "x-api-key",
            "api-key",
            "cookie",
            "proxy-authorization",
            "x-goog-api-key"
        ])
        .prop_map(Spot::SecretHeader),
        Just(Spot::OrdinaryHeader),
        prop::sample::select(vec!["api_key", "key", "access_token", "apiKey", "token"])
            .prop_map(Spot::SecretQuery),
        Just(Spot::OrdinaryQuery),
        Just(Spot::DroppedNestedField),
        Just(Spot::PassthroughField),
        Just(Spot::PassthroughText),
        Just(Spot::MessageText),
        Just(Spot::ToolArguments),
        Just(Spot::ToolResult),
        Just(Spot::SystemPrompt),
        Just(Spot::ToolDescription),
    ]
}

const APIS: [WireApi; 3] = [
    WireApi::ChatCompletions,
    WireApi::Responses,
    WireApi::Messages,
];

fn codec(api: WireApi) -> &'static dyn WireCodec {
    match api {
        WireApi::ChatCompletions => &ChatCompletions,
        WireApi::Responses => &Responses,
        _ => &Messages,
    }
}

/// A two-turn harness request of `api` with a tool call and its result, the secret planted at
/// `spot` (body spots only; header and query spots leave the body clean). `words` is prose
/// around a planted shape.
fn body(api: WireApi, spot: Spot, secret: &str, words: &str) -> Value {
    let in_text = |s: Spot, clean: &str| -> String {
        if spot == s {
            format!("{words} {secret} {words}")
        } else {
            clean.to_owned()
        }
    };
    let user = in_text(Spot::MessageText, "list the files");
    let system = in_text(Spot::SystemPrompt, "You are a coding agent.");
    let result = in_text(Spot::ToolResult, "a.txt b.txt");
    let description = in_text(Spot::ToolDescription, "Runs a shell command");
    let args = if spot == Spot::ToolArguments {
        json!({"command": format!("curl -H 'Authorization: {secret}' x"), "env": {"TOKEN": secret}})
    } else {
        json!({"command": "ls"})
    };
    let args_text = args.to_string();
    let schema = json!({"type": "object", "properties": {"command": {"type": "string"}}});
    let mcp = if spot == Spot::DroppedNestedField {
        json!({"servers": [{"name": "gh", "headers": {"Authorization": secret}, "env": {"GITHUB_TOKEN": secret}}]})
    } else {
        json!({"servers": []})
    };
    let mut v = match api {
        WireApi::ChatCompletions => json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": [{"type": "text", "text": user}]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": args_text}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": result},
            ],
            "tools": [{"type": "function", "function": {"name": "bash", "description": description, "parameters": schema}}],
            "stream": true,
            "mcp_config": mcp,
        }),
        WireApi::Responses => json!({
            "model": "m",
            "instructions": system,
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]},
                {"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": args_text},
                {"type": "function_call_output", "call_id": "call_1", "output": result},
            ],
            "tools": [{"type": "function", "name": "bash", "description": description, "parameters": schema}],
            "stream": true,
            "client_metadata": mcp,
        }),
        _ => json!({
            "model": "m",
            "max_tokens": 1024,
            "system": [{"type": "text", "text": system}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": user}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "bash", "input": args}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]},
            ],
            "tools": [{"name": "bash", "description": description, "input_schema": schema}],
            "stream": true,
            "metadata": mcp,
        }),
    };
    // Fields the engine is sent as given: Chat Completions' passthrough fields, Responses'
    // structured-output schema (sent as `response_format`). Messages has none.
    match (api, spot) {
        (WireApi::ChatCompletions, Spot::PassthroughField) => {
            v["chat_template_kwargs"] = json!({"enable_thinking": true, "api_key": secret});
        }
        (WireApi::ChatCompletions, Spot::PassthroughText) => {
            v["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "out",
                "schema": {"type": "object", "description": format!("{words} {secret}")}}});
        }
        (WireApi::Responses, Spot::PassthroughField) => {
            v["text"] = json!({"format": {"type": "json_schema", "name": "out",
                "schema": {"type": "object", "properties": {"x": {"type": "string", "default": secret}}, "x-api-key": secret}}});
        }
        (WireApi::Responses, Spot::PassthroughText) => {
            v["text"] = json!({"format": {"type": "json_schema", "name": "out",
                "schema": {"type": "object", "description": format!("{words} {secret}")}}});
        }
        (WireApi::Messages, Spot::PassthroughField | Spot::PassthroughText) => {
            v["metadata"] = json!({"user_id": format!("{words} {secret}"), "api_key": secret});
        }
        _ => {}
    }
    v
}

/// The record of one call, built as `CaptureService` builds it, as the spool stores it.
fn record_of(
    api: WireApi,
    headers: &[(String, String)],
    query: Option<&str>,
    raw_body: &[u8],
) -> tokentap_schema::CaptureRecord {
    let request = HarnessRequest {
        method: "POST".into(),
        path: "/v1/x".into(),
        query: query.map(redact::query),
        headers: redact::headers(headers.iter().map(|(k, v)| (k.as_str(), v.as_bytes()))),
        body_bytes: raw_body.len() as u64,
        body: None,
        body_text: None,
    };
    let kept = redact::recorded_body(raw_body).expect("a JSON body");
    let backend = BackendInfo {
        kind: BackendKind::Vllm,
        url: "http://engine:8000".into(),
        model: String::new(),
        policy_version: None,
        engine_weight_version: None,
        synthetic_stream: false,
    };
    let mut call = CallCapture::new(api, request, backend);
    call.request.body = Some(kept.body);
    call.body_verbatim = kept.verbatim;
    call.session = Some((
        Session {
            id: "run-1".into(),
            source: SessionSource::Header,
        },
        0,
    ));
    let parsed = codec(api)
        .parse(raw_body)
        .unwrap_or_else(|e| panic!("{api:?} rejected the request: {e}"));
    call.normalizations = parsed.normalizations;
    call.backend.model = parsed.request.model.clone();
    call.backend_request = Some(parsed.request);
    for e in [
        GenerationEvent::PromptTokens {
            ids: vec![1, 2, 3],
            source: tokentap_schema::TokenSource::EngineResponse,
        },
        GenerationEvent::Delta(Delta {
            content: Some("done".into()),
            tool_calls: vec![ToolCallDelta {
                index: 0,
                id: Some("call_2".into()),
                name: Some("bash".into()),
                arguments: Some("{\"command\":\"ls\"}".into()),
            }],
            ..Default::default()
        }),
        GenerationEvent::SampledTokens {
            ids: vec![4, 5],
            logprobs: vec![Some(-0.1), Some(-0.2)],
        },
        GenerationEvent::Finished {
            finish_reason: FinishReason::ToolCalls,
            usage: Some(Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                total_tokens: 5,
                reasoning_tokens: None,
            }),
        },
    ] {
        call.generation.push(e);
    }
    call.response_status = 200;
    call.into_record()
}

/// The record as one spool segment holds it (written by the spool writer itself).
fn spooled(record: &tokentap_schema::CaptureRecord) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut w = SpoolWriter::open(
        dir.path(),
        SpoolConfig {
            fsync: FsyncPolicy::Never,
            ..SpoolConfig::default()
        },
    )
    .unwrap();
    w.append(record).unwrap();
    w.sync().unwrap();
    drop(w);
    let mut all = String::new();
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            all.push_str(&String::from_utf8_lossy(&std::fs::read(p).unwrap()));
        }
    }
    assert!(all.contains("\"record_id\""), "no segment found");
    all
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_planted_credential_never_reaches_the_record(
        api in prop::sample::select(APIS.to_vec()),
        spot in spot(),
        secret in secret(),
        words in "[a-z]{1,8}( [a-z]{1,8}){0,2}",
    ) {
        let mut headers = vec![
            ("content-type".to_owned(), "application/json".to_owned()),
            ("user-agent".to_owned(), "harness/1.0".to_owned()),
        ];
        let mut query = Some("beta=true".to_owned());
        match spot {
            Spot::SecretHeader(name) => headers.push((name.into(), secret.planted.replace('\n', " "))),
            Spot::OrdinaryHeader => headers.push(("x-trace".into(), format!("{words} {}", secret.planted.replace('\n', " ")))),
            Spot::SecretQuery(name) => query = Some(format!("beta=true&{name}={}", secret.distinctive)),
            Spot::OrdinaryQuery => query = Some(format!("beta=true&q={}", secret.planted.replace(['\n', ' '], "+"))),
            _ => {}
        }
        let raw = serde_json::to_vec(&body(api, spot, &secret.planted, &words)).unwrap();
        let record = record_of(api, &headers, query.as_deref(), &raw);
        let d = &secret.distinctive;

        let mut outside_conversation = serde_json::to_value(&record).unwrap();
        if spot.in_conversation() {
            // Documented: the conversation and the tools as sent to the engine stay as sent.
            let b = outside_conversation["backend_request"].as_object_mut().unwrap();
            b.remove("messages");
            b.remove("tools");
            // …but never in the harness request's own copy, which is redacted.
            let harness = serde_json::to_string(&record.request).unwrap();
            prop_assert!(!harness.contains(d.as_str()), "{:?} {:?}: {} kept in request: {}", api, spot, d, harness);
        }
        let json = outside_conversation.to_string();
        prop_assert!(!json.contains(d.as_str()), "{:?} {:?}: {} kept in the record: {}", api, spot, d, json);
        if !spot.in_conversation() {
            let ndjson = spooled(&record);
            prop_assert!(!ndjson.contains(d.as_str()), "{:?} {:?}: {} kept in the spool: {}", api, spot, d, ndjson);
        }
    }
}
