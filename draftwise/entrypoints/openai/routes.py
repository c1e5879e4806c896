"""The server's routes and the state they share. Plain endpoints (/health, /metrics, /v1/models,
/tokenize, /detokenize) are answered here; the generation endpoints by `Generation`
(generation.py)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from draftwise.entrypoints.openai import protocol as P
from draftwise.entrypoints.openai.errors import ERRORS, APIError
from draftwise.entrypoints.openai.frontend import ModelFrontend
from draftwise.entrypoints.openai.generation import Generation, check_model
from draftwise.entrypoints.openai.serving import EngineLoop, PromptPreparer, ServerMetrics, TokenStrings


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


def add_routes(app, state: ServerState) -> None:
    add_plain_routes(app, state)
    generate = Generation(state, TokenStrings(state.frontend.tokenizer))

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=ERRORS)
    async def completions(body: P.CompletionRequest, request: Request):
        return await generate(request, body, chat=False)

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await generate(request, body, chat=True)


def add_plain_routes(app, state: ServerState) -> None:
    frontend = state.frontend

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
        data, ctype = state.metrics.render()
        return Response(content=data, media_type=ctype)

    @app.get("/v1/models", response_model=P.ModelList, responses=ERRORS)
    async def models():
        return P.ModelList(data=[P.ModelCard(id=state.served_model_name, created=state.created,
                                             max_model_len=frontend.max_model_len)])

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=ERRORS)
    async def tokenize(body: P.TokenizeRequest):
        check_model(body.model, state.served_model_name)
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
        return P.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=frontend.max_model_len)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: P.DetokenizeRequest):
        check_model(body.model, state.served_model_name)
        vocab = frontend.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(f"token ids must be in [0, {vocab})", param="tokens")
        if frontend.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")

        def run():
            with state.preparer.lock:
                return frontend.tokenizer.decode(body.tokens)
        return P.DetokenizeResponse(prompt=await asyncio.to_thread(run))
