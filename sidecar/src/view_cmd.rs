//! `tokentap view`: the trajectory viewer over a spool and traces, and the flags that choose
//! how token ids become text (shared with `tokentap serve`, whose nodes serve it at /view/).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use axum::Router;
use clap::Args;
use tokentap_control_plane::bearer::{self, BearerToken};
use tokentap_viewer::{TokenText, TraceFiles, ViewSources};

use crate::signals::shutdown_signal;

/// Where the viewer is served on every listener.
pub const PREFIX: &str = "/view";

/// How the viewer shows token text (display only: nothing is ever re-tokenized).
#[derive(Args, Clone)]
#[command(next_help_heading = "Token text in the viewer")]
pub struct TokenTextArgs {
    /// A tokenizer.json, a Hugging Face model directory, or a GGUF model file (its vocabulary
    /// and merges are used).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    #[command(flatten)]
    pub engine: DetokenizeArgs,
}

/// The viewer's token text from an engine. `serve` has only these: its `--tokenizer` is the
/// capture's (token mode), which the viewer uses too.
#[derive(Args, Clone)]
#[command(next_help_heading = "Token text in the viewer")]
pub struct DetokenizeArgs {
    /// Base URL of an engine whose /detokenize names each token (llama.cpp, vLLM).
    #[arg(long, value_name = "URL", conflicts_with = "tokenizer")]
    pub detokenize: Option<String>,
    /// The model name /detokenize is asked with (vLLM serving several).
    #[arg(long, requires = "detokenize")]
    pub detokenize_model: Option<String>,
}

impl DetokenizeArgs {
    /// `file` when given, else the chosen engine, else `engine` (a node's own engine), else
    /// ids only.
    pub fn token_text(
        &self,
        file: Option<&Path>,
        engine: Option<(String, Option<String>, Option<String>)>,
    ) -> anyhow::Result<TokenText> {
        if let Some(file) = file {
            return TokenText::from_file(file);
        }
        if let Some(url) = &self.detokenize {
            return TokenText::engine(url, self.detokenize_model.clone(), None);
        }
        match engine {
            Some((url, model, key)) => TokenText::engine(&url, model, key),
            None => Ok(TokenText::None),
        }
    }
}

#[derive(Args)]
#[command(after_help = "Examples:
  tokentap view --spool ./spool --traces ./traj --tokenizer ~/models/SmolLM2-135M-Instruct.Q4_1.gguf
  tokentap view --traces ./worker-out --detokenize http://127.0.0.1:8080
  TOKENTAP_VIEW_TOKEN=… tokentap view --spool ./spool --listen 0.0.0.0:8790 --tls-cert c.pem --tls-key k.pem

Prints the address to open; it carries the token in its #fragment, which the browser keeps and
never sends. A random token is made when none is given. A rollout node serves the same page at
/view/ on its control plane, behind the node's token.")]
pub struct ViewArgs {
    /// A spool directory: sessions, each call's timeline, request and answer.
    #[arg(long)]
    spool: Option<PathBuf>,
    /// A directory holding traces.jsonl files (up to 4 levels down): `reconstruct --out`,
    /// a worker's --out.
    #[arg(long)]
    traces: Option<PathBuf>,
    /// Address to serve on.
    #[arg(long, default_value = "127.0.0.1:8790")]
    listen: SocketAddr,
    /// Bearer token the data routes require [default: a random one, printed in the address].
    #[arg(long, env = "TOKENTAP_VIEW_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[command(flatten)]
    tls: tokentap_control_plane::TlsListenArgs,
    #[command(flatten)]
    text: TokenTextArgs,
}

/// The viewer's routes under [`PREFIX`], its data behind `token`.
pub fn routes(sources: ViewSources, token: Option<&str>) -> Router {
    let token = BearerToken::new(token);
    tokentap_viewer::router(PREFIX, sources, move |api| {
        api.route_layer(axum::middleware::from_fn_with_state(token, bearer::require))
    })
}

pub fn run(args: ViewArgs) -> anyhow::Result<()> {
    if args.spool.is_none() && args.traces.is_none() {
        anyhow::bail!("nothing to view: give --spool DIR, --traces DIR, or both");
    }
    if let Some(dir) = &args.traces {
        if !dir.is_dir() {
            anyhow::bail!("--traces {}: not a directory", dir.display());
        }
    }
    // Random unless given: the page is on a port any local user can reach.
    let token = match args.token.clone() {
        Some(t) if t.trim().is_empty() => anyhow::bail!("--token is empty"),
        Some(t) => t,
        None => format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        ),
    };
    let sources = ViewSources {
        spool: args.spool.clone(),
        traces: args.traces.clone().map(TraceFiles::Below),
        text: args
            .text
            .engine
            .token_text(args.text.tokenizer.as_deref(), None)
            .context("token text")?,
    };
    let app = routes(sources, Some(&token))
        .route(
            "/",
            axum::routing::get(|| async { axum::response::Redirect::to("/view/") }),
        )
        .route("/health", axum::routing::get(|| async { "ok" }));
    let rt = crate::runtime::build()?;
    rt.block_on(tokentap_control_plane::serve(
        args.listen,
        &args.tls,
        app,
        shutdown_signal(),
        move |listen, tls| {
            let scheme = if tls { "https" } else { "http" };
            println!("tokentap view: open {scheme}://{listen}{PREFIX}/#token={token}");
            tracing::info!(%listen, tls, "tokentap viewer ready");
        },
    ))
}
