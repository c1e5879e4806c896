"""Suffix decoding (per-request and global suffix statistics, chain and tree output) and hybrid
drafting: hand-worked drafts, greedy losslessness on a tiny target, per-source metrics."""
import numpy as np
import pytest

from tests.helpers import load_cfg, write_eagle3_checkpoint
from draftwise import LLM, SamplingParams
from draftwise.spec_decode.suffix import SuffixCache, build_draft, match_lengths

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# repetitive prompts, so suffix matches exist from the start
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7], [3, 4] * 10, list(range(30, 50)) * 2, [7, 7, 7],
           [12, 13, 14, 12, 13, 15, 12, 13]]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_per_request_chain_and_tree_drafts():
    c = SuffixCache(max_tree_depth=24, max_cached_requests=0, max_spec_factor=1.0, min_token_prob=0.1)
    toks = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurs twice before (length 3, the longest); continuations 4 5 6 / 4 7 8
    d = c.speculate("a", toks, 8)
    assert d.token_ids == [4, 5, 6] and d.parents == [-1, 0, 1]
    assert d.probs == [1.0, 0.5, 0.5] and d.expected_accepted == 2.0          # depth capped at 1.0 x match length
    t = c.speculate("a", toks, 8, tree=True)
    assert t.token_ids == [4, 5, 7, 6, 8] and t.parents == [-1, 0, 0, 1, 2]
    assert t.expected_accepted == pytest.approx(3.0)
    # min_token_prob prunes the 0.5 branches
    c2 = SuffixCache(max_cached_requests=0, min_token_prob=0.6)
    assert c2.speculate("a", toks, 8).token_ids == [4]
    # at most max_draft nodes
    assert c.speculate("a", toks, 2, tree=True).token_ids == [4, 5]
    # no earlier occurrence of the last token: no draft
    assert c.speculate("b", [1, 2, 3], 8).token_ids == []


def test_global_cache_and_fifo_eviction():
    c = SuffixCache(max_tree_depth=8, max_cached_requests=1, max_spec_factor=2.0)
    c.speculate("r1", [9, 1, 2], 4)
    c.finish_request("r1", [10, 11, 12, 13])
    d = c.speculate("r2", [50, 10, 11], 4)                  # matches the cached output of r1
    assert d.token_ids == [12, 13]
    c.finish_request("r2", [20, 21, 22])                     # evicts r1 (max_cached_requests=1)
    assert c.speculate("r3", [50, 10, 11], 4).token_ids == []
    assert c.speculate("r4", [20, 21], 4).token_ids == [22]
    c0 = SuffixCache(max_cached_requests=0)                   # 0 disables the global cache
    c0.finish_request("x", [1, 2, 3, 4])
    assert c0.speculate("y", [1, 2], 4).token_ids == []


def test_match_lengths_and_counts_are_vectorised_correctly():
    buf = np.array([1, 2, 3, -1, 9, 2, 3, 5, 2, 3])
    ctx = np.array([8, 1, 2, 3])
    cand = np.array([2, 6])
    assert match_lengths(buf, cand, ctx, 2, 24).tolist() == [3, 2]
    d = build_draft(buf, len(buf), np.array([2, 6]), 2, 4, 2.0, 0.0, tree=True)
    # continuations: after 2 -> a separator (nothing), after 6 -> 5 2 3 (the buffer's end)
    assert d.token_ids == [5, 2, 3] and d.probs == [0.5, 0.5, 0.5]


@pytest.mark.parametrize("spec", [
    {"method": "suffix"},
    {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_spec_factor": 2.0},
    {"method": "suffix", "num_speculative_tokens": 8, "draft_tree": True, "suffix_decoding_min_token_prob": 0.0},
    {"method": "suffix", "suffix_decoding_max_cached_requests": 0},
])
def test_suffix_greedy_is_lossless_and_accepts(tiny_llama, spec):
    path, _ = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _ids(LLM(path, block_size=4, max_model_len=256).generate(prompts, GREEDY))
    llm = LLM(path, block_size=4, max_model_len=256, max_num_seqs=2, speculative_config=spec)
    assert _ids(llm.generate(prompts, GREEDY)) == ref
    m = llm.get_metrics()
    assert m["spec_decode"]["num_accepted_tokens"] > 0
    assert set(m["spec_decode_by_source"]) == {"suffix"}


@pytest.mark.parametrize("hybrid", ["suffix", "ngram"])
def test_hybrid_drafting_is_lossless_and_uses_both_sources(tiny_llama, tmp_path, hybrid):
    path, _ = tiny_llama
    ck = write_eagle3_checkpoint(str(tmp_path / "eagle"), load_cfg(path), seed=3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _ids(LLM(path, block_size=4, max_model_len=256).generate(prompts, GREEDY))
    llm = LLM(path, block_size=4, max_model_len=256, max_num_seqs=3,
              speculative_config={"method": "eagle3", "model": ck, "num_speculative_tokens": 2, "hybrid": hybrid})
    outs = llm.generate(prompts, GREEDY)
    assert _ids(outs) == ref
    by = llm.get_metrics()["spec_decode_by_source"]
    assert set(by) == {"eagle3", hybrid} and by[hybrid]["num_accepted_tokens"] > 0
    total = llm.get_metrics()["spec_decode"]
    assert total["num_drafts"] == by["eagle3"]["num_drafts"] + by[hybrid]["num_drafts"]
    assert sum(o.metrics.num_drafts for o in outs) == total["num_drafts"]


def test_per_request_opt_out(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, max_model_len=256, speculative_config={"method": "suffix"})
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculate=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], [plain, GREEDY])
    assert outs[0].metrics.num_drafts == 0 and outs[1].metrics.num_drafts > 0
    ref = _ids(LLM(path, block_size=4, max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY))
    assert _ids(outs) == ref
    with pytest.raises(ValueError, match="speculate"):
        SamplingParams(speculate="no")


def test_suffix_and_hybrid_config_errors(tiny_llama):
    path, _ = tiny_llama
    bad = [({"method": "ngram", "num_speculative_tokens": 2, "hybrid": "suffix"}, "hybrid"),
           ({"method": "eagle3", "num_speculative_tokens": 2, "hybrid": "medusa"}, "hybrid"),
           ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "min_token_prob"),
           ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "max_tree_depth"),
           ({"method": "eagle3", "num_speculative_tokens": 2, "draft_tree": True}, "draft_tree")]
    for spec, match in bad:
        with pytest.raises(ValueError, match=match):
            LLM(path, speculative_config=spec)


def _naive_chain(buf, n, occ, match_len, max_draft, min_prob):
    """Reference: follow the most frequent continuation (the smallest token among ties) one depth
    at a time; path probability = occurrences still on the path / all occurrences."""
    from draftwise.spec_decode.suffix import SEPARATOR
    depth_limit = min(max_draft, match_len)
    rows, toks, probs = list(occ), [], []
    for depth in range(depth_limit):
        col = [int(buf[r + 1 + depth]) if r + 1 + depth < n else SEPARATOR for r in rows]
        counts = {}
        for t in col:
            if t != SEPARATOR:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        tok = min(counts, key=lambda t: (-counts[t], t))
        if counts[tok] / len(occ) < min_prob:
            break
        toks.append(tok)
        probs.append(counts[tok] / len(occ))
        rows = [r for r, t in zip(rows, col) if t == tok]
    return toks, probs


def test_chain_drafts_follow_the_most_frequent_continuation():
    import numpy as np
    from draftwise.spec_decode.suffix import SEPARATOR, build_draft
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n = int(rng.integers(5, 60))
        buf = rng.integers(0, int(rng.integers(2, 6)), n).astype(np.int64)
        buf[rng.random(n) < 0.05] = SEPARATOR
        occ = np.sort(rng.choice(n, size=int(rng.integers(1, min(n, 12))), replace=False))
        md, ml, mp = int(rng.integers(1, 12)), int(rng.integers(1, 20)), float(rng.choice([0.0, 0.1, 0.3]))
        d = build_draft(buf, n, occ, ml, md, 1.0, mp, False)
        toks, probs = _naive_chain(buf, n, occ, ml, md, mp)
        assert d.token_ids == toks and d.parents == list(range(-1, len(toks) - 1))
        assert np.allclose(d.probs, probs)


@pytest.mark.parametrize("factor,min_prob,tree", [(1.0, 0.1, False), (4.0, 0.0, False), (2.0, 0.05, True)])
def test_compiled_search_drafts_what_the_numpy_search_drafts(monkeypatch, factor, min_prob, tree):
    from draftwise import kernels
    from draftwise.spec_decode.datastore import SEPARATOR, Datastore
    if kernels.load() is None:
        pytest.skip("no CPU kernels on this machine: the numpy search serves alone")
    rng = np.random.default_rng(0)
    # phrases over a small vocabulary, repeated with variations: long matches, ties in the counts
    phrases = [rng.integers(0, 40, int(rng.integers(3, 12))).tolist() for _ in range(30)]

    def text(n):
        return [t for _ in range(n) for t in phrases[int(rng.integers(0, 30))]]
    answers = [text(int(rng.integers(2, 12))) for _ in range(60)]
    store = Datastore(np.array([t for a in answers for t in a + [SEPARATOR]], dtype=np.int32))
    requests = [(text(3), text(6)) for _ in range(6)]

    def drafts():
        cache = SuffixCache(6, 3, factor, min_prob, store)        # contexts often match to full depth
        out = []
        for r, (prompt, answer) in enumerate(requests):
            for i in range(len(answer)):
                d = cache.speculate(str(r), prompt + answer[:i], 8, tree)
                out.append((d.token_ids, d.parents, d.probs))
            cache.finish_request(str(r), answer)
        return out
    compiled = drafts()
    monkeypatch.setattr(kernels, "load", lambda: None)
    assert drafts() == compiled
    assert sum(1 for toks, _, _ in compiled if len(toks) >= 2) > len(compiled) // 2
