"""The node's refusals come back as NodeError with its status, type and message."""

from __future__ import annotations

from typing import Optional

import pytest
from support import LiveNode, agent, task, unique

from tokentap_client import Node, NodeError


@pytest.mark.parametrize("token", ["not-the-token", None])
def test_a_bad_or_missing_token_is_401(live: LiveNode, token: Optional[str]) -> None:
    bad = Node(live.url, token=token, timeout=10)
    with pytest.raises(NodeError) as e:
        bad.rollout("ro-anything")
    assert e.value.status == 401
    assert e.value.type == "unauthorized"
    assert e.value.message and "bearer token" in e.value.message
    assert str(e.value).startswith("401 unauthorized: ")
    for call in (
        lambda: bad.submit(task(live, unique("nope"), agent())),
        lambda: bad.results(wait=0),
        lambda: bad.traces("x"),
        lambda: bad.pause(wait=0),
        lambda: bad.resume(),
        lambda: bad.openapi(),
    ):
        with pytest.raises(NodeError) as e:
            call()
        assert e.value.status == 401 and e.value.type == "unauthorized"
    with pytest.raises(NodeError) as e:
        next(bad.events("ro-anything"))
    assert e.value.status == 401


def test_an_unknown_rollout_or_sample_is_404(node: Node) -> None:
    missing = "ro-00000000000000000000000000000000"
    for call in (
        lambda: node.rollout(missing),
        lambda: node.cancel(missing),
        lambda: node.wait(missing, timeout=5),
        lambda: node.traces(f"{missing}-0"),
        lambda: next(node.events(missing)),
    ):
        with pytest.raises(NodeError) as e:
            call()
        assert e.value.status == 404, e.value
        assert e.value.type == "not_found"
        assert e.value.message and missing in e.value.message


def test_an_invalid_task_is_400_naming_the_field(node: Node, live: LiveNode) -> None:
    spec = task(live, unique("bad"), agent())
    spec["num_sampels"] = 2
    with pytest.raises(NodeError) as e:
        node.submit(spec)
    assert e.value.status == 400 and e.value.type == "invalid_task"
    assert e.value.message and "num_sampels" in e.value.message
