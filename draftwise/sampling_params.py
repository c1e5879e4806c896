"""User-facing sampling parameters, validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from draftwise.structured_output import StructuredOutputParams

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
