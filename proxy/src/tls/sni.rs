//! What a new connection opens with, read without consuming it: a TLS ClientHello (and the
//! server name it asks for) or anything else. Peeking leaves every byte in the socket, so a
//! connection that is not intercepted can be spliced to its destination unchanged.

use std::time::Duration;

use tokio::net::TcpStream;

/// The opening of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opening {
    /// A TLS ClientHello, with its SNI if it sent one.
    TlsClientHello { server_name: Option<String> },
    /// Not TLS (or a ClientHello that does not parse): pass it through.
    Other,
    /// Nothing arrived within the wait (a server-speaks-first protocol) or the peer closed.
    Silent,
}

/// Largest ClientHello looked at (records are at most 16 KiB plus header).
const MAX_HELLO: usize = 16 * 1024 + 5;

/// Peeks at the first bytes of `stream` for up to `wait`.
pub async fn peek_opening(stream: &TcpStream, wait: Duration) -> std::io::Result<Opening> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut buf = vec![0u8; MAX_HELLO];
    let mut seen = 0;
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Ok(r) => r?,
            Err(_) => {
                return Ok(if seen == 0 {
                    Opening::Silent
                } else {
                    Opening::Other
                })
            }
        };
        if n == 0 {
            return Ok(Opening::Silent);
        }
        // A TLS handshake record: content type 22, major version 3.
        if buf[0] != 0x16 || (n >= 2 && buf[1] != 0x03) {
            return Ok(Opening::Other);
        }
        if n >= 5 {
            let need = 5 + u16::from_be_bytes([buf[3], buf[4]]) as usize;
            if n >= need.min(MAX_HELLO) {
                return Ok(parse_client_hello(&buf[..n]));
            }
        }
        if n == seen {
            // Nothing new yet: wait a little for the rest of the record.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        seen = n;
    }
}

/// Parses a complete ClientHello record with rustls itself.
pub fn parse_client_hello(bytes: &[u8]) -> Opening {
    let mut acceptor = rustls::server::Acceptor::default();
    let mut rd = bytes;
    if acceptor.read_tls(&mut rd).is_err() {
        return Opening::Other;
    }
    match acceptor.accept() {
        Ok(Some(accepted)) => Opening::TlsClientHello {
            server_name: accepted.client_hello().server_name().map(str::to_owned),
        },
        _ => Opening::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// The first flight a real rustls client sends for `name`.
    fn client_hello(name: &str) -> Vec<u8> {
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
        let mut conn = rustls::ClientConnection::new(
            Arc::new(config),
            rustls::pki_types::ServerName::try_from(name.to_owned()).unwrap(),
        )
        .unwrap();
        let mut out = Vec::new();
        conn.write_tls(&mut out).unwrap();
        out
    }

    #[test]
    fn a_client_hello_names_its_server() {
        assert_eq!(
            parse_client_hello(&client_hello("api.openai.com")),
            Opening::TlsClientHello {
                server_name: Some("api.openai.com".into())
            }
        );
        assert_eq!(
            parse_client_hello(b"GET / HTTP/1.1\r\n\r\n"),
            Opening::Other
        );
        assert_eq!(
            parse_client_hello(&[0x16, 3, 1, 0, 4, 1, 2, 3, 4]),
            Opening::Other
        );
    }

    #[tokio::test]
    async fn peeking_consumes_nothing() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hello = client_hello("api.anthropic.com");
        let sent = hello.clone();
        let client = tokio::spawn(async move {
            let mut c = TcpStream::connect(addr).await.unwrap();
            // Split across two writes, as a slow client might.
            c.write_all(&sent[..10]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            c.write_all(&sent[10..]).await.unwrap();
            c
        });
        let (server, _) = listener.accept().await.unwrap();
        let opening = peek_opening(&server, Duration::from_secs(2)).await.unwrap();
        assert_eq!(
            opening,
            Opening::TlsClientHello {
                server_name: Some("api.anthropic.com".into())
            }
        );
        let mut server = server;
        let mut all = vec![0u8; hello.len()];
        server.read_exact(&mut all).await.unwrap();
        assert_eq!(all, hello, "every byte is still there to read");
        drop(client.await.unwrap());

        // A client that says nothing is Silent.
        let c = TcpStream::connect(addr).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let opening = peek_opening(&server, Duration::from_millis(50))
            .await
            .unwrap();
        assert_eq!(opening, Opening::Silent);
        drop(c);
    }
}
