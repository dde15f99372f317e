//! The one way long-running commands learn they should stop: Ctrl-C or SIGTERM.

/// Resolves on the first SIGINT or SIGTERM after it is first polled.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
