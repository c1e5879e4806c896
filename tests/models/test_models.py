"""Target models against the Hugging Face reference (tiny random Llama / Qwen3)."""
import pytest
import torch

from tests.helpers import hf_greedy, make_tiny_hf
from draftwise import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3] * 20, list(range(30, 70)), [7], list(range(100, 137))]


def _check_against_hf(path, hf_model, block_size=4, max_new=24):
    llm = LLM(path, block_size=block_size, max_model_len=256, max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, max_new), p
        assert o.prompt_token_ids == p
        assert o.outputs[0].finish_reason == "length"


def test_llama_greedy_matches_transformers(tiny_llama):
    path, hf = tiny_llama
    _check_against_hf(path, hf)


def test_qwen3_greedy_matches_transformers(tiny_qwen3):
    path, hf = tiny_qwen3
    _check_against_hf(path, hf, block_size=8)


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    hf = make_tiny_hf(str(tmp_path), "llama", seed=3, rope_scaling=scaling, tie=True)
    _check_against_hf(str(tmp_path), hf)


def test_aux_hidden_states_are_pre_layer_residuals(tiny_llama):
    path, hf = tiny_llama
    llm = LLM(path, block_size=4, max_model_len=128)
    model = llm.engine.worker.model
    model.set_aux_hidden_state_layers((0, 2, 3))
    ids = torch.tensor([5, 6, 7, 8, 9])
    from draftwise.worker.kv_cache import KVCache
    from draftwise.layers.attention import AttentionMetadata
    cfg = llm.engine.worker.model_cfg
    cache = KVCache(4, 4, [(cfg.num_key_value_heads, cfg.head_dim)] * cfg.num_hidden_layers, torch.float32, "cpu")
    meta = AttentionMetadata(torch.arange(5), [5], [5], torch.arange(4)[None], 4).finalize()
    with torch.no_grad():
        out = model(ids, torch.arange(5), meta, cache, logits_indices=torch.tensor([2, 4]))
        ref = hf(ids[None], output_hidden_states=True)
    H = cfg.hidden_size
    assert out.aux_hidden_states.shape == (5, 3 * H)
    for j, layer in enumerate((0, 2, 3)):   # HF hidden_states[i] is the input of layer i
        torch.testing.assert_close(out.aux_hidden_states[:, j * H:(j + 1) * H], ref.hidden_states[layer][0],
                                   atol=1e-4, rtol=1e-4)
    assert out.logits.shape == (2, cfg.vocab_size)
    torch.testing.assert_close(out.logits, ref.logits[0, [2, 4]], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="outside"):
        model.set_aux_hidden_state_layers((0, 99))
