"""tokentap_client.verl against the real verl 0.9.1 (CPU, no GPU) over a live node.

The rows go through verl's own `AgentLoopWorker.generate_sequences` (the worker is built the
way verl's own `*_on_cpu` tests build it: `object.__new__` and the attributes its methods
read, since its constructor loads a model): verl instantiates the registered "tokentap" loop
per row with hydra, awaits `run(sampling_params, **row)`, pads and masks each output with its
`_agent_loop_postprocess` and batches them with `_postprocess` into a `DataProto`. The v1
trainer's path is `AgentLoopWorkerTQ._run_agent_loop`, its TransferQueue put captured.
Every expectation is read back from the node's own traces.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch
from conftest import Live
from omegaconf import OmegaConf
from tasks import call, loser, task, winner
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.protocol import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset

import tokentap_client.verl  # noqa: F401  (registers the "tokentap" agent loop)
from tokentap_client import Node

PROMPT_LEN, RESPONSE_LEN = 512, 64
PAD = 0


def hf_tokenizer() -> PreTrainedTokenizerFast:
    """A real Hugging Face tokenizer (verl pads with its `pad`); its vocabulary is beside the
    point: the ids come from the engine."""
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="[UNK]")
    t.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return t


def verl_config(live: Optional[Live], response_len: int = RESPONSE_LEN, **tokentap: Any) -> Any:
    block: Dict[str, Any] = dict(tokentap)
    if live is not None:
        block.setdefault("node_url", live.url)
        block.setdefault("node_token", live.token)
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": PROMPT_LEN,
                    "response_length": response_len,
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "top_k": -1,
                    "calculate_log_probs": True,
                    "val_kwargs": {"top_p": 1.0, "top_k": -1, "temperature": 0},
                    "agent": {"default_agent_loop": "tokentap", "tokentap": block},
                    "multi_turn": {"tool_config_path": None},
                    "trace": {},
                },
                "model": {"path": "unused", "tokenizer_path": "unused"},
            },
            "data": {"tool_config_path": None, "apply_chat_template_kwargs": {}},
        }
    )


def worker(cfg: Any, cls: Any = AgentLoopWorker, llm_client: Any = None) -> Any:
    w = object.__new__(cls)
    w.config = cfg
    w.rollout_config = cfg.actor_rollout_ref.rollout
    w.llm_client = llm_client
    w.tokenizer = hf_tokenizer()
    w.processor = None
    w.hf_model_type = None
    w.dataset_cls = RLHFDataset
    w.tools = []
    w.mm_processor_kwargs = {}
    w.reward_loop_worker_handles = None
    w.teacher_client = None
    w.distillation_enabled = False
    return w


def batch(rows: List[Dict[str, Any]], global_steps: int = 7) -> DataProto:
    """verl's input batch: dataset columns as object arrays (RLHFDataset's `raw_prompt`,
    `uid`, `index`, `agent_name`) plus each row's `tokentap_task` column."""
    cols: Dict[str, Any] = {}
    for key in ("raw_prompt", "uid", "index", "agent_name", "tokentap_task"):
        arr = np.empty(len(rows), dtype=object)
        arr[:] = [r[key] for r in rows]
        cols[key] = arr
    return DataProto(batch=None, non_tensor_batch=cols, meta_info={"global_steps": global_steps, "validate": False})


def row(uid: str, index: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "raw_prompt": [{"role": "user", "content": "make the test pass"}],
        "uid": uid,
        "index": index,
        "agent_name": "tokentap",
        "tokentap_task": json.dumps(spec),
    }


def generate(cfg: Any, rows: List[Dict[str, Any]]) -> DataProto:
    return asyncio.run(worker(cfg).generate_sequences(batch(rows)))


def check_row_against_trace(out: DataProto, i: int, trace: Dict[str, Any], reward: float) -> None:
    """Row i of verl's batch holds the trace: prompt left-padded, response right-padded, mask 1
    exactly on the sampled tokens, the sampler's logprobs, the reward on the last token."""
    prompt, response = trace["prompt_ids"], trace["response_ids"]
    assert len(prompt) <= PROMPT_LEN and 0 < len(response) <= RESPONSE_LEN
    b = out.batch
    assert b["prompts"][i, PROMPT_LEN - len(prompt):].tolist() == prompt
    assert b["prompts"][i, : PROMPT_LEN - len(prompt)].eq(PAD).all()
    assert b["responses"][i, : len(response)].tolist() == response
    assert b["response_mask"][i, : len(response)].tolist() == trace["loss_mask"]
    assert b["response_mask"][i, len(response):].eq(0).all()
    assert b["attention_mask"][i].sum().item() == len(prompt) + len(response)
    assert torch.allclose(b["rollout_log_probs"][i, : len(response)], torch.tensor(trace["logprobs"]), atol=1e-6)
    assert b["input_ids"][i].tolist() == b["prompts"][i].tolist() + b["responses"][i].tolist()
    scores = b["rm_scores"][i]
    assert scores[len(response) - 1].item() == reward and scores.abs().sum().item() == abs(reward)


def test_groups_of_rows_run_as_tokentap_samples_and_pass_verls_postprocessing(live: Live) -> None:
    node = Node(live.url, token=live.token)
    a, b = f"verl-a-{uuid.uuid4().hex[:6]}", f"verl-b-{uuid.uuid4().hex[:6]}"
    rows = [
        row(a, 0, task(live.project, winner("one"))),
        row(a, 0, task(live.project, loser("one"))),
        row(b, 1, task(live.project, winner("two"))),
        row(b, 1, task(live.project, winner("two"))),
    ]
    out = generate(verl_config(live), rows)
    assert out.batch["prompts"].shape == (4, PROMPT_LEN)
    assert out.batch["responses"].shape == (4, RESPONSE_LEN)
    assert out.batch["input_ids"].shape == (4, PROMPT_LEN + RESPONSE_LEN)
    nt = out.non_tensor_batch
    assert list(nt["tokentap_group_id"]) == [a, a, b, b]  # verl's uid is tokentap's group
    assert list(nt["tokentap_status"]) == ["completed"] * 4
    for i, reward in enumerate([1.0, 0.0, 1.0, 1.0]):
        [trace] = node.traces(nt["tokentap_sample_id"][i])
        assert trace["group_id"] == nt["tokentap_group_id"][i]
        check_row_against_trace(out, i, dict(trace), reward)
        assert sum(trace["loss_mask"]) > 0
        # The node runs under policy version "7": verl's staleness fields say step 7.
        assert nt["policy_version"][i] == "7"
        assert nt["min_global_steps"][i] == nt["max_global_steps"][i] == 7
        assert nt["tokentap_stale"][i] is False and nt["tokentap_clipped"][i] is False
        assert nt["tokentap_stop_reason"][i] in ("stop", "length")
        assert nt["__num_turns__"][i] == 2  # the user message and the answer
    assert out.meta_info["reward_extra_keys"] == []


def test_failed_empty_and_timed_out_samples_train_on_nothing(live: Live) -> None:
    g = f"verl-bad-{uuid.uuid4().hex[:6]}"
    failing_setup = task(live.project, winner())
    failing_setup["workspace"]["dir"]["setup"] = "exit 3"  # INIT fails: the sample ends `error`
    rows = [
        row(g, 0, failing_setup),
        row(g, 0, task(live.project, "touch ok")),  # rewarded, but no model call: no trace
        row(g, 0, task(live.project, "sleep 60; touch ok")),  # the node does not finish in time
    ]
    out = generate(verl_config(live, timeout_s=8), rows)
    nt, bt = out.non_tensor_batch, out.batch
    assert list(nt["tokentap_status"]) == ["error", "completed", "node_timeout"]
    for i in range(3):
        assert bt["response_mask"][i].eq(0).all(), f"row {i} trains on nothing"
        assert bt["attention_mask"][i, PROMPT_LEN:].sum().item() == 1  # one pad token
    # Reward absent -> 0 (verl needs a score on every output); the evaluator's reward stands
    # for a completed sample that made no call.
    assert [bt["rm_scores"][i, 0].item() for i in range(3)] == [0.0, 1.0, 0.0]
    # The empty row carries the row's own prompt in verl's tokenizer.
    assert bt["attention_mask"][1, :PROMPT_LEN].sum().item() > 0
    # The timed-out rollout was cancelled on the node.
    assert "no result within 8 s" in nt["tokentap_reason"][2]


def test_a_trace_over_the_response_length_is_clipped_at_its_end(live: Live) -> None:
    node = Node(live.url, token=live.token)
    g = f"verl-long-{uuid.uuid4().hex[:6]}"
    # The task's own max_tokens (32) wins over verl's response length (4).
    spec = task(live.project, winner("count", max_tokens=32), sampling={"max_tokens": 32, "temperature": 1.0})
    # The tiny model sampling at temperature 1 sometimes ends within 4 tokens: nothing to clip
    # then, so the row is run again (up to 5 times) until its trace outgrows the limit.
    for attempt in range(5):
        out = generate(verl_config(live, response_len=4), [row(f"{g}-{attempt}", 0, spec)])
        nt, bt = out.non_tensor_batch, out.batch
        [trace] = node.traces(nt["tokentap_sample_id"][0])
        if len(trace["response_ids"]) > 4:
            break
    assert len(trace["response_ids"]) > 4, "the tiny model stopped early 5 times: no clipping to check"
    assert bt["responses"].shape == (1, 4)
    assert bt["responses"][0].tolist() == trace["response_ids"][:4]
    assert bt["response_mask"][0].tolist() == trace["loss_mask"][:4]
    assert nt["tokentap_clipped"][0] is True and nt["tokentap_stop_reason"][0] == "length"
    assert bt["rm_scores"][0, 3].item() == 1.0


def test_the_v1_trainer_gets_one_output_per_trace(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    import verl.trainer.ppo.v1.agent_loop_tq as tq_module

    node = Node(live.url, token=live.token)
    put: List[Dict[str, Any]] = []

    async def capture(keys: List[str], fields: Any, tags: List[Dict[str, Any]], partition_id: str) -> None:
        put.append({"keys": keys, "fields": fields, "tags": tags, "partition": partition_id})

    monkeypatch.setattr(tq_module.tq, "async_kv_batch_put", capture)
    g = f"verl-v1-{uuid.uuid4().hex[:6]}"
    # Two calls whose prompts do not extend each other: two traces (a new prefix).
    spec = task(live.project, f"{call('first')} && {call('second, unrelated')} && touch ok")
    cfg = verl_config(live, outputs="traces")
    # The class under verl's @ray.remote (the worker runs here, not as an actor).
    w = worker(cfg, cls=tq_module.AgentLoopWorkerTQ.__ray_actor_class__)
    r = row(g, 0, spec)
    asyncio.run(
        w._run_agent_loop(
            {"temperature": 1.0, "top_p": 1.0},
            {"step": 7, "sample_index": 0, "rollout_n": 0, "validate": False},
            session_id=0,
            global_steps=7,
            **r,
        )
    )
    [p] = put
    assert p["keys"] == [f"{g}_0_0", f"{g}_0_1"] and p["partition"] == "train"
    fields = p["fields"]
    sample_id = fields["extra_fields"][0]["tokentap_sample_id"]
    traces = node.traces(sample_id)
    assert len(traces) == 2
    for i, t in enumerate(sorted(traces, key=lambda t: t["index"])):
        assert fields["prompts"][i].tolist() == t["prompt_ids"]
        assert fields["responses"][i].tolist() == t["response_ids"]
        assert fields["loss_mask"][i].tolist() == t["loss_mask"]
        assert fields["rm_scores"][i].tolist()[-1] == 1.0
        assert p["tags"][i]["min_global_steps"] == 7 and p["tags"][i]["status"] == "success"
    assert fields["extra_fields"][1]["tokentap_branch_cause"] == "new_prefix"


def test_without_a_node_url_it_starts_nodes_at_verls_own_server_addresses(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No node_url: the loop asks verl's router (a real Ray actor, as LLMServerManager makes
    it) for the server addresses and starts its own `tokentap serve` in front of one."""
    import ray
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    import tokentap_client.verl as adapter

    monkeypatch.delenv("TOKENTAP_NODE_URL")
    monkeypatch.delenv("TOKENTAP_NODE_TOKEN")
    address = live.engine.split("://", 1)[1]  # verl's addresses are host:port
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        cfg = verl_config(None, backend_kind="llamacpp", tokentap_bin=live.binary)
        balancer = get_router_handle(servers={address: None}, router_config_path=None)
        client = LLMServerClient(cfg, load_balancer_handle=balancer)
        g = f"verl-managed-{uuid.uuid4().hex[:6]}"
        out = asyncio.run(worker(cfg, llm_client=client).generate_sequences(batch([row(g, 0, task(live.project, winner()))])))
        assert list(out.non_tensor_batch["tokentap_status"]) == ["completed"]
        assert out.batch["response_mask"][0].sum().item() > 0
        assert list(adapter._MANAGED) == [f"http://{address}"]
    finally:
        adapter._stop_managed()
        ray.shutdown()
