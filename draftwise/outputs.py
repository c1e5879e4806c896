"""What the engine returns to users."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Speculative-decoding counters (vLLM conventions): drafts, draft tokens, accepted tokens and
    accepted tokens per draft position. Mean acceptance length = 1 + accepted / drafts."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "acceptance_rate": round(self.acceptance_rate, 4)}


@dataclass
class RequestMetrics(SpecDecodingStats):
    """Per-request timings plus the request's own speculative-decoding counters."""
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class TokenLogprob:
    """The target's log-probability of an emitted token and its `k` most likely alternatives."""
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class TokenTrace:
    """Where one output token came from (SamplingParams.spec_trace)."""
    token_id: int
    text: str             # the text this token completed ("" while a multi-byte character is pending)
    source: str | None    # the drafter whose accepted draft it was; None: the target's own token
    step: int             # the request's decoding step that produced it (0: its first token)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[TokenLogprob] | None = None   # one per token when SamplingParams.logprobs is set
    error: str | None = None           # finish_reason "error": what failed (other requests are unaffected)
    # one entry per output token when SamplingParams.spec_trace is set; the texts concatenate to
    # `text` (a finished request's trace is cut where a stop string cut the text)
    spec_trace: list[TokenTrace] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)  # produced by the last step (streaming)
    new_logprobs: list[TokenLogprob] | None = None           # their logprobs (when requested)
    new_text: str = ""
