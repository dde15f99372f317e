//! The canonical side of a call: the chat request types (defined once, in `tokentap-schema`)
//! and the stream of generation events a backend produces. Wire modules render these events;
//! backend modules produce them; neither sees the other's shapes.

pub use tokentap_schema::{
    AssistantMessage, ChatMessage, ChatRequest, ContentPart, FinishReason, Role, SamplingParams,
    TokenField, TokenGap, TokenSource, ToolCall, ToolSpec, Usage,
};

/// One step of a generation, in the order the engine produced it.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// Text, reasoning or tool-call fragments for the harness.
    Delta(Delta),
    /// Token ids the engine sampled (and their logprobs, when it sent them), in order.
    /// Travels beside the text, never derived from it.
    SampledTokens {
        ids: Vec<u32>,
        logprobs: Vec<Option<f32>>,
    },
    /// The prompt exactly as the engine tokenized it.
    PromptTokens { ids: Vec<u32>, source: TokenSource },
    /// The prompt's token count, told before generation by an engine whose prompt ids come
    /// later or not at all (llama.cpp's prompt progress). For the harness's answer only.
    PromptSize(u64),
    /// A hole in the token data the adapter could not fill.
    Gap(TokenGap),
    /// `--token-mode tito`: how tokentap built the prompt ids it sent (before any other event).
    TokenIn(tokentap_schema::TokenIn),
    /// `--engine-weight-version`: the engine's weight version before and after the call
    /// (after `Finished`: bookkeeping).
    EngineWeightVersion(tokentap_schema::EngineWeightVersion),
    /// Generation ended. Further `PromptTokens`/`Gap` events may follow (bookkeeping that
    /// does not delay the harness).
    Finished {
        finish_reason: FinishReason,
        usage: Option<Usage>,
    },
}

/// A fragment of the assistant's answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    pub content: Option<String>,
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ToolCallDelta>,
}

impl Delta {
    pub fn is_empty(&self) -> bool {
        self.content.as_deref().is_none_or(str::is_empty)
            && self.reasoning.as_deref().is_none_or(str::is_empty)
            && self.tool_calls.is_empty()
    }
}

/// A fragment of one tool call; `index` says which call of the message it extends.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolCallDelta {
    pub index: u32,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: Option<String>,
}

/// Folds a generation's events into the assistant message and token data of a record.
#[derive(Debug, Default)]
pub struct GenerationAccumulator {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
    pub completion_ids: Vec<u32>,
    pub logprobs: Vec<Option<f32>>,
    pub saw_sampled_tokens: bool,
    pub prompt: Option<(Vec<u32>, TokenSource)>,
    pub gaps: Vec<TokenGap>,
    pub finish: Option<(FinishReason, Option<Usage>)>,
    pub token_in: Option<tokentap_schema::TokenIn>,
    pub engine_weight_version: Option<tokentap_schema::EngineWeightVersion>,
    /// Whether any content reached the accumulator (first-token timing).
    pub started: bool,
}

impl GenerationAccumulator {
    /// Takes `event` by value: the prompt's ids (tens of KB) move onto the record uncopied.
    pub fn push(&mut self, event: GenerationEvent) {
        match event {
            GenerationEvent::Delta(d) => self.push_delta(&d),
            GenerationEvent::SampledTokens { ids, logprobs } => {
                self.saw_sampled_tokens = true;
                self.completion_ids.extend_from_slice(&ids);
                self.logprobs.extend_from_slice(&logprobs);
            }
            GenerationEvent::PromptTokens { ids, source } => self.prompt = Some((ids, source)),
            GenerationEvent::PromptSize(_) => {}
            GenerationEvent::Gap(g) => self.gaps.push(g),
            GenerationEvent::TokenIn(t) => self.token_in = Some(t),
            GenerationEvent::EngineWeightVersion(v) => self.engine_weight_version = Some(v),
            GenerationEvent::Finished {
                finish_reason,
                usage,
            } => self.finish = Some((finish_reason, usage)),
        }
    }

    fn push_delta(&mut self, d: &Delta) {
        if !d.is_empty() {
            self.started = true;
        }
        if let Some(c) = &d.content {
            self.content.push_str(c);
        }
        if let Some(r) = &d.reasoning {
            self.reasoning.push_str(r);
        }
        for tc in &d.tool_calls {
            let i = tc.index as usize;
            while self.tool_calls.len() <= i {
                self.tool_calls.push(ToolCall {
                    id: String::new(),
                    name: String::new(),
                    arguments: String::new(),
                });
            }
            let call = &mut self.tool_calls[i];
            if let Some(id) = &tc.id {
                call.id.push_str(id);
            }
            if let Some(name) = &tc.name {
                call.name.push_str(name);
            }
            if let Some(args) = &tc.arguments {
                call.arguments.push_str(args);
            }
        }
    }

    /// The assistant message so far (`None` when nothing was produced).
    pub fn message(&self) -> Option<AssistantMessage> {
        let m = AssistantMessage {
            content: (!self.content.is_empty()).then(|| self.content.clone()),
            reasoning: (!self.reasoning.is_empty()).then(|| self.reasoning.clone()),
            tool_calls: self.tool_calls.clone(),
        };
        (m != AssistantMessage::default()).then_some(m)
    }
}
