//! What a trainer submits (a [`TaskSpec`]) and what the node tracks for each of its samples.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use tokentap_cgroup::Limits;

/// One task: a GRPO group of `num_samples` runs of one harness on one workspace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    /// The trainer's id for the task (the group id of its samples).
    pub task_id: String,
    /// What the agent is asked to do.
    pub instruction: String,
    pub workspace: Workspace,
    pub harness: Harness,
    #[serde(default = "one")]
    pub num_samples: u32,
    #[serde(default)]
    pub sampling: Sampling,
    #[serde(default)]
    pub budgets: Budgets,
    pub evaluator: Evaluator,
    /// `prefix-merge` (default) or `per-request`.
    #[serde(default)]
    pub strategy: tokentap_schema::Strategy,
    #[serde(default)]
    pub policy_version: Option<String>,
    /// Higher runs first.
    #[serde(default)]
    pub priority: i32,
    #[serde(default)]
    pub callback_url: Option<String>,
    /// The agent's memory/CPU/process limits (each unset one falls back to the node's).
    #[serde(default)]
    pub limits: Limits,
    /// Run the agent in a bubblewrap sandbox: no network but the capture, everything
    /// read-only but its own directory.
    #[serde(default)]
    pub sandbox: bool,
    /// What becomes of the traces of a sample that did not complete (timeout, error,
    /// cancelled); their reward is 0 in every case.
    #[serde(default)]
    pub incomplete: Incomplete,
    /// How the agent's model calls reach the capture.
    #[serde(default)]
    pub capture: CaptureMode,
    /// The token mode of the samples' calls (`off`, `observe`, `tito`; absent: the node's
    /// `--token-mode`). A node runs its own mode and `off`; other modes are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_mode: Option<TokenMode>,
}

/// What a node lets one task ask for; its agent limits (the defaults of tasks that set none)
/// are ceilings too.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeCeilings {
    /// Most samples in one task.
    pub max_samples: u32,
    /// Longest budget of any kind (session, agent, evaluation), in seconds.
    pub max_budget_s: u64,
    /// The node's `--token-mode`: what it loaded at start (the tokenizer, the ids backend)
    /// decides which modes its tasks can ask for.
    pub token_mode: TokenMode,
}

impl Default for NodeCeilings {
    fn default() -> Self {
        NodeCeilings {
            max_samples: 1024,
            max_budget_s: 24 * 3600,
            token_mode: TokenMode::Off,
        }
    }
}

impl TaskSpec {
    /// Refuses a task that asks for more than the node gives: more samples or longer budgets
    /// than its ceilings, more memory, CPU or processes than its agent `limits`, or a token
    /// mode it was not started ready for; and one whose evaluator runs a file of the agent's
    /// tree as its test runner ([`Evaluator::shadowing`]).
    pub fn over_ceilings(&self, ceilings: &NodeCeilings, limits: &Limits) -> Result<(), String> {
        self.evaluator.shadowing()?;
        if let Some(asked) = self.token_mode {
            asked.runs_on(ceilings.token_mode)?;
        }
        if self.num_samples == 0 || self.num_samples > ceilings.max_samples {
            return Err(format!(
                "num_samples must be between 1 and {} on this node (got {})",
                ceilings.max_samples, self.num_samples
            ));
        }
        let b = &self.budgets;
        for (name, v) in [
            ("session_s", b.session_s),
            ("agent_s", b.agent_s),
            ("eval_s", b.eval_s),
        ] {
            if v > ceilings.max_budget_s {
                return Err(format!(
                    "budgets.{name} = {v} is over this node's ceiling of {} s",
                    ceilings.max_budget_s
                ));
            }
        }
        let asked = &self.limits;
        let over = |name: &str, asked: String, node: String| {
            Err(format!(
                "limits.{name} = {asked} is over this node's limit of {node}"
            ))
        };
        if let (Some(a), Some(n)) = (asked.memory_mb, limits.memory_mb) {
            if a > n {
                return over("memory_mb", a.to_string(), n.to_string());
            }
        }
        if let (Some(a), Some(n)) = (asked.cpus, limits.cpus) {
            if !(a > 0.0 && a <= n) {
                return over("cpus", a.to_string(), n.to_string());
            }
        }
        if let (Some(a), Some(n)) = (asked.pids, limits.pids) {
            if a > n {
                return over("pids", a.to_string(), n.to_string());
            }
        }
        Ok(())
    }
}

/// A task's token mode: `--token-mode`'s values, as a task names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum TokenMode {
    /// Text mode: the engine renders the conversation; nothing of tokentap's own ids.
    Off,
    /// Text mode, and tokentap renders and tokenizes each call too, recording how its ids
    /// compare with the engine's (`token_observation` on the records).
    Observe,
    /// Token in, token out: the engine gets tokentap's prompt ids, built from the session's
    /// earlier ids (`token_in` on the records).
    Tito,
}

impl TokenMode {
    pub fn as_str(self) -> &'static str {
        match self {
            TokenMode::Off => "off",
            TokenMode::Observe => "observe",
            TokenMode::Tito => "tito",
        }
    }

    /// Whether a node started with `--token-mode node` can run a task in this mode: its own,
    /// or `off`. `observe` and `tito` need the model's tokenizer loaded (and `tito` its ids
    /// backend built) when the node starts, so a node cannot take them up per task; `off`
    /// needs nothing more.
    pub fn runs_on(self, node: TokenMode) -> Result<(), String> {
        if self == node || self == TokenMode::Off {
            return Ok(());
        }
        let can = match node {
            TokenMode::Off => "only \"off\"".to_owned(),
            other => format!("\"{}\" and \"off\"", other.as_str()),
        };
        Err(format!(
            "token_mode \"{asked}\" needs a node started with --token-mode {asked}; this node was started with --token-mode {node} and runs {can}",
            asked = self.as_str(),
            node = node.as_str(),
        ))
    }
}

impl From<tokentap_token_mode::TokenMode> for TokenMode {
    fn from(mode: tokentap_token_mode::TokenMode) -> Self {
        match mode {
            tokentap_token_mode::TokenMode::Off => TokenMode::Off,
            tokentap_token_mode::TokenMode::Observe => TokenMode::Observe,
            tokentap_token_mode::TokenMode::Tito => TokenMode::Tito,
        }
    }
}

/// How a sample's model calls are captured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum CaptureMode {
    /// The harness is pointed at the capture through its base-URL settings.
    #[default]
    BaseUrl,
    /// The agent keeps its own (hard-coded) endpoints: its connects to port 443 are redirected
    /// by eBPF and the allow-listed LLM hosts intercepted with the node's CA (a closed binary;
    /// needs a node running as root with the eBPF program built; not with `sandbox`).
    Transparent,
}

/// The policy for traces of samples that did not complete.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Incomplete {
    /// Kept with every loss-mask bit cleared: nothing is trained on, nothing is lost.
    #[default]
    ZeroMask,
    /// Kept as sampled (mask intact), for trainers that weigh partial work themselves.
    Keep,
    /// Not written (the calls stay in the node's spool).
    Drop,
}

fn one() -> u32 {
    1
}

/// Where a sample's working copy comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Workspace {
    /// A local directory, copied.
    Dir {
        path: String,
        #[serde(default)]
        setup: Option<String>,
    },
    /// A git repository at a commit, exported without history.
    Git {
        url: String,
        commit: String,
        #[serde(default)]
        setup: Option<String>,
    },
}

/// Which harness runs the task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case", tag = "name", deny_unknown_fields)]
pub enum Harness {
    Codex,
    ClaudeCode,
    QwenCode,
    Pi,
    /// Any CLI: `{instruction}` in the arguments is replaced by the instruction.
    Command {
        argv: Vec<String>,
    },
}

/// Sampling parameters passed to the engine for every call of the sample.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Sampling {
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
}

/// Time limits, in seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Budgets {
    /// The whole sample: INIT + RUN + POST_RUN.
    #[serde(default = "default_session_s")]
    pub session_s: u64,
    /// The harness process group; killed when it runs over.
    #[serde(default = "default_agent_s")]
    pub agent_s: u64,
    /// Each evaluation command; killed when it runs over (the sample scores 0).
    #[serde(default = "default_eval_s")]
    pub eval_s: u64,
}

fn default_eval_s() -> u64 {
    600
}

fn default_session_s() -> u64 {
    3600
}

fn default_agent_s() -> u64 {
    1800
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets {
            session_s: default_session_s(),
            agent_s: default_agent_s(),
            eval_s: default_eval_s(),
        }
    }
}

/// How a finished sample is scored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case", tag = "kind", deny_unknown_fields)]
pub enum Evaluator {
    /// A command run in a fresh copy of the final workspace: exit 0 → 1.0, else 0.0.
    Command {
        command: String,
        /// Test files restored from the original workspace before the command runs.
        #[serde(default)]
        test_files: Vec<String>,
        /// Opt-in: a reward other than 0/1, or rewards per trace. This command runs after
        /// `command`, in a sandbox of its own that holds no workspace, so no code the agent
        /// wrote runs there, and it alone is given `$TOKENTAP_REWARD_FILE` (in a directory
        /// only it can write). It sees `$TOKENTAP_EVAL_EXIT_CODE`, `$TOKENTAP_EVAL_LOG` (a
        /// copy of what `command` printed) and `$TOKENTAP_TRACES` (the sample's traces).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reward_command: Option<String>,
        /// Whether the reward file may score a sample whose `command` failed. By default a
        /// failing `command` scores 0 and `reward_command` does not run.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        reward_overrides_failure: bool,
    },
    /// SWE-bench style: reward 1 only when every FAIL_TO_PASS and PASS_TO_PASS test passes.
    Swebench {
        test_command: String,
        fail_to_pass: Vec<String>,
        pass_to_pass: Vec<String>,
        #[serde(default)]
        test_files: Vec<String>,
    },
    /// 1 when the harness exited 0 within its budget.
    SessionCompleted,
}

impl Evaluator {
    /// Why a node refuses it: a command that plainly runs a file of the agent's tree as its
    /// test runner (`sh run_tests.sh` without `run_tests.sh` in `test_files`, `make` without
    /// its `Makefile`, …): see [`crate::runner`].
    pub fn shadowing(&self) -> Result<(), String> {
        let (commands, test_files) = match self {
            Evaluator::Command {
                command,
                test_files,
                ..
            } => (vec![command.clone()], test_files),
            Evaluator::Swebench {
                test_command,
                test_files,
                ..
            } => (
                vec![crate::runner::with_test(
                    test_command,
                    crate::runner::SOME_TEST_ID,
                )],
                test_files,
            ),
            Evaluator::SessionCompleted => return Ok(()),
        };
        for c in commands {
            crate::runner::analyse(&c, test_files)?;
        }
        Ok(())
    }

    /// Whether it is shown the sample's traces (`$TOKENTAP_TRACES`) to reward them one by one.
    pub fn reads_traces(&self) -> bool {
        matches!(
            self,
            Evaluator::Command {
                reward_command: Some(_),
                ..
            }
        )
    }
}

/// Where a sample is in the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Queued,
    Init,
    Run,
    PostRun,
    Done,
}

/// How a sample ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum Outcome {
    Completed { reward: f64 },
    Timeout { reward: f64, reason: String },
    Error { reason: String },
    Cancelled,
}

/// One sample of a rollout, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Sample {
    pub sample_id: String,
    pub rollout_id: String,
    /// The task's id: the GRPO group this sample belongs to.
    #[serde(default)]
    pub task_id: String,
    pub index: u32,
    pub stage: Stage,
    /// Starts of INIT, RUN, POST_RUN and the end, unix ms (0 = not yet).
    pub stage_started_ms: [u64; 4],
    /// Ends of INIT and of RUN, unix ms (0 = not yet). Between INIT's end and RUN's start a
    /// prewarmed sample waits for an agent slot; between RUN's end and POST_RUN's start, for
    /// a POST_RUN worker.
    #[serde(default)]
    pub stage_ended_ms: [u64; 2],
    /// Times this sample was started (a node restart re-runs what was running).
    pub attempt: u32,
    pub outcome: Option<Outcome>,
    /// What its captured calls became (absent when the node captures nothing).
    #[serde(default)]
    pub trajectory: Option<TrajectorySummary>,
    /// What the evaluator found (tests passed and failed, its log).
    #[serde(default)]
    pub evaluation: Option<Evaluation>,
    /// How the agent ran (exit code, time, memory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentReport>,
    /// The result's delivery to the rollout's `callback_url`, once it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callback: Option<CallbackStatus>,
    /// The node that runs (or ran) it, on a cluster of nodes sharing a bus.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

impl Sample {
    /// The capture session of the sample's current attempt: its id, suffixed `-a{n}` from the
    /// second attempt on, so that the calls of a re-run never join those of the attempt the
    /// node's restart interrupted (both stay in the node's spool).
    pub fn capture_session(&self) -> String {
        if self.attempt <= 1 {
            self.sample_id.clone()
        } else {
            format!("{}-a{}", self.sample_id, self.attempt)
        }
    }
}

/// How a sample's agent ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AgentReport {
    /// None when it was killed (budget, cancel) or died of a signal.
    pub exit_code: Option<i32>,
    pub timed_out: bool,
    pub duration_ms: u64,
    /// Peak memory of its cgroup, when it had limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_bytes: Option<u64>,
    /// The kernel's OOM killer ended a process of the agent (its memory limit).
    #[serde(default)]
    pub oom_killed: bool,
    /// A fork of the agent's was refused at its process limit.
    #[serde(default)]
    pub pids_limit_hit: bool,
}

/// How a result's callback delivery ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CallbackStatus {
    pub delivered: bool,
    pub attempts: u32,
    /// Why it was given up (a 4xx other than 408/425/429, or too many attempts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A sample's traces, written to `traces.jsonl` in its directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TrajectorySummary {
    pub path: String,
    /// The capture session its records carry in the node's spool (the sample id, suffixed
    /// `-a{n}` for a re-run).
    #[serde(default)]
    pub session_id: String,
    pub calls: u32,
    pub traces: u32,
    pub trainable_tokens: u64,
    pub faithfulness_violations: u64,
    /// False when some call's record had not arrived when the sample was reconstructed.
    pub complete: bool,
}

/// What `POST /v1/rollouts` creates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Rollout {
    pub rollout_id: String,
    pub submitted_ms: u64,
    pub spec: TaskSpec,
    pub cancelled: bool,
}

impl Rollout {
    /// Whether `sample` is one of this rollout's: its own id, an index within the rollout's
    /// samples, and the id made of the two.
    pub fn owns(&self, sample: &Sample) -> bool {
        sample.rollout_id == self.rollout_id
            && sample.index < self.spec.num_samples
            && sample.sample_id == format!("{}-{}", self.rollout_id, sample.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_task_parses_with_defaults() {
        let spec: TaskSpec = serde_json::from_value(serde_json::json!({
            "task_id": "t1",
            "instruction": "fix the failing test",
            "workspace": {"dir": {"path": "/tmp/project"}},
            "harness": {"name": "pi"},
            "evaluator": {"kind": "command", "command": "python3 -m unittest"}
        }))
        .unwrap();
        assert_eq!(spec.num_samples, 1);
        assert_eq!(spec.budgets, Budgets::default());
        assert_eq!(spec.strategy, tokentap_schema::Strategy::PrefixMerge);
        assert_eq!(spec.harness, Harness::Pi);
    }

    #[test]
    fn a_task_cannot_ask_for_more_than_the_node_gives() {
        let spec = |extra: serde_json::Value| -> TaskSpec {
            let mut v = serde_json::json!({
                "task_id": "t", "instruction": "x",
                "workspace": {"dir": {"path": "/tmp"}},
                "harness": {"name": "pi"},
                "evaluator": {"kind": "session-completed"}
            });
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            serde_json::from_value(v).unwrap()
        };
        let ceilings = NodeCeilings {
            max_samples: 8,
            max_budget_s: 600,
            token_mode: TokenMode::Off,
        };
        let node = Limits {
            memory_mb: Some(1024),
            cpus: Some(1.0),
            pids: None,
        };
        let ok = |e: serde_json::Value| spec(e).over_ceilings(&ceilings, &node);
        assert!(ok(serde_json::json!({"num_samples": 8, "budgets": {"session_s": 600, "agent_s": 300, "eval_s": 60}})).is_ok());
        assert!(ok(
            serde_json::json!({"limits": {"memory_mb": 512, "cpus": 0.5, "pids": 100000},
                "budgets": {"session_s": 600, "agent_s": 300, "eval_s": 60}})
        )
        .is_ok());
        for (bad, says) in [
            (serde_json::json!({"num_samples": 9}), "num_samples"),
            (serde_json::json!({"num_samples": 0}), "num_samples"),
            (
                serde_json::json!({"budgets": {"agent_s": 601, "session_s": 600}}),
                "agent_s",
            ),
            (serde_json::json!({}), "session_s"), // the default session budget is an hour
            (
                serde_json::json!({"limits": {"memory_mb": 4096}}),
                "memory_mb",
            ),
            (serde_json::json!({"limits": {"cpus": 2.0}}), "cpus"),
        ] {
            let mut e = bad.clone();
            if !e.as_object().unwrap().contains_key("budgets") {
                e["budgets"] = serde_json::json!({"session_s": 600, "agent_s": 300, "eval_s": 60});
            }
            if says == "session_s" {
                e = bad.clone();
            }
            let err = ok(e).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
    }

    /// A node runs tasks in its own token mode and in `off`; a task asking for another is
    /// refused at submission, its message naming the flag the node would need.
    #[test]
    fn a_task_runs_in_its_nodes_token_mode_or_off() {
        let spec = |mode: Option<&str>| -> TaskSpec {
            let mut v = serde_json::json!({
                "task_id": "t", "instruction": "x",
                "workspace": {"dir": {"path": "/tmp"}},
                "harness": {"name": "pi"},
                "evaluator": {"kind": "session-completed"},
                "budgets": {"session_s": 600, "agent_s": 300, "eval_s": 60}
            });
            if let Some(m) = mode {
                v["token_mode"] = m.into();
            }
            serde_json::from_value(v).unwrap()
        };
        let on = |node: TokenMode, asked: Option<&str>| {
            let ceilings = NodeCeilings {
                token_mode: node,
                ..NodeCeilings::default()
            };
            spec(asked).over_ceilings(&ceilings, &Limits::default())
        };
        use TokenMode::*;
        for (node, accepted) in [
            (Off, &[None, Some("off")][..]),
            (Observe, &[None, Some("off"), Some("observe")][..]),
            (Tito, &[None, Some("off"), Some("tito")][..]),
        ] {
            for asked in accepted {
                assert_eq!(on(node, *asked), Ok(()), "{asked:?} on a {node:?} node");
            }
        }
        for (node, asked, says) in [
            (
                Off,
                "tito",
                "token_mode \"tito\" needs a node started with --token-mode tito; this node was started with --token-mode off and runs only \"off\"",
            ),
            (
                Off,
                "observe",
                "token_mode \"observe\" needs a node started with --token-mode observe; this node was started with --token-mode off and runs only \"off\"",
            ),
            (
                Observe,
                "tito",
                "token_mode \"tito\" needs a node started with --token-mode tito; this node was started with --token-mode observe and runs \"observe\" and \"off\"",
            ),
            (
                Tito,
                "observe",
                "token_mode \"observe\" needs a node started with --token-mode observe; this node was started with --token-mode tito and runs \"tito\" and \"off\"",
            ),
        ] {
            assert_eq!(on(node, Some(asked)).unwrap_err(), says);
        }
        // Absent, it is not written back: a rollout stored (or sealed) before the field
        // existed reads and serializes as it did.
        let v = serde_json::to_value(spec(None)).unwrap();
        assert!(v.get("token_mode").is_none(), "{v}");
        assert_eq!(
            serde_json::to_value(spec(Some("tito"))).unwrap()["token_mode"],
            "tito"
        );
        let e = serde_json::from_value::<TaskSpec>(serde_json::json!({
            "task_id": "t", "instruction": "x",
            "workspace": {"dir": {"path": "/tmp"}},
            "harness": {"name": "pi"},
            "evaluator": {"kind": "session-completed"},
            "token_mode": "replace"
        }))
        .unwrap_err();
        assert!(e.to_string().contains("replace"), "{e}");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let err = serde_json::from_value::<TaskSpec>(serde_json::json!({
            "task_id": "t1", "instruction": "x",
            "workspace": {"dir": {"path": "/tmp"}},
            "harness": {"name": "pi"},
            "evaluator": {"kind": "session-completed"},
            "num_sampels": 4
        }))
        .unwrap_err();
        assert!(err.to_string().contains("num_sampels"), "{err}");
    }
}

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
    /// Set when the node ran an evaluation command as written, without pinning what it runs
    /// (shell syntax it does not analyse: pipes, redirections, variables, `sh -c`): why. The
    /// reward may then be the agent's tree's doing (a planted module or script standing in
    /// for the test runner); absent, every program the evaluation started was the node's
    /// choice. See docs/security.md, "Rewards the agent's tree cannot shadow".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadowable: Option<String>,
}
