//! `tokentap webhook serve|cert`: the mutating admission webhook over HTTPS (the API server
//! calls webhooks over HTTPS only), and its serving certificate.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::{Args, Subcommand};
use tokentap_control_plane::bearer::{self, BearerToken};
use tokentap_webhook::{admit, cert, InjectConfig, Mode};

#[derive(Subcommand)]
pub enum WebhookCmd {
    /// Serve AdmissionReview v1 on POST /mutate (and GET /health).
    Serve(ServeArgs),
    /// Make a CA and a serving certificate for the webhook's Service.
    Cert(CertArgs),
}

#[derive(Args)]
pub struct ServeArgs {
    #[arg(long, default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    #[command(flatten)]
    tls: tokentap_control_plane::TlsListenArgs,
    /// Bearer token the API server sends (its admission kubeconfig); required beyond
    /// loopback unless --allow-unauthenticated.
    #[arg(long, env = "TOKENTAP_WEBHOOK_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Serve without a token (managed clusters whose API server cannot send one). The webhook
    /// holds no secret and only answers with a patch of the pod it was sent.
    #[arg(long)]
    allow_unauthenticated: bool,
    /// The tokentap image of the injected containers.
    #[arg(long)]
    image: String,
    /// The mode of pods without a tokentap.io/mode annotation.
    #[arg(long, value_parser = ["transparent", "sidecar"], default_value = "transparent")]
    default_mode: String,
    /// The ConfigMap (in the pod's namespace) with ca.pem and ca-bundle.pem (transparent mode).
    #[arg(long, default_value = "tokentap-ca")]
    ca_configmap: String,
    /// The port the node agent redirects, which await-capture probes.
    #[arg(long, default_value_t = 443)]
    redirect_port: u16,
    /// The engine the sidecar proxy calls (sidecar mode; a pod may name its own with the
    /// tokentap.io/backend and tokentap.io/backend-kind annotations).
    #[arg(long)]
    backend: Option<String>,
    #[arg(long)]
    backend_kind: Option<String>,
    /// Where sidecars ship records (never chosen by the pod: it would choose where its
    /// training data goes).
    #[arg(long)]
    ship_to: Option<String>,
    /// A Secret (key `token`) in the pod's namespace with the worker's token.
    #[arg(long)]
    ship_token_secret: Option<String>,
}

#[derive(Args)]
pub struct CertArgs {
    #[arg(long, default_value = "tokentap-webhook")]
    service: String,
    #[arg(long, default_value = "tokentap")]
    namespace: String,
    /// Directory for ca.crt, tls.crt and tls.key (0600).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 365)]
    days: u32,
}

/// The API server's own limit on an object is about 1.5 MiB; a review carries one (twice for
/// updates) plus its envelope.
const MAX_REVIEW_BYTES: usize = 3 << 20;
/// Warn when the serving certificate has less left than this.
const EXPIRY_WARNING: Duration = Duration::from_secs(7 * 86400);

pub fn run(cmd: WebhookCmd) -> anyhow::Result<()> {
    match cmd {
        WebhookCmd::Serve(args) => serve(args),
        WebhookCmd::Cert(args) => make_cert(args),
    }
}

fn make_cert(args: CertArgs) -> anyhow::Result<()> {
    use base64::Engine;
    let names = cert::service_names(&args.service, &args.namespace);
    let c = cert::generate(&names, args.days)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    std::fs::write(args.out.join("ca.crt"), &c.ca_pem)?;
    std::fs::write(args.out.join("tls.crt"), &c.cert_pem)?;
    tokentap_spool::owner_only::write(&args.out.join("tls.key"), c.key_pem.as_bytes())
        .with_context(|| format!("writing {}", args.out.join("tls.key").display()))?;
    eprintln!(
        "wrote ca.crt, tls.crt, tls.key (0600) in {} for {}, valid {} days; the caBundle of the MutatingWebhookConfiguration:",
        args.out.display(),
        names.join(", "),
        args.days
    );
    println!(
        "{}",
        base64::engine::general_purpose::STANDARD.encode(c.ca_pem.as_bytes())
    );
    Ok(())
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let Some(cert_path) = args.tls.tls_cert.clone() else {
        anyhow::bail!("the API server calls webhooks over HTTPS only: give --tls-cert and --tls-key (`tokentap webhook cert` makes them)");
    };
    let left = cert::remaining_validity(&cert_path)?;
    if left < EXPIRY_WARNING {
        tracing::warn!(cert = %cert_path.display(), days_left = left.as_secs() / 86400, "the webhook's certificate expires soon: renew it and the caBundle");
    }
    if args.allow_unauthenticated {
        tracing::warn!("--allow-unauthenticated: anyone who reaches {} may ask for patches (the webhook holds no secret and only patches the pod it is sent)", args.listen);
    } else {
        tokentap_control_plane::check_exposure(
            args.listen,
            args.token.as_deref(),
            "--token",
            "TOKENTAP_WEBHOOK_TOKEN",
        )
        .context("or --allow-unauthenticated where the API server cannot send one")?;
    }
    let config = Arc::new(InjectConfig {
        image: args.image.clone(),
        default_mode: Mode::parse(&args.default_mode).unwrap_or(Mode::Transparent),
        ca_configmap: args.ca_configmap.clone(),
        redirect_port: args.redirect_port,
        backend: args.backend.clone(),
        backend_kind: args.backend_kind.clone(),
        ship_to: args.ship_to.clone(),
        ship_token_secret: args.ship_token_secret.clone(),
    });
    let token = if args.allow_unauthenticated {
        BearerToken::new(None)
    } else {
        BearerToken::new(args.token.as_deref())
    };
    let app = Router::new()
        .route("/mutate", post(mutate))
        .route_layer(axum::middleware::from_fn_with_state(token, bearer::require))
        .route("/health", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state(config);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(tokentap_control_plane::serve(
        args.listen,
        &args.tls,
        app,
        crate::signals::shutdown_signal(),
        |listen, tls| tracing::info!(%listen, tls, "tokentap webhook ready"),
    ))
}

async fn mutate(State(config): State<Arc<InjectConfig>>, body: Bytes) -> Response {
    match admit(&body, &config) {
        Ok(review) => Json(review).into_response(),
        Err(e) => (
            StatusCode::BAD_REQUEST,
            Json(
                serde_json::json!({"error": {"message": e.to_string(), "type": "invalid_request"}}),
            ),
        )
            .into_response(),
    }
}
