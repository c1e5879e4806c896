import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# tests run eager (no compile warmup) unless a test asks for compiled graphs
os.environ.setdefault("DRAFTWISE_ENFORCE_EAGER", "1")


def make_tiny_hf(path, arch="llama", vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, seed=0,
                 rope_scaling=None, tie=False):
    """A tiny random Hugging Face model saved to `path` (the reference implementation)."""
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        extra = {"rope_scaling": rope_scaling} if rope_scaling else {}
        cfg = transformers.LlamaConfig(head_dim=hidden // heads, rope_theta=10000.0, **extra, **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(head_dim=hidden // heads, rope_theta=10000.0, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    # random init has tiny std: widen it so logits are not near-ties
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    model = make_tiny_hf(path, "llama")
    return path, model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_qwen3"))
    model = make_tiny_hf(path, "qwen3", seed=1)
    return path, model


def hf_greedy(model, prompt_ids, max_new):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()
