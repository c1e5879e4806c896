"""ggml's K-quants: super-blocks of 256 weights with an fp16 super-scale d (and dmin), and integer
sub-scales per 16 or 32 weights. Each sub-block's scale d * sc and minimum dmin * m are exact fp32
products, so every type is group-affine codes exactly (layouts as ggml-quants.c / gguf.quants):

    Q2_K  16 x 16: w = d sc q - dmin m       q 2-bit          codes q (nibbles), group 16
    Q3_K  16 x 16: w = d (sc - 32) q         q in [-4, 3]     codes q + 4 (nibbles) less offset 4
    Q4_K   8 x 32: w = d sc q - dmin m       q 4-bit          codes q (nibbles)
    Q5_K   8 x 32: w = d sc q - dmin m       q 5-bit          codes q (5-bit)
    Q6_K  16 x 16: w = d sc (q - 32)         sc int8, q 6-bit codes q - 32 (int8)

Q4_K / Q5_K pack their eight 6-bit scale and minimum pairs in 12 bytes (`scale_min_k4`). Each
decoder also returns the factors (d, sc, -dmin, m) the kernels keep instead of the products."""
from __future__ import annotations

import numpy as np

from draftwise.formats import BlockFormat, f16, register

QK_K = 256


def scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of a Q4_K / Q5_K block -> (sc [n, 8], m [n, 8]), 6 bits each."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q2_k(b):
    n = b.shape[0]
    sc, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = f16(b[:, 80:82])[:, None], f16(b[:, 82:84])[:, None]
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    s, m = (sc & 0x0F).astype(np.int8), (sc >> 4).astype(np.int8)
    return q.reshape(n, QK_K), d * s.astype(np.float32), -(dmin * m.astype(np.float32)), (d, s, -dmin, m)


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, s, d = b[:, 0:32], b[:, 32:96], b[:, 96:108], f16(b[:, 108:110])[:, None]
    lo = (s[:, 0:8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    hi = (s[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(np.int8) - np.int8(32)
    scale = d * sc.astype(np.float32)
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    h = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1       # [n, 8, 32]
    # q = ql - 4 (1 - h): stored as q + 4 = ql + 4 h, in 0..7
    codes = ql.reshape(n, 8, 32) + (h << 2)
    return codes.reshape(n, QK_K), scale, None, (d, sc, None, None)


def _q4_k(b):
    n = b.shape[0]
    d, dmin = f16(b[:, 0:2])[:, None], f16(b[:, 2:4])[:, None]
    sc, mn = scale_min_k4(b[:, 4:16])
    q = (b[:, 16:144].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return q.reshape(n, QK_K), d * sc, -(dmin * mn), (d, sc.astype(np.int8), -dmin, mn.astype(np.int8))


def _q5_k(b):
    n = b.shape[0]
    d, dmin = f16(b[:, 0:2])[:, None], f16(b[:, 2:4])[:, None]
    sc, mn = scale_min_k4(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:176]
    ql = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    h = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = ql.reshape(n, 8, 32) | (h << 4)
    return q.reshape(n, QK_K), d * sc, -(dmin * mn), (d, sc.astype(np.int8), -dmin, mn.astype(np.int8))


def _q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc, d = np.ascontiguousarray(b[:, 192:208]).view(np.int8), f16(b[:, 208:210])[:, None]
    lo = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (lo.reshape(n, 8, 32) | (hi.reshape(n, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    return q.reshape(n, QK_K), d * sc.astype(np.float32), None, (d, sc, None, None)


Q2_K = register(BlockFormat("Q2_K", QK_K, 84, 16, 4, 0, _q2_k))
Q3_K = register(BlockFormat("Q3_K", QK_K, 110, 16, 4, 4, _q3_k))
Q4_K = register(BlockFormat("Q4_K", QK_K, 144, 32, 4, 0, _q4_k))
Q5_K = register(BlockFormat("Q5_K", QK_K, 176, 32, 5, 0, _q5_k))
Q6_K = register(BlockFormat("Q6_K", QK_K, 210, 16, 8, 0, _q6_k))
