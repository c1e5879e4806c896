"""logprobs / top logprobs: the target's raw log-probabilities of each emitted token, identical with
and without speculation (chain, tree, training-free drafters), and equal to transformers'."""
import pytest
import torch

from tests.helpers import load_cfg, write_eagle3_checkpoint
from draftwise import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4] * 8, list(range(30, 50))]


def _lps(outs):
    return [[(t.token_id, t.logprob, t.top_logprobs) for t in o.outputs[0].logprobs] for o in outs]


def _close(a, b):
    for ra, rb in zip(a, b):
        assert len(ra) == len(rb)
        for (ta, la, tops_a), (tb, lb, tops_b) in zip(ra, rb):
            assert ta == tb and la == pytest.approx(lb, abs=1e-4)
            assert [i for i, _ in tops_a] == [i for i, _ in tops_b]
            assert [v for _, v in tops_a] == pytest.approx([v for _, v in tops_b], abs=1e-4)


def test_plain_logprobs_match_transformers(tiny_llama):
    path, hf = tiny_llama
    outs = LLM(path, block_size=4, max_model_len=128).generate([{"prompt_token_ids": PROMPTS[0]}], SP)
    ids = PROMPTS[0] + outs[0].outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    n = len(PROMPTS[0])
    for j, t in enumerate(outs[0].outputs[0].logprobs):
        assert t.token_id == int(ref[n - 1 + j].argmax())           # greedy: the top token
        assert t.logprob == pytest.approx(float(ref[n - 1 + j, t.token_id]), abs=1e-4)
        assert t.top_logprobs[0][0] == t.token_id and len(t.top_logprobs) == 3


@pytest.mark.parametrize("kind", ["eagle3", "tree", "ngram", "suffix-tree"])
def test_speculative_logprobs_equal_plain_decoding(tiny_llama, tmp_path, kind):
    path, _ = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _lps(LLM(path, block_size=4, max_model_len=128).generate(prompts, SP))
    ck = write_eagle3_checkpoint(str(tmp_path / "e"), load_cfg(path), seed=2)
    spec = {"eagle3": {"method": "eagle3", "model": ck, "num_speculative_tokens": 3},
            "tree": {"method": "eagle3", "model": ck, "num_speculative_tokens": 4, "eagle_topk": 2, "eagle_depth": 2},
            "ngram": {"method": "ngram", "num_speculative_tokens": 3},
            "suffix-tree": {"method": "suffix", "num_speculative_tokens": 6, "draft_tree": True,
                            "suffix_decoding_min_token_prob": 0.0}}[kind]
    llm = LLM(path, block_size=4, max_model_len=128, speculative_config=spec)
    outs = llm.generate(prompts, SP)
    _close(_lps(outs), ref)
    m = llm.get_metrics()["spec_decode"]
    assert m["num_drafts"] > 0
    if kind in ("ngram", "suffix-tree"):     # repetitive prompts: accepted drafts (trees: deeper nodes)
        assert m["num_accepted_tokens"] > 0
    # streaming hands out each step's logprobs once, in order
    streamed = [t for o in llm.stream({"prompt_token_ids": PROMPTS[1]}, SP) for t in (o.new_logprobs or [])]
    _close([[(t.token_id, t.logprob, t.top_logprobs) for t in streamed]], ref[1:2])


def test_logprobs_validation():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
