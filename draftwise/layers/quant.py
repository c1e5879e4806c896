"""Weight-only quantized linears on PyTorch's CPU kernels (`quantization="int8" | "int4"`).

Kernels (ATen, vectorized for AVX2 / AVX-512 when activations and scales are **bf16**; fp32
activations take a scalar path that is 5-10x slower than fp32 matmul):

- int8: `aten._weight_int8pack_mm(x_bf16, w_int8 [N, K], scale_bf16 [N])`, per-output-channel
  symmetric scales;
- int4: `aten._weight_int4pack_mm_for_cpu(x_bf16, packed, group, scales_and_zeros_bf16 [K/g, N, 2])`
  with w = (q - 8) * scale + zero, q in 0..15, per group of `group` input columns. A GGUF Q4_1 block
  (w = d * q + m, 32 columns) is exactly this layout with scale = d, zero = m + 8 d, so SmolLM2's
  Q4_1 weights load without re-quantization (only d and m are rounded from fp16 to the kernel's
  bf16).

Both kernels stream one row of activations through the packed weights, so their cost grows
linearly with the row count: measured on SmolLM2's 120 layer linears (2 threads, AVX2), int4 takes
10.6 / 15.3 / 28.0 / 55.2 / 85 / 170 ms for 1 / 4 / 8 / 16 / 32 / 64 rows against fp32's 27.2 /
74.2 / 76.8 / 62-96 / 97 / 123 ms. So rows up to `MAX_KERNEL_ROWS` (decode, verification, drafting)
use the quantized kernel, and larger row counts (prefill chunks, large batches) dequantize the
weight for that call and run a dense GEMM: no dense copy is kept beside the quantized weights
(dequantizing costs one pass over the weight, small against a GEMM of more than 32 rows). Where
draftwise's kernels run, the int4 weight is dequantized to bf16 by the kernel and ATen's bf16 GEMM
follows (`draftwise.kernels.dense_linear`; fused layers use it for long prefill chunks only);
elsewhere the dense GEMM runs in the dtype `dense_gemm_dtype()` measured fastest on this machine
(bf16 where the CPU has bf16 matrix instructions - AVX512_BF16 / AMX - else fp32); both paths
compute the same quantized model up to activation (and, in bf16, weight) rounding.

On CUDA the dense path is used for every row count (the CPU kernels' packing is CPU-only).
"""
from __future__ import annotations

import torch
from torch import nn

from draftwise.layers.quant_formats import INT4_GROUP, quantize_int4_groupwise, quantize_int8_per_channel  # noqa: F401

QUANTIZATION_MODES = ("int8", "int4")
MAX_KERNEL_ROWS = 32


_DENSE_DTYPE: dict[str, torch.dtype] = {}


def dense_gemm_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype of the dense GEMM over dequantized weights: on CPU measured once per machine and
    torch build (fp32 against bf16 on a prefill-sized SmolLM2 shape, cached on disk so every run on
    the machine computes the same numbers); fp32 elsewhere."""
    dev = torch.device(device)
    if dev.type != "cpu":
        return torch.float32
    if "cpu" not in _DENSE_DTYPE:
        _DENSE_DTYPE["cpu"] = _measure_dense_dtype()
    return _DENSE_DTYPE["cpu"]


def _measure_dense_dtype() -> torch.dtype:
    import time
    from draftwise.machine import cached_measurement, machine_key

    def measure() -> str:
        x, w = torch.randn(256, 576), torch.randn(1536, 576)

        def best(dtype):
            xd, wd = x.to(dtype), w.to(dtype)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                (xd @ wd.t()).float()
                times.append(time.perf_counter() - t)
            return min(times)
        # bf16 only where clearly faster (AVX512_BF16 / AMX); fp32 keeps more precision otherwise
        return "bfloat16" if best(torch.bfloat16) < 0.7 * best(torch.float32) else "float32"
    return getattr(torch, cached_measurement("dense_gemm_dtype.json", machine_key(), measure))


class _QuantizedLinear(nn.Module):
    """Shared by the int8 / int4 linears: the quantized kernel up to MAX_KERNEL_ROWS rows on CPU,
    otherwise a dense GEMM over the weight dequantized for that call."""

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The dequantized [out, in] weight, fp32."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized [out, in] weight (for code that reads weights directly)."""
        return self.dequantize()

    max_kernel_rows = MAX_KERNEL_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] <= self.max_kernel_rows and x.device.type == "cpu":
            y = self._kernel(x2.to(torch.bfloat16)).to(x.dtype)
        else:
            dt = self.dense_dtype if x.device.type == "cpu" else torch.float32
            y = (x2.to(dt) @ self.dequantize().to(dt).t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


class Int8Linear(_QuantizedLinear):
    """Per-output-channel int8. Runs on draftwise's int8 kernel where `int4_kernel_choice()` measured
    it faster (flat in the row count: the LM head verifying 16 drafts costs what one row costs), else
    on PyTorch's `_weight_int8pack_mm`; one copy of the codes either way."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 backend: dict | None = None):
        super().__init__()
        self.dense_dtype = dense_gemm_dtype()      # decided here: never inside a traced forward
        self.out_features, self.in_features = q.shape
        backend = backend or {}
        fits = self.out_features % 16 == 0 and self.in_features % 32 == 0
        self.draftwise_kernel = backend.get("int8") == "draftwise" and fits
        self.draftwise_large = self.draftwise_kernel and backend.get("large") == "draftwise"
        if self.draftwise_kernel:
            from draftwise.kernels import amx, pack_int8
            self.use_amx = amx()
            self.register_buffer("kernel_q8", pack_int8(q.contiguous()))
            self.register_buffer("kernel_scale", scale.to(torch.bfloat16).float().contiguous())
        else:
            self.register_buffer("qweight", q.contiguous())
            self.register_buffer("scale", scale.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def dequantize(self) -> torch.Tensor:
        if self.draftwise_kernel:
            from draftwise.kernels import unpack_int8
            return unpack_int8(self.kernel_q8).float() * self.kernel_scale[:, None]
        return self.qweight.float() * self.scale.float()[:, None]

    def _kernel(self, x2):
        if self.draftwise_kernel:
            from draftwise.kernels import int8_linear
            return int8_linear(x2, self.kernel_q8, self.kernel_scale, self.use_amx)
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.draftwise_large and x.device.type == "cpu" and x.reshape(-1, x.shape[-1]).shape[0] > MAX_KERNEL_ROWS:
            shape = x.shape
            y = self._kernel(x.reshape(-1, shape[-1]).to(torch.bfloat16)).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
            return y.reshape(*shape[:-1], self.out_features)
        return super().forward(x)


class Int4Linear(_QuantizedLinear):
    """Group-wise int4 (w = codes * scale + minimum per group of 32 inputs). Small row counts run on
    the kernel `draftwise.kernels.int4_kernel_choice()` measured fastest on this machine: this
    package's weight-stationary AVX512-BF16 / AMX kernel (which then also serves prefill where it
    measured faster than a dense GEMM), or PyTorch's `_weight_int4pack_mm_for_cpu`. Either way
    one copy of the codes is kept, in that kernel's layout."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int = INT4_GROUP,
                 bias: torch.Tensor | None = None, backend: dict | None = None):
        super().__init__()
        N, K = codes.shape
        self.out_features, self.in_features, self.group = N, K, group
        self.dense_dtype = dense_gemm_dtype()
        if backend is None:
            backend = {"small": "aten", "large": "dense"}
        fits = group == INT4_GROUP and N % 16 == 0
        self.draftwise_kernel = backend["small"] == "draftwise" and fits      # rows up to MAX_KERNEL_ROWS
        self.draftwise_large = backend["large"] == "draftwise" and fits       # more rows (prefill)
        if self.draftwise_kernel or self.draftwise_large:
            from draftwise.kernels import amx, pack_int4
            self.use_amx = amx()
            nib, sm = pack_int4(codes, scale, minimum)
            self.register_buffer("kernel_nibbles", nib)
            self.register_buffer("kernel_sm", sm)
        if not self.draftwise_kernel:
            s = scale.to(torch.bfloat16)
            z = (minimum.float() + 8.0 * scale.float()).to(torch.bfloat16)          # w = (q - 8) s + z
            self.register_buffer("scales_and_zeros", torch.stack([s, z], -1).transpose(0, 1).contiguous())
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32).contiguous(), 1))
            if not self.draftwise_large:
                # the codes again, two per byte in our own layout (ATen's packing is private to its
                # kernel): what large-row GEMMs dequantize from
                c = codes.to(torch.uint8)
                self.register_buffer("nibbles", (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def dequantize(self) -> torch.Tensor:
        if self.draftwise_kernel or self.draftwise_large:
            from draftwise.kernels import unpack_int4
            return unpack_int4(self.kernel_nibbles, self.kernel_sm)
        N, K, g = self.out_features, self.in_features, self.group
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).reshape(N, K // g, g).float()
        s = self.scales_and_zeros[..., 0].t().float()[..., None]      # [N, K/g, 1]
        z = self.scales_and_zeros[..., 1].t().float()[..., None]
        return ((q - 8.0) * s + z).reshape(N, K)

    def _kernel(self, x2):
        if self.draftwise_kernel:
            from draftwise.kernels import int4_linear
            return int4_linear(x2, self.kernel_nibbles, self.kernel_sm, self.use_amx)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        many = x.device.type == "cpu" and x.reshape(-1, x.shape[-1]).shape[0] > MAX_KERNEL_ROWS
        if many and (self.draftwise_large or (self.draftwise_kernel and not torch.compiler.is_compiling())):
            # many rows: the exact kernel, or the kernel's dequantize + bf16 GEMM (whichever measured
            # faster here)
            from draftwise.kernels import dense_linear, int4_linear
            shape = x.shape
            x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
            if self.draftwise_large:
                y = int4_linear(x2, self.kernel_nibbles, self.kernel_sm, self.use_amx).to(x.dtype)
            else:
                y = dense_linear(x2, self.kernel_nibbles, self.kernel_sm).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
            return y.reshape(*shape[:-1], self.out_features)
        return super().forward(x)


def _linear_weight(mod: nn.Module) -> torch.Tensor:
    return mod.weight.detach()


def _linear_bias(mod: nn.Module):
    b = getattr(mod, "bias", None)
    return None if b is None else b.detach()


def quantize_model(model: nn.Module, mode: str, int4_source: dict | None = None,
                   skip: tuple[str, ...] = ()) -> dict:
    """Replace the linears of `model` (nn.Linear, or the engine's TransposedLinear) by quantized
    ones, in place. int4: every layer linear with group-wise int4 - from `int4_source[name] =
    (codes, scale, minimum)` when given (GGUF Q4_1 blocks, exact), else quantized from its weights
    - and the LM head per-channel int8 (it reads the embedding, which GGUF stores as Q8_0). int8:
    every linear per-channel int8. Returns {"exact": n, "quantized": n} counts."""
    from draftwise.layers.linear import TransposedLinear
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZATION_MODES)} or None")
    counts = {"exact": 0, "quantized": 0}
    int4_source = int4_source or {}
    backend = None
    if next(model.parameters(), torch.empty(0)).device.type == "cpu":
        from draftwise.kernels import int4_kernel_choice
        backend = int4_kernel_choice()
    for name, child in list(model.named_modules()):
        for cname, sub in list(child.named_children()):
            full = f"{name}.{cname}" if name else cname
            if not isinstance(sub, (nn.Linear, TransposedLinear)) or any(full.startswith(s) for s in skip):
                continue
            w, b = _linear_weight(sub), _linear_bias(sub)
            if mode == "int4" and full != "lm_head" and w.shape[1] % INT4_GROUP == 0:
                if full in int4_source:
                    codes, scale, mn = int4_source[full]
                    counts["exact"] += 1
                else:
                    codes, scale, mn = quantize_int4_groupwise(w)
                    counts["quantized"] += 1
                new = Int4Linear(codes, scale, mn, INT4_GROUP, b, backend=backend)
            else:
                q, s = quantize_int8_per_channel(w)
                new = Int8Linear(q, s, b, backend=backend)
                counts["quantized"] += 1
            setattr(child, cname, new)
    return counts


class Q8Embedding(nn.Module):
    """A token embedding kept as GGUF Q8_0 blocks (int8 codes, one fp16 scale per 32 columns): a
    lookup dequantizes only the rows it reads. `codes * scale` in fp32 is exact (an 11-bit
    mantissa times an 8-bit integer), so rows equal those of the dense fp32 table converted from
    the same blocks, at a quarter of its memory."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        V, H = codes.shape
        if H % scale.shape[1] or H // scale.shape[1] != 32 or scale.shape[0] != V:
            raise ValueError(f"Q8_0 embedding: codes {tuple(codes.shape)} and scales {tuple(scale.shape)} "
                             "do not match blocks of 32")
        self.num_embeddings, self.embedding_dim, self.dtype = V, H, dtype
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(torch.float16).contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes[ids].float().unflatten(-1, (-1, 32)) * self.scale[ids].float().unsqueeze(-1)
        return rows.flatten(-2).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.forward(torch.arange(self.num_embeddings, device=self.codes.device))
