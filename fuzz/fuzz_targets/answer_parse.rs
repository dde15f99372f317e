//! answer-parse's streamed reader on arbitrary sampled text.
//! Input: byte 0 picks the family (low 3 bits), reasoning (bit 3) and a generation prompt that
//! opened it (bit 4); byte 1 the chunk sizes (cycling 1..=8 from it, and a small call limit on
//! bit 7); the rest is the text (lossy UTF-8).
//! Invariants: no panic; the answer is the same read whole, in those chunks, and char by char
//! (`whole = split = byte by byte`); nothing is held after `finish`; every byte of the text
//! that is not inside a read call, a reasoning or section marker or separating whitespace comes
//! out.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokentap_answer_parse::{Answer, AnswerParser, Delta, Dialect, Family, ToolSchemas};

fn read(dialect: Dialect, max: usize, chunks: impl Iterator<Item = String>) -> Answer {
    let schemas = ToolSchemas::from_tools(&tokentap_answer_parse::probe_tools());
    let mut parser = AnswerParser::new(dialect, schemas).with_max_call_bytes(max);
    let mut deltas: Vec<Delta> = Vec::new();
    for chunk in chunks {
        deltas.extend(parser.push(&chunk));
    }
    deltas.extend(parser.finish());
    assert_eq!(parser.held(), 0);
    Answer::from_deltas(&deltas)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let family = Family::ALL[(data[0] & 7) as usize % Family::ALL.len()];
    let mut dialect = Dialect::new(family);
    if data[0] & 8 != 0 {
        dialect = dialect.with_reasoning_after(if data[0] & 16 != 0 { "<think>\n" } else { "" });
    }
    let max = if data[1] & 128 != 0 { 24 } else { 1 << 20 };
    let text = String::from_utf8_lossy(&data[2..]).into_owned();

    let whole = read(dialect, max, std::iter::once(text.clone()));
    let by_char = read(dialect, max, text.chars().map(String::from));
    assert_eq!(whole, by_char, "char by char");
    let mut chunks = Vec::new();
    let (mut at, mut step) = (0, data[1] as usize);
    while at < text.len() {
        let mut end = (at + step % 8 + 1).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        chunks.push(text[at..end].to_string());
        at = end;
        step = step.wrapping_mul(31).wrapping_add(7);
    }
    assert_eq!(whole, read(dialect, max, chunks.into_iter()), "chunked");

    // Nothing the model wrote disappears: reasoning and content are the text's own bytes, and
    // no more of them than the text has.
    assert!(whole.reasoning.len() + whole.content.len() <= text.len());
    if whole.tool_calls.is_empty() && !dialect.reasoning {
        // No call read and no reasoning: the text is content, less separating whitespace; for
        // DeepSeek, also less the section markers it read as structure (so there the content
        // is in order within the text).
        let kept: String = whole.content.split_whitespace().collect();
        let all: String = text.split_whitespace().collect();
        if family == Family::DeepSeekV3 {
            let mut rest = all.chars();
            assert!(kept.chars().all(|c| rest.any(|a| a == c)), "content not within the text");
        } else {
            assert_eq!(kept, all);
        }
    }
});
