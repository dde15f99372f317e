"""The trainer adapters against their real packages over a live node and a real engine.

Run inside a trainer's own venv (verl 0.9.1 or skyrl 0.3.0; scripts/setup's `trainers` step)
by tests/tests/e2e/trainers.rs, which starts llama-server on the tiny test model and a
`tokentap serve` in front of it, then sets:

    TOKENTAP_NODE_URL, TOKENTAP_NODE_TOKEN   the node
    TOKENTAP_TEST_PROJECT                    a directory the tasks use as their workspace
    TOKENTAP_ENGINE_URL                      the engine (the verl test's own nodes)
    TOKENTAP_BIN                             the tokentap binary (idem)

Without them every test here fails (never skips), saying what is missing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

ENV = ("TOKENTAP_NODE_URL", "TOKENTAP_NODE_TOKEN", "TOKENTAP_TEST_PROJECT", "TOKENTAP_ENGINE_URL", "TOKENTAP_BIN")


@dataclass(frozen=True)
class Live:
    url: str
    token: str
    project: str
    engine: str
    binary: str


@pytest.fixture(scope="session")
def live() -> Live:
    missing = [n for n in ENV if not os.environ.get(n)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not set (tests/tests/e2e/trainers.rs sets them)", pytrace=False)
    return Live(
        url=os.environ["TOKENTAP_NODE_URL"].rstrip("/"),
        token=os.environ["TOKENTAP_NODE_TOKEN"],
        project=os.environ["TOKENTAP_TEST_PROJECT"],
        engine=os.environ["TOKENTAP_ENGINE_URL"].rstrip("/"),
        binary=os.environ["TOKENTAP_BIN"],
    )
