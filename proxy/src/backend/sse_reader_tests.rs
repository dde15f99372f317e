//! The streamed answer's SSE reader (sse-stream) against the one it replaced
//! (eventsource-stream): for event streams written every way the SSE grammar allows (LF,
//! CRLF and CR line ends, comments, `event:`/`id:`/`retry:` fields, data split over several
//! lines, a byte-order mark, no space after the colon, an unfinished last event, bytes that
//! are not UTF-8), cut into chunks at any points, both give the same event data in the same
//! order, or both fail; with bytes that are not UTF-8 outside any data value, the new reader
//! skips their line where the old one failed the stream. Where the old reader was wrong (a leading byte-order mark made it
//! panic; a CR at the very end did not end its line) it is given the stream as meant.

use futures::executor::block_on;
use futures::StreamExt;
use proptest::prelude::*;

/// The `data` of each event that is not blank (the answer reader skips blank ones), or `None`
/// if the reader failed.
type Datas = Option<Vec<String>>;

fn chunks_of(body: &[u8], cuts: &[usize]) -> Vec<Result<bytes::Bytes, std::io::Error>> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (body.len() + 1)).collect();
    points.extend([0, body.len()]);
    points.sort_unstable();
    points.dedup();
    points
        .windows(2)
        .map(|w| Ok(bytes::Bytes::copy_from_slice(&body[w[0]..w[1]])))
        .collect()
}

fn by_sse_stream(chunks: Vec<Result<bytes::Bytes, std::io::Error>>) -> Datas {
    block_on(async {
        let mut events = std::pin::pin!(sse_stream::SseByteStream::new(futures::stream::iter(
            chunks
        )));
        let mut out = Vec::new();
        while let Some(e) = events.next().await {
            let data = e.ok()?.data.unwrap_or_default();
            if !data.trim().is_empty() {
                out.push(data);
            }
        }
        Some(out)
    })
}

fn by_eventsource_stream(chunks: Vec<Result<bytes::Bytes, std::io::Error>>) -> Datas {
    use eventsource_stream::Eventsource;
    block_on(async {
        let mut events = std::pin::pin!(futures::stream::iter(chunks).eventsource());
        let mut out = Vec::new();
        while let Some(e) = events.next().await {
            let data = e.ok()?.data;
            if !data.trim().is_empty() {
                out.push(data);
            }
        }
        Some(out)
    })
}

fn line_end() -> impl Strategy<Value = &'static str> {
    prop_oneof![6 => Just("\n"), 2 => Just("\r\n"), 1 => Just("\r")]
}

/// One field line (without its end).
fn field() -> impl Strategy<Value = String> {
    let text = "[ -~]{0,40}";
    prop_oneof![
        8 => text.prop_map(|t| format!("data: {t}")),
        2 => text.prop_map(|t| format!("data:{t}")),
        1 => Just("data:".to_owned()),
        1 => Just("data: {\"choices\": [{\"delta\": {\"content\": \"é ✓ 😀\"}}]}".to_owned()),
        1 => Just(": ping".to_owned()),
        1 => Just("event: message".to_owned()),
        1 => Just("id: 7".to_owned()),
        1 => Just("retry: 100".to_owned()),
        1 => Just("unknown field".to_owned()),
        1 => Just("data: [DONE]".to_owned()),
    ]
}

/// An event: field lines, then (usually) the empty line that ends it.
fn event() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec((field(), line_end()), 1..4),
        line_end(),
        prop::bool::weighted(0.95),
    )
        .prop_map(|(fields, end, finished)| {
            let mut out = String::new();
            for (f, e) in fields {
                out.push_str(&f);
                out.push_str(e);
            }
            if finished {
                out.push_str(end);
            }
            out.into_bytes()
        })
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::bool::weighted(0.1),
        prop::collection::vec(event(), 0..8),
        prop::option::weighted(0.05, (any::<prop::sample::Index>(), 0x80u8..=0xff)),
    )
        .prop_map(|(bom, events, bad_byte)| {
            let mut out = Vec::new();
            if bom {
                out.extend_from_slice(b"\xEF\xBB\xBF");
            }
            for e in events {
                out.extend(e);
            }
            if let Some((at, byte)) = bad_byte {
                if !out.is_empty() {
                    let i = at.index(out.len());
                    out[i] = byte;
                }
            }
            out
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3_000))]

    #[test]
    fn the_sse_reader_reads_every_stream_as_the_one_it_replaced(
        body in body(),
        cuts in prop::collection::vec(any::<usize>(), 0..6),
    ) {
        // A CR at the very end is a line end (the SSE grammar); eventsource-stream waits for
        // an LF that might follow it, so it never ends the last event. The same line written
        // CRLF is what it reads as meant.
        // A leading byte-order mark means nothing, and eventsource-stream panics on it (it
        // slices the 3-byte mark at byte 1): it is given the stream without it.
        let mut meant = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&body).to_vec();
        if meant.last() == Some(&b'\r') {
            meant.push(b'\n');
        }
        let new = by_sse_stream(chunks_of(&body, &cuts));
        if std::str::from_utf8(&body).is_ok() {
            let old = by_eventsource_stream(chunks_of(&meant, &[]));
            prop_assert_eq!(new, old, "body {:?}", String::from_utf8_lossy(&body));
        } else if let Some(new) = new {
            // Bytes that are not UTF-8 failed the old reader's whole stream; the new one
            // fails only when they are in a data value (where the answer reader needs text),
            // and otherwise skips their line, as the grammar reads it once decoded with
            // replacement characters: what the old reader reads from that decoding.
            let decoded = String::from_utf8_lossy(&meant).into_owned().into_bytes();
            let old = by_eventsource_stream(chunks_of(&decoded, &[]));
            prop_assert_eq!(Some(new), old, "body {:?}", String::from_utf8_lossy(&body));
        }
    }
}

/// The test above is not vacuous: most generated streams hold several events' data.
#[test]
fn generated_streams_carry_events() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut with_data = 0;
    for _ in 0..200 {
        let body = body().new_tree(&mut runner).unwrap().current();
        if by_sse_stream(chunks_of(&body, &[])).is_some_and(|d| d.len() >= 2) {
            with_data += 1;
        }
    }
    assert!(with_data > 100, "{with_data} of 200");
}

/// A stream that starts with a byte-order mark is read like one without it. eventsource-stream
/// panicked on it (slicing the 3-byte mark at byte 1), killing the call's task.
#[tokio::test]
async fn a_stream_led_by_a_byte_order_mark_is_read() {
    use crate::backend::decode;
    use tokentap_schema::BackendKind;
    let body = b"\xEF\xBB\xBFdata: {\"choices\": [{\"delta\": {\"content\": \"hi\"}, \"finish_reason\": \"stop\"}]}\n\ndata: [DONE]\n\n";
    let events: Vec<_> = decode::stream(BackendKind::Llamacpp, vec![body.to_vec()])
        .collect()
        .await;
    assert!(events.iter().all(Result::is_ok), "{events:?}");
    assert!(
        events.iter().any(|e| matches!(
            e,
            Ok(tokentap_wire::canonical::GenerationEvent::Finished { .. })
        )),
        "{events:?}"
    );
}
