//! Which harness made a call, for the metrics' `harness` label: a closed set, so a label never
//! carries what a client chose to send.

use std::collections::BTreeMap;

/// The harnesses tokentap knows by their requests; anything else is `Other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Harness {
    Codex,
    ClaudeCode,
    QwenCode,
    Pi,
    Other,
}

impl Harness {
    pub fn as_str(self) -> &'static str {
        match self {
            Harness::Codex => "codex",
            Harness::ClaudeCode => "claude_code",
            Harness::QwenCode => "qwen_code",
            Harness::Pi => "pi",
            Harness::Other => "other",
        }
    }

    /// From a rollout preset's or an operator's name for it (`claude-code`, `qwen_code`, …).
    pub fn from_name(name: &str) -> Harness {
        match name.to_ascii_lowercase().replace('-', "_").as_str() {
            "codex" => Harness::Codex,
            "claude" | "claude_code" => Harness::ClaudeCode,
            "qwen" | "qwen_code" => Harness::QwenCode,
            "pi" => Harness::Pi,
            _ => Harness::Other,
        }
    }

    /// From the request's headers (lower-case names, as records keep them). Codex sends
    /// `originator` and a `codex_*` user agent, Claude Code `claude-cli/…`, Qwen Code
    /// `QwenCode/…`. Pi sends its SDK's generic user agent (`OpenAI/JS`, `Anthropic/JS`), which
    /// other programs send too, so Pi is known only where a rollout preset names it.
    pub fn from_headers(headers: &BTreeMap<String, String>) -> Harness {
        let ua = headers
            .get("user-agent")
            .map(|s| s.to_ascii_lowercase())
            .unwrap_or_default();
        let originator = headers.get("originator").map(String::as_str).unwrap_or("");
        if ua.starts_with("codex") || originator.starts_with("codex") {
            Harness::Codex
        } else if ua.starts_with("claude-cli") || ua.starts_with("claude-code") {
            Harness::ClaudeCode
        } else if ua.starts_with("qwencode") || ua.starts_with("qwen-code") {
            Harness::QwenCode
        } else {
            Harness::Other
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ua(v: &str) -> BTreeMap<String, String> {
        BTreeMap::from([("user-agent".to_owned(), v.to_owned())])
    }

    #[test]
    fn the_harnesses_user_agents_are_known_and_the_rest_is_other() {
        // As the real harnesses send them (shared/reference/harness-wire).
        let cases = [
            (
                "codex_exec/0.169.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.169.0)",
                Harness::Codex,
            ),
            (
                "claude-cli/2.1.330 (external, sdk-cli)",
                Harness::ClaudeCode,
            ),
            ("QwenCode/0.24.4 (linux; x64)", Harness::QwenCode),
            ("OpenAI/JS 6.26.0", Harness::Other),
            ("curl/8.1", Harness::Other),
        ];
        for (agent, want) in cases {
            assert_eq!(Harness::from_headers(&ua(agent)), want, "{agent}");
        }
        assert_eq!(Harness::from_headers(&BTreeMap::new()), Harness::Other);
        let codex = BTreeMap::from([("originator".to_owned(), "codex_cli_rs".to_owned())]);
        assert_eq!(Harness::from_headers(&codex), Harness::Codex);
    }

    #[test]
    fn preset_names_map_to_the_same_labels() {
        assert_eq!(Harness::from_name("claude-code"), Harness::ClaudeCode);
        assert_eq!(Harness::from_name("qwen-code"), Harness::QwenCode);
        assert_eq!(Harness::from_name("pi"), Harness::Pi);
        assert_eq!(Harness::from_name("codex"), Harness::Codex);
        assert_eq!(Harness::from_name("my-agent"), Harness::Other);
    }
}
