//! SGLang's native `/generate` with the prompt as `input_ids` (`sglang/srt/managers/
//! io_struct.py` `GenerateReqInput`; the answers are the tokenizer manager's out dicts:
//! `text`, `output_ids`, `meta_info`). `return_logprob` with `logprob_start_len: -1` gives
//! `meta_info.output_token_logprobs`, one `[logprob, id, text]` per sampled token;
//! `meta_info.prompt_tokens` is the engine's count of the prompt.
//!
//! A stream's chunks are cumulative (the whole text and ids so far) unless the server runs
//! with `--incremental-streaming-output`, when each is the new part only; the reader tells
//! them apart by `meta_info.completion_tokens`, the count so far in both. Special tokens stay
//! in the text, as for vLLM, and no grammar is sent (SGLang's chat endpoint constrains
//! nothing under `tool_choice: auto`).

use serde::Deserialize;
use serde_json::{json, Value};
use tokentap_schema::{BackendKind, FinishReason};

use super::ids::{
    protocol_error, transformers_samplers, IdsCall, IdsChunk, IdsDecoder, IdsEnd, IdsEngine,
    PromptAccount,
};
use crate::backend::error::BackendError;

#[derive(Clone, Copy)]
pub(crate) struct SglangIds;

impl IdsEngine for SglangIds {
    const KIND: BackendKind = BackendKind::Sglang;
    const PATH: &'static str = "/generate";
    const NEEDS_AN_EXPLICIT_LIMIT: bool = true;
    const NAMES_ITS_MODEL_FILE: bool = false;
    // As llama.cpp (SGLang's detector strips the text after `</think>`; never run here).
    const KEEPS_SPACE_AFTER_REASONING: bool = false;
    type Decoder = GenerateDecoder;

    /// The ids, every sampler explicit ([`transformers_samplers`]), the sampled tokens'
    /// logprobs asked for.
    fn body(&self, call: &IdsCall<'_>) -> Result<Value, String> {
        let mut sampling = transformers_samplers(call);
        sampling.insert("max_new_tokens".into(), json!(call.max_tokens));
        sampling.insert("no_stop_trim".into(), json!(false));
        if let Some(seed) = call.request.sampling.seed {
            sampling.insert("sampling_seed".into(), json!(seed));
        }
        Ok(json!({
            "input_ids": call.ids,
            "sampling_params": sampling,
            "stream": call.stream,
            "return_logprob": true,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
            "return_text_in_logprobs": false,
        }))
    }

    fn decoder(&self) -> GenerateDecoder {
        GenerateDecoder::default()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Generated {
    text: Option<String>,
    output_ids: Option<Vec<u32>>,
    meta_info: MetaInfo,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct MetaInfo {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    finish_reason: Option<Value>,
    /// `[logprob, id, text]` per sampled token.
    output_token_logprobs: Vec<(Option<f64>, u32, Option<String>)>,
}

/// What the stream has given so far, to take the new part of a cumulative chunk.
#[derive(Default)]
pub(crate) struct GenerateDecoder {
    ids: usize,
    text: usize,
}

impl GenerateDecoder {
    fn read(&mut self, data: &[u8]) -> Result<IdsChunk, BackendError> {
        let g: Generated =
            serde_json::from_slice(data).map_err(|e| protocol_error("/generate", e, data))?;
        let m = g.meta_info;
        // Ids from `output_ids`, else from the logprob entries (older servers).
        let all_ids = g
            .output_ids
            .unwrap_or_else(|| m.output_token_logprobs.iter().map(|e| e.1).collect());
        let so_far = m.completion_tokens.map_or(all_ids.len(), |n| n as usize);
        // Cumulative once something was seen and the chunk holds all of it; else new only.
        let cumulative = self.ids > 0 && all_ids.len() == so_far;
        let (skip_ids, skip_text) = if cumulative {
            (self.ids, self.text)
        } else {
            (0, 0)
        };
        let text = g.text.unwrap_or_default();
        let Some(new_text) = text.get(skip_text..) else {
            return Err(protocol_error(
                "/generate",
                "a cumulative chunk shorter than the text before it",
                data,
            ));
        };
        let tokens = all_ids.get(skip_ids..).unwrap_or_default().to_vec();
        let entries = m.output_token_logprobs.get(skip_ids..).unwrap_or_default();
        // Each entry names its token; one of another id is no logprob of this token.
        let logprobs = tokens
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let (lp, entry_id, _) = entries.get(i)?;
                (entry_id == id)
                    .then_some(*lp)
                    .flatten()
                    .map(|lp| lp as f32)
            })
            .collect();
        self.ids = so_far;
        self.text = if cumulative {
            text.len()
        } else {
            self.text + text.len()
        };
        let end = m.finish_reason.filter(|f| !f.is_null()).map(|f| IdsEnd {
            finish: match f["type"].as_str() {
                Some("length") => FinishReason::Length,
                Some("abort") => FinishReason::Abort,
                _ => FinishReason::Stop,
            },
            prompt: m
                .prompt_tokens
                .map_or(PromptAccount::Unreported, PromptAccount::Evaluated),
        });
        Ok(IdsChunk {
            text: new_text.to_owned(),
            tokens,
            logprobs,
            end,
        })
    }
}

impl IdsDecoder for GenerateDecoder {
    fn whole(&mut self, body: &[u8]) -> Result<IdsChunk, BackendError> {
        self.read(body)
    }

    fn event(&mut self, data: &[u8]) -> Result<Option<IdsChunk>, BackendError> {
        if data == b"[DONE]" {
            return Ok(None);
        }
        self.read(data).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::super::ids::body_for;
    use super::*;

    #[test]
    fn the_body_is_input_ids_with_every_sampler() {
        let body = body_for(
            &SglangIds,
            json!({"model": "qwen", "messages": [], "sampling": {"seed": 5}}),
            &[7, 8],
            false,
            Some(50),
        );
        assert_eq!(body["input_ids"], json!([7, 8]));
        assert_eq!(body["return_logprob"], true);
        let s = &body["sampling_params"];
        assert_eq!(s["max_new_tokens"], 50);
        assert_eq!(
            (s["temperature"].clone(), s["top_k"].clone()),
            (json!(1.0), json!(-1))
        );
        assert_eq!(s["sampling_seed"], 5);
        assert_eq!(s["skip_special_tokens"], false);
    }

    fn generated(text: &str, ids: &[u32], so_far: usize, finish: Value) -> String {
        let entries: Vec<Value> = ids.iter().map(|id| json!([-0.5, id, null])).collect();
        json!({"text": text, "output_ids": ids, "meta_info": {"id": "r1", "finish_reason": finish,
            "prompt_tokens": 4, "completion_tokens": so_far, "cached_tokens": 0,
            "output_token_logprobs": entries}})
        .to_string()
    }

    /// The default stream: every chunk holds everything so far.
    #[test]
    fn a_cumulative_stream_yields_each_new_part_once() {
        let mut d = GenerateDecoder::default();
        let a = d
            .event(generated("Hi", &[1], 1, Value::Null).as_bytes())
            .unwrap()
            .unwrap();
        let b = d
            .event(generated("Hi there", &[1, 2], 2, Value::Null).as_bytes())
            .unwrap()
            .unwrap();
        let c = d
            .event(
                generated(
                    "Hi there",
                    &[1, 2, 3],
                    3,
                    json!({"type": "stop", "matched": 3}),
                )
                .as_bytes(),
            )
            .unwrap()
            .unwrap();
        assert_eq!((a.text.as_str(), a.tokens), ("Hi", vec![1]));
        assert_eq!((b.text.as_str(), b.tokens), (" there", vec![2]));
        assert_eq!((c.text.as_str(), c.tokens.clone()), ("", vec![3]));
        assert_eq!(c.logprobs, vec![Some(-0.5)]);
        assert_eq!(
            c.end,
            Some(IdsEnd {
                finish: FinishReason::Stop,
                prompt: PromptAccount::Evaluated(4)
            })
        );
        assert_eq!(d.event(b"[DONE]").unwrap(), None);
    }

    /// `--incremental-streaming-output`: every chunk holds its new part only.
    #[test]
    fn an_incremental_stream_yields_each_chunk_as_it_is() {
        let mut d = GenerateDecoder::default();
        let a = d
            .event(generated("Hi", &[1], 1, Value::Null).as_bytes())
            .unwrap()
            .unwrap();
        let b = d
            .event(generated(" there", &[2], 2, Value::Null).as_bytes())
            .unwrap()
            .unwrap();
        let c = d
            .event(generated("", &[3], 3, json!({"type": "length", "length": 3})).as_bytes())
            .unwrap()
            .unwrap();
        assert_eq!((a.text.as_str(), a.tokens), ("Hi", vec![1]));
        assert_eq!((b.text.as_str(), b.tokens), (" there", vec![2]));
        assert_eq!(c.tokens, vec![3]);
        assert_eq!(c.end.unwrap().finish, FinishReason::Length);
    }

    #[test]
    fn a_whole_answer_is_one_chunk_with_its_end() {
        let body = generated(
            "Done.",
            &[5, 6, 7],
            3,
            json!({"type": "stop", "matched": 7}),
        );
        let c = GenerateDecoder::default().whole(body.as_bytes()).unwrap();
        assert_eq!((c.text.as_str(), c.tokens.len()), ("Done.", 3));
        assert!(c.end.is_some());
    }
}
