"""Llama-family target model (SmolLM2, Llama-3.x) written for the paged engine.

Q/K/V and gate/up projections are fused into single matmuls. The model captures auxiliary hidden
states (the residual stream *entering* chosen layers) for EAGLE-3 / DFlash drafters and computes
logits only at requested rows (`logits_indices`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.config import ModelConfig
from draftwise.layers.attention import AttentionMetadata, attend
from draftwise.layers.fused_layer import fused_layer_forward, fused_rope_rows, fused_stack_forward
from draftwise.layers.norm import RMSNorm
from draftwise.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, input_size: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(input_size or cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.layer_idx = layer_idx          # index of this layer's K/V in the shared cache
        self.scale = self.head_dim ** -0.5

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache, rotary: RotaryEmbedding):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        o = attend(q, k, v, self.layer_idx, self.scale, meta, kv_cache)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.fused = None          # FusedLayerWeights when the layer runs fused (layers/fused_layer.py)

    def forward(self, x, positions, meta, kv_cache, rotary, rope_rows=None):
        if rope_rows is not None:                    # int4 weights on draftwise's kernel: two C++ calls
            return fused_layer_forward(self, x, rope_rows, meta, kv_cache)
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, kv_cache, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class TargetOutput:
    hidden_states: torch.Tensor               # [T, H] final-norm hidden states
    aux_hidden_states: torch.Tensor | None    # [T, k*H] residual entering the aux layers
    logits: torch.Tensor | None               # [len(logits_indices), V]


# Hugging Face parameter name (after stripping "model.") -> (our name, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def load_stacked_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         strip_prefixes: tuple[str, ...] = ("model.",), strict: bool = True,
                         rename=None) -> set[str]:
    """Copy Hugging Face-named tensors into a module whose q/k/v and gate/up are fused.
    Returns the set of parameter names that were loaded."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        for p in strip_prefixes:
            if name.startswith(p):
                name = name[len(p):]
                break
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
        parts = name.split(".")
        shard = None
        for i, part in enumerate(parts):
            if part in _STACKED:
                fused, shard = _STACKED[part]
                parts[i] = fused
                break
        target = ".".join(parts)
        if target not in params:
            if strict:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            continue
        p = params[target]
        with torch.no_grad():
            if shard is None:
                if tuple(p.shape) != tuple(tensor.shape):
                    raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} "
                                     f"vs model {tuple(p.shape)}")
                p.copy_(tensor)
            else:
                sizes = _shard_sizes(module, target)
                off = sum(sizes[:shard])
                if tensor.shape[0] != sizes[shard] or tensor.shape[1:] != p.shape[1:]:
                    raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                                     f"expected ({sizes[shard]}, {tuple(p.shape[1:])})")
                p[off:off + sizes[shard]].copy_(tensor)
        loaded.add(target if shard is None else f"{target}#{shard}")
    return loaded


def require_all_loaded(module: nn.Module, loaded: set[str], what: str, skip_prefix: str | None = None) -> None:
    """Raise if a parameter (or one shard of a fused q/k/v or gate/up parameter) was not loaded."""
    missing = []
    for name, _ in module.named_parameters():
        if skip_prefix and name.startswith(skip_prefix):
            continue
        if name in loaded:
            continue
        shards = [n for n in loaded if n.startswith(name + "#")]
        if not shards or len(shards) != len(_shard_sizes(module, name)):
            missing.append(name)
    if missing:
        raise ValueError(f"{what} is missing tensors for {sorted(missing)[:8]}")


def _shard_sizes(module: nn.Module, param_name: str) -> list[int]:
    owner = module.get_submodule(param_name.rsplit(".", 2)[0])
    if isinstance(owner, Attention):
        return [owner.q_size, owner.kv_size, owner.kv_size]
    if isinstance(owner, MLP):
        return [owner.intermediate, owner.intermediate]
    raise ValueError(f"no shard layout for {param_name}")


def _embedding_init(rows: int, cols: int) -> torch.Tensor:
    """nn.Embedding's own N(0, 1) initial weights - except on the meta device (a model laid out
    before its weights are read), where there is nothing to initialise and torch's meta `normal_`
    would import torch._dynamo (and with it triton) on the plain eager path."""
    w = torch.empty(rows, cols)
    return w if w.is_meta else nn.init.normal_(w)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=_embedding_init(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.make_rotary(max_position or cfg.max_position_embeddings)
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.num_local_kv_heads = cfg.num_key_value_heads   # the KV heads this process stores
        # what forward runs: the eager methods, or compiled graphs of them that the model runner
        # installs here (worker/compiled_graphs.py)
        self.layers_step = self.run_layers
        self.logits_step = self.compute_logits

    def make_rotary(self, max_position: int) -> None:
        """The RoPE tables for positions below `max_position` (a family with several bases builds
        each)."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)

    # --- SupportsEagle3 -------------------------------------------------------------------------
    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        n = len(self.layers)
        return (min(2, n - 1), n // 2, max(n - 3, 0))   # (2, N//2, N-3), clamped for tiny targets

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        for i in layers:
            if not 0 <= i < len(self.layers):
                raise ValueError(f"aux hidden state layer {i} is outside the target's "
                                 f"{len(self.layers)} layers")
        self.aux_hidden_state_layers = tuple(layers)

    # --- forward --------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache, logits_indices: torch.Tensor | None = None) -> TargetOutput:
        h, aux = self.layers_step(input_ids, positions, meta, kv_cache)
        logits = None
        if logits_indices is not None:
            logits = self.logits_step(h[logits_indices])
        return TargetOutput(h, aux, logits)

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata | None = None, kv_cache=None):
        """Embedding, decoder layers and final norm: (normed hidden [T, H], aux [T, k*H] or None).
        With meta=None attention reads the forward context (the compiled path)."""
        h = self.embed(input_ids)
        captured = {}
        wanted = self.aux_hidden_state_layers
        rope_rows = fused_rope_rows(self, positions, h, meta)
        stacked = None if rope_rows is None else fused_stack_forward(self, h, rope_rows, meta, kv_cache, wanted)
        if stacked is not None:                  # every layer in one C++ call (decode / verification)
            h, captured = stacked
        else:
            for i, layer in enumerate(self.layers):
                if i in wanted:
                    captured[i] = h
                h = layer(h, positions, meta, kv_cache, self.layer_rotary(), rope_rows)
        aux_t = torch.cat([captured[i] for i in wanted], dim=-1) if wanted else None
        return self.norm(h), aux_t

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embedding (a family may scale it)."""
        return self.embed_tokens(input_ids)

    def layer_rotary(self):
        """What the decoder layers take as their RoPE (a family with local and global RoPE passes both)."""
        return self.rotary

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip_lm_head = self.config.tie_word_embeddings

        def rename(n):
            if "rotary_emb" in n:
                return None
            if skip_lm_head and n == "lm_head.weight":
                return None
            return n

        require_all_loaded(self, load_stacked_weights(self, weights, rename=rename), "checkpoint")
