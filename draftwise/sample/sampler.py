"""Per-request sampling as pure tensor functions: temperature, top-k, top-p, seeded randomness.

Randomness is drawn per request from its own `torch.Generator` when it has a seed, so a seeded
request's output does not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor        # [R] float (0 for greedy rows)
    top_k: torch.Tensor              # [R] long (0: disabled)
    top_p: torch.Tensor              # [R] float
    greedy: torch.Tensor             # [R] bool
    generators: list                 # [R] torch.Generator (one per request; shared for unseeded)
    all_greedy: bool
    min_p: torch.Tensor | None = None  # [R] float; None: no row uses min-p

    @classmethod
    def from_params(cls, params_list, generators, device) -> "SamplingMetadata":
        temps = [0.0 if p.greedy else float(p.temperature) for p in params_list]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params_list], dtype=torch.long, device=device),
            top_p=torch.tensor([float(p.top_p) for p in params_list], dtype=torch.float32, device=device),
            greedy=torch.tensor([p.greedy for p in params_list], dtype=torch.bool, device=device),
            generators=list(generators),
            all_greedy=all(p.greedy for p in params_list),
            min_p=(torch.tensor([float(p.min_p) for p in params_list], dtype=torch.float32, device=device)
                   if any(p.min_p for p in params_list) else None),
        )

    def repeat_rows(self, counts: list[int]) -> "SamplingMetadata":
        """One row per logits row (request r repeated counts[r] times)."""
        idx = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        gens = [self.generators[i] for i in idx.tolist()]
        return SamplingMetadata(self.temperature[idx], self.top_k[idx], self.top_p[idx],
                                self.greedy[idx], gens, self.all_greedy,
                                self.min_p[idx] if self.min_p is not None else None)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus with -inf. logits: [N, V] float32."""
    V = logits.shape[-1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
        kmax = int(k.max())
        vals = torch.topk(logits, kmax, dim=-1).values
        thresh = vals.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < thresh, float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        remove = (cum - probs) > top_p[:, None]       # keep the smallest prefix reaching top_p
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Probabilities each row is sampled from; greedy rows are one-hot at the argmax."""
    logits = logits.float()
    temp = torch.where(meta.greedy, torch.ones_like(meta.temperature), meta.temperature)
    scaled = apply_top_k_top_p(logits / temp[:, None], meta.top_k, meta.top_p)
    probs = scaled.softmax(-1)
    if meta.min_p is not None:                # min-p: drop tokens below min_p x the top probability
        keep = probs >= meta.min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = (probs * keep).div_((probs * keep).sum(-1, keepdim=True))
    if bool(meta.greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(meta.greedy[:, None], onehot, probs)
    return probs


def exponential_noise(n_rows: int, V: int, generators, device) -> torch.Tensor:
    q = torch.empty(n_rows, V, device=device)
    for i in range(n_rows):
        q[i].exponential_(generator=generators[i])
    return q


def uniform_noise(n_rows: int, K: int, generators, device, counts=None) -> torch.Tensor:
    """[n_rows, K] uniforms; row i draws only its first `counts[i]` from its own generator (the rest
    stay 1), so how many numbers a request consumes does not depend on its batch mates."""
    u = torch.ones(n_rows, K, device=device)
    for i in range(n_rows):
        n = K if counts is None else counts[i]
        if n:
            u[i, :n].uniform_(generator=generators[i])
    return u
