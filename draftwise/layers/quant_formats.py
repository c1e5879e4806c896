"""The weight formats of the quantized linears, as pure tensor functions (layers/quant.py builds
the modules, kernels/ packs these codes for its C++ kernels)."""
from __future__ import annotations

import torch

INT4_GROUP = 32


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scale [N]) with w ~ q * scale[:, None] (symmetric, round to nearest)."""
    w = w.float()
    scale = (w.abs().amax(1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4_groupwise(w: torch.Tensor, group: int = INT4_GROUP):
    """Asymmetric min/max int4 per group of `group` input columns (the GGUF Q4_1 recipe):
    (codes uint8 [N, K] in 0..15, scale [N, K/g], minimum [N, K/g]) with w ~ codes * scale + min."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"int4 needs the input size ({K}) to be a multiple of the group size {group}")
    wg = w.float().reshape(N, K // group, group)
    mn, mx = wg.amin(-1), wg.amax(-1)
    scale = ((mx - mn) / 15.0).clamp_min(1e-12)
    codes = torch.round((wg - mn[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(N, K), scale, mn
