"""Hand-written CPU kernels, one module per instruction set, compiled on first use (`build.py`: the
kernels' and the bindings' units in parallel; cached under torch's extension directory, so later
starts load the built library in well under a second).

`cpu/avx512.cpp` (AVX512-BF16 dot products, AMX-BF16 tiles where the OS grants them) and
`cpu/avx2.cpp` (AVX2 + FMA + F16C; built a second time with AVX-VNNI's vpdpbusd for the CPUs
that have it without AVX-512) each provide the same functions: weight-stationary int4 (group 32,
GGUF Q4_1) and int8 linears for every row count, the group-affine linear every GGUF block family
runs on (`cpu/affine.h` on AVX2 FMAs, `cpu/avx512_affine.h` on AVX512-BF16 dot products; layouts by
`pack_affine`), the row-invariant attention over fp32 / bf16 / fp16 paged caches, the fused decoder
layer (`cpu/layer.h`, shared) and layer stack (`cpu/stack.h`), the row argmax.

`isa()` is the one dispatch point: the best ISA this CPU has, or the one `DRAFTWISE_ISA` names
(amx | avx512 | avx_vnni | avx2 | none; `none` = PyTorch's own kernels). A machine's numbers depend on that ISA
only: every row count runs the same kernel, so a row's bits never depend on the rows beside it. A
kernel that cannot be built or loaded here means PyTorch's kernels, with one warning: `load()`
returns None and says why once."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading

import torch

from draftwise.kernels.build import Unit, build_library, import_library, library_path
from draftwise.machine import cpu_flags

logger = logging.getLogger("draftwise")
_lock = threading.Lock()
_state: dict = {}

ISAS = ("amx", "avx512", "avx_vnni", "avx2", "none")           # best first
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]


@dataclasses.dataclass(frozen=True)
class KernelModule:
    """One ISA's compiled module: its kernels and their Python bindings, translation units compiled
    in parallel (the bindings alone include the Python and libtorch headers, and build at -O1)."""
    name: str
    sources: tuple[str, ...]        # the kernels' units, the bindings' last
    high_bits: str                  # where its 5- and 6-bit dot layouts keep the codes' high bits (HIGH_BITS)
    cflags: tuple[str, ...] = ()    # the AVX-512 files mark their functions themselves


_AVX512_MODULE = KernelModule("avx512", ("avx512.cpp", "avx512_bind.cpp"), "masks")
MODULES = {"amx": _AVX512_MODULE, "avx512": _AVX512_MODULE,     # AMX is chosen inside, at run time
           "avx_vnni": KernelModule("avx_vnni", ("avx2.cpp", "avx2_bind.cpp"), "shifts",
                                    (*_AVX2, "-mavxvnni", "-DDRAFTWISE_AVX_VNNI")),
           "avx2": KernelModule("avx2", ("avx2.cpp", "avx2_bind.cpp"), "shifts", tuple(_AVX2))}
_CPU_DIR = os.path.join(os.path.dirname(__file__), "cpu")   # the kernel sources
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}


def available_isas(flags: set[str] | None = None) -> list[str]:
    """Every kernel ISA this CPU (or these cpuinfo flags) can run, best first, `none` last."""
    flags = cpu_flags() if flags is None else flags
    has = {"amx": _AVX512 | {"amx_bf16", "amx_tile"} <= flags, "avx512": _AVX512 <= flags,
           "avx2": {"avx2", "fma", "f16c"} <= flags, "none": True}
    has["avx_vnni"] = has["avx2"] and "avx_vnni" in flags
    return [name for name in ISAS if has[name]]


def cpu_isa() -> str:
    """The best kernel ISA this CPU has."""
    return available_isas()[0]


def isa() -> str:
    """The ISA the kernels run on: `DRAFTWISE_ISA` where set (and the CPU has it), else the best the
    CPU has. A request the CPU cannot serve falls back to the best it has, with a warning."""
    if "isa" in _state:
        return _state["isa"]
    best = cpu_isa()
    want = os.environ.get("DRAFTWISE_ISA", "").strip().lower() or "auto"
    if want == "auto":
        chosen = best
    elif want not in ISAS:
        logger.warning("DRAFTWISE_ISA=%s is not one of %s (or auto); using %s", want, ", ".join(ISAS), best)
        chosen = best
    elif want not in available_isas():
        logger.warning("DRAFTWISE_ISA=%s, but this CPU has no %s; using %s", want, want, best)
        chosen = best
    else:
        chosen = want
    _state["isa"] = chosen
    return chosen


def reset() -> None:
    """Forget the chosen ISA and the loaded module (tests switch DRAFTWISE_ISA between engines)."""
    with _lock:
        _state.clear()


@contextlib.contextmanager
def forced_isa(name: str | None):
    """Run the block on ISA `name` (as DRAFTWISE_ISA would; None: leave things as they are), and
    restore the environment's choice after it (benchmarks comparing paths in one process)."""
    if name is None:
        yield
        return
    old = os.environ.get("DRAFTWISE_ISA")
    os.environ["DRAFTWISE_ISA"] = name
    reset()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DRAFTWISE_ISA", None)
        else:
            os.environ["DRAFTWISE_ISA"] = old
        reset()


def load():
    """The compiled kernel module of `isa()`, or None where none runs here (then PyTorch's kernels
    serve, with one warning naming the reason)."""
    with _lock:
        if "mod" in _state:
            return _state["mod"]
        mod, chosen = None, isa()
        if chosen == "none":
            why = "DRAFTWISE_ISA=none" if cpu_isa() != "none" else "the CPU has neither AVX2+FMA+F16C nor AVX512-BF16"
        else:
            try:
                mod = _build(MODULES[chosen])
                why = None
            except Exception as e:     # noqa: BLE001 - no compiler, a failed build, ...
                why = f"the {chosen} kernels could not be built ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        if mod is None:
            logger.warning("CPU kernels: using PyTorch's (%s)", why)
        _state["mod"] = mod
        _state["amx"] = bool(mod is not None and chosen == "amx" and mod.amx_available())
        return mod


def _build(module: KernelModule):
    from torch.utils.cpp_extension import _get_build_directory
    name = "draftwise_cpu_" + module.name
    directory = _get_build_directory(name, verbose=False)     # torch's folder (TORCH_EXTENSIONS_DIR honoured)
    # a digest of every source file, and the folder they are in (another checkout or environment
    # sharing the extension folder), decides whether the library there is this one
    built_from = f"{_sources_digest(_CPU_DIR)} {_CPU_DIR}"
    library = library_path(name, directory)
    with build_lock(directory):
        stamp = os.path.join(directory, "draftwise.built")
        if not (os.path.exists(library) and _read(stamp) == built_from):
            # one line while the compiler runs, so a first start is not silence
            print(f"draftwise: building the {module.name} CPU kernels for this machine (once after "
                  "an install or upgrade; 15-25 s on 2 cores) ...", file=sys.stderr, flush=True)
            *kernel_units, bindings = (os.path.join(_CPU_DIR, f) for f in module.sources)
            units = [*(Unit(src, "-O3") for src in kernel_units), Unit(bindings, "-O1")]
            build_library(name, units, [f"-I{_CPU_DIR}", "-fopenmp", *module.cflags], ["-fopenmp"], directory)
            with open(stamp, "w") as f:
                f.write(built_from)
        return import_library(name, library)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


@contextlib.contextmanager
def build_lock(directory: str):
    """One build of a kernel library at a time across draftwise processes, under a lock the OS
    releases when its holder dies: a build killed midway (Ctrl-C on a first start) never makes a
    later start wait."""
    try:
        import fcntl
    except ImportError:                # no POSIX locks (the build still writes its library whole)
        yield
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "draftwise.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield                          # closing the file releases the lock


def _sources_digest(folder: str) -> str:
    import hashlib
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith((".h", ".cpp")):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def kernels_id() -> str:
    """What the kernels' numbers and speed depend on: the ISA they run on and, for a built ISA, a
    digest of their sources (a cache of measured costs keyed by it is redone after an upgrade)."""
    chosen = isa()
    if chosen == "none":
        return "none"
    return f"{chosen}-{_sources_digest(_CPU_DIR)}"


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
    """The fp32 [N, K] weight of a packed layout, as the AVX-512 kernel forms it: (128 + code) * scale
    + (minimum - 128 * scale) (the AVX2 kernel multiplies code * scale and adds the minimum after the
    group's dot product; both equal code * scale + minimum up to fp32 rounding)."""
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


def _call(name: str, op, x_bf16: torch.Tensor, *args):
    """Run kernel `name` on x and its weight arguments: inside compiled graphs through its custom op
    (opaque to the compiler), eagerly straight into the extension (no dispatcher hop), named in
    profiles when one runs."""
    if torch.compiler.is_compiling():
        return op(x_bf16, *args)
    fn = getattr(_state.get("mod") or load(), name)
    if torch.autograd.profiler._is_profiler_enabled:          # named in profiles (draftwise bench step-cost)
        with torch.profiler.record_function(f"draftwise::{name}"):
            return fn(x_bf16.contiguous(), *args)
    return fn(x_bf16.contiguous(), *args)


def int4_linear(x_bf16: torch.Tensor, nibbles: torch.Tensor, sm: torch.Tensor, use_amx: bool | None = None):
    return _call("int4_linear", int4_linear_op, x_bf16, nibbles, sm, amx() if use_amx is None else bool(use_amx))


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
    """The kernel's arguments for a row plan, built once per step (every layer of one kind shares
    the plan: the full one, and a sliding-window layer's)."""
    cached = _state.setdefault("plans", [])
    for p, args in cached:
        if p is plan:
            return args
    args = _plan_args(plan)
    cached.append((plan, args))
    del cached[:-4]
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
    PyTorch's CPU argmax over the last dimension is slow: milliseconds for 8-16 rows of a 49k
    vocabulary (a verification step's greedy acceptance), and for one row of Gemma 3's 262k
    vocabulary 217 us against the kernel's 34 (~2 % of a plain step, Zen 4); the kernel does one
    row per task, 16 lanes at a time."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[0] > 0
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
    return _call("int8_linear", int8_linear_op, x_bf16, q8, scale, amx() if use_amx is None else bool(use_amx))


@torch.library.custom_op("draftwise::int8_linear", mutates_args=())
def int8_linear_op(x: torch.Tensor, q8: torch.Tensor, scale: torch.Tensor, use_amx: bool) -> torch.Tensor:
    return load().int8_linear(x.contiguous(), q8, scale, use_amx)


@int8_linear_op.register_fake
def _(x, q8, scale, use_amx):
    return x.new_empty((x.shape[0], q8.shape[0] * 16), dtype=torch.float32)


HIGH_BITS = ("masks", "shifts")    # where a 5- or 6-bit dot layout keeps its codes' bits above the nibble


def high_bits_for(isa_name: str | None = None) -> str:
    """The high-bit arrangement the kernels of `isa_name` (default: the running ISA) read: AVX2's
    shifts, the AVX-512 kernels' (and PyTorch's fallback) masks. Weights are packed for the ISA that
    will run them, as llama.cpp repacks its blocks per ISA at load."""
    return MODULES.get(isa_name or isa(), _AVX512_MODULE).high_bits


def step_bytes(bits: int) -> int:
    """Bytes of one octet step of a dot layout (pack_affine) with `bits`-bit codes."""
    return 128 if bits == 8 else 64 + 16 * (bits - 4)


def code_bits(packed: torch.Tensor) -> int:
    """The code width of a dot layout: step_bytes' inverse (8-bit codes are stored signed)."""
    return 8 if packed.dtype == torch.int8 else 4 + (packed.shape[-1] - 64) // 16


def pack_affine(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None, group: int, bits: int,
                offset: int, factors=None, high_bits: str | None = None):
    """A GroupAffine weight (draftwise/formats) -> the int8-activation kernels' dot layout
    (cpu/q8act.h): (codes, scale, minimum, offset).

    codes: per block of 16 output columns and octet o of inputs, 4- to 6-bit codes as uint8
    [N/16, K/8, 64 + 16 (bits - 4)] (byte 4j + i = code[j][8o + i] | code[j][8o + 4 + i] << 4, then
    the bits above 3 in the `high_bits` arrangement, default high_bits_for() - see
    _high_bit_places); int8 codes as [N/16, K/8, 128] (two quads of code - offset, byte 4j + i =
    input 4h + i; the offset returned is then 0). Codes of 8 bits that fit in 6 (GGUF Q6_K's q - 32)
    are stored in 6, offset 32. scale / minimum: the super-block factors where given (uint8
    [N/16, K/256, 32 + 16 * 256/group]: per super-block 16 fp16 d, then the int8 sub-scales), else
    [N/16, K/group, 16] in fp16 where every value is exact in it (the legacy families' own fp16
    numbers), else fp32; minimum empty where the family has none."""
    high_bits = high_bits or high_bits_for()
    N, K = codes.shape
    if bits == 8 and int(codes.min()) - offset >= -32 and int(codes.max()) - offset <= 31:
        bits, shift = 6, 32 - offset           # stored as code - offset + 32, offset 32
    else:
        shift = 0
    packed = torch.empty(N // 16, K // 8, step_bytes(bits), dtype=torch.int8 if bits == 8 else torch.uint8)
    # in slices of rows: the temporaries of a 150k-row LM head stay a few MB
    rows = max(16, (PACK_SLICE_BYTES // max(K, 1)) // 16 * 16)
    for r0 in range(0, N, rows):
        packed[r0 // 16:(r0 + rows) // 16] = _pack_codes(codes[r0:r0 + rows], bits, offset, shift, high_bits)
    if shift:
        offset = 32
    elif bits == 8:
        offset = 0
    if factors is not None:
        scale_t, minimum_t = _super_records(factors.d, factors.sc), None
        if factors.m is not None:
            minimum_t = _super_records(factors.dmin, factors.m)
        return packed, scale_t, torch.empty(0, dtype=torch.uint8) if minimum_t is None else minimum_t, offset

    exact16 = all(t is None or bool(torch.equal(t.half().float(), t.float())) for t in (scale, minimum))
    dtype = torch.float16 if exact16 else torch.float32

    def per_block(t):
        return t.to(dtype).reshape(N // 16, 16, K // group).transpose(1, 2).contiguous()
    return (packed, per_block(scale), torch.empty(0, dtype=dtype) if minimum is None else per_block(minimum),
            offset)


PACK_SLICE_BYTES = 1 << 23      # codes packed at a time


def _high_bit_places(planes: int, high_bits: str) -> torch.Tensor:
    """Where a step keeps its codes' bits above the nibble: for bit 4 + t of the step's code n =
    8j + 4s + i (column j of the block, s: inputs 0-3 or 4-7 of the octet, i: the input within them;
    its nibble is byte 4j + i's low or high one by s), its place byte * 8 + bit among the step's
    high-bit bytes ([planes, 128] int64).

    masks (read by AVX-512 mask registers): per plane two 64-bit masks, bit 4j + i of mask s.
    shifts (AVX2: one load, then a shift and an and per 32 codes), with h = j // 8 the code's
    half-block and u = 4 (j % 8) + i its byte within the half (the byte of 32 a 256-bit register
    holds for a, b = s 0, 1):
      6-bit: 32 bytes of 2-bit crumbs, byte u, crumb 2h + s holds bits 4-5;
      5-bit: 16 bytes read into both 128-bit lanes, byte u % 16, bit 2 (2h + s) + u // 16."""
    j, s, i = torch.meshgrid(torch.arange(16), torch.arange(2), torch.arange(4), indexing="ij")
    j, s, i = j.reshape(-1), s.reshape(-1), i.reshape(-1)
    t = torch.arange(planes)[:, None]
    if high_bits == "masks":
        return (16 * t + 8 * s + (4 * j + i) // 8) * 8 + (4 * j + i) % 8
    if high_bits != "shifts":
        raise ValueError(f"high_bits: one of {HIGH_BITS}, not {high_bits!r}")
    h, u = j // 8, 4 * (j % 8) + i
    if planes == 2:
        return u * 8 + 2 * (2 * h + s) + t
    return ((u % 16) * 8 + 2 * (2 * h + s) + u // 16).expand(planes, -1)


def _pack_codes(codes: torch.Tensor, bits: int, offset: int, shift: int, high_bits: str) -> torch.Tensor:
    """Rows [n, K] (n a multiple of 16) of codes -> their dot-layout column blocks."""
    N, K = codes.shape
    if bits == 8:
        c = (codes.to(torch.int16) - offset).to(torch.int8).reshape(N // 16, 16, K // 4, 4)
        return c.permute(0, 2, 1, 3).reshape(N // 16, K // 8, 128)
    c = (codes.to(torch.int16) + shift).to(torch.uint8) if shift else codes.to(torch.uint8)
    c = c.reshape(N // 16, 16, K // 8, 2, 4)                                            # [B, j, o, s, i]
    nib = (c[:, :, :, 0] & 15) | ((c[:, :, :, 1] & 15) << 4)                           # [B, j, o, i]
    steps = [nib.permute(0, 2, 1, 3).reshape(N // 16, K // 8, 64)]
    planes = bits - 4
    if planes:
        by_step = c.permute(0, 2, 1, 3, 4).reshape(N // 16, K // 8, 1, 128)             # code n = 8j + 4s + i
        high = (by_step >> (4 + torch.arange(planes, dtype=torch.uint8))[:, None]) & 1  # [B, O, planes, 128]
        order = torch.argsort(_high_bit_places(planes, high_bits).reshape(-1))
        bits_in_place = high.reshape(N // 16, K // 8, -1)[..., order].reshape(N // 16, K // 8, 16 * planes, 8)
        steps.append((bits_in_place << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8))
    return torch.cat(steps, -1)


def _super_records(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Factors d [N, S] (fp16 values) and q [N, S * gps] int8 -> uint8 [N/16, S, 32 + 16 gps]: per
    column block and super-block, the 16 columns' d in fp16, then gps x 16 sub-scales."""
    N, S = d.shape
    gps = q.shape[1] // S
    d16 = d.to(torch.float16).reshape(N // 16, 16, S).transpose(1, 2).contiguous().view(torch.uint8)  # [B, S, 32]
    qs = q.to(torch.int8).reshape(N // 16, 16, S, gps).permute(0, 2, 3, 1).reshape(N // 16, S, gps * 16)
    return torch.cat([d16, qs.contiguous().view(torch.uint8)], -1).contiguous()


def unpack_scales(t: torch.Tensor, group: int) -> torch.Tensor:
    """A dot layout's scale (or minimum) table -> fp32 [N/16, K/group, 16]."""
    if t.dtype != torch.uint8:
        return t.float()
    B, S, width = t.shape
    gps = (width - 32) // 16
    d = t[..., :32].contiguous().view(torch.float16).float()                            # [B, S, 16]
    q = t[..., 32:].contiguous().view(torch.int8).reshape(B, S, gps, 16).float()
    return (d[:, :, None, :] * q).reshape(B, S * gps, 16)


def unpack_codes(packed: torch.Tensor, high_bits: str | None = None) -> torch.Tensor:
    """The codes [N, K] of a dot layout (8-bit ones less their offset; high bits arranged as
    `high_bits`, default the running ISA's)."""
    high_bits = high_bits or high_bits_for()
    B, O = packed.shape[:2]
    if packed.dtype == torch.int8:
        return packed.reshape(B, 2 * O, 16, 4).permute(0, 2, 1, 3).reshape(B * 16, O * 8)
    nib = packed[..., :64].reshape(B, O, 16, 1, 4)
    codes = torch.cat([nib & 15, nib >> 4], 3).reshape(B, O, 128)                      # n = 8j + 4s + i
    planes = (packed.shape[-1] - 64) // 16
    if planes:
        bits = (packed[..., 64:, None] >> torch.arange(8, dtype=torch.uint8)) & 1         # [B, O, 16 planes, 8]
        high = bits.reshape(B, O, -1)[..., _high_bit_places(planes, high_bits).reshape(-1)].reshape(B, O, planes, 128)
        codes = codes | (high << (4 + torch.arange(planes, dtype=torch.uint8))[:, None]).sum(2, dtype=torch.uint8)
    return codes.reshape(B, O, 16, 8).permute(0, 2, 1, 3).reshape(B * 16, O * 8)


def unpack_affine(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int, offset: int,
                  high_bits: str | None = None):
    """The fp32 [N, K] weight of the dot layout: scale * (code - offset) (+ minimum)."""
    codes = unpack_codes(packed, high_bits)
    N, K = codes.shape
    per_row = lambda t: unpack_scales(t, group).transpose(1, 2).reshape(N, -1, 1)  # noqa: E731
    w = (codes.float() - offset).reshape(N, K // group, group) * per_row(scale)
    if minimum.numel():
        w = w + per_row(minimum)
    return w.reshape(N, K)


def affine_linear(x_bf16: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                  group: int, offset: int, high_bits: str | None = None) -> torch.Tensor:
    """y [M, N] fp32 = x [M, K] . W^T for a group-affine weight in the dot layout (pack_affine; a 5-
    or 6-bit one in the high-bit arrangement of the running ISA, else the kernel refuses it). x is
    bf16, quantized to int8 by the kernel per block of 32 inputs, or per 256 for a weight with
    super-block factors (cpu/q8act.h)."""
    return _call("affine_linear", affine_linear_op, x_bf16, packed, scale, minimum, group, offset,
                 HIGH_BITS.index(high_bits or high_bits_for()))


@torch.library.custom_op("draftwise::affine_linear", mutates_args=())
def affine_linear_op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                     group: int, offset: int, high_bits: int) -> torch.Tensor:
    return load().affine_linear(x.contiguous(), packed, scale, minimum, group, offset, high_bits)


@affine_linear_op.register_fake
def _(x, packed, scale, minimum, group, offset, high_bits):
    return x.new_empty((x.shape[0], packed.shape[0] * 16), dtype=torch.float32)
