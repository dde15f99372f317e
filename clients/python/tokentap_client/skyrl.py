"""tokentap as SkyRL's generator: each prompt of a batch runs as a `tokentap serve` sample.

    from skyrl.train.entrypoints.main_base import BasePPOExp
    from tokentap_client.skyrl import TokentapGenerator

    class Exp(BasePPOExp):
        def get_generator(self, cfg, tokenizer, inference_engine_client):
            return TokentapGenerator(
                node_url="http://NODE:8700", node_token="...",       # a node whose --backend is
                task={"harness": {"name": "pi"}, ...},                # inference_engine_client
                tokenizer=tokenizer,                                  #   .get_endpoint_url()
                step_wise=cfg.generator.step_wise_trajectories,
                max_seq_len=cfg.trainer.algorithm.max_seq_len,
                max_response_len=cfg.generator.sampling_params.max_generate_length,
                inference_engine_client=inference_engine_client,
            )

`generate(GeneratorInput) -> GeneratorOutput`, in input order. Prompt i's task is `task`,
then `env_extras[i]["tokentap_task"]` (a dict or its JSON text); its `task_id` is
`trajectory_ids[i].instance_id` (SkyRL's group: its `n_samples_per_prompt` repetitions share
it), its instruction the prompt's last user message, one sample each, all prompts at once.

**Rows.** Without `step_wise`, one row per prompt (SkyRL asserts as many responses as
prompts): the sample's main trace (the one with the most sampled tokens; the others counted
in `rollout_metrics["tokentap/traces_dropped"]`). With `step_wise`, one row per model call
of every trace: prompt = everything the call saw, response = the tokens it sampled, and
`is_last_step` true on the last call of the sample's last trace; `trajectory_ids` repeat
the prompt's id on each of its rows. `rewards` are per-token lists (SkyRL's layout): the
reward on the last response token of a trajectory's last row, 0.0 elsewhere.
`stop_reasons` the call's finish reason (`length` when clipped to `max_seq_len` /
`max_response_len` at the response end).

**Failures.** SkyRL needs a row per prompt: a sample without a reward (`error`, `cancelled`,
a node that does not answer within `timeout_s`) gives its traces with every mask bit cleared
and reward 0.0, or one row of one pad token with mask 0 when it has no trace.

**Policy version.** `weight_version` of `inference_engine_client` (when given) is what the
node should run under: call `node.resume(policy_version=...)` after each weight sync;
`rollout_metrics["tokentap/stale_rows"]` counts rows whose calls spanned two versions.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput

from .node import Node
from .trainers import TrainingRow, arun_task, empty_row, training_rows

__all__ = ["TokentapGenerator", "rows_to_generator_output", "step_rows"]


def _last_user_text(prompt: Any) -> Optional[str]:
    if isinstance(prompt, list):
        for m in reversed(prompt):
            if isinstance(m, Mapping) and m.get("role") == "user":
                content = m.get("content")
                if isinstance(content, str):
                    return content
    return None


def step_rows(row: TrainingRow) -> List[TrainingRow]:
    """A trace as one row per model call (SkyRL's step-wise rows): each call's prompt is the
    trace's prompt plus the response before the call's sampled tokens; its response is the
    tokens it sampled. Tokens between calls (tool results) are in the next call's prompt."""
    out: List[TrainingRow] = []
    calls = row["calls"]
    n = len(row["response_ids"])
    for k, call in enumerate(calls):
        start = int(call["response_start"])
        end = min(start + int(call["sampled_len"]), n)
        if start >= n:
            break
        step: TrainingRow = {**row}
        step["prompt_ids"] = row["prompt_ids"] + row["response_ids"][:start]
        step["response_ids"] = row["response_ids"][start:end]
        step["response_mask"] = row["response_mask"][start:end]
        step["logprobs"] = row["logprobs"][start:end]
        step["stop_reason"] = call.get("finish_reason") or row["stop_reason"]
        if row["clipped"] and end == n:
            step["stop_reason"] = "length"
        step["calls"] = [call]
        step["num_turns"] = 1
        step["policy_versions"] = [call.get("policy_version")]
        step["policy_version"] = call.get("policy_version")
        out.append(step)
    return out or [row]


def _with_token(row: TrainingRow, pad_id: int) -> TrainingRow:
    if row["response_ids"]:
        return row
    out: TrainingRow = {**row}
    out["response_ids"], out["response_mask"], out["logprobs"] = [pad_id], [0], [0.0]
    return out


def rows_to_generator_output(
    per_prompt: Sequence[Tuple[Any, List[TrainingRow]]],
    step_wise: bool,
    pad_id: int,
    elapsed: Optional[Sequence[float]] = None,
) -> GeneratorOutput:
    """Each prompt's (trajectory id, rows) as one `GeneratorOutput` (see the module's doc)."""
    prompt_ids: List[List[int]] = []
    responses: List[List[int]] = []
    rewards: List[List[float]] = []
    masks: List[List[int]] = []
    logprobs: List[List[float]] = []
    stops: List[str] = []
    traj_ids: List[Any] = []
    last: List[bool] = []
    times: List[float] = []
    dropped = stale = 0
    for i, (traj_id, rows) in enumerate(per_prompt):
        if step_wise:
            chosen = [s for r in rows for s in step_rows(r)]
        else:
            main = rows[0]
            for r in rows[1:]:
                if sum(r["response_mask"]) >= sum(main["response_mask"]):
                    main = r
            dropped += len(rows) - 1
            chosen = [main]
        chosen = [_with_token(r, pad_id) for r in chosen]
        for j, r in enumerate(chosen):
            is_last = j == len(chosen) - 1
            reward = [0.0] * len(r["response_ids"])
            if is_last:
                reward[-1] = float(r["reward"] or 0.0)
            prompt_ids.append(r["prompt_ids"])
            responses.append(r["response_ids"])
            rewards.append(reward)
            masks.append(r["response_mask"])
            logprobs.append(r["logprobs"])
            stops.append(r["stop_reason"] or "stop")
            traj_ids.append(traj_id)
            last.append(is_last)
            stale += int(r["stale"])
            if elapsed is not None:
                times.append(elapsed[i])
    out: GeneratorOutput = {
        "prompt_token_ids": prompt_ids,
        "response_ids": responses,
        "rewards": rewards,
        "loss_masks": masks,
        "stop_reasons": stops,
        "rollout_metrics": {
            "tokentap/traces_dropped": dropped,
            "tokentap/stale_rows": stale,
            "tokentap/rows": len(responses),
        },
        "rollout_logprobs": logprobs,
        "trajectory_ids": traj_ids if (step_wise or any(t is not None for t in traj_ids)) else None,
        "trajectory_generation_times": times if elapsed is not None else None,
        "rollout_expert_indices": None,
        "is_last_step": last if step_wise else None,
        "env_metrics": [{} for _ in responses],
        "pixel_values": None,
        "image_grid_thw": None,
    }
    return out


class TokentapGenerator(GeneratorInterface):
    """SkyRL's `GeneratorInterface` over a tokentap node; see the module's documentation."""

    def __init__(
        self,
        node_url: str,
        node_token: Optional[str] = None,
        task: Optional[Mapping[str, Any]] = None,
        tokenizer: Any = None,
        step_wise: bool = False,
        max_seq_len: Optional[int] = None,
        max_response_len: Optional[int] = None,
        timeout_s: float = 3600.0,
        inference_engine_client: Any = None,
    ) -> None:
        self.node = Node(node_url, token=node_token, timeout=120)
        self.task_defaults: Dict[str, Any] = json.loads(json.dumps(dict(task or {})))
        self.tokenizer = tokenizer
        self.step_wise = step_wise
        self.max_seq_len = max_seq_len
        self.max_response_len = max_response_len
        self.timeout_s = timeout_s
        self.inference_engine_client = inference_engine_client

    def task_for(self, i: int, input_batch: Mapping[str, Any]) -> Dict[str, Any]:
        """The task spec of prompt `i` of the batch."""
        task: Dict[str, Any] = json.loads(json.dumps(self.task_defaults))
        extras = (input_batch.get("env_extras") or [None] * (i + 1))[i] or {}
        given = extras.get("tokentap_task") if isinstance(extras, Mapping) else None
        if isinstance(given, str):
            given = json.loads(given)
        if isinstance(given, Mapping):
            task.update(given)
        traj = (input_batch.get("trajectory_ids") or [None] * (i + 1))[i]
        if "task_id" not in task:
            task["task_id"] = str(traj.instance_id) if traj is not None else f"skyrl-{i}"
        if "instruction" not in task:
            text = _last_user_text(input_batch["prompts"][i])
            if text is not None:
                task["instruction"] = text
        task["num_samples"] = 1
        sampling = dict(task.get("sampling") or {})
        params = input_batch.get("sampling_params") or {}
        for key in ("temperature", "top_p"):
            if key in params and key not in sampling and params[key] is not None:
                sampling[key] = float(params[key])
        limit = params.get("max_generate_length") or params.get("max_tokens") or self.max_response_len
        if limit and "max_tokens" not in sampling:
            sampling["max_tokens"] = int(limit)
        if sampling:
            task["sampling"] = sampling
        return task

    def _pad_id(self) -> int:
        tok = self.tokenizer
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(tok, attr, None) if tok is not None else None
            if value is not None:
                return int(value)
        return 0

    async def _one(self, i: int, input_batch: Mapping[str, Any]) -> Tuple[List[TrainingRow], float]:
        started = time.monotonic()
        sample, traces = await arun_task(self.node, self.task_for(i, input_batch), self.timeout_s)
        rows = training_rows(
            sample,
            traces,
            failed="zero",
            max_response_len=self.max_response_len,
            max_seq_len=self.max_seq_len,
        )
        if not rows:
            rows = [empty_row(sample)]
        return rows, time.monotonic() - started

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        n = len(input_batch["prompts"])
        done = await asyncio.gather(*(self._one(i, input_batch) for i in range(n)))
        traj = input_batch.get("trajectory_ids") or [None] * n
        return rows_to_generator_output(
            [(traj[i], rows) for i, (rows, _) in enumerate(done)],
            step_wise=self.step_wise,
            pad_id=self._pad_id(),
            elapsed=[t for _, t in done],
        )

