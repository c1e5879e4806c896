"""EAGLE-3 trainer: data pipeline, draft vocabulary, TTT == inference, end-to-end train/resume/export."""
import json
import os
from collections import Counter

import torch

from tests.helpers import make_tiny_hf
from tests.helpers import load_cfg
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


def test_a_missing_sharegpt_file_is_a_clear_error(tmp_path):
    import pytest
    with pytest.raises(ValueError, match="is not a file"):
        next(iter_sharegpt(str(tmp_path / "missing.json")))


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
    from draftwise.worker.kv_cache import KVCache
    from draftwise.layers.attention import AttentionMetadata
    from draftwise.models.loader import load_target_model
    from tests.helpers import TargetFeaturizer
    from draftwise.training.eagle3 import _attn_ttt, build_draft
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


def _tiny_target_with_tokenizer(path, seed=4):
    from tests.tokenizer_util import add_tiny_tokenizer
    make_tiny_hf(path, "llama", seed=seed)
    add_tiny_tokenizer(path)
    return path


def _prompts_jsonl(path, n, offset=0):
    """Prompts sharing a long common prefix (several KV blocks: prefix caching must not skip rows)."""
    shared = " ".join(TEXT) + " " + " ".join(TEXT)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": shared + TEXT[(i + offset) % 4] + " " + TEXT[(i + offset + 1) % 4][: 5 + i]})
                    + "\n")
    return path


def _gen(tdir, prompts, out, **kw):
    from draftwise.training.gen_data import GenDataConfig, generate_data
    cfg = dict(out=out, target=tdir, data=prompts, max_prompt_tokens=400, max_tokens=24, batch_size=4,
               shard_sequences=5, threads=1)
    cfg.update(kw)
    return generate_data(GenDataConfig(**cfg), progress=False)


def test_shard_round_trip_and_column_selection(tmp_path):
    import pytest
    from draftwise.training.shards import (ShardSequence, ShardStream, completed_prompts, count_shard_tokens,
                                           iter_shard_sequences, write_shard)
    H = 4
    seqs = []
    for i, L in enumerate((5, 7, 3)):
        aux = torch.arange(L * 3 * H, dtype=torch.float32).view(L, 3 * H) + 1000 * i
        seqs.append(ShardSequence(torch.arange(L) + i, torch.tensor([0] * 2 + [1] * (L - 2)), aux,
                                  torch.randn(L, H), 10 + i))
    d = str(tmp_path / "shards")
    os.makedirs(d)
    write_shard(os.path.join(d, "shard_00000.safetensors"), seqs[:2], (2, 5, 9), {"t": 1})
    write_shard(os.path.join(d, "shard_00001.safetensors"), seqs[2:], (2, 5, 9), {"t": 1})
    got = list(iter_shard_sequences(d, (2, 5, 9)))
    assert [g.prompt_index for g in got] == [10, 11, 12]
    for g, s in zip(got, seqs):
        assert torch.equal(g.input_ids, s.input_ids) and torch.equal(g.loss_mask, s.loss_mask)
        torch.testing.assert_close(g.aux.float(), s.aux.half().float())
        torch.testing.assert_close(g.final.float(), s.final.half().float())
    # a subset of layers, in another order, selects the matching columns
    sub = next(iter_shard_sequences(d, (9, 2)))
    torch.testing.assert_close(sub.aux.float(), torch.cat([seqs[0].aux[:, 2 * H:], seqs[0].aux[:, :H]], 1).half().float())
    with pytest.raises(ValueError, match="regenerate"):
        next(iter_shard_sequences(d, (3,)))
    assert completed_prompts(d) == {10, 11, 12}
    assert count_shard_tokens(d) == (3, 15, 9)
    # the stream goes round epochs and resumes at the same sequence
    st = ShardStream(d, (2,), seed=1, max_len=6)
    first = [next(st).prompt_index for _ in range(4)]
    assert sorted(first[:3]) == [10, 11, 12] and st.epoch == 1
    saved = st.state()
    a = [next(st).prompt_index for _ in range(3)]
    st2 = ShardStream(d, (2,), seed=1, max_len=6)
    st2.load_state(saved)
    assert [next(st2).prompt_index for _ in range(3)] == a
    assert all(len(next(st)) <= 6 for _ in range(3))


def test_gen_data_records_the_targets_hidden_states(tmp_path):
    from draftwise.models.loader import load_target_model
    from tests.helpers import TargetFeaturizer
    from draftwise.training.shards import iter_shard_sequences
    tdir = _tiny_target_with_tokenizer(str(tmp_path / "t"))
    prompts = _prompts_jsonl(str(tmp_path / "p.jsonl"), 7)
    out = str(tmp_path / "data")
    stats = _gen(tdir, prompts, out, num_prompts=4, greedy_fraction=1.0)
    assert stats["sequences"] == 4
    layers = (1, 2, 3)                                         # default capture set of a 4-layer target
    target, _, _ = load_target_model(tdir, torch.float32, "cpu")
    target.set_aux_hidden_state_layers(layers)
    feat = TargetFeaturizer(target, 256)
    seqs = list(iter_shard_sequences(out, layers))
    for s in seqs:
        L = len(s)
        n_resp = int(s.loss_mask.sum())
        assert n_resp == 24 or s.input_ids[-1] == 2                # max_tokens or eos
        assert s.loss_mask[:L - n_resp].sum() == 0                  # the mask covers the response only
        aux, logits = feat(s.input_ids.tolist())
        torch.testing.assert_close(s.aux[:L - 1].float(), aux[:L - 1].half().float(), atol=2e-2, rtol=1e-2)
        # greedy: the recorded final hidden state gives back every generated token
        nxt = target.lm_head(s.final[:L - 1].float()).argmax(-1)
        resp = torch.nonzero(s.loss_mask).flatten()
        assert torch.equal(nxt[resp - 1], s.input_ids[resp])
    # resume: a second run only answers the prompts not yet written
    stats = _gen(tdir, prompts, out, greedy_fraction=1.0)
    assert stats["sequences"] == 3
    assert sorted(s.prompt_index for s in iter_shard_sequences(out, layers)) == list(range(7))
    # teacher-forced: the conversations' own replies, read in one prefill; every row recorded
    conv = str(tmp_path / "sharegpt.json")
    _sharegpt(conv, 6)
    tf = str(tmp_path / "tf")
    _gen(tdir, conv, tf, teacher_forced=True)
    seqs = list(iter_shard_sequences(tf, layers))
    assert seqs
    for s in seqs:
        L = len(s)
        aux, _ = feat(s.input_ids.tolist())
        torch.testing.assert_close(s.aux.float(), aux.half().float(), atol=2e-2, rtol=1e-2)
        assert 0 < int(s.loss_mask.sum()) < L


def test_train_eagle3_end_to_end(tmp_path):
    from draftwise.training.eagle3 import TrainConfig, train_eagle3
    tdir = _tiny_target_with_tokenizer(str(tmp_path / "target"))
    data, held = str(tmp_path / "data"), str(tmp_path / "held")
    _gen(tdir, _prompts_jsonl(str(tmp_path / "p.jsonl"), 12), data)
    _gen(tdir, _prompts_jsonl(str(tmp_path / "h.jsonl"), 3, offset=2), held)
    out = str(tmp_path / "run")
    cfg = TrainConfig(target=tdir, out=out, data=data, eval_data=held, max_len=256, ttt_steps=3,
                      draft_vocab_size=64, vocab_sequences=16, lr=3e-3, warmup_steps=1, total_steps=3,
                      tokens_per_step=150, save_every=2, eval_every=3, eval_sequences=2, threads=1,
                      intermediate_size=48)          # a narrower MLP than the target's: a cheaper head
    export = train_eagle3(cfg, progress=False)
    log = [json.loads(x) for x in open(os.path.join(out, "train_log.jsonl"))]
    assert [r["step"] for r in log] == [1, 2, 3] and len(log[-1]["heldout_acc"]) == 3
    assert 1.0 <= log[-1]["heldout_simulated_acceptance"]["k3"] <= 4.0
    cfg.total_steps = 5
    train_eagle3(cfg, progress=False)                         # resume
    assert torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)["step"] == 5
    c = load_cfg(export)
    assert c["draft_vocab_size"] == 64 and c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c["intermediate_size"] == 48 != load_cfg(tdir)["intermediate_size"]
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


def test_simulated_acceptance_counts_leading_correct_drafts():
    from draftwise.training.eagle3 import simulated_acceptance
    c = torch.tensor([[1, 1, 0, -1, 1],
                      [1, 0, 1, -1, -1],
                      [0, 1, 1, -1, -1]])
    # anchors 0, 1, 2, 4 (column 3 not evaluated): leading correct 2, 1, 0, 1
    assert simulated_acceptance(c, 3) == (3 + 2 + 1 + 2, 4)
    assert simulated_acceptance(c, 1) == (2 + 2 + 1 + 2, 4)
