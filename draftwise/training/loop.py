"""The optimisation loop both drafter trainers share.

One optimizer step accumulates gradients over whole sequences until `tokens_per_step` tokens were
read (each sequence's loss weighted by its length), clips the gradient norm, sets the learning rate
of the schedule (`lr_at`: linear warm-up, cosine decay) and steps. Every step appends one
JSON line to `train_log.jsonl` (loss, per-position accuracy, learning rate, what the trainer adds),
held-out figures every `eval_every` steps, and a resumable checkpoint every `save_every` steps (and
at the last). What differs between drafters - the loss of one sequence, the evaluation, the
checkpoint - comes in as functions."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


def lr_at(step: int, cfg) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr (any config with these fields)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    prog = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))


@dataclass
class SequenceResult:
    """One sequence's contribution to a step (`loss` None: the sequence had nothing to learn)."""
    loss: torch.Tensor | None
    correct: list[int]                    # per draft position: top-1 matches ...
    counted: list[int]                    # ... out of this many positions
    extra: dict[str, float] = field(default_factory=dict)   # summed over the step (e.g. acceptance)


def run_training(cfg, *, opt, params, data, step: int, tokens_seen: int, log_path: str,
                 sequence_loss: Callable[[object, int], SequenceResult],
                 evaluate: Callable[[], dict] | None, save: Callable[[int, int, dict | None], None],
                 describe: Callable[[dict], dict] = lambda extra: {}, bar=None) -> None:
    """Train until `cfg.total_steps`. `sequence_loss(seq, tokens_read)` computes one
    sequence's loss and statistics (`tokens_read`: tokens read in the whole run, this sequence
    included - a resumed run sees the same numbers); `describe(extra sums)` turns the step's summed extras into
    log fields; `evaluate()` returns held-out fields; `save(step, tokens_seen, last_eval)`
    checkpoints (`last_eval`: the latest held-out fields, None before the first evaluation)."""
    t_start = time.time()
    last_eval = None
    while step < cfg.total_steps:
        opt.zero_grad(set_to_none=True)
        n_tok, n_seq, loss_sum = 0, 0, 0.0
        correct: list[int] = []
        counted: list[int] = []
        extra: dict[str, float] = {}
        while n_tok < cfg.tokens_per_step:
            seq = next(data)
            n_tok += len(seq)
            res = sequence_loss(seq, tokens_seen + n_tok)
            if res.loss is None:
                continue
            if res.loss.requires_grad:
                (res.loss * len(seq) / cfg.tokens_per_step).backward()
            loss_sum += float(res.loss.detach())
            n_seq += 1
            correct = _add(correct, res.correct)
            counted = _add(counted, res.counted)
            for k, v in res.extra.items():
                extra[k] = extra.get(k, 0.0) + v
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.step()
        step += 1
        tokens_seen += n_tok
        acc = [c / n if n else 0.0 for c, n in zip(correct, counted)]
        rec = {"step": step, "tokens": tokens_seen, "epoch": data.epoch, "loss": loss_sum / max(1, n_seq),
               "acc": acc, **describe(extra), "lr": lr_at(step - 1, cfg), "elapsed_s": time.time() - t_start}
        if bar is not None:
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=" ".join(f"{a:.2f}" for a in acc[:4]))
            bar.update(1)
        if evaluate is not None and (step % cfg.eval_every == 0 or step == cfg.total_steps):
            last_eval = evaluate()
            rec.update(last_eval)
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if step % cfg.save_every == 0 or step == cfg.total_steps:
            save(step, tokens_seen, last_eval)


def _add(a: list[int], b: list[int]) -> list[int]:
    if len(a) < len(b):
        a = a + [0] * (len(b) - len(a))
    return [x + (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
