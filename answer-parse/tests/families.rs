//! Each family's answers as its models sample them, read whole and in every cut: byte by byte
//! and at every single split point. The samples follow each family's own template (see
//! `probe_templates.rs` for the templates themselves).

use serde_json::{json, Value};
use tokentap_answer_parse::{Answer, AnswerParser, Delta, Dialect, Family, ToolCall, ToolSchemas};

fn schemas() -> ToolSchemas {
    ToolSchemas::from_tools(&tokentap_answer_parse::probe_tools())
}

/// The answer read whole, checked to be the same read byte by byte (char by char) and split
/// in two at every char boundary.
fn read(dialect: Dialect, text: &str) -> Answer {
    let whole = AnswerParser::parse_whole(dialect, schemas(), text);
    let mut parser = AnswerParser::new(dialect, schemas());
    let mut deltas = Vec::new();
    for c in text.chars() {
        deltas.extend(parser.push(&c.to_string()));
    }
    deltas.extend(parser.finish());
    assert_eq!(
        Answer::from_deltas(&deltas),
        whole,
        "char by char: {text:?}"
    );
    for (at, _) in text.char_indices().skip(1) {
        let mut parser = AnswerParser::new(dialect, schemas());
        let mut deltas = parser.push(&text[..at]);
        deltas.extend(parser.push(&text[at..]));
        deltas.extend(parser.finish());
        assert_eq!(
            Answer::from_deltas(&deltas),
            whole,
            "split at {at}: {text:?}"
        );
    }
    whole
}

fn call(name: &str, args: Value) -> (String, Value) {
    (name.to_string(), args)
}

fn calls(answer: &Answer) -> Vec<(String, Value)> {
    answer
        .tool_calls
        .iter()
        .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
        .collect()
}

fn qwen3() -> Dialect {
    Dialect::new(Family::Hermes).with_reasoning_after("<|im_start|>assistant\n")
}

#[test]
fn hermes_reasoning_content_and_two_calls() {
    let text = "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
    let got = read(qwen3(), text);
    assert_eq!(got.reasoning, "\nThe user wants weather.\n");
    assert_eq!(got.content, "Let me check.");
    assert_eq!(
        calls(&got),
        vec![
            call("get_weather", json!({"city": "Paris", "days": 3})),
            call("get_weather", json!({"city": "Oslo"}))
        ]
    );
    // The arguments are the model's own text, byte for byte.
    assert_eq!(
        got.tool_calls[0].arguments,
        r#"{"city": "Paris", "days": 3}"#
    );
}

#[test]
fn the_think_model_of_the_harness_tests() {
    // tiny-qwen3-think.gguf's turn, as llama-server samples it.
    let text = "<think>Check</think>\n\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"pwd\"}}\n</tool_call>";
    let got = read(qwen3(), text);
    assert_eq!(got.reasoning, "Check");
    assert_eq!(got.content, "");
    assert_eq!(calls(&got), vec![call("bash", json!({"command": "pwd"}))]);
    assert_eq!(
        read(qwen3(), "<think>Check</think>\n\nDone.").content,
        "Done."
    );
}

#[test]
fn markers_inside_content_and_reasoning_are_text() {
    let got = read(
        qwen3(),
        "<think>I could write <tool_call> here</think>The tag is <tool",
    );
    assert_eq!(got.reasoning, "I could write <tool_call> here");
    assert_eq!(got.content, "The tag is <tool");
    // <think> only opens the answer; later it is content.
    let got = read(qwen3(), "Hello <think>x</think>");
    assert_eq!(
        (got.reasoning.as_str(), got.content.as_str()),
        ("", "Hello <think>x</think>")
    );
    // Without reasoning in the dialect, <think> is content too.
    let got = read(Dialect::new(Family::Hermes), "<think>x</think>y");
    assert_eq!(got.content, "<think>x</think>y");
}

#[test]
fn a_generation_prompt_that_opened_the_reasoning() {
    let dialect = Dialect::new(Family::DeepSeekV3).with_reasoning_after("<｜Assistant｜><think>\n");
    assert!(dialect.starts_in_reasoning);
    let got = read(dialect, "Thinking.\n</think>\n\nThe answer.");
    assert_eq!(
        (got.reasoning.as_str(), got.content.as_str()),
        ("Thinking.\n", "The answer.")
    );
    // A prompt whose last block is closed (thinking off) does not.
    assert!(
        !Dialect::new(Family::Hermes)
            .with_reasoning_after("<|im_start|>assistant\n<think>\n\n</think>\n\n")
            .starts_in_reasoning
    );
}

#[test]
fn a_cut_off_answer_keeps_what_was_sampled() {
    // Length cut-off inside the reasoning, and inside a call.
    let got = read(qwen3(), "<think>Still thinking");
    assert_eq!(
        (got.reasoning.as_str(), got.content.as_str()),
        ("Still thinking", "")
    );
    let text = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"argu";
    let got = read(qwen3(), text);
    assert!(got.tool_calls.is_empty());
    assert_eq!(
        got.content,
        "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"argu"
    );
}

#[test]
fn a_call_that_does_not_read_stays_text() {
    let text = "<tool_call>\n{\"name\": get_weather}\n</tool_call>";
    let got = read(qwen3(), text);
    assert!(got.tool_calls.is_empty());
    assert_eq!(got.content, text);
    // Arguments that are not an object.
    let got = read(
        qwen3(),
        "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>",
    );
    assert!(got.tool_calls.is_empty());
    // String arguments holding an object (OpenAI's shape written with tojson) are unwrapped.
    let got = read(
        qwen3(),
        "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}\n</tool_call>",
    );
    assert_eq!(calls(&got), vec![call("f", json!({"a": 1}))]);
}

#[test]
fn text_after_the_calls_is_content() {
    let got = read(
        qwen3(),
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n\nDone",
    );
    assert_eq!(calls(&got), vec![call("f", json!({}))]);
    assert_eq!(got.content, "Done");
}

#[test]
fn qwen3_coder_parameters_by_declared_type() {
    let text = "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n</tool_call>";
    let got = read(Dialect::new(Family::Qwen3Coder), text);
    assert_eq!(got.content, "I will look.");
    // `days` is declared an integer, `city` a string (even when it looks like a number).
    assert_eq!(
        calls(&got),
        vec![
            call("get_weather", json!({"city": "New York", "days": 3})),
            call("get_weather", json!({"city": "42"}))
        ]
    );
    // An undeclared tool's parameters are text; multi-line values keep their inner newlines.
    let got = read(
        Dialect::new(Family::Qwen3Coder),
        "<tool_call>\n<function=write>\n<parameter=body>\nline 1\nline 2\n</parameter>\n</function>\n</tool_call>",
    );
    assert_eq!(
        calls(&got),
        vec![call("write", json!({"body": "line 1\nline 2"}))]
    );
}

#[test]
fn glm45_arg_pairs_with_and_without_newlines() {
    let dialect = Dialect::new(Family::Glm45).with_reasoning_after("<|assistant|>");
    let text = "<think>Need weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>";
    let got = read(dialect, text);
    assert_eq!(got.reasoning, "Need weather.");
    assert_eq!(
        calls(&got),
        vec![
            call("get_weather", json!({"city": "Paris", "days": 2})),
            call("get_weather", json!({"city": "Rome"}))
        ]
    );
    // A call without arguments.
    let got = read(dialect, "<tool_call>list_files</tool_call>");
    assert_eq!(calls(&got), vec![call("list_files", json!({}))]);
}

#[test]
fn deepseek_v3_and_v3_1_calls() {
    let dialect = Dialect::new(Family::DeepSeekV3);
    let v3 = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Lima\", \"days\": 5}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    let got = read(dialect, v3);
    assert_eq!(got.content, "Checking.");
    assert_eq!(
        calls(&got),
        vec![
            call("get_weather", json!({"city": "Paris"})),
            call("get_weather", json!({"city": "Lima", "days": 5}))
        ]
    );
    let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    assert_eq!(
        calls(&read(dialect, v31)),
        vec![call("get_weather", json!({"city": "Oslo"}))]
    );
}

#[test]
fn llama3_json_calls_and_plain_answers() {
    let dialect = Dialect::new(Family::Llama3Json);
    let got = read(
        dialect,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
    );
    assert_eq!(
        calls(&got),
        vec![call("get_weather", json!({"city": "Paris"}))]
    );
    let got = read(
        dialect,
        "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}",
    );
    assert_eq!(
        calls(&got),
        vec![call("a", json!({})), call("b", json!({"x": 1}))]
    );
    // A JSON answer that is not a call is content, as sampled.
    let text = "{\"answer\": 42}";
    let got = read(dialect, text);
    assert_eq!((got.content.as_str(), got.tool_calls.len()), (text, 0));
    // Prose streams as it comes.
    let mut parser = AnswerParser::new(dialect, schemas());
    assert_eq!(parser.push("Hello"), vec![Delta::Content("Hello".into())]);
}

#[test]
fn content_streams_while_markers_are_held() {
    let mut parser = AnswerParser::new(qwen3(), schemas());
    assert_eq!(parser.push("<thi"), vec![]);
    assert_eq!(parser.push("nk>Hm"), vec![Delta::Reasoning("Hm".into())]);
    assert_eq!(parser.push("m</th"), vec![Delta::Reasoning("m".into())]);
    assert_eq!(parser.push("ink>\n\nOK"), vec![Delta::Content("OK".into())]);
    assert_eq!(
        parser.push(" then\n<tool_c"),
        vec![Delta::Content(" then".into())]
    );
    assert_eq!(parser.held(), "\n<tool_c".len());
    assert_eq!(
        parser.push("all>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),
        vec![Delta::ToolCall(ToolCall {
            name: "f".into(),
            arguments: "{}".into()
        })]
    );
    assert_eq!(parser.finish(), vec![]);
}

#[test]
fn a_call_longer_than_the_limit_is_text() {
    let body = format!(
        "{{\"name\": \"f\", \"arguments\": {{\"x\": \"{}\"}}}}",
        "a".repeat(200)
    );
    let text = format!("<tool_call>\n{body}\n</tool_call>");
    let limited = |chunks: &[&str]| {
        let mut parser = AnswerParser::new(qwen3(), schemas()).with_max_call_bytes(100);
        let mut deltas: Vec<Delta> = chunks.iter().flat_map(|c| parser.push(c)).collect();
        deltas.extend(parser.finish());
        Answer::from_deltas(&deltas)
    };
    let whole = limited(&[&text]);
    assert!(whole.tool_calls.is_empty());
    assert_eq!(whole.content, text);
    let bytes: Vec<String> = text.chars().map(String::from).collect();
    let refs: Vec<&str> = bytes.iter().map(String::as_str).collect();
    assert_eq!(limited(&refs), whole);
}

/// vLLM's qwen3 reasoning parser leaves `"\n\n"` after `</think>` in the content (its answers in
/// `../shared/reference/vllm-0.32-cpu/responses/`: `"\n\nDone."` whole, a `"\n\n"` delta then
/// `"Done"`, `"."` streamed), and with a call after it the content is none (the hermes parser's
/// text before `<tool_call>`, whitespace only). llama.cpp's parser drops it: the default.
#[test]
fn the_space_after_reasoning_stays_in_the_content_for_an_engine_that_keeps_it() {
    let think = |keep: bool, chunks: &[&str]| {
        let mut parser = AnswerParser::new(qwen3(), schemas()).keeping_space_after_reasoning(keep);
        let mut deltas: Vec<Delta> = chunks.iter().flat_map(|c| parser.push(c)).collect();
        deltas.extend(parser.finish());
        Answer::from_deltas(&deltas)
    };
    let text = ["<think>", "Check", "</think>", "\n\n", "Done", "."];
    assert_eq!(think(true, &text).content, "\n\nDone.");
    assert_eq!(think(true, &[&text.concat()]).content, "\n\nDone.");
    // The control: llama.cpp's convention.
    assert_eq!(think(false, &text).content, "Done.");
    let call = [
        "<think>",
        "Check",
        "</think>",
        "\n\n",
        "<tool_call>",
        "\n",
        "{\"name\": \"f\", \"arguments\": {}}\n",
        "</tool_call>",
    ];
    for keep in [true, false] {
        let answer = think(keep, &call);
        assert_eq!(answer.content, "", "keep {keep}");
        assert_eq!(answer.reasoning, "Check");
        assert_eq!(answer.tool_calls.len(), 1);
    }
}
