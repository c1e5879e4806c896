"""GGUF weight formats, one small module per block family, decided per tensor.

Every quantized GGUF type draftwise reads decodes, at load, into one exact form the kernels share:
group-affine integer codes,

    w[n, k] = scale[n, g] * (code[n, k] - offset) + minimum[n, g]      g = k // group  (16 or 32)

with the codes small integers (4- or 5-bit unsigned, or int8; `offset` a per-tensor constant: 8 for
Q4_0, 16 for Q5_0) and the scale and minimum fp32 numbers that
are exact products of the block's fp16 super-scale and its integer sub-scales. That form holds each
family's weights exactly: `dequantize()` of it equals `gguf.quants.dequantize` bit for bit (tests
check every type), because each product `scale * code` is exact in fp32 and the one rounding left is
the block format's own (its minimum added, as llama.cpp does). The kernels multiply the codes in
fp32 and apply scale and minimum once per group (`draftwise/kernels/cpu/affine.h`).

    legacy.py   Q4_0, Q4_1, Q5_0, Q5_1, Q8_0         blocks of 32, one fp16 scale (and minimum)
    kquants.py  Q2_K, Q3_K, Q4_K, Q5_K, Q6_K          super-blocks of 256 with 6- or 8-bit sub-scales
    iquants.py  IQ4_NL, IQ4_XS                       a non-linear 16-value codebook (int8 values)
    dense.py    F32, F16, BF16                       plain numbers (norms, small tables)

A type not listed is refused by name (`UnsupportedFormat`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from draftwise.formats.dense import DENSE


class UnsupportedFormat(ValueError):
    """A tensor's GGUF type has no reader here."""


@dataclass
class ScaleFactors:
    """A super-block family's scales as its file stores them: per 256 inputs an fp16 super-scale,
    per group a small integer, so that scale = d * sc and minimum = dmin * m exactly in fp32 (the
    products' bits fit its mantissa). Kernels keep these instead of the fp32 products: ~0.6 bits a
    weight instead of 1-2."""
    d: torch.Tensor                # [N, K / 256] fp32 (fp16 values)
    sc: torch.Tensor               # [N, K / group] int8
    dmin: torch.Tensor | None = None   # [N, K / 256] fp32 (fp16 values), negated: minimum = dmin * m
    m: torch.Tensor | None = None      # [N, K / group] int8

    def take_rows(self, idx) -> "ScaleFactors":
        pick = lambda t: None if t is None else t[idx].contiguous()  # noqa: E731
        return ScaleFactors(pick(self.d), pick(self.sc), pick(self.dmin), pick(self.m))

    @staticmethod
    def cat(parts: list["ScaleFactors | None"]) -> "ScaleFactors | None":
        if any(p is None for p in parts) or len({p.dmin is None for p in parts}) > 1:
            return None
        join = lambda ts: None if ts[0] is None else torch.cat(ts, 0)  # noqa: E731
        return ScaleFactors(*(join([getattr(p, f) for p in parts]) for f in ("d", "sc", "dmin", "m")))


@dataclass
class GroupAffine:
    """A [N, K] weight as group-affine integer codes (the kernels' common form)."""
    codes: torch.Tensor            # [N, K]: uint8 0..15 (bits 4) or 0..31 (bits 5), else int8
    scale: torch.Tensor            # [N, K / group] fp32
    minimum: torch.Tensor | None   # [N, K / group] fp32, or None where the family has none (w = scale * code)
    group: int                     # 16 or 32 inputs per scale
    bits: int                      # 4 or 5 (unsigned codes: a nibble, plus a high bit) or 8 (int8)
    offset: int = 0                # subtracted from every code (Q4_0: 8, Q5_0: 16, Q3_K: 4)
    factors: ScaleFactors | None = None   # the super-block families' scales as stored (K-quants, IQ4_XS)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The fp32 [N, K] weight: scale * (code - offset) (+ minimum), as `gguf.quants` computes it."""
        N, K = self.codes.shape
        c = (self.codes.float() - self.offset).reshape(N, K // self.group, self.group)
        w = c * self.scale[..., None]
        if self.minimum is not None:
            w = w + self.minimum[..., None]
        return w.reshape(N, K)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized (an embedding lookup reads only the rows it needs)."""
        c = (self.codes[ids].float() - self.offset).unflatten(-1, (-1, self.group))
        w = c * self.scale[ids].unsqueeze(-1)
        if self.minimum is not None:
            w = w + self.minimum[ids].unsqueeze(-1)
        return w.flatten(-2)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF type: its block geometry and its decoder (raw blocks [n, type_size] uint8 of a
    row-major tensor -> (codes [n, block], scale [n, block/group], minimum or None), and for the
    super-block families (block 256) the factors of both: (d [n, 1], sc [n, block/group] int8,
    dmin [n, 1] or None, m or None) with scale = d * sc and minimum = dmin * m)."""
    name: str
    block_size: int                # weights per block
    type_size: int                 # bytes per block
    group: int
    bits: int
    offset: int
    decode_blocks: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]


FORMATS: dict[str, BlockFormat] = {}
DECODE_SLICE = 1 << 15             # blocks decoded at a time


def register(fmt: BlockFormat) -> BlockFormat:
    FORMATS[fmt.name] = fmt
    return fmt


def f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [..., 2] -> fp32 [...] (exact)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., B] -> codes [..., 2B]: the low nibbles first, then the high (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def supported_types() -> list[str]:
    return sorted(FORMATS) + sorted(DENSE)


def block_format(type_name: str) -> BlockFormat:
    fmt = FORMATS.get(type_name)
    if fmt is None:
        raise UnsupportedFormat(f"GGUF tensor type {type_name} is not supported "
                                f"(supported: {', '.join(supported_types())})")
    return fmt


def decode(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> GroupAffine:
    """A quantized [N, K] tensor's raw bytes (row-major blocks) -> its GroupAffine form."""
    fmt = block_format(type_name)
    N, K = shape
    if K % fmt.block_size:
        raise ValueError(f"a {type_name} tensor of {K} columns does not split into blocks of {fmt.block_size}")
    n = N * K // fmt.block_size
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, fmt.type_size)
    codes = np.empty((n, fmt.block_size), dtype=np.int8 if fmt.bits == 8 else np.uint8)
    scale = np.empty((n, fmt.block_size // fmt.group), dtype=np.float32)
    minimum = None
    factors: list | None = None
    # in slices of blocks, so the decoders' temporaries stay small beside a large tensor (an
    # embedding of 150k rows); the file's pages are read once, in order
    for b0 in range(0, n, DECODE_SLICE):
        c, s, m, *f = fmt.decode_blocks(np.ascontiguousarray(blocks[b0:b0 + DECODE_SLICE]))
        sl = slice(b0, b0 + DECODE_SLICE)
        codes[sl] = c
        scale[sl] = s
        if m is not None:
            if minimum is None:
                minimum = np.empty_like(scale)
            minimum[sl] = m
        if f:
            if factors is None:
                factors = [None if a is None else np.empty((n, a.shape[1]), dtype=a.dtype) for a in f[0]]
            for dst, a in zip(factors, f[0]):
                if dst is not None:
                    dst[sl] = a
    as_t = lambda a: torch.from_numpy(a.reshape(N, K // fmt.group))  # noqa: E731
    sf = None if factors is None else ScaleFactors(*(None if a is None else torch.from_numpy(a.reshape(N, -1))
                                                     for a in factors))
    return GroupAffine(torch.from_numpy(codes.reshape(N, K)), as_t(scale), None if minimum is None else as_t(minimum),
                       fmt.group, fmt.bits, fmt.offset, sf)


# the families register themselves
from draftwise.formats import iquants, kquants, legacy  # noqa: E402,F401
