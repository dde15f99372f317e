//! `tokentap records`: read a spool.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use tokentap_schema::CaptureRecord;
use tokentap_spool::{SpoolItem, SpoolReader};

#[derive(Subcommand)]
pub enum RecordsCmd {
    /// Print the last records, one line each (or as NDJSON with --json); --follow keeps
    /// printing new ones.
    #[command(
        after_help = "Examples:\n  tokentap records tail --spool ./spool -n 20\n  tokentap records tail --spool ./spool --json | jq .completion_token_ids\n  tokentap records tail --spool ./spool --follow"
    )]
    Tail {
        #[arg(long, default_value = "tokentap-spool")]
        spool: PathBuf,
        /// How many records.
        #[arg(short = 'n', long, default_value_t = 10)]
        lines: usize,
        /// Keep running and print records as they are written.
        #[arg(short, long)]
        follow: bool,
        /// Print whole records as NDJSON (token data as plain arrays, the engine request
        /// whole; see `show`).
        #[arg(long)]
        json: bool,
    },
    /// Print one record as pretty JSON, by record id or a unique prefix of it: token ids and
    /// logprobs as plain arrays and the engine request whole (the spool stores both compactly:
    /// docs/records.md), ready for jq or pandas.
    Show {
        id: String,
        #[arg(long, default_value = "tokentap-spool")]
        spool: PathBuf,
        /// Print the record as the spool stores it.
        #[arg(long)]
        stored: bool,
    },
    /// Summarize a spool: calls, sessions, tokens, and the first sampled tokens of each call
    /// with their logprobs.
    Summary {
        #[arg(long, default_value = "tokentap-spool")]
        spool: PathBuf,
        /// How many sampled tokens to show per call.
        #[arg(long, default_value_t = 8)]
        tokens: usize,
        /// A llama-server URL used only to show each token id's text piece (display only:
        /// records are never changed or filled from text).
        #[arg(long)]
        detokenize: Option<String>,
    },
    /// Count segments, records, bytes, torn and corrupt lines.
    Stats {
        #[arg(long, default_value = "tokentap-spool")]
        spool: PathBuf,
    },
}

pub fn run(cmd: RecordsCmd) -> anyhow::Result<()> {
    match cmd {
        RecordsCmd::Tail {
            spool,
            lines,
            follow,
            json,
        } => tail(&spool, lines, follow, json),
        RecordsCmd::Show { id, spool, stored } => {
            let record = tokentap_spool::find(&spool, &id)?
                .with_context(|| format!("no record {id} in {}", spool.display()))?;
            let shown = if stored {
                serde_json::to_value(&record)?
            } else {
                readable(&record)?
            };
            println!("{}", serde_json::to_string_pretty(&shown)?);
            Ok(())
        }
        RecordsCmd::Summary {
            spool,
            tokens,
            detokenize,
        } => summary(&spool, tokens, detokenize.as_deref()),
        RecordsCmd::Stats { spool } => {
            let s = tokentap_spool::stats(&spool)?;
            println!(
                "segments {}  records {}  bytes {}  torn tail {} bytes  corrupt lines {}",
                s.segments, s.records, s.bytes, s.torn_tail, s.corrupt_lines
            );
            Ok(())
        }
    }
}

/// A record as JSON for people and dataframes: token data as plain arrays, and the engine
/// request with its conversation, which the spool keeps once, in the harness body.
fn readable(r: &CaptureRecord) -> anyhow::Result<serde_json::Value> {
    let mut v = tokentap_schema::compact::expand_token_fields(serde_json::to_value(r)?);
    if let Some(request) = tokentap_proxy::replay::backend_request(r).map_err(anyhow::Error::msg)? {
        v["backend_request"] = serde_json::to_value(request.as_ref())?;
        if let Some(o) = v.as_object_mut() {
            o.remove("backend_conversation");
        }
    }
    Ok(v)
}

fn print_record(r: &CaptureRecord, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(&readable(r)?)?);
    } else {
        println!("{}", one_line(r));
    }
    Ok(())
}

/// `id  session#seq  api  status  prompt→completion tokens  finish  ms  text`
fn one_line(r: &CaptureRecord) -> String {
    let count = |ids: &Option<Vec<u32>>| {
        ids.as_ref()
            .map_or("?".to_string(), |v| v.len().to_string())
    };
    let text = r
        .message
        .as_ref()
        .map(|m| {
            let mut t = m.content.clone().unwrap_or_default();
            for c in &m.tool_calls {
                t.push_str(&format!(" [call {}({})]", c.name, c.arguments));
            }
            t
        })
        .unwrap_or_default();
    let text: String = text.chars().take(60).collect::<String>().replace('\n', "⏎");
    let outcome = match &r.error {
        Some(e) => format!("error:{}", e.kind.as_str()),
        None => r
            .finish_reason
            .map_or("-".into(), |f| format!("{f:?}").to_lowercase()),
    };
    format!(
        "{}  {}#{}  {}  {}  {}→{} tok  {}  {:.0} ms  {}",
        r.record_id,
        r.session_id,
        r.seq,
        r.wire_api.as_str(),
        r.response_status,
        count(&r.prompt_token_ids),
        count(&r.completion_token_ids),
        outcome,
        r.timings.total_ms,
        text
    )
}

fn tail(spool: &Path, n: usize, follow: bool, json: bool) -> anyhow::Result<()> {
    for r in tokentap_spool::tail(spool, n)? {
        print_record(&r, json)?;
    }
    if !follow {
        return Ok(());
    }
    // Skip what is already there, then print what arrives.
    let mut reader = SpoolReader::open(spool)?;
    while reader.next_available()?.is_some() {}
    loop {
        match reader.next_available()? {
            Some(SpoolItem::Record(e)) => print_record(&e.record, json)?,
            Some(SpoolItem::Corrupt { position, error }) => {
                eprintln!("corrupt line at {position}: {error}")
            }
            Some(SpoolItem::Torn { .. }) => {}
            None => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

fn summary(spool: &Path, show_tokens: usize, detokenize: Option<&str>) -> anyhow::Result<()> {
    let mut records = Vec::new();
    let mut problems = 0;
    for item in SpoolReader::open(spool)? {
        match item? {
            SpoolItem::Record(e) => records.push(e.record),
            SpoolItem::Corrupt { .. } | SpoolItem::Torn { .. } => problems += 1,
        }
    }
    let sessions: std::collections::BTreeSet<&str> =
        records.iter().map(|r| r.session_id.as_str()).collect();
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
    let with_ids = records
        .iter()
        .filter(|r| {
            r.prompt_token_ids.is_some() && r.completion_token_ids.is_some() && r.logprobs.is_some()
        })
        .count();
    let errors = records.iter().filter(|r| r.error.is_some()).count();
    println!("spool {}", spool.display());
    println!(
        "calls {}  sessions {}  with full token data {}  errors {}  unreadable lines {}",
        records.len(),
        sessions.len(),
        with_ids,
        errors,
        problems
    );
    println!("prompt tokens {prompt}  completion tokens {completion}");
    let pieces = Detokenizer::new(detokenize);
    for r in &records {
        println!("\n{}", one_line(r));
        for gap in &r.token_provenance.gaps {
            println!("    gap in {:?}: {}", gap.field, gap.reason);
        }
        let (Some(ids), Some(lps)) = (&r.completion_token_ids, &r.logprobs) else {
            continue;
        };
        let shown: Vec<String> = ids
            .iter()
            .zip(lps)
            .take(show_tokens)
            .map(|(id, lp)| match pieces.piece(*id) {
                Some(p) => format!("{id} {p:?} ({lp:.3})"),
                None => format!("{id} ({lp:.3})"),
            })
            .collect();
        println!("    first sampled tokens: {}", shown.join(", "));
    }
    Ok(())
}

/// Token id → text piece through a llama-server, for display only.
pub(crate) struct Detokenizer {
    url: Option<String>,
    client: reqwest::blocking::Client,
}

impl Detokenizer {
    pub(crate) fn new(url: Option<&str>) -> Self {
        Detokenizer {
            url: url.map(|u| u.trim_end_matches('/').to_owned()),
            client: reqwest::blocking::Client::new(),
        }
    }

    pub(crate) fn piece(&self, id: u32) -> Option<String> {
        let url = self.url.as_ref()?;
        let answer = self
            .client
            .post(format!("{url}/detokenize"))
            .json(&serde_json::json!({"tokens": [id]}))
            .send()
            .ok()?;
        let v: serde_json::Value = tokentap_proxy::capped_body::read_sync_json(
            answer,
            tokentap_proxy::capped_body::MAX_BODY_READ,
        )
        .ok()?;
        v.get("content")?.as_str().map(str::to_owned)
    }
}
