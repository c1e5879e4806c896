"""Resolve a model name or path, read its config and tensors, build the model and tokenizer."""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from typing import Iterator

import torch

from draftwise.config import ModelConfig, cache_dir
from draftwise.layers.rotary import RotaryEmbedding
from draftwise.models.registry import target_class
from draftwise.formats import FORMATS
from draftwise.layers.fused_layer import enable_fused_layers
from draftwise.layers.quant import GroupAffineEmbedding, exact_linear, requantize_linears
from draftwise.models.gguf_convert import _NAME_MAP, block_map, convert_gguf, gguf_metadata_dir
from draftwise.models.gguf_file import is_gguf, open_gguf
from draftwise.models.gguf_weights import GGUFBlocks
from draftwise.models.llama import load_stacked_weights
from draftwise.models.packaged import PACKAGED, packaged_gguf, packaged_model

logger = logging.getLogger("draftwise")

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def gguf_path_for(model: str) -> str | None:
    """The GGUF file a model name or path is read from, if any (a packaged model's is assembled
    into the cache on first use)."""
    if os.path.isfile(model) and (model.lower().endswith(".gguf") or is_gguf(model)):
        return model                   # (a malformed .gguf is refused by open_gguf, naming the problem)
    if packaged_model(model) is not None:
        return packaged_gguf(model, cache_dir())
    return None


def native_quantization(model: str) -> str | None:
    """The weight format a model runs in by default: "gguf" when it is a GGUF whose layer linears
    are all in block types draftwise reads exactly (draftwise/formats; layers/quant.py runs them),
    else None (the checkpoint's dtype)."""
    gguf = gguf_path_for(model)
    if gguf is None:
        return None
    reader = open_gguf(gguf)           # memory-mapped: only the tensor index is read here
    kinds = {t.tensor_type.name for t in reader.tensors
             if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2}
    return "gguf" if kinds and kinds <= set(FORMATS) else None


def resolve_model_dir(model: str) -> str:
    """Return a local Hugging Face-style directory for `model` (converting a GGUF once)."""
    gguf = gguf_path_for(model)
    if gguf is not None:
        return convert_gguf(gguf, cache_dir())
    if model.endswith(".gguf") and not os.path.exists(model):
        raise ValueError(f"model path {model!r} does not exist")
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is neither a directory, a GGUF file nor a packaged model "
                         f"({', '.join(PACKAGED)})")
    if not os.path.exists(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    return model


def read_config_json(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json")) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path!r} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}/config.json is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}/config.json must hold a JSON object")
    return d


def iter_checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors from `*.safetensors` (preferred) or `pytorch_model*.bin` in a directory."""
    st = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if st:
        from safetensors import safe_open
        for f in st:
            try:
                with safe_open(f, framework="pt") as fh:
                    for k in fh.keys():
                        yield k, fh.get_tensor(k)
            except Exception as e:
                raise ValueError(f"cannot read checkpoint file {f}: {e}") from None
        return
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not bins:
        raise ValueError(f"{path!r} holds no model.safetensors or pytorch_model.bin")
    for f in bins:
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"cannot read checkpoint file {f}: {e}") from None
        yield from sd.items()


def load_target_model(model: str, dtype: torch.dtype, device: str, max_position: int | None = None,
                      quantization: str | None = None):
    """(model, config, directory): a GGUF with quantization "gguf" is built straight from its blocks
    (load_gguf_target); anything else from a checkpoint directory (a GGUF dequantized once)."""
    gguf = gguf_path_for(model)
    if gguf is not None and quantization == "gguf":
        return load_gguf_target(gguf, dtype, device, max_position)
    path = resolve_model_dir(model)
    cfg = ModelConfig.from_hf_dict(read_config_json(path))
    cls = target_class(cfg)
    with torch.device("cpu"):
        m = cls(cfg, max_position=max(max_position or 0, cfg.max_position_embeddings))
    m.load_weights(iter_checkpoint_tensors(path))
    m.to(dtype=dtype, device=device)
    for mod in m.modules():
        if isinstance(mod, RotaryEmbedding):
            mod.to(dtype=torch.float32)
    m.eval()
    return m, cfg, path


def load_gguf_target(path: str, dtype: torch.dtype, device: str, max_position: int | None = None):
    """Build a target model from a GGUF file's own blocks, in bounded memory: the model is laid out
    on the meta device (no weights allocated), then every module gets its weights straight from the
    memory-mapped file, one module at a time - linears and the embedding as exact group-affine
    blocks (layers/quant.py), norms and biases in fp32, a linear the file keeps in plain numbers
    dense. No full-precision copy is made in memory or on disk; only config.json and the tokenizer
    are cached."""
    from torch import nn
    meta_dir = gguf_metadata_dir(path, cache_dir())
    cfg = ModelConfig.from_hf_dict(read_config_json(meta_dir))
    blocks = GGUFBlocks(path)
    max_position = max(max_position or 0, cfg.max_position_embeddings)
    with torch.device("meta"):
        m = target_class(cfg)(cfg, max_position=max_position)
    emb = blocks.get("embed_tokens")
    if emb and tuple(emb[0].codes.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"GGUF {path}: the token embedding is {list(emb[0].codes.shape)}, the configuration says "
                         f"[{cfg.vocab_size}, {cfg.hidden_size}]")
    m.embed_tokens = GroupAffineEmbedding(emb[0], dtype=dtype) if emb else \
        nn.Embedding.from_pretrained(blocks.dense("token_embd.weight"), freeze=True)
    # the LM head first: its decode and packing make the largest temporaries (a 150k x H table),
    # best made before the layers' weights are resident
    linears = sorted(((n, sub) for n, sub in m.named_modules() if isinstance(sub, nn.Linear)),
                     key=lambda item: item[0] != "lm_head")
    for name, sub in linears:
        parts, bias = blocks.get(name), blocks.bias(name)
        if parts is not None:
            rows, cols = sum(p.codes.shape[0] for p in parts), parts[0].codes.shape[1]
            if (rows, cols) != (sub.out_features, sub.in_features) or (
                    bias is not None and tuple(bias.shape) != (rows,)):
                raise ValueError(f"GGUF {path}: {name} is [{rows}, {cols}] in the file, the configuration "
                                 f"says [{sub.out_features}, {sub.in_features}]")
            new = exact_linear(parts, bias, name)
        else:
            if name not in blocks.modules:
                raise ValueError(f"GGUF {path}: no tensor for {name}")
            w = blocks.dense_weight(name)
            if tuple(w.shape) != (sub.out_features, sub.in_features):
                raise ValueError(f"GGUF {path}: {name} is {list(w.shape)} in the file, the configuration says "
                                 f"[{sub.out_features}, {sub.in_features}]")
            new = nn.Linear(sub.in_features, sub.out_features, bias=bias is not None)
            with torch.no_grad():
                new.weight.copy_(w)
                if bias is not None:
                    new.bias.copy_(bias)
        owner, _, attr = name.rpartition(".")
        setattr(m.get_submodule(owner) if owner else m, attr, new)
    m.make_rotary(max_position)
    for mod in m.modules():                    # what is left on meta: norm weights, filled below
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(mod, pname, nn.Parameter(torch.empty(p.shape), requires_grad=False))
    norms, names = [], block_map(cfg.architecture)   # the 1-D weights: RMSNorm scales
    for t in blocks.reader.tensors:
        if len(t.shape) != 1 or not t.name.endswith(".weight"):
            continue
        if t.name in _NAME_MAP:
            norms.append((_NAME_MAP[t.name], blocks.dense(t.name)))
        elif t.name.startswith("blk."):
            _, idx, rest = t.name.split(".", 2)
            base = rest.rsplit(".", 1)[0]
            if base in names:
                norms.append((f"model.layers.{idx}.{names[base]}.weight", blocks.dense(t.name)))
    loaded = load_stacked_weights(m, norms, strict=False)
    missing = [n for n, p in m.named_parameters() if n not in loaded and not n.startswith("embed_tokens")
               and not n.startswith("lm_head") and ".self_attn." not in n and ".mlp." not in n]
    leftover = [n for n, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta]
    if missing or leftover:
        raise ValueError(f"GGUF {path}: no tensors for {sorted(missing + leftover)[:8]}")
    for p in m.parameters():
        p.data = p.data.to(dtype)
    m.to(device=device)
    for mod in m.modules():
        if isinstance(mod, RotaryEmbedding):
            mod.to(dtype=torch.float32)
    m.eval()
    return m, cfg, meta_dir


def load_tokenizer(path: str):
    """The model's own tokenizer, or None if the directory has none."""
    if not (os.path.exists(os.path.join(path, "tokenizer.json"))
            or os.path.exists(os.path.join(path, "tokenizer_config.json"))):
        return None
    try:
        if _tokenizer_class(path) == "TokenizersBackend":
            # what AutoTokenizer would build, without importing and reading the model's config
            # class first (~1.3 s of a warm start: transformers' model-config modules pull in
            # torch.distributed and the kernels hub)
            from transformers import TokenizersBackend
            return TokenizersBackend.from_pretrained(path)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        logger.warning("tokenizer in %s could not be loaded (%s); token-id prompts only", path, e)
        return None


def _tokenizer_class(path: str) -> str | None:
    """The tokenizer class a model directory's tokenizer_config.json names (None: none or unreadable)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def requantized_cache(path: str, kind: str) -> str:
    """Where a model's linears re-quantized to `kind` are kept between starts: keyed by the source
    file or folder (its real path, size and modification time: a replaced file is quantized anew)
    and the quantizer's version."""
    from importlib.metadata import version
    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}|{st.st_size}|{st.st_mtime_ns}|{kind}|gguf {version('gguf')}".encode()).hexdigest()
    return os.path.join(cache_dir(), "requantized", f"{os.path.basename(real)}-{kind}-{key[:16]}.safetensors")


def load_draft_model(name: str, target_cfg: ModelConfig, target_dir: str, dtype: torch.dtype, device: str,
                     max_position: int, fused: bool, requantize: str | None = None):
    """A draft model for speculative decoding (spec_decode/draft_model.py): a packaged model's short
    name, a GGUF file or a model directory, in its own weight format (a GGUF on its own blocks) or
    re-quantized at load to the GGUF block type `requantize` (layers/quant.py requantize_linears),
    with the fused CPU layers when `fused` (eager steps). Its vocabulary must be the target's: the
    same size, and where both carry a tokenizer, the same token for every id. Returns (model,
    config, its quantization)."""
    if gguf_path_for(name) is None and not os.path.isdir(name):
        raise ValueError(f"draft model {name!r} is neither a packaged model's short name, a .gguf file nor "
                         "a model directory")
    quantization = native_quantization(name)
    model, cfg, path = load_target_model(name, dtype, device, max_position=max_position, quantization=quantization)
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"draft model {name!r} has a vocabulary of {cfg.vocab_size} tokens, the target "
                         f"{target_cfg.vocab_size}: a draft model must share the target's tokenizer")
    mine, theirs = load_tokenizer(path), load_tokenizer(target_dir)
    if mine is not None and theirs is not None and mine.get_vocab() != theirs.get_vocab():
        raise ValueError(f"draft model {name!r} has another tokenizer than the target (the same vocabulary "
                         "size, different tokens): a draft model must share the target's tokenizer")
    if requantize is not None:
        requantize_linears(model, requantize, cache=requantized_cache(gguf_path_for(name) or name, requantize))
        quantization = "gguf"
    if quantization is not None and fused and hasattr(model, "layers"):
        enable_fused_layers(model)
    return model, cfg, quantization
