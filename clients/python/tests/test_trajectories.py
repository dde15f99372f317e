"""Pure unit tests of the helpers in tokentap_client.trajectories (no node needed)."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from tokentap_client import NodeError, as_arrays, group_advantages, groups, reward_of


def test_group_advantages_normalize_within_the_group() -> None:
    adv = group_advantages([1.0, 0.0, 1.0, 0.0])
    assert adv == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    # (r - mean) / (std + eps): mean 2, population std sqrt(2/3).
    assert group_advantages([1.0, 2.0, 3.0], eps=0.0) == pytest.approx(
        [-(1.5**0.5), 0.0, 1.5**0.5]
    )
    # eps keeps a tiny spread from blowing up.
    assert group_advantages([0.0, 1e-9], eps=1.0) == pytest.approx([-5e-10, 5e-10])


def test_group_advantages_of_an_equal_group_are_zero() -> None:
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.0, 0.0]) == [0.0, 0.0]
    assert group_advantages([0.5]) == [0.0]
    assert group_advantages([]) == []


def _sample(task_id: str, index: int, outcome: Any) -> Dict[str, Any]:
    return {"sample_id": f"{task_id}-{index}", "task_id": task_id, "outcome": outcome}


def test_groups_are_by_task_id_in_order() -> None:
    samples = [
        _sample("a", 0, None),
        _sample("b", 0, None),
        _sample("a", 1, None),
        _sample("c", 0, None),
        _sample("b", 1, None),
    ]
    out = groups(samples)
    assert list(out) == ["a", "b", "c"]
    assert [s["sample_id"] for s in out["a"]] == ["a-0", "a-1"]
    assert [s["sample_id"] for s in out["b"]] == ["b-0", "b-1"]
    assert [s["sample_id"] for s in out["c"]] == ["c-0"]
    assert out["a"][0] is samples[0], "the samples themselves, not copies"
    assert groups([]) == {}
    with pytest.raises(KeyError):
        groups([{"sample_id": "no-task"}])


@pytest.mark.parametrize(
    "outcome, reward",
    [
        ({"status": "completed", "reward": 1.0}, 1.0),
        ({"status": "completed", "reward": 0.25}, 0.25),
        ({"status": "completed", "reward": 0.0}, 0.0),
        ({"status": "timeout", "reward": 0.0, "reason": "budget"}, 0.0),
        ({"status": "error", "reason": "boom"}, 0.0),
        ({"status": "cancelled"}, 0.0),
        ({"status": "completed", "reward": None}, 0.0),
        (None, 0.0),
    ],
)
def test_reward_of(outcome: Any, reward: float) -> None:
    got = reward_of(_sample("t", 0, outcome))
    assert isinstance(got, float)
    assert got == reward


def test_reward_of_a_sample_without_outcome_is_zero() -> None:
    assert reward_of({"sample_id": "s"}) == 0.0
    assert reward_of({"outcome": {"status": "completed", "reward": 1}}) == 1.0


def _trace(**over: Any) -> Dict[str, Any]:
    row: Dict[str, Any] = {
        "trace_id": "s-0/0",
        "session_id": "s-0",
        "prompt_ids": [1, 2, 3],
        "response_ids": [10, 11, 12, 13],
        "loss_mask": [1, 1, 0, 1],
        "logprobs": [-0.5, -1.5, 0.0, -0.25],
        "reward": 1.0,
        "group_id": "g",
    }
    row.update(over)
    return row


def test_as_arrays_lays_prompt_and_response_out_for_training() -> None:
    np = pytest.importorskip("numpy")
    a = as_arrays(_trace())
    assert a["input_ids"].dtype == np.int64
    assert a["loss_mask"].dtype == np.int8
    assert a["logprobs"].dtype == np.float32
    assert a["input_ids"].tolist() == [1, 2, 3, 10, 11, 12, 13]
    assert a["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0, 1]
    assert a["response_start"] == 3
    # logprobs are aligned with the response only.
    assert a["logprobs"].tolist() == [-0.5, -1.5, 0.0, -0.25]
    assert len(a["logprobs"]) == len(a["input_ids"]) - a["response_start"]
    assert (a["reward"], a["group_id"], a["trace_id"], a["session_id"]) == (
        1.0,
        "g",
        "s-0/0",
        "s-0",
    )


def test_as_arrays_without_optional_fields() -> None:
    pytest.importorskip("numpy")
    row = _trace(prompt_ids=[], response_ids=[], loss_mask=[], logprobs=[])
    for key in ("reward", "group_id", "trace_id", "session_id"):
        del row[key]
    a = as_arrays(row)
    assert a["input_ids"].shape == (0,)
    assert a["loss_mask"].shape == (0,)
    assert a["response_start"] == 0
    assert (a["reward"], a["group_id"], a["trace_id"], a["session_id"]) == (None,) * 4


@pytest.mark.parametrize("field", ["response_ids", "loss_mask", "logprobs"])
def test_as_arrays_refuses_misaligned_rows(field: str) -> None:
    pytest.importorskip("numpy")
    row = _trace()
    short: List[Any] = row[field][:-1]
    row[field] = short
    with pytest.raises(ValueError, match="s-0/0"):
        as_arrays(row)


def test_node_error_carries_the_nodes_answer() -> None:
    e = NodeError(404, "not_found", "no such rollout x")
    assert (e.status, e.type, e.message) == (404, "not_found", "no such rollout x")
    assert str(e) == "404 not_found: no such rollout x"
    assert isinstance(e, Exception)
