"""The Draft type: chains as degenerate trees, cuts that keep parents, validation."""
import pytest

from draftwise.spec_decode.draft import Draft


def test_chain_and_tree_shapes():
    c = Draft.chain([5, 6, 7], "ngram")
    assert c.is_chain and c.parents == [-1, 0, 1] and len(c) == 3 and c.expected_accepted == 3.0
    t = Draft([5, 6, 7], [-1, -1, 0], "suffix", [0.5, 0.25, 0.5])
    assert not t.is_chain and t.expected_accepted == pytest.approx(1.25)
    assert not Draft.chain([], "ngram")                     # an empty draft is falsy


def test_truncation_keeps_a_valid_draft_and_rebuilds_the_plan():
    t = Draft([5, 6, 7, 8], [-1, -1, 0, 2], "suffix", [0.5, 0.25, 0.5, 0.4])
    tree = t.verification_tree(42)
    assert tree.token_ids == [42, 5, 6, 7, 8] and tree.parents == [-1, 0, 0, 1, 3]
    cut = t.truncated(3)
    assert cut.token_ids == [5, 6, 7] and cut.parents == [-1, -1, 0] and cut.probs == [0.5, 0.25, 0.5]
    assert cut.verification_tree(42).token_ids == [42, 5, 6, 7]
    assert t.truncated(10) is t and len(t.truncated(0)) == 0


def test_parents_must_come_first():
    with pytest.raises(ValueError, match="parents"):
        Draft([1, 2], [-1, 1], "suffix")
    with pytest.raises(ValueError, match="parents"):
        Draft([1, 2], [-1], "suffix")
