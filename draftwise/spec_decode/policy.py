"""Per-step choice of how many tokens to speculate, so speculation never loses to plain decoding.

The policy models a step's throughput instead of exploring it:

    tokens/s(k) = B * (1 + a_1 + ... + a_k) / (verify(B * (1 + k)) + draft(B, k))

- `verify(T)`: seconds of one target forward over T tokens, measured at start-up for a grid of
  token counts (`ModelRunner.measure_target_costs`, after the compiled graphs are warm) and
  interpolated piecewise-linearly; k = 0 is plain decoding, verify(B).
- `a_j`: probability that the first j drafts of a request are all accepted, estimated online from
  every verified draft (exponentially decayed counts, starting from a prior of 0.5^j). The
  expected tokens per request per step is 1 + sum_j a_j (the bonus token plus accepted drafts).
- `draft(B, k)`: the drafter's measured seconds per step at this batch bucket and length k
  (decayed average; unmeasured lengths are scaled from a measured one, or taken as free).

`choose(B)` returns the k in 0..K with the highest modelled tokens/s, and 0 unless speculation
beats plain decoding by `margin`. No step is spent exploring: at compute-bound batch sizes, where
verifying B(1+k) tokens costs about (1+k) times verifying B, the model picks k = 0 from the
start-up costs alone, and the drafter is skipped for that step (its KV for those positions goes
stale, which can lower later acceptance but never changes outputs). Acceptance keeps being
learned whenever drafts are verified."""
from __future__ import annotations

import math

from draftwise.spec_decode.allocation import StepCosts


class SpeculationPolicy:
    def __init__(self, max_k: int, prior: float = 0.5, prior_weight: float = 4.0,
                 decay: float = 0.995, margin: float = 0.03, prior_acceptance: list[float] | None = None):
        self.max_k = max_k
        self.margin = margin
        self.decay = decay
        # decayed counts: drafts that reached position j, and those accepted through position j;
        # the prior is the drafter's held-out acceptance when its checkpoint records one, else 0.5^j
        self.reached = [prior_weight] * max_k
        rates = list(prior_acceptance or [])
        self.accepted = [prior_weight * (rates[j] if j < len(rates) else prior ** (j + 1)) for j in range(max_k)]
        self.step_costs = StepCosts()
        self.draft_costs: dict[tuple[int, int], float] = {}
        self.chosen: dict[tuple[int, int], int] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(1, batch_size))))

    # --- what is measured ------------------------------------------------------------------------
    def set_step_costs(self, costs: dict[int, float]) -> None:
        """Target forward seconds per token count, measured at start-up."""
        self.step_costs = StepCosts(costs)

    def observe_acceptance(self, num_draft: int, num_accepted: int) -> None:
        """One verified draft of `num_draft` tokens of which the first `num_accepted` were accepted."""
        for j in range(min(num_draft, self.max_k)):
            self.reached[j] = self.reached[j] * self.decay + 1.0
            self.accepted[j] = self.accepted[j] * self.decay + (1.0 if num_accepted > j else 0.0)

    def observe_draft_time(self, batch_size: int, k: int, seconds: float) -> None:
        if k <= 0 or seconds < 0:
            return
        key = (self.bucket(batch_size), k)
        old = self.draft_costs.get(key)
        self.draft_costs[key] = seconds if old is None else 0.8 * old + 0.2 * seconds

    # --- the model ------------------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        """a_j for j = 1..K (monotone non-increasing)."""
        out, prev = [], 1.0
        for j in range(self.max_k):
            prev = min(prev, self.accepted[j] / self.reached[j])
            out.append(prev)
        return out

    def cost(self, tokens: int) -> float | None:
        """The measured step cost at `tokens` (StepCosts: piecewise linear, extrapolated)."""
        return self.step_costs(tokens) if self.step_costs else None

    def draft_cost(self, batch_size: int, k: int) -> float:
        if k == 0:
            return 0.0
        b = self.bucket(batch_size)
        if (b, k) in self.draft_costs:
            return self.draft_costs[(b, k)]
        known = [(kk, c) for (bb, kk), c in self.draft_costs.items() if bb == b]
        if known:
            kk, c = min(known, key=lambda x: abs(x[0] - k))
            return c * k / kk
        return 0.0

    def throughput(self, batch_size: int, k: int) -> float:
        """Modelled output tokens/s at this batch size with k drafts per request."""
        a = self.acceptance()
        expected = 1.0 + sum(a[:k])
        seconds = self.cost(batch_size * (1 + k)) + self.draft_cost(batch_size, k)
        return batch_size * expected / seconds

    def choose(self, batch_size: int) -> int:
        if not self.step_costs or batch_size <= 0:
            return self.max_k
        base = self.throughput(batch_size, 0)
        best = max(range(1, self.max_k + 1), key=lambda k: self.throughput(batch_size, k))
        k = best if self.throughput(batch_size, best) > base * (1 + self.margin) else 0
        key = (self.bucket(batch_size), k)
        self.chosen[key] = self.chosen.get(key, 0) + 1
        return k

    def table(self) -> dict:
        return {"acceptance": [round(x, 3) for x in self.acceptance()],
                "chosen_steps": {f"b{b}_k{k}": n for (b, k), n in sorted(self.chosen.items())},
                "draft_seconds": {f"b{b}_k{k}": round(c, 4) for (b, k), c in sorted(self.draft_costs.items())}}
