//! The static checks scripts/test runs before building, each on fixtures that must fail it and
//! their negative controls. `scripts/check-module-cycles` finds a circle made only of paths
//! written in code: one module naming the other's type in a signature, the other calling the
//! first's function. The check it replaced read cargo-modules' `use` edges and passed that crate
//! (issue 41); so did it pass the `tokentap` binary's two circles. `scripts/check-crate-deps`
//! fails a crate outside the capture service's embedders that reaches the proxy crate, directly
//! or through another crate. Each fixture is checked in a copy, so cargo's lock file never lands
//! in the tree.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tempfile::TempDir;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

fn check_fixture(script: &str, name: &str) -> Output {
    let dir = TempDir::new().unwrap();
    let copy = dir.path().join(name);
    let status = Command::new("cp")
        .arg("-r")
        .arg(repo().join("scripts/fixtures").join(name))
        .arg(&copy)
        .status()
        .unwrap();
    assert!(status.success(), "copying fixture {name}");
    Command::new(repo().join("scripts").join(script))
        .arg("--manifest-path")
        .arg(copy.join("Cargo.toml"))
        .output()
        .unwrap_or_else(|e| panic!("running scripts/{script}: {e}"))
}

#[test]
fn a_circle_of_paths_in_code_fails_the_check_and_is_named() {
    let out = check_fixture("check-module-cycles", "module-circle");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(
        stderr.contains("import circle between crate::args, crate::source")
            && stderr.contains("crate::args -> crate::source")
            && stderr.contains("crate::source -> crate::args"),
        "the circle and both of its edges are named: {stderr}"
    );
}

/// The negative control: the same modules with the references one way pass.
#[test]
fn the_same_modules_referring_one_way_pass() {
    let out = check_fixture("check-module-cycles", "module-no-circle");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("1 module imports, no circle"),
        "the one edge is seen: {stdout}"
    );
}

#[test]
fn a_crate_that_gains_a_proxy_dependency_fails_the_check_and_so_does_one_reaching_it() {
    let out = check_fixture("check-crate-deps", "crate-gains-proxy");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(
        stderr.contains("tokentap-reconstruct depends on tokentap-proxy (tokentap-reconstruct -> tokentap-proxy)")
            && stderr.contains("(tokentap-viewer -> tokentap-reconstruct -> tokentap-proxy)"),
        "the direct and the transitive dependent are named with their paths: {stderr}"
    );
}

/// The negative control: the proxy as a dev-dependency only (a test driving it) passes.
#[test]
fn a_proxy_dev_dependency_passes_the_crate_check() {
    let out = check_fixture("check-crate-deps", "crate-without-proxy");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("3 crates; tokentap-proxy is a normal dependency of no crate only"),
        "{stdout}"
    );
}
