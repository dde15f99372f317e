//! The Chat Completions pieces all engine adapters share (backend/openai_compat.rs): a whole
//! answer's `message` or a stream chunk's `delta`, `usage`, and token id arrays, on any JSON.
//! Invariants: what comes out is what the JSON says (text, tool-call count, usage counts),
//! and token ids are the JSON's integers exactly, never truncated or guessed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use tokentap_proxy::backend::decode;

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    for whole in [true, false] {
        let d = decode::delta(&v, whole);
        assert_eq!(
            d.content.as_deref(),
            v.get("content").and_then(Value::as_str)
        );
        let calls = v.get("tool_calls").and_then(Value::as_array);
        assert_eq!(d.tool_calls.len(), calls.map_or(0, Vec::len));
        if whole {
            for (i, c) in d.tool_calls.iter().enumerate() {
                assert_eq!(c.index as usize, i, "a whole message's calls are in order");
            }
        }
    }
    if let Some(u) = decode::usage(&v) {
        let given = &v["usage"];
        assert_eq!(Some(u.prompt_tokens), given["prompt_tokens"].as_u64());
        if let Some(c) = given["completion_tokens"].as_u64() {
            assert_eq!(u.completion_tokens, c);
        }
        if let Some(t) = given["total_tokens"].as_u64() {
            assert_eq!(u.total_tokens, t);
        }
    }
    for key in ["token_ids", "prompt_token_ids", "tokens"] {
        if let Some(ids) = decode::id_array(v.get(key)) {
            let given = v[key].as_array().expect("ids come from an array");
            assert_eq!(ids.len(), given.len());
            for (id, g) in ids.iter().zip(given) {
                assert_eq!(
                    Some(u64::from(*id)),
                    g.as_u64(),
                    "token id {g} read as {id}"
                );
            }
        }
    }
});
