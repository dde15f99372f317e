//! The end-to-end tests, one module per subject, built as one test binary: each module used to
//! be a binary of its own, and linking thirty copies of tokentap's dependency graph (about
//! 200 MB each with debug lines) and instantiating the same generic code thirty times was most
//! of CI's test build. nextest still runs every test in its own process, so no test shares
//! state with another; `heavy_*` tests run one at a time (.config/nextest.toml).
//!
//!     cargo nextest run --release -p tokentap-e2e -E 'test(/^limits::/)'   # one module

mod attacks_bus;
mod attacks_sandbox;
mod backend_failures;
mod bad_input;
mod bus;
mod bus_roles;
mod callbacks;
mod chaos;
mod control_plane;
mod deploy_manifests;
mod direct_llamacpp;
mod disk_full;
mod documented_commands;
mod engine_options;
mod evaluator_shadowing;
mod harnesses;
mod limits;
mod listener_tokens;
mod metrics;
mod model_tool_calls;
mod node_agent;
mod observability;
mod observe_reasoning;
mod real_vllm;
mod reconstruction;
mod records_cli;
mod rollout;
mod rollout_cluster;
mod rollout_token_mode;
mod sandbox_uids;
mod scripts_deps_cache;
mod scripts_static_checks;
mod sdk_types;
mod secrets;
mod sessions;
mod shipping;
mod soak;
mod tito;
mod tito_engines;
mod tito_grammar_bounds;
mod tito_harnesses;
mod tito_sessions;
mod tls_off_host;
mod tool_calls;
mod trace_readers;
mod train_loop;
mod trainers;
mod transparent;
mod viewer;
mod webhook;
mod wire_apis;
mod worker;
