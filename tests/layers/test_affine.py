"""The group-affine linear (every GGUF block family) on each ISA path this CPU has: bit-identical
to a scalar reference of its order of operations, within 1e-3 of an fp64 matmul of the dequantized
weight, and the same bits for a row whatever the rows beside it."""
import pytest
import torch

from draftwise import kernels
from draftwise.formats import FORMATS, decode
from draftwise.layers.quant import GroupAffineLinear
from tests.formats.test_blocks import random_blocks


def _lane_sum(v: torch.Tensor) -> torch.Tensor:
    """8 lanes [M, 8] summed as both ISAs' reductions do: halves, then (0 + 2, 1 + 3), then the two."""
    s4 = v[:, 0:4] + v[:, 4:8]
    return (s4[:, 0:1] + s4[:, 2:3]) + (s4[:, 1:2] + s4[:, 3:4])


def reference(x_bf16: torch.Tensor, ga, isa: str) -> torch.Tensor:
    """The kernel's arithmetic in scalar steps. Per group two partial dot products: on AVX2 the even
    and the odd inputs, one FMA each in input order; on AVX-512 the even and the odd input pairs, one
    bf16 dot-product step each (pair element 2p+1's product added first, then 2p's). Every product
    x * code is exact in fp32 (bf16 x a small integer), so each step is one rounded add. Then
    acc = fma(d_even + d_odd, scale, acc) and acc = fma(minimum, sum(x_g), acc), fma as an exact
    product in fp64 rounded once to fp32."""
    x = x_bf16.float()
    M, K = x.shape
    c = ga.codes.float() - ga.offset                       # [N, K]
    gs = ga.group
    acc = torch.zeros(M, c.shape[0])
    fma = lambda a, b, d: (a.double() * b.double() + d.double()).float()  # noqa: E731
    term = lambda k: x[:, k:k + 1] * c[:, k][None]  # noqa: E731
    for g in range(K // gs):
        d = [torch.zeros(M, c.shape[0]), torch.zeros(M, c.shape[0])]
        k0 = g * gs
        if isa == "avx2":
            for k in range(k0, k0 + gs):
                d[k % 2] = d[k % 2] + term(k)
        else:
            for p in range(k0 // 2, (k0 + gs) // 2):
                d[p % 2] = (d[p % 2] + term(2 * p + 1)) + term(2 * p)
        acc = fma(d[0] + d[1], ga.scale[:, g][None], acc)
        if ga.minimum is not None:
            xg = x[:, k0:k0 + gs]
            if isa == "avx2":
                v = xg[:, 0:8] + xg[:, 8:16]
                if gs == 32:
                    v = v + (xg[:, 16:24] + xg[:, 24:32])
            else:
                v16 = xg[:, 0:16] + xg[:, 16:32] if gs == 32 else xg
                v = v16[:, 0:8] + v16[:, 8:16]
            acc = fma(ga.minimum[:, g][None], _lane_sum(v), acc)
    return acc


def _weight(name, N=32, blocks_per_row=None, seed=0):
    fmt = FORMATS[name]
    per_row = blocks_per_row or max(1, 512 // fmt.block_size)
    raw = random_blocks(name, N * per_row, seed=seed)
    return decode(name, raw, (N, per_row * fmt.block_size))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_affine_kernel_equals_its_reference(isa_kernels, name):
    ga = _weight(name)
    x = (torch.randn(5, ga.codes.shape[1]) * 3).to(torch.bfloat16)
    lin = GroupAffineLinear([ga])
    assert lin.draftwise_kernel
    y = lin(x.float())
    ref = reference(x, ga, "avx2" if isa_kernels == "avx2" else "avx512")
    assert torch.equal(y, ref), (y - ref).abs().max()
    exact = x.double() @ ga.dequantize().double().t()
    assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < 1e-3


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
def test_affine_rows_are_independent_of_the_call(kernel_isa, name):
    """Register tiles (up to 3 rows), the fp32 tile (more), and the PyTorch fallback (DRAFTWISE_ISA
    =none) alike: a row's bits do not depend on the rows beside it."""
    ga = _weight(name, N=48)
    lin = GroupAffineLinear([ga])
    x = torch.randn(11, ga.codes.shape[1])
    alone = torch.cat([lin(x[i:i + 1]) for i in range(11)])
    for m in (2, 3, 4, 11):
        assert torch.equal(lin(x[:m]), alone[:m]), m
    exact = x.to(torch.bfloat16).double() @ ga.dequantize().double().t()
    assert ((alone.double() - exact).abs().max() / exact.abs().max()).item() < 1e-3


def test_mixed_parts_join_in_order(kernel_isa):
    """A fused projection whose parts are different families (Q4_K q and k, a Q6_K v)."""
    parts = [_weight("Q4_K", N=32, seed=1), _weight("Q4_K", N=16, seed=2), _weight("Q6_K", N=16, seed=3)]
    lin = GroupAffineLinear(parts)
    w = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(lin.dequantize(), w)
    x = torch.randn(3, w.shape[1])
    exact = x.to(torch.bfloat16).double() @ w.double().t()
    assert ((lin(x).double() - exact).abs().max() / exact.abs().max()).item() < 1e-3


def test_pack_unpack_round_trip():
    for name in ("Q4_1", "Q3_K", "Q5_K", "IQ4_XS"):
        ga = _weight(name)
        packed = kernels.pack_affine(ga.codes, ga.scale, ga.minimum, ga.group, ga.bits)
        assert torch.equal(kernels.unpack_affine(*packed, ga.group, ga.offset), ga.dequantize())
