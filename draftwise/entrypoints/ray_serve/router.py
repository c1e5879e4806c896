"""Ray Serve request router for engine replicas: `routing.AffinityRouter` behind Ray
Serve's request-router API.

Ray Serve builds one router per deployment handle, in the process that calls the handle (the
ingress). `choose_replicas` ranks the affinity choice first and the rest by load; a request
retried by Ray (no replica accepted it) reuses its first decision. Replicas' reports
(`EngineReplica.record_routing_stats`) arrive every `request_routing_stats_period_s` and feed both
the KV-pressure rule and the ingress's aggregated `/metrics`."""
from __future__ import annotations

import logging
from collections import OrderedDict

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from draftwise.entrypoints.ray_serve.routing import AffinityRouter, ReplicaLoad, RouteRequest, RoutingConfig
from draftwise.entrypoints.ray_serve import client

logger = logging.getLogger("draftwise.serve")


class DraftwiseRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **routing_config):
        self.policy = AffinityRouter(RoutingConfig(**routing_config))
        self._decided: "OrderedDict[str, str]" = OrderedDict()    # internal request id -> replica id
        # Ray Serve unpickles this class from a by-value copy of this module: the registry the
        # ingress reads lives in another module
        client.LIVE_ROUTERS.append(self)

    def _sync_replicas(self) -> None:
        reports = self.replica_stats()
        self.policy.set_replicas(reports)
        for rid, stats in reports.items():
            used, total = stats.get("kv_blocks_used", 0), stats.get("kv_blocks_total", 0)
            self.policy.report_load(rid, ReplicaLoad(int(stats.get("num_running", 0)),
                                                     int(stats.get("num_waiting", 0)),
                                                     used / total if total else 0.0))

    def replica_stats(self) -> dict[str, dict]:
        """Each live replica's last report (empty until its first)."""
        return {r.replica_id.unique_id: dict(r.routing_stats or {}) for r in self._replicas.values()}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._sync_replicas()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        payload = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if not isinstance(payload, dict) or "prompt_token_ids" not in payload:
            return [candidate_replicas]          # not a generate call (describe, health ...)
        key = pending_request.metadata.internal_request_id
        chosen = self._decided.get(key)
        if chosen not in by_id:
            decision = self.policy.choose(RouteRequest(payload["prompt_token_ids"], payload.get("session_id")),
                                          list(by_id))
            chosen = decision.replica
            self._decided[key] = chosen
            while len(self._decided) > 10_000:
                self._decided.popitem(last=False)
        rest = sorted((r for rid, r in by_id.items() if rid != chosen),
                      key=lambda r: self.policy.in_flight(r.replica_id.unique_id))
        return [[by_id[chosen]]] + ([rest] if rest else [])

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        if self._decided.pop(internal_request_id, None) is not None:
            self.policy.on_completed(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self.policy.set_replicas([r for r in self.replica_stats() if r != replica_id.unique_id])
