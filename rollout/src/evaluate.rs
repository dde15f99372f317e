//! Evaluators: a sample's reward from its final workspace. Commands are task code, as hostile
//! as the agent: they run in a fresh evaluation copy (see
//! [`crate::workspace::evaluation_copy`]) confined like the agent ([`TaskJail`]: sandbox,
//! limits, a cleared environment), in their own process group, killed at the evaluation
//! budget; their output goes to the sample's `eval.log`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;

use crate::runner;
use crate::sample_files::{create_fresh, read_limited, write_fresh};
use crate::sandbox::{Mounts, TaskJail};
pub use crate::task::Evaluation;
use crate::task::Evaluator;
use crate::workspace::evaluation_copy;

/// Where one sample's evaluation happens.
pub struct EvalPaths<'a> {
    /// The sample's final working copy.
    pub work: &'a Path,
    /// The rollout's snapshot (original test files come from here).
    pub original: &'a Path,
    /// The sample's directory (`eval/`, `eval-io/` and `eval.log` go here).
    pub sample_dir: &'a Path,
    /// The sample's traces, not yet rewarded, to show a reward command as `$TOKENTAP_TRACES`
    /// (copied into its `reward-io/`) so it can reward traces one by one.
    pub traces: Option<&'a [u8]>,
}

/// The most of a reward file the node reads.
const REWARD_FILE_LIMIT: u64 = 1 << 20;

/// The most of the evaluation's log shown to a reward command.
const EVAL_LOG_SHOWN: u64 = 8 << 20;

/// Scores a sample. `agent_exited_ok`: the harness exited 0 within its budget. Commands run
/// confined by `jail`, on a copy the agent never saw: `eval/` (the copy) and `eval-io/` (its
/// HOME and TMPDIR) are all they can write. A `reward_command` runs after them in
/// `reward-io/`, made afresh once they are dead and never mounted where they ran: the reward
/// file is there, out of reach of the tests (agent-written code among them).
pub async fn evaluate(
    evaluator: &Evaluator,
    agent_exited_ok: bool,
    paths: &EvalPaths<'_>,
    jail: &TaskJail,
    budget: Duration,
) -> anyhow::Result<Evaluation> {
    let eval_dir = paths.sample_dir.join("eval");
    let io_dir = paths.sample_dir.join("eval-io");
    let log = paths.sample_dir.join("eval.log");
    let (commands, test_files, reward) = match evaluator {
        Evaluator::SessionCompleted => {
            return Ok(Evaluation {
                reward: f64::from(u8::from(agent_exited_ok)),
                ..Evaluation::default()
            })
        }
        Evaluator::Command {
            command,
            test_files,
            reward_command,
            reward_overrides_failure,
        } => (
            vec![command.clone()],
            test_files,
            reward_command
                .as_deref()
                .map(|c| (c, *reward_overrides_failure)),
        ),
        Evaluator::Swebench {
            test_command,
            fail_to_pass,
            pass_to_pass,
            test_files,
        } => (
            fail_to_pass
                .iter()
                .chain(pass_to_pass)
                .map(|t| runner::with_test(test_command, t))
                .collect(),
            test_files,
            None,
        ),
    };
    evaluation_copy(
        paths.work,
        paths.original,
        test_files,
        &eval_dir,
        jail,
        budget,
    )
    .await?;
    // What each command runs, as the node decides it (crate::runner): a form that runs a
    // file of the agent's tree was refused at submission; one stored before then fails here.
    let analyses = commands
        .iter()
        .map(|c| runner::analyse(c, test_files))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|why| anyhow::anyhow!("{why}"))?;
    if analyses.iter().any(runner::runs_pytest) {
        // pytest loads every conftest.py it passes: only the task's own (restored) stay.
        let (dir, keep) = (eval_dir.clone(), test_files.clone());
        let removed =
            tokio::task::spawn_blocking(move || remove_unlisted_conftests(&dir, &keep)).await??;
        if !removed.is_empty() {
            tracing::info!(
                ?removed,
                "removed conftest.py files the task does not list from an evaluation copy"
            );
        }
    }
    let config = match runner::pytest_config(test_files) {
        Some(c) => eval_dir.join(c),
        None => PathBuf::from("/dev/null"),
    };
    let mut resolver = runner::Resolver::new(&jail.path);
    let mut scripts = Vec::new();
    let mut shadowable = None;
    for (command, analysis) in commands.iter().zip(&analyses) {
        scripts.push(match analysis {
            runner::Analysis::Pinned(p) => {
                resolver.resolve_all(p).await;
                Some(p.render(&|n| resolver.get(n), &config, &eval_dir))
            }
            runner::Analysis::Unanalysed(why) => {
                shadowable.get_or_insert_with(|| {
                    format!("the node ran `{command}` as written: {why}; the agent's tree may have chosen what it ran (docs/security.md)")
                });
                None
            }
        });
    }
    fresh_dir(&io_dir).await?;
    // No Python the evaluation starts puts the working directory (the agent's tree) or a
    // script's directory ahead of the standard library, nor reads a user site; the rewritten
    // runners are isolated (-I) besides.
    let one = std::ffi::OsStr::new("1");
    let env: Vec<(&str, &std::ffi::OsStr)> = vec![
        ("HOME", io_dir.as_os_str()),
        ("TMPDIR", io_dir.as_os_str()),
        ("PYTHONSAFEPATH", one),
        ("PYTHONNOUSERSITE", one),
    ];
    jail.give(&[&eval_dir, &io_dir], budget).await?;
    let out = create_fresh(&log)?;
    let run = EvalRun {
        jail,
        dir: &eval_dir,
        env: &env,
        mounts: Mounts {
            writable: vec![eval_dir.clone(), io_dir.clone()],
            ..Mounts::default()
        },
        log: &log,
        out: out.try_clone()?,
        budget,
    };
    let mut codes = Vec::new();
    for (command, script) in commands.iter().zip(&scripts) {
        codes.push(run.command(command, script.as_deref()).await?);
    }
    let mut e = Evaluation {
        log: Some(log.display().to_string()),
        shadowable,
        ..Evaluation::default()
    };
    match evaluator {
        Evaluator::Swebench {
            fail_to_pass,
            pass_to_pass,
            ..
        } => {
            for (test, code) in fail_to_pass.iter().chain(pass_to_pass).zip(codes) {
                if code == Some(0) {
                    e.passed.push(test.clone());
                } else {
                    e.failed.push(test.clone());
                }
            }
            e.reward = f64::from(u8::from(e.failed.is_empty()));
        }
        _ => {
            let code = codes.first().copied().flatten();
            e.exit_code = code;
            e.reward = f64::from(u8::from(code == Some(0)));
            if let Some((command, overrides)) = reward {
                if code == Some(0) || overrides {
                    let phase = RewardPhase {
                        dir: paths.sample_dir.join("reward-io"),
                        exit_code: code,
                        traces: paths.traces,
                    };
                    if let Some(r) = phase.run(command, jail, &log, out, budget).await? {
                        (e.reward, e.trace_rewards) = r;
                    }
                }
            }
        }
    }
    Ok(e)
}

/// Removes every `conftest.py` under `root` that `test_files` did not restore (links are
/// not followed; a linked directory is pytest's to skip or the tree's own); what it removed,
/// relative to `root`.
fn remove_unlisted_conftests(root: &Path, test_files: &[String]) -> std::io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let mut dirs = vec![PathBuf::new()];
    while let Some(rel) = dirs.pop() {
        for entry in std::fs::read_dir(root.join(&rel))? {
            let entry = entry?;
            let (kind, name) = (entry.file_type()?, entry.file_name());
            let path = rel.join(&name);
            if kind.is_dir() {
                dirs.push(path);
            } else if name == "conftest.py" && !runner::restored(&path, test_files) {
                std::fs::remove_file(root.join(&path))?;
                removed.push(path);
            }
        }
    }
    Ok(removed)
}

/// `dir` removed if it was there (links in it not followed) and made empty.
async fn fresh_dir(dir: &Path) -> std::io::Result<()> {
    if dir.exists() {
        tokio::fs::remove_dir_all(dir).await?;
    }
    tokio::fs::create_dir_all(dir).await
}

/// The reward command's run: what it is shown and where its reward file is.
struct RewardPhase<'a> {
    /// Its HOME, TMPDIR and working directory, with the reward file: made afresh after the
    /// evaluation's commands were killed, so nothing they left is there.
    dir: PathBuf,
    /// The evaluation command's exit code (None: killed at the budget).
    exit_code: Option<i32>,
    traces: Option<&'a [u8]>,
}

impl RewardPhase<'_> {
    /// Runs `command` confined by `jail` with only its own directory mounted (no workspace,
    /// no evaluation copy: no code the agent wrote); what it wrote to `$TOKENTAP_REWARD_FILE`,
    /// or None when it wrote nothing. A reward command that fails is an error, not a score.
    async fn run(
        &self,
        command: &str,
        jail: &TaskJail,
        log: &Path,
        out: std::fs::File,
        budget: Duration,
    ) -> anyhow::Result<Option<(f64, BTreeMap<String, f64>)>> {
        use std::io::Read;
        fresh_dir(&self.dir).await?;
        let mut shown = Vec::new();
        std::fs::File::open(log)?
            .take(EVAL_LOG_SHOWN)
            .read_to_end(&mut shown)?;
        let (reward_file, log_copy, traces_file, exit_code) = (
            self.dir.join("reward"),
            self.dir.join("eval.log"),
            self.dir.join("traces.jsonl"),
            self.exit_code
                .map_or("killed".to_owned(), |c| c.to_string()),
        );
        write_fresh(&log_copy, &shown)?;
        let mut env: Vec<(&str, &std::ffi::OsStr)> = vec![
            ("HOME", self.dir.as_os_str()),
            ("TMPDIR", self.dir.as_os_str()),
            ("TOKENTAP_REWARD_FILE", reward_file.as_os_str()),
            ("TOKENTAP_EVAL_EXIT_CODE", exit_code.as_ref()),
            ("TOKENTAP_EVAL_LOG", log_copy.as_os_str()),
        ];
        if let Some(t) = self.traces {
            write_fresh(&traces_file, t)?;
            env.push(("TOKENTAP_TRACES", traces_file.as_os_str()));
        }
        jail.give(&[&self.dir], budget).await?;
        let run = EvalRun {
            jail,
            dir: &self.dir,
            env: &env,
            mounts: Mounts {
                writable: vec![self.dir.clone()],
                ..Mounts::default()
            },
            log,
            out,
            budget,
        };
        match run.command(command, None).await? {
            Some(0) => {}
            Some(c) => anyhow::bail!("the reward command exited {c} (see eval.log)"),
            None => anyhow::bail!(
                "the reward command was killed at the {} s evaluation budget",
                budget.as_secs()
            ),
        }
        read_limited(&reward_file, REWARD_FILE_LIMIT)?
            .map(|text| parse_reward_file(&text))
            .transpose()
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

/// One evaluation's commands, run one after the other into its log.
struct EvalRun<'a> {
    jail: &'a TaskJail,
    dir: &'a Path,
    env: &'a [(&'a str, &'a std::ffi::OsStr)],
    mounts: Mounts,
    log: &'a Path,
    out: std::fs::File,
    budget: Duration,
}

impl EvalRun<'_> {
    /// Runs `command` with `sh -c` (as `pinned` when the node rewrote it: see
    /// [`crate::runner`]), appending its output to the log; `None` when killed at the budget.
    /// A sandbox that did not start is an error, not a score.
    async fn command(&self, command: &str, pinned: Option<&str>) -> anyhow::Result<Option<i32>> {
        use std::io::Write;
        let mut out = &self.out;
        writeln!(out, "$ {command}")?;
        if let Some(p) = pinned.filter(|p| *p != command) {
            writeln!(
                out,
                "# run by the node as: {}",
                p.replace(&runner::quote(runner::PYTHON_BOOTSTRAP), "BOOTSTRAP")
            )?;
        }
        let script = pinned.unwrap_or(command);
        let mut confined = self
            .jail
            .shell("eval", script, self.dir, self.env, &self.mounts)?;
        let mut child = confined
            .cmd
            .stdin(Stdio::null())
            .stdout(self.out.try_clone()?)
            .stderr(self.out.try_clone()?)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()?;
        let pgid = child.id().map(|p| p as i32);
        let code = match tokio::time::timeout(self.budget, child.wait()).await {
            Ok(status) => Some(status?.code()),
            Err(_) => None,
        };
        if let Some(pgid) = pgid {
            // SAFETY: kill(2) on the process group this evaluation leads (what it left
            // running goes too).
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
        let _ = child.wait().await;
        if let Some(cg) = &confined.cgroup {
            cg.kill_all();
        }
        confined.check_started(self.log)?;
        match code {
            Some(c) => Ok(c),
            None => {
                writeln!(
                    out,
                    "(killed at the {} s evaluation budget)",
                    self.budget.as_secs()
                )?;
                Ok(None)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    /// Confinement without a sandbox (unit tests run anywhere): a cleared environment.
    fn plain() -> TaskJail {
        TaskJail {
            sandbox: None,
            limits: tokentap_cgroup::Limits::default(),
            path: "/usr/local/bin:/usr/bin:/bin".into(),
            name: "unit".into(),
        }
    }

    fn command(command: &str, reward_command: Option<&str>, overrides: bool) -> Evaluator {
        Evaluator::Command {
            command: command.into(),
            test_files: vec![],
            reward_command: reward_command.map(str::to_owned),
            reward_overrides_failure: overrides,
        }
    }

    async fn run_command(command: &str, traces: Option<&[u8]>, budget: Duration) -> Evaluation {
        let dir = tempfile::tempdir().unwrap();
        run_evaluator_in(
            dir.path(),
            &self::command(command, None, false),
            traces,
            budget,
        )
        .await
        .unwrap()
    }

    async fn run_evaluator_in(
        dir: &Path,
        evaluator: &Evaluator,
        traces: Option<&[u8]>,
        budget: Duration,
    ) -> anyhow::Result<Evaluation> {
        let (original, work) = (dir.join("original"), dir.join("work"));
        std::fs::create_dir_all(&original).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        let paths = EvalPaths {
            work: &work,
            original: &original,
            sample_dir: dir,
            traces,
        };
        evaluate(evaluator, true, &paths, &plain(), budget).await
    }

    #[tokio::test]
    async fn a_reward_command_sees_the_traces_and_rewards_them_one_by_one() {
        let dir = tempfile::tempdir().unwrap();
        let traces = b"{\"trace_id\": \"s-1/0\"}\n";
        // Rewards the first trace named in $TOKENTAP_TRACES with 0.5, the outcome with 1; it
        // is shown what the evaluation printed and how it exited.
        let reward = r#"grep -q TESTS-RAN "$TOKENTAP_EVAL_LOG" && [ "$TOKENTAP_EVAL_EXIT_CODE" = 0 ] || exit 3
id=$(sed -n 's/.*"trace_id": "\([^"]*\)".*/\1/p' "$TOKENTAP_TRACES" | head -1)
printf '{"reward": 1, "traces": {"%s": 0.5}}' "$id" > "$TOKENTAP_REWARD_FILE""#;
        let evaluator = command("echo TESTS-RAN", Some(reward), false);
        let budget = Duration::from_secs(10);
        let e = run_evaluator_in(dir.path(), &evaluator, Some(traces), budget)
            .await
            .unwrap();
        assert_eq!(e.reward, 1.0);
        assert_eq!(e.trace_rewards.get("s-1/0"), Some(&0.5), "{e:?}");
        // A reward command that fails is an error, not a score.
        let failing = command("true", Some("exit 3"), false);
        let err = run_evaluator_in(dir.path(), &failing, None, budget)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("reward command exited 3"), "{err}");
    }

    /// The attack: code the agent wrote (a planted test the evaluation runs) writes the
    /// reward. The tests are given no reward file, whatever they look for; the reward
    /// command's directory is made only after they are dead; and their failure stands unless
    /// the task says a reward file may override it.
    #[tokio::test]
    async fn code_the_evaluation_runs_cannot_set_the_reward() {
        let dir = tempfile::tempdir().unwrap();
        // What a planted test does: write 1 wherever a reward file might be, leave a process
        // behind to write it later, then fail (the real test failed).
        let planted = r#"for f in "$TOKENTAP_REWARD_FILE" ../reward-io/reward ../eval-io/reward; do
  [ -n "$f" ] && mkdir -p "$(dirname "$f")" && echo 1 > "$f"; done
(sleep 1; echo 1 > ../reward-io/reward) >/dev/null 2>&1 &
exit 1"#;
        let budget = Duration::from_secs(10);
        let only_tests = command(planted, None, false);
        let e = run_evaluator_in(dir.path(), &only_tests, None, budget)
            .await
            .unwrap();
        assert_eq!((e.reward, e.exit_code), (0.0, Some(1)), "{e:?}");
        // With a reward command that writes nothing, after a failing test: 0, and it did not
        // even run (it would have exited 9).
        let with_reward = command(planted, Some("exit 9"), false);
        let e = run_evaluator_in(dir.path(), &with_reward, None, budget)
            .await
            .unwrap();
        assert_eq!(e.reward, 0.0, "{e:?}");
        // Overriding allowed: the reward command runs and its reward file is its own, fresh
        // (what the planted test wrote there, then or later, is gone).
        let overriding = command(
            planted,
            Some(
                r#"[ -e "$TOKENTAP_REWARD_FILE" ] && exit 4; sleep 2; echo 0.25 > "$TOKENTAP_REWARD_FILE""#,
            ),
            true,
        );
        let e = run_evaluator_in(dir.path(), &overriding, None, budget)
            .await
            .unwrap();
        assert_eq!(e.reward, 0.25, "{e:?}");
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
        let all = evaluate(&evaluator(&["ok"]), true, &paths, &plain(), budget)
            .await
            .unwrap();
        assert_eq!((all.reward, all.failed.len()), (1.0, 0));
        let one_missing = evaluate(
            &evaluator(&["ok", "missing"]),
            true,
            &paths,
            &plain(),
            budget,
        )
        .await
        .unwrap();
        assert_eq!(one_missing.reward, 0.0);
        assert_eq!(one_missing.failed, ["missing"]);
    }

    #[tokio::test]
    async fn an_evaluator_sees_nothing_of_the_nodes_environment() {
        // The test runner's environment (CARGO_*, HOME, ...) stands in for the node's.
        let dir = tempfile::tempdir().unwrap();
        let evaluator = command(
            "env > \"$HOME/env\"; cp \"$HOME/env\" seen",
            Some("env > \"$HOME/env\""),
            false,
        );
        let e = run_evaluator_in(dir.path(), &evaluator, None, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(e.exit_code, Some(0), "{e:?}");
        // The variable names in an `env` dump, but the shell's own.
        let names = |rel: &str| {
            let seen = std::fs::read_to_string(dir.path().join(rel)).unwrap();
            let mut keys: Vec<String> = seen
                .lines()
                .filter_map(|l| l.split_once('=').map(|(k, _)| k.to_owned()))
                .filter(|k| !["PWD", "SHLVL", "_", "OLDPWD"].contains(&k.as_str()))
                .collect();
            keys.sort();
            keys
        };
        assert_eq!(
            names("eval/seen"),
            [
                "HOME",
                "LANG",
                "PATH",
                "PYTHONNOUSERSITE",
                "PYTHONSAFEPATH",
                "TMPDIR"
            ]
        );
        assert_eq!(
            names("reward-io/env"),
            [
                "HOME",
                "LANG",
                "PATH",
                "TMPDIR",
                "TOKENTAP_EVAL_EXIT_CODE",
                "TOKENTAP_EVAL_LOG",
                "TOKENTAP_REWARD_FILE"
            ]
        );
    }

    #[tokio::test]
    async fn a_reward_file_planted_as_a_link_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "1").unwrap();
        let (original, work) = (dir.path().join("original"), dir.path().join("work"));
        std::fs::create_dir_all(&original).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        let evaluator = command(
            "true",
            Some(&format!(
                "ln -s {} \"$TOKENTAP_REWARD_FILE\"",
                secret.display()
            )),
            false,
        );
        let paths = EvalPaths {
            work: &work,
            original: &original,
            sample_dir: dir.path(),
            traces: None,
        };
        let e = evaluate(&evaluator, true, &paths, &plain(), Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("reward"), "{e}");
    }

    #[tokio::test]
    async fn an_evaluation_over_budget_is_killed_and_scores_zero() {
        let e = run_command("sleep 30", None, Duration::from_millis(300)).await;
        assert_eq!((e.reward, e.exit_code), (0.0, None));
    }
}
