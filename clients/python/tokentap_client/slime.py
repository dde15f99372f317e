"""tokentap samples as slime's `Sample`s (slime is not on PyPI: no dependency on it here).

The field names and their meanings are those of `slime.utils.types.Sample` (THUDM/slime,
read at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515) and of the checks
`RolloutManager._convert_samples_to_train_data` makes on them (slime/ray/rollout.py): `tokens`
is prompt then response, `response_length` the response's length, `loss_mask` and
`rollout_log_probs` one entry per response token, `reward` a number, `status` one of
`Sample.Status`' values, `weight_versions` the policy versions the tokens were sampled under,
`rollout_id` shared by every training sample of one rollout execution (so slime averages a
rollout's loss within it), `remove_sample` to keep a sample out of the loss.

Inside slime's custom rollout function (`--rollout-function-path`):

    from slime.utils.types import Sample
    from tokentap_client.slime import sample_kwargs

    def generate_rollout(args, rollout_id, data_source, evaluation=False):
        groups = []
        for prompt_group in data_source.get_samples(args.rollout_batch_size):
            # submit each group as one tokentap task (num_samples = n_samples_per_prompt)
            # against a node whose --backend is http://{args.sglang_router_ip}:{args.sglang_router_port}
            ...
            groups.append([Sample(**kw) for s in samples
                           for kw in sample_kwargs(s, node.traces(s["sample_id"]), ...)])
        return groups
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .trainers import FailedPolicy, TrainingRow, empty_row, training_rows, zeroed

__all__ = ["sample_kwargs", "row_to_sample_kwargs", "STATUS"]

#: tokentap outcome -> slime `Sample.Status` value.
STATUS = {
    "completed": "completed",
    "timeout": "truncated",
    "error": "failed",
    "node_error": "failed",
    "node_timeout": "aborted",
    "cancelled": "aborted",
}


def _rollout_id(sample_id: str) -> int:
    """slime's `rollout_id` is an int shared by a rollout's samples: a stable hash of the
    tokentap sample id."""
    return zlib.crc32(sample_id.encode()) & 0x7FFFFFFF


def row_to_sample_kwargs(
    row: TrainingRow, group_index: Optional[int] = None, index: Optional[int] = None
) -> Dict[str, Any]:
    """One `TrainingRow` as keyword arguments of `slime.utils.types.Sample`. `status` is the
    value string: pass `Sample.Status(kw["status"])` (or use `make_samples`)."""
    failed = row["reward"] is None
    status = STATUS.get(row["status"], "failed")
    if row["clipped"] and status == "completed":
        status = "truncated"
    return {
        "group_index": group_index,
        "index": index,
        "rollout_id": _rollout_id(row["sample_id"]),
        "tokens": row["prompt_ids"] + row["response_ids"],
        "response_length": len(row["response_ids"]),
        "loss_mask": list(row["response_mask"]),
        "rollout_log_probs": list(row["logprobs"]),
        "reward": 0.0 if failed else float(row["reward"] or 0.0),
        "status": status,
        "weight_versions": [v for v in row["policy_versions"] if v is not None],
        "remove_sample": failed or not any(row["response_mask"]),
        "session_id": row["sample_id"],
        "metadata": {
            "tokentap_sample_id": row["sample_id"],
            "tokentap_trace_id": row["trace_id"],
            "tokentap_group_id": row["group_id"],
            "tokentap_status": row["status"],
            "stop_reason": row["stop_reason"],
            "stale": row["stale"],
            "branch_cause": row["branch_cause"],
            "raw_reward": None if failed else row["reward"],
        },
    }


def sample_kwargs(
    sample: Mapping[str, Any],
    traces: Sequence[Mapping[str, Any]],
    group_index: Optional[int] = None,
    index: Optional[int] = None,
    failed: FailedPolicy = "zero",
    max_response_len: Optional[int] = None,
    max_seq_len: Optional[int] = None,
) -> List[Dict[str, Any]]:
    """A finished tokentap sample as slime `Sample` keyword arguments, one per trace (a rollout
    execution with several traces gives several training samples sharing its `rollout_id`).

    A sample without a reward, with `failed="zero"` (the default; slime keeps a group's size):
    its traces (or one empty sample when it has none) with reward 0.0, status `failed` or
    `aborted`, the mask cleared and `remove_sample` set; with `"exclude"`: nothing. Limits
    (`--rollout-max-response-len`, the context length) clip at the response end."""
    rows = training_rows(
        sample, traces, failed=failed, max_response_len=max_response_len, max_seq_len=max_seq_len
    )
    outcome = sample.get("outcome") or {}
    rewarded = outcome.get("status") in ("completed", "timeout")
    if not rows and (rewarded or failed == "zero"):
        rows = [empty_row(sample)] if rewarded else [zeroed(empty_row(sample))]
    if not rewarded:
        for r in rows:
            r["reward"] = None  # row_to_sample_kwargs writes 0.0 and remove_sample
    return [row_to_sample_kwargs(r, group_index, index) for r in rows]


def make_samples(sample_cls: Any, kwargs_list: Sequence[Mapping[str, Any]]) -> List[Any]:
    """`Sample` objects from `sample_kwargs` (slime's class passed in: no import of slime)."""
    out = []
    for kw in kwargs_list:
        kw = dict(kw)
        kw["status"] = sample_cls.Status(kw["status"])
        out.append(sample_cls(**kw))
    return out
