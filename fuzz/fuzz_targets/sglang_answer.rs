//! The sglang adapter's decoders: a whole answer (JSON) or a streamed one (SSE, cut into chunks
//! at fuzzer-chosen points). Invariants: tokentap_fuzz::engine.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokentap_proxy::backend::BackendKind;

fuzz_target!(|data: &[u8]| tokentap_fuzz::engine(BackendKind::Sglang, data));
