"""LLMEngine: owns the requests, the scheduler and detokenization; the Worker (worker/worker.py)
owns the model. `step()` advances every running request by one (speculative) step and reports what
changed."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from draftwise.config import EngineConfig, SpeculativeConfig
from draftwise.engine.detokenizer import IncrementalDetokenizer
from draftwise.engine.request import Request
from draftwise.engine.scheduler import RequestUpdate, Scheduler
from draftwise.inputs import tokenize_prompt
from draftwise.outputs import CompletionOutput, RequestOutput, SpecDecodingStats, TokenTrace
from draftwise.sampling_params import SamplingLimits, SamplingParams, validate
from draftwise.spec_decode.allocation import DraftAllocator, StepCosts
from draftwise.spec_decode.policy import SpeculationPolicy
from draftwise.spec_decode.proposer import NextStep
from draftwise.step import EngineFault, SchedulerOutput
from draftwise.structured_output import GrammarCompiler, RequestGrammar
from draftwise.worker.worker import Worker

logger = logging.getLogger("draftwise")


def freeze_startup_objects() -> None:
    """Move every object alive after start-up out of the cyclic garbage collector's reach.

    A loaded engine holds a few hundred thousand long-lived Python objects (the tokenizer's and the
    GGUF file's vocabulary, the modules); a full collection walks them all, ~0.2 s during which every
    running request stalls, and it comes round whenever enough objects have survived since the last
    one - sooner with a drafter that allocates every step (suffix decoding's indexes). Frozen,
    collections walk only what serving allocated (vLLM's engine core does the same). What an
    earlier engine of this process froze is unfrozen first, so one dropped since is collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class LLMEngine:
    """Requests, scheduling, detokenization and outputs; the Worker owns the model and runs the
    steps the scheduler decides."""

    def __init__(self, config: EngineConfig):
        self.worker = Worker(config)
        self.config = config = self.worker.config
        self.tokenizer, self.eos_token_ids = self.worker.tokenizer, self.worker.eos_token_ids
        self.vocab_size = self.worker.model_cfg.vocab_size
        self.limits = SamplingLimits(self.vocab_size, config.max_model_len)
        self.spec_config: SpeculativeConfig | None = config.speculative_config
        self.num_spec_tokens = self.spec_config.num_speculative_tokens if self.spec_config is not None else 0
        costs = self.worker.step_costs
        allocator = DraftAllocator(StepCosts(costs)) if costs is not None and self.spec_config.allocate_drafts else None
        self.scheduler = Scheduler(config, self.worker.num_kv_blocks, self.worker.lookahead, allocator)
        self.policy = None
        if self.spec_config is not None and self.spec_config.adaptive:
            self.policy = SpeculationPolicy(self.num_spec_tokens, prior_acceptance=self.worker.expected_acceptance)
            self.policy.set_step_costs(costs)
        self.spec_stats = SpecDecodingStats()
        self.spec_stats_by_source: dict[str, SpecDecodingStats] = {}
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self._inflight = None                 # async scheduling: (SchedulerOutput, Future) of the running step
        self._grammar_compiler = None
        self._pool = None
        freeze_startup_objects()

    def shutdown(self) -> None:
        """Finish an in-flight step and stop worker threads / tensor-parallel workers (idempotent)."""
        if self._inflight is not None:
            self._inflight[1].result()
            self._inflight = None
            self.scheduler.end_flight()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.worker.shutdown()

    # --- requests ----------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, longer than max_model_len={self.config.max_model_len} "
                             "allows (it must leave room for at least one new token)")
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.top_k >= vocab:           # keeping every token: the same as no top-k (as vLLM clamps)
            params = dataclasses.replace(params, top_k=-1)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        validate(params, self.limits)        # token ids against this model's vocabulary
        req = Request(rid, ids, params, text, self.eos_token_ids)
        if params.bad_words:
            req.bad_words_ids = self._bad_words_ids(params.bad_words)
        if params.structured_output is not None:
            req.grammar = RequestGrammar(self.compile_grammar(params.structured_output))
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, alone and after a space (as vLLM bans them)."""
        if self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer")
        out = []
        for w in words:
            for text in (w, " " + w.lstrip()):
                ids = self.tokenizer(text, add_special_tokens=False).input_ids
                if ids and ids not in out:
                    out.append(ids)
        return out

    def compile_grammar(self, spec):
        """The compiled grammar of a StructuredOutputParams (cached per spec; the server calls this
        on its prompt-preparation thread first, so the engine thread finds it compiled)."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_compiler.compile(spec)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; returns its final output (finish_reason "abort"), None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if not req.is_finished:
            self.scheduler.finish(req, "abort")
            self.worker.on_request_finished(req)
        return self._make_output(req, [], "")

    @property
    def fault(self) -> str | None:
        """Why the engine can no longer step (a tensor-parallel rank died), None while healthy."""
        return self.worker.fault

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # --- one step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.config.async_scheduling:
            return self._step_async()
        t0, fwd0 = time.perf_counter(), self.worker.timer.totals.get("target_forward", 0.0)
        draft0 = self.worker.timer.totals.get("drafting", 0.0)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return self._nothing_scheduled()
        try:
            step = self.worker.execute(sched)
        except EngineFault:
            raise
        except Exception as err:             # noqa: BLE001 - find whose fault it was
            return self._emit(self._isolate(sched, err))
        items = self._apply(sched, step)
        self._propose(sched, step)
        outputs = self._emit(items)
        allocator = self.scheduler.draft_allocator
        if allocator is not None:            # what this step cost, for the allocation's cost model
            # (drafting apart: the allocator weighs it separately, against skipping the drafter)
            fwd = self.worker.timer.totals.get("target_forward", 0.0) - fwd0
            drafting = self.worker.timer.totals.get("drafting", 0.0) - draft0
            allocator.costs.observe_step(sum(len(s.token_ids) for s in sched.scheduled), fwd,
                                         time.perf_counter() - t0 - fwd - drafting,
                                         sum(len(t) for t in step.new_token_ids))
        return outputs

    def _nothing_scheduled(self) -> list[RequestOutput]:
        if not self.scheduler.running and self.scheduler.waiting:
            raise RuntimeError("the KV pool cannot hold the next waiting request")
        return []

    # --- async scheduling -------------------------------------------------------------------------
    def _step_async(self) -> list[RequestOutput]:
        """One step with the model running on a worker thread (async scheduling).

        What overlaps with step n on the model thread: the KV blocks step n+1 may need are reserved
        for the worst case (every draft of step n accepted, the next draft at full length), and the
        outputs of step n-1 are detokenized and returned. Step n+1 itself is scheduled and its
        tensors built only once step n's accepted tokens are applied and the next drafts proposed,
        because those decide its token ids, positions and slots; it is then launched at once, before
        step n's outputs are detokenized. (Building step n+1 with provisional positions during step n
        and correcting them afterwards would also hide scheduling and input preparation; measured on
        CPU they are ~1-2 % of a step - the target's forward is 91-93 % - so it is not done.)
        Requests that finish while a step is in flight (a stop string, an abort) release their blocks
        when that step has completed; its results for them are dropped. Outputs are unchanged."""
        if self._inflight is None:
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                return self._nothing_scheduled()
            failed = self._launch(sched)
            if failed is not None:
                return self._emit(failed)
        sched, fut = self._inflight
        self.scheduler.reserve_ahead(sched, self.num_spec_tokens)
        try:
            step = fut.result()
        except Exception as err:             # noqa: BLE001 - the model thread failed: isolate, recover
            step = err
        finally:
            self._inflight = None
            self.scheduler.end_flight()
        if isinstance(step, EngineFault):
            raise step
        if isinstance(step, Exception):
            return self._emit(self._isolate(sched, step))
        items = self._apply(sched, step)
        self._propose(sched, step)
        nxt = self.scheduler.schedule()
        if nxt.scheduled:
            items += self._launch(nxt) or []
        return self._emit(items)

    def _launch(self, sched) -> list | None:
        """Start `sched` on the model thread; if preparing it fails, run it through `_isolate`
        instead and return those items."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="draftwise-model")
        try:
            inputs = self.worker.prepare(sched)      # tensors built here: the scheduler may move on
        except EngineFault:
            raise
        except Exception as err:                     # noqa: BLE001
            return self._isolate(sched, err)
        self.scheduler.begin_flight(sched)
        self._inflight = (sched, self._pool.submit(self.worker.run, inputs))
        return None

    # --- failure isolation ------------------------------------------------------------------------
    def _isolate(self, sched: SchedulerOutput, err: Exception) -> list[RequestUpdate]:
        """A step raised `err`. Run each of its requests in a step of its own, so that a failure
        attributable to one request (its sampling parameters, stop conditions, grammar ...) fails that
        request alone with a clear error while the others advance as usual. A step's K/V writes are
        positions the request had not yet computed, so re-running them is harmless. If several
        requests were in the step and every one of them fails on its own too, the fault is the
        engine's: `EngineFault` is raised and the caller decides (the server fails the batch and keeps
        serving)."""
        scheds = [s for s in sched.scheduled if not s.request.is_finished]
        logger.warning("a step of %d request(s) failed (%s: %s); running them one at a time",
                       len(scheds), type(err).__name__, err)
        items, failures = [], []
        for s in scheds:
            solo = SchedulerOutput([s])
            try:
                step = self.worker.execute(solo)
            except EngineFault:
                raise
            except Exception as e:               # noqa: BLE001
                failures.append((s.request, e))
                continue
            items += self._apply(solo, step)
            self._propose(solo, step)
        if len(scheds) > 1 and len(failures) == len(scheds):
            raise EngineFault(f"every request of the step failed: {type(err).__name__}: {err}") from err
        for req, e in failures:
            logger.error("request %s failed: %s: %s", req.request_id, type(e).__name__, e)
            items.append(self.scheduler.fail(req, f"{type(e).__name__}: {e}"))
        return items

    # --- the phases of a step ---------------------------------------------------------------------
    def _apply(self, sched: SchedulerOutput, step) -> list[RequestUpdate]:
        """Hand a step's result to the scheduler (it owns request state) and count drafts."""
        t0 = time.perf_counter()
        updates = self.scheduler.update_from_output(sched, step)
        for u in updates:
            if u.num_draft_tokens:
                self._observe_drafts(u)
        self.worker.timer.add("bookkeeping", time.perf_counter() - t0)
        self.num_steps += 1
        return updates

    def _observe_drafts(self, u: RequestUpdate) -> None:
        self.spec_stats.observe(u.num_draft_tokens, u.num_accepted)
        src = u.draft_source or self.spec_config.method
        self.spec_stats_by_source.setdefault(src, SpecDecodingStats()).observe(u.num_draft_tokens, u.num_accepted)
        if self.policy is not None and src == self.spec_config.method:
            # the policy sizes the model drafter: it learns from that drafter's drafts only
            self.policy.observe_acceptance(u.num_draft_tokens, u.num_accepted)

    def _propose(self, sched: SchedulerOutput, step) -> None:
        """Drafts for the next step (or none, where the adaptive policy says plain decoding pays)."""
        k = self.num_spec_tokens
        if self.policy is not None:
            k = self.policy.choose(len(self.scheduler.running))
        allocator = self.scheduler.draft_allocator
        # plain decoding this step: skip the drafter entirely (its KV for these positions goes
        # stale, which can only lower later acceptance, never change outputs)
        if self.policy is not None and k == 0:
            return
        limit = None                         # requests to draft for at most (None: every one)
        next_step = None
        if allocator is not None:
            shape = self.scheduler.next_step_shape()
            if not self.scheduler.must_draft():
                if not allocator.worth_drafting(*shape):
                    return
                limit = allocator.explore_requests
            next_step = NextStep(allocator, *shape)
        t_draft = time.perf_counter()
        try:
            drafts = self.worker.propose(step, k, limit, next_step)
        except Exception:                    # noqa: BLE001 - drafts only ever save time
            logger.exception("the drafter failed; this step's requests decode without drafts")
            return
        # a draft model's catch-up on tokens it was not fed step by step is left out of the price
        t_draft = max(0.0, time.perf_counter() - t_draft - self.worker.catch_up_seconds)
        if self.policy is not None:
            self.policy.observe_draft_time(len(sched.scheduled), k, t_draft)
        if allocator is not None:
            asked = len(sched.scheduled) if limit is None else min(limit, len(sched.scheduled))
            allocator.observe_drafting(t_draft, asked)
        self.scheduler.add_drafts(sched, drafts)

    def _emit(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """Detokenize (stop strings) and build the step's outputs."""
        t0 = time.perf_counter()
        outputs = []
        now = time.time()
        for u in updates:
            req = u.request
            new_text = self._detokenize(req, u)
            if req.is_finished:
                req.metrics.finished_time = now
            outputs.append(self._make_output(req, u.new_token_ids, new_text, u.new_logprobs))
        for o in outputs:
            if o.finished:
                req = self.requests.pop(o.request_id, None)
                if req is not None:
                    self.worker.on_request_finished(req)
        self.worker.timer.add("bookkeeping", time.perf_counter() - t0)
        return outputs

    def _detokenize(self, req: Request, u: RequestUpdate) -> str:
        """Append the text of the step's new tokens (incrementally: linear in the output) and apply
        stop strings; returns the text added by this step. Traced requests get a TokenTrace per
        token (the step's first `num_accepted` tokens are the accepted drafts)."""
        appended = u.new_token_ids
        if self.tokenizer is None:
            return ""
        if req.detokenizer is None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        old = req.text
        if req.spec_trace is None:
            text = old + req.detokenizer.add(appended)
        else:
            pieces = [req.detokenizer.add([t]) for t in appended]
            req.spec_trace.extend(TokenTrace(t, p, u.draft_source if j < u.num_accepted else None, req.num_steps - 1)
                                  for j, (t, p) in enumerate(zip(appended, pieces)))
            text = old + "".join(pieces)
        if req.params.stop and len(text) > len(old):
            search_from = max(0, len(old) - max(len(s) for s in req.params.stop) + 1)
            hits = [i for i in (text.find(s, search_from) for s in req.params.stop) if i >= 0]
            if hits:
                text = text[:min(hits)]
                if req.is_finished:
                    req.finish_reason = "stop"
                else:
                    self.scheduler.finish(req, "stop")
        req.text = text
        if req.spec_trace is not None and req.is_finished:
            req.spec_trace = trace_cut_to(req.spec_trace, len(text))
        return text[len(old):]

    def _make_output(self, req: Request, new_ids: list[int], new_text: str, new_lps=None) -> RequestOutput:
        lps = list(req.logprobs) if req.params.logprobs is not None else None
        comp = CompletionOutput(0, req.text, list(req.output_token_ids), req.finish_reason, lps, req.error,
                                req.spec_trace)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], req.is_finished,
                             req.metrics, new_token_ids=new_ids, new_text=new_text, new_logprobs=new_lps)

    # --- stats ----------------------------------------------------------------------------------------
    def get_metrics(self) -> dict:
        d = {"spec_decode": self.spec_stats.as_dict(),
             "spec_decode_by_source": {k: v.as_dict() for k, v in sorted(self.spec_stats_by_source.items())},
             "kv_blocks_used": self.scheduler.allocator.num_used,
             "kv_blocks_total": self.scheduler.allocator.num_blocks,
             "prefix_cache": self.scheduler.allocator.stats(),
             "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
             "num_steps": self.num_steps,
             "step_time_s": dict(self.worker.timer.totals)}
        if self.policy is not None:
            d["speculation_policy"] = self.policy.table()
        if self.scheduler.draft_allocator is not None:
            d["draft_allocation"] = self.scheduler.draft_allocator.table()
        return d


def trace_cut_to(trace: list[TokenTrace], num_chars: int) -> list[TokenTrace]:
    """A copy of `trace` whose texts concatenate to the first `num_chars` characters of theirs
    (a stop string cut the output text; the tokens behind the cut stay, with empty text). A new
    list: outputs already handed out keep the one they were given."""
    out, left = [], num_chars
    for e in trace:
        keep = e.text[:max(left, 0)]
        left -= len(e.text)
        out.append(e if keep == e.text else TokenTrace(e.token_id, keep, e.source, e.step))
    return out
