#!/usr/bin/env python3
"""Regenerates fuzz/seeds/<target>/ (run from the repo root; needs shared/reference/harness-wire
beside the repo, or its path as the first argument). Seeds are small on purpose: the fuzzer
grows its corpus in fuzz/corpus/ (not committed)."""
import base64, json, os, re, shutil, ssl, sys

REF = sys.argv[1] if len(sys.argv) > 1 else "../shared/reference/harness-wire"
if not os.path.isdir(REF):
    REF = "/work/shared/reference/harness-wire"
OUT = "fuzz/seeds"
CONTRACT = open("proxy/src/backend/contract_tests.rs").read()


def put(target, name, data):
    os.makedirs(f"{OUT}/{target}", exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(f"{OUT}/{target}/{name}", "wb") as f:
        f.write(data)


def harness(name):
    return json.load(open(f"{REF}/{name}.json"))["body"]


for t in os.listdir(OUT):
    if os.path.isdir(f"{OUT}/{t}"):
        shutil.rmtree(f"{OUT}/{t}")

# Wire request parsers: real harness requests (Qwen Code and Pi speak Chat Completions, Codex
# Responses, Claude Code Messages), whole and trimmed to their first messages.
for target, names, key in [
    ("wire_chat_completions_request", ["qwen", "qwen-turn2", "pi", "pi-turn2"], "messages"),
    ("wire_responses_request", ["codex", "codex-turn2"], "input"),
    ("wire_messages_request", ["claude", "claude-turn2"], "messages"),
]:
    for n in names:
        body = harness(n)
        put(target, n, json.dumps(body))
        small = dict(body)
        small[key] = body[key][:2]
        small.pop("tools", None)
        if isinstance(small.get("system"), list):
            small["system"] = small["system"][:1]
        if isinstance(small.get("instructions"), str):
            small["instructions"] = small["instructions"][:200]
        put(target, n + "-small", json.dumps(small))

# Numbers JSON allows but an f64 cannot hold (a schema's `1e400`), where each API passes raw
# JSON through (a tool schema): the fuzzer found a panic there once. Written as text: Python's
# json writes such a number as `Infinity`, which is not JSON.
HUGE = '{"type": "object", "properties": {"n": {"type": "number", "maximum": 1e400}}}'
put("wire_chat_completions_request", "huge-number",
    '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
    '"function", "function": {"name": "f", "parameters": %s}}]}' % HUGE)
put("wire_responses_request", "huge-number",
    '{"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", '
    '"parameters": %s}]}' % HUGE)
put("wire_messages_request", "huge-number",
    '{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], '
    '"tools": [{"name": "f", "input_schema": %s}]}' % HUGE)

# Engine answers: the backend contract tests' fixtures (vLLM, SGLang), llama.cpp-shaped
# answers, and a mock's Chat Completions SSE; whole seeds start with 0x00, stream seeds with
# 0x08 | cuts and the cut bytes (see fuzz/src/lib.rs `cuts`).
def const(name):
    return re.search(r'const %s: &str = r#"(.*?)"#;' % name, CONTRACT, re.S).group(1)


def const_list(name):
    block = re.search(r"const %s: \[&str; \d+\] = \[(.*?)\n\];" % name, CONTRACT, re.S).group(1)
    return re.findall(r'r#"(.*?)"#', block, re.S)


def sse(chunks):
    return "".join(f"data: {c}\n\n" for c in chunks) + "data: [DONE]\n\n"


def whole(body):
    return b"\x00" + body.encode()


def stream(body, cuts=(40, 128, 200)):
    return bytes([0x08 | len(cuts), *cuts]) + body.encode()


LLAMA_WHOLE = json.dumps({
    "choices": [{"finish_reason": "stop", "index": 0,
                 "message": {"role": "assistant", "content": "Hi!"},
                 "logprobs": {"content": [
                     {"id": 13048, "token": "Hi", "bytes": [72, 105], "logprob": -0.25, "top_logprobs": []},
                     {"id": 0, "token": "!", "bytes": [33], "logprob": -1.5, "top_logprobs": []}]}}],
    "created": 1767225600, "model": "smollm2", "object": "chat.completion",
    "usage": {"completion_tokens": 3, "prompt_tokens": 9, "total_tokens": 12},
    "id": "chatcmpl-llama"})
LLAMA_STREAM = [
    json.dumps({"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}], "object": "chat.completion.chunk", "id": "c"}),
    json.dumps({"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Hi"},
                             "logprobs": {"content": [{"id": 13048, "token": "Hi", "bytes": [72, 105], "logprob": -0.25, "top_logprobs": []}]}}], "object": "chat.completion.chunk", "id": "c"}),
    json.dumps({"choices": [{"finish_reason": None, "index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{\"cmd\":"}}]},
                             "logprobs": {"content": [{"id": 7, "token": "{", "logprob": -0.5, "top_logprobs": []}]}}], "object": "chat.completion.chunk", "id": "c"}),
    json.dumps({"choices": [{"finish_reason": "tool_calls", "index": 0, "delta": {}}], "object": "chat.completion.chunk", "id": "c",
                "usage": {"completion_tokens": 3, "prompt_tokens": 9, "total_tokens": 12}}),
]
mock = [open(f"{REF}/chat-completions-{k}.sse").read() for k in ("minimal", "full")]
for target, w, s in [
    ("vllm_answer", const("VLLM_WHOLE"), sse(const_list("VLLM_STREAM"))),
    ("sglang_answer", const("SGLANG_WHOLE"), sse(const_list("SGLANG_STREAM"))),
    ("llamacpp_answer", LLAMA_WHOLE, sse(LLAMA_STREAM)),
]:
    put(target, "whole", whole(w))
    put(target, "stream", stream(s))
    put(target, "stream-uncut", stream(s, ()))
    put(target, "error-chunk", stream(sse([const("SGLANG_STREAM_REFUSAL")])))
    for i, m in enumerate(mock):
        put(target, f"mock-sse-{i}", stream(m))

# The shared pieces: whole answers, stream chunks and their messages/deltas, as JSON.
chunks = const_list("VLLM_STREAM") + const_list("SGLANG_STREAM") + LLAMA_STREAM
for i, c in enumerate(chunks):
    v = json.loads(c)
    put("openai_compat_chunk", f"chunk-{i}", c)
    if v.get("choices"):
        d = dict(v["choices"][0].get("delta") or {})
        d["token_ids"] = v["choices"][0].get("token_ids", [1, 2, 3])
        d["usage"] = v.get("usage") or {"prompt_tokens": 9, "completion_tokens": 3}
        put("openai_compat_chunk", f"delta-{i}", json.dumps(d))
for i, w in enumerate([const("VLLM_WHOLE"), const("SGLANG_WHOLE"), LLAMA_WHOLE]):
    put("openai_compat_chunk", f"whole-{i}", w)
    put("openai_compat_chunk", f"message-{i}", json.dumps(json.loads(w)["choices"][0]["message"]))

# TLS: ClientHellos as Python's OpenSSL client sends them, with and without SNI.
for name in ["api.openai.com", "api.anthropic.com", None]:
    ctx = ssl.create_default_context()
    if name is None:
        ctx.check_hostname = False
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    conn = ctx.wrap_bio(inc, out, server_hostname=name)
    try:
        conn.do_handshake()
    except ssl.SSLWantReadError:
        pass
    put("tls_client_hello", f"hello-{name or 'no-sni'}", out.read())
put("tls_client_hello", "http", b"GET / HTTP/1.1\r\nHost: example\r\n\r\n")

# Records: the first lines of a demo spool (SmolLM2 via llama.cpp), whole, torn, and garbled.
spool = open("tokentap-demo/spool/segment-00000000000000000000.ndjson", "rb").read() \
    if os.path.exists("tokentap-demo/spool/segment-00000000000000000000.ndjson") else None
if spool:
    lines = spool.split(b"\n")
    rec = lines[0] + b"\n"
    two = rec + (lines[1] + b"\n" if len(lines) > 2 and lines[1] else rec)
    for target in ("ndjson_lines", "ship_batch"):
        put(target, "one-record", rec)
        put(target, "two-records", two)
        put(target, "torn", two + rec[: len(rec) // 2])
        put(target, "garbled", b"{}\n\n" + rec.replace(b'"schema_version":1', b'"schema_version":9') + b"not json\n" + rec.replace(b'"record_id":"', b'"record_id":"x'))
    half = len(rec) // 2
    put("spool_segments", "one-segment", bytes([0x00]) + two)
    put("spool_segments", "two-segments-torn", bytes([0x01 | 0x08, 128]) + two + rec[:half])
    put("spool_segments", "three-segments", bytes([0x02, 60, 200]) + two + b"x\n" + rec[:half])
    put("spool_segments", "empty-lines", bytes([0x00]) + b"\n\n" + rec + b"{}")

# Chat templates: the golden conversations (canonical requests), each with another template,
# prompt flag and pre-tokenizer in byte 0; and two conversations in the byte-built form.
convs = json.load(open("chat-template/tests/golden/conversations.json"))["conversations"]
for i, c in enumerate(convs):
    put("chat_template", f"golden-{c['name']}", bytes([(i * 37) & 0x3F]) + json.dumps(c["request"], ensure_ascii=False).encode())
put("chat_template", "bytes-turns", bytes([0x0B]) + b"\x00".join([b"\x00You are terse.", b"\x01Hi \xc3\xa9\xc3\xa9 <|im_end|>", b"\x1a{\"city\": \"Paris\"}", b"\x03ok", b"\x01  spaced\t\ttabs\n\n\n123456"]))
put("chat_template", "bytes-odd", bytes([0x3F]) + b"\x22\xff\xfe<think>\x00\x2a\x00\x04{{ raise }}")

# Rollout tasks: the shapes the e2e tests and the Python client submit.
tasks = [
    {"task_id": "chat", "instruction": "chat", "workspace": {"dir": {"path": "/tmp/project"}},
     "harness": {"name": "command", "argv": ["sh", "-c", "echo {instruction}"]},
     "evaluator": {"kind": "session-completed"}, "num_samples": 2},
    {"task_id": "fix-pi", "instruction": "make the failing unit test pass", "workspace": {"git": {"url": "https://example.invalid/r.git", "commit": "0123456789abcdef0123456789abcdef01234567", "setup": "pip install -e ."}},
     "harness": {"name": "pi"}, "num_samples": 8, "budgets": {"agent_s": 600, "session_s": 900, "eval_s": 120},
     "evaluator": {"kind": "command", "command": "python3 -m unittest -q", "test_files": ["test_x.py"]},
     "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 2048}, "strategy": "per-request",
     "policy_version": "step-12", "priority": -3, "callback_url": "http://127.0.0.1:9/cb",
     "limits": {"memory_mb": 2048, "cpus": 1.5, "pids": 256}, "sandbox": True, "incomplete": "keep", "capture": "transparent"},
    {"task_id": "swe", "instruction": "x", "workspace": {"dir": {"path": "."}}, "harness": {"name": "claude-code"},
     "evaluator": {"kind": "swebench", "test_command": "pytest", "fail_to_pass": ["t::a"], "pass_to_pass": []}},
]
for i, t in enumerate(tasks):
    put("rollout_task", f"task-{i}", json.dumps(t))

# AdmissionReviews: the webhook e2e test's shape, pods with and without the lists it patches.
pods = [
    {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "agent", "namespace": "rl", "labels": {"app": "agent"}},
     "spec": {"containers": [{"name": "agent", "image": "agent:1", "env": [{"name": "X", "value": "1"}]}]}},
    {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "agent-", "namespace": "rl",
     "annotations": {"tokentap.io/mode": "sidecar", "tokentap.io/session": "s1", "a/b~c": "x"}},
     "spec": {"initContainers": [{"name": "init", "image": "busybox", "volumeMounts": [{"name": "v", "mountPath": "/v"}]}],
              "containers": [{"name": "a", "image": "a", "env": [{"name": "OPENAI_BASE_URL", "value": "http://x"}]}, {"name": "b", "image": "b"}],
              "volumes": [{"name": "v", "emptyDir": {}}]}},
    {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "skip", "annotations": {"tokentap.io/injected": "transparent"}}, "spec": {"containers": []}},
]
for i, pod in enumerate(pods):
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": f"uid-{i}", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                          "resource": {"group": "", "version": "v1", "resource": "pods"},
                          "namespace": "rl", "operation": "CREATE", "object": pod, "oldObject": None, "dryRun": False}}
    put("admission_review", f"review-{i}", json.dumps(review))
