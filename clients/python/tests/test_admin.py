"""Pause and resume on a live node: a weight update's hold, and the new policy version on
the calls that come after it."""

from __future__ import annotations

import time
import uuid
from typing import Iterator

import pytest
from support import LiveNode, agent, describe, task, unique

from tokentap_client import Node


@pytest.fixture
def resumed_after(node: Node) -> Iterator[None]:
    """Never leaves the node paused, whatever the test did."""
    yield
    node.resume()


def test_pause_holds_generations_and_resume_sets_the_policy_version(
    node: Node, live: LiveNode, resumed_after: None
) -> None:
    status = node.pause(wait=30)
    assert status["paused"] is True
    assert status["in_flight"] == 0

    # A sample submitted while paused runs its agent, but its model call is held.
    held = node.submit(task(live, unique("held"), agent(succeed="*"), num_samples=1))
    time.sleep(2)
    state = node.rollout(held["rollout_id"])
    assert state["status"] == "running", describe(node, held["rollout_id"], state)
    assert state["samples"][0]["stage"] == "run"

    version = f"pytest-v-{uuid.uuid4().hex[:8]}"
    status = node.resume(policy_version=version)
    assert set(status) == {"paused", "in_flight", "policy_version"}, status
    assert status["paused"] is False and status["policy_version"] == version, status
    # The held sample's one call, released by this resume, may still be in flight.
    assert status["in_flight"] in (0, 1), status

    later = node.submit(task(live, unique("later"), agent(succeed="*"), num_samples=1))
    for submitted in (held, later):
        rid = submitted["rollout_id"]
        samples = node.wait(rid, timeout=60)
        info = describe(node, rid)
        assert samples[0]["outcome"] == {"status": "completed", "reward": 1.0}, info
        rows = node.traces(samples[0]["sample_id"])
        assert rows, info
        for row in rows:
            assert row["calls"], row
            assert [c.get("policy_version") for c in row["calls"]] == [version] * len(
                row["calls"]
            )
            assert row["spans_policy_versions"] is False

    # resume() without a version keeps the node's.
    again = node.resume()
    assert again["paused"] is False and again["policy_version"] == version


def test_pause_answers_at_once_when_nothing_is_in_flight(
    node: Node, resumed_after: None
) -> None:
    began = time.monotonic()
    status = node.pause(wait=1)
    assert status["paused"] is True and status["in_flight"] == 0
    assert time.monotonic() - began < 5
    status = node.resume()
    assert status["paused"] is False
