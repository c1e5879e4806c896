"""Multi-node tensor parallelism on Ray actors: on a two-node loopback cluster, TP=2 with rank 1 on
the other node gives the same greedy tokens as TP=1; killing that rank fails the in-flight request
within seconds with an error naming it, and the server's health check reports the engine failed."""
import os
import signal
import threading
import time

import httpx
import pytest

from tests.distributed.test_tp import GREEDY, PROMPTS, _gen
from tests.helpers import ServerThread, make_tiny_hf
from tests.ray_cluster import RAY_ENV
from draftwise import LLM


@pytest.fixture
def ray_driver(ray_cluster, monkeypatch):
    """This test process joins the cluster as a driver on the head node."""
    import ray
    for k, v in RAY_ENV.items():
        monkeypatch.setenv(k, v)
    ray.init(address=ray_cluster.address, _node_ip_address=ray_cluster.ips[0], logging_level="ERROR")
    yield ray_cluster
    ray.shutdown()


def test_tp2_across_two_nodes_equals_tp1_and_a_dead_rank_fails_fast(ray_driver, tmp_path):
    from draftwise.entrypoints.openai.api_server import build_app
    path = str(tmp_path / "llama")
    make_tiny_hf(path, "llama", seed=3)                  # 4 heads, 2 KV heads: 2 + 1 per rank
    kw = dict(block_size=4, max_model_len=128, max_num_seqs=4)
    one = LLM(path, speculative_config=None, **kw)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    two = LLM(path, speculative_config=spec, tensor_parallel_size=2, distributed_executor_backend="ray", **kw)
    try:
        ranks = two.engine.worker.tp.ranks
        assert ranks.node_ips == [ray_driver.ips[1]]       # rank 1 runs on the other node
        assert _gen(two, GREEDY) == _gen(one, GREEDY)
        with ServerThread(build_app(two, "tp-ray")) as srv:
            body = {"model": "tp-ray", "prompt": PROMPTS[0], "max_tokens": 64, "ignore_eos": True}
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
            got = {}

            def long_request():
                got["r"] = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 100},
                                      timeout=60)
            real_step = two.engine.step

            def slow_step():               # keep the request in flight while the rank dies
                time.sleep(0.05)
                return real_step()
            two.engine.step = slow_step
            t = threading.Thread(target=long_request)
            t.start()
            time.sleep(0.5)
            killed = time.time()
            os.kill(ranks.pids[0], signal.SIGKILL)
            t.join(30)
            failed_after = time.time() - killed
            r = got["r"]
            assert r.status_code == 500 and "tensor-parallel" in r.json()["error"]["message"], r.text
            assert failed_after < 10, failed_after
            health = httpx.get(srv.url + "/health", timeout=10)
            assert health.status_code == 503 and "tensor-parallel worker 1" in health.json()["status"]
            refused = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
            assert refused.status_code == 503 and "tensor-parallel" in refused.json()["error"]["message"]
    finally:
        two.shutdown()
