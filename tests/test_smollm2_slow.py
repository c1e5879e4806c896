"""The real default model (SmolLM2-135M-Instruct from the packaged GGUF). Slow: run with `-m slow`."""
import json
import os

import pytest
import torch

from draftwise import LLM, SamplingParams

MT_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mt_bench", "question.jsonl")
pytestmark = pytest.mark.slow


def _mt_prompts(n):
    path = os.environ.get("DRAFTWISE_MT_BENCH", MT_BENCH)
    if not os.path.exists(path):
        pytest.skip(f"MT-bench questions not found at {path} (set DRAFTWISE_MT_BENCH)")
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()][:n]


@pytest.fixture(scope="module")
def smol():
    return LLM(max_model_len=1024, max_num_seqs=8, speculative_config=None, quantization=None)


def test_greedy_matches_transformers_on_mt_bench(smol):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(smol.engine.worker.model_path, dtype=torch.float32).eval()
    prompts = [smol.apply_chat_template([{"role": "user", "content": q}]) for q in _mt_prompts(5)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = smol.generate(prompts, sp)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([smol.tokenizer(p, add_special_tokens=False).input_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                              eos_token_id=None, pad_token_id=2)[0, ids.shape[1]:].tolist()
        assert o.outputs[0].token_ids == ref


@pytest.mark.parametrize("spec", [
    {"method": "eagle3", "num_speculative_tokens": 5},
    {"method": "eagle3", "num_speculative_tokens": 8, "eagle_topk": 2, "eagle_depth": 4},
    {"method": "ngram", "num_speculative_tokens": 5},
    {"method": "dflash"},
    {"method": "suffix"},
    "auto",
])
def test_shipped_drafter_is_lossless(smol, spec):
    prompts = [smol.apply_chat_template([{"role": "user", "content": q}]) for q in _mt_prompts(4)]
    sp = SamplingParams(temperature=0, max_tokens=64)
    ref = [o.outputs[0].token_ids for o in smol.generate(prompts, sp)]
    llm = LLM(max_model_len=1024, max_num_seqs=8, speculative_config=spec, quantization=None)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
    assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_speculation_is_lossless_on_smollm2(mode):
    prompts = [[{"role": "user", "content": q}] for q in _mt_prompts(3)]
    sp = SamplingParams(temperature=0, max_tokens=48)
    ref = LLM(max_model_len=1024, speculative_config=None, quantization=mode).chat(prompts, sp)
    llm = LLM(max_model_len=1024, quantization=mode,
              speculative_config={"method": "eagle3", "num_speculative_tokens": 3, "hybrid": "suffix"})
    assert [o.outputs[0].token_ids for o in llm.chat(prompts, sp)] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("spec", [{"method": "suffix"}, {"method": "eagle3"},
                                  {"method": "eagle3", "num_speculative_tokens": 3, "hybrid": "suffix"}])
def test_spec_trace_is_exact_on_smollm2(spec):
    """On MT-bench prompts (two turns each, the second repeating the first answer's context): per
    request, the trace's accepted tokens equal the engine's counter and its texts the output. The
    draft allocation is off: it may measure that a drafter never pays here and draft nothing."""
    llm = LLM(max_model_len=1024, max_num_seqs=4, speculative_config={**spec, "allocate_drafts": False})
    sp = SamplingParams(temperature=0, max_tokens=96, spec_trace=True)
    convs = [[{"role": "user", "content": q}] for q in _mt_prompts(4)]
    outs = llm.chat(convs, sp)
    convs = [c + [{"role": "assistant", "content": o.outputs[0].text},
                  {"role": "user", "content": "Repeat your answer word for word."}] for c, o in zip(convs, outs)]
    outs += llm.chat(convs, sp)
    accepted = 0
    for o in outs:
        c = o.outputs[0]
        assert "".join(e.text for e in c.spec_trace) == c.text
        n = sum(e.source is not None for e in c.spec_trace)
        assert n == o.metrics.num_accepted_tokens
        accepted += n
    assert accepted > 0


def test_structured_outputs_validate_on_smollm2():
    """The json-schema workload's 20 schemas: every answer is a complete document that validates
    (default configuration, suffix decoding), identical to plain constrained decoding; json_object
    answers parse; choices are one of the choices."""
    import jsonschema
    from draftwise.bench.json_schemas import load_json_schema_prompts
    from draftwise.sampling_params import StructuredOutputParams as S
    convs = load_json_schema_prompts()
    prompts = [[{"role": "user", "content": c[0]}] for c in convs]
    sps = [SamplingParams(temperature=0, max_tokens=320, structured_output=S(json=c[0].schema)) for c in convs]
    spec_llm = LLM(max_model_len=1024, max_num_seqs=4)
    outs = spec_llm.chat(prompts, sps)
    for c, o in zip(convs, outs):
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), c[0].schema)
    plain = LLM(max_model_len=1024, max_num_seqs=4, speculative_config=None).chat(prompts, sps)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    q = [[{"role": "user", "content": t}] for t in _mt_prompts(4)]
    for o in spec_llm.chat(q, SamplingParams(temperature=0, max_tokens=200, structured_output=S(json_object=True))):
        if o.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(o.outputs[0].text), dict)
    choices = ["positive", "negative", "neutral"]
    for o in spec_llm.chat(q, SamplingParams(temperature=0, max_tokens=10, structured_output=S(choice=choices))):
        assert o.outputs[0].text in choices


@pytest.mark.parametrize("kw", [dict(presence_penalty=1.0, frequency_penalty=0.5), dict(repetition_penalty=1.3),
                                dict(min_tokens=48, logit_bias={28: 2.0}),
                                dict(bad_words=["the", "The"], min_p=0.1)])
def test_penalties_are_lossless_on_smollm2(kw):
    """MT-bench prompts, the default configuration (suffix decoding, int4) against plain decoding
    with the same parameters."""
    prompts = [[{"role": "user", "content": q}] for q in _mt_prompts(4)]
    sp = SamplingParams(temperature=0, max_tokens=96, **kw)
    spec = LLM(max_model_len=1024, max_num_seqs=4)
    plain = LLM(max_model_len=1024, max_num_seqs=4, speculative_config=None)
    got = [o.outputs[0].token_ids for o in spec.chat(prompts, sp)]
    assert got == [o.outputs[0].token_ids for o in plain.chat(prompts, sp)]
    assert got != [o.outputs[0].token_ids for o in plain.chat(prompts, SamplingParams(temperature=0, max_tokens=96))]


def test_required_tool_call_validates_on_smollm2():
    import jsonschema
    from draftwise.entrypoints.openai.api_server import build_app
    from tests.helpers import ServerThread
    openai = pytest.importorskip("openai")
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                 "required": ["timezone"], "additionalProperties": False}}}]
    with ServerThread(build_app(LLM(max_model_len=1024, max_num_seqs=4), "smol")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        for q in ["What is the weather in Paris in celsius?", "What time is it in Tokyo?",
                  "Is it raining in London?"]:
            r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": q}],
                                               tools=tools, tool_choice="required", max_tokens=96, temperature=0)
            (call,) = r.choices[0].message.tool_calls
            schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("spec", [{"method": "eagle3"}, {"method": "ngram", "num_speculative_tokens": 5},
                                  {"method": "dflash"},
                                  {"method": "eagle3", "num_speculative_tokens": 3, "hybrid": "suffix"}])
def test_constraints_and_penalties_are_lossless_for_every_drafter_on_smollm2(spec):
    """The shipped drafters and the training-free ones, on MT-bench prompts (penalties, choice) and
    the first JSON-schema prompts: greedy output equals plain decoding with the same settings."""
    from draftwise.bench.json_schemas import load_json_schema_prompts
    from draftwise.sampling_params import StructuredOutputParams as S
    qs = [[{"role": "user", "content": q}] for q in _mt_prompts(3)]
    js = load_json_schema_prompts(3)
    cases = [(qs, SamplingParams(temperature=0, max_tokens=64, presence_penalty=0.8, repetition_penalty=1.2,
                                 logit_bias={28: 1.5})),
             (qs, SamplingParams(temperature=0, max_tokens=8,
                                 structured_output=S(choice=["positive", "negative", "neutral"]))),
             ([[{"role": "user", "content": c[0]}] for c in js],
              [SamplingParams(temperature=0, max_tokens=200, structured_output=S(json=c[0].schema)) for c in js])]
    llm = LLM(max_model_len=1024, max_num_seqs=4, speculative_config=spec)
    plain = LLM(max_model_len=1024, max_num_seqs=4, speculative_config=None)
    for prompts, sp in cases:
        assert [o.outputs[0].token_ids for o in llm.chat(prompts, sp)] == \
            [o.outputs[0].token_ids for o in plain.chat(prompts, sp)]
    assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0
