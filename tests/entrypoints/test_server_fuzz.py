"""Fuzzing the OpenAI-compatible server with schemathesis against its own /openapi.json: every
generated request - valid or malformed - gets a non-5xx answer, every 4xx is an OpenAI-shaped error,
and the server keeps serving."""
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from tests.helpers import make_tiny_hf  # noqa: E402
from tests.tokenizer_util import add_tiny_tokenizer  # noqa: E402
from draftwise import LLM  # noqa: E402
from draftwise.entrypoints.openai.api_server import build_app  # noqa: E402

NAME = "tiny-fuzz"


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_fuzz"))
    make_tiny_hf(path, "llama")
    add_tiny_tokenizer(path)
    llm = LLM(path, max_model_len=48, max_num_seqs=4, block_size=8,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    app = build_app(llm, NAME)
    loop = app.state.server.engine_loop
    loop.start()                    # schemathesis calls the ASGI app without running its lifespan
    yield app
    loop.stop()


STATUSES: dict = {}


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


VALID_BODIES = {"/v1/completions": {"model": NAME, "prompt": "hello", "max_tokens": 4},
                "/v1/chat/completions": {"model": NAME, "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "hi"}]}}
# the extreme values that once failed a whole batch or leaked internal error text: always among the
# examples, beside whatever the generator draws
EXTREMES = [{"top_k": 2 ** 63}, {"top_k": 10 ** 40}, {"seed": 2 ** 64}, {"seed": 2 ** 64 - 1},
            {"seed": -(2 ** 63) - 1}, {"max_tokens": 2 ** 63}, {"temperature": 1e308},
            {"top_p": 1e-300}, {"stop": ["\ud800"]}]
EXTREME_BODIES = {path: [{**body, **e} for e in EXTREMES] for path, body in {
    "/v1/completions": {"model": NAME, "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
}.items()}
EXTREME_BODIES["/v1/completions"].append({"model": NAME, "prompt": "a\ud800b", "max_tokens": 2})
EXTREME_BODIES["/v1/chat/completions"].append({"model": NAME, "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "\udc00"}]})
# schemathesis' default of 10 s is short for a request of a few hundred tokens on a loaded 2-core
# machine (a test worker a core); a hang would still end the test
CALL_TIMEOUT = 120
OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
              ("/tokenize", "POST"), ("/detokenize", "POST"), ("/health", "GET"), ("/metrics", "GET")]


def test_no_5xx_and_openai_shaped_errors(fuzz_app, fuzz_schema):
    """Hypothesis drives schemathesis' strategy for every operation of the server's own OpenAPI
    schema (the programmatic API, not schemathesis' pytest parametrization, which breaks across
    pytest releases). One test for all operations: schemathesis' plugin ends the app's lifespan
    (which drains the server) when the test that started it ends."""
    for path, method in OPERATIONS:
        op = fuzz_schema[path][method]
        strategy = op.as_strategy()
        if path in VALID_BODIES:         # a well-formed request too, whatever the generator draws
            fixed = [VALID_BODIES[path]] + EXTREME_BODIES[path]
            strategy = st.one_of(st.sampled_from([op.Case(body=b, media_type="application/json") for b in fixed]),
                                 strategy)

        for body in EXTREME_BODIES.get(path, []):       # each extreme case at least once
            r = op.Case(body=body, media_type="application/json").call(timeout=CALL_TIMEOUT)
            assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
            assert fuzz_app.state.server.engine_loop.alive

        @settings(max_examples=30, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def check(case):
            r = case.call(timeout=CALL_TIMEOUT)
            STATUSES.setdefault(case.path, []).append(r.status_code)
            assert r.status_code < 500, (case.path, case.body, r.status_code, r.text[:300])
            if 400 <= r.status_code < 500:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
            assert fuzz_app.state.server.engine_loop.alive

        check()


def test_fuzzing_reached_both_valid_and_malformed_requests():
    """The fuzz run above (same module, runs first) produced successes and 400s on the generation
    endpoints: it exercised the engine, not only the validator."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        codes = STATUSES.get(path, [])
        assert 200 in codes and 400 in codes, (path, sorted(set(codes)))


def test_openapi_describes_the_real_api(fuzz_app):
    from fastapi.testclient import TestClient
    spec = TestClient(fuzz_app).get("/openapi.json").json()
    comps = spec["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ErrorResponse", "UsageInfo"} <= set(comps)
    req = comps["CompletionRequest"]
    assert "prompt" in req["required"] and {"logprobs", "speculate", "top_k"} <= set(req["properties"])
    assert {(p, m.upper()) for p, ops in spec["paths"].items() for m in ops} == set(OPERATIONS)
    post = spec["paths"]["/v1/chat/completions"]["post"]
    assert "400" in post["responses"]
