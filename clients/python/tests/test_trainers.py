"""The shared trace -> training-row mapping (tokentap_client.trainers) and the two trainers
that do not install here, slime and verifiers/prime-rl, on the field names and shapes their
source defines. No node needed: the inputs are shaped like the node's answers (a sample from
`GET /v1/rollouts/{id}`, trace rows from `GET /v1/samples/{id}/traces`). The verl and SkyRL
adapters are tested against their real packages over a live node (tests_trainers/)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pytest

from tokentap_client.slime import STATUS, make_samples, sample_kwargs
from tokentap_client.trainers import (
    empty_row,
    fit,
    policy_step,
    row_from_trace,
    step_span,
    training_rows,
)
from tokentap_client.verifiers import branch_views, episode


def sample(status: str = "completed", reward: Optional[float] = 1.0, sid: str = "s-1") -> Dict[str, Any]:
    outcome: Dict[str, Any] = {"status": status}
    if reward is not None:
        outcome["reward"] = reward
    if status in ("error", "timeout"):
        outcome["reason"] = "boom"
    return {"sample_id": sid, "task_id": "grp", "rollout_id": "r-1", "index": 0, "outcome": outcome}


def trace(index: int = 0, versions: Optional[List[Optional[str]]] = None, reward: Optional[float] = 1.0) -> Dict[str, Any]:
    """Two calls merged: prompt [1,2,3]; call 1 samples [10,11]; the tool result [20,21];
    call 2 samples [12,13,14]."""
    versions = versions or ["v3", "v3"]
    return {
        "schema_version": 1,
        "trace_id": f"s-1/{index}",
        "session_id": "s-1",
        "strategy": "prefix-merge",
        "index": index,
        "started_by": "session_start" if index == 0 else "new_prefix",
        "tito_branch": None,
        "prompt_ids": [1, 2, 3],
        "response_ids": [10, 11, 20, 21, 12, 13, 14],
        "loss_mask": [1, 1, 0, 0, 1, 1, 1],
        "logprobs": [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5],
        "calls": [
            {"record_id": "a", "response_start": 0, "sampled_len": 2, "trainable": True,
             "finish_reason": "tool_calls", "policy_version": versions[0]},
            {"record_id": "b", "response_start": 4, "sampled_len": 3, "trainable": True,
             "finish_reason": "stop", "policy_version": versions[1]},
        ],
        "spans_policy_versions": len(set(versions)) > 1,
        "messages_json": '[{"role":"user","content":"hi"},{"role":"assistant","content":"a"},'
        '{"role":"tool","content":"t","tool_call_id":"1"},{"role":"assistant","content":"b"}]',
        "tools_json": "[]",
        "reward": reward,
        "group_id": "grp",
        "gaps": [],
    }


# -- the shared mapping -----------------------------------------------------------------------


def test_a_trace_becomes_a_row_with_every_field_of_the_contract() -> None:
    row = row_from_trace(sample(), trace(versions=["v3", "v4"]))
    assert row["prompt_ids"] == [1, 2, 3]
    assert row["response_mask"] == [1, 1, 0, 0, 1, 1, 1]
    assert len(row["logprobs"]) == len(row["response_ids"])
    assert row["reward"] == 1.0 and row["group_id"] == "grp" and row["sample_id"] == "s-1"
    assert row["policy_versions"] == ["v3", "v4"] and row["policy_version"] == "v4"
    assert row["stale"] is True
    assert row["stop_reason"] == "stop" and row["branch_cause"] == "session_start"
    assert row["num_turns"] == 2 and row["clipped"] is False


def test_misaligned_trace_is_refused() -> None:
    t = trace()
    t["logprobs"] = t["logprobs"][:-1]
    with pytest.raises(ValueError, match="differ in length"):
        row_from_trace(sample(), t)


def test_a_failed_sample_is_excluded_or_zeroed() -> None:
    failed = sample("error", reward=None)
    assert training_rows(failed, [trace()], failed="exclude") == []
    rows = training_rows(failed, [trace()], failed="zero")
    assert len(rows) == 1
    assert rows[0]["reward"] == 0.0
    assert rows[0]["response_mask"] == [0] * 7 and rows[0]["logprobs"] == [0.0] * 7
    assert rows[0]["status"] == "error" and rows[0]["reason"] == "boom"


def test_a_timed_out_sample_keeps_the_nodes_reward_zero() -> None:
    t = trace(reward=0.0)
    t["loss_mask"] = [0] * 7
    rows = training_rows(sample("timeout", reward=0.0), [t], failed="exclude")
    assert [r["reward"] for r in rows] == [0.0]


def test_an_empty_sample_gives_no_row_and_an_empty_row_on_request() -> None:
    assert training_rows(sample(), []) == []
    row = empty_row(sample(), prompt_ids=[5, 6])
    assert row["prompt_ids"] == [5, 6] and row["response_ids"] == [] and row["reward"] == 1.0
    assert empty_row(sample("error", reward=None))["reward"] is None


def test_per_trace_rewards_win_over_the_outcome() -> None:
    rows = training_rows(sample(reward=1.0), [trace(0, reward=0.25), trace(1, reward=None)])
    assert [r["reward"] for r in rows] == [0.25, 1.0]


def test_a_long_response_is_clipped_at_its_end() -> None:
    row = fit(row_from_trace(sample(), trace()), max_response_len=5)
    assert row["response_ids"] == [10, 11, 20, 21, 12]
    assert row["response_mask"] == [1, 1, 0, 0, 1]
    assert row["clipped"] and row["stop_reason"] == "length"
    whole = fit(row_from_trace(sample(), trace()), max_seq_len=6)
    assert whole["prompt_ids"] == [1, 2, 3] and whole["response_ids"] == [10, 11, 20]
    same = fit(row_from_trace(sample(), trace()), max_response_len=7)
    assert not same["clipped"] and same["stop_reason"] == "stop"


def test_a_long_prompt_hands_its_tail_to_the_response_untrained() -> None:
    row = fit(row_from_trace(sample(), trace()), max_prompt_len=2, max_response_len=8)
    assert row["prompt_ids"] == [1, 2]
    assert row["response_ids"] == [3, 10, 11, 20, 21, 12, 13, 14]
    assert row["response_mask"] == [0, 1, 1, 0, 0, 1, 1, 1]
    assert row["logprobs"][0] == 0.0 and row["logprobs"][1] == pytest.approx(-0.1)
    assert not row["clipped"]
    # The same ids in the same order: nothing's context changed.
    assert row["prompt_ids"] + row["response_ids"] == [1, 2, 3, 10, 11, 20, 21, 12, 13, 14]


def test_a_prompt_longer_than_a_whole_row_keeps_nothing_trainable() -> None:
    row = fit(row_from_trace(sample(), trace()), max_prompt_len=1, max_response_len=1)
    assert row["prompt_ids"] == [3] and row["response_ids"] == []
    assert row["clipped"]


def test_policy_versions_as_steps() -> None:
    assert policy_step("v7") == 7 and policy_step("step-12") == 12 and policy_step("3") == 3
    assert policy_step("main") is None and policy_step(None) is None
    rows = training_rows(sample(), [trace(versions=["v2", "v5"])])
    assert step_span(rows) == (2, 5)


# -- slime (THUDM/slime @ 624b824a898ab0ec1fcb4d373004c7f3852bf515, slime/utils/types.py) -----

# Every field of `Sample` the mapping fills, as the dataclass names them.
SLIME_SAMPLE_FIELDS = {
    "group_index", "index", "rollout_id", "tokens", "response_length", "loss_mask",
    "rollout_log_probs", "reward", "status", "weight_versions", "remove_sample", "session_id",
    "metadata",
}
# `Sample.Status` values.
SLIME_STATUS_VALUES = {"pending", "completed", "truncated", "aborted", "failed"}


def test_slime_sample_fields_and_the_checks_slime_makes() -> None:
    kws = sample_kwargs(sample(), [trace(0), trace(1)], group_index=4, index=9)
    assert len(kws) == 2
    for kw in kws:
        assert set(kw) == SLIME_SAMPLE_FIELDS
        # slime/ray/rollout.py: len(loss_mask) == response_length; tokens = prompt + response
        assert len(kw["loss_mask"]) == kw["response_length"] == 7
        assert len(kw["rollout_log_probs"]) == kw["response_length"]
        assert kw["tokens"] == [1, 2, 3, 10, 11, 20, 21, 12, 13, 14]
        assert kw["status"] in SLIME_STATUS_VALUES and kw["status"] == "completed"
        assert isinstance(kw["reward"], float) and kw["remove_sample"] is False
        assert kw["weight_versions"] == ["v3", "v3"]
    # One rollout execution: its training samples share rollout_id.
    assert kws[0]["rollout_id"] == kws[1]["rollout_id"] and isinstance(kws[0]["rollout_id"], int)
    assert set(STATUS.values()) <= SLIME_STATUS_VALUES


def test_slime_failed_empty_and_clipped_samples() -> None:
    [failed] = sample_kwargs(sample("error", reward=None), [trace()])
    assert failed["reward"] == 0.0 and failed["remove_sample"] and failed["status"] == "failed"
    assert failed["loss_mask"] == [0] * 7
    assert sample_kwargs(sample("cancelled", reward=None), [], failed="exclude") == []
    [cancelled] = sample_kwargs(sample("cancelled", reward=None), [])
    assert cancelled["status"] == "aborted" and cancelled["response_length"] == 0
    assert cancelled["remove_sample"]
    [empty] = sample_kwargs(sample(), [])
    assert empty["reward"] == 1.0 and empty["response_length"] == 0 and empty["remove_sample"]
    [clipped] = sample_kwargs(sample(), [trace()], max_response_len=3)
    assert clipped["status"] == "truncated" and clipped["response_length"] == 3
    assert len(clipped["tokens"]) == 6


def test_slime_samples_built_with_a_sample_class_of_that_shape() -> None:
    import dataclasses
    import enum

    @dataclasses.dataclass
    class Sample:  # the fields slime's Sample has that the mapping fills (no slime here)
        class Status(enum.Enum):
            PENDING = "pending"
            COMPLETED = "completed"
            TRUNCATED = "truncated"
            ABORTED = "aborted"
            FAILED = "failed"

        group_index: Optional[int] = None
        index: Optional[int] = None
        rollout_id: Optional[int] = None
        tokens: List[int] = dataclasses.field(default_factory=list)
        response_length: int = 0
        loss_mask: Optional[List[int]] = None
        rollout_log_probs: Optional[List[float]] = None
        reward: Optional[float] = None
        status: "Sample.Status" = Status.PENDING
        weight_versions: List[str] = dataclasses.field(default_factory=list)
        remove_sample: bool = False
        session_id: Optional[str] = None
        metadata: Dict[str, Any] = dataclasses.field(default_factory=dict)

    [s] = make_samples(Sample, sample_kwargs(sample(), [trace()]))
    assert s.status is Sample.Status.COMPLETED and s.response_length == 7


# -- verifiers v1 (PrimeIntellect-ai/verifiers @ a60a606ecc4d309247edf9ff92c3eabca362781f) ----

MESSAGE_NODE_FIELDS = {"parent", "message", "sampled", "token_ids", "mask", "logprobs"}
EPISODE_FIELDS = {"id", "task", "group", "ok", "errors", "traces"}
TRACE_FIELDS = {"version", "id", "task", "nodes", "calls", "rewards", "is_completed", "ok",
                "stop_condition", "errors", "info"}


def test_verifiers_episode_branches_are_the_traces() -> None:
    ep = episode(sample(), [trace(0), trace(1, versions=["v3", "v4"])])
    assert EPISODE_FIELDS <= set(ep) and ep["group"] == {"id": "grp"} and ep["ok"]
    [tr] = ep["traces"]
    assert TRACE_FIELDS <= set(tr)
    assert tr["rewards"] == {"tokentap": {"score": 1.0, "weight": 1.0}}
    for n in tr["nodes"]:
        assert set(n) == MESSAGE_NODE_FIELDS
        assert len(n["mask"]) == len(n["token_ids"])
        assert len(n["logprobs"]) == sum(n["mask"])  # logprobs for the sampled tokens only
        assert n["sampled"] == any(n["mask"]) or not n["sampled"]
    branches = branch_views(tr)
    assert len(branches) == 2  # one per tokentap trace
    for b in branches:
        assert b["token_ids"] == [1, 2, 3, 10, 11, 20, 21, 12, 13, 14]
        assert b["sampled_mask"] == [False] * 3 + [True, True, False, False, True, True, True]
        assert b["logprobs"][3:5] == pytest.approx([-0.1, -0.2])
        assert b["logprobs"][:3] == [0.0, 0.0, 0.0]
    # Calls point at their sampled nodes.
    assert all(tr["nodes"][c["node"]]["sampled"] for c in tr["calls"]) and len(tr["calls"]) == 4
    assert ep["policy"] == {"start": 3, "end": 4}
    assert tr["info"]["stale"] is True


def test_verifiers_failed_sample_is_a_failed_trace() -> None:
    ep = episode(sample("error", reward=None), [trace()])
    [tr] = ep["traces"]
    assert ep["ok"] is False and tr["rewards"] == {"tokentap": None}
    assert ep["errors"] == [{"type": "error", "message": "boom"}]
    assert not any(m for b in branch_views(tr) for m in b["sampled_mask"])
    empty = episode(sample(), [])
    assert empty["traces"][0]["nodes"] == [] and empty["ok"]
