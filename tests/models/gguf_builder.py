"""Tiny random Llama GGUF files in any block types, for tests (the `gguf` package writes them; it
cannot quantize K-quants, so their blocks are valid random bytes with small finite scales)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from draftwise.formats import FORMATS

# byte offsets of the fp16 scales of the types gguf cannot quantize (K-quants, IQ4)
_KQ_F16 = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0], "IQ4_NL": [0]}


def block_bytes(kind: str, w: np.ndarray, rng) -> np.ndarray:
    """A [N, K] weight in `kind`'s blocks: quantized by gguf where it can, else random blocks whose
    scales give weights of about w's size."""
    if kind in _KQ_F16:
        fmt = FORMATS[kind]
        n = w.size // fmt.block_size
        b = rng.integers(0, 256, size=(n, fmt.type_size), dtype=np.uint8)
        for off in _KQ_F16[kind]:
            b[:, off:off + 2] = np.full(n, 2e-3, np.float16).view(np.uint8).reshape(n, 2)
        if kind == "Q6_K":
            b[:, 192:208] = rng.integers(-8, 8, size=(n, 16)).astype(np.int8).view(np.uint8)
        return b.reshape(w.shape[0], -1)
    return quantize(w, GGMLQuantizationType[kind])


def byte_tokens(vocab: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of `vocab` tokens (GPT-2's byte alphabet, then merges of
    printable pairs, the last token `<|im_end|>`) and its merges: enough for a tiny model to read
    and write real text."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    alphabet = [chr(c) for c in cs]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    merges, tokens = [], list(alphabet)
    for a in ["Ġ", *letters]:
        for b in letters:
            if len(tokens) >= vocab - 1:
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    return tokens + ["<|im_end|>"], merges


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_llama_gguf(path: str, types: dict[str, str], hidden=256, layers=2, heads=4, kv_heads=2,
                          inter=512, vocab=512, seed=0, arch="llama", head_dim=None, sliding_window=8,
                          context_length=512, tokenizer: bool = False, split_max_tensors: int = 0) -> str:
    """`types`: GGUF base name (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down,
    token_embd, output) -> block type; missing ones F32. `arch`: llama, qwen2 (q/k/v biases) or
    gemma3 (q/k norms, pre- and post-norms, a sliding window of `sliding_window` keys on five
    layers of six). Writes a file with no tokenizer unless `tokenizer` (byte_tokens, a ChatML
    template); `split_max_tensors` splits it into shards as llama.cpp's gguf-split does
    (PATH-00001-of-0000N.gguf, ...; the first shard's path is returned)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(layers)
    w.add_context_length(context_length)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    if tokenizer:
        tokens, merges = byte_tokens(vocab)
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1] * (len(tokens) - 1) + [3])
        w.add_token_merges(merges)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_bos_token_id(len(tokens) - 1)
        w.add_chat_template(CHATML)
    hd = head_dim or hidden // heads
    if arch == "gemma3":
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_sliding_window(sliding_window)

    def add(name: str, kind: str, shape):
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if kind == "F32" or len(shape) == 1:
            w.add_tensor(name, x if len(shape) == 2 else np.ones(shape, np.float32) + x * 0.1)
        else:
            raw = block_bytes(kind, x, rng)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[kind])

    add("token_embd.weight", types.get("token_embd", "F32"), (vocab, hidden))
    if "output" in types:
        add("output.weight", types["output"], (vocab, hidden))
    add("output_norm.weight", "F32", (hidden,))
    shapes = {"attn_q": (heads * hd, hidden), "attn_k": (kv_heads * hd, hidden), "attn_v": (kv_heads * hd, hidden),
              "attn_output": (hidden, heads * hd), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", "F32", (hidden,))
        add(f"blk.{i}.ffn_norm.weight", "F32", (hidden,))
        if arch == "gemma3":
            for norm, size in (("post_attention_norm", hidden), ("post_ffw_norm", hidden), ("attn_q_norm", hd),
                               ("attn_k_norm", hd)):
                add(f"blk.{i}.{norm}.weight", "F32", (size,))
        for base, shape in shapes.items():
            add(f"blk.{i}.{base}.weight", types.get(base, "F32"), shape)
            if arch == "qwen2" and base in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{base}.bias", (rng.standard_normal(shape[0]) * 0.5).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        import glob
        return sorted(glob.glob(path[:-len(".gguf")] + "-00001-of-*.gguf"))[0]
    return path
