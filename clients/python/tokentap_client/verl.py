"""tokentap as verl's rollout source: an agent loop that runs its row as a `tokentap serve` task.

    # verl config (the class registers itself as "tokentap" when this module is imported;
    # or list it in rollout.agent.agent_loop_config_path with the keyword arguments below):
    actor_rollout_ref.rollout.agent.default_agent_loop=tokentap
    # and per row, a column `tokentap_task` (or extra_info.tokentap_task): the task spec

verl's `AgentLoopWorker` instantiates the loop once per row and awaits
`run(sampling_params, **row)`. Here each `run()` is one tokentap sample (`num_samples` 1):
the row's task goes to a node whose engine is verl's own inference server, the harness runs
in the node's sandbox, the evaluator rewards it, and the sample's traces come back as
`AgentLoopOutput`s with `reward_score` set (verl then skips its reward loop for them).
`rollout.n` rows of one prompt share verl's `uid`, which becomes the task id: tokentap's
group id is verl's group.

**Which node.** `node_url` (keyword, `rollout.agent.tokentap.node_url`, or
`TOKENTAP_NODE_URL`): a node or cluster already running with `--backend` at verl's
server (the addresses come from `LLMServerManager.get_addresses()` on the driver). Without
one, the loop starts one `tokentap serve` per verl server in its worker process (`tokentap`
on PATH, or `tokentap_bin`), at the addresses verl's router holds:
`server_manager._load_balancer.get_all_servers.remote()` — the one private attribute this
module uses (verl 0.9.1 gives an agent loop its `LLMServerClient`, whose only handle on the
servers is that load balancer; `get_all_servers` itself is public on the balancer). A row
goes to the node of its group (a hash of the task id), so a group shares an engine's prefix
cache.

**How many outputs.** `outputs="merged"` (default; the `AgentLoopWorker` of verl's
`ray_trainer`, which takes one output per row): the sample's main trace — under
`prefix-merge` every call that extends the last is in it; when the harness branched
(a subagent, a compaction) the trace with the most sampled tokens, the others counted in
`extra_fields["tokentap_traces_dropped"]`. `outputs="traces"` (verl's v1 trainer, whose
`AgentLoopWorkerTQ` takes a list): one output per trace, each with the sample's reward.

**Failures.** A sample without a reward (`error`, `cancelled`, a node that does not answer
within `timeout_s`): with `merged` an output that trains on nothing (the row's prompt, one
pad token with mask 0, reward 0.0: verl needs one output per row and a score on every output
for `rm_scores`); with `traces` no output (the v1 worker skips an empty list). A timed-out
agent comes back from the node with reward 0 and its masks cleared.

**Policy version.** `extra_fields["policy_version"]` (the last call's), `policy_versions`
(per call), and verl's own staleness fields `min_global_steps`/`max_global_steps` from the
versions' step numbers (resume the node with `policy_version=str(global_steps)`), else the
row's `global_steps`.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from .node import Node
from .trainers import (
    FailedPolicy,
    TrainingRow,
    arun_task,
    empty_row,
    policy_step,
    training_rows,
    zeroed,
)

__all__ = ["TokentapAgentLoop", "task_for_row", "outputs_for_sample"]


def _plain(value: Any) -> Any:
    """A row value as plain Python (verl hands numpy scalars, arrays and OmegaConf nodes)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - verl always has omegaconf
        pass
    return value


def _last_user_text(raw_prompt: Any) -> Optional[str]:
    messages = _plain(raw_prompt)
    if not isinstance(messages, list):
        return None
    for m in reversed(messages):
        if isinstance(m, Mapping) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(
                    str(p.get("text", "")) for p in content if isinstance(p, Mapping)
                )
    return None


def task_for_row(
    row: Mapping[str, Any],
    defaults: Optional[Mapping[str, Any]] = None,
    sampling_params: Optional[Mapping[str, Any]] = None,
    response_length: Optional[int] = None,
) -> Dict[str, Any]:
    """The tokentap task spec for one verl row: `defaults`, then the row's `tokentap_task`
    (a column, or a key of `extra_info`; a dict or its JSON text); `task_id` verl's `uid`
    unless given (the GRPO group), `instruction` the last user message of `raw_prompt` unless
    given, one sample, verl's temperature and top_p, and `max_tokens` verl's response length
    unless the task sets its own."""
    task: Dict[str, Any] = json.loads(json.dumps(_plain(defaults or {})))
    given = row.get("tokentap_task")
    if given is None:
        extra = _plain(row.get("extra_info")) or {}
        if isinstance(extra, Mapping):
            given = extra.get("tokentap_task")
    given = _plain(given)
    if isinstance(given, str):
        given = json.loads(given)
    if isinstance(given, Mapping):
        task.update(given)
    if "task_id" not in task:
        uid = _plain(row.get("uid"))
        index = _plain(row.get("index"))
        task["task_id"] = str(uid if uid is not None else index if index is not None else "verl")
    if "instruction" not in task:
        text = _last_user_text(row.get("raw_prompt"))
        if text is not None:
            task["instruction"] = text
    task["num_samples"] = 1
    sampling = dict(task.get("sampling") or {})
    for key in ("temperature", "top_p"):
        if sampling_params and key in sampling_params and key not in sampling:
            value = _plain(sampling_params[key])
            if value is not None:
                sampling[key] = float(value)
    if response_length and "max_tokens" not in sampling:
        sampling["max_tokens"] = int(response_length)
    if sampling:
        task["sampling"] = sampling
    return task


def _pick_main(rows: Sequence[TrainingRow]) -> TrainingRow:
    best = rows[0]
    for r in rows[1:]:
        if sum(r["response_mask"]) >= sum(best["response_mask"]):
            best = r
    return best


def _num_messages(row: TrainingRow) -> int:
    try:
        messages = json.loads(row["messages_json"])
        return len(messages) if isinstance(messages, list) else row["num_turns"]
    except ValueError:
        return row["num_turns"]


def outputs_for_sample(
    rows: List[TrainingRow],
    merged: bool,
    empty_prompt: Sequence[int],
    pad_id: int,
    elapsed_s: float,
    global_steps: Optional[int] = None,
    failed: FailedPolicy = "zero",
) -> Union[AgentLoopOutput, List[AgentLoopOutput]]:
    """`TrainingRow`s (already fitted to verl's lengths) as verl's output(s) for one row."""
    dropped = 0
    if merged:
        if not rows:
            row = zeroed(empty_row({}, status="empty", prompt_ids=empty_prompt))
        else:
            main = _pick_main(rows)
            dropped = len(rows) - 1
            row = main
        if not row["response_ids"]:
            # verl scores the last response token: give it one, with nothing to train on.
            row = {**row}
            row["response_ids"], row["response_mask"], row["logprobs"] = [pad_id], [0], [0.0]
        chosen = [row]
    else:
        chosen = list(rows)
    out: List[AgentLoopOutput] = []
    for row in chosen:
        steps = [s for s in (policy_step(v) for v in row["policy_versions"]) if s is not None]
        lo = min(steps) if steps else global_steps
        hi = max(steps) if steps else global_steps
        reward = row["reward"]
        if reward is None and failed == "zero":
            reward = 0.0
        out.append(
            AgentLoopOutput(
                prompt_ids=row["prompt_ids"],
                response_ids=row["response_ids"],
                response_mask=row["response_mask"],
                response_logprobs=row["logprobs"],
                reward_score=reward,
                num_turns=_num_messages(row),
                metrics=AgentLoopMetrics(generate_sequences=elapsed_s),
                extra_fields={
                    "turn_scores": [],
                    "tool_rewards": [],
                    "reward_extra_info": {},
                    "min_global_steps": lo,
                    "max_global_steps": hi,
                    "policy_version": row["policy_version"],
                    "policy_versions": row["policy_versions"],
                    "tokentap_sample_id": row["sample_id"],
                    "tokentap_trace_id": row["trace_id"],
                    "tokentap_group_id": row["group_id"],
                    "tokentap_status": row["status"],
                    "tokentap_reason": row["reason"],
                    "tokentap_stop_reason": row["stop_reason"],
                    "tokentap_stale": row["stale"],
                    "tokentap_branch_cause": row["branch_cause"],
                    "tokentap_clipped": row["clipped"],
                    "tokentap_traces_dropped": dropped,
                },
            )
        )
    return out[0] if merged else out


# -- nodes this process started (no node_url) ---------------------------------------------


class _ManagedNode:
    def __init__(self, engine: str, kind: str, binary: str, extra: Sequence[str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="tokentap-verl-node-")
        self.token = secrets.token_hex(16)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(os.path.join(self.dir, "serve.log"), "wb")
        env = {**os.environ, "TOKENTAP_NODE_TOKEN": self.token}
        self.proc = subprocess.Popen(
            [binary, "serve", "--listen", f"127.0.0.1:{port}", "--data", self.dir,
             "--backend", engine, "--backend-kind", kind, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokentap serve exited: see {self.dir}/serve.log")
            try:
                with opener.open(self.url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tokentap serve not healthy in 60 s: {self.dir}/serve.log")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_MANAGED: Dict[str, _ManagedNode] = {}


def _stop_managed() -> None:
    for node in _MANAGED.values():
        node.stop()
    _MANAGED.clear()


atexit.register(_stop_managed)


@register("tokentap")
class TokentapAgentLoop(AgentLoopBase):
    """verl's agent loop over a tokentap node; see the module's documentation."""

    def __init__(
        self,
        *args: Any,
        node_url: Optional[str] = None,
        node_token: Optional[str] = None,
        task: Optional[Mapping[str, Any]] = None,
        outputs: Optional[str] = None,
        failed: Optional[str] = None,
        timeout_s: Optional[float] = None,
        backend_kind: Optional[str] = None,
        tokentap_bin: Optional[str] = None,
        serve_args: Optional[Sequence[str]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        block = _plain(self.rollout_config.get("agent", {}).get("tokentap", None)) or {}
        if not isinstance(block, Mapping):
            block = {}

        def pick(name: str, given: Any, env: Optional[str] = None, default: Any = None) -> Any:
            if given is not None:
                return _plain(given)
            if name in block:
                return block[name]
            if env and os.environ.get(env):
                return os.environ[env]
            return default

        self.node_url: Optional[str] = pick("node_url", node_url, "TOKENTAP_NODE_URL")
        self.node_token: Optional[str] = pick("node_token", node_token, "TOKENTAP_NODE_TOKEN")
        self.task_defaults: Mapping[str, Any] = pick("task", task, default={}) or {}
        self.outputs: str = pick("outputs", outputs, default="merged")
        if self.outputs not in ("merged", "traces"):
            raise ValueError(f"outputs must be 'merged' or 'traces', not {self.outputs!r}")
        self.failed: FailedPolicy = pick(
            "failed", failed, default="zero" if self.outputs == "merged" else "exclude"
        )
        self.timeout_s = float(pick("timeout_s", timeout_s, default=3600.0))
        self.backend_kind: str = pick("backend_kind", backend_kind, default="vllm")
        self.tokentap_bin: Optional[str] = pick("tokentap_bin", tokentap_bin, "TOKENTAP_BIN")
        self.serve_args: List[str] = list(pick("serve_args", serve_args, default=[]))

    async def _node_for(self, task_id: str) -> Node:
        if self.node_url:
            return Node(self.node_url, token=self.node_token, timeout=120)
        # verl's servers, as its router holds them (the one private attribute: see above).
        balancer = self.server_manager._load_balancer
        addresses = sorted(await balancer.get_all_servers.remote())
        if not addresses:
            raise RuntimeError("verl's load balancer holds no inference server")
        address = addresses[zlib.crc32(task_id.encode()) % len(addresses)]
        engine = address if "://" in address else f"http://{address}"
        if engine not in _MANAGED:
            binary = self.tokentap_bin or shutil.which("tokentap")
            if not binary:
                raise RuntimeError("no node_url and no tokentap binary (PATH or tokentap_bin)")
            node = await asyncio.to_thread(
                _ManagedNode, engine, self.backend_kind, binary, self.serve_args
            )
            if engine in _MANAGED:  # another row of this process started one meanwhile
                await asyncio.to_thread(node.stop)
            else:
                _MANAGED[engine] = node
        managed = _MANAGED[engine]
        return Node(managed.url, token=managed.token, timeout=120)

    def _prompt_ids(self, raw_prompt: Any) -> List[int]:
        """The row's own prompt in verl's tokenizer (for an output of a sample with no trace)."""
        try:
            text = self.tokenizer.apply_chat_template(
                _plain(raw_prompt), add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return [int(i) for i in ids][-int(self.rollout_config.prompt_length):]
        except Exception:  # noqa: BLE001 - a prompt is a courtesy here, never a failure
            return []

    async def run(
        self, sampling_params: Dict[str, Any], **kwargs: Any
    ) -> Union[AgentLoopOutput, List[AgentLoopOutput]]:
        started = time.monotonic()
        prompt_length = int(self.rollout_config.prompt_length)
        response_length = int(self.rollout_config.response_length)
        task = task_for_row(kwargs, self.task_defaults, sampling_params, response_length)
        node = await self._node_for(str(task["task_id"]))
        sample, traces = await arun_task(node, task, self.timeout_s)
        rows = training_rows(
            sample,
            traces,
            failed="zero" if self.outputs == "merged" else self.failed,
            max_prompt_len=prompt_length,
            max_response_len=response_length,
        )
        merged = self.outputs == "merged"
        if merged and not rows:  # no trace: no model call, or a failed sample
            rows = [empty_row(sample, prompt_ids=self._prompt_ids(kwargs.get("raw_prompt")))]
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id or 0
        global_steps = _plain(kwargs.get("global_steps"))
        return outputs_for_sample(
            rows,
            merged=merged,
            empty_prompt=[],
            pad_id=int(pad),
            elapsed_s=time.monotonic() - started,
            global_steps=int(global_steps) if global_steps is not None else None,
            failed=self.failed,
        )
