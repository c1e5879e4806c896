"""A GGUF file's tensors as the engine's modules need them, read from their own blocks.

`GGUFBlocks(path)` indexes the memory-mapped file by draftwise's module names and decodes a
module's quantized tensors on demand with their block family's reader (draftwise/formats) into
exact group-affine codes: q/k/v and gate/up joined as the model fuses them, `lm_head` (the file's
`output.weight`, or the token embedding when the head is tied) and `embed_tokens`. Llama files hold
Q and K rows in llama.cpp's interleaved RoPE order; their rows are put back in the model's order
(a row permutation: codes, scales and minimums move together, so the blocks stay exact)."""
from __future__ import annotations

import numpy as np
import torch

from draftwise.formats import FORMATS, GroupAffine, ScaleFactors, decode
from draftwise.models.gguf_convert import _BLOCK_MAP, gguf_config, unpermute_qk
from draftwise.formats.dense import DENSE, read_dense
from draftwise.models.gguf_file import open_gguf

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _kind(ga: GroupAffine) -> tuple:
    return ga.group, ga.bits, ga.offset, ga.minimum is None


def concat_rows(parts: list[GroupAffine]) -> list[GroupAffine]:
    """Row-wise concatenation (q, k, v -> qkv): neighbours of one kind merge into one weight, parts
    of different kinds (a Q6_K v beside Q4_K q and k, as Q4_K_M files mix them) stay apart."""
    out = [parts[0]]
    for p in parts[1:]:
        last = out[-1]
        if _kind(p) != _kind(last):
            out.append(p)
            continue
        cat = lambda a, b: torch.cat([a, b], 0)  # noqa: E731
        out[-1] = GroupAffine(cat(last.codes, p.codes), cat(last.scale, p.scale),
                              None if p.minimum is None else cat(last.minimum, p.minimum), p.group, p.bits, p.offset,
                              ScaleFactors.cat([last.factors, p.factors]))
    return out


def _permute_rows(ga: GroupAffine, n_head: int) -> GroupAffine:
    perm = torch.from_numpy(unpermute_qk(np.arange(ga.codes.shape[0]), n_head))
    return GroupAffine(ga.codes[perm].contiguous(), ga.scale[perm].contiguous(),
                       None if ga.minimum is None else ga.minimum[perm].contiguous(), ga.group, ga.bits, ga.offset,
                       None if ga.factors is None else ga.factors.take_rows(perm))


def release_metadata(reader) -> None:
    """Drop the parsed metadata of a reader whose configuration has been read: `gguf` parses every
    value into small numpy arrays, ~0.5 GB for a 150k-token vocabulary and its merges, which a model
    built from the tensors does not need (the tokenizer is read once into the cache). The freed
    heap is handed back to the system so the weights decoded next do not stack on it."""
    import ctypes
    import gc
    big = bool(reader.tensors) and min(int(t.data_offset) for t in reader.tensors) > (4 << 20)
    reader.fields.clear()
    if not big:                              # a small header: nothing worth a collection
        return
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):        # not glibc: the memory is reused, not returned
        pass


class GGUFBlocks:
    """A GGUF file's tensors by draftwise module name, decoded on demand from the memory-mapped
    file (one module's weights in memory at a time while a model is built):
      get(name)       -> [GroupAffine parts] of a quantized linear or embedding, or None
      dense(name)     -> fp32 tensor of a plain-number tensor (norms, biases, F32/F16 matrices)
    Names: `embed_tokens`, `lm_head` (the file's `output.weight`, or the embedding when tied),
    `layers.{i}.self_attn.qkv_proj`, `.o_proj`, `layers.{i}.mlp.gate_up_proj`, `.down_proj`; dense
    names are the checkpoint's (`model.layers.0.input_layernorm.weight`, ...)."""

    def __init__(self, path: str):
        self.path = path
        self.reader = open_gguf(path)
        self.cfg = gguf_config(self.reader)
        self.by_name = {t.name: t for t in self.reader.tensors}
        release_metadata(self.reader)
        self.modules: dict[str, list[str]] = {}           # module -> its GGUF tensors, in row order
        for name in self.by_name:
            if name == "token_embd.weight":
                self.modules["embed_tokens"] = [name]
                if self.cfg["tie_word_embeddings"]:
                    self.modules["lm_head"] = [name]
            elif name == "output.weight":
                self.modules["lm_head"] = [name]
            elif name.startswith("blk.") and name.endswith(".weight"):
                _, idx, rest = name.split(".", 2)
                base = rest.rsplit(".", 1)[0]
                if "." not in _BLOCK_MAP.get(base, ""):        # a norm: not a linear
                    continue
                mod, proj = _BLOCK_MAP[base].split(".")
                fused, shard = _FUSED.get(proj, (proj, 0))
                self.modules.setdefault(f"layers.{idx}.{mod}.{fused}", []).append((shard, name))
        for k, v in self.modules.items():
            if v and isinstance(v[0], tuple):
                self.modules[k] = [n for _, n in sorted(v)]

    def tensor_type(self, gguf_name: str) -> str:
        return self.by_name[gguf_name].tensor_type.name

    def _decode(self, gguf_name: str) -> GroupAffine:
        t = self.by_name[gguf_name]
        cols, rows = (int(x) for x in t.shape)
        ga = decode(t.tensor_type.name, np.asarray(t.data), (rows, cols))
        self._drop_pages(t)
        if self.cfg["model_type"] == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = self.cfg["num_attention_heads"] if ".attn_q." in gguf_name else self.cfg["num_key_value_heads"]
            ga = _permute_rows(ga, heads)
        return ga

    def _drop_pages(self, t) -> None:
        """Hand a decoded tensor's file pages back to the page cache (they stay cached, no longer
        counted in this process's memory): a model's blocks are read once, and keeping every page
        mapped would add the whole file to the peak beside the decoded weights."""
        import mmap
        mm = getattr(t, "mmap", None) or getattr(self.reader, "mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = int(t.data_offset) + int(t.n_bytes)
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass

    def __contains__(self, name: str) -> bool:
        return self.get_names(name) is not None

    def get_names(self, name: str) -> list[str] | None:
        """The GGUF tensors of module `name` when all are in quantized block types, else None."""
        names = self.modules.get(name)
        if not names or any(self.tensor_type(n) not in FORMATS or len(self.by_name[n].shape) != 2 for n in names):
            return None
        return names

    def get(self, name: str, default=None):
        names = self.get_names(name)
        if names is None:
            return default
        return concat_rows([self._decode(n) for n in names])

    def bias(self, name: str) -> torch.Tensor | None:
        """The bias of linear module `name` (its parts' biases joined), or None where it has none."""
        names = [n[: -len(".weight")] + ".bias" for n in self.modules.get(name, [])]
        if not names or not all(n in self.by_name for n in names):
            return None
        return torch.cat([self.dense(n) for n in names])

    def dense_weight(self, name: str) -> torch.Tensor:
        """Module `name`'s weight dequantized to fp32 (its parts joined): for a linear the file keeps
        in plain numbers, or in a type with no block reader here (dequantized by gguf)."""
        return torch.cat([self.dense(n) for n in self.modules[name]])

    def dense(self, gguf_name: str) -> torch.Tensor:
        """A tensor in plain numbers (or any type, dequantized by gguf) as fp32, in the model's
        [rows, cols] order (Llama Q/K rows and biases back in the model's RoPE order)."""
        from gguf.quants import dequantize
        t = self.by_name[gguf_name]
        shape = tuple(int(x) for x in reversed(t.shape))
        kind = t.tensor_type.name
        x = read_dense(kind, np.asarray(t.data), shape) if kind in DENSE else \
            torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type).astype(np.float32))).reshape(shape)
        if self.cfg["model_type"] == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = self.cfg["num_attention_heads"] if ".attn_q." in gguf_name else self.cfg["num_key_value_heads"]
            x = torch.from_numpy(np.ascontiguousarray(unpermute_qk(x.numpy(), heads)))
        return x
