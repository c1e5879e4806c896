"""Weight-only quantization: quantized linears equal their dequantized reference, GGUF Q4_1 blocks
load exactly, speculation on a quantized target is lossless, bad modes are rejected."""
import numpy as np
import pytest
import torch

from tests.helpers import load_cfg, write_eagle3_checkpoint
from draftwise import LLM, SamplingParams
from draftwise.layers.quant import (Int4Linear, Int8Linear, quantize_int4_groupwise,
                                    quantize_int8_per_channel)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3] * 20, list(range(30, 70)), [7, 7, 7]]


@pytest.mark.parametrize("rows", [1, 4, 32, 37])
def test_quantized_linears_equal_dequantized_reference(rows):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    b = torch.randn(96) * 0.1
    x = torch.randn(rows, 128)
    q, s = quantize_int8_per_channel(w)
    lin8 = Int8Linear(q, s, b)
    ref8 = x @ (q.float() * s.to(torch.bfloat16).float()[:, None]).t() + b
    # the kernel path rounds activations and outputs to bf16: relative error ~ 2^-8
    torch.testing.assert_close(lin8(x), ref8, atol=2e-2, rtol=2e-2)
    # half a quantization step, plus the bf16 rounding of the scale (up to 127 x 2^-8 of a step)
    assert bool(((lin8.weight - w).abs() <= s[:, None] * 1.01).all())
    codes, scale, mn = quantize_int4_groupwise(w, 32)
    lin4 = Int4Linear(codes, scale, mn, 32, b)
    deq = lin4.weight
    torch.testing.assert_close(lin4(x), x @ deq.t() + b, atol=2e-2, rtol=2e-2)
    assert (deq - w).abs().max() <= scale.max() * 0.6           # half a step, plus bf16 scale/zero
    # 3-D inputs keep their shape
    assert lin4(x[None]).shape == (1, rows, 96)


def test_embedding_rows_equal_the_dense_table():
    """A GGUF's token embedding stays in its own blocks: a lookup must give exactly the rows of the
    fp32 table converted from them (gguf's own dequantization), at a fraction of its memory."""
    from gguf.quants import GGMLQuantizationType, dequantize, quantize
    from draftwise.formats import decode
    from draftwise.layers.quant import GroupAffineEmbedding
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((50, 96)) * 0.05).astype(np.float32)
    for kind in ("Q8_0", "Q4_0", "Q5_1"):
        raw = quantize(w, GGMLQuantizationType[kind])
        table = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(50, 96).astype(np.float32))
        emb = GroupAffineEmbedding(decode(kind, np.asarray(raw), (50, 96)))
        ids = torch.tensor([[0, 7, 49], [3, 3, 12]])
        assert torch.equal(emb(ids), table[ids]) and torch.equal(emb.dequantize(), table)
        assert emb.codes.numel() * emb.codes.element_size() + emb.scale.numel() * 4 < table.numel() * 4 / 2
    # K-quants and 5-bit codes from random blocks: the rows are gguf's, the codes packed
    from tests.formats.test_blocks import random_blocks
    for kind in ("Q4_K", "Q5_K", "Q6_K", "Q5_0"):
        fmt_k = 256 if kind.endswith("_K") else 32
        raw = random_blocks(kind, 20 * 512 // fmt_k)
        ga = decode(kind, raw, (20, 512))
        emb = GroupAffineEmbedding(ga)
        ids = torch.tensor([[19, 0, 7], [3, 3, 12]])
        assert torch.equal(emb(ids), ga.dequantize()[ids]), kind
        if kind in ("Q4_K", "Q5_K", "Q5_0"):
            assert emb.codes.numel() == 20 * 256


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_speculation_on_a_quantized_target_is_lossless(tiny_llama, tmp_path, mode):
    path, _ = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(path, block_size=4, max_model_len=256, quantization=mode)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]
    fp32 = [o.outputs[0].token_ids for o in LLM(path, block_size=4, max_model_len=256).generate(prompts, GREEDY)]
    assert any(isinstance(m, (Int4Linear, Int8Linear)) for m in plain.engine.worker.model.modules())
    assert ref != [[]] * len(prompts) and len(ref) == len(fp32)
    ck = write_eagle3_checkpoint(str(tmp_path / "eagle"), load_cfg(path), seed=1)
    for spec in ({"method": "eagle3", "model": ck, "num_speculative_tokens": 3},
                 # trees: every node attends alone over the context and its ancestors
                 {"method": "eagle3", "model": ck, "num_speculative_tokens": 6, "eagle_topk": 2, "eagle_depth": 3},
                 {"method": "suffix", "draft_tree": True},
                 {"method": "ngram", "num_speculative_tokens": 3}):
        llm = LLM(path, block_size=4, max_model_len=256, quantization=mode, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
        assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0


def test_bad_quantization_is_a_value_error(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="quantization"):
        LLM(path, quantization="fp8")
