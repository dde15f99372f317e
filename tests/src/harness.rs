//! Real agent harnesses (installed by `scripts/setup`), each run once with an isolated HOME
//! and working directory, a clean environment, and a time limit; killed (with any tool
//! processes they started) on drop or when the limit passes.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use serde_json::json;

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

/// A loopback port nothing listens on (discard).
pub const DEAD_PROXY: &str = "http://127.0.0.1:9";

/// A clean environment: HOME, PATH (setup's node 22 and harness bins first), locale.
pub fn harness_command(a: &Artefacts, exe: &Path, dirs: &HarnessDirs) -> Command {
    let mut cmd = Command::new(exe);
    cmd.env_clear()
        .env("HOME", dirs.home())
        .env("PATH", a.harness_path())
        .env("LANG", "C.UTF-8")
        .env("TERM", "dumb")
        .env("NO_COLOR", "1")
        // Anything a harness tries to reach beyond loopback fails at a dead local proxy
        // (the network rule), instead of leaving the machine.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .env("HTTPS_PROXY", DEAD_PROXY)
        .env("HTTP_PROXY", DEAD_PROXY)
        .env("https_proxy", DEAD_PROXY)
        .env("http_proxy", DEAD_PROXY)
        .env("TMPDIR", dirs.dir.path())
        .current_dir(dirs.work());
    cmd
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

/// The provider API a harness is set to speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wire {
    ChatCompletions,
    Responses,
    Messages,
}

impl Wire {
    /// The path tokentap sees for a model call in this API.
    pub fn path(self) -> &'static str {
        match self {
            Wire::ChatCompletions => "/v1/chat/completions",
            Wire::Responses => "/v1/responses",
            Wire::Messages => "/v1/messages",
        }
    }
}

/// Pi (`@mariozechner/pi-coding-agent`): `~/.pi/agent/models.json` names provider `x` at
/// `server` speaking `wire` with `api_key`; runs `pi -p --provider x --model MODEL PROMPT`.
pub async fn run_pi(
    dirs: &HarnessDirs,
    server: &str,
    wire: Wire,
    api_key: &str,
    model: &str,
    prompt: &str,
) -> HarnessRun {
    let (a, exe) = Artefacts::require_harness("pi");
    // The Anthropic SDK appends `/v1/messages` itself; the OpenAI ones want the `/v1` base.
    let (api, base_url) = match wire {
        Wire::ChatCompletions => ("openai-completions", format!("{server}/v1")),
        Wire::Responses => ("openai-responses", format!("{server}/v1")),
        Wire::Messages => ("anthropic-messages", server.to_owned()),
    };
    let models = json!({"providers": {"x": {
        "baseUrl": base_url,
        "api": api,
        "apiKey": api_key,
        "compat": {"supportsDeveloperRole": false, "supportsReasoningEffort": false},
        "models": [{"id": model, "contextWindow": 32768, "maxTokens": 4096}]
    }}});
    dirs.write(".pi/agent/models.json", &models.to_string());
    let mut cmd = harness_command(&a, &exe, dirs);
    cmd.args(["-p", "--provider", "x", "--model", model, prompt]);
    run(cmd, dirs, "pi").await
}

/// Qwen Code (`@qwen-code/qwen-code`): `--auth-type openai | openai-responses | anthropic` with
/// the matching `OPENAI_*` or `ANTHROPIC_*` variables, telemetry and managed memory off; runs
/// `qwen --auth-type … [--yolo] PROMPT`.
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
    let (a, exe) = Artefacts::require_harness("qwen");
    let settings = json!({
        "privacy": {"usageStatisticsEnabled": false},
        "memory": {"enableManagedAutoMemory": memory, "enableManagedAutoDream": false}
    });
    dirs.write(".qwen/settings.json", &settings.to_string());
    let mut cmd = harness_command(&a, &exe, dirs);
    let auth_type = match wire {
        Wire::ChatCompletions | Wire::Responses => {
            cmd.env("OPENAI_BASE_URL", format!("{server}/v1"))
                .env("OPENAI_API_KEY", api_key)
                .env("OPENAI_MODEL", model);
            if wire == Wire::Responses {
                "openai-responses"
            } else {
                "openai"
            }
        }
        Wire::Messages => {
            cmd.env("ANTHROPIC_BASE_URL", server)
                .env("ANTHROPIC_API_KEY", api_key)
                .env("ANTHROPIC_MODEL", model);
            "anthropic"
        }
    };
    cmd.args(["--auth-type", auth_type]);
    if yolo {
        cmd.arg("--yolo");
    }
    cmd.arg(prompt);
    run(cmd, dirs, "qwen").await
}

/// Codex CLI (`@openai/codex`): a custom provider `x` in `$CODEX_HOME/config.toml` speaking
/// Responses at `server` (a custom provider sends the key and skips the WebSocket attempt);
/// runs `codex exec --skip-git-repo-check -s danger-full-access PROMPT` with stdin closed.
pub async fn run_codex(
    dirs: &HarnessDirs,
    server: &str,
    api_key: &str,
    model: &str,
    prompt: &str,
) -> HarnessRun {
    let (a, exe) = Artefacts::require_harness("codex");
    let config = format!(
        r#"model = "{model}"
model_provider = "x"
check_for_update_on_startup = false

[model_providers.x]
name = "x"
base_url = "{server}/v1"
env_key = "X_KEY"
wire_api = "responses"
"#
    );
    dirs.write(".codex/config.toml", &config);
    let mut cmd = harness_command(&a, &exe, dirs);
    cmd.env("CODEX_HOME", dirs.home().join(".codex"))
        .env("X_KEY", api_key)
        .args([
            "exec",
            "--skip-git-repo-check",
            "-s",
            "danger-full-access",
            prompt,
        ])
        .stdin(std::process::Stdio::null());
    run(cmd, dirs, "codex").await
}

/// Codex CLI with its built-in `openai` provider pointed at `server` by `openai_base_url` and
/// `OPENAI_API_KEY`: the set-up a user has when only the base URL changes.
pub async fn run_codex_builtin(
    dirs: &HarnessDirs,
    server: &str,
    api_key: &str,
    model: &str,
    prompt: &str,
) -> HarnessRun {
    let (a, exe) = Artefacts::require_harness("codex");
    let config = format!(
        r#"model = "{model}"
openai_base_url = "{server}/v1"
check_for_update_on_startup = false
"#
    );
    dirs.write(".codex/config.toml", &config);
    let mut cmd = harness_command(&a, &exe, dirs);
    cmd.env("CODEX_HOME", dirs.home().join(".codex"))
        .env("OPENAI_API_KEY", api_key)
        .args([
            "exec",
            "--skip-git-repo-check",
            "-s",
            "danger-full-access",
            prompt,
        ])
        .stdin(std::process::Stdio::null());
    run(cmd, dirs, "codex").await
}

/// Claude Code (`@anthropic-ai/claude-code`): `ANTHROPIC_BASE_URL=server`, non-essential
/// traffic off; runs `claude -p PROMPT --model MODEL`, allowing its Bash tool when `bash`.
pub async fn run_claude(
    dirs: &HarnessDirs,
    server: &str,
    api_key: &str,
    model: &str,
    prompt: &str,
    bash: bool,
) -> HarnessRun {
    let (a, exe) = Artefacts::require_harness("claude");
    let mut cmd = harness_command(&a, &exe, dirs);
    cmd.env("ANTHROPIC_BASE_URL", server)
        .env("ANTHROPIC_API_KEY", api_key)
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .env("DISABLE_TELEMETRY", "1")
        .args(["-p", prompt, "--model", model])
        .stdin(std::process::Stdio::null());
    if bash {
        cmd.args(["--allowedTools", "Bash"]);
    }
    run(cmd, dirs, "claude").await
}
