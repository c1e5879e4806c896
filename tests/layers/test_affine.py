"""The group-affine linear (every GGUF block family) on each ISA path this CPU has: its activations
quantized to int8 per block of 32 (as llama.cpp's q8_0) for the families with per-group scales and
per 256 (as its q8_K) for the super-block families, bit-identical to a scalar reference of its order
of operations, within 1e-3 of an fp64 product of those quantized activations and the dequantized
weight (2e-2 or 4e-2 of one with the activations unquantized: the int8 activations' error), and the same
bits for a row whatever the rows beside it."""
import pytest
import torch

from draftwise import kernels
from draftwise.formats import FORMATS, GroupAffine, ScaleFactors, decode
from draftwise.layers.quant import GroupAffineLinear
from tests.formats.test_blocks import random_blocks


def quantize_activations(x: torch.Tensor, block: int = 32):
    """Rows [M, K] fp32 -> (int codes [M, K], scales [M, K/block]): d = max|x| / 127 per block,
    q = x * (1 / d) rounded to nearest even (fp32 arithmetic throughout)."""
    M, K = x.shape
    xb = x.reshape(M, K // block, block)
    d = xb.abs().amax(-1) / torch.tensor(127.0)
    inv = torch.where(d > 0, torch.tensor(1.0) / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).reshape(M, K)
    return q, d


def activation_block(ga) -> int:
    """Inputs per activation scale: 256 for the super-block families, else 32."""
    return 32 if ga.factors is None else 256


def activation_error(ga) -> float:
    """Bound on the relative error of int8 activations against an unquantized product: a scale per
    256 inputs is coarser than one per 32 (random rows reach 2.3e-2 in a few percent of draws)."""
    return 2e-2 if ga.factors is None else 4e-2


def _fma(a, b, e):
    """fp32 fma: the exact product in fp64, rounded once to fp32 with the addend."""
    return (a.double() * b.double() + e.double()).float()


def reference(x_bf16: torch.Tensor, ga) -> torch.Tensor:
    """The kernels' arithmetic in scalar steps (the same on every ISA, cpu/q8act.h). Per-group
    scales: per group the exact integer sum T of (code - offset) x q, then acc = fma(T, scale * d,
    acc) and acc = fma(minimum, d * sum(q_g), acc). Super-block factors: per super-block the exact
    integer sums P = sum_g sc_g T_g and (with minimums) M = sum_g m_g sum(q_g), then
    acc = fma(P, D * d, acc) and acc = fma(M, Dmin * d, acc)."""
    if ga.factors is not None:
        return _reference_super(x_bf16, ga)
    x = x_bf16.float()
    M, K = x.shape
    q, d = quantize_activations(x)
    c = (ga.codes.to(torch.int64) - ga.offset)                  # [N, K]
    gs = ga.group
    acc = torch.zeros(M, c.shape[0])
    for g in range(K // gs):
        k0 = g * gs
        t = q[:, k0:k0 + gs].to(torch.int64) @ c[:, k0:k0 + gs].t()          # exact
        sd = ga.scale[:, g][None] * d[:, k0 // 32:k0 // 32 + 1]
        acc = _fma(t.float(), sd, acc)
        if ga.minimum is not None:
            qsum = q[:, k0:k0 + gs].sum(-1, keepdim=True)                         # exact
            acc = _fma(ga.minimum[:, g][None], d[:, k0 // 32:k0 // 32 + 1] * qsum, acc)
    return acc


def _reference_super(x_bf16: torch.Tensor, ga) -> torch.Tensor:
    x = x_bf16.float()
    M, K = x.shape
    q, d = quantize_activations(x, 256)
    q = q.to(torch.int64)
    c = ga.codes.to(torch.int64) - ga.offset                    # [N, K]
    f, gs = ga.factors, ga.group
    gps = 256 // gs
    acc = torch.zeros(M, c.shape[0])
    for s in range(K // 256):
        P = torch.zeros(M, c.shape[0], dtype=torch.int64)
        T = torch.zeros(M, c.shape[0], dtype=torch.int64)
        for gi in range(gps):
            k0 = s * 256 + gi * gs
            dot = q[:, k0:k0 + gs] @ c[:, k0:k0 + gs].t()                      # exact
            P += dot * f.sc[:, s * gps + gi].to(torch.int64)[None]
            if f.m is not None:
                T += q[:, k0:k0 + gs].sum(-1, keepdim=True) * f.m[:, s * gps + gi].to(torch.int64)[None]
        assert P.abs().max() < 2 ** 31 and T.abs().max() < 2 ** 24
        acc = _fma(P.float(), f.d[:, s][None] * d[:, s:s + 1], acc)
        if f.m is not None:
            acc = _fma(T.float(), f.dmin[:, s][None] * d[:, s:s + 1], acc)
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
    assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < activation_error(ga)
    # the kernel's only rounding past its int8 activations is fp32 accumulation: within 1e-3 of an
    # fp64 product of the activations as it quantized them and the dequantized weight
    block = activation_block(ga)
    q, d = quantize_activations(x.float(), block)
    xq = (q.reshape(13, -1, block) * d[..., None]).reshape(13, -1)
    exact_q = xq.double() @ ga.dequantize().double().t()
    assert ((y.double() - exact_q).abs().max() / exact_q.abs().max()).item() < 1e-3


def _synthetic(bits: int, group: int, super_block: bool, minimum: bool, N=32, K=512, seed=0) -> GroupAffine:
    """A group-affine weight of a shape no GGUF family has (e.g. 5-bit codes in groups of 16)."""
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        codes = torch.randint(-128, 128, (N, K), generator=g).to(torch.int8)
    elif bits == 6:                                   # int8 codes that fit in 6 bits: packed as 6-bit
        codes, bits = torch.randint(-32, 32, (N, K), generator=g).to(torch.int8), 8
    else:
        codes = torch.randint(0, 1 << bits, (N, K), generator=g).to(torch.uint8)
    G = K // group
    if not super_block:
        scale = torch.rand(N, G, generator=g) * 0.01
        mins = -torch.rand(N, G, generator=g) * 0.1 if minimum else None
        return GroupAffine(codes, scale, mins, group, bits, 0 if bits == 8 else 1 << (bits - 1) if not minimum else 0)
    d = (torch.rand(N, K // 256, generator=g) * 1e-3).half().float()
    sc = torch.randint(1, 64, (N, G), generator=g).to(torch.int8)
    f = ScaleFactors(d, sc)
    scale = d.repeat_interleave(256 // group, 1) * sc.float()
    mins = None
    if minimum:
        f.dmin = (-torch.rand(N, K // 256, generator=g) * 1e-2).half().float()
        f.m = torch.randint(0, 64, (N, G), generator=g).to(torch.int8)
        mins = f.dmin.repeat_interleave(256 // group, 1) * f.m.float()
    return GroupAffine(codes, scale, mins, group, bits, 0, f)


@pytest.mark.parametrize("shape", [(4, 16, False, True), (5, 16, False, False), (8, 16, False, False), (6, 32, False, False),
                                   (5, 16, True, True), (6, 32, True, False), (8, 16, True, False)])
def test_shapes_no_family_has_equal_their_reference(isa_kernels, shape):
    """The tile shapes no GGUF family produces run a kernel shaped at run time: the same bits."""
    ga = _synthetic(*shape)
    lin = GroupAffineLinear([ga])
    for rows in (13, 3):                               # tiles of 8 and 5 rows; a short one
        x = (torch.randn(rows, ga.codes.shape[1]) * 3).to(torch.bfloat16)
        y, ref = lin(x.float()), reference(x, ga)
        assert torch.equal(y, ref), (y - ref).abs().max()


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
    assert ((alone.double() - exact).abs().max() / exact.abs().max()).item() < activation_error(ga)


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
    assert ((lin(x).double() - exact).abs().max() / exact.abs().max()).item() < 4e-2


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
