"""User-facing sampling parameters, validated on construction."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StructuredOutputParams:
    """Exactly one constraint. `json`: a JSON schema (dict or JSON text); `json_object`: any JSON
    object; `regex`; `choice`: one of these strings; `grammar`: EBNF in xgrammar's (GBNF-style)
    syntax with a `root` rule."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) \
                    or not self.choice:
                raise ValueError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("a structured output takes exactly one of json, json_object, regex, choice, grammar"
                             f" (got {', '.join(given) or 'none'})")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("json must be a JSON schema: an object or its JSON text")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{k} must be a non-empty string")

    def cache_key(self) -> str:
        return json.dumps([self.json, self.json_object, self.regex, self.choice, self.grammar], sort_keys=True)


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
        elif self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or [])
        validate(self)
        self.top_k = min(self.top_k, TOP_K_MAX)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class InvalidSamplingParams(ValueError):
    """A sampling field out of its range; `param` names the field (the server's 400 names it too),
    `code` is OpenAI's error code."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class SamplingLimits:
    """What the served model allows a request."""
    vocab_size: int
    max_model_len: int


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate(p: SamplingParams, limits: SamplingLimits | None = None, prompt_len: int | None = None) -> None:
    """Every check on the sampling fields, in one place: types and ranges always (SamplingParams runs
    this on construction); token ids against the vocabulary where `limits` are known; `max_tokens`
    against the context where the prompt's length is known too (the server refuses what cannot fit,
    as OpenAI does; the offline engine stops at the context instead). Raises InvalidSamplingParams."""
    def bad(param: str, message: str, code: str = "invalid_value"):
        raise InvalidSamplingParams(param, message, code)

    if not _number(p.temperature):
        bad("temperature", f"temperature must be a finite number, got {p.temperature!r}")
    if p.temperature < 0:
        bad("temperature", f"temperature must be >= 0, got {p.temperature}")
    if not _number(p.top_p) or not 0 < p.top_p <= 1:
        bad("top_p", f"top_p must be in (0, 1], got {p.top_p!r}")
    if not _int(p.top_k) or p.top_k < -1:
        bad("top_k", f"top_k must be -1 (disabled) or a positive integer, got {p.top_k!r}")
    if not _int(p.max_tokens) or p.max_tokens <= 0:
        bad("max_tokens", f"max_tokens must be a positive integer, got {p.max_tokens!r}")
    if p.seed is not None and (not _int(p.seed) or not SEED_MIN <= p.seed <= SEED_MAX):
        bad("seed", f"seed must be an integer in [-2**63, 2**64), got {p.seed!r}")
    if p.logprobs is not None and (not _int(p.logprobs) or not 0 <= p.logprobs <= 20):
        bad("logprobs", f"logprobs must be an integer in [0, 20] or None, got {p.logprobs!r}")
    for name in ("speculate", "spec_trace", "ignore_eos"):
        if not isinstance(getattr(p, name), bool):
            bad(name, f"{name} must be true or false, got {getattr(p, name)!r}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _number(v) or not -2 <= v <= 2:
            bad(name, f"{name} must be a number in [-2, 2], got {v!r}")
    if not _number(p.repetition_penalty) or not 0 < p.repetition_penalty <= 10:
        bad("repetition_penalty", f"repetition_penalty must be in (0, 10], got {p.repetition_penalty!r}")
    if not _number(p.min_p) or not 0 <= p.min_p <= 1:
        bad("min_p", f"min_p must be in [0, 1], got {p.min_p!r}")
    if p.logit_bias is not None and (not isinstance(p.logit_bias, dict) or any(
            not _int(k) or k < 0 or not _number(v) or not -100 <= v <= 100 for k, v in p.logit_bias.items())):
        bad("logit_bias", "logit_bias must map token ids (>= 0) to numbers in [-100, 100]")
    if not _int(p.min_tokens) or p.min_tokens < 0:
        bad("min_tokens", f"min_tokens must be a non-negative integer, got {p.min_tokens!r}")
    if p.bad_words is not None and (not isinstance(p.bad_words, list)
                                    or any(not isinstance(w, str) or not w.strip() for w in p.bad_words)):
        bad("bad_words", "bad_words must be a list of non-empty strings")
    if p.allowed_token_ids is not None and (not isinstance(p.allowed_token_ids, list) or not p.allowed_token_ids
                                            or any(not _int(t) or t < 0 for t in p.allowed_token_ids)):
        bad("allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids (>= 0)")
    if p.structured_output is not None and not isinstance(p.structured_output, StructuredOutputParams):
        bad("structured_output", "structured_output must be a StructuredOutputParams")
    if not isinstance(p.stop, list) or any(not isinstance(s, str) or not s for s in p.stop):
        bad("stop", "stop must be a string or a list of non-empty strings")
    if not isinstance(p.stop_token_ids, list) or any(not _int(t) or t < 0 for t in p.stop_token_ids):
        bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
    if limits is None:
        return
    vocab = limits.vocab_size
    for name in ("logit_bias", "allowed_token_ids"):
        outside = [t for t in (getattr(p, name) or ()) if t >= vocab]
        if outside:
            bad(name, f"{name} has token ids outside the vocabulary [0, {vocab}): {outside[:5]}")
    if prompt_len is not None and prompt_len + p.max_tokens > limits.max_model_len:
        bad("max_tokens", f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
            f"requested {prompt_len + p.max_tokens} tokens ({prompt_len} in the prompt, {p.max_tokens} for the "
            "completion). Please reduce the prompt or max_tokens.", "context_length_exceeded")
