"""Everything tokentap writes, checked against the providers' own client types.

Run by the e2e test `sdk_types` (tests/tests/e2e/sdk_types.rs) against tokentap on loopback in
front of the scripted engine double, whose answer a `scenario:NAME` marker in the user's message
picks (see SCENARIOS there):

    python tests/sdk/validate.py --base http://127.0.0.1:PORT

For each wire API (Chat Completions, Responses, Messages) and each scenario (text, reasoning,
tool calls, a length cut, a content-filter stop, an engine failure mid-stream, a context
overflow) it:

1. fetches the whole answer and the raw SSE stream, and validates every object and every event
   with the SDK's pydantic model (`openai` ChatCompletion / ChatCompletionChunk / Response /
   ResponseStreamEvent, `anthropic` Message / RawMessageStreamEvent, the error bodies), in
   pydantic's strict mode (no type coercion);
2. holds every object strict on fields too: the SDKs' models accept unknown fields
   (`extra="allow"`), so a misspelled field would pass them; here any field the SDK model does
   not declare is a failure, except tokentap's documented extensions (EXTENSIONS);
3. checks the providers' documented event order (a grammar per API), indices, ids and sequence
   numbers, and the values that must agree (usage, echoed request values, `message_start`'s
   prompt count);
4. runs the SDKs' own streaming helpers (`client.chat.completions.stream`,
   `client.responses.stream`, `client.messages.stream`) and whole calls over the same answers:
   they fail on a missing or malformed event, and their accumulated answer must equal the whole
   one.

Every failure is collected; the report (JSON on stdout) lists them all, and the exit status is 1
if there is any.
"""

import argparse
import json
import sys
import traceback
import typing

import anthropic
import openai
import pydantic

try:  # the HTTP client the SDKs themselves use (httpx2 in the pinned versions)
    import httpx2 as httpx
except ImportError:
    import httpx
from anthropic.types import ErrorResponse as AnthropicErrorResponse
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.shared import ErrorObject as OpenAIErrorObject

# Fields tokentap writes that the SDK models do not declare, on purpose: (model class, field).
EXTENSIONS = {
    # Chat Completions has no reasoning field; tokentap writes reasoning where vLLM, SGLang,
    # llama.cpp and DeepSeek put it, and clients of reasoning models read it there.
    ("ChoiceDelta", "reasoning_content"),
    ("ChatCompletionMessage", "reasoning_content"),
    # OpenAI's Response objects carry `store` (its API reference shows it) although the SDK's
    # Response model does not declare it.
    ("Response", "store"),
}


def by_type(union):
    """The models of a discriminated union of events, by their `type` literal."""
    models = {}
    for m in typing.get_args(typing.get_args(union)[0]):
        models[typing.get_args(m.model_fields["type"].annotation)[0]] = m
    return models


# Each event is validated by the model its `type` names (as the SDKs pick it), so that a
# failure names that model's fields rather than every member of the union.
STREAM_EVENT = by_type(ResponseStreamEvent)
MESSAGE_EVENT = by_type(RawMessageStreamEvent)

TOOL_ARGS = [{"command": "ls -la", "timeout": 5}, {"path": "README.md", "lines": [1, 2]}]

# scenario -> what the engine double answers (mirrors sdk_types.rs).
SCENARIOS = ["text", "reasoning", "tools", "length", "filter", "error", "overflow"]
# The ones that end normally (the SDK helpers run on these).
ANSWERED = ["text", "reasoning", "tools", "length", "filter"]


class Report:
    def __init__(self):
        self.failures = []
        self.checks = 0
        self.validated = {}

    def fail(self, where, what):
        self.failures.append(f"{where}: {what}")

    def check(self, where, cond, what):
        self.checks += 1
        if not cond:
            self.fail(where, what)
        return cond

    def count(self, model_name):
        self.validated[model_name] = self.validated.get(model_name, 0) + 1


def undeclared(obj, path="$"):
    """Fields present on `obj` (a validated model) that its model classes do not declare."""
    found = []
    if isinstance(obj, pydantic.BaseModel):
        for k in obj.model_extra or {}:
            if (type(obj).__name__, k) not in EXTENSIONS:
                found.append(f"{path}.{k} (not a field of {type(obj).__name__})")
        for name in type(obj).model_fields:
            found += undeclared(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found += undeclared(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found += undeclared(v, f"{path}.{k}")
    return found


def validate(report, where, model, obj):
    """`obj` validated strictly by `model` (a model class, or a dict of them by `type`), or None."""
    if isinstance(model, dict):
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind not in model:
            report.fail(where, f"no event of the SDK has type {kind!r}")
            return None
        model = model[kind]
    try:
        m = model.model_validate(obj, strict=True)
    except pydantic.ValidationError as e:
        report.fail(where, f"the SDK type rejects it: {e}\n    object: {json.dumps(obj)[:600]}")
        return None
    report.count(type(m).__name__)
    extra = undeclared(m)
    report.check(where, not extra, f"fields the SDK type does not declare: {extra}")
    return m


def sse_frames(text):
    """(event name or None, data text) of each SSE frame."""
    frames = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith(":"):
                continue
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
        frames.append((event, "\n".join(data)))
    return frames


# ---------------------------------------------------------------------------------------------
# requests


def scenario_text(name):
    return f"scenario:{name} Be brief."


def chat_tools():
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": "Run it.",
                "parameters": {"type": "object", "properties": {}, "additionalProperties": True},
                "strict": True,
            },
        }
        for name in ("shell", "read")
    ]


def chat_request(name, stream):
    r = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": scenario_text(name)},
        ],
        "tools": chat_tools(),
        "max_tokens": 256,
    }
    if stream:
        r["stream"] = True
        r["stream_options"] = {"include_usage": True}
    return r


RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": name,
        "description": "Run it.",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": True},
        "strict": False,
    }
    for name in ("shell", "read")
]

# What a Response object must echo of the request (OpenAI echoes the request's values).
RESPONSES_ECHO = {
    "instructions": "You are terse.",
    "max_output_tokens": 256,
    "temperature": 0.5,
    "top_p": 0.9,
    "tools": RESPONSES_TOOLS,
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"effort": "low", "summary": "auto"},
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "metadata": {"run": "sdk-validate"},
    "store": False,
}


def responses_request(name, stream):
    r = {"model": "m", "input": [{"role": "user", "content": scenario_text(name)}], **RESPONSES_ECHO}
    if stream:
        r["stream"] = True
    return r


MESSAGES_TOOLS = [
    {"name": name, "description": "Run it.", "input_schema": {"type": "object", "properties": {}}}
    for name in ("shell", "read")
]


def messages_request(name, stream):
    r = {
        "model": "m",
        "max_tokens": 256,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": scenario_text(name)}],
        "tools": MESSAGES_TOOLS,
    }
    if stream:
        r["stream"] = True
    return r


ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "sk-ant-sdk"}


# ---------------------------------------------------------------------------------------------
# Chat Completions


def check_chat(report, http, name):
    where = f"chat/{name}"
    whole_resp = http.post("/v1/chat/completions", json=chat_request(name, False))
    body = whole_resp.json()
    if name in ("error", "overflow"):
        report.check(f"{where}/whole", whole_resp.status_code >= 400, f"status {whole_resp.status_code}")
        validate(report, f"{where}/whole error", OpenAIErrorObject, body.get("error"))
        report.check(f"{where}/whole", set(body) == {"error"}, f"error body keys {sorted(body)}")
    else:
        report.check(f"{where}/whole", whole_resp.status_code == 200, f"status {whole_resp.status_code}: {body}")
        whole = validate(report, f"{where}/whole", ChatCompletion, body)
        if whole:
            report.check(f"{where}/whole", whole.usage is not None, "no usage")
            expect_finish = {"length": "length", "filter": "content_filter", "tools": "tool_calls"}.get(name, "stop")
            report.check(f"{where}/whole", whole.choices[0].finish_reason == expect_finish,
                         f"finish_reason {whole.choices[0].finish_reason} (expected {expect_finish})")

    with http.stream("POST", "/v1/chat/completions", json=chat_request(name, True)) as r:
        status, text = r.status_code, r.read().decode()
    if name == "overflow":
        report.check(f"{where}/stream", status == 400, f"status {status}")
        return
    report.check(f"{where}/stream", status == 200, f"status {status}: {text[:300]}")
    frames = sse_frames(text)
    report.check(f"{where}/stream", frames and frames[-1][1] == "[DONE]", "the stream does not end with [DONE]")
    chunks = [json.loads(d) for _, d in frames if d != "[DONE]"]
    if name == "error":
        report.check(f"{where}/stream", "error" in chunks[-1], "the last frame before [DONE] is not an error")
        validate(report, f"{where}/stream error", OpenAIErrorObject, chunks[-1].get("error"))
        chunks = chunks[:-1]
    content, reasoning, calls, finish, usage = "", "", {}, None, None
    for i, c in enumerate(chunks):
        m = validate(report, f"{where}/stream chunk {i}", ChatCompletionChunk, c)
        if not m:
            continue
        if i == 0:
            report.check(f"{where}/stream", m.choices and m.choices[0].delta.role == "assistant",
                         "the first chunk does not carry the role")
        if m.usage is not None:
            report.check(f"{where}/stream", m.choices == [], "the usage chunk has choices")
            usage = m.usage
            continue
        report.check(f"{where}/stream", usage is None, "a chunk after the usage chunk")
        d = m.choices[0].delta
        report.check(f"{where}/stream", finish is None, "a chunk after the finish_reason chunk")
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                report.check(f"{where}/stream", call["id"] is None, f"call {tc.index} got a second id")
                call["id"] = tc.id
            if tc.function and tc.function.name:
                call["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        finish = m.choices[0].finish_reason or finish
    if name != "error":
        report.check(f"{where}/stream", finish is not None, "no finish_reason")
        report.check(f"{where}/stream", usage is not None, "no usage chunk although include_usage")
        if usage is not None:
            report.check(f"{where}/stream", usage.prompt_tokens > 0, "usage.prompt_tokens is 0")
        if whole:
            w = whole.choices[0].message
            report.check(f"{where}/stream", content == (w.content or ""), "streamed text differs from the whole answer")
            report.check(f"{where}/stream", reasoning == ((w.model_extra or {}).get("reasoning_content") or ""),
                         "streamed reasoning differs from the whole answer")
            streamed_calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
            whole_calls = [(c.function.name, json.loads(c.function.arguments)) for c in w.tool_calls or []]
            report.check(f"{where}/stream", streamed_calls == whole_calls,
                         f"streamed calls {streamed_calls} differ from the whole answer's {whole_calls}")
            if name == "tools":
                report.check(f"{where}/stream", [a for _, a in streamed_calls] == TOOL_ARGS,
                             f"call arguments {streamed_calls}")


def sdk_chat(report, client, name):
    where = f"chat/{name}/sdk"
    req = chat_request(name, False)
    whole = client.chat.completions.create(**req)
    # The helper parses strict tools' arguments, and so refuses an answer that was cut short
    # or filtered, with the error for each (it read the finish_reason).
    refusal = {"length": openai.LengthFinishReasonError, "filter": openai.ContentFilterFinishReasonError}.get(name)
    try:
        with client.chat.completions.stream(**req, stream_options={"include_usage": True}) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
    except Exception as e:  # noqa: BLE001
        if refusal and isinstance(e, refusal):
            return
        raise
    report.check(where, refusal is None, f"the helper accepted a {name} answer")
    f, w = final.choices[0], whole.choices[0]
    report.check(where, f.finish_reason == w.finish_reason, f"finish {f.finish_reason} vs {w.finish_reason}")
    report.check(where, (f.message.content or "") == (w.message.content or ""), "stream helper text differs")
    fc = [(c.function.name, c.function.parsed_arguments) for c in f.message.tool_calls or []]
    wc = [(c.function.name, json.loads(c.function.arguments)) for c in w.message.tool_calls or []]
    report.check(where, fc == wc, f"stream helper calls {fc} vs whole {wc}")
    report.check(where, final.usage is not None and final.usage.prompt_tokens == whole.usage.prompt_tokens,
                 f"stream helper usage {final.usage} vs whole {whole.usage}")


def sdk_chat_error(report, client):
    where = "chat/error/sdk"
    try:
        for _ in client.chat.completions.create(**chat_request("error", False), stream=True):
            pass
        report.fail(where, "the SDK saw no error in the stream")
    except openai.APIError as e:
        report.check(where, bool(e.message), "the SDK's error has no message")


# ---------------------------------------------------------------------------------------------
# Responses

# item type -> the events between its output_item.added and output_item.done (documented order).
RESPONSES_ITEM_EVENTS = {
    "message": ["response.content_part.added", "response.output_text.delta*", "response.output_text.done",
                "response.content_part.done"],
    "reasoning": ["response.reasoning_summary_part.added", "response.reasoning_summary_text.delta*",
                  "response.reasoning_summary_text.done", "response.reasoning_summary_part.done"],
    "function_call": ["response.function_call_arguments.delta*", "response.function_call_arguments.done"],
}

TERMINAL = {"response.completed": "completed", "response.incomplete": "incomplete", "response.failed": "failed"}


def check_echo(report, where, resp):
    dumped = resp.model_dump(mode="json", exclude_none=True)
    for k, want in RESPONSES_ECHO.items():
        got = dumped.get(k)
        if k == "reasoning" and isinstance(got, dict):
            got = {x: got.get(x) for x in want}
        report.check(where, got == want, f"echo of '{k}' is {json.dumps(got)}, the request sent {json.dumps(want)}")


def check_responses_order(report, where, names, events):
    """The documented event order: created, in_progress, items (each added ... done), terminal."""
    i = 0

    def expect(n):
        nonlocal i
        ok = report.check(where, i < len(names) and names[i] == n,
                          f"event {i} is {names[i] if i < len(names) else 'missing'}, expected {n}")
        i += 1
        return ok

    expect("response.created")
    expect("response.in_progress")
    index = 0
    while i < len(names) and names[i] == "response.output_item.added":
        item = events[i].item
        report.check(where, events[i].output_index == index, f"item {index} added at output_index {events[i].output_index}")
        i += 1
        for step in RESPONSES_ITEM_EVENTS.get(item.type, []):
            if step.endswith("*"):
                while i < len(names) and names[i] == step[:-1]:
                    report.check(where, events[i].item_id == item.id, f"{names[i]} for item {events[i].item_id}, open is {item.id}")
                    report.check(where, events[i].output_index == index, f"{names[i]} at output_index {events[i].output_index}")
                    i += 1
            elif i < len(names) and names[i] == "response.failed":
                break
            else:
                if expect(step):
                    report.check(where, events[i - 1].item_id == item.id, f"{step} for another item")
        if i < len(names) and names[i] == "response.failed":
            break
        if expect("response.output_item.done"):
            report.check(where, events[i - 1].item.id == item.id, "output_item.done for another item")
        index += 1
    report.check(where, i == len(names) - 1 and names[-1] in TERMINAL,
                 f"after the items: {names[i:]}, expected one terminal event")


def check_responses(report, http, name):
    where = f"responses/{name}"
    r = http.post("/v1/responses", json=responses_request(name, False))
    body = r.json()
    whole = None
    if name in ("error", "overflow"):
        report.check(f"{where}/whole", r.status_code >= 400, f"status {r.status_code}")
        validate(report, f"{where}/whole error", OpenAIErrorObject, body.get("error"))
    else:
        report.check(f"{where}/whole", r.status_code == 200, f"status {r.status_code}: {body}")
        whole = validate(report, f"{where}/whole", Response, body)
        if whole:
            check_echo(report, f"{where}/whole", whole)
            report.check(f"{where}/whole", whole.usage is not None, "no usage")
            expect = {"length": "incomplete", "filter": "incomplete"}.get(name, "completed")
            report.check(f"{where}/whole", whole.status == expect, f"status {whole.status}, expected {expect}")

    with http.stream("POST", "/v1/responses", json=responses_request(name, True)) as s:
        status, text = s.status_code, s.read().decode()
    if name == "overflow":
        report.check(f"{where}/stream", status == 400, f"status {status}")
        return
    report.check(f"{where}/stream", status == 200, f"status {status}: {text[:300]}")
    names, events = [], []
    for i, (event, data) in enumerate(sse_frames(text)):
        obj = json.loads(data)
        report.check(f"{where}/stream", event == obj.get("type"), f"frame {i}: event name {event} but type {obj.get('type')}")
        report.check(f"{where}/stream", obj.get("sequence_number") == i, f"frame {i}: sequence_number {obj.get('sequence_number')}")
        m = validate(report, f"{where}/stream {obj.get('type')} #{i}", STREAM_EVENT, obj)
        names.append(obj.get("type"))
        events.append(m)
    if None in events:
        return
    check_responses_order(report, f"{where}/stream", names, events)
    for e in events:
        if e.type in ("response.created", "response.in_progress") or e.type in TERMINAL:
            check_echo(report, f"{where}/stream {e.type}", e.response)
    last = events[-1]
    if name == "error":
        report.check(f"{where}/stream", last.type == "response.failed" and last.response.error is not None,
                     f"ends with {last.type}, expected response.failed with an error")
        return
    report.check(f"{where}/stream", last.response.usage is not None, "the terminal event has no usage")
    if whole:
        # Ids differ between two calls (response ids, the engine's call ids).
        strip = lambda resp: [o.model_dump(mode="json", exclude={"id", "call_id"}) for o in resp.output]  # noqa: E731
        report.check(f"{where}/stream", strip(last.response) == strip(whole),
                     f"streamed output {strip(last.response)} differs from the whole answer's {strip(whole)}")
        report.check(f"{where}/stream", last.response.status == whole.status, "streamed status differs")
        report.check(f"{where}/stream", last.response.usage == whole.usage,
                     f"streamed usage {last.response.usage} vs whole {whole.usage}")
        # Every item the stream announced as done is the one in the final output.
        done = [e.item for e in events if e.type == "response.output_item.done"]
        report.check(f"{where}/stream", done == list(last.response.output), "output_item.done items differ from the final output")


def sdk_responses(report, client, name):
    where = f"responses/{name}/sdk"
    req = responses_request(name, False)
    whole = client.responses.create(**req)
    kwargs = {k: v for k, v in req.items() if k not in ("text",)}
    with client.responses.stream(**kwargs) as stream:
        seen = [e.type for e in stream]
        if name in ("length", "filter"):
            report.check(where, seen[-1] == "response.incomplete", f"the helper's last event is {seen[-1]}")
            return
        final = stream.get_final_response()
    report.check(where, final.output_text == whole.output_text, "stream helper text differs")
    fc = [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"]
    wc = [(o.name, json.loads(o.arguments)) for o in whole.output if o.type == "function_call"]
    report.check(where, fc == wc, f"stream helper calls {fc} vs whole {wc}")
    report.check(where, final.usage == whole.usage, f"stream helper usage {final.usage} vs whole {whole.usage}")


def sdk_responses_error(report, client):
    where = "responses/error/sdk"
    types = [e.type for e in client.responses.create(**responses_request("error", False), stream=True)]
    report.check(where, types and types[-1] == "response.failed", f"the SDK's events end with {types[-1:]}")


# ---------------------------------------------------------------------------------------------
# Messages


def check_messages_order(report, where, names, events):
    """message_start, then each block (start, deltas, stop), message_delta, message_stop."""
    i = 0
    report.check(where, names[:1] == ["message_start"], f"starts with {names[:1]}")
    i = 1
    while i < len(names) and names[i] == "ping":
        i += 1
    index = 0
    while i < len(names) and names[i] == "content_block_start":
        report.check(where, events[i].index == index, f"block {index} starts with index {events[i].index}")
        kind = events[i].content_block.type
        i += 1
        while i < len(names) and names[i] == "content_block_delta":
            d = events[i].delta.type
            allowed = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"},
                       "tool_use": {"input_json_delta"}}[kind]
            report.check(where, d in allowed, f"a {d} in a {kind} block")
            report.check(where, events[i].index == index, f"a delta for block {events[i].index} in block {index}")
            i += 1
        if i < len(names) and names[i] == "error":
            break
        report.check(where, i < len(names) and names[i] == "content_block_stop" and events[i].index == index,
                     f"block {index} ends with {names[i] if i < len(names) else 'nothing'}")
        i += 1
        index += 1
    if i < len(names) and names[i] == "error":
        report.check(where, i == len(names) - 1, "events after the error")
        return
    report.check(where, names[i:] == ["message_delta", "message_stop"], f"after the blocks: {names[i:]}")


def check_messages(report, http, name):
    where = f"messages/{name}"
    r = http.post("/v1/messages", json=messages_request(name, False), headers=ANTHROPIC_HEADERS)
    body = r.json()
    whole = None
    if name in ("error", "overflow"):
        report.check(f"{where}/whole", r.status_code >= 400, f"status {r.status_code}")
        validate(report, f"{where}/whole error", AnthropicErrorResponse, body)
    else:
        report.check(f"{where}/whole", r.status_code == 200, f"status {r.status_code}: {body}")
        whole = validate(report, f"{where}/whole", Message, body)
        if whole:
            report.check(f"{where}/whole", whole.usage.input_tokens > 0, "usage.input_tokens is 0")
            expect = {"length": "max_tokens", "filter": "refusal", "tools": "tool_use"}.get(name, "end_turn")
            report.check(f"{where}/whole", whole.stop_reason == expect, f"stop_reason {whole.stop_reason}, expected {expect}")

    with http.stream("POST", "/v1/messages", json=messages_request(name, True), headers=ANTHROPIC_HEADERS) as s:
        status, text = s.status_code, s.read().decode()
    if name == "overflow":
        report.check(f"{where}/stream", status == 400, f"status {status}")
        return
    report.check(f"{where}/stream", status == 200, f"status {status}: {text[:300]}")
    names, events = [], []
    for i, (event, data) in enumerate(sse_frames(text)):
        obj = json.loads(data)
        report.check(f"{where}/stream", event == obj.get("type"), f"frame {i}: event name {event} but type {obj.get('type')}")
        if obj.get("type") == "error":
            m = validate(report, f"{where}/stream error", AnthropicErrorResponse, obj)
        else:
            m = validate(report, f"{where}/stream {obj.get('type')} #{i}", MESSAGE_EVENT, obj)
        names.append(obj.get("type"))
        events.append(m)
    if None in events:
        return
    check_messages_order(report, f"{where}/stream", names, events)
    start = events[0].message
    report.check(f"{where}/stream", start.usage.input_tokens > 0,
                 f"message_start carries usage.input_tokens {start.usage.input_tokens}; the API puts the prompt's token count there")
    if name == "error":
        report.check(f"{where}/stream", names[-1] == "error", f"ends with {names[-1]}, expected error")
        return
    delta = events[-2]
    if whole:
        report.check(f"{where}/stream", start.usage.input_tokens == whole.usage.input_tokens,
                     f"message_start input_tokens {start.usage.input_tokens} vs whole {whole.usage.input_tokens}")
        report.check(f"{where}/stream", delta.usage.output_tokens == whole.usage.output_tokens,
                     f"message_delta output_tokens {delta.usage.output_tokens} vs whole {whole.usage.output_tokens}")
        report.check(f"{where}/stream", delta.delta.stop_reason == whole.stop_reason, "streamed stop_reason differs")


def sdk_messages(report, client, name):
    where = f"messages/{name}/sdk"
    req = messages_request(name, False)
    whole = client.messages.create(**req)
    with client.messages.stream(**req) as stream:
        for _ in stream:
            pass
        final = stream.get_final_message()
    # Ids differ between two calls (the engine names its calls), signatures too.
    strip = lambda m: [b.model_dump(mode="json", exclude={"signature", "id"}) for b in m.content]  # noqa: E731
    report.check(where, strip(final) == strip(whole), f"stream helper content {strip(final)} vs whole {strip(whole)}")
    report.check(where, final.stop_reason == whole.stop_reason, "stream helper stop_reason differs")
    report.check(where, final.usage.input_tokens == whole.usage.input_tokens
                 and final.usage.output_tokens == whole.usage.output_tokens,
                 f"stream helper usage {final.usage} vs whole {whole.usage}")
    if name == "tools":
        report.check(where, [b.input for b in final.content if b.type == "tool_use"] == TOOL_ARGS,
                     "tool inputs differ from the engine's arguments")


def sdk_messages_error(report, client):
    where = "messages/error/sdk"
    try:
        with client.messages.stream(**messages_request("error", False)) as stream:
            for _ in stream:
                pass
        report.fail(where, "the SDK saw no error in the stream")
    except anthropic.APIStatusError as e:
        report.check(where, bool(e.message), "the SDK's error has no message")


# ---------------------------------------------------------------------------------------------


def run(report, label, fn, *args):
    try:
        fn(report, *args)
    except Exception:  # noqa: BLE001 - every failure is reported, the run goes on
        report.fail(label, "raised:\n" + traceback.format_exc())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="tokentap's base URL, http://127.0.0.1:PORT")
    ap.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="comma-separated scenarios to run (default: all); the error ones run only if listed",
    )
    args = ap.parse_args()
    chosen = args.scenarios.split(",")
    unknown = [n for n in chosen if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}: choose from {SCENARIOS}")
    report = Report()
    http = httpx.Client(base_url=args.base, timeout=30)
    oai = openai.OpenAI(base_url=args.base + "/v1", api_key="sk-sdk", max_retries=0, timeout=30)
    ant = anthropic.Anthropic(base_url=args.base, api_key="sk-ant-sdk", max_retries=0, timeout=30)
    for name in [n for n in SCENARIOS if n in chosen]:
        run(report, f"chat/{name}", check_chat, http, name)
        run(report, f"responses/{name}", check_responses, http, name)
        run(report, f"messages/{name}", check_messages, http, name)
    for name in [n for n in ANSWERED if n in chosen]:
        run(report, f"chat/{name}/sdk", sdk_chat, oai, name)
        run(report, f"responses/{name}/sdk", sdk_responses, oai, name)
        run(report, f"messages/{name}/sdk", sdk_messages, ant, name)
    if "error" in chosen:
        run(report, "chat/error/sdk", sdk_chat_error, oai)
        run(report, "responses/error/sdk", sdk_responses_error, oai)
        run(report, "messages/error/sdk", sdk_messages_error, ant)
    print(json.dumps({
        "openai": openai.__version__,
        "anthropic": anthropic.__version__,
        "checks": report.checks,
        "validated": report.validated,
        "failures": report.failures,
    }, indent=1))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
