"""The results feed on a live node: results() pages after a cursor, stream() follows it."""

from __future__ import annotations

import time
from typing import List

from support import LiveNode, agent, head, task, unique

from tokentap_client import Node, Result, Sample


def _collect(node: Node, after: int, rollout_id: str, want: int) -> List[Result]:
    """Results after `after` until `want` of `rollout_id` are in (others are skipped)."""
    got: List[Result] = []
    cursor = after
    deadline = time.monotonic() + 60
    while len(got) < want:
        assert time.monotonic() < deadline, f"only {len(got)} of {want} results came"
        items, nxt = node.results(after=cursor, wait=10)
        for item in items:
            assert item["cursor"] > cursor, "only results after the cursor"
        if items:
            assert nxt == items[-1]["cursor"]
        else:
            assert nxt == cursor
        got += [i for i in items if i["sample"]["rollout_id"] == rollout_id]
        cursor = nxt
    return got


def test_results_long_poll_after_a_cursor(node: Node, live: LiveNode) -> None:
    start = head(node)
    # Nothing new: the long poll waits its `wait`, then answers empty at the same cursor.
    began = time.monotonic()
    items, nxt = node.results(after=start, wait=1)
    waited = time.monotonic() - began
    assert (items, nxt) == ([], start)
    assert 0.8 <= waited < 10, waited

    submitted = node.submit(task(live, unique("results"), agent(), num_samples=3))
    rid = submitted["rollout_id"]
    # A result wakes the poll long before its 30 s are up.
    began = time.monotonic()
    first, _ = node.results(after=start, wait=30)
    assert first and time.monotonic() - began < 20
    mine = _collect(node, start, rid, 3)
    cursors = [r["cursor"] for r in mine]
    assert cursors == sorted(cursors) and len(set(cursors)) == 3
    assert all(c > start for c in cursors)
    assert sorted(r["sample"]["sample_id"] for r in mine) == submitted["samples"]
    for r in mine:
        assert r["sample"]["stage"] == "done" and r["sample"]["outcome"] is not None

    # after=cursor gives only what is newer.
    items, _ = node.results(after=cursors[0], wait=0)
    got = [i["cursor"] for i in items]
    assert cursors[0] not in got and cursors[1] in got and cursors[2] in got
    assert all(c > cursors[0] for c in got)
    items, _ = node.results(after=cursors[2], wait=0)
    assert all(i["cursor"] > cursors[2] for i in items)

    # limit caps a page; `next` continues where it ended.
    items, nxt = node.results(after=start, wait=0, limit=1)
    assert len(items) == 1 and nxt == items[0]["cursor"]
    items2, nxt2 = node.results(after=nxt, wait=0, limit=2)
    assert len(items2) == 2 and nxt2 == items2[-1]["cursor"]
    assert [i["cursor"] for i in items + items2] == sorted(
        i["cursor"] for i in items + items2
    )
    assert nxt < items2[0]["cursor"]
    page, _ = node.results(after=start, wait=0, limit=3)
    assert [i["cursor"] for i in page] == [i["cursor"] for i in items + items2]
    assert items[0]["sample"] == page[0]["sample"]


def test_stream_yields_new_results_and_stops(node: Node, live: LiveNode) -> None:
    start = head(node)
    submitted = node.submit(task(live, unique("stream"), agent(), num_samples=2))
    rid = submitted["rollout_id"]
    seen: List[Sample] = []
    began = time.monotonic()
    for sample in node.stream(after=start, wait=5, stop=lambda: len(seen) >= 2):
        assert time.monotonic() - began < 60, "stream never saw the rollout's samples"
        assert sample["_cursor"] > start
        if sample["rollout_id"] == rid:
            seen.append(sample)
    # The loop ended: stop() was asked between pages.
    assert sorted(s["sample_id"] for s in seen) == submitted["samples"]
    for s in seen:
        assert s["outcome"] is not None and s["outcome"]["status"] == "completed"

    # Resuming from a kept cursor gives what came after it, first the next sample.
    first, second = sorted(seen, key=lambda s: s["_cursor"])
    resumed = node.stream(after=first["_cursor"], wait=0)
    try:
        nxt = next(resumed)
    finally:
        resumed.close()
    assert nxt["sample_id"] == second["sample_id"]
    assert nxt["_cursor"] == second["_cursor"]

    # A stop that is true at once reads nothing.
    assert list(node.stream(after=start, wait=0, stop=lambda: True)) == []
