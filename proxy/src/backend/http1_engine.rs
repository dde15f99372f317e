//! An engine's chat answers over plain HTTP/1, read in the task that relays them.
//!
//! reqwest (hyper) reads an answer in a connection task of its own and hands the body to the
//! reader over a one-slot channel: each chunk of a streamed answer costs a task switch, and the
//! relay never sees two events at once, so it writes each to the harness in a flushed write of
//! its own (12 `sendto`s for a 12-event answer). Pingora's HTTP/1 client (the crate that serves
//! the harness) reads in the caller's task instead: the chunks the engine has already sent are
//! parsed from one buffer, the relay finds them ready, and writes them together.
//!
//! Whole answers come this way too (no connection task to hand their chunks over). Only
//! `http://` engines take this path (Pingora is built without TLS here); HTTPS engines, and the
//! side endpoints (`/tokenize`, `/v1/models`, ...), keep reqwest.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pingora::connectors::http::v1::Connector;
use pingora::connectors::ConnectorOptions;
use pingora::http::RequestHeader;
use pingora::protocols::http::v1::client::HttpSession;
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error as PingoraError, ErrorType};

use super::answer_body::{read_error_text, AnswerBody};
use super::error::{error_chain, BackendError};
use super::interface::BackendConfig;

/// How long an idle connection to the engine is kept for the next call (reqwest's default).
const POOL_IDLE: Duration = Duration::from_secs(90);
/// The most idle connections kept (as reqwest's pool was set: one per harness connection the
/// proxy serves at once, and more).
const POOL_SIZE: usize = 1024;
/// How long a resolved engine address is used before it is looked up again.
const ADDRESS_TTL: Duration = Duration::from_secs(5);

/// One `http://` engine, with a pool of kept-alive connections.
pub(crate) struct Http1Engine {
    connector: Arc<Connector>,
    /// `host[:port]` of the engine's URL, for the Host header.
    authority: String,
    /// The path of the engine's base URL, which request paths go under.
    prefix: String,
    address: EngineAddress,
    authorization: Option<String>,
    connect_timeout: Duration,
    idle_timeout: Duration,
}

/// Where the engine is: an IP literal, or a host name looked up again every [`ADDRESS_TTL`]
/// (a Service's address may change under a long run).
enum EngineAddress {
    Literal(Arc<[SocketAddr]>),
    Name {
        host: String,
        port: u16,
        looked_up: Mutex<Option<(Instant, Arc<[SocketAddr]>)>>,
    },
}

impl Http1Engine {
    /// The engine at `config.url`, if that is an `http://` URL.
    pub(crate) fn for_engine(config: &BackendConfig) -> Option<Http1Engine> {
        let url = reqwest::Url::parse(config.base_url()).ok()?;
        if url.scheme() != "http" || url.query().is_some() {
            return None;
        }
        let prefix = url.path().trim_end_matches('/').to_owned();
        let port = url.port_or_known_default()?;
        let host = url.host_str()?;
        // An IPv6 literal is bracketed in a URL.
        let literal = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>();
        let address = match literal {
            Ok(ip) => EngineAddress::Literal(Arc::from([SocketAddr::new(ip, port)])),
            Err(_) => EngineAddress::Name {
                host: host.to_owned(),
                port,
                looked_up: Mutex::new(None),
            },
        };
        let authority = match url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_owned(),
        };
        Some(Http1Engine {
            connector: Arc::new(Connector::new(Some(ConnectorOptions::new(POOL_SIZE)))),
            authority,
            prefix,
            address,
            authorization: config.api_key.as_ref().map(|k| format!("Bearer {k}")),
            connect_timeout: config.connect_timeout,
            idle_timeout: config.idle_timeout,
        })
    }

    /// POSTs `body` (JSON) to `path` and returns the answer's body as it arrives. A non-2xx
    /// answer is a classified [`BackendError`].
    pub(crate) async fn post(&self, path: &str, body: Vec<u8>) -> Result<AnswerBody, BackendError> {
        let addresses = self.addresses().await?;
        let mut refused = None;
        for &addr in addresses.iter() {
            let peer = self.peer(addr);
            match self.request(&peer, path, &body).await {
                Ok(session) => {
                    return answer_body(session, Arc::clone(&self.connector), peer).await
                }
                // A name with several addresses: the next one may take the call.
                Err(e) if is_connect_error(&e) => refused = Some(e),
                Err(e) => return Err(classify(&e)),
            }
        }
        Err(refused.map_or_else(
            || BackendError::Unavailable(format!("{} has no address", self.authority)),
            |e| classify(&e),
        ))
    }

    /// Sends the request on a kept-alive connection or a new one and reads the answer's head.
    /// A kept-alive connection the engine closed meanwhile fails before any answer; the request
    /// then goes out again on another connection.
    async fn request(
        &self,
        peer: &HttpPeer,
        path: &str,
        body: &[u8],
    ) -> pingora::Result<HttpSession> {
        loop {
            let (mut session, reused) = self.connector.get_http_session(peer).await?;
            // The wait for the answer's head and for each chunk after it, as reqwest's read
            // timeout was (Pingora's connector leaves these to the caller).
            session.read_timeout = Some(self.idle_timeout);
            session.write_timeout = Some(self.idle_timeout);
            match self.send(&mut session, path, body).await {
                Ok(()) => return Ok(session),
                Err(e) if reused && stale(&e) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    async fn send(
        &self,
        session: &mut HttpSession,
        path: &str,
        body: &[u8],
    ) -> pingora::Result<()> {
        let path = format!("{}{path}", self.prefix);
        let mut req = RequestHeader::build("POST", path.as_bytes(), Some(5))?;
        req.insert_header("host", &self.authority)?;
        req.insert_header("content-type", "application/json")?;
        req.insert_header("content-length", body.len().to_string())?;
        if let Some(auth) = &self.authorization {
            req.insert_header("authorization", auth)?;
        }
        session.write_request_header(Box::new(req)).await?;
        session.write_body(body).await?;
        session.finish_body().await?;
        session.read_response().await?;
        Ok(())
    }

    /// The engine's addresses, looked up again once they are [`ADDRESS_TTL`] old.
    async fn addresses(&self) -> Result<Arc<[SocketAddr]>, BackendError> {
        let (host, port, looked_up) = match &self.address {
            EngineAddress::Literal(addr) => return Ok(Arc::clone(addr)),
            EngineAddress::Name {
                host,
                port,
                looked_up,
            } => (host, port, looked_up),
        };
        if let Some((at, addrs)) = &*looked_up.lock().expect("not poisoned") {
            if at.elapsed() < ADDRESS_TTL {
                return Ok(Arc::clone(addrs));
            }
        }
        let addrs: Arc<[SocketAddr]> = tokio::net::lookup_host((host.as_str(), *port))
            .await
            .map_err(|e| BackendError::Unavailable(format!("looking up {host}: {e}")))?
            .collect();
        *looked_up.lock().expect("not poisoned") = Some((Instant::now(), Arc::clone(&addrs)));
        Ok(addrs)
    }

    /// A peer at `addr` with the connect timeout (the pool's idle time is given on release).
    fn peer(&self, addr: SocketAddr) -> HttpPeer {
        let mut peer = HttpPeer::new(addr, false, String::new());
        peer.options.connection_timeout = Some(self.connect_timeout);
        peer
    }
}

/// The body of an answer whose head `session` has read: an error status is the classified
/// error; a kept-alive connection goes back to the pool once the body is read to its end.
async fn answer_body(
    session: HttpSession,
    pool: Arc<Connector>,
    peer: HttpPeer,
) -> Result<AnswerBody, BackendError> {
    let status = session.get_status().map_or(0, |s| s.as_u16());
    let body: AnswerBody = Box::pin(futures::stream::unfold(
        Some((session, pool, peer)),
        |state| async move {
            let (mut session, pool, peer) = state?;
            match session.read_body_bytes().await {
                Ok(Some(chunk)) => Some((Ok(chunk), Some((session, pool, peer)))),
                Ok(None) => {
                    pool.release_http_session(session, &peer, Some(POOL_IDLE))
                        .await;
                    None
                }
                Err(e) => Some((Err(io_error(&e)), None)),
            }
        },
    ));
    if !(200..300).contains(&status) {
        let message = read_error_text(body).await;
        return Err(BackendError::from_status(status, &message));
    }
    Ok(body)
}

/// Whether a kept-alive connection failed because the engine had closed it (not a timeout:
/// an engine that hangs is not asked twice).
fn stale(e: &PingoraError) -> bool {
    matches!(
        e.etype(),
        ErrorType::ConnectionClosed | ErrorType::ReadError | ErrorType::WriteError
    )
}

/// Whether no connection could be made (the request was never sent).
fn is_connect_error(e: &PingoraError) -> bool {
    matches!(
        e.etype(),
        ErrorType::ConnectRefused
            | ErrorType::ConnectNoRoute
            | ErrorType::ConnectTimedout
            | ErrorType::ConnectError
    )
}

/// A Pingora error as the engine failure it is.
fn classify(e: &PingoraError) -> BackendError {
    match e.etype() {
        ErrorType::ConnectTimedout | ErrorType::ReadTimedout | ErrorType::WriteTimedout => {
            BackendError::Timeout(error_chain(e))
        }
        ErrorType::InvalidHTTPHeader => BackendError::Protocol(error_chain(e)),
        _ => BackendError::Unavailable(error_chain(e)),
    }
}

/// A body read error, for the event-stream reader (which tells a timeout by its kind).
fn io_error(e: &PingoraError) -> std::io::Error {
    let kind = match e.etype() {
        ErrorType::ReadTimedout => std::io::ErrorKind::TimedOut,
        _ => std::io::ErrorKind::Other,
    };
    std::io::Error::new(kind, error_chain(e))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::StreamExt;
    use tokentap_schema::BackendKind;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    const ANSWER: &str = "data: {\"a\":1}\n\ndata: [DONE]\n\n";

    /// A streamed chat answer as vLLM sends it (one token, finished).
    const CHAT_ANSWER: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\
                               \"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";

    /// What the scripted engine does with the n-th request (from 0) on a connection.
    #[derive(Clone, Copy)]
    enum Script {
        /// Answers every request with this SSE body, chunked, and keeps the connection.
        Answer(&'static str),
        /// The same, the body's last chunk sent 50 ms after the events (as an engine's server
        /// does once the generator behind the body ends).
        AnswerEndLater(&'static str),
        /// Answers the first request with [`ANSWER`], then closes the connection on reading the next one.
        AnswerOnceThenClose,
        /// Closes the connection on reading a request.
        Close,
        /// Reads the request and never answers.
        Hang,
        /// Answers 500 with an OpenAI-shaped error.
        Fail,
    }

    struct Engine {
        url: String,
        connections: Arc<AtomicUsize>,
        requests: Arc<Mutex<Vec<String>>>,
    }

    async fn engine(script: Script, host: &str) -> Engine {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{host}:{}", listener.local_addr().unwrap().port());
        let connections = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (c, r) = (Arc::clone(&connections), Arc::clone(&requests));
        tokio::spawn(async move {
            loop {
                let (conn, _) = listener.accept().await.unwrap();
                c.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(conn, script, Arc::clone(&r)));
            }
        });
        Engine {
            url,
            connections,
            requests,
        }
    }

    async fn serve(mut conn: TcpStream, script: Script, requests: Arc<Mutex<Vec<String>>>) {
        let mut buf = Vec::new();
        for n in 0.. {
            let Some(request) = read_request(&mut conn, &mut buf).await else {
                return;
            };
            requests.lock().unwrap().push(request);
            match (script, n) {
                (Script::Answer(answer), _) => {
                    conn.write_all(chunked(answer, true).as_bytes())
                        .await
                        .unwrap();
                }
                (Script::AnswerOnceThenClose, 0) => {
                    conn.write_all(chunked(ANSWER, true).as_bytes())
                        .await
                        .unwrap();
                }
                (Script::AnswerEndLater(answer), _) => {
                    conn.write_all(chunked(answer, false).as_bytes())
                        .await
                        .unwrap();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    conn.write_all(b"0\r\n\r\n").await.unwrap();
                }
                (Script::Fail, _) => {
                    let body = r#"{"error":{"message":"engine fell over","code":500}}"#;
                    let out = format!(
                        "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    conn.write_all(out.as_bytes()).await.unwrap();
                }
                (Script::Hang, _) => std::future::pending::<()>().await,
                _ => return, // closes
            }
        }
    }

    /// An SSE answer's head and its events, one chunk each, with the body's last chunk if
    /// `end`.
    fn chunked(answer: &str, end: bool) -> String {
        let mut out = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                       transfer-encoding: chunked\r\n\r\n"
            .to_owned();
        for event in answer.split_inclusive("\n\n") {
            out.push_str(&format!("{:x}\r\n{event}\r\n", event.len()));
        }
        if end {
            out.push_str("0\r\n\r\n");
        }
        out
    }

    /// One request (head and content-length body) as text, or `None` at the connection's end.
    async fn read_request(conn: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if buf.len() >= end + 4 + len {
                    let request: Vec<u8> = buf.drain(..end + 4 + len).collect();
                    return Some(String::from_utf8_lossy(&request).into_owned());
                }
            }
            let mut chunk = [0; 4096];
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    fn client(url: &str, idle: Duration) -> Http1Engine {
        Http1Engine::for_engine(&BackendConfig {
            kind: BackendKind::Vllm,
            url: url.to_owned(),
            api_key: Some("sk-engine".into()),
            ca_roots: Vec::new(),
            connect_timeout: Duration::from_secs(2),
            idle_timeout: idle,
            max_answer_bytes: crate::backend::DEFAULT_MAX_ANSWER_BYTES,
        })
        .expect("an http:// engine")
    }

    async fn call(client: &Http1Engine) -> Result<String, BackendError> {
        let body = client
            .post("/v1/chat/completions", br#"{"stream":true}"#.to_vec())
            .await?;
        let chunks: Vec<_> = body.collect().await;
        let mut text = Vec::new();
        for chunk in chunks {
            text.extend_from_slice(&chunk.map_err(|e| BackendError::Protocol(e.to_string()))?);
        }
        Ok(String::from_utf8(text).unwrap())
    }

    /// One call to an engine following `script`, which must fail; the engine and the error.
    async fn failed_call(script: Script, idle: Duration) -> (Engine, BackendError) {
        let engine = engine(script, "127.0.0.1").await;
        let err = call(&client(&engine.url, idle)).await.unwrap_err();
        (engine, err)
    }

    #[tokio::test]
    async fn streamed_answers_come_whole_over_one_kept_alive_connection() {
        let engine = engine(Script::Answer(ANSWER), "127.0.0.1").await;
        let client = client(&engine.url, Duration::from_secs(5));
        for _ in 0..3 {
            assert_eq!(call(&client).await.unwrap(), ANSWER);
        }
        assert_eq!(engine.connections.load(Ordering::SeqCst), 1);
        let requests = engine.requests.lock().unwrap();
        let port = engine.url.rsplit(':').next().unwrap();
        for r in requests.iter() {
            assert!(
                r.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"),
                "{r}"
            );
            let lower = r.to_lowercase();
            assert!(
                lower.contains(&format!("\r\nhost: 127.0.0.1:{port}\r\n")),
                "{r}"
            );
            assert!(
                lower.contains("\r\ncontent-type: application/json\r\n"),
                "{r}"
            );
            assert!(
                lower.contains("\r\nauthorization: bearer sk-engine\r\n"),
                "{r}"
            );
            assert!(r.ends_with("\r\n\r\n{\"stream\":true}"), "{r}");
        }
    }

    /// The relay stops reading an answer's events at the terminal one and drops the stream:
    /// the connection still goes back to the pool, whether the body's last chunk came with
    /// `[DONE]` or after it. (Each call had opened a new connection, one `connect` per call.)
    #[tokio::test]
    async fn a_streamed_answer_read_to_its_finish_returns_its_connection() {
        use crate::backend::openai_compat::stream_events;
        use crate::backend::vllm::VllmDialect;
        use tokentap_wire::canonical::GenerationEvent;

        let scripts = [
            (Script::Answer(CHAT_ANSWER), 0),
            (Script::AnswerEndLater(CHAT_ANSWER), 300),
        ];
        for (script, settle) in scripts {
            let engine = engine(script, "127.0.0.1").await;
            let client = client(&engine.url, Duration::from_secs(5));
            for _ in 0..3 {
                let body = client
                    .post("/v1/chat/completions", br#"{"stream":true}"#.to_vec())
                    .await
                    .unwrap();
                let mut events = stream_events(body, VllmDialect, Duration::from_secs(5));
                loop {
                    match events.next().await {
                        Some(Ok(GenerationEvent::Finished { .. })) => break,
                        Some(Ok(_)) => {}
                        other => panic!("{other:?}"),
                    }
                }
                drop(events);
                // The body's end is 50 ms behind [DONE] in the second script.
                tokio::time::sleep(Duration::from_millis(settle)).await;
            }
            let n = engine.connections.load(Ordering::SeqCst);
            assert_eq!(n, 1, "{} connections", n);
        }
    }

    /// The engine may close a kept-alive connection just as the next call is sent on it: that
    /// call goes out again on a new connection, and succeeds.
    #[tokio::test]
    async fn a_kept_alive_connection_the_engine_closed_is_replaced() {
        let engine = engine(Script::AnswerOnceThenClose, "127.0.0.1").await;
        let client = client(&engine.url, Duration::from_secs(5));
        assert_eq!(call(&client).await.unwrap(), ANSWER);
        assert_eq!(call(&client).await.unwrap(), ANSWER);
        assert_eq!(engine.connections.load(Ordering::SeqCst), 2);
    }

    /// A new connection the engine closes without answering is an unavailable engine, asked
    /// once.
    #[tokio::test]
    async fn an_engine_that_closes_without_answering_is_unavailable() {
        let (engine, err) = failed_call(Script::Close, Duration::from_secs(5)).await;
        assert!(matches!(err, BackendError::Unavailable(_)), "{err:?}");
        assert_eq!(engine.connections.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_engine_that_never_answers_times_out() {
        let started = Instant::now();
        let (_, err) = failed_call(Script::Hang, Duration::from_millis(300)).await;
        assert!(matches!(err, BackendError::Timeout(_)), "{err:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn an_error_answer_is_classified_with_its_message() {
        let (_, err) = failed_call(Script::Fail, Duration::from_secs(5)).await;
        match err {
            BackendError::Status { status, message } => {
                assert_eq!((status, message.as_str()), (500, "engine fell over"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn an_engine_named_by_host_name_is_looked_up() {
        let engine = engine(Script::Answer(ANSWER), "localhost").await;
        assert_eq!(
            call(&client(&engine.url, Duration::from_secs(5)))
                .await
                .unwrap(),
            ANSWER
        );
    }

    /// Request paths go under the URL's path, a trailing `/v1` removed (as reqwest's were).
    #[tokio::test]
    async fn requests_go_under_the_engine_urls_path() {
        let engine = engine(Script::Answer(ANSWER), "127.0.0.1").await;
        for (suffix, expect) in [
            ("/v1", "POST /v1/chat/completions "),
            ("/", "POST /v1/chat/completions "),
            ("/engines/a/v1/", "POST /engines/a/v1/chat/completions "),
            ("/engines/a", "POST /engines/a/v1/chat/completions "),
        ] {
            let client = client(&format!("{}{suffix}", engine.url), Duration::from_secs(5));
            assert_eq!(call(&client).await.unwrap(), ANSWER);
            let last = engine.requests.lock().unwrap().last().cloned().unwrap();
            assert!(last.starts_with(expect), "{suffix}: {last}");
        }
    }

    #[tokio::test]
    async fn https_engines_are_left_to_reqwest() {
        for url in ["https://127.0.0.1:8443", "unix:/run/engine.sock"] {
            let config = BackendConfig {
                kind: BackendKind::Vllm,
                url: url.into(),
                api_key: None,
                ca_roots: Vec::new(),
                connect_timeout: Duration::from_secs(1),
                idle_timeout: Duration::from_secs(1),
                max_answer_bytes: crate::backend::DEFAULT_MAX_ANSWER_BYTES,
            };
            assert!(Http1Engine::for_engine(&config).is_none(), "{url}");
        }
    }
}
