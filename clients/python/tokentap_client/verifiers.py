"""tokentap samples as verifiers' (prime-rl's) v1 `Episode` / `Trace` (no dependency on it).

The shapes are those of PrimeIntellect-ai/verifiers read at commit
a60a606ecc4d309247edf9ff92c3eabca362781f: `verifiers/v1/episode.py` (`Episode`: `id`, `task`,
`group`, `ok`, `errors`, `traces`), `verifiers/v1/trace.py` (`Trace`: `nodes`, `calls`,
`rewards`, `is_completed`, `ok`, `stop_condition`, `info`; `Branch`: one root-to-leaf path
of nodes, each branch one training sample) and `verifiers/v1/graph.py` (`MessageNode`:
`parent`, `message`, `sampled`, `token_ids` — the node's delta of the cumulative sequence —
`mask` parallel to it, True on model-sampled tokens, and `logprobs` for the sampled tokens
only). The dicts validate as those pydantic models once the consumer adds its `agent` info.

Each tokentap trace becomes one branch: a root node holding the prompt (and any tokens
before the first call's answer), then per call a sampled node (its sampled tokens, mask and
logprobs) and, before the next call, a context node (tool results, user turns, template
glue; mask False). Several traces of a sample are several roots of one graph, so
`Trace.branches` gives one branch per tokentap trace. Node messages are for reference (the
assistant messages of the call's conversation, in order); the tokens are exact.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .trainers import TrainingRow, policy_step, training_rows

__all__ = ["episode", "branch_views"]


def _assistant_messages(row: TrainingRow) -> List[Dict[str, Any]]:
    try:
        messages = json.loads(row["messages_json"])
    except ValueError:
        return []
    if not isinstance(messages, list):
        return []
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant":
            content = m.get("content")
            out.append({"role": "assistant", "content": content if isinstance(content, str) else None})
    return out


def _nodes(row: TrainingRow, base: int) -> List[Dict[str, Any]]:
    response, mask, logprobs = row["response_ids"], row["response_mask"], row["logprobs"]
    assistants = _assistant_messages(row)
    nodes: List[Dict[str, Any]] = []

    def add(message: Dict[str, Any], ids: List[int], m: List[int], lp: List[float], sampled: bool) -> None:
        nodes.append(
            {
                "parent": base + len(nodes) - 1 if nodes else None,
                "message": message,
                "sampled": sampled,
                "token_ids": ids,
                "mask": [bool(x) for x in m],
                "logprobs": [x for x, keep in zip(lp, m) if keep],
            }
        )

    pos = 0
    first = row["calls"][0]["response_start"] if row["calls"] else len(response)
    add({"role": "user", "content": ""}, row["prompt_ids"] + response[:first], [0] * (len(row["prompt_ids"]) + min(first, len(response))), [0.0] * (len(row["prompt_ids"]) + min(first, len(response))), False)
    pos = min(first, len(response))
    for k, call in enumerate(row["calls"]):
        start = min(int(call["response_start"]), len(response))
        if start > pos:  # context between the previous answer and this call's
            add({"role": "user", "content": ""}, response[pos:start], mask[pos:start], logprobs[pos:start], False)
            pos = start
        end = min(start + int(call["sampled_len"]), len(response))
        if end <= start:
            continue
        message = assistants[k] if k < len(assistants) else {"role": "assistant", "content": None}
        add(message, response[start:end], mask[start:end], logprobs[start:end], True)
        pos = end
    if pos < len(response):
        add({"role": "user", "content": ""}, response[pos:], mask[pos:], logprobs[pos:], False)
    return nodes


def episode(
    sample: Mapping[str, Any],
    traces: Sequence[Mapping[str, Any]],
    max_response_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
) -> Dict[str, Any]:
    """A finished tokentap sample as a verifiers v1 `Episode` dict holding one `Trace`.

    A sample without a reward (`error`, `cancelled`, no answer from the node) is verifiers'
    own failed trace: `ok` false, `rewards` {"tokentap": None} ("scoring didn't run"), the
    reason in `errors`, its tokens kept with the mask cleared: excluded from training the way
    verifiers' consumers exclude failed traces. A timed-out agent is scored (reward 0)."""
    rows = training_rows(sample, traces, failed="zero", max_response_len=max_response_len, max_seq_len=max_seq_len)
    outcome = sample.get("outcome") or {}
    status = outcome.get("status")
    rewarded = status in ("completed", "timeout")
    nodes: List[Dict[str, Any]] = []
    calls: List[Dict[str, Any]] = []
    for row in rows:
        row_nodes = _nodes(row, len(nodes))
        sampled_at = [len(nodes) + i for i, n in enumerate(row_nodes) if n["sampled"]]
        for call, node in zip(row["calls"], sampled_at):
            calls.append({"node": node, "finish_reason": call.get("finish_reason") if call.get("finish_reason") in ("stop", "length", "tool_calls") else None})
        nodes.extend(row_nodes)
    steps = [s for r in rows for s in (policy_step(v) for v in r["policy_versions"]) if s is not None]
    reward = outcome.get("reward") if rewarded else None
    errors = [] if rewarded else [{"type": str(status), "message": str(outcome.get("reason") or status)}]
    group = str(sample.get("task_id", ""))
    trace = {
        "version": 1,
        "id": str(sample.get("sample_id", "")),
        "task": {"type": "tokentap", "data": {"task_id": group}, "key": group},
        "nodes": nodes,
        "calls": calls,
        "rewards": {"tokentap": None if reward is None else {"score": float(reward), "weight": 1.0}},
        "is_completed": status == "completed",
        "ok": status == "completed",
        "stop_condition": status,
        "errors": errors,
        "info": {
            "tokentap_sample_id": sample.get("sample_id"),
            "tokentap_trace_ids": [r["trace_id"] for r in rows],
            "policy_versions": [r["policy_versions"] for r in rows],
            "stale": any(r["stale"] for r in rows),
            "branch_causes": [r["branch_cause"] for r in rows],
            "clipped": [r["clipped"] for r in rows],
        },
    }
    return {
        "id": str(sample.get("sample_id", "")),
        "task": trace["task"],
        "group": {"id": group},
        "ok": trace["ok"],
        "errors": errors,
        "traces": [trace],
        "policy": {"start": min(steps), "end": max(steps)} if steps else None,
    }


def branch_views(trace: Mapping[str, Any]) -> List[Dict[str, List[Any]]]:
    """What verifiers' `Trace.branches` gives a trainer, per branch (root-to-leaf path):
    `token_ids`, `sampled_mask` and `logprobs` spread onto the sampled positions (0.0
    elsewhere), as `Branch.token_ids`/`sampled_mask`/`logprobs` define them."""
    nodes = trace["nodes"]
    parents = {n["parent"] for n in nodes if n["parent"] is not None}
    out = []
    for leaf in (i for i in range(len(nodes)) if i not in parents):
        path: List[int] = []
        nid: Optional[int] = leaf
        while nid is not None:
            path.append(nid)
            nid = nodes[nid]["parent"]
        ids: List[int] = []
        mask: List[bool] = []
        lps: List[float] = []
        for i in reversed(path):
            n = nodes[i]
            ids += n["token_ids"]
            mask += n["mask"]
            it = iter(n["logprobs"])
            lps += [next(it, 0.0) if m else 0.0 for m in n["mask"]]
        view: Dict[str, List[Any]] = {"token_ids": ids, "sampled_mask": mask, "logprobs": lps}
        out.append(view)
    return out
