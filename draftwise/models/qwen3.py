"""Qwen3 target: the Llama stack with per-head q_norm / k_norm applied before RoPE.

The shared implementation in `llama.py` switches those norms on from `ModelConfig.qk_norm`
(architecture "qwen3"); this class only names the architecture for the registry."""
from draftwise.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, max_position=None):
        if cfg.architecture != "qwen3":
            raise ValueError("Qwen3ForCausalLM needs a qwen3 config")
        super().__init__(cfg, max_position)
