"""What one target step costs, by query rows: the measurement speculation lives or dies by.

    draftwise bench step-cost [--formats fp32,bf16,int8,int4] [--threads 1,2] [--rows 1,2,4,8,16,32]
                              [--contexts 128,1024] [--requests 1,16] [--compiled] [--out bench_out/step_cost]
                              [--draft-model NAME [--draft-quantization Q4_0]]

For one request (or B requests, `--requests`: the batch shapes a loaded server runs) with `context`
tokens in the KV cache feeding M new rows each (M = 1: plain decoding; M = K + 1: verifying K
drafts), each weight format and thread count: the full target step (layers +
LM head on every row, `ModelRunner.measure_target_costs`, the same code the adaptive policy's cost
table reads) plus greedy acceptance, and where its time goes - layer linears, attention (KV writes
and reads included), other ops (norms, RoPE, residuals, embedding, casts), Python / dispatch (the
wall time no op accounts for), LM head, sampling / acceptance. With `--draft-model`, one pass of the
draft model (a drafted token's cost) beside the target's plain step. The split comes from one
torch.profiler pass per point (op self-times), scaled to the unprofiled wall time. Prints a
Markdown table per context with t(M)/t(1) ratios, then the layer linears' rate at each M in GMAC/s
a core beside the kernel's own ceiling measured in the same run (the model's largest linear, its
own kernel, on weights that stay in cache, one thread: the gap is what memory and threading cost);
writes JSON and a PNG plot; the header names the CPU and its ISA."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

from draftwise import LLM
from draftwise.kernels import HIGH_BITS, code_bits, forced_isa, isa, load, row_argmax
from draftwise.layers.quant import GroupAffineLinear
from draftwise.machine import isa_summary
from draftwise.models.loader import DEFAULT_MODEL
from draftwise.sample.rejection_sampler import greedy_accept

FORMATS = {"fp32": dict(quantization=None, dtype="float32"), "bf16": dict(quantization=None, dtype="bfloat16"),
           "int8": dict(quantization="int8", dtype="float32"), "int4": dict(quantization="int4", dtype="float32"),
           # int4 on PyTorch's kernels (DRAFTWISE_ISA=none) / on draftwise's for this CPU
           "int4-aten": dict(quantization="int4", dtype="float32", isa="none"),
           "int4-draftwise": dict(quantization="int4", dtype="float32", isa="auto"),
           # a GGUF file's own blocks, every family (the default for a quantized GGUF)
           "gguf": dict(quantization="gguf", dtype="float32")}
LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm",
              "mkldnn::_linear_pointwise", "aten::linear", "aten::matmul", "draftwise::int4_linear",
              "draftwise::int8_linear", "draftwise::affine_linear",
              # the fused int4 layer's two calls: its linears, with the norms, RoPE, SiLU and K/V writes
              # around them (a few percent of the calls)
              "draftwise::attn_in", "draftwise::attn_out_mlp")
ATTENTION_OPS = ("scaled_dot_product", "aten::index_select", "aten::index_copy", "aten::_efficient_attention",
                 "aten::_flash_attention", "draftwise::attend_rows")


def machine_line() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return (f"{model or 'unknown CPU'}, {os.cpu_count()} cores; torch {torch.__version__} "
            f"(capability {torch.backends.cpu.get_cpu_capability()}; {isa_summary() or 'no AVX-512/AMX flags'}); "
            f"kernels: {isa()}")


def _category(name: str) -> str:
    if name.startswith(LINEAR_OPS):
        return "linears"
    if any(k in name for k in ATTENTION_OPS):
        return "attention"
    return "other ops"


@contextlib.contextmanager
def _profiler_lines_muted():
    """File descriptor 2 on /dev/null around the profiler's own start and stop calls only: libkineto
    writes a `USDT: ... profiler_start` / `profiler_stop` line from C++ at each, whatever
    KINETO_LOG_LEVEL says. The measured calls run outside, their errors shown as always."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _split(runner, inputs, lm_head_rows: torch.Tensor) -> dict[str, float]:
    """Seconds by category of one layer-stack call (profiled), plus the LM head and greedy acceptance
    timed on their own."""
    from torch.profiler import ProfilerActivity, profile
    model = runner.model
    ids, pos, meta, _ = inputs
    kv = runner.kv_cache
    prof = profile(activities=[ProfilerActivity.CPU])
    with _profiler_lines_muted():
        prof.start()
    try:
        t0 = time.perf_counter()
        h, _ = model.run_layers(ids, pos, meta, kv)
        wall = time.perf_counter() - t0
    finally:
        with _profiler_lines_muted():
            prof.stop()
    by = {"linears": 0.0, "attention": 0.0, "other ops": 0.0}
    for ev in prof.key_averages():
        by[_category(ev.key)] += ev.self_cpu_time_total / 1e6
    ops = sum(by.values())
    by["python / dispatch"] = max(0.0, wall - ops)
    return by


def _leaf_linears(model):
    """(name, module) of every linear of the decoder layers (the LM head apart), outermost only."""
    found = [(n, m) for n, m in model.named_modules() if n.startswith("layers.") and hasattr(m, "in_features")
             and hasattr(m, "out_features")]
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(o.startswith(n + ".") for o in names)]


def layer_linear_macs(model) -> int:
    """Multiply-adds of one row through the decoder layers' linears."""
    return sum(m.in_features * m.out_features for _, m in _leaf_linears(model))


CEILING_ROWS, CEILING_BLOCKS = 16, 16      # 16 rows x 256 output columns: a few hundred KB of codes


@torch.inference_mode()
def kernel_ceiling(model, seconds: float = 0.5) -> dict | None:
    """The linear kernel's own rate where memory is no limit: CEILING_ROWS rows through the first
    CEILING_BLOCKS column blocks of the model's largest layer linear (its own block type, layout and
    kernel), cache-resident, one thread, called directly - the inner loop's ceiling on this CPU and
    ISA, beside which each step's linear rate reads. None where the layers do not run the
    group-affine kernel."""
    lins = [m for _, m in _leaf_linears(model) if isinstance(m, GroupAffineLinear) and m.draftwise_kernel]
    mod = load()
    if not lins or mod is None:
        return None
    big = max(lins, key=lambda m: m.in_features * m.out_features)
    codes, scale, minimum, group, offset, high_bits = big.packed_parts()[0]
    n = min(CEILING_BLOCKS, codes.shape[0])
    args = (codes[:n].contiguous(), scale[:n].contiguous(), minimum[:n].contiguous() if minimum.numel() else minimum,
            group, offset, HIGH_BITS.index(high_bits))
    x = torch.randn(CEILING_ROWS, codes.shape[1] * 8).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mod.affine_linear(x, *args)
        calls, t0 = 0, time.perf_counter()
        while calls < 3 or time.perf_counter() - t0 < seconds:
            mod.affine_linear(x, *args)
            calls += 1
        per_call = (time.perf_counter() - t0) / calls
    finally:
        torch.set_num_threads(threads)
    macs = CEILING_ROWS * n * 16 * x.shape[1]
    return {"gmacs_per_core": macs / per_call / 1e9, "bits": code_bits(codes),
            "rows": CEILING_ROWS, "columns": n * 16, "inputs": x.shape[1]}


@torch.inference_mode()
def measure_format(fmt: str, model: str, threads: list[int], rows: list[int], contexts: list[int],
                   compiled: bool, repeats: int, requests: list[int] = (1,), draft: dict | None = None) -> list[dict]:
    kw = dict(FORMATS[fmt])
    with forced_isa(kw.pop("isa", None)):
        llm = LLM(model, max_model_len=max(contexts) + max(rows) + 64, max_num_seqs=max(requests),
                  speculative_config=draft, enforce_eager=not compiled, **kw)
        return [r for b in requests for r in _measure(llm, fmt, threads, rows, contexts, repeats, b)]


def _measure(llm, fmt: str, threads: list[int], rows: list[int], contexts: list[int], repeats: int,
             requests: int = 1) -> list[dict]:
    runner = llm.engine.worker.runner
    macs = layer_linear_macs(runner.model)
    ceiling = kernel_ceiling(runner.model)
    out = []
    for th in threads:
        torch.set_num_threads(th)
        for ctx in contexts:
            # every row count sampled alike, in interleaved rounds (ratios within one run)
            totals = runner.measure_target_costs(rows, repeats=repeats, context=ctx, large_repeats=None,
                                                 num_requests=requests)
            draft_ms = _draft_token_ms(runner, ctx, requests, repeats)
            for m in rows:
                total = totals[m]
                inputs = runner.scratch_step_inputs(m, ctx, requests)
                h, _ = runner.model.run_layers(*inputs[:3], runner.kv_cache)
                best_head = best_layers = best_sample = float("inf")
                drafts = [[0] * (m - 1)] * requests
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    runner.model.run_layers(*inputs[:3], runner.kv_cache)
                    t1 = time.perf_counter()
                    logits = runner.model.compute_logits(h)
                    t2 = time.perf_counter()
                    greedy_accept(row_argmax(logits).tolist(), drafts)
                    t3 = time.perf_counter()
                    best_layers, best_head, best_sample = (min(best_layers, t1 - t0), min(best_head, t2 - t1),
                                                           min(best_sample, t3 - t2))
                split = _split(runner, inputs, inputs[3])
                scale = best_layers / max(sum(split.values()), 1e-9)    # profiler overhead removed
                row = {"format": fmt, "threads": th, "context": ctx, "rows": m, "requests": requests,
                       "step_ms": (total + best_sample) * 1e3}
                row.update({k + "_ms": v * scale * 1e3 for k, v in split.items()})
                row["lm_head_ms"] = best_head * 1e3
                # the layer linears' multiply-adds over their profiled time, per thread
                row["linear_gmac"] = macs * m * requests / 1e9
                row["linear_gmacs_per_core"] = row["linear_gmac"] / max(row["linears_ms"] / 1e3, 1e-9) / th
                if ceiling is not None:
                    row["ceiling"] = ceiling
                row["sampling_ms"] = best_sample * 1e3
                if draft_ms is not None:
                    row["draft_token_ms"] = draft_ms
                out.append(row)
                print(f"  {fmt} {th} thr ctx {ctx} B={requests} M={m}: {row['step_ms']:.1f} ms", flush=True)
    del llm
    return out


def _draft_token_ms(runner, context: int, requests: int, repeats: int) -> float | None:
    """Milliseconds of one draft-model pass (every layer and the LM head) for `requests` requests
    of one row each after `context` tokens - what each drafted token costs a chain - or None
    without a draft model."""
    proposer = runner.proposer
    if proposer is None or not hasattr(proposer, "draft"):
        return None
    ids, pos, meta, _ = runner.scratch_step_inputs(1, context, requests)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        proposer.logits_step(proposer.layer_step(ids, pos, None, meta, runner.kv_cache))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def format_table(rows: list[dict]) -> str:
    lines = []
    for ctx in sorted({r["context"] for r in rows}):
        lines.append(f"\ncontext {ctx} tokens: full target step in ms (ratio to M=1; with B requests, each feeds "
                     "M rows), then the split at the largest M")
        ms = sorted({r["rows"] for r in rows})
        lines.append("| weights | threads | " + " | ".join(f"M={m}" for m in ms)
                     + " | linears | attention | other ops | python | LM head | sampling |")
        lines.append("|---|---|" + "---|" * (len(ms) + 6))
        at_ctx = [r for r in rows if r["context"] == ctx]
        for label, th, pts in _series(at_ctx):
            base = pts[ms[0]]["step_ms"]
            cells = [f"{pts[m]['step_ms']:.1f}" + (f" ({pts[m]['step_ms'] / base:.2f}x)" if m != ms[0] else "")
                     for m in ms]
            big = pts[ms[-1]]
            split = [big["linears_ms"], big["attention_ms"], big["other ops_ms"], big["python / dispatch_ms"],
                     big["lm_head_ms"], big["sampling_ms"]]
            lines.append(f"| {label} | {th} | " + " | ".join(cells) + " | " + " | ".join(f"{x:.1f}" for x in split)
                         + " |")
        lines += _rate_table(at_ctx, ms)
    return "\n".join(lines)


def _rate_table(rows: list[dict], ms: list[int]) -> list[str]:
    """The layer linears' rate at each M, GMAC/s a core, beside the kernel's cache-resident ceiling."""
    if not any("linear_gmacs_per_core" in r for r in rows):
        return []
    lines = ["", "layer linears, GMAC/s a core (their multiply-adds over their profiled time), and the kernel's "
             "ceiling: the same kernel on cache-resident weights, 1 thread (bench step-cost's kernel_ceiling)",
             "| weights | threads | " + " | ".join(f"M={m}" for m in ms) + " | ceiling |",
             "|---|---|" + "---|" * (len(ms) + 1)]
    for label, th, pts in _series(rows):
        cells = [f"{pts[m]['linear_gmacs_per_core']:.1f}" if m in pts else "" for m in ms]
        ceiling = next((r["ceiling"] for r in pts.values() if "ceiling" in r), None)
        c = (f"{ceiling['gmacs_per_core']:.1f} ({ceiling['bits']}-bit codes, {ceiling['rows']} x "
             f"{ceiling['columns']} x {ceiling['inputs']})" if ceiling else "n/a")
        lines.append(f"| {label} | {th} | " + " | ".join(cells) + f" | {c} |")
    return lines


def _series(rows: list[dict]):
    """(label, threads, {M: row}) of each weight format, batch shape and thread count among `rows`
    (one context), in the order measured."""
    for fmt, b in dict.fromkeys((r["format"], r.get("requests", 1)) for r in rows):
        for th in sorted({r["threads"] for r in rows}):
            pts = {r["rows"]: r for r in rows if r["format"] == fmt and r.get("requests", 1) == b and r["threads"] == th}
            if pts:
                yield (fmt if b == 1 else f"{fmt}, {b} requests"), th, pts


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    threads = sorted({r["threads"] for r in rows})
    ctxs = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(len(ctxs), len(threads), figsize=(5.5 * len(threads), 4 * len(ctxs)), squeeze=False)
    for i, ctx in enumerate(ctxs):
        for j, th in enumerate(threads):
            ax = axes[i][j]
            for fmt, b in dict.fromkeys((r["format"], r.get("requests", 1)) for r in rows):
                pts = sorted((r["rows"], r["step_ms"]) for r in rows
                             if r["format"] == fmt and r.get("requests", 1) == b and r["threads"] == th
                             and r["context"] == ctx)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            label=fmt if b == 1 else f"{fmt}, {b} requests")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("query rows M (1 = plain decoding, K+1 = verifying K drafts)")
            ax.set_ylabel("target step, ms")
            ax.set_title(f"context {ctx}, {th} thread{'s' if th > 1 else ''}")
            ax.grid(alpha=0.3)
            ax.legend()
    import textwrap
    fig.suptitle("\n".join(textwrap.wrap(title, 150)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="draftwise bench step-cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--formats", default="fp32,bf16,int8,int4",
                    help=f"comma-separated, from {', '.join(FORMATS)}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--requests", default="1",
                    help="batch shapes: B requests each feeding M rows after the context (e.g. 1,16)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compiled", action="store_true", help="compiled graphs (default: eager)")
    ap.add_argument("--draft-model", default=None,
                    help="also time one pass of this draft model (a packaged name, GGUF file or directory): "
                         "what each drafted token costs, beside the target's step")
    ap.add_argument("--draft-quantization", default=None, help="re-quantize the draft model at load (Q4_0, ...)")
    ap.add_argument("--out", default="bench_out/step_cost")
    a = ap.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    fmts = a.formats.split(",")
    bad = [f for f in fmts if f not in FORMATS]
    if bad:
        raise SystemExit(f"unknown format(s) {bad}; choose from {', '.join(FORMATS)}")
    draft = None
    if a.draft_model is not None:
        draft = {"method": "draft_model", "model": a.draft_model, "num_speculative_tokens": 1,
                 "quantization": a.draft_quantization}
    head = f"{machine_line()}; {'compiled' if a.compiled else 'eager'}"
    print(head, flush=True)
    rows = []
    for f in fmts:
        rows += measure_format(f, a.model, ints(a.threads), ints(a.rows), ints(a.contexts), a.compiled, a.repeats,
                               ints(a.requests), draft)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "step_cost.json"), "w") as fh:
        json.dump({"machine": head, "rows": rows}, fh, indent=1)
    plot(rows, os.path.join(a.out, "step_cost.png"), head)
    print(head)
    print(format_table(rows))
    for r in rows:
        if "draft_token_ms" in r and r["rows"] == min(x["rows"] for x in rows):
            print(f"draft model {a.draft_model}: {r['draft_token_ms']:.1f} ms per drafted token ({r['format']}, "
                  f"{r['threads']} threads, context {r['context']}, {r['requests']} requests) = "
                  f"{r['draft_token_ms'] / r['step_ms']:.2f}x a plain target step")
    print(f"wrote {a.out}/step_cost.json and step_cost.png")
    return rows


if __name__ == "__main__":
    main()
