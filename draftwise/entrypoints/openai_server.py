"""An OpenAI-compatible HTTP server: `draftwise serve`.

    draftwise serve --model HuggingFaceTB/SmolLM2-135M-Instruct --port 8000

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics
(Prometheus text).

Design: one engine thread owns the `LLMEngine` and is the only caller of add_request / step /
abort_request (and of the tokenizer). HTTP handlers (on the asyncio loop) validate the JSON, put a
submission on a thread-safe inbox and await a per-request `asyncio.Queue`; the engine thread drains
the inbox, runs `engine.step()` while there is work (continuous batching across every connection)
and hands each step's outputs back with `loop.call_soon_threadsafe`. A client that disconnects
aborts its request (its KV blocks are freed at once). SIGTERM: new /v1 requests get 503, running
ones finish within --shutdown-timeout seconds, then the engine thread stops and the process exits.
"""

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("draftwise.serve")

DEFAULT_SPECULATIVE_CONFIG = {"method": "eagle3", "num_speculative_tokens": 3}
COMPLETION_DEFAULT_MAX_TOKENS = 16        # OpenAI's default for /v1/completions


# ---------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(err: APIError):
    from fastapi.responses import JSONResponse
    return JSONResponse(err.body(), status_code=err.status)


# ---------------------------------------------------------------------------------------------------
# Prometheus metrics (a private registry per app)
# ---------------------------------------------------------------------------------------------------
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
        self._last_spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self._last_pos: list[int] = []

    def observe_engine(self, m: dict) -> None:
        """Called on the engine thread with `engine.get_metrics()`."""
        self.running.set(m.get("num_running", 0))
        self.waiting.set(m.get("num_waiting", 0))
        self.kv_used.set(m.get("kv_blocks_used", 0))
        self.kv_total.set(m.get("kv_blocks_total", 0))
        spec = m.get("spec_decode") or {}
        for key, counter in (("num_drafts", self.drafts), ("num_draft_tokens", self.draft_tokens),
                             ("num_accepted_tokens", self.accepted_tokens)):
            v = int(spec.get(key, 0))
            if v > self._last_spec[key]:
                counter.inc(v - self._last_spec[key])
            self._last_spec[key] = v
        pos = list(spec.get("accepted_per_position") or [])
        for i, v in enumerate(pos):
            last = self._last_pos[i] if i < len(self._last_pos) else 0
            child = self.accepted_per_pos.labels(position=str(i))   # creates the series at 0
            if v > last:
                child.inc(v - last)
        self._last_pos = pos

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# ---------------------------------------------------------------------------------------------------
# the engine thread
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Submission:
    request_id: str
    prompt: Any                          # str | list[int]; None for chat
    messages: list | None                # chat messages (template applied on the engine thread)
    sampling: dict                       # SamplingParams kwargs (max_tokens may be None)
    default_max_tokens: int | None       # None: up to the context (chat); else min(this, room left)
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.time)
    first_token_time: float | None = None


_STOP = object()


class EngineLoop:
    """Runs `engine.step()` on one background thread for every connection."""

    def __init__(self, llm, metrics: ServerMetrics | None = None, idle_poll_s: float = 0.5):
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        self.idle_poll_s = idle_poll_s
        self._inbox: queue.Queue = queue.Queue()
        self._subs: dict[str, _Submission] = {}     # engine thread only
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._closed = False                         # no more submissions (stopping or crashed)
        self.fatal_error: BaseException | None = None

    # --- called from the event loop / any thread ---------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="draftwise-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._closed = True
            self._inbox.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.1fs", timeout)

    async def submit(self, sub: _Submission) -> asyncio.Queue:
        """Queue a request; returns its output queue once the engine accepted it (raises APIError)."""
        with self._lock:               # either the engine thread will answer, or we refuse here
            if self._closed or not self.alive:
                raise APIError("the engine is not running", 503, type="server_error", code="engine_unavailable")
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

    def _deliver(self, items: list[tuple[_Submission, tuple]]) -> None:
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

    def _add(self, sub: _Submission) -> None:
        from draftwise.sampling_params import SamplingParams
        engine = self.engine
        try:
            if sub.messages is not None:
                prompt = self.llm.apply_chat_template(sub.messages)
                param = "messages"
            else:
                prompt = sub.prompt
                param = "prompt"
            text, ids = engine.tokenize_prompt(prompt)
            if not ids:
                raise APIError("the prompt is empty", param=param)
            max_len = engine.config.max_model_len
            if len(ids) >= max_len:
                raise APIError(f"This model's maximum context length is {max_len} tokens, but the prompt has "
                               f"{len(ids)} tokens (it must leave room for at least one new token).",
                               param=param, code="context_length_exceeded")
            kw = dict(sub.sampling)
            room = max_len - len(ids)
            if kw.get("max_tokens") is None:
                kw["max_tokens"] = room if sub.default_max_tokens is None else min(sub.default_max_tokens, room)
            elif len(ids) + kw["max_tokens"] > max_len:
                raise APIError(f"This model's maximum context length is {max_len} tokens. However, you requested "
                               f"{len(ids) + kw['max_tokens']} tokens ({len(ids)} in the prompt, "
                               f"{kw['max_tokens']} for the completion). Please reduce the prompt or max_tokens.",
                               param="max_tokens", code="context_length_exceeded")
            params = SamplingParams(**kw)
            engine.add_request({"prompt_token_ids": ids, "prompt": text}, params, request_id=sub.request_id)
        except APIError as e:
            self._reject(sub, e)
            return
        except (ValueError, TypeError) as e:
            self._reject(sub, APIError(str(e)))
            return
        except Exception as e:         # noqa: BLE001
            if type(e).__module__.startswith("jinja2"):      # e.g. raise_exception() in a chat template
                self._reject(sub, APIError(f"chat template error: {e}", param="messages"))
                return
            logger.exception("add_request failed")
            self._reject(sub, APIError(f"internal error: {e}", 500, type="server_error"), outcome="error")
            return
        self._subs[sub.request_id] = sub
        if self.metrics:
            self.metrics.prompt_tokens.inc(len(ids))
        self._deliver([(sub, ("accepted", None))])

    def _reject(self, sub: _Submission, err: APIError, outcome: str = "rejected") -> None:
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
            items.append((sub, ("output", out)))
            if out.finished:
                del self._subs[out.request_id]
                self._observe_finished(sub, out, now)
        self._deliver(items)

    def _observe_finished(self, sub: _Submission, out, now: float) -> None:
        m = self.metrics
        if m is None:
            return
        comp = out.outputs[0]
        n = len(comp.token_ids)
        m.requests.labels(outcome=comp.finish_reason or "stop").inc()
        m.generation_tokens.inc(n)
        if sub.first_token_time is not None:
            m.ttft.observe(max(0.0, sub.first_token_time - sub.arrival))
            if n > 1:
                m.tpot.observe(max(0.0, now - sub.first_token_time) / (n - 1))
        m.e2e.observe(max(0.0, now - sub.arrival))

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
        err = APIError("the server is shutting down", 503, type="server_error", code="shutting_down")
        if self._subs:
            logger.warning("stopping the engine with %d unfinished request(s)", len(self._subs))
        self._fail_all(err)
        self._reject_pending(cmds, err)
        self._publish_metrics()

    def _publish_metrics(self) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.observe_engine(self.engine.get_metrics())
        except Exception:              # noqa: BLE001
            logger.exception("reading engine metrics failed")


def _put_all(batch) -> None:
    for q, item in batch:
        q.put_nowait(item)


# ---------------------------------------------------------------------------------------------------
# request parsing
# ---------------------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(body: dict, name: str, check, expected: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise APIError(f"'{name}' must be {expected}, got {json.dumps(v)[:80]}", param=name, code="invalid_type")
    return v


async def _read_json(request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"We could not parse the JSON body of your request ({e}).", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    return body


def _check_model(body: dict, served: str) -> str:
    model = body.get("model")
    if model is None:
        return served
    if not isinstance(model, str):
        raise APIError("'model' must be a string", param="model", code="invalid_type")
    if model != served:
        raise APIError(f"The model '{model}' does not exist; this server serves '{served}'.",
                       param="model", code="model_not_found")
    return model


def _common_sampling(body: dict, chat: bool) -> tuple[dict, bool, bool]:
    """SamplingParams kwargs plus (stream, include_usage) from an OpenAI request body."""
    n = _opt(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise APIError("only n=1 is supported", param="n", code="unsupported_value")
    best_of = _opt(body, "best_of", _is_int, "an integer", 1)
    if best_of != 1:
        raise APIError("only best_of=1 is supported", param="best_of", code="unsupported_value")
    if chat:
        if _opt(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False):
            raise APIError("logprobs are not supported", param="logprobs", code="unsupported_value")
    else:
        if _opt(body, "logprobs", _is_int, "an integer") is not None:
            raise APIError("logprobs are not supported", param="logprobs", code="unsupported_value")
        if _opt(body, "echo", lambda v: isinstance(v, bool), "a boolean", False):
            raise APIError("echo is not supported", param="echo", code="unsupported_value")
        if _opt(body, "suffix", lambda v: isinstance(v, str), "a string"):
            raise APIError("suffix is not supported", param="suffix", code="unsupported_value")
    for pen in ("presence_penalty", "frequency_penalty"):
        if _opt(body, pen, _is_num, "a number", 0) != 0:
            raise APIError(f"{pen} is not supported (only 0)", param=pen, code="unsupported_value")
    if _opt(body, "logit_bias", lambda v: isinstance(v, dict), "an object"):
        raise APIError("logit_bias is not supported", param="logit_bias", code="unsupported_value")

    max_tokens = _opt(body, "max_tokens", _is_int, "an integer")
    if chat and max_tokens is None:
        max_tokens = _opt(body, "max_completion_tokens", _is_int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        name = "max_tokens" if "max_tokens" in body else "max_completion_tokens"
        raise APIError(f"'{name}' must be at least 1, got {max_tokens}", param=name, code="invalid_value")
    stop = _opt(body, "stop", lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
                "a string or a list of strings")
    if isinstance(stop, str):
        stop = [stop]
    kw = {
        "max_tokens": max_tokens,
        "temperature": _opt(body, "temperature", _is_num, "a number", 1.0),
        "top_p": _opt(body, "top_p", _is_num, "a number", 1.0),
        "top_k": _opt(body, "top_k", _is_int, "an integer", -1),
        "seed": _opt(body, "seed", _is_int, "an integer"),
        "stop": stop,
        "ignore_eos": _opt(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False),
    }
    stream = _opt(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    so = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = bool(so.get("include_usage", False))
    # validate the sampling values now (the engine thread validates again against the prompt)
    from draftwise.sampling_params import SamplingParams
    try:
        SamplingParams(**{**kw, "max_tokens": kw["max_tokens"] or 1})
    except ValueError as e:
        raise APIError(str(e), code="invalid_value") from None
    return kw, stream, include_usage


def _parse_prompt(body: dict):
    if "prompt" not in body or body["prompt"] is None:
        raise APIError("you must provide a 'prompt'", param="prompt", code="missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                        # a batch of one
    if isinstance(p, str):
        if not p:
            raise APIError("'prompt' must not be empty", param="prompt", code="invalid_value")
        return p
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise APIError("only one prompt per request is supported", param="prompt", code="unsupported_value")
    raise APIError("'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt",
                   code="invalid_type")


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _parse_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError("you must provide 'messages'", param="messages", code="missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty list", param="messages", code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"'{where}' must be an object", param=where, code="invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise APIError(f"'{where}.role' must be one of {', '.join(_ROLES)}", param=f"{where}.role",
                           code="invalid_value")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(f"'{where}.content' parts must be {{'type': 'text', 'text': ...}} "
                                   "(only text is supported)", param=f"{where}.content", code="invalid_value")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(f"'{where}.content' must be a string or a list of text parts",
                           param=f"{where}.content", code="invalid_type")
        msg = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


class _TextDelta:
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


def _finish_reason(r: str | None) -> str | None:
    return "length" if r == "length" else ("stop" if r is not None else None)


def _usage(out) -> dict:
    p = len(out.prompt_token_ids)
    c = len(out.outputs[0].token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------------
class _Gate:
    """Pure ASGI middleware: API-key check and draining (503) for /v1/*; /health and /metrics stay open."""

    def __init__(self, app, state: "_ServerState"):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            st = self.state
            err = None
            if st.draining:
                err, outcome = APIError("the server is shutting down", 503, type="server_error",
                                        code="shutting_down"), "unavailable"
            elif st.api_key is not None and not _auth_ok(scope, st.api_key):
                err, outcome = APIError("Incorrect or missing API key: send 'Authorization: Bearer KEY'.",
                                        401, code="invalid_api_key"), "unauthorized"
            if err is not None:
                st.metrics.requests.labels(outcome=outcome).inc()
                resp = _error_response(err)
                if err.status == 401:
                    resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _auth_ok(scope, api_key: str) -> bool:
    for k, v in scope.get("headers", ()):
        if k == b"authorization":
            val = v.decode("latin-1").strip()
            if val[:7].lower() == "bearer ":
                return hmac.compare_digest(val[7:].strip().encode(), api_key.encode())
            return False
    return False


@dataclass
class _ServerState:
    llm: Any
    served_model_name: str
    api_key: str | None
    metrics: ServerMetrics
    engine_loop: EngineLoop
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def build_app(llm, served_model_name: str, api_key: str | None = None):
    """The FastAPI app serving `llm` (an `LLM`) under the name `served_model_name`. The engine thread
    starts with the app's lifespan (so run it under uvicorn or `with TestClient(app)`)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    SSEResponse = _sse_response_class()
    metrics = ServerMetrics()
    state = _ServerState(llm, served_model_name, api_key or None, metrics, EngineLoop(llm, metrics))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.engine_loop.start()
        logger.info("serving %r (max_model_len=%d)", served_model_name, llm.engine.config.max_model_len)
        try:
            yield
        finally:
            state.draining = True
            await asyncio.to_thread(state.engine_loop.stop)

    app = FastAPI(title="draftwise OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(_Gate, state=state)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        err = APIError(str(exc.detail), exc.status_code,
                       code="not_found" if exc.status_code == 404 else None)
        return _error_response(err)

    # --- plain endpoints --------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not state.engine_loop.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        data, ctype = metrics.render()
        return Response(content=data, media_type=ctype)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": state.created, "owned_by": "draftwise",
            "max_model_len": llm.engine.config.max_model_len}]}

    # --- generation -------------------------------------------------------------------------------
    async def _generate(request: Request, chat: bool):
        try:
            body = await _read_json(request)
            model = _check_model(body, served_model_name)
            if chat:
                messages, prompt = _parse_messages(body), None
            else:
                messages, prompt = None, _parse_prompt(body)
            sampling, stream, include_usage = _common_sampling(body, chat)
        except APIError:
            metrics.requests.labels(outcome="rejected").inc()
            raise
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        sub = _Submission(rid, prompt, messages, sampling,
                          None if chat else COMPLETION_DEFAULT_MAX_TOKENS,
                          asyncio.get_running_loop(), asyncio.Queue())
        created = int(time.time())
        done = False
        try:
            q = await state.engine_loop.submit(sub)     # APIError (400/500/503) propagates
            if stream:
                done = True            # the response owns the request from here (aborts it if cut short)
                return SSEResponse(_stream_events(q, rid, model, created, chat, include_usage,
                                                   sampling.get("stop")),
                                    on_abort=lambda: state.engine_loop.abort(rid))
            final = await _wait_final(request, q)
            done = True
            return _full_response(final, rid, model, created, chat)
        finally:
            if not done:
                state.engine_loop.abort(rid)

    async def _stream_events(q, rid, model, created, chat, include_usage, stop):
        obj = "chat.completion.chunk" if chat else "text_completion"
        delta = _TextDelta(stop)

        def chunk(choice_delta: dict | str, finish=None, usage=None, choices=True):
            c: dict = {"id": rid, "object": obj, "created": created, "model": model}
            if not choices:
                c["choices"] = []
            elif chat:
                c["choices"] = [{"index": 0, "delta": choice_delta, "logprobs": None, "finish_reason": finish}]
            else:
                c["choices"] = [{"index": 0, "text": choice_delta, "logprobs": None, "finish_reason": finish}]
            if include_usage:
                c["usage"] = usage
            return _sse(c)

        if chat:
            yield chunk({"role": "assistant", "content": ""})
        while True:
            kind, payload = await q.get()
            if kind == "error":
                yield _sse(payload.body())
                break
            out = payload
            comp = out.outputs[0]
            d = delta.update(comp.text, out.finished)
            if out.finished:
                fr = _finish_reason(comp.finish_reason)
                if chat:
                    if d:
                        yield chunk({"content": d})
                    yield chunk({}, fr)
                else:
                    yield chunk(d, fr)
                if include_usage:
                    yield chunk(None, usage=_usage(out), choices=False)
                yield _FINISHED
                break
            if d:
                yield chunk({"content": d} if chat else d)
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    return app


def _sse_response_class():
    """A text/event-stream StreamingResponse that aborts its request when the client goes away before
    the end (whether Starlette notices through `http.disconnect` or through a failing send)."""
    from fastapi.responses import StreamingResponse

    class SSEResponse(StreamingResponse):
        def __init__(self, events, on_abort):
            self.finished = False
            self._events = events
            self._on_abort = on_abort
            super().__init__(self._body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def _body(self):
            async for ev in self._events:
                if ev == _FINISHED:
                    self.finished = True
                    continue
                yield ev

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                with contextlib.suppress(Exception):
                    await self._events.aclose()
                if not self.finished:
                    self._on_abort()

    return SSEResponse


_FINISHED = "__FINISHED__"


async def _wait_final(request, q: asyncio.Queue):
    """Wait for the finished output of a non-streaming request; raises if the client goes away first
    (the caller then aborts the request)."""
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        while True:
            get = asyncio.ensure_future(q.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                raise APIError("client disconnected", 499, code="client_disconnected")
            kind, payload = get.result()
            if kind == "error":
                raise payload
            if payload.finished:
                return payload
    finally:
        gone.cancel()


async def _wait_disconnect(request) -> None:
    """Returns when the ASGI server reports `http.disconnect` (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _full_response(out, rid: str, model: str, created: int, chat: bool) -> dict:
    comp = out.outputs[0]
    fr = _finish_reason(comp.finish_reason)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": comp.text}, "logprobs": None,
                  "finish_reason": fr}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": comp.text, "logprobs": None, "finish_reason": fr}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": _usage(out)}


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------
def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from draftwise.models.loader import DEFAULT_MODEL
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"model name, directory or .gguf file (default: {DEFAULT_MODEL})")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding config as JSON, or 'none'. Default: "
                             f"{json.dumps(DEFAULT_SPECULATIVE_CONFIG)} with the shipped drafter "
                             "(no speculation, with a warning, when there is none for this model)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $DRAFTWISE_API_KEY)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: 2048)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="max requests per batch (default: 16)")
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (default: 0)")
    parser.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"],
                        help="weight-only quantization of the target's linears (default: none)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip compiled graphs (no warmup at start-up; slower steps)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds to let running requests finish on SIGTERM (default: 30)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def _default_spec_available(model: str) -> bool:
    """Whether a shipped EAGLE-3 drafter exists for `model` (checked without loading the weights)."""
    try:
        from draftwise.config import ModelConfig
        from draftwise.models.loader import read_config_json, resolve_model_dir
        from draftwise.spec_decode.factory import shipped_drafter
        path = resolve_model_dir(model)
        cfg = ModelConfig.from_hf_dict(read_config_json(path))
        return shipped_drafter(path, cfg, DEFAULT_SPECULATIVE_CONFIG["method"]) is not None
    except Exception:                  # noqa: BLE001 - let LLM() report the real problem
        return True


def build_llm(args):
    """The `LLM` for `args` (falls back to no speculation when the default drafter is missing)."""
    from draftwise.entrypoints.llm import LLM
    kw = {"seed": args.seed}
    if args.max_model_len is not None:
        kw["max_model_len"] = args.max_model_len
    if args.max_num_seqs is not None:
        kw["max_num_seqs"] = args.max_num_seqs
    if getattr(args, "dtype", None):
        kw["dtype"] = args.dtype
    if getattr(args, "enforce_eager", False):
        kw["enforce_eager"] = True
    if getattr(args, "quantization", None):
        kw["quantization"] = args.quantization
    spec_arg = args.speculative_config
    if spec_arg is not None and spec_arg.strip().lower() in ("none", "null", ""):
        return LLM(args.model, speculative_config=None, **kw)
    if spec_arg is not None:
        return LLM(args.model, speculative_config=spec_arg, **kw)
    spec = dict(DEFAULT_SPECULATIVE_CONFIG)
    if not _default_spec_available(args.model):
        logger.warning("no shipped %s drafter for %s: serving without speculative decoding",
                       spec["method"], args.model)
        return LLM(args.model, speculative_config=None, **kw)
    try:
        return LLM(args.model, speculative_config=spec, **kw)
    except ValueError as e:
        if "drafter" not in str(e):
            raise
        logger.warning("default speculative config unavailable (%s): serving without speculative decoding", e)
        return LLM(args.model, speculative_config=None, **kw)


def run_server(args) -> None:
    import uvicorn
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("DRAFTWISE_API_KEY") or None
    llm = build_llm(args)
    name = args.served_model_name or args.model
    app = build_app(llm, name, api_key=api_key)
    state: _ServerState = app.state.server

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not state.draining:
                logger.info("signal %s: refusing new requests, finishing running ones (up to %.0fs)",
                            sig, args.shutdown_timeout)
            state.draining = True
            super().handle_exit(sig, frame)
            # a graceful stop is a clean exit: do not let uvicorn re-raise the signal afterwards
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key", args.host)
    _Server(config).run()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="draftwise serve", description="OpenAI-compatible server")
    add_serve_args(parser)
    run_server(parser.parse_args(argv))


if __name__ == "__main__":
    main()
