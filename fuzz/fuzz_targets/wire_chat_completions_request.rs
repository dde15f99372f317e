//! The ChatCompletions request parser (proxy/src/wire/chat_completions.rs), on any request body.
//! Invariants: tokentap_fuzz::wire_request, tokentap_fuzz::recorded_body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokentap_proxy::wire::chat_completions::ChatCompletions;
use tokentap_proxy::wire::WireCodec;

fuzz_target!(|data: &[u8]| {
    tokentap_fuzz::wire_request(&ChatCompletions, ChatCompletions.parse(data));
    tokentap_fuzz::recorded_body(data);
});
