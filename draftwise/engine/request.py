"""A request's state as it moves through the scheduler."""
from __future__ import annotations

import enum
import time

import torch

from draftwise.outputs import RequestMetrics
from draftwise.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, eos_token_ids: tuple[int, ...] = ()):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0          # tokens whose K/V are in the cache
        self.spec_token_ids: list[int] = []   # drafts to verify in the next step
        self.spec_tree = None                 # tree drafting: the TreeDraft to verify next
        self.spec_source: str | None = None   # which drafter made the pending draft (hybrid drafting)
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []   # chained SHA-256 keys of the full computed blocks (prefix cache)
        self.finish_reason: str | None = None
        self.error: str | None = None         # why the request failed (finish_reason "error")
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.text = ""                        # detokenized output (maintained by the engine)
        self.detokenizer = None               # its IncrementalDetokenizer (created on first output)
        self.logprobs: list = []              # TokenLogprob per output token (when requested)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.num_preemptions = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
