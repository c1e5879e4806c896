"""Qwen2 / Qwen2.5 target: the Llama stack with biases on the q, k and v projections.

The shared implementation in `llama.py` gives the fused qkv projection its bias from
`ModelConfig.attention_bias` (true for architecture "qwen2"); this class only names the
architecture for the registry."""
from draftwise.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, max_position=None):
        if cfg.architecture != "qwen2":
            raise ValueError("Qwen2ForCausalLM needs a qwen2 config")
        super().__init__(cfg, max_position)
