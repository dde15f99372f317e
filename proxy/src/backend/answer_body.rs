//! An engine answer's body as it arrives, whichever HTTP client read it, and the most of it the
//! proxy reads.
//!
//! The idle timeout bounds the wait for each chunk, not how many chunks come: an engine that
//! streams one endless SSE line, or a whole answer that never ends, would otherwise grow the
//! proxy's memory (the SSE reader holds an event until its blank line) for as long as it
//! keeps sending. Every chat answer, streamed or whole, from Pingora's client or reqwest, is
//! read through [`limited`]; past its limit the call ends as a protocol error, with what was
//! already relayed and recorded kept.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};

use super::error::{error_chain, BackendError};

/// An answer's body, as it arrives. A read that timed out has [`io::ErrorKind::TimedOut`].
pub(crate) type AnswerBody = BoxStream<'static, Result<Bytes, io::Error>>;

/// The default for [`super::BackendConfig::max_answer_bytes`]: far past any context's prompt
/// ids (a 1M-token prompt's are about 8 MB) and a long streamed answer's events (a 100k-token
/// answer with logprobs is about 40 MB), short of what a runaway engine could make the proxy
/// hold.
pub const DEFAULT_MAX_ANSWER_BYTES: usize = 256 << 20;

/// The most of an error answer read, for its message.
pub(crate) const MAX_ERROR_BODY: usize = tokentap_service_kit::capped_body::MAX_BODY_READ;

/// A reqwest answer's body as an [`AnswerBody`] (its read timeout keeps its kind).
pub(crate) fn from_reqwest(answer: reqwest::Response) -> AnswerBody {
    Box::pin(answer.bytes_stream().map(|chunk| {
        chunk.map_err(|e| {
            let kind = if e.is_timeout() {
                io::ErrorKind::TimedOut
            } else {
                io::ErrorKind::Other
            };
            io::Error::new(kind, error_chain(&e))
        })
    }))
}

/// `body`, ending with an [`AnswerTooLarge`] error once more than `max` bytes have come.
pub(crate) fn limited(body: AnswerBody, max: usize) -> AnswerBody {
    Box::pin(Limited {
        body: Some(body),
        left: max,
        max,
    })
}

/// The error that ends a body past its limit.
#[derive(Debug, thiserror::Error)]
#[error("the engine's answer is larger than {max} bytes (tokentap proxy --max-answer-bytes)")]
pub(crate) struct AnswerTooLarge {
    max: usize,
}

struct Limited {
    /// Dropped at the limit: the engine connection is closed rather than read on.
    body: Option<AnswerBody>,
    left: usize,
    max: usize,
}

impl Stream for Limited {
    type Item = Result<Bytes, io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let Some(body) = self.body.as_mut() else {
            return Poll::Ready(None);
        };
        let next = body.as_mut().poll_next(cx);
        if let Poll::Ready(Some(Ok(chunk))) = &next {
            match self.left.checked_sub(chunk.len()) {
                Some(left) => self.left = left,
                None => {
                    self.body = None;
                    let max = self.max;
                    return Poll::Ready(Some(Err(io::Error::other(AnswerTooLarge { max }))));
                }
            }
        }
        next
    }
}

/// The engine failure a body read error is when the read timed out (`waited` is how long it
/// waited) or the body passed its limit; `None` for other errors, which each reader words.
pub(crate) fn timeout_or_limit(e: &io::Error, waited: Duration) -> Option<BackendError> {
    if let Some(too_large) = e.get_ref().and_then(|e| e.downcast_ref::<AnswerTooLarge>()) {
        return Some(BackendError::Protocol(too_large.to_string()));
    }
    (e.kind() == io::ErrorKind::TimedOut)
        .then(|| BackendError::Timeout(format!("no data from the backend for {waited:?}: {e}")))
}

/// A whole answer's body, read to its end (its limit is [`limited`]'s).
pub(crate) async fn read_whole(
    mut answer: AnswerBody,
    waited: Duration,
) -> Result<Bytes, BackendError> {
    let mut whole = BytesMut::new();
    while let Some(chunk) = answer.next().await {
        let chunk = chunk.map_err(|e| {
            timeout_or_limit(&e, waited).unwrap_or_else(|| BackendError::Unavailable(e.to_string()))
        })?;
        whole.extend_from_slice(&chunk);
    }
    Ok(whole.freeze())
}

/// The start of an error answer's body (at most [`MAX_ERROR_BODY`]), for its message.
pub(crate) async fn read_error_text(mut answer: AnswerBody) -> String {
    let mut body = Vec::new();
    while body.len() < MAX_ERROR_BODY {
        match answer.next().await {
            Some(Ok(chunk)) => body.extend_from_slice(&chunk),
            _ => break,
        }
    }
    body.truncate(MAX_ERROR_BODY);
    String::from_utf8_lossy(&body).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(chunks: &[&'static [u8]]) -> AnswerBody {
        let chunks: Vec<Result<Bytes, io::Error>> =
            chunks.iter().map(|c| Ok(Bytes::from_static(c))).collect();
        Box::pin(futures::stream::iter(chunks))
    }

    #[tokio::test]
    async fn a_body_up_to_its_limit_is_read_whole() {
        let read = read_whole(limited(body(&[b"abc", b"de"]), 5), Duration::ZERO).await;
        assert_eq!(read.unwrap(), Bytes::from_static(b"abcde"));
    }

    #[tokio::test]
    async fn a_body_past_its_limit_ends_in_an_error_naming_the_limit_and_the_flag() {
        let mut stream = limited(body(&[b"abc", b"def", b"never read"]), 5);
        assert_eq!(stream.next().await.unwrap().unwrap(), "abc");
        let err = stream.next().await.unwrap().unwrap_err();
        match timeout_or_limit(&err, Duration::ZERO) {
            Some(BackendError::Protocol(m)) => assert_eq!(
                m,
                "the engine's answer is larger than 5 bytes (tokentap proxy --max-answer-bytes)"
            ),
            other => panic!("{other:?}"),
        }
        assert!(stream.next().await.is_none(), "nothing after the limit");
        let whole = read_whole(limited(body(&[b"abc", b"def"]), 5), Duration::ZERO).await;
        assert!(matches!(whole, Err(BackendError::Protocol(_))), "{whole:?}");
    }

    #[tokio::test]
    async fn a_timed_out_read_is_a_timeout_and_a_broken_one_an_unavailable_engine() {
        let timeout = io::Error::new(io::ErrorKind::TimedOut, "read timed out");
        let waited = Duration::from_secs(2);
        assert!(matches!(
            timeout_or_limit(&timeout, waited),
            Some(BackendError::Timeout(m)) if m == "no data from the backend for 2s: read timed out"
        ));
        let reset = io::Error::other("connection reset");
        assert!(timeout_or_limit(&reset, waited).is_none());
        let broken: AnswerBody = Box::pin(futures::stream::iter([
            Ok(Bytes::from_static(b"{")),
            Err(reset),
        ]));
        let whole = read_whole(broken, waited).await;
        assert!(
            matches!(whole, Err(BackendError::Unavailable(_))),
            "{whole:?}"
        );
    }

    #[tokio::test]
    async fn an_error_answer_is_read_to_at_most_a_mebibyte() {
        let chunk: &'static [u8] = Box::leak(vec![b'x'; 700 << 10].into_boxed_slice());
        let text = read_error_text(body(&[chunk, chunk, chunk])).await;
        assert_eq!(text.len(), MAX_ERROR_BODY);
    }
}
