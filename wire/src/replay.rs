//! A record's backend request, whole again.
//!
//! Since capture schema 2 a record whose harness body is kept byte for byte does not store the
//! conversation a second time: its `backend_request` carries the model, sampling, tool choice
//! and passthrough fields as sent, and `messages`/`tools` are the harness body parsed again by
//! the same wire codec, with the system messages folded when the record lists
//! `single_system_message`. That is exactly what the proxy sent, because parsing is a pure
//! function of the body, and nothing after it changes the conversation but that fold (the
//! admission gate may change sampling only: the proxy's `gate::CallGate`).

use std::borrow::Cow;

use tokentap_schema::{
    CaptureRecord, ChatMessage, ChatRequest, ConversationSource, Normalization, RawJson, ToolSpec,
    WireApi,
};

use crate::chat_completions::ChatCompletions;
use crate::messages::Messages;
use crate::normalize::{fold_system_messages, SINGLE_SYSTEM_MESSAGE};
use crate::responses::Responses;
use crate::WireCodec;

/// The codec of a wire API (none for `unparsed`).
pub fn codec(api: WireApi) -> Option<&'static dyn WireCodec> {
    static CHAT: ChatCompletions = ChatCompletions;
    static RESPONSES: Responses = Responses;
    static MESSAGES: Messages = Messages;
    match api {
        WireApi::ChatCompletions => Some(&CHAT),
        WireApi::Responses => Some(&RESPONSES),
        WireApi::Messages => Some(&MESSAGES),
        WireApi::Unparsed => None,
    }
}

/// The backend request of `record` as the engine got it; `None` when the call never got one.
/// Borrowed when the record holds it whole (every version 1 record).
pub fn backend_request(record: &CaptureRecord) -> Result<Option<Cow<'_, ChatRequest>>, String> {
    let Some(recorded) = &record.backend_request else {
        return Ok(None);
    };
    if record.backend_conversation == ConversationSource::Recorded {
        return Ok(Some(Cow::Borrowed(recorded)));
    }
    let body = record.request.body.as_ref().ok_or_else(|| {
        format!(
            "record {}: the conversation is the harness body's, and the record has none",
            record.record_id
        )
    })?;
    let (messages, tools) = conversation(record.wire_api, body, &record.normalizations)
        .map_err(|e| format!("record {}: {e}", record.record_id))?;
    let mut whole = recorded.clone();
    whole.messages = messages;
    whole.tools = tools;
    Ok(Some(Cow::Owned(whole)))
}

/// The messages and tools the engine got for a harness `body` of `api`, given the call's
/// normalizations.
pub fn conversation(
    api: WireApi,
    body: &RawJson,
    normalizations: &[Normalization],
) -> Result<(Vec<ChatMessage>, Vec<ToolSpec>), String> {
    let codec = codec(api).ok_or("no wire API to parse the harness body with")?;
    let mut request = codec
        .parse(body.get().as_bytes())
        .map_err(|e| format!("the harness body does not parse: {e}"))?
        .request;
    if normalizations
        .iter()
        .any(|n| n.kind == SINGLE_SYSTEM_MESSAGE)
    {
        fold_system_messages(&mut request);
    }
    Ok((request.messages, request.tools))
}
