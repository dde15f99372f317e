"""Rollouts on a live node: submit, wait, their trajectories, events and cancel."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

import pytest
from support import LiveNode, agent, describe, eventually, task, unique

from tokentap_client import Node, Sample, Submitted, reward_of


@pytest.fixture(scope="module")
def finished(node: Node, live: LiveNode) -> Tuple[str, Submitted, List[Sample]]:
    """A two-sample group: sample 0 leaves `ok` (reward 1.0), sample 1 does not (0.0)."""
    group = unique("alpha")
    submitted = node.submit(task(live, group, agent(succeed="*-0"), num_samples=2))
    samples = node.wait(submitted["rollout_id"], timeout=60)
    return group, submitted, samples


def test_submit_returns_the_rollout_and_its_samples_at_once(node: Node, live: LiveNode) -> None:
    started = time.monotonic()
    submitted = node.submit(task(live, unique("quick"), agent(), num_samples=3))
    assert time.monotonic() - started < 5, "submit does not wait for the samples"
    rid = submitted["rollout_id"]
    assert submitted["samples"] == [f"{rid}-{i}" for i in range(3)]
    node.wait(rid, timeout=60)


def test_wait_gives_completed_samples_rewarded_by_the_evaluator(
    node: Node, finished: Tuple[str, Submitted, List[Sample]]
) -> None:
    group, submitted, samples = finished
    rid = submitted["rollout_id"]
    info = describe(node, rid)
    by_index = {s["index"]: s for s in samples}
    assert sorted(by_index) == [0, 1], info
    assert [by_index[i]["sample_id"] for i in (0, 1)] == submitted["samples"]
    assert by_index[0]["outcome"] == {"status": "completed", "reward": 1.0}, info
    assert by_index[1]["outcome"] == {"status": "completed", "reward": 0.0}, info
    for s in samples:
        assert s["rollout_id"] == rid
        assert s["task_id"] == group
        assert s["stage"] == "done"
        assert s["attempt"] == 1
        evaluation = s["evaluation"]
        assert evaluation is not None and evaluation["reward"] == reward_of(s)
        trajectory = s["trajectory"]
        assert trajectory is not None, info
        assert trajectory["calls"] == 1 and trajectory["traces"] == 1, info
        assert trajectory["complete"] and trajectory["faithfulness_violations"] == 0
        assert s["agent"]["exit_code"] == 0
    # The rollout as the node reports it now.
    state = node.rollout(rid)
    assert state["status"] == "done"
    assert state["rollout"]["rollout_id"] == rid
    assert state["rollout"]["spec"]["task_id"] == group
    assert state["rollout"]["cancelled"] is False
    assert sorted(s["sample_id"] for s in state["samples"]) == submitted["samples"]


def test_traces_are_aligned_token_rows_with_sampled_tokens_trainable(
    node: Node, finished: Tuple[str, Submitted, List[Sample]]
) -> None:
    group, _, samples = finished
    for s in samples:
        rows = node.traces(s["sample_id"])
        assert len(rows) == 1, rows
        for row in rows:
            n = len(row["response_ids"])
            assert n > 0
            assert len(row["loss_mask"]) == n and len(row["logprobs"]) == n
            assert row["prompt_ids"], "the prompt as the engine saw it"
            assert 1 in row["loss_mask"], "the model-sampled tokens are trainable"
            assert set(row["loss_mask"]) <= {0, 1}
            for m, lp in zip(row["loss_mask"], row["logprobs"]):
                assert (lp <= 0.0) if m else (lp == 0.0)
            assert row["session_id"] == s["sample_id"]
            assert row["trace_id"].startswith(s["sample_id"] + "/")
            assert row["group_id"] == group
            assert row["reward"] == reward_of(s)
            call = row["calls"][0]
            assert call["trainable"] and call["sampled_len"] == sum(row["loss_mask"])
        # trajectories() takes the sample or its id, and gives the same rows.
        assert node.trajectories(s) == rows
        assert node.trajectories(s["sample_id"], numpy=False) == rows


def test_trajectories_as_numpy_arrays(
    node: Node, finished: Tuple[str, Submitted, List[Sample]]
) -> None:
    np = pytest.importorskip("numpy")
    _, _, samples = finished
    for s in samples:
        rows = node.traces(s["sample_id"])
        arrays = node.trajectories(s, numpy=True)
        assert len(arrays) == len(rows)
        for a, row in zip(arrays, rows):
            for key in ("input_ids", "loss_mask", "logprobs"):
                assert isinstance(a[key], np.ndarray), key
            start = a["response_start"]
            assert start == len(row["prompt_ids"])
            # input_ids and loss_mask span prompt + response; logprobs the response.
            assert a["input_ids"].shape == a["loss_mask"].shape
            assert len(a["input_ids"]) == start + len(row["response_ids"])
            assert len(a["logprobs"]) == len(a["input_ids"]) - start
            assert a["input_ids"].tolist() == row["prompt_ids"] + row["response_ids"]
            assert not a["loss_mask"][:start].any(), "the prompt is never trained on"
            assert a["loss_mask"][start:].tolist() == row["loss_mask"]
            assert a["loss_mask"].sum() > 0
            assert np.allclose(a["logprobs"], row["logprobs"])
            assert (a["logprobs"][a["loss_mask"][start:] == 1] <= 0).all()
            assert a["reward"] == row["reward"] and a["group_id"] == row["group_id"]


def test_events_stream_the_rollout_until_done(node: Node, live: LiveNode) -> None:
    # A second's pause before the model call, so the stream sees the samples progress.
    submitted = node.submit(task(live, unique("events"), agent(before="sleep 1; ")))
    rid = submitted["rollout_id"]
    events: List[Tuple[str, Any]] = list(node.events(rid, timeout=60))
    names = [name for name, _ in events]
    assert names[0] == "snapshot", names
    snapshot = events[0][1]
    assert snapshot["rollout"]["rollout_id"] == rid
    assert sorted(s["sample_id"] for s in snapshot["samples"]) == submitted["samples"]
    assert names[-1] == "done", names
    assert events[-1][1] == {"rollout_id": rid}
    assert names.count("done") == 1
    finished: Dict[str, Any] = {d["sample_id"]: d for n, d in events if n == "finished"}
    assert sorted(finished) == submitted["samples"], names
    for d in finished.values():
        assert d["event"] == "finished" and d["rollout_id"] == rid
        assert d["outcome"]["status"] == "completed"
    for sid in submitted["samples"]:
        # Its stages in order, then its "finished".
        mine = [(i, n, d) for i, (n, d) in enumerate(events) if d and d.get("sample_id") == sid]
        stages = [d["stage"] for _, n, d in mine if n == "stage"]
        assert stages and stages[-1] == "post_run", names
        order = ["queued", "init", "run", "post_run"]
        assert stages == sorted(stages, key=order.index), stages
        assert mine[-1][1] == "finished", mine

    # A finished rollout's stream is its snapshot, then done at once.
    started = time.monotonic()
    again = list(node.events(rid, timeout=30))
    assert [n for n, _ in again] == ["snapshot", "done"]
    assert all(s["outcome"] for s in again[0][1]["samples"])
    assert time.monotonic() - started < 10


def test_cancel_kills_a_running_rollout(node: Node, live: LiveNode) -> None:
    # The agent calls the model, then would run for a minute before leaving `ok`.
    submitted = node.submit(
        task(live, unique("cancel"), agent(succeed="*", after="; sleep 60; touch ok"), 1)
    )
    rid = submitted["rollout_id"]
    sid = submitted["samples"][0]

    def running() -> bool:
        return node.rollout(rid)["samples"][0]["stage"] == "run"

    eventually(f"{sid} to run", running)
    time.sleep(0.5)  # let its model call go through
    started = time.monotonic()
    cancelled = node.cancel(rid)
    assert cancelled == {"rollout_id": rid, "stopping": 1}
    samples = node.wait(rid, timeout=30)
    assert time.monotonic() - started < 20, "the agent was killed, not waited for"
    info = describe(node, rid)
    assert len(samples) == 1
    s = samples[0]
    assert s["outcome"] == {"status": "cancelled"}, info
    assert s["agent"]["exit_code"] is None, f"killed by a signal: {info}"
    state = node.rollout(rid)
    assert state["status"] == "done" and state["rollout"]["cancelled"] is True
    # What it captured is kept, with nothing to train on (the default `incomplete`:
    # "zero-mask").
    trajectory = s["trajectory"]
    assert trajectory is not None and trajectory["trainable_tokens"] == 0, info
    if trajectory["traces"]:
        for row in node.traces(sid):
            assert not any(row["loss_mask"]), row
    # Cancelling an ended rollout stops nothing.
    assert node.cancel(rid) == {"rollout_id": rid, "stopping": 0}
