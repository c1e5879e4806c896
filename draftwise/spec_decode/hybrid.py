"""Hybrid drafting (Arctic Inference): a model drafter (EAGLE-3 or DFlash) with a training-free
drafter (suffix decoding or n-gram) beside it.

Per request per step the training-free draft is taken when its score reaches the model drafter's
draft length (suffix: the expected number of accepted tokens, the sum of its path probabilities;
n-gram: its length, every token a single confident match); otherwise the model drafts. The model
drafter still runs its prefill pass over every request's new rows (its KV must cover the accepted
tokens whichever source drafted them); it only skips the drafting passes for requests the
training-free draft wins. `last_sources` names the source of each request's draft for the
per-source acceptance metrics."""
from __future__ import annotations

from dataclasses import replace

from draftwise.spec_decode.proposer import Proposer, ProposerInput
from draftwise.spec_decode.suffix import SuffixDraft, SuffixProposer, to_engine_draft


class HybridProposer(Proposer):
    def __init__(self, model: Proposer, fast: Proposer, fast_max_tokens: int):
        self.drafter = model               # EagleProposer / DFlashProposer
        self.fast = fast                   # SuffixProposer / NgramProposer
        self.fast_max_tokens = fast_max_tokens
        self.method = f"{model.method}+{fast.method}"
        self.needs_aux_hidden_states = model.needs_aux_hidden_states
        self.num_lookahead_tokens = model.num_lookahead_tokens
        self.last_sources: list[str | None] = []
        self.expected_acceptance = getattr(model, "expected_acceptance", None)

    @property
    def model(self):
        """The draft network (the engine prepares its linears like the target's)."""
        return self.drafter.model

    # the model drafter owns the KV layers, aux layers and compiled graphs
    def kv_layer_specs(self):
        return self.drafter.kv_layer_specs()

    def bind_kv_cache(self, first_layer: int) -> None:
        self.drafter.bind_kv_cache(first_layer)

    def aux_layers(self):
        return self.drafter.aux_layers()

    def compile_graphs(self, compile_method, common, dtype, device):
        return self.drafter.compile_graphs(compile_method, common, dtype, device)

    def on_request_finished(self, request) -> None:
        self.fast.on_request_finished(request)

    def _fast_drafts(self, inp: ProposerInput) -> list[SuffixDraft]:
        if isinstance(self.fast, SuffixProposer):
            return self.fast.suffix_drafts(inp, self.fast_max_tokens)
        chains = self.fast.propose(inp, None, 0, self.fast_max_tokens)
        return [SuffixDraft(list(c), list(range(-1, len(c) - 1)), [1.0] * len(c), len(c)) for c in chains]

    def propose(self, inp: ProposerInput, kv_cache, block_size: int, num_spec_tokens: int):
        fast = self._fast_drafts(inp) if num_spec_tokens > 0 else [SuffixDraft() for _ in inp.requests]
        use_fast = [w and len(d) > 0 and d.score >= num_spec_tokens for w, d in zip(inp.want_draft, fast)]
        model_inp = replace(inp, want_draft=[w and not f for w, f in zip(inp.want_draft, use_fast)])
        model_drafts = self.drafter.propose(model_inp, kv_cache, block_size, num_spec_tokens)
        out, self.last_sources = [], []
        for req, f, d, md in zip(inp.requests, use_fast, fast, model_drafts):
            if f:
                out.append(to_engine_draft(d, req.all_token_ids[-1]))
                self.last_sources.append(self.fast.method)
            else:
                out.append(md)
                self.last_sources.append(self.drafter.method if md else None)
        return out
