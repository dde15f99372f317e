//! The rollout node's integration tests (control plane, capture, delivery, pipeline), one
//! module per subject in one test binary: a binary per file linked the dependency graph once each.

mod api;
mod capture;
mod delivery;
mod pipeline;
