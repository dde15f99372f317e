#!/usr/bin/env python3
"""Write a tiny, fast, deterministic llama GGUF that keeps SmolLM2's real tokenizer.

usage: make_tiny_model.py REAL_SMOLLM2.gguf OUT.gguf
       make_tiny_model.py --tools QWEN2_VOCAB.gguf QWEN3_TEMPLATE.jinja OUT.gguf
       make_tiny_model.py --think QWEN2_VOCAB.gguf QWEN3_TEMPLATE.jinja OUT.gguf

The second form writes the tool-calling model instead: see tool_model()'s docstring; the third
its reasoning variant (`--think`), see the THINK_* constants and tool_model()'s docstring.

The model is 2 layers, 64 wide, 4 heads, ffn 128, random small weights from a
fixed seed (so the file is byte-for-byte reproducible). Every `tokenizer.*`
key of the real model is copied (vocab, merges, token types, BOS/EOS/pad ids,
chat template), so token ids mean exactly what they mean for SmolLM2.

Random weights never emit EOS, and agent harnesses ask for 16k+ tokens, so the
output is biased on purpose:
  * every token embedding has a large constant in dimension 0, so after the
    final RMSNorm the hidden state is dominated by dimension 0 (h0 ~= H0);
  * the untied `output.weight` column 0 sets each token's base logit
    (column 0 * H0): ~20 common English word tokens near 0, the end-of-turn
    token `<|im_end|>` at EOS_LOGIT (about a 10% chance per step at
    temperature 0.8-1.0), everything else at OTHER_LOGIT (never sampled);
  * the newline token (which ends the generation prompt) has a large
    dimension-1 component that the EOS row weighs negatively, so a reply is
    never empty (EOS cannot be the first generated token);
  * the word tokens' other columns are small random numbers, so the small
    per-token components of the hidden state add a little noise and the text
    varies from step to step and from token to token.
"""
import sys

import numpy as np
import gguf

SEED = 20240601
N_EMBD, N_LAYER, N_HEAD, N_FF = 64, 2, 4, 128
CTX = 32768
EMB_CONST = 1.0     # dimension-0 component of every token embedding
EMB_NOISE = 0.05    # std of the other 63 dimensions of the embeddings
W_STD = 0.02        # std of the layer weights (small: layers barely move the residual)
WORD_NOISE = 0.25   # std of output.weight[word, 1:] -> ~0.7-1 logit of noise
EOS_LOGIT = 1.0     # vs. 22 words at ~0 +- noise: ~10% EOS per sampled step
NL_MARK = 2.0       # dimension-1 component of the newline token's embedding ...
NL_EOS = -1.0       # ... times this weight keeps EOS off the first generated token
OTHER_LOGIT = -25.0

# Common words the tiny model babbles (GPT-2 style byte-level pieces, "Ġ" = space).
WORDS = ["Ġthe", "Ġand", "Ġcode", "Ġfile", "Ġhello", "Ġis", "Ġto", "Ġof", "Ġa",
         "Ġin", "Ġit", "Ġthis", "Ġwe", "Ġwill", "Ġrun", "Ġtest", "Ġdata",
         "Ġwith", "Ġyou", "Ġcan", ".", ","]
EOS_PIECE = "<|im_end|>"
NL_PIECE = "Ċ"      # "\n": the chat template's generation prompt ends "<|im_start|>assistant\n"


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> list[str]:
    """Copy every tokenizer.* key/value verbatim (same types); return the vocab."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    return reader.fields["tokenizer.ggml.tokens"].contents()


def main(src: str, dst: str) -> None:
    reader = gguf.GGUFReader(src)
    rng = np.random.default_rng(SEED)
    w = gguf.GGUFWriter(dst, "llama")
    w.add_name("tiny-smollm2 (random weights, SmolLM2 tokenizer; tokentap test model)")
    w.add_context_length(CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = copy_tokenizer(reader, w)
    n_vocab = len(vocab)
    w.add_vocab_size(n_vocab)

    def rand(*shape, std=W_STD):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    # Embeddings: constant dim 0 + small per-token noise elsewhere.
    emb = rand(n_vocab, N_EMBD, std=EMB_NOISE)
    emb[:, 0] = EMB_CONST
    # The model never emits "\n" itself, so "\n" as the current token means
    # "first step of a reply": mark it so the output layer can veto an empty reply.
    index = {piece: i for i, piece in enumerate(vocab)}
    missing = [p for p in WORDS + [EOS_PIECE, NL_PIECE] if p not in index]
    if missing:
        raise SystemExit(f"tokens not in vocab: {missing}")
    emb[index[NL_PIECE], 1] = NL_MARK
    w.add_tensor("token_embd.weight", emb.astype(np.float16))

    for i in range(N_LAYER):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + name + ".weight", rand(N_EMBD, N_EMBD).astype(np.float16))
        w.add_tensor(p + "ffn_norm.weight", np.ones(N_EMBD, np.float32))
        w.add_tensor(p + "ffn_gate.weight", rand(N_FF, N_EMBD).astype(np.float16))
        w.add_tensor(p + "ffn_up.weight", rand(N_FF, N_EMBD).astype(np.float16))
        w.add_tensor(p + "ffn_down.weight", rand(N_EMBD, N_FF).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, np.float32))

    # Hidden state after the final RMSNorm: dim 0 is about H0, the rest ~N(0, EMB_NOISE*H0/EMB_CONST).
    h0 = EMB_CONST / np.sqrt((EMB_CONST**2 + (N_EMBD - 1) * EMB_NOISE**2) / N_EMBD)
    out = np.zeros((n_vocab, N_EMBD), np.float32)
    out[:, 0] = OTHER_LOGIT / h0
    for piece in WORDS:
        t = index[piece]
        out[t, 0] = 0.0
        out[t, 1:] = rng.standard_normal(N_EMBD - 1) * WORD_NOISE
    out[index[EOS_PIECE], 0] = EOS_LOGIT / h0
    out[index[EOS_PIECE], 1] = NL_EOS
    w.add_tensor("output.weight", out.astype(np.float16))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {dst}: vocab {n_vocab}, {len(WORDS)} word tokens, eos id {index[EOS_PIECE]}")


# ---------------------------------------------------------------------------
# The tool-calling model (`--tools`).

# Qwen2.5/Qwen3's added tokens, which the Qwen2 vocab-only GGUF of llama.cpp still lists as
# `[PADn]`: (text, token type). Types as llama.cpp's converter writes them for Qwen3: `<|...|>`
# are CONTROL (3), the rest USER_DEFINED (4, parsed and rendered as text, like in Qwen3 GGUFs).
QWEN3_ADDED = {
    151646: "<|object_ref_start|>", 151647: "<|object_ref_end|>", 151648: "<|box_start|>",
    151649: "<|box_end|>", 151650: "<|quad_start|>", 151651: "<|quad_end|>",
    151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
    151655: "<|image_pad|>", 151656: "<|video_pad|>", 151657: "<tool_call>",
    151658: "</tool_call>", 151659: "<|fim_prefix|>", 151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>", 151662: "<|fim_pad|>", 151663: "<|repo_name|>",
    151664: "<|file_sep|>", 151665: "<tool_response>", 151666: "</tool_response>",
    151667: "<think>", 151668: "</think>",
}

T_D, T_HEADS, T_FF = 32, 2, 32   # width, heads (one per flag), feed-forward (all zero)
T_HEAD_DIM = T_D // T_HEADS
T_CTX = 40960                     # Qwen3's
T_ROPE_BASE = 1e30                # the last RoPE pair of a head turns by pos * 1e-26: never
T_CONST = 4.0                     # the constant component of every embedding
T_SCORE = 30.0                    # attention score of a marker token (e^30 >> any context length)
T_SCALE = 2.0                     # every logit below is multiplied by this
T_GATE = 60.0                     # how far the wrong branch's tokens are pushed down
T_UNLISTED = -30.0                # every token not named below
R = 20.0                          # rank of a tool-call token

# Tool branch. Before `<tool_call>\n` nothing constrains sampling; after it llama-server's lazy
# grammar (built from the offered tools) allows only a well-formed call to one of them, and the
# highest-ranked allowed token wins. The ranks spell, for whichever shell tool is offered,
#   <tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>
# (`exec_command`/`cmd` for Codex, `run_shell_command` for Qwen Code, `Bash` for Claude Code),
# byte for byte what Qwen3's template writes when the call comes back in the history. Each rank
# was chosen against the other ranked tokens the grammar allows at the same place (e.g. after
# `pwd` a string may go on with ` {"` or ` "`, so `"}}\n` outranks both), and the pieces are
# the ones Qwen's tokenizer cuts that text into, so the call's sampled ids reappear unchanged
# in the next request's prompt ids.
TOOL_RANKS = {
    '{"': R, 'Ġ{"': R + 10, 'name': R, '":': R, 'Ġ"': R, '",': R, 'arguments': R,
    'command': R, 'cmd': R, '"}}Ċ': R + 25, '</tool_call>': R,
    # first pieces of the shell tools' names (the grammar allows only offered names)
    'bash': R, 'exec': R, '_command': R, 'run': R, '_shell': R, 'B': R, 'ash': R,
}
# (current tokens, next token, logit added)
TOOL_BIGRAMS = [
    (["Ċ", "ĊĊ"], "<tool_call>", 60.0),   # the generation prompt ends in "\n" (or "\n\n" after
    (["<tool_call>"], "Ċ", 60.0),          # an empty think block): open a call; "\n" triggers
    (["Ċ"], '{"', 20.0),                   # `{"name"` right after the trigger, as the template
    (['":'], 'Ġ"', 35.0),                  # a string value, not `"}}\n` closing an empty one
    (['Ġ"'], "pwd", 55.0),                 # the one string the model writes itself
    (["</tool_call>"], "<|im_end|>", 30.0),
]
# Answer branch (a tool result is in the conversation, or no tools are offered): no grammar.
ANSWER = ["Done", "."]
ANSWER_BIGRAMS = [
    (["Ċ", "ĊĊ"], "Done", 30.0),
    (["Done"], ".", 30.0),
    (["."], "<|im_end|>", 30.0),
    (["*"], "<|im_end|>", 20.0),           # after any token not named here: stop
]
EOT_BASE = 5.0                             # `<|im_end|>` above the other end-of-generation tokens


# Think variant (`--think`): a reasoning block opens every reply, and the tool branch lasts for
# THINK_CALLS calls. Head B measures C = n(<tool_response>) / (n(<tool_call>) + n(<tool_response>))
# over the context: Qwen3's template writes `<tool_call>` twice into the system prompt when tools
# are offered, and once per call in the history, so after k complete call/result rounds
# C = k / (2 + 2k) (0, 1/4, 1/3, 3/8, ...; lower still once the reply has opened its own call).
# The feed-forward block turns C > THINK_THETA into a 0/1 flag (a difference of two SiLUs).
THINK_CALLS = 3
THINK_THETA = (2 / 6 + 3 / 8) / 2   # between k = 2 (1/3) and k = 3 (3/8)
THINK_STEEP = 8.0                   # the step's SiLU input at |C - THINK_THETA| = 1/48
THINK_STEP = 3.0                    # the SiLU inputs of the step's two units differ by this
THINK_BIGRAMS = [                   # both branches: `<think>Check</think>\n\n` first
    (["Ċ"], "<think>", 90.0),
    (["<think>"], "Check", 60.0),
    (["Check"], "</think>", 60.0),
    (["</think>"], "ĊĊ", 60.0),
]


def tool_model(vocab_path: str, template_path: str, dst: str, think: bool = False) -> None:
    """A 1-layer, 32-wide llama GGUF with hand-set weights (nothing random) that has Qwen3's
    tokenizer (Qwen2's vocab and merges from llama.cpp's vocab-only GGUF, plus Qwen3's added
    tokens) and Qwen3's real chat template, and runs an agent harness through one tool loop:

      * no tool result in the conversation and tools offered: it calls the harness's shell
        tool with `pwd`, Hermes style, `<tool_call>\\n{"name": ..., "arguments": ...}</tool_call>`;
      * once a tool result is in the conversation (or when no tools are offered): it answers
        `Done.` and ends the turn (`<|im_end|>`).

    How. Every embedding is T_CONST on dimension 0 plus a one-hot: its own dimension for the
    few tokens the output depends on, a shared "other" dimension for the rest (so all have the
    same norm). Two attention heads detect whether a token occurs anywhere before: head A looks
    for `<tool_call>` (Qwen3's template writes it into the system prompt exactly when tools are
    offered), head B for `<tool_response>` (the template's wrapping of every tool result). The
    query is the constant dimension, the key the marker's dimension, both on the head's last
    RoPE pair with a huge RoPE base (no rotation), so a marker scores T_SCORE and every other
    token 0; the value is the marker dimension, so the head outputs ~1 if the marker occurs and
    exactly 0 if not. The output head then makes the next token a function of (current token,
    A, B): the tool branch's tokens get +T_GATE*(A-B-1), the answer's +T_GATE*(B-A). The
    feed-forward block is zero.

    Sampling is effectively deterministic at any temperature up to 2 without top-k/top-p/min-p
    (the chosen token leads every other allowed one by at least 10 logits times T_SCALE); the
    tool call's JSON comes from llama-server's grammar, so the arguments are valid for the tool
    the harness offered.

    With `think` (`--think`, tiny-qwen3-think.gguf) every reply opens with the reasoning block
    `<think>Check</think>\n\n` (llama-server's `--reasoning-format` hands `Check` back as
    reasoning), and the tool branch lasts for THINK_CALLS calls, not one: head B attends to both
    markers and reads the `<tool_response>` share C of them, and the feed-forward block turns
    `C > THINK_THETA` (3 results present) into the flag that switches to the answer."""
    reader = gguf.GGUFReader(vocab_path)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    for i, text in QWEN3_ADDED.items():
        if tokens[i] != f"[PAD{i}]":
            raise SystemExit(f"{vocab_path}: token {i} is {tokens[i]!r}, expected a pad")
        tokens[i] = text
        types[i] = 3 if text.startswith("<|") else 4
    index = {t: i for i, t in enumerate(tokens)}
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(dst, "llama")
    if think:
        w.add_name("tiny-qwen3-think (hand-set weights, Qwen3 tokenizer and template; tokentap test model)")
    else:
        w.add_name("tiny-qwen3-tools (hand-set weights, Qwen3 tokenizer and template; tokentap test model)")
    w.add_context_length(T_CTX)
    w.add_embedding_length(T_D)
    w.add_block_count(1)
    w.add_feed_forward_length(T_FF)
    w.add_head_count(T_HEADS)
    w.add_head_count_kv(T_HEADS)
    w.add_rope_dimension_count(T_HEAD_DIM)
    w.add_rope_freq_base(T_ROPE_BASE)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(reader.fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    # As in Qwen3's GGUFs: no BOS, `<|im_end|>` ends a turn, `<|endoftext|>` pads.
    w.add_bos_token_id(index["<|endoftext|>"])
    w.add_eos_token_id(index["<|im_end|>"])
    w.add_pad_token_id(index["<|endoftext|>"])
    w.add_add_bos_token(False)
    with open(template_path, encoding="utf-8") as f:
        w.add_chat_template(f.read())
    w.add_vocab_size(n_vocab)

    free = THINK_BIGRAMS if think else []   # ungated: the same in both branches
    named = {p for p in TOOL_RANKS} | {p for _, p, _ in TOOL_BIGRAMS + ANSWER_BIGRAMS + free} | set(ANSWER)
    missing = sorted(p for p in named if p not in index)
    if missing:
        raise SystemExit(f"tokens not in vocab: {missing}")

    # Residual dimensions: constant, "other", the two markers, the two flags, then one per
    # token some output depends on.
    CONST, OTHER, KEY_A, KEY_B, FLAG_A, FLAG_B = range(6)
    dim = {"*": OTHER, "<tool_call>": KEY_A, "<tool_response>": KEY_B}
    for cur, _, _ in TOOL_BIGRAMS + ANSWER_BIGRAMS + free:
        for c in cur:
            dim.setdefault(c, 6 + len([d for d in dim.values() if d >= 6]))
    STEP = T_D - 1   # think: the feed-forward's "C > THINK_THETA" flag
    if max(dim.values()) >= (STEP if think else T_D):
        raise SystemExit("too many context tokens for the width")
    emb = np.zeros((n_vocab, T_D), np.float32)
    emb[:, CONST] = T_CONST
    emb[:, OTHER] = 1.0
    for piece, d in dim.items():
        if piece != "*":
            emb[index[piece], OTHER] = 0.0
            emb[index[piece], d] = 1.0
    w.add_tensor("token_embd.weight", emb.astype(np.float16))

    # RMSNorm scales an embedding (norm sqrt(T_CONST^2 + 1)) by `norm`.
    norm = np.sqrt(T_D) / np.sqrt(T_CONST**2 + 1)
    qk = np.sqrt(T_SCORE * np.sqrt(T_HEAD_DIM) / (T_CONST * norm * norm))
    wq, wk, wv, wo = (np.zeros((T_D, T_D), np.float32) for _ in range(4))
    for h, (key, flag) in enumerate([(KEY_A, FLAG_A), (KEY_B, FLAG_B)]):
        base = h * T_HEAD_DIM
        slow = base + T_HEAD_DIM - 2   # first dimension of the head's slowest RoPE pair
        wq[slow, CONST] = qk
        wk[slow, key] = qk
        if think and h == 1:   # head B: the share of `<tool_response>` among both markers
            wk[slow, KEY_A] = qk
        wv[base, key] = 1.0 / norm
        wo[flag, base] = 1.0
    p = "blk.0."
    w.add_tensor(p + "attn_norm.weight", np.ones(T_D, np.float32))
    w.add_tensor(p + "attn_q.weight", wq)
    w.add_tensor(p + "attn_k.weight", wk)
    w.add_tensor(p + "attn_v.weight", wv)
    w.add_tensor(p + "attn_output.weight", wo)
    w.add_tensor(p + "ffn_norm.weight", np.ones(T_D, np.float32))
    gate, up, down = (np.zeros((T_FF, T_D), np.float32), np.zeros((T_FF, T_D), np.float32),
                      np.zeros((T_D, T_FF), np.float32))
    if think:
        # ffn_norm scales x by n ~= `norm` (the flags move it by a few percent, and the step's
        # threshold is a ratio of two components, so that does not matter):
        #   unit 0: silu(a*n*(C - THINK_THETA)) * n,  unit 1: the same, input THINK_STEP lower;
        # their difference is ~0 below the threshold and ~THINK_STEP*n above it.
        a = THINK_STEEP * 48 / norm
        for u, shift in ((0, 0.0), (1, THINK_STEP / norm)):
            gate[u, FLAG_B] = a
            gate[u, CONST] = -(a * THINK_THETA + shift) / T_CONST
            up[u, CONST] = 1.0 / T_CONST
        down[STEP, 0] = 1.0 / (THINK_STEP * norm)
        down[STEP, 1] = -1.0 / (THINK_STEP * norm)
    w.add_tensor(p + "ffn_gate.weight", gate)
    w.add_tensor(p + "ffn_up.weight", up)
    w.add_tensor(p + "ffn_down.weight", down)
    w.add_tensor("output_norm.weight", np.ones(T_D, np.float32))

    # Output rows, in units of the pre-norm residual (x[CONST] = T_CONST, x[dim] = 1 for the
    # current token's dimension, x[FLAG_*] = 0 or 1); divided by `norm` at the end.
    out = np.zeros((n_vocab, T_D), np.float32)
    out[:, CONST] = T_UNLISTED / T_CONST
    for piece in named:
        out[index[piece], CONST] = 0.0
    gated = dict(TOOL_RANKS)
    for _, piece, _ in TOOL_BIGRAMS:
        if piece != "<|im_end|>":
            gated.setdefault(piece, 0.0)
    done = STEP if think else FLAG_B        # "answer now": a tool result (think: 3 of them)
    for piece, rank in gated.items():       # tool branch: rank + T_GATE*(A - B - 1)
        t = index[piece]
        out[t, CONST] += (rank - T_GATE) / T_CONST
        out[t, FLAG_A] += T_GATE
        out[t, done] -= T_GATE
    for piece in ANSWER:                    # answer branch: + T_GATE*(B - A)
        t = index[piece]
        out[t, FLAG_A] -= T_GATE
        out[t, done] += T_GATE
    for cur, piece, logit in TOOL_BIGRAMS + ANSWER_BIGRAMS + free:
        for c in cur:
            out[index[piece], dim[c]] += logit
    out[index["<|im_end|>"], CONST] += EOT_BASE / T_CONST
    out *= T_SCALE / norm
    w.add_tensor("output.weight", out.astype(np.float16))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {dst}: vocab {n_vocab}, {len(named)} named tokens, context dims {len(dim)}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--tools":
        tool_model(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 5 and sys.argv[1] == "--think":
        tool_model(sys.argv[2], sys.argv[3], sys.argv[4], think=True)
    elif len(sys.argv) == 3:
        main(sys.argv[1], sys.argv[2])
    else:
        raise SystemExit(__doc__)
