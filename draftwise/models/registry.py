"""Architecture -> target model class. Draft models are not registered here: a draft checkpoint
is loaded by its method's own loader (models/eagle3.py, models/dflash.py), so the dependency runs
one way: loader -> registry -> model classes, never back."""
from __future__ import annotations

from draftwise.config import ModelConfig
from draftwise.models.gemma3 import Gemma3ForCausalLM
from draftwise.models.llama import LlamaForCausalLM
from draftwise.models.qwen2 import Qwen2ForCausalLM
from draftwise.models.qwen3 import Qwen3ForCausalLM

TARGETS = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM,
           "gemma3": Gemma3ForCausalLM}


def target_class(cfg: ModelConfig):
    return TARGETS.get(cfg.architecture, LlamaForCausalLM)
