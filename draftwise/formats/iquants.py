"""The non-linear 4-bit formats: each nibble indexes a fixed 16-value codebook of int8 numbers
(`KVALUES`, llama.cpp's kvalues_iq4nl), so the codes are the codebook's values and the weights
group-affine with no minimum:

    IQ4_NL  blocks of 32: w = d * KVALUES[q]
    IQ4_XS  super-blocks of 256, 8 x 32: w = d * (ls - 32) * KVALUES[q], ls 6-bit (4 low bits in
            scales_l, 2 high in scales_h)"""
from __future__ import annotations

import numpy as np

from draftwise.formats import BlockFormat, f16, nibbles, register

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_nl(b):
    return KVALUES[nibbles(b[:, 2:18])], f16(b[:, 0:2])[:, None], None


def _iq4_xs(b):
    n = b.shape[0]
    d = f16(b[:, 0:2])[:, None]
    sh = np.ascontiguousarray(b[:, 2:4]).view("<u2")                                          # [n, 1]
    sl = (b[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    hi = ((sh >> np.arange(0, 16, 2, dtype=np.uint16).reshape(1, 8)) & 3).astype(np.uint8)
    ls = (sl | (hi << 4)).astype(np.int8) - np.int8(32)
    q = (b[:, 8:136].reshape(n, 8, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return KVALUES[q.reshape(n, 256)], d * ls.astype(np.float32), None, (d, ls, None, None)


IQ4_NL = register(BlockFormat("IQ4_NL", 32, 18, 32, 8, 0, _iq4_nl))
IQ4_XS = register(BlockFormat("IQ4_XS", 256, 136, 32, 8, 0, _iq4_xs))
