"""Shared pieces of the live-node tests: the node's coordinates and task specs whose agents
are small shell scripts that call the model through the node's capture."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from tokentap_client import Node, RolloutState


@dataclass(frozen=True)
class LiveNode:
    """The node under test (from TOKENTAP_NODE_URL, TOKENTAP_NODE_TOKEN and
    TOKENTAP_TEST_PROJECT)."""

    url: str
    token: str
    project: str


# One model call through the capture (the node puts its proxy in OPENAI_BASE_URL and a
# per-sample key in OPENAI_API_KEY); a few tokens, so the tiny model answers at once.
MODEL_CALL = (
    'curl -sS --max-time 20 "$OPENAI_BASE_URL/chat/completions"'
    " -H 'content-type: application/json'"
    ' -H "authorization: Bearer $OPENAI_API_KEY"'
    """ -d '{"model":"m","messages":[{"role":"user","content":"task"}],"max_tokens":8}'"""
    " > /dev/null"
)


def agent(succeed: str = "*-0", before: str = "", after: str = "") -> str:
    """An agent script: one model call, then `touch ok` (what the evaluator `test -f ok`
    rewards) in the samples whose session id matches the `case` pattern `succeed` (the
    session id ends in the sample's index: -0, -1, ...). `ok` is removed first, so a stray one
    in the project cannot reward a failing sample."""
    return (
        f"rm -f ok; {before}{MODEL_CALL} && "
        f'case "$TOKENTAP_SESSION" in {succeed}) touch ok;; esac{after}'
    )


def unique(name: str) -> str:
    """A task id of this test run only (the task id is the GRPO group)."""
    return f"pytest-{name}-{uuid.uuid4().hex[:8]}"


def task(
    live: LiveNode, task_id: str, script: str, num_samples: int = 2, **extra: Any
) -> Dict[str, Any]:
    """A task spec running `script` with `sh -c` in a copy of the test project, rewarded 1.0
    when it leaves a file `ok` behind."""
    spec: Dict[str, Any] = {
        "task_id": task_id,
        "instruction": "chat",
        "workspace": {"dir": {"path": live.project}},
        "harness": {"name": "command", "argv": ["sh", "-c", script]},
        "evaluator": {"kind": "command", "command": "test -f ok"},
        "num_samples": num_samples,
    }
    spec.update(extra)
    return spec


def eventually(
    what: str, check: Callable[[], bool], timeout: float = 30.0, every: float = 0.1
) -> None:
    """Polls `check` until it is true; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def head(node: Node) -> int:
    """The node's newest results cursor (what `after` must be to see only new results)."""
    cursor = 0
    while True:
        items, cursor = node.results(after=cursor, wait=0, limit=1000)
        if not items:
            return cursor


def describe(node: Node, rollout_id: str, state: Optional[RolloutState] = None) -> str:
    """A rollout's samples, for failure messages; with their agents' logs when the node runs
    on this host (they are next to the sample's traces)."""
    state = state or node.rollout(rollout_id)
    lines = []
    for s in state["samples"]:
        lines.append(repr(s))
        trajectory = s.get("trajectory")
        if trajectory:
            log = os.path.join(os.path.dirname(trajectory["path"]), "agent.log")
            if os.path.isfile(log):
                with open(log, errors="replace") as f:
                    lines.append(f"  agent.log: {f.read()[-2000:]!r}")
    return "\n".join(lines)
