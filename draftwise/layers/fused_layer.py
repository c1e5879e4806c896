"""A Llama-family decoder layer on quantized weights in two C++ calls around attention.

Eagerly, a decoder layer is ~55 small PyTorch operations (RMSNorm in five, a bf16 cast before each
quantized linear, RoPE in seven per tensor, SiLU-and-mul, residual adds); on a 135M-parameter model
at one token per step their dispatch costs about as much as the matmuls themselves. Where every
linear of a layer runs on draftwise's kernels - int4 (Q4_1 / Q4_0 blocks) or group-affine (every
other GGUF family), biases included (Qwen2) - the layer runs as

    q = attn_in(x)                             RMSNorm -> bf16 -> qkv (+ bias) -> RoPE, K/V into the cache
    o = attend_cached(q)                       the paged attention of the eager path
    x = attn_out_mlp(x, o)                     o_proj + residual -> RMSNorm -> gate/up -> SiLU * up
                                               -> down + residual

(`draftwise/kernels/cpu/layer.h`, on every ISA's kernels; each linear is a kernel-side `Linear`
holding its parts and bias). Every row is computed alone in a fixed order, as the kernels and the
row-invariant attention are, so a token's values do not depend on how many rows share the step -
decode, verification, drafting and prefill chunks of any length alike: speculation stays bit-exact
with plain decoding, and a prompt's K/V do not depend on how it was chunked. The RoPE cos / sin rows
of a step are looked up once for all layers. Families beyond Llama's shape pass their extra parts
(`LayerExtras`): q/k norms (Qwen3, Gemma 3), norms on the attention and MLP outputs, GELU, and
Gemma 3's sliding-window layers (their own RoPE rows and row plan)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from draftwise.kernels import HIGH_BITS, attention_kernel_fits, load, row_plan_args
from draftwise.layers.attention import attend_cached
from draftwise.layers.quant import GroupAffineLinear, Int4Linear


@dataclass
class FusedLayerWeights:
    """A decoder layer's linears as the kernels' `Linear` objects (sharing their modules' tensors),
    its two main norms, and its extra parts (`LayerExtras`) and sliding window (0: none)."""
    qkv: object
    o: object
    gate_up: object
    down: object
    in_norm: object = None
    mlp_norm: object = None
    extras: object = None
    window: int = 0


def kernel_linear(mod):
    """The kernel module's `Linear` for a quantized linear running on draftwise's kernels, else None."""
    if not getattr(mod, "draftwise_kernel", False):
        return None
    bias = mod.bias if mod.bias is not None else torch.empty(0)
    if isinstance(mod, Int4Linear):
        return load().Linear([True], [mod.kernel_nibbles], [mod.kernel_sm], [torch.empty(0)], [32], [0], [0], bias,
                             mod.use_amx)
    if isinstance(mod, GroupAffineLinear):
        parts = mod.packed_parts()
        return load().Linear([False] * len(parts), [p[0] for p in parts], [p[1] for p in parts],
                             [p[2] for p in parts], [p[3] for p in parts], [p[4] for p in parts],
                             [HIGH_BITS.index(p[5]) for p in parts], bias, False)
    return None


def fusable(layer) -> FusedLayerWeights | None:
    """The kernel linears, norms and extra parts of `layer` (a Llama-family or Gemma 3 decoder layer)
    when all its linears run on draftwise's kernels; else None."""
    attn, mlp = layer.self_attn, layer.mlp
    if attn.head_dim % 2:
        return None
    lins = [kernel_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(lin is None for lin in lins):
        return None
    none = torch.empty(0)
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    weight = lambda norm: norm.weight.detach().float().contiguous()  # noqa: E731
    extras = load().LayerExtras(
        weight(attn.q_norm) if attn.qk_norm else none, weight(attn.k_norm) if attn.qk_norm else none,
        weight(layer.post_attention_layernorm) if gemma else none,
        weight(layer.post_feedforward_layernorm) if gemma else none, gemma)
    mlp_norm = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
    return FusedLayerWeights(*lins, weight(layer.input_layernorm), weight(mlp_norm), extras,
                             getattr(attn, "window", 0))


def enable_fused_layers(model) -> int:
    """Give every fusable decoder layer of a Llama-family model its FusedLayerWeights (all or none,
    so a step runs one path); returns the number of fused layers."""
    if load() is None:
        return 0
    weights = [fusable(layer) for layer in model.layers]
    if not weights or any(w is None for w in weights):
        return 0
    for layer, w in zip(model.layers, weights):
        layer.fused = w
    return len(weights)


def fused_rope_rows(model, positions: torch.Tensor, x: torch.Tensor, meta):
    """(cos, sin, cos_local, sin_local) rows [T, D] for the step when its layers run fused (eager
    steps on the CPU), else None; the local pair is the sliding-window layers' (Gemma 3), else the
    same tables."""
    w = getattr(model.layers[0], "fused", None) if len(model.layers) else None
    if w is None or meta is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    cos, sin = model.rotary.cos[positions].contiguous(), model.rotary.sin[positions].contiguous()
    local = getattr(model, "rotary_local", None)
    if local is None:
        return cos, sin, cos, sin
    return cos, sin, local.cos[positions].contiguous(), local.sin[positions].contiguous()


def fused_layer_forward(layer, x: torch.Tensor, rope_rows, meta, kv_cache) -> torch.Tensor:
    """One layer: attn_in -> attention over the cache -> attn_out_mlp."""
    mod, w, attn = load(), layer.fused, layer.self_attn
    T, D = x.shape[0], attn.head_dim
    cos, sin = rope_rows[2:] if w.window else rope_rows[:2]
    k_cache, v_cache = kv_cache.layer(attn.layer_idx)
    x = x.contiguous()
    eps = layer.input_layernorm.eps
    with _label("draftwise::attn_in"):
        q = mod.attn_in(x, w.in_norm, eps, w.qkv, cos, sin, attn.num_heads, attn.num_kv_heads, D, meta.slot_mapping,
                        k_cache, v_cache, w.extras)
    o = attend_cached(q.view(T, attn.num_heads, D), k_cache, v_cache, meta, attn.scale,
                      w.window).reshape(T, attn.q_size)
    with _label("draftwise::attn_out_mlp"):
        return mod.attn_out_mlp(x, o.contiguous(), w.o, w.mlp_norm, eps, w.gate_up, w.down, w.extras)


def fused_stack_forward(model, x: torch.Tensor, rope_rows, meta, kv_cache, capture: tuple[int, ...]):
    """Every layer of a step in one C++ call where all its rows attend row by row (decode, chain and
    tree verification: meta.row_plan covers the step) - the per-layer path's calls in the same
    order, without ~40 us of Python per layer. Returns (x after the stack, {layer: x before it} for
    `capture`), or None where the step needs the per-layer path (DFlash blocks, tree drafting)."""
    if meta.groups or not meta.row_plan:
        return None
    args = row_plan_args(meta.row_plan)
    if args is None:
        return None
    stack, window = _stack(model, kv_cache)
    if stack is None:
        return None
    plan = load().RowPlan(*args)
    local = plan if not window else load().RowPlan(*row_plan_args(meta.window_plan(window)))
    order = sorted(capture)
    outs = stack.run(x.contiguous(), *rope_rows, meta.slot_mapping, plan, local, order)
    return outs[0], dict(zip(order, outs[1:]))


def _stack(model, kv_cache):
    """(the model's FusedStack over this KV cache, or None where the attention kernel does not take
    this model's shapes; its sliding window, 0 for none): built once, rebuilt if the cache is
    replaced."""
    layers = model.layers
    k0 = kv_cache.layer(layers[0].self_attn.layer_idx)[0]      # a drafter's layers sit past the target's
    key = (id(kv_cache), k0.data_ptr(), k0.dtype)
    cached = getattr(model, "_fused_stack", None)
    if cached is not None and cached[0] == key:
        return cached[1:]
    kv = [kv_cache.layer(layer.self_attn.layer_idx) for layer in layers]
    attn = layers[0].self_attn
    stack = None
    if attention_kernel_fits(attn.head_dim, attn.num_heads // attn.num_kv_heads, k0):
        w = [layer.fused for layer in layers]
        stack = load().FusedStack(
            [f.qkv for f in w], [f.o for f in w], [f.gate_up for f in w], [f.down for f in w],
            [f.in_norm for f in w], [f.mlp_norm for f in w],
            [k for k, _ in kv], [v for _, v in kv],
            [f.extras for f in w], [bool(f.window) for f in w],
            float(layers[0].input_layernorm.eps), attn.num_heads, attn.num_kv_heads, attn.head_dim, float(attn.scale))
    windows = {layer.fused.window for layer in layers} - {0}
    model._fused_stack = (key, stack, windows.pop() if windows else 0)
    return model._fused_stack[1:]


def _label(name: str):
    """A profiler label for a C++ call (`draftwise bench step-cost` splits a step by them); free
    when no profiler runs."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
