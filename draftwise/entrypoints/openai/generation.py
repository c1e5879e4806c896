"""The generation endpoints (/v1/completions, /v1/chat/completions): a request is admitted (model
name, tool mode, sampling fields, prompt: every check before anything reaches the engine), then
served as one engine request, or, for `n` / `best_of`, one engine request per candidate, whose
choices are merged (`best_of` > n: the n candidates with the highest cumulative log-probability)."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from fastapi import Request

from draftwise.entrypoints.openai import protocol as P
from draftwise.entrypoints.openai.errors import APIError
from draftwise.entrypoints.openai.serving import (COMPLETION_DEFAULT_MAX_TOKENS, Submission, chat_messages,
                                                  full_response, merged_usage, sampling_kwargs)
from draftwise.entrypoints.openai.streaming import ChoiceStream, SSEResponse, StreamContext, merge_streams


@dataclasses.dataclass
class Admitted:
    """A request that passed every check: what its engine requests are built from."""
    body: P.SamplingRequest
    chat: bool
    model: str
    tools: tuple | None          # (mode, tools) of a chat request with tools, else None
    sampling: dict               # SamplingParams kwargs (max_tokens may be None)
    text: str | None
    ids: list[int]
    default_max: int             # max_tokens where the request gave none (fits the context)
    echo: str | None             # completions with echo: the prompt's text

    @property
    def stop(self):
        return self.sampling["stop"]


def check_model(model: str | None, served: str) -> str:
    if model is not None and model != served:
        raise APIError(f"The model '{model}' does not exist; this server serves '{served}'.",
                       status=404, param="model", code="model_not_found")
    return served


class Generation:
    """Serves the generation endpoints for one ServerState."""

    def __init__(self, state, strings):
        self.state, self.strings = state, strings

    async def __call__(self, request: Request, body: P.SamplingRequest, chat: bool):
        try:
            adm = await self.admit(body, chat)
        except APIError:
            self.state.metrics.requests.labels(outcome="rejected").inc()
            raise
        n, best_of = body.n, (body.best_of or body.n) if not chat else body.n
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if best_of > 1:
            return await self.many(request, adm, rid, n, best_of)
        return await self.one(request, adm, rid)

    async def admit(self, body: P.SamplingRequest, chat: bool) -> Admitted:
        """Every check of a request, cheapest first; raises APIError."""
        state = self.state
        model = check_model(body.model, state.served_model_name)
        tools = None
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
        sampling = sampling_kwargs(body, chat, state.frontend.generation_defaults)
        text, ids, default_max = await asyncio.to_thread(
            state.preparer, prompt, messages, sampling, None if chat else COMPLETION_DEFAULT_MAX_TOKENS)
        echo = None
        if not chat and body.echo:
            echo = text if text is not None else state.frontend.tokenizer.decode(ids)
        return Admitted(body, chat, model, tools, sampling, text, ids, default_max, echo)

    def _context(self, adm: Admitted, rid: str) -> StreamContext:
        opts = adm.body.stream_options
        return StreamContext(rid, adm.model, int(time.time()), adm.chat, bool(opts and opts.include_usage),
                             self.strings)

    def _submission(self, request: Request, adm: Admitted, rid: str, sampling: dict) -> Submission:
        return Submission(rid, adm.text, adm.ids, sampling, adm.default_max, asyncio.get_running_loop(),
                          asyncio.Queue(), session_id=request.headers.get("x-session-id") or adm.body.user,
                          stream=bool(adm.body.stream))

    def _response(self, final, adm: Admitted, ctx: StreamContext):
        return echoed(full_response(final, ctx.rid, ctx.model, ctx.created, adm.chat, self.strings, adm.tools),
                      adm.echo)

    async def one(self, request: Request, adm: Admitted, rid: str):
        loop = self.state.engine_loop
        ctx = self._context(adm, rid)
        owned = False
        try:
            q = await loop.submit(self._submission(request, adm, rid, adm.sampling))   # APIError propagates
            if adm.body.stream:
                owned = True           # the response owns the request from here (aborts it if cut short)
                events = ChoiceStream(ctx, adm.stop, adm.tools, echo=adm.echo).events(q)
                return SSEResponse(events, on_abort=lambda: loop.abort(rid))
            final = await wait_final(request, q)
            owned = True
            return self._response(final, adm, ctx)
        finally:
            if not owned:
                loop.abort(rid)

    async def many(self, request: Request, adm: Admitted, rid: str, n: int, best_of: int):
        """n choices from best_of candidates: one engine request each, seeds seed, seed + 1, ...
        when a seed is given."""
        loop = self.state.engine_loop
        ctx = self._context(adm, rid)
        subs = [self._submission(request, adm, f"{rid}-{i}", s)
                for i, s in enumerate(candidate_samplings(adm.sampling, best_of, ranked=best_of > n))]
        queues, owned = [], False
        try:
            for sub in subs:
                queues.append(await loop.submit(sub))
            if adm.body.stream:
                owned = True
                gens = [ChoiceStream(ctx, adm.stop, adm.tools, index=i, trailer=False, echo=adm.echo).events(q)
                        for i, q in enumerate(queues)]
                return SSEResponse(merge_streams(gens, ctx),
                                   on_abort=lambda: [loop.abort(s.request_id) for s in subs])
            finals = await wait_finals(request, queues)
            owned = True
        finally:
            if not owned:
                for s in subs:
                    loop.abort(s.request_id)
        finals = best_candidates(finals, n, keep_logprobs=adm.sampling.get("logprobs") is not None)
        return merged_choices([self._response(f, adm, ctx) for f in finals], finals)


def candidate_samplings(sampling: dict, best_of: int, ranked: bool) -> list[dict]:
    """Each candidate's sampling kwargs: seed + i where a seed is given (seed - i past 2**64), and
    every token's log-probability where the candidates are ranked."""
    out = []
    for i in range(best_of):
        s = dict(sampling)
        if s.get("seed") is not None:
            s["seed"] = s["seed"] + i if s["seed"] + i < 2 ** 64 else s["seed"] - i
        if ranked and s.get("logprobs") is None:
            s["logprobs"] = 0
        out.append(s)
    return out


def best_candidates(finals: list, n: int, keep_logprobs: bool) -> list:
    """The n finished candidates with the highest cumulative log-probability (all of them, in
    order, when there are n); log-probabilities the request did not ask for are dropped."""
    if len(finals) == n:
        return finals
    finals = sorted(finals, key=lambda o: sum(t.logprob for t in (o.outputs[0].logprobs or [])), reverse=True)[:n]
    if not keep_logprobs:
        for o in finals:
            o.outputs[0].logprobs = None
    return finals


def merged_choices(resps: list, finals: list):
    """One response holding every choice (indexed 0..n-1) and the candidates' summed usage."""
    first = resps[0]
    for i, r in enumerate(resps):
        r.choices[0].index = i
    first.choices = [r.choices[0] for r in resps]
    first.usage = merged_usage(finals)
    first.timings = None
    return first


def echoed(resp, echo: str | None):
    """echo (completions): the prompt's text before the answer."""
    if echo:
        for c in resp.choices:
            c.text = echo + c.text
    return resp


async def wait_final(request, q: asyncio.Queue):
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


async def wait_finals(request, queues: list) -> list:
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


async def _wait_disconnect(request) -> None:
    """Returns when the ASGI server reports `http.disconnect` (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return
