//! Turning one session's records into traces, one record at a time.
//!
//! Prefix merge keeps a session's open *chains*. A chain's committed tokens (first prompt +
//! response so far) are exactly the prompt of its last call, the *tip*, whose sampled tokens
//! are held apart until the next call shows how the conversation went on:
//!
//! - the call's prompt starts with the chain's tokens followed by the tip's sampled ids → the
//!   tip's ids are appended with mask 1, the rest of the new prompt with mask 0, and the call
//!   becomes the tip (a merge);
//! - it starts with the chain's tokens but not with the sampled ids → the template re-rendered
//!   that turn: the chain ends there and the call starts a new one (`rerendered`);
//! - it equals the chain's tokens → a retry or duplicate: the call replaces the tip, and the
//!   replaced answer, if it has sampled tokens, becomes a trace of its own (`superseded`);
//! - it extends no chain → a new chain (`new_prefix`: subagent, compaction, rewritten history).
//!
//! Only prompt ids are compared; sampled text is never re-tokenized.

use std::collections::{BTreeMap, HashSet};

use serde_json::Value;
use tokentap_schema::{
    AssistantMessage, CaptureRecord, ChatMessage, ConversationSource, FinishReason, Normalization,
    RawJson, SessionStats, SplitCause, SplitPoint, Strategy, TitoBranchCause, TitoContinuation,
    ToolSpec, Trace, TraceCall, WireApi, TRAJECTORY_SCHEMA_VERSION,
};

/// The traces of a session and how they were made.
#[derive(Debug, Clone)]
pub struct SessionTraces {
    pub session_id: String,
    pub strategy: Strategy,
    pub traces: Vec<Trace>,
    pub stats: SessionStats,
    pub split_points: Vec<SplitPoint>,
}

/// Builds one session's traces from its records, fed in the order the proxy wrote them.
pub struct SessionBuilder {
    session_id: String,
    strategy: Strategy,
    chains: Vec<Chain>,
    done: Vec<Trace>,
    stats: SessionStats,
    split_points: Vec<SplitPoint>,
    seen: HashSet<String>,
    policy_versions: HashSet<String>,
    next_index: u32,
}

/// An open chain: committed tokens plus the pending tip.
struct Chain {
    index: u32,
    started_by: SplitCause,
    /// The tito branch cause of the chain's first call.
    tito_branch: Option<TitoBranchCause>,
    prompt_len: usize,
    /// First prompt ++ committed response: the tip's prompt.
    tokens: Vec<u32>,
    /// Aligned with `tokens[prompt_len..]`.
    mask: Vec<u8>,
    logprobs: Vec<f32>,
    calls: Vec<TraceCall>,
    gaps: Vec<String>,
    tip: Tip,
}

/// The last call of a chain, its sampled tokens not yet committed.
struct Tip {
    record_id: String,
    /// Why tito rendered this call whole, if it did.
    tito_branch: Option<TitoBranchCause>,
    completion: Option<Vec<u32>>,
    logprobs: Option<Vec<f32>>,
    finish_reason: Option<FinishReason>,
    policy_version: Option<String>,
    engine_weight_version: Option<tokentap_schema::EngineWeightVersion>,
    failed: bool,
    conversation: TipConversation,
    gaps: Vec<String>,
}

/// The tip's conversation and answer, as the trace will show them if the tip ends its chain.
enum TipConversation {
    /// Serialized when the record held the conversation itself.
    Json { messages: String, tools: String },
    /// Kept as the harness body (capture schema 2), parsed only if this tip ends a trace:
    /// most tips are merged into the next call and never shown.
    Body {
        body: RawJson,
        wire_api: WireApi,
        normalizations: Vec<Normalization>,
        answer: Option<AssistantMessage>,
    },
}

impl TipConversation {
    fn of(r: &CaptureRecord) -> TipConversation {
        match (&r.backend_conversation, &r.request.body) {
            (ConversationSource::HarnessBody, Some(body)) if r.backend_request.is_some() => {
                TipConversation::Body {
                    body: body.clone(),
                    wire_api: r.wire_api,
                    normalizations: r.normalizations.clone(),
                    answer: r.message.clone(),
                }
            }
            _ => {
                let (messages, tools) = match &r.backend_request {
                    Some(b) => (&b.messages[..], &b.tools[..]),
                    None => (&[][..], &[][..]),
                };
                TipConversation::Json {
                    messages: messages_json(messages, r.message.as_ref()),
                    tools: tools_json(tools),
                }
            }
        }
    }

    /// `(messages_json, tools_json)`, and a gap if the body could not be parsed again.
    fn into_json(self, record_id: &str) -> (String, String, Option<String>) {
        match self {
            TipConversation::Json { messages, tools } => (messages, tools, None),
            TipConversation::Body {
                body,
                wire_api,
                normalizations,
                answer,
            } => match tokentap_wire::replay::conversation(wire_api, &body, &normalizations) {
                Ok((messages, tools)) => (
                    messages_json(&messages, answer.as_ref()),
                    tools_json(&tools),
                    None,
                ),
                Err(e) => (
                    messages_json(&[], answer.as_ref()),
                    tools_json(&[]),
                    Some(format!("record {record_id}: conversation unavailable: {e}")),
                ),
            },
        }
    }

    fn held_bytes(&self) -> usize {
        match self {
            TipConversation::Json { messages, tools } => messages.capacity() + tools.capacity(),
            TipConversation::Body { body, .. } => body.get().len(),
        }
    }
}

impl Tip {
    fn of(r: &CaptureRecord) -> Tip {
        let mut gaps: Vec<String> = r
            .token_provenance
            .gaps
            .iter()
            .map(|g| format!("record {}: {:?}: {}", r.record_id, g.field, g.reason))
            .collect();
        let logprobs = match (&r.completion_token_ids, &r.logprobs) {
            (Some(ids), Some(lp)) if lp.len() == ids.len() => Some(lp.clone()),
            (Some(ids), lp) => {
                gaps.push(format!(
                    "record {}: {} sampled tokens without aligned logprobs ({} given): masked",
                    r.record_id,
                    ids.len(),
                    lp.as_ref().map_or(0, |l| l.len())
                ));
                None
            }
            (None, _) => {
                gaps.push(format!(
                    "record {}: sampled ids unavailable: what the model said there is masked context",
                    r.record_id
                ));
                None
            }
        };
        Tip {
            record_id: r.record_id.clone(),
            tito_branch: match r.token_in.as_ref().map(|t| &t.continuation) {
                Some(TitoContinuation::Branch { cause, .. }) => Some(*cause),
                _ => None,
            },
            completion: r.completion_token_ids.clone(),
            logprobs,
            finish_reason: r.finish_reason,
            policy_version: r.backend.policy_version.clone(),
            engine_weight_version: r.backend.engine_weight_version.clone(),
            failed: r.error.is_some(),
            conversation: TipConversation::of(r),
            gaps,
        }
    }

    fn held_bytes(&self) -> usize {
        self.completion.as_ref().map_or(0, |c| c.capacity() * 4)
            + self.logprobs.as_ref().map_or(0, |l| l.capacity() * 4)
            + self.conversation.held_bytes()
            + self.record_id.capacity()
    }

    fn sampled(&self) -> &[u32] {
        self.completion.as_deref().unwrap_or(&[])
    }

    fn trainable(&self) -> bool {
        self.logprobs.is_some() && !self.sampled().is_empty()
    }

    /// Ended normally, so a repeat of its prompt is a duplicate rather than a retry.
    fn completed(&self) -> bool {
        !self.failed
            && matches!(
                self.finish_reason,
                Some(FinishReason::Stop | FinishReason::ToolCalls)
            )
    }
}

impl Chain {
    fn start(index: u32, started_by: SplitCause, prompt: Vec<u32>, tip: Tip) -> Chain {
        Chain {
            index,
            started_by,
            tito_branch: tip.tito_branch,
            prompt_len: prompt.len(),
            tokens: prompt,
            mask: Vec::new(),
            logprobs: Vec::new(),
            calls: Vec::new(),
            gaps: Vec::new(),
            tip,
        }
    }

    /// Whether `prompt` starts with the tip's prompt followed by the tip's sampled ids.
    fn held_bytes(&self) -> usize {
        self.tokens.capacity() * 4
            + self.mask.capacity()
            + self.logprobs.capacity() * 4
            + self.calls.capacity() * std::mem::size_of::<TraceCall>()
            + self.tip.held_bytes()
    }

    fn continues_with(&self, prompt: &[u32]) -> bool {
        prompt[self.tokens.len()..].starts_with(self.tip.sampled())
    }

    /// Appends the tip's sampled tokens, with mask 1 when they are trainable.
    fn commit_tip(&mut self) {
        let tip = &self.tip;
        let sampled = tip.sampled();
        let trainable = tip.trainable();
        self.calls.push(TraceCall {
            record_id: tip.record_id.clone(),
            response_start: (self.tokens.len() - self.prompt_len) as u32,
            sampled_len: sampled.len() as u32,
            trainable,
            finish_reason: tip.finish_reason,
            policy_version: tip.policy_version.clone(),
            engine_weight_version: tip
                .engine_weight_version
                .as_ref()
                .and_then(|v| v.at_end.clone()),
            straddles_weight_update: tip
                .engine_weight_version
                .as_ref()
                .is_some_and(|v| v.straddles_update()),
        });
        self.tokens.extend_from_slice(sampled);
        match (&tip.logprobs, trainable) {
            (Some(lp), true) => {
                self.mask.extend(std::iter::repeat_n(1, sampled.len()));
                self.logprobs.extend_from_slice(lp);
            }
            _ => {
                self.mask.extend(std::iter::repeat_n(0, sampled.len()));
                self.logprobs
                    .extend(std::iter::repeat_n(0.0, sampled.len()));
            }
        }
        self.gaps.extend(tip.gaps.iter().cloned());
    }

    /// Commits the tip, appends the rest of `prompt` as context and makes `next` the tip.
    fn extend(&mut self, prompt: &[u32], next: Tip) {
        self.commit_tip();
        let glue = &prompt[self.tokens.len().min(prompt.len())..];
        self.tokens.extend_from_slice(glue);
        self.mask.extend(std::iter::repeat_n(0, glue.len()));
        self.logprobs.extend(std::iter::repeat_n(0.0, glue.len()));
        self.tip = next;
    }

    fn into_trace(mut self, session_id: &str, strategy: Strategy) -> Trace {
        self.commit_tip();
        let (messages_json, tools_json, gap) = self.tip.conversation.into_json(&self.tip.record_id);
        self.gaps.extend(gap);
        let response_ids = self.tokens.split_off(self.prompt_len);
        let versions: HashSet<&str> = self
            .calls
            .iter()
            .filter_map(|c| c.policy_version.as_deref())
            .collect();
        let engine_versions: HashSet<&str> = self
            .calls
            .iter()
            .filter_map(|c| c.engine_weight_version.as_deref())
            .collect();
        let spans_engine_weight_versions =
            engine_versions.len() > 1 || self.calls.iter().any(|c| c.straddles_weight_update);
        Trace {
            schema_version: TRAJECTORY_SCHEMA_VERSION,
            trace_id: format!("{session_id}/{}", self.index),
            session_id: session_id.to_string(),
            strategy,
            index: self.index,
            started_by: self.started_by,
            tito_branch: self.tito_branch,
            prompt_ids: self.tokens,
            response_ids,
            loss_mask: self.mask,
            logprobs: self.logprobs,
            spans_policy_versions: versions.len() > 1,
            spans_engine_weight_versions,
            calls: self.calls,
            messages_json,
            tools_json,
            reward: None,
            group_id: None,
            gaps: self.gaps,
        }
    }
}

impl SessionBuilder {
    pub fn new(session_id: &str, strategy: Strategy) -> SessionBuilder {
        SessionBuilder::continuing(session_id, strategy, 0)
    }

    /// A builder for records that arrive after the session was already finished once: its
    /// traces are numbered from `first_index`, so trace ids stay unique.
    pub fn continuing(session_id: &str, strategy: Strategy, first_index: u32) -> SessionBuilder {
        SessionBuilder {
            session_id: session_id.to_string(),
            strategy,
            chains: Vec::new(),
            done: Vec::new(),
            stats: SessionStats::default(),
            split_points: Vec::new(),
            seen: HashSet::new(),
            policy_versions: HashSet::new(),
            next_index: first_index,
        }
    }

    /// Open chains: what the builder holds in memory besides finished traces.
    pub fn open_chains(&self) -> usize {
        self.chains.len()
    }

    /// Tokens held by open chains.
    pub fn open_tokens(&self) -> usize {
        self.chains.iter().map(|c| c.tokens.len()).sum()
    }

    /// Heap bytes held for this session: open chains, traces closed but not yet emitted, and
    /// the record ids seen (an accounting of capacities, not an allocator measurement).
    pub fn held_bytes(&self) -> usize {
        let done: usize = self
            .done
            .iter()
            .map(|t| {
                (t.prompt_ids.capacity() + t.response_ids.capacity() + t.logprobs.capacity()) * 4
                    + t.loss_mask.capacity()
                    + t.messages_json.capacity()
                    + t.tools_json.capacity()
            })
            .sum();
        let seen: usize = self.seen.iter().map(|id| id.capacity() + 32).sum();
        self.chains.iter().map(Chain::held_bytes).sum::<usize>() + done + seen
    }

    /// Feeds the next record of the session. A record id seen before is counted and ignored.
    pub fn push(&mut self, r: &CaptureRecord) {
        debug_assert_eq!(r.session_id, self.session_id);
        if !self.seen.insert(r.record_id.clone()) {
            self.stats.duplicate_records += 1;
            return;
        }
        self.stats.calls += 1;
        if let Some(o) = &r.token_observation {
            self.stats
                .token_mode
                .get_or_insert_with(Default::default)
                .add(o);
        }
        if let Some(t) = &r.token_in {
            self.stats.tito.get_or_insert_with(Default::default).add(t);
        }
        if let Some(v) = &r.backend.policy_version {
            self.policy_versions.insert(v.clone());
        }
        let Some(prompt) = r.prompt_token_ids.as_deref() else {
            self.stats.calls_without_tokens += 1;
            return;
        };
        match r.finish_reason {
            Some(FinishReason::Length) => self.stats.truncated_turns += 1,
            Some(FinishReason::Abort) => self.stats.aborted_turns += 1,
            _ if r.error.is_some() => self.stats.aborted_turns += 1,
            _ => {}
        }
        let tip = Tip::of(r);
        if !tip.trainable() {
            self.stats.calls_with_token_gaps += 1;
        }
        match self.strategy {
            Strategy::PerRequest => {
                let chain = self.start_chain(SplitCause::PerRequest, prompt.to_vec(), tip);
                let trace = chain.into_trace(&self.session_id, self.strategy);
                self.done.push(trace);
            }
            Strategy::PrefixMerge => self.merge(prompt, tip),
        }
    }

    fn merge(&mut self, prompt: &[u32], tip: Tip) {
        // The open chain whose tip prompt is the longest prefix of this prompt.
        let best = self
            .chains
            .iter()
            .enumerate()
            .filter(|(_, c)| prompt.starts_with(&c.tokens))
            .max_by_key(|(_, c)| c.tokens.len())
            .map(|(i, _)| i);
        let Some(i) = best else {
            let cause = if self.next_index == 0 {
                SplitCause::SessionStart
            } else {
                SplitCause::NewPrefix
            };
            let chain = self.start_chain(cause, prompt.to_vec(), tip);
            self.chains.push(chain);
            return;
        };
        let chain = &mut self.chains[i];
        if prompt.len() == chain.tokens.len() {
            // Same prompt again: the new call replaces the tip.
            let duplicate = chain.tip.completed();
            let old = std::mem::replace(&mut chain.tip, tip);
            let context = (!old.sampled().is_empty()).then(|| chain.tokens.clone());
            if duplicate {
                self.stats.duplicates += 1;
            } else {
                self.stats.retries += 1;
            }
            if let Some(context) = context {
                let trace = self
                    .start_chain(SplitCause::Superseded, context, old)
                    .into_trace(&self.session_id, self.strategy);
                self.done.push(trace);
            }
        } else if chain.continues_with(prompt) {
            chain.extend(prompt, tip);
            self.stats.merged_calls += 1;
        } else {
            let ended = self.chains.swap_remove(i);
            self.done
                .push(ended.into_trace(&self.session_id, self.strategy));
            let chain = self.start_chain(SplitCause::Rerendered, prompt.to_vec(), tip);
            self.chains.push(chain);
        }
    }

    fn start_chain(&mut self, cause: SplitCause, prompt: Vec<u32>, tip: Tip) -> Chain {
        let index = self.next_index;
        self.next_index += 1;
        *self.stats.splits.entry(cause).or_insert(0) += 1;
        self.split_points.push(SplitPoint {
            trace_index: index,
            record_id: tip.record_id.clone(),
            cause,
        });
        Chain::start(index, cause, prompt, tip)
    }

    /// Closes every chain; the traces in index order.
    pub fn finish(mut self) -> SessionTraces {
        for chain in std::mem::take(&mut self.chains) {
            self.done
                .push(chain.into_trace(&self.session_id, self.strategy));
        }
        self.done.sort_by_key(|t| t.index);
        self.stats.traces = self.done.len() as u32;
        self.stats.spans_policy_versions = self.policy_versions.len() > 1;
        SessionTraces {
            session_id: self.session_id,
            strategy: self.strategy,
            traces: self.done,
            stats: self.stats,
            split_points: self.split_points,
        }
    }
}

/// Builds every session of `records` (in spool order); sessions in order of first record.
pub fn build_all<'a>(
    records: impl IntoIterator<Item = &'a CaptureRecord>,
    strategy: Strategy,
) -> Vec<SessionTraces> {
    let mut order: Vec<String> = Vec::new();
    let mut builders: BTreeMap<String, SessionBuilder> = BTreeMap::new();
    for r in records {
        builders
            .entry(r.session_id.clone())
            .or_insert_with(|| {
                order.push(r.session_id.clone());
                SessionBuilder::new(&r.session_id, strategy)
            })
            .push(r);
    }
    order
        .iter()
        .filter_map(|s| builders.remove(s))
        .map(SessionBuilder::finish)
        .collect()
}

/// A call's conversation and answer as JSON text.
fn messages_json(messages: &[ChatMessage], answer: Option<&AssistantMessage>) -> String {
    let mut out: Vec<Value> = messages
        .iter()
        .filter_map(|m| serde_json::to_value(m).ok())
        .collect();
    if let Some(mut answer) = answer.and_then(|m| serde_json::to_value(m).ok()) {
        if let Some(o) = answer.as_object_mut() {
            o.entry("role").or_insert_with(|| Value::from("assistant"));
        }
        out.push(answer);
    }
    serde_json::to_string(&out).expect("JSON values always serialize")
}

fn tools_json(tools: &[ToolSpec]) -> String {
    serde_json::to_string(tools).expect("JSON values always serialize")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokentap_schema::{
        TitoBranchCause, TitoContinuation, TokenIn, TokenOrigin, TokenOriginRun,
    };

    /// A tito call: `continuation`, its prompt as `sampled` ids after `rendered` ones.
    fn tito_record(
        n: u64,
        continuation: TitoContinuation,
        rendered: u32,
        sampled: u32,
    ) -> CaptureRecord {
        let mut r = crate::synthetic::record("tito", &format!("r{n}"), n);
        let origins = [
            (TokenOrigin::Rendered, rendered),
            (TokenOrigin::Sampled, sampled),
        ];
        r.token_in = Some(TokenIn {
            continuation,
            origins: origins
                .into_iter()
                .filter(|&(_, len)| len > 0)
                .map(|(origin, len)| TokenOriginRun { origin, len })
                .collect(),
            build_us: 100,
            verify: None,
        });
        r
    }

    #[test]
    fn a_sessions_tito_prompts_are_counted_in_its_stats() {
        let branch = |cause| TitoContinuation::Branch {
            cause,
            detail: None,
        };
        let extends = |n: u64| TitoContinuation::Extends {
            record_id: format!("r{}", n - 1),
            appended: 5,
        };
        let records = [
            tito_record(0, branch(TitoBranchCause::First), 30, 0),
            tito_record(1, extends(1), 5, 35),
            tito_record(2, extends(2), 5, 45),
            tito_record(3, branch(TitoBranchCause::Edited), 60, 0),
            // Observe mode's or text mode's records of the session leave the tally alone.
            crate::synthetic::record("tito", "r4", 4),
        ];
        let sessions = build_all(&records, Strategy::PrefixMerge);
        let stats = &sessions[0].stats;
        let tito = stats.tito.as_ref().expect("tito stats");
        assert_eq!((stats.calls, tito.calls, tito.extends), (5, 4, 2));
        assert_eq!(
            tito.branches,
            BTreeMap::from([(TitoBranchCause::First, 1), (TitoBranchCause::Edited, 1)])
        );
        assert_eq!(tito.extension_rate, Some(2.0 / 3.0));
        assert_eq!(
            tito.prompt_tokens,
            BTreeMap::from([(TokenOrigin::Rendered, 100), (TokenOrigin::Sampled, 80)])
        );
        // As sessions.jsonl names them.
        let json = serde_json::to_value(stats).unwrap();
        assert_eq!(json["tito"]["branches"]["edited"], 1);
        assert_eq!(json["tito"]["prompt_tokens"]["sampled"], 80);
        assert!(json.get("token_mode").is_none(), "{json}");

        // A session without token_in has no `tito` at all.
        let text = build_all(&records[4..], Strategy::PrefixMerge);
        assert_eq!(text[0].stats.tito, None);
        assert!(serde_json::to_value(&text[0].stats)
            .unwrap()
            .get("tito")
            .is_none());
    }

    /// Each trace names the tito branch its first call was rendered for; a call that extends
    /// its trace's tip adds none.
    #[test]
    fn a_trace_names_the_tito_branch_that_started_it() {
        let with_ids = |n: u64, continuation, prompt: Vec<u32>, sampled: Vec<u32>| {
            let mut r = tito_record(n, continuation, 1, 0);
            r.logprobs = Some(vec![-0.5; sampled.len()]);
            r.prompt_token_ids = Some(prompt);
            r.completion_token_ids = Some(sampled);
            r
        };
        let first = TitoContinuation::Branch {
            cause: TitoBranchCause::First,
            detail: None,
        };
        let extends = TitoContinuation::Extends {
            record_id: "r0".into(),
            appended: 2,
        };
        let compacted = TitoContinuation::Branch {
            cause: TitoBranchCause::Compacted,
            detail: None,
        };
        let records = [
            with_ids(0, first, vec![1, 2, 3], vec![4, 5]),
            with_ids(1, extends, vec![1, 2, 3, 4, 5, 6, 7], vec![8]),
            with_ids(2, compacted, vec![1, 9, 3], vec![10]),
        ];
        let sessions = build_all(&records, Strategy::PrefixMerge);
        let traces = &sessions[0].traces;
        assert_eq!(traces.len(), 2, "{traces:?}");
        assert_eq!(traces[0].calls.len(), 2);
        assert_eq!(traces[0].tito_branch, Some(TitoBranchCause::First));
        assert_eq!(traces[1].tito_branch, Some(TitoBranchCause::Compacted));
        // Outside tito there is no branch to name.
        let mut text = records[1].clone();
        text.token_in = None;
        let plain = build_all(&[text], Strategy::PrefixMerge);
        assert_eq!(plain[0].traces[0].tito_branch, None);
    }
}
