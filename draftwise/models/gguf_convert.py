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

from draftwise.config import HF_ARCHITECTURES
from draftwise.models.gguf_file import open_gguf

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


# Gemma 3 names its four per-layer norms apart ("ffn_norm" is the MLP's pre-norm there)
_GEMMA3_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}


def block_map(arch: str) -> dict[str, str]:
    """GGUF per-layer tensor base name -> the model's module path, for architecture `arch`."""
    return {**_BLOCK_MAP, **_GEMMA3_NORMS} if arch.startswith("gemma3") else _BLOCK_MAP


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(weights, n_head)` on a [rows, cols] projection."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - a value the parser cannot decode
        raise ValueError(f"GGUF metadata {key!r} cannot be read") from None


def _number(reader, key, kind, default=None, lo=1, hi=1 << 24):
    """A numeric metadata value, checked to be a number in [lo, hi] (a hostile file's absurd sizes
    are refused before anything is sized by them)."""
    v = _field(reader, key, default)
    if v is None:
        raise ValueError(f"GGUF metadata {key!r} is missing")
    try:
        x = kind(v)
    except (TypeError, ValueError):
        raise ValueError(f"GGUF metadata {key!r} is {v!r}, not a number") from None
    if not lo <= x <= hi:
        raise ValueError(f"GGUF metadata {key!r} = {x} is outside [{lo}, {hi}]")
    return x


def gguf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in HF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported ({', '.join(HF_ARCHITECTURES)})")
    n = lambda k, d=None, hi=1 << 24: _number(reader, f"{arch}.{k}", int, d, hi=hi)  # noqa: E731
    f = lambda k, d: _number(reader, f"{arch}.{k}", float, d, lo=0.0, hi=1e12)  # noqa: E731
    heads = n("attention.head_count", hi=4096)
    hidden = n("embedding_length")
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    cfg = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "attention_bias": arch == "qwen2",
        "hidden_size": hidden,
        "intermediate_size": n("feed_forward_length"),
        "num_hidden_layers": n("block_count", hi=1024),
        "num_attention_heads": heads,
        "num_key_value_heads": n("attention.head_count_kv", heads, hi=4096),
        "head_dim": n("attention.key_length", max(hidden // heads, 1), hi=4096),
        "rms_norm_eps": f("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": f("rope.freq_base", 10000.0),
        "max_position_embeddings": n("context_length", 2048, hi=1 << 26),
        "vocab_size": n("vocab_size", len(tokens) if isinstance(tokens, list) else None),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and eot != cfg["eos_token_id"] and cfg["eos_token_id"] is not None:
        cfg["eos_token_id"] = [cfg["eos_token_id"], eot]          # every end-of-turn token stops
    if arch == "gemma3":
        # llama.cpp's Gemma 3: every 6th layer global, the others a sliding window with RoPE base
        # 10,000; softmax scale head_dim ** -0.5; norms stored with Gemma's +1 already added
        cfg.update({"model_type": "gemma3_text", "sliding_window": n("attention.sliding_window", 512, hi=1 << 26),
                    "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
                    "query_pre_attn_scalar": cfg["head_dim"], "hidden_activation": "gelu_pytorch_tanh",
                    "norms_include_one": True})
    return cfg


def iter_gguf_tensors(reader, cfg: dict):
    from gguf.quants import dequantize
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = block_map(cfg["model_type"])
    for t in reader.tensors:
        name = t.name
        if name in _NAME_MAP:
            hf = _NAME_MAP[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            base, suffix = rest.rsplit(".", 1)
            if base not in names:
                continue
            hf = f"model.layers.{idx}.{names[base]}.{suffix}"
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


# (GGUF architecture, tokenizer model) -> the tokenizer class transformers' AutoTokenizer builds for
# such a file. AutoTokenizer finds it through a config it first reads from the whole file with
# gguf-py's reader (4 s for SmolLM2, 11 s for Qwen2.5-Coder-0.5B); the class's own from_pretrained
# reads only the tokenizer's keys (0.4 s, 1 s) and gives the same files (tests/models/test_gguf_file.py
# compares them). Other files go through AutoTokenizer.
GGUF_TOKENIZER_CLASSES = {("llama", "gpt2"): "TokenizersBackend", ("qwen2", "gpt2"): "Qwen2Tokenizer"}


def gguf_tokenizer(path: str, reader):
    """The Hugging Face tokenizer a GGUF's metadata describes, as AutoTokenizer builds it."""
    import transformers
    name = GGUF_TOKENIZER_CLASSES.get((_field(reader, "general.architecture"), _field(reader, "tokenizer.ggml.model")))
    cls = getattr(transformers, name) if name else transformers.AutoTokenizer
    return cls.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))


def gguf_metadata_dir(path: str, cache_root: str) -> str:
    """The cached directory of a GGUF's configuration (config.json) and tokenizer, read from its
    metadata alone (a few MB at most; the weights stay in the file). Returns the directory."""
    out = os.path.join(cache_root, "models", _file_key(path))
    if os.path.exists(os.path.join(out, "config.json")) and (
            os.path.exists(os.path.join(out, "META")) or os.path.exists(os.path.join(out, "DONE"))):
        return out
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    reader = open_gguf(path)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(gguf_config(reader), f, indent=2)
    try:
        tok = gguf_tokenizer(path, reader)
        tmpl = _field(reader, "tokenizer.chat_template")
        if tmpl and not getattr(tok, "chat_template", None):
            tok.chat_template = tmpl
        tok.save_pretrained(tmp)
    except Exception as e:  # a model without a usable tokenizer still runs on token ids
        logger.warning("could not build a tokenizer from %s: %s", path, e)
    open(os.path.join(tmp, "META"), "w").close()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def convert_gguf(path: str, cache_root: str) -> str:
    """The GGUF dequantized to a cached Hugging Face directory (fp32 model.safetensors beside the
    metadata): what runs it unquantized (`quantization=None`) or re-quantized (int8 / int4).
    Running a GGUF on its own blocks needs none of it (loader.load_gguf_target)."""
    from safetensors.torch import save_file
    out = gguf_metadata_dir(path, cache_root)
    if os.path.exists(os.path.join(out, "DONE")):
        return out
    logger.info("dequantizing %s to fp32 (one-time, cached at %s)", path, out)
    reader = open_gguf(path)
    tensors = dict(iter_gguf_tensors(reader, gguf_config(reader)))
    target = os.path.join(out, "model.safetensors")
    save_file(tensors, target + ".tmp")
    os.replace(target + ".tmp", target)
    open(os.path.join(out, "DONE"), "w").close()
    return out
