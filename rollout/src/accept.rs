//! Accept loops that a flood cannot stop. A sample's agent can open connections to its capture
//! until the node runs out of file descriptors; an accept loop that ends on the first error
//! (`while let Ok(..) = accept()`) then stops capturing for every sample, for good. These loops
//! retry every error instead, backing off while descriptors are short, and a sandboxed
//! sample's own socket holds at most [`MAX_CONNECTIONS_PER_SAMPLE`] connections at once.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::now_ms;

/// Most connections one sandboxed sample may hold open to the node at once. A harness uses a
/// handful (one per concurrent model call, plus keep-alive); more are closed at once, so one
/// sample can never take the descriptors the node and the other samples need.
pub const MAX_CONNECTIONS_PER_SAMPLE: usize = 64;

/// The next connection `accept` gives (a listener's `accept`, a `TcpListener`'s or a
/// `UnixListener`'s), however many times it fails first: every error is waited out as it
/// fits ([`after_accept_error`]) and tried again, so a loop over this ends only when it is
/// dropped. `listener` names it in the log.
pub async fn accept_retrying<T, F, Fut>(mut accept: F, listener: &'static str) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = io::Result<T>>,
{
    loop {
        match accept().await {
            Ok(accepted) => return accepted,
            Err(e) => after_accept_error(&e, listener).await,
        }
    }
}

/// Waits as fits the error of a failed `accept` (every error is retried; a listener is given
/// up only when its loop is dropped). Out of descriptors (EMFILE, ENFILE) or of kernel
/// memory, the wait lets the connections being served finish and free theirs; a connection
/// that was reset before it could be accepted is simply skipped. Logged at most once a second
/// per kind of listener.
async fn after_accept_error(e: &io::Error, listener: &'static str) {
    static LAST_LOGGED_MS: AtomicU64 = AtomicU64::new(0);
    let delay = match e.raw_os_error() {
        Some(libc::ECONNABORTED | libc::EINTR | libc::EPROTO) => return,
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => {
            Duration::from_millis(100)
        }
        _ => Duration::from_millis(50),
    };
    let now = now_ms();
    let last = LAST_LOGGED_MS.load(Ordering::Relaxed);
    if now.saturating_sub(last) >= 1000
        && LAST_LOGGED_MS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        tracing::warn!(listener, error = %e, "accepting a connection failed; still listening");
    }
    tokio::time::sleep(delay).await;
}

/// Raises this process's soft limit of open files to its hard limit (the default soft limit,
/// often 1024, is what a flood of connections reaches first). Returns the limit in force.
pub fn raise_open_files_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return Err(io::Error::last_os_error());
        }
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
    }
    Ok(lim.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs out of descriptors on purpose, so it runs in a process of its own (this test
    /// binary again, this test alone): under `cargo test` other tests share the process.
    #[test]
    fn an_accept_loop_outlives_running_out_of_descriptors() {
        const ALONE: &str = "TOKENTAP_TEST_ALONE";
        if std::env::var_os(ALONE).is_some() {
            return tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(run_out_of_descriptors());
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "accept::tests::an_accept_loop_outlives_running_out_of_descriptors",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ALONE, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("1 passed"),
            "the test did not run alone: {text}"
        );
    }

    async fn run_out_of_descriptors() {
        use std::os::fd::{FromRawFd, OwnedFd};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        use std::os::fd::AsRawFd;
        // The test's own process (nextest runs each test in one) runs out of descriptors while
        // a client waits to be accepted: a low limit, then every descriptor taken.
        let low = libc::rlimit {
            rlim_cur: 256,
            rlim_max: libc::RLIM_INFINITY,
        };
        let mut lim = low;
        // SAFETY: getrlimit/setrlimit with valid pointers to local rlimits.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
            lim.rlim_cur = lim.rlim_cur.min(low.rlim_cur);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
        let mut hog: Vec<OwnedFd> = Vec::new();
        let client = std::net::TcpStream::connect(addr).unwrap();
        loop {
            // SAFETY: dup of a descriptor we hold; the result is owned by `hog`, or is -1.
            let fd = unsafe { libc::dup(client.as_raw_fd()) };
            if fd < 0 {
                assert_eq!(
                    io::Error::last_os_error().raw_os_error(),
                    Some(libc::EMFILE)
                );
                break;
            }
            hog.push(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        let first = listener.accept().await;
        let err = first.expect_err("accept works with no descriptor left");
        assert_eq!(err.raw_os_error(), Some(libc::EMFILE));
        // The loops' way: wait, then accept again once descriptors are free.
        let freeing = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            drop(hog);
        });
        let accepted = tokio::time::timeout(
            Duration::from_secs(5),
            accept_retrying(|| listener.accept(), "test"),
        )
        .await;
        freeing.await.unwrap();
        assert!(
            accepted.is_ok(),
            "never accepted after descriptors came back"
        );
        drop(client);
    }
}
