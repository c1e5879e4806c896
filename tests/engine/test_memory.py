"""Bounded memory: one copy of each weight (no dense fp32 copy beside quantized weights, no second
layout beside fp32 weights), the KV pool sized by a memory budget, a 16-bit KV option."""
import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.config import parse_bytes
from draftwise.layers.linear import TransposedLinear, prepare_linears_for_inference
from draftwise.layers.quant import Int4Linear, Int8Linear, quantize_int4_groupwise, quantize_int8_per_channel

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9], [3] * 20, list(range(30, 60)))]


def _buffer_bytes(mod):
    return sum(b.numel() * b.element_size() for b in mod.buffers() if b is not None)


def test_quantized_linears_keep_no_dense_copy():
    w = torch.randn(96, 128) * 0.05
    q, s = quantize_int8_per_channel(w)
    lin8 = Int8Linear(q, s)
    assert _buffer_bytes(lin8) < w.numel() * 4 / 3                     # int8 + scales, not fp32
    codes, scale, mn = quantize_int4_groupwise(w)
    lin4 = Int4Linear(codes, scale, mn)
    assert _buffer_bytes(lin4) < w.numel() * 4 / 3                     # packed int4 twice + scales
    x = torch.randn(40, 128)                                           # past the kernel's row limit
    torch.testing.assert_close(lin4(x), x @ lin4.dequantize().t(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lin8(x), x @ lin8.dequantize().t(), atol=3e-2, rtol=3e-2)


def test_one_weight_layout_per_execution_mode():
    lin = torch.nn.Linear(64, 32, bias=False)
    eager = prepare_linears_for_inference(torch.nn.Sequential(lin), compiled=False)
    assert isinstance(eager[0], torch.nn.Linear)
    compiled = prepare_linears_for_inference(torch.nn.Sequential(torch.nn.Linear(64, 32)), compiled=True)
    t = compiled[0]
    assert isinstance(t, TransposedLinear) and _buffer_bytes(t) == (64 * 32 + 32) * 4
    x = torch.randn(3, 64)
    torch.testing.assert_close(t(x), x @ t.weight.t() + t.bias)


def test_kv_pool_follows_the_memory_budget(tiny_llama):
    path, _ = tiny_llama
    full = LLM(path, block_size=4, max_model_len=128, max_num_seqs=4)
    blocks = full.engine.scheduler.allocator.num_blocks
    per_block = 4 * 4 * 2 * 2 * 16 * 4                                 # tokens x layers x K,V x heads x dim x fp32
    assert blocks == 4 * 4 * 33           # the budget holds more: capped at 4x max_num_seqs full sequences
    small = LLM(path, block_size=4, max_model_len=128, max_num_seqs=4, kv_cache_memory="200KiB")
    assert small.engine.scheduler.allocator.num_blocks == (200 << 10) // per_block < blocks
    ref = [o.outputs[0].token_ids for o in full.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in small.generate(PROMPTS, GREEDY)] == ref   # preempts, same output
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(path, block_size=4, max_model_len=128, kv_cache_memory=1000)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_16_bit_kv_cache(tiny_llama, quantization):
    """Speculation stays lossless on a 16-bit cache, on the dense path and on the row-invariant one
    of quantized targets (whose attention kernel reads the widened keys)."""
    path, _ = tiny_llama
    kw = dict(block_size=4, max_model_len=128, max_num_seqs=4, kv_cache_dtype="bfloat16", quantization=quantization)
    llm = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    assert llm.engine.worker.runner.kv_cache.layer(0)[0].dtype == torch.bfloat16
    plain = LLM(path, speculative_config=None, **kw)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(path, kv_cache_dtype="int3")


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("1GiB") == 1 << 30
    assert parse_bytes("300MB") == 300 * 10 ** 6 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")

@pytest.mark.parametrize("kernel", [True, False])
def test_auto_kv_dtype_and_default_budget(tiny_llama, kernel, monkeypatch):
    """"auto": bf16 for quantized weights where the attention kernel reads 16-bit caches, the
    model's dtype otherwise; the default pool holds the same tokens either way (max_num_seqs x 512
    plus one full sequence)."""
    import draftwise.worker.worker as W
    from draftwise.config import EngineConfig, default_kv_tokens
    from draftwise.worker.worker import resolve_kv_cache_dtype
    monkeypatch.setattr(W, "attention_reads_16bit", lambda: kernel)
    path, _ = tiny_llama
    int4 = resolve_kv_cache_dtype(EngineConfig(model=path, quantization="int4"))
    assert int4.kv_torch_dtype == (torch.bfloat16 if kernel else torch.float32)
    assert resolve_kv_cache_dtype(EngineConfig(model=path)).kv_torch_dtype == torch.float32
    asked = EngineConfig(model=path, quantization="int4", kv_cache_dtype="float32")
    assert resolve_kv_cache_dtype(asked).kv_torch_dtype == torch.float32
    llm = LLM(path, block_size=4, max_model_len=2048, max_num_seqs=64, quantization="int4")
    per_block = 4 * 4 * 2 * 2 * 16 * (2 if kernel else 4)     # tokens x layers x K,V x heads x dim x bytes
    assert llm.engine.worker.runner.kv_cache.layer(0)[0].dtype == (torch.bfloat16 if kernel else torch.float32)
    assert per_block <= 4096
    assert llm.engine.scheduler.allocator.num_blocks == default_kv_tokens(64, 2048) // 4 == (64 * 512 + 2048) // 4


def test_default_kv_pool_is_capped_by_available_memory(tiny_llama, monkeypatch):
    import draftwise.worker.worker as W
    path, _ = tiny_llama
    quarter = 400 * 1024
    monkeypatch.setattr(W, "available_memory", lambda: 4 * quarter)
    llm = LLM(path, block_size=4, max_model_len=256, max_num_seqs=64, quantization="int4", kv_cache_dtype="bfloat16")
    kv = llm.engine.worker.runner.kv_cache
    blocks = llm.engine.scheduler.allocator.num_blocks
    pool = sum(t.numel() * t.element_size() for i in range(4) for t in kv.layer(i))
    assert blocks < (64 * 512 + 256) // 4                 # the default token count did not fit
    assert pool <= quarter and pool + pool // blocks > quarter


def test_a_pool_sized_for_more_sequences_than_the_batch_keeps_the_memory_cap(tiny_llama, monkeypatch):
    """kv_pool_seqs sizes the default pool for a server's batch while one sequence runs; the
    quarter-of-memory cap still holds, and an explicit kv_cache_memory still wins."""
    import draftwise.worker.worker as W
    from draftwise.config import default_kv_tokens
    path, _ = tiny_llama
    small = LLM(path, block_size=4, max_model_len=256, max_num_seqs=1, quantization="int4", kv_pool_seqs=16)
    assert small.engine.scheduler.allocator.num_blocks == default_kv_tokens(16, 256) // 4
    quarter = 400 * 1024
    monkeypatch.setattr(W, "available_memory", lambda: 4 * quarter)
    capped = LLM(path, block_size=4, max_model_len=256, max_num_seqs=1, quantization="int4",
                 kv_cache_dtype="bfloat16", kv_pool_seqs=64)
    blocks = capped.engine.scheduler.allocator.num_blocks
    assert blocks < default_kv_tokens(64, 256) // 4
    kv = capped.engine.worker.runner.kv_cache
    assert sum(t.numel() * t.element_size() for i in range(4) for t in kv.layer(i)) <= quarter
    given = LLM(path, block_size=4, max_model_len=256, max_num_seqs=1, quantization="int4",
                kv_cache_dtype="bfloat16", kv_pool_seqs=64, kv_cache_memory=quarter // 2)
    assert given.engine.scheduler.allocator.num_blocks < blocks
    with pytest.raises(ValueError, match="kv_pool_seqs"):
        LLM(path, kv_pool_seqs=0)
