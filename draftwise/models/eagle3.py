"""The EAGLE-3 draft model (one decoder layer over [embedding ; target features]) and the loader
for the layouts it is published in:

- SafeAILab/EAGLE and SpecForge (`yuhuili/*`, `AngelSlim/*`): a Llama config.json with
  `num_hidden_layers: 1`, `draft_vocab_size`, `target_hidden_size`; tensors `fc`, `midlayer.*`,
  `norm`, `lm_head`, `d2t`, `t2d` in model.safetensors or pytorch_model.bin;
- `speculators` (`RedHatAI/*.eagle3`): `speculators_model_type: "eagle3"`, the layer's Llama config
  under `transformer_layer_config`, the proposal length under `speculators_config`, tensors
  `layers.0.*` in place of `midlayer.*`, and `norm_before_residual` (default true there): the
  incoming hidden state is normalised before it becomes the residual."""
from __future__ import annotations

import os

import torch
from torch import nn

from draftwise.config import ModelConfig
from draftwise.layers.norm import RMSNorm
from draftwise.layers.rotary import RotaryEmbedding
from draftwise.models.llama import MLP, Attention, load_stacked_weights, require_all_loaded
from draftwise.models.loader import iter_checkpoint_tensors, read_config_json


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, norm_before_residual: bool = False):
        super().__init__()
        H = cfg.hidden_size
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, input_size=2 * H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(self, embeds, hidden, positions, meta, kv_cache, rotary):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(x, positions, meta, kv_cache, rotary)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3LlamaForCausalLM(nn.Module):
    """forward() returns the pre-norm hidden state (the recurrent state); compute_logits() maps it
    to draft-vocabulary logits; draft_to_target() maps draft ids to target ids via d2t."""

    def __init__(self, cfg: ModelConfig, target_hidden_size: int, draft_vocab_size: int,
                 target_vocab_size: int, layer_idx: int = 0, max_position: int = 4096,
                 num_aux: int = 3, norm_before_residual: bool = False):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(target_vocab_size, H)
        self.fc = nn.Linear(num_aux * target_hidden_size, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg, layer_idx, norm_before_residual)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(target_vocab_size, dtype=torch.bool))
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.has_own_embedding = False

    def set_layer_idx(self, idx: int) -> None:
        self.midlayer.self_attn.layer_idx = idx

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux)

    def forward(self, input_ids, positions, hidden, meta, kv_cache):
        embeds = self.embed_tokens(input_ids)
        return self.midlayer(embeds, hidden, positions, meta, kv_cache, self.rotary)

    def compute_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(prenorm))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def eagle3_aux_layer_ids(cfg: dict) -> tuple[int, ...] | None:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(cfg.get("eagle_config"), dict):
        ids = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else None


def eagle3_class(architectures: list[str]):
    """The draft class for a checkpoint's architecture: `Eagle3` + the target's (vLLM's naming,
    Eagle3LlamaForCausalLM) or SpecForge's `LlamaForCausalLMEagle3`."""
    arch = (architectures or ["LlamaForCausalLM"])[0]
    if arch in ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "LlamaForCausalLM"):
        return Eagle3LlamaForCausalLM
    raise ValueError(f"no EAGLE-3 draft class for architecture {arch!r} (known: Eagle3LlamaForCausalLM, "
                     "LlamaForCausalLMEagle3)")


def eagle3_config(raw: dict, path: str) -> dict:
    """A checkpoint's config.json in the SafeAILab form: a `speculators` config is unpacked (its
    layer's Llama config, with the EAGLE-3 keys beside it and its proposal length as the preset
    draft length); others are returned as they are."""
    kind = raw.get("speculators_model_type")
    if kind is None:
        return raw
    if kind != "eagle3":
        raise ValueError(f"{path} is a speculators {kind!r} drafter; draftwise reads speculators eagle3")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{path}: a speculators config needs transformer_layer_config")
    out = {**layer, "architectures": ["Eagle3LlamaForCausalLM"]}
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if raw.get(key) is not None:
            out[key] = raw[key]
    out["norm_before_residual"] = bool(raw.get("norm_before_residual", True))
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or []
    k = methods[0].get("speculative_tokens") if methods and isinstance(methods[0], dict) else None
    if isinstance(k, int) and k > 0:
        out["draftwise_speculative_config"] = {"num_speculative_tokens": k, "chain_num_speculative_tokens": k,
                                               "eagle_topk": 1}
    return out


def eagle3_tensor_name(name: str) -> str:
    """A published tensor name in the SafeAILab form (`model.` prefixes dropped, speculators'
    `layers.0.` as `midlayer.`)."""
    name = name[len("model."):] if name.startswith("model.") else name
    return "midlayer." + name[len("layers.0."):] if name.startswith("layers.0.") else name


def load_eagle3_checkpoint(path: str, target_cfg: ModelConfig, target_embedding: nn.Embedding,
                           dtype: torch.dtype, device, max_position: int):
    """Build an Eagle3 draft model from a published-format directory. Returns (model, raw config)."""

    if not path or not os.path.isdir(path):
        raise ValueError(f"EAGLE-3 draft checkpoint {path!r} is not a directory")
    raw = eagle3_config(read_config_json(path), path)
    cls = eagle3_class(raw.get("architectures") or ["LlamaForCausalLM"])
    try:
        raw_for_cfg = dict(raw)
        raw_for_cfg.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        dcfg = ModelConfig.from_hf_dict(raw_for_cfg)
    except KeyError as e:
        raise ValueError(f"EAGLE-3 config in {path} lacks {e}") from None
    if dcfg.num_hidden_layers != 1:
        raise ValueError(f"an EAGLE-3 draft has one decoder layer; {path} says num_hidden_layers="
                         f"{dcfg.num_hidden_layers}")
    target_hidden = raw.get("target_hidden_size") or dcfg.hidden_size
    if target_hidden != target_cfg.hidden_size:
        raise ValueError(f"draft expects target hidden size {target_hidden}, the target has "
                         f"{target_cfg.hidden_size}")
    if dcfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"draft vocabulary ({dcfg.vocab_size}) does not match the target's "
                         f"({target_cfg.vocab_size})")
    draft_vocab = raw.get("draft_vocab_size") or dcfg.vocab_size
    tensors = {eagle3_tensor_name(k): v for k, v in iter_checkpoint_tensors(path)}
    required = ["fc.weight", "norm.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight",
                "midlayer.hidden_norm.weight"]
    missing = [k for k in required if k not in tensors]
    if missing:
        raise ValueError(f"EAGLE-3 checkpoint {path} is missing tensors {missing}")
    num_aux = tensors["fc.weight"].shape[1] // target_hidden
    if tensors["fc.weight"].shape[1] != num_aux * target_hidden:
        raise ValueError(f"fc.weight {tuple(tensors['fc.weight'].shape)} does not fit target hidden {target_hidden}")
    if tensors["lm_head.weight"].shape[0] != draft_vocab:
        raise ValueError(f"lm_head.weight has {tensors['lm_head.weight'].shape[0]} rows, config says "
                         f"draft_vocab_size={draft_vocab}")
    with torch.device("cpu"):
        model = cls(dcfg, target_hidden, draft_vocab, target_cfg.vocab_size, 0, max_position, num_aux,
                    bool(raw.get("norm_before_residual", False)))
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)
    if draft_vocab != target_cfg.vocab_size and d2t is None:
        raise ValueError(f"{path}: a reduced draft vocabulary needs the d2t tensor")
    if d2t is not None:
        if d2t.shape[0] != draft_vocab:
            raise ValueError(f"d2t has {d2t.shape[0]} entries, expected {draft_vocab}")
        model.d2t.copy_(d2t.long())
        if int((torch.arange(draft_vocab) + model.d2t).max()) >= target_cfg.vocab_size:
            raise ValueError("d2t maps draft ids outside the target vocabulary")
    if t2d is not None:
        model.t2d.copy_(t2d.bool())
    emb = tensors.pop("embed_tokens.weight", None)
    loaded = load_stacked_weights(model, tensors.items(), strip_prefixes=(), strict=False)
    if emb is not None:
        if tuple(emb.shape) != tuple(model.embed_tokens.weight.shape):
            raise ValueError(f"embed_tokens.weight {tuple(emb.shape)} does not fit")
        model.embed_tokens.weight.data.copy_(emb)
        model.has_own_embedding = True
    else:
        model.embed_tokens = target_embedding   # shared with the target
    require_all_loaded(model, loaded, f"EAGLE-3 checkpoint {path}", skip_prefix="embed_tokens")
    model.to(dtype=dtype, device=device)
    model.rotary.to(dtype=torch.float32)
    model.eval()
    return model, raw


def save_eagle3_checkpoint(path: str, model: Eagle3LlamaForCausalLM, extra_config: dict,
                           dtype: torch.dtype = torch.float16) -> None:
    """Write the published EAGLE-3 layout: unfused q/k/v and gate/up, d2t, t2d."""
    from safetensors.torch import save_file
    import json
    os.makedirs(path, exist_ok=True)
    sd = {}
    attn, mlp = model.midlayer.self_attn, model.midlayer.mlp
    q, k, v = attn.qkv_proj.weight.detach().split([attn.q_size, attn.kv_size, attn.kv_size])
    g, u = mlp.gate_up_proj.weight.detach().split(mlp.intermediate)
    sd.update({"midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
               "midlayer.self_attn.v_proj.weight": v,
               "midlayer.self_attn.o_proj.weight": attn.o_proj.weight.detach(),
               "midlayer.mlp.gate_proj.weight": g, "midlayer.mlp.up_proj.weight": u,
               "midlayer.mlp.down_proj.weight": mlp.down_proj.weight.detach(),
               "midlayer.hidden_norm.weight": model.midlayer.hidden_norm.weight.detach(),
               "midlayer.input_layernorm.weight": model.midlayer.input_layernorm.weight.detach(),
               "midlayer.post_attention_layernorm.weight": model.midlayer.post_attention_layernorm.weight.detach(),
               "norm.weight": model.norm.weight.detach(), "fc.weight": model.fc.weight.detach(),
               "lm_head.weight": model.lm_head.weight.detach()})
    sd = {k: v.to(dtype).contiguous().cpu() for k, v in sd.items()}
    sd["d2t"] = model.d2t.detach().long().cpu()
    sd["t2d"] = model.t2d.detach().bool().cpu()
    save_file(sd, os.path.join(path, "model.safetensors"))
    c = model.config
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
           "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
           "draft_vocab_size": model.lm_head.weight.shape[0],
           "target_hidden_size": model.fc.weight.shape[1] // 3, "tie_word_embeddings": False,
           "torch_dtype": str(dtype).replace("torch.", "")}
    cfg.update(extra_config)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
