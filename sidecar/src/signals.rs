//! The one way long-running commands learn they should stop: Ctrl-C or SIGTERM.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Resolves on the first SIGINT or SIGTERM after it is first polled.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Sets `flag` when `signal` arrives (a thread waits on the signal through tokio).
pub fn signal_sets(signal: libc::c_int, flag: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a signal runtime");
        rt.block_on(async {
            use tokio::signal::unix::{signal as on, SignalKind};
            if let Ok(mut s) = on(SignalKind::from_raw(signal)) {
                s.recv().await;
                flag.store(true, Ordering::Relaxed);
            }
        });
    });
}
