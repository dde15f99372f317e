//! Harness presets: how each agent harness is installed into an isolated HOME, pointed at a
//! capture URL, kept quiet (telemetry and update checks off) and run once, non-interactively,
//! on one instruction. One copy of this knowledge: the rollout node and the end-to-end tests
//! both launch harnesses through it.
//!
//! A preset only builds the [`Command`]; who runs it decides the process group, the time
//! limit and where output goes.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::json;

use crate::task::Harness;

/// A loopback port nothing listens on (discard): with egress blocked, whatever a harness
/// tries to reach through its HTTP(S) proxy variables fails here instead of leaving the
/// machine (telemetry, update checks), while loopback (the capture URL) stays direct.
pub const DEAD_PROXY: &str = "http://127.0.0.1:9";

/// Where and how one harness run happens.
#[derive(Debug, Clone)]
pub struct HarnessEnv {
    /// The harness's HOME; its config files are written here.
    pub home: PathBuf,
    /// Its working directory (the task's workspace).
    pub work: PathBuf,
    /// Its TMPDIR.
    pub tmp: PathBuf,
    /// PATH for the harness (directories with node and the harness binaries first).
    pub path: String,
    /// The capture endpoint's root for this run's session, e.g.
    /// `http://127.0.0.1:8710/s/SAMPLE` (no trailing `/v1`).
    pub server: String,
    /// The key the harness sends (a placeholder: the engine's credentials stay in tokentap).
    pub api_key: String,
    /// The model name the harness asks for (tokentap maps it to the engine's model).
    pub model: String,
    /// Route the harness's non-loopback HTTP(S) through [`DEAD_PROXY`].
    pub block_egress: bool,
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

impl HarnessEnv {
    /// `exe` with a clean environment: HOME, PATH, TMPDIR, a UTF-8 locale, no colours, and
    /// egress blocked when asked. Nothing of the caller's environment leaks in (API keys in
    /// particular).
    pub fn command(&self, exe: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new(exe);
        cmd.env_clear()
            .env("HOME", &self.home)
            .env("PATH", &self.path)
            .env("LANG", "C.UTF-8")
            .env("TERM", "dumb")
            .env("NO_COLOR", "1")
            .env("TMPDIR", &self.tmp)
            .current_dir(&self.work)
            .stdin(Stdio::null());
        if self.block_egress {
            for (k, v) in [
                ("NO_PROXY", "127.0.0.1,localhost,::1"),
                ("no_proxy", "127.0.0.1,localhost,::1"),
                ("HTTPS_PROXY", DEAD_PROXY),
                ("HTTP_PROXY", DEAD_PROXY),
                ("https_proxy", DEAD_PROXY),
                ("http_proxy", DEAD_PROXY),
            ] {
                cmd.env(k, v);
            }
        }
        cmd
    }

    /// Writes `contents` to `rel` under the harness's HOME. Set-up (task code) ran in that
    /// HOME before, so nothing it left on the way is followed (see
    /// [`crate::sample_files::write_beneath`]); the node runs as root.
    pub fn write_home(&self, rel: &str, contents: &str) -> io::Result<()> {
        std::fs::create_dir_all(&self.home)?;
        crate::sample_files::write_beneath(&self.home, Path::new(rel), contents.as_bytes())
    }

    /// The OpenAI-style base URL (`…/v1`).
    pub fn openai_base(&self) -> String {
        format!("{}/v1", self.server)
    }
}

/// Pi (`@mariozechner/pi-coding-agent`): `~/.pi/agent/models.json` names provider `x` at the
/// capture URL speaking `wire`; runs `pi -p --provider x --model MODEL INSTRUCTION`.
pub fn pi(env: &HarnessEnv, wire: Wire, instruction: &str) -> io::Result<Command> {
    // The Anthropic SDK appends `/v1/messages` itself; the OpenAI ones want the `/v1` base.
    let (api, base_url) = match wire {
        Wire::ChatCompletions => ("openai-completions", env.openai_base()),
        Wire::Responses => ("openai-responses", env.openai_base()),
        Wire::Messages => ("anthropic-messages", env.server.clone()),
    };
    let models = json!({"providers": {"x": {
        "baseUrl": base_url,
        "api": api,
        "apiKey": env.api_key,
        "compat": {"supportsDeveloperRole": false, "supportsReasoningEffort": false},
        "models": [{"id": env.model, "contextWindow": 32768, "maxTokens": 4096}]
    }}});
    env.write_home(".pi/agent/models.json", &models.to_string())?;
    let mut cmd = env.command("pi");
    cmd.args(["-p", "--provider", "x", "--model", &env.model, instruction]);
    Ok(cmd)
}

/// Qwen Code options.
#[derive(Debug, Clone, Copy)]
pub struct QwenOptions {
    pub wire: Wire,
    /// `--yolo`: run tools without asking (a non-interactive run cannot answer).
    pub yolo: bool,
    /// Managed auto-memory: after a turn, a memory-extraction subagent makes calls of its own.
    pub memory: bool,
}

/// Qwen Code (`@qwen-code/qwen-code`): `--auth-type openai | openai-responses | anthropic`
/// with the matching `OPENAI_*` or `ANTHROPIC_*` variables, usage statistics off; runs
/// `qwen --auth-type … [--yolo] INSTRUCTION`.
pub fn qwen(env: &HarnessEnv, o: QwenOptions, instruction: &str) -> io::Result<Command> {
    let settings = json!({
        "privacy": {"usageStatisticsEnabled": false},
        "memory": {"enableManagedAutoMemory": o.memory, "enableManagedAutoDream": false}
    });
    env.write_home(".qwen/settings.json", &settings.to_string())?;
    let mut cmd = env.command("qwen");
    let auth_type = match o.wire {
        Wire::ChatCompletions | Wire::Responses => {
            cmd.env("OPENAI_BASE_URL", env.openai_base())
                .env("OPENAI_API_KEY", &env.api_key)
                .env("OPENAI_MODEL", &env.model);
            if o.wire == Wire::Responses {
                "openai-responses"
            } else {
                "openai"
            }
        }
        Wire::Messages => {
            cmd.env("ANTHROPIC_BASE_URL", &env.server)
                .env("ANTHROPIC_API_KEY", &env.api_key)
                .env("ANTHROPIC_MODEL", &env.model);
            "anthropic"
        }
    };
    cmd.args(["--auth-type", auth_type]);
    if o.yolo {
        cmd.arg("--yolo");
    }
    cmd.arg(instruction);
    Ok(cmd)
}

/// Which Codex provider carries the calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodexProvider {
    /// A custom provider `x` speaking Responses (it sends the key and skips Codex's
    /// WebSocket attempt).
    Custom,
    /// The built-in `openai` provider with `openai_base_url`: what a user has when only the
    /// base URL changes.
    Builtin,
}

/// Codex CLI (`@openai/codex`): `$CODEX_HOME/config.toml` points it at the capture URL, update
/// checks off; runs `codex exec --skip-git-repo-check -s danger-full-access INSTRUCTION` (the
/// sample's directory is its sandbox).
pub fn codex(env: &HarnessEnv, provider: CodexProvider, instruction: &str) -> io::Result<Command> {
    let (model, base) = (&env.model, env.openai_base());
    let config = match provider {
        CodexProvider::Custom => format!(
            r#"model = "{model}"
model_provider = "x"
check_for_update_on_startup = false

[model_providers.x]
name = "x"
base_url = "{base}"
env_key = "X_KEY"
wire_api = "responses"
"#
        ),
        CodexProvider::Builtin => format!(
            r#"model = "{model}"
openai_base_url = "{base}"
check_for_update_on_startup = false
"#
        ),
    };
    env.write_home(".codex/config.toml", &config)?;
    let mut cmd = env.command("codex");
    cmd.env("CODEX_HOME", env.home.join(".codex"));
    match provider {
        CodexProvider::Custom => cmd.env("X_KEY", &env.api_key),
        CodexProvider::Builtin => cmd.env("OPENAI_API_KEY", &env.api_key),
    };
    cmd.args([
        "exec",
        "--skip-git-repo-check",
        "-s",
        "danger-full-access",
        instruction,
    ]);
    Ok(cmd)
}

/// Claude Code (`@anthropic-ai/claude-code`): `ANTHROPIC_BASE_URL` at the capture URL,
/// non-essential traffic, telemetry and the auto-updater off; runs
/// `claude -p INSTRUCTION --model MODEL [--allowedTools …]`.
pub fn claude(env: &HarnessEnv, allowed_tools: &[&str], instruction: &str) -> Command {
    let mut cmd = env.command("claude");
    cmd.env("ANTHROPIC_BASE_URL", &env.server)
        .env("ANTHROPIC_API_KEY", &env.api_key)
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .env("DISABLE_TELEMETRY", "1")
        .args(["-p", instruction, "--model", &env.model]);
    if !allowed_tools.is_empty() {
        cmd.arg("--allowedTools").arg(allowed_tools.join(","));
    }
    cmd
}

/// The tools a rollout lets Claude Code use without asking (it runs as whoever runs the
/// node, often root, where `--dangerously-skip-permissions` is refused).
pub const CLAUDE_ROLLOUT_TOOLS: &[&str] = &["Bash", "Edit", "Write", "Read", "Glob", "Grep"];

/// A rollout sample's command for `harness`: each preset with the settings a training run
/// wants (tools allowed, no side agents), or the task's own `command` with `{instruction}`
/// substituted and the capture URLs, placeholder keys and `TOKENTAP_SESSION` in its
/// environment.
pub fn for_sample(
    harness: &Harness,
    env: &HarnessEnv,
    instruction: &str,
    session: &str,
) -> io::Result<Command> {
    let mut cmd = match harness {
        Harness::Pi => pi(env, Wire::ChatCompletions, instruction)?,
        Harness::QwenCode => qwen(
            env,
            QwenOptions {
                wire: Wire::ChatCompletions,
                yolo: true,
                memory: false,
            },
            instruction,
        )?,
        Harness::Codex => codex(env, CodexProvider::Custom, instruction)?,
        Harness::ClaudeCode => claude(env, CLAUDE_ROLLOUT_TOOLS, instruction),
        Harness::Command { argv } => {
            let argv: Vec<String> = argv
                .iter()
                .map(|a| a.replace("{instruction}", instruction))
                .collect();
            let Some((exe, args)) = argv.split_first() else {
                return Err(io::Error::other("the command preset's argv is empty"));
            };
            let mut cmd = env.command(exe);
            cmd.args(args)
                .env("OPENAI_BASE_URL", env.openai_base())
                .env("OPENAI_API_KEY", &env.api_key)
                .env("ANTHROPIC_BASE_URL", &env.server)
                .env("ANTHROPIC_API_KEY", &env.api_key);
            cmd
        }
    };
    cmd.env("TOKENTAP_SESSION", session);
    Ok(cmd)
}

/// The executable a preset runs (`None` for `command`, which names its own).
pub fn executable(harness: &Harness) -> Option<&'static str> {
    match harness {
        Harness::Pi => Some("pi"),
        Harness::QwenCode => Some("qwen"),
        Harness::Codex => Some("codex"),
        Harness::ClaudeCode => Some("claude"),
        Harness::Command { .. } => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(dir: &Path) -> HarnessEnv {
        HarnessEnv {
            home: dir.join("home"),
            work: dir.to_owned(),
            tmp: dir.to_owned(),
            path: "/usr/bin:/bin".into(),
            server: "http://127.0.0.1:1/s/sample-1".into(),
            api_key: "placeholder".into(),
            model: "policy".into(),
            block_egress: true,
        }
    }

    fn envs(cmd: &Command) -> std::collections::HashMap<String, String> {
        cmd.get_envs()
            .filter_map(|(k, v)| Some((k.to_str()?.to_owned(), v?.to_str()?.to_owned())))
            .collect()
    }

    #[test]
    fn the_command_preset_substitutes_the_instruction_and_sets_the_capture_urls() {
        let dir = tempfile::tempdir().unwrap();
        let harness = Harness::Command {
            argv: vec!["agent".into(), "--task={instruction}".into()],
        };
        let cmd = for_sample(&harness, &env(dir.path()), "fix it", "sample-1").unwrap();
        let args: Vec<_> = cmd.get_args().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(args, ["--task=fix it"]);
        let e = envs(&cmd);
        assert_eq!(e["OPENAI_BASE_URL"], "http://127.0.0.1:1/s/sample-1/v1");
        assert_eq!(e["ANTHROPIC_BASE_URL"], "http://127.0.0.1:1/s/sample-1");
        assert_eq!(e["TOKENTAP_SESSION"], "sample-1");
        assert_eq!(e["HTTPS_PROXY"], DEAD_PROXY);
    }

    #[test]
    fn nothing_of_the_node_environment_reaches_the_agent() {
        let dir = tempfile::tempdir().unwrap();
        let harness = Harness::Command {
            argv: vec!["env".into()],
        };
        let out = for_sample(&harness, &env(dir.path()), "x", "s")
            .unwrap()
            .output()
            .unwrap();
        let seen: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| Some(l.split_once('=')?.0.to_owned()))
            .collect();
        // The test runner's own variables (CARGO_*, HOME, PATH...) would leak without
        // env_clear; only what the preset sets may be there.
        let allowed = [
            "HOME",
            "PATH",
            "LANG",
            "TERM",
            "NO_COLOR",
            "TMPDIR",
            "NO_PROXY",
            "no_proxy",
            "HTTPS_PROXY",
            "HTTP_PROXY",
            "https_proxy",
            "http_proxy",
            "OPENAI_BASE_URL",
            "OPENAI_API_KEY",
            "ANTHROPIC_BASE_URL",
            "ANTHROPIC_API_KEY",
            "TOKENTAP_SESSION",
            "PWD",
            "SHLVL",
            "_",
        ];
        assert!(!seen.is_empty());
        for k in &seen {
            assert!(allowed.contains(&k.as_str()), "{k} leaked into the agent");
        }
    }

    #[test]
    fn presets_write_their_config_under_the_isolated_home() {
        let dir = tempfile::tempdir().unwrap();
        let env = env(dir.path());
        for h in [Harness::Pi, Harness::QwenCode, Harness::Codex] {
            for_sample(&h, &env, "x", "s").unwrap();
        }
        let pi = std::fs::read_to_string(env.home.join(".pi/agent/models.json")).unwrap();
        assert!(pi.contains("http://127.0.0.1:1/s/sample-1/v1"), "{pi}");
        let qwen = std::fs::read_to_string(env.home.join(".qwen/settings.json")).unwrap();
        assert!(qwen.contains(r#""usageStatisticsEnabled":false"#), "{qwen}");
        let codex = std::fs::read_to_string(env.home.join(".codex/config.toml")).unwrap();
        assert!(
            codex.contains("check_for_update_on_startup = false"),
            "{codex}"
        );
    }

    /// Set-up (task code) ran in the HOME before the preset writes there, as root: a link it
    /// planted at any directory or at the file of any preset's config must not carry the
    /// write outside.
    #[test]
    fn presets_never_write_through_links_set_up_planted() {
        let configs = [
            (Harness::Pi, ".pi/agent/models.json"),
            (Harness::QwenCode, ".qwen/settings.json"),
            (Harness::Codex, ".codex/config.toml"),
        ];
        for (harness, config) in configs {
            let parts: Vec<&str> = config.split('/').collect();
            for depth in 1..=parts.len() {
                let dir = tempfile::tempdir().unwrap();
                let env = env(dir.path());
                let outside = dir.path().join("outside");
                std::fs::create_dir_all(&outside).unwrap();
                let victim = outside.join("victim");
                std::fs::write(&victim, "root's").unwrap();
                let at = env.home.join(parts[..depth].join("/"));
                std::fs::create_dir_all(at.parent().unwrap()).unwrap();
                let target = if depth == parts.len() {
                    &victim
                } else {
                    &outside
                };
                std::os::unix::fs::symlink(target, &at).unwrap();
                for_sample(&harness, &env, "x", "s").unwrap();
                let what = format!("{harness:?} with {} linked", at.display());
                assert_eq!(
                    std::fs::read_to_string(&victim).unwrap(),
                    "root's",
                    "{what}"
                );
                assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1, "{what}");
                let written = std::fs::read_to_string(env.home.join(config)).unwrap();
                assert!(!written.is_empty(), "{what}");
            }
        }
    }

    #[test]
    fn an_empty_command_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = for_sample(
            &Harness::Command { argv: vec![] },
            &env(dir.path()),
            "x",
            "s",
        )
        .unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
    }
}
