"""Server-sent events of a streamed completion: one `ChoiceStream` per choice turns the engine's
outputs into OpenAI's chunks, `merge_streams` joins several choices into one stream, and
`SSEResponse` aborts the request when the client goes away before the end.

A choice's stream: the role chunk (chat), the echoed prompt (completions), then per engine output
the new text (held back while it may still turn into a stop string), the new log-probabilities and
speculation-trace spans; at the end the finish chunk with the timings, usage (`include_usage`) and
`data: [DONE]`. With tools the text is not streamed as content where it may be a call: forced tool
calls are sent whole at the end as one tool_calls delta; with tool_choice "auto" content streams
until a `<tool_call>` block starts. A choice among several (`trailer=False`) leaves usage and
[DONE] to the merge."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from fastapi.responses import StreamingResponse

from draftwise.entrypoints.openai import protocol as P
from draftwise.entrypoints.openai.errors import APIError
from draftwise.entrypoints.openai.serving import (TextDelta, TokenStrings, TraceCursor, auto_visible, chat_logprobs,
                                                  completion_logprobs, finish_reason, merged_usage, sse,
                                                  timings, tool_calls_from, usage)

FINISHED = "__FINISHED__"       # marks a stream that reached its end (SSEResponse does not abort it)
DONE = "data: [DONE]\n\n"


@dataclass
class StreamContext:
    """What every chunk of one response carries."""
    rid: str
    model: str
    created: int
    chat: bool
    include_usage: bool
    strings: TokenStrings

    def response(self, choices: list, **kw) -> str:
        cls = P.ChatCompletionStreamResponse if self.chat else P.CompletionStreamResponse
        return sse(cls(id=self.rid, created=self.created, model=self.model, choices=choices, **kw))


class ChoiceStream:
    def __init__(self, ctx: StreamContext, stop: list[str] | None, tools=None, index: int = 0,
                 trailer: bool = True, echo: str | None = None):
        self.ctx, self.tools, self.index, self.trailer, self.echo = ctx, tools, index, trailer, echo
        self.delta = TextDelta(stop)
        self.cursor = TraceCursor()
        self.logprobs_sent = 0
        self.offset = 0                 # completions: characters sent (logprob text offsets)
        self.auto_sent = 0              # tool_choice "auto": content characters sent

    async def events(self, q: asyncio.Queue):
        """The events of this choice from its engine queue; a finished stream yields FINISHED (or,
        among several choices, (FINISHED, the final output))."""
        if self.ctx.chat:
            yield self.chunk("", role="assistant")
        if self.echo:
            yield self.chunk(self.echo)
        while True:
            kind, payload = await q.get()
            if kind in ("error", "shutdown"):
                err = payload if kind == "error" else APIError(
                    "the server shut down before the request finished", 503, type="server_error",
                    code="shutting_down")
                yield sse(err.body())
                break
            for ev in self._on_output(payload):
                yield ev
            if payload.finished:
                break
        if self.trailer:
            yield DONE

    def chunk(self, text: str | None, finish=None, lps=None, role=None, trace=None, times=None) -> str:
        ctx = self.ctx
        if ctx.chat:
            c = P.ChatStreamChoice(index=self.index, delta=P.DeltaMessage(role=role, content=text),
                                   logprobs=chat_logprobs(lps, ctx.strings), finish_reason=finish, spec_trace=trace)
            return ctx.response([c], timings=times)
        c = P.CompletionChoice(index=self.index, text=text or "", finish_reason=finish, spec_trace=trace,
                               logprobs=completion_logprobs(lps, ctx.strings, self.offset))
        self.offset += len(text or "")
        return ctx.response([c], timings=times)

    def _on_output(self, out) -> list:
        comp = out.outputs[0]
        d = self.delta.update(comp.text, out.finished)
        lps = None
        if comp.logprobs is not None:
            lps, self.logprobs_sent = comp.logprobs[self.logprobs_sent:], len(comp.logprobs)
        trace = None
        if comp.spec_trace is not None:
            trace = self.cursor.take(comp.spec_trace, len(d)) + (
                self.cursor.rest(comp.spec_trace) if out.finished else [])
        evs = []
        if self.tools is not None:
            if self.tools[0] == "auto":     # content streams until a tool-call block starts
                trace = None                # (the trace follows the text deltas, not held-back blocks)
                vis = auto_visible(comp.text, out.finished)
                d, self.auto_sent = vis[self.auto_sent:], len(vis)
                if d:
                    evs.append(self.chunk(d))
                d = ""
            if not out.finished:            # tool calls are sent whole, as one tool_calls delta
                return evs
            calls = tool_calls_from(comp.text, self.tools) if finish_reason(comp.finish_reason) == "stop" else None
            if calls is not None:
                return evs + self._tool_call_events(calls, out) + self._end(out)
            # not a complete call (length): the text as content; with "auto" the held-back rest
            d = comp.text if self.tools[0] != "auto" else comp.text[self.auto_sent:]
        if out.finished:
            return evs + self._finish_events(out, d, lps, trace) + self._end(out)
        if d or lps or trace:
            evs.append(self.chunk(d, lps=lps, trace=trace))
        return evs

    def _tool_call_events(self, calls, out) -> list[str]:
        ctx = self.ctx
        delta_calls = [P.DeltaToolCall(index=i, **c.model_dump()) for i, c in enumerate(calls)]
        calls_chunk = P.ChatStreamChoice(index=self.index, delta=P.DeltaMessage(tool_calls=delta_calls))
        end = P.ChatStreamChoice(index=self.index, delta=P.DeltaMessage(), finish_reason="tool_calls")
        return [ctx.response([calls_chunk]), ctx.response([end], timings=timings(out) if self.trailer else None)]

    def _finish_events(self, out, d: str, lps, trace) -> list[str]:
        """The last text and the finish chunk (chat: the text in a chunk of its own first)."""
        evs = []
        chat = self.ctx.chat
        if chat and (d or lps or trace):
            evs.append(self.chunk(d, lps=lps, trace=trace))
            lps, trace = None, None
        fr = finish_reason(out.outputs[0].finish_reason)
        evs.append(self.chunk(None if chat else d, fr, lps=None if chat else lps, trace=trace,
                              times=timings(out) if self.trailer else None))
        return evs

    def _end(self, out) -> list:
        if not self.trailer:                # one of several choices: the merge ends the stream
            return [(FINISHED, out)]
        evs = [self.ctx.response([], usage=usage(out))] if self.ctx.include_usage else []
        return evs + [FINISHED]


async def merge_streams(gens: list, ctx: StreamContext):
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
            elif isinstance(ev, tuple):            # (FINISHED, the finished output)
                finished += 1
                finals.append(ev[1])
            else:
                yield ev
        if finished == len(gens):
            if ctx.include_usage:
                yield ctx.response([], usage=merged_usage(finals))
            yield FINISHED
        yield DONE
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            with contextlib.suppress(Exception):
                await g.aclose()


class SSEResponse(StreamingResponse):
    """A text/event-stream response that aborts its request when the client goes away before the
    end (whether Starlette notices through `http.disconnect` or through a failing send)."""

    def __init__(self, events, on_abort):
        self.finished = False
        self._events = events
        self._on_abort = on_abort
        super().__init__(self._body(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _body(self):
        async for ev in self._events:
            if ev == FINISHED:
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
