//! vLLM's `/v1/completions` with the prompt as ids (`vllm/entrypoints/openai/completion/
//! protocol.py`): `return_token_ids` echoes `prompt_token_ids` on the choice (the first chunk
//! only, when streaming) and gives each choice (or chunk) its `token_ids`, the EOS included
//! when the model sampled it; `logprobs: 0` gives `token_logprobs` for the sampled tokens
//! only, and `return_tokens_as_token_ids` spells the logprob tokens `token_id:<id>`, the ids'
//! only source on servers older than `return_token_ids` (v0.10.2).
//!
//! Special tokens stay in the text (`skip_special_tokens: false`): a family's call markers
//! are special tokens in some vocabularies (DeepSeek's), and the reader needs them. The stop
//! token's own text is never written (vLLM drops it from the text of a stopped sequence).
//! No grammar is sent: vLLM's chat endpoint constrains nothing under `tool_choice: auto`
//! either. Logprobs are of the processed distribution only when vLLM runs with
//! `--logprobs-mode processed_logprobs` (docs/token-in.md).

use serde::Deserialize;
use serde_json::{json, Value};
use tokentap_schema::{BackendKind, FinishReason};

use super::ids::{
    protocol_error, transformers_samplers, IdsCall, IdsChunk, IdsDecoder, IdsEnd, IdsEngine,
    PromptAccount,
};
use crate::backend::error::BackendError;
use crate::backend::vllm::NO_LOGPROB;

#[derive(Clone, Copy)]
pub(crate) struct VllmIds;

impl IdsEngine for VllmIds {
    const KIND: BackendKind = BackendKind::Vllm;
    const PATH: &'static str = "/v1/completions";
    const NEEDS_AN_EXPLICIT_LIMIT: bool = true;
    const NAMES_ITS_MODEL_FILE: bool = false;
    // vLLM's qwen3 reasoning parser keeps `"\n\n"` after `</think>` in the content
    // (seen on vLLM 0.32: `"\n\nDone."`).
    const KEEPS_SPACE_AFTER_REASONING: bool = true;
    type Decoder = CompletionsDecoder;

    /// The ids, every sampler explicit ([`transformers_samplers`]), token data asked for.
    fn body(&self, call: &IdsCall<'_>) -> Result<Value, String> {
        let mut body = json!({
            "model": call.request.model,
            "prompt": call.ids,
            "stream": call.stream,
            "n": 1,
            "max_tokens": call.max_tokens,
            "logprobs": 0,
            "return_token_ids": true,
            "return_tokens_as_token_ids": true,
            "include_stop_str_in_output": false,
        });
        let fields = body.as_object_mut().expect("an object");
        fields.extend(transformers_samplers(call));
        if let Some(seed) = call.request.sampling.seed {
            fields.insert("seed".into(), json!(seed));
        }
        Ok(body)
    }

    fn decoder(&self) -> CompletionsDecoder {
        CompletionsDecoder::default()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Completion {
    choices: Vec<CompletionChoice>,
    usage: Option<CompletionUsage>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct CompletionChoice {
    text: String,
    logprobs: Option<CompletionLogprobs>,
    finish_reason: Option<String>,
    token_ids: Option<Vec<u32>>,
    prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct CompletionLogprobs {
    token_logprobs: Vec<Option<f64>>,
    tokens: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct CompletionUsage {
    prompt_tokens: Option<u64>,
}

/// Keeps the first chunk's echoed prompt for the last one.
#[derive(Default)]
pub(crate) struct CompletionsDecoder {
    prompt: Option<Vec<u32>>,
    prompt_tokens: Option<u64>,
}

impl CompletionsDecoder {
    fn read(&mut self, data: &[u8], whole: bool) -> Result<Option<IdsChunk>, BackendError> {
        let c: Completion =
            serde_json::from_slice(data).map_err(|e| protocol_error("/v1/completions", e, data))?;
        if let Some(n) = c.usage.and_then(|u| u.prompt_tokens) {
            self.prompt_tokens = Some(n);
        }
        let Some(choice) = c.choices.into_iter().next() else {
            return if whole {
                Err(protocol_error("/v1/completions", "no choice", data))
            } else {
                Ok(None)
            };
        };
        if choice.prompt_token_ids.is_some() {
            self.prompt = choice.prompt_token_ids;
        }
        let logprobs = choice.logprobs.unwrap_or_default();
        let tokens = match choice.token_ids {
            Some(ids) => ids,
            None => placeholder_ids(&logprobs.tokens).ok_or_else(|| {
                protocol_error(
                    "/v1/completions",
                    "neither token_ids nor token_id:<id> logprob tokens",
                    data,
                )
            })?,
        };
        let logprobs = if logprobs.token_logprobs.len() == tokens.len() {
            logprobs
                .token_logprobs
                .iter()
                .map(|lp| lp.filter(|lp| *lp > NO_LOGPROB).map(|lp| lp as f32))
                .collect()
        } else {
            vec![None; tokens.len()]
        };
        let end = choice.finish_reason.map(|reason| IdsEnd {
            finish: match reason.as_str() {
                "length" => FinishReason::Length,
                "abort" | "error" => FinishReason::Abort,
                _ => FinishReason::Stop,
            },
            prompt: match (self.prompt.take(), self.prompt_tokens) {
                (Some(ids), _) => PromptAccount::Echoed(ids),
                (None, Some(n)) => PromptAccount::Evaluated(n),
                (None, None) => PromptAccount::Unreported,
            },
        });
        Ok(Some(IdsChunk {
            text: choice.text,
            tokens,
            logprobs,
            end,
        }))
    }
}

/// Ids spelled `token_id:<id>`; `None` unless every token is.
fn placeholder_ids(tokens: &[String]) -> Option<Vec<u32>> {
    tokens
        .iter()
        .map(|t| t.strip_prefix("token_id:")?.parse().ok())
        .collect()
}

impl IdsDecoder for CompletionsDecoder {
    fn whole(&mut self, body: &[u8]) -> Result<IdsChunk, BackendError> {
        self.read(body, true)
            .map(|c| c.expect("a whole answer has its choice"))
    }

    fn event(&mut self, data: &[u8]) -> Result<Option<IdsChunk>, BackendError> {
        if data == b"[DONE]" {
            return Ok(None);
        }
        self.read(data, false)
    }
}

#[cfg(test)]
mod tests {
    use super::super::ids::body_for;
    use super::*;

    #[test]
    fn the_body_is_ids_with_every_sampler_and_the_token_data() {
        let body = body_for(
            &VllmIds,
            json!({"model": "qwen", "messages": [], "sampling": {"temperature": 0.6}}),
            &[7, 8],
            true,
            Some(100),
        );
        assert_eq!(body["prompt"], json!([7, 8]));
        assert_eq!(body["model"], "qwen");
        assert_eq!(body["max_tokens"], 100);
        assert_eq!(body["temperature"], 0.6);
        assert_eq!(
            (body["top_p"].clone(), body["top_k"].clone()),
            (json!(1.0), json!(-1))
        );
        assert_eq!(body["logprobs"], 0);
        assert_eq!(body["return_token_ids"], true);
        assert_eq!(body["skip_special_tokens"], false);
    }

    /// A whole answer as vLLM writes it (`CompletionResponse`, return_token_ids, logprobs 0).
    #[test]
    fn a_whole_answer_echoes_the_prompt_and_gives_ids_and_logprobs() {
        let body = json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "qwen",
            "choices": [{"index": 0, "text": "Hi.", "finish_reason": "stop", "stop_reason": null,
                "logprobs": {"text_offset": [0, 2, 3], "token_logprobs": [-0.5, -9999.0, -0.25],
                    "tokens": ["token_id:13048", "token_id:13", "token_id:151645"],
                    "top_logprobs": [{"token_id:13048": -0.5}, {"token_id:13": -9999.0}, {"token_id:151645": -0.25}]},
                "token_ids": [13048, 13, 151645], "prompt_logprobs": null, "prompt_token_ids": [1, 2, 3]}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}});
        let chunk = CompletionsDecoder::default()
            .whole(body.to_string().as_bytes())
            .unwrap();
        assert_eq!(chunk.text, "Hi.");
        assert_eq!(chunk.tokens, vec![13048, 13, 151645]);
        // vLLM's -9999 is its "no logprob".
        assert_eq!(chunk.logprobs, vec![Some(-0.5), None, Some(-0.25)]);
        assert_eq!(
            chunk.end,
            Some(IdsEnd {
                finish: FinishReason::Stop,
                prompt: PromptAccount::Echoed(vec![1, 2, 3])
            })
        );
    }

    /// A stream as vLLM writes it: the prompt on the first chunk, each chunk's own ids, the
    /// finish on the last token chunk, then a usage-only chunk and `[DONE]`.
    #[test]
    fn a_stream_keeps_the_first_chunks_prompt_for_the_end() {
        let chunk = |text: &str, id: u32, lp: f64, extra: Value| {
            let mut c = json!({"index": 0, "text": text, "token_ids": [id], "finish_reason": null,
                "stop_reason": null, "logprobs": {"text_offset": [0], "token_logprobs": [lp],
                "tokens": [format!("token_id:{id}")], "top_logprobs": [null]}});
            c.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "qwen", "choices": [c]})
                .to_string()
        };
        let mut d = CompletionsDecoder::default();
        let first = d
            .event(chunk("Hi", 13048, -0.5, json!({"prompt_token_ids": [1, 2]})).as_bytes())
            .unwrap()
            .unwrap();
        assert_eq!(
            (first.tokens, first.logprobs),
            (vec![13048], vec![Some(-0.5)])
        );
        assert_eq!(first.end, None);
        let last = d
            .event(chunk("", 151645, -0.1, json!({"finish_reason": "length"})).as_bytes())
            .unwrap()
            .unwrap();
        assert_eq!(
            last.end,
            Some(IdsEnd {
                finish: FinishReason::Length,
                prompt: PromptAccount::Echoed(vec![1, 2])
            })
        );
        let usage = json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "qwen",
            "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}});
        assert_eq!(d.event(usage.to_string().as_bytes()).unwrap(), None);
        assert_eq!(d.event(b"[DONE]").unwrap(), None);
    }

    #[test]
    fn without_ids_of_any_kind_the_answer_is_unreadable() {
        let body = json!({"choices": [{"index": 0, "text": "Hi", "finish_reason": "stop",
            "logprobs": {"token_logprobs": [-0.5], "tokens": ["Hi"]}}]});
        let e = CompletionsDecoder::default()
            .whole(body.to_string().as_bytes())
            .unwrap_err();
        assert!(e.to_string().contains("neither token_ids"), "{e}");
    }
}
