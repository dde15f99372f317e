//! Real Qwen Code (`qwen --auth-type openai`) through tokentap to a real llama-server (via the
//! tee): it may make several calls; each record holds exactly the engine's token ids.

use tokentap_e2e::checks::{
    assert_complete_token_data, assert_records_match_engine, assert_secret_redacted,
};
use tokentap_e2e::harness::{run_qwen, HarnessDirs};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::tee::TeeProxy;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::SessionSource;

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_say_hi_is_captured_with_the_engines_exact_tokens() {
    let llama = LlamaServer::shared().await;
    let tee = TeeProxy::start(&llama.url).await;
    let tokentap = Tokentap::start(TokentapConfig::new(tee.url.clone(), "llamacpp")).await;
    let dirs = HarnessDirs::new();
    let key = "sk-tokentap-e2e-qwen-5a8e31f6c4";

    let run = run_qwen(&dirs, &tokentap.base_url(), key, "m", "say hi", true).await;
    run.assert_success("qwen");

    let calls = tee.chat_exchanges().len();
    assert!(calls >= 1, "Qwen Code made no model call through tokentap");
    eprintln!("Qwen Code made {calls} model call(s)");
    let records = tokentap.wait_records(calls).await;
    assert_eq!(records.len(), calls);
    // Complete token data, no gaps (the harness sends tools, so tokentap makes whole engine
    // calls, whose answers carry every sampled id including the end of turn).
    records.iter().for_each(assert_complete_token_data);
    assert_records_match_engine(&records, &tee, &llama.tokenizer()).await;
    assert_secret_redacted(&records, &tokentap.spool_bytes(), key);
    let mut seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    seqs.sort();
    assert_eq!(
        seqs,
        (0..calls as u64).collect::<Vec<_>>(),
        "one key, one session, seq 0..n"
    );
    assert!(records.iter().all(
        |r| r.session_source == SessionSource::ApiKey && r.session_id == records[0].session_id
    ));
    assert!(
        records.iter().any(|r| r
            .request
            .body
            .as_ref()
            .is_some_and(|b| b.to_string().contains("say hi"))),
        "no record carries the user's prompt"
    );
}
