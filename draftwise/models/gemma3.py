"""Gemma 3 target (text): the Llama stack with

- interleaved attention: most layers see a sliding window of their last `sliding_window` keys
  (with their own RoPE base, 10,000), every sixth layer all keys (RoPE base rope_theta, 1e6);
- q/k RMS norms before RoPE, and a softmax scale of query_pre_attn_scalar ** -0.5;
- four norms per layer: the attention and the MLP each between a pre-norm and a post-norm
  (x + post(attn(pre(x)))), GELU (tanh) instead of SiLU in the gated MLP;
- the token embedding scaled by sqrt(hidden) (the tied LM head is not).

Gemma's RMSNorm multiplies by (1 + w); GGUF files store w + 1 already (llama.cpp's converter adds
it), Hugging Face checkpoints store w, so `load_weights` adds 1 unless the configuration says the
norms include it (`norms_include_one`, set for GGUF files). Every layer keeps its full K/V in the
paged cache (the prefix cache, draft roll-back and trees work unchanged); a sliding layer only
reads its window (layers/attention.py: AttentionMetadata.window_plan). On draftwise's kernels the
layers run fused like Llama's (layers/fused_layer.py), their extra norms and GELU inside the C++
layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.config import ModelConfig
from draftwise.layers.attention import attend
from draftwise.layers.fused_layer import fused_layer_forward
from draftwise.layers.norm import RMSNorm
from draftwise.layers.rotary import RotaryEmbedding
from draftwise.models.llama import MLP, Attention, LlamaForCausalLM, load_stacked_weights, require_all_loaded


class Gemma3Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.sliding = layer_idx in cfg.sliding_layers
        self.window = cfg.sliding_window if self.sliding else 0
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5

    def forward(self, x, positions, meta, kv_cache, rotary: RotaryEmbedding):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(T, self.num_kv_heads, self.head_dim))
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        o = attend(q, k, v, self.layer_idx, self.scale, meta, kv_cache, self.window)
        return self.o_proj(o.reshape(T, self.q_size))


class GeluMLP(MLP):
    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = GeluMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.fused = None          # FusedLayerWeights when the layer runs fused (layers/fused_layer.py)

    def forward(self, x, positions, meta, kv_cache, rotaries, rope_rows=None):
        if rope_rows is not None:                    # on draftwise's kernels: two C++ calls
            return fused_layer_forward(self, x, rope_rows, meta, kv_cache)
        rotary = rotaries[1] if self.self_attn.sliding else rotaries[0]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, meta, kv_cache,
                                                             rotary))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_position: int | None = None):
        if cfg.architecture != "gemma3":
            raise ValueError("Gemma3ForCausalLM needs a gemma3 config")
        super().__init__(cfg, max_position)
        self.layers = nn.ModuleList([Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.embed_scale = cfg.hidden_size ** 0.5
        self.make_rotary(max_position or cfg.max_position_embeddings)

    def make_rotary(self, max_position: int) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_local_theta or cfg.rope_theta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h * torch.tensor(self.embed_scale, dtype=h.dtype)      # scaled by sqrt(hidden)

    def layer_rotary(self):
        return (self.rotary, self.rotary_local)                      # global, sliding-window layers

    def load_weights(self, weights) -> None:
        plus_one = not self.config.extra.get("norms_include_one", False)
        skip_lm_head = self.config.tie_word_embeddings

        def rename(n):
            if "rotary_emb" in n or (skip_lm_head and n == "lm_head.weight"):
                return None
            return n

        def adjusted():
            for name, w in weights:
                if plus_one and name.endswith("norm.weight"):
                    w = w + 1.0
                yield name, w

        require_all_loaded(self, load_stacked_weights(self, adjusted(), rename=rename), "checkpoint")
