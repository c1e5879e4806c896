"""The host-built slot mapping of a step (cache_slots) against the tensor one (slots_for_positions)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from draftwise.layers.attention import cache_slots, slots_for_positions


@settings(max_examples=200, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]), data=st.data())
def test_cache_slots_equal_the_tensor_mapping(block_size, data):
    num_blocks = data.draw(st.integers(1, 12))
    block_ids = data.draw(st.lists(st.integers(0, 500), min_size=num_blocks, max_size=num_blocks, unique=True))
    start = data.draw(st.integers(0, num_blocks * block_size - 1))
    n = data.draw(st.integers(1, num_blocks * block_size - start))
    table = torch.tensor([block_ids])
    want = slots_for_positions(table, torch.zeros(n, dtype=torch.long), torch.arange(start, start + n), block_size)
    assert cache_slots(block_ids, start, n, block_size) == want.tolist()


def test_a_position_past_the_blocks_is_refused_not_mapped_elsewhere():
    with pytest.raises(IndexError):
        cache_slots([7, 3], 6, 4, 4)          # positions 6..9: 8 and 9 lie past the second block
