//! Builds the kernel program (`ebpf/program`) for `bpfel-unknown-none` with nightly, rust-src
//! and bpf-linker (`scripts/setup --only ebpf` installs them), and hands its path to the crate
//! as `TOKENTAP_EBPF_OBJECT`. Without that toolchain the crate still builds, with an empty
//! object and a warning; loading then fails with a message that says what to install.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let program = manifest.join("../program");
    let common = manifest.join("../common");
    for p in [
        program.join("src"),
        program.join("Cargo.toml"),
        program.join("Cargo.lock"),
        common.join("src"),
    ] {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    println!("cargo:rerun-if-env-changed=TOKENTAP_CACHE");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap());
    let object = out.join("tokentap-redirect.o");

    match build(&program, &out) {
        Ok(built) => {
            std::fs::copy(&built, &object).expect("copy the eBPF object");
        }
        Err(why) => {
            println!("cargo:warning=tokentap-ebpf: the kernel program was not built ({why}); transparent capture will be unavailable. Run scripts/setup --only ebpf and rebuild.");
            // A path that never exists makes cargo run this script again on every build, so
            // the program is built as soon as the toolchain appears (`scripts/demo` before
            // `scripts/setup --only ebpf` in one clone would otherwise keep the empty object).
            println!(
                "cargo:rerun-if-changed={}",
                out.join("toolchain-missing-retry").display()
            );
            std::fs::write(&object, b"").expect("write the placeholder object");
        }
    }
    println!("cargo:rustc-env=TOKENTAP_EBPF_OBJECT={}", object.display());
}

fn build(program: &Path, out: &Path) -> Result<PathBuf, String> {
    // bpf-linker from the setup cache, found without the caller's PATH being set up.
    let cache = std::env::var_os("TOKENTAP_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tokentap")))
        .ok_or("no HOME")?;
    let mut path = std::env::var_os("PATH").unwrap_or_default();
    let linker_dir = cache.join("bpf-linker/bin");
    if linker_dir.join("bpf-linker").exists() {
        let mut dirs = vec![linker_dir];
        dirs.extend(std::env::split_paths(&path));
        path = std::env::join_paths(dirs).map_err(|e| e.to_string())?;
    }
    // Without the linker the nested build can only fail, and only after compiling `core` for
    // the BPF target (about 40 s of a 2-core machine's time in every fresh build, the demo's
    // among them): say so at once.
    if !std::env::split_paths(&path).any(|dir| dir.join("bpf-linker").is_file()) {
        return Err("bpf-linker not found".into());
    }
    let target_dir = out.join("ebpf-target");
    let mut cmd = Command::new("rustup");
    cmd.args([
        "run",
        "nightly",
        "cargo",
        "build",
        "--release",
        "--locked",
        "--target",
        "bpfel-unknown-none",
        "-Z",
        "build-std=core",
        // aya-ebpf's own dependencies may name a newer rust-version than nightly has.
        "--ignore-rust-version",
        "--manifest-path",
    ])
    .arg(program.join("Cargo.toml"))
    .arg("--target-dir")
    .arg(&target_dir)
    .env("PATH", path);
    // This build script's own toolchain settings must not leak into the nested build.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("CARGO_")
            && k != "CARGO_HOME"
            && k != "CARGO_MAKEFLAGS"
            && k != "CARGO_NET_OFFLINE"
            || k.starts_with("RUSTC")
            || k == "RUSTFLAGS"
            || k == "RUSTUP_TOOLCHAIN"
            || k == "RUSTDOCFLAGS"
        {
            cmd.env_remove(k.as_ref());
        }
    }
    let output = cmd.output().map_err(|e| format!("running rustup: {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(format!(
            "`rustup run nightly cargo build --target bpfel-unknown-none` failed:\n{}",
            tail.join("\n")
        ));
    }
    Ok(target_dir.join("bpfel-unknown-none/release/tokentap-redirect"))
}
