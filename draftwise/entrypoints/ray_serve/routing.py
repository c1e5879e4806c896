"""Which engine replica serves a request: session and prefix affinity, held back by load.

Every replica keeps its own prefix cache and, with suffix decoding, its own tree of past outputs,
so the replica a request lands on decides both how much of its prompt is already computed and how
well its drafts will be accepted. The policy, in order:

1. **Session affinity.** A request naming a session (an `x-session-id` header or the OpenAI `user`
   field) goes where that session's last request went.
2. **Prefix affinity.** Otherwise the prompt's full KV blocks are hashed exactly as the replicas'
   prefix caches key them (chained SHA-256 of token ids), and the request goes to the replica that
   was sent the longest run of its leading blocks. Blocks that many different requests started
   with (a system prompt everyone shares) are *common*: they are cached on whichever replica runs
   them once, so they earn no affinity; otherwise a shared system prompt would send every request
   to the replica that saw it first.
3. **Balance.** An affinity choice is overruled when its replica is loaded beyond the least loaded
   one by more than `imbalance_threshold` requests in flight, or its KV cache is above
   `kv_high_watermark` while another's is not. Without affinity the least loaded replica wins
   (ties: the one sent fewest requests so far, which spreads an idle cluster evenly).

The table of block hashes per replica is approximate (what was routed, not what is still cached)
and bounded (`max_blocks_per_replica`, least recently routed forgotten first). `ReplicaLoad` is the
load a replica reports; `in_flight` is counted here from routing and completion events, which is
exact for this router and immediate (replica reports arrive periodically). This module has no Ray
dependency: the Ray Serve request router adapts it."""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from draftwise.engine.kv_cache import block_hashes


@dataclass
class ReplicaLoad:
    """What a replica reports about itself (its engine's gauges)."""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0               # fraction of KV blocks in use


@dataclass
class RouteRequest:
    """What the router reads from a request."""
    prompt_token_ids: list[int]
    session_id: str | None = None


@dataclass
class RoutingDecision:
    replica: str
    reason: str                         # session | prefix | balance | least_loaded
    matched_blocks: int = 0


@dataclass
class RoutingConfig:
    mode: str = "affinity"               # affinity | round_robin (the baseline affinity is measured against)
    block_size: int = 16
    imbalance_threshold: int = 4         # extra requests in flight an affinity target may carry
    kv_high_watermark: float = 0.9
    common_prefix_requests: int = 4      # a block routed this many times is common (no affinity)
    max_blocks_per_replica: int = 200_000
    max_sessions: int = 100_000


@dataclass
class _ReplicaState:
    blocks: "OrderedDict[bytes, None]" = field(default_factory=OrderedDict)
    in_flight: int = 0
    routed: int = 0
    load: ReplicaLoad = field(default_factory=ReplicaLoad)


class AffinityRouter:
    """The routing policy over a changing set of replica ids (pure Python, no I/O)."""

    def __init__(self, config: RoutingConfig | None = None):
        self.config = config or RoutingConfig()
        if self.config.mode not in ("affinity", "round_robin"):
            raise ValueError(f"routing mode must be 'affinity' or 'round_robin', got {self.config.mode!r}")
        self._replicas: dict[str, _ReplicaState] = {}
        self._sessions: "OrderedDict[str, str]" = OrderedDict()
        self._block_requests: Counter = Counter()      # block hash -> requests routed with it
        self.decisions: Counter = Counter()            # reason -> count
        self._turn = 0
        self.requests_per_replica: Counter = Counter()
        self.session_requests = 0                      # requests of a session seen before
        self.session_hits = 0                          # of which routed to the session's replica

    # --- replica set and load ------------------------------------------------------------------------
    def set_replicas(self, replica_ids) -> None:
        """The replicas that may take requests now (a dead one's state is forgotten)."""
        ids = set(replica_ids)
        gone = [rid for rid in self._replicas if rid not in ids]
        for rid in gone:
            del self._replicas[rid]
        for rid in ids:
            self._replicas.setdefault(rid, _ReplicaState())
        if gone:                       # called per request: forget a dead replica's state only then
            live = set().union(*(r.blocks for r in self._replicas.values()))
            self._block_requests = Counter({h: n for h, n in self._block_requests.items() if h in live})
            for sid, rid in list(self._sessions.items()):
                if rid not in ids:
                    del self._sessions[sid]

    def report_load(self, replica: str, load: ReplicaLoad) -> None:
        if replica in self._replicas:
            self._replicas[replica].load = load

    def in_flight(self, replica: str) -> int:
        st = self._replicas.get(replica)
        return st.in_flight if st is not None else 0

    def on_completed(self, replica: str) -> None:
        st = self._replicas.get(replica)
        if st is not None and st.in_flight > 0:
            st.in_flight -= 1

    # --- the decision ----------------------------------------------------------------------------------
    def block_hashes(self, token_ids: list[int]) -> list[bytes]:
        bs = self.config.block_size
        return block_hashes(token_ids, bs, len(token_ids) // bs)

    def choose(self, request: RouteRequest, candidates: list[str] | None = None) -> RoutingDecision:
        """Pick a replica among `candidates` (all known replicas by default) and record the choice."""
        ids = [r for r in (candidates if candidates is not None else self._replicas) if r in self._replicas]
        if not ids:
            raise LookupError("no replica is available")
        hashes = self.block_hashes(request.prompt_token_ids)
        if self.config.mode == "round_robin":
            target = sorted(ids)[self._turn % len(ids)]
            self._turn += 1
            self._record(target, request.session_id, hashes)
            self.decisions["round_robin"] += 1
            return RoutingDecision(target, "round_robin")
        target, reason, matched = None, "least_loaded", 0
        if request.session_id is not None and request.session_id in self._sessions:
            self.session_requests += 1
            prev = self._sessions[request.session_id]
            if prev in ids:
                target, reason = prev, "session"
        if target is None:
            target, matched = self._longest_prefix(hashes, ids)
            if target is not None:
                reason = "prefix"
        if target is not None and self._overloaded(target, ids):
            target, reason = None, "balance"
        if target is None:
            target = self._least_loaded(ids)
        if reason == "session":
            self.session_hits += 1
        self._record(target, request.session_id, hashes)
        self.decisions[reason] += 1
        return RoutingDecision(target, reason, matched)

    def _longest_prefix(self, hashes: list[bytes], ids: list[str]) -> tuple[str | None, int]:
        """The replica sent the longest run of this prompt's leading non-common blocks."""
        common = self.config.common_prefix_requests
        best, best_len = None, 0
        for rid in ids:
            blocks = self._replicas[rid].blocks
            n = distinctive = 0
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
                if self._block_requests[h] < common:
                    distinctive += 1
            if distinctive > best_len:
                best, best_len = rid, distinctive
        return best, best_len

    def _overloaded(self, rid: str, ids: list[str]) -> bool:
        loads = {r: self._replicas[r].in_flight for r in ids}
        if loads[rid] - min(loads.values()) > self.config.imbalance_threshold:
            return True
        hi = self.config.kv_high_watermark
        return (self._replicas[rid].load.kv_usage > hi
                and any(self._replicas[r].load.kv_usage <= hi for r in ids if r != rid))

    def _least_loaded(self, ids: list[str]) -> str:
        """Fewest requests in flight, then the lower KV usage in steps of a tenth (the gauge is a
        report up to a second old: finer differences would send a whole burst to one replica), then
        the fewer requests routed so far."""
        return min(ids, key=lambda r: (self._replicas[r].in_flight, round(self._replicas[r].load.kv_usage, 1),
                                       self._replicas[r].routed, r))

    def _record(self, rid: str, session: str | None, hashes: list[bytes]) -> None:
        st = self._replicas[rid]
        st.in_flight += 1
        st.routed += 1
        self.requests_per_replica[rid] += 1
        for h in hashes:
            self._block_requests[h] += 1
            st.blocks[h] = None
            st.blocks.move_to_end(h)
        while len(st.blocks) > self.config.max_blocks_per_replica:
            old, _ = st.blocks.popitem(last=False)
            if not any(old in r.blocks for r in self._replicas.values()):
                self._block_requests.pop(old, None)
        if session is not None:
            self._sessions[session] = rid
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)

    # --- reporting ----------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {"decisions": dict(self.decisions), "requests_per_replica": dict(self.requests_per_replica),
                "in_flight": {r: s.in_flight for r, s in self._replicas.items()},
                "session_requests": self.session_requests, "session_hits": self.session_hits}
