//! Reconstruction's integration and property tests, one module per subject in one test
//! binary (with their shared generators in `common`): a binary per file linked the
//! dependency graph once each.

mod common;
mod live;
mod properties;
mod properties_order;
