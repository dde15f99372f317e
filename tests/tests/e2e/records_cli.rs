//! `tokentap records tail|show|summary|stats` on a spool written by a real tokentap run.

use serde_json::Value;
use tokentap_e2e::fixtures::{hello_request, post_chat, scripted_tokentap};
use tokentap_e2e::scripted::{sequence, Reply};
use tokentap_e2e::tokentap::tokentap_cli;
use tokentap_e2e::CaptureRecord;

/// A record as `records show` and `records tail --json` print it: the engine request with its
/// conversation replayed from the harness body (the spool keeps it once, record version 2).
fn readable(r: &CaptureRecord) -> CaptureRecord {
    let mut r = r.clone();
    r.backend_request = tokentap_proxy::replay::backend_request(&r)
        .expect("the conversation replays")
        .map(std::borrow::Cow::into_owned);
    r.backend_conversation = Default::default();
    r
}

/// A spool with three calls: two answers and one engine failure.
async fn spool_with_three_calls() -> (
    tokentap_e2e::scripted::ScriptedBackend,
    tokentap_e2e::tokentap::Tokentap,
    Vec<CaptureRecord>,
) {
    let boom = Reply::Error {
        status: 500,
        body: serde_json::json!({"message": "boom"}),
    };
    let (backend, tokentap) = scripted_tokentap(
        sequence(vec![
            Reply::text("first answer"),
            boom,
            Reply::text("third answer"),
        ]),
        &[],
    )
    .await;
    let session = [("x-tokentap-session", "cli-run")];
    // Each call's record is awaited before the next call, so the spool holds them in order.
    let (status, _) = post_chat(&tokentap, &session, &hello_request(false)).await;
    assert_eq!(status, 200);
    tokentap.wait_records(1).await;
    let (status, _) = post_chat(&tokentap, &session, &hello_request(true)).await;
    assert_eq!(status, 502);
    tokentap.wait_records(2).await;
    let (status, _) =
        tokentap_e2e::fixtures::post_stream(&tokentap.chat_url(), &session, &hello_request(true))
            .await;
    assert_eq!(status, 200);
    let records = tokentap.wait_records(3).await;
    (backend, tokentap, records)
}

#[tokio::test(flavor = "multi_thread")]
async fn tail_lists_every_record_and_json_mode_round_trips() {
    let (_b, tokentap, records) = spool_with_three_calls().await;
    let spool = tokentap.spool.to_str().unwrap();

    let out = tokentap_cli(&["records", "tail", "--spool", spool]).await;
    assert!(out.success, "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", out.stdout);
    for (line, r) in lines.iter().zip(&records) {
        assert!(line.starts_with(&r.record_id), "{line}");
        assert!(line.contains(&format!("cli-run#{}", r.seq)), "{line}");
    }
    assert!(lines[0].contains("first answer"), "{}", lines[0]);
    assert!(lines[1].contains("error:backend_error"), "{}", lines[1]);

    let out = tokentap_cli(&["records", "tail", "--spool", spool, "-n", "2", "--json"]).await;
    assert!(out.success, "{out:?}");
    let parsed: Vec<CaptureRecord> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("tail --json prints records"))
        .collect();
    assert_eq!(
        parsed,
        records[1..].iter().map(readable).collect::<Vec<_>>(),
        "the last two records, their conversation replayed"
    );
    // Readable by jq and dataframes: token data as plain arrays, the conversation inline.
    let v: Value = serde_json::from_str(out.stdout.lines().last().unwrap()).unwrap();
    assert!(v["prompt_token_ids"].is_array(), "{v}");
    assert!(v["logprobs"].is_array(), "{v}");
    assert!(
        v["backend_request"]["messages"]
            .as_array()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn show_prints_the_record_of_an_id_prefix_as_pretty_json() {
    let (_b, tokentap, records) = spool_with_three_calls().await;
    let spool = tokentap.spool.to_str().unwrap();
    let target = &records[2];
    // UUIDv7 ids made within a millisecond share a long prefix; take the shortest unique one.
    let prefix_len = (8..=target.record_id.len())
        .find(|n| {
            records
                .iter()
                .filter(|r| r.record_id.starts_with(&target.record_id[..*n]))
                .count()
                == 1
        })
        .unwrap();
    let prefix = &target.record_id[..prefix_len];
    let out = tokentap_cli(&["records", "show", prefix, "--spool", spool]).await;
    assert!(out.success, "{out:?}");
    assert!(
        out.stdout.lines().count() > 10,
        "pretty (multi-line) JSON expected: {}",
        out.stdout
    );
    assert!(out.stdout.contains("\n  \"record_id\": "), "{}", out.stdout);
    let shown: CaptureRecord = serde_json::from_str(&out.stdout).expect("show prints a record");
    assert_eq!(shown, readable(target));
    // `--stored`: the record exactly as the spool keeps it.
    let out = tokentap_cli(&["records", "show", prefix, "--stored", "--spool", spool]).await;
    let stored: CaptureRecord = serde_json::from_str(&out.stdout).expect("a stored record");
    assert_eq!(&stored, target);

    // The full id works too; an unknown one fails and says so.
    let out = tokentap_cli(&["records", "show", &records[0].record_id, "--spool", spool]).await;
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["record_id"], records[0].record_id.as_str());
    let out = tokentap_cli(&["records", "show", "ffffffff-no-such", "--spool", spool]).await;
    assert!(!out.success);
    assert!(out.stderr.contains("no record ffffffff-no-such"), "{out:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn summary_and_stats_count_what_the_spool_holds() {
    let (_b, tokentap, records) = spool_with_three_calls().await;
    let spool = tokentap.spool.to_str().unwrap();

    let out = tokentap_cli(&["records", "summary", "--spool", spool]).await;
    assert!(out.success, "{out:?}");
    assert!(
        out.stdout
            .contains("calls 3  sessions 1  with full token data 2  errors 1"),
        "{}",
        out.stdout
    );
    for r in &records {
        assert!(
            out.stdout.contains(&r.record_id),
            "summary lacks {}: {}",
            r.record_id,
            out.stdout
        );
    }
    let prompt: usize = records
        .iter()
        .filter_map(|r| r.prompt_token_ids.as_ref())
        .map(Vec::len)
        .sum();
    let completion: usize = records
        .iter()
        .filter_map(|r| r.completion_token_ids.as_ref())
        .map(Vec::len)
        .sum();
    assert!(
        out.stdout.contains(&format!(
            "prompt tokens {prompt}  completion tokens {completion}"
        )),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("first sampled tokens: "),
        "{}",
        out.stdout
    );

    let out = tokentap_cli(&["records", "stats", "--spool", spool]).await;
    assert!(out.success, "{out:?}");
    assert!(
        out.stdout.contains("segments 1  records 3  "),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("torn tail 0 bytes  corrupt lines 0"),
        "{}",
        out.stdout
    );
}
