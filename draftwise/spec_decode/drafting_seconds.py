"""Measured seconds of a drafter's work by the number of requests it drafts for."""
from __future__ import annotations


class DraftingSeconds:
    """Decayed mean seconds of a drafter's call (or pass) by the number of requests it drafts for
    (buckets 0, 1, 2, 3-4, 5-8, ...); `marginal(m)` is what drafting for m requests adds to a
    call that drafts for none (0 until measured: an unmeasured drafter is tried). A bucket's first
    observation is dropped: the first call of a shape pays one-off allocations."""

    def __init__(self, weight: float = 0.1):
        self.weight = weight
        self.means: dict[int, float] = {}
        self._seen: set[int] = set()

    @staticmethod
    def bucket(m: int) -> int:
        return 0 if m <= 0 else (m - 1).bit_length() + 1

    def observe(self, m: int, seconds: float) -> None:
        b = self.bucket(m)
        if b not in self._seen:
            self._seen.add(b)
            return
        old = self.means.get(b)
        self.means[b] = seconds if old is None else old + self.weight * (seconds - old)

    def mean(self, m: int) -> float:
        """The mean of m's bucket, else of the nearest measured bucket (0 where none is)."""
        measured = [b for b in self.means if b > 0]
        if not measured:
            return 0.0
        return self.means[min(measured, key=lambda x: (abs(x - self.bucket(m)), -x))]

    def marginal(self, m: int) -> float:
        """What a call for m requests takes over one for none (0 until measured)."""
        return max(0.0, self.mean(m) - self.means.get(0, 0.0))
