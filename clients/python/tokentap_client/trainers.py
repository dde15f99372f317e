"""The one mapping from a finished tokentap sample to what a trainer trains on.

Every trainer adapter (verl, SkyRL, slime, verifiers/prime-rl, TRL) goes through
`training_rows`: one `TrainingRow` per trace of the sample, with the same meaning everywhere
(docs/training.md is the contract):

- `prompt_ids` then `response_ids`: the exact ids the engine saw and sampled;
  `response_mask` is 1 exactly where the model sampled the token (train on it), 0 on tool
  results, user turns, template glue and, for a sample that did not complete, everywhere;
  `logprobs` is the sampler's logprob per response token (0.0 where the mask is 0).
- `reward`: the evaluator's reward (per trace when the evaluator rewarded traces), None when
  the sample has none (`error`, `cancelled`, no answer from the node): see `failed`.
- `group_id` (the task id: one GRPO group), `sample_id`, `trace_id`, `index`.
- `policy_versions` (per call, in order), `policy_version` (the last call's),
  `engine_weight_versions` (per call, the engine's own weight version when the call ended,
  where the node read it: `tokentap serve --engine-weight-version`), `stale` (the trace's
  calls ran under more than one version, or one straddled an engine weight update),
  `stop_reason` (the last call's
  finish reason; `length` when clipped here), `branch_cause` (why the trace starts where it
  does: `session_start`, `new_prefix`, `rerendered`, `superseded`, `per_request`) and
  `tito_branch` (token-in mode's cause, when the node ran in tito).

Standard library only, like the rest of the client.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, TypedDict

from .node import Node, NodeError

FailedPolicy = Literal["exclude", "zero"]
"""What becomes of a sample without a reward (outcome `error` or `cancelled`, or the node
did not answer in time): `exclude` gives no rows; `zero` gives its traces (or one empty row
when it has none) with reward 0.0 and every mask bit cleared, so it counts in its group and
trains on nothing."""

#: Outcomes that carry no reward.
FAILED_STATUSES = ("error", "cancelled", "node_timeout", "node_error")


class TrainingRow(TypedDict):
    """One trainable sequence of a sample (one trace)."""

    sample_id: str
    trace_id: Optional[str]
    group_id: str
    index: int
    prompt_ids: List[int]
    response_ids: List[int]
    response_mask: List[int]
    logprobs: List[float]
    reward: Optional[float]
    status: str
    reason: Optional[str]
    stop_reason: Optional[str]
    policy_versions: List[Optional[str]]
    policy_version: Optional[str]
    engine_weight_versions: List[Optional[str]]
    stale: bool
    branch_cause: Optional[str]
    tito_branch: Optional[str]
    num_turns: int
    clipped: bool
    calls: List[Dict[str, Any]]
    messages_json: str


def _trace_reward(sample: Mapping[str, Any], trace: Mapping[str, Any]) -> Optional[float]:
    outcome = sample.get("outcome") or {}
    if outcome.get("status") not in ("completed", "timeout"):
        return None
    if trace.get("reward") is not None:
        return float(trace["reward"])
    r = outcome.get("reward")
    return None if r is None else float(r)


def row_from_trace(sample: Mapping[str, Any], trace: Mapping[str, Any]) -> TrainingRow:
    """One trace of a finished sample as a `TrainingRow` (no clipping, no failure policy)."""
    response = [int(t) for t in trace["response_ids"]]
    mask = [int(m) for m in trace["loss_mask"]]
    logprobs = [float(x) for x in trace["logprobs"]]
    if not (len(response) == len(mask) == len(logprobs)):
        raise ValueError(
            f"trace {trace.get('trace_id')}: response, mask and logprobs differ in length"
        )
    calls = [dict(c) for c in trace.get("calls") or []]
    versions = [c.get("policy_version") for c in calls]
    outcome = sample.get("outcome") or {}
    return {
        "sample_id": str(sample["sample_id"]),
        "trace_id": trace.get("trace_id"),
        "group_id": str(trace.get("group_id") or sample.get("task_id")),
        "index": int(trace.get("index", 0)),
        "prompt_ids": [int(t) for t in trace["prompt_ids"]],
        "response_ids": response,
        "response_mask": mask,
        "logprobs": logprobs,
        "reward": _trace_reward(sample, trace),
        "status": str(outcome.get("status", "unknown")),
        "reason": outcome.get("reason"),
        "stop_reason": calls[-1].get("finish_reason") if calls else None,
        "policy_versions": versions,
        "policy_version": versions[-1] if versions else None,
        "engine_weight_versions": [c.get("engine_weight_version") for c in calls],
        "stale": bool(
            trace.get("spans_policy_versions", False)
            or trace.get("spans_engine_weight_versions", False)
        ),
        "branch_cause": trace.get("started_by"),
        "tito_branch": trace.get("tito_branch"),
        "num_turns": len(calls),
        "clipped": False,
        "calls": calls,
        "messages_json": str(trace.get("messages_json", "[]")),
    }


def empty_row(
    sample: Mapping[str, Any],
    status: Optional[str] = None,
    reason: Optional[str] = None,
    prompt_ids: Sequence[int] = (),
) -> TrainingRow:
    """A row with nothing to train on, for a sample that left no trace (no model call, a
    failed sample, a node that did not answer) when the trainer needs one row per sample:
    `prompt_ids` as given (e.g. the trainer's own prompt), an empty response, the sample's
    reward (None when it has none)."""
    outcome = sample.get("outcome") or {}
    reward = outcome.get("reward") if outcome.get("status") in ("completed", "timeout") else None
    return {
        "sample_id": str(sample.get("sample_id", "")),
        "trace_id": None,
        "group_id": str(sample.get("task_id", "")),
        "index": 0,
        "prompt_ids": [int(t) for t in prompt_ids],
        "response_ids": [],
        "response_mask": [],
        "logprobs": [],
        "reward": None if reward is None else float(reward),
        "status": status or str(outcome.get("status", "unknown")),
        "reason": reason if reason is not None else outcome.get("reason"),
        "stop_reason": None,
        "policy_versions": [],
        "policy_version": None,
        "engine_weight_versions": [],
        "stale": False,
        "branch_cause": None,
        "tito_branch": None,
        "num_turns": 0,
        "clipped": False,
        "calls": [],
        "messages_json": "[]",
    }


def zeroed(row: TrainingRow) -> TrainingRow:
    """The row with reward 0.0 and every mask bit cleared (and logprobs 0.0 there)."""
    out: TrainingRow = {**row}
    out["reward"] = 0.0
    out["response_mask"] = [0] * len(row["response_ids"])
    out["logprobs"] = [0.0] * len(row["response_ids"])
    return out


def fit(
    row: TrainingRow,
    max_prompt_len: Optional[int] = None,
    max_response_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
) -> TrainingRow:
    """The row within a trainer's length limits, without changing a single token's context:

    - a prompt over `max_prompt_len` hands its tail to the response as context (mask 0): the
      sequence stays the same ids, only where the prompt ends moves;
    - a response over `max_response_len` (or a sequence over `max_seq_len`) is clipped at the
      response end: the first tokens are kept, the rest dropped, `clipped` and
      `stop_reason = "length"` set;
    - a prompt longer than a whole row may be (`max_prompt_len + max_response_len`, or
      `max_seq_len`) is left-truncated, as trainers truncate long prompts themselves, and the
      row keeps no trainable token (its tokens would be trained under a context that is not
      the one they were sampled in)."""
    prompt = list(row["prompt_ids"])
    response = list(row["response_ids"])
    mask = list(row["response_mask"])
    logprobs = list(row["logprobs"])
    clipped = row["clipped"]
    truncated_prompt = False
    budget = max_seq_len
    if max_prompt_len is not None and max_response_len is not None:
        whole = max_prompt_len + max_response_len
        budget = whole if budget is None else min(budget, whole)
    if budget is not None and len(prompt) > budget:
        keep = budget if max_prompt_len is None else min(max_prompt_len, budget)
        prompt = prompt[len(prompt) - keep :] if keep > 0 else []
        response, mask, logprobs = [], [], []
        truncated_prompt = clipped = True
    if max_prompt_len is not None and len(prompt) > max_prompt_len:
        extra = len(prompt) - max_prompt_len
        response = prompt[max_prompt_len:] + response
        mask = [0] * extra + mask
        logprobs = [0.0] * extra + logprobs
        prompt = prompt[:max_prompt_len]
    limit = max_response_len
    if max_seq_len is not None:
        room = max(max_seq_len - len(prompt), 0)
        limit = room if limit is None else min(limit, room)
    if limit is not None and len(response) > limit:
        response, mask, logprobs = response[:limit], mask[:limit], logprobs[:limit]
        clipped = True
    out: TrainingRow = {**row}
    out["prompt_ids"] = prompt
    out["response_ids"] = response
    out["response_mask"] = [0] * len(response) if truncated_prompt else mask
    out["logprobs"] = [0.0] * len(response) if truncated_prompt else logprobs
    out["clipped"] = clipped
    if clipped and not row["clipped"]:
        out["stop_reason"] = "length"
    return out


def training_rows(
    sample: Mapping[str, Any],
    traces: Sequence[Mapping[str, Any]],
    failed: FailedPolicy = "exclude",
    max_prompt_len: Optional[int] = None,
    max_response_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
) -> List[TrainingRow]:
    """A finished sample's traces as training rows, fitted to the trainer's limits (`fit`),
    in trace order. A sample without a reward follows `failed`; a completed sample keeps every
    trace as the node gave it (a timed-out one comes with reward 0 and its mask cleared by the
    node). A sample with no trace gives no row: the adapters that need one per sample add an
    `empty_row`."""
    outcome = sample.get("outcome") or {}
    rewarded = outcome.get("status") in ("completed", "timeout")
    if not rewarded and failed == "exclude":
        return []
    rows = []
    for t in sorted(traces, key=lambda t: int(t.get("index", 0))):
        row = row_from_trace(sample, t)
        if not rewarded:
            row = zeroed(row)
        rows.append(fit(row, max_prompt_len, max_response_len, max_seq_len))
    return rows


_STEP = re.compile(r"(\d+)\s*$")


def policy_step(version: Optional[str]) -> Optional[int]:
    """The training step a policy version names, for trainers that count versions in steps
    (verl's `min_global_steps`/`max_global_steps`, verifiers' `PolicySpan`): the trailing
    integer of the version ("v7" → 7, "step-12" → 12, "3" → 3); None when it has none.
    Resume the node with `policy_version=str(global_steps)` (or "vN") to keep them equal."""
    if version is None:
        return None
    m = _STEP.search(str(version))
    return int(m.group(1)) if m else None


def step_span(rows: Sequence[TrainingRow]) -> Tuple[Optional[int], Optional[int]]:
    """The first and last training step the rows' calls ran under (None when none parses)."""
    steps = [s for r in rows for s in (policy_step(v) for v in r["policy_versions"]) if s is not None]
    if not steps:
        return None, None
    return min(steps), max(steps)


def group_key(row: Mapping[str, Any]) -> str:
    """What groups rows for a group-relative advantage (GRPO): the task id."""
    return str(row["group_id"])


def failed_sample(task_id: str, status: str, reason: str, sample_id: str = "") -> Dict[str, Any]:
    """A sample-shaped dict for a run that got no sample from the node (`node_timeout`,
    `node_error`), so it goes through the same failure policy as an `error` sample."""
    return {
        "sample_id": sample_id,
        "task_id": task_id,
        "outcome": {"status": status, "reason": reason},
    }


def run_group(
    node: Node, task: Mapping[str, Any], timeout: float
) -> List[Tuple[Mapping[str, Any], List[Dict[str, Any]]]]:
    """Submits `task` as one group (its `num_samples`, 1 when unset) and waits at most
    `timeout` seconds for it; returns (finished sample, its traces) for every sample, always
    `num_samples` of them in the node's order. A node that does not finish the group in time
    gets the rollout cancelled and every sample is a `node_timeout` one (no traces); a node that
    refuses or cannot be reached gives `node_error` samples. Blocking."""
    spec = dict(task)
    spec.setdefault("num_samples", 1)
    n = int(spec["num_samples"])
    task_id = str(spec.get("task_id", ""))
    started = time.monotonic()
    try:
        sub = node.submit(spec)
    except (NodeError, OSError) as e:
        return [(failed_sample(task_id, "node_error", f"submit: {e}"), []) for _ in range(n)]
    rollout_id = sub["rollout_id"]
    ids = list(sub["samples"]) + [""] * max(n - len(sub["samples"]), 0)
    try:
        remaining = max(timeout - (time.monotonic() - started), 1.0)
        samples = node.wait(rollout_id, timeout=remaining)
    except (TimeoutError, OSError, NodeError) as e:
        try:
            node.cancel(rollout_id)
        except (NodeError, OSError):
            pass
        reason = f"no result within {timeout:g} s: {e}"
        return [(failed_sample(task_id, "node_timeout", reason, sid), []) for sid in ids[:n]]
    by_id = {str(s["sample_id"]): s for s in samples}
    out: List[Tuple[Mapping[str, Any], List[Dict[str, Any]]]] = []
    for sid in ids[:n]:
        sample = by_id.get(sid)
        if sample is None:
            out.append((failed_sample(task_id, "node_error", "the rollout lacks this sample", sid), []))
            continue
        try:
            traces = [dict(t) for t in node.traces(sample["sample_id"])]
        except NodeError as e:
            if e.status == 404:  # no trace file: e.g. `incomplete: drop`, or no model call
                traces = []
            else:
                raise
        out.append((sample, traces))
    return out


def run_task(
    node: Node, task: Mapping[str, Any], timeout: float
) -> Tuple[Mapping[str, Any], List[Dict[str, Any]]]:
    """Submits `task` (one sample: `num_samples` 1) and waits at most `timeout` seconds for it;
    returns (the finished sample, its traces). A node that does not finish it in time gets
    the rollout cancelled and yields a `node_timeout` sample (no traces); a node that refuses
    or cannot be reached yields `node_error`. Blocking: call through `asyncio.to_thread`
    (`arun_task`) from an event loop."""
    spec = dict(task)
    spec["num_samples"] = int(spec.get("num_samples", 1))
    if spec["num_samples"] < 1:
        spec["num_samples"] = 1
    results = run_group(node, spec, timeout)
    if not results:
        return failed_sample(str(spec.get("task_id", "")), "node_error", "the rollout has no sample"), []
    return results[0]


def main_row(rows: Sequence[TrainingRow]) -> Tuple[TrainingRow, int]:
    """The row a trainer that takes one sequence per sample trains on, and how many others
    it leaves out: the trace with the most sampled tokens (under `prefix-merge` an
    append-only conversation is one trace; a harness that branches — a subagent, a compaction —
    leaves several), the first one on a tie."""
    if not rows:
        raise ValueError("main_row needs at least one row")
    main = rows[0]
    for r in rows[1:]:
        if sum(r["response_mask"]) > sum(main["response_mask"]):
            main = r
    return main, len(rows) - 1


async def arun_task(
    node: Node, task: Mapping[str, Any], timeout: float
) -> Tuple[Mapping[str, Any], List[Dict[str, Any]]]:
    """`run_task` from an event loop (on a worker thread)."""
    return await asyncio.to_thread(run_task, node, task, timeout)
