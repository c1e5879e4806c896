"""Automatic prefix caching: shared full blocks give identical greedy output (target alone and with
drafters), reference counts return to zero, eviction under a small pool, hashing is chained."""
import pytest

from tests.helpers import load_cfg, write_eagle3_checkpoint
from draftwise import LLM, SamplingParams
from draftwise.engine.kv_cache import BlockAllocator, block_hashes

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
BASE = list(range(40, 75))                      # 35 tokens: 8 full blocks of 4
TURNS = [BASE, BASE + [9, 8, 7, 6, 5], BASE[:20] + [1, 2, 3], list(range(100, 130)), BASE + [9, 8]]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _run_one_by_one(llm, prompts, sp=GREEDY):
    """Sequential requests (each sees the blocks the earlier ones left in the cache)."""
    return [llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids for p in prompts]


def test_block_hashes_are_chained_and_lookup_takes_the_longest_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4, 2)
    assert a[1] != b[1]                         # same block tokens, different prefix
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, start=1, parent=a[0]) == a[1:]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in a)   # SHA-256 digests
    ta, tb = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 5, 6, 7, 8]
    pool = BlockAllocator(4, enable_caching=True)
    x = pool.allocate(2)
    pool.cache_block(x[0], a[0], ta[:4])
    pool.cache_block(x[1], a[1], ta[4:])
    assert pool.lookup(a, ta, 4) == x and pool.lookup(b, tb, 4) == []
    assert pool.lookup([a[0], b[1]], ta, 4) == x[:1]
    pool.free(x)
    assert pool.num_free == 4 and pool.lookup(a, ta, 4) == x          # freed, still cached
    pool.touch(x[:1])
    assert pool.num_free == 3 and pool.ref[x[0]] == 1
    pool.allocate(3)                                           # evicts every other block, x[1] too
    assert pool.lookup(a, ta, 4) == x[:1] and pool.num_cached == 1


def test_a_key_collision_never_serves_another_requests_kv():
    """Even if two token blocks produced the same key, the stored token ids are compared on a hit."""
    pool = BlockAllocator(4, enable_caching=True)
    x = pool.allocate(1)
    key = block_hashes([1, 2, 3, 4], 4, 1)
    pool.cache_block(x[0], key[0], [1, 2, 3, 4])
    assert pool.lookup(key, [1, 2, 3, 4], 4) == x
    assert pool.lookup(key, [1, 2, 3, 5], 4) == []            # forged / colliding key: no hit


@pytest.mark.parametrize("spec", [None, "eagle3", {"method": "suffix"}, "tree", "dflash"])
def test_prefix_hits_give_identical_greedy_output(tiny_llama, tmp_path, spec):
    path, _ = tiny_llama
    if spec in ("eagle3", "tree"):
        ck = write_eagle3_checkpoint(str(tmp_path / "e"), load_cfg(path), seed=2)
        tree = {"eagle_topk": 2, "eagle_depth": 2} if spec == "tree" else {}
        spec = {"method": "eagle3", "model": ck, "num_speculative_tokens": 3, **tree}
    elif spec == "dflash":
        from tests.helpers import write_dflash_checkpoint
        spec = {"method": "dflash", "model": write_dflash_checkpoint(str(tmp_path / "d"), load_cfg(path))}
    ref = _run_one_by_one(LLM(path, block_size=4, max_model_len=128, enable_prefix_caching=False), TURNS)
    llm = LLM(path, block_size=4, max_model_len=128, speculative_config=spec)
    assert _run_one_by_one(llm, TURNS) == ref
    pc = llm.get_metrics()["prefix_cache"]
    assert pc["hits"] >= 8 * 4 and 0 < pc["hit_rate"] < 1
    # every reference was returned: all blocks free (cached or not)
    alloc = llm.engine.scheduler.allocator
    assert all(r == 0 for r in alloc.ref) and alloc.num_free == alloc.num_blocks
    # concurrent requests sharing a prefix that is already cached
    assert _ids(llm.generate([{"prompt_token_ids": p} for p in TURNS], GREEDY)) == ref
    assert all(r == 0 for r in alloc.ref)


def test_eviction_under_a_small_pool(tiny_llama):
    path, _ = tiny_llama
    prompts = [list(range(10 * i, 10 * i + 23)) for i in range(12)] + [list(range(0, 23)) + [5]]
    ref = _run_one_by_one(LLM(path, block_size=4, max_model_len=64, enable_prefix_caching=False), prompts)
    llm = LLM(path, block_size=4, max_model_len=64, max_num_seqs=2, num_kv_blocks=24)
    assert _run_one_by_one(llm, prompts) == ref
    alloc = llm.engine.scheduler.allocator
    assert alloc.num_cached <= 24 and all(r == 0 for r in alloc.ref)
    # the first prompts' blocks were evicted by the later ones: the last prompt (sharing prompt 0's
    # prefix) finds nothing; a repeat of the previous prompt does
    before = alloc.hits
    _run_one_by_one(llm, [prompts[-2] + [1]])
    assert alloc.hits > before
    # concurrent requests that do not fit preempt each other; outputs stay the same
    assert _ids(llm.generate([{"prompt_token_ids": p} for p in prompts[:6]], GREEDY)) == ref[:6]
    assert all(r == 0 for r in alloc.ref)


def test_cached_blocks_do_not_depend_on_speculation(tiny_llama):
    """A request cut at max_tokens in the middle of accepted drafts computed K/V past its end; only
    the blocks plain decoding would have computed (the final sequence but its last token) are cached,
    so later requests' prefix hits are the same with and without speculation."""
    path, _ = tiny_llama
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1}
    for max_tokens in range(6, 14):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        caches = []
        for cfg in (None, spec):
            llm = LLM(path, block_size=4, max_model_len=128, speculative_config=cfg)
            out = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids
            caches.append((out, set(llm.engine.scheduler.allocator.cached)))
        assert caches[0] == caches[1], max_tokens
