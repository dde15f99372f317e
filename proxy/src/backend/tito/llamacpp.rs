//! llama.cpp's `/completion` with the prompt as ids (`tools/server/server.cpp`): no BOS is
//! added to an id prompt and `cache_prompt` reuses the longest cached prefix. Its sampler
//! defaults are top-k 40, top-p 0.95, min-p 0.05 (and temperature 0.8 on some builds), which
//! no harness asked for, so every sampler is sent: the request's value, else the
//! distribution itself (temperature 1, no truncation). `n_probs: 1` gives each sampled
//! token's logprob first in its `completion_probabilities` entry, `return_tokens` the sampled
//! ids, the stop token included when the model sampled one; `tokens_evaluated` is the
//! engine's count of the prompt.

use serde::Deserialize;
use serde_json::{json, Value};
use tokentap_answer_parse::{call_grammar, NoGrammar};
use tokentap_schema::{BackendKind, FinishReason};

use super::ids::{protocol_error, IdsCall, IdsChunk, IdsDecoder, IdsEnd, IdsEngine, PromptAccount};
use crate::backend::error::BackendError;

#[derive(Clone, Copy)]
pub(crate) struct LlamaCppIds;

impl IdsEngine for LlamaCppIds {
    const KIND: BackendKind = BackendKind::Llamacpp;
    const PATH: &'static str = "/completion";
    // `n_predict: -1` runs to the end of the context, as the chat endpoint does.
    const NEEDS_AN_EXPLICIT_LIMIT: bool = false;
    const NAMES_ITS_MODEL_FILE: bool = true;
    // llama.cpp's reasoning parser consumes the whitespace after `</think>`.
    const KEEPS_SPACE_AFTER_REASONING: bool = false;
    type Decoder = CompletionDecoder;

    /// The ids, every sampler explicit, token data asked for, and the grammar of the family's
    /// calls to the offered tools as llama-server's chat endpoint applies it (lazy: from the
    /// call's opening marker on), unless the request says `tool_choice: none`. Tools past the
    /// grammar's bounds (`GrammarBounds`: nesting, subschemas, its size) refuse the call:
    /// sent without the grammar, the call would not be the one the chat endpoint makes, and
    /// such schemas are hostile or broken.
    fn body(&self, call: &IdsCall<'_>) -> Result<Value, String> {
        let s = &call.request.sampling;
        let mut body = json!({
            "prompt": call.ids,
            "stream": call.stream,
            "n_predict": call.max_tokens.map_or(-1, |n| n as i64),
            "return_tokens": true,
            "n_probs": 1,
            "cache_prompt": true,
            "temperature": s.temperature.unwrap_or(1.0),
            "top_p": s.top_p.unwrap_or(1.0),
            "top_k": s.top_k.unwrap_or(0),
            "min_p": s.min_p.unwrap_or(0.0),
            "typical_p": 1.0,
            "repeat_penalty": 1.0,
            "presence_penalty": s.presence_penalty.unwrap_or(0.0),
            "frequency_penalty": s.frequency_penalty.unwrap_or(0.0),
            "dry_multiplier": 0.0,
            "xtc_probability": 0.0,
            "mirostat": 0,
            "stop": s.stop,
        });
        if let Some(seed) = s.seed {
            body["seed"] = json!(seed);
        }
        let calls_allowed =
            call.request.tool_choice.as_ref().and_then(Value::as_str) != Some("none");
        if calls_allowed {
            match call_grammar(call.family, call.tools) {
                Ok(grammar) => {
                    if let (Value::Object(body), Value::Object(fields)) =
                        (&mut body, grammar.completion_fields())
                    {
                        body.extend(fields);
                    }
                }
                Err(NoGrammar::NoTools) => {}
                Err(refused @ NoGrammar::Refused(_)) => {
                    return Err(format!(
                        "tokentap refuses this call's tools: {refused} (docs/token-in.md)"
                    ))
                }
            }
        }
        Ok(body)
    }

    fn decoder(&self) -> CompletionDecoder {
        CompletionDecoder
    }
}

/// One `/completion` answer, whole or one stream chunk (the fields tito reads).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct CompletionChunk {
    content: String,
    tokens: Vec<u32>,
    completion_probabilities: Vec<TokenProb>,
    stop: bool,
    stop_type: Option<String>,
    tokens_evaluated: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct TokenProb {
    id: Option<u32>,
    logprob: Option<f32>,
}

/// `/completion` answers are self-contained: each chunk carries its own text and ids, the
/// last one (`stop`) how it ended.
pub(crate) struct CompletionDecoder;

impl CompletionDecoder {
    fn read(data: &[u8], whole: bool) -> Result<IdsChunk, BackendError> {
        let c: CompletionChunk =
            serde_json::from_slice(data).map_err(|e| protocol_error("/completion", e, data))?;
        // Each entry is the sampled token's own (n_probs 1 lists it first); one that names
        // another id is no logprob of this token.
        let logprobs = c
            .tokens
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let p = c.completion_probabilities.get(i)?;
                (p.id == Some(*id)).then_some(p.logprob).flatten()
            })
            .collect();
        let end = (c.stop || whole).then(|| IdsEnd {
            finish: match c.stop_type.as_deref() {
                Some("limit") => FinishReason::Length,
                _ => FinishReason::Stop,
            },
            prompt: c
                .tokens_evaluated
                .map_or(PromptAccount::Unreported, PromptAccount::Evaluated),
        });
        Ok(IdsChunk {
            text: c.content,
            tokens: c.tokens,
            logprobs,
            end,
        })
    }
}

impl IdsDecoder for CompletionDecoder {
    fn whole(&mut self, body: &[u8]) -> Result<IdsChunk, BackendError> {
        Self::read(body, true)
    }

    fn event(&mut self, data: &[u8]) -> Result<Option<IdsChunk>, BackendError> {
        Self::read(data, false).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::super::ids::tools_json;
    use super::*;
    use tokentap_answer_parse::Family;
    use tokentap_wire::canonical::ChatRequest;

    fn request(tools: Value) -> ChatRequest {
        serde_json::from_value(json!({"model": "m", "messages": [], "tools": tools})).unwrap()
    }

    fn body(request: &ChatRequest, ids: &[u32]) -> Value {
        let tools = tools_json(request);
        LlamaCppIds
            .body(&IdsCall {
                request,
                tools: &tools,
                family: Family::Hermes,
                ids,
                stream: false,
                max_tokens: None,
            })
            .unwrap()
    }

    #[test]
    fn every_sampler_is_explicit() {
        let body = body(&request(json!([])), &[1, 2]);
        for key in [
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "typical_p",
            "repeat_penalty",
            "dry_multiplier",
            "xtc_probability",
            "mirostat",
            "n_probs",
            "return_tokens",
        ] {
            assert!(body.get(key).is_some(), "{key} not sent");
        }
        assert_eq!(body["top_k"], 0);
        assert_eq!(body["n_predict"], -1);
        assert_eq!(body["prompt"], json!([1, 2]));
        assert!(body.get("grammar").is_none(), "no tools, no grammar");
    }

    #[test]
    fn offered_tools_bring_the_calls_grammar_unless_refused() {
        let tools = json!([{"name": "bash", "parameters": {"type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"]}}]);
        let body_with_tools = body(&request(tools.clone()), &[1]);
        let grammar = body_with_tools["grammar"].as_str().unwrap();
        assert!(
            grammar.contains(r#""<tool_call>\n{\"name\": \"bash\", \"arguments\": ""#),
            "{grammar}"
        );
        assert_eq!(body_with_tools["grammar_lazy"], true);
        assert_eq!(
            body_with_tools["grammar_triggers"],
            json!([{"type": 1, "value": "<tool_call>"}])
        );
        let mut none = request(tools);
        none.tool_choice = Some(json!("none"));
        assert!(body(&none, &[1]).get("grammar").is_none());
    }

    #[test]
    fn tools_past_the_grammars_bounds_refuse_the_call() {
        let mut schema = json!({"type": "string"});
        for _ in 0..40 {
            schema = json!({"type": ["object", "object"], "properties": {"a": schema}});
        }
        let deep = request(json!([{"name": "f", "parameters": schema}]));
        let tools = tools_json(&deep);
        let refused = LlamaCppIds
            .body(&IdsCall {
                request: &deep,
                tools: &tools,
                family: Family::Hermes,
                ids: &[1],
                stream: false,
                max_tokens: None,
            })
            .unwrap_err();
        assert!(refused.contains("nest deeper than 32 levels"), "{refused}");
        // No grammar asked for, nothing refused.
        let mut none = deep;
        none.tool_choice = Some(json!("none"));
        assert!(body(&none, &[1]).get("grammar").is_none());
    }

    #[test]
    fn a_logprob_entry_of_another_id_is_no_logprob() {
        let data = br#"{"content": "a", "tokens": [5, 6], "stop": false,
            "completion_probabilities": [{"id": 5, "logprob": -0.5}, {"id": 7, "logprob": -0.1}]}"#;
        let chunk = CompletionDecoder.event(data).unwrap().unwrap();
        assert_eq!(chunk.logprobs, vec![Some(-0.5), None]);
        assert_eq!(chunk.end, None);
    }

    #[test]
    fn the_limit_is_a_length_finish_with_the_evaluated_count() {
        let data = br#"{"content": "", "tokens": [], "stop": true, "stop_type": "limit", "tokens_evaluated": 4}"#;
        let end = CompletionDecoder.event(data).unwrap().unwrap().end.unwrap();
        assert_eq!(end.finish, FinishReason::Length);
        assert_eq!(end.prompt, PromptAccount::Evaluated(4));
    }
}
