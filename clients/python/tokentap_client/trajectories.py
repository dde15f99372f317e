"""Trajectories as arrays, and GRPO's group-normalized advantages."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, DefaultDict, Dict, Iterable, List, Mapping, Sequence, TypeVar

from .schema import TraceArrays

S = TypeVar("S", bound=Mapping[str, Any])


def as_arrays(trace: Mapping[str, Any]) -> TraceArrays:
    """A trace row as NumPy arrays, ready for a policy-gradient step:

    - input_ids: prompt then response ids (int64)
    - loss_mask: 0 over the prompt, the trace's mask over the response (1 = sampled by the
      model, train on it)
    - logprobs: the sampler's logprob of each response token, aligned with the response
      (float32; 0 where masked)
    - response_start: where the response begins in input_ids
    - reward, group_id, trace_id, session_id as given
    """
    import numpy as np

    prompt = np.asarray(trace["prompt_ids"], dtype=np.int64)
    response = np.asarray(trace["response_ids"], dtype=np.int64)
    mask = np.asarray(trace["loss_mask"], dtype=np.int8)
    logprobs = np.asarray(trace["logprobs"], dtype=np.float32)
    if not (len(response) == len(mask) == len(logprobs)):
        raise ValueError(
            f"trace {trace.get('trace_id')}: response, mask and logprobs differ in length"
        )
    return {
        "input_ids": np.concatenate([prompt, response]),
        "loss_mask": np.concatenate([np.zeros(len(prompt), dtype=np.int8), mask]),
        "logprobs": logprobs,
        "response_start": len(prompt),
        "reward": trace.get("reward"),
        "group_id": trace.get("group_id"),
        "trace_id": trace.get("trace_id"),
        "session_id": trace.get("session_id"),
    }


def groups(samples: Iterable[S]) -> Dict[str, List[S]]:
    """Finished samples by GRPO group (their task id)."""
    out: DefaultDict[str, List[S]] = defaultdict(list)
    for s in samples:
        out[s["task_id"]].append(s)
    return dict(out)


def reward_of(sample: Mapping[str, Any]) -> float:
    """A finished sample's reward (0 when it did not complete)."""
    outcome = sample.get("outcome") or {}
    return float(outcome.get("reward", 0.0) or 0.0)


def group_advantages(rewards: Sequence[float], eps: float = 1e-6) -> List[float]:
    """GRPO's advantage per sample: (reward - group mean) / (group std + eps). A group whose
    rewards are all equal gets zeros (it carries no learning signal)."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    return [(r - mean) / (std + eps) for r in rewards]
