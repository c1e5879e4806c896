"""EAGLE-3 trainer: data pipeline, draft vocabulary, TTT == inference, end-to-end train/resume/export."""
import json
import os
from collections import Counter

import torch

from conftest import make_tiny_hf
from helpers import load_cfg
from draftwise import LLM, SamplingParams
from draftwise.training.data import iter_sharegpt, render, to_messages
from draftwise.training.vocab import build_draft_vocab

TEXT = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
        "Speculative decoding drafts several tokens.", "Hello world! How are you today?"]


def _sharegpt(path, n=16):
    recs = [{"id": f"r{i}", "conversations": [
        {"from": "human", "value": TEXT[i % 4]},
        {"from": "gpt", "value": " ".join(TEXT[(i + j) % 4] for j in range(3))},
        {"from": "human", "value": "more"}, {"from": "gpt", "value": TEXT[(i + 1) % 4]}]} for i in range(n)]
    with open(path, "w") as f:
        json.dump(recs, f, indent=1)
    return recs


def test_sharegpt_reader_survives_truncation(tmp_path):
    p = str(tmp_path / "d.json")
    _sharegpt(p, 5)
    text = open(p).read()
    with open(p, "w") as f:
        f.write(text[: len(text) - 60])     # cut inside the last record
    recs = list(iter_sharegpt(p))
    assert len(recs) == 4 and recs[0]["id"] == "r0"


def test_render_masks_only_assistant_tokens(tmp_path):
    from tests.tokenizer_util import add_tiny_tokenizer
    d = str(tmp_path / "m")
    make_tiny_hf(d)
    tok = add_tiny_tokenizer(d)
    msgs = to_messages({"conversations": [{"from": "human", "value": "hello there"},
                                          {"from": "gpt", "value": "Paris is the capital"}]})
    ex = render(tok, msgs, 512)
    masked = tok.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    assert "Paris is the capital" in masked and "hello" not in masked


def test_draft_vocab_d2t_t2d():
    c = Counter({5: 10, 9: 7, 2: 5, 30: 1})
    d2t, t2d, cov = build_draft_vocab(c, 40, 3)
    used = torch.arange(3) + d2t
    assert used.tolist() == [2, 5, 9]
    assert t2d.sum() == 3 and t2d[[2, 5, 9]].all()
    assert abs(cov - 22 / 23) < 1e-9


def test_ttt_unroll_matches_inference_recurrence(tiny_llama):
    from draftwise.engine.kv_cache import KVCache
    from draftwise.layers.attention import AttentionMetadata
    from draftwise.models.loader import load_target_model
    from draftwise.training.eagle3 import TargetFeaturizer, _attn_ttt, build_draft
    path, _ = tiny_llama
    target, cfg, _ = load_target_model(path, torch.float32, "cpu")
    target.set_aux_hidden_state_layers(target.get_eagle3_aux_hidden_state_layers())
    V = cfg.vocab_size
    m = build_draft(target, torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool), 600)
    torch.manual_seed(0)
    for p in m.parameters():
        if p.dim() == 2:
            p.data.normal_(0, 0.1)
    L = 12
    ids = torch.randint(0, V, (L,))
    aux, _ = TargetFeaturizer(target, 64)(ids.tolist())
    layer, attn = m.midlayer, m.midlayer.self_attn
    h0 = m.combine_hidden_states(aux)
    hs, k0, v0, dk, dv, h = [], None, None, [], [], h0
    for i in range(3):
        n = L - 2 - i
        t = torch.arange(n)
        x = torch.cat([layer.input_layernorm(m.embed_tokens(ids[t + i + 1])), layer.hidden_norm(h[:n])], -1)
        a, k, v = _attn_ttt(attn, x, t + i, m.rotary, k0, v0, None if i == 0 else dk, None if i == 0 else dv, t)
        if i == 0:
            k0, v0 = k, v
        else:
            dk.append(k)
            dv.append(v)
        hm = h[:n] + a
        h = hm + layer.mlp(layer.post_attention_layernorm(hm))
        hs.append(h)
    with torch.no_grad():
        m.set_layer_idx(0)
        cache = KVCache(4, 16, [(cfg.num_key_value_heads, cfg.head_dim)], torch.float32, "cpu")
        bt = torch.arange(4)[None]
        p = 5
        meta = AttentionMetadata(torch.arange(p + 1), [p + 1], [p + 1], bt, 16).finalize()
        out = m(ids[1:p + 2], torch.arange(p + 1), h0[:p + 1], meta, cache)
        torch.testing.assert_close(out[p], hs[0][p], atol=1e-5, rtol=1e-5)
        cur = out[p:p + 1]
        for i in (1, 2):
            pos = torch.tensor([p + i])
            meta = AttentionMetadata(pos, [1], [p + i + 1], bt, 16).finalize()
            cur = m(ids[p + i + 1:p + i + 2], pos, cur, meta, cache)
            torch.testing.assert_close(cur[0], hs[i][p], atol=1e-5, rtol=1e-5)


def test_train_eagle3_end_to_end(tmp_path):
    from tests.tokenizer_util import add_tiny_tokenizer
    from draftwise.training.eagle3 import TrainConfig, train_eagle3
    tdir = str(tmp_path / "target")
    make_tiny_hf(tdir, "llama", seed=4)
    add_tiny_tokenizer(tdir)
    data = str(tmp_path / "sharegpt.json")
    _sharegpt(data)
    out = str(tmp_path / "run")
    cfg = TrainConfig(target=tdir, out=out, data=data, max_len=96, ttt_steps=3, draft_vocab_size=64,
                      vocab_examples=16, lr=3e-3, warmup_steps=1, total_steps=3, tokens_per_step=150,
                      save_every=2, eval_every=3, eval_examples=2, threads=1)
    export = train_eagle3(cfg, progress=False)
    log = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))]
    assert [r["step"] for r in log] == [1, 2, 3] and len(log[-1]["heldout_acc"]) == 3
    cfg.total_steps = 5
    train_eagle3(cfg, progress=False)                         # resume
    assert torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)["step"] == 5
    c = load_cfg(export)
    assert c["draft_vocab_size"] == 64 and c["architectures"] == ["LlamaForCausalLMEagle3"]
    from safetensors import safe_open
    with safe_open(os.path.join(export, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
        assert f.get_tensor("fc.weight").dtype == torch.float16
    assert "midlayer.self_attn.q_proj.weight" in keys and "embed_tokens.weight" not in keys
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], [30, 31, 32, 33, 34], [9] * 7)]
    ref = [o.outputs[0].token_ids for o in LLM(tdir, block_size=4, max_model_len=128).generate(prompts, sp)]
    llm = LLM(tdir, block_size=4, max_model_len=128,
              speculative_config={"method": "eagle3", "model": export, "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
