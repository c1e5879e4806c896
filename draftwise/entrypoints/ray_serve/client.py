"""The ingress's engine client: the HTTP app's `engine_loop` when the engines are Ray Serve replicas.

`submit` sends a request to the engine deployment (the router picks the replica) and returns the
same queue of ("output" | "error" | "shutdown", payload) items the local engine loop produces, so
the protocol, validation and SSE code is shared. Failover: while no token of a request has reached
the client (a stream's first token, a non-streaming request's whole answer), a replica that dies
costs nothing: the request is sent again, to another replica, up to `max_attempts` times; the new
replica's outputs start from scratch (a non-streaming response reads only the final output). Once a
stream has sent tokens, a dead replica ends it with an error item (an error event and [DONE])."""
from __future__ import annotations

import asyncio
import logging
import time

from draftwise.entrypoints.openai.serving import ALLOCATION_COUNTERS, APIError, ServerMetrics, Submission

logger = logging.getLogger("draftwise.serve")

# the request routers (router.DraftwiseRequestRouter) Ray Serve created in this process
LIVE_ROUTERS: list = []


def _replica_failure(e: BaseException) -> bool:
    """Errors that mean the replica (not the request) failed: worth another replica."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    return isinstance(e, (RayActorError, ActorDiedError, ActorUnavailableError))


class RayEngineClient:
    def __init__(self, handle, metrics: ServerMetrics | None = None, max_attempts: int = 3,
                 retry_backoff_s: float = 0.5):
        self.handle = handle.options(stream=True)
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self._tasks: dict[str, asyncio.Task] = {}
        self._closed = False
        self.retries = 0                      # requests re-sent after a replica failure
        self.replica_failures = 0             # requests ended by a replica failure mid-stream
        self.routing_metrics = RoutingMetrics(metrics.registry) if metrics is not None else None

    # --- the engine-loop interface the HTTP app uses -------------------------------------------------
    def start(self) -> None:
        pass

    def stop(self, timeout: float = 10.0) -> None:
        self._closed = True

    @property
    def alive(self) -> bool:
        return not self._closed

    @property
    def is_idle(self) -> bool:
        return not self._tasks

    async def submit(self, sub: Submission) -> asyncio.Queue:
        if self._closed:
            raise APIError("the engine is not running", 503, type="server_error", code="engine_unavailable")
        payload = {"request_id": sub.request_id, "prompt": sub.prompt, "prompt_token_ids": sub.prompt_token_ids,
                   "sampling": sub.sampling, "default_max_tokens": sub.default_max_tokens,
                   "session_id": sub.session_id}
        gen = await self._open(payload)
        task = asyncio.get_running_loop().create_task(self._pump(sub, payload, gen))
        self._tasks[sub.request_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(sub.request_id, None))
        return sub.queue

    def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def collect_metrics(self) -> None:
        """Before /metrics renders: the replicas' engine metrics summed, and the router's counters."""
        if self.metrics is None or not LIVE_ROUTERS:
            return
        router = LIVE_ROUTERS[-1]
        stats = router.replica_stats()
        self.metrics.observe_engine(sum_engine_metrics(list(stats.values())))
        self.routing_metrics.observe(router.policy.snapshot(), stats, self.retries, self.replica_failures)

    # --- internals -----------------------------------------------------------------------------------------
    async def _open(self, payload: dict):
        """Send the request until a replica accepts it; -> the open stream (its "accepted" item read)."""
        last = None
        for attempt in range(self.max_attempts):
            if attempt:
                self.retries += 1
                await asyncio.sleep(self.retry_backoff_s * attempt)
            gen = self.handle.generate.remote(payload)
            try:
                kind, info = await gen.__anext__()
            except StopAsyncIteration:
                last = RuntimeError("the replica closed the stream")
                continue
            except Exception as e:     # noqa: BLE001
                if not _replica_failure(e):
                    raise APIError(f"engine replica error: {type(e).__name__}: {e}", 500, type="server_error") \
                        from None
                logger.warning("replica failed before accepting %s (%s); retrying", payload["request_id"], e)
                last = e
                continue
            if kind == "error":
                raise APIError.from_dict(info)
            return gen
        raise APIError(f"no engine replica could take the request ({type(last).__name__})", 503,
                       type="server_error", code="engine_unavailable")

    async def _pump(self, sub: Submission, payload: dict, gen) -> None:
        put = sub.queue.put_nowait
        sent_tokens = False
        try:
            while True:
                try:
                    async for kind, item in gen:
                        if kind == "output":
                            if item.new_token_ids:
                                if sub.first_token_time is None:
                                    sub.first_token_time = time.time()
                                sent_tokens = True
                            put((kind, item))
                            if item.finished and self.metrics is not None:
                                self.metrics.observe_finished(sub, item, time.time())
                        elif kind == "error":
                            self._count("error")
                            put(("error", APIError.from_dict(item)))
                        elif kind == "shutdown":
                            put(("shutdown", item) if not isinstance(item, dict)
                                else ("error", APIError.from_dict(item)))
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001
                    if not _replica_failure(e):
                        logger.exception("request %s failed in its replica", sub.request_id)
                        self._count("error")
                        put(("error", APIError(f"engine replica error: {type(e).__name__}", 500,
                                               type="server_error")))
                        return
                    if sent_tokens and sub.stream:
                        self.replica_failures += 1
                        self._count("error")
                        put(("error", APIError("the engine replica serving this request failed mid-generation; "
                                               "retry the request", 502, type="server_error",
                                               code="replica_failed")))
                        return
                    logger.warning("replica failed before %s produced a token (%s); retrying", sub.request_id, e)
                    try:
                        gen = await self._open(payload)
                    except APIError as err:
                        self._count("unavailable")
                        put(("error", err))
                        return
        except asyncio.CancelledError:
            gen.cancel()               # the replica aborts the request and frees its KV blocks
            self._count("abort")
            raise

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(outcome=outcome).inc()


def sum_engine_metrics(reports: list[dict]) -> dict:
    """Several engines' `get_metrics()` as one engine's: gauges and counters add up, the prefix
    hit rate is recomputed from the summed counts, per-position acceptance adds element-wise."""
    out = {"num_running": 0, "num_waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 0,
           "prefix_cache": {"queries": 0, "hits": 0}, "spec_decode": {}}
    spec = out["spec_decode"]
    for m in reports:
        for k in ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total"):
            out[k] += int(m.get(k, 0))
        for k in ("queries", "hits"):
            out["prefix_cache"][k] += int((m.get("prefix_cache") or {}).get(k, 0))
        for k, v in (m.get("spec_decode") or {}).items():
            if k == "accepted_per_position":
                acc = spec.setdefault(k, [])
                acc.extend([0] * (len(v) - len(acc)))
                for i, x in enumerate(v):
                    acc[i] += x
            elif isinstance(v, (int, float)) and k.startswith("num_"):
                spec[k] = spec.get(k, 0) + v
        alloc = m.get("draft_allocation") or {}
        for k in ALLOCATION_COUNTERS:
            if k in alloc:
                total = out.setdefault("draft_allocation", {})
                total[k] = total.get(k, 0) + alloc[k]
    pc = out["prefix_cache"]
    pc["hit_rate"] = pc["hits"] / pc["queries"] if pc["queries"] else 0.0
    return out


class RoutingMetrics:
    """The router's decisions on the ingress's /metrics."""

    def __init__(self, registry):
        from prometheus_client import Counter, Gauge
        self.decisions = Counter("draftwise_router_decisions", "Requests routed, by reason (session, prefix, "
                                 "balance, least_loaded)", ["reason"], registry=registry)
        self.per_replica = Counter("draftwise_router_requests", "Requests routed to each replica", ["replica"],
                                   registry=registry)
        self.session_hit_rate = Gauge("draftwise_router_session_hit_rate", "Requests of a known session routed "
                                      "to that session's replica / requests naming a session", registry=registry)
        self.replicas = Gauge("draftwise_router_replicas", "Engine replicas taking requests", registry=registry)
        self.replica_info = Gauge("draftwise_replica_info", "One series per live engine replica: its node and "
                                  "process", ["replica", "node_ip", "pid"], registry=registry)
        self.retries = Counter("draftwise_router_retries", "Requests re-sent to another replica after a replica "
                               "failed before their first token", registry=registry)
        self.replica_failures = Counter("draftwise_router_replica_failures", "Requests ended by a replica failure "
                                        "after tokens were sent", registry=registry)
        self._last: dict = {}

    def observe(self, snapshot: dict, replicas: dict[str, dict], retries: int, failures: int) -> None:
        def bump(counter, key, value):
            last = self._last.get(key, 0)
            if value > last:
                counter.inc(value - last)
            self._last[key] = value
        for reason, n in snapshot["decisions"].items():
            bump(self.decisions.labels(reason=reason), ("d", reason), n)
        for replica, n in snapshot["requests_per_replica"].items():
            bump(self.per_replica.labels(replica=replica), ("r", replica), n)
        bump(self.retries, "retries", retries)
        bump(self.replica_failures, "failures", failures)
        asked = snapshot["session_requests"]
        self.session_hit_rate.set(snapshot["session_hits"] / asked if asked else 0.0)
        self.replicas.set(len(replicas))
        self.replica_info.clear()
        for rid, stats in replicas.items():
            self.replica_info.labels(replica=rid, node_ip=str(stats.get("node_ip", "")),
                                     pid=str(stats.get("pid", ""))).set(1)
