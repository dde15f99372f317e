//! `tokentap records`: read a spool.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use tokentap_reconstruct::show;
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
                show::readable(&record).map_err(anyhow::Error::msg)?
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

fn print_record(r: &CaptureRecord, json: bool) -> anyhow::Result<()> {
    if json {
        println!(
            "{}",
            serde_json::to_string(&show::readable(r).map_err(anyhow::Error::msg)?)?
        );
    } else {
        println!("{}", show::one_line(r));
    }
    Ok(())
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
    let pieces = Detokenizer::new(detokenize);
    print!(
        "{}",
        show::spool_summary(spool, &records, problems, show_tokens, &|id| pieces
            .piece(id))
    );
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
