"""n choices, best_of and echo over HTTP: each choice is its own engine request (seed, seed + 1, ...
when seeded), best_of keeps the n with the highest cumulative log-probability, streams of several
choices are merged with one usage chunk and one [DONE]."""
import json

import pytest

httpx = pytest.importorskip("httpx")

from draftwise import LLM, SamplingParams  # noqa: E402
from draftwise.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.helpers import ServerThread  # noqa: E402

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def srv(model_dir):
    llm = LLM(model_dir, max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with ServerThread(build_app(llm, "t")) as s:
        # the same configuration offline: seeded sampling with drafts is reproducible, not equal to plain
        s.offline = LLM(model_dir, max_model_len=256, speculative_config={"method": "ngram",
                                                                          "num_speculative_tokens": 3})
        yield s


def _post(srv, path="/v1/completions", **body):
    return httpx.post(srv.url + path, json={"prompt": PROMPT, "max_tokens": 12, **body}, timeout=60)


def test_n_sampled_choices_are_the_seeded_requests(srv):
    r = _post(srv, n=3, temperature=1.0, seed=7).json()
    texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    want = [srv.offline.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=12, seed=7 + i))[0]
            .outputs[0] for i in range(3)]
    assert texts == [w.text for w in want]
    assert r["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want)
    assert r["usage"]["prompt_tokens"] == len(srv.offline.tokenizer(PROMPT, add_special_tokens=False).input_ids)


def test_best_of_keeps_the_most_likely(srv):
    r = _post(srv, n=1, best_of=4, temperature=1.0, seed=3).json()
    (choice,) = r["choices"]
    outs = [srv.offline.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=12, seed=3 + i, logprobs=0))[0]
            for i in range(4)]
    best = max(outs, key=lambda o: sum(t.logprob for t in o.outputs[0].logprobs))
    assert choice["text"] == best.outputs[0].text and choice["logprobs"] is None


def test_streamed_choices_are_merged(srv):
    body = {"n": 2, "temperature": 1.0, "seed": 11, "stream": True, "stream_options": {"include_usage": True}}
    texts, usage, done = {0: "", 1: ""}, None, 0
    with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, **body}) as resp:
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                usage = ev.get("usage") or usage
                for c in ev["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
    assert done == 1 and usage is not None
    full = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "n": 2,
                            "temperature": 1.0, "seed": 11}).json()
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in full["choices"]]
    assert usage["completion_tokens"] == full["usage"]["completion_tokens"]


def test_echo_and_refusals(srv):
    r = _post(srv, echo=True, temperature=0).json()
    plain = _post(srv, temperature=0).json()
    assert r["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    for bad in ({"n": 2, "best_of": 1}, {"best_of": 3, "stream": True}, {"echo": True, "logprobs": 1},
                {"n": 17}, {"n": 0}):
        resp = _post(srv, **bad)
        assert resp.status_code == 400 and resp.json()["error"]["message"], bad
