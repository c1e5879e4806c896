"""A request's state as it moves through the scheduler."""
from __future__ import annotations

import enum
import time

import torch

from draftwise.outputs import RequestMetrics
from draftwise.sample.logits_processors import needs_processing
from draftwise.sampling_params import SamplingParams
from draftwise.spec_decode.draft import Draft


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
        self._all_token_ids = list(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0          # tokens whose K/V are in the cache
        self.draft: Draft | None = None       # tokens to verify in the next step (chain or tree)
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []   # chained SHA-256 keys of the full computed blocks (prefix cache)
        self.finish_reason: str | None = None
        self.error: str | None = None         # why the request failed (finish_reason "error")
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.text = ""                        # detokenized output (maintained by the engine)
        self.detokenizer = None               # its IncrementalDetokenizer (created on first output)
        self.logprobs: list = []              # TokenLogprob per output token (when requested)
        self.spec_trace: list | None = [] if params.spec_trace else None   # TokenTrace per output token
        self.num_steps = 0                    # decoding steps that produced tokens for this request
        self.grammar = None                   # RequestGrammar when the output is constrained
        self.bad_words_ids: list[list[int]] = []   # token sequences of params.bad_words (the engine's tokenizer)
        self.needs_logits_processing = needs_processing(params)   # decided once, read every step
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.num_preemptions = 0
        # decayed share of this request's decided drafts whose first node the target agreed with
        # (verified or watched): the draft allocation's calibration conditions on it
        self.draft_agreement = 0.5

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens (one list kept up to date by `append_output`; read-only)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
