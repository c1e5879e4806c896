"""The KV pool's tensors: zeroed, writable, contiguous, and alive as long as any view of them."""
import gc

import torch

from draftwise.worker.kv_cache import HUGE_PAGE, KVCache, pool_zeros


def test_a_pool_is_zeroed_writable_and_outlives_its_owner():
    shape = (3, 2, HUGE_PAGE // 128, 2, 32)                 # bf16: above the huge-page size
    t = pool_zeros(shape, torch.bfloat16, "cpu")
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    t[1, 0, 5] = 2.5
    view = t[1, 0]
    del t
    gc.collect()
    assert view[5].eq(2.5).all() and view.sum().item() == 2.5 * 64


def test_small_pools_and_other_dtypes_are_plain_zeros():
    for dtype in (torch.float32, torch.float16):
        t = pool_zeros((2, 4, 8), dtype, "cpu")
        assert t.dtype == dtype and t.shape == (2, 4, 8) and not t.any()


def test_layers_of_one_shape_share_the_pool():
    cache = KVCache(num_blocks=4096, block_size=16, layer_specs=[(2, 32)] * 3 + [(1, 64)],
                    dtype=torch.bfloat16, device="cpu")
    k0, v0 = cache.layer(0)
    k2, _ = cache.layer(2)
    assert k0.shape == (4096 * 16, 2, 32) and k0.untyped_storage().data_ptr() == k2.untyped_storage().data_ptr()
    assert cache.layer(3)[0].shape == (4096 * 16, 1, 64)
    k0[7] = 1.0
    assert not v0.any() and cache.layer(1)[0].sum().item() == 0
