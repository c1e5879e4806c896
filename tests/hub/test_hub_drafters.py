"""Drafters by Hub id, in the layouts they are published in. A random drafter accepts nothing, so
a layout bug (a wrong tensor name, the wrong captured layers, a broken d2t) would pass unseen:
the EAGLE-3 head here is trained briefly by our own trainer on the tiny target, exported, and the
same weights republished in each layout (SafeAILab/SpecForge safetensors, yuhuili's
pytorch_model.bin, `speculators`). Each, fetched by Hub id, must draft exactly what the local
export drafts, accept some of it, and decode exactly as plain decoding."""
import json
import os
import shutil

import pytest
import torch

from draftwise import LLM, SamplingParams
from tests.helpers import load_cfg, make_tiny_hf, write_dflash_checkpoint, write_eagle3_checkpoint
from tests.hub.local_hub import LocalHub, Repo
from tests.spec_decode.test_spec_decode import _sample_counts, chi2_critical, two_sample_chi2
from tests.training.test_training import _gen, _prompts_jsonl, _tiny_target_with_tokenizer


def to_bin(src: str, dst: str) -> str:
    """yuhuili's layout: the same config, the weights as pytorch_model.bin only."""
    from safetensors.torch import load_file
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    torch.save(load_file(os.path.join(src, "model.safetensors")), os.path.join(dst, "pytorch_model.bin"))
    return dst


def to_speculators(src: str, dst: str, norm_before_residual: bool = False, k: int = 3) -> str:
    """The `speculators` layout of a SafeAILab-layout head: the layer's Llama config under
    transformer_layer_config, `layers.0.*` tensors."""
    from safetensors.torch import load_file, save_file
    cfg = load_cfg(src)
    layer = {key: v for key, v in cfg.items() if key not in ("architectures", "draft_vocab_size", "target_hidden_size",
                                                             "eagle_aux_hidden_state_layer_ids",
                                                             "draftwise_speculative_config")}
    out = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
           "draft_vocab_size": cfg.get("draft_vocab_size"), "target_hidden_size": cfg.get("target_hidden_size"),
           "norm_before_residual": norm_before_residual,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                                  "verifier": {"name_or_path": "tiny-org/target", "architectures": ["LlamaForCausalLM"]}}}
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        out["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    os.makedirs(dst, exist_ok=True)
    tensors = {("layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name): t
               for name, t in load_file(os.path.join(src, "model.safetensors")).items()}
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(out, f)
    return dst


def serve(repos: dict[str, str], monkeypatch, tmp_path) -> LocalHub:
    hub = LocalHub({name: Repo({f: os.path.join(d, f) for f in os.listdir(d)}) for name, d in repos.items()}).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hub


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory):
    """A tiny target and an EAGLE-3 head trained on its own greedy answers (our exporter's layout)."""
    from draftwise.training.eagle3 import TrainConfig, train_eagle3
    d = tmp_path_factory.mktemp("trained_head")
    tdir = _tiny_target_with_tokenizer(str(d / "target"))
    _gen(tdir, _prompts_jsonl(str(d / "p.jsonl"), 12), str(d / "data"), greedy_fraction=1.0)
    cfg = TrainConfig(target=tdir, out=str(d / "run"), data=str(d / "data"), max_len=256, ttt_steps=3,
                      draft_vocab_size=64, vocab_sequences=16, lr=3e-3, warmup_steps=1, total_steps=24,
                      tokens_per_step=150, save_every=100, eval_every=100, threads=1, intermediate_size=48)
    return tdir, train_eagle3(cfg, progress=False)


PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7], [30, 31, 32, 33, 34], [9] * 7, [12, 40, 41])]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def held_out_chats(tmp_path):
    """Prompts like those the head was trained on, not among them."""
    path = _prompts_jsonl(str(tmp_path / "held.jsonl"), 4, offset=2)
    return [[{"role": "user", "content": json.loads(line)["prompt"]}] for line in open(path)]


def run(target: str, drafter: str | None, chats):
    spec = None if drafter is None else {"method": "eagle3", "model": drafter, "num_speculative_tokens": 3,
                                         "allocate_drafts": False}
    llm = LLM(target, block_size=4, max_model_len=512, speculative_config=spec)
    outs = [o.outputs[0].token_ids for o in llm.chat(chats, GREEDY)]
    return outs, llm.get_metrics()["spec_decode"]


def test_each_published_eagle3_layout_drafts_as_our_export(trained_head, tmp_path, monkeypatch):
    target, ours = trained_head
    hub = serve({"tiny-org/head-specforge": ours,
                 "tiny-org/head-yuhuili": to_bin(ours, str(tmp_path / "bin")),
                 "tiny-org/head-speculators": to_speculators(ours, str(tmp_path / "spec"))}, monkeypatch, tmp_path)
    try:
        chats = held_out_chats(tmp_path)
        plain, _ = run(target, None, chats)
        local, m = run(target, ours, chats)
        assert local == plain
        assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0, m
        for repo in ("tiny-org/head-specforge", "tiny-org/head-yuhuili", "tiny-org/head-speculators"):
            got, mr = run(target, repo, chats)
            assert got == plain, repo
            assert {k: mr[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} == \
                {k: m[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}, repo
        assert hub.fetched("tiny-org/head-yuhuili") == ["config.json", "pytorch_model.bin"]
    finally:
        hub.stop()


def test_a_dflash_drafter_by_hub_id_drafts_as_by_path_and_is_accepted(tmp_path, monkeypatch):
    """z-lab's DFlash layout by Hub id: the same drafts as the same checkpoint by path, some of them
    accepted (a vocabulary of 8 tokens, where a block of drafts often matches), output equal to
    plain decoding."""
    path = str(tmp_path / "v8")
    make_tiny_hf(path, "llama", vocab=8, hidden=32, layers=2, heads=2, kv_heads=1, seed=5)
    dflash = write_dflash_checkpoint(str(tmp_path / "dflash"), load_cfg(path), block_size=3, target_layer_ids=(0,),
                                     mask_token_id=7, scale=0.3, seed=3)
    hub = serve({"tiny-org/Tiny-DFlash-b3": dflash}, monkeypatch, tmp_path)
    prompts = [{"prompt_token_ids": p} for p in ([3, 4, 5], [1, 2], [6, 6, 6, 2])]
    try:
        def go(model):
            spec = None if model is None else {"method": "dflash", "model": model, "allocate_drafts": False}
            llm = LLM(path, block_size=4, max_model_len=64, speculative_config=spec)
            return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)], llm.get_metrics()["spec_decode"]
        plain, _ = go(None)
        by_path, m = go(dflash)
        by_id, mi = go("tiny-org/Tiny-DFlash-b3")
        assert by_id == by_path == plain
        assert {k: mi[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")} == \
            {k: m[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        assert m["num_accepted_tokens"] > 0, m
    finally:
        hub.stop()


@pytest.mark.parametrize("params_kw", [{"temperature": 1.0}])
def test_sampling_stays_lossless_with_a_speculators_drafter_from_the_hub(params_kw, tmp_path, monkeypatch):
    """The chi-square test of tests/spec_decode with the drafter read from the Hub in the
    `speculators` layout (norm_before_residual, as speculators trains it)."""
    path = str(tmp_path / "v8")
    make_tiny_hf(path, "llama", vocab=8, hidden=32, layers=2, heads=2, kv_heads=1, seed=5)
    ck = write_eagle3_checkpoint(str(tmp_path / "eagle_v8"), load_cfg(path), scale=0.3, seed=2)
    hub = serve({"tiny-org/v8-speculators": to_speculators(ck, str(tmp_path / "spec"), norm_before_residual=True,
                                                           k=2)}, monkeypatch, tmp_path)
    try:
        n = 3000
        base, _ = _sample_counts(path, None, params_kw, n)
        spec = {"method": "eagle3", "model": "tiny-org/v8-speculators", "num_speculative_tokens": 2,
                "rejection_sampler": "logits", "allocate_drafts": False}
        got, m = _sample_counts(path, spec, params_kw, n)
        assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0
        stat, df = two_sample_chi2(base, got)
        assert stat < chi2_critical(df), (stat, df)
    finally:
        hub.stop()
