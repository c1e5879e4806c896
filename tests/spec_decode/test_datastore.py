"""The suffix-decoding datastore: the backward suffix array against a brute-force sort, longest-match
lookup against a brute-force scan, drafting from it, and lossless speculation with a datastore made
of the target's own answers (which it then predicts)."""
import numpy as np
import pytest

from draftwise import LLM, SamplingParams
from draftwise.spec_decode.datastore import SEPARATOR, SORT_DEPTH, Datastore, backward_suffix_array, pack_answers
from draftwise.spec_decode.suffix import SuffixCache


def _key(buf, p, depth):
    return tuple(int(buf[p - d]) if p - d >= 0 else -2 for d in range(depth))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backward_suffix_array_sorts_positions_by_backward_context(seed):
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 4, 300).astype(np.int32)          # a small alphabet: long shared contexts
    buf[rng.integers(0, 300, 12)] = SEPARATOR
    buf[100:140] = buf[200:240]                             # a repeat longer than a doubling step
    order = backward_suffix_array(buf)
    assert sorted(order.tolist()) == list(range(len(buf)))
    keys = [_key(buf, int(p), SORT_DEPTH) for p in order]
    assert keys == sorted(keys)


def _brute_matches(buf, ctx, max_depth):
    best, occ = 0, []
    for p in range(len(buf)):
        m = 0
        while m < min(max_depth, len(ctx)) and p - m >= 0 and buf[p - m] == ctx[-1 - m]:
            m += 1
        if m > best:
            best, occ = m, [p]
        elif m == best and m > 0:
            occ.append(p)
    return sorted(occ), best


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_matches_finds_every_occurrence_of_the_longest_suffix(seed):
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 6, 2000).astype(np.int32)
    buf[rng.integers(0, 2000, 30)] = SEPARATOR
    ds = Datastore(buf)
    for _ in range(50):
        start = int(rng.integers(0, 1900))
        ctx = np.concatenate([rng.integers(0, 6, 3), buf[start:start + int(rng.integers(1, 12))]])
        ctx = ctx[ctx != SEPARATOR]
        if len(ctx) == 0:
            continue
        occ, length = ds.matches(ctx, 8)
        want, want_len = _brute_matches(buf, ctx, 8)
        assert length == want_len
        if len(want) <= 256:
            assert sorted(occ.tolist()) == want
        else:                                              # sampled evenly from the same set
            assert len(occ) == 256 and set(occ.tolist()) <= set(want)
    assert ds.matches(np.array([99]), 8)[1] == 0             # a token the corpus lacks


def test_suffix_cache_drafts_from_the_datastore(tmp_path):
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"i": 0, "tokens": [5, 6, 7, 8, 9]}\n{"i": 1, "tokens": [1, 6, 7, 8, 4]}\n')
    info = pack_answers(str(answers), str(tmp_path / "tokens.npy"))
    assert info["datastore_tokens"] == 12 and (tmp_path / "index.npy").exists()
    ds = Datastore.load(str(tmp_path))
    assert np.load(tmp_path / "tokens.npy").dtype == np.uint16 and ds.buf.tolist() == [
        5, 6, 7, 8, 9, SEPARATOR, 1, 6, 7, 8, 4, SEPARATOR]
    pack_answers(str(answers), str(tmp_path / "tokens.npy"), save_index=False)     # rebuilt at load
    assert not (tmp_path / "index.npy").exists()
    assert np.array_equal(Datastore.load(str(tmp_path)).order, ds.order)
    c = SuffixCache(max_tree_depth=8, max_cached_requests=0, max_spec_factor=2.0, datastore=ds)
    d = c.speculate("r", [30, 5, 6, 7], 8)                 # never seen by this cache: the datastore's
    assert d.token_ids == [8, 9] and d.probs == [1.0, 1.0]
    d = c.speculate("s", [6, 7], 8)                        # two occurrences: 8 certain, then 9 or 4
    assert d.token_ids[0] == 8 and d.probs[0] == 1.0
    assert SuffixCache(max_cached_requests=0).speculate("t", [30, 5, 6, 7], 8).token_ids == []


def test_datastore_of_the_targets_answers_is_lossless_and_accepts(tiny_llama, tmp_path):
    path, _ = tiny_llama
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3 + i, 17, 40 + 2 * i, 9]} for i in range(4)]
    ref = [o.outputs[0].token_ids for o in LLM(path, block_size=4, max_model_len=256).generate(prompts, greedy)]
    with open(tmp_path / "answers.jsonl", "w") as f:
        for i, toks in enumerate(ref):
            f.write(f'{{"i": {i}, "tokens": {list(toks)}}}\n')
    pack_answers(str(tmp_path / "answers.jsonl"), str(tmp_path / "tokens.npy"))
    spec = {"method": "suffix", "suffix_decoding_max_cached_requests": 0,
            "suffix_decoding_datastore": str(tmp_path)}
    llm = LLM(path, block_size=4, max_model_len=256, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == ref
    with_ds = llm.get_metrics()["spec_decode"]["num_accepted_tokens"]
    off = LLM(path, block_size=4, max_model_len=256, speculative_config={**spec, "suffix_decoding_datastore": None})
    assert [o.outputs[0].token_ids for o in off.generate(prompts, greedy)] == ref
    assert with_ds > off.get_metrics()["spec_decode"]["num_accepted_tokens"] + 16


def test_datastore_config_errors(tiny_llama, tmp_path):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="no tokens.npy"):
        LLM(path, speculative_config={"method": "suffix", "suffix_decoding_datastore": str(tmp_path)})
    np.save(tmp_path / "tokens.npy", np.array([1, 2, 10 ** 6], dtype=np.int32))
    with pytest.raises(ValueError, match="beyond the target's vocabulary"):
        LLM(path, speculative_config={"method": "suffix", "suffix_decoding_datastore": str(tmp_path)})
    with pytest.raises(ValueError, match="suffix_decoding_datastore must be"):
        LLM(path, speculative_config={"method": "suffix", "suffix_decoding_datastore": 3})
