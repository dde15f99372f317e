"""tokentap_client.trl's rollout_func on bad input, in the TRL venv (scripts/setup's `trl`
step). No engine: a node that cannot be reached is a real closed port on 127.0.0.1; the other
cases are node answers given by `CannedNode` (the node's shapes, from tokentap_client.schema).
TRL's own run of the adapter's rows (its checks, env_mask, the loss) is the heavy e2e test
train_loop."""

from types import SimpleNamespace
from typing import Any, Dict, List

import pytest

from tokentap_client.trl import TokentapRollout, tokentap_reward

PROMPT = [{"role": "user", "content": "Create an empty file named ok."}]


def trainer(max_completion_length: int = 64) -> Any:
    tok = SimpleNamespace(pad_token_id=151643, eos_token_id=151645)
    args = SimpleNamespace(temperature=1.0, top_p=1.0, max_completion_length=max_completion_length)
    return SimpleNamespace(args=args, state=SimpleNamespace(global_step=3), processing_class=tok)


def trace(sample_id: str, n_resp: int, reward: Any = None) -> Dict[str, Any]:
    return {
        "trace_id": f"{sample_id}/0", "index": 0, "group_id": "g",
        "prompt_ids": [1, 2, 3], "response_ids": list(range(10, 10 + n_resp)),
        "loss_mask": [1] * n_resp, "logprobs": [-0.5] * n_resp, "reward": reward,
        "calls": [{"response_start": 0, "sampled_len": n_resp, "finish_reason": "stop",
                   "policy_version": "3"}],
        "spans_policy_versions": False, "started_by": "session_start",
    }


class CannedNode:
    """Answers as a node would for one group: `samples` (id -> outcome) and their traces."""

    def __init__(self, outcomes: List[Dict[str, Any]], traces: Dict[str, List[Dict[str, Any]]],
                 hang: bool = False) -> None:
        self.outcomes, self._traces, self.hang, self.cancelled = outcomes, traces, hang, False

    def submit(self, task: Dict[str, Any]) -> Dict[str, Any]:
        assert task["num_samples"] == len(self.outcomes)
        return {"rollout_id": "r", "samples": [f"s{i}" for i in range(len(self.outcomes))]}

    def wait(self, rollout_id: str, timeout: float = 0) -> List[Dict[str, Any]]:
        if self.hang:
            raise TimeoutError("rollout r is still running")
        return [{"sample_id": f"s{i}", "task_id": "g", "outcome": o} for i, o in enumerate(self.outcomes)]

    def cancel(self, rollout_id: str) -> Dict[str, Any]:
        self.cancelled = True
        return {"rollout_id": rollout_id, "stopping": 0}

    def traces(self, sample_id: str) -> List[Dict[str, Any]]:
        from tokentap_client.node import NodeError

        if sample_id not in self._traces:
            raise NodeError(404, "not_found", "no traces")
        return self._traces[sample_id]


def test_a_node_that_is_down_gives_unscorable_untrained_completions() -> None:
    rollout = TokentapRollout("http://127.0.0.1:9", timeout_s=5)
    out = rollout([PROMPT] * 4, trainer())
    assert out["completion_ids"] == [[151643]] * 4 and out["env_mask"] == [[0]] * 4
    assert out["tokentap_reward"] == [None] * 4          # TRL: unscorable, advantage 0
    assert set(out["tokentap_status"]) == {"node_error"}
    assert rollout.stats["failed"] == 4 and rollout.stats["mean_reward"] is None
    assert tokentap_reward(tokentap_reward=out["tokentap_reward"]) == [None] * 4


def test_a_group_that_times_out_is_cancelled_and_fails_every_sample() -> None:
    node = CannedNode([{"status": "completed", "reward": 1.0}] * 2, {}, hang=True)
    rollout = TokentapRollout("unused", node=node, timeout_s=1)
    out = rollout([PROMPT] * 2, trainer())
    assert node.cancelled
    assert out["tokentap_status"] == ["node_timeout"] * 2 and out["tokentap_reward"] == [None] * 2


def test_no_trace_keeps_the_reward_on_a_row_that_trains_on_nothing() -> None:
    node = CannedNode([{"status": "completed", "reward": 0.0}, {"status": "completed", "reward": 1.0}],
                      {"s1": [trace("s1", 4)]})
    rollout = TokentapRollout("unused", node=node)
    out = rollout([PROMPT] * 2, trainer())
    assert out["completion_ids"][0] == [151643] and out["env_mask"][0] == [0]
    assert out["tokentap_reward"] == [0.0, 1.0]
    assert out["env_mask"][1] == [1, 1, 1, 1] and out["logprobs"][1] == [-0.5] * 4
    assert rollout.stats["no_trace"] == 1 and rollout.stats["trainable_tokens"] == 4


def test_a_trace_over_the_limit_is_clipped_at_the_response_end_never_the_prompt() -> None:
    node = CannedNode([{"status": "completed", "reward": 1.0}], {"s0": [trace("s0", 100)]})
    rollout = TokentapRollout("unused", node=node)
    out = rollout([PROMPT], trainer(max_completion_length=16))
    assert out["prompt_ids"] == [[1, 2, 3]]
    assert out["completion_ids"][0] == list(range(10, 26))
    assert len(out["env_mask"][0]) == len(out["logprobs"][0]) == 16
    assert rollout.stats["clipped"] == 1


def test_an_error_sample_has_no_reward_and_no_trainable_token() -> None:
    node = CannedNode([{"status": "error", "reason": "evaluator failed"},
                       {"status": "completed", "reward": 1.0}],
                      {"s0": [trace("s0", 3)], "s1": [trace("s1", 3)]})
    rollout = TokentapRollout("unused", node=node)
    out = rollout([PROMPT] * 2, trainer())
    assert out["tokentap_reward"] == [None, 1.0]
    assert out["env_mask"][0] == [0, 0, 0] and out["env_mask"][1] == [1, 1, 1]


def test_max_staleness_drops_samples_from_older_versions() -> None:
    old = trace("s0", 3)
    old["calls"][0]["policy_version"] = "1"                  # step 3 - 1 > 0
    node = CannedNode([{"status": "completed", "reward": 1.0}] * 2, {"s0": [old], "s1": [trace("s1", 3)]})
    rollout = TokentapRollout("unused", node=node, max_staleness=0)
    out = rollout([PROMPT] * 2, trainer())
    assert out["tokentap_reward"] == [None, 1.0] and rollout.stats["stale_dropped"] == 1


def test_groups_follow_runs_of_one_prompt() -> None:
    other = [{"role": "user", "content": "Make a file called ok."}]
    seen: List[Dict[str, Any]] = []

    class Recording(CannedNode):
        def submit(self, task: Dict[str, Any]) -> Dict[str, Any]:
            seen.append(task)
            return {"rollout_id": "r", "samples": ["s0", "s1"]}

    node = Recording([{"status": "completed", "reward": 1.0}] * 2, {})
    out = TokentapRollout("unused", node=node)([PROMPT, PROMPT, other, other], trainer())
    assert [t["num_samples"] for t in seen] == [2, 2]
    assert sorted(t["instruction"] for t in seen) == sorted([PROMPT[0]["content"], other[0]["content"]])
    assert len({t["task_id"] for t in seen}) == 2 and len(out["completion_ids"]) == 4


def test_the_reward_function_needs_the_adapter() -> None:
    with pytest.raises(ValueError, match="rollout_func"):
        tokentap_reward(prompts=[], completions=[])
