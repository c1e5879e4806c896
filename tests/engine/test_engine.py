"""Scheduler, KV cache, sampler and API behaviour of the engine."""
import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.layers.attention import AttentionMetadata, CAUSAL, NONCAUSAL, TREE
from draftwise.sample.sampler import apply_top_k_top_p

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [3] * 17, list(range(30, 61)), [9, 9], list(range(200, 211)), [1, 2, 3],
           list(range(60, 90)), [44] * 5]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batch_invariance_and_chunked_prefill(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, max_model_len=256, max_num_seqs=8)
    batch = _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    alone = [_ids(llm.generate([{"prompt_token_ids": p}], GREEDY))[0] for p in PROMPTS]
    assert batch == alone
    chunked = LLM(path, block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=8)
    assert _ids(chunked.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)) == batch


def test_preemption_keeps_greedy_outputs(tiny_llama):
    path, _ = tiny_llama
    ref = _ids(LLM(path, block_size=4, max_model_len=128).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    small = LLM(path, block_size=4, max_model_len=64, max_num_seqs=8, num_kv_blocks=24)
    outs = small.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert _ids(outs) == ref
    assert sum(r.num_preemptions for r in []) == 0  # requests are gone; check via scheduler counters below
    assert small.engine.scheduler.allocator.num_used == 0


def test_preemption_actually_happens(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, max_model_len=64, max_num_seqs=8, num_kv_blocks=24)
    eng = llm.engine
    for p in PROMPTS:
        eng.add_request({"prompt_token_ids": p}, GREEDY)
    reqs = list(eng.requests.values())
    while eng.has_unfinished_requests():
        eng.step()
    assert sum(r.num_preemptions for r in reqs) > 0


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, max_model_len=128)
    sp = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = _ids(llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 3
    mixed = _ids(llm.generate([{"prompt_token_ids": p} for p in ([[5, 6, 7]] + PROMPTS[:3])], [sp] + others))
    assert mixed[0] == alone
    other_seed = _ids(llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                                   SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=12, seed=99,
                                                  ignore_eos=True)))[0]
    assert other_seed != alone


def test_stops_on_eos_and_max_model_len(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, max_model_len=40)
    out = llm.generate([{"prompt_token_ids": list(range(30, 61))}], SamplingParams(temperature=0, max_tokens=100,
                                                                                   ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
    assert out.outputs[0].finish_reason == "length"
    ref = _ids(llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY))[0]
    stop_tok = ref[3]
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref[:ref.index(stop_tok) + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_bad_input_raises_clear_errors(tiny_llama, tmp_path):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="does not exist|neither"):
        LLM(str(tmp_path / "nope"))
    llm = LLM(path, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": list(range(40))}], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=bad)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], GREEDY)


def test_attention_masks():
    bt = torch.arange(8)[None].repeat(2, 1)
    slots = torch.arange(5)
    m = AttentionMetadata(slots, [3, 2], [5, 4], bt, 4, CAUSAL).finalize()
    a = m.groups[0].attn_mask[:, 0]
    # request 0: context 2, queries at entries 2,3,4 causal
    assert a[0, 0].tolist() == [True, True, True, False, False]
    assert a[0, 2].tolist() == [True] * 5
    # request 1: context 2, 2 queries
    assert a[1, 1].tolist() == [True, True, True, True, False]
    n = AttentionMetadata(slots, [3, 2], [5, 4], bt, 4, NONCAUSAL).finalize()
    assert n.groups[0].attn_mask[0, 0, 0].tolist() == [True] * 5
    tm = torch.zeros(2, 3, 3, dtype=torch.bool)
    tm[0] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tm[1, :2, :2] = torch.eye(2, dtype=torch.bool)
    t = AttentionMetadata(slots, [3, 2], [5, 4], bt, 4, TREE, tm).finalize()
    assert t.groups[0].attn_mask[0, 0, 2].tolist() == [True, True, True, False, True]
    assert t.groups[0].attn_mask[1, 0, 1].tolist() == [True, True, False, True, False]


def test_top_k_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, 0]), torch.tensor([1.0, 0.7]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).tolist() == [True, True, False, False]


def test_streaming_yields_incremental_tokens(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, max_model_len=128)
    chunks = list(llm.stream({"prompt_token_ids": [5, 6, 7]}, GREEDY))
    assert chunks[-1].finished
    streamed = [t for c in chunks for t in c.new_token_ids]
    assert streamed == chunks[-1].outputs[0].token_ids and len(streamed) == 20
    assert all(c.new_token_ids for c in chunks)                     # one chunk per step with tokens
    plain = list(LLM(path, block_size=4, max_model_len=128, speculative_config=None).stream(
        {"prompt_token_ids": [5, 6, 7]}, GREEDY))
    assert len(plain) == 20 and [t for c in plain for t in c.new_token_ids] == streamed


@pytest.mark.parametrize("kind", [CAUSAL, NONCAUSAL])
def test_mixed_prefill_and_decode_attention_groups(monkeypatch, kind):
    """A step mixing long prefill chunks with short queries splits into attention groups (short
    queries batched, each long query alone); the result equals one padded batch."""
    import draftwise.layers.attention as A
    torch.manual_seed(0)
    bs, Hkv, H, D = 4, 2, 4, 8
    qlens, slens = [1, 20, 3, 1, 33], [9, 25, 7, 40, 33]
    R = len(qlens)
    bt = torch.randperm(64)[: R * 12].view(R, 12)
    kc, vc = torch.randn(64 * bs, Hkv, D), torch.randn(64 * bs, Hkv, D)
    req = torch.repeat_interleave(torch.arange(R), torch.tensor(qlens))
    pos = torch.cat([torch.arange(s - q, s) for q, s in zip(qlens, slens)])
    slots = A.slots_for_positions(bt, req, pos, bs)
    T = sum(qlens)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    meta = AttentionMetadata(slots, qlens, slens, bt, bs, kind).finalize()
    assert len(meta.groups) == 3 and meta.groups[0].req_index == [0, 2, 3]
    grouped = A.paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.3)
    monkeypatch.setattr(A, "MAX_BATCHED_QUERY", 10_000)
    one = AttentionMetadata(slots, qlens, slens, bt, bs, kind).finalize()
    assert len(one.groups) == 1
    torch.testing.assert_close(grouped, A.paged_attention(q, k, v, kc.clone(), vc.clone(), one, 0.3))


@pytest.mark.parametrize("n", [5, 24])
def test_row_invariant_attention_equals_decoding_each_row_alone(n):
    """Row-invariant mode (quantized targets): an n-row causal query (decode, or verification of
    n - 1 drafts, longer than the batched-query limit too) gives, bit for bit, what n one-row decode
    steps give."""
    import draftwise.layers.attention as A
    torch.manual_seed(0)
    bs, Hkv, H, D = 4, 2, 4, 8
    bt = torch.randperm(16)[:12].view(1, 12)
    kc, vc = torch.randn(16 * bs, Hkv, D), torch.randn(16 * bs, Hkv, D)
    q, k, v = torch.randn(n, H, D), torch.randn(n, Hkv, D), torch.randn(n, Hkv, D)
    pos = torch.arange(40 - n, 40)
    slots = A.slots_for_positions(bt, torch.zeros(n, dtype=torch.long), pos, bs)
    kc1, vc1 = kc.clone(), vc.clone()
    meta = AttentionMetadata(slots, [n], [40], bt, bs, CAUSAL, row_invariant=True).finalize()
    together = A.paged_attention(q, k, v, kc1, vc1, meta, 0.3)
    kc2, vc2 = kc.clone(), vc.clone()
    alone = [A.paged_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], kc2, vc2,
                               AttentionMetadata(slots[i:i + 1], [1], [41 - n + i], bt, bs, CAUSAL,
                                                 row_invariant=True).finalize(), 0.3) for i in range(n)]
    assert torch.equal(together, torch.cat(alone))
    plain = A.paged_attention(q, k, v, kc.clone(), vc.clone(),
                              AttentionMetadata(slots, [n], [40], bt, bs, CAUSAL).finalize(), 0.3)
    torch.testing.assert_close(together, plain)


def test_row_invariant_attention_with_a_prefill_in_the_same_step():
    """A long prefill sharing the step with decode rows in row-invariant mode: every row of both
    attends alone (no group), and together they give what ordinary grouped attention gives."""
    import draftwise.layers.attention as A
    torch.manual_seed(1)
    bs, Hkv, H, D = 4, 2, 4, 8
    bt = torch.arange(24).view(2, 12)
    kc, vc = torch.randn(24 * bs, Hkv, D), torch.randn(24 * bs, Hkv, D)
    qlens, slens = [40, 2], [40, 30]
    T = sum(qlens)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    req = torch.tensor([0] * qlens[0] + [1] * qlens[1])
    pos = torch.cat([torch.arange(qlens[0]), torch.arange(28, 30)])
    slots = A.slots_for_positions(bt, req, pos, bs)
    inv = AttentionMetadata(slots, qlens, slens, bt, bs, CAUSAL, row_invariant=True).finalize()
    assert not inv.groups and inv.row_plan
    out = A.paged_attention(q, k, v, kc.clone(), vc.clone(), inv, 0.3)
    ref = A.paged_attention(q, k, v, kc.clone(), vc.clone(),
                            AttentionMetadata(slots, qlens, slens, bt, bs, CAUSAL).finalize(), 0.3)
    assert out.shape == (T, H, D)
    torch.testing.assert_close(out, ref)


def test_row_invariant_tree_attention_equals_decoding_each_path():
    """Tree verification in row-invariant mode (quantized targets): each node's output equals, bit
    for bit, decoding that node one row at a time after its ancestors (what plain decoding of the
    accepted path computes)."""
    import draftwise.layers.attention as A
    from draftwise.layers.attention import TREE
    torch.manual_seed(2)
    bs, Hkv, H, D, ctx = 4, 2, 4, 16, 9
    parents = [-1, 0, 0, 1, 1, 2]                         # a root, two children, three grandchildren
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    bt = torch.arange(8).view(1, 8)
    kc, vc = torch.randn(32, Hkv, D), torch.randn(32, Hkv, D)
    q, k, v = torch.randn(n, H, D), torch.randn(n, Hkv, D), torch.randn(n, Hkv, D)
    slots = A.slots_for_positions(bt, torch.zeros(n, dtype=torch.long), torch.arange(ctx, ctx + n), bs)
    meta = AttentionMetadata(slots, [n], [ctx + n], bt, bs, TREE, mask[None], row_invariant=True).finalize()
    assert meta.row_plan
    tree_out = A.paged_attention(q, k, v, kc.clone(), vc.clone(), meta, 0.3)
    for i in range(n):
        path = [j for j in range(n) if mask[i, j]]          # ancestors in order, then the node itself
        kc2, vc2 = kc.clone(), vc.clone()
        for step, j in enumerate(path):                     # decode the path one row at a time
            pos = torch.tensor([ctx + step])
            s1 = A.slots_for_positions(bt, torch.zeros(1, dtype=torch.long), pos, bs)
            m1 = AttentionMetadata(s1, [1], [ctx + step + 1], bt, bs, CAUSAL, row_invariant=True).finalize()
            o = A.paged_attention(q[j:j + 1], k[j:j + 1], v[j:j + 1], kc2, vc2, m1, 0.3)
        assert torch.equal(o[0], tree_out[i]), i
