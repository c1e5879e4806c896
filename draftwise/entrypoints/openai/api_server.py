"""The FastAPI app of the OpenAI-compatible server, and `draftwise serve`.

    draftwise serve --model HuggingFaceTB/SmolLM2-135M-Instruct --port 8000

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics
(Prometheus text), GET /openapi.json (the request/response models of protocol.py).

Every malformed request is a 4xx with OpenAI's error shape ({"error": {message, type, param,
code}}), never a 500: pydantic validation errors are mapped to 400 naming the field. A client
that disconnects aborts its request (its KV blocks are freed at once). SIGTERM: new /v1 requests
get 503, running ones finish within --shutdown-timeout seconds, then the engine thread stops."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request

from draftwise.entrypoints.openai import protocol as P
from draftwise.entrypoints.openai.frontend import ModelFrontend
from draftwise.entrypoints.openai.serving import (COMPLETION_DEFAULT_MAX_TOKENS, APIError, EngineLoop,
                                                  PromptPreparer, ServerMetrics, Submission, TextDelta, TraceCursor, timings,
                                                  tool_calls_from, merged_usage, auto_visible,
                                                  TokenStrings,
                                                  chat_logprobs, chat_messages, completion_logprobs,
                                                  finish_reason, full_response, sampling_kwargs, sse, usage)

logger = logging.getLogger("draftwise.serve")

ERRORS = {code: {"model": P.ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
_TYPE_ERRORS = ("int_type", "string_type", "bool_type", "float_type", "list_type", "dict_type", "model_type",
                "int_parsing", "float_parsing", "literal_error", "model_attributes_type", "union_tag_invalid")


def _error_response(err: APIError):
    from fastapi.responses import JSONResponse
    headers = {"Retry-After": "1"} if err.status in (429, 503) else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error of a request body as an OpenAI-style 400 naming the field."""
    e = errors[0] if errors else {"type": "value_error", "loc": ("body",), "msg": "invalid request"}
    parts = []
    for p in e.get("loc", ())[1:]:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif isinstance(p, str) and p.isidentifier() and p not in ("str", "int", "float", "bool", "list", "dict"):
            parts.append(("." if parts else "") + p)
    param = "".join(parts) or None
    kind = e.get("type", "")
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError(f"We could not parse the JSON body of your request ({e.get('ctx', {}).get('error', msg)}).",
                        code="invalid_json")
    if param is None:
        return APIError("the request body must be a JSON object" if kind in _TYPE_ERRORS or kind == "missing"
                        else msg, code="invalid_json" if kind in _TYPE_ERRORS else "invalid_value")
    if kind == "missing":
        return APIError(f"you must provide '{param}'", param=param, code="missing_required_parameter")
    code = "invalid_type" if kind in _TYPE_ERRORS else "invalid_value"
    return APIError(f"'{param}': {msg}", param=param, code=code)


_GATED = ("/tokenize", "/detokenize")       # vLLM serves these beside /v1; same key, limits and drain


class _Gate:
    """Pure ASGI middleware for /v1/*: draining (503), the API key (401), the request-size limit
    (413, checked against Content-Length and again while a chunked body streams in) and overload
    (429 with Retry-After); /health and /metrics stay open."""

    def __init__(self, app, state: "ServerState"):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/") or path in _GATED):
            st = self.state
            err = None
            if st.draining:
                err, outcome = APIError("the server is shutting down", 503, type="server_error",
                                        code="shutting_down"), "unavailable"
            elif st.api_key is not None and not _auth_ok(scope, st.api_key):
                err, outcome = APIError("Incorrect or missing API key: send 'Authorization: Bearer KEY'.",
                                        401, code="invalid_api_key"), "unauthorized"
            elif _content_length(scope) > st.max_request_bytes:
                err, outcome = _too_large(st.max_request_bytes), "too_large"
            if err is not None:
                await _refuse(st, err, outcome, scope, receive, send)
                return
            if scope["method"] == "POST" and not _has_content_length(scope):
                # a chunked body: read it here, up to the limit, then replay it to the app
                body = await _read_body(receive, st.max_request_bytes)
                if body is None:
                    await _refuse(st, _too_large(st.max_request_bytes), "too_large", scope, receive, send)
                    return
                receive = _replay(body, receive)
        await self.app(scope, receive, send)


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than this server's limit of {limit} bytes "
                    "(--max-request-bytes)", 413, code="request_too_large")


async def _refuse(st: "ServerState", err: APIError, outcome: str, scope, receive, send) -> None:
    st.metrics.requests.labels(outcome=outcome).inc()
    resp = _error_response(err)
    if err.status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    await resp(scope, receive, send)


def _content_length(scope) -> int:
    for k, v in scope.get("headers", ()):
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return 0
    return 0


def _has_content_length(scope) -> bool:
    return any(k == b"content-length" for k, _ in scope.get("headers", ()))


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None as soon as it passes `limit` bytes."""
    parts, seen = [], 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"".join(parts)
        chunk = msg.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            return None
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive):
    """`receive` that first yields `body` in one message, then defers to the real one (disconnects)."""
    sent = False

    async def wrapped():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return wrapped


def _auth_ok(scope, api_key: str) -> bool:
    for k, v in scope.get("headers", ()):
        if k == b"authorization":
            val = v.decode("latin-1").strip()
            if val[:7].lower() == "bearer ":
                return hmac.compare_digest(val[7:].strip().encode(), api_key.encode())
            return False
    return False


@dataclass
class ServerState:
    frontend: ModelFrontend
    served_model_name: str
    api_key: str | None
    metrics: ServerMetrics
    engine_loop: EngineLoop
    preparer: PromptPreparer
    max_request_bytes: int
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


def default_max_request_bytes(max_model_len: int) -> int:
    """Room for a full context of text even at 6 JSON bytes per character (\\uXXXX escapes) and
    ~16 characters per token, and never under 1 MiB."""
    return max(1 << 20, max_model_len * 16 * 6)


def build_app(llm, served_model_name: str, api_key: str | None = None, max_request_bytes: int | None = None,
              max_num_queued_requests: int | None = 64, playground: bool = True, *,
              frontend: ModelFrontend | None = None, make_engine_client=None):
    """The FastAPI app serving `llm` (an `LLM`) under the name `served_model_name`, with the browser
    playground at `/` unless `playground` is False. The engine thread starts with the app's
    lifespan (so run it under uvicorn or `with TestClient(app)`).

    Without a local model (`llm` None) the app serves through `make_engine_client(metrics)`, any
    object with EngineLoop's start / stop / alive / is_idle / submit / abort (the Ray ingress),
    and `frontend` describes the model."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    SSEResponse = _sse_response_class()
    metrics = ServerMetrics()
    if llm is not None:
        frontend = ModelFrontend.of_engine(llm.engine)
        engine_client = EngineLoop(llm, metrics, max_num_queued_requests=max_num_queued_requests)
    else:
        engine_client = make_engine_client(metrics)
    max_len = frontend.max_model_len
    limit = max_request_bytes or default_max_request_bytes(max_len)
    state = ServerState(frontend, served_model_name, api_key or None, metrics, engine_client,
                        PromptPreparer(frontend, max_prompt_chars=max_len * 64), limit)
    strings = TokenStrings(frontend.tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        from draftwise.entrypoints.openai.serving import release_free_memory
        release_free_memory()                 # what loading and compiling freed
        state.engine_loop.start()
        logger.info("serving %r (max_model_len=%d)", served_model_name, max_len)
        try:
            yield
        finally:
            state.draining = True
            await asyncio.to_thread(state.engine_loop.stop)
            if llm is not None:
                llm.engine.shutdown()         # tensor-parallel workers, if any

    app = FastAPI(title="draftwise OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(_Gate, state=state)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        metrics.requests.labels(outcome="rejected").inc()
        return _error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        err = APIError(str(exc.detail), exc.status_code,
                       code="not_found" if exc.status_code == 404 else None)
        return _error_response(err)

    if playground:
        from draftwise.entrypoints.openai.playground import add_playground_routes
        add_playground_routes(app)

    # --- plain endpoints --------------------------------------------------------------------------
    @app.get("/health", response_model=P.HealthStatus, responses={503: {"model": P.HealthStatus}})
    async def health():
        if not state.engine_loop.alive:
            fault = getattr(state.engine_loop, "fault", None)
            return JSONResponse({"status": f"engine failed: {fault}" if fault else "engine not running"},
                                status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics():
        collect = getattr(state.engine_loop, "collect_metrics", None)
        if collect is not None:               # engines in other processes: pull their figures now
            collect()
        data, ctype = metrics.render()
        return Response(content=data, media_type=ctype)

    @app.get("/v1/models", response_model=P.ModelList, responses=ERRORS)
    async def models():
        return P.ModelList(data=[P.ModelCard(id=served_model_name, created=state.created,
                                             max_model_len=max_len)])

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=ERRORS)
    async def tokenize(body: P.TokenizeRequest):
        _check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", param="prompt")

        def run():
            with state.preparer.lock:
                if body.messages is not None:
                    msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
                    text = frontend.apply_chat_template(msgs, body.add_generation_prompt)
                else:
                    text = body.prompt
                return frontend.tokenize_prompt(text)[1]
        try:
            ids = await asyncio.to_thread(run)
        except ValueError as e:
            raise APIError(str(e), param="messages" if body.messages is not None else "prompt") from None
        return P.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=max_len)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: P.DetokenizeRequest):
        _check_model(body.model)
        vocab = frontend.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(f"token ids must be in [0, {vocab})", param="tokens")
        if frontend.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")

        def run():
            with state.preparer.lock:
                return frontend.tokenizer.decode(body.tokens)
        return P.DetokenizeResponse(prompt=await asyncio.to_thread(run))

    # --- generation -------------------------------------------------------------------------------
    def _check_model(model: str | None) -> str:
        if model is not None and model != served_model_name:
            raise APIError(f"The model '{model}' does not exist; this server serves '{served_model_name}'.",
                           status=404, param="model", code="model_not_found")
        return served_model_name

    async def _generate(request: Request, body: P.SamplingRequest, chat: bool):
        tools = None
        try:
            model = _check_model(body.model)
            if chat:
                try:
                    tools = body.tool_mode()
                except ValueError as e:
                    raise APIError(str(e), param="tool_choice", code="invalid_value") from None
                messages, prompt = chat_messages(body), None
            else:
                try:
                    body.check_choices()
                except ValueError as e:
                    raise APIError(str(e), param="best_of", code="invalid_value") from None
                messages, prompt = None, body.single_prompt()
            sampling = sampling_kwargs(body, chat)
            text, ids, default_max = await asyncio.to_thread(
                state.preparer, prompt, messages, sampling, None if chat else COMPLETION_DEFAULT_MAX_TOKENS)
        except APIError:
            metrics.requests.labels(outcome="rejected").inc()
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        echo = None if chat or not body.echo else (text if text is not None else frontend.tokenizer.decode(ids))
        n, best_of = body.n, (body.best_of or body.n) if not chat else body.n
        if best_of > 1:
            return await _generate_many(request, body, rid, model, chat, text, ids, sampling, default_max,
                                        include_usage, tools, n, best_of, echo)
        session = request.headers.get("x-session-id") or body.user
        sub = Submission(rid, text, ids, sampling, default_max, asyncio.get_running_loop(), asyncio.Queue(),
                         session_id=session, stream=bool(body.stream))
        created = int(time.time())
        done = False
        try:
            q = await state.engine_loop.submit(sub)     # APIError (400/500/503) propagates
            if body.stream:
                done = True            # the response owns the request from here (aborts it if cut short)
                return SSEResponse(_stream_events(q, rid, model, created, chat, include_usage, sampling["stop"], tools,
                                                  echo=echo),
                                   on_abort=lambda: state.engine_loop.abort(rid))
            final = await _wait_final(request, q)
            done = True
            return _echoed(full_response(final, rid, model, created, chat, strings, tools), echo)
        finally:
            if not done:
                state.engine_loop.abort(rid)

    async def _generate_many(request, body, rid, model, chat, text, ids, sampling, default_max, include_usage,
                             tools, n, best_of, echo):
        """n choices (best_of >= n candidates, the n with the highest cumulative log-probability):
        one engine request per candidate, seeds seed, seed + 1, ... when a seed is given."""
        loop = asyncio.get_running_loop()
        rank = best_of > n
        subs = []
        for i in range(best_of):
            s = dict(sampling)
            if s.get("seed") is not None:
                s["seed"] = s["seed"] + i if s["seed"] + i < 2 ** 64 else s["seed"] - i
            if rank and s.get("logprobs") is None:
                s["logprobs"] = 0                # the ranking needs every token's log-probability
            subs.append(Submission(f"{rid}-{i}", text, ids, s, default_max, loop, asyncio.Queue(),
                                   session_id=request.headers.get("x-session-id") or body.user,
                                   stream=bool(body.stream)))
        created = int(time.time())
        queues, owned = [], False
        try:
            for sub in subs:
                queues.append(await state.engine_loop.submit(sub))
            if body.stream:
                owned = True
                gens = [_stream_events(q, rid, model, created, chat, include_usage, sampling["stop"], tools,
                                       index=i, trailer=False, echo=echo) for i, q in enumerate(queues)]
                return SSEResponse(_merge_streams(gens, rid, model, created, chat, include_usage),
                                   on_abort=lambda: [state.engine_loop.abort(s.request_id) for s in subs])
            finals = await _wait_finals(request, queues)
            owned = True
        finally:
            if not owned:
                for s in subs:
                    state.engine_loop.abort(s.request_id)
        if rank:
            def score(o):
                return sum(t.logprob for t in (o.outputs[0].logprobs or []))
            finals = sorted(finals, key=score, reverse=True)[:n]
            if sampling.get("logprobs") is None:
                for o in finals:
                    o.outputs[0].logprobs = None
        resps = [_echoed(full_response(f, rid, model, created, chat, strings, tools), echo) for f in finals]
        first = resps[0]
        for i, r in enumerate(resps):
            r.choices[0].index = i
        first.choices = [r.choices[0] for r in resps]
        first.usage = merged_usage(finals)
        first.timings = None
        return first

    async def _merge_streams(gens, rid, model, created, chat, include_usage):
        """The events of several choices' streams as one stream; usage and [DONE] once, at the end."""
        q: asyncio.Queue = asyncio.Queue()
        end = object()
        finals: list = []

        async def pump(g):
            try:
                async for ev in g:
                    await q.put(ev)
            finally:
                await q.put(end)
        tasks = [asyncio.ensure_future(pump(g)) for g in gens]
        ended = finished = 0
        try:
            while ended < len(gens):
                ev = await q.get()
                if ev is end:
                    ended += 1
                elif isinstance(ev, tuple):            # (_FINISHED, the finished output)
                    finished += 1
                    finals.append(ev[1])
                else:
                    yield ev
            if finished == len(gens):
                if include_usage:
                    cls = P.ChatCompletionStreamResponse if chat else P.CompletionStreamResponse
                    yield sse(cls(id=rid, created=created, model=model, choices=[], usage=merged_usage(finals)))
                yield _FINISHED
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for g in gens:
                with contextlib.suppress(Exception):
                    await g.aclose()

    async def _stream_events(q, rid, model, created, chat, include_usage, stop, tools=None, index=0, trailer=True,
                             echo=None):
        delta = TextDelta(stop)
        sent = 0                                  # logprobs already streamed
        offset = 0
        cursor = TraceCursor()
        auto_sent = 0                             # tool_choice auto: content characters sent

        def chunk(text: str | None, finish=None, lps=None, role=None, trace=None, times=None):
            nonlocal offset
            if chat:
                c = P.ChatStreamChoice(index=index, delta=P.DeltaMessage(role=role, content=text),
                                       logprobs=chat_logprobs(lps, strings), finish_reason=finish, spec_trace=trace)
                return sse(P.ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[c],
                                                          timings=times))
            c = P.CompletionChoice(index=index, text=text or "",
                                   logprobs=completion_logprobs(lps, strings, offset),
                                   finish_reason=finish, spec_trace=trace)
            offset += len(text or "")
            return sse(P.CompletionStreamResponse(id=rid, created=created, model=model, choices=[c], timings=times))

        if chat:
            yield chunk("", role="assistant")
        if echo:
            yield chunk(echo)
        while True:
            kind, payload = await q.get()
            if kind in ("error", "shutdown"):
                err = payload if kind == "error" else APIError(
                    "the server shut down before the request finished", 503, type="server_error",
                    code="shutting_down")
                yield sse(err.body())
                if not trailer:
                    return
                break
            out = payload
            comp = out.outputs[0]
            d = delta.update(comp.text, out.finished)
            lps = None
            if comp.logprobs is not None:
                lps, sent = comp.logprobs[sent:], len(comp.logprobs)
            trace = None
            if comp.spec_trace is not None:
                trace = cursor.take(comp.spec_trace, len(d)) + (cursor.rest(comp.spec_trace) if out.finished else [])
            if tools is not None and tools[0] == "auto":   # content streams until a tool-call block starts
                trace = None                   # (the trace follows the text deltas, not held-back blocks)
                vis = auto_visible(comp.text, out.finished)
                d, auto_sent = vis[auto_sent:], len(vis)
                if not out.finished:
                    if d:
                        yield chunk(d)
                    continue
                if d:
                    yield chunk(d)
                d = ""
            if tools is not None:              # tool calls are sent whole, as one tool_calls delta
                if not out.finished:
                    continue
                calls = tool_calls_from(comp.text, tools) if finish_reason(comp.finish_reason) == "stop" else None
                if calls is not None:
                    delta_calls = [P.DeltaToolCall(index=i, **c.model_dump()) for i, c in enumerate(calls)]
                    c = P.ChatStreamChoice(index=index, delta=P.DeltaMessage(tool_calls=delta_calls))
                    yield sse(P.ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[c]))
                    c = P.ChatStreamChoice(index=index, delta=P.DeltaMessage(), finish_reason="tool_calls")
                    yield sse(P.ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[c],
                                                             timings=timings(out) if trailer else None))
                    if not trailer:
                        yield (_FINISHED, out)
                        return
                    if include_usage:
                        yield sse(P.ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[],
                                                                 usage=usage(out)))
                    yield _FINISHED
                    break
                if tools[0] != "auto":
                    d = comp.text              # not a complete call (length): the text as content
                else:
                    d = comp.text[auto_sent:]  # the held-back rest (a block that did not parse)
            if out.finished:
                fr = finish_reason(comp.finish_reason)
                if chat and (d or lps or trace):
                    yield chunk(d, lps=lps, trace=trace)
                    lps, trace = None, None
                yield chunk(None if chat else d, fr, lps=None if chat else lps, trace=trace,
                            times=timings(out) if trailer else None)
                if not trailer:                 # one of several choices: the merge ends the stream
                    yield (_FINISHED, out)
                    return
                if include_usage:
                    cls = P.ChatCompletionStreamResponse if chat else P.CompletionStreamResponse
                    yield sse(cls(id=rid, created=created, model=model, choices=[], usage=usage(out)))
                yield _FINISHED
                break
            if d or lps or trace:
                yield chunk(d, lps=lps, trace=trace)
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=ERRORS)
    async def completions(body: P.CompletionRequest, request: Request):
        return await _generate(request, body, chat=False)

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await _generate(request, body, chat=True)

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
            if kind == "shutdown" or payload.finished:       # shutdown: the partial output, "abort"
                return payload
    finally:
        gone.cancel()


async def _final_of(q: asyncio.Queue):
    while True:
        kind, payload = await q.get()
        if kind == "error":
            raise payload
        if kind == "shutdown" or payload.finished:
            return payload


async def _wait_finals(request, queues: list) -> list:
    """The finished outputs of several requests (one client request's choices), in order; raises
    if the client goes away first (the caller then aborts them)."""
    gone = asyncio.ensure_future(_wait_disconnect(request))
    pending = {asyncio.ensure_future(_final_of(q)): i for i, q in enumerate(queues)}
    finals: list = [None] * len(queues)
    try:
        while pending:
            done, _ = await asyncio.wait(set(pending) | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                raise APIError("client disconnected", 499, code="client_disconnected")
            for t in done:
                finals[pending.pop(t)] = t.result()
        return finals
    finally:
        gone.cancel()
        for t in pending:
            t.cancel()


def _echoed(resp, echo: str | None):
    """echo (completions): the prompt's text before the answer."""
    if echo:
        for c in resp.choices:
            c.text = echo + c.text
    return resp


async def _wait_disconnect(request) -> None:
    """Returns when the ASGI server reports `http.disconnect` (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------
def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine's flags (EngineArgs) and the server's own."""
    from draftwise.engine_args import EngineArgs
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or set DRAFTWISE_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM; new ones get 503 meanwhile "
                        "(default: 30)")
    g.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body accepted, else 413 (default: room for a full context, "
                        "at least 1 MiB)")
    g.add_argument("--max-num-queued-requests", type=int, default=64,
                   help="requests that may wait beyond the running batch, else 429 with Retry-After; "
                        "-1: no limit (default: 64)")
    g.add_argument("--no-playground", dest="playground", action="store_false",
                   help="do not serve the browser playground at /")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from draftwise.entrypoints.ray_serve.options import add_ray_args
    add_ray_args(parser)
    return parser


def drain(state: ServerState, timeout: float) -> None:
    """Refuse new requests (503), wait up to `timeout` seconds for running ones to finish, then end
    the rest (streams: an error event and [DONE]; others: their partial output, finish_reason
    "abort") and stop the engine thread. Blocking: run it off the event loop."""
    state.draining = True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not state.engine_loop.is_idle:
        time.sleep(0.05)
    state.engine_loop.stop()                # ends whatever is left, each with its final event
    time.sleep(0.1)                         # let the event loop write those events


def configure_logging(args) -> None:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def api_key_of(args) -> str | None:
    return args.api_key or os.environ.get("DRAFTWISE_API_KEY") or None


def run_server(args, llm=None) -> None:
    """Serve `llm` (built from `args`' engine flags when not given) until SIGTERM / SIGINT."""
    import uvicorn
    configure_logging(args)
    api_key = api_key_of(args)
    if llm is None:
        from draftwise.engine_args import EngineArgs
        from draftwise.entrypoints.llm import LLM
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    name = args.served_model_name or args.model
    queued = None if args.max_num_queued_requests is not None and args.max_num_queued_requests < 0 \
        else args.max_num_queued_requests
    app = build_app(llm, name, api_key=api_key, max_request_bytes=args.max_request_bytes,
                    max_num_queued_requests=queued, playground=args.playground)
    state: ServerState = app.state.server

    class _Server(uvicorn.Server):
        """SIGTERM / SIGINT drain: the listener stays open (new /v1 requests get 503, /health says
        draining) while running requests finish, for up to --shutdown-timeout seconds; what is
        still running then ends with an error event and [DONE] (streams) or finish_reason "abort";
        then uvicorn closes. A second signal stops at once."""

        def handle_exit(self, sig, frame):
            if state.draining:
                self._stop_uvicorn(sig, frame)
                return
            logger.info("signal %s: refusing new requests, finishing running ones (up to %.0fs)",
                        sig, args.shutdown_timeout)
            state.draining = True
            threading.Thread(target=self._drain, args=(sig, frame), name="draftwise-drain", daemon=True).start()

        def _drain(self, sig, frame):
            drain(state, args.shutdown_timeout)
            self._stop_uvicorn(sig, frame)

        def _stop_uvicorn(self, sig, frame):
            super().handle_exit(sig, frame)
            # a graceful stop is a clean exit: do not let uvicorn re-raise the signal afterwards
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key", args.host)
    _Server(config).run()
    logger.info("server stopped")
    # skip the interpreter's final teardown (seconds of garbage collection over the model's objects):
    # everything worth keeping is written already
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

