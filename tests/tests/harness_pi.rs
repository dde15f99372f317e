//! Real Pi (`pi -p`) through tokentap to a real llama-server (via the tee): Pi is answered,
//! and every record holds exactly the token ids llama-server saw and sampled, with the
//! harness's credential nowhere in the spool.

use tokentap_e2e::checks::{
    assert_complete_token_data, assert_records_match_engine, assert_secret_redacted,
};
use tokentap_e2e::harness::{run_pi, HarnessDirs};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::tee::TeeProxy;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::SessionSource;

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_say_hi_is_captured_with_the_engines_exact_tokens() {
    let llama = LlamaServer::shared().await;
    let tee = TeeProxy::start(&llama.url).await;
    let tokentap = Tokentap::start(TokentapConfig::new(tee.url.clone(), "llamacpp")).await;
    let dirs = HarnessDirs::new();
    let key = "sk-tokentap-e2e-pi-7d41c9e0b2";

    let run = run_pi(&dirs, &tokentap.base_url(), key, "m", "say hi").await;
    run.assert_success("pi -p");

    let calls = tee.chat_exchanges().len();
    assert!(calls >= 1, "Pi made no model call through tokentap");
    eprintln!("Pi made {calls} model call(s)");
    let records = tokentap.wait_records(calls).await;
    assert_eq!(records.len(), calls);
    // Complete token data, no gaps (the harness sends tools, so tokentap makes whole engine
    // calls, whose answers carry every sampled id including the end of turn).
    records.iter().for_each(assert_complete_token_data);
    assert_records_match_engine(&records, &tee, &llama.tokenizer()).await;
    assert_secret_redacted(&records, &tokentap.spool_bytes(), key);

    // Pi's calls share its API key, hence one session, numbered 0..n.
    for r in &records {
        assert_eq!(r.session_source, SessionSource::ApiKey);
        assert_eq!(r.session_id, records[0].session_id);
        assert_eq!(r.request.path, "/v1/chat/completions");
    }
    let mut seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    seqs.sort();
    assert_eq!(seqs, (0..calls as u64).collect::<Vec<_>>());
    // The first call carries the user's prompt as the harness sent it.
    let first = records.iter().find(|r| r.seq == 0).unwrap();
    let body = first.request.body.as_ref().expect("request body");
    assert!(body.to_string().contains("say hi"), "{body}");
    assert_eq!(body["stream"], true, "Pi streams");
}
