"""What the engine returns to users."""
from __future__ import annotations

from dataclasses import dataclass, field

from draftwise.spec_decode.metrics import SpecDecodingStats


@dataclass
class RequestMetrics(SpecDecodingStats):
    """Per-request timings plus the request's own speculative-decoding counters."""
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None   # "stop" | "length" | "abort" | None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)  # produced by the last step (streaming)
    new_text: str = ""
