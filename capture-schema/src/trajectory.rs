//! Trajectories: what the reconstruction worker builds from capture records, for trainers.
//!
//! A [`Trace`] is one trainable token sequence: `prompt_ids` (context, never trained on)
//! followed by `response_ids`, with `loss_mask` 1 exactly on the tokens the model sampled and
//! `logprobs` aligned with `response_ids`. One row per trace in `traces.jsonl` /
//! `traces.parquet`; one [`SessionReport`] per session in `sessions.jsonl`.
//!
//! Every field is a scalar, a string or a list of them (messages and tools travel as JSON
//! text), so pandas and Hugging Face `datasets` read the files with no custom code.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::chat::FinishReason;

/// Version of the trajectory layout; bumped on any incompatible change.
pub const TRAJECTORY_SCHEMA_VERSION: u32 = 1;

/// How a session's calls become traces.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// One trace per call: its prompt, and its sampled tokens as the response.
    PerRequest,
    /// Calls whose prompts extend the previous call's prompt and answer become one trace.
    #[default]
    PrefixMerge,
}

impl Strategy {
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::PerRequest => "per-request",
            Strategy::PrefixMerge => "prefix-merge",
        }
    }
}

/// Why a trace begins where it does: the first call of a session, or the reason the call
/// could not continue any open chain.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum SplitCause {
    /// The session's first call with token data.
    SessionStart,
    /// Per-request strategy: every call is its own trace.
    PerRequest,
    /// The prompt extends no open chain: a subagent, a compaction, rewritten history or a
    /// changed system prompt.
    NewPrefix,
    /// The prompt extends a chain's context but does not repeat the tokens the model sampled
    /// there: the chat template re-rendered that turn differently (e.g. reasoning stripped).
    Rerendered,
    /// The call repeated the prompt of a chain's last call and superseded it; this trace is the
    /// superseded answer, kept because the model really sampled it.
    Superseded,
}

impl SplitCause {
    pub fn as_str(self) -> &'static str {
        match self {
            SplitCause::SessionStart => "session_start",
            SplitCause::PerRequest => "per_request",
            SplitCause::NewPrefix => "new_prefix",
            SplitCause::Rerendered => "rerendered",
            SplitCause::Superseded => "superseded",
        }
    }
}

/// One model call inside a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TraceCall {
    /// The capture record of the call.
    pub record_id: String,
    /// Index in `response_ids` where the call's sampled tokens begin; the tokens before it
    /// (`prompt_ids` and `response_ids[..response_start]`) are exactly the call's prompt.
    pub response_start: u32,
    /// Number of sampled tokens the record holds (mask 1 when `trainable`).
    pub sampled_len: u32,
    /// Whether those tokens carry mask 1: false when the record lacks ids or logprobs for them.
    pub trainable: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<FinishReason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<String>,
    /// The engine's weight version when the call's answer ended (its record's
    /// `backend.engine_weight_version.at_end`), when tokentap read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_weight_version: Option<String>,
    /// The engine's weights changed while the call ran: its tokens may come from two policies.
    /// Always written (Parquet's columns are the same in every row).
    #[serde(default)]
    pub straddles_weight_update: bool,
}

/// One trainable token sequence (a row of `traces.jsonl` / `traces.parquet`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Trace {
    /// [`TRAJECTORY_SCHEMA_VERSION`] at the time of writing.
    pub schema_version: u32,
    /// `{session_id}/{index}`; unique within a reconstruction.
    pub trace_id: String,
    pub session_id: String,
    pub strategy: Strategy,
    /// Position of the trace in its session, from 0, in order of each trace's first call.
    pub index: u32,
    /// Why the trace begins here.
    pub started_by: SplitCause,
    /// `--token-mode tito`: why tito rendered the trace's first call whole (`first`,
    /// `edited`, `compacted`, …); null when that call extended an earlier one, or was not
    /// built in tito.
    #[serde(default)]
    pub tito_branch: Option<crate::token_mode::TitoBranchCause>,
    /// Context tokens: the first call's prompt exactly as the engine saw it.
    pub prompt_ids: Vec<u32>,
    /// Everything after the prompt: sampled tokens and, between calls, the tokens the next
    /// prompt added (tool results, user turns, template glue).
    pub response_ids: Vec<u32>,
    /// 1 where `response_ids` holds a token the model sampled (with its logprob), else 0.
    pub loss_mask: Vec<u8>,
    /// The sampling logprob of each token of `response_ids`; 0.0 where `loss_mask` is 0.
    pub logprobs: Vec<f32>,
    /// The calls merged into the trace, in order.
    pub calls: Vec<TraceCall>,
    /// True when the calls were served by more than one policy version.
    pub spans_policy_versions: bool,
    /// True when the engine reported more than one weight version for the calls, or a call
    /// straddled a weight update (`TraceCall::straddles_weight_update`). Always written, as
    /// `spans_policy_versions` is.
    #[serde(default)]
    pub spans_engine_weight_versions: bool,
    /// The last call's conversation plus its answer, as JSON text, for reference.
    pub messages_json: String,
    /// The tools offered in the last call, as JSON text (`[]` when none).
    pub tools_json: String,
    /// The outcome reward, filled by an evaluator; absent until then.
    #[serde(default)]
    pub reward: Option<f64>,
    /// The group the reward is relative to (a rollout node's task id: one GRPO group).
    #[serde(default)]
    pub group_id: Option<String>,
    /// Token data the trace lacks, each with a reason (never filled by re-tokenizing).
    #[serde(default)]
    pub gaps: Vec<String>,
}

impl Trace {
    /// Number of tokens with loss mask 1.
    pub fn trainable_tokens(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m == 1).count()
    }
}

/// Where a session's calls were split, and what the builder did with each call.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionStats {
    /// Records of the session seen by the builder.
    pub calls: u32,
    /// Calls with no prompt ids (failed before the engine saw them): in no trace.
    pub calls_without_tokens: u32,
    pub traces: u32,
    /// Calls appended to an existing chain (prefix-merge only).
    pub merged_calls: u32,
    /// Traces started, by cause.
    pub splits: BTreeMap<SplitCause, u32>,
    /// Calls that repeated a chain's last prompt after it failed, was cut short or ran out of
    /// tokens.
    pub retries: u32,
    /// Calls that repeated a chain's last prompt after it completed normally.
    pub duplicates: u32,
    /// Record ids seen twice (redelivery); the second copy is ignored.
    pub duplicate_records: u32,
    /// Calls that ended by the token budget.
    pub truncated_turns: u32,
    /// Calls that ended early (client gone, backend error, timeout).
    pub aborted_turns: u32,
    /// Calls whose sampled tokens could not be given mask 1 (ids or logprobs missing).
    pub calls_with_token_gaps: u32,
    /// True when the session's calls were served by more than one policy version.
    pub spans_policy_versions: bool,
    /// `--token-mode observe`'s findings on the session's calls; absent when none had any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_mode: Option<crate::token_mode::TokenModeTally>,
    /// `--token-mode tito`'s prompts for the session's calls: extensions, branches by cause,
    /// prompt tokens by origin; absent when none was built in tito.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tito: Option<crate::token_mode::TitoTally>,
}

/// Independent check of the traces against their records.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Faithfulness {
    /// Tokens with mask 1.
    pub trainable_tokens: u64,
    /// Tokens with mask 0 in `response_ids`.
    pub masked_tokens: u64,
    /// Mask-1 tokens that are not the sampled id of their record with its logprob, contexts
    /// that differ from what the engine saw, and misaligned fields. Must be 0.
    pub violations: u64,
    /// The first few violations, described.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<String>,
}

/// Where a trace began, by record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SplitPoint {
    pub trace_index: u32,
    pub record_id: String,
    pub cause: SplitCause,
}

/// One row of `sessions.jsonl`: a session's statistics and faithfulness report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionReport {
    pub schema_version: u32,
    pub session_id: String,
    pub strategy: Strategy,
    pub stats: SessionStats,
    pub faithfulness: Faithfulness,
    pub split_points: Vec<SplitPoint>,
}
