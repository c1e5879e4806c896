"""N-gram (prompt lookup) drafting: propose the continuation of the most recent earlier match of the
last n tokens (n from prompt_lookup_max down to prompt_lookup_min). No model, no training."""
from __future__ import annotations

import numpy as np

from draftwise.spec_decode.draft import Draft
from draftwise.spec_decode.proposer import Proposer, ProposerInput


def ngram_propose(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        # windows of length n ending before the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        if len(hits):
            start = int(hits[-1]) + n                 # most recent match
            cont = tokens[start:start + k]
            if len(cont):
                return cont.tolist()
    return []


class NgramProposer(Proposer):
    method = "ngram"
    reads_target_rows = False

    def __init__(self, num_speculative_tokens: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = num_speculative_tokens, n_min, n_max
        self.num_lookahead_tokens = 0

    def propose(self, inp: ProposerInput, kv_cache, block_size: int, num_spec_tokens: int):
        out = []
        for req, want in zip(inp.requests, inp.want_draft):
            if not want or num_spec_tokens <= 0:
                out.append(None)
                continue
            toks = np.asarray(req.all_token_ids, dtype=np.int64)
            toks = ngram_propose(toks, self.n_min, self.n_max, num_spec_tokens)
            out.append(Draft.chain(toks, self.method) if toks else None)
        return out
