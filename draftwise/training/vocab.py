"""Draft vocabulary: the N most frequent target tokens on assistant (loss-masked) positions, in
the published `d2t` / `t2d` form (target = draft + d2t[draft]; t2d[target] is True if kept)."""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch


def count_tokens(examples: Iterable, counter: Counter | None = None) -> Counter:
    counter = counter if counter is not None else Counter()
    for ex in examples:
        ids, mask = torch.as_tensor(ex.input_ids), torch.as_tensor(ex.loss_mask)
        counter.update(ids[mask > 0].tolist())
    return counter


def build_draft_vocab(counter: Counter, target_vocab_size: int, draft_vocab_size: int,
                      always: Iterable[int] = (), fallback: Counter | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Returns (d2t [N] int64, t2d [V] bool, coverage of the counted tokens). Slots the counted
    tokens do not fill take the most frequent `fallback` tokens (e.g. counts over human-written
    responses, for a small self-distilled data set), then unused low ids."""
    if draft_vocab_size > target_vocab_size:
        raise ValueError(f"draft vocabulary {draft_vocab_size} larger than the target's {target_vocab_size}")
    chosen = list(dict.fromkeys(list(always)))
    have = set(chosen)
    for src in (counter, fallback or Counter()):
        for tok, _ in src.most_common():
            if len(chosen) >= draft_vocab_size:
                break
            if tok not in have and 0 <= tok < target_vocab_size:
                chosen.append(tok)
                have.add(tok)
    # pad with unused low ids so the vocabulary has exactly the requested size
    t = 0
    while len(chosen) < draft_vocab_size:
        if t not in have:
            chosen.append(t)
            have.add(t)
        t += 1
    used = torch.tensor(sorted(chosen[:draft_vocab_size]), dtype=torch.long)
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    total = sum(counter.values()) or 1
    coverage = sum(c for tok, c in counter.items() if t2d[tok]) / total
    return d2t, t2d, coverage
