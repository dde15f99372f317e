//! The start of an answer's body from a server tokentap calls that is not its engine's chat
//! answer: a callback receiver, a reconstruction worker, a llama-server asked to detokenize.
//! Such a body is read for an error message, an ack or a small JSON document, so reading it
//! whole would let whoever answers decide how much of the caller's memory it takes (a receiver
//! answering 500 with a 1 GB body once took a node from 80 MB to 975 MB).
//!
//! [`read`] (async) and [`read_sync`] (a blocking reqwest answer is an [`std::io::Read`]) stop
//! at the cap and say whether more came; dropping the answer then closes its connection
//! rather than reading on.

use std::borrow::Cow;
use std::io::Read;

/// The most of such a body read: far past any ack, limits document or error message.
pub const MAX_BODY_READ: usize = 1 << 20;

/// A body's first bytes, at most the cap it was read with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BodyExcerpt {
    pub bytes: Vec<u8>,
    /// More came after `bytes` (the rest was not read).
    pub truncated: bool,
}

/// Why a body is not the JSON document asked for.
#[derive(Debug, thiserror::Error)]
pub enum BodyJsonError {
    #[error("the answer's body is over {0} bytes")]
    TooLarge(usize),
    #[error("the answer's body is not the JSON expected: {0}")]
    Json(#[from] serde_json::Error),
    #[error("reading the answer's body: {0}")]
    Read(#[from] std::io::Error),
}

impl BodyExcerpt {
    /// The excerpt as text (invalid UTF-8 replaced).
    pub fn text(&self) -> Cow<'_, str> {
        String::from_utf8_lossy(&self.bytes)
    }

    /// The body as a `T`, if it was read whole.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, BodyJsonError> {
        if self.truncated {
            return Err(BodyJsonError::TooLarge(self.bytes.len()));
        }
        Ok(serde_json::from_slice(&self.bytes)?)
    }
}

/// The first `cap` bytes at most of `answer`'s body, read chunk by chunk.
pub async fn read(
    mut answer: reqwest::Response,
    cap: usize,
) -> Result<BodyExcerpt, reqwest::Error> {
    let mut bytes = Vec::new();
    while let Some(chunk) = answer.chunk().await? {
        let room = cap - bytes.len();
        if chunk.len() > room {
            bytes.extend_from_slice(&chunk[..room]);
            return Ok(BodyExcerpt {
                bytes,
                truncated: true,
            });
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(BodyExcerpt {
        bytes,
        truncated: false,
    })
}

/// The first `cap` bytes at most of a blocking body (a `reqwest::blocking::Response`).
pub fn read_sync(body: impl Read, cap: usize) -> std::io::Result<BodyExcerpt> {
    let mut bytes = Vec::new();
    // One byte past the cap tells whether more came.
    body.take(cap as u64 + 1).read_to_end(&mut bytes)?;
    let truncated = bytes.len() > cap;
    bytes.truncate(cap);
    Ok(BodyExcerpt { bytes, truncated })
}

/// A blocking body as a `T`, read to at most `cap` bytes (more is an error).
pub fn read_sync_json<T: serde::de::DeserializeOwned>(
    body: impl Read,
    cap: usize,
) -> Result<T, BodyJsonError> {
    read_sync(body, cap)?.json()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server answering every connection with `head` and then `body_bytes` of zeros (as
    /// many as the reader takes), never held in memory; the bytes it got written are counted.
    async fn endless(head: &'static str) -> (String, tokio::sync::mpsc::UnboundedReceiver<u64>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut req = [0u8; 4096];
                    let _ = s.read(&mut req).await;
                    s.write_all(head.as_bytes()).await.unwrap();
                    let zeros = vec![b'0'; 64 << 10];
                    let mut written = 0u64;
                    while s.write_all(&zeros).await.is_ok() {
                        written += zeros.len() as u64;
                    }
                    let _ = tx.send(written);
                });
            }
        });
        (url, rx)
    }

    const GIGABYTE_500: &str =
        "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 1073741824\r\n\r\n";

    #[tokio::test]
    async fn a_gigabyte_body_is_read_to_the_cap_and_its_connection_dropped() {
        let (url, mut written) = endless(GIGABYTE_500).await;
        let answer = reqwest::Client::new().get(&url).send().await.unwrap();
        assert_eq!(answer.status(), 500);
        let started = Instant::now();
        let excerpt = read(answer, MAX_BODY_READ).await.unwrap();
        assert_eq!(excerpt.bytes.len(), MAX_BODY_READ);
        assert!(excerpt.truncated);
        // The server's writes fail once the reader is gone: it wrote the cap and what the
        // sockets' buffers held, nowhere near the gigabyte.
        let sent = tokio::time::timeout(Duration::from_secs(30), written.recv())
            .await
            .expect("the connection was closed at the cap")
            .unwrap();
        assert!(sent < 64 << 20, "{sent} bytes sent");
        assert!(started.elapsed() < Duration::from_secs(30));
        assert!(matches!(
            excerpt.json::<serde_json::Value>(),
            Err(BodyJsonError::TooLarge(_))
        ));
    }

    #[test]
    fn an_endless_blocking_body_is_read_to_the_cap() {
        let excerpt = read_sync(std::io::repeat(b'0'), 1000).unwrap();
        assert_eq!((excerpt.bytes.len(), excerpt.truncated), (1000, true));
    }

    #[test]
    fn a_body_up_to_the_cap_is_read_whole() {
        let whole = read_sync(&b"{\"ok\": true}"[..], 12).unwrap();
        assert!(!whole.truncated);
        assert_eq!(
            whole.json::<serde_json::Value>().unwrap(),
            serde_json::json!({"ok": true})
        );
        let cut = read_sync(&b"{\"ok\": true}"[..], 11).unwrap();
        assert_eq!(
            (cut.text().as_ref(), cut.truncated),
            ("{\"ok\": true", true)
        );
        assert!(matches!(
            cut.json::<serde_json::Value>(),
            Err(BodyJsonError::TooLarge(11))
        ));
    }
}
