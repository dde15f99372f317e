//! `--token-mode tito`'s answer decoders (llama.cpp `/completion`, vLLM `/v1/completions`,
//! SGLang `/generate`, whole or as stream events): the first byte picks the engine and the
//! form, the rest is the body, or the events one per line. Invariants: nothing panics, every
//! chunk has one logprob slot per id, and nothing follows a chunk that ended the answer but
//! `[DONE]`-like events that decode to nothing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokentap_proxy::backend::{decode, BackendKind};

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let kind = [BackendKind::Llamacpp, BackendKind::Vllm, BackendKind::Sglang][pick as usize % 3];
    let whole = pick & 0x80 != 0;
    let events: Vec<&[u8]> = if whole {
        vec![rest]
    } else {
        rest.split(|b| *b == b'\n').collect()
    };
    for chunk in decode::ids_answer(kind, whole, &events).into_iter().flatten() {
        let (_text, ids, logprobs, _ended) = chunk;
        assert_eq!(ids.len(), logprobs.len(), "one logprob slot per id");
    }
});
