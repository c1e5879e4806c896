"""A Llama decoder layer on int4 weights in two C++ calls around attention.

Eagerly, a decoder layer is ~55 small PyTorch operations (RMSNorm in five, a bf16 cast before each
int4 linear, RoPE in seven per tensor, SiLU-and-mul, residual adds); on a 135M-parameter model at
one token per step their dispatch costs about as much as the int4 matmuls themselves. Where every
linear of a layer runs on draftwise's int4 kernel, the layer runs as

    q = attn_in(x)                             RMSNorm -> bf16 -> qkv (int4) -> RoPE, K/V into the cache
    o = attend_cached(q)                       the paged attention of the eager path
    x = attn_out_mlp(x, o)                     o_proj + residual -> RMSNorm -> gate/up -> SiLU * up
                                               -> down + residual

(`draftwise/kernels/cpu/layer.h`, on every ISA's kernels). Every row is computed alone in a fixed
order, as the int4 kernel and the row-invariant attention are, so a token's values do not depend on
how many rows share the step - decode, verification, drafting and prefill chunks of any length
alike: speculation stays bit-exact with plain decoding, and a prompt's K/V do not depend on how it
was chunked. The RoPE cos / sin rows of a step are looked up once for all layers. Qwen3's q/k norms
and attention biases keep the eager path."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class FusedLayerWeights:
    """A decoder layer's int4 weights in the kernel's packed layout (shared with its Int4Linears)."""
    qkv: tuple[torch.Tensor, torch.Tensor]       # (nibbles, scales/minimums)
    o: tuple[torch.Tensor, torch.Tensor]
    gate_up: tuple[torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor]
    use_amx: bool


def fusable(layer) -> FusedLayerWeights | None:
    """The packed weights of `layer` (a Llama DecoderLayer) when all its linears run on draftwise's
    int4 kernel without biases and it has no q/k norm; else None."""
    from draftwise.layers.quant import Int4Linear
    attn, mlp = layer.self_attn, layer.mlp
    lins = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    if attn.qk_norm or not all(isinstance(m, Int4Linear) and m.draftwise_kernel and m.bias is None for m in lins):
        return None
    if len({m.use_amx for m in lins}) != 1 or attn.head_dim % 2:
        return None
    packed = [(m.kernel_nibbles, m.kernel_sm) for m in lins]
    return FusedLayerWeights(*packed, lins[0].use_amx)


def enable_fused_layers(model) -> int:
    """Give every fusable decoder layer of a Llama-family model its FusedLayerWeights (all or none,
    so a step runs one path); returns the number of fused layers."""
    from draftwise.kernels import load
    if load() is None:
        return 0
    weights = [fusable(layer) for layer in model.layers]
    if not weights or any(w is None for w in weights):
        return 0
    for layer, w in zip(model.layers, weights):
        layer.fused = w
    return len(weights)


def fused_rope_rows(model, positions: torch.Tensor, x: torch.Tensor, meta):
    """(cos, sin) rows [T, D] for the step when its layers run fused (eager steps on the CPU), else
    None."""
    w = getattr(model.layers[0], "fused", None) if len(model.layers) else None
    if w is None or meta is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return model.rotary.cos[positions].contiguous(), model.rotary.sin[positions].contiguous()


def fused_layer_forward(layer, x: torch.Tensor, rope_rows, meta, kv_cache) -> torch.Tensor:
    """One layer: attn_in -> attention over the cache -> attn_out_mlp."""
    from draftwise.kernels import load
    from draftwise.layers.attention import attend_cached
    mod, w, attn = load(), layer.fused, layer.self_attn
    T, D = x.shape[0], attn.head_dim
    cos, sin = rope_rows
    k_cache, v_cache = kv_cache.layer(attn.layer_idx)
    x = x.contiguous()
    with _label("draftwise::attn_in"):
        q = mod.attn_in(x, layer.input_layernorm.weight, layer.input_layernorm.eps, *w.qkv, w.use_amx, cos, sin,
                        attn.num_heads, attn.num_kv_heads, D, meta.slot_mapping, k_cache, v_cache)
    o = attend_cached(q.view(T, attn.num_heads, D), k_cache, v_cache, meta, attn.scale).reshape(T, attn.q_size)
    with _label("draftwise::attn_out_mlp"):
        return mod.attn_out_mlp(x, o.contiguous(), *w.o, layer.post_attention_layernorm.weight,
                                layer.post_attention_layernorm.eps, *w.gate_up, *w.down, w.use_amx)


def fused_stack_forward(model, x: torch.Tensor, rope_rows, meta, kv_cache, capture: tuple[int, ...]):
    """Every layer of a step in one C++ call where all its rows attend row by row (decode, chain and
    tree verification: meta.row_plan covers the step) - the per-layer path's calls in the same
    order, without ~40 us of Python per layer. Returns (x after the stack, {layer: x before it} for
    `capture`), or None where the step needs the per-layer path (DFlash blocks, tree drafting)."""
    from draftwise.kernels import row_plan_args
    if meta.groups or not meta.row_plan:
        return None
    args = row_plan_args(meta.row_plan)
    if args is None:
        return None
    stack = _stack(model, kv_cache)
    if stack is None:
        return None
    cos, sin = rope_rows
    order = sorted(capture)
    outs = stack.run(x.contiguous(), cos, sin, meta.slot_mapping, *args, order)
    return outs[0], dict(zip(order, outs[1:]))


def _stack(model, kv_cache):
    """The model's FusedStack over this KV cache (built once; rebuilt if the cache is replaced), or
    None where the attention kernel does not take this model's shapes."""
    from draftwise.kernels import attention_kernel_fits, load
    k0 = kv_cache.layer(0)[0]
    key = (id(kv_cache), k0.data_ptr(), k0.dtype)
    cached = getattr(model, "_fused_stack", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    layers = model.layers
    attn = layers[0].self_attn
    stack = None
    if (attention_kernel_fits(attn.head_dim, attn.num_heads // attn.num_kv_heads, k0)
            and len({layer.fused.use_amx for layer in layers}) == 1):
        w = [layer.fused for layer in layers]
        stack = load().FusedStack(
            [f.qkv[0] for f in w], [f.qkv[1] for f in w], [f.o[0] for f in w], [f.o[1] for f in w],
            [f.gate_up[0] for f in w], [f.gate_up[1] for f in w], [f.down[0] for f in w], [f.down[1] for f in w],
            [layer.input_layernorm.weight for layer in layers], [layer.post_attention_layernorm.weight for layer in layers],
            [kv_cache.layer(i)[0] for i in range(len(layers))], [kv_cache.layer(i)[1] for i in range(len(layers))],
            float(layers[0].input_layernorm.eps), w[0].use_amx, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            float(attn.scale))
    model._fused_stack = (key, stack)
    return stack


def _label(name: str):
    """A profiler label for a C++ call (`draftwise bench step-cost` splits a step by them); free
    when no profiler runs."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
