//! The trajectory viewer (`tokentap view`, and `/view/` on `tokentap serve` nodes): a small web
//! page over a spool and traces — the sessions; one session's timeline (each call a bar, the
//! engine's time against the harness's time between calls); a trace's tokens coloured by mask
//! and shaded by logprob, with text and id on hover; each call's request and answer.
//!
//! The page is static and holds no data; everything it shows comes from `PREFIX/api/*`, which
//! the binary puts behind the control plane's bearer token (the page reads the token from its
//! URL's fragment, which browsers never send to a server). Captured text is hostile: the page
//! only ever writes it with `textContent`, and the content security policy forbids inline and
//! foreign scripts besides.

pub mod api;
pub mod assets;
pub mod calls;
pub mod token_text;
pub mod traces;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::Router;

pub use token_text::TokenText;
pub use traces::TraceFiles;

/// What to show.
pub struct ViewSources {
    /// A spool directory (calls, records).
    pub spool: Option<PathBuf>,
    /// Where traces are.
    pub traces: Option<TraceFiles>,
    /// How token ids become text.
    pub text: TokenText,
}

/// The viewer's routes under `prefix` (e.g. `/view`): the page, open to anyone who can reach
/// the listener (it holds no data), and the data routes, passed through `guard` (the caller's
/// authentication).
pub fn router(prefix: &str, sources: ViewSources, guard: impl FnOnce(Router) -> Router) -> Router {
    let shared = Arc::new(api::Sources {
        calls: sources
            .spool
            .map(|dir| Mutex::new(calls::SpoolCalls::new(&dir))),
        traces: sources
            .traces
            .map(|f| Mutex::new(traces::TraceIndex::new(f))),
        text: sources.text,
    });
    assets::router(prefix)
        .merge(guard(api::router(prefix, shared)))
        .layer(axum::middleware::map_response(assets::security_headers))
}
