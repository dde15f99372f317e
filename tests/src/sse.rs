//! Server-sent events and OpenAI Chat Completions shapes, as a client sees them.

use serde_json::Value;

/// One server-sent event: its `event:` name (`"message"` when the stream named none, as the
/// spec says) and its `data:` lines joined with newlines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

/// The events of an SSE body, by the WHATWG rules (`\r\n` or `\n`, multi-line data, comments,
/// `data:` with or without its space, an unterminated last event dropped): parsed by
/// eventsource-stream, the parser tokentap uses on engines' streams. The one SSE parser of
/// every test.
pub fn events(body: &str) -> Vec<SseEvent> {
    use eventsource_stream::Eventsource;
    use futures::StreamExt;
    let chunk = Ok::<_, std::convert::Infallible>(bytes::Bytes::from(body.to_owned()));
    let parsed = futures::executor::block_on(
        futures::stream::iter([chunk])
            .eventsource()
            .collect::<Vec<_>>(),
    );
    parsed
        .into_iter()
        .map(|e| {
            let e = e.unwrap_or_else(|e| panic!("not an SSE body ({e}): {body}"));
            SseEvent {
                event: e.event,
                data: e.data,
            }
        })
        .collect()
}

/// [`events`] of a body framed exactly as tokentap frames its answers, which is asserted:
/// every event `[event: NAME\n]data: ONE LINE\n\n`, and nothing else in the body.
pub fn canonical_events(body: &str) -> Vec<SseEvent> {
    assert!(
        body.is_empty() || body.ends_with("\n\n"),
        "the stream must end with a whole event: {body:?}"
    );
    for block in body.split_terminator("\n\n") {
        let data = block.strip_prefix("event: ").map_or(Some(block), |rest| {
            rest.split_once('\n')
                .filter(|(name, _)| !name.is_empty())
                .map(|(_, data)| data)
        });
        assert!(
            data.and_then(|d| d.strip_prefix("data: "))
                .is_some_and(|d| !d.contains('\n') && !d.contains('\r')),
            "not a canonical SSE event: {block:?}"
        );
    }
    events(body)
}

/// A Messages or Responses stream: its [`canonical_events`] as (event name, JSON data), each
/// event's name asserted equal to its data's `type`.
pub fn typed_events(body: &str) -> Vec<(String, Value)> {
    canonical_events(body)
        .into_iter()
        .map(|e| {
            let data: Value = serde_json::from_str(&e.data)
                .unwrap_or_else(|err| panic!("event data is not JSON ({err}): {}", e.data));
            assert_eq!(
                data["type"],
                e.event.as_str(),
                "event name and data type differ"
            );
            (e.event, data)
        })
        .collect()
}

/// The `data:` payloads of an SSE body, in order (`[DONE]` included verbatim).
pub fn data_frames(body: &str) -> Vec<String> {
    events(body).into_iter().map(|e| e.data).collect()
}

/// The JSON objects of an answer body: every chunk of an SSE stream, or the one object of a
/// whole answer.
pub fn response_objects(body: &[u8]) -> Vec<Value> {
    let text = String::from_utf8_lossy(body);
    if text.trim_start().starts_with("data:") {
        data_frames(&text)
            .iter()
            .filter(|d| d.as_str() != "[DONE]")
            .map(|d| {
                serde_json::from_str(d)
                    .unwrap_or_else(|e| panic!("SSE frame is not JSON ({e}): {d}"))
            })
            .collect()
    } else {
        serde_json::from_slice(body)
            .map(|v| vec![v])
            .unwrap_or_default()
    }
}

/// A streamed Chat Completions answer, checked for shape and folded.
#[derive(Debug, Default)]
pub struct ChatStream {
    pub chunks: Vec<Value>,
    /// Concatenated `delta.content`.
    pub content: String,
    pub finish_reason: Option<String>,
    /// `usage` of the usage chunk (choices empty), if one was sent.
    pub usage: Option<Value>,
    /// How many usage chunks were sent.
    pub usage_chunks: usize,
    /// In-stream error objects (`{"error": {...}}` frames).
    pub errors: Vec<Value>,
    /// Whether the stream ended with `data: [DONE]`.
    pub done: bool,
    /// Tool calls folded from the deltas: (id, name, arguments).
    pub tool_calls: Vec<(String, String, String)>,
}

/// Parses a Chat Completions SSE body, asserting the OpenAI chunk shape of every frame:
/// `object: chat.completion.chunk`, one id for all, nothing after `[DONE]`.
pub fn parse_chat_stream(body: &str) -> ChatStream {
    let mut s = ChatStream::default();
    let frames = data_frames(body);
    let mut id: Option<String> = None;
    for (i, f) in frames.iter().enumerate() {
        if f == "[DONE]" {
            assert_eq!(i, frames.len() - 1, "frames after [DONE]: {body}");
            s.done = true;
            continue;
        }
        let v: Value =
            serde_json::from_str(f).unwrap_or_else(|e| panic!("frame {i} is not JSON ({e}): {f}"));
        if v.get("error").is_some() {
            s.errors.push(v);
            continue;
        }
        assert_eq!(v["object"], "chat.completion.chunk", "frame {i}: {v}");
        let this_id = v["id"]
            .as_str()
            .unwrap_or_else(|| panic!("frame {i} without id: {v}"));
        assert!(this_id.starts_with("chatcmpl-"), "frame {i} id: {v}");
        assert_eq!(
            id.get_or_insert_with(|| this_id.to_owned()),
            this_id,
            "ids differ across chunks"
        );
        assert!(
            v["created"].is_u64() && v["model"].is_string(),
            "frame {i}: {v}"
        );
        let choices = v["choices"]
            .as_array()
            .unwrap_or_else(|| panic!("frame {i} without choices: {v}"));
        if choices.is_empty() {
            assert!(
                v["usage"].is_object(),
                "a chunk with no choices must be the usage chunk: {v}"
            );
            s.usage = Some(v["usage"].clone());
            s.usage_chunks += 1;
        } else {
            assert!(
                v.get("usage").is_none_or(Value::is_null),
                "usage on a content chunk: {v}"
            );
        }
        for c in choices {
            assert_eq!(c["index"], 0, "frame {i}: {v}");
            let d = &c["delta"];
            if let Some(t) = d["content"].as_str() {
                s.content.push_str(t);
            }
            for tc in d["tool_calls"].as_array().into_iter().flatten() {
                let idx = tc["index"].as_u64().expect("tool call delta index") as usize;
                while s.tool_calls.len() <= idx {
                    s.tool_calls.push(Default::default());
                }
                let call = &mut s.tool_calls[idx];
                if let Some(x) = tc["id"].as_str() {
                    call.0.push_str(x);
                }
                if let Some(x) = tc["function"]["name"].as_str() {
                    call.1.push_str(x);
                }
                if let Some(x) = tc["function"]["arguments"].as_str() {
                    call.2.push_str(x);
                }
            }
            if let Some(f) = c["finish_reason"].as_str() {
                assert!(s.finish_reason.is_none(), "two finish reasons: {body}");
                s.finish_reason = Some(f.to_owned());
            }
        }
        s.chunks.push(v);
    }
    s
}

/// Asserts the OpenAI error body shape `{"error": {"message", "type", "param", "code"}}` and
/// returns the inner object.
pub fn assert_openai_error(v: &Value) -> &Value {
    let e = &v["error"];
    assert!(e.is_object(), "not an OpenAI error body: {v}");
    let keys: Vec<&String> = e.as_object().unwrap().keys().collect();
    for k in ["message", "type", "param", "code"] {
        assert!(
            e.get(k).is_some(),
            "error body lacks `{k}` (has {keys:?}): {v}"
        );
    }
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "error message must be a non-empty string: {v}"
    );
    assert!(e["type"].is_string(), "error type must be a string: {v}");
    assert!(e["param"].is_null() || e["param"].is_string(), "{v}");
    assert!(e["code"].is_null() || e["code"].is_string(), "{v}");
    e
}
