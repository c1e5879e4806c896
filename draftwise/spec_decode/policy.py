"""Per-step choice of how many tokens to speculate, so speculation never loses to plain decoding.

Policy (measured, not modelled): for each batch-size bucket (1, 2, 4, …, 64) the engine keeps an
exponential moving average of *output tokens per second* observed for each candidate draft length
k in {0, 1, 2, K/2, K}. A bucket first tries every candidate a few times (exploration), then uses the
best one, and re-tries the others every `reexplore_every` steps so the estimates follow changes in
acceptance (prompts differ) and in step cost. k = 0 means plain decoding: the drafter is skipped
for that step (its KV for those positions goes stale, which can lower later acceptance but never
changes outputs). Because k = 0 is always a candidate, measured
throughput can only fall below autoregressive decoding by the exploration steps and the drafter's
KV-update pass.

Exploration is pruned with the target's step costs measured at start-up (`set_step_costs`, from
`ModelRunner.measure_target_costs`): a draft length k is never tried at batch size B when even
perfect acceptance with free drafting could not beat plain decoding, i.e. when
B * (1 + k) / cost(B * (1 + k)) <= B / cost(B). At large batches, where verification is
compute-bound, this keeps the engine on plain decoding without paying exploration steps."""
from __future__ import annotations

import math


class SpeculationPolicy:
    def __init__(self, max_k: int, min_samples: int = 2, ema: float = 0.3, reexplore_every: int = 64):
        self.max_k = max_k
        self.candidates = sorted({0, 1, min(2, max_k), max(1, max_k // 2), max_k})
        self.min_samples = min_samples
        self.ema = ema
        self.reexplore_every = reexplore_every
        self.rate: dict[tuple[int, int], float] = {}
        self.count: dict[tuple[int, int], int] = {}
        self.steps: dict[int, int] = {}
        self.step_costs: dict[int, float] = {}

    def set_step_costs(self, costs: dict[int, float]) -> None:
        """Target forward seconds per token count, measured at start-up."""
        self.step_costs = {int(t): float(c) for t, c in costs.items() if c > 0}

    def cost(self, tokens: int) -> float | None:
        """Piecewise-linear interpolation of the measured step costs (linear extrapolation past
        the largest measured size)."""
        pts = sorted(self.step_costs.items())
        if not pts:
            return None
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
            if tokens <= t1:
                return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
        if len(pts) == 1:
            return pts[0][1] * tokens / pts[0][0]
        (t0, c0), (t1, c1) = pts[-2], pts[-1]
        return c1 + (c1 - c0) * (tokens - t1) / (t1 - t0)

    def can_win(self, batch_size: int, k: int) -> bool:
        """Could k beat plain decoding at this batch size if every draft were accepted for free?"""
        if k == 0 or not self.step_costs:
            return True
        b = self.bucket(batch_size)
        return b * (1 + k) / self.cost(b * (1 + k)) > b / self.cost(b)

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))

    def record(self, batch_size: int, k: int, tokens: int, seconds: float) -> None:
        if seconds <= 0 or batch_size <= 0:
            return
        key = (self.bucket(batch_size), k)
        r = tokens / seconds
        self.rate[key] = r if key not in self.rate else (1 - self.ema) * self.rate[key] + self.ema * r
        self.count[key] = self.count.get(key, 0) + 1

    def choose(self, batch_size: int) -> int:
        b = self.bucket(batch_size)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        cands = [k for k in self.candidates if self.can_win(b, k)]
        for k in cands:
            if self.count.get((b, k), 0) < self.min_samples:
                return k
        best = max(cands, key=lambda k: self.rate[(b, k)])
        if n % self.reexplore_every == 0 and len(cands) > 1:
            others = [k for k in cands if k != best]
            return others[(n // self.reexplore_every) % len(others)]
        return best

    def table(self) -> dict:
        return {f"b{b}_k{k}": round(r, 2) for (b, k), r in sorted(self.rate.items())}
