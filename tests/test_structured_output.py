"""Structured outputs (xgrammar) under speculation: greedy outputs equal plain constrained decoding
for every drafter and constraint, drafts are cut where the grammar forbids them, sampling with a
grammar mask keeps the plain distribution (chi-square), and the API's response_format / guided_*
fields."""
import json
import re

import pytest

from draftwise import LLM, SamplingParams
from draftwise.spec_decode.draft import Draft
from draftwise.sampling_params import StructuredOutputParams as S
from tests.helpers import ServerThread, drafter_specs, tiny_target_with_drafters
from tests.spec_decode.test_spec_decode import chi2_critical, two_sample_chi2

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"type": "string", "enum": ["x", "yy"]},
                                           "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
          "required": ["a", "b", "c"], "additionalProperties": False}
CONSTRAINTS = {"choice": S(choice=["yes", "no", "maybe so"]), "json": S(json=SCHEMA),
               "regex": S(regex=r"[0-9]{3}-[a-z]{2,4}"), "json_object": S(json_object=True),
               "grammar": S(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-e]+')}
PROMPTS = ["Hello there", "one two three one two three", "abc abc abc"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_target_with_drafters(tmp_path_factory, "so_target", 7, 3)


def _run(llm, so, max_tokens=40):
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, structured_output=so)
    return [o.outputs[0] for o in llm.generate(PROMPTS, sp)]


@pytest.fixture(scope="module")
def plain_outputs(model):
    path, _, _ = model
    llm = LLM(path, max_model_len=256, speculative_config=None)
    return {name: [(c.token_ids, c.text, c.finish_reason) for c in _run(llm, so)] for name, so in CONSTRAINTS.items()}


@pytest.mark.parametrize("drafter", ["suffix", "suffix-tree", "ngram", "eagle3", "eagle3-tree", "dflash", "hybrid"])
def test_greedy_constrained_output_equals_plain_for_every_drafter(model, plain_outputs, drafter):
    path, head, dflash = model
    llm = LLM(path, max_model_len=256, speculative_config=drafter_specs(head, dflash)[drafter])
    for name, so in CONSTRAINTS.items():
        got = [(c.token_ids, c.text, c.finish_reason) for c in _run(llm, so)]
        assert got == plain_outputs[name], (drafter, name)
    if drafter in ("suffix", "ngram", "hybrid"):
        assert llm.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0


def test_outputs_satisfy_their_constraints(plain_outputs):
    for _, text, reason in plain_outputs["choice"]:
        assert text in ("yes", "no", "maybe so") and reason == "stop"
    for _, text, reason in plain_outputs["regex"]:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) and reason == "stop"
    for _, text, reason in plain_outputs["json"]:
        if reason == "stop":                           # finished: a complete, valid document
            doc = json.loads(text)
            assert set(doc) == {"a", "b", "c"} and 0 <= doc["a"] <= 99 and doc["b"] in ("x", "yy")
    for _, text, reason in plain_outputs["grammar"]:
        assert re.fullmatch(r"\([a-e]+(,[a-e]+)*\)", text) or reason == "length"


def test_drafts_are_cut_where_the_grammar_forbids(model):
    path, _, _ = model
    llm = LLM(path, max_model_len=256)
    from draftwise.structured_output import RequestGrammar
    tok = llm.tokenizer
    g = RequestGrammar(llm.engine.compile_grammar(S(choice=["yes", "no"])))
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("y", "e", "s", "n", "o", "x")}
    assert None not in ids.values()
    chain = Draft.chain([ids["y"], ids["e"], ids["x"], ids["s"]], "suffix")
    assert g.valid_draft(chain).token_ids == [ids["y"], ids["e"]]                  # cut at "x"
    tree = Draft([ids["y"], ids["x"], ids["e"], ids["n"], ids["o"], ids["s"]], [-1, -1, 0, -1, 3, 2], "suffix")
    cut = g.valid_draft(tree)                  # "x" (a root child) is forbidden; y-e-s and n-o stay
    assert cut.token_ids == [ids["y"], ids["e"], ids["n"], ids["o"], ids["s"]]
    assert cut.parents == [-1, 0, -1, 2, 1]
    g.accept([ids["n"]])
    assert g.valid_draft(chain) is None        # after "n" only "o" can follow


def test_sampling_with_a_grammar_mask_keeps_the_distribution(model):
    path, _, _ = model
    so = S(regex=r"[0-2]-[0-1]-[0-1]")           # one token per character: drafts several rows deep
    n = 1200

    def counts(spec):
        llm = LLM(path, max_model_len=64, max_num_seqs=64, speculative_config=spec)
        sps = [SamplingParams(temperature=1.0, max_tokens=8, seed=500 + i, structured_output=so) for i in range(n)]
        c: dict = {}
        for o in llm.generate(["Pick two letters"] * n, sps):
            c[o.outputs[0].text] = c.get(o.outputs[0].text, 0) + 1
        return c, llm.get_metrics()["spec_decode"]

    plain, _ = counts("none")
    # suffix decoding drafts from earlier outputs (its global cache): the rest of a seen answer
    spec, stats = counts({"method": "suffix", "suffix_decoding_min_token_prob": 0.0})
    assert stats["num_accepted_tokens"] > 0
    assert all(re.fullmatch(r"[0-2]-[0-1]-[0-1]", k) for k in list(plain) + list(spec))
    stat, df = two_sample_chi2(plain, spec)
    assert stat < chi2_critical(df), (stat, df, plain, spec)


def test_a_grammar_the_vocabulary_cannot_finish_fails_that_request_alone(model):
    path, _, _ = model
    llm = LLM(path, max_model_len=256, speculative_config=None)
    sp_bad = SamplingParams(temperature=0, max_tokens=8, structured_output=S(regex="\u00e9\u00e9\u00e9"))
    sp_ok = SamplingParams(temperature=0, max_tokens=8)
    bad, ok = llm.generate(["Hello", "Hello"], [sp_bad, sp_ok])
    assert bad.outputs[0].finish_reason == "error" and "allows no token" in bad.outputs[0].error
    assert ok.outputs[0].finish_reason == "length"


def test_api_response_format_and_guided_fields(model):
    httpx = pytest.importorskip("httpx")
    from draftwise.entrypoints.openai.api_server import build_app
    path, _, _ = model
    llm = LLM(path, max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with ServerThread(build_app(llm, "t")) as srv:
        def chat(**kw):
            return httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                                    "temperature": 0, **kw})
        r = chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
        assert r.status_code == 200
        c = r.json()["choices"][0]
        if c["finish_reason"] == "stop":
            assert set(json.loads(c["message"]["content"])) == {"a", "b", "c"}
        assert chat(guided_choice=["red", "blue"]).json()["choices"][0]["message"]["content"] in ("red", "blue")
        assert chat(structured_outputs={"choice": ["up", "down"]}).json()["choices"][0]["message"]["content"] \
            in ("up", "down")
        assert re.fullmatch(r"[a-c]{4}", chat(guided_regex="[a-c]{4}").json()["choices"][0]["message"]["content"])
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": "x", "max_tokens": 10, "temperature": 0, "guided_choice": ["aa", "bb"]})
        assert r.json()["choices"][0]["text"] in ("aa", "bb")
        for bad, what in (({"guided_regex": "a", "guided_choice": ["b"]}, "one structured-output"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
                           "invalid JSON schema"),
                          ({"guided_grammar": "root ::= missing"}, "invalid grammar"),
                          ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
                          ({"guided_choice": []}, "guided_choice")):
            r = chat(**bad)
            assert r.status_code == 400 and what in r.json()["error"]["message"] + str(r.json()["error"]["param"]), \
                (bad, r.json())
        assert chat(response_format={"type": "text"}).status_code == 200
