"""The paged KV cache's bookkeeping: the block allocator with automatic prefix caching, and the
block hashes that name a prefix. The tensors themselves belong to the worker (worker/kv_cache.py);
the scheduler hands out block ids and every layer addresses them by the same slots:
`slot = block_table[pos // block_size] * block_size + pos % block_size`.
"""
from __future__ import annotations


class BlockAllocator:
    """The block pool, with automatic prefix caching (vLLM v1 style).

    Blocks are reference counted. A request's *full* computed blocks are registered under a chained
    SHA-256 key of their tokens (`sha256(parent_key + block_tokens)`, see `block_hashes`), so a
    later request whose prompt starts with the same tokens reuses them (`lookup` + `touch`). A hit
    also compares the block's stored token ids with the request's: another request's K/V is never
    served on a key match alone. A block whose last reference is
    dropped joins the free queue but keeps its cached contents until it is evicted: allocation takes
    the least recently freed block first and forgets its hash then. With caching disabled nothing
    is ever registered and this is a plain free list."""

    def __init__(self, num_blocks: int, enable_caching: bool = False):
        from collections import OrderedDict
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free: "OrderedDict[int, None]" = OrderedDict((b, None) for b in range(num_blocks))
        self.ref = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}        # key -> block id
        self.queries = 0                         # prompt tokens looked up
        self.hits = 0                            # of which found in the cache

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError("out of KV blocks")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)          # least recently freed first
            h = self.block_hash[b]
            if h is not None:                            # evict its cached contents
                self.block_hash[b] = None
                self.block_tokens[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
            self.ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the last blocks of a sequence are freed first, so they
        are evicted before its (more shareable) prefix."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] < 0:
                raise RuntimeError(f"KV block {b} freed more often than allocated")
            if self.ref[b] == 0:
                self._free[b] = None

    # --- prefix caching ---------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], token_ids: list[int], block_size: int) -> list[int]:
        """Blocks caching the longest prefix of `hashes` (the keys of `token_ids`' full blocks) whose
        stored tokens are the request's own."""
        out = []
        for i, h in enumerate(hashes):
            b = self.cached.get(h)
            if b is None or self.block_tokens[b] != tuple(token_ids[i * block_size:(i + 1) * block_size]):
                break
            out.append(b)
        return out

    def num_free_after_touch(self, blocks: list[int]) -> int:
        """Free blocks left once `blocks` (cached hits) are taken: hits sitting in the free queue
        leave it."""
        return len(self._free) - sum(1 for b in blocks if self.ref[b] == 0)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Prefix-cache statistics: a prompt of `num_tokens` found `num_hit_tokens` cached."""
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def stats(self) -> dict:
        return {"enabled": self.enable_caching, "queries": self.queries, "hits": self.hits,
                "hit_rate": round(self.hits / self.queries, 4) if self.queries else 0.0,
                "cached_blocks": self.num_cached}

    def touch(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks (reviving them from the free queue)."""
        for b in blocks:
            if self.ref[b] == 0:
                del self._free[b]
            self.ref[b] += 1

    def cache_block(self, block: int, h: bytes, tokens) -> None:
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        self.block_hash[block] = h
        self.block_tokens[block] = tuple(tokens)
        self.cached.setdefault(h, block)


def block_hashes(token_ids: list[int], block_size: int, num_blocks: int, start: int = 0,
                 parent: bytes | None = None) -> list[bytes]:
    """Chained SHA-256 keys of full blocks `start .. num_blocks - 1` of `token_ids` (`parent` is the
    key of block start - 1): each block's key covers its parent's key and its own token ids as
    64-bit integers, so equal keys mean equal prefixes up to a cryptographic collision."""
    import hashlib
    from array import array
    out = []
    for i in range(start, num_blocks):
        h = hashlib.sha256(parent or b"")
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        parent = h.digest()
        out.append(parent)
    return out
