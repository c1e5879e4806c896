"""DFlash: published-format loader, block proposer (context KV injection + non-causal block pass),
lossless speculation through the engine, and the trainer (dense block forward == engine path)."""
import json
import logging
import os

import pytest
import torch

from draftwise import LLM, SamplingParams
from draftwise.config import ModelConfig
from draftwise.worker.kv_cache import KVCache
from draftwise.layers.attention import CAUSAL, AttentionMetadata
from draftwise.models.dflash import (dflash_capture_layers, default_target_layer_ids, load_dflash_checkpoint,
                                     save_dflash_checkpoint, spread_target_layer_ids)
from draftwise.models.loader import load_target_model
from draftwise.spec_decode.dflash import DFlashProposer
from draftwise.spec_decode.draft import Draft
from draftwise.spec_decode.proposer import ProposerInput
from draftwise.training.dflash import block_hidden_states
from tests.helpers import load_cfg, write_dflash_checkpoint

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 27)), [3] * 9, list(range(100, 131))]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _gen(llm, prompts=PROMPTS, sp=GREEDY):
    return _ids(llm.generate([{"prompt_token_ids": p} for p in prompts], sp))


def _llm(path, spec=None, **kw):
    args = dict(block_size=4, max_model_len=128, max_num_seqs=4, seed=0)
    args.update(kw)
    return LLM(path, speculative_config=spec, **args)


@pytest.fixture(scope="module")
def llama_ckpt(tiny_llama, tmp_path_factory):
    path, _ = tiny_llama
    d = str(tmp_path_factory.mktemp("dflash_llama"))
    write_dflash_checkpoint(d, load_cfg(path), block_size=4, num_layers=2, target_layer_ids=(0, 2),
                            dtype=torch.bfloat16, seed=3)
    return d


@pytest.fixture(scope="module")
def llama_ref(tiny_llama):
    path, _ = tiny_llama
    return _gen(_llm(path))


# ---------------------------------------------------------------------------------------------
# engine: lossless greedy speculation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["fused", "logits"])
def test_greedy_matches_non_speculative(tiny_llama, llama_ckpt, llama_ref, sampler):
    path, _ = tiny_llama
    llm = _llm(path, {"method": "dflash", "model": llama_ckpt, "num_speculative_tokens": 3,
                      "rejection_sampler": sampler})
    assert _gen(llm) == llama_ref
    prop = llm.engine.worker.proposer
    assert isinstance(prop, DFlashProposer)
    assert prop.aux_layers() == (1, 3)                 # ids (0, 2) are layer outputs: capture id + 1
    assert prop.num_lookahead_tokens == 4
    assert llm.engine.spec_stats.num_drafts > 0
    assert prop.num_blocks > 0 and all(v > 0 for v in prop.timings.values())


def _run_capped(llm, prompts, max_steps=400):
    """Step the engine at most max_steps times; None if it did not finish."""
    eng = llm.engine
    for p in prompts:
        eng.add_request({"prompt_token_ids": p}, GREEDY)
    reqs = list(eng.requests.values())
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return reqs
        eng.step()
    return None


def test_preemption_recomputes_injected_context(tiny_llama, llama_ckpt, llama_ref):
    path, _ = tiny_llama
    reqs = _run_capped(_llm(path, {"method": "dflash", "model": llama_ckpt}, max_model_len=64, num_kv_blocks=20),
                       PROMPTS + PROMPTS[::-1])
    assert reqs is not None
    assert sum(r.num_preemptions for r in reqs) > 0
    assert [r.output_token_ids for r in reqs] == llama_ref + llama_ref[::-1]


def test_chunked_prefill(tiny_llama, llama_ckpt, llama_ref):
    """Prefill chunks are injected as context without drafting."""
    path, _ = tiny_llama
    assert _run_capped(_llm(path, max_num_batched_tokens=8), PROMPTS) is not None
    reqs = _run_capped(_llm(path, {"method": "dflash", "model": llama_ckpt}, max_num_batched_tokens=8), PROMPTS)
    assert [r.output_token_ids for r in reqs] == llama_ref


def test_qwen3_target_fp16_checkpoint(tiny_qwen3, tmp_path):
    path, _ = tiny_qwen3
    ckpt = write_dflash_checkpoint(str(tmp_path / "d"), load_cfg(path), block_size=4, num_layers=1,
                                   target_layer_ids=(0, 1, 2), dtype=torch.float16, ids_location="top")
    ref = _gen(_llm(path), PROMPTS[:2])
    assert _gen(_llm(path, {"method": "dflash", "model": ckpt}), PROMPTS[:2]) == ref


def test_k_from_checkpoint_and_mismatch_error(tiny_llama, llama_ckpt):
    path, _ = tiny_llama
    llm = _llm(path, {"method": "dflash", "model": llama_ckpt})
    assert llm.engine.num_spec_tokens == 3
    with pytest.raises(ValueError, match=r"num_speculative_tokens=5.*block_size=4.*3"):
        _llm(path, {"method": "dflash", "model": llama_ckpt, "num_speculative_tokens": 5})


def test_layer_ids_beyond_target_fall_back_with_warning(tiny_llama, tmp_path, caplog):
    path, _ = tiny_llama
    ckpt = write_dflash_checkpoint(str(tmp_path / "d"), load_cfg(path), target_layer_ids=(1, 8, 15, 22, 29)[:3],
                                   num_target_layers=32)
    with caplog.at_level(logging.WARNING, logger="draftwise"):
        llm = _llm(path, {"method": "dflash", "model": ckpt})
    assert any("target_layer_ids" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert llm.engine.worker.proposer.aux_layers() == (1, 2, 3)
    assert _gen(llm, PROMPTS[:2]) == _gen(_llm(path), PROMPTS[:2])


def test_capture_layer_mapping():
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(32, 1) == [16]
    assert dflash_capture_layers([1, 8, 15, 22, 29], 32) == (2, 9, 16, 23, 30)
    assert spread_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert spread_target_layer_ids(4, 2) == [0, 2] and spread_target_layer_ids(4, 3) == [0, 1, 2]
    assert dflash_capture_layers([1, 8, 15, 22, 29], 30) == (2, 9, 15, 21, 28)   # 1..27 spread, +1
    with pytest.raises(ValueError, match="only 2 layers"):
        dflash_capture_layers([0, 1, 2], 2)


def test_pytorch_bin_with_model_prefix(tiny_llama, tmp_path, llama_ref):
    path, _ = tiny_llama
    cfg = load_cfg(path)
    a = write_dflash_checkpoint(str(tmp_path / "st"), cfg, seed=5, dtype=torch.float16)
    b = write_dflash_checkpoint(str(tmp_path / "bin"), cfg, seed=5, dtype=torch.float16, fmt="bin", prefix="model.")
    assert set(os.listdir(b)) == {"pytorch_model.bin", "config.json"}
    tcfg = ModelConfig.from_hf_dict(cfg)
    ma, _ = load_dflash_checkpoint(a, tcfg, torch.float32, "cpu", 256)
    mb, _ = load_dflash_checkpoint(b, tcfg, torch.float32, "cpu", 256)
    for (n1, p1), (n2, p2) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert _gen(_llm(path, {"method": "dflash", "model": b}), PROMPTS[:2]) == llama_ref[:2]


def test_malformed_checkpoints_raise_clear_errors(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file
    path, _ = tiny_llama
    cfg = load_cfg(path)
    tcfg = ModelConfig.from_hf_dict(cfg)

    def variant(name, edit_tensors=None, edit_cfg=None):
        d = write_dflash_checkpoint(str(tmp_path / name), cfg)
        if edit_tensors:
            f = os.path.join(d, "model.safetensors")
            t = load_file(f)
            edit_tensors(t)
            save_file(t, f)
        if edit_cfg:
            c = load_cfg(d)
            edit_cfg(c)
            with open(os.path.join(d, "config.json"), "w") as fh:
                json.dump(c, fh)
        return d

    def load(d):
        return load_dflash_checkpoint(d, tcfg, torch.float32, "cpu", 256)

    with pytest.raises(ValueError, match=r"missing tensors.*layers\.1\.self_attn\.k_norm"):
        load(variant("missing", lambda t: t.pop("layers.1.self_attn.k_norm.weight")))
    with pytest.raises(ValueError, match="shape mismatch.*v_proj"):
        load(variant("shape", lambda t: t.__setitem__("layers.0.self_attn.v_proj.weight",
                                                       torch.zeros(8, 64, dtype=torch.bfloat16))))
    with pytest.raises(ValueError, match="fc.weight"):
        load(variant("fc", lambda t: t.__setitem__("fc.weight", torch.zeros(64, 100, dtype=torch.bfloat16))))
    with pytest.raises(ValueError, match="hidden_size=32 does not match"):
        load(variant("hidden", edit_cfg=lambda c: c.__setitem__("hidden_size", 32)))
    with pytest.raises(ValueError, match=r"mask_token_id=300 is outside"):
        load(variant("mask", edit_cfg=lambda c: c["dflash_config"].__setitem__("mask_token_id", 300)))
    with pytest.raises(ValueError, match="no mask_token_id"):
        load(variant("nomask", edit_cfg=lambda c: c["dflash_config"].pop("mask_token_id")))
    with pytest.raises(ValueError, match="no block_size"):
        load(variant("noblock", edit_cfg=lambda c: c.pop("block_size")))
    with pytest.raises(ValueError, match="target_layer_ids lists 3"):
        load(variant("ids", edit_cfg=lambda c: c["dflash_config"].__setitem__("target_layer_ids", [0, 1, 2])))
    with pytest.raises(ValueError, match="not a DFlash checkpoint"):
        load(variant("arch", edit_cfg=lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"])))
    with pytest.raises(ValueError, match="no matching parameter"):
        load(variant("extra", lambda t: t.__setitem__("layers.2.mlp.up_proj.weight", torch.zeros(2, 2))))


# ---------------------------------------------------------------------------------------------
# engine path vs dense (training) block forward
# ---------------------------------------------------------------------------------------------
def _target_features(target, ids):
    """Aux states [L, k*H] of `ids` from a private target cache."""
    cfg = target.config
    L = len(ids)
    bs = 4
    nb = (L + bs - 1) // bs
    cache = KVCache(nb, bs, [(cfg.num_key_value_heads, cfg.head_dim)] * cfg.num_hidden_layers,
                    torch.float32, "cpu")
    bt = torch.arange(nb)[None]
    pos = torch.arange(L)
    meta = AttentionMetadata(pos.clone(), [L], [L], bt, bs, CAUSAL).finalize()
    return target(torch.tensor(ids), pos, meta, cache).aux_hidden_states


def _dense_block_logits(draft, target, ids, s, k):
    aux = _target_features(target, ids[:s])
    h = block_hidden_states(draft, target.embed_tokens, aux, torch.tensor(ids[:s + 1]), torch.tensor([s]),
                            use_fused=True)
    return target.compute_logits(h[0, 1:1 + k])


def _exact_head_spy(prop) -> list:
    """Make the proposer score blocks with the target's exact head and record each call's logits."""
    prop.draft_head = None
    seen, real = [], prop.block_logits

    def spy(hidden):
        out = real(hidden)
        seen.append(out.detach().float().clone())
        return out
    prop.block_logits = spy
    return seen


@torch.no_grad()
def test_engine_block_matches_dense_forward(tiny_llama, llama_ckpt):
    path, _ = tiny_llama
    target, tcfg, _ = load_target_model(path, torch.float32, "cpu", 256)
    draft, raw = load_dflash_checkpoint(llama_ckpt, tcfg, torch.float32, "cpu", 256)
    prop = DFlashProposer(draft, raw, target, tcfg)
    seen = _exact_head_spy(prop)
    target.set_aux_hidden_state_layers(prop.aux_layers())
    bs, N = 4, tcfg.num_hidden_layers
    specs = [(tcfg.num_key_value_heads, tcfg.head_dim)] * N
    prop.bind_kv_cache(N)
    specs += prop.kv_layer_specs()
    kv = KVCache(40, bs, specs, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 250, (23,), generator=g).tolist(), torch.randint(3, 250, (10,), generator=g).tolist()]
    # scattered, non-identity block tables
    tables = torch.tensor([[7, 3, 12, 0, 9, 30, 21, 5], [2, 17, 11, 25, 4, 8, 1, 6]])
    split = [(9, 22), (4, 9)]          # inject rows [0, a) in a first call, [a, s) in a second; bonus at s

    def step(lo_hi, want):
        rows_tok, rows_pos, ql, nxt, sl, aux = [], [], [], [], [], []
        for r, (lo, hi) in enumerate(lo_hi):
            ids = seqs[r]
            # the target's own forward for its KV; its aux states feed the proposer
            aux.append(_target_features(target, ids[:hi])[lo:hi])
            rows_tok += ids[lo:hi]
            rows_pos += list(range(lo, hi))
            ql.append(hi - lo)
            nxt.append(ids[hi])
            sl.append(hi)
        inp = ProposerInput(torch.tensor(rows_tok), torch.tensor(rows_pos), torch.cat(aux), ql,
                            torch.tensor(nxt), sl, tables, [want] * 2, [None, None], [[], []])
        return prop.propose(inp, kv, bs, 3)

    assert step([(0, split[0][0]), (0, split[1][0])], False) == [None, None]
    drafts = step([split[0], split[1]], True)
    eng = seen[-1].view(2, 3, -1)
    for r in range(2):
        dense = _dense_block_logits(draft, target, seqs[r], split[r][1], 3)
        torch.testing.assert_close(eng[r], dense, atol=1e-4, rtol=1e-4)
        assert drafts[r].token_ids == dense.argmax(-1).tolist() and drafts[r].is_chain
    # several anchors in one dense pass == one pass each (blocks never see each other)
    ids = seqs[0]
    aux = _target_features(target, ids)
    anchors = torch.tensor([3, 8, 9, 15])
    many = block_hidden_states(draft, target.embed_tokens, aux, torch.tensor(ids), anchors)
    for j, a in enumerate(anchors.tolist()):
        one = block_hidden_states(draft, target.embed_tokens, aux[:a], torch.tensor(ids[:a + 1]), torch.tensor([a]))
        torch.testing.assert_close(many[j], one[0], atol=1e-5, rtol=1e-5)


def _reference_block_logits(ckpt, target, aux, bonus, s):
    """z-lab's DFlashDraftModel forward written out from the raw checkpoint tensors (plain torch, no
    draftwise modules): ctx = hidden_norm(fc(aux)); per layer q from the block only, k/v from
    [ctx ; block] with the same projections, k_norm then RoPE over [ctx positions ; block positions],
    no mask; logits = target lm_head(norm(h)) at block positions 1..B-1."""
    from safetensors.torch import load_file
    c = load_cfg(ckpt)
    w = {k: v.float() for k, v in load_file(os.path.join(ckpt, "model.safetensors")).items()}
    B, eps, hd = c["block_size"], c["rms_norm_eps"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]

    def rms(x, wt):
        return wt * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):                       # x [T, heads, hd]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        f = pos.float()[:, None] * inv[None]
        emb = torch.cat([f, f], -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin

    ctx = rms(aux @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = target.embed_tokens(torch.tensor([bonus] + [c["dflash_config"]["mask_token_id"]] * (B - 1))).float()
    qpos = torch.arange(s, s + B)
    kpos = torch.cat([torch.arange(s), qpos])
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = rms((x @ w[p + "self_attn.q_proj.weight"].T).view(B, nh, hd), w[p + "self_attn.q_norm.weight"])
        both = torch.cat([ctx, x])
        k = rms((both @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q, k = rope(q, qpos), rope(k, kpos)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(B, nh * hd)
        h = h + o @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        g = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)
        h = h + g @ w[p + "mlp.down_proj.weight"].T
    return target.compute_logits(rms(h, w["norm.weight"])[1:])


@torch.no_grad()
def test_block_pass_matches_reference_formulation(tiny_llama, llama_ckpt):
    path, _ = tiny_llama
    target, tcfg, _ = load_target_model(path, torch.float32, "cpu", 256)
    draft, raw = load_dflash_checkpoint(llama_ckpt, tcfg, torch.float32, "cpu", 256)
    # HF layer-output ids (0, 2) == hidden_states[1], hidden_states[3] == states entering layers 1, 3
    target.set_aux_hidden_state_layers(dflash_capture_layers(draft.target_layer_ids, tcfg.num_hidden_layers))
    ids = list(range(40, 57))
    s = 13
    aux = _target_features(target, ids[:s])
    ref = _reference_block_logits(llama_ckpt, target, aux, ids[s], s)
    torch.testing.assert_close(_dense_block_logits(draft, target, ids, s, 3), ref, atol=1e-4, rtol=1e-4)


def test_accepted_rows_are_injected_as_context(tiny_llama, llama_ckpt, llama_ref):
    """Force partial/full acceptance with oracle drafts; every block the engine evaluates must equal
    the dense forward over the full history recomputed from scratch."""
    path, _ = tiny_llama
    llm = _llm(path, {"method": "dflash", "model": llama_ckpt})
    prop = llm.engine.worker.proposer
    seen = _exact_head_spy(prop)
    target = llm.engine.worker.model
    full = {tuple(p): p + o for p, o in zip(PROMPTS, llama_ref)}
    real = prop.propose
    calls = {"n": 0, "checked": 0}

    def propose(inp, kv_cache, block_size, k):
        out = real(inp, kv_cache, block_size, k)
        want = [i for i in range(len(out)) if inp.want_draft[i]]
        for j, i in enumerate(want):
            req = inp.requests[i]
            s = inp.seq_lens[i]
            hist = req.all_token_ids
            assert hist[s] == int(inp.next_token_ids[i])
            dense = _dense_block_logits(prop.model, target, hist[:s + 1], s, k)
            torch.testing.assert_close(seen[-1].view(len(want), k, -1)[j], dense, atol=1e-4, rtol=1e-4)
            calls["checked"] += 1
            ref = full[tuple(req.prompt_token_ids)][s + 1:s + 1 + k]
            d = list(ref) + [0] * (k - len(ref))
            bad = calls["n"] % (k + 1)
            if bad < k:
                d[bad] = (d[bad] + 1) % 256
            calls["n"] += 1
            out[i] = Draft.chain(d, "dflash")
        return out

    prop.propose = propose
    assert _gen(llm) == llama_ref
    stats = llm.engine.spec_stats
    assert calls["checked"] > 10
    assert stats.num_accepted_tokens > 0
    assert stats.accepted_per_position[-1] > 0       # some blocks were accepted in full


# ---------------------------------------------------------------------------------------------
# checkpoint round trip and trainer
# ---------------------------------------------------------------------------------------------
def test_save_round_trip(tiny_llama, llama_ckpt, tmp_path):
    path, _ = tiny_llama
    tcfg = ModelConfig.from_hf_dict(load_cfg(path))
    m, _ = load_dflash_checkpoint(llama_ckpt, tcfg, torch.float32, "cpu", 256)
    out = str(tmp_path / "re")
    save_dflash_checkpoint(out, m, {"draftwise_training": {"steps": 1}}, torch.float32)
    c = load_cfg(out)
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["dflash_config"] == {"mask_token_id": m.mask_token_id, "target_layer_ids": [0, 2]}
    m2, _ = load_dflash_checkpoint(out, tcfg, torch.float32, "cpu", 256)
    for (a, p), (b, q) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert a == b and torch.equal(p, q)


def _tokenizer(model_dir):
    from tests.tokenizer_util import add_tiny_tokenizer
    return add_tiny_tokenizer(model_dir)


def test_trainer_runs_resumes_and_exports(tmp_path):
    from tests.helpers import make_tiny_hf
    from draftwise.training.dflash import DFlashTrainConfig, train_dflash
    tdir = str(tmp_path / "target")
    make_tiny_hf(tdir, "llama", seed=4)
    _tokenizer(tdir)
    from draftwise.training.gen_data import GenDataConfig, generate_data
    text = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
            "Speculative decoding drafts several tokens.", "Hello world! How are you today?"]
    prompts = str(tmp_path / "p.jsonl")
    with open(prompts, "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": " ".join(text[(i + j) % 4] for j in range(2))}) + "\n")
    data = str(tmp_path / "data")
    generate_data(GenDataConfig(out=data, target=tdir, data=prompts, max_prompt_tokens=96, max_tokens=32,
                                batch_size=4, shard_sequences=6, threads=1), progress=False)
    out = str(tmp_path / "run")
    cfg = DFlashTrainConfig(target=tdir, out=out, data=data, eval_data=data, max_len=96, block_size=4,
                            num_draft_layers=2, anchors_per_seq=8, lr=3e-3, warmup_steps=1, total_steps=3,
                            tokens_per_step=150, save_every=2, eval_every=2, eval_sequences=2, threads=1,
                            export_dtype="float16")
    export = train_dflash(cfg, progress=False)
    with open(os.path.join(out, "train_log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == [1, 2, 3] and all(len(r["acc"]) == 3 for r in log)
    state = torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)
    assert state["step"] == 3
    c = load_cfg(export)
    assert c["architectures"] == ["DFlashDraftModel"] and c["block_size"] == 4
    mask = c["dflash_config"]["mask_token_id"]
    assert 0 <= mask < 256 and mask not in (0, 1, 2)
    assert c["dflash_config"]["target_layer_ids"] == [0, 2]          # 1..N-3 has no room on 4 layers
    # resume for one more step
    cfg.total_steps = 4
    train_dflash(cfg, progress=False)
    assert torch.load(os.path.join(out, "trainer_state.pt"), weights_only=False)["step"] == 4
    # the export speculates losslessly
    ref = _gen(_llm(tdir), PROMPTS[:3])
    assert _gen(_llm(tdir, {"method": "dflash", "model": export}), PROMPTS[:3]) == ref
