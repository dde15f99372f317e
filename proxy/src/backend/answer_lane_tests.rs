//! The fast lane against serde_json: for any answer text (well-formed, odd, or broken),
//! decoding with the lane gives exactly what serde_json alone gives (the same fields, ids,
//! texts, or the same error). The generated answers are vLLM-, SGLang- and llama.cpp-shaped,
//! then varied where the lane has its own rules: whitespace, repeated and escaped keys, ids
//! with leading zeros, signs, fractions, exponents, values past `u32::MAX`, nesting, and
//! truncated or corrupted bytes.

use proptest::prelude::*;
use proptest::strategy::ValueTree;

use super::answer::{decode, decode_by_serde, Answer, Lenient};
use super::json_lane;

/// Whitespace between tokens: mostly none, as engines write it.
fn ws() -> impl Strategy<Value = &'static str> {
    prop_oneof![8 => Just(""), 1 => Just(" "), 1 => Just("\n\t "), 1 => Just("\r")]
}

/// One id as text: mostly plain, sometimes one the lane must leave to serde_json.
fn id_text() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => any::<u32>().prop_map(|n| n.to_string()),
        6 => (0u32..200_000).prop_map(|n| n.to_string()),
        1 => Just("4294967295".to_owned()),
        1 => Just("4294967296".to_owned()),
        1 => Just("0".to_owned()),
        1 => Just("-0".to_owned()),
        1 => Just("01".to_owned()),
        1 => Just("-3".to_owned()),
        1 => Just("7.0".to_owned()),
        1 => Just("1e3".to_owned()),
        1 => Just("123456789012".to_owned()),
        1 => Just("\"5\"".to_owned()),
        1 => Just("null".to_owned()),
        1 => Just("[1]".to_owned()),
    ]
}

/// An id array: compact (the engines' form) or spaced, sometimes odd.
fn ids_text() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::collection::vec(0u32..300_000, 0..40)
            .prop_map(|ids| serde_json::to_string(&ids).unwrap()),
        3 => (prop::collection::vec(id_text(), 0..12), ws()).prop_map(|(ids, ws)| {
            format!("[{ws}{}{ws}]", ids.join(&format!("{ws},{ws}")))
        }),
        1 => Just("null".to_owned()),
        1 => Just("{\"0\":1}".to_owned()),
    ]
}

/// A JSON string with the texts an answer carries (escapes, non-ASCII, brackets).
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("\"hello\"".to_owned()),
        Just("\"\"".to_owned()),
        Just("\"say \\\"hi\\\"\\n\"".to_owned()),
        Just("\"caf\u{e9} \\u00e9 \\ud83d\\ude00\"".to_owned()),
        Just("\"[{]}\"".to_owned()),
        "[a-z ,:{}\\[\\]]{0,12}".prop_map(|s| serde_json::to_string(&s).unwrap()),
        Just("5".to_owned()),
        Just("null".to_owned()),
    ]
}

/// Any JSON value (what an answer's unread fields hold).
fn junk() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        text(),
        Just("true".to_owned()),
        Just("-1.5e-3".to_owned()),
        Just("18446744073709551616".to_owned()),
        ids_text(),
    ];
    leaf.prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            prop::collection::vec(("[a-z]{1,6}", inner), 0..4).prop_map(|m| {
                let members: Vec<String> =
                    m.into_iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    })
}

/// A key as the answer spells it: mostly plain, sometimes escaped (the same key to serde_json).
fn key(name: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![
        9 => Just(format!("\"{name}\"")),
        1 => Just(format!("\"\\u{:04x}{}\"", name.as_bytes()[0], &name[1..])),
    ]
}

/// An object of `members`, joined with `ws`, possibly with a member repeated.
fn object(members: Vec<(String, String)>, ws: &str, repeat: Option<usize>) -> String {
    let mut members: Vec<String> = members
        .into_iter()
        .map(|(k, v)| format!("{k}{ws}:{ws}{v}"))
        .collect();
    if let Some(i) = repeat.filter(|_| !members.is_empty()) {
        let again = members[i % members.len()].clone();
        members.push(again);
    }
    format!("{{{ws}{}{ws}}}", members.join(&format!("{ws},{ws}")))
}

fn members(
    fields: Vec<BoxedStrategy<(String, String)>>,
) -> impl Strategy<Value = Vec<(String, String)>> {
    fields
        .into_iter()
        .map(|f| prop::option::weighted(0.7, f))
        .collect::<Vec<_>>()
        .prop_map(|m| m.into_iter().flatten().collect())
}

fn field(
    name: &'static str,
    value: impl Strategy<Value = String> + 'static,
) -> BoxedStrategy<(String, String)> {
    (key(name), value).boxed()
}

fn logprob_entry() -> impl Strategy<Value = String> {
    (
        members(vec![
            field("token", text()),
            field(
                "logprob",
                prop_oneof![
                    Just("-0.25".to_owned()),
                    Just("0".to_owned()),
                    Just("-9.5e-7".to_owned()),
                    text()
                ],
            ),
            field("id", id_text()),
            field("bytes", junk()),
            field("top_logprobs", Just("[]".to_owned())),
        ]),
        ws(),
        prop::option::weighted(0.1, any::<usize>()),
    )
        .prop_map(|(m, ws, r)| object(m, ws, r))
}

fn choice() -> impl Strategy<Value = String> {
    let message = (
        members(vec![
            field("role", Just("\"assistant\"".to_owned())),
            field("content", text()),
            field("reasoning_content", text()),
            field(
                "tool_calls",
                prop_oneof![
                    Just("[]".to_owned()),
                    Just(r#"[{"index":0,"id":"call_1","function":{"name":"ls","arguments":"{\"a\":1}"}}]"#.to_owned()),
                    junk(),
                ],
            ),
        ]),
        ws(),
    )
        .prop_map(|(m, ws)| object(m, ws, None))
        .boxed();
    let logprobs = (prop::collection::vec(logprob_entry(), 0..4), ws())
        .prop_map(|(entries, ws)| format!("{{\"content\":{ws}[{}]}}", entries.join(",")));
    let meta_info = prop::collection::vec((-3.0f64..0.0, 0u32..1000), 0..4).prop_map(|e| {
        let entries: Vec<String> = e
            .iter()
            .map(|(l, id)| format!("[{l},{id},\"t\"]"))
            .collect();
        format!("{{\"output_token_logprobs\":[{}]}}", entries.join(","))
    });
    (
        members(vec![
            field("index", Just("0".to_owned())),
            field("message", message.clone()),
            field("delta", message),
            field("finish_reason", text()),
            field("token_ids", ids_text()),
            field("prompt_token_ids", ids_text()),
            field("logprobs", prop_oneof![logprobs, Just("null".to_owned())]),
            field("meta_info", meta_info),
        ]),
        ws(),
        prop::option::weighted(0.1, any::<usize>()),
    )
        .prop_map(|(m, ws, r)| object(m, ws, r))
}

fn answer_text() -> impl Strategy<Value = String> {
    let choices = (prop::collection::vec(choice(), 0..3), ws())
        .prop_map(|(c, ws)| format!("[{ws}{}{ws}]", c.join(",")));
    let usage = (0u32..100_000, 0u32..1000).prop_map(|(p, c)| {
        format!(
            r#"{{"prompt_tokens":{p},"completion_tokens":{c},"total_tokens":{}}}"#,
            p + c
        )
    });
    (
        members(vec![
            field("id", text()),
            field("object", Just("\"chat.completion\"".to_owned())),
            field("prompt_token_ids", ids_text()),
            field("choices", choices),
            field("usage", prop_oneof![usage, junk()]),
            field(
                "sglext",
                ids_text().prop_map(|ids| format!("{{\"input_ids\":{ids}}}")),
            ),
            field(
                "error",
                prop_oneof![Just("null".to_owned()), Just(r#"{"code":429}"#.to_owned())],
            ),
            field("kv_transfer_params", junk()),
        ]),
        ws(),
        prop::option::weighted(0.1, any::<usize>()),
        ws(),
    )
        .prop_map(|(mut m, ws, r, outer)| {
            // Engines put the prompt ids anywhere among the members.
            let turn = m.len().min(2);
            m.rotate_left(turn);
            format!("{outer}{}{outer}", object(m, ws, r))
        })
}

/// An answer text, sometimes damaged: cut short, a byte changed, or trailing junk.
fn maybe_damaged() -> impl Strategy<Value = Vec<u8>> {
    (
        answer_text(),
        0u8..10,
        any::<prop::sample::Index>(),
        any::<u8>(),
    )
        .prop_map(|(text, damage, at, byte)| {
            let mut bytes = text.into_bytes();
            let i = at.index(bytes.len().max(1));
            match damage {
                0 => bytes.truncate(i),
                1 if !bytes.is_empty() => bytes[i] = byte,
                2 => bytes.insert(i, byte),
                3 => bytes.extend_from_slice(b" x"),
                _ => {}
            }
            bytes
        })
}

fn debug<T: std::fmt::Debug>(decoded: serde_json::Result<T>) -> String {
    match decoded {
        Ok(v) => format!("{v:?}"),
        Err(e) => format!("error: {e}"),
    }
}

fn took_the_lane(json: &[u8]) -> bool {
    json_lane::document(json, |json| Answer::lane(json, 0)).is_some()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_lane_decodes_exactly_as_serde_json(json in maybe_damaged()) {
        prop_assert_eq!(debug(decode::<Answer>(&json)), debug(decode_by_serde::<Answer>(&json)));
        if took_the_lane(&json) {
            prop_assert!(decode_by_serde::<Answer>(&json).is_ok(), "the lane took what serde_json refuses");
        }
    }
}

#[test]
fn engine_shaped_answers_take_the_lane() {
    // Not vacuous: most generated answers (undamaged) are read by the lane.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = answer_text();
    let (mut taken, total) = (0, 500);
    for _ in 0..total {
        let json = strategy.new_tree(&mut runner).unwrap().current();
        taken += usize::from(took_the_lane(json.as_bytes()));
    }
    assert!(
        taken * 3 > total,
        "only {taken} of {total} answers took the lane"
    );

    let prompt: Vec<u32> = (0..10_000).map(|i| 1000 + (i * 7919) % 150_000).collect();
    let vllm = serde_json::json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                     "token_ids": [5, 6], "finish_reason": "stop",
                     "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.5}]}}],
        "usage": {"prompt_tokens": 10_000, "completion_tokens": 2, "total_tokens": 10_002},
        "prompt_token_ids": prompt, "kv_transfer_params": null,
    });
    let json = serde_json::to_vec(&vllm).unwrap();
    assert!(took_the_lane(&json));
    let answer = decode::<Answer>(&json).unwrap();
    assert_eq!(answer.prompt_token_ids.0.as_ref(), Some(&prompt));
    assert_eq!(debug(Ok(answer)), debug(decode_by_serde::<Answer>(&json)));
}

#[test]
fn nesting_serde_json_refuses_is_refused_with_the_lane_too() {
    // serde_json refuses 128 levels; the lane reads the outer ones itself and serde_json the
    // inner ones in place, each counting its own, and must still refuse (or accept) alike.
    for (levels, ok) in [(126, true), (127, false), (200, false)] {
        for json in [
            format!(
                r#"{{"kv_transfer_params":{}1{}}}"#,
                "[".repeat(levels),
                "]".repeat(levels)
            ),
            format!(
                r#"{{"choices":[{{"message":{{"tool_calls":{}1{}}}}}]}}"#,
                "[".repeat(levels - 3),
                "]".repeat(levels - 3)
            ),
        ] {
            let by_lane = decode::<Answer>(json.as_bytes());
            assert_eq!(by_lane.is_ok(), ok, "{levels} levels");
            assert_eq!(
                debug(by_lane),
                debug(decode_by_serde::<Answer>(json.as_bytes()))
            );
        }
    }
}
