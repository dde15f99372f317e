//! The tokio runtime of the commands that serve a node's APIs (serve, generate, view): one
//! module of its own, so that those commands share it without importing each other.

/// Two worker threads: the control plane and the capture listeners are I/O-bound, and the
/// agents' sandboxes, not this process, are what a node's cores are for.
pub fn build() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}
