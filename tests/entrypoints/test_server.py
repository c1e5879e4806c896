"""The OpenAI-compatible server (`draftwise serve`) against a real uvicorn on loopback, with the
official `openai` client: outputs equal the offline `LLM` ones, concurrency, 400s, disconnects,
API keys, graceful shutdown and /metrics."""
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.helpers import ServerThread  # noqa: E402

from draftwise import LLM, SamplingParams  # noqa: E402
from draftwise.entrypoints.openai.api_server import build_app  # noqa: E402

MAX_LEN = 256
NAME = "tiny-test"
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
ENGINE_KW = dict(max_model_len=MAX_LEN, max_num_seqs=8, block_size=16, seed=0)

PROMPTS = ["Hello world, how are you today?", "The quick brown fox", "Write a short poem about the sea.",
           "What is the capital of France?", "Numbers like 42 and 2024", "Once upon a time there was",
           "Continuous batching lets new requests join", "A paged key value cache stores"]


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, speculative_config=SPEC, **ENGINE_KW)


@pytest.fixture(scope="module")
def local_server(model_dir):
    llm = LLM(model_dir, speculative_config=SPEC, **ENGINE_KW)
    with ServerThread(build_app(llm, NAME)) as srv:
        srv.llm = llm
        yield srv


@pytest.fixture(scope="module", params=["local", "ray"])
def server(request, model_dir):
    """The same HTTP tests against the single-process server and against two engine replicas on a
    two-node Ray cluster (`serve --data-parallel-size 2`)."""
    if request.param == "local":
        yield request.getfixturevalue("local_server")
        return
    from tests.ray_cluster import RayServer
    cluster = request.getfixturevalue("ray_cluster")
    srv = RayServer(cluster, "--model", model_dir, "--served-model-name", NAME, "--speculative-config", json.dumps(SPEC),
                    "--max-model-len", str(ENGINE_KW["max_model_len"]), "--max-num-seqs", str(ENGINE_KW["max_num_seqs"]),
                    "--block-size", str(ENGINE_KW["block_size"]), "--seed", str(ENGINE_KW["seed"]), "--threads", "1",
                    "--data-parallel-size", "2", "--max-replicas-per-node", "1")
    srv.metrics_lag = 2.5              # replicas report their engine figures every second
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def scrape(url_or_server) -> dict:
    """Prometheus text -> {'name{labels}': value} (from a server: after its replicas reported)."""
    url = getattr(url_or_server, "url", url_or_server)
    time.sleep(getattr(url_or_server, "metrics_lag", 0))
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


# ----------------------------------------------------------------------------------------------------
def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in ("draftwise_requests_total", "draftwise_time_to_first_token_seconds_bucket",
                 "draftwise_time_per_output_token_seconds_bucket", "draftwise_num_requests_running",
                 "draftwise_num_requests_waiting", "draftwise_kv_blocks_used",
                 "draftwise_spec_decode_num_drafts_total", "draftwise_spec_decode_num_draft_tokens_total",
                 "draftwise_spec_decode_num_accepted_tokens_total", "draftwise_draft_allocation_steps_total",
                 "draftwise_draft_allocation_draft_tokens_kept_total"):
        assert name in r.text, name
    assert httpx.get(server.url + "/nope").status_code == 404


def test_completions_match_offline(server, client, offline):
    prompts = PROMPTS[:3]
    ref = offline.generate(prompts, greedy(20))
    for p, want in zip(prompts, ref):
        r = client.completions.create(model=NAME, prompt=p, max_tokens=20, temperature=0)
        assert r.object == "text_completion" and len(r.choices) == 1
        assert r.choices[0].text == want.outputs[0].text
        assert r.choices[0].finish_reason == ("length" if want.outputs[0].finish_reason == "length" else "stop")
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

        chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=20, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == want.outputs[0].text
        finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finals) == 1
        assert chunks[-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    # token-id prompts work too
    ids = offline.tokenizer(prompts[0], add_special_tokens=False).input_ids
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=20, temperature=0)
    assert r.choices[0].text == ref[0].outputs[0].text


def test_chat_matches_offline(server, client, offline):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there!"}]
    (want,) = offline.chat(msgs, greedy(24))
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)

    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")

    # the raw SSE framing ends with [DONE]
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                      json={"model": NAME, "messages": msgs, "max_tokens": 4, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["object"] == "chat.completion.chunk"


def test_stop_strings_streaming_equals_offline(server, client, offline):
    p = PROMPTS[0]
    (full,) = offline.generate([p], greedy(30))
    text = full.outputs[0].text
    if len(text) < 8:
        pytest.skip("greedy output too short to pick a stop string")
    stop = text[4:7]
    (want,) = offline.generate([p], greedy(30, stop=[stop]))
    r = client.completions.create(model=NAME, prompt=p, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == want.outputs[0].text and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=30, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.outputs[0].text


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stop", [None, "stop-at"])
def test_spec_trace_spans_are_the_text_and_the_counters(server, offline, chat, stop):
    """`include_spec_trace`: spans (per token: draft or the target's own, drafter, step) whose texts
    concatenate to the answer, as many draft tokens as usage.spec_decode counts; streamed the same;
    llama-server's timings beside usage."""
    p = "one two three one two three one two three one"
    (free,) = offline.generate([p], greedy(40))
    stop = [free.outputs[0].text[10:13]] if stop and len(free.outputs[0].text) > 16 else None
    body = {"model": NAME, "max_tokens": 40, "temperature": 0, "include_spec_trace": True, "stop": stop,
            **({"messages": [{"role": "user", "content": p}]} if chat else {"prompt": p})}
    url = server.url + ("/v1/chat/completions" if chat else "/v1/completions")
    r = httpx.post(url, json=body, timeout=60).json()
    ch = r["choices"][0]
    text = ch["message"]["content"] if chat else ch["text"]
    spans = ch["spec_trace"]
    assert "".join(s["text"] for s in spans) == text
    tokens = {s["token"] for s in spans}
    assert tokens == set(range(r["usage"]["completion_tokens"]))
    drafted = {s["token"] for s in spans if s["draft"]}
    spec = r["usage"]["spec_decode"] or {"num_accepted_tokens": 0, "num_draft_tokens": 0}
    assert len(drafted) == spec["num_accepted_tokens"]
    assert all(s["source"] == "ngram" for s in spans if s["draft"])
    t = r["timings"]
    assert t["draft_n"] == spec["num_draft_tokens"] and t["draft_n_accepted"] == spec["num_accepted_tokens"]
    assert t["predicted_n"] == r["usage"]["completion_tokens"] and t["prompt_n"] == r["usage"]["prompt_tokens"]
    # streamed: each chunk's spans cover exactly its text
    body = {**body, "include_spec_trace": False, "stream": True,
            "stream_options": {"include_usage": True, "include_spec_trace": True}}
    streamed, stream_spans, usage_seen, timings_seen = "", [], None, None
    with httpx.stream("POST", url, json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage_seen = ev.get("usage") or usage_seen
            timings_seen = ev.get("timings") or timings_seen
            for c in ev["choices"]:
                piece = (c["delta"].get("content") or "") if chat else c["text"]
                spans_here = c.get("spec_trace") or []
                assert "".join(s["text"] for s in spans_here) == piece
                streamed += piece
                stream_spans += spans_here
    assert streamed == text
    assert {s["token"] for s in stream_spans if s["draft"]} == drafted
    assert usage_seen["spec_decode"] == r["usage"]["spec_decode"] and timings_seen["draft_n"] == t["draft_n"]
    # not asked: no trace
    plain = httpx.post(url, json={k: v for k, v in body.items() if k not in ("stream", "stream_options")},
                       timeout=60).json()
    assert plain["choices"][0]["spec_trace"] is None


def test_32_concurrent_requests(server, offline):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " + str(i) for i in range(32)]
    lens = [8 + (i % 5) * 4 for i in range(32)]
    ref = offline.generate(prompts, [greedy(n, ignore_eos=True) for n in lens])
    cl = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                       http_client=httpx.Client(limits=httpx.Limits(max_connections=64)))

    def one(i):
        kw = dict(model=NAME, prompt=prompts[i], max_tokens=lens[i], temperature=0, extra_body={"ignore_eos": True})
        if i % 2:
            return "".join(c.choices[0].text for c in cl.completions.create(stream=True, **kw))
        return cl.completions.create(**kw).choices[0].text

    with ThreadPoolExecutor(32) as ex:
        got = list(ex.map(one, range(32)))
    assert got == [r.outputs[0].text for r in ref]
    m = scrape(server)
    assert m["draftwise_kv_blocks_used"] == 0
    assert m['draftwise_requests_total{outcome="length"}'] >= 32
    assert m["draftwise_time_to_first_token_seconds_count"] >= 32
    assert m["draftwise_spec_decode_num_draft_tokens_total"] >= m["draftwise_spec_decode_num_accepted_tokens_total"]


BAD = [
    ("completions", b"{not json", "malformed JSON"),
    ("completions", b"[1, 2]", "body not an object"),
    ("completions", {"model": "nope", "prompt": "hi"}, "unknown model"),
    ("completions", {"model": NAME}, "missing prompt"),
    ("completions", {"model": NAME, "prompt": 5}, "prompt wrong type"),
    ("completions", {"model": NAME, "prompt": ""}, "empty prompt"),
    ("completions", {"model": NAME, "prompt": [1, 99999]}, "token id out of vocab"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": "5"}, "max_tokens wrong type"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": 0}, "max_tokens zero"),
    ("completions", {"model": NAME, "prompt": "hi", "max_tokens": MAX_LEN}, "max_tokens beyond context"),
    ("completions", {"model": NAME, "prompt": "hello " * (MAX_LEN + 10), "max_tokens": 1}, "prompt too long"),
    ("completions", {"model": NAME, "prompt": list(range(3, 3 + MAX_LEN))}, "token prompt too long"),
    ("completions", {"model": NAME, "prompt": "hi", "temperature": "hot"}, "temperature wrong type"),
    ("completions", {"model": NAME, "prompt": "hi", "temperature": -1}, "negative temperature"),
    ("completions", {"model": NAME, "prompt": "hi", "top_p": 0}, "top_p zero"),
    ("completions", {"model": NAME, "prompt": "hi", "top_k": -5}, "bad top_k"),
    ("completions", {"model": NAME, "prompt": "hi", "n": 17}, "n > 16"),
    ("completions", {"model": NAME, "prompt": "hi", "stop": 3}, "stop wrong type"),
    ("completions", {"model": NAME, "prompt": "hi", "seed": "x"}, "seed wrong type"),
    ("completions", {"model": NAME, "prompt": "hi", "stream": "yes"}, "stream wrong type"),
    ("chat/completions", {"model": NAME}, "missing messages"),
    ("chat/completions", {"model": NAME, "messages": []}, "empty messages"),
    ("chat/completions", {"model": NAME, "messages": "hi"}, "messages wrong type"),
    ("chat/completions", {"model": NAME, "messages": [{"content": "hi"}]}, "message without role"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": 3}]}, "content wrong type"),
    ("chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, "unknown model"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_LEN},
     "chat max_tokens beyond context"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi " * MAX_LEN}]},
     "chat prompt too long"),
    ("chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 0, "stream": True},
     "streaming n = 0"),
]


def test_bad_inputs_get_4xx_and_server_keeps_serving(server, client):
    before = scrape(server).get('draftwise_requests_total{outcome="rejected"}', 0)
    with httpx.Client(base_url=server.url, timeout=30) as h:
        for path, body, why in BAD:
            if isinstance(body, bytes):
                r = h.post("/v1/" + path, content=body, headers={"content-type": "application/json"})
            else:
                r = h.post("/v1/" + path, json=body)
            # an unknown model is a 404 model_not_found, as OpenAI and vLLM answer
            assert r.status_code == (404 if why == "unknown model" else 400), (why, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], why
            assert set(err) == {"message", "type", "param", "code"}, why
            ok = client.completions.create(model=NAME, prompt="hi", max_tokens=2)
            assert ok.usage.completion_tokens >= 1, why
    assert scrape(server)['draftwise_requests_total{outcome="rejected"}'] == before + len(BAD)
    assert scrape(server)["draftwise_kv_blocks_used"] == 0
    # the official client surfaces them as BadRequestError
    with pytest.raises(openai.NotFoundError, match="does not exist") as nf:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[], max_tokens=2)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="hi", max_tokens=5, temperature=0, n=2, best_of=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=NAME, prompt="hi", max_tokens=MAX_LEN)


def test_client_disconnect_aborts_and_frees_kv(local_server):
    server = local_server
    engine = server.llm.engine
    real_step = engine.step

    def slow_step():              # the tiny model would otherwise finish before we hang up
        time.sleep(0.01)
        return real_step()

    before = scrape(server).get('draftwise_requests_total{outcome="abort"}', 0)
    engine.step = slow_step
    try:
        body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            running = scrape(server)
            assert running["draftwise_kv_blocks_used"] > 0 and running["draftwise_num_requests_running"] == 1
            lines.close()             # drops the connection mid-stream
        deadline = time.time() + 10
        while True:
            m = scrape(server)
            if m.get('draftwise_requests_total{outcome="abort"}', 0) == before + 1 and m["draftwise_kv_blocks_used"] == 0:
                break
            assert time.time() < deadline, m
            time.sleep(0.05)
        assert m["draftwise_num_requests_running"] == 0 and m["draftwise_num_requests_waiting"] == 0
        # a non-streaming client that gives up is aborted too
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/chat/completions", timeout=0.3,
                       json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        deadline = time.time() + 10
        while True:
            m = scrape(server)
            if m['draftwise_requests_total{outcome="abort"}'] == before + 2 and m["draftwise_kv_blocks_used"] == 0:
                break
            assert time.time() < deadline, m
            time.sleep(0.05)
    finally:
        engine.step = real_step
    assert not engine.requests


def test_penalties_bias_and_filters_match_offline(server, client, offline):
    kw = dict(presence_penalty=1.2, frequency_penalty=0.6, logit_bias={"20": 5, "2": -100}, max_tokens=24,
              temperature=0)
    extra = {"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 10, "bad_words": ["the"]}
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], extra_body=extra, **kw)
    sp = greedy(24, presence_penalty=1.2, frequency_penalty=0.6, logit_bias={20: 5.0, 2: -100.0},
                repetition_penalty=1.3, min_p=0.05, min_tokens=10, bad_words=["the"])
    (want,) = offline.generate([PROMPTS[1]], sp)
    assert r.choices[0].text == want.outputs[0].text
    for bad in ({"logit_bias": {"x": 1}}, {"logit_bias": {"999999": 1}}, {"presence_penalty": 3},
                {"min_p": 2}, {"allowed_token_ids": []}, {"allowed_token_ids": [10 ** 7]}, {"bad_words": [""]},
                {"repetition_penalty": 0}, {"min_tokens": -1}):
        resp = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 2, **bad})
        assert resp.status_code == 400 and resp.json()["error"]["message"], bad


def test_openai_client_response_format_n_and_logit_bias(server, client, offline):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=30,
                                       temperature=0, response_format={"type": "json_schema", "json_schema": {
                                           "name": "s", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=30,
                                       temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=NAME, prompt="hi", max_tokens=6, temperature=0.9, seed=5, n=3,
                                  logit_bias={"20": 100})
    assert [c.index for c in r.choices] == [0, 1, 2]
    forced = offline.tokenizer.decode([20] * 6)          # a +100 bias makes token 20 certain
    assert all(c.text == forced for c in r.choices)


def test_tokenize_and_detokenize(server, client):
    msgs = [{"role": "user", "content": "Hello there!"}]
    t = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": msgs}).json()
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, temperature=0)
    assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens and t["max_model_len"] == MAX_LEN
    p = httpx.post(server.url + "/tokenize", json={"prompt": "The quick brown fox"}).json()
    d = httpx.post(server.url + "/detokenize", json={"tokens": p["tokens"]}).json()
    assert d["prompt"].strip() == "The quick brown fox"
    for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": "a", "messages": msgs}),
                       ("/detokenize", {"tokens": [10 ** 9]}), ("/detokenize", {"tokens": ["a"]}),
                       ("/tokenize", {"prompt": "a", "model": "other"})):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["message"], (path, body)


def test_api_key(model_dir):
    llm = LLM(model_dir, **ENGINE_KW)
    seen = []
    real_add = llm.engine.add_request
    llm.engine.add_request = lambda *a, **k: (seen.append(a), real_add(*a, **k))[1]
    with ServerThread(build_app(llm, NAME, api_key="sekret")) as srv:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                        {"Authorization": "Basic sekret"}):
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/nope", "/tokenize",
                         "/detokenize"):
                r = httpx.post(srv.url + path, json=body, headers=headers)
                assert r.status_code == 401, (headers, path)
                assert r.json()["error"]["code"] == "invalid_api_key"
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert seen == []                          # the engine never saw them
        assert httpx.get(srv.url + "/health").status_code == 200
        m = scrape(srv.url)
        assert m['draftwise_requests_total{outcome="unauthorized"}'] == 4 * 6 + 1
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model=NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert [m.id for m in good.models.list().data] == [NAME]
        assert len(seen) == 1


def test_graceful_shutdown_finishes_running_requests(model_dir):
    llm = LLM(model_dir, **ENGINE_KW)
    real_step = llm.engine.step
    llm.engine.step = lambda: (time.sleep(0.01), real_step())[1]
    app = build_app(llm, NAME)
    srv = ServerThread(app).__enter__()
    body = {"model": NAME, "prompt": "The quick brown fox", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    lines = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as resp:
        it = resp.iter_lines()
        lines.append(next(it))
        # what SIGTERM does (run_server's handle_exit): refuse new requests, let uvicorn drain
        app.state.server.draining = True
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(srv.url + "/health").status_code == 503
        srv.server.should_exit = True
        lines += [ln for ln in it if ln]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["completion_tokens"] == 60
    srv.thread.join(30)
    assert not srv.thread.is_alive()
    assert not app.state.server.engine_loop.alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=2)


def test_metrics_spec_decode_per_position(server):
    m = scrape(server)
    per_pos = {k: v for k, v in m.items() if k.startswith("draftwise_spec_decode_num_accepted_tokens_per_pos_total")}
    if m["draftwise_spec_decode_num_drafts_total"] > 0:
        assert per_pos and all(re.search(r'position="\d+"', k) for k in per_pos)
        assert sum(per_pos.values()) == m["draftwise_spec_decode_num_accepted_tokens_total"]
        # the allocation chose for the drafting steps and kept no more than was offered (seeded
        # sampled requests verify their drafts whole, beside the allocation's choice)
        alloc = {k[len("draftwise_draft_allocation_"):-len("_total")]: v for k, v in m.items()
                 if k.startswith("draftwise_draft_allocation_") and k.endswith("_total")}
        assert alloc["steps"] > 0 and 0 < alloc["draft_tokens_kept"] <= alloc["draft_tokens_offered"]


def test_engine_failure_is_500_and_server_recovers(local_server):
    server = local_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    engine = server.llm.engine
    real_step = engine.step

    def boom():
        engine.step = real_step
        raise RuntimeError("simulated kernel failure")

    engine.step = boom
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=NAME, prompt="hi", max_tokens=4)
    assert engine.step is real_step
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=4).usage.completion_tokens >= 1
    assert scrape(server)["draftwise_kv_blocks_used"] == 0


def test_load_bench_smoke(server):
    from draftwise.bench.load import format_results, run_load_test
    res = run_load_test(server.url, num_requests=6, concurrency=3, max_tokens=5)
    assert res["completed"] == 6 and res["errors"] == 0 and res["completion_tokens"] == 30
    assert res["requests_per_s"] > 0 and res["latency_p99_s"] >= res["latency_p50_s"] > 0
    assert "req/s" in format_results(res)
    res = run_load_test(server.url, num_requests=2, concurrency=2, max_tokens=3, stream=False, chat=True)
    assert res["completed"] == 2
    multi = run_load_test(server.url, num_requests=3, concurrency=2, max_tokens=4, chat=True, turns=2,
                          prompts=[["Hi there", "And then?"], ["Tell me a story"]])
    assert multi["completed"] == 6 and multi["errors"] == 0 and "follow_up_ttft_p50_s" in multi
    assert res["completed"] == 2 and res["completion_tokens"] == 6
    with pytest.raises(ValueError, match="loopback"):
        run_load_test("http://example.com:8000", num_requests=1)


def test_logprobs_usage_spec_metrics_and_opt_out_over_http(server, client, offline):
    """logprobs over HTTP equal the offline engine's (which equal plain decoding's); usage carries the
    request's speculative-decoding counters; `speculate: false` decodes without drafts."""
    prompt = "Hello world hello world hello world hello"
    ref = offline.generate([prompt], greedy(12, logprobs=2, ignore_eos=True))[0].outputs[0]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
    assert [len(t) for t in lp.top_logprobs] == [2] * 12
    spec = r.usage.model_extra["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["mean_acceptance_length"] >= 1.0
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    # streaming: the chunks' logprobs are the same sequence
    chunks = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                       stream=True, extra_body={"ignore_eos": True})
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)
    off = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "speculate": False})
    assert off.choices[0].text == r.choices[0].text and off.usage.model_extra.get("spec_decode") is None


def test_prefix_cache_hits_in_metrics(server, client):
    long = "A paged key value cache stores attention state in fixed size blocks. " * 3
    for _ in range(2):
        client.completions.create(model=NAME, prompt=long, max_tokens=2, temperature=0)
    m = scrape(server)
    assert m["draftwise_prefix_cache_hits_total"] > 0 and 0 < m["draftwise_prefix_cache_hit_rate"] <= 1


def test_server_metrics_follow_cumulative_engine_counts():
    """The engine reports cumulative counts; /metrics counters advance by the difference, and the
    allocation's cost-model gauges show its latest state."""
    from draftwise.entrypoints.openai.serving import ServerMetrics
    metrics = ServerMetrics()
    report = {"spec_decode": {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 5},
              "draft_allocation": {"steps": 10, "steps_without_drafting": 4, "draft_tokens_offered": 20,
                                   "draft_tokens_kept": 9, "drafts_watched": 2, "step_cost_scale": 1.5,
                                   "step_overhead_ms": 2.0}}
    metrics.observe_engine(report)
    report["draft_allocation"] = dict(report["draft_allocation"], steps=15, draft_tokens_kept=12,
                                      step_cost_scale=1.25)
    metrics.observe_engine(report)
    text = metrics.render()[0].decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(values["draftwise_draft_allocation_steps_total"]) == 15
    assert float(values["draftwise_draft_allocation_draft_tokens_kept_total"]) == 12
    assert float(values["draftwise_draft_allocation_steps_without_drafting_total"]) == 4
    assert float(values["draftwise_draft_allocation_step_cost_scale"]) == 1.25
    assert float(values["draftwise_draft_allocation_step_overhead_seconds"]) == 0.002
    assert float(values["draftwise_spec_decode_num_draft_tokens_total"]) == 9


def test_replicas_allocation_counts_add_up():
    from draftwise.entrypoints.ray_serve.client import sum_engine_metrics
    a = {"draft_allocation": {"steps": 10, "draft_tokens_kept": 4, "step_cost_scale": 1.5}}
    b = {"draft_allocation": {"steps": 5, "draft_tokens_kept": 1, "step_cost_scale": 2.0}}
    total = sum_engine_metrics([a, b, {}])["draft_allocation"]
    assert total == {"steps": 15, "draft_tokens_kept": 5}          # counters add; a replica's scale does not
    assert "draft_allocation" not in sum_engine_metrics([{}])
