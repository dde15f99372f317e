//! Real agent harnesses (installed by `scripts/setup`), each run once with an isolated HOME
//! and working directory, a clean environment, and a time limit; killed (with any tool
//! processes they started) on drop or when the limit passes.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use crate::artefacts::Artefacts;
use crate::procs::{spawn_guarded_split, KillScope};

/// Longest a harness run may take before it is killed (a safety bound, not an assertion).
pub const HARNESS_LIMIT: Duration = Duration::from_secs(180);

/// An isolated place to run a harness: `home/` (its HOME) and `work/` (its working dir).
pub struct HarnessDirs {
    dir: tempfile::TempDir,
}

impl HarnessDirs {
    pub fn new() -> HarnessDirs {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(dir.path().join("home")).unwrap();
        std::fs::create_dir_all(dir.path().join("work")).unwrap();
        HarnessDirs { dir }
    }

    pub fn home(&self) -> PathBuf {
        self.dir.path().join("home")
    }

    pub fn work(&self) -> PathBuf {
        self.dir.path().join("work")
    }

    pub fn write(&self, rel: &str, contents: &str) {
        let p = self.home().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, contents).unwrap();
    }
}

impl Default for HarnessDirs {
    fn default() -> Self {
        HarnessDirs::new()
    }
}

/// What a harness run left behind.
#[derive(Debug)]
pub struct HarnessRun {
    /// `None` when it had to be killed at [`HARNESS_LIMIT`].
    pub status: Option<ExitStatus>,
    pub stdout: String,
    pub stderr: String,
}

impl HarnessRun {
    pub fn assert_success(&self, what: &str) {
        assert!(
            self.status.is_some_and(|s| s.success()),
            "{what} did not exit 0 (status {:?}).\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status,
            tail(&self.stdout, 4000),
            tail(&self.stderr, 4000),
        );
    }
}

fn tail(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

use tokentap_rollout::preset::{self, CodexProvider, HarnessEnv, QwenOptions};
pub use tokentap_rollout::preset::{Wire, DEAD_PROXY};

/// The preset environment for a run in `dirs` against `server`: setup's PATH, egress blocked
/// (anything a harness tries to reach beyond loopback fails at a dead local proxy: the network
/// rule).
fn preset_env(
    a: &Artefacts,
    dirs: &HarnessDirs,
    server: &str,
    api_key: &str,
    model: &str,
) -> HarnessEnv {
    HarnessEnv {
        home: dirs.home(),
        work: dirs.work(),
        tmp: dirs.dir.path().to_owned(),
        path: a.harness_path(),
        server: server.to_owned(),
        api_key: api_key.to_owned(),
        model: model.to_owned(),
        block_egress: true,
    }
}

/// A clean environment: HOME, PATH (setup's node 22 and harness bins first), locale, egress
/// blocked.
pub fn harness_command(a: &Artefacts, exe: &Path, dirs: &HarnessDirs) -> Command {
    preset_env(a, dirs, "", "", "").command(exe)
}

pub async fn run(cmd: Command, dirs: &HarnessDirs, what: &str) -> HarnessRun {
    let (out, err) = (
        dirs.dir.path().join(format!("{what}.stdout")),
        dirs.dir.path().join(format!("{what}.stderr")),
    );
    let mut child = spawn_guarded_split(cmd, &out, &err, KillScope::Group, what)
        .unwrap_or_else(|e| panic!("starting {what}: {e}"));
    let status = child.wait_limited(HARNESS_LIMIT).await;
    HarnessRun {
        status,
        stdout: std::fs::read_to_string(&out).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err).unwrap_or_default(),
    }
}

/// Pi through its preset ([`preset::pi`]), speaking `wire` to `server`.
pub async fn run_pi(
    dirs: &HarnessDirs,
    server: &str,
    wire: Wire,
    api_key: &str,
    model: &str,
    prompt: &str,
) -> HarnessRun {
    let (a, _) = Artefacts::require_harness("pi");
    let cmd = preset::pi(&preset_env(&a, dirs, server, api_key, model), wire, prompt).unwrap();
    run(cmd, dirs, "pi").await
}

/// Qwen Code through its preset ([`preset::qwen`]), managed memory off.
pub async fn run_qwen(
    dirs: &HarnessDirs,
    server: &str,
    wire: Wire,
    api_key: &str,
    model: &str,
    prompt: &str,
    yolo: bool,
) -> HarnessRun {
    run_qwen_with_memory(dirs, server, wire, api_key, model, prompt, yolo, false).await
}

/// [`run_qwen`], with Qwen Code's managed auto-memory on or off (on: after the turn, a
/// memory-extraction subagent makes calls of its own with a prompt of its own).
#[allow(clippy::too_many_arguments)]
pub async fn run_qwen_with_memory(
    dirs: &HarnessDirs,
    server: &str,
    wire: Wire,
    api_key: &str,
    model: &str,
    prompt: &str,
    yolo: bool,
    memory: bool,
) -> HarnessRun {
    let (a, _) = Artefacts::require_harness("qwen");
    let options = QwenOptions { wire, yolo, memory };
    let cmd = preset::qwen(
        &preset_env(&a, dirs, server, api_key, model),
        options,
        prompt,
    )
    .unwrap();
    run(cmd, dirs, "qwen").await
}

/// Codex CLI through its preset with a custom Responses provider ([`preset::codex`]).
pub async fn run_codex(
    dirs: &HarnessDirs,
    server: &str,
    api_key: &str,
    model: &str,
    prompt: &str,
) -> HarnessRun {
    run_codex_with(dirs, server, api_key, model, prompt, CodexProvider::Custom).await
}

/// Codex CLI with its built-in `openai` provider pointed at `server` by `openai_base_url`:
/// the set-up a user has when only the base URL changes.
pub async fn run_codex_builtin(
    dirs: &HarnessDirs,
    server: &str,
    api_key: &str,
    model: &str,
    prompt: &str,
) -> HarnessRun {
    run_codex_with(dirs, server, api_key, model, prompt, CodexProvider::Builtin).await
}

async fn run_codex_with(
    dirs: &HarnessDirs,
    server: &str,
    api_key: &str,
    model: &str,
    prompt: &str,
    provider: CodexProvider,
) -> HarnessRun {
    let (a, _) = Artefacts::require_harness("codex");
    let cmd = preset::codex(
        &preset_env(&a, dirs, server, api_key, model),
        provider,
        prompt,
    )
    .unwrap();
    run(cmd, dirs, "codex").await
}

/// Claude Code through its preset ([`preset::claude`]), allowing its Bash tool when `bash`.
pub async fn run_claude(
    dirs: &HarnessDirs,
    server: &str,
    api_key: &str,
    model: &str,
    prompt: &str,
    bash: bool,
) -> HarnessRun {
    let (a, _) = Artefacts::require_harness("claude");
    let tools: &[&str] = if bash { &["Bash"] } else { &[] };
    let cmd = preset::claude(&preset_env(&a, dirs, server, api_key, model), tools, prompt);
    run(cmd, dirs, "claude").await
}

/// A second run of a harness in the same `dirs`, continuing its most recent session with a
/// new user message (`prompt`): `pi -c`, `qwen --continue`, `codex exec resume --last`,
/// `claude --continue`. The conversation so far goes back to the model with `prompt` after it.
pub async fn continue_session(
    harness: &str,
    dirs: &HarnessDirs,
    server: &str,
    api_key: &str,
    model: &str,
    prompt: &str,
) -> HarnessRun {
    let (a, _) = Artefacts::require_harness(harness);
    let env = preset_env(&a, dirs, server, api_key, model);
    let (cmd, flags): (Command, &[&str]) = match harness {
        "pi" => (
            preset::pi(&env, Wire::ChatCompletions, prompt).unwrap(),
            &["-c"],
        ),
        "qwen" => {
            let options = QwenOptions {
                wire: Wire::ChatCompletions,
                yolo: true,
                memory: false,
            };
            (
                preset::qwen(&env, options, prompt).unwrap(),
                &["--continue"],
            )
        }
        "codex" => (
            preset::codex(&env, CodexProvider::Custom, prompt).unwrap(),
            &["resume", "--last"],
        ),
        "claude" => (preset::claude(&env, &["Bash"], prompt), &["--continue"]),
        other => panic!("no continuation for harness {other:?}"),
    };
    let what = format!("{harness}-continued");
    run(with_flags_before(cmd, prompt, flags), dirs, &what).await
}

/// `cmd` with `flags` inserted just before its argument `before`. Every preset starts from
/// [`HarnessEnv::command`], which clears the environment, so the copy does too.
fn with_flags_before(cmd: Command, before: &str, flags: &[&str]) -> Command {
    let mut out = Command::new(cmd.get_program());
    out.env_clear().stdin(std::process::Stdio::null());
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            out.env(k, v);
        }
    }
    if let Some(dir) = cmd.get_current_dir() {
        out.current_dir(dir);
    }
    let mut placed = false;
    for arg in cmd.get_args() {
        if !placed && arg == before {
            out.args(flags);
            placed = true;
        }
        out.arg(arg);
    }
    assert!(placed, "{before:?} is not an argument of {cmd:?}");
    out
}
