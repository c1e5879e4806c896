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
