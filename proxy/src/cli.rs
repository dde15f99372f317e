//! The capturing commands' shared flags as clap arguments (the `clap` feature, for the
//! `tokentap` binary): the engine, the spool, the capture policy and the listener limits
//! ([`CaptureArgs`], [`LimitArgs`]), what transparent capture intercepts ([`InterceptArgs`]),
//! and the capture service built from them ([`CaptureArgs::build`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use tokentap_spool::{FsyncPolicy, SpoolConfig, SpoolWriter};

use crate::backend::{self, BackendConfig, BackendKind};
use crate::capture::{OnSpoolError, RecordSink};
use crate::metrics::Metrics;
use crate::tls::CertificateAuthority;
use crate::transparent::{InterceptList, DEFAULT_INTERCEPT};
use crate::{CaptureService, ProxyConfig};
use tokentap_service_kit::limits::ListenerLimits;
use tokentap_wire::engine_options::{EngineOption, EngineOptionPolicy};
use tokentap_wire::normalize::SystemLayout;

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
    /// Read the engine's own weight version (vLLM's `GET /weight_info`) just before each call
    /// and once its answer ends, and record both (`backend.engine_weight_version`): the
    /// weights the engine served beside `--policy-version`, and a call they changed under
    /// (`straddles_weight_update` on its trace call). vLLM only; two small reads per call.
    #[arg(long)]
    engine_weight_version: bool,
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
    /// `tito` (token in, token out): tokentap builds each prompt's ids from the
    /// ids the engine saw and sampled before plus the new messages, calls the engine with
    /// ids, and reads the answer back itself, so later turns condition on exactly the
    /// sampled tokens (docs/token-in.md).
    #[arg(long, default_value = "off", value_name = "off|observe|tito")]
    token_mode: tokentap_token_mode::TokenMode,
    /// `--token-mode tito`: also render these calls' conversations in full, as text mode
    /// would send them, and compare with the ids tito built; each difference is content drift
    /// (inside sampled tokens: expected) or boundary drift (tito wrote the template's frame
    /// differently: a bug, logged and counted in tokentap_token_mode_tito_verify_*). On the
    /// record as `token_in.verify`. Costs a full render per verified call.
    #[arg(long, default_value = "off", value_name = "off|always|sample:N%")]
    token_verify: tokentap_token_mode::TokenVerify,
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

    /// `--token-mode`: the mode the service is built in.
    pub fn token_mode(&self) -> tokentap_token_mode::TokenMode {
        self.token_mode
    }

    /// The engine called with text, as `--token-mode off` calls it: what a service built in
    /// another mode sends the sessions it runs in text mode to
    /// ([`CaptureService::with_text_mode_sessions`]).
    pub fn text_backend(&self) -> anyhow::Result<Arc<dyn backend::Backend>> {
        let backend = backend::build(self.backend_config()?).context("configuring the backend")?;
        self.engine_versioned(Arc::from(backend))
    }

    /// `backend` as `--engine-weight-version` asks: read around each call, or as it is.
    fn engine_versioned(
        &self,
        backend: Arc<dyn backend::Backend>,
    ) -> anyhow::Result<Arc<dyn backend::Backend>> {
        if !self.engine_weight_version {
            return Ok(backend);
        }
        Ok(backend::with_engine_weight_version(
            backend,
            &self.backend_config()?,
        )?)
    }

    /// How the engine is reached: `--backend`, its kind, key, CA and limits.
    fn backend_config(&self) -> anyhow::Result<BackendConfig> {
        Ok(BackendConfig {
            kind: self.backend_kind.into(),
            url: self.backend.clone(),
            api_key: self.backend_api_key.clone(),
            ca_roots: self.ca_roots()?,
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(self.backend_timeout),
            max_answer_bytes: self.max_answer_bytes,
        })
    }

    /// `--tokenizer`: the model's tokenizer and template, when given.
    pub fn tokenizer(&self) -> Option<&std::path::Path> {
        self.tokenizer.as_deref()
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

impl CaptureArgs {
    /// The `--ca-file` certificates (none without it).
    pub fn ca_roots(&self) -> anyhow::Result<Vec<reqwest::Certificate>> {
        load_ca_file(self.ca_file.as_deref())
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
        observer: Option<crate::capture::RecordObserver>,
    ) -> anyhow::Result<(CaptureService, Option<std::thread::JoinHandle<()>>)> {
        let args = self;
        let mut backend = self.text_backend()?;
        let token_model = self.token_model(backend.as_ref())?;
        let token_observer = match (self.token_mode, token_model) {
            (tokentap_token_mode::TokenMode::Observe, Some(model)) => Some(Arc::new(
                tokentap_token_mode::Observer::new(model, Default::default()),
            )),
            (tokentap_token_mode::TokenMode::Tito, Some(model)) => {
                let tito = Arc::new(
                    tokentap_token_mode::Tito::new(model, Default::default())
                        .map_err(|e| anyhow::anyhow!("--token-mode tito: {e}"))?,
                );
                tracing::info!(family = %tito.dialect().family, reasoning = tito.dialect().reasoning, "token mode tito: prompts built from the conversation's ids, answers read back by tokentap");
                // What the start-up probe found in the model's template, construct by construct.
                for finding in tito.probe_report() {
                    tracing::info!("token mode tito: the template: {finding}");
                }
                backend = self.engine_versioned(Arc::from(
                    backend::build_tito(self.backend_config()?, tito, self.token_verify)
                        .context("configuring the backend")?,
                ))?;
                None
            }
            _ => None,
        };
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
        if let Some(observer) = token_observer {
            service = service.with_token_observer(observer);
        }
        Ok((service, spool_thread))
    }

    /// `--token-mode observe|tito`: the model from `--tokenizer`, else from the file the
    /// engine names.
    fn token_model(
        &self,
        backend: &dyn backend::Backend,
    ) -> anyhow::Result<Option<tokentap_token_mode::TokenModel>> {
        let mode = match self.token_mode {
            tokentap_token_mode::TokenMode::Off => return Ok(None),
            tokentap_token_mode::TokenMode::Observe => "observe",
            tokentap_token_mode::TokenMode::Tito => "tito",
        };
        let path = match &self.tokenizer {
            Some(p) => p.clone(),
            None => backend::block_on_engine(backend.model_file())
                .flatten()
                .map(PathBuf::from)
                .filter(|p| p.is_file())
                .with_context(|| format!(
                    "--token-mode {mode} needs the model's tokenizer: give --tokenizer PATH (a Hugging Face model directory, a tokenizer.json or a GGUF); the engine named no model file readable here",
                ))?,
        };
        let dialect = match self.backend_kind {
            KindArg::Llamacpp => tokentap_token_mode::EngineDialect::LlamaCpp,
            KindArg::Vllm | KindArg::Sglang => tokentap_token_mode::EngineDialect::Transformers,
        };
        let model = tokentap_token_mode::TokenModel::open(&path, dialect)
            .map_err(|e| anyhow::anyhow!("--token-mode {mode}: {e}"))?;
        tracing::info!(tokenizer = %path.display(), "token mode {mode}: rendering every call with the model's template");
        Ok(Some(model))
    }
}

/// What is intercepted, and with which CA (`run`, `sidecar` and the rollout node).
#[derive(Args, Clone)]
pub struct InterceptArgs {
    /// Also intercept this host (repeatable; `*.example.com` for subdomains). Defaults:
    /// api.openai.com, api.anthropic.com, chatgpt.com, generativelanguage.googleapis.com,
    /// dashscope.aliyuncs.com.
    #[arg(long = "intercept", value_name = "HOST")]
    intercept: Vec<String>,
    /// Intercept only the `--intercept` hosts, not the defaults.
    #[arg(long)]
    no_default_intercept: bool,
    /// Destination port whose TCP connects are redirected (repeatable; default 443).
    #[arg(long = "redirect-port", value_name = "PORT")]
    redirect_ports: Vec<u16>,
    /// Directory of the local CA (created on first use).
    #[arg(long, env = "TOKENTAP_CA_DIR")]
    ca_dir: Option<PathBuf>,
}

impl InterceptArgs {
    /// The CA in `--ca-dir`, else in `default_dir`, created on first use.
    pub fn ca(&self, default_dir: PathBuf) -> anyhow::Result<Arc<CertificateAuthority>> {
        let dir = self.ca_dir.clone().unwrap_or(default_dir);
        let (ca, created) = CertificateAuthority::load_or_create(&dir)?;
        if created {
            tracing::info!(cert = %ca.cert_path().display(), "created the local interception CA");
        }
        Ok(Arc::new(ca))
    }

    pub fn intercept_list(&self) -> InterceptList {
        let defaults: &[&str] = if self.no_default_intercept {
            &[]
        } else {
            DEFAULT_INTERCEPT
        };
        InterceptList::new(
            defaults
                .iter()
                .map(|s| s.to_string())
                .chain(self.intercept.iter().cloned()),
        )
    }

    pub fn ports(&self) -> Vec<u16> {
        if self.redirect_ports.is_empty() {
            vec![443]
        } else {
            self.redirect_ports.clone()
        }
    }
}

/// The CA certificates of a `--ca-file` (PEM, one or more), to trust besides the built-in
/// roots; none without one.
pub fn load_ca_file(path: Option<&Path>) -> anyhow::Result<Vec<reqwest::Certificate>> {
    let Some(path) = path else {
        return Ok(Vec::new());
    };
    let pem =
        std::fs::read(path).with_context(|| format!("reading --ca-file {}", path.display()))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .with_context(|| format!("--ca-file {}: not PEM certificates", path.display()))?;
    if certs.is_empty() {
        anyhow::bail!("--ca-file {}: no certificate in it", path.display());
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        capture: CaptureArgs,
        #[command(flatten)]
        interception: InterceptArgs,
    }

    fn parse(args: &[&str]) -> Result<Cmd, clap::Error> {
        Cmd::try_parse_from(["tokentap"].iter().chain(args))
    }

    /// `extra` after a vLLM engine nothing listens at (the port was bound, then let go), its
    /// model given so that none is asked for.
    fn at_closed_engine(extra: &[&str]) -> Cmd {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let engine = format!("http://{}", closed.local_addr().unwrap());
        let base = [
            "--backend",
            &engine,
            "--backend-kind=vllm",
            "--backend-model=m",
        ];
        parse(&[&base[..], extra].concat()).unwrap()
    }

    #[test]
    fn the_defaults_are_the_documented_ones() {
        let cmd = parse(&["--backend", "http://e:8000", "--backend-kind", "vllm"]).unwrap();
        let c = &cmd.capture;
        assert_eq!(c.spool, Path::new(DEFAULT_SPOOL));
        assert_eq!(c.fsync, "100ms".parse::<FsyncPolicy>().unwrap());
        assert_eq!(c.token_mode, tokentap_token_mode::TokenMode::Off);
        assert!(!c.no_capture && c.policy_version.is_none());
        assert_eq!(c.limits.limits(), ListenerLimits::default());
        // Without --engine-option, the command's own default holds.
        let rollout = EngineOptionPolicy::rollout_default();
        assert_eq!(c.engine_option_policy(rollout.clone()).unwrap(), rollout);
        assert_eq!(cmd.interception.ports(), vec![443]);
        assert!(cmd.interception.intercept_list().contains("api.openai.com"));
    }

    #[test]
    fn flags_reach_the_limits_the_policy_and_the_interception() {
        let cmd = parse(&[
            "--backend=http://e",
            "--backend-kind=sglang",
            "--header-timeout=2s",
            "--max-connections=3",
            "--engine-option=logit_bias",
            "--no-default-intercept",
            "--intercept=*.example.com",
            "--redirect-port=8443",
        ])
        .unwrap();
        let limits = cmd.capture.limits.limits();
        assert_eq!(limits.header_timeout, Duration::from_secs(2));
        assert_eq!(limits.max_connections, 3);
        let policy = cmd
            .capture
            .engine_option_policy(EngineOptionPolicy::all())
            .unwrap();
        assert_eq!(policy.names(), vec!["logit_bias"]);
        let list = cmd.interception.intercept_list();
        assert!(list.contains("api.example.com") && !list.contains("api.openai.com"));
        assert_eq!(cmd.interception.ports(), vec![8443]);
    }

    #[test]
    fn bad_values_are_refused_naming_the_flag() {
        for (bad, flag) in [
            ("--fsync=sometimes", "--fsync"),
            ("--engine-option=temperature_of_the_sun", "--engine-option"),
            ("--token-mode=replace", "--token-mode"),
            ("--on-spool-error=ignore", "--on-spool-error"),
            ("--body-timeout=soon", "--body-timeout"),
        ] {
            let e = parse(&["--backend=http://e", "--backend-kind=vllm", bad])
                .err()
                .unwrap_or_else(|| panic!("{bad} was taken"));
            // A value outside a fixed list is invalid; one its parser refuses, not valid.
            assert!(
                matches!(
                    e.kind(),
                    clap::error::ErrorKind::ValueValidation | clap::error::ErrorKind::InvalidValue
                ),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains(flag), "{bad}: {e}");
        }
        let e = parse(&["--backend=http://e"]).err().unwrap();
        assert_eq!(e.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        assert!(e.to_string().contains("--backend-kind"), "{e}");
    }

    #[test]
    fn only_engines_with_a_detokenize_offer_one() {
        let llama = parse(&[
            "--backend=http://e",
            "--backend-kind=llamacpp",
            "--backend-model=m",
        ])
        .unwrap();
        assert_eq!(
            llama.capture.detokenizer(),
            Some(("http://e".to_owned(), Some("m".to_owned()), None))
        );
        let sglang = parse(&["--backend=http://e", "--backend-kind=sglang"]).unwrap();
        assert_eq!(sglang.capture.detokenizer(), None);
    }

    #[test]
    fn build_opens_the_spool_unless_capture_is_off() {
        let dir = tempfile::tempdir().unwrap();
        let spool = dir.path().join("spool");
        let on = at_closed_engine(&["--spool", spool.to_str().unwrap()]);
        let (service, thread) = on.capture.build(Some("s".into())).unwrap();
        assert!(spool.is_dir() && thread.is_some());
        // The writer drains and ends once the service (its sink's sender) is gone.
        drop(service);
        thread.unwrap().join().unwrap();

        let elsewhere = dir.path().join("never");
        let off = at_closed_engine(&["--no-capture", "--spool", elsewhere.to_str().unwrap()]);
        let (_service, thread) = off.capture.build(None).unwrap();
        assert!(thread.is_none() && !elsewhere.exists());
    }

    #[test]
    fn token_mode_observe_without_a_tokenizer_says_how_to_give_one() {
        let cmd = at_closed_engine(&["--no-capture", "--token-mode", "observe"]);
        let e = cmd.capture.build(None).err().unwrap().to_string();
        assert!(e.contains("--tokenizer PATH"), "{e}");
        let missing = at_closed_engine(&[
            "--no-capture",
            "--token-mode=observe",
            "--tokenizer=/no/such/model",
        ]);
        let e = missing.capture.build(None).err().unwrap().to_string();
        assert!(
            e.starts_with("--token-mode observe: ") && e.contains("/no/such/model"),
            "{e}"
        );
    }

    #[test]
    fn the_interception_ca_is_created_once_then_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let cmd = parse(&["--backend=http://e", "--backend-kind=vllm"]).unwrap();
        let first = cmd.interception.ca(dir.path().join("ca")).unwrap();
        let again = cmd.interception.ca(dir.path().join("ca")).unwrap();
        assert_eq!(first.cert_pem(), again.cert_pem());
    }

    #[test]
    fn a_ca_file_must_hold_certificates() {
        assert!(load_ca_file(None).unwrap().is_empty());
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.pem");
        let e = load_ca_file(Some(&missing)).unwrap_err().to_string();
        assert!(e.starts_with("reading --ca-file"), "{e}");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no PEM here\n").unwrap();
        let e = load_ca_file(Some(&empty)).unwrap_err().to_string();
        assert!(
            e.contains("no certificate in it") || e.contains("not PEM"),
            "{e}"
        );
        let (ca, _) = CertificateAuthority::load_or_create(&dir.path().join("ca")).unwrap();
        assert_eq!(load_ca_file(Some(&ca.cert_path())).unwrap().len(), 1);
    }
}
