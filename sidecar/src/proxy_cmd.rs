//! `tokentap proxy`: wires the backend adapter, the spool and the capture service into a
//! Pingora server.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server};
use pingora::services::listening::Service;
use tokentap_proxy::backend::{self, BackendConfig, BackendKind};
use tokentap_proxy::capture::{OnSpoolError, RecordSink};
use tokentap_proxy::engine_options::{EngineOption, EngineOptionPolicy};
use tokentap_proxy::limits::ListenerLimits;
use tokentap_proxy::metrics::Metrics;
use tokentap_proxy::normalize::SystemLayout;
use tokentap_proxy::{CaptureService, ProxyConfig};
use tokentap_spool::{FsyncPolicy, SpoolConfig, SpoolWriter};

use crate::downstream::DownstreamArgs;

#[derive(Clone, Copy, ValueEnum)]
pub enum KindArg {
    Vllm,
    Sglang,
    Llamacpp,
}

impl From<KindArg> for BackendKind {
    fn from(k: KindArg) -> Self {
        match k {
            KindArg::Vllm => BackendKind::Vllm,
            KindArg::Sglang => BackendKind::Sglang,
            KindArg::Llamacpp => BackendKind::Llamacpp,
        }
    }
}

#[derive(Args)]
#[command(after_help = "Examples:
  # vLLM on a GPU node; harnesses use http://127.0.0.1:8800/v1 as their OpenAI base URL
  tokentap proxy --listen 127.0.0.1:8800 --backend http://gpu-node:8000 --backend-kind vllm --spool ./spool

  # llama.cpp's llama-server on this machine, one session per run via a path prefix
  tokentap proxy --backend http://127.0.0.1:8080 --backend-kind llamacpp --spool ./spool
  OPENAI_BASE_URL=http://127.0.0.1:8800/s/run-42/v1 my-harness ...

  # inspect what was captured
  tokentap records tail --spool ./spool -n 5")]
pub struct ProxyArgs {
    /// Address to listen on for harness traffic (also serves /health and /metrics).
    #[arg(long, default_value = "127.0.0.1:8800")]
    listen: String,
    /// The key clients must present as their API key (`Authorization: Bearer TOKEN` or
    /// `x-api-key: TOKEN`) on every route but /health; required to listen on anything but a
    /// loopback address. Harnesses pass it as their API key (OPENAI_API_KEY, ANTHROPIC_API_KEY).
    #[arg(long, env = "TOKENTAP_CLIENT_TOKEN", hide_env_values = true)]
    client_token: Option<String>,
    #[command(flatten)]
    capture: CaptureArgs,
    /// Worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Record every call under this session (a pod's sidecar: the pod's) instead of
    /// attributing per call.
    #[arg(long, env = "TOKENTAP_SESSION")]
    session: Option<String>,
    #[command(flatten)]
    downstream: DownstreamArgs,
}

/// Where `proxy`, `run` and the node agent spool when `--spool` is not given.
pub const DEFAULT_SPOOL: &str = "tokentap-spool";

/// What every capturing command shares: the engine, the spool, the capture policy.
#[derive(Args, Clone)]
pub struct CaptureArgs {
    /// Base URL of the inference engine.
    #[arg(long)]
    pub backend: String,
    /// Which engine it is (decides how token ids and logprobs are obtained).
    #[arg(long, value_enum)]
    backend_kind: KindArg,
    /// Model name to send to the engine; by default the engine's only served model
    /// (asked at start-up), else the harness's own model name.
    #[arg(long)]
    backend_model: Option<String>,
    /// Bearer token for the engine (never recorded).
    #[arg(long, env = "TOKENTAP_BACKEND_API_KEY", hide_env_values = true)]
    backend_api_key: Option<String>,
    /// A PEM file of CA certificates to trust, besides the system's and Mozilla's roots, for
    /// every HTTPS connection tokentap makes: the engine, the worker (--ship-to), callbacks.
    #[arg(long, env = "TOKENTAP_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Seconds to wait for the engine's first byte and between streamed chunks.
    #[arg(long, default_value_t = 600)]
    backend_timeout: u64,
    /// Largest engine answer read, in bytes, streamed or whole; past it the call ends in an
    /// error (the idle timeout alone would let an endless answer grow the proxy's memory).
    #[arg(long, default_value_t = backend::DEFAULT_MAX_ANSWER_BYTES)]
    max_answer_bytes: usize,
    /// Directory of the capture spool [serve: DATA/spool; generate: OUT/spool].
    #[arg(long, default_value = DEFAULT_SPOOL)]
    pub spool: PathBuf,
    /// When to fsync the spool: `always` (every record, and each answer's last bytes wait for
    /// its record to be on disk), `never` (leave it to the OS) or an interval such as `100ms`.
    #[arg(long, default_value = "100ms")]
    fsync: FsyncPolicy,
    /// What to do while the spool cannot be written (disk full, read-only, I/O errors):
    /// `fail-closed` keeps every record in memory, retries, and refuses new calls with a 503
    /// naming the cause until the spool is writable again (every answered call is in the
    /// data); `fail-open` keeps answering and counts the records it cannot write in
    /// tokentap_records_lost_total. Both recover by themselves when space returns.
    #[arg(
        long,
        default_value = "fail-closed",
        value_name = "fail-closed|fail-open"
    )]
    on_spool_error: OnSpoolError,
    /// Start a new spool segment past this many bytes.
    #[arg(long, default_value_t = 64 << 20)]
    segment_bytes: u64,
    /// Do not write capture records (for measuring the proxy itself).
    #[arg(long)]
    pub no_capture: bool,
    /// Call the engine non-streaming and play its answer back as a stream.
    #[arg(long)]
    synthetic_stream: bool,
    /// Largest accepted request body in bytes.
    #[arg(long, default_value_t = 32 << 20)]
    max_body_bytes: usize,
    /// Policy (weights) version to record with each call.
    #[arg(long)]
    pub policy_version: Option<String>,
    /// How system and developer messages reach the engine: `single` folds them into one
    /// leading system message (what most chat templates take), `as-sent` keeps them where the
    /// harness put them, `auto` asks the engine's template once (llama.cpp, vLLM) and folds
    /// when it rejects or drops a second system message or does not know `developer`.
    #[arg(long, default_value = "auto")]
    system_layout: SystemLayout,
    /// An engine option callers may set (repeatable): a field passed to the engine as the
    /// harness gave it. Others are dropped from engine requests (noted on the record, counted
    /// in tokentap_engine_options_dropped_total). `all` allows every one, `none` (alone) none.
    /// Every option is held to its bounds whatever this allows (logit_bias at most 300
    /// entries; chat_template_kwargs only plain template variables; response_format at most
    /// 64 KiB; …) [default: all; serve and generate: parallel_tool_calls, reasoning_effort].
    #[arg(long = "engine-option", value_name = "NAME", value_parser = engine_option_names())]
    engine_options: Vec<String>,
    /// `observe`: calls go to the engine as before, and tokentap also renders and tokenizes
    /// each conversation with the model's own template and tokenizer, recording on each
    /// record whether its ids equal the engine's and where the session's prompt stops
    /// extending what the model sampled (tokentap_token_mode_* metrics; `records summary`).
    #[arg(long, default_value = "off", value_name = "off|observe")]
    token_mode: tokentap_token_mode::TokenMode,
    /// The model's tokenizer and chat template for --token-mode: a Hugging Face model
    /// directory, a tokenizer.json or a GGUF file [default: the file llama.cpp's /props names].
    #[arg(long, value_name = "PATH")]
    tokenizer: Option<PathBuf>,
    #[command(flatten)]
    pub limits: LimitArgs,
}

/// `--engine-option`'s values: the options' names, `all` and `none`.
fn engine_option_names() -> clap::builder::PossibleValuesParser {
    let names = EngineOption::ALL.map(EngineOption::name);
    clap::builder::PossibleValuesParser::new(names.into_iter().chain(["all", "none"]))
}

impl CaptureArgs {
    /// The engine options callers may set: `--engine-option`'s, or `default` without any.
    pub fn engine_option_policy(
        &self,
        default: EngineOptionPolicy,
    ) -> anyhow::Result<EngineOptionPolicy> {
        if self.engine_options.is_empty() {
            return Ok(default);
        }
        EngineOptionPolicy::from_flag_values(&self.engine_options).map_err(anyhow::Error::msg)
    }

    /// The engine's /detokenize, for the viewer's token text, when the engine has one
    /// (llama.cpp, vLLM): base URL, model, API key.
    pub fn detokenizer(&self) -> Option<(String, Option<String>, Option<String>)> {
        match self.backend_kind {
            KindArg::Llamacpp | KindArg::Vllm => Some((
                self.backend.clone(),
                self.backend_model.clone(),
                self.backend_api_key.clone(),
            )),
            KindArg::Sglang => None,
        }
    }
}

/// Limits on every listener of the capture service (plain and transparent), so that slow or
/// hostile clients cannot starve harness calls.
#[derive(Args, Clone)]
pub struct LimitArgs {
    /// A new connection's request head must arrive whole within this (e.g. `10s`).
    #[arg(long, default_value = "10s", value_parser = tokentap_spool::parse_duration)]
    header_timeout: Duration,
    /// A request body must arrive whole within this.
    #[arg(long, default_value = "60s", value_parser = tokentap_spool::parse_duration)]
    body_timeout: Duration,
    /// A TLS handshake on the transparent listener must finish within this.
    #[arg(long, default_value = "10s", value_parser = tokentap_spool::parse_duration)]
    tls_handshake_timeout: Duration,
    /// A kept-alive connection without a new request for this long is closed.
    #[arg(long, default_value = "60s", value_parser = tokentap_spool::parse_duration)]
    idle_timeout: Duration,
    /// Connections open at once; more are closed at once.
    #[arg(long, default_value_t = 4096)]
    max_connections: usize,
    /// A request's head (target and headers) larger than this many bytes is refused (431)
    /// and not recorded.
    #[arg(long, default_value_t = 64 << 10)]
    max_header_bytes: usize,
}

impl LimitArgs {
    pub fn limits(&self) -> ListenerLimits {
        ListenerLimits {
            header_timeout: self.header_timeout,
            body_timeout: self.body_timeout,
            tls_handshake_timeout: self.tls_handshake_timeout,
            idle_timeout: self.idle_timeout,
            max_connections: self.max_connections,
            max_header_bytes: self.max_header_bytes,
        }
    }
}

pub fn run(args: ProxyArgs) -> anyhow::Result<()> {
    match args.listen.parse::<std::net::SocketAddr>() {
        Ok(listen) => tokentap_control_plane::check_exposure(
            listen,
            args.client_token.as_deref(),
            "--client-token",
            "TOKENTAP_CLIENT_TOKEN",
        )?,
        // A host name may resolve to anything: it is not known to be loopback-only.
        Err(_) if args.client_token.is_none() => anyhow::bail!(
            "refusing to listen on {} without --client-token (TOKENTAP_CLIENT_TOKEN): give a loopback address (127.0.0.1:PORT) or a token",
            args.listen
        ),
        Err(_) => {}
    }
    let (service, spool_thread) = args.capture.build(args.session.clone())?;
    let service = service.with_client_token(args.client_token.clone());
    let capture = &args.capture;
    let downstream = if capture.no_capture {
        None
    } else {
        args.downstream.start(
            &capture.spool,
            capture.ca_roots()?,
            service.metrics().downstream(),
        )?
    };

    let conf = ServerConf {
        threads: args.threads.max(1),
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(5),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut listener = Service::new("tokentap capture proxy".into(), service);
    listener.add_tcp(&args.listen);
    server.add_service(listener);
    tracing::info!(
        listen = %args.listen,
        // The engine URL's userinfo password stays out of the log.
        backend = %tokentap_proxy::redact::url(&capture.backend),
        spool = %capture.spool.display(),
        capture = !capture.no_capture,
        "tokentap proxy ready; point harnesses at http://{}/v1",
        args.listen
    );
    server.run(RunArgs::default());
    // The server is down: every sender of the sink is gone, so the writer drains and syncs.
    if let Some(handle) = spool_thread {
        let _ = handle.join();
    }
    // Open sessions stay open: a restarted proxy (or worker) resumes them.
    if let Some(d) = downstream {
        d.stop(false);
    }
    tracing::info!("tokentap proxy stopped");
    Ok(())
}

impl CaptureArgs {
    /// The `--ca-file` certificates (none without it).
    pub fn ca_roots(&self) -> anyhow::Result<Vec<reqwest::Certificate>> {
        tokentap_ship::shipper::load_ca_file(self.ca_file.as_deref())
    }

    /// The capture service and the spool writer's thread (join it after the service is gone).
    pub fn build(
        &self,
        fixed_session: Option<String>,
    ) -> anyhow::Result<(CaptureService, Option<std::thread::JoinHandle<()>>)> {
        self.build_observed(fixed_session, None)
    }

    /// [`CaptureArgs::build`], with `observer` seeing every batch the spool writer appends.
    pub fn build_observed(
        &self,
        fixed_session: Option<String>,
        observer: Option<tokentap_proxy::capture::RecordObserver>,
    ) -> anyhow::Result<(CaptureService, Option<std::thread::JoinHandle<()>>)> {
        let args = self;
        let backend_config = BackendConfig {
            kind: args.backend_kind.into(),
            url: args.backend.clone(),
            api_key: args.backend_api_key.clone(),
            ca_roots: args.ca_roots()?,
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(args.backend_timeout),
            max_answer_bytes: args.max_answer_bytes,
        };
        let backend: Arc<dyn backend::Backend> =
            Arc::from(backend::build(backend_config).context("configuring the backend")?);
        let backend_model = match args.backend_model.clone() {
            Some(m) => Some(m),
            None => backend::served_model(backend.as_ref()),
        };
        let metrics = Arc::new(Metrics::new());
        let (sink, spool_thread) = if args.no_capture {
            (RecordSink::Discard, None)
        } else {
            let writer = SpoolWriter::open(
                &args.spool,
                SpoolConfig {
                    segment_max_bytes: args.segment_bytes,
                    fsync: args.fsync,
                },
            )
            .with_context(|| format!("opening the spool at {}", args.spool.display()))?;
            let (sink, handle) =
                RecordSink::start(writer, metrics.clone(), observer, args.on_spool_error);
            (sink, Some(handle))
        };
        let config = ProxyConfig {
            max_body_bytes: args.max_body_bytes,
            synthetic_stream: args.synthetic_stream,
            backend_model,
            policy_version: args.policy_version.clone(),
            system_layout: args.system_layout,
            fixed_session,
            limits: args.limits.limits(),
            // `always` promises that an answered call is on disk: its record is written
            // before the harness gets the answer's end.
            durable_answers: args.fsync == FsyncPolicy::Always && !args.no_capture,
            // Set by the commands whose listener takes one (`proxy --client-token`).
            client_token: None,
            // Set by the commands whose sessions are authenticated (`serve`'s samples).
            session_budget: Default::default(),
            // The harness is the operator's own here; `serve` narrows the default.
            engine_options: args.engine_option_policy(EngineOptionPolicy::all())?,
        };
        let mut service = CaptureService::new(config, backend.clone(), sink, metrics);
        if let Some(observer) = self.token_observer(backend.as_ref())? {
            service = service.with_token_observer(observer);
        }
        Ok((service, spool_thread))
    }

    /// `--token-mode observe`: the model from `--tokenizer`, else from the file the engine
    /// names.
    fn token_observer(
        &self,
        backend: &dyn backend::Backend,
    ) -> anyhow::Result<Option<Arc<tokentap_token_mode::Observer>>> {
        if self.token_mode == tokentap_token_mode::TokenMode::Off {
            return Ok(None);
        }
        let path = match &self.tokenizer {
            Some(p) => p.clone(),
            None => block_on_engine(backend.model_file())
                .flatten()
                .map(PathBuf::from)
                .filter(|p| p.is_file())
                .context(
                    "--token-mode observe needs the model's tokenizer: give --tokenizer PATH (a Hugging Face model directory, a tokenizer.json or a GGUF); the engine named no model file readable here",
                )?,
        };
        let dialect = match self.backend_kind {
            KindArg::Llamacpp => tokentap_token_mode::EngineDialect::LlamaCpp,
            KindArg::Vllm | KindArg::Sglang => tokentap_token_mode::EngineDialect::Transformers,
        };
        let model = tokentap_token_mode::TokenModel::open(&path, dialect)
            .map_err(|e| anyhow::anyhow!("--token-mode observe: {e}"))?;
        tracing::info!(tokenizer = %path.display(), "token mode observe: rendering every call with the model's template");
        Ok(Some(Arc::new(tokentap_token_mode::Observer::new(
            model,
            Default::default(),
        ))))
    }
}

/// Runs one start-up question to the engine, bounded by 5 s; `None` if it took longer.
fn block_on_engine<T>(f: impl std::future::Future<Output = T>) -> Option<T> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), f).await })
        .ok()
}
