//! The real inference engine: llama.cpp's `llama-server` on the tiny SmolLM2-tokenizer model
//! (or the tiny tool-calling Qwen3-tokenizer model), and its tokenizer/template helpers (`/apply-template`, `/tokenize`, `/detokenize`).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::OnceCell;

use crate::artefacts::Artefacts;
use crate::procs::{free_port, http_client, spawn_guarded, wait_healthy, ChildGuard, KillScope};

/// SmolLM2's end-of-turn token `<|im_end|>`.
pub const END_OF_TURN: u32 = 2;

/// The tiny tool-calling model's (Qwen3's) end-of-turn token `<|im_end|>`.
pub const QWEN3_END_OF_TURN: u32 = 151645;
/// Qwen3's `<tool_call>` token, which opens every call the tool model makes.
pub const QWEN3_TOOL_CALL: u32 = 151657;
/// Qwen3's `<think>` and `</think>` (added tokens).
pub const QWEN3_THINK: u32 = 151667;
pub const QWEN3_END_THINK: u32 = 151668;

/// A running llama-server, killed on drop.
pub struct LlamaServer {
    pub url: String,
    pub port: u16,
    _child: ChildGuard,
    _dir: tempfile::TempDir,
}

impl LlamaServer {
    /// `llama-server -m $TOKENTAP_MODEL_TINY --host 127.0.0.1 --port P -c CTX -np 1 -a tiny --jinja`,
    /// healthy. Fails the test (with a pointer to `scripts/setup`) if the artefacts are missing.
    pub async fn start(ctx: u32) -> LlamaServer {
        LlamaServer::start_with(ctx, &[]).await
    }

    /// The same, with extra llama-server arguments.
    pub async fn start_with(ctx: u32, extra: &[&str]) -> LlamaServer {
        LlamaServer::start_model(None, ctx, extra).await
    }

    /// [`Self::start_with`] on `model` (`None`: the tiny SmolLM2-tokenizer model).
    pub async fn start_model(model: Option<&Path>, ctx: u32, extra: &[&str]) -> LlamaServer {
        let a = Artefacts::require_llama();
        let model = model.unwrap_or(&a.model_tiny);
        let dir = tempfile::tempdir().expect("temp dir");
        let mut last_err = String::new();
        for _attempt in 0..3 {
            let port = free_port();
            let log = dir.path().join(format!("llama-server-{port}.log"));
            let mut cmd = Command::new(&a.llama_server);
            cmd.arg("-m")
                .arg(model)
                .args(["--host", "127.0.0.1", "--port"])
                .arg(port.to_string())
                .args(["-c", &ctx.to_string(), "-np", "1", "-a", "tiny", "--jinja"])
                .args(["--threads", "2"])
                .args(extra);
            let mut child = spawn_guarded(cmd, &log, KillScope::Process, "llama-server")
                .unwrap_or_else(|e| panic!("starting {}: {e}", a.llama_server.display()));
            let url = format!("http://127.0.0.1:{port}");
            match wait_healthy(
                &format!("{url}/health"),
                &mut child,
                Duration::from_secs(60),
            )
            .await
            {
                Ok(()) => {
                    return LlamaServer {
                        url,
                        port,
                        _child: child,
                        _dir: dir,
                    }
                }
                Err(e) => last_err = e, // e.g. a port race: try another port
            }
        }
        panic!("llama-server did not start: {last_err}");
    }

    /// One llama-server (context 32768) shared by every test in this process; it dies with
    /// the process (parent-death signal).
    pub async fn shared() -> &'static LlamaServer {
        static SHARED: OnceCell<LlamaServer> = OnceCell::const_new();
        SHARED.get_or_init(|| LlamaServer::start(32768)).await
    }

    /// A llama-server (context 32768) whose chat template renders assistant tool calls back
    /// into the history exactly as sampled (`tests/fixtures/chatml-hermes-tools.jinja`), shared
    /// by the tests in this process.
    pub async fn shared_with_tool_template() -> &'static LlamaServer {
        static SHARED: OnceCell<LlamaServer> = OnceCell::const_new();
        const TEMPLATE: &str = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/chatml-hermes-tools.jinja"
        );
        SHARED
            .get_or_init(|| LlamaServer::start_with(32768, &["--chat-template-file", TEMPLATE]))
            .await
    }

    /// A llama-server (context 40960, Qwen3's) on the tiny tool-calling model
    /// ([`Artefacts::require_tool_model`]), shared by the tests in this process.
    pub async fn shared_tool_model() -> &'static LlamaServer {
        static SHARED: OnceCell<LlamaServer> = OnceCell::const_new();
        SHARED
            .get_or_init(|| async {
                let model = Artefacts::require_tool_model();
                LlamaServer::start_model(Some(&model), 40960, &[]).await
            })
            .await
    }

    /// A llama-server (context 40960) on the tiny reasoning model
    /// ([`Artefacts::require_think_model`]) with `--reasoning-format deepseek`, so the
    /// `<think>` block comes back as reasoning (`reasoning_content`, thinking blocks), shared
    /// by the tests in this process.
    pub async fn shared_think_model() -> &'static LlamaServer {
        static SHARED: OnceCell<LlamaServer> = OnceCell::const_new();
        SHARED
            .get_or_init(|| async {
                let model = Artefacts::require_think_model();
                LlamaServer::start_model(Some(&model), 40960, &["--reasoning-format", "deepseek"])
                    .await
            })
            .await
    }

    pub fn tokenizer(&self) -> LlamaTokenizer {
        LlamaTokenizer {
            url: self.url.clone(),
        }
    }
}

/// The tokenizer and chat template of a llama-server, by URL.
#[derive(Debug, Clone)]
pub struct LlamaTokenizer {
    pub url: String,
}

impl LlamaTokenizer {
    async fn post(&self, path: &str, body: &Value) -> Value {
        let r = http_client()
            .post(format!("{}{path}", self.url))
            .json(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path} to llama-server: {e}"));
        let status = r.status();
        let v: Value = r.json().await.expect("llama-server answers JSON");
        assert!(
            status.is_success(),
            "llama-server {path} answered {status}: {v}"
        );
        v
    }

    /// The prompt text llama-server renders for a chat request body (messages, tools, ...).
    pub async fn apply_template(&self, chat_body: &Value) -> String {
        let v = self.post("/apply-template", chat_body).await;
        v["prompt"]
            .as_str()
            .unwrap_or_else(|| panic!("/apply-template without prompt: {v}"))
            .to_owned()
    }

    /// Token ids of a rendered prompt, as the server tokenizes it (`add_special` and
    /// `parse_special`).
    pub async fn tokenize(&self, text: &str) -> Vec<u32> {
        self.tokenize_with_pieces(text, true)
            .await
            .into_iter()
            .map(|(id, _)| id)
            .collect()
    }

    /// Token ids with their text pieces (a piece that is not valid UTF-8 on its own comes back
    /// as `None`).
    pub async fn tokenize_with_pieces(
        &self,
        text: &str,
        add_special: bool,
    ) -> Vec<(u32, Option<String>)> {
        let v = self
            .post(
                "/tokenize",
                &json!({"content": text, "add_special": add_special, "parse_special": true, "with_pieces": true}),
            )
            .await;
        v["tokens"]
            .as_array()
            .unwrap_or_else(|| panic!("/tokenize without tokens: {v}"))
            .iter()
            .map(|t| match t {
                Value::Number(n) => (n.as_u64().expect("id") as u32, None),
                t => (
                    t["id"].as_u64().expect("token id") as u32,
                    t["piece"].as_str().map(str::to_owned),
                ),
            })
            .collect()
    }

    /// The text of token ids.
    pub async fn detokenize(&self, ids: &[u32]) -> String {
        let v = self.post("/detokenize", &json!({"tokens": ids})).await;
        v["content"]
            .as_str()
            .unwrap_or_else(|| panic!("/detokenize without content: {v}"))
            .to_owned()
    }
}
