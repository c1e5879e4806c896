"""draftwise's int4 CPU kernel (AVX512-BF16 dot products / AMX tiles): equal to its fp32 reference,
every row's numbers independent of how many rows share the call (so speculation stays bit-exact),
packing round-trips, the measured choice is well-formed, and speculation on an int4 target that runs
on it is greedy-identical to plain decoding. Skipped where the CPU has no AVX512-BF16 (PyTorch's
kernel then serves int4, covered by test_quant.py)."""
import pytest
import torch

from draftwise import LLM, SamplingParams, kernels
from draftwise.layers.quant import quantize_int4_groupwise

needs_kernel = pytest.mark.skipif(kernels.load() is None, reason="no AVX512-BF16 CPU or no compiler: "
                                  "PyTorch's int4 kernel is used instead")
PATHS = [False] + ([True] if kernels.load() is not None and kernels.amx() else [])


def _weights(N=96, K=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_int4_groupwise(torch.randn(N, K, generator=g) * 0.05)


def test_pack_unpack_round_trip():
    codes, scale, mn = _weights()
    nib, sm = kernels.pack_int4(codes, scale, mn)
    assert nib.shape == (6, 64, 16) and sm.shape == (6, 4, 2, 16)
    # scale and minimum are kept in fp16 (exact for GGUF Q4_1 blocks, which store them so)
    s16, m16 = scale.half().float(), mn.half().float()
    ref = (codes.float().reshape(96, 4, 32) * s16[..., None] + m16[..., None]).reshape(96, 128)
    torch.testing.assert_close(kernels.unpack_int4(nib, sm), ref, atol=1e-6, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("use_amx", PATHS)
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 300])
def test_kernel_equals_reference_and_rows_are_independent(use_amx, rows):
    codes, scale, mn = _weights()
    nib, sm = kernels.pack_int4(codes, scale, mn)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    y = kernels.int4_linear(x, nib, sm, use_amx)
    ref = x.double() @ kernels.unpack_int4(nib, sm).double().t()
    torch.testing.assert_close(y.double(), ref, atol=2e-4, rtol=1e-4)
    for r in {0, rows // 2, rows - 1}:                     # bit for bit, alone or in company
        assert torch.equal(kernels.int4_linear(x[r:r + 1], nib, sm, use_amx)[0], y[r])


@needs_kernel
def test_amx_and_avx512_paths_agree():
    if len(PATHS) < 2:
        pytest.skip("no AMX here")
    codes, scale, mn = _weights(N=160, K=256, seed=3)
    nib, sm = kernels.pack_int4(codes, scale, mn)
    x = torch.randn(9, 256).to(torch.bfloat16)
    torch.testing.assert_close(kernels.int4_linear(x, nib, sm, True), kernels.int4_linear(x, nib, sm, False),
                               atol=1e-4, rtol=1e-4)


def test_choice_is_well_formed():
    c = kernels.int4_kernel_choice()
    assert c["small"] in ("draftwise", "aten") and c["large"] in ("draftwise", "dense")
    if kernels.load() is None:
        assert c == {"small": "aten", "large": "dense"}


@needs_kernel
def test_speculation_on_the_kernel_is_lossless(tiny_llama, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_INT4_KERNEL", "draftwise")
    path, _ = tiny_llama
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9, 10, 11], [3] * 20, list(range(30, 70)), [7, 7, 7])]
    plain = LLM(path, block_size=4, max_model_len=256, quantization="int4", speculative_config=None)
    lin = plain.engine.model.layers[0].mlp.gate_up_proj
    assert lin.draftwise_kernel and not hasattr(lin, "packed")       # one copy, the kernel's
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3}, {"method": "suffix"}):
        llm = LLM(path, block_size=4, max_model_len=256, quantization="int4", speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == ref
        assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ctx,n", [(40, 1), (40, 7), (70, 24)])
def test_row_invariant_attention_kernel(ctx, n, cache_dtype, monkeypatch):
    """The C++ row-invariant attention equals SDPA row by row (to rounding) and, bit for bit, the
    same rows decoded one at a time - on an fp32 cache, and on a 16-bit one (read widened in
    registers: bit-equal to an fp32 cache holding the same values)."""
    import draftwise.layers.attention as A
    from draftwise.layers.attention import CAUSAL, AttentionMetadata
    torch.manual_seed(0)
    bs, Hkv, H, D = 16, 3, 9, 64
    nb = (ctx + n) // bs + 1
    bt = torch.randperm(nb * 2)[:nb].view(1, nb)
    kc, vc = torch.randn(nb * 2 * bs, Hkv, D).to(cache_dtype), torch.randn(nb * 2 * bs, Hkv, D).to(cache_dtype)
    q, k, v = torch.randn(n, H, D), torch.randn(n, Hkv, D), torch.randn(n, Hkv, D)
    k, v = k.to(cache_dtype).float(), v.to(cache_dtype).float()       # values the cache holds exactly
    pos = torch.arange(ctx, ctx + n)
    slots = A.slots_for_positions(bt, torch.zeros(n, dtype=torch.long), pos, bs)
    meta = AttentionMetadata(slots, [n], [ctx + n], bt, bs, CAUSAL, row_invariant=True).finalize()
    out = A.paged_attention(q, k, v, kc, vc, meta, 0.125)
    alone = torch.cat([A.paged_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], kc, vc, AttentionMetadata(
        slots[i:i + 1], [1], [ctx + i + 1], bt, bs, CAUSAL, row_invariant=True).finalize(), 0.125) for i in range(n)])
    assert torch.equal(out, alone)
    if cache_dtype != torch.float32:
        assert torch.equal(out, A.paged_attention(q, k, v, kc.float(), vc.float(), meta, 0.125))
    monkeypatch.setenv("DRAFTWISE_NO_ATTENTION_KERNEL", "1")
    torch.testing.assert_close(out, A.paged_attention(q, k, v, kc, vc, meta, 0.125), atol=2e-6, rtol=1e-5)


@needs_kernel
def test_row_argmax_equals_torch_argmax():
    """The first maximum of every row, as torch.argmax picks it: ties, NaN, odd widths, one row."""
    g = torch.Generator().manual_seed(0)
    for M, V in [(1, 49152), (16, 49152), (9, 37), (3, 16), (5, 15)]:
        x = torch.randn(M, V, generator=g)
        x[0, V // 3] = x[0, V // 2] = x.max() + 1            # a tie: the first index wins
        if M > 2:
            x[1] = 0.0                                       # a row of equal values
            x[2, V - 1] = float("nan")                       # NaN counts as the maximum
        assert torch.equal(kernels.row_argmax(x), x.argmax(-1)), (M, V)


@needs_kernel
@pytest.mark.parametrize("use_amx", PATHS)
@pytest.mark.parametrize("rows", [17, 40, 300])
def test_many_rows_in_wide_column_blocks_equal_single_rows(use_amx, rows):
    """With the column blocks a multiple of four, many rows run the AMX kernel's wide path (four
    column blocks per row tile): every row bit-equal to the same row computed alone."""
    codes, scale, mn = _weights(N=128, K=192, seed=5)
    nib, sm = kernels.pack_int4(codes, scale, mn)
    x = torch.randn(rows, 192).to(torch.bfloat16)
    y = kernels.int4_linear(x, nib, sm, use_amx)
    alone = torch.cat([kernels.int4_linear(x[r:r + 1], nib, sm, use_amx) for r in range(rows)])
    assert torch.equal(y, alone)
    torch.testing.assert_close(y.double(), x.double() @ kernels.unpack_int4(nib, sm).double().t(), atol=2e-4, rtol=1e-4)


@needs_kernel
def test_dense_prefill_linear_is_the_bf16_rounded_weight():
    """The many-row path: the weight dequantized to bf16 (each value rounded once from its exact
    fp32 value) and a bf16 GEMM, close to the exact kernel."""
    codes, scale, mn = _weights(N=96, K=128, seed=7)
    nib, sm = kernels.pack_int4(codes, scale, mn)
    w = kernels.load().dequant_bf16_kn(nib, sm)                      # [K, N]
    exact = kernels.unpack_int4(nib, sm).t()
    assert w.dtype == torch.bfloat16 and w.shape == (128, 96)
    assert ((w.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-30).all()
    x = torch.randn(70, 128).to(torch.bfloat16)
    y = kernels.dense_linear(x, nib, sm)
    ref = (x.double() @ w.double()).float()
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y.float(), kernels.int4_linear(x, nib, sm), atol=3e-2, rtol=3e-2)
