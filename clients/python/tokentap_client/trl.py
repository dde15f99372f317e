"""tokentap as TRL's rollout source: GRPO's generations are `tokentap serve` samples of a real
harness, and the trained weights go back into the engine the node calls, every step.

    from trl import GRPOConfig, GRPOTrainer
    from tokentap_client.trl import TokentapRollout, VllmWeightSync, tokentap_reward

    rollout = TokentapRollout(node_url="http://NODE:8700", node_token="...",
                              task={"harness": {"name": "pi"}, "workspace": ..., "evaluator": ...})
    trainer = GRPOTrainer(model=MODEL_DIR, args=GRPOConfig(num_generations=4, ...),
                          train_dataset=prompts, reward_funcs=[tokentap_reward],
                          rollout_func=rollout)
    trainer.add_callback(VllmWeightSync(engine_url="http://ENGINE:8000", node=rollout.node,
                                        model_dir=MODEL_DIR, rollout=rollout))
    trainer.train()

**Groups.** TRL hands `rollout_func(prompts, trainer)` its prompt slice with each prompt
repeated `num_generations` times in a row (its `RepeatSampler`). Each run of one prompt becomes
one tokentap task of `num_samples` = the run's length (one GRPO group: the node runs the
samples side by side, and its group id is the task id), and the samples come back in the
slots of that run. The task is `task`, then `tasks[instruction]` when given; its instruction
is the prompt's last user message (or the prompt itself, for a plain-text dataset).

**What TRL gets per sample** (from `tokentap_client.trainers.training_rows`, the one mapping):
`prompt_ids` = the first call's prompt, exactly as the engine saw it; `completion_ids` =
everything after it (each call's sampled ids and, between calls, the tool results and
template glue the next prompt added); `env_mask` = the row's `response_mask` (1 where the model
sampled the token, 0 for tool output and glue: TRL's tool mask, which keeps those out of the
loss); `logprobs` = the sampler's logprob per completion token (0.0 under mask 0, which TRL's
importance-sampling correction masks out too). Every other key goes to the reward functions:
`tokentap_reward` (the evaluator's reward, None when the sample has none), `tokentap_status`,
`tokentap_sample_id`, `tokentap_policy_version`, `tokentap_stale`.

**Several traces.** TRL takes one sequence per sample. A harness that branches (a subagent, a
compaction, re-rendered history) leaves more than one trace: the sample trains on its main
trace (the one with the most sampled tokens, `trainers.main_row`), with the sample's reward,
and the others are counted in `stats["traces_dropped"]`. Under `prefix-merge` (and token-in
mode, which keeps an append-only conversation one trace) most samples have one.

**Failures** (a node down, a group over `timeout_s`, an `error`/`cancelled` sample): a
completion of one pad token with `env_mask` 0 and reward None. TRL 1.16 takes a completion
whose every reward is None as unscorable: it is left out of its group's baseline and gets
advantage 0, so it neither trains nor shifts the others (never a silent zero). A sample that
completed without a model call keeps its reward on a one-pad-token row that trains on nothing.
A trace over `max_completion_length` is clipped at the response end (`trainers.fit`). Counted
per step in `stats`.

**Staleness.** With `max_staleness = k`, a sample any of whose calls ran under a policy
version (a step number: resume the node with `str(step)`) more than k steps behind the
trainer's step is handled like a failed one (mask 0, reward None) and counted in
`stats["stale_dropped"]`; None keeps every sample (`stats["stale"]` counts those spanning two
versions).

**Mismatch.** With `measure_mismatch=True` the adapter runs the trainer's model over every
returned sequence right after the rollout (the weights the engine was last given) and compares
its logprob of each mask-1 token with the captured one (`tokentap_client.mismatch`):
`stats["mismatch"]`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import time
import urllib.request
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from transformers import TrainerCallback

from .mismatch import MismatchStats, logprob_mismatch
from .node import Node
from .trainers import (
    FAILED_STATUSES,
    TrainingRow,
    empty_row,
    main_row,
    policy_step,
    run_group,
    training_rows,
    zeroed,
)

__all__ = [
    "TokentapRollout",
    "VllmWeightSync",
    "tokentap_reward",
    "trainer_logprobs",
]


def _instruction(prompt: Any) -> str:
    """The text a TRL prompt asks: its last user message, or the prompt itself."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        for m in reversed(prompt):
            if isinstance(m, Mapping) and m.get("role") == "user":
                content = m.get("content")
                if isinstance(content, str):
                    return content
                if isinstance(content, list):
                    return "".join(
                        str(p.get("text", "")) for p in content if isinstance(p, Mapping)
                    )
    raise ValueError(f"a prompt without a user message: {prompt!r}")


def _runs(prompts: Sequence[Any]) -> List[Tuple[int, int]]:
    """(start, length) of each run of equal consecutive prompts: TRL's groups."""
    runs: List[Tuple[int, int]] = []
    i = 0
    while i < len(prompts):
        j = i + 1
        while j < len(prompts) and prompts[j] == prompts[i]:
            j += 1
        runs.append((i, j - i))
        i = j
    return runs


def tokentap_reward(
    prompts: Any = None, completions: Any = None, tokentap_reward: Any = None, **kwargs: Any
) -> List[Optional[float]]:
    """TRL reward function: the evaluator's reward of each sample as the node gave it (None
    where the sample has none, which TRL leaves out of the group's baseline)."""
    if tokentap_reward is None:
        raise ValueError("tokentap_reward needs TokentapRollout as the trainer's rollout_func")
    return [None if r is None else float(r) for r in tokentap_reward]


def trainer_logprobs(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    temperature: float = 1.0,
) -> List[List[float]]:
    """The model's logprob of every completion token given everything before it, one
    sequence at a time (no padding, so nothing but the ids themselves can differ from what the
    engine computed), without gradients. `temperature` divides the logits as the sampler did."""
    out: List[List[float]] = []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for p, c in zip(prompt_ids, completion_ids):
                if not c:
                    out.append([])
                    continue
                ids = torch.tensor([list(p) + list(c)], device=device)
                # Only the completion's logits (a long prompt times a large vocabulary would
                # not fit): the last len(c) + 1 positions, the final one predicting nothing.
                logits = model(input_ids=ids, logits_to_keep=len(c) + 1).logits[0, :-1].float()
                logits = logits / temperature
                lp = torch.log_softmax(logits, dim=-1)
                picked = lp.gather(1, torch.tensor(list(c), device=device).unsqueeze(1))
                out.append([float(x) for x in picked.squeeze(1).tolist()])
    finally:
        if was_training:
            model.train()
    return out


class TokentapRollout:
    """TRL's `rollout_func` over a tokentap node; see the module's documentation. `stats`
    holds the last call's counts (and mismatch), `history` every call's."""

    def __init__(
        self,
        node_url: str,
        node_token: Optional[str] = None,
        task: Optional[Mapping[str, Any]] = None,
        tasks: Optional[Mapping[str, Mapping[str, Any]]] = None,
        timeout_s: float = 3600.0,
        max_staleness: Optional[int] = None,
        measure_mismatch: bool = False,
        mismatch_threshold: float = 0.1,
        node: Optional[Node] = None,
    ) -> None:
        self.node = node or Node(node_url, token=node_token, timeout=120)
        self.task_defaults: Dict[str, Any] = json.loads(json.dumps(dict(task or {})))
        self.tasks = {k: dict(v) for k, v in (tasks or {}).items()}
        self.timeout_s = timeout_s
        self.max_staleness = max_staleness
        self.measure_mismatch = measure_mismatch
        self.mismatch_threshold = mismatch_threshold
        self.stats: Dict[str, Any] = {}
        self.history: List[Dict[str, Any]] = []
        self.last_rows: List[TrainingRow] = []
        self.last_trainer_logprobs: List[List[float]] = []
        self._groups = 0

    def task_for(self, prompt: Any, n: int, trainer: Any) -> Dict[str, Any]:
        """The task spec of one group: `n` samples of `prompt`."""
        text = _instruction(prompt)
        task: Dict[str, Any] = json.loads(json.dumps(self.task_defaults))
        task.update(json.loads(json.dumps(self.tasks.get(text, {}))))
        task.setdefault("instruction", text)
        if "task_id" not in task:
            # One id per group and step: the node's group id, unique across steps.
            step = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)
            task["task_id"] = f"trl-{step}-{self._groups}"
        self._groups += 1
        task["num_samples"] = n
        sampling = dict(task.get("sampling") or {})
        args = getattr(trainer, "args", None)
        for key in ("temperature", "top_p"):
            value = getattr(args, key, None)
            if value is not None and key not in sampling:
                sampling[key] = float(value)
        limit = getattr(args, "max_completion_length", None)
        if limit and "max_tokens" not in sampling:
            sampling["max_tokens"] = int(limit)
        task["sampling"] = sampling
        return task

    def _pad_id(self, trainer: Any) -> int:
        tok = getattr(trainer, "processing_class", None)
        tok = getattr(tok, "tokenizer", tok)
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(tok, attr, None) if tok is not None else None
            if value is not None:
                return int(value)
        return 0

    def _rows(
        self, sample: Mapping[str, Any], traces: List[Dict[str, Any]], trainer: Any, counts: Dict[str, int]
    ) -> TrainingRow:
        """The one row sample trains on (see the module's documentation)."""
        args = getattr(trainer, "args", None)
        rows = training_rows(
            sample, traces, failed="zero", max_response_len=getattr(args, "max_completion_length", None)
        )
        status = str((sample.get("outcome") or {}).get("status", "unknown"))
        failed = status in FAILED_STATUSES
        if not rows:
            row = empty_row(sample)
            counts["no_trace"] += 1
        else:
            row, dropped = main_row(rows)
            counts["traces_dropped"] += dropped
        if failed:
            row = {**zeroed(row), "reward": None}
            counts["failed"] += 1
        step = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)
        if self.max_staleness is not None and not failed:
            steps = [s for s in (policy_step(v) for v in row["policy_versions"]) if s is not None]
            if steps and step - min(steps) > self.max_staleness:
                row = {**zeroed(row), "reward": None}
                counts["stale_dropped"] += 1
        counts["stale"] += int(row["stale"])
        counts["clipped"] += int(row["clipped"])
        if not row["response_ids"]:
            # TRL needs a token per completion: one pad token, never trained on.
            row = {**row, "response_ids": [self._pad_id(trainer)], "response_mask": [0], "logprobs": [0.0]}
        return row

    def __call__(self, prompts: List[Any], trainer: Any) -> Dict[str, Any]:
        started = time.monotonic()
        runs = _runs(prompts)
        counts = {k: 0 for k in ("failed", "no_trace", "traces_dropped", "stale", "stale_dropped", "clipped")}
        # Every group is submitted before any is waited on, so the node runs them side by side.
        specs = [self.task_for(prompts[i], n, trainer) for i, n in runs]
        results = _parallel([functools.partial(run_group, self.node, s, self.timeout_s) for s in specs])
        rows: List[TrainingRow] = []
        for group in results:
            for sample, traces in group:
                rows.append(self._rows(sample, traces, trainer, counts))
        if len(rows) != len(prompts):
            raise RuntimeError(f"{len(rows)} samples for {len(prompts)} prompts")
        rollout_s = time.monotonic() - started
        out: Dict[str, Any] = {
            "prompt_ids": [r["prompt_ids"] for r in rows],
            "completion_ids": [r["response_ids"] for r in rows],
            "logprobs": [r["logprobs"] for r in rows],
            "env_mask": [r["response_mask"] for r in rows],
            "tokentap_reward": [r["reward"] for r in rows],
            "tokentap_status": [r["status"] for r in rows],
            "tokentap_sample_id": [r["sample_id"] for r in rows],
            "tokentap_policy_version": [r["policy_version"] for r in rows],
            "tokentap_stale": [r["stale"] for r in rows],
        }
        mismatch: Optional[MismatchStats] = None
        mismatch_s = 0.0
        if self.measure_mismatch:
            t0 = time.monotonic()
            model = getattr(trainer, "model", None)
            temperature = float(getattr(getattr(trainer, "args", None), "temperature", 1.0) or 1.0)
            lps = trainer_logprobs(model, out["prompt_ids"], out["completion_ids"], temperature)
            self.last_trainer_logprobs = lps
            mismatch = logprob_mismatch(lps, out["logprobs"], out["env_mask"], self.mismatch_threshold)
            mismatch_s = time.monotonic() - t0
        rewards = [r["reward"] for r in rows if r["reward"] is not None]
        self.last_rows = rows
        self.stats = {
            "samples": len(rows),
            "groups": len(runs),
            "rewarded": len(rewards),
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "trainable_tokens": sum(sum(r["response_mask"]) for r in rows),
            "policy_versions": sorted({str(v) for r in rows for v in r["policy_versions"] if v is not None}),
            "rollout_s": rollout_s,
            "mismatch_s": mismatch_s,
            "mismatch": mismatch,
            **counts,
        }
        self.history.append(self.stats)
        return out


def _parallel(jobs: Sequence[Callable[[], Any]]) -> List[Any]:
    """Runs blocking jobs on threads of their own; their results in order."""
    from concurrent.futures import ThreadPoolExecutor

    if len(jobs) <= 1:
        return [j() for j in jobs]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        return list(pool.map(lambda j: j(), jobs))


def _post(url: str, body: Optional[Mapping[str, Any]] = None, timeout: float = 300.0) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST")
    req.add_header("content-type", "application/json")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=timeout) as resp:
        text = resp.read()
    return json.loads(text) if text.strip() else None


def _get(url: str, timeout: float = 30.0) -> Any:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class VllmWeightSync(TrainerCallback):
    """After every optimizer step, the trainer's weights into the running vLLM, without a
    restart, under tokentap's gate:

    1. `node.pause()`: the node's capture holds new model calls (harnesses see a slower
       answer) and returns once none is in flight;
    2. vLLM `POST /pause?mode=wait` (nothing else reaches it either);
    3. the model's state dict as safetensors into `weights_dir` (on /dev/shm when there is
       one), then `POST /collective_rpc {"method": "reload_weights", "kwargs":
       {"weights_path": DIR}}`: each worker loads the files in place;
    4. `POST /reset_prefix_cache` (no KV computed under the old weights is reused) and
       `POST /update_weight_version {"new_version": STEP}`;
    5. vLLM `POST /resume`, then `node.resume(policy_version=STEP)`: held calls go on, and
       every later call records the new version.

    vLLM's own weight-transfer engines (`/init_weight_transfer_engine`, `/update_weights`,
    `/finish_weight_update`) are the fast path on GPUs, but every backend vLLM 0.32 ships
    (nccl, ipc, sparse_nccl, nccl_m2n, sharded_rdt) needs CUDA: on the CPU build
    `init_weight_transfer_engine` answers 500 "Found no NVIDIA driver" (docs/training.md). The
    reload from disk needs vLLM started with `VLLM_SERVER_DEV_MODE=1` (the RL and
    `collective_rpc` routes exist only then). `timings` holds each update's seconds."""

    def __init__(
        self,
        engine_url: str,
        node: Optional[Node],
        model_dir: str,
        weights_dir: Optional[str] = None,
        rollout: Optional[TokentapRollout] = None,
        on_update: Optional[Callable[[Dict[str, Any]], None]] = None,
    ) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.node = node
        self.model_dir = model_dir
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self.weights_dir = weights_dir or tempfile.mkdtemp(prefix="tokentap-weights-", dir=base)
        self._own_dir = weights_dir is None
        self.rollout = rollout
        self.on_update = on_update
        self.timings: List[Dict[str, Any]] = []
        # vLLM's loader reads the checkpoint's config with the weights: keep the model's files.
        for name in os.listdir(model_dir):
            if name.endswith(".json") or name.endswith(".jinja"):
                shutil.copyfile(os.path.join(model_dir, name), os.path.join(self.weights_dir, name))

    def weight_version(self) -> str:
        """vLLM's `GET /weight_info` version."""
        return str(_get(f"{self.engine_url}/weight_info")["weight_version"])

    def push(self, model: Any, version: str) -> Dict[str, Any]:
        """One update (the steps above); returns its timings in seconds."""
        from safetensors.torch import save_file

        t0 = time.monotonic()
        gate = self.node.pause() if self.node is not None else None
        t_paused = time.monotonic()
        _post(f"{self.engine_url}/pause?mode=wait")
        try:
            state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
            tmp = os.path.join(self.weights_dir, "model.safetensors.tmp")
            save_file(state, tmp, metadata={"format": "pt"})
            os.replace(tmp, os.path.join(self.weights_dir, "model.safetensors"))
            t_saved = time.monotonic()
            _post(
                f"{self.engine_url}/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": self.weights_dir}},
            )
            t_loaded = time.monotonic()
            _post(f"{self.engine_url}/reset_prefix_cache")
            _post(f"{self.engine_url}/update_weight_version", {"new_version": version})
        finally:
            _post(f"{self.engine_url}/resume")
            if self.node is not None:
                self.node.resume(policy_version=version)
        t1 = time.monotonic()
        timing = {
            "version": version,
            "weight_update_s": t1 - t0,
            "gate_pause_s": t_paused - t0,
            "save_s": t_saved - t_paused,
            "reload_s": t_loaded - t_saved,
            "paused_in_flight": None if gate is None else gate.get("in_flight"),
        }
        self.timings.append(timing)
        if self.on_update is not None:
            self.on_update(timing)
        return timing

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        self.push(model, str(state.global_step))
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._own_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
        return control
