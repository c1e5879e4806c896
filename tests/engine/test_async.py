"""Async scheduling: the model runs step n on a worker thread while step n+1's blocks are reserved
and step n's outputs are emitted; greedy output equals synchronous decoding (plain, chain, tree),
requests finishing mid-flight release their blocks afterwards."""
import pytest

from tests.helpers import load_cfg, write_eagle3_checkpoint
from draftwise import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3] * 20, list(range(30, 70)), [7, 7, 7], [12, 13, 12, 13, 12, 13]]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", [None, "eagle3", "tree", "suffix"])
def test_async_scheduling_is_lossless(tiny_llama, tmp_path, kind):
    path, _ = tiny_llama
    spec = None
    if kind in ("eagle3", "tree"):
        ck = write_eagle3_checkpoint(str(tmp_path / "e"), load_cfg(path), seed=2)
        spec = {"method": "eagle3", "model": ck, "num_speculative_tokens": 3}
        if kind == "tree":
            spec.update(eagle_topk=2, eagle_depth=2)
    elif kind == "suffix":
        spec = {"method": "suffix"}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    kw = dict(block_size=4, max_model_len=128, max_num_seqs=3, speculative_config=spec)
    ref = _ids(LLM(path, **kw).generate(prompts, GREEDY))
    llm = LLM(path, async_scheduling=True, **kw)
    assert _ids(llm.generate(prompts, GREEDY)) == ref
    alloc = llm.engine.scheduler.allocator
    assert all(r == 0 for r in alloc.ref) and not llm.engine.has_unfinished_requests()
    if spec is not None:
        assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0


def test_requests_finishing_or_aborted_in_flight(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, max_model_len=128, async_scheduling=True, speculative_config=None)
    eng = llm.engine
    a = eng.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
    b = eng.add_request({"prompt_token_ids": [8, 9]}, GREEDY)
    eng.step()
    eng.step()                        # a step is in flight now
    assert eng._inflight is not None
    eng.abort_request(b)              # its blocks are released once the in-flight step completes
    assert eng.scheduler._deferred
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == [a]
    assert all(r == 0 for r in eng.scheduler.allocator.ref)
    ref = LLM(path, block_size=4, max_model_len=128, speculative_config=None).generate(
        [{"prompt_token_ids": [5, 6, 7]}], GREEDY)
    assert [o for o in outs if o.finished][0].outputs[0].token_ids == ref[0].outputs[0].token_ids
