"""The proposer interface every drafting method implements."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draftwise.spec_decode.draft import Draft


@dataclass
class NextStep:
    """What a step's drafts are weighed against: the scheduler's draft allocator (it cuts them
    to the lengths that pay) and the next step's shape besides drafts."""
    allocator: object                     # spec_decode/allocation.py DraftAllocator
    fixed_tokens: int                     # the step's tokens besides drafts
    sampled: int                          # requests that sample a token in it
    decode_tokens: int                    # its decode rows (the rest of fixed_tokens is prefill)


@dataclass
class ProposerInput:
    """What the target step leaves for the drafter. Rows are the *valid* rows of the step (the
    tokens fed, minus rejected drafts), grouped per request in batch order; a drafter that does not
    read them (`Proposer.reads_target_rows` False) gets None and an empty `query_lens`."""
    token_ids: torch.Tensor | None        # [Tv] tokens fed at those rows
    positions: torch.Tensor | None        # [Tv] their positions
    aux_hidden_states: torch.Tensor | None  # [Tv, k*H] target auxiliary states at those rows
    query_lens: list[int]                 # valid rows per request
    next_token_ids: torch.Tensor | None   # [R] token at position last+1 (sampled, or next prompt token)
    seq_lens: list[int]                   # last valid position + 1, per request
    block_tables: torch.Tensor            # [R, W]
    want_draft: list[bool]                # requests to draft for (others only update drafter state)
    requests: list                        # the Request objects (token history for n-gram)
    new_tokens: list[list[int]]           # tokens appended to each request by this step
    next_step: NextStep | None = None     # None: no draft allocation (drafts verified whole)


class Proposer:
    """Drafts tokens for the next step. `num_lookahead_tokens` is how many cache entries beyond the
    newest token the drafter writes (the scheduler reserves them)."""
    method = "base"
    needs_aux_hidden_states = False
    reads_target_rows = True              # False: drafts from the requests' token histories alone
    num_lookahead_tokens = 0
    # seconds of the last `propose` spent catching the drafter up on tokens a request drafting every
    # step would have been fed step by step (a draft model's lazy catch-up); the draft allocation
    # prices drafting without them
    last_catch_up_seconds = 0.0

    def kv_layer_specs(self) -> list[tuple[int, int]]:
        return []

    def bind_kv_cache(self, first_layer: int) -> None:
        pass

    def aux_layers(self) -> tuple[int, ...]:
        return ()

    def compile_graphs(self, compile_graph, common: dict, dtype, device) -> list:
        """Compile the drafter's passes with `compile_graph` (worker/compiled_graphs.py) and install
        them as its steps; returns the graphs (none by default)."""
        return []

    def propose(self, inp: ProposerInput, kv_cache, block_size: int, num_spec_tokens: int) -> list[Draft | None]:
        """One draft per request of `inp` (None where none is wanted or found), at most
        `num_spec_tokens` nodes, its `source` naming the drafter."""
        raise NotImplementedError

    def on_request_finished(self, request) -> None:
        """A request finished or was aborted (suffix decoding caches its output)."""
