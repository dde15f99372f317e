//! Assertions shared by several tests.

use tokentap_schema::{CaptureRecord, TokenField, TokenSource};

use crate::llama::LlamaTokenizer;
use crate::tee::{Exchange, TeeProxy};

/// A successful call's record carries complete token data: prompt ids, completion ids and
/// logprobs of equal length, no gaps, no error.
pub fn assert_complete_token_data(r: &CaptureRecord) {
    assert!(
        r.token_provenance.gaps.is_empty(),
        "record {} has token gaps: {:?}",
        r.record_id,
        r.token_provenance.gaps
    );
    assert_token_data_present(r);
}

/// Prompt ids, completion ids and logprobs (aligned) are present on a successful record.
pub fn assert_token_data_present(r: &CaptureRecord) {
    let ctx = || serde_json::to_string_pretty(r).unwrap();
    assert!(r.error.is_none(), "record has an error: {}", ctx());
    let prompt = r
        .prompt_token_ids
        .as_ref()
        .unwrap_or_else(|| panic!("no prompt_token_ids: {}", ctx()));
    let completion = r
        .completion_token_ids
        .as_ref()
        .unwrap_or_else(|| panic!("no completion_token_ids: {}", ctx()));
    let logprobs = r
        .logprobs
        .as_ref()
        .unwrap_or_else(|| panic!("no logprobs: {}", ctx()));
    assert!(
        !prompt.is_empty() && !completion.is_empty(),
        "empty ids: {}",
        ctx()
    );
    assert_eq!(
        completion.len(),
        logprobs.len(),
        "ids and logprobs differ in length"
    );
    assert!(
        logprobs.iter().all(|lp| lp.is_finite() && *lp <= 0.0),
        "logprobs out of range: {logprobs:?}"
    );
    assert_eq!(r.token_provenance.completion, TokenSource::EngineResponse);
    assert_ne!(r.token_provenance.prompt, TokenSource::Unavailable);
    assert_eq!(r.response_status, 200);
}

/// Each record of a llama.cpp-backed run is faithful to what llama-server itself did for that
/// call, as seen through the tee:
/// - one engine chat call per record;
/// - `completion_token_ids` (and `logprobs`) equal the ids (and logprobs) llama-server
///   reported for the call, with no gap unless llama-server counted a token it sent no id for;
/// - `prompt_token_ids` detokenize to exactly the prompt llama-server renders
///   (`/apply-template`) for the request tokentap sent it, and their count equals the
///   engine's `usage.prompt_tokens`.
///
/// Records are paired with engine calls by their sampled ids (each call used once), which
/// stays correct when a harness overlaps calls; the prompt check then ties the pair.
pub async fn assert_records_match_engine(
    records: &[CaptureRecord],
    tee: &TeeProxy,
    tok: &LlamaTokenizer,
) {
    let mut calls: Vec<Option<Exchange>> = tee.chat_exchanges().into_iter().map(Some).collect();
    assert_eq!(
        calls.len(),
        records.len(),
        "expected one llama-server chat call per record"
    );
    for r in records {
        assert_token_data_present(r);
        let completion = r.completion_token_ids.as_ref().unwrap();
        let slot = calls
            .iter_mut()
            .find(|c| c.as_ref().is_some_and(|c| &c.reported_ids() == completion))
            .unwrap_or_else(|| {
                panic!(
                    "record {} has completion ids {completion:?} that llama-server never reported; it reported {:?}",
                    r.record_id,
                    tee.chat_exchanges().iter().map(Exchange::reported_ids).collect::<Vec<_>>()
                )
            });
        let call = slot.take().unwrap();
        assert!(
            call.complete && call.status == 200,
            "engine call incomplete: {call:?}"
        );

        let reported = call.reported_tokens();
        for ((id, lp), (rid, rlp)) in completion
            .iter()
            .zip(r.logprobs.as_ref().unwrap())
            .zip(&reported)
        {
            assert_eq!(id, rid);
            assert!(
                (f64::from(*lp) - rlp).abs() < 1e-3,
                "logprob of token {id}: record {lp}, llama-server {rlp}"
            );
        }

        // Every sampled token is there, or the record says which is missing. llama-server
        // streams no id for the end-of-turn token (it does in whole answers) while counting
        // it in usage: then, and only then, the record must carry exactly that gap.
        let engine_usage = call.reported_usage().expect("llama-server reported usage");
        let engine_completion = engine_usage["completion_tokens"]
            .as_u64()
            .expect("completion_tokens") as usize;
        let gaps = &r.token_provenance.gaps;
        if engine_completion == completion.len() {
            assert!(
                gaps.is_empty(),
                "record {} has token gaps: {gaps:?}",
                r.record_id
            );
        } else {
            assert!(
                call.request_json()["stream"] == true,
                "a whole answer lacked ids: {engine_completion} vs {completion:?}"
            );
            assert_eq!(
                engine_completion,
                completion.len() + 1,
                "only the end-of-turn id may be missing"
            );
            assert_eq!(gaps.len(), 1, "{gaps:?}");
            assert_eq!(gaps[0].field, TokenField::CompletionTokenIds);
            assert!(
                gaps[0].reason.contains(&engine_completion.to_string())
                    && gaps[0].reason.contains(&completion.len().to_string()),
                "{gaps:?}"
            );
        }

        let prompt = r.prompt_token_ids.as_ref().unwrap();
        let usage = r.usage.expect("record usage");
        assert_eq!(
            usage.prompt_tokens as usize,
            prompt.len(),
            "usage.prompt_tokens vs prompt_token_ids"
        );
        assert_eq!(
            engine_usage["prompt_tokens"].as_u64(),
            Some(usage.prompt_tokens)
        );
        assert_eq!(
            usage.completion_tokens as usize, engine_completion,
            "usage is the engine's"
        );

        let rendered = tok.apply_template(&call.request_json()).await;
        let detok = tok.detokenize(prompt).await;
        assert_eq!(
            detok, rendered,
            "record {}: prompt_token_ids do not spell the prompt llama-server rendered",
            r.record_id
        );
        // And the server's own tokenization of that prompt is exactly the recorded ids.
        assert_eq!(&tok.tokenize(&rendered).await, prompt);
    }
}

/// The request's credential never reaches the spool: the header that carried it
/// (`authorization` for OpenAI clients, `x-api-key` for Anthropic ones) is recorded as
/// `[redacted]` and the key string appears in no spool file.
pub fn assert_secret_redacted(records: &[CaptureRecord], spool_bytes: &[u8], api_key: &str) {
    assert_key_headers_redacted(records);
    assert_key_absent(spool_bytes, api_key);
}

/// Every record names the header that carried the credential, and shows it `[redacted]`.
pub fn assert_key_headers_redacted(records: &[CaptureRecord]) {
    for r in records {
        let h = &r.request.headers;
        let carrier = ["authorization", "x-api-key"]
            .into_iter()
            .find(|n| h.contains_key(*n))
            .unwrap_or_else(|| panic!("no credential header recorded in {}", r.record_id));
        assert_eq!(
            h[carrier], "[redacted]",
            "{carrier} header not redacted in {}",
            r.record_id
        );
    }
}

/// The key string appears in no spool file.
pub fn assert_key_absent(spool_bytes: &[u8], api_key: &str) {
    assert!(
        !spool_bytes
            .windows(api_key.len())
            .any(|w| w == api_key.as_bytes()),
        "the API key appears in the spool"
    );
}
