"""One engine as a Ray Serve replica (the deployment class; `launch` applies `serve.deployment`)."""
from __future__ import annotations

import asyncio
import logging
import os

from draftwise.distributed.ray_utils import node_ip
from draftwise.engine_args import EngineArgs
from draftwise.entrypoints.llm import LLM
from draftwise.entrypoints.openai.frontend import describe_engine
from draftwise.entrypoints.openai.serving import APIError, EngineLoop, Submission

logger = logging.getLogger("draftwise.serve")

class EngineReplica:
    """An `LLM` on its engine thread. `generate` streams the engine loop's items for one request:
    ("accepted", facts), then ("output", RequestOutput) until one is finished, or ("error", dict) /
    ("shutdown", RequestOutput | dict). A cancelled stream (the client went away, the ingress gave
    up) aborts the request and frees its KV blocks."""

    def __init__(self, engine_options: dict, max_num_queued_requests: int | None = 64):
        import torch
        torch.set_grad_enabled(False)
        self.llm = LLM.from_engine_args(EngineArgs(**engine_options))
        self.loop = EngineLoop(self.llm, None, max_num_queued_requests=max_num_queued_requests)
        self.loop.start()
        self.node_ip = _node_ip()
        logger.info("engine replica ready on %s (pid %d)", self.node_ip, os.getpid())

    def describe(self) -> dict:
        return {**describe_engine(self.llm.engine), "node_ip": self.node_ip, "pid": os.getpid()}

    async def generate(self, request: dict):
        sub = Submission(request["request_id"], request.get("prompt"), request["prompt_token_ids"],
                         request["sampling"], request["default_max_tokens"], asyncio.get_running_loop(),
                         asyncio.Queue())
        try:
            q = await self.loop.submit(sub)
        except APIError as e:
            yield ("error", e.to_dict())
            return
        yield ("accepted", {"node_ip": self.node_ip, "pid": os.getpid()})
        done = False
        try:
            while True:
                kind, payload = await q.get()
                if kind == "output":
                    yield ("output", payload)
                    if payload.finished:
                        done = True
                        return
                    continue
                done = True
                yield (kind, payload.to_dict() if isinstance(payload, APIError) else payload)
                return
        finally:
            if not done:
                self.loop.abort(sub.request_id)

    def record_routing_stats(self) -> dict:
        """Ray Serve polls this: the engine's gauges and cumulative counters, plus this process."""
        m = dict(self.loop.engine_metrics)
        m.update(pid=os.getpid(), node_ip=self.node_ip, alive=self.loop.alive)
        return m

    def check_health(self) -> None:
        """Ray Serve calls this periodically and replaces the replica when it raises."""
        if self.loop.fault:
            raise RuntimeError(f"the engine failed: {self.loop.fault}")
        if not self.loop.alive:
            raise RuntimeError(f"the engine thread is not running ({self.loop.fatal_error!r})")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def _node_ip() -> str:
    try:
        return node_ip()
    except Exception:                  # noqa: BLE001 - outside Ray (tests)
        return "127.0.0.1"
