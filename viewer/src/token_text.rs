//! Token id → text piece, for display only (tokentap never re-tokenizes captured text).
//!
//! Offline from a `tokenizer.json` or a GGUF model file through the `tokenizers` crate, or
//! from the engine's own `/detokenize` endpoint (llama.cpp answers `{"content"}`, vLLM
//! `{"prompt"}`), or not at all: the page then shows ids only.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use tokentap_chat_template::gguf::GgufVocabulary;

/// Most distinct ids asked of an engine for one page (the rest show as ids).
const MAX_REMOTE_IDS: usize = 20_000;
/// Detokenize requests in flight at once.
const REMOTE_CONCURRENCY: usize = 16;
/// Pieces kept from an engine (each is a few bytes).
const MAX_CACHED: usize = 1 << 20;

pub enum TokenText {
    None,
    Offline(Box<tokenizers::Tokenizer>),
    Engine {
        url: String,
        model: Option<String>,
        api_key: Option<String>,
        client: reqwest::Client,
        cache: Mutex<HashMap<u32, String>>,
    },
}

impl TokenText {
    /// A `tokenizer.json`, or a `.gguf` model whose vocabulary is rebuilt as one.
    pub fn from_file(path: &Path) -> anyhow::Result<TokenText> {
        // A Hugging Face model directory (what --tokenizer also takes for token mode).
        let in_dir;
        let path = if path.is_dir() {
            in_dir = path.join("tokenizer.json");
            in_dir.as_path()
        } else {
            path
        };
        let gguf = path.extension().is_some_and(|e| e == "gguf");
        let tokenizer = if gguf {
            // Decoding only, so any pre-tokenizer type will do (tokentap-chat-template owns the
            // GGUF reader; its encoding tokenizer refuses a `pre` it does not know).
            let json = GgufVocabulary::read(path)
                .and_then(|v| v.decoding_tokenizer_json())
                .with_context(|| format!("--tokenizer {}", path.display()))?;
            serde_json::from_value(json).map_err(anyhow::Error::msg)
        } else {
            tokenizers::Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!(e))
        }
        .with_context(|| format!("--tokenizer {}: not a usable tokenizer", path.display()))?;
        Ok(TokenText::Offline(Box::new(tokenizer)))
    }

    /// The engine at `url` (its base, without `/detokenize`); `model` for engines that want
    /// it; `api_key` sent as a bearer token.
    pub fn engine(
        url: &str,
        model: Option<String>,
        api_key: Option<String>,
    ) -> anyhow::Result<TokenText> {
        Ok(TokenText::Engine {
            url: url.trim_end_matches('/').to_owned(),
            model,
            api_key,
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()?,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// What the page says about token text.
    pub fn describe(&self) -> &'static str {
        match self {
            TokenText::None => "none (ids only)",
            TokenText::Offline(_) => "tokenizer file",
            TokenText::Engine { .. } => "engine /detokenize",
        }
    }

    /// The text piece of each id it can name.
    pub async fn pieces(&self, ids: &BTreeSet<u32>) -> HashMap<u32, String> {
        match self {
            TokenText::None => HashMap::new(),
            TokenText::Offline(t) => ids
                .iter()
                .filter_map(|&id| offline_piece(t, id).map(|p| (id, p)))
                .collect(),
            TokenText::Engine {
                url,
                model,
                api_key,
                client,
                cache,
            } => {
                let (mut known, missing) = {
                    let cache = cache.lock().unwrap();
                    let mut known = HashMap::new();
                    let mut missing = Vec::new();
                    for &id in ids {
                        match cache.get(&id) {
                            Some(p) => {
                                known.insert(id, p.clone());
                            }
                            None => missing.push(id),
                        }
                    }
                    (known, missing)
                };
                let fetched: Vec<(u32, String)> =
                    futures::stream::iter(missing.into_iter().take(MAX_REMOTE_IDS))
                        .map(|id| async move {
                            remote_piece(client, url, model.as_deref(), api_key.as_deref(), id)
                                .await
                                .map(|p| (id, p))
                        })
                        .buffer_unordered(REMOTE_CONCURRENCY)
                        .filter_map(|p| async move { p })
                        .collect()
                        .await;
                let mut cache = cache.lock().unwrap();
                for (id, p) in fetched {
                    if cache.len() < MAX_CACHED {
                        cache.insert(id, p.clone());
                    }
                    known.insert(id, p);
                }
                known
            }
        }
    }
}

/// One id decoded alone. A piece that is part of a multi-byte character decodes to U+FFFD;
/// its vocabulary entry (the byte-level spelling) says more, so that is shown instead.
fn offline_piece(t: &tokenizers::Tokenizer, id: u32) -> Option<String> {
    let text = t.decode(&[id], false).ok()?;
    if text.contains('\u{FFFD}') {
        return t.id_to_token(id).or(Some(text));
    }
    Some(text)
}

async fn remote_piece(
    client: &reqwest::Client,
    url: &str,
    model: Option<&str>,
    api_key: Option<&str>,
    id: u32,
) -> Option<String> {
    let mut body = serde_json::json!({"tokens": [id]});
    if let Some(m) = model {
        body["model"] = m.into();
    }
    let mut request = client.post(format!("{url}/detokenize")).json(&body);
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let answer: serde_json::Value = request
        .send()
        .await
        .ok()?
        .error_for_status()
        .ok()?
        .json()
        .await
        .ok()?;
    answer
        .get("content")
        .or_else(|| answer.get("prompt"))?
        .as_str()
        .map(str::to_owned)
}
