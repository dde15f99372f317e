//! Test doubles of metric exporters that cannot run here (no GPU): vLLM's and SGLang's
//! `/metrics` and NVIDIA's DCGM exporter. Each serves Prometheus exposition text with the real
//! exporters' metric names, types and labels (vLLM v1 `vllm:*` with `model_name` and `engine`;
//! SGLang `sglang:*` with `model_name`; dcgm-exporter's default `DCGM_FI_*` counters with `gpu`,
//! `UUID`, `device`, `modelName`, `Hostname` and, on Kubernetes, `namespace`/`pod`/
//! `container`), with counters that advance on every scrape. Named as doubles: nothing in the
//! product uses them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Which exporter a double plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exporter {
    Vllm,
    Sglang,
    Dcgm,
}

/// One double, serving `GET /metrics` on loopback until dropped.
pub struct ExporterDouble {
    pub exporter: Exporter,
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ExporterDouble {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ExporterDouble {
    /// Starts the double; `model` is the served model name, `pod` and `namespace` the labels
    /// that join an engine's series with its GPU's (as Prometheus's Kubernetes discovery or
    /// dcgm-exporter's pod mapping would set them).
    pub async fn start(exporter: Exporter, model: &str, namespace: &str, pod: &str) -> Self {
        let scrapes = Arc::new(AtomicU64::new(0));
        let (model, namespace, pod) = (model.to_owned(), namespace.to_owned(), pod.to_owned());
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let n = scrapes.fetch_add(1, Ordering::Relaxed) + 1;
                let body = match exporter {
                    Exporter::Vllm => vllm(n, &model),
                    Exporter::Sglang => sglang(n, &model),
                    Exporter::Dcgm => dcgm(n, &namespace, &pod),
                };
                async move { ([("content-type", "text/plain; version=0.0.4")], body) }
            }),
        );
        let (addr, task) = crate::procs::serve_on_loopback(app, "the exporter double").await;
        ExporterDouble {
            exporter,
            addr,
            task,
        }
    }

    /// `host:port`, as a Prometheus static target.
    pub fn target(&self) -> String {
        self.addr.to_string()
    }
}

/// vLLM v1's engine metrics (vllm/v1/metrics/loggers.py): counters `_total`, gauges, and the
/// time-to-first-token histogram.
fn vllm(n: u64, model: &str) -> String {
    let l = format!("engine=\"0\",model_name=\"{model}\"");
    let ttft = [
        (0.05, n),
        (0.1, 2 * n),
        (0.5, 3 * n),
        (f64::INFINITY, 3 * n),
    ];
    let mut s = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{{l}}} {running}\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{{l}}} {waiting}\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{{l}}} {kv}\n\
         # HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n\
         # TYPE vllm:prefix_cache_queries_total counter\n\
         vllm:prefix_cache_queries_total{{{l}}} {queries}\n\
         # HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n\
         # TYPE vllm:prefix_cache_hits_total counter\n\
         vllm:prefix_cache_hits_total{{{l}}} {hits}\n\
         # HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n\
         # TYPE vllm:prompt_tokens_total counter\n\
         vllm:prompt_tokens_total{{{l}}} {prompt}\n\
         # HELP vllm:generation_tokens_total Number of generation tokens processed.\n\
         # TYPE vllm:generation_tokens_total counter\n\
         vllm:generation_tokens_total{{{l}}} {gen}\n\
         # HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n\
         # TYPE vllm:time_to_first_token_seconds histogram\n",
        running = 24 + n % 8,
        waiting = n % 5,
        kv = 0.5 + (n % 40) as f64 / 100.0,
        queries = 12_000 * n,
        hits = 9_000 * n,
        prompt = 12_000 * n,
        gen = 1_800 * n,
    );
    for (le, c) in ttft {
        let le = if le.is_infinite() {
            "+Inf".to_owned()
        } else {
            le.to_string()
        };
        s.push_str(&format!(
            "vllm:time_to_first_token_seconds_bucket{{{l},le=\"{le}\"}} {c}\n"
        ));
    }
    s.push_str(&format!(
        "vllm:time_to_first_token_seconds_sum{{{l}}} {}\nvllm:time_to_first_token_seconds_count{{{l}}} {}\n",
        0.2 * (3 * n) as f64,
        3 * n
    ));
    s
}

/// SGLang's scheduler and tokenizer metrics (sglang/srt/metrics/collector.py).
fn sglang(n: u64, model: &str) -> String {
    let l = format!("model_name=\"{model}\"");
    format!(
        "# HELP sglang:num_running_reqs The number of running requests.\n\
         # TYPE sglang:num_running_reqs gauge\n\
         sglang:num_running_reqs{{{l}}} {running}\n\
         # HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n\
         # TYPE sglang:num_queue_reqs gauge\n\
         sglang:num_queue_reqs{{{l}}} {queued}\n\
         # HELP sglang:token_usage The token usage.\n\
         # TYPE sglang:token_usage gauge\n\
         sglang:token_usage{{{l}}} {usage}\n\
         # HELP sglang:cache_hit_rate The prefix cache hit rate.\n\
         # TYPE sglang:cache_hit_rate gauge\n\
         sglang:cache_hit_rate{{{l}}} {hit}\n\
         # HELP sglang:gen_throughput The generation throughput (token/s).\n\
         # TYPE sglang:gen_throughput gauge\n\
         sglang:gen_throughput{{{l}}} {tput}\n\
         # HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n\
         # TYPE sglang:prompt_tokens_total counter\n\
         sglang:prompt_tokens_total{{{l}}} {prompt}\n\
         # HELP sglang:generation_tokens_total Number of generation tokens processed.\n\
         # TYPE sglang:generation_tokens_total counter\n\
         sglang:generation_tokens_total{{{l}}} {gen}\n",
        running = 16 + n % 4,
        queued = n % 3,
        usage = 0.6 + (n % 20) as f64 / 100.0,
        hit = 0.8,
        tput = 1500 + n % 100,
        prompt = 10_000 * n,
        gen = 1_500 * n,
    )
}

/// dcgm-exporter's default counters (etc/default-counters.csv): utilisation in percent, the
/// graphics engine's activity as a ratio (a DCP counter it enables by default; SM_ACTIVE is
/// commented out there, so the double does not emit it), framebuffer in MiB; one GPU.
fn dcgm(n: u64, namespace: &str, pod: &str) -> String {
    let l = format!(
        "gpu=\"0\",UUID=\"GPU-5e4a3b2c-double-0000-0000-000000000000\",device=\"nvidia0\",modelName=\"NVIDIA H100 80GB HBM3\",Hostname=\"gpu-node-1\",container=\"engine\",namespace=\"{namespace}\",pod=\"{pod}\""
    );
    format!(
        "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n\
         # TYPE DCGM_FI_DEV_GPU_UTIL gauge\n\
         DCGM_FI_DEV_GPU_UTIL{{{l}}} {util}\n\
         # HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.\n\
         # TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge\n\
         DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{l}}} {active}\n\
         # HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).\n\
         # TYPE DCGM_FI_DEV_FB_USED gauge\n\
         DCGM_FI_DEV_FB_USED{{{l}}} 71234\n",
        util = 60 + n % 35,
        active = 0.55 + (n % 30) as f64 / 100.0,
    )
}
