"""Continuous-batching scheduler (vLLM-v1 style token accounting).

Every step each running request is given `num_tokens + len(draft) - num_computed_tokens`
new tokens (a prefill chunk, one decode token, or 1 + K verification tokens) within a per-step
token budget; waiting requests are admitted while sequences, budget and KV blocks allow. When the
pool runs out, the newest running request is preempted (its blocks freed, recomputed later).

The step contract: `schedule()` -> SchedulerOutput (what runs, each request with its draft) ->
the model runner's ModelRunnerOutput (accepted drafts + sampled token per request) ->
`update_from_output()`, which alone changes request state; the next step's drafts come back
through `add_drafts()`. The scheduler is tested with hand-built outputs, no model.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from draftwise.config import EngineConfig
from draftwise.engine.kv_cache import BlockAllocator, block_hashes
from draftwise.engine.request import Request, RequestStatus
from draftwise.spec_decode.allocation import DraftAllocator, agreement_level, updated_agreement, watched_outcome
from draftwise.spec_decode.draft import Draft
from draftwise.step import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from draftwise.step import ModelRunnerOutput


def keeps_whole_drafts(req: Request) -> bool:
    """Seeded sampled requests are exempt from draft allocation (and from skipped drafting): the
    drafts they verify decide the random numbers they draw, so their tokens must not depend on
    measured step costs."""
    return req.params.seed is not None and not req.params.greedy


@dataclass
class RequestUpdate:
    """What a step changed for one request that produced tokens (Scheduler.update_from_output)."""
    request: Request
    new_token_ids: list[int]            # appended to the output (cut at a stop condition)
    new_logprobs: list | None           # TokenLogprob per appended token, when asked for
    num_draft_tokens: int = 0           # drafts verified this step
    num_accepted: int = 0               # of which accepted and emitted (a stop condition may cut them)
    draft_source: str | None = None     # the drafter that made them


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, num_lookahead_tokens: int = 0,
                 draft_allocator: DraftAllocator | None = None):
        self.config = config
        # how much of each draft a step verifies (spec_decode/allocation.py); None: whole drafts
        self.draft_allocator = draft_allocator
        # drafts the allocation cut whole, by request id: (draft, index of the token its first node
        # predicts, the exploration that made it or 0), compared with the tokens the target emits
        self._watched: dict[str, tuple[Draft, int, int]] = {}
        self.block_size = config.block_size
        self.allocator = BlockAllocator(num_blocks, enable_caching=config.enable_prefix_caching)
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_blocks_per_seq = math.ceil((config.max_model_len + num_lookahead_tokens + 1) / self.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # async scheduling: requests of the step in flight, and blocks whose release waits for it
        self.in_flight: set[int] = set()
        self._deferred: list[list[int]] = []
        if self.max_blocks_per_seq > num_blocks:
            raise ValueError(f"KV pool of {num_blocks} blocks cannot hold one sequence of max_model_len="
                             f"{config.max_model_len} (needs {self.max_blocks_per_seq})")

    # --- queue management --------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str) -> None:
        if req.status == RequestStatus.FINISHED:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.draft = None
        if req.request_id in self._watched:
            self._check_watched(req, complete=True)
        self._free(req)
        if req in self.running:
            self.running.remove(req)
        try:
            self.waiting.remove(req)
        except ValueError:
            pass

    def _free(self, req: Request) -> None:
        if id(req) in self.in_flight:          # the running step still writes these blocks
            self._deferred.append(req.block_ids)
        else:
            self.allocator.free(req.block_ids)
        req.block_ids = []
        req.block_hashes = []

    # --- async scheduling -------------------------------------------------------------------------
    def begin_flight(self, out: "SchedulerOutput") -> None:
        self.in_flight = {id(s.request) for s in out.scheduled}

    def end_flight(self) -> None:
        self.in_flight = set()
        for blocks in self._deferred:
            self.allocator.free(blocks)
        self._deferred = []

    def reserve_ahead(self, out: "SchedulerOutput", max_draft: int) -> None:
        """While `out` runs: allocate the blocks its continuing requests need next step in the worst
        case (all drafts accepted, then 1 + max_draft tokens and the lookahead). Only free blocks
        are taken - nothing is preempted while a step is in flight; the regular schedule() after the
        step covers whatever could not be reserved."""
        for s in out.scheduled:
            req = s.request
            if req.is_finished or not s.completes_prompt:
                continue
            need = s.start_pos + s.num_new_tokens + 1 + max_draft + self.num_lookahead_tokens
            blocks = min(math.ceil(need / self.block_size), self.max_blocks_per_seq) - len(req.block_ids)
            if 0 < blocks <= self.allocator.num_free:
                req.block_ids.extend(self.allocator.allocate(blocks))

    def _prefix_hits(self, req: Request) -> tuple[list[int], list[int]]:
        """(cached blocks, their hashes) for the longest cached prefix of a request that has computed
        nothing yet; at least its last token is left to compute (it yields the first logits)."""
        if not self.allocator.enable_caching or req.num_computed_tokens:
            return [], []
        hashes = block_hashes(req.all_token_ids, self.block_size, (req.num_tokens - 1) // self.block_size)
        hits = self.allocator.lookup(hashes, req.all_token_ids, self.block_size)
        return hits, hashes[:len(hits)]

    def _register_full_blocks(self, req: Request, token_ids: list[int], num_computed: int) -> None:
        """Cache the request's newly full blocks among its first `num_computed` (computed) tokens
        under their chained hashes."""
        n_full = min(num_computed // self.block_size, len(req.block_ids))
        have = len(req.block_hashes)
        if not self.allocator.enable_caching or n_full <= have:
            return
        new = block_hashes(token_ids, self.block_size, n_full, have, req.block_hashes[-1] if have else None)
        bs = self.block_size
        for i, h in zip(range(have, n_full), new):
            self.allocator.cache_block(req.block_ids[i], h, token_ids[i * bs:(i + 1) * bs])
        req.block_hashes.extend(new)

    def _ensure_blocks(self, req: Request, num_tokens: int) -> bool:
        need = min(math.ceil(num_tokens / self.block_size), self.max_blocks_per_seq) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        req.block_ids.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, req: Request) -> None:
        self._free(req)
        req.num_computed_tokens = 0
        req.draft = None
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    # --- one step ----------------------------------------------------------------------------
    def must_draft(self) -> bool:
        """Whether a running request's drafts may not be skipped (keeps_whole_drafts; such requests
        get drafts only where the configuration drafts for seeded sampling)."""
        spec = self.config.speculative_config
        return bool(spec is not None and spec.draft_seeded_sampling and any(keeps_whole_drafts(r) for r in self.running))

    def next_step_shape(self, budget: int | None = None) -> tuple[int, int, int]:
        """(tokens besides drafts, requests that sample a token, decode tokens) of the next step
        as it stands: every running request's pending tokens (one in decode), and the prefill a
        waiting request would add, within the token budget."""
        budget = self.config.max_num_batched_tokens if budget is None else budget
        pending = [r.num_tokens - r.num_computed_tokens for r in self.running]
        fixed = min(budget, sum(pending))
        sampled = sum(1 for n in pending if n <= 1)
        if self.waiting and len(self.running) < self.config.max_num_seqs:
            fixed = min(budget, fixed + sum(r.num_tokens - r.num_computed_tokens for r in self.waiting))
        return fixed, sampled, sampled

    def _allocate_drafts(self, budget: int) -> None:
        """Cut the running requests' drafts to the lengths that maximise the step's expected
        emitted tokens per second (spec_decode/allocation.py), counting the step's other tokens:
        every running request's pending tokens and the prefill a waiting request would add."""
        running = self.running
        if not any(r.draft for r in running):
            return
        fixed, sampled, decode = self.next_step_shape(budget)
        # a seeded sampled request verifies its whole draft: how many drafts it verifies decides
        # which random numbers it draws, and its seed must give the same tokens on every run
        for r in running:
            if r.draft is not None:
                r.draft.level = agreement_level(r.draft_agreement)
        pinned = [r.draft is not None and keeps_whole_drafts(r) for r in running]
        whole = [r.draft for r, pin in zip(running, pinned) if pin]
        drafts = [None if pin else r.draft for r, pin in zip(running, pinned)]
        lengths = self.draft_allocator.choose(drafts, fixed, sampled, whole, decode)
        for r, d, k in zip(running, drafts, lengths):
            if not d:
                continue
            r.draft = d.truncated(k) if k else None
            if not k and d.is_chain and r.request_id not in self._watched:
                # not verified: the tokens the target emits next tell whether it would have been
                self._watched[r.request_id] = (d, r.num_tokens, self.draft_allocator.explored)

    def _check_watched(self, req: Request, complete: bool = False) -> None:
        """Hand a watched draft's outcome to the allocation once the emitted tokens decide it."""
        draft, start, exploration = self._watched[req.request_id]
        verdict = watched_outcome(draft, req.all_token_ids[start:start + len(draft)], complete)
        if verdict is not None or complete:
            del self._watched[req.request_id]
        if verdict is not None:
            self.draft_allocator.observe_watched(*verdict, exploration)
            req.draft_agreement = updated_agreement(req.draft_agreement, verdict[1] > 0)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.draft_allocator is not None:
            self._allocate_drafts(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n_prefix = req.num_tokens - req.num_computed_tokens
            n_draft = len(req.draft) if req.draft is not None else 0
            if n_prefix + n_draft > budget:          # cut the draft first (its first nodes stay valid)
                n_draft = max(0, budget - n_prefix)
                n_prefix = min(n_prefix, budget)
            lookahead = self.num_lookahead_tokens if (n_prefix + req.num_computed_tokens >= req.num_tokens) else 0
            need = req.num_computed_tokens + n_prefix + n_draft + lookahead
            ok = self._ensure_blocks(req, need)
            preempted_self = False
            while not ok:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    preempted_self = True
                    break
                ok = self._ensure_blocks(req, need)
            if preempted_self:
                break
            toks = req.all_token_ids[req.num_computed_tokens:req.num_computed_tokens + n_prefix]
            draft = req.draft.truncated(n_draft) if n_draft else None
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens,
                                                  toks + (draft.token_ids if draft else []), n_draft, draft))
            budget -= n_prefix + n_draft
            i += 1
        if out.preempted:
            return out
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            req = self.waiting[0]
            hits, hashes = self._prefix_hits(req)
            computed = req.num_computed_tokens + len(hits) * self.block_size
            n = min(req.num_tokens - computed, budget)
            lookahead = self.num_lookahead_tokens if computed + n >= req.num_tokens else 0
            total = min(math.ceil((computed + n + lookahead) / self.block_size), self.max_blocks_per_seq)
            if total - len(req.block_ids) - len(hits) > self.allocator.num_free_after_touch(hits):
                break
            if self.allocator.enable_caching and req.num_computed_tokens == 0:
                self.allocator.record_lookup(req.num_tokens, len(hits) * self.block_size)
            if hits:
                self.allocator.touch(hits)
                req.block_ids = hits + req.block_ids
                req.block_hashes = list(hashes)
                req.num_computed_tokens = computed
            self._ensure_blocks(req, computed + n + lookahead)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, computed, req.all_token_ids[computed:computed + n], 0))
            budget -= n
        return out

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        """Apply a step's result (a ModelRunnerOutput: per scheduled request the accepted drafts and
        the sampled token, the accepted count, logprobs) to the requests: computed tokens, output
        tokens cut at a stop condition, finished requests, per-request metrics. Returns an update per
        request that produced tokens; prefill chunks that sample nothing are only accounted."""
        updates = []
        now = time.time()
        for s, new, acc, lps in zip(out.scheduled, result.new_token_ids, result.num_accepted, result.logprobs):
            req = s.request
            if req.is_finished:                 # finished (stop string, abort) while the step ran
                continue
            appended = self._update(s, new, acc)
            if not new:
                continue
            if req.request_id in self._watched:
                self._check_watched(req)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.num_steps += 1
            # accepted drafts that were emitted (a stop condition may cut inside them)
            num_verified, acc = acc, min(acc, len(appended))
            if s.num_draft_tokens:
                req.metrics.observe(s.num_draft_tokens, acc)
                if self.draft_allocator is not None:
                    self.draft_allocator.observe(s.draft, num_verified)
                    req.draft_agreement = updated_agreement(req.draft_agreement, num_verified > 0)
            new_lps = None
            if lps is not None:
                new_lps = lps[:len(appended)]
                req.logprobs.extend(new_lps)
            updates.append(RequestUpdate(req, appended, new_lps, s.num_draft_tokens, acc,
                                         s.draft.source if s.draft is not None else None))
        return updates

    def add_drafts(self, out: SchedulerOutput, drafts: list[Draft | None]) -> None:
        """Install the drafts proposed after step `out` for the next step (requests still running)."""
        for s, d in zip(out.scheduled, drafts):
            req = s.request
            if d and req.grammar is not None:
                d = req.grammar.valid_draft(d)       # no compute on tokens the grammar forbids
            if d and not req.is_finished:
                req.draft = d

    def fail(self, req: Request, error: str) -> RequestUpdate:
        """End a request whose step failed on its own account (finish_reason "error")."""
        req.error = error
        self.finish(req, "error")
        return RequestUpdate(req, [], None)

    def _update(self, sched: ScheduledRequest, new_token_ids: list[int], num_accepted: int) -> list[int]:
        """Account for one request's result: `new_token_ids` are the accepted drafts followed by the
        one sampled token (empty for an unfinished prefill chunk). Returns the tokens actually
        appended (cut at a stop condition)."""
        req = sched.request
        req.num_computed_tokens = sched.start_pos + sched.num_prefix_tokens + num_accepted
        req.draft = None
        appended, reason = [], None
        p = req.params
        for tok in new_token_ids:
            req.append_output(tok)
            appended.append(tok)
            if tok in req.eos_token_ids or tok in p.stop_token_ids:
                reason = "stop"
                break
            if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
                reason = "length"
                break
        if req.grammar is not None:
            req.grammar.accept(appended)
            if reason is None and req.grammar.terminated:     # the grammar is complete
                reason = "stop"
        if self.allocator.enable_caching:
            # cache only the blocks plain decoding would have computed: the final sequence but its
            # last token. Accepted drafts cut at a stop condition have K/V too, but caching them would
            # make a later request's prefix hits (and, on a quantized target, whether a token's K/V
            # comes from a decode row or a prefill row) depend on speculation.
            self._register_full_blocks(req, req.all_token_ids, min(req.num_computed_tokens, req.num_tokens - 1))
        if reason is not None:
            self.finish(req, reason)
        return appended
