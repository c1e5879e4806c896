"""User-facing sampling parameters, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftwise.structured_output import StructuredOutputParams

def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1    # what torch.Generator.manual_seed accepts
TOP_K_MAX = 2 ** 31 - 1                          # any top_k at least the vocabulary size means "off"


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1            # -1 or 0: disabled
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    speculate: bool = True     # False: this request is decoded without drafts (per-request opt-out)
    logprobs: int | None = None  # return each token's log-probability and this many top alternatives
    spec_trace: bool = False   # record each output token's text, drafter source and step (outputs.TokenTrace)
    # constrain the output to a JSON schema / regex / choice / grammar (structured_output.py)
    structured_output: StructuredOutputParams | None = None
    # history-dependent logits processors (sample/logits_processors.py) and min-p filtering
    presence_penalty: float = 0.0      # OpenAI: [-2, 2]
    frequency_penalty: float = 0.0     # OpenAI: [-2, 2]
    repetition_penalty: float = 1.0    # > 0; 1 = off
    min_p: float = 0.0                 # [0, 1]: drop tokens below min_p x the top probability
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, [-100, 100]
    min_tokens: int = 0                # no stop token before this many output tokens
    bad_words: list[str] | None = None           # never generate these words
    allowed_token_ids: list[int] | None = None   # generate only these tokens

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < -1):
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        self.top_k = min(self.top_k, TOP_K_MAX)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20] or None, got {self.logprobs!r}")
        if not isinstance(self.speculate, bool):
            raise ValueError(f"speculate must be true or false, got {self.speculate!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        if not _number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not isinstance(k, int) or isinstance(k, bool) or k < 0 or not _number(v) or not -100 <= v <= 100
                    for k, v in self.logit_bias.items()):
                raise ValueError("logit_bias must map token ids (>= 0) to numbers in [-100, 100]")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise ValueError("bad_words must be a list of non-empty strings")
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, list)
                                                   or not self.allowed_token_ids or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids (>= 0)")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputParams):
            raise ValueError("structured_output must be a StructuredOutputParams")
        if not isinstance(self.spec_trace, bool):
            raise ValueError(f"spec_trace must be true or false, got {self.spec_trace!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
