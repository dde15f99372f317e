#!/usr/bin/env python3
"""Write a tiny, fast, deterministic llama GGUF that keeps SmolLM2's real tokenizer.

usage: make_tiny_model.py REAL_SMOLLM2.gguf OUT.gguf

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


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
