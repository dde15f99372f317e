//! `--token-mode observe`: tokentap renders and tokenizes each call's conversation itself with
//! the model's own chat template and tokenizer, and records how that compares with the
//! engine's prompt ids and with the session's earlier calls. Calls still go to the engine as
//! text; this measures how much of the data re-rendering changes before anything is switched.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What tokentap found out about one call's prompt ids (`CaptureRecord::token_observation`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TokenObservation {
    /// tokentap's ids for the conversation against the engine's prompt ids.
    pub render: RenderComparison,
    /// How the engine's prompt goes on from the session's earlier calls.
    pub continuation: Continuation,
    /// Time tokentap took to render and tokenize the conversation, in microseconds.
    pub render_us: u64,
}

/// tokentap's rendering of the call against what the engine saw.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum RenderComparison {
    /// The same ids.
    Equal { tokens: u32 },
    /// Different ids, from token `at` on.
    Differs {
        at: u32,
        ours_len: u32,
        engine_len: u32,
        /// The first differing stretch, classified.
        span: DriftSpan,
    },
    /// Nothing to compare: no engine prompt ids, or the template refused or failed.
    Unavailable { reason: String },
}

/// How a call's prompt continues the session (compared by token ids, never by text).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Continuation {
    /// The session's first call on this proxy (or the first since its state was evicted).
    First,
    /// The prompt is an earlier call's prompt + the ids it sampled + `appended` new tokens:
    /// append-only, one trace.
    Extends { record_id: String, appended: u32 },
    /// The prompt repeats an earlier call's prompt exactly (a retry).
    Repeats { record_id: String },
    /// The prompt goes on with an earlier call's conversation (it keeps most of a turn the
    /// model sampled there, as sampled or as the template re-rendered it) but not as it was:
    /// re-rendered, reasoning dropped, or edited by the harness. `record_id` is the call whose
    /// ids it first parts from (the one that sampled them, when that is where it parts). Each
    /// span says where and why.
    Diverges {
        record_id: String,
        spans: Vec<DriftSpan>,
    },
    /// The prompt holds none of the turns the session's kept calls sampled after the prefix
    /// it shares with them (a compaction, a new system prompt, a subagent's own
    /// conversation): `common` tokens with the closest.
    NewPrefix {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        closest_record_id: Option<String>,
        common: u32,
    },
    /// Nothing to compare: the engine gave no prompt ids.
    Unavailable { reason: String },
}

/// One stretch where two token sequences part: a span of the earlier ids (sampled, or
/// tokentap's rendering) and what stands in its place in the engine's prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DriftSpan {
    /// Index in the engine's prompt where the span starts.
    pub at: u32,
    /// Tokens of the earlier sequence in the span.
    pub before_len: u32,
    /// Tokens of the engine's prompt in their place.
    pub prompt_len: u32,
    pub cause: DriftCause,
    /// The span's text on each side (special tokens included), each cut to 200 characters.
    pub before_text: String,
    pub prompt_text: String,
}

/// Why ids differ where the text was meant to be the same.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum DriftCause {
    /// The template left out reasoning the model sampled (Qwen3, GLM, MiniMax, …).
    ReasoningDropped,
    /// Only special tokens or whitespace differ: a turn's end or separator written
    /// differently (a stop token the engine kept or dropped, an added newline).
    BoundaryToken,
    /// The same text, tokenized differently (`"\n","\n"` against `"\n\n"`).
    MergeDifference,
    /// Different text: the harness changed what came back (re-serialized tool-call JSON,
    /// trimmed whitespace), or the template writes it differently.
    ContentChanged,
}

impl DriftCause {
    pub const ALL: [DriftCause; 4] = [
        DriftCause::ReasoningDropped,
        DriftCause::BoundaryToken,
        DriftCause::MergeDifference,
        DriftCause::ContentChanged,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DriftCause::ReasoningDropped => "reasoning_dropped",
            DriftCause::BoundaryToken => "boundary_token",
            DriftCause::MergeDifference => "merge_difference",
            DriftCause::ContentChanged => "content_changed",
        }
    }
}

impl Continuation {
    /// The label of the kind (`first`, `extends`, …), for metrics and summaries.
    pub fn kind(&self) -> &'static str {
        match self {
            Continuation::First => "first",
            Continuation::Extends { .. } => "extends",
            Continuation::Repeats { .. } => "repeats",
            Continuation::Diverges { .. } => "diverges",
            Continuation::NewPrefix { .. } => "new_prefix",
            Continuation::Unavailable { .. } => "unavailable",
        }
    }
}

impl RenderComparison {
    /// `equal`, `differs` or `unavailable`.
    pub fn result(&self) -> &'static str {
        match self {
            RenderComparison::Equal { .. } => "equal",
            RenderComparison::Differs { .. } => "differs",
            RenderComparison::Unavailable { .. } => "unavailable",
        }
    }
}

/// `--token-mode tito`: how tokentap built one call's prompt ids, which it sent to the engine
/// (`CaptureRecord::token_in`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TokenIn {
    pub continuation: TitoContinuation,
    /// Where each prompt token came from, in order: only `sampled` tokens are the policy's.
    pub origins: Vec<TokenOriginRun>,
    /// Time tokentap took to build the prompt, in microseconds.
    pub build_us: u64,
    /// `--token-verify`: the conversation's full render compared with these ids, when this
    /// call was picked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<TitoVerify>,
}

/// A tito prompt against the full render text mode would have sent (`--token-verify`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TitoVerify {
    /// The full render's length in tokens.
    pub rendered_tokens: u32,
    /// Differences inside the tokens the model sampled: what tito keeps on purpose (reasoning
    /// the template drops or rewrites, a call the harness re-serialized).
    pub content_spans: u32,
    /// Special-token or whitespace differences touching tokens tito wrote itself (the
    /// template's frame, a turn's boundary): tito rendered the frame other than the template
    /// does. A bug; counted in `tokentap_token_mode_tito_verify_spans_total{kind="boundary"}`.
    pub boundary_spans: u32,
    /// A few of the spans, boundary drift first (positions index the tito prompt).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<DriftSpan>,
}

/// How a tito prompt goes on from the conversation's earlier calls.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TitoContinuation {
    /// The prompt is call `record_id`'s prompt + the ids it sampled + `appended` tokens (the
    /// end of its turn if the model did not sample one, the new messages, the generation
    /// prompt): one trace.
    Extends { record_id: String, appended: u32 },
    /// A full render: the conversation continues none that tokentap answered as it was.
    Branch {
        cause: TitoBranchCause,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
}

/// Why a tito prompt was rendered whole.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum TitoBranchCause {
    /// No assistant turn yet: a conversation's first call.
    First,
    /// A conversation tokentap answered, changed after its first user message: an earlier
    /// message edited or dropped, or an answer sent back with other content or calls.
    Edited,
    /// The harness's system prompt and tools with a history tokentap never answered: a
    /// compaction rewrote it.
    Compacted,
    /// The first user message of a conversation tokentap answered under another system prompt.
    NewSystem,
    /// The same conversation with other tools offered (the template writes them into the prompt).
    ToolsChanged,
    /// Assistant turns tokentap knows nothing of: another proxy answered them, or a restart or
    /// eviction lost the conversation's ids.
    UnknownHistory,
    /// The conversation ends with the answered turn itself: nothing new to append.
    NoNewMessage,
    /// The template did not write the new messages after the answered turn as the start-up
    /// probe found (`detail` says how).
    TemplateConstruct,
}

impl TitoContinuation {
    /// `extends` or the branch's cause.
    pub fn kind(&self) -> &'static str {
        match self {
            TitoContinuation::Extends { .. } => "extends",
            TitoContinuation::Branch { cause, .. } => cause.as_str(),
        }
    }
}

impl TitoBranchCause {
    pub fn as_str(self) -> &'static str {
        match self {
            TitoBranchCause::First => "first",
            TitoBranchCause::Edited => "edited",
            TitoBranchCause::Compacted => "compacted",
            TitoBranchCause::NewSystem => "new_system",
            TitoBranchCause::ToolsChanged => "tools_changed",
            TitoBranchCause::UnknownHistory => "unknown_history",
            TitoBranchCause::NoNewMessage => "no_new_message",
            TitoBranchCause::TemplateConstruct => "template_construct",
        }
    }
}

/// Where a run of prompt tokens came from.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum TokenOrigin {
    /// Rendered by the chat template and tokenized by tokentap: template text and the
    /// harness's messages.
    Rendered,
    /// The end of an assistant turn the model did not sample (a stop string, a length
    /// cut-off), written as the template writes it.
    Boundary,
    /// Ids the model sampled in an earlier call, as sampled.
    Sampled,
}

impl TokenOrigin {
    pub const ALL: [TokenOrigin; 3] = [
        TokenOrigin::Sampled,
        TokenOrigin::Rendered,
        TokenOrigin::Boundary,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TokenOrigin::Rendered => "rendered",
            TokenOrigin::Boundary => "boundary",
            TokenOrigin::Sampled => "sampled",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TokenOriginRun {
    pub origin: TokenOrigin,
    pub len: u32,
}

/// `--token-mode observe`'s findings over many calls: a session's (`sessions.jsonl`'s
/// `stats.token_mode`) or a spool's (`tokentap records summary`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TokenModeTally {
    /// Calls with an observation.
    pub observed: u32,
    /// By [`RenderComparison::result`].
    pub render: BTreeMap<String, u32>,
    /// By [`Continuation::kind`].
    pub continuations: BTreeMap<String, u32>,
    /// Drift spans of `diverges` calls, by cause.
    pub drift_spans: BTreeMap<DriftCause, u32>,
}

impl TokenModeTally {
    pub fn add(&mut self, o: &TokenObservation) {
        self.observed += 1;
        *self.render.entry(o.render.result().into()).or_default() += 1;
        *self
            .continuations
            .entry(o.continuation.kind().into())
            .or_default() += 1;
        if let Continuation::Diverges { spans, .. } = &o.continuation {
            for s in spans {
                *self.drift_spans.entry(s.cause).or_default() += 1;
            }
        }
    }

    /// One line: `observed 12  ids equal to the engine's 12  extends 8  diverges 3
    /// (reasoning_dropped 3)  new_prefix 0  first 1`.
    pub fn line(&self) -> String {
        let get = |m: &BTreeMap<String, u32>, k: &str| m.get(k).copied().unwrap_or(0);
        let mut out = format!(
            "observed {}  ids equal to the engine's {}  differ {}  unavailable {}  |  first {}  extends {}  repeats {}  diverges {}",
            self.observed,
            get(&self.render, "equal"),
            get(&self.render, "differs"),
            get(&self.render, "unavailable"),
            get(&self.continuations, "first"),
            get(&self.continuations, "extends"),
            get(&self.continuations, "repeats"),
            get(&self.continuations, "diverges"),
        );
        if !self.drift_spans.is_empty() {
            let causes: Vec<String> = self
                .drift_spans
                .iter()
                .map(|(c, n)| format!("{} {n}", c.as_str()))
                .collect();
            let _ = write!(out, " ({})", causes.join(", "));
        }
        let _ = write!(
            out,
            "  new_prefix {}",
            get(&self.continuations, "new_prefix")
        );
        out
    }
}

/// `--token-mode tito`'s prompts over many calls: a session's (`sessions.jsonl`'s
/// `stats.tito`) or a spool's (`tokentap records summary`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TitoTally {
    /// Calls whose prompt tito built (records with `token_in`).
    pub calls: u32,
    /// Calls whose prompt extended an earlier call's prompt + sampled ids.
    pub extends: u32,
    /// Calls rendered whole, by cause (`first` included).
    pub branches: BTreeMap<TitoBranchCause, u32>,
    /// `extends / (calls - first)`: of the calls that had an earlier turn to extend, the share
    /// that did. Absent while every call was a conversation's first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extension_rate: Option<f64>,
    /// Prompt tokens summed over the calls, by origin: only `sampled` ones are the policy's.
    pub prompt_tokens: BTreeMap<TokenOrigin, u64>,
    /// Calls `--token-verify` also rendered in full.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub verified: u32,
    /// Of those, the calls whose frame tito wrote other than the full render (a bug).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub boundary_drift: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl TitoTally {
    pub fn add(&mut self, t: &TokenIn) {
        self.calls += 1;
        match &t.continuation {
            TitoContinuation::Extends { .. } => self.extends += 1,
            TitoContinuation::Branch { cause, .. } => {
                *self.branches.entry(*cause).or_default() += 1
            }
        }
        for run in &t.origins {
            *self.prompt_tokens.entry(run.origin).or_default() += u64::from(run.len);
        }
        if let Some(v) = &t.verify {
            self.verified += 1;
            self.boundary_drift += u32::from(v.boundary_spans > 0);
        }
        let could_extend = self.could_extend();
        self.extension_rate =
            (could_extend > 0).then(|| f64::from(self.extends) / f64::from(could_extend));
    }

    /// Calls that had an earlier turn to extend: all but the conversations' first calls.
    fn could_extend(&self) -> u32 {
        let first = self
            .branches
            .get(&TitoBranchCause::First)
            .copied()
            .unwrap_or(0);
        self.calls - first
    }

    /// Two lines: `calls 4  extended 2 of 3 (67%)  branches 2 (first 1, edited 1)` and
    /// `prompt tokens by origin: sampled 40  rendered 90  boundary 1`.
    pub fn lines(&self) -> [String; 2] {
        let mut calls = format!(
            "calls {}  extended {} of {}",
            self.calls,
            self.extends,
            self.could_extend()
        );
        if let Some(rate) = self.extension_rate {
            let _ = write!(calls, " ({:.0}%)", rate * 100.0);
        }
        let _ = write!(calls, "  branches {}", self.branches.values().sum::<u32>());
        if !self.branches.is_empty() {
            let causes: Vec<String> = self
                .branches
                .iter()
                .map(|(c, n)| format!("{} {n}", c.as_str()))
                .collect();
            let _ = write!(calls, " ({})", causes.join(", "));
        }
        if self.verified > 0 {
            let _ = write!(
                calls,
                "  verified {} (boundary drift in {})",
                self.verified, self.boundary_drift
            );
        }
        let origins: Vec<String> = TokenOrigin::ALL
            .iter()
            .map(|o| {
                let n = self.prompt_tokens.get(o).copied().unwrap_or(0);
                format!("{} {n}", o.as_str())
            })
            .collect();
        [
            calls,
            format!("prompt tokens by origin: {}", origins.join("  ")),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(cause: DriftCause) -> DriftSpan {
        DriftSpan {
            at: 10,
            before_len: 3,
            prompt_len: 0,
            cause,
            before_text: "<think>x</think>".into(),
            prompt_text: String::new(),
        }
    }

    #[test]
    fn a_tally_counts_results_kinds_and_spans_and_says_so_in_one_line() {
        let mut t = TokenModeTally::default();
        let equal = RenderComparison::Equal { tokens: 5 };
        for continuation in [
            Continuation::First,
            Continuation::Extends {
                record_id: "a".into(),
                appended: 4,
            },
            Continuation::Diverges {
                record_id: "b".into(),
                spans: vec![
                    span(DriftCause::ReasoningDropped),
                    span(DriftCause::ReasoningDropped),
                    span(DriftCause::BoundaryToken),
                ],
            },
        ] {
            t.add(&TokenObservation {
                render: equal.clone(),
                continuation,
                render_us: 1,
            });
        }
        t.add(&TokenObservation {
            render: RenderComparison::Unavailable { reason: "x".into() },
            continuation: Continuation::NewPrefix {
                closest_record_id: None,
                common: 0,
            },
            render_us: 1,
        });
        assert_eq!(t.observed, 4);
        assert_eq!(t.drift_spans[&DriftCause::ReasoningDropped], 2);
        assert_eq!(
            t.line(),
            "observed 4  ids equal to the engine's 3  differ 0  unavailable 1  |  first 1  extends 1  repeats 0  diverges 1 (reasoning_dropped 2, boundary_token 1)  new_prefix 1"
        );
        // As sessions.jsonl writes it: causes as snake_case keys, and back.
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["drift_spans"]["reasoning_dropped"], 2);
        assert_eq!(serde_json::from_value::<TokenModeTally>(json).unwrap(), t);
    }

    fn token_in(continuation: TitoContinuation, origins: &[(TokenOrigin, u32)]) -> TokenIn {
        TokenIn {
            continuation,
            origins: origins
                .iter()
                .map(|&(origin, len)| TokenOriginRun { origin, len })
                .collect(),
            build_us: 5,
            verify: None,
        }
    }

    #[test]
    fn a_tito_tally_counts_extensions_branches_and_origins_and_says_so_in_two_lines() {
        let mut t = TitoTally::default();
        let branch = |cause| TitoContinuation::Branch {
            cause,
            detail: None,
        };
        let extends = TitoContinuation::Extends {
            record_id: "a".into(),
            appended: 3,
        };
        t.add(&token_in(
            branch(TitoBranchCause::First),
            &[(TokenOrigin::Rendered, 10)],
        ));
        // Every call so far was a first: nothing could extend, so no rate.
        assert_eq!(t.extension_rate, None);
        assert_eq!(
            t.lines()[0],
            "calls 1  extended 0 of 0  branches 1 (first 1)"
        );
        t.add(&token_in(
            extends.clone(),
            &[
                (TokenOrigin::Rendered, 10),
                (TokenOrigin::Sampled, 4),
                (TokenOrigin::Boundary, 1),
                (TokenOrigin::Rendered, 3),
            ],
        ));
        t.add(&token_in(extends, &[(TokenOrigin::Sampled, 2)]));
        t.add(&token_in(
            branch(TitoBranchCause::Edited),
            &[(TokenOrigin::Rendered, 20)],
        ));
        assert_eq!((t.calls, t.extends), (4, 2));
        assert_eq!(t.extension_rate, Some(2.0 / 3.0));
        assert_eq!(t.prompt_tokens[&TokenOrigin::Rendered], 43);
        assert_eq!(
            t.lines(),
            [
                "calls 4  extended 2 of 3 (67%)  branches 2 (first 1, edited 1)".to_owned(),
                "prompt tokens by origin: sampled 6  rendered 43  boundary 1".to_owned(),
            ]
        );
        // As sessions.jsonl writes it: causes and origins as the records name them, and back.
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["branches"]["edited"], 1);
        assert_eq!(json["prompt_tokens"]["sampled"], 6);
        assert_eq!(
            serde_json::from_value::<TitoTally>(json.clone()).unwrap(),
            t
        );
        assert!(json.get("verified").is_none(), "no verify, no field");

        // Two verified calls, one with boundary drift.
        let verified = |boundary_spans| {
            let mut v = token_in(extends_again(), &[(TokenOrigin::Sampled, 1)]);
            v.verify = Some(TitoVerify {
                rendered_tokens: 9,
                content_spans: 1,
                boundary_spans,
                examples: vec![],
            });
            v
        };
        t.add(&verified(0));
        t.add(&verified(2));
        assert_eq!((t.verified, t.boundary_drift), (2, 1));
        assert!(
            t.lines()[0].ends_with("  verified 2 (boundary drift in 1)"),
            "{}",
            t.lines()[0]
        );
    }

    fn extends_again() -> TitoContinuation {
        TitoContinuation::Extends {
            record_id: "b".into(),
            appended: 1,
        }
    }

    #[test]
    fn observations_serialize_with_their_tags() {
        let o = TokenObservation {
            render: RenderComparison::Equal { tokens: 7 },
            continuation: Continuation::Diverges {
                record_id: "r1".into(),
                spans: vec![span(DriftCause::MergeDifference)],
            },
            render_us: 12,
        };
        let v = serde_json::to_value(&o).unwrap();
        assert_eq!(
            v["render"],
            serde_json::json!({"result": "equal", "tokens": 7})
        );
        assert_eq!(v["continuation"]["kind"], "diverges");
        assert_eq!(v["continuation"]["spans"][0]["cause"], "merge_difference");
        assert_eq!(serde_json::from_value::<TokenObservation>(v).unwrap(), o);
    }
}
