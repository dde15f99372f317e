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

    fn write(&self, rel: &str, contents: &str) {
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

/// A clean environment: HOME, PATH (setup's node 22 and harness bins first), locale.
fn harness_command(a: &Artefacts, exe: &Path, dirs: &HarnessDirs) -> Command {
    let mut cmd = Command::new(exe);
    cmd.env_clear()
        .env("HOME", dirs.home())
        .env("PATH", a.harness_path())
        .env("LANG", "C.UTF-8")
        .env("TERM", "dumb")
        .env("NO_COLOR", "1")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("TMPDIR", dirs.dir.path())
        .current_dir(dirs.work());
    cmd
}

async fn run(cmd: Command, dirs: &HarnessDirs, what: &str) -> HarnessRun {
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

/// Pi (`@mariozechner/pi-coding-agent`): `~/.pi/agent/models.json` names provider `x` at
/// `base_url` speaking Chat Completions with `api_key`; runs `pi -p --provider x --model
/// MODEL PROMPT`.
pub async fn run_pi(
    dirs: &HarnessDirs,
    base_url: &str,
    api_key: &str,
    model: &str,
    prompt: &str,
) -> HarnessRun {
    let (a, exe) = Artefacts::require_harness("pi");
    let models = json!({"providers": {"x": {
        "baseUrl": base_url,
        "api": "openai-completions",
        "apiKey": api_key,
        "compat": {"supportsDeveloperRole": false, "supportsReasoningEffort": false},
        "models": [{"id": model, "contextWindow": 32768, "maxTokens": 4096}]
    }}});
    dirs.write(".pi/agent/models.json", &models.to_string());
    let mut cmd = harness_command(&a, &exe, dirs);
    cmd.args(["-p", "--provider", "x", "--model", model, prompt]);
    run(cmd, dirs, "pi").await
}

/// Qwen Code (`@qwen-code/qwen-code`): `OPENAI_BASE_URL`/`OPENAI_API_KEY`/`OPENAI_MODEL`,
/// telemetry and managed memory off; runs `qwen --auth-type openai [--yolo] PROMPT`.
pub async fn run_qwen(
    dirs: &HarnessDirs,
    base_url: &str,
    api_key: &str,
    model: &str,
    prompt: &str,
    yolo: bool,
) -> HarnessRun {
    let (a, exe) = Artefacts::require_harness("qwen");
    let settings = json!({
        "privacy": {"usageStatisticsEnabled": false},
        "memory": {"enableManagedAutoMemory": false, "enableManagedAutoDream": false}
    });
    dirs.write(".qwen/settings.json", &settings.to_string());
    let mut cmd = harness_command(&a, &exe, dirs);
    cmd.env("OPENAI_BASE_URL", base_url)
        .env("OPENAI_API_KEY", api_key)
        .env("OPENAI_MODEL", model)
        .args(["--auth-type", "openai"]);
    if yolo {
        cmd.arg("--yolo");
    }
    cmd.arg(prompt);
    run(cmd, dirs, "qwen").await
}
