"""Architecture name -> model class. Draft classes are resolved the way the seed describes:
`Eagle3` + the checkpoint's architecture (e.g. LlamaForCausalLM -> Eagle3LlamaForCausalLM)."""
from __future__ import annotations

from draftwise.config import ModelConfig


def _targets():
    from draftwise.models.llama import LlamaForCausalLM
    from draftwise.models.qwen3 import Qwen3ForCausalLM
    return {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM}


def _drafts():
    def eagle3():
        from draftwise.models.eagle3 import Eagle3LlamaForCausalLM
        return Eagle3LlamaForCausalLM

    def dflash():
        from draftwise.models.dflash import DFlashDraftModel
        return DFlashDraftModel
    return {"Eagle3LlamaForCausalLM": eagle3, "DFlashDraftModel": dflash}


def target_class(cfg: ModelConfig):
    name = "Qwen3ForCausalLM" if cfg.architecture == "qwen3" else "LlamaForCausalLM"
    return _targets()[name]


def eagle3_class(architectures: list[str]):
    arch = (architectures or ["LlamaForCausalLM"])[0]
    name = arch if arch.startswith("Eagle3") else "Eagle3" + arch
    # SpecForge names its heads "LlamaForCausalLMEagle3"
    if name.endswith("Eagle3") and name.startswith("Eagle3"):
        name = name[: -len("Eagle3")]
    classes = _drafts()
    if name not in classes:
        raise ValueError(f"no EAGLE-3 draft class for architecture {arch!r} "
                         f"(known: {', '.join(k for k in classes if k.startswith('Eagle3'))})")
    return classes[name]()

