"""The fused int4 decoder layer (two C++ calls around attention), on every compiled ISA path this
machine has: close to the eager layer on the same int4 weights, each row independent of the rows
beside it (a long prefill chunk included), and speculation on it lossless. `DRAFTWISE_ISA=none` has
no fused layer (the eager layers serve)."""
import pytest
import torch

from draftwise import LLM, SamplingParams, kernels
from draftwise.layers.attention import CAUSAL, AttentionMetadata, slots_for_positions

pytestmark = pytest.mark.usefixtures("isa_kernels")          # every compiled ISA path here
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9, 10, 11], [3] * 20, list(range(30, 70)), [7, 7, 7])]


def _int4(path, monkeypatch, kv="auto"):
    return LLM(path, block_size=4, max_model_len=256, quantization="int4", speculative_config=None,
               kv_cache_dtype=kv)


def _step(model, runner, n, ctx):
    ids, pos, meta, rows = runner.scratch_step_inputs(n, ctx)
    ids = torch.arange(3, 3 + n) % model.config.vocab_size
    return model(ids, pos, meta, runner.kv_cache, rows).logits


def test_fused_layers_match_the_eager_layers(tiny_llama, monkeypatch):
    import draftwise.models.llama as L
    calls = []
    real = L.fused_layer_forward
    monkeypatch.setattr(L, "fused_layer_forward", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(L, "fused_stack_forward", lambda *a: None)    # the per-layer path (the stack: below)
    path, _ = tiny_llama
    llm = _int4(path, monkeypatch)
    model, runner = llm.engine.worker.model, llm.engine.worker.runner
    assert all(layer.fused is not None for layer in model.layers)
    calls.clear()
    with torch.inference_mode():
        fused = _step(model, runner, 5, 11)
        assert len(calls) == len(model.layers)                  # the fused path ran, once per layer
        saved = [layer.fused for layer in model.layers]
        for layer in model.layers:
            layer.fused = None
        eager = _step(model, runner, 5, 11)
        for layer, w in zip(model.layers, saved):
            layer.fused = w
    assert len(calls) == len(model.layers)
    # the same bf16 activations and int4 weights: equal up to the order of a few fp32 sums
    torch.testing.assert_close(fused, eager, atol=1e-3, rtol=1e-3)


def test_fused_rows_do_not_depend_on_their_neighbours(tiny_llama, monkeypatch):
    """Logits of a row are bit-equal whether it is fed alone or among 7 others."""
    path, _ = tiny_llama
    llm = _int4(path, monkeypatch)
    model, runner = llm.engine.worker.model, llm.engine.worker.runner
    cfg, bs = model.config, runner.block_size
    ids = torch.tensor([9, 4, 33, 12, 7, 50, 2, 18])
    with torch.inference_mode():
        bt = torch.arange(8)[None]
        pos = torch.arange(8)
        meta = AttentionMetadata(slots_for_positions(bt, torch.zeros(8, dtype=torch.long), pos, bs), [8], [8], bt, bs,
                                 CAUSAL, row_invariant=True).finalize()
        together = model(ids, pos, meta, runner.kv_cache, torch.arange(8)).logits
        alone = []
        for i in range(8):
            m = AttentionMetadata(slots_for_positions(bt, torch.zeros(1, dtype=torch.long), pos[i:i + 1], bs), [1],
                                  [i + 1], bt, bs, CAUSAL, row_invariant=True).finalize()
            alone.append(model(ids[i:i + 1], pos[i:i + 1], m, runner.kv_cache, torch.arange(1)).logits)
    assert cfg.num_hidden_layers and torch.equal(together, torch.cat(alone))


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "float16"])
def test_speculation_on_fused_layers_is_lossless(tiny_llama, monkeypatch, kv):
    """The fused layer writes K/V into the cache itself, in the cache's dtype."""
    path, _ = tiny_llama
    plain = _int4(path, monkeypatch, kv)
    assert plain.engine.worker.model.layers[0].fused is not None
    assert plain.engine.worker.runner.kv_cache.layer(0)[0].dtype == getattr(torch, kv)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    unfused = _int4(path, monkeypatch, kv)
    for layer in unfused.engine.worker.model.layers:
        layer.fused = None
    # the same tokens as the eager layers (whose values agree to the last few fp32 bits)
    assert [o.outputs[0].token_ids for o in unfused.generate(PROMPTS, GREEDY)] == ref
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "suffix", "num_speculative_tokens": 8, "draft_tree": True}):
        llm = LLM(path, block_size=4, max_model_len=256, quantization="int4", speculative_config=spec,
                  kv_cache_dtype=kv)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
        assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0


def test_a_long_prefill_chunk_beside_decode_rows(tiny_llama, monkeypatch):
    """A step holding a long prefill chunk beside a decode row computes every row exactly as it
    would alone: the decode row's logits and the chunk's last row bit-equal to their own steps."""
    path, _ = tiny_llama
    llm = _int4(path, monkeypatch)
    model, runner = llm.engine.worker.model, llm.engine.worker.runner
    assert model.layers[0].fused is not None
    bs = runner.block_size
    n = 40                                                        # > 32 rows: a long chunk
    with torch.inference_mode():
        bt = torch.stack([torch.arange(0, 12), torch.arange(12, 24)])      # two requests' blocks
        ids_a = torch.arange(3, 3 + n) % model.config.vocab_size
        pos_a = torch.arange(n)
        ids_b = torch.tensor([11, 5, 9])
        pos_b = torch.arange(3)

        def meta(reqs):   # reqs: (request index, positions written this step, seq_len)
            slots = torch.cat([slots_for_positions(bt, torch.full((len(p),), r), p, bs) for r, p, _ in reqs])
            sub = bt[[r for r, _, _ in reqs]]
            return AttentionMetadata(slots, [len(p) for _, p, _ in reqs], [s for _, _, s in reqs], sub, bs, CAUSAL,
                                     row_invariant=True).finalize()
        # request b's first two tokens in the cache, then its third decoded alone
        model(ids_b[:2], pos_b[:2], meta([(1, pos_b[:2], 2)]), runner.kv_cache, torch.arange(2))
        alone_b = model(ids_b[2:], pos_b[2:], meta([(1, pos_b[2:], 3)]), runner.kv_cache, torch.arange(1)).logits
        alone_a = model(ids_a, pos_a, meta([(0, pos_a, n)]), runner.kv_cache, torch.tensor([n - 1])).logits
        m = meta([(0, pos_a, n), (1, pos_b[2:], 3)])
        assert not m.groups and m.row_plan                      # every row attends alone
        both = model(torch.cat([ids_a, ids_b[2:]]), torch.cat([pos_a, pos_b[2:]]), m, runner.kv_cache,
                     torch.tensor([n - 1, n])).logits
    assert torch.equal(both[1], alone_b[0])
    assert torch.equal(both[0], alone_a[0])


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_the_layer_stack_in_one_call_equals_the_per_layer_path(tiny_llama, monkeypatch, kv):
    """Decode / verification steps run every layer in one C++ call: the same logits, K/V and
    captured hidden states (EAGLE-3's) as the per-layer calls, bit for bit."""
    import draftwise.models.llama as L
    path, _ = tiny_llama
    llm = _int4(path, monkeypatch, kv)
    model, runner = llm.engine.worker.model, llm.engine.worker.runner
    model.set_aux_hidden_state_layers((0, 2))
    stacked = []
    real = L.fused_stack_forward
    with torch.inference_mode():
        monkeypatch.setattr(L, "fused_stack_forward", lambda *a: stacked.append(1) or real(*a))
        one = model(*runner.scratch_step_inputs(5, 11)[:3], runner.kv_cache, torch.arange(5))
        k_one = runner.kv_cache.layer(1)[0].clone()
        assert stacked and model._fused_stack[1] is not None
        monkeypatch.setattr(L, "fused_stack_forward", lambda *a: None)
        per_layer = model(*runner.scratch_step_inputs(5, 11)[:3], runner.kv_cache, torch.arange(5))
    assert torch.equal(one.logits, per_layer.logits)
    assert torch.equal(one.aux_hidden_states, per_layer.aux_hidden_states)
    assert torch.equal(k_one, runner.kv_cache.layer(1)[0])
