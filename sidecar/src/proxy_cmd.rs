//! `tokentap proxy`: wires the backend adapter, the spool and the capture service into a
//! Pingora server (the flags every capturing command shares, and the service built from them,
//! are `tokentap_proxy::cli`).

use clap::Args;
use pingora::server::configuration::ServerConf;
use pingora::server::{RunArgs, Server};
use pingora::services::listening::Service;
use tokentap_proxy::cli::CaptureArgs;

use crate::downstream::DownstreamArgs;

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
