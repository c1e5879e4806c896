"""Which files of a Hugging Face Hub repository make the model a name asks for (pure functions: a
list of file names in, the files to fetch out; no network).

A repository of GGUF files is read as llama.cpp's `-hf user/repo[:quant]` reads it: the quant tag is
matched case-insensitively against the tag in each file's name; without a tag Q4_K_M is taken, else
Q8_0, else the first GGUF in name order. Files that are not a main model - a vision projector
(`mmproj*`), an importance matrix (`imatrix*`), a speculative head shipped beside the model
(`*eagle3*`, `*dflash*`, `mtp-*`) - are never chosen. A model split by `gguf-split`
(`NAME-00001-of-00003.gguf`, ...) is chosen by its first shard and fetched whole.

A repository in the transformers layout gives its configuration, tokenizer files and weights:
`*.safetensors` (with their index) where there are any, else `pytorch_model*.bin`; never the
`original/` folder, `*.pth` or `*.onnx` exports other engines publish beside them."""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")          # no tag: the first of these the repo has, else its first GGUF
_QUANT = re.compile(r"(?:^|[-_.])((?:I?Q\d(?:_[A-Z0-9]+)*)|F16|BF16|F32|TQ\d_\d)(?=$|[-_.])", re.IGNORECASE)
_AUXILIARY = re.compile(r"^(mmproj|imatrix|mtp-)|eagle3|dflash", re.IGNORECASE)

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                "chat_template.jinja", "chat_template.json")


class NoSuchQuant(ValueError):
    """The repo has GGUF files, none in the quant asked for; `available` lists the quants it has."""

    def __init__(self, quant: str, available: list[str]):
        self.quant, self.available = quant, available
        super().__init__(f"no {quant} GGUF here; the quants it has: {', '.join(available) or 'none'}")


@dataclass(frozen=True)
class GGUFChoice:
    quant: str | None          # the tag in the file's name (upper case), None when it has none
    files: tuple[str, ...]     # the file, or every shard of a split model in order


def quant_of(filename: str) -> str | None:
    """The quant tag in a GGUF file's name (`Qwen2.5-1.5B-Instruct-Q4_K_M.gguf` -> `Q4_K_M`), upper
    case; the last tag-like part of the name wins (`q8_0` in `model.q8_0.gguf`)."""
    stem = SPLIT.sub("", posixpath.basename(filename))
    stem = re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    tags = _QUANT.findall(stem)
    return tags[-1].upper() if tags else None


def is_main_gguf(filename: str) -> bool:
    """A `.gguf` file that can be a main model (not a projector, imatrix or speculative head)."""
    base = posixpath.basename(filename)
    return base.lower().endswith(".gguf") and not _AUXILIARY.search(base)


def gguf_choices(files: list[str]) -> list[GGUFChoice]:
    """Every main model a repo's file list holds, in name order: single files, and split models by
    their first shard with all their shards (a split model missing a shard is left out)."""
    singles, splits = [], {}
    for f in sorted(files):
        if not is_main_gguf(f):
            continue
        m = SPLIT.search(f)
        if m is None:
            singles.append(GGUFChoice(quant_of(f), (f,)))
        else:
            splits.setdefault((f[:m.start()], int(m.group(2))), []).append((int(m.group(1)), f))
    for (prefix, count), shards in splits.items():
        if sorted(i for i, _ in shards) == list(range(1, count + 1)):
            singles.append(GGUFChoice(quant_of(shards[0][1]), tuple(f for _, f in sorted(shards))))
    return sorted(singles, key=lambda c: c.files[0])


def pick_gguf(files: list[str], quant: str | None = None) -> GGUFChoice | None:
    """The model `repo:quant` names among `files` (llama.cpp's rule, above); None when the repo has
    no main GGUF at all. A tag the repo lacks raises NoSuchQuant naming the tags it has."""
    choices = gguf_choices(files)
    if not choices:
        return None
    if quant:
        for c in choices:
            if c.quant == quant.upper():
                return c
        raise NoSuchQuant(quant.upper(), sorted({c.quant for c in choices if c.quant}))
    for preferred in DEFAULT_QUANTS:
        for c in choices:
            if c.quant == preferred:
                return c
    return choices[0]


def pick_checkpoint(files: list[str]) -> list[str]:
    """The files of a transformers-layout checkpoint at the top of the repo: configuration and
    tokenizer files, then the safetensors weights (or, only where there are none, the
    `pytorch_model*.bin` ones) with their index. Empty when the repo has no config.json."""
    top = [f for f in files if "/" not in f]
    if "config.json" not in top:
        return []
    chosen = [f for f in CONFIG_FILES if f in top]
    weights = sorted(f for f in top if f.endswith(".safetensors"))
    index = "model.safetensors.index.json"
    if not weights:
        weights = sorted(f for f in top if re.fullmatch(r"pytorch_model.*\.bin", f))
        index = "pytorch_model.bin.index.json"
    if weights and index in top:
        chosen.append(index)
    return chosen + weights
