"""Build the proposer a SpeculativeConfig asks for, resolving shipped drafters when no model is named."""
from __future__ import annotations

import os

from draftwise.config import EngineConfig, ModelConfig, SpeculativeConfig
from draftwise.models.dflash import load_dflash_checkpoint
from draftwise.models.eagle3 import load_eagle3_checkpoint
from draftwise.models.loader import load_draft_model
from draftwise.spec_decode.datastore import Datastore
from draftwise.spec_decode.dflash import DFlashProposer
from draftwise.spec_decode.draft_model import DraftModelProposer
from draftwise.spec_decode.eagle import EagleProposer
from draftwise.spec_decode.hybrid import HybridProposer
from draftwise.spec_decode.ngram import NgramProposer
from draftwise.spec_decode.suffix import SuffixProposer

DRAFTERS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafters")


def shipped_drafter(model_path: str, target_cfg: ModelConfig, method: str, marker: str = "config.json") -> str | None:
    """The drafter (or datastore) shipped in the package for this target, found by the target's shape."""
    key = f"{target_cfg.architecture}-L{target_cfg.num_hidden_layers}-H{target_cfg.hidden_size}-V{target_cfg.vocab_size}"
    d = os.path.join(DRAFTERS_DIR, key, method)
    return d if os.path.exists(os.path.join(d, marker)) else None


def build_proposer(spec: SpeculativeConfig, target_model, target_cfg: ModelConfig, cfg: EngineConfig,
                   model_path: str):
    if spec.method in ("ngram", "suffix"):
        return _training_free(spec.method, spec, spec.num_speculative_tokens, target_cfg)
    model = _model_proposer(spec, target_model, target_cfg, cfg, model_path)
    if spec.hybrid is None:
        return model
    fast_k = spec.suffix_decoding_max_tree_depth if spec.hybrid == "suffix" else spec.num_speculative_tokens
    return HybridProposer(model, _training_free(spec.hybrid, spec, fast_k, target_cfg), fast_k)


def _training_free(method: str, spec: SpeculativeConfig, k: int, target_cfg: ModelConfig):
    if method == "ngram":
        return NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return SuffixProposer(k, spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                          spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
                          spec.draft_tree, suffix_datastore(spec, target_cfg))


def suffix_datastore(spec: SpeculativeConfig, target_cfg: ModelConfig):
    """The Datastore suffix decoding searches (None: none): the one shipped for this target when
    "auto", a directory when named. Resolved into spec.suffix_decoding_datastore (a path or None)."""
    where = spec.suffix_decoding_datastore
    if where is None or where.lower() == "none":
        spec.suffix_decoding_datastore = None
        return None
    if where.lower() == "auto":
        where = shipped_drafter("", target_cfg, "suffix-datastore", marker="tokens.npy")
        if where is None:
            spec.suffix_decoding_datastore = None
            return None
    ds = Datastore.load(where)
    if ds.n and int(ds.buf.max()) >= target_cfg.vocab_size:
        raise ValueError(f"suffix-decoding datastore {where!r} holds token ids beyond the target's vocabulary "
                         f"({int(ds.buf.max())} >= {target_cfg.vocab_size})")
    spec.suffix_decoding_datastore = where
    return ds


def apply_drafter_preset(spec: SpeculativeConfig, raw: dict, path: str) -> None:
    """Fill what the user left out from the drafter's recommended shape (its config.json's
    "draftwise_speculative_config": the tree preset measured fastest, and the chain length used when
    the user asks for a chain - eagle_topk 1 or the adaptive policy)."""
    preset = raw.get("draftwise_speculative_config") or {}
    chain = spec.eagle_topk == 1 or spec.adaptive
    if spec.num_speculative_tokens is None:
        k = preset.get("chain_num_speculative_tokens") if chain else preset.get("num_speculative_tokens")
        if k is None:
            raise ValueError(f"the EAGLE-3 drafter in {path} recommends no draft length: pass "
                             "speculative_config['num_speculative_tokens']")
        spec.num_speculative_tokens = int(k)
        if not chain and spec.eagle_topk is None:
            spec.eagle_topk = int(preset.get("eagle_topk", 1))
            if spec.eagle_depth is None and preset.get("eagle_depth") is not None:
                spec.eagle_depth = int(preset["eagle_depth"])
    if spec.eagle_topk is None:
        spec.eagle_topk = 1
    spec.validate_basic()


def _model_proposer(spec: SpeculativeConfig, target_model, target_cfg: ModelConfig, cfg: EngineConfig,
                    model_path: str):
    if spec.method == "draft_model":
        return _draft_model_proposer(spec, target_cfg, cfg, model_path)
    path = spec.model
    if path is None:
        path = shipped_drafter(model_path, target_cfg, spec.method)
        if path is None:
            raise ValueError(f"no shipped {spec.method} drafter for this target ({cfg.model}); "
                             "pass speculative_config['model'] = PATH to a draft checkpoint")
        spec.model = path
    if not os.path.isdir(path):
        raise ValueError(f"draft checkpoint {path!r} does not exist or is not a directory")
    max_pos = cfg.max_model_len + 512
    if spec.method == "eagle3":
        draft, raw = load_eagle3_checkpoint(path, target_cfg, target_model.embed_tokens, cfg.torch_dtype,
                                            cfg.device, max_pos)
        apply_drafter_preset(spec, raw, path)
        return EagleProposer(draft, raw, target_model, spec.num_speculative_tokens, spec.eagle_topk,
                             spec.eagle_depth)
    if spec.method == "dflash":
        draft, raw = load_dflash_checkpoint(path, target_cfg, cfg.torch_dtype, cfg.device, max_pos)
        block = draft.block_size
        if spec.num_speculative_tokens is None:
            spec.num_speculative_tokens = block - 1
        elif spec.num_speculative_tokens != block - 1:
            raise ValueError(f"num_speculative_tokens={spec.num_speculative_tokens} does not match the DFlash "
                             f"checkpoint: block_size={block} gives block_size - 1 = {block - 1} draft tokens")
        return DFlashProposer(draft, raw, target_model, target_cfg)
    raise ValueError(f"unknown speculative method {spec.method!r}")


def _draft_model_proposer(spec: SpeculativeConfig, target_cfg: ModelConfig, cfg: EngineConfig, model_path: str):
    if cfg.tensor_parallel_size > 1:
        raise ValueError("method 'draft_model' runs on one process: tensor_parallel_size > 1 is not supported")
    draft, _, quantization = load_draft_model(spec.model, target_cfg, model_path, cfg.torch_dtype, cfg.device,
                                cfg.max_model_len + 512, fused=cfg.enforce_eager, requantize=spec.quantization)
    if spec.eagle_topk is None:
        spec.eagle_topk = 1
    return DraftModelProposer(draft, spec.num_speculative_tokens, spec.eagle_topk, spec.eagle_depth,
                              max_rows_per_pass=cfg.max_num_batched_tokens, row_invariant=quantization is not None,
                              confidence_threshold=spec.draft_confidence_threshold)
