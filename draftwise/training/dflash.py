"""`draftwise train dflash`: train a DFlash block drafter for a target (self-distillation).

Training reads data shards written by `draftwise train gen-data` (training/shards.py): the target's
own responses with its hidden states captured while generating, before layers id+1 for the
(layer-output) `target_layer_ids` written to the checkpoint; labels are recomputed through the
frozen target LM head. Per
sequence, random anchor positions on assistant tokens are drawn; each anchor a gives a block
`[token_a, mask x (B-1)]` at positions a..a+B-1 that sees the injected context of positions < a
and itself bidirectionally, never other blocks (one dense attention mask per sequence, no paged
cache). Block position k (1..B-1) is trained with hard-label cross-entropy through the frozen
target LM head against the target's greedy token at position a+k (the argmax of its logits at
a+k-1), weighted exp(-(k-1)/gamma). The block forward is the inference block pass with a dense
mask, so its logits equal the engine's (tests/spec_decode/test_dflash.py checks this).
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from draftwise.config import ModelConfig
from draftwise.models.dflash import DFlashDraftModel, save_dflash_checkpoint, spread_target_layer_ids
from draftwise.training.loop import SequenceResult, run_training
from draftwise.models.loader import load_target_model, load_tokenizer
from draftwise.models.names import resolve_model
from draftwise.training.shards import ShardStream, iter_shard_sequences

logger = logging.getLogger("draftwise")


@dataclass
class DFlashTrainConfig:
    target: str
    data: str                           # directory of data shards (`draftwise train gen-data`)
    out: str
    eval_data: str | None = None        # held-out shards; None: no held-out evaluation
    max_len: int = 1024
    block_size: int = 8                 # K = block_size - 1 drafts per step
    num_draft_layers: int = 2
    num_target_layer_ids: int | None = None   # None: one per draft layer (DFlash's default)
    target_layer_ids: list[int] | None = None  # layer-output ids; None: DFlash default spacing
    mask_token_id: int | None = None    # None: tokenizer's mask token, else an unused special token
    anchors_per_seq: int = 64
    loss_gamma: float = 7.0             # position weight exp(-(k-1)/gamma); 0 disables
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    total_steps: int = 2000
    tokens_per_step: int = 8192
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    save_every: int = 50
    eval_every: int = 100
    eval_sequences: int = 32
    seed: int = 0
    threads: int | None = None
    export_dtype: str = "bfloat16"


# ---------------------------------------------------------------------------------------------
# the training block forward (dense; equals the paged inference block pass)
# ---------------------------------------------------------------------------------------------
def block_hidden_states(model: DFlashDraftModel, embed_tokens, aux: torch.Tensor, ids: torch.Tensor,
                        anchors: torch.Tensor, use_fused: bool = False) -> torch.Tensor:
    """Final-normed hidden states [m, B, H] of the blocks anchored at `anchors` ([m] positions of
    one sequence). aux: [L, n*Ht] target states at positions 0..L-1 (context), ids: [L] tokens
    (the anchor token is ids[a]). Block j sees context positions < anchors[j] and its own B
    entries, nothing else."""
    dev = aux.device
    B = model.block_size
    m = anchors.shape[0]
    L = aux.shape[0]
    ctx_pos = torch.arange(L, device=dev)
    ctx_kv = model.context_kv(aux, ctx_pos, use_fused=use_fused)
    pos = (anchors[:, None] + torch.arange(B, device=dev)[None, :]).reshape(-1)       # [m*B]
    blk_ids = torch.full((m, B), model.mask_token_id, dtype=torch.long, device=dev)
    blk_ids[:, 0] = ids[anchors]
    h = embed_tokens(blk_ids.reshape(-1))
    qblk = torch.arange(m, device=dev).repeat_interleave(B)
    allowed = torch.cat([ctx_pos[None, :] < anchors[qblk][:, None],                  # [mB, L]
                         qblk[:, None] == qblk[None, :]], dim=1)                      # [mB, mB]
    for layer, (kc, vc) in zip(model.layers, ctx_kv):
        attn = layer.self_attn
        T = h.shape[0]
        x = layer.input_layernorm(h)
        q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(T, attn.num_heads, attn.head_dim)
        k = k.reshape(T, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(T, attn.num_kv_heads, attn.head_dim)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = model.rotary(pos, q, k)
        keys = torch.cat([kc, k], 0).transpose(0, 1)           # [Hkv, L+T, D]
        vals = torch.cat([vc, v], 0).transpose(0, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys, vals, attn_mask=allowed[None],
                                           scale=attn.scale, enable_gqa=attn.num_kv_heads != attn.num_heads)
        h = h + attn.o_proj(o.transpose(0, 1).reshape(T, attn.q_size))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h).view(m, B, -1)


def sample_anchors(loss_mask: list[int], block_size: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to n distinct anchors a on assistant tokens with 1 <= a <= L-2 (context before it and at
    least one labelled position after it)."""
    L = len(loss_mask)
    cand = [a for a in range(1, L - 1) if loss_mask[a]]
    if not cand:
        return torch.zeros(0, dtype=torch.long)
    perm = torch.randperm(len(cand), generator=gen)[:n]
    return torch.tensor(cand, dtype=torch.long)[perm].sort().values


def target_next_tokens(lm_head_weight: torch.Tensor, final: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[L]: the target's greedy token after each row (argmax of its frozen LM head over the stored
    final hidden state), computed only where the next token is a response token (-1 elsewhere)."""
    L = final.shape[0]
    out = torch.full((L,), -1, dtype=torch.long)
    rows = torch.nonzero(loss_mask[1:] > 0).flatten()
    if rows.numel():
        out[rows] = (final[rows].float() @ lm_head_weight.T).argmax(-1)
    return out


def block_labels(next_tokens: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 block_size: int):
    """Labels [m, B-1] (the target's greedy token at a+k, made at row a+k-1) and validity [m, B-1]
    (position inside the sequence and a response token)."""
    L = next_tokens.shape[0]
    k = torch.arange(1, block_size, device=anchors.device)
    p = anchors[:, None] + k[None, :]
    inside = p < L
    pc = p.clamp(max=L - 1)
    labels = next_tokens[pc - 1]
    valid = inside & (loss_mask[pc] > 0) & (labels >= 0)
    return labels, valid


def dflash_loss(model, target, aux, next_tokens, ids, loss_mask, anchors, gamma: float):
    """Loss of the blocks at `anchors` of one sequence. Returns (loss, correct [B-1], count [B-1],
    (sum of accepted prefix lengths, number of fully labelled blocks))."""
    B = model.block_size
    labels, valid = block_labels(next_tokens, loss_mask, anchors, B)
    h = block_hidden_states(model, target.embed_tokens, aux, ids, anchors)[:, 1:]   # [m, B-1, H]
    w = torch.exp(-torch.arange(B - 1, device=aux.device, dtype=torch.float32) / gamma) if gamma > 0 \
        else torch.ones(B - 1, device=aux.device)
    logits = target.lm_head(h[valid]).float()
    ce = F.cross_entropy(logits, labels[valid], reduction="none")
    wv = w[None, :].expand_as(valid)[valid]
    loss = (ce * wv).sum() / wv.sum().clamp_min(1e-9)
    with torch.no_grad():
        correct = torch.zeros_like(valid)
        correct[valid] = logits.argmax(-1) == labels[valid]
        corr = correct.sum(0).tolist()
        cnt = valid.sum(0).tolist()
        full = valid.all(1)
        acc_len = torch.cumprod(correct[full].long(), 1).sum(1)
    return loss, corr, cnt, (int(acc_len.sum()), int(full.sum()))


# ---------------------------------------------------------------------------------------------
def choose_mask_token_id(tokenizer, vocab_size: int, seen_ids=()) -> tuple[int, str]:
    """The id used for the block's mask slots: the tokenizer's mask token if it has one; otherwise
    the highest-id special (added) token that is not bos/eos/pad/unk and never appears in the
    training text (for SmolLM2: 16 `<empty_output>`); otherwise the highest id never seen."""
    mid = getattr(tokenizer, "mask_token_id", None)
    if mid is not None and 0 <= mid < vocab_size:
        return int(mid), str(tokenizer.convert_ids_to_tokens(mid))
    seen = set(seen_ids)
    reserved = {getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id",
                                                      "unk_token_id")}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    cands = sorted(i for i, t in added.items()
                   if getattr(t, "special", False) and i < vocab_size and i not in reserved and i not in seen)
    if cands:
        return cands[-1], str(added[cands[-1]])
    for i in range(vocab_size - 1, -1, -1):
        if i not in seen and i not in reserved:
            try:
                name = str(tokenizer.convert_ids_to_tokens(i))
            except Exception:
                name = ""
            return i, name
    return vocab_size - 1, ""


def build_draft(target, block_size: int, num_layers: int, target_layer_ids: list[int], mask_token_id: int,
                max_position: int) -> DFlashDraftModel:
    tc: ModelConfig = target.config
    dcfg = ModelConfig(architecture="qwen3", vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                       intermediate_size=tc.intermediate_size, num_hidden_layers=num_layers,
                       num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                       head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
                       rope_scaling=tc.rope_scaling, max_position_embeddings=tc.max_position_embeddings)
    model = DFlashDraftModel(dcfg, block_size, mask_token_id, target_layer_ids, tc.hidden_size,
                             tc.num_hidden_layers, max_position)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
        model.norm.weight.copy_(target.norm.weight.float())
    return model


def _step_seed(seed: int, consumed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + consumed)


def _sequence_loss(model, target, seq, anchors, cfg: DFlashTrainConfig):
    nxt = target_next_tokens(target.lm_head.weight, seq.final, seq.loss_mask)
    return dflash_loss(model, target, seq.aux.float(), nxt, seq.input_ids, seq.loss_mask, anchors,
                       cfg.loss_gamma)


@torch.no_grad()
def evaluate(model, target, sequences, cfg: DFlashTrainConfig) -> dict:
    B = model.block_size
    corr, cnt = [0] * (B - 1), [0] * (B - 1)
    acc_sum, blocks = 0, 0
    was_training = model.training
    model.eval()
    for j, seq in enumerate(sequences):
        anchors = sample_anchors(seq.loss_mask.tolist(), B, cfg.anchors_per_seq, _step_seed(cfg.seed + 1, j))
        if anchors.numel() == 0:
            continue
        _, c, n, (a, b) = _sequence_loss(model, target, seq, anchors, cfg)
        corr = [x + y for x, y in zip(corr, c)]
        cnt = [x + y for x, y in zip(cnt, n)]
        acc_sum += a
        blocks += b
    model.train(was_training)
    return {"heldout_acc": [c / n if n else 0.0 for c, n in zip(corr, cnt)],
            "heldout_acceptance_length": 1 + acc_sum / blocks if blocks else None}


def train_dflash(cfg: DFlashTrainConfig, progress: bool = True) -> str:
    """Train (or resume) on data shards and export; returns the export directory."""
    from tqdm import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {cfg.block_size}")
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    target, tcfg, tpath = load_target_model(resolve_model(cfg.target).path, torch.float32, "cpu",
                                             max_position=cfg.max_len + 64)
    for p in target.parameters():
        p.requires_grad_(False)
    N = tcfg.num_hidden_layers
    ckpt_path = os.path.join(cfg.out, "trainer_state.pt")
    state = torch.load(ckpt_path, weights_only=False) if os.path.exists(ckpt_path) else None
    if state is not None:
        arch = state["arch"]
        for k in ("block_size", "num_draft_layers"):
            if getattr(cfg, k) != arch[k]:
                logger.warning("resuming %s: keeping its %s=%s (config says %s)", cfg.out, k, arch[k],
                               getattr(cfg, k))
    else:
        ids = cfg.target_layer_ids or spread_target_layer_ids(N, cfg.num_target_layer_ids or cfg.num_draft_layers)
        if any(not 0 <= i + 1 < N for i in ids):
            raise ValueError(f"target_layer_ids {ids} need capture layers id+1 inside the target's {N} layers")
        mask_id, mask_name = cfg.mask_token_id, None
        if mask_id is None:
            tok = load_tokenizer(tpath)
            if tok is None:
                raise ValueError(f"target {cfg.target} has no tokenizer: pass mask_token_id")
            seen = set()
            for _, seq in zip(range(200), iter_shard_sequences(cfg.data, tuple(i + 1 for i in ids))):
                seen.update(seq.input_ids.tolist())
            mask_id, mask_name = choose_mask_token_id(tok, tcfg.vocab_size, seen)
        if not 0 <= mask_id < tcfg.vocab_size:
            raise ValueError(f"mask_token_id {mask_id} is outside the vocabulary [0, {tcfg.vocab_size})")
        arch = {"block_size": cfg.block_size, "num_draft_layers": cfg.num_draft_layers,
                "target_layer_ids": list(ids), "mask_token_id": int(mask_id), "mask_token": mask_name or ""}
    capture = tuple(i + 1 for i in arch["target_layer_ids"])
    model = build_draft(target, arch["block_size"], arch["num_draft_layers"], arch["target_layer_ids"],
                        arch["mask_token_id"], cfg.max_len + arch["block_size"] + 64)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, tokens_seen = 0, 0
    data = ShardStream(cfg.data, capture, cfg.seed, cfg.max_len)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, tokens_seen = state["step"], state["tokens_seen"]
        data.load_state(state["data"])
    logger.info("DFlash draft: %d layers, block %d, target_layer_ids %s (capture %s), mask token %d %r",
                model.num_layers, model.block_size, arch["target_layer_ids"], list(capture),
                arch["mask_token_id"], arch["mask_token"])
    B = model.block_size
    heldout = []
    if cfg.eval_data:
        heldout = [s for _, s in zip(range(cfg.eval_sequences), iter_shard_sequences(cfg.eval_data, capture))]
        heldout = [s.truncate(cfg.max_len) for s in heldout]
    log_path = os.path.join(cfg.out, "train_log.jsonl")
    bar = tqdm(total=cfg.total_steps, initial=step, desc="train dflash", disable=not progress,
               dynamic_ncols=True)
    model.train()

    def sequence_loss(seq, tokens_read):
        # anchors drawn from a seed of the tokens read so far: a resumed run draws the same ones
        anchors = sample_anchors(seq.loss_mask.tolist(), B, cfg.anchors_per_seq,
                                 _step_seed(cfg.seed, tokens_read))
        if anchors.numel() == 0:
            return SequenceResult(None, [], [])
        loss, c, n, (a, b) = _sequence_loss(model, target, seq, anchors, cfg)
        return SequenceResult(loss, list(c), list(n), {"accepted": a, "blocks": b})

    def describe(extra):
        blocks = extra.get("blocks", 0)
        return {"acceptance_length": 1 + extra.get("accepted", 0) / blocks if blocks else float("nan")}

    def save(step, tokens_seen, _last_eval):
        _save(cfg, model, opt, step, data.state(), tokens_seen, arch)

    run_training(cfg, opt=opt, params=params, data=data, step=step, tokens_seen=tokens_seen, log_path=log_path,
                 sequence_loss=sequence_loss, describe=describe,
                 evaluate=(lambda: evaluate(model, target, heldout, cfg)) if heldout else None, save=save, bar=bar)
    bar.close()
    return os.path.join(cfg.out, "export")


def _save(cfg, model, opt, step, data_state, tokens_seen, arch):
    tmp = os.path.join(cfg.out, "trainer_state.pt.tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "data": data_state,
                "tokens_seen": tokens_seen, "arch": arch, "config": asdict(cfg)}, tmp)
    os.replace(tmp, os.path.join(cfg.out, "trainer_state.pt"))
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.export_dtype]
    save_dflash_checkpoint(os.path.join(cfg.out, "export"), model,
                           {"draftwise_training": {"steps": step, "tokens_seen": tokens_seen,
                                                   "mask_token": arch["mask_token"],
                                                   "anchors_per_seq": cfg.anchors_per_seq,
                                                   "loss_gamma": cfg.loss_gamma}}, dtype)
