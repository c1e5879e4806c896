"""Draft-model speculation: lossless greedy decoding, the draft model's KV kept in step with the
target's accepted tokens (roll-back, skipped steps, prefix-cache hits, preemption), trees, hybrid,
sampling distributions, and the errors a user gets for a model that cannot draft."""
import os

import pytest

from tests.helpers import make_tiny_hf
from tests.spec_decode.test_spec_decode import chi2_critical, two_sample_chi2
from draftwise import LLM, SamplingParams
from draftwise.spec_decode.draft_model import _Segment, catch_up_share

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3] * 20, list(range(30, 70)), [7, 7, 7], [12, 13, 12, 13, 12, 13, 12]]
K = 4
# the first token comes from the prompt's step, then every step emits K + 1 tokens when all drafts
# are accepted: with this length no draft reaches past the end of a request
EXACT_STEPS = SamplingParams(temperature=0, max_tokens=1 + 4 * (K + 1), ignore_eos=True)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _prompts():
    return [{"prompt_token_ids": p} for p in PROMPTS]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, an unrelated draft model of the same vocabulary)."""
    target = str(tmp_path_factory.mktemp("dm_target"))
    other = str(tmp_path_factory.mktemp("dm_other"))
    make_tiny_hf(target, "llama", seed=0)
    make_tiny_hf(other, "llama", seed=7, layers=2)
    return target, other


@pytest.fixture(scope="module")
def reference(models):
    return _ids(LLM(models[0], block_size=4, max_model_len=256).generate(_prompts(), EXACT_STEPS))


def _spec(draft, **kw):
    """Whole chains of K: no allocation, no confidence threshold."""
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": K, "allocate_drafts": False,
            "draft_confidence_threshold": 0.0, **kw}


def _run(target, spec, prompts=None, **engine_kw):
    llm = LLM(target, block_size=4, max_model_len=256, speculative_config=spec, **engine_kw)
    outs = _ids(llm.generate(prompts or _prompts(), EXACT_STEPS))
    return llm, outs


def test_the_target_as_its_own_draft_model_is_always_accepted(models, reference):
    """A draft model equal to the target proposes exactly the target's tokens, so every draft is
    accepted - unless its KV is out of step with the accepted tokens."""
    target, _ = models
    llm, outs = _run(target, _spec(target))
    assert outs == reference
    m = llm.get_metrics()["spec_decode"]
    assert m["num_draft_tokens"] > 50 and m["num_accepted_tokens"] == m["num_draft_tokens"]
    # the same prompts again: prefix-cache hits (the draft model catches up on the cached prefix)
    assert _ids(llm.generate(_prompts(), EXACT_STEPS)) == reference
    m2 = llm.get_metrics()["spec_decode"]
    assert m2["num_accepted_tokens"] == m2["num_draft_tokens"] > m["num_draft_tokens"]


def test_an_unrelated_draft_model_is_lossless(models, reference):
    """Drafts that are mostly rejected: the draft model's cache is rolled back every step."""
    target, other = models
    for extra in ({}, {"eagle_topk": 3, "eagle_depth": 3}):
        llm, outs = _run(target, _spec(other, **extra), max_num_seqs=3)
        assert outs == reference, extra
        m = llm.get_metrics()["spec_decode"]
        assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] < m["num_draft_tokens"]


def test_steps_without_drafting_are_caught_up(models, reference, monkeypatch):
    """The engine skips the drafter on some steps (the draft allocation does when drafting cannot
    pay): the draft model then feeds the positions it missed before its next draft."""
    target, _ = models
    from draftwise.worker.model_runner import ModelRunner
    orig, calls = ModelRunner.propose, []

    def every_third(self, step, k, max_requests=None, next_step=None):
        calls.append(1)
        if len(calls) % 3:
            return [None] * len(step.sched.scheduled)
        return orig(self, step, k, max_requests, next_step)

    monkeypatch.setattr(ModelRunner, "propose", every_third)
    llm, outs = _run(target, _spec(target))
    assert outs == reference
    m = llm.get_metrics()["spec_decode"]
    assert m["num_draft_tokens"] > 0 and m["num_accepted_tokens"] == m["num_draft_tokens"]


def test_preempted_requests_redraft_from_a_fresh_cache(models, reference, monkeypatch):
    """A KV pool too small for every request at once preempts (frees and later recomputes) requests;
    the draft model's entries of the freed blocks are gone, so it starts such a request over."""
    target, _ = models
    from draftwise.engine.scheduler import Scheduler
    orig, preempted = Scheduler._preempt, []

    def counting(self, req):
        preempted.append(req.request_id)
        return orig(self, req)

    monkeypatch.setattr(Scheduler, "_preempt", counting)
    llm = LLM(target, block_size=4, max_model_len=64, num_kv_blocks=24, max_num_seqs=5,
              enable_prefix_caching=False, speculative_config=_spec(target))
    drafts = _record_drafts(monkeypatch)
    assert _ids(llm.generate(_prompts(), EXACT_STEPS)) == reference
    assert preempted
    # a recomputed request's steps no longer end where its answer does: check every draft against
    # the reference continuation instead of the acceptance counters
    checked = 0
    for prompt, seq_len, tokens in drafts:
        full = list(prompt) + reference[PROMPTS.index(list(prompt))]
        truth = full[seq_len + 1:seq_len + 1 + len(tokens)]
        assert tokens[:len(truth)] == truth
        checked += len(truth)
    assert checked > 50


def _record_drafts(monkeypatch) -> list:
    """(prompt, seq_len, draft tokens) of every draft the draft model makes from now on."""
    from draftwise.spec_decode.draft_model import DraftModelProposer
    orig, seen = DraftModelProposer.propose, []

    def spy(self, inp, kv_cache, block_size, k):
        out = orig(self, inp, kv_cache, block_size, k)
        for i, d in enumerate(out):
            if d is not None:
                seen.append((tuple(inp.requests[i].prompt_token_ids), inp.seq_lens[i], d.token_ids))
        return out

    monkeypatch.setattr(DraftModelProposer, "propose", spy)
    return seen


def test_draft_model_beside_suffix_decoding(models, reference):
    target, other = models
    llm, outs = _run(target, _spec(other, hybrid="suffix", suffix_decoding_min_token_prob=0.0))
    assert outs == reference
    assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0


def test_accepted_chain_tokens_are_not_fed_again(models, reference, monkeypatch):
    """The chain passes already wrote the entries of the draft tokens the target keeps: with every
    draft accepted, a step feeds the draft model only the chain's last token and the new root,
    not the whole accepted chain again - and its drafts stay exact."""
    from draftwise.spec_decode.draft_model import DraftModelProposer
    target, _ = models
    orig, fed = DraftModelProposer._segments, []

    def recording(self, inp):
        segs = orig(self, inp)
        fed.extend(len(s.tokens) for s in segs if s.start > 0)
        return segs

    monkeypatch.setattr(DraftModelProposer, "_segments", recording)
    llm, outs = _run(target, _spec(target))
    assert outs == reference
    m = llm.get_metrics()["spec_decode"]
    assert m["num_accepted_tokens"] == m["num_draft_tokens"] > 50
    assert fed and max(fed) == 2


def test_the_cost_aware_hybrid_is_lossless_and_drafts_with_both(models, reference, monkeypatch):
    """With the draft allocation on, the hybrid weighs suffix decoding's draft against the draft
    model's chain per request and step: outputs stay the target's, and both drafters draft. Steps
    and draft passes are priced by a fixed cost model, not by timing them: which drafter wins must
    not depend on how busy the machine is while the test runs."""
    from draftwise.spec_decode.allocation import DraftAllocator, StepCosts
    from draftwise.spec_decode.draft_model import DraftModelProposer
    monkeypatch.setattr(StepCosts, "__bool__", lambda self: True)
    monkeypatch.setattr(StepCosts, "__call__", lambda self, tokens: 5e-3 + 5e-4 * tokens)
    monkeypatch.setattr(StepCosts, "observe_step", lambda self, *a: None)
    monkeypatch.setattr(DraftAllocator, "observe_drafting", lambda self, seconds, requests=1: None)
    monkeypatch.setattr(DraftModelProposer, "drafting_seconds", lambda self, n, k: 2e-5 * k * (1 + 0.1 * n))
    target, _ = models
    llm, outs = _run(target, _spec(target, hybrid="suffix", allocate_drafts=True,
                                   suffix_decoding_min_token_prob=0.0))
    assert outs == reference
    by_source = llm.get_metrics()["spec_decode_by_source"]
    assert by_source["draft_model"]["num_drafts"] > 0 and by_source["suffix"]["num_drafts"] > 0


def test_the_allocation_prices_drafting_without_the_draft_models_catch_up(models, reference, monkeypatch):
    """A request's first draft feeds the draft model its whole prompt: that share of the call is
    what the worker reports as catch-up (the engine leaves it out of the drafting seconds the
    allocation learns); a call that drafts for no request - the runner then never reaches the
    drafter - reports none, not the last drafting call's."""
    from draftwise.spec_decode.allocation import DraftAllocator
    from draftwise.worker.worker import Worker
    calls, priced = [], []
    propose, observe = Worker.propose, DraftAllocator.observe_drafting

    def recording_propose(self, *a):
        drafts = propose(self, *a)
        calls.append((any(d is not None for d in drafts), self.catch_up_seconds))
        return drafts

    def recording_observe(self, seconds, requests=1):
        priced.append(seconds)
        observe(self, seconds, requests)
    monkeypatch.setattr(Worker, "propose", recording_propose)
    monkeypatch.setattr(DraftAllocator, "observe_drafting", recording_observe)
    target, other = models
    _, outs = _run(target, _spec(other, allocate_drafts=True), max_num_seqs=2)
    assert outs == reference
    assert any(seconds > 0 for _, seconds in calls)                  # the prompts' first drafts
    assert any(not drafted for drafted, _ in calls)
    assert all(seconds == 0 for drafted, seconds in calls if not drafted)
    assert priced and min(priced) >= 0.0


def test_a_catch_up_rows_seconds_are_learned_from_long_feeds_only(models, reference, monkeypatch):
    """What the hybrid charges a request for its pending catch-up comes from feeds of many catch-up
    rows (the 40-token prompt's first draft here), not from a few rows sharing a pass's cost."""
    from draftwise.spec_decode.draft_model import DraftModelProposer
    target, other = models
    llm, outs = _run(target, _spec(other))
    assert outs == reference and llm.engine.worker.proposer.catch_up_row_seconds > 0
    monkeypatch.setattr(DraftModelProposer, "CATCH_UP_ROWS_MEASURED", 10 ** 6)
    llm, outs = _run(target, _spec(other))
    assert outs == reference and llm.engine.worker.proposer.catch_up_row_seconds == 0.0


def test_chains_end_after_a_doubtful_token(models, reference, monkeypatch):
    target, other = models
    for threshold, check in ((1.0, lambda n: n == 1), (0.0, lambda n: n == K)):
        drafts = _record_drafts(monkeypatch)
        _, outs = _run(target, _spec(other, draft_confidence_threshold=threshold))
        assert outs == reference
        assert drafts and all(check(len(tokens)) for _, _, tokens in drafts), threshold
        monkeypatch.undo()


def test_draft_model_errors(models, tmp_path):
    target, _ = models
    with pytest.raises(ValueError, match="needs speculative_config\\['model'\\]"):
        LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="model path .*missing. does not exist"):
        LLM(target, speculative_config=_spec(str(tmp_path / "missing")))
    small = str(tmp_path / "v128")
    make_tiny_hf(small, "llama", vocab=128, seed=3)
    with pytest.raises(ValueError, match="vocabulary of 128 tokens, the target 256"):
        LLM(target, speculative_config=_spec(small))
    with pytest.raises(ValueError, match="draft_confidence_threshold must be in"):
        LLM(target, speculative_config=_spec(target, draft_confidence_threshold=1.5))


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    target = str(tmp_path_factory.mktemp("dm_v8"))
    draft = str(tmp_path_factory.mktemp("dm_v8_draft"))
    make_tiny_hf(target, "llama", vocab=8, hidden=32, layers=2, heads=2, kv_heads=1, seed=5)
    make_tiny_hf(draft, "llama", vocab=8, hidden=32, layers=1, heads=2, kv_heads=1, seed=6)
    return target, draft


def _sample_counts(path, spec, n):
    llm = LLM(path, block_size=4, max_model_len=64, max_num_seqs=64, speculative_config=spec)
    sps = [SamplingParams(max_tokens=2, seed=1000 + i, ignore_eos=True, temperature=1.0) for i in range(n)]
    counts: dict = {}
    for o in llm.generate([{"prompt_token_ids": [3, 4, 5]}] * n, sps):
        k = tuple(o.outputs[0].token_ids)
        counts[k] = counts.get(k, 0) + 1
    return counts, llm.get_metrics()["spec_decode"]


@pytest.mark.parametrize("tree", [False, True])
def test_sampling_distribution_is_preserved(small_vocab_pair, tree):
    target, draft = small_vocab_pair
    n = 3000
    base, _ = _sample_counts(target, None, n)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2, "rejection_sampler": "logits",
            "allocate_drafts": False}
    if tree:
        spec.update(num_speculative_tokens=4, eagle_topk=2, eagle_depth=2)
    got, m = _sample_counts(target, spec, n)
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0
    stat, df = two_sample_chi2(base, got)
    assert stat < chi2_critical(df), (stat, df)


def test_requantize_linears_matches_llamas_reference_quantizer():
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from draftwise.layers.quant import requantize_linears
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(48, 16))
    w = [lin.weight.detach().clone() for lin in m]
    assert requantize_linears(m, "Q4_0") == 2          # 48 inputs do not split into 32-input blocks
    ref = dequantize(quantize(w[0].numpy(), GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    assert torch.equal(m[0].dequantize(), torch.from_numpy(np.ascontiguousarray(ref)))
    assert not torch.equal(m[0].dequantize(), w[0]) and isinstance(m[2], torch.nn.Linear)
    x = torch.randn(3, 64)
    assert torch.allclose(m[0](x), x @ torch.from_numpy(ref).T + m[0].bias, atol=1e-2)
    with pytest.raises(ValueError, match="cannot re-quantize"):
        requantize_linears(m, "Q2_K")


def test_requantized_blocks_are_cached_and_reread_as_the_quantizer_made_them(tmp_path, monkeypatch, caplog):
    """The blocks a start quantizes are kept (one safetensors file) and the next start reads them
    instead of quantizing: the same bytes, the quantizer not called; a cut file is quantized again."""
    import torch
    from gguf import quants
    from draftwise.layers.quant import requantize_linears

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16, bias=False))
    cache = str(tmp_path / "c" / "m-Q4_0.safetensors")
    first = model()
    assert requantize_linears(first, "Q4_0", cache=cache) == 2
    calls = []
    real = quants.quantize
    monkeypatch.setattr(quants, "quantize", lambda *a: calls.append(a) or real(*a))
    again = model()
    assert requantize_linears(again, "Q4_0", cache=cache) == 2 and calls == []
    for a, b in zip(first, again):
        assert torch.equal(a.dequantize(), b.dequantize())
    with open(cache, "r+b") as f:                     # cut mid-file
        f.truncate(100)
    with caplog.at_level("WARNING", logger="draftwise"):
        third = model()
        assert requantize_linears(third, "Q4_0", cache=cache) == 2 and len(calls) == 2
    assert "could not be read" in caplog.text and torch.equal(third[0].dequantize(), first[0].dequantize())
    assert requantize_linears(model(), "Q4_0", cache=cache) == 2 and len(calls) == 2    # rewritten whole


def test_a_gguf_draft_model_re_quantized_at_load_is_lossless(tmp_path, monkeypatch):
    from tests.models.gguf_builder import write_tiny_llama_gguf
    q8 = {k: "Q8_0" for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    target = write_tiny_llama_gguf(str(tmp_path / "t.gguf"), q8, hidden=128, layers=2, inter=256, vocab=256)
    draft = write_tiny_llama_gguf(str(tmp_path / "d.gguf"), q8, hidden=128, layers=1, inter=256, vocab=256, seed=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _ids(LLM(target, block_size=4, max_model_len=128).generate(prompts, EXACT_STEPS))
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    for spec in (_spec(draft, quantization="q4_0"), _spec(target, quantization="Q4_0"),
                 _spec(draft, quantization="q4_0")):     # the last from the re-quantized blocks kept
        llm = LLM(target, block_size=4, max_model_len=128, speculative_config=spec)
        assert _ids(llm.generate(prompts, EXACT_STEPS)) == ref
        assert llm.engine.spec_config.quantization == "Q4_0"
        lin = llm.engine.worker.proposer.draft.layers[0].mlp.down_proj
        assert lin.dequantize().shape == (128, 256)
        assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0
    assert len(os.listdir(tmp_path / "cache" / "requantized")) == 2
    with pytest.raises(ValueError, match="must be one of Q4_0"):
        LLM(target, speculative_config=_spec(draft, quantization="int3"))
    with pytest.raises(ValueError, match="applies to method 'draft_model' only"):
        LLM(target, speculative_config={"method": "suffix", "quantization": "Q4_0"})


def test_only_rows_beyond_a_steady_step_count_as_catching_up():
    """A request drafting every step feeds at most K + 2 rows (its emitted tokens, then the root);
    rows beyond that - a new turn's prompt, tokens of steps it did not draft in - catch it up."""
    steady = _Segment(0, 10, list(range(6)))                 # K = 4: 6 rows, nothing to catch up
    assert catch_up_share([steady], 4) == 0.0
    long_turn = _Segment(1, 0, list(range(106)))             # 100 rows beyond a steady step
    assert catch_up_share([steady, long_turn], 4) == 100 / 112
    assert catch_up_share([], 4) == 0.0
