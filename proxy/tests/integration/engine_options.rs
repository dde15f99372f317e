//! Engine options through each wire API: a call with an option out of bounds is refused with
//! that API's own 400 body naming the parameter as the caller wrote it; an option a listener
//! does not allow is left out of the engine request with a note; an allowed option reaches
//! the engine request byte for byte as the harness wrote it.

use std::collections::HashMap;

use proptest::prelude::{any, prop, prop_assert_eq, prop_oneof, proptest, Just, Strategy};
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};
use tokentap_proxy::backend::{chat_body, CallMode};
use tokentap_proxy::engine_options::{
    self, EngineOption, EngineOptionPolicy, MAX_N_PROBS, REASONING_EFFORTS, TEMPLATE_VARIABLES,
};
use tokentap_proxy::wire::chat_completions::ChatCompletions;
use tokentap_proxy::wire::messages::Messages;
use tokentap_proxy::wire::responses::Responses;
use tokentap_proxy::wire::{CallError, ParsedCall, WireCodec, WireError};

/// What the capture service does with a body: parse, then screen the engine options as
/// `CaptureService` does (the refusal rendered by the codec, as the harness gets it).
fn call(
    codec: &dyn WireCodec,
    body: &Value,
    policy: &EngineOptionPolicy,
) -> Result<ParsedCall, (u16, Value)> {
    let render = |e: CallError| {
        let (status, body) = codec.render_error(&e);
        (status, serde_json::from_slice(&body).unwrap())
    };
    let mut parsed = codec
        .parse(&serde_json::to_vec(body).unwrap())
        .map_err(|e| render(e.into()))?;
    screen(codec, &mut parsed, policy).map_err(render)?;
    Ok(parsed)
}

fn screen(
    codec: &dyn WireCodec,
    parsed: &mut ParsedCall,
    policy: &EngineOptionPolicy,
) -> Result<(), CallError> {
    let dropped = engine_options::screen(&mut parsed.request, policy, |o| {
        codec.engine_option_param(o)
    })
    .map_err(|r| CallError::from(WireError::at(r.param, r.message)))?;
    parsed
        .normalizations
        .extend(dropped.iter().map(|d| d.normalization()));
    Ok(())
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn responses(extra: Value) -> Value {
    let mut body = json!({"model": "m", "input": "hi"});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn messages(extra: Value) -> Value {
    let mut body =
        json!({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

fn many_biases(n: usize) -> Value {
    Value::Object((0..n).map(|i| (i.to_string(), json!(-100))).collect())
}

#[test]
fn chat_completions_refusals_are_openai_400s_naming_the_parameter() {
    let all = EngineOptionPolicy::all();
    let (status, body) = call(
        &ChatCompletions,
        &chat(json!({"logit_bias": many_biases(301)})),
        &all,
    )
    .unwrap_err();
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["param"], "logit_bias");
    assert_eq!(body["error"]["code"], Value::Null);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("'logit_bias'") && message.contains("300"),
        "{message}"
    );

    let (status, body) = call(
        &ChatCompletions,
        &chat(json!({"chat_template_kwargs": {"chat_template": "{% for x in range(99999999) %}{% endfor %}"}})),
        &all,
    )
    .unwrap_err();
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "chat_template_kwargs.chat_template");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("'chat_template' is not a chat template variable"));

    let (_, body) = call(&ChatCompletions, &chat(json!({"n_probs": 1000})), &all).unwrap_err();
    assert_eq!(body["error"]["param"], "n_probs");
}

#[test]
fn responses_refusals_are_openai_400s_naming_the_callers_parameter() {
    let all = EngineOptionPolicy::all();
    let (status, body) = call(
        &Responses,
        &responses(json!({"reasoning": {"effort": "maximal"}})),
        &all,
    )
    .unwrap_err();
    assert_eq!(status, 400);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(body["error"]["param"], "reasoning.effort");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("'reasoning.effort': 'maximal'"));

    let properties: Map<String, Value> = (0..3000)
        .map(|i| (format!("p{i}"), json!({"type": "string"})))
        .collect();
    let huge = json!({"text": {"format": {"type": "json_schema", "name": "out",
        "schema": {"type": "object", "properties": properties}}}});
    let (status, body) = call(&Responses, &responses(huge), &all).unwrap_err();
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "text.format");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("Invalid 'text.format'"));
}

#[test]
fn messages_refusals_are_anthropic_400s_naming_the_parameter() {
    // Messages maps no option a caller can put out of bounds (`disable_parallel_tool_use` is
    // a typed boolean); an option out of bounds in its canonical request still answers in
    // Anthropic's shape.
    let mut parsed = Messages
        .parse(&serde_json::to_vec(&messages(json!({}))).unwrap())
        .unwrap();
    parsed
        .request
        .extra
        .insert("logit_bias".into(), many_biases(400));
    let e = screen(&Messages, &mut parsed, &EngineOptionPolicy::all()).unwrap_err();
    let (status, body) = Messages.render_error(&e);
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, 400);
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("'logit_bias'") && message.contains("400"),
        "{message}"
    );
}

#[test]
fn options_a_listener_does_not_allow_are_left_out_and_noted_in_each_api() {
    let none = EngineOptionPolicy::only([]);
    let parsed = call(
        &ChatCompletions,
        &chat(json!({"logit_bias": {"5": 1}, "parallel_tool_calls": true})),
        &EngineOptionPolicy::rollout_default(),
    )
    .unwrap();
    assert_eq!(
        parsed.request.extra.keys().collect::<Vec<_>>(),
        ["parallel_tool_calls"]
    );
    let engine: Value =
        serde_json::from_slice(&chat_body(&parsed.request, CallMode::Whole)).unwrap();
    assert!(engine.get("logit_bias").is_none(), "{engine}");
    assert!(parsed
        .normalizations
        .iter()
        .any(|n| n.kind == "dropped_field"
            && n.detail.contains("'logit_bias'")
            && n.detail.contains("not allowed on this node")));

    let parsed = call(
        &Responses,
        &responses(json!({"reasoning": {"effort": "high"},
            "text": {"format": {"type": "json_object"}}})),
        &none,
    )
    .unwrap();
    assert!(parsed.request.extra.is_empty());
    let notes: Vec<_> = parsed.normalizations.iter().map(|n| &n.detail).collect();
    for param in ["'reasoning.effort'", "'text.format'"] {
        assert!(notes.iter().any(|d| d.contains(param)), "{notes:?}");
    }

    let tools = json!([{"name": "bash", "input_schema": {"type": "object"}}]);
    let parsed = call(
        &Messages,
        &messages(json!({"tools": tools,
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}})),
        &none,
    )
    .unwrap();
    assert!(parsed.request.extra.is_empty());
    assert!(parsed
        .normalizations
        .iter()
        .any(|n| n.detail.contains("'tool_choice.disable_parallel_tool_use'")));
    // Allowed (a node's default), the proxy's own mapping reaches the engine.
    let parsed = call(
        &Messages,
        &messages(json!({"tools": tools,
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}})),
        &EngineOptionPolicy::rollout_default(),
    )
    .unwrap();
    assert_eq!(parsed.request.extra["parallel_tool_calls"], false);
}

/// Text with what JSON makes interesting: quotes, escapes, unicode.
fn text() -> impl Strategy<Value = String> {
    prop::string::string_regex("[a-z \"\\\\\n\t/é中😀]{0,24}").unwrap()
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e12f64..1e12).prop_map(Value::from),
        text().prop_map(Value::from),
    ]
}

/// A JSON schema: a few levels of objects, arrays and enums with arbitrary text.
fn schema() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(json!({"type": "string"})),
        Just(json!({"type": "number", "minimum": -1.5})),
        prop::collection::vec(text(), 1..4).prop_map(|e| json!({"enum": e})),
        text().prop_map(|d| json!({"type": "boolean", "description": d})),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::btree_map("[a-z_]{1,8}", inner.clone(), 0..4).prop_map(
                |p| json!({"type": "object", "properties": p, "additionalProperties": false})
            ),
            inner.prop_map(|i| json!({"type": "array", "items": i})),
        ]
    })
}

/// An allowed value of `option`, within its bounds.
fn allowed_value(option: EngineOption) -> proptest::strategy::BoxedStrategy<Value> {
    match option {
        EngineOption::ParallelToolCalls => any::<bool>().prop_map(Value::from).boxed(),
        EngineOption::ReasoningEffort => prop::sample::select(REASONING_EFFORTS)
            .prop_map(Value::from)
            .boxed(),
        EngineOption::ChatTemplateKwargs => prop::sample::subsequence(TEMPLATE_VARIABLES, 0..=6)
            .prop_flat_map(|keys| {
                prop::collection::vec(scalar(), keys.len()).prop_map(move |v| {
                    Value::Object(keys.iter().map(|k| k.to_string()).zip(v).collect())
                })
            })
            .boxed(),
        EngineOption::RepetitionPenalty => (0.01f64..5.0).prop_map(Value::from).boxed(),
        EngineOption::LogitBias => prop::collection::btree_map(
            any::<u32>(),
            prop_oneof![
                (-100i64..=100).prop_map(Value::from),
                (-100f64..=100.0).prop_map(Value::from),
            ],
            0..300,
        )
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
        .boxed(),
        EngineOption::NProbs => (0..=MAX_N_PROBS).prop_map(Value::from).boxed(),
        EngineOption::ResponseFormat => prop_oneof![
            Just(json!({"type": "text"})),
            Just(json!({"type": "json_object"})),
            (text(), schema(), prop::option::of(any::<bool>())).prop_map(
                |(name, schema, strict)| {
                    let mut js = json!({"name": name, "schema": schema});
                    if let Some(s) = strict {
                        js["strict"] = json!(s);
                    }
                    json!({"type": "json_schema", "json_schema": js})
                }
            ),
        ]
        .boxed(),
    }
}

/// Some engine options, each with an allowed value.
fn allowed_options() -> impl Strategy<Value = Vec<(EngineOption, Value)>> {
    prop::sample::subsequence(EngineOption::ALL.to_vec(), 1..=EngineOption::ALL.len())
        .prop_flat_map(|options| {
            options
                .into_iter()
                .map(|o| allowed_value(o).prop_map(move |v| (o, v)))
                .collect::<Vec<_>>()
        })
}

proptest! {
    /// An allowed option reaches the engine as the harness wrote it, byte for byte, and
    /// nothing is noted about it.
    #[test]
    fn an_allowed_option_reaches_the_engine_byte_for_byte(options in allowed_options()) {
        let mut raw = String::from(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]"#);
        for (o, v) in &options {
            raw.push_str(&format!(",\"{}\":{}", o.name(), serde_json::to_string(v).unwrap()));
        }
        raw.push('}');
        let mut parsed = ChatCompletions.parse(raw.as_bytes()).unwrap();
        let before = parsed.normalizations.len();
        screen(&ChatCompletions, &mut parsed, &EngineOptionPolicy::all()).unwrap();
        prop_assert_eq!(parsed.normalizations.len(), before);
        let engine = chat_body(&parsed.request, CallMode::Whole);
        let fields: HashMap<String, Box<RawValue>> = serde_json::from_slice(&engine).unwrap();
        for (o, v) in &options {
            let written = serde_json::to_string(v).unwrap();
            let sent = fields.get(o.name()).map(|r| r.get());
            prop_assert_eq!(sent, Some(written.as_str()));
        }
    }
}
