"""The DFlash draft model (z-lab format) and its checkpoint loader / writer.

A small stack of Qwen3 decoder layers with no embedding and no LM head of its own (both are the
target's). The target's auxiliary hidden states at each context token go through
`hidden_norm(fc(aux))` to give one context vector per token; every draft layer projects those
vectors with its own k/v projections (k_norm, then RoPE at the context positions) into its paged KV
cache. The query block `[bonus, mask, ..., mask]` (block_size tokens at positions
seq_len + 0..B-1) is then run through the layers with non-causal attention over the injected
context and the block itself; block position k predicts the token *at* position k, so positions
1..B-1 give B-1 drafts through the target's LM head after the draft's final `norm`.

Context injection uses one fused weight holding every layer's K and V projections
(`build_fused_kv()`, built after loading), so all layers' context K/V come from one matmul.
"""
from __future__ import annotations

import json
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.config import ModelConfig
from draftwise.layers.norm import RMSNorm
from draftwise.layers.rotary import RotaryEmbedding
from draftwise.models.llama import DecoderLayer, load_stacked_weights, require_all_loaded
from draftwise.models.loader import iter_checkpoint_tensors, read_config_json

logger = logging.getLogger("draftwise")

# per-layer tensors of the published layout (after "layers.{i}.")
LAYER_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)
TOP_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight")


# ---------------------------------------------------------------------------------------------
# target layers
# ---------------------------------------------------------------------------------------------
def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """DFlash's default (layer-output) ids: evenly spaced from 1 to N-3; with one id, N//2."""
    if num_ids == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_ids - 1))) for i in range(num_ids)]


def spread_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """DFlash's default ids, or - when the target is too shallow for distinct ids in 1..N-3 - ids
    spread evenly over every capturable layer output 0..N-2."""
    N, n = int(num_target_layers), int(num_ids)
    ids = default_target_layer_ids(N, n)
    if len(set(ids)) < min(n, N - 1) or any(not 0 <= i <= N - 2 for i in ids):
        hi = max(N - 2, 0)
        ids = [int(round(i * hi / (n - 1))) for i in range(n)] if n > 1 else [min(N // 2, hi)]
    return ids


def dflash_capture_layers(target_layer_ids, num_target_layers: int) -> tuple[int, ...]:
    """Pre-layer capture indices for a DFlash checkpoint's (layer-output) target_layer_ids: id + 1.

    When some id + 1 does not exist in this target (a reduced target), the same number of evenly
    spaced layers is captured instead, with a warning; a target with fewer layers than ids is an
    error."""
    ids = [int(i) for i in target_layer_ids]
    n, N = len(ids), int(num_target_layers)
    if n == 0:
        raise ValueError("DFlash target_layer_ids is empty")
    if any(i < 0 for i in ids):
        raise ValueError(f"DFlash target_layer_ids {ids} has negative ids")
    if N < n:
        raise ValueError(f"the DFlash checkpoint reads {n} target layers {ids}, but the target has only "
                         f"{N} layers")
    if all(i + 1 < N for i in ids):
        return tuple(i + 1 for i in ids)
    fb = spread_target_layer_ids(N, n)
    capture = tuple(i + 1 for i in fb)
    logger.warning("DFlash target_layer_ids %s do not fit this %d-layer target (capture layer id+1 must "
                   "be < %d); capturing %d evenly spaced layers %s (layer outputs %s) instead - "
                   "acceptance will be lower than the checkpoint was trained for", ids, N, N, n,
                   list(capture), fb)
    return capture


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int, mask_token_id: int, target_layer_ids,
                 target_hidden_size: int | None = None, num_target_layers: int | None = None,
                 max_position: int = 4096):
        super().__init__()
        if cfg.architecture != "qwen3":
            raise ValueError("the DFlash draft is a Qwen3 stack: its ModelConfig needs architecture='qwen3'")
        self.config = cfg
        H = cfg.hidden_size
        self.block_size = int(block_size)
        self.mask_token_id = int(mask_token_id)
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.target_hidden_size = target_hidden_size or H
        self.num_target_layers = num_target_layers
        self.fc = nn.Linear(len(self.target_layer_ids) * self.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.fused_kv_weight: torch.Tensor | None = None
        self.fused_kv_bias: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def set_first_layer(self, first_layer: int) -> None:
        """Draft layer i uses KV-cache layer first_layer + i."""
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_idx = first_layer + i

    @torch.no_grad()
    def build_fused_kv(self) -> None:
        """Stack every layer's K and V projection rows into one [L*2*kv_size, H] weight (a copy:
        rebuild after changing the weights)."""
        ws, bs = [], []
        for layer in self.layers:
            a = layer.self_attn
            ws.append(a.qkv_proj.weight[a.q_size:a.q_size + 2 * a.kv_size])
            if a.qkv_proj.bias is not None:
                bs.append(a.qkv_proj.bias[a.q_size:a.q_size + 2 * a.kv_size])
        self.fused_kv_weight = torch.cat(ws, 0).detach().clone()
        self.fused_kv_bias = torch.cat(bs, 0).detach().clone() if bs else None

    def combine_context(self, aux: torch.Tensor) -> torch.Tensor:
        """[N, n_ids*Ht] target states -> [N, H] context vectors."""
        return self.hidden_norm(self.fc(aux))

    def _live_kv_weight(self):
        """The stacked K/V weight built from the live (trainable) parameters."""
        ws, bs = [], []
        for layer in self.layers:
            a = layer.self_attn
            ws.append(a.qkv_proj.weight[a.q_size:])
            if a.qkv_proj.bias is not None:
                bs.append(a.qkv_proj.bias[a.q_size:])
        return torch.cat(ws, 0), (torch.cat(bs, 0) if bs else None)

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor, use_fused: bool = True):
        """Per-layer (k, v) of the context [N, Hkv, D]: k normed then rotated at `positions`.
        `use_fused=False` reads the live parameters (training; differentiable)."""
        if use_fused:
            if self.fused_kv_weight is None or self.fused_kv_weight.device != self.fc.weight.device \
                    or self.fused_kv_weight.dtype != self.fc.weight.dtype:
                self.build_fused_kv()
            w, b = self.fused_kv_weight, self.fused_kv_bias
        else:
            w, b = self._live_kv_weight()
        ctx = self.combine_context(aux)
        N = ctx.shape[0]
        a0 = self.layers[0].self_attn
        kv = F.linear(ctx, w, b)
        kv = kv.view(N, self.num_layers, 2, a0.num_kv_heads, a0.head_dim)
        out = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k, v = kv[:, i, 0], kv[:, i, 1]
            if attn.qk_norm:
                k = attn.k_norm(k)
            k = self.rotary.rotate(positions, k)
            out.append((k, v))
        return out

    def inject_context(self, aux: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       kv_cache) -> None:
        """Write the context K/V of every draft layer into its paged cache at `slots`."""
        for layer, (k, v) in zip(self.layers, self.context_kv(aux, positions)):
            k_cache, v_cache = kv_cache.layer(layer.self_attn.layer_idx)
            k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
            v_cache.index_copy_(0, slots, v.to(v_cache.dtype))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, meta, kv_cache) -> torch.Tensor:
        """Block pass: embeds [T, H] of the query blocks (from the target's embedding), attention
        metadata of kind NONCAUSAL. Returns the final-normed hidden states [T, H] (apply the
        target's LM head to get logits)."""
        h = embeds
        for layer in self.layers:
            h = layer(h, positions, meta, kv_cache, self.rotary)
        return self.norm(h)


# ---------------------------------------------------------------------------------------------
# checkpoint I/O (z-lab layout)
# ---------------------------------------------------------------------------------------------
def dflash_config_value(raw: dict, name: str, default=None):
    """A DFlash field from `dflash_config` or, failing that, the top level."""
    dc = raw.get("dflash_config")
    if isinstance(dc, dict) and dc.get(name) is not None:
        return dc[name]
    v = raw.get(name)
    return default if v is None else v


def _int(v, what: str, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(f"DFlash config in {path}: {what} must be an integer, got {v!r}")
    return int(v)


def load_dflash_checkpoint(path: str, target_cfg: ModelConfig, dtype: torch.dtype, device,
                           max_position: int):
    """Build a DFlash draft from a published-format directory. Returns (model, raw config)."""

    if not path or not os.path.isdir(path):
        raise ValueError(f"DFlash draft checkpoint {path!r} is not a directory")
    raw = read_config_json(path)
    archs = raw.get("architectures") or []
    if archs and not any("DFlash" in str(a) for a in archs):
        raise ValueError(f"{path} is not a DFlash checkpoint (architectures={archs}, expected "
                         "['DFlashDraftModel'])")
    block_size = dflash_config_value(raw, "block_size")
    if block_size is None:
        raise ValueError(f"DFlash config in {path} has no block_size")
    block_size = _int(block_size, "block_size", path)
    if block_size < 2:
        raise ValueError(f"DFlash config in {path}: block_size must be >= 2, got {block_size}")
    mask_id = dflash_config_value(raw, "mask_token_id")
    if mask_id is None:
        raise ValueError(f"DFlash config in {path} has no mask_token_id (in dflash_config)")
    mask_id = _int(mask_id, "mask_token_id", path)
    V = target_cfg.vocab_size
    if not 0 <= mask_id < V:
        raise ValueError(f"DFlash mask_token_id={mask_id} is outside the target vocabulary [0, {V})")
    if raw.get("vocab_size") is not None and raw["vocab_size"] != V:
        raise ValueError(f"DFlash draft was trained for a vocabulary of {raw['vocab_size']}, the target has "
                         f"{V}: the draft uses the target's embedding and LM head, so they must match")
    try:
        raw_for_cfg = dict(raw)
        raw_for_cfg.setdefault("vocab_size", V)
        dcfg = ModelConfig.from_hf_dict(raw_for_cfg)
    except KeyError as e:
        raise ValueError(f"DFlash config in {path} lacks {e}") from None
    dcfg.architecture = "qwen3"        # Qwen3 layers (q_norm / k_norm) whatever the target family
    if dcfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"DFlash draft hidden_size={dcfg.hidden_size} does not match the target's "
                         f"{target_cfg.hidden_size} (the draft uses the target's embedding and LM head)")
    if dcfg.num_hidden_layers < 1:
        raise ValueError(f"DFlash config in {path}: num_hidden_layers must be >= 1")
    H, Ht = dcfg.hidden_size, target_cfg.hidden_size

    tensors = {}
    for k, v in iter_checkpoint_tensors(path):
        if k.startswith("model."):
            k = k[len("model."):]
        if "rotary_emb" in k or k in ("embed_tokens.weight", "lm_head.weight"):
            continue                    # the target's (never used from the draft)
        tensors[k] = v
    required = list(TOP_TENSORS) + [f"layers.{i}.{n}" for i in range(dcfg.num_hidden_layers)
                                    for n in LAYER_TENSORS]
    missing = [k for k in required if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"DFlash checkpoint {path} is missing tensors {missing[:8]}{more}")
    fc = tensors["fc.weight"]
    if fc.dim() != 2 or fc.shape[0] != H or fc.shape[1] % Ht or fc.shape[1] == 0:
        raise ValueError(f"DFlash fc.weight has shape {tuple(fc.shape)}; expected [{H}, n * {Ht}] for a "
                         f"target of hidden size {Ht}")
    n_ids = fc.shape[1] // Ht
    ids = dflash_config_value(raw, "target_layer_ids")
    num_target_layers = raw.get("num_target_layers")
    if ids is None:
        ids = default_target_layer_ids(num_target_layers or target_cfg.num_hidden_layers, n_ids)
        logger.info("DFlash config in %s has no target_layer_ids; using the default %s", path, ids)
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"DFlash target_layer_ids must be a list, got {ids!r}")
    ids = [_int(i, "target_layer_ids", path) for i in ids]
    if len(ids) != n_ids:
        raise ValueError(f"DFlash fc.weight takes {n_ids} x {Ht} target features, but target_layer_ids "
                         f"lists {len(ids)} layers {ids}")
    with torch.device("cpu"):
        model = DFlashDraftModel(dcfg, block_size, mask_id, ids, Ht, num_target_layers,
                                 max(max_position, 1) + block_size)
    try:
        loaded = load_stacked_weights(model, tensors.items(), strip_prefixes=(), strict=True)
    except ValueError as e:
        raise ValueError(f"DFlash checkpoint {path}: {e}") from None
    require_all_loaded(model, loaded, f"DFlash checkpoint {path}")
    model.to(dtype=dtype, device=device)
    model.rotary.to(dtype=torch.float32)
    model.eval()
    model.build_fused_kv()
    return model, raw


def dflash_state_dict(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """The published (unfused) tensor names of a draft model."""
    sd = {"fc.weight": model.fc.weight, "hidden_norm.weight": model.hidden_norm.weight,
          "norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        a, m = layer.self_attn, layer.mlp
        p = f"layers.{i}."
        q, k, v = a.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size])
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": a.o_proj.weight,
                   p + "self_attn.q_norm.weight": a.q_norm.weight, p + "self_attn.k_norm.weight": a.k_norm.weight,
                   p + "input_layernorm.weight": layer.input_layernorm.weight,
                   p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
                   p + "mlp.down_proj.weight": m.down_proj.weight})
        if a.qkv_proj.bias is not None:
            qb, kb, vb = a.qkv_proj.bias.split([a.q_size, a.kv_size, a.kv_size])
            sd.update({p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                       p + "self_attn.v_proj.bias": vb})
        g, u = m.gate_up_proj.weight.split(m.intermediate)
        sd.update({p + "mlp.gate_proj.weight": g, p + "mlp.up_proj.weight": u})
    return sd


def save_dflash_checkpoint(path: str, model: DFlashDraftModel, extra_config: dict | None = None,
                           dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the published z-lab layout: model.safetensors (unfused q/k/v, gate/up) + config.json."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    sd = {k: v.detach().to(dtype).contiguous().cpu() for k, v in dflash_state_dict(model).items()}
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    c = model.config
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "block_size": model.block_size,
           "dflash_config": {"mask_token_id": model.mask_token_id,
                             "target_layer_ids": list(model.target_layer_ids)},
           "num_hidden_layers": model.num_layers,
           "num_target_layers": model.num_target_layers,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
           "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
           "attention_bias": c.attention_bias, "attention_dropout": 0.0, "tie_word_embeddings": False,
           "torch_dtype": str(dtype).replace("torch.", "")}
    if extra_config:
        extra = dict(extra_config)
        dc = extra.pop("dflash_config", None)
        if dc:
            cfg["dflash_config"].update(dc)
        cfg.update(extra)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
