"""The suite runs against a live tokentap node, named by environment variables:

    TOKENTAP_NODE_URL      the node's control plane, e.g. http://127.0.0.1:8700
    TOKENTAP_NODE_TOKEN    its bearer token (the node must have one: a test checks the 401)
    TOKENTAP_TEST_PROJECT  a directory on the node's host the tasks use as their workspace

Without them every live test fails (it is never skipped): a green run means the client was
checked against a node. The pure unit tests (test_trajectories.py) need no node.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request

import pytest
from support import LiveNode

from tokentap_client import Node, NodeError

ENV = ("TOKENTAP_NODE_URL", "TOKENTAP_NODE_TOKEN", "TOKENTAP_TEST_PROJECT")

USAGE = (
    "the live-node tests need TOKENTAP_NODE_URL (e.g. http://127.0.0.1:8700), "
    "TOKENTAP_NODE_TOKEN (the node's bearer token) and TOKENTAP_TEST_PROJECT (a directory "
    "on the node's host for the tasks' workspace), e.g.\n"
    "  TOKENTAP_NODE_URL=http://127.0.0.1:8700 TOKENTAP_NODE_TOKEN=... "
    "TOKENTAP_TEST_PROJECT=/tmp/project python -m pytest clients/python/tests"
)


@pytest.fixture(scope="session")
def live() -> LiveNode:
    """The node under test; fails (never skips) when it is not configured or not reachable."""
    missing = [name for name in ENV if not os.environ.get(name)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not set: {USAGE}", pytrace=False)
    config = LiveNode(
        url=os.environ["TOKENTAP_NODE_URL"].rstrip("/"),
        token=os.environ["TOKENTAP_NODE_TOKEN"],
        project=os.environ["TOKENTAP_TEST_PROJECT"],
    )
    health = config.url + "/health"
    problem = None
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(health, timeout=10) as resp:
            resp.read()
    except (OSError, urllib.error.URLError) as e:
        problem = f"no tokentap node answers at {health}: {e}"
    if problem is None:
        try:
            Node(config.url, token=config.token, timeout=10).openapi()
        except NodeError as e:
            problem = f"the node at {config.url} refused TOKENTAP_NODE_TOKEN: {e}"
    if problem is not None:  # failed outside the handlers: one clear line, no traceback
        pytest.fail(problem, pytrace=False)
    return config


@pytest.fixture(scope="session")
def node(live: LiveNode) -> Node:
    return Node(live.url, token=live.token, timeout=60)
