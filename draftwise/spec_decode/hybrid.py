"""Hybrid drafting (Arctic Inference): a model drafter (EAGLE-3 or DFlash) with a training-free
drafter (suffix decoding or n-gram) beside it.

Per request per step the training-free draft is taken when its score reaches the model drafter's
draft length (suffix: the expected number of accepted tokens, the sum of its path probabilities;
n-gram: its length, every token a single confident match); otherwise the model drafts. The model
drafter still runs its prefill pass over every request's new rows (its KV must cover the accepted
tokens whichever source drafted them); it only skips the drafting passes for requests the
training-free draft wins. Each draft's `source` names the drafter that made it (the per-source
acceptance metrics)."""
from __future__ import annotations

from dataclasses import replace

from draftwise.spec_decode.proposer import Proposer, ProposerInput


class HybridProposer(Proposer):
    def __init__(self, model: Proposer, fast: Proposer, fast_max_tokens: int):
        self.drafter = model               # EagleProposer / DFlashProposer
        self.fast = fast                   # SuffixProposer / NgramProposer
        self.fast_max_tokens = fast_max_tokens
        self.method = f"{model.method}+{fast.method}"
        self.needs_aux_hidden_states = model.needs_aux_hidden_states
        self.num_lookahead_tokens = model.num_lookahead_tokens
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

    def compile_graphs(self, compile_graph, common, dtype, device):
        return self.drafter.compile_graphs(compile_graph, common, dtype, device)

    def on_request_finished(self, request) -> None:
        self.fast.on_request_finished(request)

    def propose(self, inp: ProposerInput, kv_cache, block_size: int, num_spec_tokens: int):
        fast = self.fast.propose(inp, None, 0, self.fast_max_tokens) if num_spec_tokens > 0 else [None] * len(inp.requests)
        use_fast = [bool(w and d and d.expected_accepted >= num_spec_tokens) for w, d in zip(inp.want_draft, fast)]
        model_inp = replace(inp, want_draft=[w and not f for w, f in zip(inp.want_draft, use_fast)])
        model_drafts = self.drafter.propose(model_inp, kv_cache, block_size, num_spec_tokens)
        return [f if use else m for use, f, m in zip(use_fast, fast, model_drafts)]
