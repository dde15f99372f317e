//! The node agent's integration tests, one module per subject in one test binary: a binary
//! per file linked the dependency graph once each. `agent_attach` needs root and the kernel;
//! it runs in the heavy group (.config/nextest.toml).

mod agent_attach;
mod kubernetes_source;
