//! The Responses request parser (proxy/src/wire/responses.rs), on any request body.
//! Invariants: tokentap_fuzz::wire_request, tokentap_fuzz::recorded_body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokentap_proxy::wire::responses::Responses;
use tokentap_proxy::wire::WireCodec;

fuzz_target!(|data: &[u8]| {
    tokentap_fuzz::wire_request(&Responses, Responses.parse(data));
    tokentap_fuzz::recorded_body(data);
});
