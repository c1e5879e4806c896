"""The hybrid drafter's per-request choice between its model drafter and its training-free one,
on hand-built acceptance and costs."""
from draftwise.spec_decode.allocation import best_allocation
from draftwise.spec_decode.drafting_seconds import DraftingSeconds
from draftwise.spec_decode.hybrid import choose_model_drafts


def _rate(step_seconds=0.010, per_token=0.0005):
    cost = lambda t: step_seconds + per_token * t          # noqa: E731
    return lambda accept, seconds: best_allocation(accept, len(accept), len(accept), cost, seconds)[1]


def test_a_cheap_model_drafts_where_the_training_free_draft_is_weak():
    chain = [0.9, 0.8, 0.7, 0.6]
    got = choose_model_drafts([[0.3], [0.95, 0.9, 0.85, 0.8, 0.75]], chain, _rate(), lambda m, k: 0.002 * m)[0]
    assert got == [True, False]


def test_a_model_dearer_than_its_gain_never_drafts():
    chain = [0.9, 0.8, 0.7, 0.6]
    # a 10 ms step: 3 expected tokens more are worth less than 40 ms of drafting
    assert choose_model_drafts([[0.3], []], chain, _rate(), lambda m, k: 0.040)[0] == [False, False]


def test_requests_that_want_no_draft_are_never_handed_to_the_model():
    assert choose_model_drafts([None, []], [0.9, 0.9], _rate(), lambda m, k: 0.0)[0] == [False, True]


def test_the_model_takes_the_requests_it_gains_most_on_first():
    chain = [0.9, 0.8, 0.7, 0.6]
    fast = [[0.5, 0.4], [], [0.6, 0.5, 0.4]]
    # drafting is cheap for one request, dear for more: only the biggest gain (the empty draft) pays
    seconds = lambda m, k: 0.001 if m == 1 else 0.050      # noqa: E731
    assert choose_model_drafts(fast, chain, _rate(), seconds)[0] == [False, True, False]
    assert choose_model_drafts(fast, chain, _rate(), lambda m, k: 0.0)[0] == [True, True, True]


def test_a_model_priced_per_pass_drafts_the_chain_length_that_pays():
    # a pass costs 4 ms on a 10 ms step: the 0.9-probable first token pays, the 0.3 tail does not
    chain = [0.9, 0.6, 0.3, 0.1]
    chosen, k = choose_model_drafts([[]], chain, _rate(), lambda m, k: 0.004 * k, lengths=(1, 2, 3, 4))
    assert chosen == [True] and k == 2
    assert choose_model_drafts([[]], chain, _rate(), lambda m, k: 0.004 * k)[1] == 4   # one length only


def test_drafting_seconds_are_marginal_and_borrow_the_nearest_measured_count():
    s = DraftingSeconds(weight=1.0)
    assert s.marginal(3) == 0.0                      # unmeasured: tried
    for m, seconds in ((0, 0.002), (1, 0.012), (8, 0.030)):
        s.observe(m, 1.0)                            # a shape's first call: warm-up, dropped
        s.observe(m, seconds)
    assert abs(s.marginal(1) - 0.010) < 1e-12
    assert abs(s.marginal(2) - 0.010) < 1e-12       # bucket 2 unmeasured: bucket 1 is nearest
    assert abs(s.marginal(7) - 0.028) < 1e-12       # 5-8 share a bucket
    assert abs(s.marginal(64) - 0.028) < 1e-12


def test_a_request_whose_catch_up_outweighs_its_gain_keeps_its_training_free_draft():
    """Two requests alike but for what the model must catch up on before drafting for them (spread
    over their remaining steps): only the one without goes to the model."""
    chain = [0.9, 0.8, 0.7, 0.6]
    got = choose_model_drafts([[0.3], [0.3]], chain, _rate(), lambda m, k: 0.002 * m, request_seconds=[0.050, 0.0])
    assert got[0] == [False, True]
    assert choose_model_drafts([[0.3], [0.3]], chain, _rate(), lambda m, k: 0.002 * m,
                               request_seconds=[0.0, 0.0])[0] == [True, True]


def _hybrid(catch_up=None):
    from types import SimpleNamespace
    from draftwise.spec_decode.hybrid import HybridProposer
    model = SimpleNamespace(method="draft_model", needs_aux_hidden_states=False, num_lookahead_tokens=5)
    if catch_up is not None:
        model.catch_up_seconds = catch_up
    return HybridProposer(model, SimpleNamespace(method="suffix"), 8)


def test_a_catch_up_is_spread_over_the_steps_a_request_has_left():
    from types import SimpleNamespace
    h = _hybrid(lambda inp, i: 0.4)
    req = lambda limit, done: SimpleNamespace(params=SimpleNamespace(max_tokens=limit), output_token_ids=[0] * done)  # noqa: E731
    inp = SimpleNamespace(requests=[req(400, 0), req(400, 396), req(None, 0), req(400, 0)],
                          want_draft=[True, True, True, False])
    chain = [1.0, 1.0, 1.0, 1.0]                      # 5 tokens a step with model drafts
    got = h._catch_up_per_step(inp, chain)
    assert abs(got[0] - 0.4 / 80) < 1e-12            # 400 tokens left: 80 steps
    assert abs(got[1] - 0.4) < 1e-12                 # 4 tokens left: this step pays it all
    assert got[2] == 0.0 and got[3] == 0.0           # no limit / no draft wanted
    assert _hybrid()._catch_up_per_step(inp, chain) is None   # a drafter without catch-up


def test_explorations_wait_until_the_last_ones_seconds_are_repaid():
    """With a step priced at 10 ms, an exploration costing 50 ms (a catch-up) is repaid by 500
    steps' 1 % share: none comes before, one comes after."""
    h = _hybrid()
    fast, chain = [[0.2]], [0.9, 0.9]
    explored = []
    for step in range(1200):
        if h._explored([False], fast, chain, 0.010) == [True]:
            explored.append(step)
            h._charge_exploration(0.050)
    assert explored[0] == h.EXPLORE_EVERY - 1
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    share = h.EXPLORE_SHARE * 0.010                   # the budget holds at most MAX_EXPLORE_EVERY shares
    assert gaps and all((0.050 - share * h.MAX_EXPLORE_EVERY) / share <= g <= 0.050 / share + 1 for g in gaps)
    assert _hybrid()._explored([False], fast, chain, None) == [False]          # no step costs: counts only
