//! Tests whose real parts need privileges (root, cgroup v2, a kernel feature, a tool the
//! machine lacks). Nothing skips in silence: with `TOKENTAP_REQUIRE_PRIVILEGED=1` (which
//! `.ci/run` sets) a test that cannot run its real parts fails; otherwise it says it skipped,
//! on stderr and in the file `$TOKENTAP_SKIP_LOG`, which `scripts/test` prints as a summary.

use std::io::Write;

/// The variable that turns every skip into a failure.
pub const REQUIRE: &str = "TOKENTAP_REQUIRE_PRIVILEGED";
/// Where skips are listed (one line each) for the run's summary.
pub const SKIP_LOG: &str = "TOKENTAP_SKIP_LOG";

/// Whether the calling test may go on: `Ok` runs; `Err(why)` panics under
/// `TOKENTAP_REQUIRE_PRIVILEGED=1`, else reports the skip and returns false.
pub fn runs(requirement: Result<(), String>) -> bool {
    let Err(why) = requirement else {
        return true;
    };
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    if std::env::var(REQUIRE).is_ok_and(|v| v == "1") {
        panic!("{test} cannot run its real parts ({why}) and {REQUIRE}=1 forbids skipping it");
    }
    eprintln!("skipped: {why}");
    if let Some(log) = std::env::var_os(SKIP_LOG) {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            // One write per line: concurrent test processes append without interleaving.
            let _ = f.write_all(format!("{test}: {why}\n").as_bytes());
        }
    }
    false
}

/// Root and a cgroup v2 hierarchy (what transparent capture and sample cgroups need).
pub fn root_with_cgroup2() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root".into());
    }
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    if !mounts.contains(" cgroup2 ") {
        return Err("needs a cgroup v2 hierarchy".into());
    }
    Ok(())
}

/// Root (the sandbox's uid drop) and bubblewrap on PATH: what a sandboxed rollout node needs.
pub fn root_with_bwrap() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root (the sandbox's uid drop)".to_owned());
    }
    let path = std::env::var("PATH").unwrap_or_default();
    if tokentap_rollout::runner::on_path("bwrap", &path).is_none() {
        return Err("needs bubblewrap (bwrap) on PATH".to_owned());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_met_requirement_runs() {
        assert!(runs(Ok(())));
    }

    #[test]
    fn an_unmet_requirement_fails_when_skipping_is_forbidden() {
        // Each nextest test is a process of its own, so the variable stays with this test.
        std::env::set_var(REQUIRE, "1");
        let r = std::panic::catch_unwind(|| runs(Err("needs a unicorn".into())));
        std::env::remove_var(REQUIRE);
        let msg = r.unwrap_err();
        let msg = msg.downcast_ref::<String>().unwrap();
        assert!(
            msg.contains("needs a unicorn") && msg.contains(REQUIRE),
            "{msg}"
        );
    }

    #[test]
    fn an_unmet_requirement_is_logged_as_a_skip() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("skips");
        std::env::remove_var(REQUIRE);
        std::env::set_var(SKIP_LOG, &log);
        assert!(!runs(Err("needs a unicorn".into())));
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(
            text.contains("an_unmet_requirement_is_logged_as_a_skip: needs a unicorn"),
            "{text}"
        );
    }
}
