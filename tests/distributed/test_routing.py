"""The replica routing policy, driven by hand-built requests (no Ray, no model)."""
import random

import pytest

from draftwise.entrypoints.ray_serve.routing import AffinityRouter, ReplicaLoad, RouteRequest, RoutingConfig

BS = 4


def router(**kw) -> AffinityRouter:
    r = AffinityRouter(RoutingConfig(block_size=BS, **kw))
    r.set_replicas(["a", "b"])
    return r


def prompt(seed: int, n: int = 24, prefix: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    return list(prefix or []) + [rng.randrange(1000) for _ in range(n)]


def test_session_sticks_to_its_first_replica():
    r = router()
    first = {f"s{i}": r.choose(RouteRequest(prompt(i), f"s{i}")).replica for i in range(8)}
    for i in range(8):
        r.on_completed(first[f"s{i}"])
    assert set(first.values()) == {"a", "b"}          # sessions spread over both replicas
    for turn in range(3):
        for i in range(8):
            d = r.choose(RouteRequest(prompt(100 * turn + i), f"s{i}"))
            assert (d.replica, d.reason) == (first[f"s{i}"], "session")
            r.on_completed(d.replica)
    assert r.session_hits == r.session_requests == 24


def test_a_conversation_without_session_follows_its_prefix():
    r = router()
    turn1 = prompt(1)
    d1 = r.choose(RouteRequest(turn1))
    r.on_completed(d1.replica)
    other = r.choose(RouteRequest(prompt(2)))          # least loaded: the other replica
    assert other.replica != d1.replica
    r.on_completed(other.replica)
    d2 = r.choose(RouteRequest(turn1 + prompt(3, 12)))
    assert (d2.replica, d2.reason) == (d1.replica, "prefix") and d2.matched_blocks == len(turn1) // BS


def test_a_shared_system_prompt_does_not_pile_onto_one_replica():
    r = router(common_prefix_requests=3)
    system = prompt(0, 64)
    counts = {"a": 0, "b": 0}
    for i in range(40):                                # sequential: nothing ever in flight
        d = r.choose(RouteRequest(prompt(i + 1, 8, prefix=system)))
        counts[d.replica] += 1
        r.on_completed(d.replica)
    assert max(counts.values()) <= 0.75 * 40, counts


def test_balance_overrules_affinity_beyond_the_threshold():
    r = router(imbalance_threshold=2)
    conv = prompt(7)
    home = r.choose(RouteRequest(conv, "s")).replica
    for _ in range(2):                                 # two more in flight on the same replica: allowed
        assert r.choose(RouteRequest(conv, "s")).replica == home
    d = r.choose(RouteRequest(conv, "s"))              # now 3 ahead of the idle replica
    assert d.replica != home and d.reason == "balance"


def test_a_replica_with_full_kv_loses_its_affinity():
    r = router()
    conv = prompt(9)
    home = r.choose(RouteRequest(conv, "s")).replica
    r.on_completed(home)
    r.report_load(home, ReplicaLoad(running=1, kv_usage=0.97))
    assert r.choose(RouteRequest(conv, "s")).replica != home


def test_a_removed_replica_is_never_chosen_and_its_sessions_move():
    r = router()
    home = r.choose(RouteRequest(prompt(3), "s")).replica
    r.set_replicas([x for x in ("a", "b") if x != home])
    d = r.choose(RouteRequest(prompt(3), "s"))
    assert d.replica != home and d.reason == "least_loaded"
    r.set_replicas([])
    with pytest.raises(LookupError):
        r.choose(RouteRequest(prompt(3)))


def test_block_tables_stay_bounded():
    r = router(max_blocks_per_replica=10)
    for i in range(50):
        r.on_completed(r.choose(RouteRequest(prompt(i, 40))).replica)
    assert all(len(s.blocks) <= 10 for s in r._replicas.values())
    assert len(r._block_requests) <= 20


def test_round_robin_ignores_affinity():
    r = router(mode="round_robin")
    got = [r.choose(RouteRequest(prompt(1), "s")).replica for _ in range(6)]
    assert got == ["a", "b"] * 3
    with pytest.raises(ValueError, match="routing mode"):
        AffinityRouter(RoutingConfig(mode="random"))


def test_small_kv_differences_do_not_send_a_burst_to_one_replica():
    """Requests without affinity alternate while the replicas' reported KV usage differs only a
    little (the report can be a second old); a real difference still decides."""
    r = router()
    r.report_load("a", ReplicaLoad(running=0, kv_usage=0.01))
    r.report_load("b", ReplicaLoad(running=0, kv_usage=0.03))
    got = []
    for i in range(10):
        d = r.choose(RouteRequest([1000 + i]))             # shorter than a block: no affinity
        got.append(d.replica)
        r.on_completed(d.replica)
    assert got.count("a") == got.count("b") == 5
    r.report_load("a", ReplicaLoad(running=0, kv_usage=0.6))
    assert r.choose(RouteRequest([7])).replica == "b"
