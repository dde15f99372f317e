"""tokentap_client.mismatch: the train/infer check and its positive control (no node)."""

import math

import pytest

from tokentap_client.mismatch import logprob_mismatch, shifted


def test_equal_logprobs_match_and_mask_0_tokens_are_not_compared() -> None:
    captured = [[-0.5, 0.0, -2.0], [-1.0]]
    trainer = [[-0.5, -9.0, -2.0], [-1.0]]  # -9.0 sits under mask 0 (a tool result)
    stats = logprob_mismatch(trainer, captured, [[1, 0, 1], [1]])
    assert stats["tokens"] == 3
    assert stats["mean_abs"] == 0.0 and stats["max_abs"] == 0.0 and stats["k3"] == 0.0
    assert stats["over_threshold"] == 0.0


def test_a_shifted_mask_is_caught_by_orders_of_magnitude() -> None:
    captured = [[-0.43, 0.0, 0.0, -0.02]]
    trainer = [[-0.43 + 1e-7, -30.0, -25.0, -0.02]]
    mask = [[1, 0, 0, 1]]
    good = logprob_mismatch(trainer, captured, mask)
    bad = logprob_mismatch(trainer, captured, shifted(mask))
    assert good["mean_abs"] is not None and good["mean_abs"] < 1e-6
    assert bad["mean_abs"] is not None and bad["mean_abs"] > 1e5 * good["mean_abs"]
    assert bad["over_threshold"] == 1.0


def test_k3_is_the_kl_estimate() -> None:
    d = 0.3
    stats = logprob_mismatch([[-1.0 + d]], [[-1.0]], [[1]])
    assert stats["k3"] == pytest.approx(math.exp(d) - 1 - d)


def test_rows_of_other_lengths_are_an_alignment_error() -> None:
    with pytest.raises(ValueError, match="row 0"):
        logprob_mismatch([[0.0, 0.0]], [[0.0]], [[1]])
    with pytest.raises(ValueError, match="number of rows"):
        logprob_mismatch([[0.0]], [], [])


def test_no_token_to_compare_gives_none_not_zero() -> None:
    stats = logprob_mismatch([[0.0]], [[0.0]], [[0]])
    assert stats["tokens"] == 0 and stats["mean_abs"] is None


def test_shifted_moves_right_and_keeps_lengths() -> None:
    assert shifted([[1, 1, 0], [1], []]) == [[0, 1, 1], [0], []]
