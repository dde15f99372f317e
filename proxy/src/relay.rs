//! Relays a generation to the harness as the provider's event stream, keeping every event on
//! the call's record.
//!
//! One rule decides whether the harness got its answer: it did once the frames carrying the
//! terminal event (`[DONE]`, `response.completed`, `message_stop`) were written. Clients such
//! as Codex close the connection as soon as they read that event, before the stream's own end
//! marker (the last, empty chunk) is written; that is a complete call, not a disconnect.

use std::future::Future;
use std::time::Instant;

use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use pingora::http::ResponseHeader;
use pingora::protocols::http::ServerSession;
use tokentap_schema::ErrorKind;

use crate::backend::{BackendError, GenerationStream};
use crate::capture::CallCapture;
use tokentap_wire::canonical::GenerationEvent;
use tokentap_wire::{CallError, StreamRenderer};

/// Where a streamed answer is written: the harness's connection (or, in tests, a recorder).
/// Each method says whether the bytes were accepted.
pub trait AnswerSink {
    fn send_head(&mut self, head: ResponseHeader) -> impl Future<Output = bool> + Send;
    fn send_body(&mut self, data: Bytes, end: bool) -> impl Future<Output = bool> + Send;
}

impl AnswerSink for ServerSession {
    async fn send_head(&mut self, head: ResponseHeader) -> bool {
        self.write_response_header(Box::new(head)).await.is_ok()
    }

    async fn send_body(&mut self, data: Bytes, end: bool) -> bool {
        self.write_response_body(data, end).await.is_ok()
    }
}

/// Streams `events` to `sink` through `renderer`, accumulating them on `call`. Returns whether
/// the connection can serve another request.
pub async fn relay_stream(
    sink: &mut impl AnswerSink,
    renderer: Box<dyn StreamRenderer>,
    events: GenerationStream,
    call: &mut CallCapture,
) -> bool {
    relay(sink, renderer, events, call, false).await.0
}

/// Like [`relay_stream`], but the frames from the terminal event on are held back and
/// returned, with the generation drained onto `call`, for the caller to write (`end` set) once
/// the call's record is durable: the harness cannot have its answer before its record exists.
/// `None` when the stream ended without a terminal event (an error, a harness gone), which the
/// caller records as usual.
pub async fn relay_stream_holding_end(
    sink: &mut impl AnswerSink,
    renderer: Box<dyn StreamRenderer>,
    events: GenerationStream,
    call: &mut CallCapture,
) -> (bool, Option<Bytes>) {
    relay(sink, renderer, events, call, true).await
}

/// Past this many rendered bytes a write goes out even while the engine has more ready.
const MAX_UNWRITTEN: usize = 64 * 1024;

async fn relay(
    sink: &mut impl AnswerSink,
    mut renderer: Box<dyn StreamRenderer>,
    mut events: GenerationStream,
    call: &mut CallCapture,
    hold_end: bool,
) -> (bool, Option<Bytes>) {
    let mut head = ResponseHeader::build(200, Some(4)).expect("valid status");
    let _ = head.insert_header("content-type", "text/event-stream");
    let _ = head.insert_header("cache-control", "no-cache");
    let _ = head.insert_header("transfer-encoding", "chunked");
    call.response_status = 200;
    let mut out = Vec::with_capacity(512);
    renderer.start(&mut out);
    if !sink.send_head(head).await {
        return (client_gone(call), None);
    }
    let mut relayed = Relayed {
        hold_end,
        ..Relayed::default()
    };
    loop {
        // Events the engine has already sent are rendered together and written at once (each
        // write of a chunked body is flushed: a syscall per event otherwise). Nothing waits on
        // them: before waiting for the engine, what is rendered is written.
        let next = match ready_event(&mut events, call) {
            Some(next) => next,
            None => {
                if !relayed.holding()
                    && !out.is_empty()
                    && !relayed.write(sink, &mut out, &mut events, call).await
                {
                    return (false, None);
                }
                next_event(&mut events, call).await
            }
        };
        let Some(event) = next else { break };
        match event {
            Ok(event) => {
                match &event {
                    GenerationEvent::Delta(d) if !d.is_empty() => {
                        renderer.delta(d, &mut out);
                        call.first_content_at.get_or_insert_with(Instant::now);
                    }
                    GenerationEvent::Finished {
                        finish_reason,
                        usage,
                    } => {
                        // What precedes the terminal event goes now; the rest is held.
                        if hold_end
                            && !out.is_empty()
                            && !relayed.write(sink, &mut out, &mut events, call).await
                        {
                            return (false, None);
                        }
                        renderer.finish(*finish_reason, *usage, &mut out);
                        relayed.rendered_end = true;
                    }
                    GenerationEvent::PromptTokens { ids, .. } => {
                        renderer.prompt_tokens(ids.len() as u64);
                    }
                    GenerationEvent::PromptSize(n) => renderer.prompt_tokens(*n),
                    _ => {}
                }
                call.generation.push(event);
            }
            Err(e) => {
                let err = CallError::from(&e);
                if !relayed.rendered_end {
                    renderer.error(&err, &mut out);
                }
                call.error = Some(err);
                break;
            }
        }
        if !relayed.holding()
            && out.len() >= MAX_UNWRITTEN
            && !relayed.write(sink, &mut out, &mut events, call).await
        {
            return (false, None);
        }
    }
    // An engine error ends the stream with the API's error event, and the response is as
    // complete as any: the connection stays usable. Closing it unannounced (the head went out
    // long ago, without `connection: close`) raced the harness's next request on it.
    if relayed.holding() {
        return (true, Some(Bytes::from(out)));
    }
    // The terminal event's frames go in a write of their own, before the stream's end marker:
    // a harness that closes once it has read them (Codex) had a complete call.
    if !out.is_empty() && !relayed.write(sink, &mut out, &mut events, call).await {
        return (false, None);
    }
    if !sink.send_body(Bytes::new(), true).await {
        if relayed.delivered {
            tracing::debug!("the harness closed the connection after the terminal event");
        } else if call.error.is_none() {
            client_gone(call);
        } // else: the engine's error stays the record's error
        return (false, None);
    }
    (true, None)
}

/// How far a streamed answer has got to the harness.
#[derive(Default)]
struct Relayed {
    /// The terminal event's frames are rendered (written or not).
    rendered_end: bool,
    /// The terminal event's frames were written: from then on the harness has its answer,
    /// whatever happens to the connection.
    delivered: bool,
    /// The terminal event's frames are to be held back for the caller.
    hold_end: bool,
}

impl Relayed {
    /// Whether the terminal event's frames (and what follows them) are being held back.
    fn holding(&self) -> bool {
        self.hold_end && self.rendered_end
    }

    /// Writes what is rendered; `false` when the harness is gone. Then the record says so
    /// (unless the harness had its answer, or the engine's error is the record's error), and
    /// keeps what the engine sends after an answer rendered whole (the prompt ids).
    async fn write(
        &mut self,
        sink: &mut impl AnswerSink,
        out: &mut Vec<u8>,
        events: &mut GenerationStream,
        call: &mut CallCapture,
    ) -> bool {
        if sink
            .send_body(Bytes::from(std::mem::take(out)), false)
            .await
        {
            self.delivered |= self.rendered_end;
            return true;
        }
        if self.rendered_end {
            drain_into(events, call).await;
        }
        if !self.delivered && call.error.is_none() {
            client_gone(call);
        }
        false
    }
}

/// The generation's next event if the engine has already sent it, without waiting.
fn ready_event(
    events: &mut GenerationStream,
    call: &mut CallCapture,
) -> Option<Option<Result<GenerationEvent, BackendError>>> {
    let t = Instant::now();
    let next = events.next().now_or_never();
    call.backend_time += t.elapsed();
    next
}

/// The next event of a generation, counting the wait as the engine's time.
async fn next_event(
    events: &mut GenerationStream,
    call: &mut CallCapture,
) -> Option<Result<GenerationEvent, BackendError>> {
    let t = Instant::now();
    let next = events.next().await;
    call.backend_time += t.elapsed();
    next
}

/// The whole generation, up to and including its first error.
pub async fn collect_events(
    events: &mut GenerationStream,
    call: &mut CallCapture,
) -> Vec<Result<GenerationEvent, BackendError>> {
    let mut all = Vec::new();
    while let Some(e) = next_event(events, call).await {
        let failed = e.is_err();
        all.push(e);
        if failed {
            break;
        }
    }
    all
}

/// Accumulates what is left of `events` on the record, without answering anyone.
async fn drain_into(events: &mut GenerationStream, call: &mut CallCapture) {
    for event in collect_events(events, call).await.into_iter().flatten() {
        call.generation.push(event);
    }
}

/// Notes on the record that the harness went away before its answer was complete.
pub fn client_gone(call: &mut CallCapture) -> bool {
    call.error = Some(CallError::new(
        ErrorKind::ClientDisconnected,
        499,
        "the harness closed the connection before the answer was complete; generation was cancelled",
    ));
    false
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokentap_schema::{
        BackendInfo, BackendKind, FinishReason, HarnessRequest, TokenSource, WireApi,
    };

    use super::*;
    use tokentap_wire::canonical::Delta;
    use tokentap_wire::chat_completions::ChatCompletions;
    use tokentap_wire::{ResponseMeta, WireCodec};

    /// Records what reaches the harness; refuses the writes `refuse` names, as a closed
    /// connection would.
    struct Harness {
        written: Vec<u8>,
        /// Each accepted write's bytes, in order (the empty end of the stream left out).
        writes: Vec<String>,
        refuse: fn(&[u8], bool) -> bool,
        refused: bool,
    }

    impl Harness {
        fn new(refuse: fn(&[u8], bool) -> bool) -> Harness {
            Harness {
                written: Vec::new(),
                writes: Vec::new(),
                refuse,
                refused: false,
            }
        }

        fn text(&self) -> String {
            String::from_utf8_lossy(&self.written).into_owned()
        }
    }

    impl AnswerSink for Harness {
        async fn send_head(&mut self, _head: ResponseHeader) -> bool {
            true
        }

        async fn send_body(&mut self, data: Bytes, end: bool) -> bool {
            // Once closed, a connection stays closed.
            if self.refused || (self.refuse)(&data, end) {
                self.refused = true;
                return false;
            }
            self.written.extend_from_slice(&data);
            if !data.is_empty() {
                self.writes
                    .push(String::from_utf8_lossy(&data).into_owned());
            }
            true
        }
    }

    fn call() -> CallCapture {
        let request = HarnessRequest::bare("POST", "/v1/chat/completions");
        let backend = BackendInfo {
            kind: BackendKind::Vllm,
            url: "http://127.0.0.1:9".into(),
            model: "m".into(),
            policy_version: None,
            engine_weight_version: None,
            synthetic_stream: false,
        };
        CallCapture::new(WireApi::ChatCompletions, request, backend)
    }

    fn renderer() -> Box<dyn StreamRenderer> {
        let meta = ResponseMeta::new("chatcmpl-1", 1, "m");
        ChatCompletions.stream_renderer(meta, false)
    }

    /// "hi" as two sampled tokens, the end of generation, then (a moment later, as llama.cpp's
    /// template ids do) the prompt ids.
    fn answer() -> GenerationStream {
        let text = |t: &str| {
            Ok(GenerationEvent::Delta(Delta {
                content: Some(t.into()),
                ..Default::default()
            }))
        };
        let tokens = |id| {
            Ok(GenerationEvent::SampledTokens {
                ids: vec![id],
                logprobs: vec![Some(-0.5)],
            })
        };
        let head = futures::stream::iter(vec![
            text("h"),
            tokens(71),
            text("i"),
            tokens(72),
            Ok(GenerationEvent::Finished {
                finish_reason: FinishReason::Stop,
                usage: None,
            }),
        ]);
        let late_prompt = futures::stream::once(async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(GenerationEvent::PromptTokens {
                ids: vec![1, 2, 3],
                source: TokenSource::EngineTemplate,
            })
        });
        Box::pin(head.chain(late_prompt))
    }

    /// "h", then the engine fails.
    fn text_then_engine_failure() -> GenerationStream {
        Box::pin(futures::stream::iter(vec![
            Ok(GenerationEvent::Delta(Delta {
                content: Some("h".into()),
                ..Default::default()
            })),
            Err(BackendError::Protocol("engine went away".into())),
        ]))
    }

    fn the_end(_: &[u8], end: bool) -> bool {
        end
    }

    fn the_terminal_event(data: &[u8], _: bool) -> bool {
        String::from_utf8_lossy(data).contains("[DONE]")
    }

    /// Events the engine sent together go to the harness in one write; an event still to
    /// come never holds back what is already rendered.
    #[tokio::test]
    async fn events_that_arrived_together_are_written_together() {
        let mut harness = Harness::new(|_, _| false);
        let mut call = call();
        assert!(relay_stream(&mut harness, renderer(), answer(), &mut call).await);
        // "h", "i" and the finish were ready at once; the prompt ids came 20 ms later.
        let first = harness
            .writes
            .iter()
            .position(|w| w.contains("\"h\""))
            .expect("h written");
        let write = &harness.writes[first];
        assert!(
            write.contains("\"i\"") && write.contains("[DONE]"),
            "{write}"
        );
        assert_eq!(harness.writes.len(), first + 1, "{:?}", harness.writes);
        assert_eq!(call.into_record().prompt_token_ids, Some(vec![1, 2, 3]));
    }

    #[tokio::test]
    async fn rendered_events_are_written_before_waiting_for_the_next() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;

        /// Sets `seen` once a write with "h" reaches the harness.
        struct Watching {
            inner: Harness,
            seen: Arc<AtomicBool>,
        }
        impl AnswerSink for Watching {
            async fn send_head(&mut self, head: ResponseHeader) -> bool {
                self.inner.send_head(head).await
            }
            async fn send_body(&mut self, data: Bytes, end: bool) -> bool {
                if String::from_utf8_lossy(&data).contains("\"h\"") {
                    self.seen.store(true, Ordering::SeqCst);
                }
                self.inner.send_body(data, end).await
            }
        }

        let seen = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&seen);
        // The engine sends its next event only once the harness has the first: a relay that
        // waited for more before writing would wait forever.
        let events: GenerationStream = Box::pin(
            futures::stream::iter(vec![Ok(GenerationEvent::Delta(Delta {
                content: Some("h".into()),
                ..Default::default()
            }))])
            .chain(futures::stream::once(async move {
                while !flag.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Ok(GenerationEvent::Finished {
                    finish_reason: FinishReason::Stop,
                    usage: None,
                })
            })),
        );
        let mut harness = Watching {
            inner: Harness::new(|_, _| false),
            seen,
        };
        let mut call = call();
        let relayed = tokio::time::timeout(
            Duration::from_secs(5),
            relay_stream(&mut harness, renderer(), events, &mut call),
        )
        .await
        .expect("the first event was written without waiting for the second");
        assert!(relayed);
        assert!(harness.inner.text().ends_with("data: [DONE]\n\n"));
    }

    #[tokio::test]
    async fn a_harness_that_reads_everything_gets_a_complete_stream() {
        let mut harness = Harness::new(|_, _| false);
        let mut call = call();
        assert!(relay_stream(&mut harness, renderer(), answer(), &mut call).await);
        assert!(call.error.is_none(), "{:?}", call.error);
        assert!(
            harness.text().ends_with("data: [DONE]\n\n"),
            "{}",
            harness.text()
        );
        let record = call.into_record();
        assert_eq!(record.completion_token_ids, Some(vec![71, 72]));
        assert_eq!(record.prompt_token_ids, Some(vec![1, 2, 3]));
    }

    /// Durable answers: everything up to the terminal event reaches the harness, the rest is
    /// handed back for after the record is written, with the generation (prompt ids after the
    /// answer included) already on the call.
    #[tokio::test]
    async fn holding_the_end_keeps_the_terminal_event_back_until_the_record_is_written() {
        let mut harness = Harness::new(|_, _| false);
        let mut call = call();
        let (reusable, end) =
            relay_stream_holding_end(&mut harness, renderer(), answer(), &mut call).await;
        assert!(reusable);
        let end = String::from_utf8(end.expect("the end is held").to_vec()).unwrap();
        assert!(!harness.text().contains("[DONE]"), "{}", harness.text());
        assert!(
            !harness.text().contains("finish_reason\":\"stop"),
            "{}",
            harness.text()
        );
        assert!(end.ends_with("data: [DONE]\n\n"), "{end}");
        let record = call.take_record();
        assert!(call.committed);
        assert_eq!(record.completion_token_ids, Some(vec![71, 72]));
        assert_eq!(record.prompt_token_ids, Some(vec![1, 2, 3]), "drained");
        assert!(record.error.is_none());
    }

    /// Codex closes the connection as soon as it reads `response.completed`, so the stream's
    /// last (empty) chunk may find the connection gone. The harness had its whole answer.
    #[tokio::test]
    async fn a_harness_that_closes_after_the_terminal_event_had_a_complete_call() {
        let mut harness = Harness::new(the_end);
        let mut call = call();
        let reusable = relay_stream(&mut harness, renderer(), answer(), &mut call).await;
        assert!(!reusable, "the connection is gone");
        assert!(
            harness.text().ends_with("data: [DONE]\n\n"),
            "{}",
            harness.text()
        );
        assert!(call.error.is_none(), "not a disconnect: {:?}", call.error);
        let record = call.into_record();
        assert_eq!(record.response_status, 200);
        assert_eq!(
            record.prompt_token_ids,
            Some(vec![1, 2, 3]),
            "bookkeeping kept"
        );
    }

    #[tokio::test]
    async fn a_harness_that_closes_before_the_terminal_event_is_a_disconnect() {
        let mut harness = Harness::new(the_terminal_event);
        let mut call = call();
        assert!(!relay_stream(&mut harness, renderer(), answer(), &mut call).await);
        assert!(!harness.text().contains("[DONE]"));
        let err = call.error.as_ref().expect("an error");
        assert_eq!(err.kind, ErrorKind::ClientDisconnected);
        let record = call.into_record();
        assert_eq!(record.completion_token_ids, Some(vec![71, 72]));
        assert_eq!(
            record.prompt_token_ids,
            Some(vec![1, 2, 3]),
            "what the engine sent after the answer is still recorded"
        );
    }

    /// The engine fails and the harness is gone before its error frame is written: the
    /// engine's failure is the record's error, not a disconnect.
    #[tokio::test]
    async fn an_engine_failure_stays_the_error_when_its_error_frame_finds_the_harness_gone() {
        let events = text_then_engine_failure();
        let mut harness = Harness::new(|data, _| String::from_utf8_lossy(data).contains("error"));
        let mut call = call();
        assert!(!relay_stream(&mut harness, renderer(), events, &mut call).await);
        assert!(harness.refused, "the error frame was refused");
        let err = call.error.as_ref().expect("an error");
        assert_eq!(err.kind, ErrorKind::BackendError, "{err:?}");
    }

    #[tokio::test]
    async fn an_engine_failure_stays_the_error_when_the_harness_is_also_gone() {
        let events = text_then_engine_failure();
        let mut harness = Harness::new(the_end);
        let mut call = call();
        assert!(!relay_stream(&mut harness, renderer(), events, &mut call).await);
        let err = call.error.as_ref().expect("an error");
        assert_eq!(err.kind, ErrorKind::BackendError, "{err:?}");
    }

    /// The engine's prompt size reaches the renderer before its first content: Anthropic's
    /// `message_start` opens with it, from the prompt ids (vLLM, SGLang) or the prompt progress
    /// (llama.cpp).
    #[tokio::test]
    async fn message_start_carries_the_prompt_size_the_engine_told_first() {
        use tokentap_wire::messages::Messages;
        for told in [
            GenerationEvent::PromptTokens {
                ids: vec![5, 6, 7],
                source: TokenSource::EngineResponse,
            },
            GenerationEvent::PromptSize(3),
        ] {
            let mut harness = Harness::new(|_, _| false);
            let mut call = call();
            let renderer = Messages.stream_renderer(ResponseMeta::new("msg_1", 1, "m"), true);
            let events: GenerationStream = Box::pin(futures::stream::iter(vec![
                Ok(told),
                Ok(GenerationEvent::Delta(Delta {
                    content: Some("hi".into()),
                    ..Default::default()
                })),
                Ok(GenerationEvent::Finished {
                    finish_reason: FinishReason::Stop,
                    usage: None,
                }),
            ]));
            assert!(relay_stream(&mut harness, renderer, events, &mut call).await);
            let text = harness.text();
            let start = text
                .lines()
                .find(|l| l.starts_with("data: ") && l.contains("message_start"))
                .expect("message_start");
            let v: serde_json::Value = serde_json::from_str(&start[6..]).unwrap();
            assert_eq!(v["message"]["usage"]["input_tokens"], 3, "{text}");
            assert!(text.starts_with("event: message_start"), "{text}");
        }
    }
}
