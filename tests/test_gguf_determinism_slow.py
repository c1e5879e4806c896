"""Real GGUF files in their default configuration (their own blocks): greedy speculation with every
drafter that exists for the model equals plain decoding for all 16 requests of a batch of 16, after
prefix-cache hits and one request at a time. The packaged SmolLM2 Q4_1 file always; other files of
the same model (llama.cpp's quantizer: Q4_K_M, Q4_0, Q8_0, ...) through DRAFTWISE_GGUF_FILES
(paths separated by ':'). Slow: run with `-m slow`."""
import os

import pytest

from draftwise import LLM, SamplingParams
from tests.test_smollm2_slow import _mt_prompts

pytestmark = pytest.mark.slow

FILES = ["smollm2-135m"] + [p for p in os.environ.get("DRAFTWISE_GGUF_FILES", "").split(":") if p]
SPECS = ["auto", {"method": "eagle3", "num_speculative_tokens": 5},
         {"method": "eagle3", "num_speculative_tokens": 8, "eagle_topk": 2, "eagle_depth": 4},
         {"method": "ngram", "num_speculative_tokens": 5}, {"method": "suffix", "num_speculative_tokens": 8}]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=FILES)
def plain(request):
    """(model, prompts, the plain tokens of 16 MT-bench first turns at max_num_seqs 16)."""
    prompts = [[{"role": "user", "content": q}] for q in _mt_prompts(16)]
    llm = LLM(request.param, max_model_len=1024, max_num_seqs=16, speculative_config=None)
    assert llm.engine.config.quantization == "gguf"
    return request.param, prompts, _ids(llm.chat(prompts, GREEDY))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s if isinstance(s, str) else "-".join(map(str, s.values())))
def test_greedy_speculation_equals_plain_on_the_files_own_blocks(plain, spec):
    model, prompts, ref = plain
    llm = LLM(model, max_model_len=1024, max_num_seqs=16, speculative_config=spec)
    out = _ids(llm.chat(prompts, GREEDY))
    assert sum(a == b for a, b in zip(out, ref)) == 16
    assert _ids(llm.chat(prompts, GREEDY)) == ref, "after prefix-cache hits"
    assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0
    alone = LLM(model, max_model_len=1024, max_num_seqs=1, enable_prefix_caching=False, speculative_config=spec)
    assert _ids(alone.chat(prompts[:4], GREEDY)) == ref[:4], "one request at a time"
