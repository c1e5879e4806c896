"""Batch-aware draft allocation: how many of each request's drafted tokens the next step verifies.

A step verifies, for every running request, its pending tokens (one, in decode) followed by some
prefix of its draft, plus any prefill chunks the scheduler adds. With `a_ij` the probability that
node j of request i's draft is accepted (its whole path accepted), the step is expected to emit

    E(k) = D + sum_i sum_{j < k_i} a_ij          (D: requests that sample a token this step)

tokens at a cost of `cost(F + sum_i k_i)` seconds, F being the step's tokens before drafts. The
allocation picks the draft lengths k_i (0 included) that maximise E(k) / cost(...): expected
output tokens per second of the whole step. Within a draft `a_ij` is non-increasing (a node is
accepted only if its parent is), so for a given total N the best choice is the N most probable
nodes of the batch, taken as prefixes; the allocator sorts the nodes once and scans N. One code
path serves batch 1 (where verification is nearly free and long drafts pay) and batch 64 (where
every verified token costs about what a decoded one does and only near-certain drafts pay).

- `cost(T)`: the target's step cost at T tokens, measured at start-up (`StepCosts`, piecewise
  linear, extrapolated linearly past the largest measured size), plus the step's fixed overhead
  (scheduling, sampling, bookkeeping) learned online from the engine's measured step times.
- `a_ij`: the drafter's own estimate (suffix decoding's count-based path probability; model
  drafters' path probability; 1 where a drafter gives none) *calibrated online*: each node's
  acceptance given its parent's is counted per (drafter, position bucket, estimate bin) with
  exponential decay, starting from the estimate itself as a prior, and a node's acceptance is the
  product along its path - so a drafter never verified yet has its first nodes tried (an
  under-confident drafter would otherwise be cut before it could show its rate), an
  over-confident drafter is corrected within a few hundred drafts,
  a drafter without estimates learns its acceptance per position, and a depth rarely verified
  borrows the rate of the depth above it.

A draft the allocation cuts whole is not wasted: the scheduler *watches* it, comparing its tokens
with those the target goes on to emit, and the calibration counts the agreement as the acceptance
verification would have found (`watched_outcome`). Under greedy decoding the two are the same
event; under sampling a one-token-per-node draft (suffix decoding, greedy drafters) is accepted
with the target's probability of its token, the probability that the target samples it; for a
drafter that samples its own tokens agreement is the lower bound `sum q p` of `sum min(p, q)`,
so watching can only make such a drafter look worse than it is. This is how the allocation keeps
learning where it drafts nothing: every few skipped steps it has a couple of requests drafted
and watches them (an exploration), at the cost of their drafting and no verified row.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from draftwise.spec_decode.draft import Draft

NUM_BINS = 10                      # estimate bins: [0, 0.1), ..., [0.9, 1]
POSITION_BUCKETS = (0, 1, 2, 4, 8)  # node depth buckets: 0, 1, 2-3, 4-7, 8+
UNTRIED_RATE = (NUM_BINS - 0.5) / NUM_BINS   # a node of a drafter never verified: worth a try
AGREEMENT_DECAY = 0.7              # a request's agreement: decayed share of its drafts' first nodes right
AGREEMENT_LEVELS = 3


def agreement_level(agreement: float) -> int:
    """A request's recent drafts, by the decayed share whose first node was right: 0 seldom
    (< 0.4), 1 middling, 2 mostly (>= 0.75). Replaying suffix decoding over SmolLM2's MT-bench
    answers, a first node the drafter gave >= 0.8 was right 41 % / 56 % / 87 % of the time at
    these levels: the text a request is writing (a list, a repeated phrase, code) says more about
    its next draft than the drafter's own estimate."""
    return 0 if agreement < 0.4 else 1 if agreement < 0.75 else 2


def updated_agreement(agreement: float, first_node_right: bool) -> float:
    return AGREEMENT_DECAY * agreement + (1.0 - AGREEMENT_DECAY) * float(first_node_right)


def monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """A step-cost table made non-decreasing in the token count: each cost is capped by every cost
    measured at more tokens. More tokens never cost less, so a size that measured slower than a
    larger one met a busy spell of the machine; left in, it would make a draft of that size look
    dearer than a longer one and the allocation would cut drafts it should keep."""
    out, cap = [], float("inf")
    for t, c in reversed(points):
        cap = min(cap, c)
        out.append((t, cap))
    return out[::-1]


class StepCosts:
    """Seconds of one whole step by token count: `forward(T) + overhead`.

    The start-up table `measured` holds the target forward's measured seconds at a few token
    counts (one request, short context, cached per model and machine), interpolated
    piecewise-linearly and extrapolated linearly past the largest. A served step differs: its
    rows belong to many requests with long contexts, the machine may run slower than when the
    table was measured, and scheduling and sampling run around the forward. The engine reports
    every step's forward seconds and the rest of its wall time but drafting (weighed apart).

    Each table point learns its own ratio of served to table seconds from the steps near it
    (a step's weight shared between the two points around its size, as the interpolation shares
    it; decayed, so the last few dozen steps there count), pulled towards `scale` - the ratio over
    every served step - with the weight of `prior` steps; `forward(T)` interpolates the corrected
    points. A size the steps have not reached is priced at the table's cost times the ratio of the
    nearest size they have, and a point not served for a while drifts back to that (`forget` per
    step).

    Per point, because the allocation lives on the *shape* of the costs: a table measured during
    a busy spell (two tokens priced at twice one, where served steps show them level) kept the
    allocation from drafting for as long as the cache held it, and a batch whose steps alternate
    between long phases of 4 and of 8 tokens must price each size by its own steps. A size priced
    too cheap is tried and corrected by its own steps; one priced too dear is tried only by the
    allocation's explorations, and those now correct it too.

    `overhead` is the part of a step's other seconds that does not grow with the tokens it emits:
    the intercept of a decayed least-squares line through (tokens emitted, other seconds). A
    server's steps spend time per emitted token (detokenizing, streaming, the GIL shared with the
    HTTP side); priced as a fixed overhead, that time would look amortized by accepted drafts, and
    drafts would look cheaper than they are. A per-token cost adds the same to every allocation's
    seconds per token and changes no choice, so only the fixed part is priced."""

    PRICED_PAST_TABLE = 2     # steps up to this many times the largest measured size teach the table

    def __init__(self, points: dict[int, float] | None = None, decay: float = 0.97, point_decay: float = 0.95,
                 prior: float = 2.0, forget: float = 0.999):
        self.measured = monotone(sorted((int(t), float(c)) for t, c in (points or {}).items() if c > 0))
        self._points = list(self.measured)  # the table corrected by the served steps, non-decreasing
        self._stale = False                 # steps observed since `_points` was last worked out
        self.decay, self.point_decay, self.prior, self.forget = decay, point_decay, prior, forget
        self.scale, self.overhead = 1.0, 0.0
        self._sums = [0.0, 0.0, 0.0, 0.0]   # decayed: steps, table seconds, forward seconds, other seconds
        self._emitted = [0.0, 0.0, 0.0]     # decayed: tokens emitted, their squares, times other seconds
        self._near = [[0.0, 0.0] for _ in self.measured]   # per point, decayed: served seconds, table seconds

    @property
    def ratios(self) -> list[float]:
        """Each point's served / table seconds. A point the steps come near leans on the common
        `scale`; one they have hardly reached (under a step's worth of weight: the sizes past the
        batch that only long drafts would make) on the nearest point they have reached, whose
        contexts and batch it would share - priced at the common ratio instead, the size one past
        a batch of 32 at long contexts looked cheaper than the batch itself, the monotone cap
        lowered the batch's cost to it, and every draft token past the batch looked nearly free."""
        own = [(served + self.prior * c * self.scale) / (table + self.prior * c)
               for (_, c), (served, table) in zip(self.measured, self._near)]
        reached = [k for k, ((_, c), (_, table)) in enumerate(zip(self.measured, self._near)) if table >= c]
        if not reached:
            return own
        out = []
        for k, ((_, c), (served, table)) in enumerate(zip(self.measured, self._near)):
            if table >= c:
                out.append(own[k])
                continue
            nearest = own[min(reached, key=lambda j: (abs(j - k), j))]
            out.append((served + self.prior * c * nearest) / (table + self.prior * c))
        return out

    def __bool__(self) -> bool:
        return bool(self.measured)

    @property
    def points(self) -> list[tuple[int, float]]:
        """The table corrected by the served steps (worked out when asked, not at every step:
        a step that drafts nothing asks for none of it)."""
        if self._stale:
            self._points = monotone([(t, c * r) for (t, c), r in zip(self.measured, self.ratios)])
            self._stale = False
        return self._points

    def forward(self, tokens: int) -> float:
        return _interpolate(self.points, tokens)

    def __call__(self, tokens: int) -> float:
        return self.forward(tokens) + self.overhead

    def observe_step(self, tokens: int, forward_seconds: float, other_seconds: float,
                     emitted: int | None = None) -> None:
        """A served step of `tokens` tokens that emitted `emitted` (None: unknown): its forward took
        `forward_seconds`, everything else around it but drafting (scheduling, inputs, sampling,
        outputs) `other_seconds`."""
        if not self.measured or tokens <= 0 or forward_seconds <= 0:
            return
        table = _interpolate(self.measured, tokens)
        s, e, other = self._sums, self._emitted, max(0.0, other_seconds)
        x = float(tokens if emitted is None else emitted)
        for i in (0, 3):
            s[i] = s[i] * self.decay + (1.0 if i == 0 else other)
        for i, v in enumerate((x, x * x, x * other)):
            e[i] = e[i] * self.decay + v
        self.overhead = _intercept(s[0], e[0], e[1], s[3], e[2])
        if tokens > self.PRICED_PAST_TABLE * self.measured[-1][0]:
            # a prompt chunk far past the table (a 2,048-token prefill) runs its linears as large
            # matrix products, cheaper a token than the line extrapolated past the table: taught to
            # the largest point, it priced the decode batch's drafts at nearly nothing
            return
        for i, v in ((1, table), (2, forward_seconds)):
            s[i] = s[i] * self.decay + v
        self.scale = min(8.0, max(0.125, s[2] / s[1]))
        for near in self._near:
            near[0] *= self.forget
            near[1] *= self.forget
        for k, w in _point_weights(self.measured, tokens):
            near = self._near[k]
            near[0] = near[0] * self.point_decay + w * forward_seconds
            near[1] = near[1] * self.point_decay + w * table
        self._stale = True


def _intercept(n: float, sx: float, sxx: float, sy: float, sxy: float) -> float:
    """The intercept of the least-squares line through points with these (decayed) sums, kept
    within [0, mean y]; the mean y where x hardly varies."""
    mean_y = sy / n
    var = n * sxx - sx * sx
    if var <= 1e-9 * max(1.0, n * sxx):
        return mean_y
    slope = max(0.0, (n * sxy - sx * sy) / var)
    return min(mean_y, max(0.0, mean_y - slope * sx / n))


def _interpolate(pts: list[tuple[int, float]], tokens: int) -> float:
    """Piecewise-linear through `pts` (token count, seconds), linear past the last two points."""
    if not pts:
        return 0.0
    if tokens <= pts[0][0]:
        return pts[0][1]
    for (t0, c0), (t1, c1) in zip(pts, pts[1:]):
        if tokens <= t1:
            return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
    if len(pts) == 1:
        return pts[0][1] * tokens / pts[0][0]
    (t0, c0), (t1, c1) = pts[-2], pts[-1]
    return c1 + (c1 - c0) * (tokens - t1) / (t1 - t0)


def _point_weights(pts: list[tuple[int, float]], tokens: int) -> list[tuple[int, float]]:
    """The points a step of `tokens` tokens informs, weighted as the interpolation weighs them
    (past either end: the end point alone)."""
    if tokens <= pts[0][0]:
        return [(0, 1.0)]
    for i, ((t0, _), (t1, _)) in enumerate(zip(pts, pts[1:])):
        if tokens == t1:
            return [(i + 1, 1.0)]
        if tokens < t1:
            w = (tokens - t0) / (t1 - t0)
            return [(i, 1.0 - w), (i + 1, w)]
    return [(len(pts) - 1, 1.0)]


def watched_outcome(draft: Draft, emitted: list[int], complete: bool) -> tuple[Draft, int] | None:
    """What the tokens the target emitted after a draft was made (`emitted`, from the position of
    the draft's first node) tell of the unverified chain `draft`: (the nodes they decide, how many
    lead in agreement) - the verification verdict those tokens imply - or None while undecided.
    Decided at the first disagreement or when every node agreed; a request that ended (`complete`)
    before either decides only the nodes it reached, and those all agreed."""
    tokens, n = draft.token_ids, 0
    while n < len(tokens) and n < len(emitted) and tokens[n] == emitted[n]:
        n += 1
    if n == len(tokens) or n < len(emitted):
        return draft, n
    if complete and n:
        return draft.truncated(n), n
    return None


def _bin(p: float) -> int:
    return min(NUM_BINS - 1, max(0, int(p * NUM_BINS)))


def _position_bucket(depth: int) -> int:
    b = 0
    for i, start in enumerate(POSITION_BUCKETS):
        if depth >= start:
            b = i
    return b


@dataclass
class AcceptanceCalibration:
    """Online acceptance of draft nodes, learned as the *conditional* rate of a node given that its
    parent was accepted, by (drafter, depth bucket, estimate bin); a node's acceptance is the
    product of the conditional rates along its path. The estimate binned is the drafter's own
    conditional one (its path probability over its parent's). Counts decay, and shrinkage runs at
    two levels: a cell leans on its (drafter, depth bucket) group with the weight of
    `prior_weight` trials, and a group leans on the group one bucket shallower (the first bucket
    on the mean estimate the drafter gave its observed nodes, or the node's own before anything
    was observed).

    The rate is also conditioned on the drafting request's agreement level (`Draft.level`): the
    bin's rate times the level's factor, the (drafter, depth bucket, level) rate over the group's
    observed rate (the level's rate leaning on the group's with `prior_weight` trials). The
    levels partition the group's trials, so where every trial came from one level the factor is
    exactly 1: no observation is counted twice.

    Conditional rates are what a draft's depth changes least - a drafter whose first token is
    right a third of the time is right about as often again after a right one - so a depth the
    allocation has rarely let through (drafts cut short verify few deep nodes) inherits the
    shallower depth's rate instead of staying at whatever its first few trials said, and the
    allocation keeps trying it while its rate could pay."""
    prior_weight: float = 4.0
    decay: float = 0.998
    cells: dict = field(default_factory=dict)       # (source, depth bucket, bin) -> [accepted, trials]
    groups: dict = field(default_factory=dict)      # (source, depth bucket) -> [accepted, trials, sum of estimates]
    level_groups: dict = field(default_factory=dict)  # (source, depth bucket, level) -> [accepted, trials]
    observations: int = 0                           # chain drafts observed (what the counts have seen)
    # mean_chain by length, until the next observation (asked every step, changed by few)
    _mean_chains: dict = field(default_factory=dict, repr=False)

    def _group_rate(self, source: str, bucket: int, estimate: float) -> float:
        acc, seen, sum_p = self.groups.get((source, bucket), (0.0, 0.0, 0.0))
        if bucket == 0:
            prior = sum_p / seen if seen else estimate
        else:
            prior = self._group_rate(source, bucket - 1, estimate)
        return (acc + self.prior_weight * prior) / (seen + self.prior_weight)

    def rate(self, source: str, depth: int, estimate: float, level: int | None = None) -> float:
        """P(a node at `depth` is accepted | its parent was), for a drafter estimate of that
        conditional probability, from a request at agreement `level` (None: any request). A
        drafter with no verified node yet gets its first nodes tried: were its estimates low (a
        model unsure of itself), its drafts would be cut before any was verified and its rate
        never learned."""
        bucket = _position_bucket(depth)
        if bucket == 0 and (source, 0) not in self.groups:
            return max(estimate, UNTRIED_RATE)
        w = self.prior_weight
        group = self._group_rate(source, bucket, estimate)
        acc, seen = self.cells.get((source, bucket, _bin(estimate)), (0.0, 0.0))
        by_bin = (acc + w * group) / (seen + w)
        g_acc, g_seen = self.groups.get((source, bucket), (0.0, 0.0, 0.0))[:2]
        if level is None or g_acc <= 0:
            return by_bin
        observed = g_acc / g_seen
        acc, seen = self.level_groups.get((source, bucket, level), (0.0, 0.0))
        return min(1.0, by_bin * (acc + w * observed) / (seen + w) / observed)

    def estimates(self, draft: Draft) -> list[float]:
        """Calibrated probability that each node (creation order) is accepted: its parent's times
        its conditional rate, made non-increasing along the creation order (what the prefix
        truncation needs)."""
        out, prev = [], 1.0
        for j, (c, d) in enumerate(zip(_conditional_estimates(draft), _depths(draft.parents))):
            parent = draft.parents[j]
            p = (out[parent] if parent >= 0 else 1.0) * self.rate(draft.source, d, c, draft.level)
            prev = min(prev, p)
            out.append(prev)
        return out

    def observe(self, draft: Draft, num_accepted: int) -> None:
        """A verified chain draft of which the first `num_accepted` nodes were accepted: each node
        whose parent was accepted is a trial of its cell (accepted iff it lies before the first
        rejection); nodes after the rejection tell nothing about their own rate. Trees are not
        observed (their accepted path is not a prefix of the creation order)."""
        if draft is None or not len(draft) or not draft.is_chain:
            return
        self._mean_chains.clear()
        self.observations += 1
        for j, c in enumerate(_conditional_estimates(draft)[:num_accepted + 1]):
            bucket, hit = _position_bucket(j), 1.0 if j < num_accepted else 0.0
            cell = self.cells.setdefault((draft.source, bucket, _bin(c)), [0.0, 0.0])
            cell[0] = cell[0] * self.decay + hit
            cell[1] = cell[1] * self.decay + 1.0
            group = self.groups.setdefault((draft.source, bucket), [0.0, 0.0, 0.0])
            group[0] = group[0] * self.decay + hit
            group[1] = group[1] * self.decay + 1.0
            group[2] = group[2] * self.decay + c
            for lv in range(AGREEMENT_LEVELS):       # decayed alike: the levels partition the group
                counts = self.level_groups.setdefault((draft.source, bucket, lv), [0.0, 0.0])
                mine = lv == draft.level
                counts[0] = counts[0] * self.decay + (hit if mine else 0.0)
                counts[1] = counts[1] * self.decay + (1.0 if mine else 0.0)

    def chain(self, source: str, length: int) -> list[float]:
        """What `source`'s `length`-node chain is expected to have accepted, node by node: the
        product of its groups' conditional rates along the depths (UNTRIED_RATE per node before
        anything of `source` was observed)."""
        rates = [self._group_rate(source, b, UNTRIED_RATE) for b in range(len(POSITION_BUCKETS))]
        out, prev = [], 1.0
        for d in range(length):
            prev *= rates[_position_bucket(d)]
            out.append(prev)
        return out

    def mean_chain(self, length: int) -> list[float]:
        """What a drafter's `length`-node chain is expected to have accepted, node by node
        (non-increasing): the product of its groups' conditional rates along the depths, for the
        drafter with the best chain; UNTRIED_RATE per node conditional before anything is observed (so a
        new drafter is tried)."""
        best = self._mean_chains.get(length)
        if best is not None:
            return best
        best = []
        for src in {s for (s, _) in self.groups} or {None}:
            out = self.chain(src, length)
            if sum(out) > sum(best):
                best = out
        self._mean_chains[length] = best
        return best

    def table(self) -> dict:
        """Conditional rates by drafter / depth bucket / estimate bin (any request), as `rate`
        gives them, and by drafter / depth bucket / request agreement level."""
        out = {f"{s}/d{POSITION_BUCKETS[b]}/p{k / NUM_BINS:.1f}": round(self.rate(s, POSITION_BUCKETS[b],
                                                                                 (k + 0.5) / NUM_BINS), 3)
               for (s, b, k) in sorted(self.cells)}
        out.update({f"{s}/d{POSITION_BUCKETS[b]}/level{lv}": round(acc / seen, 3)
                    for (s, b, lv), (acc, seen) in sorted(self.level_groups.items()) if seen})
        return out


def _conditional_estimates(draft: Draft) -> list[float]:
    """The drafter's estimate of each node's acceptance given its parent's: its path probability
    over its parent's (1 where the drafter gives none)."""
    if draft.probs is None:
        return [1.0] * len(draft)
    out = []
    for p, parent in zip(draft.probs, draft.parents):
        up = draft.probs[parent] if parent >= 0 else 1.0
        out.append(min(1.0, max(0.0, float(p) / up)) if up > 0 else 0.0)
    return out


def _depths(parents: list[int]) -> list[int]:
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def allocate(accept: list[list[float]], fixed_tokens: int, sampled: float, cost, min_gain: float = 0.0) -> list[int]:
    """Draft lengths maximising expected emitted tokens per second of the step.

    accept: per request, the acceptance probability of each draft node in creation order
            (non-increasing); fixed_tokens: the step's tokens besides these drafts; sampled: the
            tokens the step emits without them (one per sampling request); cost(T): seconds of a
            step of T tokens; min_gain: drafts are kept only if they promise at least this share
            more tokens per second than the step without them.
    Returns k_i per request (a prefix length of its draft)."""
    return best_allocation(accept, fixed_tokens, sampled, cost, min_gain=min_gain)[0]


def best_allocation(accept: list[list[float]], fixed_tokens: int, sampled: float, cost,
                    extra_seconds: float = 0.0, min_gain: float = 0.0) -> tuple[list[int], float]:
    """`allocate`'s draft lengths and the expected emitted tokens per second they give, the step
    costing `extra_seconds` more than `cost` says (the drafting that made these drafts)."""
    nodes = sorted(((p, j, i) for i, row in enumerate(accept) for j, p in enumerate(row)),
                   key=lambda x: (-x[0], x[1], x[2]))
    base = sampled / (cost(fixed_tokens) + extra_seconds) if fixed_tokens else 0.0
    best_n, best_rate = 0, base
    expected = float(sampled)
    for n, (p, _, _) in enumerate(nodes, start=1):
        if p <= 0:
            break
        expected += p
        rate = expected / (cost(fixed_tokens + n) + extra_seconds)
        if rate > best_rate:
            best_n, best_rate = n, rate
    if best_n and best_rate < base * (1.0 + min_gain):
        best_n, best_rate = 0, base
    lengths = [0] * len(accept)
    for _, j, i in nodes[:best_n]:
        lengths[i] = max(lengths[i], j + 1)
    return lengths, best_rate


class _Verdict(NamedTuple):
    """The gate's last priced answer (`DraftAllocator._drafting_pays`)."""
    shape: tuple                 # (fixed tokens, sampling requests, decode tokens) of the step priced
    seen: int                    # the calibration's observations when it was priced
    left: int                    # further steps it holds
    pays: bool
    step_seconds: float          # the priced seconds of a step of that shape without drafts


class DraftAllocator:
    """The scheduler's draft allocation: calibration, step costs and the per-step choice."""

    EXPLORE_EVERY = 8
    MAX_EXPLORE_EVERY = 64
    EXPLORE_REQUESTS = 2                   # an exploring step drafts for this many requests at most
    # explorations spend at most this share of the serving time: each skipped step adds this share
    # of its priced seconds to a budget, and an exploration draws its drafting seconds from it (at
    # batch 4 an exploration every 8 steps drafted for two requests, ~0.25 ms each with their
    # pricing, beside 6 ms steps: ~1 % of the throughput, for drafts that did not pay there)
    EXPLORE_SHARE = 0.005
    # steps a "worth drafting or not" verdict holds for an unchanged step shape, unless the
    # calibration has taken in this many drafts since
    RECHECK_EVERY = 8
    # drafts must promise this share more tokens per second than the step without them: the cost
    # model and the calibration are each a few percent off at times (a server's calibration read
    # 9 % optimistic at concurrency 4; one engine's steps differ 2 % from another's), and a draft
    # within that of break-even is a coin flip that costs its drafting and host work
    MIN_GAIN = 0.03

    def __init__(self, costs: StepCosts, calibration: AcceptanceCalibration | None = None):
        self.costs = costs
        self.calibration = calibration or AcceptanceCalibration()
        self.steps = 0
        self.offered = 0
        self.kept = 0
        self.skipped = 0                   # steps whose drafting was skipped
        self._skips_in_row = 0
        self._explore_every = self.EXPLORE_EVERY
        self._exploring = False
        # which exploration made the drafts the last `choose` cut whole (numbered from 1; 0: none):
        # their watched outcome sets how many skipped steps pass before the next exploration
        self.explored = 0
        self._explorations = 0
        self._backed_off = 0               # the last exploration that doubled the interval
        self.watched = 0                   # drafts cut whole whose outcome the target's tokens decided
        self.watched_agreed = 0            # ... and their nodes that agreed with them
        self.explore_requests: int | None = None   # the next drafting step's request limit (None: all)
        # decayed mean of a step's drafting seconds per request drafted for: an exploring step
        # drafts for a couple of requests, a full one for the whole batch, and pricing the latter
        # at the former's seconds made drafting for 32 requests look as cheap as for two
        self.draft_seconds_per_request = 0.0
        self.longest_draft = 1             # nodes of the longest draft offered so far (at most 32)
        self._verdict: _Verdict | None = None
        self._pricing_seconds = 0.0        # the last `choose`'s own time, charged to the next drafting
        self._explore_budget = 0.0         # seconds explorations may still spend (EXPLORE_SHARE)

    def _credited(self, fixed_tokens: int, sampled: float, decode_tokens: int | None) -> float:
        """`sampled`, with the step's prefill credited at the plain decoding rate of its decode
        rows: prefill emits nothing now but is work the server needs, so a step carrying a prompt
        chunk must not make drafts look cheap against an artificially low tokens/s."""
        if decode_tokens and 0 < decode_tokens < fixed_tokens:
            return sampled * self.costs(fixed_tokens) / self.costs(decode_tokens)
        return sampled

    def worth_drafting(self, fixed_tokens: int, sampled: int, decode_tokens: int | None = None) -> bool:
        """Whether drafting for the next step can pay: every sampling request drafting a chain of
        the drafter's observed mean acceptance per depth (of the best length up to the longest
        draft offered) must raise the step's expected tokens per second by more than drafting
        for all of them costs (decayed mean of measured drafting seconds per request) - a drafter that costs about a target
        step per token pays only through long accepted chains. False skips the drafter for the
        step; allocation can only cut drafts further."""
        if not self.costs or sampled <= 0:
            return True
        pays = self._drafting_pays(fixed_tokens, sampled, decode_tokens)
        # a skipped step still drafts now and then, so the calibration keeps learning what drafts
        # are worth now (text turns repetitive, the batch shrinks, the first few drafts were
        # unlucky): after EXPLORE_EVERY skipped steps, backing off to MAX_EXPLORE_EVERY while the
        # explorations' drafts disagree with the target - for a couple of requests only, and
        # watched rather than verified where the allocation cuts them (the scheduler compares
        # them with the tokens emitted next), so an exploration costs their drafting alone - and
        # draws it from a budget that grows by EXPLORE_SHARE of every skipped step's seconds
        explore = False
        if not pays:
            cost = min(sampled, self.EXPLORE_REQUESTS) * self.draft_seconds_per_request
            share = self.EXPLORE_SHARE * self._verdict.step_seconds
            self._explore_budget = min(self._explore_budget + share, max(2.0 * cost, share))
            explore = self._skips_in_row + 1 >= self._explore_every and self._explore_budget >= cost
            if explore:
                self._explore_budget -= cost
        worth = pays or explore
        self._exploring = explore
        self.explore_requests = self.EXPLORE_REQUESTS if explore else None
        self._skips_in_row = 0 if worth else self._skips_in_row + 1
        self.skipped += not worth
        return worth

    def _drafting_pays(self, fixed_tokens: int, sampled: int, decode_tokens: int | None) -> bool:
        """`worth_drafting`'s price comparison. Its verdict holds for RECHECK_EVERY steps of the
        same shape unless the calibration has taken in RECHECK_EVERY drafts since: at batch 32 the
        answer stays no for a hundred steps, at batch 4 it sits near break-even with a draft
        verified every few steps, and pricing it every step was a measurable share of the host
        work `auto` adds to plain decoding (tens of microseconds of a 5.8 ms step at batch 4)."""
        shape = (fixed_tokens, sampled, decode_tokens)
        seen = self.calibration.observations
        v = self._verdict
        if v is not None and v.shape == shape and v.left > 0 and seen - v.seen < self.RECHECK_EVERY:
            self._verdict = v._replace(left=v.left - 1)
            return v.pays
        requests = sampled
        sampled = self._credited(fixed_tokens, sampled, decode_tokens)
        step_seconds = self.costs(fixed_tokens)
        base = sampled / step_seconds
        expected, with_one = float(sampled), 0.0
        for n, p in enumerate(self.calibration.mean_chain(self.longest_draft), start=1):
            if p < 0.01:                  # deeper nodes add under 1 % of a token each: stop pricing
                break
            expected += requests * p
            with_one = max(with_one, expected / (self.costs(fixed_tokens + requests * n)
                                                 + requests * self.draft_seconds_per_request))
        pays = with_one > base * (1.0 + self.MIN_GAIN)
        self._verdict = _Verdict(shape, seen, self.RECHECK_EVERY - 1, pays, step_seconds)
        return pays

    def step_rate(self, accept: list[list[float]], fixed_tokens: int, sampled: int, decode_tokens: int | None,
                  extra_seconds: float) -> float:
        """Expected emitted tokens per second of the next step if its drafts, with calibrated node
        acceptance `accept`, cost `extra_seconds` of drafting and are cut as `choose` cuts them."""
        sampled = self._credited(fixed_tokens, sampled, decode_tokens)
        return best_allocation(accept, fixed_tokens, sampled, self.costs, extra_seconds)[1]

    def observe_drafting(self, seconds: float, requests: int = 1) -> None:
        """A step spent `seconds` drafting for `requests` requests; the last `choose` (pricing the
        drafts it cut) is charged to it too: a step that drafts pays for both, and at batch 4
        pricing cost about half as much as drafting."""
        per_request = (seconds + self._pricing_seconds) / max(1, requests)
        self._pricing_seconds = 0.0
        self.draft_seconds_per_request += 0.1 * (per_request - self.draft_seconds_per_request)

    def choose(self, drafts: list[Draft | None], fixed_tokens: int, sampled: int,
               whole: list[Draft] = (), decode_tokens: int | None = None) -> list[int]:
        """Lengths to keep of each draft (0 for None); `whole` drafts are verified in full beside
        them (their tokens and expected accepted tokens are part of the step); `decode_tokens`:
        the step's decode rows, where the rest of `fixed_tokens` is prefill."""
        t0 = time.perf_counter()
        if self.costs:
            sampled = self._credited(fixed_tokens, sampled, decode_tokens)
        fixed_tokens += sum(len(d) for d in whole)
        sampled += sum(sum(self.calibration.estimates(d)) for d in whole)
        accept = [self.calibration.estimates(d) if d else [] for d in drafts]
        self.longest_draft = max([self.longest_draft] + [min(len(d), 32) for d in drafts if d])
        if not self.costs:
            lengths = [len(a) for a in accept]
        else:
            lengths = allocate(accept, fixed_tokens, sampled, self.costs, self.MIN_GAIN)
        if self._exploring:
            self._explorations += 1
        self.explored = self._explorations if self._exploring and not sum(lengths) else 0
        if self._exploring and sum(lengths):
            self._explore_every = self.EXPLORE_EVERY
        elif self._exploring and not any(accept):       # the drafter had nothing: nothing to watch
            self._explore_every = min(self.MAX_EXPLORE_EVERY, 2 * self._explore_every)
        self._exploring = False
        self.steps += 1
        self.offered += sum(len(a) for a in accept)
        self.kept += sum(lengths)
        self._pricing_seconds = time.perf_counter() - t0
        return lengths

    def observe(self, draft: Draft | None, num_accepted: int) -> None:
        """A verified draft of which the first `num_accepted` nodes were accepted."""
        self.calibration.observe(draft, num_accepted)

    def observe_watched(self, draft: Draft, num_agreed: int, exploration: int = 0) -> None:
        """A draft cut whole whose first `num_agreed` nodes the target went on to emit (of the
        nodes in `draft`: `watched_outcome`'s verdict); `exploration`: the exploration that made
        it (`explored` when it was cut; 0: none). An agreeing exploration draft brings the
        interval back to EXPLORE_EVERY; an exploration whose drafts disagree doubles it, once."""
        self.calibration.observe(draft, num_agreed)
        self.watched += 1
        self.watched_agreed += num_agreed
        if exploration and num_agreed:
            self._explore_every = self.EXPLORE_EVERY
        elif exploration > self._backed_off:
            self._backed_off = exploration
            self._explore_every = min(self.MAX_EXPLORE_EVERY, 2 * self._explore_every)

    def table(self) -> dict:
        return {"steps": self.steps, "steps_without_drafting": self.skipped, "draft_tokens_offered": self.offered,
                "draft_tokens_kept": self.kept, "drafts_watched": self.watched,
                "watched_tokens_agreed": self.watched_agreed,
                "drafting_ms_per_request": round(self.draft_seconds_per_request * 1000, 3),
                "step_cost_scale": round(self.costs.scale, 3),
                "step_cost_ratios": {t: round(f, 3) for (t, _), f in zip(self.costs.measured, self.costs.ratios)},
                "step_overhead_ms": round(self.costs.overhead * 1000, 3),
                "calibration": self.calibration.table()}
