"""The group-affine linear (every GGUF block family) on each ISA path this CPU has: its activations
quantized to int8 per block of 32 (as llama.cpp's q8_0), bit-identical to a scalar reference of its
order of operations, within 1e-3 of an fp64 product of those quantized activations and the
dequantized weight (2e-2 of one with the activations unquantized: the int8 activations' error), and
the same bits for a row whatever the rows beside it."""
import pytest
import torch

from draftwise import kernels
from draftwise.formats import FORMATS, decode
from draftwise.layers.quant import GroupAffineLinear
from tests.formats.test_blocks import random_blocks


def quantize_activations(x: torch.Tensor):
    """Rows [M, K] fp32 -> (int codes [M, K], scales [M, K/32]): d = max|x| / 127 per block of 32,
    q = x * (1 / d) rounded to nearest even (fp32 arithmetic throughout)."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    d = xb.abs().amax(-1) / torch.tensor(127.0)
    inv = torch.where(d > 0, torch.tensor(1.0) / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).reshape(M, K)
    return q, d


def reference(x_bf16: torch.Tensor, ga) -> torch.Tensor:
    """The kernels' arithmetic in scalar steps (the same on every ISA): per group the exact integer
    sum of (code - offset) x q, then acc = fma(T, scale * d, acc) and acc = fma(minimum, d * sum(q_g),
    acc), fma as an exact product in fp64 rounded once to fp32."""
    x = x_bf16.float()
    M, K = x.shape
    q, d = quantize_activations(x)
    c = (ga.codes.to(torch.int64) - ga.offset)                  # [N, K]
    gs = ga.group
    acc = torch.zeros(M, c.shape[0])
    fma = lambda a, b, e: (a.double() * b.double() + e.double()).float()  # noqa: E731
    for g in range(K // gs):
        k0 = g * gs
        t = q[:, k0:k0 + gs].to(torch.int64) @ c[:, k0:k0 + gs].t()          # exact
        sd = ga.scale[:, g][None] * d[:, k0 // 32:k0 // 32 + 1]
        acc = fma(t.float(), sd, acc)
        if ga.minimum is not None:
            qsum = q[:, k0:k0 + gs].sum(-1, keepdim=True)                         # exact
            acc = fma(ga.minimum[:, g][None], d[:, k0 // 32:k0 // 32 + 1] * qsum, acc)
    return acc


def _weight(name, N=32, blocks_per_row=None, seed=0):
    fmt = FORMATS[name]
    per_row = blocks_per_row or max(1, 512 // fmt.block_size)
    raw = random_blocks(name, N * per_row, seed=seed)
    return decode(name, raw, (N, per_row * fmt.block_size))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_affine_kernel_equals_its_reference(isa_kernels, name):
    ga = _weight(name)
    # 13 rows: a full register tile and a part one
    x = (torch.randn(13, ga.codes.shape[1]) * 3).to(torch.bfloat16)
    lin = GroupAffineLinear([ga])
    assert lin.draftwise_kernel
    y = lin(x.float())
    ref = reference(x, ga)
    assert torch.equal(y, ref), (y - ref).abs().max()
    exact = x.double() @ ga.dequantize().double().t()
    assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < 2e-2
    # the kernel's only rounding past its int8 activations is fp32 accumulation: within 1e-3 of an
    # fp64 product of the activations as it quantized them and the dequantized weight
    q, d = quantize_activations(x.float())
    xq = (q.reshape(13, -1, 32) * d[..., None]).reshape(13, -1)
    exact_q = xq.double() @ ga.dequantize().double().t()
    assert ((y.double() - exact_q).abs().max() / exact_q.abs().max()).item() < 1e-3


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
def test_affine_rows_are_independent_of_the_call(kernel_isa, name):
    """Register tiles (up to 4 or 6 rows), row chunks, and the PyTorch fallback (DRAFTWISE_ISA=none)
    alike: a row's bits do not depend on the rows beside it."""
    ga = _weight(name, N=48)
    lin = GroupAffineLinear([ga])
    x = torch.randn(11, ga.codes.shape[1])
    alone = torch.cat([lin(x[i:i + 1]) for i in range(11)])
    for m in (2, 3, 4, 11):
        assert torch.equal(lin(x[:m]), alone[:m]), m
    many = torch.randn(70, x.shape[1])               # more rows than a chunk keeps in cache
    assert torch.equal(lin(many)[69:], lin(many[69:]))
    exact = x.to(torch.bfloat16).double() @ ga.dequantize().double().t()
    assert ((alone.double() - exact).abs().max() / exact.abs().max()).item() < 2e-2


def test_high_bit_arrangements_place_every_bit_once():
    """Each arrangement of the bits above the nibble is a permutation of the step's high-bit
    bytes; the masks one is the AVX-512 kernels' (two 64-bit masks per bit), the shifts one puts
    the codes of a 6-bit step's first byte in one byte's four crumbs."""
    for planes in (1, 2):
        for high_bits in kernels.HIGH_BITS:
            places = kernels._high_bit_places(planes, high_bits).reshape(-1)
            assert torch.equal(places.sort().values, torch.arange(128 * planes)), (planes, high_bits)
    masks = kernels._high_bit_places(1, "masks")[0]
    assert masks[8 * 3 + 4 + 2].item() == 64 + 4 * 3 + 2          # column 3, input 4 + 2: mask 1, bit 14
    crumbs = kernels._high_bit_places(2, "shifts")
    first_byte = [8 * j + 4 * s for j in (0, 8) for s in (0, 1)]   # a and b of byte 0 in halves 0 and 1
    assert crumbs[0, first_byte].tolist() == [0, 2, 4, 6] and crumbs[1, first_byte].tolist() == [1, 3, 5, 7]


def test_a_weight_packed_for_another_isa_is_refused(isa_kernels):
    """The kernels read 5- and 6-bit codes in their own ISA's arrangement: a weight packed for
    another is a clear error, not wrong numbers."""
    ga = _weight("Q6_K", N=16)
    theirs = "masks" if kernels.high_bits_for() == "shifts" else "shifts"
    codes, scale, minimum, offset = kernels.pack_affine(ga.codes, ga.scale, ga.minimum, ga.group, ga.bits, ga.offset,
                                                        ga.factors, theirs)
    x = torch.randn(1, ga.codes.shape[1]).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"high bits as {theirs}"):
        kernels.affine_linear(x, codes, scale, minimum, ga.group, offset, theirs)


def test_mixed_parts_join_in_order(kernel_isa):
    """A fused projection whose parts are different families (Q4_K q and k, a Q6_K v)."""
    parts = [_weight("Q4_K", N=32, seed=1), _weight("Q4_K", N=16, seed=2), _weight("Q6_K", N=16, seed=3)]
    lin = GroupAffineLinear(parts)
    w = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(lin.dequantize(), w)
    x = torch.randn(3, w.shape[1])
    exact = x.to(torch.bfloat16).double() @ w.double().t()
    assert ((lin(x).double() - exact).abs().max() / exact.abs().max()).item() < 2e-2


@pytest.mark.parametrize("high_bits", kernels.HIGH_BITS)
@pytest.mark.parametrize("name", ["Q4_1", "Q3_K", "Q5_K", "Q5_0", "Q6_K", "Q8_0", "IQ4_XS"])
def test_pack_unpack_round_trip(name, high_bits):
    ga = _weight(name)
    codes, scale, minimum, offset = kernels.pack_affine(ga.codes, ga.scale, ga.minimum, ga.group, ga.bits, ga.offset,
                                                        ga.factors, high_bits)
    assert torch.equal(kernels.unpack_affine(codes, scale, minimum, ga.group, offset, high_bits), ga.dequantize())
    want = ga.codes.to(torch.int16) - (ga.offset - offset)
    assert torch.equal(kernels.unpack_codes(codes, high_bits).to(torch.int16), want)
    if ga.factors is not None:                       # the file's factors, not the fp32 products
        assert scale.dtype == torch.uint8 and (minimum.numel() == 0 or minimum.dtype == torch.uint8)
        assert torch.equal(kernels.unpack_scales(scale, ga.group), kernels.pack_affine(
            ga.codes, ga.scale, ga.minimum, ga.group, ga.bits, ga.offset)[1].float())
