//! tokentap's mutating admission webhook, as data in and data out: an `AdmissionReview` of a
//! pod in, an `AdmissionReview` with a JSONPatch out ([`review`]); which pods are injected
//! and with what ([`inject`]); the serving certificate and its validity ([`cert`]). The HTTPS
//! listener lives in the `tokentap webhook` command.

pub mod cert;
pub mod inject;
pub mod review;

pub use inject::{InjectConfig, Mode};
pub use review::{admit, ReviewError};
