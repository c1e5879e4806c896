"""GGUF files in every block family run on their own blocks: the engine reads each tensor with its
family's reader (no requantization) and runs them fused on every ISA path this CPU has; greedy
tokens follow the dequantized model. (That the tokens do not depend on batching, chunking or the
prefix cache, for these mixes on every ISA path: tests/engine/test_determinism.py.)"""
import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.layers.quant import GroupAffineEmbedding, GroupAffineLinear, Int4Linear
from tests.models.gguf_builder import write_tiny_llama_gguf

MIXES = {
    # llama.cpp's Q4_K_M recipe: Q4_K with Q6_K for v and down, a Q6_K embedding (tied head)
    "q4_k_m": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
               "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"},
    "legacy": {"attn_q": "Q4_0", "attn_k": "Q5_0", "attn_v": "Q5_1", "attn_output": "Q8_0", "ffn_gate": "Q4_1",
               "ffn_up": "IQ4_NL", "ffn_down": "Q8_0", "token_embd": "Q8_0", "output": "Q5_0"},
    "low_bits": {"attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "Q5_K", "attn_output": "IQ4_XS", "ffn_gate": "Q3_K",
                 "ffn_up": "Q2_K", "ffn_down": "Q5_K", "token_embd": "Q4_K"},
    # a Qwen2 file (q/k/v biases) as Qwen2.5-Coder-0.5B mixes its types
    "qwen2": {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0",
              "ffn_up": "Q5_0", "ffn_down": "Q8_0", "token_embd": "Q8_0"},
}


@pytest.fixture(scope="module", params=sorted(MIXES))
def gguf_file(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf")
    arch = "qwen2" if request.param == "qwen2" else "llama"
    return write_tiny_llama_gguf(path, MIXES[request.param], seed=len(request.param), arch=arch)


def _tokens(llm, prompts, n=12):
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


def test_every_family_runs_on_its_own_blocks(gguf_file, kernel_isa):
    llm = LLM(model=gguf_file, max_model_len=256, max_num_batched_tokens=64)
    eng = llm.engine
    assert eng.config.quantization == "gguf"
    mods = list(eng.worker.model.modules())
    assert isinstance(eng.worker.model.embed_tokens, GroupAffineEmbedding)
    lins = [m for m in mods if isinstance(m, (GroupAffineLinear, Int4Linear))]
    assert len(lins) == 2 * 4 + 1                  # qkv, o, gate_up, down per layer, and the head
    assert not any(isinstance(m, torch.nn.Linear) for m in mods)
    # every layer runs fused on the kernels (int4 and group-affine linears, biases included)
    assert all((layer.fused is not None) == (kernel_isa != "none") for layer in eng.worker.model.layers)
    # the same tokens alone, in a batch, after prefix-cache hits and in any chunking: every mix
    # here on every ISA path, in tests/engine/test_determinism.py
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 70, 150)]
    assert [len(t) for t in _tokens(llm, prompts)] == [12] * 3


def test_tokens_follow_the_dequantized_model(gguf_file):
    """The exact blocks and the fp32 model dequantized from the same file (gguf's reference) give
    logits within bf16-activation rounding: the first greedy tokens agree."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (10, 40)]
    mine = _tokens(LLM(model=gguf_file, max_model_len=128), prompts, n=1)
    ref = _tokens(LLM(model=gguf_file, max_model_len=128, quantization=None), prompts, n=1)
    assert mine == ref


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_architectures_match_transformers_reading_the_same_file(tmp_path, arch):
    """transformers reads the same GGUF (dequantizing it with gguf, un-permuting llama's Q/K rows as
    llama.cpp's converter permuted them, taking Gemma's +1 out of its norms): draftwise's fp32 model
    gives the same logits (1e-4 relative) and greedy tokens, its exact-blocks model (int8
    activations) logits within 2e-2. Gemma 3's six layers, a window of 8 keys over 24 tokens: five
    sliding layers and one global, and the window matters."""
    import numpy as np
    layers = 6 if arch == "gemma3" else 2
    path = write_tiny_llama_gguf(str(tmp_path / f"{arch}.gguf"), {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q4_0",
                                 "attn_output": "Q8_0", "ffn_gate": "Q8_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0"},
                                 hidden=128, heads=4, kv_heads=2, inter=256, vocab=256, arch=arch, layers=layers,
                                 head_dim=48 if arch == "gemma3" else None)
    ref = _transformers_from_gguf(path)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids).logits[0, -1]
    llm = LLM(model=path, max_model_len=128, quantization=None)
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    out = llm.generate([{"prompt_token_ids": ids[0].tolist()}], sp)[0].outputs[0]
    ref_lp = torch.log_softmax(want.double(), -1)
    top = out.logprobs[0].top_logprobs
    assert len(top) == 5
    for tok, lp in top:
        np.testing.assert_allclose(lp, float(ref_lp[tok]), rtol=1e-4, atol=1e-4)
    greedy = _tokens(llm, [ids[0].tolist()], n=4)[0]
    hf, seq = [], ids
    with torch.no_grad():
        for _ in range(4):
            nxt = int(ref(seq).logits[0, -1].argmax())
            hf.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], 1)
    assert greedy == hf
    # the exact blocks with bf16 activations: the same distribution up to bf16 rounding
    blocks = LLM(model=path, max_model_len=128).generate([{"prompt_token_ids": ids[0].tolist()}], sp)[0].outputs[0]
    for tok, lp in blocks.logprobs[0].top_logprobs:
        np.testing.assert_allclose(lp, float(ref_lp[tok]), rtol=2e-2, atol=2e-2)


def _transformers_from_gguf(path: str):
    """transformers' own GGUF reading (what from_pretrained(gguf_file=...) does, without needing
    accelerate): its config and its dequantized, un-permuted tensors."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    cfg = dict(load_gguf_checkpoint(path)["config"])
    if cfg["model_type"].startswith("gemma3"):
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]       # llama.cpp's scale for Gemma 3 files
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ckpt = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    sd = {k: torch.as_tensor(v) for k, v in ckpt["tensors"].items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m or "rotary" in m for m in missing), (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_equals_plain_decoding_under_load(tmp_path, method):
    """Greedy speculation on exact non-Q4 blocks at max_num_seqs 16: every request's tokens equal
    plain decoding's (the verification rows run the same kernels as decode rows)."""
    path = write_tiny_llama_gguf(str(tmp_path / "m.gguf"), MIXES["q4_k_m"], seed=7)
    g = torch.Generator().manual_seed(5)
    # repetitive prompts, so the drafters find matches and verify several tokens a step
    prompts = [(torch.randint(0, 512, (int(n),), generator=g).tolist() * 4)[:60]
               for n in torch.randint(5, 15, (16,), generator=g)]
    plain = _tokens(LLM(model=path, max_model_len=256, max_num_seqs=16, speculative_config=None), prompts, n=24)
    spec = LLM(model=path, max_model_len=256, max_num_seqs=16,
               speculative_config={"method": method, "num_speculative_tokens": 4})
    assert _tokens(spec, prompts, n=24) == plain
    assert spec.get_metrics()["spec_decode"]["num_drafts"] > 0


def test_gemma3_windows_stay_exact_under_speculation_chunking_and_prefix_hits(tmp_path):
    """Gemma 3's sliding layers (a window of 8 keys here) read only their window while the cache
    keeps every key: n-gram speculation (draft rows rolled back), prompts chunked by 16 tokens,
    prefix-cache hits and batches of 16 all give plain decoding's tokens."""
    path = write_tiny_llama_gguf(str(tmp_path / "g.gguf"), MIXES["q4_k_m"], arch="gemma3", layers=6, hidden=256,
                                 heads=4, kv_heads=2, inter=512, vocab=512, head_dim=64, seed=3)
    g = torch.Generator().manual_seed(9)
    prompts = [(torch.randint(0, 512, (int(n),), generator=g).tolist() * 5)[:50]
               for n in torch.randint(4, 10, (16,), generator=g)]
    alone = [_tokens(LLM(model=path, max_model_len=256, speculative_config=None), [p], n=20)[0] for p in prompts[:3]]
    plain = _tokens(LLM(model=path, max_model_len=256, max_num_seqs=16, speculative_config=None), prompts, n=20)
    assert plain[:3] == alone
    chunked = LLM(model=path, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=16,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert _tokens(chunked, prompts, n=20) == plain
    assert _tokens(chunked, prompts, n=20) == plain            # again: every prompt a prefix-cache hit
    assert chunked.get_metrics()["spec_decode"]["num_drafts"] > 0


def test_int4_on_a_gguf_keeps_its_q4_blocks_and_quantizes_the_rest(tmp_path):
    """quantization="int4" on a GGUF file: Q4_1 / Q4_0 layers keep the file's blocks (exact), other
    types are quantized from their weights; greedy decoding runs and is the same in a batch."""
    types = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0", "ffn_gate": "Q4_1",
             "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0"}
    path = write_tiny_llama_gguf(str(tmp_path / "m.gguf"), types, seed=2)
    llm = LLM(model=path, quantization="int4", max_model_len=256, speculative_config=None)
    assert llm.engine.config.quantization == "int4"
    assert all(isinstance(layer.self_attn.qkv_proj, Int4Linear) for layer in llm.engine.worker.model.layers)
    prompts = [[5, 9, 2, 7] * 5, list(range(3, 40))]
    alone = [_tokens(llm, [p])[0] for p in prompts]
    assert _tokens(llm, prompts) == alone


def test_a_kernel_that_cannot_be_built_means_pytorch_and_every_request_succeeds(tmp_path, monkeypatch, caplog):
    """After a warm start (kernels built, step costs cached), an engine whose kernels cannot be
    built (a compiler removed, a build that now fails) or that DRAFTWISE_ISA=none turns off runs
    PyTorch's kernels with one warning, and every request of the default configuration succeeds."""
    import logging

    from draftwise import kernels
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"), MIXES["q4_k_m"], seed=3)
    prompts = [[5, 6, 7, 8] * 5, list(range(40, 100)), [9] * 30]
    kernels.reset()
    warm = LLM(model=path, max_model_len=256)
    assert len(_tokens(warm, prompts)) == 3
    del warm

    def no_compiler(source):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")
    for how in ("build fails", "DRAFTWISE_ISA=none"):
        kernels.reset()
        if how == "build fails":
            monkeypatch.setattr(kernels, "_build", no_compiler)
        else:
            monkeypatch.setenv("DRAFTWISE_ISA", "none")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="draftwise"):
            llm = LLM(model=path, max_model_len=256)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3, how
        assert all(len(o.outputs[0].token_ids) == 12 for o in outs), how
        warnings = [r.getMessage() for r in caplog.records if "CPU kernels: using PyTorch's" in r.getMessage()]
        assert len(warnings) == 1, (how, warnings)
        assert ("could not be built" in warnings[0]) == (how == "build fails")
    kernels.reset()
