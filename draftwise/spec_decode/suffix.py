"""Suffix decoding (SuffixDecoding, Oliaro et al., NeurIPS 2025; vLLM / Arctic Inference `suffix`).

Training-free drafting from suffix statistics. Two token corpora are searched every step:

- the request's own tokens (prompt + output so far): its "per-request suffix tree";
- the outputs of earlier requests (a bounded FIFO cache of `max_cached_requests`): the "global
  suffix tree" (0 disables it);
- optionally a static datastore of answers the target wrote beforehand (spec_decode/datastore.py),
  searched through a suffix array; it drafts the model's habitual phrasing from the first request.

For a corpus, the *occurrences* of the context's longest suffix (at most `max_tree_depth` tokens)
are the nodes of a suffix tree's matched path; the tokens that followed those occurrences form the
matched node's subtree. Each continuation path gets the count-based probability

    p(path) = #occurrences continuing with `path` / #occurrences of the matched suffix

(the product of the conditional frequencies along it). The draft keeps paths with
p >= `min_token_prob`, at most `max_spec_factor x match length` deep and at most `max_draft`
nodes: the most likely chain (chain output) or the best-first tree of candidates (tree output,
verified by the tree verifier). Its *score* is the expected number of accepted tokens, the sum of
the kept nodes' probabilities; between the two corpora the higher score wins, and hybrid drafting
(spec_decode/hybrid.py) compares it to a model drafter's draft length.

The suffix structure is an occurrence index rather than an explicit tree (same statistics, memory
linear in the tokens instead of tokens x depth): a bigram -> positions map (unigram as a fallback),
matches extended backwards with vectorized numpy comparisons, continuations counted with numpy.
A step costs tens of microseconds per request: the searches run compiled (kernels/cpu/suffix.h,
the same drafts as the numpy code here, which serves where no CPU kernels load).
"""
from __future__ import annotations

import heapq
from collections import deque

import numpy as np

import draftwise.kernels as kernels
from draftwise.spec_decode.draft import Draft
from draftwise.spec_decode.proposer import Proposer, ProposerInput

SEPARATOR = -1            # between sequences of the global corpus: never matches a token
MAX_OCCURRENCES = 256     # most recent occurrences of a suffix considered (bounds a step's work)


def no_draft() -> Draft:
    return Draft([], [], SuffixProposer.method, [])


class TokenIndex:
    """A growing token array with bigram and unigram occurrence indexes (positions of the *last*
    token of the n-gram). Positions below `valid_from` belong to evicted sequences."""

    def __init__(self, capacity: int = 1024):
        self.buf = np.full(capacity, SEPARATOR, dtype=np.int64)
        self.n = 0
        self.bigrams: dict[tuple[int, int], list[int]] = {}
        self.unigrams: dict[int, list[int]] = {}
        self.valid_from = 0

    def extend(self, tokens) -> None:
        tokens = list(tokens)
        need = self.n + len(tokens)
        if need > len(self.buf):
            new = np.full(max(need, 2 * len(self.buf)), SEPARATOR, dtype=np.int64)
            new[:self.n] = self.buf[:self.n]
            self.buf = new
        prev = int(self.buf[self.n - 1]) if self.n else SEPARATOR
        for i, t in enumerate(tokens):
            t = int(t)
            pos = self.n + i
            self.buf[pos] = t
            if t != SEPARATOR:
                self.unigrams.setdefault(t, []).append(pos)
                if prev != SEPARATOR:
                    self.bigrams.setdefault((prev, t), []).append(pos)
            prev = t
        self.n = need

    def candidates(self, context: np.ndarray, exclude_last: bool) -> tuple[np.ndarray, int]:
        """Positions p whose token equals the context's last token and whose bigram matches when
        possible (then the known match length is 2, else 1); p must have a continuation."""
        last = int(context[-1])
        known = 1
        pos = None
        if len(context) >= 2:
            pos = self.bigrams.get((int(context[-2]), last))
            known = 2
        if not pos:
            pos = self.unigrams.get(last)
            known = 1
        if not pos:
            return np.empty(0, dtype=np.int64), 0
        tail = pos[-(MAX_OCCURRENCES + 1):]
        p = np.asarray(tail, dtype=np.int64)
        limit = self.n - 1 if exclude_last else self.n
        p = p[(p < limit) & (p >= self.valid_from)]
        return p[-MAX_OCCURRENCES:], known


def match_lengths(buf: np.ndarray, cand: np.ndarray, context: np.ndarray, known: int, max_depth: int) -> np.ndarray:
    """Length of the common suffix of `context` and buf[: p + 1] for each candidate p (at least
    `known`, at most `max_depth`)."""
    m = np.full(len(cand), known, dtype=np.int64)
    alive = np.ones(len(cand), dtype=bool)
    for d in range(known, min(max_depth, len(context))):
        idx = cand - d
        ok = alive & (idx >= 0)
        eq = ok & (buf[np.maximum(idx, 0)] == context[-1 - d])
        m += eq
        alive = eq
        if not alive.any():
            break
    return m


def longest_match(buf: np.ndarray, cand: np.ndarray, context: np.ndarray, known: int,
                  max_depth: int) -> tuple[np.ndarray, int]:
    """The candidates whose common suffix with `context` is longest (match_lengths' maximum), in
    their order, and that length."""
    mod = kernels.load()                  # the compiled search (kernels/cpu/suffix.h), if built
    if mod is not None:
        best, occ = mod.suffix_longest_match(buf, cand, context, known, max_depth)
        return occ, best
    m = match_lengths(buf, cand, context, known, max_depth)
    best = int(m.max())
    return cand[m == best], best


def build_draft(buf: np.ndarray, n: int, occ: np.ndarray, match_len: int, max_draft: int,
                max_spec_factor: float, min_token_prob: float, tree: bool) -> Draft:
    """Draft from the continuations of the occurrences `occ` of a suffix of length `match_len`;
    `probs` holds each node's path probability."""
    depth_limit = min(max_draft, int(max_spec_factor * match_len))
    draft = no_draft()
    if depth_limit <= 0 or len(occ) == 0:
        return draft
    if not tree:
        return chain_draft(buf, n, occ, min(depth_limit, max_draft), min_token_prob)
    cols = occ[:, None] + 1 + np.arange(depth_limit)[None, :]
    conts = np.where(cols < n, buf[np.minimum(cols, n - 1)], SEPARATOR)      # [n_occ, depth]
    total = len(occ)
    heap: list = []          # candidate nodes: (-path prob, tie, parent node, token, rows, depth)
    tie = 0

    def push_children(parent: int, rows: np.ndarray, depth: int) -> None:
        nonlocal tie
        if depth >= depth_limit:
            return
        col = conts[rows, depth]
        first = col[0]
        if (col == first).all():                        # one continuation (the common case)
            if first == SEPARATOR:
                return
            vals, counts, order = col[:1], np.array([len(col)]), [0]
        else:
            keep = col != SEPARATOR
            vals, counts = np.unique(col[keep], return_counts=True)
            order = np.argsort(-counts, kind="stable")
        for j in (order if tree else order[:1]):       # a chain follows the most frequent child
            p = counts[j] / total
            if p < min_token_prob:
                break
            tok = int(vals[j])
            heapq.heappush(heap, (-p, tie, parent, tok, rows[col == tok], depth + 1))
            tie += 1

    push_children(-1, np.arange(total), 0)
    while heap and len(draft) < max_draft:       # best-first by path probability
        negp, _, parent, tok, rows, depth = heapq.heappop(heap)
        draft.token_ids.append(tok)
        draft.parents.append(parent)
        draft.probs.append(float(-negp))
        push_children(len(draft) - 1, rows, depth)
    return draft


def chain_draft(buf: np.ndarray, n: int, occ: np.ndarray, limit: int, min_token_prob: float) -> Draft:
    """The chain build_draft's best-first search yields (the most frequent continuation at each
    depth, path probability = its occurrences / all occurrences), at most `limit` tokens."""
    mod = kernels.load()                  # the compiled search (kernels/cpu/suffix.h), if built
    if mod is not None:
        tokens, probs = mod.suffix_chain(buf, n, occ, limit, min_token_prob)
        return Draft(tokens, list(range(-1, len(tokens) - 1)), SuffixProposer.method, probs)
    return _chain_draft_numpy(buf, n, occ, limit, min_token_prob)


def _chain_draft_numpy(buf: np.ndarray, n: int, occ: np.ndarray, limit: int, min_token_prob: float) -> Draft:
    """chain_draft without the search: where every remaining occurrence continues alike for
    several tokens - the common case, one occurrence always - the whole run is taken at once."""
    draft = no_draft()
    cols = occ[:, None] + 1 + np.arange(limit)[None, :]
    conts = np.where(cols < n, buf[np.minimum(cols, n - 1)], SEPARATOR)      # [n_occ, limit]
    total = len(occ)
    rows = np.arange(total)
    depth = 0
    while depth < limit:
        block = conts[rows, depth:limit]
        agree = (block == block[0]).all(axis=0) & (block[0] != SEPARATOR)
        run = int(np.argmin(agree)) if not agree.all() else len(agree)
        if run:                                   # `run` tokens every remaining occurrence shares
            p = len(rows) / total
            if p < min_token_prob:
                break
            for t in block[0, :run].tolist():
                draft.parents.append(len(draft.token_ids) - 1)
                draft.token_ids.append(int(t))
                draft.probs.append(p)
            depth += run
            continue
        col = block[:, 0]
        keep = col != SEPARATOR
        if not keep.any():
            break
        vals, counts = np.unique(col[keep], return_counts=True)
        j = int(np.argmax(counts))                # the first of the most frequent, as the search
        p = counts[j] / total
        if p < min_token_prob:
            break
        tok = int(vals[j])
        draft.parents.append(len(draft.token_ids) - 1)
        draft.token_ids.append(tok)
        draft.probs.append(float(p))
        rows = rows[col == tok]
        depth += 1
    return draft


class SuffixCache:
    """Per-request indexes plus the global index over earlier requests' outputs (FIFO-bounded)."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1, datastore=None):
        self.datastore = datastore            # a Datastore (spec_decode/datastore.py) or None
        self.max_depth = max_tree_depth
        self.max_cached = max_cached_requests
        self.factor = max_spec_factor
        self.min_prob = min_token_prob
        self.requests: dict[str, tuple[TokenIndex, int]] = {}   # request id -> (index, tokens seen)
        self.global_index = TokenIndex(4096)
        self.global_spans: deque[tuple[int, int]] = deque()      # (start, end) of cached outputs

    # --- corpora ---------------------------------------------------------------------------------
    def update_request(self, request_id: str, all_token_ids: list[int]) -> TokenIndex:
        idx, seen = self.requests.get(request_id, (None, 0))
        if idx is None or seen > len(all_token_ids):
            idx, seen = TokenIndex(max(64, 2 * len(all_token_ids))), 0
        if len(all_token_ids) > seen:
            idx.extend(all_token_ids[seen:])
        self.requests[request_id] = (idx, len(all_token_ids))
        return idx

    def finish_request(self, request_id: str, output_token_ids: list[int]) -> None:
        """Forget the request's own index; add its output to the global corpus."""
        self.requests.pop(request_id, None)
        if self.max_cached <= 0 or not output_token_ids:
            return
        g = self.global_index
        start = g.n
        g.extend(list(output_token_ids) + [SEPARATOR])
        self.global_spans.append((start, g.n))
        while len(self.global_spans) > self.max_cached:
            _, end = self.global_spans.popleft()
            g.valid_from = end
        if g.valid_from > g.n // 2 and g.valid_from > 4096:
            self._compact()

    def _compact(self) -> None:
        old, spans = self.global_index, list(self.global_spans)
        self.global_index, self.global_spans = TokenIndex(max(4096, old.n - old.valid_from)), deque()
        for s, e in spans:
            start = self.global_index.n
            self.global_index.extend(old.buf[s:e].tolist())
            self.global_spans.append((start, self.global_index.n))

    # --- speculation -----------------------------------------------------------------------------
    def _draft_from(self, index: TokenIndex, context: np.ndarray, exclude_last: bool, max_draft: int,
                    tree: bool) -> Draft:
        cand, known = index.candidates(context, exclude_last)
        if len(cand) == 0:
            return no_draft()
        occ, best = longest_match(index.buf, cand, context, known, self.max_depth)
        return build_draft(index.buf, index.n, occ, best, max_draft, self.factor, self.min_prob, tree)

    def speculate(self, request_id: str, all_token_ids: list[int], max_draft: int,
                  tree: bool = False) -> Draft:
        idx = self.update_request(request_id, all_token_ids)
        if max_draft <= 0 or not all_token_ids:
            return no_draft()
        ctx = idx.buf[max(0, idx.n - self.max_depth):idx.n]
        best = self._draft_from(idx, ctx, True, max_draft, tree)
        if self.max_cached > 0 and self.global_index.n:
            g = self._draft_from(self.global_index, ctx, False, max_draft, tree)
            if g.expected_accepted > best.expected_accepted:
                best = g
        if self.datastore is not None:
            occ, length = self.datastore.matches(ctx, self.max_depth)
            if len(occ):
                d = build_draft(self.datastore.buf, self.datastore.n, occ, length, max_draft, self.factor,
                                self.min_prob, tree)
                if d.expected_accepted > best.expected_accepted:
                    best = d
        return best


class SuffixProposer(Proposer):
    """`method: "suffix"`: variable-length chain drafts (or trees with `draft_tree`)."""
    method = "suffix"
    reads_target_rows = False

    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1, tree: bool = False, datastore=None):
        self.k = num_speculative_tokens
        self.tree = tree
        self.cache = SuffixCache(max_tree_depth, max_cached_requests, max_spec_factor, min_token_prob, datastore)
        self.num_lookahead_tokens = 0

    def suffix_drafts(self, inp: ProposerInput, num_spec_tokens: int) -> list[Draft]:
        """A draft per request (empty where none is wanted or matched)."""
        out = []
        for req, want in zip(inp.requests, inp.want_draft):
            if not want or num_spec_tokens <= 0:
                self.cache.update_request(req.request_id, req.all_token_ids)
                out.append(no_draft())
                continue
            out.append(self.cache.speculate(req.request_id, req.all_token_ids, num_spec_tokens, self.tree))
        return out

    def propose(self, inp: ProposerInput, kv_cache, block_size: int, num_spec_tokens: int):
        return [d or None for d in self.suffix_drafts(inp, num_spec_tokens)]

    def on_request_finished(self, request) -> None:
        self.cache.finish_request(request.request_id, request.output_token_ids)

