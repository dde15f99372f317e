//! Helpers shared by the fuzz targets: how a fuzz input picks chunk boundaries, and the
//! invariants every engine answer decoder keeps.

use std::sync::OnceLock;

use futures::StreamExt;
use tokentap_proxy::backend::{decode, BackendKind};
use tokentap_proxy::canonical::GenerationEvent;

/// Splits a fuzz input into chunk boundaries and a body: the low 3 bits of `data[0]` say how
/// many cuts, the following bytes place them (scaled to the body's length). The rest of byte 0
/// is left to the target.
pub fn cuts(data: &[u8]) -> (u8, Vec<usize>, &[u8]) {
    let Some((&head, rest)) = data.split_first() else {
        return (0, Vec::new(), data);
    };
    let n = ((head & 7) as usize).min(rest.len());
    let (places, body) = rest.split_at(n);
    let mut cuts: Vec<usize> = places
        .iter()
        .map(|&p| p as usize * (body.len() + 1) / 256)
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    (head >> 3, cuts, body)
}

/// `body` cut at `cuts` (sorted offsets within it).
pub fn chunks(body: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut start = 0;
    for &c in cuts {
        if c > start && c < body.len() {
            out.push(body[start..c].to_vec());
            start = c;
        }
    }
    out.push(body[start..].to_vec());
    out
}

/// Runs of ASCII digits in `bytes`: every token id a decoder yields is spelled by one.
pub fn digit_runs(bytes: &[u8]) -> usize {
    let mut runs = 0;
    let mut in_run = false;
    for b in bytes {
        let d = b.is_ascii_digit();
        if d && !in_run {
            runs += 1;
        }
        in_run = d;
    }
    runs
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a current-thread runtime")
    })
}

/// What decoding a streamed body gives: its events, then the error that ended it (if any).
pub type Decoded = (Vec<GenerationEvent>, Option<String>);

/// Decodes a streamed answer arriving in `chunks`.
pub fn decode_stream(kind: BackendKind, chunks: Vec<Vec<u8>>) -> Decoded {
    runtime().block_on(async {
        let mut stream = decode::stream(kind, chunks);
        let mut events = Vec::new();
        while let Some(item) = stream.next().await {
            match item {
                Ok(e) => events.push(e),
                Err(e) => return (events, Some(e.to_string())),
            }
        }
        (events, None)
    })
}

/// The invariants of a decoded answer (whole or streamed) from `input`:
/// - each batch of sampled ids comes with exactly one logprob slot per id;
/// - no more ids come out than digit runs went in (no id is invented or yielded twice);
/// - prompt ids at most once; `Finished` exactly once when the decode succeeded, at most
///   once otherwise; after it only gaps.
pub fn check_events(events: &[GenerationEvent], ended_ok: bool, input: &[u8]) {
    let mut ids = 0usize;
    let mut prompts = 0;
    let mut finished = 0;
    for e in events {
        match e {
            GenerationEvent::SampledTokens { ids: s, logprobs } => {
                assert_eq!(s.len(), logprobs.len(), "one logprob slot per sampled id");
                assert_eq!(finished, 0, "sampled ids after Finished");
                ids += s.len();
            }
            GenerationEvent::PromptTokens { ids: p, .. } => {
                prompts += 1;
                assert_eq!(finished, 0, "prompt ids after Finished");
                ids += p.len();
            }
            GenerationEvent::Delta(_) => assert_eq!(finished, 0, "a delta after Finished"),
            GenerationEvent::PromptSize(_) => {
                assert_eq!(finished, 0, "a prompt size after Finished")
            }
            GenerationEvent::Gap(_) => {}
            GenerationEvent::TokenIn(_) => assert_eq!(finished, 0, "token_in after Finished"),
            GenerationEvent::Finished { .. } => finished += 1,
            // Only the `--engine-weight-version` decorator adds it, after the engine's answer;
            // a decoder that made one would be inventing engine state.
            GenerationEvent::EngineWeightVersion(_) => {
                panic!("a decoder yielded an engine weight version")
            }
        }
    }
    assert!(prompts <= 1, "prompt ids {prompts} times");
    assert!(finished <= 1, "Finished {finished} times");
    if ended_ok {
        assert_eq!(finished, 1, "a decode that succeeded ends with Finished");
    }
    let digits = digit_runs(input);
    assert!(ids <= digits, "{ids} ids out of {digits} digit runs");
}

/// One engine target: bit 3 of byte 0 picks a whole answer (JSON) or a stream (SSE); a stream
/// is decoded whole, cut where the input says, and (when short) byte by byte, and all three
/// must agree. Either way the body, read as one answer, decodes the same through the fast lane
/// as through serde_json alone.
pub fn engine(kind: BackendKind, data: &[u8]) {
    let (flags, cuts, body) = cuts(data);
    // The fast lane reads exactly what serde_json reads (proxy/src/backend/json_lane.rs).
    assert!(decode::lane_agrees(body), "the fast lane and serde_json disagree");
    if flags & 1 == 0 {
        match decode::whole(kind, body) {
            Ok(events) => check_events(&events, true, body),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
        return;
    }
    let one = decode_stream(kind, vec![body.to_vec()]);
    check_events(&one.0, one.1.is_none(), body);
    let split = decode_stream(kind, chunks(body, &cuts));
    assert_eq!(
        format!("{one:?}"),
        format!("{split:?}"),
        "the same SSE bytes whole and cut at {cuts:?}"
    );
    if body.len() <= 1024 {
        let bytes = decode_stream(kind, body.iter().map(|&b| vec![b]).collect());
        assert_eq!(
            format!("{one:?}"),
            format!("{bytes:?}"),
            "the same SSE bytes whole and byte by byte"
        );
    }
}

/// The invariant of the record's copy of any request body: the byte pass that lets a body be
/// kept as it is never clears one the scan would redact (proxy/src/redact.rs).
pub fn recorded_body(body: &[u8]) {
    assert!(
        tokentap_proxy::redact::byte_pass_is_sound(body),
        "the byte pass cleared a body with something to redact"
    );
}

/// The invariants of a wire API's request parser on any body:
/// - a refusal renders as the API's own 400 error, valid JSON;
/// - an accepted request is a canonical request that serializes (it is recorded) and reads
///   back equal, and the engine request the proxy builds from it (`chat_body`) is itself a
///   Chat Completions request that parses to the same conversation.
pub fn wire_request(
    codec: &dyn tokentap_proxy::wire::WireCodec,
    parsed: Result<tokentap_proxy::wire::ParsedCall, tokentap_proxy::wire::WireError>,
) {
    use tokentap_proxy::backend::{chat_body, CallMode};
    use tokentap_proxy::canonical::ChatRequest;
    use tokentap_proxy::wire::chat_completions::ChatCompletions;
    use tokentap_proxy::wire::{CallError, WireCodec};

    let call = match parsed {
        Ok(call) => call,
        Err(e) => {
            let (status, body) = codec.render_error(&CallError::from(e));
            assert_eq!(status, 400);
            serde_json::from_slice::<serde_json::Value>(&body).expect("an error body is JSON");
            return;
        }
    };
    let request = &call.request;
    let recorded = serde_json::to_vec(request).expect("a canonical request serializes");
    let back: ChatRequest = serde_json::from_slice(&recorded).expect("and reads back");
    assert_eq!(&back, request, "the recorded request reads back as parsed");

    let mode = if request.stream {
        CallMode::Streaming
    } else {
        CallMode::Whole
    };
    let engine_body = chat_body(request, mode);
    let again = match ChatCompletions.parse(&engine_body) {
        Ok(c) => c.request,
        Err(e) => panic!(
            "the engine request does not parse as Chat Completions: {e}\n{}",
            String::from_utf8_lossy(&engine_body)
        ),
    };
    assert_eq!(again.model, request.model);
    assert_eq!(again.messages, request.messages);
    assert_eq!(again.tools, request.tools);
    assert_eq!(again.tool_choice, request.tool_choice);
    assert_eq!(again.sampling, request.sampling);
}
