"""A GRPO loop against a running tokentap node.

Each step submits every task as a group of --samples samples under the current policy
version, waits for the groups, turns rewards into group-normalized advantages, gathers the
trainable tokens as NumPy arrays (where a trainer would take its policy-gradient step), then
pauses the node, "updates the weights" and resumes under the next policy version. Prints one
JSON line per step.

    python examples/grpo_loop.py --node http://127.0.0.1:8700 --token $TOKENTAP_NODE_TOKEN \\
        --tasks tasks.jsonl --samples 4 --steps 2
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Tuple

import numpy as np

from tokentap_client import Node, TraceArrays, group_advantages, groups, reward_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--node", required=True)
    ap.add_argument("--token")
    ap.add_argument("--tasks", required=True, help="task specs, one JSON object per line")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    node = Node(args.node, token=args.token)
    with open(args.tasks) as f:
        tasks: List[Dict[str, Any]] = [json.loads(line) for line in f if line.strip()]

    version = node.resume()["policy_version"] or "v0"
    for step in range(args.steps):
        rollouts = [
            node.submit(dict(t, num_samples=args.samples, policy_version=version)) for t in tasks
        ]
        samples = [s for r in rollouts for s in node.wait(r["rollout_id"], timeout=600)]

        batch: List[Tuple[TraceArrays, float]] = []  # (arrays, advantage) for every trace
        for _, group in sorted(groups(samples).items()):
            advantages = group_advantages([reward_of(s) for s in group])
            for sample, adv in zip(group, advantages):
                for arrays in node.trajectories(sample, numpy=True):
                    batch.append((arrays, adv))

        # A trainer's step: loss = -sum(advantage * logprob_new(token)) over mask-1 tokens,
        # with the sampler's logprobs (arrays["logprobs"]) for the importance ratio.
        trainable = sum(int(a["loss_mask"].sum()) for a, _ in batch)
        weighted = float(sum(adv * float(a["loss_mask"].sum()) for a, adv in batch))
        mean_logprob = (
            float(np.mean(np.concatenate([a["logprobs"][a["loss_mask"][a["response_start"]:] == 1] for a, _ in batch])))
            if trainable
            else 0.0
        )

        # The weight update: no new generation starts until resume.
        paused = node.pause()
        version = f"v{step + 1}"
        node.resume(policy_version=version)
        print(
            json.dumps(
                {
                    "step": step,
                    "samples": len(samples),
                    "groups": {
                        g: [reward_of(s) for s in ss] for g, ss in sorted(groups(samples).items())
                    },
                    "traces": len(batch),
                    "trainable_tokens": trainable,
                    "advantage_weighted_tokens": weighted,
                    "mean_sampled_logprob": mean_logprob,
                    "paused_in_flight": paused["in_flight"],
                    "next_policy_version": version,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
