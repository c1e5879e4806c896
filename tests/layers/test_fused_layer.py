"""The fused int4 decoder layer (two C++ calls around attention): close to the eager layer on the same
int4 weights, each row independent of the rows beside it, and speculation on it lossless. Skipped
where the CPU has no AVX512-BF16 (the eager layer then serves)."""
import pytest
import torch

from draftwise import LLM, SamplingParams, kernels
from draftwise.layers.attention import CAUSAL, AttentionMetadata, slots_for_positions

needs_kernel = pytest.mark.skipif(kernels.load() is None, reason="no AVX512-BF16 CPU or no compiler")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9, 10, 11], [3] * 20, list(range(30, 70)), [7, 7, 7])]


def _int4(path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_INT4_KERNEL", "draftwise")
    return LLM(path, block_size=4, max_model_len=256, quantization="int4", speculative_config=None)


def _step(model, runner, n, ctx):
    ids, pos, meta, rows = runner.scratch_step_inputs(n, ctx)
    ids = torch.arange(3, 3 + n) % model.config.vocab_size
    return model(ids, pos, meta, runner.kv_cache, rows).logits


@needs_kernel
def test_fused_layers_match_the_eager_layers(tiny_llama, monkeypatch):
    import draftwise.models.llama as L
    calls = []
    real = L.fused_layer_forward
    monkeypatch.setattr(L, "fused_layer_forward", lambda *a: calls.append(1) or real(*a))
    path, _ = tiny_llama
    llm = _int4(path, monkeypatch)
    model, runner = llm.engine.model, llm.engine.runner
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


@needs_kernel
def test_fused_rows_do_not_depend_on_their_neighbours(tiny_llama, monkeypatch):
    """Logits of a row are bit-equal whether it is fed alone or among 7 others."""
    path, _ = tiny_llama
    llm = _int4(path, monkeypatch)
    model, runner = llm.engine.model, llm.engine.runner
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


@needs_kernel
def test_speculation_on_fused_layers_is_lossless(tiny_llama, monkeypatch):
    path, _ = tiny_llama
    plain = _int4(path, monkeypatch)
    assert plain.engine.model.layers[0].fused is not None
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "suffix", "num_speculative_tokens": 8, "draft_tree": True}):
        llm = LLM(path, block_size=4, max_model_len=256, quantization="int4", speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
        assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0
