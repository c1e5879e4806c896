"""The step contract between the engine and the worker, in the shape of vLLM v1's.

Each step the engine's scheduler decides what runs (`SchedulerOutput`: each scheduled request
with its share of tokens and the draft it verifies); the worker runs the target over those rows,
verifies and samples, and answers with a `ModelRunnerOutput` (per request the accepted drafts and
the sampled token, plus what the proposer reads for the next drafts); the scheduler alone turns
that answer into request state (`Scheduler.update_from_output`). Neither side imports the other:
both import this module. `request` fields hold the engine's Request (its id, block table, tokens
and sampling parameters are what the worker reads), or a picklable `RequestView` where the step
crosses a process boundary.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from draftwise.spec_decode.draft import Draft

if TYPE_CHECKING:
    from draftwise.spec_decode.tree import TreeDraft


class EngineFault(RuntimeError):
    """A failure of the engine itself, not of one request: a crashed tensor-parallel worker, or a
    step that failed for every request in it, alone as well as together. The engine does not retry
    it request by request; the caller fails the batch (the server keeps serving)."""


@dataclass
class ScheduledRequest:
    """One request's share of a step."""
    request: Any                # the engine's Request, or a RequestView on a worker rank
    start_pos: int              # == num_computed_tokens when scheduled
    token_ids: list[int]        # tokens fed this step: the not-yet-computed prefix, then the draft
    num_draft_tokens: int
    draft: Draft | None = None  # the draft being verified (cut to num_draft_tokens), None if none
    completes_prompt: bool = field(init=False)  # every known token is computed after it: one is sampled
    tree: TreeDraft | None = field(init=False)  # verification tree of a branching draft, None for chains

    def __post_init__(self):
        self.completes_prompt = self.start_pos + self.num_prefix_tokens >= self.request.num_tokens
        self.tree = None
        if self.draft is not None and not self.draft.is_chain:
            self.tree = self.draft.verification_tree(self.token_ids[self.num_prefix_tokens - 1])

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prefix_tokens(self) -> int:
        return len(self.token_ids) - self.num_draft_tokens


@dataclass
class RequestView:
    """What a target forward reads of a request (its KV blocks): the picklable stand-in for a
    Request in the SchedulerOutput that tensor-parallel worker ranks receive."""
    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class SchedulerOutput:
    """What one step runs: the scheduled requests in batch order, and those preempted to make room."""
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Any] = field(default_factory=list)   # the engine's Requests

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def for_workers(self) -> "SchedulerOutput":
        """The step as worker ranks run it: the same scheduled rows (tokens, positions, drafts and
        their verification trees), each request reduced to a RequestView (requests carry sampling
        state, grammar matchers and detokenizers that neither pickle nor matter to a forward)."""
        scheduled = []
        for s in self.scheduled:
            v = copy.copy(s)
            v.request = RequestView(s.request.request_id, list(s.request.block_ids), s.request.num_tokens)
            scheduled.append(v)
        return SchedulerOutput(scheduled)


@dataclass
class ModelRunnerOutput:
    """Result of one target step (Scheduler.update_from_output reads the first four fields; the
    proposer reads the rest for the next step's drafts)."""
    sched: SchedulerOutput
    new_token_ids: list[list[int]]        # per scheduled request: accepted drafts + sampled token
    num_accepted: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    aux_hidden_states: torch.Tensor | None
    block_tables: torch.Tensor
    query_start: list[int]
    accepted_rows: list[list[int]] = field(default_factory=list)  # tree: rows of the accepted path
    logprobs: list = field(default_factory=list)   # per request: TokenLogprob per new token, or None
