//! `scripts/deps-cache` as a fresh machine runs it, offline: a cargo home that holds none of
//! the lock file's crates, and one that holds exactly what a build on this platform fetched
//! (no Linux build fetches the other platforms' crates, such as `android_system_properties`).
//! A save that resolved the whole lock file (`cargo metadata --offline`) failed there, and the
//! demo, which hid it, left CI to start cold (issues 36 and 40); from scripts/test's exit trap
//! it turned a green test run red. Each test works in a copy of the repository's tracked files,
//! so the real manifests and the script under test are the ones in this tree.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tempfile::TempDir;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

/// A copy of every tracked file (working-tree contents), a cargo home with nothing in it and
/// an empty tokentap cache.
struct FreshMachine {
    dir: TempDir,
}

/// The cargo home the tests themselves were built with (it holds every crate this platform's
/// build of the workspace needed).
fn runner_cargo_home() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cargo"))
}

fn host_triple() -> String {
    let out = Command::new("rustc").arg("-vV").output().expect("rustc");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV names its host")
        .to_string()
}

/// A hard link, or a copy where the two paths are on different file systems.
fn link_or_copy(from: &Path, to: &Path) {
    fs::create_dir_all(to.parent().unwrap()).unwrap();
    if fs::hard_link(from, to).is_err() {
        fs::copy(from, to).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    }
}

fn link_or_copy_tree(from: &Path, to: &Path) {
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if entry.file_type().unwrap().is_dir() {
            link_or_copy_tree(&src, &dst);
        } else {
            link_or_copy(&src, &dst);
        }
    }
}

impl FreshMachine {
    /// The machine after a first build: its cargo home holds the registry index and the
    /// `.crate` files of exactly the packages this platform resolves to (`cargo metadata
    /// --filter-platform HOST` on the runner's cargo home), nothing for other platforms.
    fn with_host_crates_fetched() -> Self {
        let machine = Self::new();
        let meta = Command::new("cargo")
            .args(["metadata", "--format-version", "1", "--offline", "--locked"])
            .args(["--filter-platform", &host_triple()])
            .current_dir(repo())
            .output()
            .expect("cargo");
        assert!(
            meta.status.success(),
            "cargo metadata --filter-platform on the runner's cargo home: {}",
            String::from_utf8_lossy(&meta.stderr)
        );
        let meta: serde_json::Value = serde_json::from_slice(&meta.stdout).unwrap();
        let registry = runner_cargo_home().join("registry");
        let home = machine.cargo_home().join("registry");
        // The registry's index (its cached entries are what an offline resolve reads).
        for entry in fs::read_dir(registry.join("index")).unwrap() {
            let entry = entry.unwrap();
            link_or_copy_tree(&entry.path(), &home.join("index").join(entry.file_name()));
        }
        let mut linked = 0;
        for cache in fs::read_dir(registry.join("cache")).unwrap() {
            let cache = cache.unwrap();
            for package in meta["packages"].as_array().unwrap() {
                if package["source"].is_null() {
                    continue; // a path package
                }
                let file = format!(
                    "{}-{}.crate",
                    package["name"].as_str().unwrap(),
                    package["version"].as_str().unwrap()
                );
                let from = cache.path().join(&file);
                if from.is_file() {
                    link_or_copy(
                        &from,
                        &home.join("cache").join(cache.file_name()).join(&file),
                    );
                    linked += 1;
                }
            }
        }
        assert!(
            linked > 100,
            "only {linked} crates found in {}",
            registry.display()
        );
        machine
    }

    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let listing = Command::new("git")
            .args(["ls-files", "-z"])
            .current_dir(repo())
            .output()
            .expect("git");
        assert!(listing.status.success(), "git ls-files failed");
        let copy = dir.path().join("repo");
        for rel in listing.stdout.split(|b| *b == 0).filter(|p| !p.is_empty()) {
            let rel = Path::new(std::str::from_utf8(rel).unwrap());
            let from = repo().join(rel);
            if !from.is_file() {
                continue; // deleted in the working tree
            }
            let to = copy.join(rel);
            fs::create_dir_all(to.parent().unwrap()).unwrap();
            fs::copy(&from, &to).unwrap();
        }
        fs::create_dir_all(dir.path().join("cargo-home")).unwrap();
        fs::create_dir_all(dir.path().join("cache")).unwrap();
        FreshMachine { dir }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("repo")
    }

    fn cache(&self) -> PathBuf {
        self.dir.path().join("cache")
    }

    fn cargo_home(&self) -> PathBuf {
        self.dir.path().join("cargo-home")
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.current_dir(self.root())
            .env("CARGO_HOME", self.cargo_home())
            .env("CARGO_NET_OFFLINE", "true")
            .env("TOKENTAP_CACHE", self.cache())
            .env_remove("DEPS_CACHE_TOOLCHAIN");
        cmd
    }

    fn deps_cache(&self, args: &[&str]) -> Output {
        self.deps_cache_with_cache(args, &self.cache())
    }

    fn deps_cache_with_cache(&self, args: &[&str], cache: &Path) -> Output {
        let out = self
            .command("bash")
            .arg("scripts/deps-cache")
            .args(args)
            .env("TOKENTAP_CACHE", cache)
            .output()
            .expect("bash");
        eprintln!(
            "deps-cache {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Files a build would leave: a crates.io dependency's (kept) and the path packages'
    /// (never kept), in the target directory `target` (relative to the copy's root).
    fn fake_build(&self, target: &str, profile_dir: &str, own: &[&str]) {
        let base = self.root().join(target).join(profile_dir);
        let write = |rel: &str| {
            let path = base.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, rel).unwrap();
        };
        write("deps/libserde-0123abcd.rlib");
        write("deps/libserde-0123abcd.rmeta");
        write(".fingerprint/serde-0123abcd/lib-serde");
        write("build/serde-4567ef01/out/private.rs");
        write("incremental/serde-0123abcd/state");
        for name in own {
            write(&format!("deps/lib{}-89ab.rlib", name.replace('-', "_")));
            write(&format!("deps/{name}-89ab"));
            write(&format!(".fingerprint/{name}-89ab/lib"));
            write(&format!("build/{name}-cdef/output"));
            write(name);
        }
    }
}

fn kept_files(cache: &Path) -> Vec<String> {
    let mut files = Vec::new();
    let mut stack = vec![cache.join("deps-cache")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.push(path.strip_prefix(cache).unwrap().display().to_string());
            }
        }
    }
    files.sort();
    files
}

fn assert_ok(out: &Output, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} exited {}", out.status);
    assert!(
        !stderr.contains("FAILED"),
        "{what} reported a failure:\n{stderr}"
    );
}

/// The command the save of issues 36 and 40 ran: a resolve of the whole lock file, which
/// wants every package downloaded, also those of other platforms.
fn full_resolve(machine: &FreshMachine) -> Output {
    machine
        .command("cargo")
        .args(["metadata", "--format-version", "1", "--offline"])
        .output()
        .expect("cargo")
}

#[test]
fn save_and_restore_work_with_none_of_the_lock_files_crates_fetched() {
    let machine = FreshMachine::new();

    // Positive control: this cargo home is a fresh machine's. Resolving the whole lock file
    // offline fails here, as the save of issue 36 did.
    assert!(
        !full_resolve(&machine).status.success(),
        "a full resolve worked offline with an empty cargo home: this is not a fresh machine"
    );
    save_and_restore(&machine);
}

#[test]
fn save_and_restore_work_with_only_the_host_platforms_crates_fetched() {
    let machine = FreshMachine::with_host_crates_fetched();

    // Positive controls: everything this platform's build needs is here (an offline fetch for
    // the host finds it all), and the old save's resolve fails on another platform's crate,
    // as it did on the fresh machine of issue 40 (`failed to download
    // android_system_properties … --offline was specified`).
    let fetch = machine
        .command("cargo")
        .args(["fetch", "--offline", "--locked", "--target", &host_triple()])
        .output()
        .expect("cargo");
    assert!(
        fetch.status.success(),
        "the host's crates are not all in the test's cargo home: {}",
        String::from_utf8_lossy(&fetch.stderr)
    );
    let full = full_resolve(&machine);
    let stderr = String::from_utf8_lossy(&full.stderr);
    assert!(
        !full.status.success() && stderr.contains("failed to download"),
        "a full resolve did not fail on a missing package: {}\n{stderr}",
        full.status
    );
    save_and_restore(&machine);
}

/// Restore into a fresh target dir, a build's files, save; a second clone's restore; the same
/// for the fuzz workspace: nothing may fail, only crates.io dependencies may be kept.
fn save_and_restore(machine: &FreshMachine) {
    // The workspace: restore (nothing kept yet), a build's files, save, then a new clone's
    // target dir restored from it.
    assert_ok(&machine.deps_cache(&["restore"]), "restore (empty cache)");
    let own = ["tokentap", "tokentap-proxy", "tokentap-schema"];
    machine.fake_build("target", "release", &own);
    assert_ok(&machine.deps_cache(&["save"]), "save");
    let kept = kept_files(&machine.cache());
    let seed = kept
        .iter()
        .find(|f| f.ends_with("release/deps/libserde-0123abcd.rlib"))
        .unwrap_or_else(|| panic!("the dependency was not kept: {kept:#?}"));
    assert!(seed.starts_with("deps-cache/workspace-"), "{seed}");
    for want in [
        "release/deps/libserde-0123abcd.rmeta",
        "release/.fingerprint/serde-0123abcd/lib-serde",
        "release/build/serde-4567ef01/out/private.rs",
    ] {
        assert!(
            kept.iter().any(|f| f.ends_with(want)),
            "{want} not kept: {kept:#?}"
        );
    }
    // Neither incremental state nor binaries uplifted into the profile directory.
    let stray: Vec<_> = kept
        .iter()
        .filter(|f| {
            f.contains("/incremental/")
                || f.split_once("/release/")
                    .is_some_and(|(_, rest)| !rest.contains('/'))
        })
        .collect();
    assert!(
        stray.is_empty(),
        "kept beyond deps, build and fingerprints: {stray:#?}"
    );
    for name in own {
        let form = name.replace('-', "_");
        let found: Vec<_> = kept
            .iter()
            .filter(|f| f.contains(&format!("/{name}-")) || f.contains(&format!("/lib{form}-")))
            .collect();
        assert!(
            found.is_empty(),
            "the path package {name} was kept: {found:#?}"
        );
    }

    fs::remove_dir_all(machine.root().join("target")).unwrap();
    assert_ok(
        &machine.deps_cache(&["restore"]),
        "restore (a second clone)",
    );
    let restored = machine
        .root()
        .join("target/release/deps/libserde-0123abcd.rlib");
    assert_eq!(
        fs::read_to_string(&restored).unwrap(),
        "deps/libserde-0123abcd.rlib"
    );
    assert!(!machine
        .root()
        .join("target/release/deps/libtokentap_proxy-89ab.rlib")
        .exists());

    // The fuzz workspace: its own package and its path dependencies on the root workspace's
    // crates are not kept either.
    assert_ok(
        &machine.deps_cache(&["restore", "fuzz/target"]),
        "restore (fuzz)",
    );
    machine.fake_build(
        "fuzz/target",
        "x86_64-unknown-linux-gnu/release",
        &[
            "tokentap-fuzz",
            "tokentap-proxy",
            "wire_chat_completions_request",
        ],
    );
    assert_ok(&machine.deps_cache(&["save", "fuzz/target"]), "save (fuzz)");
    let fuzz: Vec<_> = kept_files(&machine.cache())
        .into_iter()
        .filter(|f| f.starts_with("deps-cache/fuzz-"))
        .collect();
    assert!(
        fuzz.iter()
            .any(|f| f.ends_with("deps/libserde-0123abcd.rlib")),
        "{fuzz:#?}"
    );
    let own_kept: Vec<_> = fuzz
        .iter()
        .filter(|f| f.contains("89ab") || f.contains("cdef"))
        .collect();
    assert!(own_kept.is_empty(), "path packages kept: {own_kept:#?}");
}

#[test]
fn a_cache_that_cannot_be_written_or_read_never_fails_the_caller() {
    let machine = FreshMachine::new();
    // A cache path under a regular file: nothing can be created there.
    let blocked = machine.dir.path().join("not-a-directory");
    fs::write(&blocked, "").unwrap();
    let cache = blocked.join("cache");

    let restore = machine.deps_cache_with_cache(&["restore"], &cache);
    machine.fake_build("target", "release", &["tokentap"]);
    let save = machine.deps_cache_with_cache(&["save"], &cache);
    for (what, out) in [("restore", &restore), ("save", &save)] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{what} changed its caller's status: {}",
            out.status
        );
        // One loud line, not silence.
        assert_eq!(
            stderr.matches("[deps-cache] FAILED").count(),
            1,
            "{what} did not say it failed:\n{stderr}"
        );
    }

    // A wrong command line is the one thing that does fail.
    let usage = machine.deps_cache(&["sav"]);
    assert_eq!(usage.status.code(), Some(2));
}
