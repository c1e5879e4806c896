"""ggml's first block formats: 32 weights per block, one fp16 scale d (and, for the _1 types, an
fp16 minimum m).

    Q4_0  w = d * (q - 8)        q 4-bit     -> codes q (nibbles) less offset 8, scale d
    Q4_1  w = d * q + m          q 4-bit     -> codes q (nibbles), scale d, minimum m
    Q5_0  w = d * (q - 16)       q 5-bit     -> codes q (5-bit) less offset 16, scale d
    Q5_1  w = d * q + m          q 5-bit     -> codes q (5-bit), scale d, minimum m
    Q8_0  w = d * q              q int8      -> codes q, scale d

A 5-bit code is a nibble from `qs` plus one bit from the 32-bit `qh` (bit j for weight j)."""
from __future__ import annotations

import numpy as np

from draftwise.formats import BlockFormat, f16, nibbles, register


def _q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    high = (np.ascontiguousarray(qh).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1       # [n, 32]
    return nibbles(qs) | (high.astype(np.uint8) << 4)


def _q4_0(b):
    return nibbles(b[:, 2:18]), f16(b[:, 0:2])[:, None], None


def _q4_1(b):
    return nibbles(b[:, 4:20]), f16(b[:, 0:2])[:, None], f16(b[:, 2:4])[:, None]


def _q5_0(b):
    return _q5(b[:, 2:6], b[:, 6:22]), f16(b[:, 0:2])[:, None], None


def _q5_1(b):
    return _q5(b[:, 4:8], b[:, 8:24]), f16(b[:, 0:2])[:, None], f16(b[:, 2:4])[:, None]


def _q8_0(b):
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), f16(b[:, 0:2])[:, None], None


Q4_0 = register(BlockFormat("Q4_0", 32, 18, 32, 4, 8, _q4_0))
Q4_1 = register(BlockFormat("Q4_1", 32, 20, 32, 4, 0, _q4_1))
Q5_0 = register(BlockFormat("Q5_0", 32, 22, 32, 5, 16, _q5_0))
Q5_1 = register(BlockFormat("Q5_1", 32, 24, 32, 5, 0, _q5_1))
Q8_0 = register(BlockFormat("Q8_0", 32, 34, 32, 8, 0, _q8_0))
