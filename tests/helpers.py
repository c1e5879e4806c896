"""Test helpers: tiny random Hugging Face models (the reference implementation), published-format
draft checkpoints with random weights, the repository root."""
import json
import os
import socket
import threading
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_eagle3_checkpoint(path, target_cfg: dict, draft_vocab=None, fmt="safetensors", seed=0,
                            aux_ids=None, dtype=torch.float16, scale=0.05, with_embedding=False):
    """An EAGLE-3 head in the exact published layout (SafeAILab/EAGLE, SpecForge)."""
    g = torch.Generator().manual_seed(seed)
    H = target_cfg["hidden_size"]
    V = target_cfg["vocab_size"]
    heads = target_cfg["num_attention_heads"]
    kv = target_cfg.get("num_key_value_heads", heads)
    hd = target_cfg.get("head_dim", H // heads)
    I = target_cfg["intermediate_size"]
    dv = draft_vocab or V
    r = lambda *s: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    t = {
        "fc.weight": r(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": r(heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, heads * hd),
        "midlayer.mlp.gate_proj.weight": r(I, H),
        "midlayer.mlp.up_proj.weight": r(I, H),
        "midlayer.mlp.down_proj.weight": r(H, I),
        "midlayer.hidden_norm.weight": torch.ones(H, dtype=dtype),
        "midlayer.input_layernorm.weight": torch.ones(H, dtype=dtype),
        "midlayer.post_attention_layernorm.weight": torch.ones(H, dtype=dtype),
        "norm.weight": torch.ones(H, dtype=dtype),
        "lm_head.weight": r(dv, H) * 20,
    }
    used = torch.sort(torch.randperm(V, generator=g)[:dv]).values if dv < V else torch.arange(V)
    t["d2t"] = (used - torch.arange(dv)).long()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    t["t2d"] = t2d
    if with_embedding:
        t["embed_tokens.weight"] = r(V, H)
    os.makedirs(path, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(t, os.path.join(path, "model.safetensors"))
    else:
        torch.save(t, os.path.join(path, "pytorch_model.bin"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": I, "num_hidden_layers": 1, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "rms_norm_eps": 1e-6, "vocab_size": V,
           "draft_vocab_size": dv, "target_hidden_size": H, "max_position_embeddings": 2048,
           "torch_dtype": "float16"}
    if aux_ids is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def load_cfg(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def write_dflash_checkpoint(path, target_cfg: dict, block_size=4, num_layers=2, target_layer_ids=(0, 2),
                            mask_token_id=None, fmt="safetensors", seed=0, dtype=torch.bfloat16,
                            scale=0.05, prefix="", ids_location="dflash_config", num_target_layers=None,
                            rope_theta=1000000.0):
    """A DFlash drafter in the exact published z-lab layout (random weights): config.json with
    architectures ["DFlashDraftModel"], model_type qwen3, block_size, dflash_config {mask_token_id,
    target_layer_ids} (or the ids at the top level: ids_location="top"), and unfused tensors
    fc / hidden_norm / norm / layers.{i}.self_attn.{q,k,v,o}_proj, {q,k}_norm, mlp.{gate,up,down}_proj,
    input/post_attention_layernorm. No embedding, no LM head."""
    g = torch.Generator().manual_seed(seed)
    H = target_cfg["hidden_size"]
    V = target_cfg["vocab_size"]
    heads = target_cfg["num_attention_heads"]
    kv = target_cfg.get("num_key_value_heads", heads)
    hd = target_cfg.get("head_dim", H // heads)
    I = target_cfg["intermediate_size"]
    ids = list(target_layer_ids)
    mask = V - 1 if mask_token_id is None else mask_token_id
    r = lambda *s: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    n = lambda *s: (1 + 0.1 * torch.randn(*s, generator=g)).to(dtype)  # noqa: E731
    t = {"fc.weight": r(H, len(ids) * H), "hidden_norm.weight": n(H), "norm.weight": n(H)}
    for i in range(num_layers):
        p = f"layers.{i}."
        t.update({
            p + "self_attn.q_proj.weight": r(heads * hd, H), p + "self_attn.k_proj.weight": r(kv * hd, H),
            p + "self_attn.v_proj.weight": r(kv * hd, H), p + "self_attn.o_proj.weight": r(H, heads * hd),
            p + "self_attn.q_norm.weight": n(hd), p + "self_attn.k_norm.weight": n(hd),
            p + "mlp.gate_proj.weight": r(I, H), p + "mlp.up_proj.weight": r(I, H),
            p + "mlp.down_proj.weight": r(H, I),
            p + "input_layernorm.weight": n(H), p + "post_attention_layernorm.weight": n(H),
        })
    t = {prefix + k: v.contiguous() for k, v in t.items()}
    os.makedirs(path, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(t, os.path.join(path, "pytorch_model.bin"))
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
           "hidden_size": H, "intermediate_size": I, "num_hidden_layers": num_layers,
           "num_target_layers": num_target_layers or target_cfg["num_hidden_layers"],
           "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "max_position_embeddings": 2048,
           "vocab_size": V, "attention_bias": False, "tie_word_embeddings": False,
           "torch_dtype": str(dtype).replace("torch.", "")}
    if ids_location == "top":
        cfg["target_layer_ids"] = ids
        cfg["dflash_config"] = {"mask_token_id": mask}
    else:
        cfg["dflash_config"] = {"mask_token_id": mask, "target_layer_ids": ids}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


class TargetFeaturizer:
    """Runs a target over one sequence (one prefill through a scratch paged cache) and returns
    (aux states [L, k*H], logits [L, V]): the reference for recorded / trained features."""

    def __init__(self, target, max_len: int, block_size: int = 64):
        import math
        from draftwise.worker.kv_cache import KVCache
        self.target = target
        cfg = target.config
        self.block_size = block_size
        nblocks = math.ceil(max_len / block_size)
        specs = [(cfg.num_key_value_heads, cfg.head_dim)] * cfg.num_hidden_layers
        w = target.embed_tokens.weight
        self.cache = KVCache(nblocks, block_size, specs, w.dtype, w.device)
        self.block_table = torch.arange(nblocks, device=w.device)[None, :]

    @torch.no_grad()
    def __call__(self, ids: list[int], rows: torch.Tensor | None = None):
        from draftwise.layers.attention import CAUSAL, AttentionMetadata
        dev = self.block_table.device
        L = len(ids)
        pos = torch.arange(L, device=dev)
        meta = AttentionMetadata(pos.clone(), [L], [L], self.block_table, self.block_size, CAUSAL).finalize()
        out = self.target(torch.tensor(ids, device=dev), pos, meta, self.cache,
                          logits_indices=pos if rows is None else rows.to(dev))
        return out.aux_hidden_states.clone(), out.logits.clone()


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


def hf_greedy(model, prompt_ids, max_new):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


class ServerThread:
    """uvicorn serving `app` from a background thread on a free 127.0.0.1 port."""

    def __init__(self, app):
        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()

    def __exit__(self, *exc):
        if self.thread.is_alive():
            self.stop()


def tiny_target_with_drafters(tmp_path_factory, name: str, target_seed: int, drafter_seed: int):
    """(target dir with a tokenizer, EAGLE-3 head dir, DFlash drafter dir): a tiny random target and
    published-format drafters for it."""
    from tests.tokenizer_util import add_tiny_tokenizer
    path = str(tmp_path_factory.mktemp(name))
    make_tiny_hf(path, "llama", seed=target_seed)
    add_tiny_tokenizer(path)
    cfg = load_cfg(path)
    head = write_eagle3_checkpoint(str(tmp_path_factory.mktemp(name + "_head")), cfg, seed=drafter_seed)
    dflash = write_dflash_checkpoint(str(tmp_path_factory.mktemp(name + "_dflash")), cfg, block_size=4,
                                     target_layer_ids=(0, 2), seed=drafter_seed)
    return path, head, dflash


def drafter_specs(head: str, dflash: str) -> dict:
    """A speculative config per drafter family, for greedy-equality tests over every drafter."""
    return {"suffix": {"method": "suffix"},
            "suffix-tree": {"method": "suffix", "draft_tree": True, "num_speculative_tokens": 8},
            "ngram": {"method": "ngram", "num_speculative_tokens": 3},
            "eagle3": {"method": "eagle3", "model": head, "num_speculative_tokens": 3},
            "eagle3-tree": {"method": "eagle3", "model": head, "num_speculative_tokens": 5, "eagle_topk": 2,
                            "eagle_depth": 3},
            "dflash": {"method": "dflash", "model": dflash},
            "hybrid": {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "hybrid": "suffix"}}

