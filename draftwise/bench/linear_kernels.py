"""Weight-only low-bit CPU kernel candidates on SmolLM2's linear shapes, by row count.

    python -m draftwise.bench.linear_kernels [--rows 1,4,8,16,32,64] [--threads 2]

Times the 120 layer linears of SmolLM2-135M (q/k/v fused 576->960, o 576->576, gate/up fused
576->3072, down 1536->576; x30) for each candidate, best of --repeats, random weights of the real
shapes: fp32 `x @ W^T` (row-major, F.linear) and `x @ Wt` (transposed copy, draftwise's CPU default),
bf16 F.linear, fp16-weight F.linear, FBGEMM dynamic int8 (`quantized::linear_dynamic`, deprecated
torch.ao path), `_weight_int8pack_mm` with bf16 and with fp32 activations, and
`_weight_int4pack_mm_for_cpu` (group 32) with bf16 activations. Prints a Markdown table (ms).

FBGEMM's dynamic int8 is the fastest here but quantizes the activations too (per tensor, at run
time): on SmolLM2 that raised held-out perplexity from 6.21 to 7.26 (reduce_range) and kept 4 % of
greedy tokens equal to fp32 (without reduce_range it saturates: perplexity in the thousands), so
draftwise's int8 / int4 modes are weight-only (layers/quant.py)."""
from __future__ import annotations

import argparse
import time

import torch

from draftwise.layers.quant import Int4Linear, Int8Linear, quantize_int4_groupwise, quantize_int8_per_channel
from draftwise.machine import isa_summary

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def candidates(weights: list[torch.Tensor]) -> dict:
    wt = [w.t().contiguous() for w in weights]
    wb = [w.bfloat16() for w in weights]
    wh = [w.half() for w in weights]
    q8 = [quantize_int8_per_channel(w) for w in weights]
    int8 = [Int8Linear(q, s) for q, s in q8]
    int4 = [Int4Linear(*quantize_int4_groupwise(w)) for w in weights]
    dyn = None
    try:
        dyn = [torch.ops.quantized.linear_prepack(torch._make_per_channel_quantized_tensor(
            q, s.double(), torch.zeros(q.shape[0], dtype=torch.long), 0), None) for q, s in q8]
    except Exception:                  # noqa: BLE001 - FBGEMM missing in this build
        pass
    c = {
        "fp32 F.linear (row-major)": lambda xs: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
        "fp32 x @ Wt (draftwise default)": lambda xs: [xs[w.shape[0]] @ w for w in wt],
        "bf16 F.linear": lambda xs: [torch.nn.functional.linear(xs[w.shape[1]].bfloat16(), w) for w in wb],
        "fp16 weights F.linear": lambda xs: [torch.nn.functional.linear(xs[w.shape[1]].half(), w) for w in wh],
        "int8 _weight_int8pack_mm, fp32 act.": lambda xs: [torch.ops.aten._weight_int8pack_mm(
            xs[q.shape[1]], q, s) for q, s in q8],
        "int8 _weight_int8pack_mm, bf16 act.": lambda xs: [m._kernel(xs[m.in_features].bfloat16()) for m in int8],
        "int4 _weight_int4pack_mm_for_cpu g32, bf16 act.": lambda xs: [m._kernel(xs[m.in_features].bfloat16())
                                                                     for m in int4],
    }
    try:                     # oneDNN-prepacked bf16 (what Inductor's freezing uses; AMX / AVX512_BF16)
        packed_bf16 = [(torch.ops.mkldnn._reorder_linear_weight(w, 16), w.shape[1]) for w in wb]
        c["bf16 oneDNN prepacked"] = lambda xs: [torch.ops.mkldnn._linear_pointwise(
            xs[k].bfloat16(), p, None, "none", [], "") for p, k in packed_bf16]
    except Exception:                  # noqa: BLE001 - no oneDNN in this build
        pass
    try:
        packed_fp32 = [(torch.ops.mkldnn._reorder_linear_weight(w, 16), w.shape[1]) for w in weights]
        c["fp32 oneDNN prepacked"] = lambda xs: [torch.ops.mkldnn._linear_pointwise(
            xs[k], p, None, "none", [], "") for p, k in packed_fp32]
    except Exception:                  # noqa: BLE001
        pass
    if dyn is not None:      # W8A8: activations quantized too (reduce_range for AVX2 without VNNI)
        c["int8 FBGEMM linear_dynamic (W8A8)"] = lambda xs: [torch.ops.quantized.linear_dynamic(
            xs[w.shape[1]], p, True) for w, p in zip(weights, dyn)]
    return c


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    rows = [int(r) for r in a.rows.split(",")]
    cands = candidates(weights)
    table = {}
    with torch.inference_mode():
        for name, fn in cands.items():
            for m in rows:
                xs = {k: torch.randn(m, k) for k in (576, 1536)}
                table.setdefault(name, {})[m] = _best(lambda: fn(xs), a.repeats)
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()} ({isa_summary()}), "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}; ms for SmolLM2's 120 layer linears")
    print("| kernel | " + " | ".join(f"{m} row{'s' if m > 1 else ''}" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name, r in table.items():
        print(f"| {name} | " + " | ".join(f"{r[m]:.1f}" for m in rows) + " |")
    return table


if __name__ == "__main__":
    main()
