"""The same greedy request gives the same tokens however it is scheduled: cold or after a prefix-cache
hit, with prefix caching off, alone or in a batch, with its prompt cut into chunks of any size, and
under speculation - in the default configuration of every weight format (int4 on a Hugging Face
checkpoint; GGUF files of every block family on their own blocks), where a last-bit difference
becomes another token, on every kernel ISA path this machine has, PyTorch's included."""
import pytest

from draftwise import LLM, SamplingParams
from tests.models.gguf_builder import write_tiny_llama_gguf
from tests.models.test_gguf_formats import MIXES

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LENGTHS = (20, 45, 90, 300, 800)     # prompt tokens: under, around and over every chunk size below


@pytest.fixture(scope="module", params=["int4"] + sorted(MIXES))
def weights(request, tiny_llama, tmp_path_factory):
    """(model path, engine options): the int4 checkpoint, or a GGUF file of one mix of block types
    (its default: the file's own blocks)."""
    if request.param == "int4":
        return tiny_llama[0], {"quantization": "int4"}
    path = str(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf")
    arch = "qwen2" if request.param == "qwen2" else "llama"
    return write_tiny_llama_gguf(path, MIXES[request.param], seed=3, arch=arch, context_length=1024), {}


def _prompts(n=len(LENGTHS)):
    """n prompts cycling through LENGTHS (prompt i and i + len(LENGTHS) are the same)."""
    return [{"prompt_token_ids": [(7 * k + 3 * j) % 250 + 3 for j in range(LENGTHS[k])]}
            for k in (i % len(LENGTHS) for i in range(n))]


def _run(weights, prompts, **kw):
    path, opts = weights
    opts = dict(block_size=4, max_model_len=1024, speculative_config=None, **opts)
    llm = LLM(path, **{**opts, **kw})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], llm


_REFERENCES: dict = {}


def _reference(weights, isa) -> list:
    """The plain greedy tokens of _prompts(), each prompt prefilled whole and nothing cached: what
    every schedule below must reproduce (computed once per weights and ISA path)."""
    key = (weights[0], isa)
    if key not in _REFERENCES:
        _REFERENCES[key], _ = _run(weights, _prompts(), enable_prefix_caching=False, max_num_batched_tokens=2048)
    return _REFERENCES[key]


def test_greedy_tokens_do_not_depend_on_scheduling(weights, kernel_isa):
    path = weights
    prompts = _prompts()
    ref = _reference(weights, kernel_isa)
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
def test_greedy_speculation_equals_plain_decoding_in_a_batch_of_16(weights, kernel_isa, spec):
    # every draft verified whole: the allocation would cut drafts by this machine's measured step
    # costs, and a batch of 16 on PyTorch's kernels may then verify none (the test would pass
    # without testing anything); what it may cut is a prefix of what is verified here
    spec = {**spec, "allocate_drafts": False}
    path = weights
    ref = _reference(weights, kernel_isa)
    out, llm = _run(path, _prompts(16), max_num_seqs=16, speculative_config=spec)
    assert out == [ref[i % len(LENGTHS)] for i in range(16)], "speculation, a batch of 16 with prefix-cache hits"
    assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0
    alone, _ = _run(path, _prompts(), max_num_seqs=1, speculative_config=spec)
    assert alone == ref, "speculation, one request at a time"
