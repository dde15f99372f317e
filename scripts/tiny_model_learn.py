#!/usr/bin/env python3
"""Write the tiny model GRPO can teach (scripts/train-demo, e2e train_loop) as a Hugging Face
directory that vLLM serves and transformers trains.

usage: tiny_model_learn.py TINY_QWEN3_TOOLS_HF_DIR OUT_DIR [P_TOUCH]

The tokenizer, template and layout (LlamaForCausalLM, 1 layer, 32 wide, 2 heads of 32) are those
of the tool model's Hugging Face directory (tiny_model_hf.py); the weights are set here, in
float32, with nothing random. Driven by a real harness (Pi offers its `bash` tool), it:

  * with no tool result in the conversation, calls `bash`, in compact Hermes JSON that no
    grammar is needed for (vLLM applies none under `tool_choice: auto`):
        <tool_call>{"name":"bash","arguments":{"command":"touch ok"}}</tool_call><|im_end|>
    or the same with `"pwd"`: the one sampled choice, `touch` with probability P_TOUCH
    (default 0.35) at temperature 1, every other token decided by at least 40 logits;
  * once a tool result is in the conversation: answers `Done.` and ends the turn.

So the task "create a file named ok", rewarded by `test -f ok`, succeeds with probability
P_TOUCH at first, and a policy gradient raises it by moving that one choice: what the model
learns is in its weights (the output rows of `touch` and `pwd` and what feeds them), and a run
with learning rate 0 stays where it starts.

How (as in make_tiny_model.py's tool model). Every embedding is T_CONST on dimension CONST plus
a one-hot: its own dimension for the few tokens the output depends on, a shared OTHER
dimension for the rest. Head 0 finds `<tool_response>` anywhere before (a tool result is in the
conversation), head 1 finds `":{"` (the call's arguments are open: the next `":"` is the
command's, not the name's); each head's query is the constant dimension and its key the
marker's, on the slowest RoPE pair (dimensions 15 and 31 of the head; with RoPE base 1e30 they
turn by position * 1e-28, so never), scoring T_SCORE for a marker and 0 otherwise, and its
value the marker dimension: the head writes ~1 into its flag if the marker occurs, exactly 0 if
not. The output rows make the next token a function of (current token, the two flags). The
template's system prompt renders the tools with spaced JSON (`": "`), so `":{"` occurs only in
what the model writes. The feed-forward block is zero.
"""
import json
import os
import shutil
import struct
import sys

import numpy as np

D, HEADS, HEAD = 32, 2, 32
T_CONST = 4.0
T_SCORE = 30.0
UNLISTED = -30.0     # logit of every token not named below
L = 40.0             # a bigram's logit
G = 80.0             # how far the wrong branch is pushed down

CONST, OTHER, KEY_RESULT, KEY_ARGS, FLAG_RESULT, FLAG_ARGS = range(6)

# (current tokens, next token): the call, then the answer.
CALL = [
    (["Ċ", "ĊĊ"], "<tool_call>"),
    (["<tool_call>"], '{"'),
    (['{"'], "name"),
    (["name"], '":"'),
    (['":"'], "bash"),          # before `":{"` only (FLAG_ARGS gates it)
    (["bash"], '","'),
    (['","'], "arguments"),
    (["arguments"], '":{"'),
    (['":{"'], "command"),
    (["command"], '":"'),
    (["touch"], "Ġok"),
    (["Ġok"], '"}}'),
    (["pwd"], '"}}'),
    (['"}}'], "</tool_call>"),
    (["</tool_call>"], "<|im_end|>"),
]
CHOICE = ["touch", "pwd"]       # after the command's `":"` (FLAG_ARGS set)
ANSWER = [
    (["Ċ", "ĊĊ"], "Done"),
    (["Done"], "."),
    (["."], "<|im_end|>"),
]
ANSWER_TOKENS = ["Done", "."]


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def main(src, dst, p_touch=0.35):
    with open(os.path.join(src, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    index = dict(tok["model"]["vocab"])
    for a in tok["added_tokens"]:
        index[a["content"]] = a["id"]
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    n_vocab = int(config["vocab_size"])

    named = {p for cur, nxt in CALL + ANSWER for p in cur + [nxt]} | set(CHOICE) | {"<tool_response>"}
    missing = sorted(p for p in named if p not in index)
    if missing:
        raise SystemExit(f"tokens not in the vocabulary: {missing}")

    dim = {"<tool_response>": KEY_RESULT, '":{"': KEY_ARGS}
    for cur, _ in CALL + ANSWER:
        for c in cur:
            dim.setdefault(c, 6 + len([d for d in dim.values() if d >= 6]))
    for c in CHOICE:
        dim.setdefault(c, 6 + len([d for d in dim.values() if d >= 6]))
    if max(dim.values()) >= D:
        raise SystemExit("too many context tokens for the width")

    emb = np.zeros((n_vocab, D), np.float32)
    emb[:, CONST] = T_CONST
    emb[:, OTHER] = 1.0
    for piece, d in dim.items():
        emb[index[piece], OTHER] = 0.0
        emb[index[piece], d] = 1.0

    # RMSNorm (weight 1) scales an embedding, norm sqrt(T_CONST^2 + 1), by `norm`.
    norm = np.sqrt(D) / np.sqrt(T_CONST**2 + 1)
    qk = np.sqrt(T_SCORE * np.sqrt(HEAD) / (T_CONST * norm * norm))
    wq = np.zeros((HEADS * HEAD, D), np.float32)
    wk = np.zeros((HEADS * HEAD, D), np.float32)
    wv = np.zeros((HEADS * HEAD, D), np.float32)
    wo = np.zeros((D, HEADS * HEAD), np.float32)
    for h, (key, flag) in enumerate([(KEY_RESULT, FLAG_RESULT), (KEY_ARGS, FLAG_ARGS)]):
        base = h * HEAD
        slow = base + HEAD // 2 - 1      # Hugging Face pairs (i, i + 16): i = 15 turns slowest
        wq[slow, CONST] = qk
        wk[slow, key] = qk
        wv[base, key] = 1.0 / norm
        wo[flag, base] = 1.0

    # Output rows in units of the pre-norm residual x (x[CONST] = T_CONST, x[dim(current)] = 1,
    # the flags 0 or 1), divided by `norm` at the end.
    out = np.zeros((n_vocab, D), np.float32)
    out[:, CONST] = UNLISTED / T_CONST
    for piece in named:
        out[index[piece], CONST] = 0.0
    call_tokens = {nxt for _, nxt in CALL if nxt != "<|im_end|>"} | set(CHOICE)
    for piece in call_tokens:                       # the call: only without a tool result
        out[index[piece], FLAG_RESULT] -= G
    for piece in ANSWER_TOKENS:                     # the answer: only with one
        out[index[piece], FLAG_RESULT] += G
        out[index[piece], CONST] -= G / T_CONST
    for cur, nxt in CALL + ANSWER:
        for c in cur:
            out[index[nxt], dim[c]] += L
    # `":"` names the tool until the arguments are open, then the command.
    out[index["bash"], FLAG_ARGS] -= G
    for c in CHOICE:
        out[index[c], dim['":"']] += L
        out[index[c], FLAG_ARGS] += G
        out[index[c], CONST] -= G / T_CONST
    # The choice: logit(touch) - logit(pwd) = log(p / (1 - p)) where it is made. There the
    # residual holds FLAG_ARGS too (no tool result yet), so the final RMSNorm divides by
    # sqrt(T_CONST^2 + 2), not sqrt(T_CONST^2 + 1): the gap is scaled for that.
    at_choice = np.sqrt(D) / np.sqrt(T_CONST**2 + 2)
    gap = np.log(p_touch / (1 - p_touch))
    out[index["touch"], CONST] += gap / (at_choice / norm) / T_CONST
    out *= 1.0 / norm

    tensors = {
        "model.embed_tokens.weight": emb,
        "model.norm.weight": np.ones(D, np.float32),
        "lm_head.weight": out,
        "model.layers.0.input_layernorm.weight": np.ones(D, np.float32),
        "model.layers.0.post_attention_layernorm.weight": np.ones(D, np.float32),
        "model.layers.0.self_attn.q_proj.weight": wq,
        "model.layers.0.self_attn.k_proj.weight": wk,
        "model.layers.0.self_attn.v_proj.weight": wv,
        "model.layers.0.self_attn.o_proj.weight": wo,
        "model.layers.0.mlp.gate_proj.weight": np.zeros((D, D), np.float32),
        "model.layers.0.mlp.up_proj.weight": np.zeros((D, D), np.float32),
        "model.layers.0.mlp.down_proj.weight": np.zeros((D, D), np.float32),
    }
    config.update({"hidden_size": D, "intermediate_size": D, "num_hidden_layers": 1,
                   "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HEAD})
    os.makedirs(dst, exist_ok=True)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "chat_template.jinja"):
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    print(f"wrote {dst}: p(touch) {p_touch}, {len(dim)} context dimensions")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) == 4 else 0.35)
