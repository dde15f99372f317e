//! The Messages request parser (proxy/src/wire/messages.rs), on any request body.
//! Invariants: tokentap_fuzz::wire_request, tokentap_fuzz::recorded_body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokentap_proxy::wire::messages::Messages;
use tokentap_proxy::wire::WireCodec;

fuzz_target!(|data: &[u8]| {
    tokentap_fuzz::wire_request(&Messages, Messages.parse(data));
    tokentap_fuzz::recorded_body(data);
    tokentap_fuzz::wire_request(&Messages, Messages.parse_count_tokens(data));
});
