//! `scripts/deps-cache` as a fresh machine runs it: a cargo home that holds none of the
//! lock file's crates (no Linux build fetches the other platforms' ones, such as
//! `android_system_properties`), offline. A save that resolved the whole lock file failed
//! there and, from scripts/test's exit trap, turned a green test run red (issue 36). Each test
//! works in a copy of the repository's tracked files, so the real manifests and the script
//! under test are the ones in this tree.

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

impl FreshMachine {
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

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.current_dir(self.root())
            .env("CARGO_HOME", self.dir.path().join("cargo-home"))
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

#[test]
fn save_and_restore_work_with_none_of_the_lock_files_crates_fetched() {
    let machine = FreshMachine::new();

    // Positive control: this cargo home is a fresh machine's. Resolving the whole lock file
    // offline fails here, as the save of issue 36 did.
    let full = machine
        .command("cargo")
        .args(["metadata", "--format-version", "1", "--offline"])
        .output()
        .expect("cargo");
    assert!(
        !full.status.success(),
        "a full resolve worked offline with an empty cargo home: this is not a fresh machine"
    );

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
