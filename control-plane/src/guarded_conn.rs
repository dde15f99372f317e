//! A control-plane connection under its listener's limits. axum's server sets no timer on
//! hyper, so hyper's own header timeout never fires: without this, a client that opens a
//! connection and trickles (or never sends) a request head holds it, and its descriptor,
//! for ever. Two deadlines, enforced on reads, close such a connection:
//!
//! - **head**: from accept, and from the first byte after a response was written, the
//!   request head must be complete (`\r\n\r\n`) within `head`;
//! - **idle**: after a response was written, the client has `idle` to start the next request.
//!
//! Neither runs while the server is working on a request (a long poll, a pause waiting for
//! calls in flight) or streaming its answer (each write restarts `idle`). The connection also
//! holds its place under the listener's cap until it closes.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokentap_service_kit::limits::ConnectionPermit;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{sleep, Sleep};

/// What a guarded connection wraps (plain TCP or a TLS stream).
pub trait Conn: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Conn for T {}

/// The deadlines of a control-plane connection.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub head: Duration,
    pub idle: Duration,
}

pub struct GuardedConn {
    io: Box<dyn Conn>,
    _permit: ConnectionPermit,
    deadlines: Deadlines,
    /// Running while a request head is incomplete.
    head: Option<Pin<Box<Sleep>>>,
    /// Running between a response and the next request.
    idle: Option<Pin<Box<Sleep>>>,
    /// The last four bytes read, to see a head's end across reads.
    tail: u32,
    /// A response was written since the last head ended: the next byte read starts a head.
    responded: bool,
}

impl GuardedConn {
    pub fn new(io: Box<dyn Conn>, permit: ConnectionPermit, deadlines: Deadlines) -> GuardedConn {
        GuardedConn {
            io,
            _permit: permit,
            deadlines,
            head: Some(Box::pin(sleep(deadlines.head))),
            idle: None,
            tail: 0,
            responded: false,
        }
    }

    fn observe_read(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        self.idle = None;
        if self.responded {
            self.responded = false;
            self.head = Some(Box::pin(sleep(self.deadlines.head)));
        }
        if self.head.is_none() {
            return;
        }
        for b in bytes {
            self.tail = (self.tail << 8) | u32::from(*b);
            if self.tail == u32::from_be_bytes(*b"\r\n\r\n") {
                self.head = None;
                self.tail = 0;
                return;
            }
        }
    }
}

fn expired(deadline: &mut Option<Pin<Box<Sleep>>>, cx: &mut Context<'_>) -> bool {
    deadline
        .as_mut()
        .is_some_and(|d| d.as_mut().poll(cx).is_ready())
}

impl AsyncRead for GuardedConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                this.observe_read(&buf.filled()[before..]);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                // Polled here, the deadlines wake this read when they pass.
                if expired(&mut this.head, cx) {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the request head did not arrive in time",
                    )));
                }
                if expired(&mut this.idle, cx) {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the connection was idle too long",
                    )));
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for GuardedConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, data);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.responded = true;
            this.head = None;
            this.idle = Some(Box::pin(sleep(this.deadlines.idle)));
        }
        r
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokentap_service_kit::limits::ConnectionGate;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn guarded(io: tokio::io::DuplexStream) -> GuardedConn {
        let permit = ConnectionGate::new(1).admit().unwrap();
        let deadlines = Deadlines {
            head: Duration::from_secs(10),
            idle: Duration::from_secs(60),
        };
        GuardedConn::new(Box::new(io), permit, deadlines)
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickled_head_is_cut_at_the_deadline() {
        let (mut client, server) = tokio::io::duplex(1024);
        let mut conn = guarded(server);
        client.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        assert!(conn.read(&mut buf).await.unwrap() > 0);
        let e = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_at_work_is_given_all_the_time_it_needs_and_idleness_after_is_cut() {
        let (mut client, server) = tokio::io::duplex(1024);
        let mut conn = guarded(server);
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        assert!(conn.read(&mut buf).await.unwrap() > 0);
        // The head is complete: no deadline while the server works (a 10-minute pause).
        let wait = tokio::time::timeout(Duration::from_secs(600), conn.read(&mut buf)).await;
        assert!(
            wait.is_err(),
            "a read with no deadline running stays pending"
        );
        conn.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        // Answered: the client has `idle` to send its next request.
        let e = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test(start_paused = true)]
    async fn the_next_request_after_an_answer_has_its_own_head_deadline() {
        let (mut client, server) = tokio::io::duplex(1024);
        let mut conn = guarded(server);
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        assert!(conn.read(&mut buf).await.unwrap() > 0);
        conn.write_all(b"HTTP/1.1 200 OK\r\n\r\n").await.unwrap();
        client.write_all(b"GET /again HTTP/1.1\r\n").await.unwrap();
        assert!(conn.read(&mut buf).await.unwrap() > 0);
        let started = tokio::time::Instant::now();
        let e = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }
}
