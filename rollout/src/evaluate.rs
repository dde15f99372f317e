//! Evaluators: a sample's reward from its final workspace. Commands run in a fresh evaluation
//! copy (see [`crate::workspace::evaluation_copy`]), in their own process group, killed at
//! the evaluation budget; their output goes to the sample's `eval.log`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tokio::process::Command;

use crate::task::Evaluator;
use crate::workspace::evaluation_copy;

/// What an evaluator found, stored with the sample.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Evaluation {
    /// The outcome reward: every trace gets it unless `trace_rewards` names the trace.
    pub reward: f64,
    /// Rewards for single traces, by `trace_id`, when the evaluator gave them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub trace_rewards: BTreeMap<String, f64>,
    /// Tests that passed and failed (the `swebench` evaluator).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub passed: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed: Vec<String>,
    /// The evaluation command's exit code (the `command` evaluator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Where the evaluation's output is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<String>,
}

/// Where one sample's evaluation happens.
pub struct EvalPaths<'a> {
    /// The sample's final working copy.
    pub work: &'a Path,
    /// The rollout's snapshot (original test files come from here).
    pub original: &'a Path,
    /// The sample's directory (`eval/`, `eval.log` and `reward` go here).
    pub sample_dir: &'a Path,
    /// The sample's traces (`traces.jsonl`, not yet rewarded), shown to the evaluator as
    /// `$TOKENTAP_TRACES` so it can reward traces one by one.
    pub traces: Option<&'a Path>,
}

/// Scores a sample. `agent_exited_ok`: the harness exited 0 within its budget.
pub async fn evaluate(
    evaluator: &Evaluator,
    agent_exited_ok: bool,
    paths: &EvalPaths<'_>,
    budget: Duration,
) -> anyhow::Result<Evaluation> {
    let eval_dir = paths.sample_dir.join("eval");
    let log = paths.sample_dir.join("eval.log");
    match evaluator {
        Evaluator::SessionCompleted => Ok(Evaluation {
            reward: f64::from(u8::from(agent_exited_ok)),
            ..Evaluation::default()
        }),
        Evaluator::Command {
            command,
            test_files,
        } => {
            evaluation_copy(paths.work, paths.original, test_files, &eval_dir).await?;
            let reward_file = paths.sample_dir.join("reward");
            let _ = tokio::fs::remove_file(&reward_file).await;
            let code =
                run_logged(command, &eval_dir, &log, &reward_file, paths.traces, budget).await?;
            let (reward, trace_rewards) = match tokio::fs::read_to_string(&reward_file).await {
                Ok(text) => parse_reward_file(&text)?,
                Err(_) => (f64::from(u8::from(code == Some(0))), BTreeMap::new()),
            };
            Ok(Evaluation {
                reward,
                trace_rewards,
                exit_code: code,
                log: Some(log.display().to_string()),
                ..Evaluation::default()
            })
        }
        Evaluator::Swebench {
            test_command,
            fail_to_pass,
            pass_to_pass,
            test_files,
        } => {
            evaluation_copy(paths.work, paths.original, test_files, &eval_dir).await?;
            let reward_file = paths.sample_dir.join("reward");
            let mut e = Evaluation {
                log: Some(log.display().to_string()),
                ..Evaluation::default()
            };
            for test in fail_to_pass.iter().chain(pass_to_pass) {
                let command = with_test(test_command, test);
                let code =
                    run_logged(&command, &eval_dir, &log, &reward_file, None, budget).await?;
                if code == Some(0) {
                    e.passed.push(test.clone());
                } else {
                    e.failed.push(test.clone());
                }
            }
            e.reward = f64::from(u8::from(e.failed.is_empty()));
            Ok(e)
        }
    }
}

/// What a `command` evaluator wrote to `$TOKENTAP_REWARD_FILE`: a number (the outcome
/// reward), or `{"reward": R, "traces": {"TRACE_ID": R, ...}}` to reward traces one by one.
pub fn parse_reward_file(text: &str) -> anyhow::Result<(f64, BTreeMap<String, f64>)> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct PerTrace {
        reward: f64,
        #[serde(default)]
        traces: BTreeMap<String, f64>,
    }
    let text = text.trim();
    if let Ok(reward) = text.parse::<f64>() {
        return finite(reward).map(|r| (r, BTreeMap::new()));
    }
    let parsed: PerTrace = serde_json::from_str(text).map_err(|e| {
        anyhow::anyhow!(
            "the reward file held {:?}: expected a number or {{\"reward\": R, \"traces\": {{\"TRACE_ID\": R}}}} ({e})",
            text.chars().take(200).collect::<String>()
        )
    })?;
    for r in parsed.traces.values() {
        finite(*r)?;
    }
    Ok((finite(parsed.reward)?, parsed.traces))
}

fn finite(r: f64) -> anyhow::Result<f64> {
    anyhow::ensure!(
        r.is_finite(),
        "the reward file held a reward that is not finite: {r}"
    );
    Ok(r)
}

/// `test_command` for one test: `{test}` replaced by the shell-quoted id, or the id appended.
pub fn with_test(test_command: &str, test: &str) -> String {
    let quoted = format!("'{}'", test.replace('\'', r"'\''"));
    if test_command.contains("{test}") {
        test_command.replace("{test}", &quoted)
    } else {
        format!("{test_command} {quoted}")
    }
}

/// Runs `command` with `sh -c` in `dir`, appending its output to `log`; `None` when killed at
/// `budget`.
async fn run_logged(
    command: &str,
    dir: &Path,
    log: &Path,
    reward_file: &PathBuf,
    traces: Option<&Path>,
    budget: Duration,
) -> anyhow::Result<Option<i32>> {
    use std::io::Write;
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    writeln!(out, "$ {command}")?;
    let mut cmd = Command::new("sh");
    cmd.args(["-c", command])
        .current_dir(dir)
        .env("TOKENTAP_REWARD_FILE", reward_file);
    if let Some(traces) = traces {
        cmd.env("TOKENTAP_TRACES", traces);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out.try_clone()?)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()?;
    let pgid = child.id().map(|p| p as i32);
    match tokio::time::timeout(budget, child.wait()).await {
        Ok(status) => Ok(status?.code()),
        Err(_) => {
            if let Some(pgid) = pgid {
                // SAFETY: kill(2) on the process group this evaluation leads.
                unsafe { libc::kill(-pgid, libc::SIGKILL) };
            }
            let _ = child.wait().await;
            writeln!(
                out,
                "(killed at the {} s evaluation budget)",
                budget.as_secs()
            )?;
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_id_is_quoted_into_the_command() {
        assert_eq!(
            with_test("python3 -m unittest", "test_a.T.test_x"),
            "python3 -m unittest 'test_a.T.test_x'"
        );
        assert_eq!(
            with_test("pytest {test} -q", "t.py::it's"),
            r"pytest 't.py::it'\''s' -q"
        );
    }

    #[test]
    fn a_reward_file_holds_a_number_or_rewards_per_trace() {
        assert_eq!(
            parse_reward_file(" 0.25\n").unwrap(),
            (0.25, BTreeMap::new())
        );
        let (r, per) =
            parse_reward_file(r#"{"reward": 1, "traces": {"s-1/0": 0.5, "s-1/1": 1}}"#).unwrap();
        assert_eq!(r, 1.0);
        assert_eq!(
            per.into_iter().collect::<Vec<_>>(),
            [("s-1/0".to_owned(), 0.5), ("s-1/1".to_owned(), 1.0)]
        );
        for bad in [
            "yes",
            "",
            "NaN",
            r#"{"traces": {}}"#,
            r#"{"reward": 1, "trace": {}}"#,
        ] {
            let e = parse_reward_file(bad).unwrap_err().to_string();
            assert!(e.contains("reward file"), "{bad:?}: {e}");
        }
    }

    /// A `command` evaluator run on an empty workspace.
    async fn run_command(command: &str, traces: Option<&Path>, budget: Duration) -> Evaluation {
        let dir = tempfile::tempdir().unwrap();
        let (original, work) = (dir.path().join("original"), dir.path().join("work"));
        std::fs::create_dir_all(&original).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        let evaluator = Evaluator::Command {
            command: command.into(),
            test_files: vec![],
        };
        let paths = EvalPaths {
            work: &work,
            original: &original,
            sample_dir: dir.path(),
            traces,
        };
        evaluate(&evaluator, true, &paths, budget).await.unwrap()
    }

    #[tokio::test]
    async fn a_command_evaluator_sees_the_traces_and_rewards_them_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let traces = dir.path().join("traces.jsonl");
        std::fs::write(&traces, "{\"trace_id\": \"s-1/0\"}\n").unwrap();
        // Rewards the first trace named in $TOKENTAP_TRACES with 0.5, the outcome with 1.
        let command = r#"id=$(sed -n 's/.*"trace_id": "\([^"]*\)".*/\1/p' "$TOKENTAP_TRACES" | head -1)
printf '{"reward": 1, "traces": {"%s": 0.5}}' "$id" > "$TOKENTAP_REWARD_FILE""#;
        let e = run_command(command, Some(&traces), Duration::from_secs(10)).await;
        assert_eq!(e.reward, 1.0);
        assert_eq!(e.trace_rewards.get("s-1/0"), Some(&0.5), "{e:?}");
    }

    #[tokio::test]
    async fn swebench_rewards_only_when_every_listed_test_passes() {
        let dir = tempfile::tempdir().unwrap();
        let (original, work, sample) = (
            dir.path().join("original"),
            dir.path().join("work"),
            dir.path().join("sample"),
        );
        for d in [&original, &work, &sample] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(work.join("ok"), "").unwrap();
        let evaluator = |f2p: &[&str]| Evaluator::Swebench {
            test_command: "test -e".into(),
            fail_to_pass: f2p.iter().map(|s| s.to_string()).collect(),
            pass_to_pass: vec!["ok".into()],
            test_files: vec![],
        };
        let paths = EvalPaths {
            work: &work,
            original: &original,
            sample_dir: &sample,
            traces: None,
        };
        let budget = Duration::from_secs(10);
        let all = evaluate(&evaluator(&["ok"]), true, &paths, budget)
            .await
            .unwrap();
        assert_eq!((all.reward, all.failed.len()), (1.0, 0));
        let one_missing = evaluate(&evaluator(&["ok", "missing"]), true, &paths, budget)
            .await
            .unwrap();
        assert_eq!(one_missing.reward, 0.0);
        assert_eq!(one_missing.failed, ["missing"]);
    }

    #[tokio::test]
    async fn an_evaluation_over_budget_is_killed_and_scores_zero() {
        let e = run_command("sleep 30", None, Duration::from_millis(300)).await;
        assert_eq!((e.reward, e.exit_code), (0.0, None));
    }
}
