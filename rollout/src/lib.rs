//! The rollout node: trainers submit tasks, the node runs harness samples under capture,
//! reconstructs, evaluates and returns rewarded trajectories. See docs/rollout-design.md.
//!
//! - [`task`]: what is submitted and what is tracked per sample.
//! - [`store`]: the durable state (redb) that survives node restarts.
//! - [`pipeline`]: INIT → RUN → POST_RUN pools.
//! - [`api`]: the HTTP control plane of `tokentap serve`.
//! - [`capture`]: the in-process capture endpoint and the per-sample record index.
//! - [`accept`]: accept loops a flood of connections cannot stop.
//! - [`deliver`]: results POSTed to callback URLs from a durable outbox.
//! - [`cluster`]: nodes sharing one bus (`serve --bus`): the sample queue, state, results,
//!   events, callbacks and the gate on NATS JetStream.
//! - [`openapi`]: the control plane's OpenAPI document.
//! - [`generate`]: offline generation's task file in and SFT dataset out.
//! - [`metrics`]: per-stage Prometheus metrics.
//! - [`isolation`]: per-sample cgroups (memory, CPU, processes).
//! - [`gate`]: pause/resume for weight updates, policy versions, task sampling.
//! - [`evaluate`]: rewards from the final workspace.
//! - [`runner`]: the programs an evaluation runs, pinned by the node, never by the tree.
//! - [`sandbox`]: bubblewrap with no network but the capture.
//! - [`preset`]: how each harness is configured and launched.
//! - [`uids`]: a uid of its own for each sample's sandboxed task code.
//! - [`workspace`]: a sample's working copy, and the fresh copy its evaluation runs in.

pub mod accept;
pub mod api;
pub mod capture;
#[cfg(feature = "clap")]
pub mod cli;
pub mod clock;
pub mod cluster;
pub mod deliver;
pub mod evaluate;
pub mod gate;
pub mod generate;
pub mod metrics;
pub mod openapi;
pub mod pipeline;
pub mod preset;
pub mod runner;
pub mod sample_disk;
pub mod sample_files;
pub mod sandbox;
pub mod seccomp;
pub mod store;
pub mod task;
pub mod transparent;
pub mod uids;
pub mod workspace;
