//! The node's capture: one in-process `CaptureService` on 127.0.0.1 shared by every sample.
//! A sample reaches only its own session (the sample id; a re-run gets its own, see
//! [`crate::task::Sample::capture_session`]): a sandboxed one through a socket of its own
//! ([`crate::sandbox::serve_socket`]), any other through a base URL `/s/{secret}/v1` with an
//! unguessable secret of its own that the capture maps to its session ([`SampleSecrets`]);
//! what a request says about its session is ignored, and unknown secrets are refused. Records
//! go to the
//! node's spool as with `tokentap proxy`; the spool writer also hands each appended batch to an
//! index of the samples running now, so POST_RUN gets a sample's records at once. A sample whose
//! task asks for `"token_mode": "off"` on a node started in a token mode has its calls sent to
//! the engine as text ([`TextModeSamples`]).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokentap_proxy::app::TextModeSessions;
use tokentap_proxy::capture::RecordSink;
use tokentap_proxy::session::SessionResolver;
use tokentap_proxy::CaptureService;
use tokentap_schema::CaptureRecord;
use tokentap_spool::LineAt;

/// Where the records of the sessions being watched are in the spool, as the spool writer
/// appends them: positions, not records, so a running sample's records cost the node a few
/// bytes each until POST_RUN reads them back ([`SessionIndex::take`]).
pub struct SessionIndex {
    spool: PathBuf,
    watched: Mutex<HashMap<String, Vec<LineAt>>>,
}

impl SessionIndex {
    /// An index of the spool in `spool` (the one whose writer it observes).
    pub fn of_spool(spool: &Path) -> SessionIndex {
        SessionIndex {
            spool: spool.to_owned(),
            watched: Mutex::default(),
        }
    }

    /// Starts collecting `session`'s records (before its agent starts).
    pub fn watch(&self, session: &str) {
        self.lock().entry(session.to_owned()).or_default();
    }

    /// Stops collecting and returns the records collected, read back from the spool, and
    /// whether each could be read (a segment removed meanwhile, say, loses its records: the
    /// error is logged and the trajectory marked incomplete).
    pub fn take(&self, session: &str) -> (Vec<CaptureRecord>, bool) {
        let lines = self.lock().remove(session).unwrap_or_default();
        let mut all = true;
        let records = tokentap_spool::read_lines(&self.spool, &lines)
            .into_iter()
            .filter_map(|r| {
                r.map_err(|e| {
                    all = false;
                    tracing::error!(%session, error = %e, "a record of the session cannot be read back from the spool");
                })
                .ok()
            })
            .collect();
        (records, all)
    }

    pub fn count(&self, session: &str) -> usize {
        self.lock().get(session).map_or(0, Vec::len)
    }

    fn observe(&self, batch: &[CaptureRecord], lines: &[LineAt]) {
        let mut map = self.lock();
        for (r, at) in batch.iter().zip(lines) {
            if let Some(v) = map.get_mut(&r.session_id) {
                v.push(*at);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<LineAt>>> {
        self.watched.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The observer to pass to [`RecordSink::spool_observed`].
pub fn observer(index: Arc<SessionIndex>) -> tokentap_proxy::capture::RecordObserver {
    Box::new(move |batch, lines| index.observe(batch, lines))
}

/// The secrets of the samples running now, each standing for its session.
#[derive(Default)]
pub struct SampleSecrets {
    sessions: Mutex<HashMap<String, String>>,
}

impl SampleSecrets {
    /// A fresh secret for `session` (244 random bits), valid until [`Self::forget`].
    pub fn issue(&self, session: &str) -> String {
        let secret = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        self.lock().insert(secret.clone(), session.to_owned());
        secret
    }

    pub fn forget(&self, secret: &str) {
        self.lock().remove(secret);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl SessionResolver for SampleSecrets {
    fn resolve(&self, prefix: &str) -> Option<String> {
        self.lock().get(prefix).cloned()
    }
}

/// The sessions of the samples whose task runs in text mode (`"token_mode": "off"`): on a
/// node started in a token mode, the capture sends their calls to the engine as text and
/// observes none ([`CaptureService::with_text_mode_sessions`]). A session stays here until
/// its records are collected, so a call still in flight when its agent ended keeps its mode.
#[derive(Default)]
pub struct TextModeSamples {
    sessions: Mutex<HashSet<String>>,
}

impl TextModeSamples {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl TextModeSessions for TextModeSamples {
    fn in_text_mode(&self, session: &str) -> bool {
        self.lock().contains(session)
    }
}

/// A running capture endpoint.
pub struct NodeCapture {
    pub service: Arc<CaptureService>,
    pub index: Arc<SessionIndex>,
    pub addr: SocketAddr,
    pub secrets: Arc<SampleSecrets>,
    /// The samples running in text mode (wired into `service` when the node was built in a
    /// token mode; on a node in text mode every sample is).
    pub text_mode: Arc<TextModeSamples>,
}

impl NodeCapture {
    /// Serves `service` on 127.0.0.1 (an ephemeral port) on the current tokio runtime, each
    /// call's session from its secret; `text_mode`: the samples it runs in text mode.
    pub async fn start(
        service: CaptureService,
        index: Arc<SessionIndex>,
        text_mode: Arc<TextModeSamples>,
    ) -> std::io::Result<NodeCapture> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let secrets = Arc::new(SampleSecrets::default());
        let service = Arc::new(service.with_session_resolver(secrets.clone()));
        let serving = service.clone();
        // Held by the accept loop: capture stops when the runtime does.
        let (_tx, watch) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            let _keep = _tx;
            loop {
                let (conn, _) =
                    crate::accept::accept_retrying(|| listener.accept(), "capture").await;
                let (service, watch) = (serving.clone(), watch.clone());
                tokio::spawn(async move {
                    let stream: pingora::protocols::Stream =
                        Box::new(pingora::protocols::l4::stream::Stream::from(conn));
                    service.serve_stream(stream, &watch, None).await;
                });
            }
        });
        Ok(NodeCapture {
            service,
            index,
            addr,
            secrets,
            text_mode,
        })
    }

    /// Starts capturing `session` before its agent starts: its records collected for
    /// [`Self::collect`], its calls in text mode when `text_mode` (its task's
    /// `"token_mode": "off"`).
    pub fn open_session(&self, session: &str, text_mode: bool) {
        self.index.watch(session);
        if text_mode {
            self.text_mode.lock().insert(session.to_owned());
        }
    }

    /// The capture root for a sample's `secret` (the Anthropic base URL; OpenAI's adds `/v1`).
    pub fn server(&self, secret: &str) -> String {
        format!("http://{}/s/{secret}", self.addr)
    }

    /// Every record of `session`: waits (up to `limit`) until each call the proxy began in the
    /// session has its record, then stops watching it. Returns the records and whether all
    /// arrived.
    pub async fn collect(&self, session: &str, limit: Duration) -> (Vec<CaptureRecord>, bool) {
        let deadline = tokio::time::Instant::now() + limit;
        let complete = loop {
            let begun = self.service.session_calls(session) as usize;
            if self.index.count(session) >= begun {
                break true;
            }
            if tokio::time::Instant::now() >= deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let (records, all_read) = self.index.take(session);
        self.text_mode.lock().remove(session);
        (records, complete && all_read)
    }
}

/// Builds the spool sink with the index observing it.
pub fn sink(
    writer: tokentap_spool::SpoolWriter,
    metrics: Arc<tokentap_proxy::metrics::Metrics>,
    index: Arc<SessionIndex>,
) -> (RecordSink, std::thread::JoinHandle<()>) {
    RecordSink::spool_observed(writer, metrics, Some(observer(index)))
}
