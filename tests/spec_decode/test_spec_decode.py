"""Speculative decoding core: metadata, rejection samplers, EAGLE-3 / n-gram losslessness, checkpoints."""
import math

import pytest
import torch

from tests.helpers import make_tiny_hf
from tests.helpers import load_cfg, write_eagle3_checkpoint
from draftwise import LLM, SamplingParams
from draftwise.sample import rejection_sampler as rs
from draftwise.sample.sampler import SamplingMetadata
from draftwise.spec_decode.metadata import SpecDecodeMetadata
from draftwise.spec_decode.ngram import ngram_propose

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3] * 20, list(range(30, 70)), [7, 7, 7], [12, 13, 12, 13, 12, 13, 12]]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_spec_decode_metadata_seed_example():
    cu = [4, 104, 107, 207, 209]
    nd = [3, 0, 2, 0, 1]
    input_ids = torch.arange(209) + 1000
    m = SpecDecodeMetadata.build(nd, cu, input_ids)
    assert m.cu_num_draft_tokens.tolist() == [3, 3, 5, 5, 6]
    assert m.logits_indices.tolist() == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]
    assert m.target_logits_indices.tolist() == [0, 1, 2, 5, 6, 9]
    assert m.bonus_logits_indices.tolist() == [3, 4, 7, 8, 10]
    assert m.draft_token_ids.tolist() == [1001, 1002, 1003, 1105, 1106, 1208]
    assert m.draft_matrix().tolist() == [[1001, 1002, 1003], [-1, -1, -1], [1105, 1106, -1],
                                         [-1, -1, -1], [1208, -1, -1]]


def test_greedy_rejection_sampler():
    # request 0: drafts [5, 6, 7], target argmax [5, 6, 9] + bonus 4 -> [5, 6, 9]
    # request 1: no drafts, bonus 8 -> [8]
    # request 2: drafts [1, 2], all accepted, bonus 3 -> [1, 2, 3]
    # request 3: drafts [7], first rejected -> the target's [2]
    target = [5, 6, 9, 4, 8, 1, 2, 3, 2, 5]
    out = rs.greedy_accept(target, [[5, 6, 7], [], [1, 2], [7]])
    assert out == [[5, 6, 9], [8], [1, 2, 3], [2]]


def test_probabilistic_sampler_reduces_to_greedy_for_greedy_rows():
    V = 10
    logits = torch.randn(6, V)
    am = logits.argmax(-1)
    drafts = torch.tensor([[int(am[0]), int(am[1]), (int(am[2]) + 1) % V], [-1, -1, -1]])
    nd = torch.tensor([3, 1])
    drafts[1, 0] = am[4]
    logits = logits[:6]
    meta = SamplingMetadata(torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2),
                            torch.tensor([True, True]), [torch.Generator().manual_seed(0)] * 2, True)
    out = rs.rejection_sample(logits, drafts, nd, meta)
    assert out[0].tolist() == [int(am[0]), int(am[1]), int(am[2]), -1]
    assert out[1].tolist() == [int(am[4]), int(am[5]), -1, -1]


def test_ngram_lookup():
    import numpy as np
    toks = np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    assert ngram_propose(toks, 1, 3, 3) == [4, 5, 9]
    assert ngram_propose(np.array([7, 8, 9]), 1, 3, 3) == []


@pytest.fixture(scope="module")
def eagle_ckpt(tiny_llama, tmp_path_factory):
    path, _ = tiny_llama
    return write_eagle3_checkpoint(str(tmp_path_factory.mktemp("eagle3")), load_cfg(path), draft_vocab=128)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("mode", ["fused", "logits"])
def test_eagle3_greedy_is_lossless(tiny_llama, eagle_ckpt, k, mode):
    path, _ = tiny_llama
    ref = _ids(LLM(path, block_size=4, max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    llm = LLM(path, block_size=4, max_model_len=256, speculative_config={
        "method": "eagle3", "model": eagle_ckpt, "num_speculative_tokens": k, "rejection_sampler": mode,
        "allocate_drafts": False})   # whole drafts: the test checks their shape
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert _ids(outs) == ref
    m = llm.get_metrics()["spec_decode"]
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == m["num_drafts"] * k
    assert outs[0].metrics.num_drafts > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_greedy_is_lossless_and_accepts(tiny_llama, k):
    path, _ = tiny_llama
    ref = _ids(LLM(path, block_size=4, max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    llm = LLM(path, block_size=4, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})
    assert _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)) == ref
    m = llm.get_metrics()["spec_decode"]
    assert m["num_accepted_tokens"] > 0          # repetitive prompts: drafts do get accepted
    assert m["mean_acceptance_length"] > 1.0


def test_checkpoint_formats_load_and_run(tiny_llama, tmp_path):
    path, _ = tiny_llama
    cfg = load_cfg(path)
    ref = _ids(LLM(path, block_size=4, max_model_len=128).generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY))
    for fmt in ("safetensors", "bin"):
        ck = write_eagle3_checkpoint(str(tmp_path / fmt), cfg, draft_vocab=64, fmt=fmt, aux_ids=[1, 2, 3],
                                     with_embedding=(fmt == "bin"))
        llm = LLM(path, block_size=4, max_model_len=128,
                  speculative_config={"method": "eagle3", "model": ck, "num_speculative_tokens": 2})
        assert llm.engine.worker.model.aux_hidden_state_layers == (1, 2, 3)
        assert llm.engine.worker.proposer.model.has_own_embedding == (fmt == "bin")
        assert _ids(llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)) == ref


def test_speculative_config_errors(tiny_llama, eagle_ckpt, tmp_path):
    path, _ = tiny_llama
    cfg = load_cfg(path)
    with pytest.raises(ValueError, match="unknown speculative method"):
        LLM(path, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(path, speculative_config={"method": "eagle3", "model": eagle_ckpt, "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="not a directory|does not exist"):
        LLM(path, speculative_config={"method": "eagle3", "model": str(tmp_path / "x"), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(path, speculative_config="{method: eagle3")
    bad = write_eagle3_checkpoint(str(tmp_path / "wrong_h"), dict(cfg, hidden_size=32, intermediate_size=64))
    with pytest.raises(ValueError, match="hidden size"):
        LLM(path, speculative_config={"method": "eagle3", "model": bad, "num_speculative_tokens": 2})
    badv = write_eagle3_checkpoint(str(tmp_path / "wrong_v"), dict(cfg, vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(path, speculative_config={"method": "eagle3", "model": badv, "num_speculative_tokens": 2})
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(path, speculative_config={"method": "eagle3", "model": str(broken), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="no shipped"):
        LLM(path, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})


def test_position_cutoff_near_max_model_len(tiny_llama):
    path, _ = tiny_llama
    L, K = 48, 5
    prompt = [12, 13] * 10
    ref = _ids(LLM(path, block_size=4, max_model_len=L).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)))[0]
    llm = LLM(path, block_size=4, max_model_len=L,
              speculative_config={"method": "ngram", "num_speculative_tokens": K})
    eng = llm.engine
    eng.add_request({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    req = next(iter(eng.requests.values()))
    while eng.has_unfinished_requests():
        eng.step()
        if req.draft:
            # a draft is only proposed while the verified block still fits below max_model_len
            assert req.num_tokens - 1 + K < L
    assert req.output_token_ids == ref
    assert req.num_tokens == L


# ----------------------------------------------------------------------------------------------
# sampling is lossless: two-sample chi-square test over thousands of seeded samples
# ----------------------------------------------------------------------------------------------
def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def two_sample_chi2(a: dict, b: dict) -> tuple[float, int]:
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat, df = 0.0, -1
    for k in keys:
        x, y = a.get(k, 0), b.get(k, 0)
        tot = x + y
        if tot == 0:
            continue
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
        df += 1
    return stat, max(df, 1)


def _sample_counts(path, spec, params_kw, n, n_tokens=2):
    llm = LLM(path, block_size=4, max_model_len=64, max_num_seqs=64, speculative_config=spec)
    sps = [SamplingParams(max_tokens=n_tokens, seed=1000 + i, ignore_eos=True, **params_kw) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": [3, 4, 5]}] * n, sps)
    counts: dict = {}
    for o in outs:
        k = tuple(o.outputs[0].token_ids)
        counts[k] = counts.get(k, 0) + 1
    return counts, llm.get_metrics()["spec_decode"]


_PLAIN_COUNTS: dict = {}


def _plain_counts(path, params_kw, n, n_tokens=2):
    """_sample_counts without a drafter: the reference every drafter's sample is tested against,
    drawn once per sampling setting."""
    key = (path, tuple(sorted(params_kw.items())), n, n_tokens)
    if key not in _PLAIN_COUNTS:
        _PLAIN_COUNTS[key] = _sample_counts(path, None, params_kw, n, n_tokens)[0]
    return _PLAIN_COUNTS[key]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_v8"))
    make_tiny_hf(path, "llama", vocab=8, hidden=32, layers=2, heads=2, kv_heads=1, seed=5)
    ck = write_eagle3_checkpoint(str(tmp_path_factory.mktemp("eagle_v8")), load_cfg(path), scale=0.3, seed=2)
    from tests.helpers import write_dflash_checkpoint
    dck = write_dflash_checkpoint(str(tmp_path_factory.mktemp("dflash_v8")), load_cfg(path), block_size=3,
                                  target_layer_ids=(0,), mask_token_id=7, scale=0.3, seed=3)
    return path, ck, dck


def _broken_rejection_sample(logits, drafts, nd, meta):
    """Deliberately wrong: recovered tokens drawn from p instead of max(p - q, 0)."""
    R, K = drafts.shape
    probs = rs._per_request(rs.target_probs(logits, meta.repeat_rows((nd + 1).tolist())), nd, K)
    out = torch.full((R, K + 1), -1, dtype=torch.long)
    for r in range(R):
        g = meta.generators[r]
        for i in range(int(nd[r]) + 1):
            p = probs[r, i]
            if i < nd[r] and float(torch.rand((), generator=g)) < float(p[drafts[r, i]]):
                out[r, i] = drafts[r, i]
                continue
            out[r, i] = int(torch.multinomial(p, 1, generator=g))
            break
    return out


@pytest.mark.parametrize("params_kw", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 5, "top_p": 0.9}])
@pytest.mark.parametrize("method", ["eagle3", "ngram", "dflash", "suffix", "suffix-tree", "eagle3+suffix"])
def test_sampling_distribution_is_preserved(small_vocab, params_kw, method):
    path, ck, dck = small_vocab
    n = 3000
    base = _plain_counts(path, params_kw, n)
    spec = {"eagle3": {"method": "eagle3", "model": ck, "num_speculative_tokens": 2},
            "ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
            "dflash": {"method": "dflash", "model": dck, "num_speculative_tokens": 2},
            "suffix": {"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.0},
            "suffix-tree": {"method": "suffix", "num_speculative_tokens": 4, "draft_tree": True,
                            "suffix_decoding_min_token_prob": 0.0, "suffix_decoding_max_spec_factor": 2.0},
            "eagle3+suffix": {"method": "eagle3", "model": ck, "num_speculative_tokens": 1, "hybrid": "suffix",
                              "suffix_decoding_min_token_prob": 0.0}}[method]
    # whole drafts: on this random model the allocation would verify almost none of them
    got, m = _sample_counts(path, dict(spec, rejection_sampler="logits", allocate_drafts=False), params_kw, n)
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0
    stat, df = two_sample_chi2(base, got)
    assert stat < chi2_critical(df), (stat, df)


def test_distribution_test_detects_a_broken_sampler(small_vocab, monkeypatch):
    path, ck, _ = small_vocab
    n = 3000
    base = _plain_counts(path, {"temperature": 1.0}, n)
    import draftwise.worker.model_runner as mr
    monkeypatch.setattr(mr, "rejection_sample", _broken_rejection_sample)
    got, m = _sample_counts(path, {"method": "eagle3", "model": ck, "num_speculative_tokens": 2,
                                   "rejection_sampler": "logits", "allocate_drafts": False}, {"temperature": 1.0}, n)
    assert m["num_drafts"] > 0
    stat, df = two_sample_chi2(base, got)
    assert stat > chi2_critical(df), (stat, df)


def _policy(costs, **kw):
    from draftwise.spec_decode.policy import SpeculationPolicy
    pol = SpeculationPolicy(5, **kw)
    pol.set_step_costs(costs)
    return pol


# latency-bound up to 8 tokens, then cost grows linearly with tokens (compute-bound)
COSTS = {1: 0.030, 2: 0.031, 4: 0.033, 8: 0.040, 16: 0.080, 32: 0.160, 64: 0.320}


def test_speculation_policy_cost_model():
    from draftwise.spec_decode.policy import SpeculationPolicy
    # a drafter's recorded held-out acceptance is the prior (else 0.5^j)
    assert SpeculationPolicy(3, prior_acceptance=[0.6, 0.3]).acceptance() == pytest.approx([0.6, 0.3, 0.125])
    pol = _policy(COSTS)
    assert pol.cost(3) == pytest.approx(0.032)
    assert pol.cost(128) == pytest.approx(0.640)
    # prior acceptance 0.5^j, free drafting: 1 + 0.5 + 0.25 + ... tokens per step
    assert pol.throughput(1, 2) == pytest.approx(1.75 / 0.032)
    assert pol.throughput(16, 0) == pytest.approx(16 / 0.080)


def test_speculation_policy_speculates_when_cheap_and_accepted():
    pol = _policy(COSTS)
    for _ in range(400):                      # drafts of 5, the first 4 always accepted
        pol.observe_acceptance(5, 4)
    assert pol.acceptance()[:4] == pytest.approx([1, 1, 1, 1], abs=0.02)
    pol.observe_draft_time(1, 5, 0.004)
    assert pol.choose(1) >= 4
    # at a compute-bound batch size even perfect drafts cannot pay for verification
    assert pol.choose(16) == 0


def test_speculation_policy_falls_back_when_acceptance_or_drafting_is_poor():
    pol = _policy(COSTS)
    for _ in range(400):
        pol.observe_acceptance(5, 0)          # nothing accepted
    assert pol.choose(1) == 0
    pol = _policy(COSTS)
    for _ in range(400):
        pol.observe_acceptance(3, 1)          # a_1 = 1, a_2 = a_3 = 0
    pol.observe_draft_time(1, 1, 0.040)       # drafting as slow as a target step
    assert pol.choose(1) == 0
    pol.draft_costs.clear()
    pol.observe_draft_time(1, 1, 0.001)       # cheap drafting: one draft (the only one accepted)
    assert pol.choose(1) == 1


def test_adaptive_speculation_is_lossless(tiny_llama):
    path, _ = tiny_llama
    ref = _ids(LLM(path, block_size=4, max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    llm = LLM(path, block_size=4, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": True})
    assert _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)) == ref
    assert llm.engine.policy.step_costs and llm.engine.policy.chosen


def test_eagle3_alone_takes_the_drafters_recommended_preset(tiny_llama, tmp_path):
    """{"method": "eagle3"} with no length: the drafter's config names its tree preset and its
    chain length; a drafter without one is a clear error; outputs stay those of plain decoding."""
    import json
    import os
    path, _ = tiny_llama
    ck = write_eagle3_checkpoint(str(tmp_path / "head"), load_cfg(path))
    with pytest.raises(ValueError, match="recommends no draft length"):
        LLM(path, speculative_config={"method": "eagle3", "model": ck})
    raw = load_cfg(ck)
    raw["draftwise_speculative_config"] = {"num_speculative_tokens": 5, "eagle_topk": 2, "eagle_depth": 3,
                                           "chain_num_speculative_tokens": 2}
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump(raw, f)
    ref = _ids(LLM(path).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    tree = LLM(path, speculative_config={"method": "eagle3", "model": ck})
    spec = tree.engine.spec_config
    assert (spec.num_speculative_tokens, spec.eagle_topk, spec.eagle_depth) == (5, 2, 3)
    assert _ids(tree.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)) == ref
    chain = LLM(path, speculative_config={"method": "eagle3", "model": ck, "eagle_topk": 1}).engine.spec_config
    assert (chain.num_speculative_tokens, chain.eagle_topk) == (2, 1)
    mine = LLM(path, speculative_config={"method": "eagle3", "model": ck, "num_speculative_tokens": 4}).engine.spec_config
    assert (mine.num_speculative_tokens, mine.eagle_topk) == (4, 1)
