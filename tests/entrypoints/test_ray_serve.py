"""Serving on Ray (`serve --data-parallel-size 2` on a two-node loopback cluster): replicas on
different nodes, session affinity, prefix-cache hits against round robin, balance under a shared
system prompt, and failover when a replica dies under load (no request lost; the replacement
replica takes traffic again). The OpenAI-API tests also run through this endpoint
(`test_server.py`, the `ray` parameter)."""
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.ray_cluster import RayServer

NAME = "tiny-ray"


def serve(cluster, model_dir, *extra):
    return RayServer(cluster, "--model", model_dir, "--served-model-name", NAME, "--max-model-len", "512",
                     "--max-num-seqs", "8", "--threads", "1", "--seed", "0", "--data-parallel-size", "2",
                     "--max-replicas-per-node", "1", *extra)


def metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def replicas(url: str) -> dict[str, dict]:
    """replica id -> {"node_ip", "pid"} from draftwise_replica_info."""
    out = {}
    for k in metrics(url):
        if k.startswith("draftwise_replica_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', k))
            out[labels["replica"]] = labels
    return out


def routed(url: str) -> dict[str, float]:
    return {dict(re.findall(r'(\w+)="([^"]*)"', k))["replica"]: v for k, v in metrics(url).items()
            if k.startswith("draftwise_router_requests_total{")}


def wait_for(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def chat(url, messages, max_tokens=8, session=None, user=None, **kw):
    body = {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}
    if user:
        body["user"] = user
    headers = {"x-session-id": session} if session else {}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def dp_server(model_dir, ray_cluster):
    srv = serve(ray_cluster, model_dir)
    chat(srv.url, [{"role": "user", "content": "warm up"}])
    wait_for(lambda: len(replicas(srv.url)) == 2, 30, "both replicas to report")
    yield srv
    assert srv.stop() == 0


def test_two_replicas_on_two_nodes(dp_server):
    info = replicas(dp_server.url)
    assert sorted(r["node_ip"] for r in info.values()) == ["127.0.0.2", "127.0.0.3"]
    assert len({r["pid"] for r in info.values()}) == 2


def test_a_shared_system_prompt_spreads_over_both_replicas(dp_server):
    # before the conversations test, which stops this server
    url = dp_server.url
    system = {"role": "system", "content": "You are a careful assistant who answers in one short sentence. " * 4}
    before = routed(url)
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda i: chat(url, [system, {"role": "user", "content": f"What is {i} plus {i}?"}], 4),
                    range(40)))
    after = routed(url)
    share = {r: after.get(r, 0) - before.get(r, 0) for r in after}
    assert sum(share.values()) == 40 and max(share.values()) <= 0.75 * 40, share


def conversations(url: str, n: int = 16, turns: int = 4, by_user: bool = True) -> None:
    """n conversations of `turns` turns each, 8 at a time; half name their session with the
    `user` field, half with the x-session-id header."""
    topics = ["the sea", "compilers", "bread", "chess", "rivers", "owls", "tea", "glass", "jazz", "maps",
              "bees", "clocks", "snow", "paper", "kites", "salt"]

    def one(i):
        msgs = [{"role": "system", "content": f"You are a guide to {topics[i % len(topics)]}. " * 2}]
        for t in range(turns):
            msgs.append({"role": "user", "content": f"Question {t} about {topics[i % len(topics)]}?"})
            sid = f"conv-{i}"
            r = chat(url, msgs, 8, **({"user": sid} if by_user and i % 2 else {"session": sid}))
            msgs.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(one, range(n)))


def test_conversations_stay_on_their_replica_and_hit_the_prefix_cache(dp_server, model_dir, ray_cluster):
    def hit_rate_after(url):
        before = metrics(url)
        conversations(url)
        time.sleep(2.5)                # replicas report every second
        after = metrics(url)
        q = after["draftwise_prefix_cache_queries_total"] - before.get("draftwise_prefix_cache_queries_total", 0)
        h = after["draftwise_prefix_cache_hits_total"] - before.get("draftwise_prefix_cache_hits_total", 0)
        return h / q, before, after

    affinity, before, after = hit_rate_after(dp_server.url)
    key = 'draftwise_router_decisions_total{reason="session"}'
    later_turns = 16 * 3
    assert after.get(key, 0) - before.get(key, 0) >= 0.95 * later_turns
    # the same workload routed round robin (a second server on the cluster, after this one is gone)
    dp_server.stop()
    rr = serve(ray_cluster, model_dir, "--routing", "round_robin")
    try:
        round_robin, _, _ = hit_rate_after(rr.url)
    finally:
        rr.stop()
    print(f"prefix-cache hit rate: affinity {affinity:.3f}, round robin {round_robin:.3f}")
    assert affinity > round_robin


@pytest.fixture
def fresh_server(model_dir, ray_cluster):
    srv = serve(ray_cluster, model_dir)
    chat(srv.url, [{"role": "user", "content": "warm up"}])
    wait_for(lambda: len(replicas(srv.url)) == 2, 30, "both replicas to report")
    yield srv
    srv.stop()


def stream_one(url: str, i: int, model: str = NAME) -> dict:
    """One streaming completion: what the client saw."""
    body = {"model": model, "prompt": f"Request number {i} tells a story about", "max_tokens": 96,
            "temperature": 0, "stream": True, "ignore_eos": True}
    t0, text, finish, error, done, status = time.time(), "", None, None, False, None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    error = ev["error"]
                    continue
                ch = ev["choices"][0]
                text += ch.get("text") or ""
                finish = ch.get("finish_reason") or finish
    except httpx.HTTPError as e:
        error = repr(e)
    return {"status": status, "text": text, "finish": finish, "error": error, "done": done,
            "latency": time.time() - t0}


def kill_a_replica_under_load(url: str, model: str = NAME) -> None:
    """100 streamed requests at concurrency 8, one replica SIGKILLed after 30 finished: none is lost
    (each completes, or ends with an error event and [DONE] after streaming tokens), p99 bounded;
    Ray Serve replaces the replica and the router sends it traffic again."""
    victim_id, victim = sorted(replicas(url).items())[0]
    finished = []

    def run(i):
        res = stream_one(url, i, model)
        finished.append(res)
        if len(finished) == 30:
            os.kill(int(victim["pid"]), signal.SIGKILL)
        return res

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(run, range(100)))
    completed = [r for r in results if r["status"] == 200 and r["finish"] == "length" and r["done"]
                 and not r["error"]]
    cut = [r for r in results if r["status"] == 200 and r["error"] and r["text"] and r["done"]]
    lost = [r for r in results if r not in completed and r not in cut]
    lat = sorted(r["latency"] for r in results)
    print(f"completed {len(completed)}, cut mid-stream with an error event {len(cut)}, lost {len(lost)}, "
          f"p50 {lat[49]:.2f}s p99 {lat[98]:.2f}s")
    assert not lost, lost[:3]
    assert len(completed) >= 100 - 8          # at most the victim's in-flight streams are cut
    assert lat[98] < 120

    def replaced():
        info = replicas(url)
        return info if len(info) == 2 and victim_id not in info else None
    survivors = set(wait_for(replaced, 180, "a replacement replica"))
    before = routed(url)
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda i: stream_one(url, 1000 + i, model), range(12)))
    after = routed(url)
    assert all(after.get(r, 0) - before.get(r, 0) > 0 for r in survivors), (before, after)


def test_a_killed_replica_loses_no_request_and_is_replaced(fresh_server):
    kill_a_replica_under_load(fresh_server.url)


@pytest.mark.slow
def test_smollm2_replicas_on_two_nodes_match_one_process_and_survive_a_kill(ray_cluster):
    """The default model (SmolLM2-135M, int4, suffix decoding): two replicas on two nodes, greedy
    answers identical to the single-process engine's, then the failover run."""
    from draftwise import LLM, SamplingParams
    from draftwise.bench.datasets import load_prompts
    from draftwise.entrypoints.llm import DEFAULT_MODEL
    srv = RayServer(ray_cluster, "--threads", "1", "--max-num-seqs", "8", "--data-parallel-size", "2",
                    "--max-replicas-per-node", "1", timeout=600)
    try:
        wait_for(lambda: httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                    timeout=60).status_code == 200 and len(replicas(srv.url)) == 2,
                 60, "both replicas to report")
        assert sorted(r["node_ip"] for r in replicas(srv.url).values()) == ["127.0.0.2", "127.0.0.3"]
        questions = [c[0] for c in load_prompts(os.environ.get("MT_BENCH", "code-edits"), 6)]
        ref = LLM(DEFAULT_MODEL, threads=1)
        want = [o.outputs[0].text for o in ref.chat([[{"role": "user", "content": q}] for q in questions],
                                                     SamplingParams(temperature=0, max_tokens=48))]
        ref.shutdown()
        with ThreadPoolExecutor(6) as ex:
            got = list(ex.map(lambda q: httpx.post(srv.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": q}], "max_tokens": 48, "temperature": 0},
                timeout=300).json()["choices"][0]["message"]["content"], questions))
        assert got == want
        kill_a_replica_under_load(srv.url, DEFAULT_MODEL)
    finally:
        srv.stop()


@pytest.mark.slow          # ~20 s; TP across Ray nodes stays in tests/distributed/test_tp_ray.py
def test_a_replica_with_tensor_parallelism_across_the_nodes(model_dir, ray_cluster):
    """`serve --ray-address ... --tensor-parallel-size 2 --distributed-executor-backend ray`: one
    replica whose target is sharded over both nodes answers as the single-process engine does."""
    from draftwise import LLM, SamplingParams
    srv = RayServer(ray_cluster, "--model", model_dir, "--served-model-name", NAME, "--max-model-len", "256",
                    "--threads", "1", "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    try:
        prompts = ["Hello world, how are", "The quick brown fox"]
        got = [httpx.post(srv.url + "/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0},
                          timeout=60).json()["choices"][0]["text"] for p in prompts]
    finally:
        assert srv.stop() == 0
    ref = LLM(model_dir, max_model_len=256)
    assert got == [o.outputs[0].text for o in ref.generate(prompts, SamplingParams(temperature=0, max_tokens=12))]


def test_an_existing_serve_instance_is_kept_replaced_or_named():
    """Ray Serve keeps the HTTP options of the instance a cluster already runs; a new `draftwise
    serve` on another port replaces one that holds only draftwise's applications (a server that
    did not shut down left it) and refuses, naming its port, one that serves anything else."""
    from draftwise.entrypoints.ray_serve.launch import ENGINE_APP, INGRESS_APP, existing_serve_verdict
    here = ("127.0.0.1", 8000)
    assert existing_serve_verdict(here, here, {"other"}) == "keep"
    assert existing_serve_verdict(here, ("127.0.0.1", 8123), set()) == "replace"
    assert existing_serve_verdict(here, ("127.0.0.1", 8123), {ENGINE_APP, INGRESS_APP}) == "replace"
    with pytest.raises(ValueError, match=r"127.0.0.1:8123 \(applications: chatbot\).*--port 8123"):
        existing_serve_verdict(here, ("127.0.0.1", 8123), {INGRESS_APP, "chatbot"})


@pytest.mark.slow          # two server starts, ~40 s
def test_a_server_killed_without_shutting_down_leaves_no_wrong_port(model_dir, ray_cluster):
    """SIGKILL a server (its Serve controller and proxy live on in the cluster), then serve on
    another port: the new server answers there."""
    first = serve(ray_cluster, model_dir)
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.stop()
    second = serve(ray_cluster, model_dir)
    try:
        assert httpx.get(second.url + "/health", timeout=10).status_code == 200
        assert chat(second.url, [{"role": "user", "content": "hi"}])["choices"]
    finally:
        second.stop()
