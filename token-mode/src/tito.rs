//! `--token-mode tito` (token in, token out): each call's prompt built from the ids the engine
//! saw and sampled before, so every later turn conditions on exactly the tokens the policy
//! sampled, and an append-only conversation is one trace.
//!
//! Conversations are found by meaning within a session: each answered call leaves a *tip* in
//! its session (the ids the engine saw and sampled, and the conversation they stand for, the
//! assistant message as tokentap answered it included), keyed by that conversation. A call
//! only ever extends a tip of its own session: two samples of one GRPO group often make the
//! same first call and get the same tool call back (with different reasoning), and matched
//! across sessions the later one's sampled ids would become the earlier one's context. A request whose
//! messages are a tip's conversation followed by new non-assistant messages (tool results, a
//! user turn) extends it: the tip's ids, the template's end of the assistant turn if the
//! model did not sample it, then the new messages rendered after a stand-in for the turn.
//! Anything else branches from a full render, with the cause. Subagents and concurrent
//! conversations are separate tips by construction; a restart or an evicted tip branches,
//! never corrupts.
//!
//! Compared by meaning: an assistant message's content trimmed, its tool calls by name and
//! arguments as parsed JSON (key order and spacing ignored), its reasoning ignored (a harness
//! that sends it back and one that drops it both extend); tool-call ids ignored (tokentap
//! made them); every other message exactly.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};

use lru::LruCache;
use serde_json::Value;
use tokentap_answer_parse::Dialect;
use tokentap_schema::{
    ChatMessage, ChatRequest, ContentPart, Role, TitoBranchCause, TitoContinuation, TokenOrigin,
    TokenOriginRun,
};

use crate::TokenModel;

/// Stands in for the answered turn's content when the new messages are rendered: a string no
/// conversation holds, so the text after it is the template's end of that turn and what
/// follows.
const STAND_IN: &str = "\u{E000}tokentap-answered-turn\u{E001}";

/// Bounds on what tito keeps, per session and in all.
#[derive(Debug, Clone, Copy)]
pub struct TitoLimits {
    /// Conversations (tips) kept in all sessions together.
    pub tips: usize,
    /// Token ids kept in all tips together (4 bytes each).
    pub held_tokens: usize,
    /// Conversations one session keeps; its least recently used go first. A harness keeps
    /// one conversation per agent (subagents, compaction branches), far fewer than this.
    pub session_tips: usize,
    /// Token ids one session's tips hold together.
    pub session_held_tokens: usize,
}

impl Default for TitoLimits {
    fn default() -> Self {
        TitoLimits {
            tips: 4096,
            // 256 MiB of ids.
            held_tokens: 64 << 20,
            session_tips: 256,
            // 64 MiB of ids: 256 tips of a 64k-token conversation.
            session_held_tokens: 16 << 20,
        }
    }
}

/// How the model stopped sampling the answer, as far as the prompt's end of turn goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampledEnd {
    /// The last sampled id is a stop token (kept in the ids: the next prompt continues after it).
    StopToken,
    /// A stop string, a length cut-off or a cancelled call: the template's end of turn is added.
    Open,
}

/// One call's prompt in tito.
#[derive(Debug, Clone)]
pub struct TitoPrompt {
    pub ids: Vec<u32>,
    /// Where each prompt token came from, as runs.
    pub origins: Vec<TokenOriginRun>,
    pub continuation: TitoContinuation,
    /// Time taken to build it, in microseconds.
    pub build_us: u64,
    /// The request's meaning as [`Tito::prompt`] hashed it, reused by [`Tito::answered`].
    meaning: Option<Meaning>,
}

impl TitoPrompt {
    pub fn new(
        ids: Vec<u32>,
        origins: Vec<TokenOriginRun>,
        continuation: TitoContinuation,
    ) -> Self {
        TitoPrompt {
            ids,
            origins,
            continuation,
            build_us: 0,
            meaning: None,
        }
    }
}

/// A request's meaning, hashed: each message's, and the offered tools'.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Meaning {
    messages: Vec<u64>,
    tools: u64,
}

/// What a tip holds: the engine's ids (prompt, then sampled) and the conversation they stand
/// for.
struct Tip {
    ids: Vec<u32>,
    origins: Vec<TokenOriginRun>,
    /// Every message's meaning hashed, the answered assistant message last.
    meaning: Vec<u64>,
    tools: u64,
    record_id: String,
    end: SampledEnd,
}

/// One session's conversations, and what its branches' causes are read from.
struct SessionTips {
    tips: LruCache<u64, Arc<Tip>>,
    held: usize,
    /// The latest (system, tools) per first user message, and the (system, tools) pairs seen:
    /// what a branch's cause is read from.
    starts: LruCache<u64, (u64, u64)>,
    frames: LruCache<(u64, u64), ()>,
    /// (system, tools, the first answered turn) of the conversations seen: a conversation
    /// whose first user message changed but whose first answer is one tokentap gave is edited,
    /// not compacted.
    first_answers: LruCache<(u64, u64, u64), ()>,
    /// When the session last answered a call ([`State::clock`]): the global bound's tie-break.
    used_at: u64,
}

impl SessionTips {
    fn new(limits: &TitoLimits) -> SessionTips {
        let cap = || std::num::NonZeroUsize::new(limits.session_tips.max(1)).expect("max(1)");
        SessionTips {
            tips: LruCache::unbounded(),
            held: 0,
            starts: LruCache::new(cap()),
            frames: LruCache::new(cap()),
            first_answers: LruCache::new(cap()),
            used_at: 0,
        }
    }

    fn pop_lru(&mut self) -> Option<Arc<Tip>> {
        let (_, old) = self.tips.pop_lru()?;
        self.held -= old.ids.len();
        Some(old)
    }
}

/// Every session's tips. Sessions without a tip are not kept.
#[derive(Default)]
struct State {
    sessions: std::collections::HashMap<String, SessionTips>,
    /// Tips and ids in all sessions.
    tips: usize,
    held: usize,
    clock: u64,
}

impl State {
    /// Evicts until every bound holds: first within `session` (its own least recently used
    /// tips), then, past the global bounds, from the session holding the most ids that has
    /// more than one tip; only when every session is down to one tip does the least recently
    /// answered session lose it. So one session's flood of calls costs only its own tips, and
    /// never takes another session's only conversation while any session has more.
    fn enforce(&mut self, session: &str, limits: &TitoLimits) {
        if let Some(own) = self.sessions.get_mut(session) {
            while own.tips.len() > limits.session_tips.max(1)
                || (own.held > limits.session_held_tokens && !own.tips.is_empty())
            {
                let Some(old) = own.pop_lru() else { break };
                self.tips -= 1;
                self.held -= old.ids.len();
            }
            if own.tips.is_empty() {
                self.sessions.remove(session);
            }
        }
        while self.tips > limits.tips.max(1) || self.held > limits.held_tokens {
            let victim = self
                .sessions
                .iter()
                .filter(|(_, s)| s.tips.len() > 1)
                .max_by_key(|(_, s)| (s.held, s.tips.len()))
                .or_else(|| self.sessions.iter().min_by_key(|(_, s)| s.used_at))
                .map(|(id, _)| id.clone());
            let Some(victim) = victim else { break };
            let s = self.sessions.get_mut(&victim).expect("just found");
            if let Some(old) = s.pop_lru() {
                self.tips -= 1;
                self.held -= old.ids.len();
            }
            if s.tips.is_empty() {
                self.sessions.remove(&victim);
            }
        }
    }
}

/// `--token-mode tito`'s state and prompt building, for all calls; its state is kept per
/// session.
pub struct Tito {
    model: TokenModel,
    dialect: Dialect,
    limits: TitoLimits,
    /// The new messages render the same after a short stand-in conversation (a user message
    /// and the answered turn, no tools) as after the whole one: the cheap way, checked at start.
    short_suffix: bool,
    /// The texts of the tokens that end an assistant turn ([`stop_texts`]).
    stop_texts: Vec<String>,
    /// Keys the meaning hashes (SipHash with this process's random keys: a harness cannot
    /// make two different conversations collide on purpose).
    keys: std::hash::RandomState,
    state: Mutex<State>,
    /// What the start-up probe found, one line per template construct.
    probe_report: Vec<String>,
}

impl std::fmt::Debug for Tito {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tito")
            .field("model", &self.model)
            .field("dialect", &self.dialect)
            .finish_non_exhaustive()
    }
}

impl Tito {
    /// Refused for a model whose answers no parser reads back, or whose template does not
    /// write an assistant turn's end and the next messages after it (checked on a probe
    /// conversation, as every call will need).
    pub fn new(model: TokenModel, limits: TitoLimits) -> Result<Tito, String> {
        let template = model
            .tokenizer()
            .chat_templates()
            .ok_or("no chat template")?
            .select(true)
            .map_err(|e| e.to_string())?;
        let dialect =
            tokentap_answer_parse::probe(template, model.tokenizer().template_variables())
                .map_err(|e| {
                    format!(
                        "{}: tito needs the model's answers read back: {e}",
                        model.source()
                    )
                })?;
        let stop_texts = stop_texts(&model);
        let mut tito = Tito {
            model,
            dialect,
            limits,
            short_suffix: false,
            stop_texts,
            keys: std::hash::RandomState::new(),
            state: Mutex::new(State::default()),
            probe_report: Vec::new(),
        };
        tito.short_suffix = tito.check_appends()?;
        tito.probe_report.push(tito.check_reasoning());
        Ok(tito)
    }

    /// The start-up probe's findings, one line per template construct: each append tito
    /// needs (refused at start when one fails, naming it), whether it renders alone after a
    /// stand-in, and what the template does with an earlier turn's reasoning.
    pub fn probe_report(&self) -> &[String] {
        &self.probe_report
    }

    /// Whether the template writes an earlier assistant turn's reasoning once a user turn
    /// follows it (Qwen3, GLM and MiniMax drop it: there text mode re-renders what was
    /// sampled, and tito keeps the sampled ids).
    fn check_reasoning(&self) -> String {
        let request: Result<ChatRequest, _> = serde_json::from_value(serde_json::json!({
            "model": "probe",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "question"}], "content_was_string": true},
                {"role": "assistant", "content": [{"type": "text", "text": "answer"}], "content_was_string": true, "reasoning": "\u{E003}"},
                {"role": "user", "content": [{"type": "text", "text": "next"}], "content_was_string": true},
            ],
        }));
        match request.map_err(|e| e.to_string()).and_then(|r| self.model.prompt_text(&r)) {
            Ok(text) if text.contains('\u{E003}') => {
                "an earlier turn's reasoning: the template keeps it".into()
            }
            Ok(_) => "an earlier turn's reasoning: the template drops it (text mode re-renders those turns; tito keeps the sampled ids)".into(),
            Err(e) => format!("an earlier turn's reasoning: not rendered ({e})"),
        }
    }

    pub fn model(&self) -> &TokenModel {
        &self.model
    }

    /// How the model's answers are read (its family, reasoning).
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Whether each extension renders only the new messages after a short stand-in (the
    /// template was found to write them the same as after the whole conversation).
    pub fn renders_short_suffix(&self) -> bool {
        self.short_suffix
    }

    /// Conversations kept and their ids, in all sessions, for metrics.
    pub fn held(&self) -> (usize, usize) {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        (state.tips, state.held)
    }

    /// Conversations kept and their ids in `session`.
    pub fn held_by(&self, session: &str) -> (usize, usize) {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state
            .sessions
            .get(session)
            .map_or((0, 0), |s| (s.tips.len(), s.held))
    }

    /// The template must write, after an answered turn with a call, an end of turn the engine
    /// stops on, then a tool result and a user message. Whether they come out the same after a
    /// short stand-in conversation as after the whole one (then each call renders only that).
    fn check_appends(&mut self) -> Result<bool, String> {
        let base: Vec<serde_json::Value> = vec![
            serde_json::json!({"role": "system", "content": [{"type": "text", "text": "You are a probe."}], "content_was_string": true}),
            serde_json::json!({"role": "user", "content": [{"type": "text", "text": "question"}], "content_was_string": true}),
            serde_json::json!({"role": "assistant", "tool_calls": [{"id": "call_0", "name": "probe", "arguments": "{\"path\": \"/\"}"}]}),
        ];
        let tool = serde_json::json!({"role": "tool", "tool_call_id": "call_0", "content": [{"type": "text", "text": "result"}], "content_was_string": true});
        let user = serde_json::json!({"role": "user", "content": [{"type": "text", "text": "next"}], "content_was_string": true});
        let mut short_agrees = true;
        for (what, new) in [
            ("a tool result", vec![tool.clone()]),
            ("two tool results", vec![tool.clone(), tool.clone()]),
            ("a user message", vec![tool, user]),
        ] {
            let mut messages = base.clone();
            messages.extend(new);
            let request: ChatRequest = serde_json::from_value(serde_json::json!({
                "model": "probe",
                "messages": messages,
                "tools": [{"name": "probe", "description": "A probe", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
            }))
            .map_err(|e| e.to_string())?;
            let full = self
                .suffix_after_answer(&request, 2, false)
                .map_err(|why| {
                    format!("{}: tito cannot append {what}: {why}", self.model.source())
                })?;
            let alone = self.suffix_after_answer(&request, 2, true).ok() == Some(full);
            self.probe_report.push(format!(
                "{what} after an answered call: appends; {}",
                if alone {
                    "renders alone after a short stand-in"
                } else {
                    "renders only after the whole conversation"
                }
            ));
            short_agrees &= alone;
        }
        Ok(short_agrees)
    }

    /// The prompt for `request` of `session`: extending the conversation of that session it
    /// continues, or a full render. `None`: a call that belongs to no session (nothing to
    /// extend, and [`Tito::answered`] keeps nothing of it).
    pub fn prompt(
        &self,
        session: Option<&str>,
        request: &ChatRequest,
    ) -> Result<TitoPrompt, String> {
        let started = std::time::Instant::now();
        let meaning = self.meaning(request);
        let tools = meaning.tools;
        let last_assistant = request
            .messages
            .iter()
            .rposition(|m| m.role == Role::Assistant);
        let found = last_assistant.zip(session).and_then(|(k, session)| {
            let key = self.conversation_key(&meaning.messages[..=k], tools);
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let tip = state.sessions.get_mut(session)?.tips.get(&key)?.clone();
            (tip.meaning[..] == meaning.messages[..=k] && tip.tools == tools).then_some((k, tip))
        });
        let mut prompt = match found {
            Some((k, tip)) if k + 1 < request.messages.len() => match self.extend(request, k, &tip)
            {
                Ok((ids, origins)) => TitoPrompt {
                    continuation: TitoContinuation::Extends {
                        record_id: tip.record_id.clone(),
                        appended: (ids.len() - tip.ids.len()) as u32,
                    },
                    ids,
                    origins,
                    build_us: 0,
                    meaning: None,
                },
                Err(why) => self.full(request, TitoBranchCause::TemplateConstruct, Some(why))?,
            },
            // The conversation ends with the answered turn itself (a harness that asks the
            // model to go on with its own message): nothing to append after it.
            Some(_) => self.full(request, TitoBranchCause::NoNewMessage, None)?,
            None => {
                let cause = match last_assistant {
                    None => TitoBranchCause::First,
                    Some(_) => self.cause(session, request, &meaning),
                };
                self.full(request, cause, None)?
            }
        };
        prompt.meaning = Some(meaning);
        prompt.build_us = started.elapsed().as_micros() as u64;
        Ok(prompt)
    }

    /// The tip's ids, the end of its turn if the model did not sample one, then the new
    /// messages and the generation prompt, rendered after a stand-in for the answered turn.
    fn extend(
        &self,
        request: &ChatRequest,
        k: usize,
        tip: &Tip,
    ) -> Result<(Vec<u32>, Vec<TokenOriginRun>), String> {
        let (end, rest) = self.suffix_after_answer(request, k, self.short_suffix)?;
        let tokenizer = self.model.tokenizer();
        let mut ids = tip.ids.clone();
        let mut origins = tip.origins.clone();
        if tip.end == SampledEnd::Open {
            let end_ids = tokenizer.encode(&end).map_err(|e| e.to_string())?;
            push_run(&mut origins, TokenOrigin::Boundary, end_ids.len());
            ids.extend(end_ids);
        }
        let rest_ids = tokenizer.encode(&rest).map_err(|e| e.to_string())?;
        push_run(&mut origins, TokenOrigin::Rendered, rest_ids.len());
        ids.extend(rest_ids);
        Ok((ids, origins))
    }

    /// For the conversation with message `k` (the answered turn) replaced by a stand-in that
    /// keeps its calls: the end of that turn the template writes (the stop token the engine
    /// stops on) and everything after it (the new messages and the generation prompt).
    /// `short`: after a user message and the stand-in only, without tools (the history
    /// before the turn is never rendered again).
    fn suffix_after_answer(
        &self,
        request: &ChatRequest,
        k: usize,
        short: bool,
    ) -> Result<(String, String), String> {
        let mut stand_in = request.messages[k].clone();
        stand_in.content = vec![ContentPart::Text {
            text: STAND_IN.into(),
        }];
        stand_in.content_was_string = true;
        stand_in.reasoning = None;
        let synthetic = if short {
            let mut messages = Vec::with_capacity(request.messages.len() - k + 1);
            messages.push(ChatMessage::text(Role::User, "\u{E002}"));
            messages.push(stand_in);
            messages.extend_from_slice(&request.messages[k + 1..]);
            // The request's own template kwargs (`enable_thinking`, …) still apply: they shape
            // the generation prompt.
            ChatRequest {
                model: request.model.clone(),
                messages,
                tools: Vec::new(),
                tool_choice: None,
                sampling: Default::default(),
                stream: false,
                extra: request.extra.clone(),
            }
        } else {
            let mut synthetic = request.clone();
            synthetic.messages[k] = stand_in;
            synthetic
        };
        let text = self.model.prompt_text(&synthetic)?;
        let at = text
            .find(STAND_IN)
            .ok_or("the template does not write the answered turn's content")?;
        if text.rfind(STAND_IN) != Some(at) {
            return Err("the template writes the answered turn's content twice".into());
        }
        let tail = &text[at + STAND_IN.len()..];
        let (end_at, end) = self
            .stop_texts
            .iter()
            .filter_map(|s| tail.find(s.as_str()).map(|at| (at, s.clone())))
            .min()
            .ok_or("the template writes no end-of-turn token after the answered turn")?;
        let rest = tail[end_at + end.len()..].to_string();
        Ok((end, rest))
    }

    fn full(
        &self,
        request: &ChatRequest,
        cause: TitoBranchCause,
        detail: Option<String>,
    ) -> Result<TitoPrompt, String> {
        let ids = self.model.prompt_ids(request)?;
        let mut origins = Vec::new();
        push_run(&mut origins, TokenOrigin::Rendered, ids.len());
        Ok(TitoPrompt::new(
            ids,
            origins,
            TitoContinuation::Branch { cause, detail },
        ))
    }

    /// Why a conversation with assistant turns matches no tip.
    fn cause(
        &self,
        session: Option<&str>,
        request: &ChatRequest,
        meaning: &Meaning,
    ) -> TitoBranchCause {
        let tools = meaning.tools;
        let system = self.system_key(request, meaning);
        let Some(start) = first_of(request, meaning, Role::User) else {
            return TitoBranchCause::UnknownHistory;
        };
        let first_answer = first_of(request, meaning, Role::Assistant);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let Some(state) = session.and_then(|s| state.sessions.get_mut(s)) else {
            return TitoBranchCause::UnknownHistory;
        };
        match state.starts.get(&start).copied() {
            Some((s, _)) if s != system => TitoBranchCause::NewSystem,
            Some((_, t)) if t != tools => TitoBranchCause::ToolsChanged,
            Some(_) => TitoBranchCause::Edited,
            None if first_answer
                .is_some_and(|a| state.first_answers.contains(&(system, tools, a))) =>
            {
                TitoBranchCause::Edited
            }
            None if state.frames.contains(&(system, tools)) => TitoBranchCause::Compacted,
            None => TitoBranchCause::UnknownHistory,
        }
    }

    /// How the model ended `sampled`: with one of the template's end-of-turn tokens (kept:
    /// the next prompt goes on after it), or open (a stop string, a length cut-off).
    pub fn sampled_end(&self, sampled: &[u32]) -> SampledEnd {
        let Some(&last) = sampled.last() else {
            return SampledEnd::Open;
        };
        let text = self.model.text(&[last]);
        if self.stop_texts.contains(&text) {
            SampledEnd::StopToken
        } else {
            SampledEnd::Open
        }
    }

    /// Keeps the call's conversation, with the assistant message as tokentap answered it, as a
    /// tip for `session`'s next call to extend (nothing for a call of no session).
    #[allow(clippy::too_many_arguments)]
    pub fn answered(
        &self,
        session: Option<&str>,
        request: &ChatRequest,
        prompt: &TitoPrompt,
        sampled: &[u32],
        end: SampledEnd,
        answer: &ChatMessage,
        record_id: &str,
    ) {
        let Some(session) = session else { return };
        let request_meaning = match &prompt.meaning {
            Some(m) if m.messages.len() == request.messages.len() => m.clone(),
            _ => self.meaning(request),
        };
        let tools = request_meaning.tools;
        let mut meaning = request_meaning.messages.clone();
        meaning.push(self.message_hash(answer));
        let mut ids = prompt.ids.clone();
        ids.extend_from_slice(sampled);
        let mut origins = prompt.origins.clone();
        push_run(&mut origins, TokenOrigin::Sampled, sampled.len());
        let key = self.conversation_key(&meaning, tools);
        let answer_hash = meaning[meaning.len() - 1];
        let tip = Tip {
            ids,
            origins,
            meaning,
            tools,
            record_id: record_id.to_string(),
            end,
        };
        let system = self.system_key(request, &request_meaning);
        let first_answer =
            first_of(request, &request_meaning, Role::Assistant).unwrap_or(answer_hash);
        let start = first_of(request, &request_meaning, Role::User);
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let state = &mut *guard;
        state.clock += 1;
        let own = state
            .sessions
            .entry(session.to_owned())
            .or_insert_with(|| SessionTips::new(&self.limits));
        own.used_at = state.clock;
        if let Some(start) = start {
            own.starts.put(start, (system, tools));
        }
        own.frames.put((system, tools), ());
        own.first_answers.put((system, tools, first_answer), ());
        let added = tip.ids.len();
        own.held += added;
        state.held += added;
        state.tips += 1;
        if let Some(old) = own.tips.put(key, Arc::new(tip)) {
            own.held -= old.ids.len();
            state.held -= old.ids.len();
            state.tips -= 1;
        }
        state.enforce(session, &self.limits);
    }
}

/// The texts of the tokens that end an assistant turn: the model's EOS and the templates'
/// turn ends the engines stop on.
fn stop_texts(model: &TokenModel) -> Vec<String> {
    let mut texts: Vec<String> = [
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<｜end▁of▁sentence｜>",
        "<|observation|>",
        "<|user|>",
        "<|endoftext|>",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    if let Some(Value::String(eos)) = model.tokenizer().template_variables().get("eos_token") {
        if !texts.contains(eos) {
            texts.push(eos.clone());
        }
    }
    texts
}

fn push_run(runs: &mut Vec<TokenOriginRun>, origin: TokenOrigin, len: usize) {
    if len == 0 {
        return;
    }
    match runs.last_mut() {
        Some(last) if last.origin == origin => last.len += len as u32,
        _ => runs.push(TokenOriginRun {
            origin,
            len: len as u32,
        }),
    }
}

/// The meaning hash of the first message of `role`.
fn first_of(request: &ChatRequest, meaning: &Meaning, role: Role) -> Option<u64> {
    request
        .messages
        .iter()
        .position(|m| m.role == role)
        .map(|i| meaning.messages[i])
}

impl Tito {
    fn hash_of(&self, value: impl Hash) -> u64 {
        self.keys.hash_one(value)
    }

    /// A request's meaning (see the module's comment for what counts).
    fn meaning(&self, request: &ChatRequest) -> Meaning {
        let mut h = self.keys.build_hasher();
        for tool in &request.tools {
            tool.name.hash(&mut h);
            tool.description.hash(&mut h);
            tool.parameters.as_ref().map(|p| p.get()).hash(&mut h);
            tool.strict.hash(&mut h);
        }
        Meaning {
            messages: request
                .messages
                .iter()
                .map(|m| self.message_hash(m))
                .collect(),
            tools: h.finish(),
        }
    }

    fn message_hash(&self, m: &ChatMessage) -> u64 {
        let mut h = self.keys.build_hasher();
        (m.role as u8).hash(&mut h);
        m.name.hash(&mut h);
        let assistant = m.role == Role::Assistant;
        let texts: Vec<&str> = m
            .content
            .iter()
            .filter_map(|p| match p {
                ContentPart::Text { text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        if assistant {
            // Content trimmed, parts joined: `["a", "b"]` and `"a\nb"` are one answer.
            texts.join("\n").trim().hash(&mut h);
        } else {
            texts.hash(&mut h);
        }
        for part in &m.content {
            if !matches!(part, ContentPart::Text { .. }) {
                serde_json::to_string(part).unwrap_or_default().hash(&mut h);
            }
        }
        if assistant {
            for call in &m.tool_calls {
                call.name.hash(&mut h);
                match serde_json::from_str::<Value>(&call.arguments) {
                    Ok(v) => sorted_json(&v).hash(&mut h),
                    Err(_) => call.arguments.trim().hash(&mut h),
                }
            }
        }
        h.finish()
    }

    fn conversation_key(&self, messages: &[u64], tools: u64) -> u64 {
        self.hash_of((messages, tools))
    }

    fn system_key(&self, request: &ChatRequest, meaning: &Meaning) -> u64 {
        let system: Vec<u64> = request
            .messages
            .iter()
            .zip(&meaning.messages)
            .filter(|(m, _)| matches!(m.role, Role::System | Role::Developer))
            .map(|(_, h)| *h)
            .collect();
        self.hash_of(system)
    }
}

/// JSON with object keys in sorted order and no spacing: the same for the same meaning.
fn sorted_json(v: &Value) -> String {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let fields: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", Value::String(k.clone()), sorted_json(&map[k])))
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(sorted_json).collect::<Vec<_>>().join(",")
        ),
        other => other.to_string(),
    }
}
