//! tito on the real Qwen3 chat template and tokenizer (the tiny tool model's GGUF): prompts
//! built from the ids the engine saw and sampled, checked against the template's own full
//! render of the same conversation, and every branch cause.

use std::path::PathBuf;

use serde_json::json;
use tokentap_schema::{ChatMessage, ChatRequest, TitoBranchCause, TitoContinuation, TokenOrigin};
use tokentap_token_mode::{
    verify, EngineDialect, SampledEnd, Tito, TitoLimits, TitoPrompt, TokenModel,
};

fn model_at(var: &str, file: &str) -> TokenModel {
    let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var("HOME").unwrap())
            .join(".cache/tokentap/models")
            .join(file)
    });
    assert!(
        path.is_file(),
        "{} is missing: run scripts/setup and source ~/.cache/tokentap/env.sh",
        path.display()
    );
    TokenModel::open(&path, EngineDialect::Transformers).unwrap()
}

/// The session the single-conversation tests' calls belong to.
const S: Option<&str> = Some("sample-0");

fn tito() -> Tito {
    tito_with(TitoLimits::default())
}

fn tito_with(limits: TitoLimits) -> Tito {
    Tito::new(
        model_at("TOKENTAP_MODEL_TINY_TOOLS", "tiny-qwen3-tools.gguf"),
        limits,
    )
    .unwrap()
}

fn request(messages: Vec<serde_json::Value>) -> ChatRequest {
    request_with_tool(messages, "bash")
}

fn request_with_tool(messages: Vec<serde_json::Value>, tool: &str) -> ChatRequest {
    serde_json::from_value(json!({
        "model": "m",
        "messages": messages,
        "tools": [{"name": tool, "description": "Run a command",
                   "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}],
    }))
    .unwrap()
}

fn msg(role: &str, t: &str) -> serde_json::Value {
    json!({"role": role, "content": [{"type": "text", "text": t}], "content_was_string": true})
}

fn tool_result(t: &str) -> serde_json::Value {
    let mut m = msg("tool", t);
    m["tool_call_id"] = json!("call_1");
    m
}

/// The assistant turn as a harness sends it back.
fn assistant_call(arguments: &str, reasoning: Option<&str>) -> serde_json::Value {
    let mut m = json!({"role": "assistant",
        "tool_calls": [{"id": "call_1", "name": "bash", "arguments": arguments}]});
    if let Some(r) = reasoning {
        m["reasoning"] = json!(r);
    }
    m
}

fn message(v: serde_json::Value) -> ChatMessage {
    serde_json::from_value(v).unwrap()
}

/// What the model sampled for a call turn (reasoning as Qwen3 models write it), stop token
/// included.
const SAMPLED_CALL: &str = "<think>\nList it.\n</think>\n\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"pwd\"}}\n</tool_call><|im_end|>";

/// Answers call `prompt` with `sampled`, as the proxy does after the engine's answer.
fn answer(
    t: &Tito,
    r: &ChatRequest,
    p: &TitoPrompt,
    sampled: &str,
    end: SampledEnd,
    id: &str,
) -> Vec<u32> {
    answer_in(t, S, r, p, sampled, end, id)
}

/// [`answer`] for a call of `session`.
fn answer_in(
    t: &Tito,
    session: Option<&str>,
    r: &ChatRequest,
    p: &TitoPrompt,
    sampled: &str,
    end: SampledEnd,
    id: &str,
) -> Vec<u32> {
    let ids = t.model().tokenizer().encode(sampled).unwrap();
    let answer = message(assistant_call("{\"command\": \"pwd\"}", Some("List it.")));
    t.answered(session, r, p, &ids, end, &answer, id);
    ids
}

fn base() -> Vec<serde_json::Value> {
    vec![msg("system", "You are terse."), msg("user", "Where am I?")]
}

fn cause(p: &TitoPrompt) -> Option<TitoBranchCause> {
    match &p.continuation {
        TitoContinuation::Branch { cause, .. } => Some(*cause),
        TitoContinuation::Extends { .. } => None,
    }
}

#[test]
fn a_tool_result_extends_the_sampled_ids() {
    let t = tito();
    assert!(
        t.renders_short_suffix(),
        "Qwen3 writes new messages alike after a short stand-in"
    );
    let r1 = request(base());
    let p1 = t.prompt(S, &r1).unwrap();
    assert_eq!(cause(&p1), Some(TitoBranchCause::First));
    assert_eq!(
        p1.ids,
        t.model().prompt_ids(&r1).unwrap(),
        "a first call is the full render"
    );
    let sampled = answer(&t, &r1, &p1, SAMPLED_CALL, SampledEnd::StopToken, "r1");

    // The harness drops the reasoning and re-serializes the arguments: the same meaning.
    let mut messages = base();
    messages.push(assistant_call("{\"command\":\"pwd\"}", None));
    messages.push(tool_result("/home/agent"));
    let r2 = request(messages);
    let p2 = t.prompt(S, &r2).unwrap();
    let TitoContinuation::Extends {
        record_id,
        appended,
    } = &p2.continuation
    else {
        panic!("{:?}", p2.continuation)
    };
    assert_eq!(record_id, "r1");
    let mut earlier = p1.ids.clone();
    earlier.extend(&sampled);
    assert!(p2.ids.starts_with(&earlier), "the sampled ids, as sampled");
    assert_eq!(*appended as usize, p2.ids.len() - earlier.len());
    // What is appended is exactly what the template writes after the turn in a full render.
    let full = t.model().prompt_ids(&r2).unwrap();
    let new = &p2.ids[earlier.len()..];
    assert!(full.ends_with(new), "{:?}", t.model().text(new));
    assert_eq!(
        t.model().text(new),
        "\n<|im_start|>user\n<tool_response>\n/home/agent\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    );
    // The full render would have re-written the reasoning: tito did not.
    assert_ne!(full[..earlier.len()], earlier[..]);
    let origins: Vec<(TokenOrigin, u32)> = p2.origins.iter().map(|r| (r.origin, r.len)).collect();
    assert_eq!(
        origins,
        vec![
            (TokenOrigin::Rendered, p1.ids.len() as u32),
            (TokenOrigin::Sampled, sampled.len() as u32),
            (TokenOrigin::Rendered, new.len() as u32)
        ]
    );
}

#[test]
fn a_harness_that_sends_reasoning_back_extends_too() {
    let t = tito();
    let r1 = request(base());
    let p1 = t.prompt(S, &r1).unwrap();
    answer(&t, &r1, &p1, SAMPLED_CALL, SampledEnd::StopToken, "r1");
    let mut messages = base();
    messages.push(assistant_call("{\"command\": \"pwd\"}", Some("List it.")));
    messages.push(tool_result("/"));
    assert!(matches!(
        t.prompt(S, &request(messages)).unwrap().continuation,
        TitoContinuation::Extends { .. }
    ));
}

#[test]
fn a_new_user_turn_keeps_the_reasoning_the_template_would_drop() {
    let t = tito();
    let r1 = request(base());
    let p1 = t.prompt(S, &r1).unwrap();
    let s1 = answer(&t, &r1, &p1, SAMPLED_CALL, SampledEnd::StopToken, "r1");
    let mut messages = base();
    messages.push(assistant_call("{\"command\": \"pwd\"}", None));
    messages.push(tool_result("/"));
    let r2 = request(messages.clone());
    let p2 = t.prompt(S, &r2).unwrap();
    let done = t
        .model()
        .tokenizer()
        .encode("<think>\nDone.\n</think>\n\nYou are in /.<|im_end|>")
        .unwrap();
    t.answered(
        S,
        &r2,
        &p2,
        &done,
        SampledEnd::StopToken,
        &message(msg("assistant", "You are in /.")),
        "r2",
    );
    messages.push(msg("assistant", "You are in /."));
    messages.push(msg("user", "And the date?"));
    let r3 = request(messages);
    let p3 = t.prompt(S, &r3).unwrap();
    assert!(
        matches!(&p3.continuation, TitoContinuation::Extends { record_id, .. } if record_id == "r2")
    );
    let mut earlier = p2.ids.clone();
    earlier.extend(&done);
    assert!(p3.ids.starts_with(&earlier));
    assert!(
        p3.ids.windows(s1.len()).any(|w| w == &s1[..]),
        "the first turn's reasoning, as sampled"
    );
    // The template itself drops both turns' reasoning on the new user turn.
    let full_text = t.model().prompt_text(&r3).unwrap();
    assert!(!full_text.contains("List it."));
    assert_eq!(
        t.model().text(&p3.ids[earlier.len()..]),
        "\n<|im_start|>user\nAnd the date?<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn an_open_turn_gets_the_template_end_as_boundary() {
    // Stopped by a stop string (or cut off): no <|im_end|> sampled.
    let t = tito();
    let r1 = request(base());
    let p1 = t.prompt(S, &r1).unwrap();
    let open = SAMPLED_CALL.strip_suffix("<|im_end|>").unwrap();
    let sampled = answer(&t, &r1, &p1, open, SampledEnd::Open, "r1");
    let mut messages = base();
    messages.push(assistant_call("{\"command\": \"pwd\"}", None));
    messages.push(tool_result("/"));
    let p2 = t.prompt(S, &request(messages)).unwrap();
    assert!(matches!(p2.continuation, TitoContinuation::Extends { .. }));
    let after = &p2.ids[p1.ids.len() + sampled.len()..];
    assert_eq!(t.model().text(&after[..1]), "<|im_end|>");
    let origins: Vec<TokenOrigin> = p2.origins.iter().map(|r| r.origin).collect();
    assert_eq!(
        origins,
        vec![
            TokenOrigin::Rendered,
            TokenOrigin::Sampled,
            TokenOrigin::Boundary,
            TokenOrigin::Rendered
        ]
    );
    assert_eq!(p2.origins[2].len, 1);
}

/// A conversation of one answered call, then `change` applied to the next request.
fn branch_after(
    change: impl FnOnce(&mut Vec<serde_json::Value>) -> String,
) -> Option<TitoBranchCause> {
    let t = tito();
    let r1 = request(base());
    let p1 = t.prompt(S, &r1).unwrap();
    answer(&t, &r1, &p1, SAMPLED_CALL, SampledEnd::StopToken, "r1");
    let mut messages = base();
    messages.push(assistant_call("{\"command\": \"pwd\"}", None));
    messages.push(tool_result("/"));
    let tool = change(&mut messages);
    cause(&t.prompt(S, &request_with_tool(messages, &tool)).unwrap())
}

#[test]
fn each_branch_has_its_cause() {
    // Control: unchanged, it extends.
    assert_eq!(branch_after(|_| "bash".into()), None);
    assert_eq!(
        branch_after(|m| {
            m[1] = msg("user", "Where am I? Be brief.");
            "bash".into()
        }),
        // Another first user message, but the answer tokentap gave after it: edited (Qwen Code,
        // resumed, drops the date it had put there).
        Some(TitoBranchCause::Edited)
    );
    assert_eq!(
        branch_after(|m| {
            m[1] = msg(
                "user",
                "Summary of the work so far: the directory was listed.",
            );
            m[2] = assistant_call("{\"command\": \"ls\"}", None);
            "bash".into()
        }),
        // The same system prompt and tools over a history tokentap never answered.
        Some(TitoBranchCause::Compacted)
    );
    assert_eq!(
        branch_after(|m| {
            m[2] = assistant_call("{\"command\": \"ls\"}", None);
            "bash".into()
        }),
        Some(TitoBranchCause::Edited)
    );
    assert_eq!(
        branch_after(|m| {
            m[0] = msg("system", "You are verbose.");
            "bash".into()
        }),
        Some(TitoBranchCause::NewSystem)
    );
    assert_eq!(
        branch_after(|_| "shell".into()),
        Some(TitoBranchCause::ToolsChanged)
    );
    assert_eq!(
        branch_after(|m| {
            m.pop();
            "bash".into()
        }),
        Some(TitoBranchCause::NoNewMessage)
    );
}

#[test]
fn a_restart_branches_without_corrupting() {
    let mut messages = base();
    messages.push(assistant_call("{\"command\": \"pwd\"}", None));
    messages.push(tool_result("/"));
    let t = tito();
    let r = request(messages);
    let p = t.prompt(S, &r).unwrap();
    assert_eq!(cause(&p), Some(TitoBranchCause::UnknownHistory));
    assert_eq!(p.ids, t.model().prompt_ids(&r).unwrap());
}

#[test]
fn concurrent_conversations_each_extend() {
    let t = tito();
    let sub = vec![
        msg("system", "You are a subagent."),
        msg("user", "Count files."),
    ];
    let (ra, rb) = (request(base()), request(sub.clone()));
    let (pa, pb) = (t.prompt(S, &ra).unwrap(), t.prompt(S, &rb).unwrap());
    answer(&t, &rb, &pb, SAMPLED_CALL, SampledEnd::StopToken, "b1");
    answer(&t, &ra, &pa, SAMPLED_CALL, SampledEnd::StopToken, "a1");
    for (mut messages, id) in [(sub, "b1"), (base(), "a1")] {
        messages.push(assistant_call("{\"command\": \"pwd\"}", None));
        messages.push(tool_result("/"));
        let p = t.prompt(S, &request(messages)).unwrap();
        assert!(
            matches!(&p.continuation, TitoContinuation::Extends { record_id, .. } if record_id == id)
        );
    }
}

#[test]
fn state_is_bounded() {
    let t = tito_with(TitoLimits {
        tips: 2,
        held_tokens: 1 << 20,
        ..TitoLimits::default()
    });
    for i in 0..5 {
        let r = request(vec![msg("user", &format!("question {i}"))]);
        let p = t.prompt(S, &r).unwrap();
        answer(
            &t,
            &r,
            &p,
            SAMPLED_CALL,
            SampledEnd::StopToken,
            &format!("r{i}"),
        );
    }
    assert_eq!(t.held().0, 2);
    // The oldest is gone: its next call branches; the newest still extends.
    let next = |i: usize| {
        let r = request(vec![
            msg("user", &format!("question {i}")),
            assistant_call("{\"command\": \"pwd\"}", None),
            tool_result("/"),
        ]);
        t.prompt(S, &r).unwrap().continuation
    };
    assert!(matches!(next(0), TitoContinuation::Branch { .. }));
    assert!(matches!(next(4), TitoContinuation::Extends { .. }));
    let few = tito_with(TitoLimits {
        tips: 100,
        held_tokens: 300,
        ..TitoLimits::default()
    });
    for i in 0..5 {
        let r = request(vec![msg("user", &format!("question {i}"))]);
        let p = few.prompt(S, &r).unwrap();
        answer(
            &few,
            &r,
            &p,
            SAMPLED_CALL,
            SampledEnd::StopToken,
            &format!("r{i}"),
        );
    }
    assert!(few.held().1 <= 300, "{:?}", few.held());
}

#[test]
fn a_model_whose_calls_no_parser_reads_is_refused() {
    // SmolLM2's template writes no tool calls.
    let smol = model_at("TOKENTAP_MODEL_TINY", "tiny-smollm2.gguf");
    let err = Tito::new(smol, TitoLimits::default()).unwrap_err();
    assert!(err.contains("no parser reads the tool calls"), "{err}");
}

#[test]
fn the_requests_template_kwargs_shape_the_appended_generation_prompt() {
    let t = tito();
    let with_kwargs = |messages: Vec<serde_json::Value>| {
        let mut r = request(messages);
        r.extra.insert(
            "chat_template_kwargs".into(),
            json!({"enable_thinking": false}),
        );
        r
    };
    let r1 = with_kwargs(base());
    let p1 = t.prompt(S, &r1).unwrap();
    assert!(
        t.model().text(&p1.ids).ends_with("<think>\n\n</think>\n\n"),
        "the control: a full render"
    );
    answer(&t, &r1, &p1, SAMPLED_CALL, SampledEnd::StopToken, "r1");
    let mut messages = base();
    messages.push(assistant_call("{\"command\": \"pwd\"}", None));
    messages.push(tool_result("/"));
    let r2 = with_kwargs(messages);
    let p2 = t.prompt(S, &r2).unwrap();
    assert!(matches!(p2.continuation, TitoContinuation::Extends { .. }));
    assert!(t
        .model()
        .text(&p2.ids)
        .ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    let full = t.model().prompt_ids(&r2).unwrap();
    let new = &p2.ids[p1.ids.len()..];
    assert!(full.ends_with(&new[new.len() - 20..]));
}

/// `--token-verify`: the full render against tito's ids. Where the harness dropped the
/// reasoning tito keeps, the difference lies inside sampled tokens (content drift, expected);
/// a frame token tito wrote differently is boundary drift (the positive control: one
/// `<|im_start|>` of the render's frame swapped for `<|im_end|>`).
#[test]
fn token_verify_tells_kept_reasoning_from_a_frame_written_differently() {
    let t = tito();
    let r1 = request(base());
    let p1 = t.prompt(S, &r1).unwrap();
    let v1 = verify(t.model(), &r1, &p1.ids, &p1.origins).unwrap();
    assert_eq!(
        (v1.content_spans, v1.boundary_spans),
        (0, 0),
        "a first call is the full render"
    );
    answer(&t, &r1, &p1, SAMPLED_CALL, SampledEnd::StopToken, "r1");
    let mut m2 = base();
    m2.push(assistant_call("{\"command\": \"pwd\"}", None));
    m2.push(tool_result("/work"));
    let r2 = request(m2);
    let p2 = t.prompt(S, &r2).unwrap();
    assert_eq!(cause(&p2), None, "extends");
    let v2 = verify(t.model(), &r2, &p2.ids, &p2.origins).unwrap();
    assert!(v2.content_spans >= 1, "{v2:?}");
    assert_eq!(v2.boundary_spans, 0, "{v2:?}");
    assert_eq!(
        v2.rendered_tokens as usize,
        t.model().prompt_ids(&r2).unwrap().len()
    );

    let tokenizer = t.model().tokenizer();
    let (start, end) = (
        tokenizer.encode("<|im_start|>").unwrap()[0],
        tokenizer.encode("<|im_end|>").unwrap()[0],
    );
    let mut bad = p2.ids.clone();
    let at = bad.iter().rposition(|id| *id == start).unwrap();
    bad[at] = end;
    let v = verify(t.model(), &r2, &bad, &p2.origins).unwrap();
    assert!(v.boundary_spans >= 1, "{v:?}");
    assert_eq!(
        v.examples[0].cause,
        tokentap_schema::DriftCause::BoundaryToken
    );
}

/// The start-up probe's report on Qwen3's template: every append tito needs works, each
/// renders alone after a stand-in, and the template drops an earlier turn's reasoning.
#[test]
fn the_start_up_probe_reports_each_construct() {
    let t = tito();
    assert_eq!(
        t.probe_report(),
        [
            "a tool result after an answered call: appends; renders alone after a short stand-in",
            "two tool results after an answered call: appends; renders alone after a short stand-in",
            "a user message after an answered call: appends; renders alone after a short stand-in",
            "an earlier turn's reasoning: the template drops it (text mode re-renders those turns; tito keeps the sampled ids)",
        ]
    );
}

/// What two samples of one GRPO group often do: the same first call, answered with the same
/// tool call but different reasoning. Each sample's second prompt is its own first prompt and
/// its own sampled ids (its own reasoning, never the other's), extending its own record. The
/// positive control: the same calls in one session (what every call shared before state was
/// kept per session) make the earlier-answered sample extend the other's tip.
#[test]
fn a_session_extends_only_its_own_sampled_ids() {
    let sampled = |secret: &str| {
        format!("<think>\n{secret}\n</think>\n\n<tool_call>\n{{\"name\": \"bash\", \"arguments\": {{\"command\": \"pwd\"}}}}\n</tool_call><|im_end|>")
    };
    let second = || {
        let mut messages = base();
        messages.push(assistant_call("{\"command\": \"pwd\"}", None));
        messages.push(tool_result("/"));
        request(messages)
    };
    let run = |sessions: [Option<&str>; 2]| {
        let t = tito();
        let first = request(base());
        let (p0, p1) = (
            t.prompt(sessions[0], &first).unwrap(),
            t.prompt(sessions[1], &first).unwrap(),
        );
        let tokens = |s: &str| t.model().tokenizer().encode(s).unwrap();
        let (ids0, ids1) = (
            tokens(&sampled("SECRET-100")),
            tokens(&sampled("SECRET-101")),
        );
        // Sample 0 is answered first, sample 1 last.
        for (session, p, ids, id) in [
            (sessions[0], &p0, &ids0, "s0-1"),
            (sessions[1], &p1, &ids1, "s1-1"),
        ] {
            let answer = message(assistant_call("{\"command\": \"pwd\"}", None));
            t.answered(session, &first, p, ids, SampledEnd::StopToken, &answer, id);
        }
        let next0 = t.prompt(sessions[0], &second()).unwrap();
        let text = t.model().text(&next0.ids);
        (next0, text, [p0, p1], [ids0, ids1])
    };

    let (next0, text, [p0, _], [ids0, _]) = run([Some("sample-0"), Some("sample-1")]);
    assert!(
        matches!(&next0.continuation, TitoContinuation::Extends { record_id, .. } if record_id == "s0-1"),
        "{:?}",
        next0.continuation
    );
    assert!(
        text.contains("SECRET-100") && !text.contains("SECRET-101"),
        "{text}"
    );
    let own: Vec<u32> = p0.ids.iter().chain(&ids0).copied().collect();
    assert_eq!(
        &next0.ids[..own.len()],
        &own[..],
        "its own prompt and sampled ids first"
    );
    let sampled_run = next0
        .origins
        .iter()
        .find(|r| r.origin == TokenOrigin::Sampled)
        .unwrap();
    assert_eq!(
        sampled_run.len as usize,
        ids0.len(),
        "only its own ids are labelled sampled"
    );

    // Positive control: one shared scope, and sample 0's context is sample 1's reasoning.
    let (shared, text, ..) = run([Some("shared"), Some("shared")]);
    assert!(
        matches!(&shared.continuation, TitoContinuation::Extends { record_id, .. } if record_id == "s1-1"),
        "{:?}",
        shared.continuation
    );
    assert!(text.contains("SECRET-101"), "{text}");
}

/// A session that was never answered sends the visible conversation of another's: it gets a
/// full render of what it sent (no hidden reasoning of anyone's), and so does its token count.
#[test]
fn a_session_never_answered_gets_a_fresh_render() {
    let t = tito();
    let first = request(base());
    let p = t.prompt(Some("victim"), &first).unwrap();
    let ids = t
        .model()
        .tokenizer()
        .encode(&SAMPLED_CALL.replace("List it.", "SECRET-7"))
        .unwrap();
    let answer = message(assistant_call("{\"command\": \"pwd\"}", None));
    t.answered(
        Some("victim"),
        &first,
        &p,
        &ids,
        SampledEnd::StopToken,
        &answer,
        "v1",
    );
    let mut messages = base();
    messages.push(assistant_call("{\"command\": \"pwd\"}", None));
    messages.push(tool_result("/"));
    let guess = request(messages);
    for session in [Some("attacker"), None] {
        let p = t.prompt(session, &guess).unwrap();
        assert_eq!(
            cause(&p),
            Some(TitoBranchCause::UnknownHistory),
            "{session:?}"
        );
        assert_eq!(p.ids, t.model().prompt_ids(&guess).unwrap());
        assert!(!t.model().text(&p.ids).contains("SECRET-7"));
    }
    // The victim itself extends.
    let own = t.prompt(Some("victim"), &guess).unwrap();
    assert!(t.model().text(&own.ids).contains("SECRET-7"));
}

/// One session making 4,096 calls evicts only its own conversations: another session's only
/// tip is still extended, and the flooding session stays within its own bound. With one shared
/// bound (the positive control: every call in one session), the victim's tip is gone and its
/// next call branches.
#[test]
fn one_sessions_flood_leaves_another_sessions_tip() {
    let flood = |attacker: Option<&str>| {
        let t = tito_with(TitoLimits {
            tips: 512,
            session_tips: 64,
            ..TitoLimits::default()
        });
        let first = request(base());
        let p = t.prompt(Some("victim"), &first).unwrap();
        answer_in(
            &t,
            Some("victim"),
            &first,
            &p,
            SAMPLED_CALL,
            SampledEnd::StopToken,
            "v1",
        );
        for i in 0..4096 {
            let r = request(vec![msg("user", &format!("q{i}"))]);
            let p = t.prompt(attacker, &r).unwrap();
            // Tiny answers, as an attacker would send: the count bound binds first.
            let ids = t.model().tokenizer().encode("ok<|im_end|>").unwrap();
            let a = message(msg("assistant", "ok"));
            t.answered(
                attacker,
                &r,
                &p,
                &ids,
                SampledEnd::StopToken,
                &a,
                &format!("a{i}"),
            );
        }
        let mut messages = base();
        messages.push(assistant_call("{\"command\": \"pwd\"}", None));
        messages.push(tool_result("/"));
        let next = t.prompt(Some("victim"), &request(messages)).unwrap();
        (next.continuation, t.held_by("attacker").0, t.held().0)
    };
    let (victim, attacker_tips, all) = flood(Some("attacker"));
    assert!(
        matches!(victim, TitoContinuation::Extends { .. }),
        "{victim:?}"
    );
    assert_eq!(attacker_tips, 64, "the flood keeps at most its own bound");
    assert!(all <= 512);
    let (victim, ..) = flood(Some("victim"));
    assert!(
        matches!(victim, TitoContinuation::Branch { .. }),
        "positive control: {victim:?}"
    );
}

/// Past the global bound, the session holding most gives up tips first, and a session's only
/// conversation goes only when every session is down to one (the least recently answered).
#[test]
fn the_global_bound_takes_from_the_largest_session() {
    let t = tito_with(TitoLimits {
        tips: 6,
        session_tips: 100,
        ..TitoLimits::default()
    });
    let call = |session: &str, q: &str| {
        let r = request(vec![msg("user", q)]);
        let p = t.prompt(Some(session), &r).unwrap();
        answer_in(
            &t,
            Some(session),
            &r,
            &p,
            SAMPLED_CALL,
            SampledEnd::StopToken,
            q,
        );
    };
    call("small", "only one");
    for i in 0..10 {
        call("big", &format!("big {i}"));
    }
    assert_eq!(t.held_by("small").0, 1, "its only tip is kept");
    assert_eq!(t.held_by("big").0, 5);
    for i in 0..4 {
        call(&format!("one-{i}"), "q");
    }
    assert_eq!(t.held().0, 6);
    assert_eq!(
        t.held_by("big").0,
        1,
        "the large session gave up all but one first"
    );
    assert_eq!(t.held_by("small").0, 1);
    // Every session down to one: the least recently answered goes.
    call("one-4", "q");
    assert_eq!(t.held_by("small").0, 0);
    assert_eq!(t.held_by("big").0, 1);
    assert_eq!(t.held().0, 6);
}
