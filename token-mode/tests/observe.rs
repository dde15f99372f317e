//! The observer on the real Qwen3 chat template and tokenizer (the tiny tool model's GGUF,
//! `scripts/make_tiny_model.py --tools`: Qwen2's vocabulary and merges, Qwen3's added tokens
//! and Qwen3-0.6B's template). Engine prompts here are the template's own rendering, as an
//! engine that renders with the same template produces them; sampled ids are written as a
//! model would sample them (including ways a real model may cut text that re-encoding does
//! not reproduce).

use std::path::PathBuf;

use serde_json::json;
use tokentap_schema::{ChatRequest, Continuation, DriftCause, RenderComparison};
use tokentap_token_mode::{CallView, EngineDialect, Observer, ObserverLimits, TokenModel};

fn model() -> TokenModel {
    let path = std::env::var_os("TOKENTAP_MODEL_TINY_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap())
                .join(".cache/tokentap/models/tiny-qwen3-tools.gguf")
        });
    assert!(
        path.is_file(),
        "{} is missing: run scripts/setup and source ~/.cache/tokentap/env.sh",
        path.display()
    );
    TokenModel::open(&path, EngineDialect::Transformers)
        .expect("the tool model's tokenizer and template")
}

fn request(messages: serde_json::Value) -> ChatRequest {
    serde_json::from_value(json!({
        "model": "m",
        "messages": messages,
        "tools": [{"name": "bash", "description": "Run a command",
                   "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}],
    }))
    .unwrap()
}

fn text(t: &str) -> serde_json::Value {
    json!([{"type": "text", "text": t}])
}

fn user(t: &str) -> serde_json::Value {
    json!({"role": "user", "content": text(t), "content_was_string": true})
}

fn tool_result(t: &str) -> serde_json::Value {
    json!({"role": "tool", "content": text(t), "content_was_string": true, "tool_call_id": "c1"})
}

/// An assistant turn as the harness sends it back: the call, with or without its reasoning.
fn assistant_call(reasoning: Option<&str>) -> serde_json::Value {
    let mut m = json!({"role": "assistant",
        "tool_calls": [{"id": "c1", "name": "bash", "arguments": "{\"command\": \"pwd\"}"}]});
    if let Some(r) = reasoning {
        m["reasoning"] = json!(r);
    }
    m
}

const REASONING: &str = "The user wants the directory; pwd prints it.";
const SAMPLED_CALL: &str = "<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"pwd\"}}\n</tool_call><|im_end|>";

fn sampled_with_reasoning(m: &TokenModel) -> Vec<u32> {
    let t = m.tokenizer();
    t.encode(&format!("<think>\n{REASONING}\n</think>\n\n{SAMPLED_CALL}"))
        .unwrap()
}

struct Call {
    request: ChatRequest,
    prompt: Vec<u32>,
    completion: Vec<u32>,
    reasoning: Option<&'static str>,
    id: &'static str,
}

fn observe(o: &Observer, session: &str, c: &Call) -> tokentap_schema::TokenObservation {
    o.observe(CallView {
        session_id: session,
        record_id: c.id,
        request: &c.request,
        engine_prompt: Some(&c.prompt),
        completion: Some(&c.completion),
        reasoning: c.reasoning,
    })
}

/// The first call of a tool loop: the model reasons, then calls the tool.
fn first_call(m: &TokenModel) -> Call {
    let request = request(json!([user("Where am I?")]));
    Call {
        prompt: m.prompt_ids(&request).unwrap(),
        completion: sampled_with_reasoning(m),
        reasoning: Some(REASONING),
        request,
        id: "r1",
    }
}

/// A call of `request` that the model answered `Done.`.
fn answered_done(m: &TokenModel, request: ChatRequest, id: &'static str) -> Call {
    Call {
        prompt: m.prompt_ids(&request).unwrap(),
        completion: m.tokenizer().encode("Done.<|im_end|>").unwrap(),
        reasoning: None,
        request,
        id,
    }
}

/// The tool loop answered, then a second question: `first` is the first user message as the
/// harness now sends it (the reasoning goes back too; Qwen3's template drops it).
fn asked_again(first: &str) -> ChatRequest {
    request(json!([
        user(first),
        assistant_call(Some(REASONING)),
        tool_result("/work"),
        {"role": "assistant", "content": text("Done."), "content_was_string": true},
        user("And now?"),
    ]))
}

/// The next call, the harness sending the turn back with or without its reasoning.
fn second_call(m: &TokenModel, with_reasoning: bool) -> Call {
    let request = request(json!([
        user("Where am I?"),
        assistant_call(with_reasoning.then_some(REASONING)),
        tool_result("/work"),
    ]));
    Call {
        prompt: m.prompt_ids(&request).unwrap(),
        completion: m.tokenizer().encode("Done.<|im_end|>").unwrap(),
        reasoning: None,
        request,
        id: "r2",
    }
}

#[test]
fn a_harness_that_sends_reasoning_back_extends_the_session() {
    let m = model();
    let (a, b) = (first_call(&m), second_call(&m, true));
    let o = Observer::new(m, ObserverLimits::default());
    let first = observe(&o, "s", &a);
    assert_eq!(first.continuation, Continuation::First);
    assert!(
        matches!(first.render, RenderComparison::Equal { .. }),
        "{first:?}"
    );
    let second = observe(&o, "s", &b);
    match &second.continuation {
        Continuation::Extends {
            record_id,
            appended,
        } => {
            assert_eq!(record_id, "r1");
            assert_eq!(
                *appended as usize,
                b.prompt.len() - a.prompt.len() - a.completion.len()
            );
        }
        other => panic!("expected extends, got {other:?}"),
    }
}

#[test]
fn a_harness_that_drops_reasoning_splits_the_session_and_the_span_says_so() {
    let m = model();
    let (a, b) = (first_call(&m), second_call(&m, false));
    let o = Observer::new(m, ObserverLimits::default());
    observe(&o, "s", &a);
    let second = observe(&o, "s", &b);
    let Continuation::Diverges { record_id, spans } = &second.continuation else {
        panic!("expected diverges, got {:?}", second.continuation);
    };
    assert_eq!(record_id, "r1");
    assert_eq!(spans.len(), 1, "{spans:#?}");
    let s = &spans[0];
    assert_eq!(s.cause, DriftCause::ReasoningDropped, "{s:#?}");
    assert_eq!(
        s.at as usize,
        a.prompt.len(),
        "the drift starts where sampling did"
    );
    assert!(s.before_text.contains(REASONING), "{s:#?}");
    assert!(!s.prompt_text.contains("pwd prints"), "{s:#?}");
    // Without the reasoning to compare with, the same span is only changed content.
    let m = model();
    let o = Observer::new(m, ObserverLimits::default());
    observe(
        &o,
        "s",
        &Call {
            reasoning: None,
            ..first_call(o.model())
        },
    );
    let Continuation::Diverges { spans, .. } = observe(&o, "s", &b).continuation else {
        panic!()
    };
    assert_eq!(spans[0].cause, DriftCause::ContentChanged);
}

#[test]
fn a_new_user_turn_drops_past_reasoning_even_when_sent_back() {
    // Qwen3 keeps reasoning only after the last user message: a second question re-renders
    // the first answer without it, whatever the harness sends.
    let m = model();
    let a = first_call(&m);
    let b = second_call(&m, true);
    let request = asked_again("Where am I?");
    let c = answered_done(&m, request, "r3");
    let o = Observer::new(m, ObserverLimits::default());
    observe(&o, "s", &a);
    assert!(matches!(
        observe(&o, "s", &b).continuation,
        Continuation::Extends { .. }
    ));
    let third = observe(&o, "s", &c);
    // The third prompt no longer holds the first turn's reasoning: it parts from r2's prompt
    // where r1 sampled, and that span alone is drift (the rest of r2 is kept, shifted).
    match &third.continuation {
        Continuation::Diverges { record_id, spans } => {
            assert_eq!(record_id, "r1");
            assert_eq!(spans.len(), 1, "{spans:#?}");
            assert_eq!(spans[0].cause, DriftCause::ReasoningDropped);
            assert_eq!(spans[0].at as usize, a.prompt.len());
            assert_eq!(spans[0].prompt_len, 0);
        }
        other => panic!("expected diverges, got {other:?}"),
    }
}

#[test]
fn a_turn_the_template_rewrote_still_parts_as_sampled_reasoning_when_later_dropped() {
    // The model sampled its reasoning without the newlines Qwen3's template writes around it:
    // sent back, the turn is re-rendered (two boundary spans, no reasoning lost); after a
    // second user message the template drops it, and that is still the reasoning r1 sampled.
    let m = model();
    let tight = m
        .tokenizer()
        .encode(&format!("<think>{REASONING}</think>\n\n{SAMPLED_CALL}"))
        .unwrap();
    let a = Call {
        completion: tight,
        ..first_call(&m)
    };
    let b = second_call(&m, true);
    let request = asked_again("Where am I?");
    let c = answered_done(&m, request, "r3");
    let o = Observer::new(m, ObserverLimits::default());
    observe(&o, "s", &a);
    let Continuation::Diverges { record_id, spans } = observe(&o, "s", &b).continuation else {
        panic!("expected diverges")
    };
    assert_eq!(record_id, "r1");
    assert_eq!(spans.len(), 2, "{spans:#?}");
    for s in &spans {
        assert_eq!(s.cause, DriftCause::BoundaryToken, "{spans:#?}");
        assert_eq!(s.before_text.trim(), s.prompt_text.trim(), "{spans:#?}");
    }
    match observe(&o, "s", &c).continuation {
        Continuation::Diverges { record_id, spans } => {
            assert_eq!(record_id, "r1");
            assert_eq!(spans.len(), 1, "{spans:#?}");
            assert_eq!(spans[0].cause, DriftCause::ReasoningDropped, "{spans:#?}");
            assert_eq!(spans[0].at as usize, a.prompt.len());
            assert!(spans[0].before_text.contains(REASONING), "{spans:#?}");
        }
        other => panic!("expected diverges, got {other:?}"),
    }
}

#[test]
fn a_harness_edit_before_the_samples_is_changed_content_and_the_conversation_goes_on() {
    // A harness that rewrites its first user message on resume (Qwen Code drops the date
    // reminder it had added) and asks again: the prompt parts before any sampled id, but it
    // still holds the earlier turns, so it diverges: the edit, then the reasoning the template
    // dropped. A subagent's conversation sharing only the system prompt is a new prefix.
    let m = model();
    let a = first_call(&m);
    let b = second_call(&m, true);
    let edited = asked_again("Where?");
    let c = answered_done(&m, edited, "r3");
    let sub = answered_done(
        &m,
        request(json!([user("Summarise the repository")])),
        "sub",
    );
    let o = Observer::new(m, ObserverLimits::default());
    observe(&o, "s", &a);
    observe(&o, "s", &b);
    assert!(matches!(
        observe(&o, "s", &sub).continuation,
        Continuation::NewPrefix { .. }
    ));
    match observe(&o, "s", &c).continuation {
        Continuation::Diverges { record_id, spans } => {
            assert_eq!(
                record_id, "r2",
                "it parts in r2's prompt, before anything sampled"
            );
            let causes: Vec<_> = spans.iter().map(|s| s.cause).collect();
            assert_eq!(
                causes,
                [DriftCause::ContentChanged, DriftCause::ReasoningDropped],
                "{spans:#?}"
            );
            assert_eq!(spans[0].before_text, " am I", "{spans:#?}");
        }
        other => panic!("expected diverges, got {other:?}"),
    }
}

#[test]
fn the_same_text_in_other_ids_is_a_merge_difference_and_a_different_stop_a_boundary() {
    let m = model();
    let t = m.tokenizer();
    let a = {
        let request = request(json!([user("Say hello")]));
        // "Hello" sampled as two pieces where the tokenizer makes one.
        let mut completion = t.encode("Hel").unwrap();
        completion.extend(t.encode("lo").unwrap());
        completion.extend(t.encode("<|im_end|>").unwrap());
        assert_ne!(
            t.encode("Hello").unwrap().len(),
            2,
            "the test needs a one-piece word"
        );
        Call {
            prompt: m.prompt_ids(&request).unwrap(),
            completion,
            reasoning: None,
            request,
            id: "r1",
        }
    };
    let b = {
        let request = request(json!([
            user("Say hello"),
            {"role": "assistant", "content": text("Hello"), "content_was_string": true},
            user("Again"),
        ]));
        Call {
            prompt: m.prompt_ids(&request).unwrap(),
            completion: vec![],
            reasoning: None,
            request,
            id: "r2",
        }
    };
    let o = Observer::new(m, ObserverLimits::default());
    observe(&o, "s", &a);
    let Continuation::Diverges { spans, .. } = observe(&o, "s", &b).continuation else {
        panic!()
    };
    assert_eq!(spans.len(), 1, "{spans:#?}");
    assert_eq!(spans[0].cause, DriftCause::MergeDifference, "{spans:#?}");
    assert_eq!((spans[0].before_len, spans[0].prompt_len), (2, 1));

    // The model stopped on <|endoftext|>; the template closes the turn with <|im_end|>.
    let m = model();
    let t = m.tokenizer();
    let mut a2 = first_call(&m);
    a2.request = request(json!([user("Say hello")]));
    a2.prompt = m.prompt_ids(&a2.request).unwrap();
    a2.completion = t.encode("Hello<|endoftext|>").unwrap();
    a2.reasoning = None;
    let o = Observer::new(m, ObserverLimits::default());
    observe(&o, "s", &a2);
    let Continuation::Diverges { spans, .. } = observe(&o, "s", &b).continuation else {
        panic!()
    };
    assert_eq!(spans[0].cause, DriftCause::BoundaryToken, "{spans:#?}");
}

#[test]
fn tokentaps_ids_against_the_engines() {
    let m = model();
    let a = first_call(&m);
    let o = Observer::new(model(), ObserverLimits::default());
    // An engine that saw one token more than the template writes (a doubled BOS, say).
    let mut engine = vec![m.tokenizer().encode("<|endoftext|>").unwrap()[0]];
    engine.extend(&a.prompt);
    let seen = o.observe(CallView {
        session_id: "s",
        record_id: "r1",
        request: &a.request,
        engine_prompt: Some(&engine),
        completion: None,
        reasoning: None,
    });
    match &seen.render {
        RenderComparison::Differs {
            at,
            ours_len,
            engine_len,
            span,
        } => {
            assert_eq!(*at, 0);
            assert_eq!(
                (*ours_len as usize, *engine_len as usize),
                (a.prompt.len(), engine.len())
            );
            assert_eq!((span.before_len, span.prompt_len), (0, 1));
            assert_eq!(span.cause, DriftCause::BoundaryToken);
        }
        other => panic!("expected differs, got {other:?}"),
    }
    let none = o.observe(CallView {
        engine_prompt: None,
        ..CallView {
            session_id: "s",
            record_id: "r2",
            request: &a.request,
            engine_prompt: None,
            completion: None,
            reasoning: None,
        }
    });
    assert!(matches!(none.render, RenderComparison::Unavailable { .. }));
    assert!(matches!(
        none.continuation,
        Continuation::Unavailable { .. }
    ));
    // A conversation the template refuses: the reason names it.
    let refused: ChatRequest =
        serde_json::from_value(json!({"model": "m", "messages": []})).unwrap();
    let r = o.observe(CallView {
        session_id: "s",
        record_id: "r3",
        request: &refused,
        engine_prompt: Some(&engine),
        completion: None,
        reasoning: None,
    });
    match r.render {
        RenderComparison::Unavailable { reason } => assert!(reason.contains("render"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn interleaved_conversations_in_one_session_each_continue_their_own() {
    let m = model();
    let a = first_call(&m);
    let b = second_call(&m, true);
    let sub = answered_done(&m, request(json!([user("A subagent's own task")])), "sub1");
    let o = Observer::new(m, ObserverLimits::default());
    observe(&o, "s", &a);
    assert!(matches!(
        observe(&o, "s", &sub).continuation,
        Continuation::NewPrefix { .. }
    ));
    assert!(
        matches!(observe(&o, "s", &b).continuation, Continuation::Extends { ref record_id, .. } if record_id == "r1")
    );
    // A retry of the last call repeats it; another session knows nothing of these.
    assert!(
        matches!(observe(&o, "s", &Call { id: "r2b", ..second_call(o.model(), true) }).continuation,
        Continuation::Repeats { ref record_id } if record_id == "r2")
    );
    assert_eq!(observe(&o, "other", &b).continuation, Continuation::First);
}

#[test]
fn what_the_observer_holds_is_bounded() {
    let m = model();
    let a = first_call(&m);
    let per_call = a.prompt.len() + a.completion.len();
    let o = Observer::new(
        m,
        ObserverLimits {
            sessions: 3,
            tips_per_session: 2,
            held_tokens: per_call * 5,
        },
    );
    for s in 0..10 {
        observe(&o, &format!("s{s}"), &a);
        assert!(o.held_tokens() <= 3 * per_call, "{}", o.held_tokens());
    }
    // Three conversations in one session keep two tips.
    let o = Observer::new(
        model(),
        ObserverLimits {
            sessions: 3,
            tips_per_session: 2,
            held_tokens: usize::MAX,
        },
    );
    for id in ["x1", "x2", "x3"] {
        let mut c = first_call(o.model());
        c.id = id;
        c.request = request(json!([user(id)]));
        c.prompt = o.model().prompt_ids(&c.request).unwrap();
        observe(&o, "s", &c);
    }
    assert!(o.held_tokens() <= 2 * (per_call + 4), "{}", o.held_tokens());
    // The tokens held are given back when sessions go.
    let o = Observer::new(
        model(),
        ObserverLimits {
            sessions: 1,
            tips_per_session: 2,
            held_tokens: usize::MAX,
        },
    );
    observe(&o, "a", &a);
    observe(&o, "b", &a);
    assert_eq!(o.held_tokens(), per_call);
}

#[test]
fn text_parts_reach_a_string_template_joined_as_the_engines_join_them() {
    // Harnesses send content as parts (Codex, Claude Code, Pi over Responses and Messages);
    // Qwen3's template takes strings only, so llama.cpp and vLLM join the text parts with
    // "\n" before rendering. Without that the template fails (`+` on a list).
    let m = model();
    let parts = request(json!([{"role": "user", "content": [
        {"type": "text", "text": "first part"},
        {"type": "text", "text": "second part"}]}]));
    let joined = request(json!([user("first part\nsecond part")]));
    assert_eq!(
        m.prompt_ids(&parts).unwrap(),
        m.prompt_ids(&joined).unwrap()
    );
    assert!(m
        .prompt_text(&parts)
        .unwrap()
        .contains("first part\nsecond part"));
}

#[test]
fn llama_cpp_hands_developer_messages_and_tools_to_the_template_its_own_way() {
    // What llama-server rendered for Codex and Pi (seen in the harness tests): `developer` as
    // `system`, tools without `strict` and with `parameters: {}` when absent.
    let path = std::env::var_os("TOKENTAP_MODEL_TINY_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap())
                .join(".cache/tokentap/models/tiny-qwen3-tools.gguf")
        });
    let llama = TokenModel::open(&path, EngineDialect::LlamaCpp).unwrap();
    let hf = model();
    let as_sent: ChatRequest = serde_json::from_value(json!({"model": "m",
        "messages": [{"role": "developer", "content": text("Be brief."), "content_was_string": true}, user("hi")],
        "tools": [{"name": "bash", "strict": false}]})).unwrap();
    let as_llama: ChatRequest = serde_json::from_value(json!({"model": "m",
        "messages": [{"role": "system", "content": text("Be brief."), "content_was_string": true}, user("hi")],
        "tools": [{"name": "bash", "description": "", "parameters": {}}]})).unwrap();
    assert_eq!(
        llama.prompt_text(&as_sent).unwrap(),
        hf.prompt_text(&as_llama).unwrap()
    );
    // transformers passes them as given: Qwen3's template skips a developer message.
    assert_ne!(
        hf.prompt_text(&as_sent).unwrap(),
        hf.prompt_text(&as_llama).unwrap()
    );
}
