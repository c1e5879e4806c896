"""Compiled graphs (worker/compiled_graphs.py): bucketing helpers, and compiled greedy output ==
eager greedy output on a tiny model, with speculation, without compiling while serving."""

import pytest

from draftwise import LLM, SamplingParams
from draftwise.worker.compiled_graphs import DYNAMIC_PAD, bucket_for

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 9, 11, 3, 7], [21, 4], list(range(30, 70)), [8] * 13]


def test_bucket_for_pads_to_static_sizes_then_dynamic_multiples():
    sizes = (1, 2, 4, 8)
    assert bucket_for(1, sizes) == (1, True)
    assert bucket_for(3, sizes) == (4, True)
    assert bucket_for(8, sizes) == (8, True)
    assert bucket_for(9, sizes) == (DYNAMIC_PAD, False)
    assert bucket_for(DYNAMIC_PAD + 1, sizes) == (2 * DYNAMIC_PAD, False)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_compiled_greedy_equals_eager(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    path, _ = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    eager = LLM(path, block_size=4, max_model_len=128, max_num_seqs=4, enforce_eager=True)
    ref = _ids(eager.generate(prompts, GREEDY))
    # one static size (decode steps of 1-4 rows padded to it; the buckets are tested above) and the
    # dynamic graph of the prompts: each compile costs seconds
    llm = LLM(path, block_size=4, max_model_len=128, max_num_seqs=4, enforce_eager=False,
              compile_sizes=(4,))
    graphs = llm.engine.worker.runner.graphs
    assert [g.name for g in graphs] == ["target", "target lm_head"]
    assert all(g.warm for g in graphs)
    assert _ids(llm.generate(prompts, GREEDY)) == ref
    # every call went through a warmed graph: nothing compiled (or fell back) while serving
    assert all(g.fallbacks == 0 for g in graphs)
    assert all(g.calls > 0 for g in graphs)


@pytest.mark.slow          # an opt-in path's variant (~20-30 s): test_compiled_greedy_equals_eager stays
def test_compiled_eagle3_tree_and_chain_are_lossless(tiny_llama, tmp_path, monkeypatch):
    """Drafter graphs (EAGLE-3 layer and head) compiled too; chain and tree both equal eager AR."""
    from tests.helpers import load_cfg, write_eagle3_checkpoint
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    path, _ = tiny_llama
    ck = write_eagle3_checkpoint(str(tmp_path / "eagle3"), load_cfg(path), draft_vocab=128)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _ids(LLM(path, block_size=4, max_model_len=128, max_num_seqs=4,
                   enforce_eager=True).generate(prompts, GREEDY))
    for spec in ({"method": "eagle3", "model": ck, "num_speculative_tokens": 3},
                 {"method": "eagle3", "model": ck, "num_speculative_tokens": 4, "eagle_topk": 2,
                  "eagle_depth": 2}):
        llm = LLM(path, block_size=4, max_model_len=128, max_num_seqs=4, enforce_eager=False,
                  compile_sizes=(1, 4), speculative_config=spec)
        graphs = llm.engine.worker.runner.graphs
        assert [g.name for g in graphs] == ["target", "target lm_head", "eagle3 layer", "eagle3 lm_head"]
        assert _ids(llm.generate(prompts, GREEDY)) == ref
        assert all(g.fallbacks == 0 for g in graphs)
        assert all(g.calls > 0 for g in graphs)


@pytest.mark.slow          # an opt-in path's variant (~20-30 s): test_compiled_greedy_equals_eager stays
def test_compiled_quantized_target_equals_eager(tiny_llama, tmp_path, monkeypatch):
    """The int4 / int8 kernels run inside compiled graphs (no graph break, no fallback) and give the
    eager quantized model's greedy output."""
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    path, _ = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _ids(LLM(path, block_size=4, max_model_len=128, max_num_seqs=4, enforce_eager=True,
                   quantization="int4").generate(prompts, GREEDY))
    llm = LLM(path, block_size=4, max_model_len=128, max_num_seqs=4, enforce_eager=False,
              compile_sizes=(1, 4), quantization="int4")
    graphs = llm.engine.worker.runner.graphs
    assert _ids(llm.generate(prompts, GREEDY)) == ref
    assert all(g.fallbacks == 0 for g in graphs) and all(g.calls > 0 for g in graphs)
