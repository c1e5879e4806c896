"""GGUF -> Hugging Face directory conversion (dequantized with the `gguf` package).

llama.cpp's converter permutes the rows of Llama Q and K projections (to its interleaved RoPE
layout); we undo that here so the weights match the Hugging Face (neox) layout our model uses.
The converted copy (config.json, model.safetensors, tokenizer files) is cached, so a second load
takes seconds.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

import numpy as np
import torch

logger = logging.getLogger("draftwise")

_NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_MAP = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(weights, n_head)` on a [rows, cols] projection."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def gguf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama, qwen3)")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    cfg = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "vocab_size": int(g("vocab_size", len(_field(reader, "tokenizer.ggml.tokens", [])))),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    return cfg


def iter_gguf_tensors(reader, cfg: dict):
    from gguf.quants import dequantize
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for t in reader.tensors:
        name = t.name
        if name in _NAME_MAP:
            hf = _NAME_MAP[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            base, suffix = rest.rsplit(".", 1)
            if base not in _BLOCK_MAP:
                continue
            hf = f"model.layers.{idx}.{_BLOCK_MAP[base]}.{suffix}"
        else:
            continue
        arr = dequantize(t.data, t.tensor_type).astype(np.float32)
        arr = arr.reshape([int(x) for x in reversed(t.shape)]) if arr.ndim != len(t.shape) else arr
        if cfg["model_type"] == "llama" and suffix_is_weight(name):
            if ".attn_q." in name:
                arr = unpermute_qk(arr, n_head)
            elif ".attn_k." in name:
                arr = unpermute_qk(arr, n_kv)
        yield hf, torch.from_numpy(np.ascontiguousarray(arr))


def suffix_is_weight(name: str) -> bool:
    return name.endswith(".weight")


def _file_key(path: str) -> str:
    st = os.stat(path)
    h = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return f"{os.path.basename(path).rsplit('.', 1)[0]}-{h}"


def convert_gguf(path: str, cache_root: str) -> str:
    """Convert a GGUF file to a cached Hugging Face directory; return the directory."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    out = os.path.join(cache_root, "models", _file_key(path))
    if os.path.exists(os.path.join(out, "DONE")):
        return out
    logger.info("converting %s (one-time, cached at %s)", path, out)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    reader = GGUFReader(path)
    cfg = gguf_config(reader)
    tensors = dict(iter_gguf_tensors(reader, cfg))
    save_file(tensors, os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                            gguf_file=os.path.basename(path))
        tmpl = _field(reader, "tokenizer.chat_template")
        if tmpl and not getattr(tok, "chat_template", None):
            tok.chat_template = tmpl
        tok.save_pretrained(tmp)
    except Exception as e:  # a model without a usable tokenizer still runs on token ids
        logger.warning("could not build a tokenizer from %s: %s", path, e)
    open(os.path.join(tmp, "DONE"), "w").close()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# --- Q4_1 blocks for the int4 kernels (layers/quant.py) ------------------------------------------
Q4_1_BLOCK = 32
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def decode_q4_1(raw: np.ndarray, rows: int, cols: int):
    """GGUF Q4_1 bytes -> (codes uint8 [rows, cols] in 0..15, d fp16 [rows, cols/32], m fp16 [...]),
    with w = codes * d + m per block of 32 columns (ggml's block_q4_1: d, m, 16 bytes of nibbles;
    low nibbles are columns 0..15 of the block, high nibbles 16..31)."""
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0]
    m = blocks[:, 2:4].copy().view(np.float16)[:, 0]
    qs = blocks[:, 4:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.uint8)
    return (codes.reshape(rows, cols), d.reshape(rows, cols // Q4_1_BLOCK), m.reshape(rows, cols // Q4_1_BLOCK))


def gguf_int4_source(gguf_path: str, cache_root: str) -> dict:
    """The GGUF's Q4_1 layer weights in the int4 layout, keyed by draftwise module name (q/k/v and
    gate/up fused like the model): {name: (codes [N, K] uint8, scale [N, K/32], minimum [N, K/32])}.
    Cached next to the converted model (the fp32 conversion's directory)."""
    from safetensors.torch import load_file, save_file
    out_dir = convert_gguf(gguf_path, cache_root)
    cached = os.path.join(out_dir, "int4", "q4_1_blocks.safetensors")   # not a model shard
    if not os.path.exists(cached):
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        from gguf import GGUFReader
        reader = GGUFReader(gguf_path)
        cfg = gguf_config(reader)
        n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        parts: dict[str, dict[int, tuple]] = {}
        for t in reader.tensors:
            if t.tensor_type.name != "Q4_1" or not t.name.startswith("blk.") or not t.name.endswith(".weight"):
                continue
            _, idx, rest = t.name.split(".", 2)
            base = rest.rsplit(".", 1)[0]
            if base not in _BLOCK_MAP:
                continue
            cols, rows = (int(x) for x in t.shape)
            codes, d, m = decode_q4_1(np.asarray(t.data), rows, cols)
            if cfg["model_type"] == "llama" and base in ("attn_q", "attn_k"):
                n = n_head if base == "attn_q" else n_kv
                codes, d, m = (unpermute_qk(a, n) for a in (codes, d, m))
            mod, proj = _BLOCK_MAP[base].split(".")
            fused, shard = _FUSED.get(proj, (proj, 0))
            parts.setdefault(f"layers.{idx}.{mod}.{fused}", {})[shard] = (codes, d, m)
        tensors = {}
        for name, shards in parts.items():
            ordered = [shards[i] for i in sorted(shards)]
            for j, key in enumerate(("codes", "scale", "minimum")):
                tensors[f"{name}.{key}"] = torch.from_numpy(np.ascontiguousarray(
                    np.concatenate([s[j] for s in ordered], axis=0)))
        save_file(tensors, cached + ".tmp")
        os.replace(cached + ".tmp", cached)
    t = load_file(cached)
    names = {k.rsplit(".", 1)[0] for k in t}
    return {n: (t[f"{n}.codes"], t[f"{n}.scale"].float(), t[f"{n}.minimum"].float()) for n in names}


# --- the Q8_0 token embedding, looked up without a dense copy (layers/quant.py Q8Embedding) ------
Q8_0_BLOCK = 32


def decode_q8_0(raw: np.ndarray, rows: int, cols: int):
    """GGUF Q8_0 bytes -> (codes int8 [rows, cols], d fp16 [rows, cols/32]), w = codes * d per
    block of 32 columns (ggml's block_q8_0: d, then 32 signed bytes)."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0]
    codes = blocks[:, 2:].copy().view(np.int8)
    return codes.reshape(rows, cols), d.reshape(rows, cols // Q8_0_BLOCK)


def gguf_q8_0_embedding(gguf_path: str, cache_root: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The GGUF's token embedding as (codes int8 [V, H], scale fp16 [V, H/32]) when it is stored as
    Q8_0 (None otherwise); cached next to the converted model."""
    from safetensors.torch import load_file, save_file
    out_dir = convert_gguf(gguf_path, cache_root)
    cached = os.path.join(out_dir, "int4", "q8_0_embedding.safetensors")   # not a model shard
    if not os.path.exists(cached):
        from gguf import GGUFReader
        reader = GGUFReader(gguf_path)
        t = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if t is None or t.tensor_type.name != "Q8_0":
            return None
        cols, rows = (int(x) for x in t.shape)
        codes, d = decode_q8_0(np.asarray(t.data), rows, cols)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        save_file({"codes": torch.from_numpy(np.ascontiguousarray(codes)),
                   "scale": torch.from_numpy(np.ascontiguousarray(d))}, cached + ".tmp")
        os.replace(cached + ".tmp", cached)
    t = load_file(cached)
    return t["codes"], t["scale"]
