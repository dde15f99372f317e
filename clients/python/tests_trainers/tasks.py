"""Task specs for the trainer tests: `sh -c` agents calling the model through the capture."""

from __future__ import annotations

from typing import Any, Dict


def call(content: str, max_tokens: int = 8) -> str:
    """One chat call through the node's capture (the node sets OPENAI_BASE_URL and the key)."""
    return (
        'curl -sS --max-time 60 "$OPENAI_BASE_URL/chat/completions"'
        " -H 'content-type: application/json'"
        ' -H "authorization: Bearer $OPENAI_API_KEY"'
        f""" -d '{{"model":"m","messages":[{{"role":"user","content":"{content}"}}],"max_tokens":{max_tokens}}}'"""
        " > /dev/null"
    )


def task(project: str, script: str, **extra: Any) -> Dict[str, Any]:
    """A task whose agent runs `script`, rewarded 1.0 when it leaves a file `ok` behind."""
    spec: Dict[str, Any] = {
        "workspace": {"dir": {"path": project}},
        "harness": {"name": "command", "argv": ["sh", "-c", "rm -f ok; " + script]},
        "evaluator": {"kind": "command", "command": "test -f ok"},
    }
    spec.update(extra)
    return spec


def winner(content: str = "hello", max_tokens: int = 8) -> str:
    return f"{call(content, max_tokens)} && touch ok"


def loser(content: str = "hello", max_tokens: int = 8) -> str:
    return call(content, max_tokens)
