"""Batch-aware draft allocation (spec_decode/allocation.py): the choice is the optimum of its
model, the model's parts learn from what they observe, and the scheduler applies the choice."""
import itertools
import random

import pytest

from draftwise.spec_decode.allocation import (UNTRIED_RATE, AcceptanceCalibration, DraftAllocator, StepCosts,
                                              allocate)
from draftwise.spec_decode.draft import Draft


def _rate(accept, lengths, fixed, sampled, cost):
    expected = sampled + sum(sum(row[:k]) for row, k in zip(accept, lengths))
    return expected / cost(fixed + sum(lengths))


@pytest.mark.parametrize("seed", range(30))
def test_allocate_is_the_optimum_of_its_model(seed):
    rng = random.Random(seed)
    n_req = rng.randint(1, 4)
    accept = []
    for _ in range(n_req):
        row, p = [], 1.0
        for _ in range(rng.randint(0, 4)):
            p *= rng.uniform(0.2, 1.0)
            row.append(p)
        accept.append(row)
    knee, slope, base = rng.randint(1, 8), rng.uniform(0.2, 2.0), rng.uniform(0.5, 5.0)
    cost = lambda t: base + slope * max(0, t - knee)         # flat, then compute-bound   # noqa: E731
    fixed = sampled = n_req
    got = allocate(accept, fixed, sampled, cost)
    best = max(_rate(accept, ks, fixed, sampled, cost)
               for ks in itertools.product(*[range(len(r) + 1) for r in accept]))
    assert _rate(accept, got, fixed, sampled, cost) == pytest.approx(best)
    assert all(0 <= k <= len(r) for k, r in zip(got, accept))


def test_allocate_keeps_everything_when_verification_is_free_and_only_sure_drafts_when_not():
    accept = [[0.9, 0.6, 0.3], [0.5, 0.2], []]
    assert allocate(accept, 3, 3, lambda t: 1.0) == [3, 2, 0]
    # every token costs what a decoded one does: only drafts that are nearly certain pay
    assert allocate(accept, 3, 3, lambda t: float(t)) == [0, 0, 0]
    assert allocate([[0.99, 0.98]], 1, 1, lambda t: 1.0 + 0.01 * t) == [2]


def test_step_costs_interpolate_and_follow_the_served_steps():
    c = StepCosts({1: 0.010, 8: 0.017, 16: 0.030})
    assert c(4) == pytest.approx(0.013)
    assert c(32) == pytest.approx(0.056)            # extrapolated from the last two points
    for _ in range(200):                            # the served forward runs at twice the table's cost
        c.observe_step(8, 0.034, 0.002)
    assert c.scale == pytest.approx(2.0, rel=1e-2)
    assert c.overhead == pytest.approx(0.002, rel=1e-3)
    assert c(8) == pytest.approx(0.036, rel=1e-2)
    assert not StepCosts() and StepCosts()(5) == 0.0


def test_step_overhead_that_grows_with_emitted_tokens_is_not_priced_as_fixed():
    """A server step's other seconds: 1 ms fixed plus 0.5 ms per emitted token (streaming). Only
    the fixed millisecond is the overhead drafts amortize."""
    c = StepCosts({1: 0.010, 8: 0.017, 16: 0.030})
    for i in range(300):
        emitted = 8 + i % 7                          # accepted drafts: 8 to 14 tokens a step
        c.observe_step(8 + i % 7, 0.02, 0.001 + 0.0005 * emitted, emitted)
    assert c.overhead == pytest.approx(0.001, rel=1e-3)
    flat = StepCosts({1: 0.010, 8: 0.017, 16: 0.030})
    for _ in range(300):                             # every step emits the same: the mean
        flat.observe_step(8, 0.02, 0.003, 8)
    assert flat.overhead == pytest.approx(0.003, rel=1e-3)


def test_a_size_that_measured_dearer_than_a_larger_one_is_capped():
    # measured on a busy machine: 2 tokens met a slow spell and cost more than 4
    c = StepCosts({1: 0.0051, 2: 0.0085, 4: 0.0065, 8: 0.0096})
    assert c.points == [(1, 0.0051), (2, 0.0065), (4, 0.0065), (8, 0.0096)]
    assert all(c(t) <= c(t + 1) for t in range(1, 12))
    # with the slow spell left in, a one-node draft would have looked dearer than it is
    assert allocate([[0.4]], 1, 1, c) == [1]
    assert allocate([[0.4]], 1, 1, lambda t: {1: 0.0051, 2: 0.0085}[t]) == [0]


def test_served_steps_correct_a_table_measured_during_a_busy_spell():
    # cached at start-up while the machine was busy: more than one token priced at ~2x one
    busy = {1: 4.4e-3, 2: 7.7e-3, 4: 9.6e-3, 8: 14.6e-3}
    quiet = {1: 3.5e-3, 2: 3.6e-3, 3: 3.8e-3, 4: 4.0e-3, 8: 5.5e-3}
    c = StepCosts(busy)
    assert allocate([[0.4]], 1, 1, c) == [0]        # a one-node draft looks too dear to verify
    for i in range(400):                            # served at 1.2x the quiet cost: decode steps,
        t = 3 if i % 10 == 9 else 1                 # now and then an exploring step of 3 tokens
        c.observe_step(t, 1.2 * quiet[t], 0.0)
    assert c(1) == pytest.approx(1.2 * quiet[1], rel=0.05)
    assert c(3) == pytest.approx(1.2 * quiet[3], rel=0.15)     # few steps there: the prior still pulls
    assert c(2) / c(1) < 1.15
    assert allocate([[0.4]], 1, 1, c) == [1]
    # a size the steps never reached: the table's cost at the ratio of the nearest size they did
    # (nearer the quiet machine's cost than the served steps' common ratio would price it)
    ratios = c.ratios
    assert c.forward(8) == pytest.approx(ratios[2] * busy[8], rel=0.05)
    assert abs(c.forward(8) - 1.2 * quiet[8]) < abs(c.scale * busy[8] - 1.2 * quiet[8])


def test_each_size_is_priced_by_its_own_steps_across_phases():
    # a batch of 4 drafting in phases: 8-token steps for a while, then 4-token ones
    c = StepCosts({1: 3.8e-3, 2: 3.9e-3, 4: 4.9e-3, 8: 6.5e-3, 16: 11.4e-3})
    served = {4: 6.5e-3, 8: 10.7e-3}                # 8 tokens cost 1.65x 4 (the table says 1.33x)
    for t in [8] * 100 + [4] * 100 + [8] * 50:
        c.observe_step(t, served[t], 0.0)
    assert c.forward(8) / c.forward(4) == pytest.approx(10.7 / 6.5, rel=0.05)
    assert c.forward(8) == pytest.approx(10.7e-3, rel=0.02)
    # a size no step reached: the table's cost at the ratio of the nearest size served (8)
    assert c.forward(16) / c.measured[-1][1] == pytest.approx(10.7 / 6.5, rel=0.05)


def test_sizes_past_the_batch_are_priced_like_the_batch():
    """A batch of 32 at long contexts is served at ~1.9x the start-up table (one request, short
    context); sizes past it are reached only by the odd draft. Priced at the common ratio (pulled
    down by the cheaper steps of the batch's start), 33 tokens looked cheaper than 32, the monotone
    cap lowered 32 to it and the first draft tokens past the batch looked free."""
    table = {1: 4e-3, 16: 12e-3, 32: 20e-3, 33: 21e-3, 64: 38e-3}
    c = StepCosts(table)
    for t in [16] * 100 + [32] * 12:                 # short contexts first: 16 rows at 1.2x the table
        c.observe_step(t, (1.2 if t == 16 else 1.9) * table[t], 0.0)
    assert c.scale < 1.7
    assert c.forward(32) == pytest.approx(1.9 * table[32], rel=0.05)
    assert c.forward(33) >= c.forward(32) + 0.5 * 1.9 * (table[33] - table[32])
    assert c.forward(64) == pytest.approx(1.9 * table[64], rel=0.05)


def test_prompt_chunks_far_past_the_table_do_not_price_the_drafts():
    """A server's batch fills with a 2,048-token prompt chunk or two (large matrix products: 0.9x
    the line extrapolated past the table) before it decodes 32 requests at 1.9x the table. Taught
    to the largest point, the chunks priced 61 draft tokens past the batch at 3 ms of a 41 ms step."""
    table = {1: 4e-3, 16: 12e-3, 32: 20e-3, 33: 21e-3, 64: 38e-3}
    c = StepCosts(table)
    c.observe_step(2048, 0.9 * c.forward(2048), 0.0)
    c.observe_step(1635, 0.9 * c.forward(1635), 0.0)
    for _ in range(10):
        c.observe_step(32, 1.9 * table[32], 0.0)
    marginal = (c.forward(93) - c.forward(32)) / 61
    assert marginal == pytest.approx(1.9 * (table[64] - table[32]) / 32, rel=0.1)
    assert c.scale == pytest.approx(1.9, rel=0.01)


def test_calibration_learns_an_over_confident_drafter():
    cal = AcceptanceCalibration()
    d = Draft.chain([1, 2, 3], "suffix", [0.95, 0.9, 0.9])
    assert cal.estimates(d)[0] == pytest.approx(0.95)
    for _ in range(300):
        cal.observe(d, 0)                           # the first node is never accepted
    est = cal.estimates(d)
    assert est[0] < 0.05 and est == sorted(est, reverse=True)
    # a drafter without estimates learns its acceptance per position
    e = Draft.chain([4, 5], "ngram")
    for i in range(400):
        cal.observe(e, 1 if i % 2 else 2)           # the first always accepted, the second half the time
    a0, a1 = cal.estimates(e)
    assert a0 > 0.9 and 0.4 < a1 < 0.6


def test_a_drafter_never_verified_has_its_first_nodes_tried():
    """A drafter unsure of itself (a draft model's flat distribution) would be cut at every step if
    its own estimates were trusted before any of its nodes was verified: its rate would never be
    learned. Its first node is tried until one is; then its cells learn from what was verified."""
    cal = AcceptanceCalibration()
    d = Draft.chain([1, 2, 3], "draft_model", [0.02, 0.0004, 0.00001])
    est = cal.estimates(d)
    assert allocate([est], 1, 1, lambda t: 1.0 + 0.1 * t) == [1]
    for _ in range(20):
        cal.observe(d, 3)                           # every node accepted
    est = cal.estimates(d)
    assert est[0] > 0.7 and est[2] > 0.3
    assert allocate([est], 1, 1, lambda t: 1.0 + 0.1 * t) == [3]
    # another drafter's verified nodes do not make this one tried
    assert cal.estimates(Draft.chain([4], "suffix", [0.02]))[0] == pytest.approx(UNTRIED_RATE)


def test_a_depth_rarely_verified_borrows_the_rate_of_the_depth_above():
    cal = AcceptanceCalibration(decay=1.0)
    one = Draft.chain([1], "suffix", [0.7])
    two = Draft.chain([1, 2], "suffix", [0.7, 0.5])
    for i in range(300):                            # one-node drafts: a third accepted
        cal.observe(one, 1 if i % 3 == 0 else 0)
    for _ in range(2):                              # two unlucky two-node drafts: the second rejected
        cal.observe(two, 1)
    a0, a1 = cal.estimates(two)
    assert a0 == pytest.approx(1 / 3, abs=0.02)
    # the second node's rate given the first: the first depth's third, pulled down only a little
    # by two misses, not zero - so the allocation keeps trying second nodes while they could pay
    assert 0.1 < a1 / a0 < 1 / 3
    # counted only where the parent was accepted: a rejected first node says nothing of the second
    before = dict(cal.groups)
    cal.observe(two, 0)
    assert cal.groups[("suffix", 1)] == before[("suffix", 1)]


def test_drafting_is_skipped_where_it_cannot_pay_but_still_explored():
    al = DraftAllocator(StepCosts({1: 0.001, 64: 0.064}))      # compute-bound: a token costs a token
    d = Draft.chain([1], "suffix", [0.5])
    for _ in range(300):
        al.observe(d, 0)
    decisions, limits = [], []
    for _ in range(16):
        decisions.append(al.worth_drafting(16, 16))
        limits.append(al.explore_requests)
    assert decisions.count(True) == 16 // DraftAllocator.EXPLORE_EVERY
    # an exploring step drafts for a couple of the 16 requests, not all
    assert [lim for d, lim in zip(decisions, limits) if d] == [DraftAllocator.EXPLORE_REQUESTS] * 2
    assert all(lim is None for d, lim in zip(decisions, limits) if not d)
    # where the calibration cuts an exploration's drafts, nothing of them is verified: they are
    # watched (the scheduler compares them with the tokens the target emits next) and explorations
    # whose drafts disagree back off: 8, 16, 32, ... skipped steps
    al2 = DraftAllocator(StepCosts({1: 0.001, 64: 0.064}))
    for _ in range(300):
        al2.observe(d, 0)
    explored = []
    two = Draft.chain([1, 2, 3], "suffix", [0.5, 0.25, 0.1])
    for step in range(8 + 16 + 32 + 64 + 64):
        if al2.worth_drafting(16, 16):
            explored.append(step)
            drafts = [two] * DraftAllocator.EXPLORE_REQUESTS + [None] * 14
            assert al2.choose(drafts, 16, 16) == [0] * 16 and al2.explored
            for _ in range(DraftAllocator.EXPLORE_REQUESTS):
                al2.observe_watched(two, 0, al2.explored)
    assert explored == [7, 7 + 16, 7 + 16 + 32, 7 + 16 + 32 + 64, 7 + 16 + 32 + 64 + 64]
    assert al2.kept == 0 and al2.watched == 2 * len(explored)
    cheap = DraftAllocator(StepCosts({1: 0.010, 64: 0.011}))   # memory-bound: verification is free
    assert all(cheap.worth_drafting(16, 16) for _ in range(16))
    assert cheap.explore_requests is None                      # drafting that pays drafts for all


def test_a_drafter_whose_first_drafts_were_rejected_is_drafting_again_once_its_explorations_agree():
    # verification costs: 2 rows 1.5x one, 3 rows 2x (a compute-bound CPU core): a first node pays
    # only above ~0.5 acceptance. Two unlucky first drafts (a warm-up on a meaningless prompt) put
    # the calibrated rate below that, so no step drafts; the explorations' watched drafts, which
    # the target's tokens go on to agree with, must bring it back
    al = DraftAllocator(StepCosts({1: 0.006, 2: 0.009, 4: 0.015, 8: 0.027}))
    low = Draft.chain([5, 6], "suffix", [0.25, 0.1])
    al.choose([low], 1, 1)
    al.observe(low, 0)
    al.observe(low, 0)
    chain = Draft.chain([1, 2, 3, 4], "suffix", [0.3, 0.15, 0.1, 0.05])   # under-confident estimates
    kept, watched = {}, []
    for step in range(200):
        if not al.worth_drafting(1, 1):
            continue
        (k,) = al.choose([chain], 1, 1)
        if k:
            kept[step] = k
            al.observe(chain.truncated(k), k)          # the text is repetitive: every node accepted
        else:
            watched.append(step)
            al.observe_watched(chain, 4, al.explored)
    assert watched[0] == DraftAllocator.EXPLORE_EVERY - 1
    # agreeing explorations keep the interval short until the calibration pays by itself, without
    # verifying a node; within 50 steps every step drafts the whole chain
    assert not [s for s in kept if s < watched[-1]]
    assert all(kept.get(step) == 4 for step in range(50, 200))


def test_a_watched_draft_is_decided_by_the_tokens_the_target_emits():
    from draftwise.spec_decode.allocation import watched_outcome
    d = Draft.chain([4, 5, 6, 7], "suffix", [0.9, 0.8, 0.7, 0.6])
    assert watched_outcome(d, [], False) is None
    assert watched_outcome(d, [4, 5], False) is None                 # agreeing so far: undecided
    assert watched_outcome(d, [4, 9], False) == (d, 1)               # node 1 would be rejected
    assert watched_outcome(d, [9], False) == (d, 0)
    assert watched_outcome(d, [4, 5, 6, 7], False) == (d, 4)         # every node accepted
    # a request that ended after two agreeing tokens decides those two nodes only
    cut, n = watched_outcome(d, [4, 5], True)
    assert cut.token_ids == [4, 5] and n == 2
    assert watched_outcome(d, [], True) is None


def test_a_request_limited_drafting_step_takes_the_requests_in_turn():
    from draftwise.worker.model_runner import _some_of
    want = [True, False, True, True, True]
    assert _some_of(want, 2, 0) == [True, False, True, False, False]
    assert _some_of(want, 2, 1) == [False, False, True, True, False]
    assert _some_of(want, 2, 3) == [True, False, False, False, True]


def test_scheduler_verifies_the_allocated_part_of_each_draft():
    from draftwise.config import EngineConfig
    from draftwise.engine.request import Request
    from draftwise.engine.scheduler import Scheduler
    from draftwise.sampling_params import SamplingParams
    cfg = EngineConfig(model="x", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=4)
    sched = Scheduler(cfg, 64, 0, DraftAllocator(StepCosts({1: 1.0, 4: 1.0, 8: 1.6, 16: 3.0})))
    reqs = [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=8)) for i in range(2)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    for s in out.scheduled:                              # prefill done, one token sampled each
        s.request.num_computed_tokens = 3
        s.request.append_output(7)
    reqs[0].draft = Draft.chain([5, 6, 7, 8], "suffix", [0.97, 0.95, 0.4, 0.1])
    reqs[1].draft = Draft.chain([9, 9], "suffix", [0.3, 0.1])
    sched.draft_allocator.calibration.groups[("suffix", 0)] = [0.0, 0.0, 0.0]   # tried: estimates stand
    out = sched.schedule()
    by_id = {s.request.request_id: s for s in out.scheduled}
    assert by_id["0"].num_draft_tokens == 2 and by_id["0"].token_ids == [7, 5, 6]
    assert by_id["1"].num_draft_tokens == 0 and by_id["1"].draft is None


def test_seeded_sampled_requests_verify_whole_drafts():
    """Their drafts decide the random numbers they draw: allocation must not depend on timing."""
    from draftwise.config import EngineConfig, SpeculativeConfig
    from draftwise.engine.request import Request
    from draftwise.engine.scheduler import Scheduler
    from draftwise.sampling_params import SamplingParams
    cfg = EngineConfig(model="x", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                       speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    sched = Scheduler(cfg, 64, 0, DraftAllocator(StepCosts({1: 1.0, 64: 64.0})))   # drafts never pay
    seeded = Request("s", [1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0, seed=7))
    plain = Request("p", [1, 2, 3], SamplingParams(max_tokens=8, temperature=1.0))
    for r in (seeded, plain):
        sched.add(r)
    for s in sched.schedule().scheduled:
        s.request.num_computed_tokens = 3
        s.request.append_output(7)
    seeded.draft = Draft.chain([5, 6, 7], "ngram")
    plain.draft = Draft.chain([5, 6, 7], "ngram")
    assert sched.must_draft()
    by_id = {s.request.request_id: s for s in sched.schedule().scheduled}
    assert by_id["s"].num_draft_tokens == 3 and by_id["p"].num_draft_tokens == 0


def test_a_prefill_chunk_in_the_step_does_not_make_drafts_look_cheap():
    """Prefill emits nothing now: without crediting it, a step carrying a prompt chunk has a low
    tokens/s and any draft seems to raise it."""
    al = DraftAllocator(StepCosts({1: 0.002, 64: 0.065, 128: 0.129}))     # 1 ms a token + 1 ms
    d = [Draft.chain([1], "ngram", [0.5])] * 4
    for _ in range(500):
        al.observe(d[0], 0 if _ % 2 else 1)                                # accepted half the time
    assert al.choose(d, 4, 4) == [0] * 4                                   # decode alone: no
    assert al.choose(d, 64, 4, decode_tokens=4) == [0] * 4                 # with 60 prompt tokens: still no
    assert al.choose(d, 64, 4) == [1] * 4                                  # (uncredited, it would draft)


def test_an_expensive_drafter_pays_through_long_accepted_chains():
    """A drafter that costs more than a target step: one node never pays for it, an accepted chain
    of four does (a draft model); the same drafter with poor acceptance is skipped."""
    costs = {1: 0.031, 2: 0.033, 4: 0.039, 8: 0.069}            # the 1.5B target at batch 1
    good = DraftAllocator(StepCosts(costs))
    d = Draft.chain([1, 2, 3, 4], "draft_model", [0.95, 0.9, 0.85, 0.8])
    assert good.choose([d], 1, 1) == [4]
    good.observe_drafting(0.3)
    for _ in range(200):
        good.observe_drafting(0.045)
        good.observe(d, 4)
    assert good.worth_drafting(1, 1)
    poor = DraftAllocator(StepCosts(costs))
    poor.choose([d], 1, 1)
    for _ in range(200):
        poor.observe_drafting(0.045)
        poor.observe(d, 0)
    assert not poor.worth_drafting(1, 1)


def test_the_mean_chain_asked_every_step_follows_each_new_observation():
    cal = AcceptanceCalibration()
    d = Draft.chain([1, 2, 3], "suffix", [0.9, 0.8, 0.7])
    before = cal.mean_chain(3)
    assert before == [pytest.approx(UNTRIED_RATE ** (i + 1)) for i in range(3)]
    assert cal.mean_chain(3) == before                 # asked again, nothing observed: the same
    for _ in range(50):
        cal.observe(d, 0)
    after = cal.mean_chain(3)
    assert after[0] < 0.2 < before[0]
    assert after == AcceptanceCalibration(cells=cal.cells, groups=cal.groups).mean_chain(3)


def test_drafting_is_priced_per_request_it_drafts_for():
    """Drafting seconds learned from exploring steps (two requests) are not the price of drafting
    for a batch of 32: at 1 ms a request, drafts that pay at batch 2 do not pay at batch 32."""
    al = DraftAllocator(StepCosts({1: 0.010, 32: 0.016, 64: 0.022, 128: 0.034}))
    d = Draft.chain([1, 2], "suffix", [0.9, 0.8])
    for _ in range(100):
        al.observe(d, 2)                            # accepted: drafting would pay were it free
        al.observe_drafting(0.002, 2)               # an exploring step: two requests, 1 ms each
    assert al.worth_drafting(2, 2)
    assert not al.worth_drafting(32, 32)


def test_a_request_whose_recent_drafts_were_right_gets_its_next_nodes_rated_higher():
    """The same drafter estimate from a request whose drafts keep being right and from one whose
    drafts keep being wrong: the calibration tells them apart by the request's agreement level,
    and a group observed at one level only is not moved by the level (no trial counted twice)."""
    from draftwise.spec_decode.allocation import agreement_level, updated_agreement
    cal = AcceptanceCalibration(decay=1.0)
    for i in range(200):
        right = Draft.chain([1], "suffix", [0.9], level=2)
        wrong = Draft.chain([1], "suffix", [0.9], level=0)
        cal.observe(right, 1 if i % 10 else 0)       # 90 % right
        cal.observe(wrong, 1 if i % 10 == 0 else 0)  # 10 % right
    high, = cal.estimates(Draft.chain([1], "suffix", [0.9], level=2))
    low, = cal.estimates(Draft.chain([1], "suffix", [0.9], level=0))
    middling, = cal.estimates(Draft.chain([1], "suffix", [0.9], level=1))
    assert high == pytest.approx(0.9, abs=0.03) and low == pytest.approx(0.1, abs=0.03)
    assert middling == pytest.approx(0.5, abs=0.03)           # no trials: the bin's rate
    one = AcceptanceCalibration(decay=1.0)
    for i in range(200):
        one.observe(Draft.chain([1], "suffix", [0.9], level=2), 1 if i % 2 else 0)
    assert one.rate("suffix", 0, 0.9, 2) == pytest.approx(one.rate("suffix", 0, 0.9))
    # a request's level follows its drafts' first nodes
    a = 0.5
    for _ in range(5):
        a = updated_agreement(a, True)
    assert agreement_level(a) == 2 and agreement_level(updated_agreement(0.5, False)) == 0


def test_a_verdict_is_not_priced_again_until_the_shape_or_the_calibration_moves():
    """At batch 32 drafting stays unprofitable for a hundred steps, and at batch 4 it sits near
    break-even with drafts verified every few steps: the price comparison runs once per
    RECHECK_EVERY steps of an unchanged shape, explorations keep their cadence, and another shape
    or RECHECK_EVERY drafts taken in by the calibration price it afresh."""
    priced = []

    class Counted(StepCosts):
        def __call__(self, tokens):
            priced.append(tokens)
            return super().__call__(tokens)

    al = DraftAllocator(Counted({1: 0.001, 64: 0.064}))          # a token costs a token: drafts never pay
    d = Draft.chain([1, 2], "suffix", [0.5, 0.25])
    for _ in range(50):
        al.observe(d, 0)
    answers = []
    for _ in range(2 * DraftAllocator.RECHECK_EVERY):
        answers.append(al.worth_drafting(32, 32))
    pricings = sum(1 for t in priced if t == 32)
    assert pricings == 2                                           # once per RECHECK_EVERY steps
    assert answers.count(True) == 2 and answers[DraftAllocator.EXPLORE_EVERY - 1]   # explorations as before
    al.worth_drafting(32, 32)                                      # the third pricing: a fresh verdict
    priced.clear()
    al.observe(d, 0)
    al.worth_drafting(32, 32)
    assert 32 not in priced                                        # one more draft: the verdict holds
    for _ in range(DraftAllocator.RECHECK_EVERY):
        al.observe(d, 0)
    al.worth_drafting(32, 32)
    assert 32 in priced                                            # the calibration moved: priced afresh
    priced.clear()
    al.worth_drafting(31, 31)
    assert 31 in priced                                            # another shape: priced afresh


def test_a_yes_holds_too_and_drafting_is_charged_for_its_pricing():
    """A step shape where drafting pays keeps its yes for RECHECK_EVERY steps (batch 1 prices it
    once, not every step), and what `choose` spent pricing drafts is charged to drafting: with
    pricing as dear as a target step, drafting for one request no longer pays."""
    priced = []

    class Counted(StepCosts):
        def __call__(self, tokens):
            priced.append(tokens)
            return super().__call__(tokens)

    al = DraftAllocator(Counted({1: 0.010, 2: 0.0101, 4: 0.0103, 8: 0.0106}))   # rows nearly free
    d = Draft.chain([1, 2, 3], "suffix", [0.9, 0.8, 0.7])
    for _ in range(50):
        al.observe(d, 3)
    assert all(al.worth_drafting(1, 1) for _ in range(DraftAllocator.RECHECK_EVERY))
    assert sum(1 for t in priced if t == 1) == 1                   # priced once for the whole run of yeses
    al._pricing_seconds = 0.05                                     # a `choose` that took 50 ms
    al.observe_drafting(0.0, 1)
    assert al.draft_seconds_per_request == pytest.approx(0.005)    # decayed mean: 0.1 of the new 50 ms
    for _ in range(30):
        al._pricing_seconds = 0.05
        al.observe_drafting(0.0, 1)
    al._verdict = None
    assert not al._drafting_pays(1, 1, 1)                          # drafting now costs more than it saves
    lengths = al.choose([d], 1, 1)
    assert lengths == [3] and al._pricing_seconds > 0              # choose times itself


def test_explorations_spend_at_most_their_share_of_the_serving_time():
    """Where drafting does not pay, explorations draw their drafting seconds from a budget of
    EXPLORE_SHARE of the skipped steps' seconds: dear drafting beside short steps explores less
    often than every EXPLORE_EVERY steps, free drafting as often as before."""
    def explorations(draft_seconds: float, steps: int = 800) -> int:
        al = DraftAllocator(StepCosts({1: 0.001, 64: 0.064}))      # a token costs a token: drafts never pay
        d = Draft.chain([1, 2], "suffix", [0.5, 0.25])
        for _ in range(50):
            al.observe(d, 0)
        for _ in range(100):
            al.observe_drafting(2 * draft_seconds, 2)
        return sum(al.worth_drafting(4, 4) for _ in range(steps))

    free = explorations(0.0)
    assert free == 800 // DraftAllocator.EXPLORE_EVERY             # the cadence alone
    dear = explorations(0.00025)                                   # 0.5 ms an exploration beside 4 ms steps
    spent = dear * 2 * 0.00025
    assert 0 < dear < free / 2
    assert spent <= DraftAllocator.EXPLORE_SHARE * 800 * 0.004 + 2 * 2 * 0.00025
