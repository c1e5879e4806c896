"""Hand-written CPU kernels, compiled on first use with torch.utils.cpp_extension (cached under
torch's extension directory, so later starts load the built library in well under a second).

`int4_cpu.cpp`: a weight-stationary int4 (group 32, GGUF Q4_1) linear for the small row counts of
decoding and verification, on AVX512-BF16 dot products or AMX-BF16 tiles (see the file), its int8
sibling for the LM head, and the row-invariant attention over fp32 / bf16 / fp16 paged caches. Machines
without AVX512-BF16, or without a C++ compiler / ninja, keep PyTorch's own int4 kernel: `load()`
returns None and says why once."""
from __future__ import annotations

import logging
import os
import threading

import torch

from draftwise.machine import cached_measurement, cpu_flags, machine_key

logger = logging.getLogger("draftwise")
_lock = threading.Lock()
_state: dict = {}


def load():
    """The compiled int4 kernel module, or None where it cannot run here."""
    with _lock:
        if "mod" in _state:
            return _state["mod"]
        mod = None
        flags = cpu_flags()
        if os.environ.get("DRAFTWISE_NO_KERNELS"):
            why = "DRAFTWISE_NO_KERNELS is set"
        elif "avx512_bf16" not in flags:
            why = "the CPU has no AVX512-BF16"
        else:
            why = None
            try:
                from torch.utils.cpp_extension import load as build
                src = os.path.join(os.path.dirname(__file__), "int4_cpu.cpp")
                logger.info("building the int4 CPU kernel (first run only)")
                mod = build(name="draftwise_int4_cpu", sources=[src], extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                            verbose=False)
            except Exception as e:     # noqa: BLE001 - no compiler, no ninja, ...
                why = f"it could not be built ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        if mod is None:
            logger.warning("int4 kernel: using PyTorch's (%s)", why)
        _state["mod"] = mod
        _state["amx"] = bool(mod is not None and {"amx_bf16", "amx_tile"} <= flags and mod.amx_available())
        return mod


def attention_reads_16bit() -> bool:
    """Whether the row-invariant attention kernel serves this machine (it reads fp32, bf16 and
    fp16 caches alike); where it does not, a 16-bit cache would fall back to per-row SDPA."""
    return load() is not None


def amx() -> bool:
    load()
    return _state.get("amx", False)


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor):
    """codes uint8 [N, K] (0..15), scale / minimum [N, K/32] (w = codes * scale + minimum) -> the
    kernel's (nibbles uint8 [N/16, K/2, 16], sm fp16 [N/16, K/32, 2, 16] holding scale and minimum;
    GGUF Q4_1 stores both in fp16, so its blocks stay exact)."""
    N, K = codes.shape
    c = codes.to(torch.uint8).reshape(N // 16, 16, K // 2, 2)
    nib = (c[..., 0] | (c[..., 1] << 4)).transpose(1, 2).contiguous()          # [N/16, K/2, 16]
    s = scale.float().reshape(N // 16, 16, K // 32).transpose(1, 2)             # [N/16, K/32, 16]
    m = minimum.float().reshape(N // 16, 16, K // 32).transpose(1, 2)
    return nib, torch.stack([s, m], 2).to(torch.float16).contiguous()           # [N/16, K/32, 2, 16]


def unpack_int4(nibbles: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """The fp32 [N, K] weight of a packed layout, computed as the kernel does: (128 + code) * scale
    + (minimum - 128 * scale)."""
    B, P, _ = nibbles.shape
    codes = torch.stack([nibbles & 15, nibbles >> 4], -1)                        # [N/16, K/2, 16, 2]
    codes = codes.permute(0, 2, 1, 3).reshape(B * 16, P * 2).float() + 128.0      # [N, K]
    s = sm[:, :, 0, :].float().transpose(1, 2).reshape(B * 16, -1, 1)            # [N, K/32, 1]
    m = sm[:, :, 1, :].float().transpose(1, 2).reshape(B * 16, -1, 1) - 128.0 * s
    return (codes.reshape(B * 16, -1, 32) * s + m).reshape(B * 16, P * 2)


@torch.library.custom_op("draftwise::int4_linear", mutates_args=())
def int4_linear_op(x: torch.Tensor, nibbles: torch.Tensor, sm: torch.Tensor, use_amx: bool) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] (bf16) . W^T for a packed int4 weight (an opaque op to compiled graphs)."""
    return load().int4_linear(x.contiguous(), nibbles, sm, use_amx)


@int4_linear_op.register_fake
def _(x, nibbles, sm, use_amx):
    return x.new_empty((x.shape[0], nibbles.shape[0] * 16), dtype=torch.float32)


def _call(name: str, op, x_bf16: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, use_amx):
    """Run kernel `name`: inside compiled graphs through its custom op (opaque to the compiler),
    eagerly straight into the extension (no dispatcher hop), named in profiles when one runs."""
    use_amx = amx() if use_amx is None else bool(use_amx)
    if torch.compiler.is_compiling():
        return op(x_bf16, weight, scales, use_amx)
    fn = getattr(_state.get("mod") or load(), name)
    if torch.autograd.profiler._is_profiler_enabled:          # named in profiles (draftwise bench step-cost)
        with torch.profiler.record_function(f"draftwise::{name}"):
            return fn(x_bf16.contiguous(), weight, scales, use_amx)
    return fn(x_bf16.contiguous(), weight, scales, use_amx)


def int4_linear(x_bf16: torch.Tensor, nibbles: torch.Tensor, sm: torch.Tensor, use_amx: bool | None = None):
    return _call("int4_linear", int4_linear_op, x_bf16, nibbles, sm, use_amx)


def dense_linear(x_bf16: torch.Tensor, nibbles: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """y [M, N] bf16 = x [M, K] (bf16) . W^T with W dequantized to bf16 for this call and a dense
    bf16 GEMM (ATen's: oneDNN AMX / AVX512-BF16): the many-row path (prefill chunks)."""
    mod = _state.get("mod") or load()
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function("draftwise::dense_linear"):
            return mod.layer_linear(x_bf16.contiguous(), nibbles, sm, False, True)
    return mod.layer_linear(x_bf16.contiguous(), nibbles, sm, False, True)


def attend_rows_kernel(q, k_cache, v_cache, plan, scale: float, out: torch.Tensor) -> bool:
    """Row-invariant attention for `plan` (AttentionMetadata.row_plan) in one kernel call; False
    where the kernel does not apply here (then the caller attends row by row with SDPA). Used by
    every row-invariant step alike, so decode and verification rows compute the same way."""
    args = row_plan_args(plan)
    if (args is None or q.device.type != "cpu" or q.dtype != torch.float32 or not q.is_contiguous()
            or not out.is_contiguous() or not attention_kernel_fits(q.shape[-1], q.shape[1] // k_cache.shape[1], k_cache)):
        return False
    mod = _state["mod"] if "mod" in _state else load()
    if mod is None:
        return False
    # a 16-bit cache is read as it is and widened in registers (exact): the same scores as fp32
    # copies of its values, and half the memory traffic
    if torch.autograd.profiler._is_profiler_enabled:        # named in profiles (draftwise bench step-cost)
        with torch.profiler.record_function("draftwise::attend_rows"):
            mod.attend_rows(q, k_cache, v_cache, out, *args, float(scale))
        return True
    mod.attend_rows(q, k_cache, v_cache, out, *args, float(scale))
    return True


def attention_kernel_fits(head_dim: int, groups: int, k_cache: torch.Tensor) -> bool:
    """Whether the row-invariant attention kernel takes fp32 queries of this head size, `groups`
    query heads per KV head, over this cache."""
    return (k_cache.device.type == "cpu" and k_cache.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and head_dim in (16, 32, 64, 128, 256)               # the head sizes it is built for
            and groups <= 64)


def row_plan_args(plan):
    """The kernel's arguments for a row plan, built once per step (every layer shares the plan);
    None where the kernel is switched off (DRAFTWISE_NO_ATTENTION_KERNEL, an A/B switch for the
    bench and tests)."""
    cached = _state.get("plan")
    if cached is not None and cached[0] is plan:
        return cached[1]
    args = None if os.environ.get("DRAFTWISE_NO_ATTENTION_KERNEL") else _plan_args(plan)
    _state["plan"] = (plan, args)
    return args


def _plan_args(plan) -> tuple:
    """The kernel's flat arguments for a row plan: rows, their key counts, their key lists."""
    rows, lens, lists, slots = [], [], [], []
    for i, (start, seq_lens, s) in enumerate(plan):
        slots.append(s.contiguous())
        for j, n in enumerate(seq_lens):
            rows.append(start + j)
            lens.append(n)
            lists.append(i)
    return rows, lens, lists, slots


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [M, V] -> int64 [M], each row's argmax with torch.argmax's rule (the first maximum).
    PyTorch's CPU argmax over the last dimension is slow for several rows (milliseconds for 8-16
    rows of a 49k vocabulary: a verification step's greedy acceptance); the kernel does one row per
    task, 16 lanes at a time."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[0] > 1
            and logits.is_contiguous()):
        mod = _state["mod"] if "mod" in _state else load()
        if mod is not None:
            return mod.row_argmax(logits)
    return logits.argmax(-1)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] (per-channel codes) -> the int8 kernel's pair layout [N/16, K/2, 16, 2]."""
    N, K = q.shape
    return q.reshape(N // 16, 16, K // 2, 2).transpose(1, 2).contiguous()


def unpack_int8(q8: torch.Tensor) -> torch.Tensor:
    B, P = q8.shape[:2]
    return q8.transpose(1, 2).reshape(B * 16, P * 2)


def int8_linear(x_bf16: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor, use_amx: bool | None = None):
    return _call("int8_linear", int8_linear_op, x_bf16, q8, scale, use_amx)


@torch.library.custom_op("draftwise::int8_linear", mutates_args=())
def int8_linear_op(x: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor, use_amx: bool) -> torch.Tensor:
    return load().int8_linear(x.contiguous(), q8, scale, use_amx)


@int8_linear_op.register_fake
def _(x, q8, scale, use_amx):
    return x.new_empty((x.shape[0], q8.shape[0] * 16), dtype=torch.float32)


def int4_kernel_choice() -> dict:
    """Which int4 kernel serves the engine's linears - "draftwise" (this package's) or "aten"
    (PyTorch's) - for small row counts, and whether draftwise's also serves large ones (prefill)
    instead of a dense GEMM over dequantized weights. Measured once per machine, torch build, thread
    count and kernel source on SmolLM2's layer shapes and cached on disk (every run on the machine
    then computes the same numbers). The cost weighed is decoding plus verifying (1, 8 and 16 rows);
    it does not depend on whether this engine speculates, because plain decoding and speculation must
    compute the same numbers. One kernel serves every row count up to the limit, so a row's numbers
    never depend on how many rows shared its step."""
    import hashlib
    # "draftwise" | "draftwise+dense" (long prefill chunks on the dense GEMM) | "aten": skip the measurement
    forced = os.environ.get("DRAFTWISE_INT4_KERNEL")
    if forced in ("draftwise", "draftwise+dense", "aten"):
        if forced != "aten" and load() is None:
            raise RuntimeError(f"DRAFTWISE_INT4_KERNEL={forced}, but the kernel cannot run here (see the log)")
        small = "aten" if forced == "aten" else "draftwise"
        return {"small": small, "large": "draftwise" if forced == "draftwise" else "dense", "int8": small}
    if "choice" in _state:
        return _state["choice"]
    src = os.path.join(os.path.dirname(__file__), "int4_cpu.cpp")
    with open(src, "rb") as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:12]
    costs = cached_measurement("int4_kernel_choice.json", machine_key(digest, torch.get_num_threads()),
                               _measure_int4_costs)
    rows = (1, 8, 16)

    def cheaper(ours: str, theirs: str) -> bool:
        return ours in costs and sum(costs[ours][str(m)] for m in rows) < sum(costs[theirs][str(m)] for m in rows)
    small = "draftwise" if cheaper("draftwise", "aten") else "aten"
    large = "draftwise" if "draftwise" in costs and costs["draftwise"]["256"] < costs["dense"]["256"] else "dense"
    int8 = "draftwise" if cheaper("int8_draftwise", "int8_aten") else "aten"
    choice = {"small": small, "large": large, "int8": int8}
    _state["choice"] = choice
    logger.info("int4 kernel: %s for decode/verification, %s for prefill; int8: %s", 
                f"draftwise's ({'AMX' if amx() else 'AVX512-BF16'})" if small == "draftwise" else "PyTorch's",
                "draftwise's" if large == "draftwise" else "a dense GEMM",
                "draftwise's" if int8 == "draftwise" else "PyTorch's")
    return choice


SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]     # SmolLM2's layer linears (N, K)


def _measure_int4_costs(layers: int = 12) -> dict:
    """Seconds per pass over `layers` SmolLM2-shaped layers (four linears each, distinct weights, ~25 MB
    of int4 codes: more than the caches hold, as in a real step;
    decode streams every weight from memory, so a kernel timed on one hot matrix would look faster
    than it runs), by kernel and row count, p10 of repeated passes."""
    import time
    from draftwise.layers.quant_formats import quantize_int4_groupwise
    g = torch.Generator().manual_seed(0)

    def p10(fn, x_by_k, reps):
        fn(x_by_k)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(x_by_k)
            ts.append(time.perf_counter() - t)
        return sorted(ts)[reps // 10]
    have = load() is not None
    mats = []
    for _ in range(layers):
        for N, K in SHAPES:
            codes, scale, mn = quantize_int4_groupwise(torch.randn(N, K, generator=g) * 0.05)
            sz = torch.stack([scale.to(torch.bfloat16), (mn + 8.0 * scale).to(torch.bfloat16)], -1).transpose(0, 1).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            mats.append((K, packed, sz, *pack_int4(codes, scale, mn)))
    fns = {"aten": lambda xs: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[K], p, 32, sz) for K, p, sz, _, _ in mats],
           # what the large-row path does: dequantize for the call, then a dense GEMM
           "dense": lambda xs: [xs[K] @ unpack_int4(nib, sm).to(xs[K].dtype).t() for K, _, _, nib, sm in mats[:4]]}
    if have:
        fns["draftwise"] = lambda xs: [int4_linear(xs[K], nib, sm) for K, _, _, nib, sm in mats]
        # the kernel's own dequantize-to-bf16 + GEMM (what fused layers run for long prefill chunks)
        fns["dense"] = lambda xs: [dense_linear(xs[K], nib, sm) for K, _, _, nib, sm in mats[:4]]
    out: dict = {name: {} for name in fns}
    for m in (1, 8, 16, 256):
        xs = {K: torch.randn(m, K, generator=g).to(torch.bfloat16) for K in (576, 1536)}
        for name, fn in fns.items():
            if name == "aten" and m == 256:
                continue
            t = p10(fn, xs, 10 if m < 256 else 3)
            if name == "dense" or m == 256:      # one layer's worth where only the large path is compared
                t = t if name == "dense" else t / layers
            out[name][str(m)] = t
    del mats
    # int8 per channel (the LM head and drafter linears), on a slice of an LM head
    from draftwise.layers.quant_formats import quantize_int8_per_channel
    q, scale = quantize_int8_per_channel(torch.randn(4096, 576, generator=g) * 0.05)
    sb = scale.to(torch.bfloat16)
    fns = {"int8_aten": lambda x: torch.ops.aten._weight_int8pack_mm(x, q, sb)}
    if have:
        q8, sf = pack_int8(q), scale.float().contiguous()
        fns["int8_draftwise"] = lambda x: int8_linear(x, q8, sf)
    for name, fn in fns.items():
        out[name] = {str(m): p10(lambda x: fn(x[576]), {576: torch.randn(m, 576, generator=g).to(torch.bfloat16)}, 40)
                     for m in (1, 8, 16)}
    return out
