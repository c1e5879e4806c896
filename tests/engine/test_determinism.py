"""The same greedy request gives the same tokens however it is scheduled: cold or after a prefix-cache
hit, with prefix caching off, alone or in a batch, with its prompt cut into chunks of any size, and
under speculation - on int4 weights (bf16 activations, where a last-bit difference becomes another
token) on every kernel ISA path this machine has, PyTorch's included."""
import pytest

from draftwise import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LENGTHS = (20, 45, 90, 300)          # prompt tokens: under, around and over every chunk size below


def _prompts(n=len(LENGTHS)):
    """n prompts cycling through LENGTHS (prompt i and i + len(LENGTHS) are the same)."""
    return [{"prompt_token_ids": [(7 * k + 3 * j) % 250 + 3 for j in range(LENGTHS[k])]}
            for k in (i % len(LENGTHS) for i in range(n))]


def _run(path, prompts, **kw):
    opts = dict(block_size=4, max_model_len=512, quantization="int4", speculative_config=None)
    llm = LLM(path, **{**opts, **kw})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], llm


def test_greedy_tokens_do_not_depend_on_scheduling(tiny_llama, kernel_isa):
    path, _ = tiny_llama
    prompts = _prompts()
    ref, _ = _run(path, prompts, enable_prefix_caching=False, max_num_batched_tokens=2048)
    cached, llm = _run(path, prompts, enable_prefix_caching=True, max_num_batched_tokens=2048)
    assert cached == ref, "cold, prefix caching on"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref, "after a prefix-cache hit"
    alone, _ = _run(path, prompts, enable_prefix_caching=False, max_num_seqs=1)
    assert alone == ref, "one request at a time"
    batch, _ = _run(path, _prompts(8), enable_prefix_caching=False, max_num_seqs=8)
    assert batch == [ref[i % len(ref)] for i in range(8)], "a batch of 8"
    for mbt in (16, 33, 64, 512):
        chunked, _ = _run(path, prompts, enable_prefix_caching=False, max_num_batched_tokens=mbt)
        assert chunked == ref, f"max_num_batched_tokens={mbt}"


@pytest.mark.parametrize("spec", [{"method": "suffix", "num_speculative_tokens": 8},
                                  {"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "suffix", "num_speculative_tokens": 8, "draft_tree": True}])
def test_greedy_speculation_equals_plain_decoding_in_a_batch_of_16(tiny_llama, kernel_isa, spec):
    path, _ = tiny_llama
    prompts = _prompts(16)
    ref, _ = _run(path, prompts, max_num_seqs=16)
    out, llm = _run(path, prompts, max_num_seqs=16, speculative_config=spec)
    assert ref == [ref[i % len(LENGTHS)] for i in range(16)]
    assert sum(a == b for a, b in zip(out, ref)) == 16
    assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0
