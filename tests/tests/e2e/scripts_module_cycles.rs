//! `scripts/check-module-cycles` finds a circle made only of paths written in code: one module
//! naming the other's type in a signature, the other calling the first's function. The check
//! it replaced read cargo-modules' `use` edges and passed that crate (issue 41); so did it pass
//! the `tokentap` binary's two circles. Each fixture is checked in a copy, so cargo's lock file
//! never lands in the tree.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tempfile::TempDir;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

fn check_fixture(name: &str) -> Output {
    let dir = TempDir::new().unwrap();
    let copy = dir.path().join(name);
    let status = Command::new("cp")
        .arg("-r")
        .arg(repo().join("scripts/fixtures").join(name))
        .arg(&copy)
        .status()
        .unwrap();
    assert!(status.success(), "copying fixture {name}");
    Command::new(repo().join("scripts/check-module-cycles"))
        .arg("--manifest-path")
        .arg(copy.join("Cargo.toml"))
        .output()
        .expect("running scripts/check-module-cycles")
}

#[test]
fn a_circle_of_paths_in_code_fails_the_check_and_is_named() {
    let out = check_fixture("module-circle");
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
    let out = check_fixture("module-no-circle");
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
