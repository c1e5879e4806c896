"""Hybrid drafting (Arctic Inference): a model drafter (a draft model, EAGLE-3 or DFlash) with a
training-free drafter (suffix decoding or n-gram) beside it.

Per request per step either the training-free draft or the model's is verified. The training-free
draft is free to make; the model's costs drafting passes (a draft model: a pass of a smaller model
per drafted token). With the scheduler's draft allocation at hand (its calibrated acceptance per
drafter and depth, and the measured step costs), the choice is the one with the most expected
emitted tokens per second of the next step, the model's drafting seconds included: requests are
handed to the model in order of what its chain is expected to add over their training-free draft,
as long as the step's rate rises. The model's drafting seconds are its own estimate where it has
one (a draft model times its chain passes), else measured here per number of requests it drafts
for, as the difference to a call that drafts for none (a hidden-state drafter still runs its
prefill pass then). Without an allocation the training-free draft is taken
when its expected number of accepted tokens reaches the model's draft length.

The model drafter keeps its state whichever draft wins: EAGLE-3 / DFlash run their prefill pass
over every request's new rows each step; a draft model catches up on the accepted tokens the
next time it drafts for the request. Each draft's `source` names the drafter that made it (the
per-source acceptance metrics and calibration)."""
from __future__ import annotations

import time
from dataclasses import replace

from draftwise.spec_decode.drafting_seconds import DraftingSeconds
from draftwise.spec_decode.proposer import Proposer, ProposerInput


def choose_model_drafts(fast_accept: list[list[float] | None], model_chain: list[float], step_rate,
                        model_seconds, lengths: tuple[int, ...] | None = None,
                        request_seconds: list[float] | None = None) -> tuple[list[bool], int]:
    """Which requests the model drafter drafts for, and its chain length.

    fast_accept[i]: calibrated acceptance per node of request i's training-free draft ([] where
                    it found none; None where request i wants no draft);
    model_chain:    calibrated acceptance per node of a model chain (its longest);
    step_rate(accept, seconds): expected emitted tokens per second of the next step with drafts of
                    node acceptance `accept` per request, costing `seconds` of drafting;
    model_seconds(m, k): seconds the model takes to draft k-token chains for m requests;
    lengths:        the chain lengths to weigh (default: the longest only);
    request_seconds[i]: what handing request i to the model adds to a step besides its chain
                    passes (a draft model's catch-up on the request, spread over its remaining
                    steps; default none).
    For each length, requests go to the model in order of its expected gain over their own draft
    (less their own seconds, as tokens at the step's rate without model drafts) and the prefix
    with the best step rate is kept (of the prefixes of 1, 2, 4, ... requests and of all that
    gain: a batch of R requests costs O(log R) rate evaluations per length); the best (length,
    prefix) wins - none, if no prefix beats the training-free drafts alone."""
    own = request_seconds or [0.0] * len(fast_accept)
    best_rate = base = step_rate([a or [] for a in fast_accept], 0.0)
    best_set, best_k = [], len(model_chain)
    for k in lengths or (len(model_chain),):
        chain = model_chain[:k]
        model_sum = sum(chain)
        # a request's own seconds count as the tokens the step would emit in them
        gains = sorted((sum(a) - model_sum + own[i] * base, i) for i, a in enumerate(fast_accept) if a is not None)
        order = [i for g, i in gains if g < 0]
        accept = [a or [] for a in fast_accept]
        extra = 0.0
        for m, i in enumerate(order, start=1):
            accept[i] = chain
            extra += own[i]
            if m & (m - 1) and m != len(order):
                continue                   # prefixes of 1, 2, 4, ... and all: a batch weighs few
            rate = step_rate(accept, model_seconds(m, k) + extra)
            if rate > best_rate:
                best_set, best_k, best_rate = order[:m], k, rate
    chosen = set(best_set)
    return [i in chosen for i in range(len(fast_accept))], best_k


class HybridProposer(Proposer):
    EXPLORE_EVERY = 8
    MAX_EXPLORE_EVERY = 64
    # explorations spend at most this share of the steps' seconds: each step without a model
    # draft adds this share of its priced seconds to a budget, and an exploration takes what it
    # cost - the draft model's catch-up included - once it has run. A request the draft model has
    # not drafted for lately is fed every token since in that call (a whole prompt: ~1.5 s of an
    # 11 s run of ten code edits at batch 16, for seven drafts the allocation then cut), so an
    # exploration can cost a hundred steps' worth of the share; the next waits until they are paid
    EXPLORE_SHARE = 0.01

    def __init__(self, model: Proposer, fast: Proposer, fast_max_tokens: int):
        self.drafter = model               # DraftModelProposer / EagleProposer / DFlashProposer
        self.fast = fast                   # SuffixProposer / NgramProposer
        self.fast_max_tokens = fast_max_tokens
        self.method = f"{model.method}+{fast.method}"
        self.needs_aux_hidden_states = model.needs_aux_hidden_states
        self.num_lookahead_tokens = model.num_lookahead_tokens
        self.expected_acceptance = getattr(model, "expected_acceptance", None)
        self.model_seconds = DraftingSeconds()
        self._skips, self._explore_every = 0, self.EXPLORE_EVERY
        self._explore_budget = 0.0         # seconds explorations may spend (EXPLORE_SHARE)
        self._exploring = False

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
        self.drafter.on_request_finished(request)

    def _model_requests(self, inp: ProposerInput, fast, num_spec_tokens: int) -> tuple[list[bool], int]:
        """The requests the model drafts for, and its chain length."""
        nxt = inp.next_step
        if nxt is None:
            return [bool(w) and not (d is not None and d.expected_accepted >= num_spec_tokens)
                    for w, d in zip(inp.want_draft, fast)], num_spec_tokens
        cal = nxt.allocator.calibration
        fast_accept = [(cal.estimates(d) if d else []) if w else None for w, d in zip(inp.want_draft, fast)]

        def step_rate(accept, seconds):
            return nxt.allocator.step_rate(accept, nxt.fixed_tokens, nxt.sampled, nxt.decode_tokens, seconds)

        chain = cal.chain(self.drafter.method, num_spec_tokens)
        # a drafter that prices its chain by length (a draft model: a pass per token) is weighed
        # at every length; one priced by measured calls at its configured length only
        lengths = tuple(range(1, num_spec_tokens + 1)) if hasattr(self.drafter, "drafting_seconds") else None
        chosen, k = choose_model_drafts(fast_accept, chain, step_rate, self._model_seconds, lengths,
                                        self._catch_up_per_step(inp, chain))
        costs = nxt.allocator.costs
        return self._explored(chosen, fast_accept, chain, costs(nxt.fixed_tokens) if costs else None), k

    def _explored(self, chosen: list[bool], fast_accept, chain, step_seconds: float | None) -> list[bool]:
        """`chosen`, or - after EXPLORE_EVERY steps in a row without a model draft, with the
        exploration budget paid up - the model drafting for the one request it gains most on, so
        that its calibrated acceptance and its measured seconds follow the text (both are learned
        only from its own drafts); backing off to MAX_EXPLORE_EVERY while explorations are not
        followed by chosen model drafts. `step_seconds`: the next step's priced seconds (None
        where no step costs were measured: no budget then)."""
        if any(chosen):
            self._skips, self._explore_every = 0, self.EXPLORE_EVERY
            return chosen
        wanted = [i for i, a in enumerate(fast_accept) if a is not None]
        if not wanted:
            return chosen
        self._skips += 1
        if step_seconds is not None:
            share = self.EXPLORE_SHARE * step_seconds
            self._explore_budget = min(self._explore_budget + share, share * self.MAX_EXPLORE_EVERY)
        if self._skips < self._explore_every or (step_seconds is not None and self._explore_budget < 0):
            return chosen
        self._skips, self._explore_every = 0, min(self.MAX_EXPLORE_EVERY, 2 * self._explore_every)
        self._exploring = True
        best = min(wanted, key=lambda i: sum(fast_accept[i]) - sum(chain))
        return [i == best for i in range(len(chosen))]

    def _charge_exploration(self, seconds: float) -> None:
        """An exploring call is paid from the budget whole, its catch-up included."""
        if self._exploring:
            self._explore_budget -= seconds
            self._exploring = False

    def _catch_up_per_step(self, inp: ProposerInput, chain: list[float]) -> list[float] | None:
        """Per request, what a model draft now costs in catching the drafter up (a draft model fed
        lazily: every token since the request last drafted), spread over the steps the request has
        left at the tokens a step emits with model drafts: a conversation's new turn is caught up
        once for the hundreds of tokens drafted after it, but at the tail of a batch a request
        with a few tokens to go paid a whole prompt's catch-up for them (a tenth of a batch-16
        run's seconds). The allocation's price of a drafting call leaves the catch-up out; this
        weighs it where it is decided. None for a drafter without catch-up."""
        seconds = getattr(self.drafter, "catch_up_seconds", None)
        if seconds is None:
            return None
        per_step = 1.0 + sum(chain)
        out = []
        for i, req in enumerate(inp.requests):
            limit = req.params.max_tokens
            if not inp.want_draft[i] or limit is None:
                out.append(0.0)
                continue
            steps_left = max(1.0, (limit - len(req.output_token_ids)) / per_step)
            out.append(seconds(inp, i) / steps_left)
        return out

    def _model_seconds(self, num_requests: int, num_spec_tokens: int) -> float:
        """Seconds the model drafter adds to a step by drafting for `num_requests` requests: its own
        estimate where it gives one (a draft model: its chain passes), else the measured whole call
        over a call that drafts for none."""
        own = getattr(self.drafter, "drafting_seconds", None)
        seconds = own(num_requests, num_spec_tokens) if own is not None else None
        return self.model_seconds.marginal(num_requests) if seconds is None else seconds

    def propose(self, inp: ProposerInput, kv_cache, block_size: int, num_spec_tokens: int):
        n = len(inp.requests)
        fast = self.fast.propose(inp, None, 0, self.fast_max_tokens) if num_spec_tokens > 0 else [None] * n
        use_model, k = self._model_requests(inp, fast, num_spec_tokens) if num_spec_tokens > 0 else ([False] * n, 0)
        t0 = time.perf_counter()
        model_drafts = self.drafter.propose(replace(inp, want_draft=use_model), kv_cache, block_size, k)
        seconds = time.perf_counter() - t0
        self._charge_exploration(seconds)
        self.last_catch_up_seconds = self.drafter.last_catch_up_seconds
        self.model_seconds.observe(sum(use_model), max(0.0, seconds - self.last_catch_up_seconds))
        return [m if use else f for use, f, m in zip(use_model, fast, model_drafts)]
