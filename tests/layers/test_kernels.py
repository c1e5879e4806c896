"""draftwise's CPU kernels, on every ISA path this machine has (forced with DRAFTWISE_ISA): the int4
and int8 linears equal their fp64 reference, every row's numbers independent of how many rows share
the call (so speculation stays bit-exact), packing round-trips, the row-invariant attention and the
argmax, and speculation on an int4 target that runs on them greedy-identical to plain decoding.
Paths the CPU lacks are skipped with the reason (the `kernel_isa` fixture lists those it has)."""
import logging

import pytest
import torch

from draftwise import LLM, SamplingParams, kernels
from draftwise.kernels import build
from draftwise.layers.quant import quantize_int4_groupwise, quantize_int8_per_channel


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


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 40, 300])
def test_kernel_equals_reference_and_rows_are_independent(isa_kernels, rows):
    use_amx = kernels.amx()
    codes, scale, mn = _weights()
    nib, sm = kernels.pack_int4(codes, scale, mn)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    y = kernels.int4_linear(x, nib, sm, use_amx)
    ref = x.double() @ kernels.unpack_int4(nib, sm).double().t()
    torch.testing.assert_close(y.double(), ref, atol=2e-4, rtol=1e-4)
    for r in {0, rows // 2, rows - 1}:                     # bit for bit, alone or in company
        assert torch.equal(kernels.int4_linear(x[r:r + 1], nib, sm, use_amx)[0], y[r])


@pytest.mark.parametrize("rows", [1, 3, 4, 17])
def test_int8_kernel_equals_reference_and_rows_are_independent(isa_kernels, rows):
    g = torch.Generator().manual_seed(4)
    q, s = quantize_int8_per_channel(torch.randn(64, 96, generator=g) * 0.05)
    q8, sf = kernels.pack_int8(q), s.float().contiguous()
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    y = kernels.int8_linear(x, q8, sf)
    ref = x.double() @ (q.double() * sf.double()[:, None]).t()
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-4)
    for r in {0, rows - 1}:
        assert torch.equal(kernels.int8_linear(x[r:r + 1], q8, sf)[0], y[r])


def test_amx_and_avx512_paths_agree(kernel_isa):
    if kernel_isa != "amx":
        pytest.skip("compares AMX with AVX512-BF16: needs an AMX CPU" if kernel_isa == "none" else "AMX case only")
    if not kernels.amx():
        pytest.skip("the OS does not grant the AMX tile state")
    codes, scale, mn = _weights(N=160, K=256, seed=3)
    nib, sm = kernels.pack_int4(codes, scale, mn)
    x = torch.randn(9, 256).to(torch.bfloat16)
    torch.testing.assert_close(kernels.int4_linear(x, nib, sm, True), kernels.int4_linear(x, nib, sm, False),
                               atol=1e-4, rtol=1e-4)


def test_isa_dispatch(monkeypatch, caplog):
    """DRAFTWISE_ISA picks the path; a name it does not know, or an ISA the CPU lacks, falls back to
    the best the CPU has with a warning; `none` loads no module."""
    best = kernels.cpu_isa()
    try:
        for value, want in [("none", "none"), ("bogus", best), ("", best), ("auto", best)]:
            monkeypatch.setenv("DRAFTWISE_ISA", value)
            kernels.reset()
            with caplog.at_level(logging.WARNING, logger="draftwise"):
                assert kernels.isa() == want
            if value == "bogus":
                assert "DRAFTWISE_ISA=bogus" in caplog.text
        if best != "amx":
            monkeypatch.setenv("DRAFTWISE_ISA", "amx")
            kernels.reset()
            assert kernels.isa() == best
        monkeypatch.setenv("DRAFTWISE_ISA", "none")
        kernels.reset()
        assert kernels.load() is None and not kernels.amx()
    finally:
        monkeypatch.delenv("DRAFTWISE_ISA")
        kernels.reset()


def test_speculation_on_the_kernel_is_lossless(isa_kernels, tiny_llama):
    path, _ = tiny_llama
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9, 10, 11], [3] * 20, list(range(30, 70)), [7, 7, 7])]
    plain = LLM(path, block_size=4, max_model_len=256, quantization="int4", speculative_config=None)
    lin = plain.engine.worker.model.layers[0].mlp.gate_up_proj
    assert lin.draftwise_kernel and not hasattr(lin, "packed")       # one copy, the kernel's
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3}, {"method": "suffix"}):
        llm = LLM(path, block_size=4, max_model_len=256, quantization="int4", speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == ref
        assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ctx,n,D", [(40, 1, 64), (40, 7, 64), (70, 24, 64), (0, 50, 64), (30, 60, 32), (30, 60, 128),
                                     (20, 20, 256)])
def test_row_invariant_attention_kernel(isa_kernels, ctx, n, D, cache_dtype, monkeypatch):
    """The C++ row-invariant attention equals SDPA row by row (to rounding) and, bit for bit, the
    same rows decoded one at a time - on an fp32 cache, and on a 16-bit one (read widened in
    registers: bit-equal to an fp32 cache holding the same values). Long tiles (many rows' query
    heads) score their keys on another path than a single row's: the bits must not change."""
    import draftwise.layers.attention as A
    from draftwise.layers.attention import CAUSAL, AttentionMetadata
    torch.manual_seed(0)
    bs, Hkv, H = 16, 3, 9
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
    monkeypatch.setattr(A, "attend_rows_kernel", lambda *a: False)      # one SDPA call per row instead
    torch.testing.assert_close(out, A.paged_attention(q, k, v, kc, vc, meta, 0.125), atol=2e-6, rtol=1e-5)


def test_row_argmax_equals_torch_argmax(isa_kernels):
    """The first maximum of every row, as torch.argmax picks it: ties, NaN, odd widths, one row."""
    g = torch.Generator().manual_seed(0)
    for M, V in [(1, 49152), (16, 49152), (9, 37), (3, 16), (5, 15)]:
        x = torch.randn(M, V, generator=g)
        x[0, V // 3] = x[0, V // 2] = x.max() + 1            # a tie: the first index wins
        if M > 2:
            x[1] = 0.0                                       # a row of equal values
            x[2, V - 1] = float("nan")                       # NaN counts as the maximum
        assert torch.equal(kernels.row_argmax(x), x.argmax(-1)), (M, V)


@pytest.mark.parametrize("rows", [17, 40, 300])
def test_many_rows_in_wide_column_blocks_equal_single_rows(isa_kernels, rows):
    """With the column blocks a multiple of four, many rows run the AMX kernel's wide path (four
    column blocks per row tile): every row bit-equal to the same row computed alone."""
    codes, scale, mn = _weights(N=128, K=192, seed=5)
    nib, sm = kernels.pack_int4(codes, scale, mn)
    x = torch.randn(rows, 192).to(torch.bfloat16)
    use_amx = kernels.amx()
    y = kernels.int4_linear(x, nib, sm, use_amx)
    alone = torch.cat([kernels.int4_linear(x[r:r + 1], nib, sm, use_amx) for r in range(rows)])
    assert torch.equal(y, alone)
    torch.testing.assert_close(y.double(), x.double() @ kernels.unpack_int4(nib, sm).double().t(), atol=2e-4, rtol=1e-4)


def test_kernels_id_names_the_isa_and_the_sources(tmp_path):
    """Costs measured on one kernel build are not reused by another: the id that keys the cached
    step-cost table changes with the ISA the kernels run on and with any change to their sources."""
    with kernels.forced_isa("none"):
        assert kernels.kernels_id() == "none"
    if kernels.cpu_isa() == "none":
        pytest.skip("this CPU has no kernel ISA")
    with kernels.forced_isa("avx2"):
        avx2 = kernels.kernels_id()
    assert avx2.startswith("avx2-")
    (tmp_path / "a.h").write_text("int a;")
    before = kernels._sources_digest(str(tmp_path))
    (tmp_path / "a.h").write_text("int b;")
    assert kernels._sources_digest(str(tmp_path)) != before


def test_a_second_build_waits_only_while_the_first_holds_the_lock(tmp_path):
    """Builds in two processes (here threads) take turns; the lock is the OS's, released with its
    holder, so a build killed midway never makes a later start wait."""
    import threading
    with kernels.build_lock(str(tmp_path)):
        entered = threading.Event()

        def second():
            with kernels.build_lock(str(tmp_path)):
                entered.set()
        t = threading.Thread(target=second)
        t.start()
        assert not entered.wait(0.3)               # the first build holds the lock
    assert entered.wait(10)                          # released with the first
    t.join()


_TINY_MODULE = """
#include <Python.h>
static PyModuleDef def = {PyModuleDef_HEAD_INIT, "NAME", nullptr, -1, nullptr};
int answer();
PyMODINIT_FUNC PyInit_NAME() {
  PyObject* m = PyModule_Create(&def);
  PyModule_AddIntConstant(m, "answer", answer());
  return m;
}
"""


def _tiny_units(tmp_path, name, body):
    (tmp_path / "glue.cpp").write_text(_TINY_MODULE.replace("NAME", name))
    (tmp_path / "work.cpp").write_text(body)
    return [build.Unit(str(tmp_path / "work.cpp"), "-O3"), build.Unit(str(tmp_path / "glue.cpp"), "-O1")]


def test_the_builder_compiles_each_unit_at_its_level_links_and_imports(tmp_path):
    units = _tiny_units(tmp_path, "dw_tiny_ok", "int answer() { return 42; }")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "dw_tiny_ok.so.999.partial").write_text("what a killed build left")
    path = build.build_library("dw_tiny_ok", units, [], [], str(tmp_path / "out"))
    assert build.import_library("dw_tiny_ok", path).answer == 42
    log = (tmp_path / "out" / "build.log").read_text().splitlines()
    assert any("work.cpp" in line and " -O3 " in line for line in log)
    assert any("glue.cpp" in line and " -O1 " in line for line in log)


def test_a_unit_that_does_not_compile_is_named_and_leaves_no_library(tmp_path):
    units = _tiny_units(tmp_path, "dw_tiny_bad", "int answer() { return undeclared_name; }")
    with pytest.raises(build.BuildError, match=r"failed on work\.cpp: .*undeclared_name.*build\.log"):
        build.build_library("dw_tiny_bad", units, [], [], str(tmp_path / "out"))
    assert not (tmp_path / "out" / "dw_tiny_bad.so").exists()
