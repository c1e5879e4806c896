"""A static token datastore for suffix decoding: retrieval drafting over a fixed corpus.

Suffix decoding searches the request's own tokens and earlier requests' outputs. A datastore adds a
third corpus that is there from the first request: many answers the target itself wrote (made by
`draftwise train gen-datastore`), so phrases the model habitually produces ("Here are some ...",
list scaffolding, closing sentences) are drafted even on a prompt the server has never seen. This
is the retrieval idea of REST (He et al., 2023), with the target's own output as the corpus and
suffix decoding's count-based draft tree on top.

Index: a suffix array over the *reversed* token stream. Position p's key is its backward context
buf[p], buf[p-1], buf[p-2], ...; sorting positions by that key puts every occurrence of a context
suffix in one contiguous range, so the longest match of a request's context is found by narrowing
the range one token at a time (a binary search per depth), and the tokens after those occurrences
are the candidate continuations (the same `build_draft` as the other corpora). Keys are sorted to
`SORT_DEPTH` tokens, enough for every match length suffix decoding uses. Memory: two int32 arrays
(tokens and the sorted positions), 8 bytes per token.
"""
from __future__ import annotations

import json
import os

import numpy as np

import draftwise.kernels as kernels
from draftwise.config import cache_dir

SEPARATOR = -1           # between answers: never matches a token
U16_SEPARATOR = 0xFFFF   # the separator in a uint16 tokens.npy (vocabularies under 65,535 tokens)
SORT_DEPTH = 32          # backward-key tokens the positions are sorted by (>= the match depths used)
MAX_OCCURRENCES = 256    # occurrences of a matched suffix sampled (evenly over its range) per draft


def backward_suffix_array(buf: np.ndarray, depth: int = SORT_DEPTH) -> np.ndarray:
    """Positions of `buf` sorted by their backward keys (buf[p], buf[p-1], ...), compared to
    `depth` tokens (prefix doubling: log2(depth) sorts). Before the start reads as -2, below
    every token and the separator."""
    n = len(buf)
    rank = buf.astype(np.int64)
    idx = np.arange(n)
    order = np.argsort(rank, kind="stable")
    k = 1
    while k < depth:
        prev = np.where(idx - k >= 0, rank[np.maximum(idx - k, 0)], -2)   # the key's next k tokens
        order = np.lexsort((prev, rank))
        a, b = rank[order], prev[order]
        new_group = np.empty(n, dtype=bool)
        new_group[0] = True
        new_group[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(new_group) - 1
        if new_group.all():
            break
        k *= 2
    return order.astype(np.int32)


class Datastore:
    """Read-only token corpus with a backward suffix array; `matches` finds the occurrences of a
    context's longest suffix."""

    def __init__(self, tokens: np.ndarray, order: np.ndarray | None = None):
        self.buf = np.ascontiguousarray(tokens, dtype=np.int32)
        self.n = len(self.buf)
        self.order = backward_suffix_array(self.buf) if order is None else np.ascontiguousarray(order, np.int32)
        if len(self.order) != self.n:
            raise ValueError(f"datastore index has {len(self.order)} positions for {self.n} tokens")
        # the range of positions whose own token is t: first-depth lookup without a search
        toks = self.buf[self.order].astype(np.int64)
        self._vocab_start = int(toks.min()) if self.n else 0
        self._bounds = np.searchsorted(toks, np.arange(self._vocab_start, int(toks.max()) + 2 if self.n else 1))

    @classmethod
    def load(cls, path: str) -> "Datastore":
        """A datastore directory (tokens.npy, and index.npy when saved) or a tokens.npy file."""
        tokens_path = os.path.join(path, "tokens.npy") if os.path.isdir(path) else path
        if not os.path.exists(tokens_path):
            raise ValueError(f"suffix-decoding datastore {path!r} has no tokens.npy")
        raw = np.load(tokens_path)
        if raw.ndim != 1 or raw.dtype not in (np.int32, np.uint16):
            raise ValueError(f"{tokens_path}: expected a 1-D int32 or uint16 array of token ids")
        tokens = raw.astype(np.int32)
        if raw.dtype == np.uint16:
            tokens[raw == U16_SEPARATOR] = SEPARATOR
        index_path = os.path.join(os.path.dirname(tokens_path), "index.npy")
        if os.path.exists(index_path):
            return cls(tokens, np.load(index_path))
        # no index beside the tokens (a shipped datastore keeps the repository small): built once
        # and cached under the draftwise cache directory, keyed by the tokens' hash
        import hashlib
        key = hashlib.sha256(tokens.tobytes()).hexdigest()[:16]
        cached = os.path.join(cache_dir(), "datastore-index", f"{key}-{SORT_DEPTH}.npy")
        if os.path.exists(cached):
            order = np.load(cached)
            if len(order) == len(tokens):
                return cls(tokens, order)
        ds = cls(tokens)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        np.save(cached + ".tmp.npy", ds.order)
        os.replace(cached + ".tmp.npy", cached)
        return ds

    def _key_at(self, rows: np.ndarray, d: int) -> np.ndarray:
        """The depth-d backward-key tokens of the positions at `rows` of the sorted order."""
        p = self.order[rows] - d
        return np.where(p >= 0, self.buf[np.maximum(p, 0)], -2)

    def matches(self, context: np.ndarray, max_depth: int) -> tuple[np.ndarray, int]:
        """(positions of the occurrences of the longest suffix of `context` found, at most
        MAX_OCCURRENCES of them evenly spread over the range; that suffix's length)."""
        if self.n == 0 or len(context) == 0:
            return np.empty(0, dtype=np.int64), 0
        t = int(context[-1]) - self._vocab_start
        if t < 0 or t + 1 >= len(self._bounds):
            return np.empty(0, dtype=np.int64), 0
        lo, hi = int(self._bounds[t]), int(self._bounds[t + 1])
        if lo >= hi:
            return np.empty(0, dtype=np.int64), 0
        mod = kernels.load()
        if mod is not None:              # the same narrowing, compiled (kernels/cpu/suffix.h)
            lo, hi, depth = mod.suffix_array_narrow(self.order, self.buf, lo, hi, context, max_depth)
        else:
            lo, hi, depth = self._narrow(lo, hi, context, max_depth)
        rows = np.arange(lo, hi) if hi - lo <= MAX_OCCURRENCES else \
            np.linspace(lo, hi - 1, MAX_OCCURRENCES).astype(np.int64)
        return self.order[rows].astype(np.int64), depth

    def _narrow(self, lo: int, hi: int, context: np.ndarray, max_depth: int) -> tuple[int, int, int]:
        """Rows [lo, hi) share the context's last token; narrow them to the rows whose key at each
        further depth equals the context's token there, while any remain: (lo, hi, depth matched)."""
        depth = 1
        for d in range(1, min(max_depth, len(context))):
            want = int(context[-1 - d])
            if hi - lo <= 64:           # small range: compare directly
                keys = self._key_at(np.arange(lo, hi), d)
                a = lo + int(np.searchsorted(keys, want, "left"))
                b = lo + int(np.searchsorted(keys, want, "right"))
            else:
                a, b = self._bisect(lo, hi, d, want, False), self._bisect(lo, hi, d, want, True)
            if a >= b:
                break
            lo, hi, depth = a, b, d + 1
        return lo, hi, depth

    def _bisect(self, lo: int, hi: int, d: int, want: int, right: bool) -> int:
        """First row in [lo, hi) whose depth-d key is >= want (> want when `right`)."""
        while lo < hi:
            mid = (lo + hi) // 2
            p = int(self.order[mid]) - d
            k = int(self.buf[p]) if p >= 0 else -2
            if k < want or (right and k == want):
                lo = mid + 1
            else:
                hi = mid
        return lo


def pack_answers(answers_jsonl: str, out: str, save_index: bool = True) -> dict:
    """answers.jsonl ({"i", "tokens"} per line) -> tokens.npy (answers joined by a separator; uint16
    where every id fits, else int32) and index.npy (the backward suffix array) beside it, unless
    `save_index` is False (it is rebuilt at load: a fraction of a second per million tokens)."""
    seqs = []
    with open(answers_jsonl, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                break
            if rec.get("tokens"):
                seqs.append(rec["tokens"])
    flat = np.fromiter((t for s in seqs for t in list(s) + [SEPARATOR]), dtype=np.int32)
    if len(flat) and int(flat.max()) < U16_SEPARATOR:
        np.save(out, np.where(flat == SEPARATOR, U16_SEPARATOR, flat).astype(np.uint16))
    else:
        np.save(out, flat)
    index = os.path.join(os.path.dirname(out), "index.npy")
    if save_index:
        np.save(index, backward_suffix_array(flat))
    elif os.path.exists(index):
        os.unlink(index)
    return {"datastore_tokens": int(len(flat)), "datastore_answers": len(seqs), "datastore": out}
