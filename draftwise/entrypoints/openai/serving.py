"""Serving logic of the OpenAI-compatible server: the engine thread, request -> SamplingParams,
output -> response objects (logprobs, usage with per-request speculative-decoding counters), and
the Prometheus metrics.

One engine thread owns the `LLMEngine` and is the only caller of add_request / step / abort_request.
HTTP handlers (on the asyncio loop) put a submission on a thread-safe inbox and await a per-request
`asyncio.Queue`; the engine thread drains the inbox, runs `engine.step()` while there is work
(continuous batching across every connection) and hands each step's outputs back with
`loop.call_soon_threadsafe`."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from draftwise.entrypoints.openai import protocol as P
from draftwise.entrypoints.openai.errors import APIError
from draftwise.sampling_params import (InvalidSamplingParams, SamplingLimits, SamplingParams,
                                       StructuredOutputParams, validate)

logger = logging.getLogger("draftwise.serve")

COMPLETION_DEFAULT_MAX_TOKENS = 16        # OpenAI's default for /v1/completions


# the draft allocation's cumulative counts exported on /metrics (`DraftAllocator.table()` keys)
ALLOCATION_COUNTERS = {
    "steps": "Steps the draft allocation chose for",
    "steps_without_drafting": "Steps whose drafting was skipped",
    "draft_tokens_offered": "Draft tokens the drafters proposed",
    "draft_tokens_kept": "Draft tokens the allocation kept to verify",
    "drafts_watched": "Drafts cut whole and compared with the tokens emitted next",
}


class ServerMetrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = r = CollectorRegistry()
        self.requests = Counter("draftwise_requests", "Requests by outcome (stop, length, abort, "
                                "rejected, unauthorized, unavailable, error)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("draftwise_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("draftwise_generation_tokens", "Generated tokens", registry=r)
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram("draftwise_time_to_first_token_seconds", "Time to first token (from arrival)",
                              buckets=lat, registry=r)
        self.tpot = Histogram("draftwise_time_per_output_token_seconds", "Mean time per output token after "
                              "the first, per request",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.5),
                              registry=r)
        self.e2e = Histogram("draftwise_e2e_request_latency_seconds", "Arrival to last token", buckets=lat,
                             registry=r)
        self.running = Gauge("draftwise_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("draftwise_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_used = Gauge("draftwise_kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_total = Gauge("draftwise_kv_blocks_total", "KV-cache blocks in the pool", registry=r)
        self.drafts = Counter("draftwise_spec_decode_num_drafts", "Draft proposals verified", registry=r)
        self.draft_tokens = Counter("draftwise_spec_decode_num_draft_tokens", "Draft tokens verified",
                                    registry=r)
        self.accepted_tokens = Counter("draftwise_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.accepted_per_pos = Counter("draftwise_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"],
                                        registry=r)
        self.prefix_queries = Counter("draftwise_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache", registry=r)
        self.prefix_hits = Counter("draftwise_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=r)
        self.prefix_hit_rate = Gauge("draftwise_prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens, "
                                     "since start)", registry=r)
        # the draft allocation's choices (absent without speculation): the counters of its table
        # and the cost model's state, so an operator sees whether the server drafts under load
        self.allocation = {key: Counter(f"draftwise_draft_allocation_{key}", doc, registry=r)
                           for key, doc in ALLOCATION_COUNTERS.items()}
        self.step_cost_scale = Gauge("draftwise_draft_allocation_step_cost_scale", "Served step seconds over "
                                     "the start-up table's (decayed)", registry=r)
        self.step_overhead = Gauge("draftwise_draft_allocation_step_overhead_seconds", "A step's fixed seconds "
                                   "around its forward, as the allocation prices them", registry=r)
        self._last: dict[str, int] = {}
        self._last_pos: list[int] = []

    def observe_engine(self, m: dict) -> None:
        """Called on the engine thread with `engine.get_metrics()`."""
        self.running.set(m.get("num_running", 0))
        self.waiting.set(m.get("num_waiting", 0))
        self.kv_used.set(m.get("kv_blocks_used", 0))
        self.kv_total.set(m.get("kv_blocks_total", 0))
        pc = m.get("prefix_cache") or {}
        for key, counter in (("queries", self.prefix_queries), ("hits", self.prefix_hits)):
            self._advance(counter, "prefix_" + key, pc.get(key, 0))
        self.prefix_hit_rate.set(pc.get("hit_rate", 0.0))
        spec = m.get("spec_decode") or {}
        for key, counter in (("num_drafts", self.drafts), ("num_draft_tokens", self.draft_tokens),
                             ("num_accepted_tokens", self.accepted_tokens)):
            self._advance(counter, key, spec.get(key, 0))
        alloc = m.get("draft_allocation") or {}
        for key, counter in self.allocation.items():
            self._advance(counter, "allocation_" + key, alloc.get(key, 0))
        if alloc:
            self.step_cost_scale.set(alloc.get("step_cost_scale", 1.0))
            self.step_overhead.set(alloc.get("step_overhead_ms", 0.0) / 1000)
        pos = list(spec.get("accepted_per_position") or [])
        for i, v in enumerate(pos):
            last = self._last_pos[i] if i < len(self._last_pos) else 0
            child = self.accepted_per_pos.labels(position=str(i))   # creates the series at 0
            if v > last:
                child.inc(v - last)
        self._last_pos = pos

    def _advance(self, counter, key: str, value) -> None:
        """Move `counter` on to the engine's cumulative `value` (engines count from their start)."""
        v = int(value)
        if v > self._last.get(key, 0):
            counter.inc(v - self._last.get(key, 0))
        self._last[key] = v

    def observe_finished(self, sub: "Submission", out, now: float) -> None:
        """A request finished: its outcome, tokens, and latencies since its arrival."""
        comp = out.outputs[0]
        n = len(comp.token_ids)
        self.requests.labels(outcome=comp.finish_reason or "stop").inc()
        self.generation_tokens.inc(n)
        if sub.first_token_time is not None:
            self.ttft.observe(max(0.0, sub.first_token_time - sub.arrival))
            if n > 1:
                self.tpot.observe(max(0.0, now - sub.first_token_time) / (n - 1))
        self.e2e.observe(max(0.0, now - sub.arrival))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@dataclass
class Submission:
    request_id: str
    prompt: str | None                   # the prompt text (None for token-id prompts)
    prompt_token_ids: list[int]          # tokenized off the engine thread (`prepare_prompt`)
    sampling: dict                       # SamplingParams kwargs (max_tokens may be None)
    default_max_tokens: int              # max_tokens when the request gave none (fits the context)
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.time)
    first_token_time: float | None = None
    session_id: str | None = None        # routing affinity across replicas (x-session-id or `user`)
    stream: bool = True                  # False: partial outputs never reach the client (retry-safe)


_STOP = object()


class EngineLoop:
    """Runs `engine.step()` on one background thread for every connection."""

    def __init__(self, llm, metrics: ServerMetrics | None = None, idle_poll_s: float = 0.5,
                 max_num_queued_requests: int | None = None):
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        # admission control: requests beyond the running batch that may wait (None: no limit)
        self.max_num_queued_requests = max_num_queued_requests
        self.idle_poll_s = idle_poll_s
        self._inbox: queue.Queue = queue.Queue()
        self._subs: dict[str, Submission] = {}     # engine thread only
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._closed = False                         # no more submissions (stopping or crashed)
        self.fatal_error: BaseException | None = None
        self.engine_metrics: dict = {}               # the engine's gauges and counters, as of the last step

    # --- called from the event loop / any thread ---------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="draftwise-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed and self.fault is None

    @property
    def fault(self) -> str | None:
        """Why the engine cannot step any more (e.g. a tensor-parallel rank died), None if healthy."""
        return getattr(self.engine, "fault", None)

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._closed = True
            self._inbox.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.1fs", timeout)

    @property
    def num_outstanding(self) -> int:
        """Requests admitted or on their way to the engine (approximate when read off-thread)."""
        return len(self._subs) + self._inbox.qsize()

    @property
    def is_idle(self) -> bool:
        return not self._subs and self._inbox.empty()

    async def submit(self, sub: Submission) -> asyncio.Queue:
        """Queue a request; returns its output queue once the engine accepted it (raises APIError)."""
        with self._lock:               # either the engine thread will answer, or we refuse here
            if self._closed or not self.alive:
                why = f": {self.fault}" if self.fault else ""
                raise APIError(f"the engine is not running{why}", 503, type="server_error",
                               code="engine_unavailable")
            limit = self.max_num_queued_requests
            if limit is not None and self.num_outstanding >= self.engine.config.max_num_seqs + limit:
                if self.metrics:
                    self.metrics.requests.labels(outcome="overloaded").inc()
                raise APIError(f"the server is at capacity ({self.engine.config.max_num_seqs} running and {limit} "
                               "queued requests); retry later", 429, type="server_error", code="overloaded")
            self._inbox.put(("add", sub))
        kind, payload = await sub.queue.get()
        if kind == "error":
            raise payload
        return sub.queue

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # --- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        import torch
        torch.set_grad_enabled(False)
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                try:
                    first = self._inbox.get_nowait() if busy else self._inbox.get(timeout=self.idle_poll_s)
                    cmds = [first]
                except queue.Empty:
                    cmds = []
                while True:
                    try:
                        cmds.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if any(c is _STOP for c in cmds):
                    self._shutdown_requests([c for c in cmds if c is not _STOP])
                    return
                for kind, payload in cmds:
                    if kind == "add":
                        self._add(payload)
                    elif kind == "abort":
                        self._abort(payload)
                if self.engine.has_unfinished_requests():
                    self._step()
                if cmds or busy:
                    self._publish_metrics()
                if busy and not self.engine.has_unfinished_requests():
                    release_free_memory()      # idle again: hand a large prompt's buffers back
        except BaseException as e:     # never leave handlers waiting forever
            self.fatal_error = e
            logger.exception("engine thread crashed")
            with self._lock:
                self._closed = True
            err = APIError(f"engine failure: {e}", 500, type="server_error")
            self._fail_all(err)
            self._reject_pending([], err)
        finally:
            self._stopped.set()

    def _deliver(self, items: list[tuple[Submission, tuple]]) -> None:
        if not items:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for sub, item in items:
            by_loop.setdefault(sub.loop, []).append((sub.queue, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:       # the event loop is closed: nobody is listening anymore
                pass

    def _add(self, sub: Submission) -> None:
        try:
            params = sampling_params(sub.sampling, sub.default_max_tokens)
            self.engine.add_request({"prompt_token_ids": sub.prompt_token_ids, "prompt": sub.prompt}, params,
                                    request_id=sub.request_id)
        except APIError as e:
            self._reject(sub, e)
            return
        except InvalidSamplingParams as e:
            self._reject(sub, APIError(str(e), param=e.param, code=e.code))
            return
        except (ValueError, TypeError) as e:
            self._reject(sub, APIError(str(e)))
            return
        except Exception as e:         # noqa: BLE001
            logger.exception("add_request failed")
            self._reject(sub, APIError(f"internal error: {type(e).__name__}", 500, type="server_error"),
                         outcome="error")
            return
        ids = sub.prompt_token_ids
        self._subs[sub.request_id] = sub
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(ids))
        self._deliver([(sub, ("accepted", None))])

    def _reject(self, sub: Submission, err: APIError, outcome: str = "rejected") -> None:
        if self.metrics:
            self.metrics.requests.labels(outcome=outcome).inc()
        self._deliver([(sub, ("error", err))])

    def _abort(self, request_id: str) -> None:
        sub = self._subs.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:              # noqa: BLE001
            logger.exception("abort_request(%s) failed", request_id)
        if sub is not None:
            logger.info("request %s aborted (client went away)", request_id)
            if self.metrics:
                self.metrics.requests.labels(outcome="abort").inc()

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:         # noqa: BLE001 - fail the running requests, keep serving
            logger.exception("engine.step() failed; failing %d request(s)", len(self._subs))
            self._fail_all(APIError(f"internal engine error: {e}", 500, type="server_error"))
            return
        now = time.time()
        items = []
        for out in outs:
            sub = self._subs.get(out.request_id)
            if sub is None:
                continue
            if sub.first_token_time is None and out.new_token_ids:
                sub.first_token_time = now
            if out.outputs[0].finish_reason == "error":     # this request alone failed
                del self._subs[out.request_id]
                if self.metrics:
                    self.metrics.requests.labels(outcome="error").inc()
                items.append((sub, ("error", APIError(f"the request failed: {out.outputs[0].error}", 500,
                                                      type="server_error", code="request_failed"))))
                continue
            items.append((sub, ("output", out)))
            if out.finished:
                del self._subs[out.request_id]
                if self.metrics:
                    self.metrics.observe_finished(sub, out, now)
        self._deliver(items)

    def _fail_all(self, err: APIError) -> None:
        """Abort every admitted request and send it `err`."""
        subs = list(self._subs.values())
        self._subs.clear()
        for sub in subs:
            try:
                self.engine.abort_request(sub.request_id)
            except Exception:          # noqa: BLE001
                pass
            if self.metrics:
                self.metrics.requests.labels(outcome="error").inc()
        self._deliver([(s, ("error", err)) for s in subs])

    def _reject_pending(self, cmds: list, err: APIError) -> None:
        """Answer every submission in `cmds` and in the inbox with `err` (the thread is going away;
        `_closed` is set, so nothing more can be queued after this)."""
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        items = [(c[1], ("error", err)) for c in cmds if c is not _STOP and c[0] == "add"]
        if self.metrics:
            for _ in items:
                self.metrics.requests.labels(outcome="unavailable").inc()
        self._deliver(items)

    def _shutdown_requests(self, cmds: list) -> None:
        """The drain ran out of time: every unfinished request ends now. Each gets its partial output
        with finish_reason "abort" (a stream turns it into an error event and [DONE])."""
        err = APIError("the server is shutting down", 503, type="server_error", code="shutting_down")
        if self._subs:
            logger.warning("stopping the engine with %d unfinished request(s)", len(self._subs))
        items = []
        for rid, sub in list(self._subs.items()):
            try:
                out = self.engine.abort_request(rid)
            except Exception:          # noqa: BLE001
                out = None
            items.append((sub, ("shutdown", out) if out is not None else ("error", err)))
            if self.metrics:
                self.metrics.requests.labels(outcome="abort").inc()
        self._subs.clear()
        self._deliver(items)
        self._reject_pending(cmds, err)
        self._publish_metrics()

    def _publish_metrics(self) -> None:
        try:
            self.engine_metrics = self.engine.get_metrics()
            if self.metrics is not None:
                self.metrics.observe_engine(self.engine_metrics)
        except Exception:              # noqa: BLE001
            logger.exception("reading engine metrics failed")


def release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc keeps it in its arenas otherwise, so a server's RSS
    would stay at the high-water mark of its largest prefill). A no-op off glibc."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def _put_all(batch) -> None:
    for q, item in batch:
        q.put_nowait(item)


# ---------------------------------------------------------------------------------------------------
# request -> submission
# ---------------------------------------------------------------------------------------------------
def sampling_kwargs(req: P.SamplingRequest, chat: bool, defaults: dict | None = None) -> dict:
    """SamplingParams kwargs (max_tokens may be None: filled in against the prompt length). The
    model's generation_config.json defaults (`defaults`) fill the sampling fields the request left
    out, as vLLM's server does; a request's own values win."""
    max_tokens = req.max_tokens
    if chat and max_tokens is None:
        max_tokens = req.max_completion_tokens
    kw = {"max_tokens": max_tokens, "temperature": float(req.temperature), "top_p": float(req.top_p),
          "top_k": req.top_k, "seed": req.seed, "stop": req.stop_list(), "ignore_eos": req.ignore_eos,
          "speculate": req.speculate, "spec_trace": req.wants_spec_trace(),
          "presence_penalty": float(req.presence_penalty), "frequency_penalty": float(req.frequency_penalty),
          "repetition_penalty": float(req.repetition_penalty), "min_p": float(req.min_p),
          # JSON keys are strings: digits become token ids, anything else is left for validate to refuse
          "logit_bias": {int(k) if k.isdigit() else k: float(v) for k, v in req.logit_bias.items()}
          if req.logit_bias else None,
          "min_tokens": req.min_tokens, "bad_words": req.bad_words, "allowed_token_ids": req.allowed_token_ids,
          "logprobs": req.num_logprobs() if chat else req.logprobs}
    for key, value in (defaults or {}).items():
        if key in kw and key not in req.model_fields_set:
            kw[key] = value
    spec = None
    try:
        spec = req.structured_output_spec()
        if spec is not None:
            kw["structured_output"] = StructuredOutputParams(**spec[1])
    except ValueError as e:
        raise APIError(str(e), param=spec[0] if spec else "response_format", code="invalid_value") from None
    sampling_params(kw, 1)             # the fields' own ranges now; the prompt's length once tokenized
    return kw


def sampling_params(kw: dict, max_tokens: int, limits: SamplingLimits | None = None,
                    prompt_len: int | None = None) -> SamplingParams:
    """SamplingParams from a request's kwargs (`max_tokens` where the request gave none), checked by
    `validate` against the model's limits; its InvalidSamplingParams becomes a 400 naming the field."""
    try:
        params = SamplingParams(**{**kw, "max_tokens": kw.get("max_tokens") or max_tokens})
        validate(params, limits, prompt_len)
    except InvalidSamplingParams as e:
        raise APIError(str(e), param=e.param, code=e.code) from None
    return params


class PromptPreparer:
    """Chat template + tokenization + context-length checks, run on a worker thread (never the
    engine thread: a huge prompt must not stall everyone's decoding). One lock serialises tokenizer
    calls (Hugging Face tokenizers mutate their padding / truncation state per call)."""

    def __init__(self, frontend, max_prompt_chars: int):
        self.frontend = frontend
        self.max_prompt_chars = max_prompt_chars
        self.lock = threading.Lock()

    def __call__(self, prompt, messages, sampling: dict, default_max_tokens: int | None):
        """-> (prompt text or None, token ids, max_tokens when none is given). Raises APIError."""
        fe = self.frontend
        max_len = fe.max_model_len
        param = "messages" if messages is not None else "prompt"
        with self.lock:
            try:
                if messages is not None:
                    prompt = fe.apply_chat_template(messages)
                if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
                    # far more characters than the context can hold tokens: refuse before tokenizing
                    raise APIError(f"This model's maximum context length is {max_len} tokens, but the prompt "
                                   f"has {len(prompt)} characters (at least {len(prompt) // 16} tokens).",
                                   param=param, code="context_length_exceeded")
                text, ids = fe.tokenize_prompt(prompt)
            except APIError:
                raise
            except (ValueError, TypeError) as e:
                raise APIError(str(e), param=param) from None
            except Exception as e:      # noqa: BLE001
                if type(e).__module__.startswith("jinja2"):      # e.g. raise_exception() in a chat template
                    raise APIError(f"chat template error: {e}", param="messages") from None
                logger.exception("preparing a prompt failed")
                raise APIError(f"could not tokenize the {param}: {type(e).__name__}", param=param) from None
        if not ids:
            raise APIError("the prompt is empty", param=param)
        if sampling.get("structured_output") is not None:
            try:                      # compiled here, off the engine thread (the engine finds it cached)
                fe.compile_grammar(sampling["structured_output"])
            except ValueError as e:
                raise APIError(str(e), param="response_format", code="invalid_value") from None
        if len(ids) >= max_len:
            raise APIError(f"This model's maximum context length is {max_len} tokens, but the prompt has "
                           f"{len(ids)} tokens (it must leave room for at least one new token).",
                           param=param, code="context_length_exceeded")
        vocab = fe.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(f"prompt token ids must be in [0, {vocab})", param=param, code="invalid_value")
        room = max_len - len(ids)
        default = room if default_max_tokens is None else min(default_max_tokens, room)
        sampling_params(sampling, default, SamplingLimits(vocab, max_len), len(ids))
        return text, ids, default


def chat_messages(req: P.ChatCompletionRequest) -> list[dict]:
    out = []
    mode = req.tool_mode()
    if mode is not None:
        # the tools reach the model as a system message (works with any chat template); the
        # grammar then makes the answer a valid call
        import json as _json
        spec = [{"name": t.function.name, "description": t.function.description or "",
                 "parameters": t.function.parameters or {"type": "object"}} for t in mode[1]]
        how = ("To call one, answer with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>; "
               "otherwise answer normally." if mode[0] == "auto" else "Answer with a function call as JSON.")
        out.append({"role": "system", "content": "You can call these functions (JSON schemas of their "
                    f"arguments):\n{_json.dumps(spec)}\n{how}"})
    for i, m in enumerate(req.messages):
        try:
            msg = {"role": m.role, "content": m.text()}
        except ValueError as e:
            raise APIError(str(e), param=f"messages[{i}].content", code="invalid_value") from None
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


# ---------------------------------------------------------------------------------------------------
# output -> response
# ---------------------------------------------------------------------------------------------------
class TokenStrings:
    """Token id -> text, for logprobs (cached; a lock keeps tokenizer calls off concurrent threads)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}
        self.lock = threading.Lock()

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            with self.lock:
                s = self.tok.decode([token_id]) if self.tok is not None else str(token_id)
            self.cache[token_id] = s
        return s


def finish_reason(r: str | None) -> str | None:
    if r in ("length", "abort"):
        return r
    return "stop" if r is not None else None


def usage(out) -> P.UsageInfo:
    p = len(out.prompt_token_ids)
    c = len(out.outputs[0].token_ids)
    m = out.metrics
    spec = None
    if m.num_drafts:
        spec = P.SpecDecodeUsage(num_drafts=m.num_drafts, num_draft_tokens=m.num_draft_tokens,
                                 num_accepted_tokens=m.num_accepted_tokens,
                                 mean_acceptance_length=round(m.mean_acceptance_length, 4))
    return P.UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c, spec_decode=spec)


def merged_usage(outs) -> P.UsageInfo:
    """Usage of several choices of one request: the prompt once, completions and drafts summed."""
    us = [usage(o) for o in outs]
    specs = [u.spec_decode for u in us if u.spec_decode is not None]
    spec = None
    if specs:
        drafts = sum(s.num_drafts for s in specs)
        acc = sum(s.num_accepted_tokens for s in specs)
        spec = P.SpecDecodeUsage(num_drafts=drafts, num_draft_tokens=sum(s.num_draft_tokens for s in specs),
                                 num_accepted_tokens=acc,
                                 mean_acceptance_length=round(1 + acc / drafts, 4) if drafts else 1.0)
    c = sum(u.completion_tokens for u in us)
    return P.UsageInfo(prompt_tokens=us[0].prompt_tokens, completion_tokens=c,
                       total_tokens=us[0].prompt_tokens + c, spec_decode=spec)


def completion_logprobs(lps, strings: TokenStrings, offset: int = 0) -> P.CompletionLogprobs | None:
    if lps is None:
        return None
    tokens = [strings(t.token_id) for t in lps]
    offs = []
    for s in tokens:
        offs.append(offset)
        offset += len(s)
    return P.CompletionLogprobs(tokens=tokens, token_logprobs=[t.logprob for t in lps],
                                top_logprobs=[{strings(i): v for i, v in t.top_logprobs} for t in lps],
                                text_offset=offs)


def chat_logprobs(lps, strings: TokenStrings) -> P.ChatLogprobs | None:
    if lps is None:
        return None

    def entry(tid, lp):
        s = strings(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return P.ChatLogprobs(content=[P.ChatTokenLogprob(**entry(t.token_id, t.logprob),
                                                      top_logprobs=[P.TopLogprob(**entry(i, v))
                                                                    for i, v in t.top_logprobs])
                                   for t in lps])


def timings(out) -> P.Timings:
    """llama-server's `timings`: prompt = arrival to first token, predicted = the tokens after it."""
    m = out.metrics
    first = m.first_token_time or m.arrival_time
    end = m.finished_time or first
    n_prompt, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    prompt_ms, predicted_ms = 1000 * max(first - m.arrival_time, 0.0), 1000 * max(end - first, 0.0)
    return P.Timings(prompt_n=n_prompt, prompt_ms=round(prompt_ms, 3),
                     prompt_per_second=round(1000 * n_prompt / prompt_ms, 3) if prompt_ms > 0 else 0.0,
                     predicted_n=n_out, predicted_ms=round(predicted_ms, 3),
                     predicted_per_second=round(1000 * max(n_out - 1, 0) / predicted_ms, 3) if predicted_ms > 0 else 0.0,
                     draft_n=m.num_draft_tokens, draft_n_accepted=m.num_accepted_tokens)


class TraceCursor:
    """Cuts a request's token trace (outputs.TokenTrace, one per output token) into the spans of
    the text chunks a stream sends, in order: `take(n)` covers the next n characters, `rest()` the
    tokens left at the end (whose text a stop string cut, or that had none)."""

    def __init__(self):
        self.i = 0               # the token being consumed
        self.off = 0             # characters of its text already covered

    def take(self, trace, n: int) -> list[P.TraceSpan]:
        spans = []
        while self.i < len(trace):
            e = trace[self.i]
            k = min(n, len(e.text) - self.off)
            if k <= 0 and len(e.text) > self.off:
                break                                   # the next characters are not sent yet
            spans.append(_span(self.i, e, e.text[self.off:self.off + k]))
            self.off += k
            n -= k
            if self.off < len(e.text):
                break
            self.i, self.off = self.i + 1, 0
        return spans

    def rest(self, trace) -> list[P.TraceSpan]:
        spans = [_span(j, trace[j], "") for j in range(self.i + (1 if self.off else 0), len(trace))]
        self.i, self.off = len(trace), 0
        return spans


def _span(i: int, e, text: str) -> P.TraceSpan:
    return P.TraceSpan(token=i, text=text, draft=e.source is not None, source=e.source, step=e.step)


def trace_spans(comp) -> list[P.TraceSpan] | None:
    """The whole text's spans of a finished output (non-streamed responses)."""
    if comp.spec_trace is None:
        return None
    cur = TraceCursor()
    return cur.take(comp.spec_trace, len(comp.text)) + cur.rest(comp.spec_trace)


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def split_auto_tool_calls(text: str, tools) -> tuple[str | None, list[P.ToolCall] | None]:
    """(content, tool calls) of an answer under tool_choice auto: Hermes-style
    <tool_call>{"name", "arguments"}</tool_call> blocks naming one of the tools become calls; the
    rest is the content (None when empty). Blocks that do not parse stay in the content."""
    import json as _json
    import re as _re
    import uuid as _uuid
    names = {t.function.name for t in tools}
    calls, kept = [], []
    last = 0
    for m in _re.finditer(_re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + _re.escape(TOOL_CALL_CLOSE), text, _re.S):
        try:
            doc = _json.loads(m.group(1))
            ok = isinstance(doc, dict) and doc.get("name") in names and isinstance(doc.get("arguments", {}), dict)
        except ValueError:
            ok = False
        if not ok:
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(P.ToolCall(id=f"call_{_uuid.uuid4().hex[:24]}", function=P.FunctionCall(
            name=doc["name"], arguments=_json.dumps(doc.get("arguments", {}), ensure_ascii=False))))
    if not calls:
        return text, None
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


def auto_visible(text: str, finished: bool) -> str:
    """The part of an auto-mode answer that can be streamed as content: before the first tool-call
    block, holding back a possible partial opening tag while the answer runs."""
    cut = text.find(TOOL_CALL_OPEN)
    if cut >= 0:
        return text[:cut]
    if finished:
        return text
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return text[:-k]
    return text


def tool_calls_from(text: str, mode) -> list[P.ToolCall] | None:
    """The call a tool-constrained answer encodes, or None if it is not complete JSON."""
    import json as _json
    import uuid as _uuid
    kind, tools = mode
    if kind == "auto":
        return split_auto_tool_calls(text, tools)[1]
    try:
        doc = _json.loads(text)
    except ValueError:
        return None
    if kind == "named":
        name, args = tools[0].function.name, text
    else:
        name, args = doc["name"], _json.dumps(doc["arguments"], ensure_ascii=False)
    return [P.ToolCall(id=f"call_{_uuid.uuid4().hex[:24]}", function=P.FunctionCall(name=name, arguments=args))]


def full_response(out, rid: str, model: str, created: int, chat: bool, strings: TokenStrings, tools=None):
    comp = out.outputs[0]
    fr = finish_reason(comp.finish_reason)
    calls = tool_calls_from(comp.text, tools) if tools is not None and fr == "stop" else None
    if calls is not None:
        content = split_auto_tool_calls(comp.text, tools[1])[0] if tools[0] == "auto" else None
        message = P.ChatResponseMessage(content=content, tool_calls=calls)
        choice = P.ChatCompletionChoice(index=0, message=message, finish_reason="tool_calls",
                                        logprobs=chat_logprobs(comp.logprobs, strings), spec_trace=trace_spans(comp))
        return P.ChatCompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage(out),
                                        timings=timings(out))
    if chat:
        choice = P.ChatCompletionChoice(index=0, message=P.ChatResponseMessage(content=comp.text),
                                        logprobs=chat_logprobs(comp.logprobs, strings), finish_reason=fr,
                                        spec_trace=trace_spans(comp))
        return P.ChatCompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage(out),
                                        timings=timings(out))
    choice = P.CompletionChoice(index=0, text=comp.text, logprobs=completion_logprobs(comp.logprobs, strings),
                                finish_reason=fr, spec_trace=trace_spans(comp))
    return P.CompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage(out),
                                timings=timings(out))


def sse(obj) -> str:
    if isinstance(obj, P.BaseModel):
        return f"data: {obj.model_dump_json()}\n\n"
    import json
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class TextDelta:
    """Incremental text for streaming. Holds back what might still become a stop string (the engine
    truncates the text there) and a trailing partial UTF-8 character."""

    def __init__(self, stop: list[str] | None):
        self.sent = 0
        self.hold = max((len(s) for s in stop), default=1) - 1 if stop else 0

    def update(self, text: str, finished: bool) -> str:
        limit = len(text) if finished else len(text) - self.hold
        if not finished:
            while limit > self.sent and text[limit - 1] == "\ufffd":
                limit -= 1
        if limit <= self.sent:
            return ""
        d = text[self.sent:limit]
        self.sent = limit
        return d
