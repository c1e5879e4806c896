"""What the HTTP layer knows about the served model, without its weights: the tokenizer, the chat
template, the context length and vocabulary size, and grammar compilation (validated before a
request is admitted). The single-process server builds one over its engine; the Ray ingress builds
one from a replica's `describe()` and loads only the tokenizer."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from draftwise.inputs import apply_chat_template, set_chat_template, tokenize_prompt
from draftwise.models.loader import load_tokenizer
from draftwise.structured_output import GrammarCompiler


@dataclass
class ModelFrontend:
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    eos_token_ids: tuple[int, ...]
    _compile: Callable | None = None
    # sampling defaults from the model's generation_config.json: a request's own values win
    generation_defaults: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of_engine(cls, engine) -> "ModelFrontend":
        """The front end of a local engine: grammars compile into the engine's own cache, so the
        engine thread finds them compiled."""
        info = describe_engine(engine)
        return cls(engine.tokenizer, info["max_model_len"], info["vocab_size"], info["max_num_seqs"],
                   tuple(info["eos_token_ids"]), engine.compile_grammar, info["generation_defaults"])

    @classmethod
    def from_description(cls, info: dict) -> "ModelFrontend":
        tokenizer = load_tokenizer(info.get("tokenizer_path") or info["model_path"])
        set_chat_template(tokenizer, info.get("chat_template"))
        return cls(tokenizer, info["max_model_len"], info["vocab_size"], info["max_num_seqs"],
                   tuple(info["eos_token_ids"]), generation_defaults=info.get("generation_defaults") or {})

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt)

    def compile_grammar(self, spec):
        """Compile (and so validate) a StructuredOutputParams; raises ValueError naming the problem."""
        if self._compile is None:
            with self._lock:
                if self._compile is None:
                    if self.tokenizer is None:
                        raise ValueError("structured outputs need the model's tokenizer")
                    self._compile = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids).compile
        return self._compile(spec)


def describe_engine(engine) -> dict:
    """The plain facts a front end needs about an engine (picklable: crosses process boundaries)."""
    return {"model_path": engine.worker.model_path, "tokenizer_path": engine.config.tokenizer,
            "max_model_len": engine.config.max_model_len,
            "vocab_size": engine.worker.model_cfg.vocab_size, "max_num_seqs": engine.config.max_num_seqs,
            "eos_token_ids": list(engine.eos_token_ids), "chat_template": engine.config.chat_template,
            "generation_defaults": dict(engine.config.generation_defaults)}
