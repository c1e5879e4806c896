"""The paged KV cache's tensors: one pool of fixed-size blocks shared by the target's layers
(`layers.0 … layers.N-1`) and the drafter's layers (`layers.N …`). The engine's block allocator
(engine/kv_cache.py) decides which blocks a request owns.

Layers with the same (num_kv_heads, head_dim) share one tensor; every layer is addressed by the
same slots: `slot = block_table[pos // block_size] * block_size + pos % block_size`.
"""
from __future__ import annotations

import mmap

import torch


class KVCache:
    def __init__(self, num_blocks: int, block_size: int, layer_specs: list[tuple[int, int]],
                 dtype: torch.dtype, device: str | torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_slots = num_blocks * block_size
        self.layer_specs = list(layer_specs)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, spec in enumerate(self.layer_specs):
            groups.setdefault(spec, []).append(i)
        self._layers: list = [None] * len(self.layer_specs)
        for (hkv, hd), idxs in groups.items():
            t = pool_zeros((len(idxs), 2, self.num_slots, hkv, hd), dtype, device)
            for j, li in enumerate(idxs):
                self._layers[li] = (t[j, 0], t[j, 1])

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, layers: range | None = None) -> None:
        """Move K/V entries src -> dst (same length) in the given layers (all by default); used to
        keep only the accepted path of a verified tree."""
        for i in (layers if layers is not None else range(self.num_layers)):
            k, v = self._layers[i]
            k.index_copy_(0, dst, k[src])
            v.index_copy_(0, dst, v[src])


HUGE_PAGE = 2 << 20


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed KV pool. On a Linux CPU, backed by memory the kernel is asked to map with 2 MiB
    pages (madvise MADV_HUGEPAGE; transparent huge pages are often "madvise"-only): a decode
    step's attention reads its keys and values from blocks scattered over the whole pool, and with
    4 KiB pages nearly every block costs a TLB miss (SmolLM2, 16 requests, 30 layers: 194 -> 150 us
    per layer's attention at one thread). Elsewhere, or where that fails, plain torch.zeros."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    try:
        buf = mmap.mmap(-1, nbytes)                      # anonymous: zero-filled, faulted in on first use
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)   # the tensor keeps buf alive
