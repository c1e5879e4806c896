"""History-dependent sampling parameters (penalties, logit_bias, allowed tokens, bad words,
min_tokens, min_p) under speculation: row semantics by hand, greedy outputs equal plain decoding
with the same parameters for every drafter (row j sees the drafts before it), and chi-square tests
for sampling."""
import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.sample.logits_processors import process_row
from tests.helpers import drafter_specs, tiny_target_with_drafters
from tests.spec_decode.test_spec_decode import _plain_counts, _sample_counts, chi2_critical, small_vocab, two_sample_chi2  # noqa: F401

PROMPTS = ["one two three one two three one two", "abc abc abc abc", "The quick brown fox jumps over"]


def test_process_row_by_hand():
    V = 8
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                       logit_bias={7: 3.0}, min_tokens=4)
    logits = torch.tensor([1.0, -1.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    process_row(logits, p, prompt=[1], output=[2, 2, 3], stop_ids=(0,))
    want = torch.tensor([float("-inf"),            # a stop token before min_tokens outputs
                         -2.0,                      # in the prompt, negative: x 2
                         2.0 / 2 - 0.25 * 2 - 0.5,  # output twice: / 2, then frequency and presence
                         0.5 / 2 - 0.25 - 0.5, 0.0, 0.0, 0.0, 3.0])
    assert torch.allclose(logits, want)
    logits = torch.zeros(V)
    process_row(logits, SamplingParams(allowed_token_ids=[1, 2]), [5], [6], (), bad_words_ids=[[6, 2], [4]])
    assert torch.isinf(logits).tolist() == [True, False, True, True, True, True, True, True]   # 2: after 6
    logits = torch.zeros(V)
    process_row(logits, SamplingParams(min_tokens=1), [5], [6], stop_ids=(0,))
    assert not torch.isinf(logits).any()                    # min_tokens reached


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_target_with_drafters(tmp_path_factory, "lp_target", 11, 4)


PARAMS = {"penalties": dict(presence_penalty=1.5, frequency_penalty=0.7),
          "repetition": dict(repetition_penalty=1.6),
          "bias": dict(logit_bias={20: 4.0, 30: 3.0, 5: -100.0}),
          "allowed": dict(allowed_token_ids=list(range(3, 80))),
          "bad_words": dict(bad_words=["one", "abc", "the"]),
          "min_tokens": dict(min_tokens=30)}


@pytest.mark.parametrize("drafter", ["suffix", "ngram", "eagle3", "eagle3-tree", "dflash", "hybrid"])
def test_greedy_with_processors_equals_plain(model, drafter):
    path, head, dflash = model
    # every draft verified whole (no cost-based allocation, which times the machine): the check
    # below that drafts were accepted must not depend on how busy the machine is
    spec = dict(drafter_specs(head, dflash)[drafter], allocate_drafts=False)
    plain = LLM(path, max_model_len=256, speculative_config=None)
    spec_llm = LLM(path, max_model_len=256, speculative_config=spec)
    free = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))]
    for name, kw in PARAMS.items():
        sp = SamplingParams(temperature=0, max_tokens=40, **kw)
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp)]
        got = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, sp)]
        assert got == want, (drafter, name)
        if name in ("penalties", "repetition", "bias"):
            assert want != free, name                       # the parameter does change the output
        if name == "allowed":
            assert all(3 <= t < 80 for o in want for t in o)
        if name == "min_tokens":
            assert all(len(o) >= 30 for o in want)
    if drafter in ("suffix", "ngram", "hybrid"):
        assert spec_llm.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["eagle3", "suffix-tree"])
def test_sampling_with_penalties_and_min_p_keeps_the_distribution(small_vocab, method):  # noqa: F811
    path, ck, _ = small_vocab
    params = {"temperature": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
              "min_p": 0.05}
    n = 3000
    base = _plain_counts(path, params, n, n_tokens=3)
    spec = {"eagle3": {"method": "eagle3", "model": ck, "num_speculative_tokens": 2},
            "suffix-tree": {"method": "suffix", "num_speculative_tokens": 4, "draft_tree": True,
                            "suffix_decoding_min_token_prob": 0.0, "suffix_decoding_max_spec_factor": 2.0}}[method]
    got, m = _sample_counts(path, dict(spec, rejection_sampler="logits"), params, n, n_tokens=3)
    assert m["num_accepted_tokens"] > 0
    stat, df = two_sample_chi2(base, got)
    assert stat < chi2_critical(df), (stat, df)
