"""Train/infer mismatch: the trainer's logprobs of the sampled tokens against the engine's.

Every trainable token of a tokentap trace is the id the engine sampled, with the logprob the
engine's sampler gave it. A trainer's own forward pass over the same ids must give (nearly) the
same logprob for each of them; where it does not, the gradient is off-policy by that much
(the mismatch truncated importance sampling corrects), and where it is far off, the ids, the
mask or their alignment are wrong (an off-by-one shows up at once as a large mismatch).

    stats = logprob_mismatch(trainer_lps, [r["logprobs"] for r in rows],
                             [r["response_mask"] for r in rows])
    stats["mean_abs"], stats["max_abs"], stats["k3"], stats["over_threshold"]

Standard library only, like the rest of the client; `tokentap_client.trl.trainer_logprobs`
gives a Hugging Face model's logprobs for rows.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, TypedDict

__all__ = ["MismatchStats", "logprob_mismatch", "shifted"]

#: |Δ| above which a token counts in `over_threshold` (nats): far beyond float noise and
#: batching drift, well below what a misaligned token gives.
DEFAULT_THRESHOLD = 0.1


class MismatchStats(TypedDict):
    """What `logprob_mismatch` measures over the mask-1 tokens of a batch."""

    tokens: int
    """How many tokens were compared (mask 1, a captured logprob)."""
    mean_abs: Optional[float]
    """Mean |trainer logprob - captured logprob| (None without a token)."""
    max_abs: Optional[float]
    """The largest |Δ|."""
    k3: Optional[float]
    """The k3 estimate of KL(sampler || trainer): mean of r - 1 - log r, r = exp(trainer -
    captured), over tokens the sampler drew (unbiased, never negative)."""
    over_threshold: Optional[float]
    """The share of tokens with |Δ| > `threshold`."""
    threshold: float


def logprob_mismatch(
    trainer: Sequence[Sequence[float]],
    captured: Sequence[Sequence[float]],
    masks: Sequence[Sequence[int]],
    threshold: float = DEFAULT_THRESHOLD,
) -> MismatchStats:
    """Compares, row by row, the trainer's logprob of every response token with the captured
    one where the mask is 1 (tokens the model sampled). The three sequences of a row must have
    the same length: a row of another length is an alignment error, not a mismatch, and raises
    ValueError."""
    if not (len(trainer) == len(captured) == len(masks)):
        raise ValueError("trainer, captured and masks differ in their number of rows")
    deltas: List[float] = []
    k3: List[float] = []
    for i, (t_row, c_row, m_row) in enumerate(zip(trainer, captured, masks)):
        if not (len(t_row) == len(c_row) == len(m_row)):
            raise ValueError(
                f"row {i}: {len(t_row)} trainer logprobs, {len(c_row)} captured, {len(m_row)} mask bits"
            )
        for t, c, m in zip(t_row, c_row, m_row):
            if not m:
                continue
            d = float(t) - float(c)
            deltas.append(abs(d))
            # r - 1 - log r with log r = d; expm1 keeps it exact for the tiny d of a match.
            k3.append(math.expm1(d) - d)
    n = len(deltas)
    if n == 0:
        return {"tokens": 0, "mean_abs": None, "max_abs": None, "k3": None,
                "over_threshold": None, "threshold": threshold}
    return {
        "tokens": n,
        "mean_abs": sum(deltas) / n,
        "max_abs": max(deltas),
        "k3": sum(k3) / n,
        "over_threshold": sum(1 for d in deltas if d > threshold) / n,
        "threshold": threshold,
    }


def shifted(masks: Sequence[Sequence[int]], by: int = 1) -> List[List[int]]:
    """The masks moved `by` tokens to the right (bits falling off the end dropped, zeros in
    front): the positive control of `logprob_mismatch`, an off-by-one the check must catch."""
    out: List[List[int]] = []
    for m in masks:
        row = [0] * min(by, len(m)) + [int(b) for b in m[: max(len(m) - by, 0)]]
        out.append(row)
    return out
