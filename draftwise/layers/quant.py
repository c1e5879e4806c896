"""Weight-only quantized linears (`quantization="int8" | "int4"`).

On CPU every row count - decode, verification, drafting, prefill chunks of any length, a batch of
any size - runs one kernel, so a row's numbers never depend on the rows beside it (plain decoding,
speculation, prefix-cache hits and any chunking of a prompt agree bit for bit):

- draftwise's kernels (`draftwise.kernels`, chosen by instruction set: AMX / AVX512-BF16 / AVX2):
  a weight-stationary int4 linear over GGUF Q4_1 blocks (w = d * q + m per 32 inputs, d and m kept
  in fp16: exact) and an int8 linear with one scale per output channel;
- where none runs (`DRAFTWISE_ISA=none`, no compiler, another architecture): PyTorch's
  `aten._weight_int4pack_mm_for_cpu(x_bf16, packed, 32, scales_and_zeros_bf16 [K/32, N, 2])` with
  w = (q - 8) * scale + zero (a Q4_1 block is scale = d, zero = m + 8 d, rounded to bf16) and
  `aten._weight_int8pack_mm(x_bf16, w_int8 [N, K], scale_bf16 [N])` - each computes a row the same
  way whatever the row count.

Activations enter the kernels in bf16. On other devices the weight is dequantized for each call and
multiplied in fp32 (the CPU kernels' packing is CPU-only).
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch import nn

from draftwise.layers.quant_formats import INT4_GROUP, quantize_int4_groupwise, quantize_int8_per_channel  # noqa: F401
from draftwise.config import REQUANTIZE_TYPES
from draftwise.formats import block_format, decode
from draftwise.kernels import (affine_linear, amx, high_bits_for, int4_linear, int8_linear, load, pack_affine,
                               pack_int4, pack_int8, unpack_affine, unpack_int4, unpack_int8)
from draftwise.layers.linear import TransposedLinear

logger = logging.getLogger("draftwise")

QUANTIZATION_MODES = ("int8", "int4")      # re-quantization; "gguf" models are built by the loader


def _draftwise_kernels() -> bool:
    return load() is not None


class _QuantizedLinear(nn.Module):
    """Shared by the int8 / int4 linears: the CPU kernel for every row count, elsewhere a dense fp32
    GEMM over the weight dequantized for the call."""

    def _kernel(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The dequantized [out, in] weight, fp32."""
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized [out, in] weight (for code that reads weights directly)."""
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x.device.type == "cpu":
            y = self._kernel(x2.to(torch.bfloat16)).to(x.dtype)
        else:
            y = (x2.float() @ self.dequantize().to(x.device).t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


class Int8Linear(_QuantizedLinear):
    """Per-output-channel int8 on draftwise's int8 kernel (flat in the row count: the LM head
    verifying 16 drafts costs about what one row costs), else on PyTorch's `_weight_int8pack_mm`;
    one copy of the codes either way."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        fits = self.out_features % 16 == 0 and self.in_features % 32 == 0
        self.draftwise_kernel = fits and _draftwise_kernels()
        if self.draftwise_kernel:
            self.use_amx = amx()
            self.register_buffer("kernel_q8", pack_int8(q.contiguous()))
            self.register_buffer("kernel_scale", scale.to(torch.bfloat16).float().contiguous())
        else:
            self.register_buffer("qweight", q.contiguous())
            self.register_buffer("scale", scale.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def dequantize(self) -> torch.Tensor:
        if self.draftwise_kernel:
            return unpack_int8(self.kernel_q8).float() * self.kernel_scale[:, None]
        return self.qweight.float() * self.scale.float()[:, None]

    def _kernel(self, x2):
        if self.draftwise_kernel:
            return int8_linear(x2, self.kernel_q8, self.kernel_scale, self.use_amx)
        return torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)


class Int4Linear(_QuantizedLinear):
    """Group-wise int4 (w = codes * scale + minimum per group of 32 inputs) on draftwise's
    weight-stationary kernel for this CPU's instruction set, else on PyTorch's
    `_weight_int4pack_mm_for_cpu`; one copy of the codes, in that kernel's layout."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int = INT4_GROUP,
                 bias: torch.Tensor | None = None):
        super().__init__()
        N, K = codes.shape
        self.out_features, self.in_features, self.group = N, K, group
        self.draftwise_kernel = group == INT4_GROUP and N % 16 == 0 and _draftwise_kernels()
        if self.draftwise_kernel:
            self.use_amx = amx()
            nib, sm = pack_int4(codes, scale, minimum)
            self.register_buffer("kernel_nibbles", nib)
            self.register_buffer("kernel_sm", sm)
        else:
            s = scale.to(torch.bfloat16)
            z = (minimum.float() + 8.0 * scale.float()).to(torch.bfloat16)          # w = (q - 8) s + z
            self.register_buffer("scales_and_zeros", torch.stack([s, z], -1).transpose(0, 1).contiguous())
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32).contiguous(), 1))
            # the codes again, two per byte in our own layout (ATen's packing is private to its
            # kernel): what dequantize() reads
            c = codes.to(torch.uint8)
            self.register_buffer("nibbles", (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def dequantize(self) -> torch.Tensor:
        if self.draftwise_kernel:
            return unpack_int4(self.kernel_nibbles, self.kernel_sm)
        N, K, g = self.out_features, self.in_features, self.group
        q = torch.stack([self.nibbles & 15, self.nibbles >> 4], -1).reshape(N, K // g, g).float()
        s = self.scales_and_zeros[..., 0].t().float()[..., None]      # [N, K/g, 1]
        z = self.scales_and_zeros[..., 1].t().float()[..., None]
        return ((q - 8.0) * s + z).reshape(N, K)

    def _kernel(self, x2):
        if self.draftwise_kernel:
            return int4_linear(x2, self.kernel_nibbles, self.kernel_sm, self.use_amx)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_and_zeros)


def _linear_weight(mod: nn.Module) -> torch.Tensor:
    return mod.weight.detach()


def _linear_bias(mod: nn.Module):
    b = getattr(mod, "bias", None)
    return None if b is None else b.detach()


def quantize_model(model: nn.Module, mode: str, source=None,
                   skip: tuple[str, ...] = ()) -> dict:
    """Replace the linears of `model` (nn.Linear, or the engine's TransposedLinear) by quantized
    ones, in place (a GGUF run on its own blocks, "gguf", is built that way by
    models/loader.load_gguf_target, with exact_linear below).
    - "int4": every layer linear group-wise int4 - the file's own blocks where `source` holds them
      as Q4_1 / Q4_0, else quantized from its weights (the Q4_1 recipe) - and the LM head per-channel
      int8. `source`: module name -> GroupAffine parts, a dict or a GGUF file's blocks (GGUFBlocks).
    - "int8": every linear per-channel int8.
    Returns {"exact": n, "quantized": n} counts."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZATION_MODES)} or None")
    counts = {"exact": 0, "quantized": 0}
    source = source or {}
    for name, child in list(model.named_modules()):
        for cname, sub in list(child.named_children()):
            full = f"{name}.{cname}" if name else cname
            if not isinstance(sub, (nn.Linear, TransposedLinear)) or any(full.startswith(s) for s in skip):
                continue
            w, b = _linear_weight(sub), _linear_bias(sub)
            if mode == "int4" and full != "lm_head" and w.shape[1] % INT4_GROUP == 0:
                exact = as_q4_1(source.get(full)) if full in source else None
                new = Int4Linear(*(exact or quantize_int4_groupwise(w)), INT4_GROUP, b)
                counts["exact" if exact else "quantized"] += 1
            else:
                q, s = quantize_int8_per_channel(w)
                new = Int8Linear(q, s, b)
                counts["quantized"] += 1
            setattr(child, cname, new)
    return counts


def requantize_linears(model: nn.Module, kind: str, cache: str | None = None) -> int:
    """Re-quantize every linear of `model` (quantized or dense) to the GGUF block type `kind` with
    llama.cpp's reference quantizer (`gguf.quants`), run by the same kernels as a file's own blocks.
    For a draft model, whose weights only propose tokens: a smaller type reads faster, and the
    target's verification keeps outputs unchanged. Linears whose input size does not split into
    the type's blocks stay as they are. `cache`: a safetensors file of the blocks by module name -
    read where it has them (the quantizer is deterministic, so they are the bytes it would make;
    numpy's quantizer takes ~10 s for a 0.5B model at every start otherwise), written when any had
    to be made. Returns the number re-quantized."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    if kind not in REQUANTIZE_TYPES:
        raise ValueError(f"cannot re-quantize to {kind!r}; choose one of {', '.join(REQUANTIZE_TYPES)}")
    fmt = block_format(kind)
    stored, made, done = _read_blocks(cache), {}, 0
    for name, child in list(model.named_modules()):
        for cname, sub in list(child.named_children()):
            if not isinstance(sub, (nn.Linear, _QuantizedLinear)):
                continue
            shape = (sub.out_features, sub.in_features)
            if shape[1] % fmt.block_size or shape[0] % 16:
                continue
            full = f"{name}.{cname}" if name else cname
            raw = stored.get(full)
            if raw is None or raw.shape != (shape[0], shape[1] // fmt.block_size * fmt.type_size):
                w = (sub.dequantize() if isinstance(sub, _QuantizedLinear) else sub.weight).detach().float()
                raw = made[full] = quantize(w.numpy(), GGMLQuantizationType[kind])
            setattr(child, cname, exact_linear([decode(kind, raw, shape)], _linear_bias(sub), full))
            done += 1
    if cache is not None and made:
        _write_blocks(cache, {**stored, **made})
    return done


def _read_blocks(path: str | None) -> dict:
    """The re-quantized blocks stored at `path`, by module name; none where it is absent or unreadable."""
    if path is None or not os.path.exists(path):
        return {}
    from safetensors.numpy import load_file
    try:
        return load_file(path)
    except Exception as e:     # noqa: BLE001 - a cut or foreign file: quantize again and replace it
        logger.warning("re-quantized weights in %s could not be read (%s); quantizing again", path, e)
        return {}


def _write_blocks(path: str, blocks: dict) -> None:
    """`blocks` into a safetensors file at `path`, whole or not at all (written aside, then renamed)."""
    from safetensors.numpy import save_file
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        save_file(blocks, tmp)
        os.replace(tmp, path)
    except OSError as e:       # a full or read-only disk costs the next start the quantizer, nothing more
        logger.warning("re-quantized weights not cached in %s (%s)", path, e)
        with contextlib.suppress(OSError):
            os.remove(tmp)


def exact_linear(parts, bias, name: str) -> nn.Module:
    """A GGUF linear on its own blocks: every family group-affine on the int8-activation kernels
    (the weights exact, activations quantized per 32 inputs as llama.cpp does); on AMX machines
    Q4_1 / Q4_0 layer weights run on the int4 AMX-BF16 kernels instead (tile products ~8x the
    prefill throughput of VNNI there, bf16 activations)."""
    q4 = as_q4_1(parts) if name != "lm_head" and _draftwise_kernels() and amx() else None
    if q4 is not None:
        return Int4Linear(*q4, INT4_GROUP, bias)
    return GroupAffineLinear(parts, bias)


def as_q4_1(parts):
    """(codes, scale, minimum) of a weight the int4 kernels hold exactly - 4-bit codes in groups of
    32 with fp16-exact scales and minimums (Q4_1; Q4_0 as minimum -8 d, exact) - else None."""
    if len(parts) != 1:
        return None
    p = parts[0]
    if p.bits != 4 or p.group != INT4_GROUP or p.codes.shape[0] % 16:
        return None
    if p.minimum is None and p.offset == 8:
        minimum = -8.0 * p.scale
    elif p.minimum is not None and p.offset == 0:
        minimum = p.minimum
    else:
        return None
    exact = lambda t: bool(torch.equal(t.half().float(), t))  # noqa: E731
    return (p.codes, p.scale, minimum) if exact(p.scale) and exact(minimum) else None


class GroupAffineLinear(_QuantizedLinear):
    """A linear on a GGUF tensor's own blocks, any family (draftwise/formats): its row parts (one,
    or several where a fused projection mixes block kinds) in the affine kernel's layout, each run
    by draftwise's group-affine kernel and the outputs joined. Where no kernel runs (DRAFTWISE_ISA=
    none, another architecture) every row is multiplied alone against the weight dequantized in
    chunks of output columns: slow, exact, and the same for every row count."""

    FALLBACK_CHUNK = 1024      # output columns dequantized at a time by the fallback

    def __init__(self, parts, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features = sum(p.codes.shape[0] for p in parts)
        self.in_features = parts[0].codes.shape[1]
        if any(p.codes.shape[0] % 16 for p in parts):
            raise ValueError("group-affine linears need output sizes that are multiples of 16")
        self.draftwise_kernel = _draftwise_kernels()
        self.high_bits = high_bits_for()        # packed for the ISA that runs it
        self.meta = []
        for i, p in enumerate(parts):
            packed, scale, minimum, offset = pack_affine(p.codes, p.scale, p.minimum, p.group, p.bits, p.offset,
                                                         p.factors, self.high_bits)
            self.meta.append((p.group, offset))
            self.register_buffer(f"codes{i}", packed)
            self.register_buffer(f"scale{i}", scale)
            self.register_buffer(f"minimum{i}", minimum)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def packed_parts(self):
        """(codes, scale, minimum, group, offset, high_bits) of each row part: affine_linear's arguments."""
        return [(getattr(self, f"codes{i}"), getattr(self, f"scale{i}"), getattr(self, f"minimum{i}"), g, off,
                 self.high_bits) for i, (g, off) in enumerate(self.meta)]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([unpack_affine(*part) for part in self.packed_parts()], 0)

    def _kernel(self, x2):
        if self.draftwise_kernel:
            ys = [affine_linear(x2, *part) for part in self.packed_parts()]
            return ys[0] if len(ys) == 1 else torch.cat(ys, 1)
        x = x2.float()
        y = x.new_empty(x.shape[0], self.out_features)
        col = 0
        for codes, scale, minimum, g, off, high_bits in self.packed_parts():
            blocks = self.FALLBACK_CHUNK // 16
            for b0 in range(0, codes.shape[0], blocks):
                part = (codes[b0:b0 + blocks], scale[b0:b0 + blocks],
                        minimum[b0:b0 + blocks] if minimum.numel() else minimum, g, off, high_bits)
                w = unpack_affine(*part)
                for r in range(x.shape[0]):
                    y[r, col:col + w.shape[0]] = torch.mv(w, x[r])
                col += w.shape[0]
        return y


class GroupAffineEmbedding(nn.Module):
    """A token embedding kept in the GGUF's own blocks (any family): a lookup dequantizes only the
    rows it reads, exactly as the dense table converted from the same blocks would hold them. 4- and
    5-bit codes are stored two to a byte (5-bit: plus a plane of high bits, eight to a byte), so a
    150k-token table costs about what its file does."""

    def __init__(self, weight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.codes.shape
        self.dtype, self.group, self.offset, self.bits = dtype, weight.group, weight.offset, weight.bits
        c = weight.codes
        if self.bits in (4, 5):
            V, H = c.shape
            packed = torch.empty(V, H // 2, dtype=torch.uint8)
            high = torch.empty(V, H // 8, dtype=torch.uint8) if self.bits == 5 else None
            for r in range(0, V, 8192):            # in slices of rows: small temporaries beside a large table
                rows = c[r:r + 8192]
                packed[r:r + 8192] = (rows[:, 0::2] & 15) | ((rows[:, 1::2] & 15) << 4)
                if high is not None:
                    h = (rows >> 4).reshape(rows.shape[0], -1, 8).to(torch.int32) << torch.arange(8, dtype=torch.int32)
                    high[r:r + 8192] = h.sum(-1).to(torch.uint8)
            self.register_buffer("codes", packed)
            self.register_buffer("high", high)
        else:
            self.register_buffer("codes", c.contiguous())
            self.register_buffer("high", None)
        exact16 = all(t is None or bool(torch.equal(t.half().float(), t)) for t in (weight.scale, weight.minimum))
        sdt = torch.float16 if exact16 else torch.float32
        self.register_buffer("scale", weight.scale.to(sdt).contiguous())
        self.register_buffer("minimum", None if weight.minimum is None else weight.minimum.to(sdt).contiguous())

    def _codes(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.codes[ids]
        if self.bits == 8:
            return c.float()
        full = torch.stack([c & 15, c >> 4], -1).flatten(-2)
        if self.high is not None:
            bits = (self.high[ids].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
            full = full | (bits.flatten(-2) << 4)
        return full.float()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        c = (self._codes(ids) - self.offset).unflatten(-1, (-1, self.group))
        w = c * self.scale[ids].float().unsqueeze(-1)
        if self.minimum is not None:
            w = w + self.minimum[ids].float().unsqueeze(-1)
        return w.flatten(-2).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.forward(torch.arange(self.num_embeddings, device=self.codes.device))
