#!/usr/bin/env python3
"""Write a tiny Qwen3 test GGUF (make_tiny_model.py --tools / --think) as a Hugging Face model
directory that vLLM serves with the same tokenizer, template and logits.

usage: tiny_model_hf.py TINY_QWEN3.gguf OUT_DIR

Needs only the `gguf` and `numpy` packages (the setup venv's); the safetensors file is written
by hand (an 8-byte header length, a JSON header, the raw little-endian tensors).

What it writes:
  * config.json: LlamaForCausalLM, the GGUF's width, heads, RMSNorm epsilon and RoPE base, but
    a head size of 32 (see below), float32;
  * model.safetensors: the GGUF's weights in float32 (its F16 tensors widen exactly);
  * tokenizer.json: Qwen2's byte-level BPE (the GGUF's vocab and merges, Qwen2's split regex),
    with the NFC normalizer Qwen's own tokenizer.json has; every GGUF token that is not NORMAL
    is an added token, CONTROL ones special (`<|im_end|>`, ...), USER_DEFINED ones not
    (`<tool_call>`, `<think>`, ...: rendered as text, as in Qwen3's tokenizer);
  * tokenizer_config.json, generation_config.json, chat_template.jinja (the GGUF's template,
    transformers 5's layout).

Head size. vLLM's CPU attention takes head sizes 32 to 512; the GGUF's heads are 16 wide. Each
head is padded to 32 without changing any logit:
  * llama.cpp rotates adjacent pairs (2i, 2i+1) of a head with frequency base^(-2i/16);
    Hugging Face's llama rotates (i, i + d/2) with base^(-2i/d). With d = 32 the pair j = 2i
    turns at base^(-4i/32) = base^(-2i/16), so GGUF dimension 2i goes to 2i and 2i+1 to
    2i + 16 (q and k rows); the other pairs stay zero and add nothing to q.k;
  * the score is q.k / sqrt(head size): q is scaled by sqrt(32/16) so scores stay the same;
  * v rows and o columns of each head go to the same positions (the first 16), rest zero.
"""
import json
import os
import struct
import sys

import gguf
import numpy as np

HEAD = 32   # the padded head size

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2/Qwen2.5/Qwen3; llama.cpp's `qwen2`).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
              "use_regex": False}


def field(reader, key):
    return reader.fields[key].contents()


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


def pad_heads(w, n_head, head, kind, scale=1.0):
    """q/k/v rows (`kind` "rope" or "value") of `w` ([n_head*head, d_in]) padded per head to HEAD."""
    out = np.zeros((n_head * HEAD, w.shape[1]), np.float32)
    for h in range(n_head):
        src = w[h * head:(h + 1) * head]
        base = h * HEAD
        if kind == "rope":
            for i in range(head // 2):
                out[base + 2 * i] = src[2 * i]
                out[base + 2 * i + HEAD // 2] = src[2 * i + 1]
        else:
            out[base:base + head] = src
    return out * scale


def main(src, dst):
    r = gguf.GGUFReader(src)
    arch = field(r, "general.architecture")
    if arch != "llama":
        raise SystemExit(f"{src}: architecture {arch}, expected llama")
    d = int(field(r, "llama.embedding_length"))
    n_head = int(field(r, "llama.attention.head_count"))
    n_kv = int(field(r, "llama.attention.head_count_kv"))
    n_layer = int(field(r, "llama.block_count"))
    n_ff = int(field(r, "llama.feed_forward_length"))
    head = d // n_head
    if int(field(r, "llama.rope.dimension_count")) != head or head > HEAD or n_kv != n_head:
        raise SystemExit(f"{src}: unexpected head layout")
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in r.tensors}

    hf = {
        "model.embed_tokens.weight": tensors["token_embd.weight"],
        "model.norm.weight": tensors["output_norm.weight"],
        "lm_head.weight": tensors["output.weight"],
    }
    q_scale = np.sqrt(HEAD / head)
    for i in range(n_layer):
        g, p = f"blk.{i}.", f"model.layers.{i}."
        wo = tensors[g + "attn_output.weight"]          # [d, n_head*head]
        wo_pad = np.zeros((wo.shape[0], n_head * HEAD), np.float32)
        for h in range(n_head):
            wo_pad[:, h * HEAD:h * HEAD + head] = wo[:, h * head:(h + 1) * head]
        hf.update({
            p + "input_layernorm.weight": tensors[g + "attn_norm.weight"],
            p + "post_attention_layernorm.weight": tensors[g + "ffn_norm.weight"],
            p + "self_attn.q_proj.weight": pad_heads(tensors[g + "attn_q.weight"], n_head, head, "rope", q_scale),
            p + "self_attn.k_proj.weight": pad_heads(tensors[g + "attn_k.weight"], n_head, head, "rope"),
            p + "self_attn.v_proj.weight": pad_heads(tensors[g + "attn_v.weight"], n_head, head, "value"),
            p + "self_attn.o_proj.weight": wo_pad,
            p + "mlp.gate_proj.weight": tensors[g + "ffn_gate.weight"],
            p + "mlp.up_proj.weight": tensors[g + "ffn_up.weight"],
            p + "mlp.down_proj.weight": tensors[g + "ffn_down.weight"],
        })

    tokens = list(field(r, "tokenizer.ggml.tokens"))
    types = list(field(r, "tokenizer.ggml.token_type"))
    merges = list(field(r, "tokenizer.ggml.merges"))
    bos = int(field(r, "tokenizer.ggml.bos_token_id"))
    eos = int(field(r, "tokenizer.ggml.eos_token_id"))
    pad = int(field(r, "tokenizer.ggml.padding_token_id"))
    template = field(r, "tokenizer.chat_template")
    rope_base = float(field(r, "llama.rope.freq_base"))
    eps = float(field(r, "llama.attention.layer_norm_rms_epsilon"))
    ctx = int(field(r, "llama.context_length"))

    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == 3}
             for i, t in enumerate(tokens) if types[i] != 1]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated",
             "invert": False},
            BYTE_LEVEL]},
        "post_processor": BYTE_LEVEL,
        "decoder": BYTE_LEVEL,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": ctx,
        "bos_token": None, "eos_token": tokens[eos], "pad_token": tokens[pad], "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "errors": "replace",
        "split_special_tokens": False,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                 for a in added},
    }
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": d, "intermediate_size": n_ff, "num_hidden_layers": n_layer,
        "num_attention_heads": n_head, "num_key_value_heads": n_kv, "head_dim": HEAD,
        "hidden_act": "silu", "max_position_embeddings": ctx, "rms_norm_eps": eps,
        "rope_theta": rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_base},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "vocab_size": len(tokens), "bos_token_id": bos, "eos_token_id": eos,
        "pad_token_id": pad, "torch_dtype": "float32", "dtype": "float32",
    }
    generation_config = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}

    os.makedirs(dst, exist_ok=True)
    write_safetensors(os.path.join(dst, "model.safetensors"), hf)
    for name, obj in [("config.json", config), ("tokenizer.json", tokenizer),
                      ("tokenizer_config.json", tokenizer_config),
                      ("generation_config.json", generation_config)]:
        with open(os.path.join(dst, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, ensure_ascii=False, indent=None if name == "tokenizer.json" else 2)
            f.write("\n")
    with open(os.path.join(dst, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    print(f"wrote {dst}: vocab {len(tokens)}, {len(added)} added tokens, heads {n_head}x{HEAD}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
