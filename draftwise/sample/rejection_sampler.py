"""Rejection samplers: greedy (on the host, over the rows' argmax) and probabilistic (a pure
tensor function).

Request r verified `num_draft[r]` drafts; its logits rows are laid out as `num_draft[r]` draft
positions followed by one bonus position (see SpecDecodeMetadata). The probabilistic sampler
returns `[R, K+1]` token ids: accepted drafts, then the correction (or bonus) token, then -1.
"""
from __future__ import annotations

import torch

from draftwise.sample.sampler import SamplingMetadata, target_probs, uniform_noise, exponential_noise

PLACEHOLDER = -1


def _per_request(rows: torch.Tensor, num_draft: torch.Tensor, K: int) -> torch.Tensor:
    """Scatter flat per-row values ([sum(num_draft+1), ...]) into [R, K+1, ...] (row num_draft[r] =
    the bonus row)."""
    R = num_draft.shape[0]
    counts = num_draft + 1
    req = torch.repeat_interleave(torch.arange(R, device=rows.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    col = torch.arange(rows.shape[0], device=rows.device) - starts[req]
    out = rows.new_zeros((R, K + 1) + tuple(rows.shape[1:]))
    out[req, col] = rows
    return out


def greedy_accept(target_argmax: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Greedy verification on the host. target_argmax: the argmax of every logits row, laid out per
    request as len(drafts[r]) draft rows then the bonus row; drafts: each request's chain.
    Accept drafts while they equal the target's argmax; the first mismatch emits the target's
    token; if all match, the bonus row's token is appended. Returns each request's emitted tokens.

    The argmax rows come to the host anyway (the scheduler needs the tokens), and a step verifies
    tens of rows at most: a loop over them costs a few microseconds, where the same logic as
    tensor operations costs ~20 small ops (~0.25 ms a step on CPU, ~5 % of a SmolLM2 step)."""
    out, row = [], 0
    for draft in drafts:
        emitted = []
        for j, tok in enumerate(draft):
            emitted.append(target_argmax[row + j])
            if emitted[-1] != tok:
                break
        else:
            emitted.append(target_argmax[row + len(draft)])
        row += len(draft) + 1
        out.append(emitted)
    return out


def rejection_sample(logits: torch.Tensor, draft_token_ids: torch.Tensor, num_draft: torch.Tensor,
                     meta: SamplingMetadata) -> torch.Tensor:
    """Probabilistic rejection sampling (Leviathan et al., arXiv 2211.17192) for greedy drafts
    (draft distribution one-hot): accept draft d with probability p(d); on the first rejection emit
    a token from normalise(max(p - onehot(d), 0)); if all are accepted emit a bonus token from the
    last row. Greedy requests have one-hot p, which reduces to exact argmax matching. meta has one
    row per request."""
    R, K = draft_token_ids.shape
    counts = (num_draft + 1).tolist()
    row_meta = meta.repeat_rows(counts)
    probs = _per_request(target_probs(logits, row_meta), num_draft, K)   # [R, K+1, V]
    cols = torch.arange(K, device=probs.device)
    valid = cols[None, :] < num_draft[:, None]
    safe_draft = torch.where(valid, draft_token_ids, torch.zeros_like(draft_token_ids))
    p_draft = probs[:, :K].gather(2, safe_draft[:, :, None]).squeeze(2)   # [R, K]
    u = uniform_noise(R, K, meta.generators, probs.device, num_draft.tolist())
    accept = (u < p_draft) & valid
    reject = torch.cat([~accept, torch.ones(R, 1, dtype=torch.bool, device=probs.device)], 1)
    first = reject.int().argmax(1)                                       # [R] in 0..num_draft
    dist = probs[torch.arange(R), first]                                 # [R, V]
    rejected_draft = first < num_draft
    d_at_first = safe_draft.gather(1, first.clamp(max=max(K - 1, 0))[:, None]).squeeze(1) if K else first
    if K:
        zero_it = torch.zeros_like(dist).scatter_(1, d_at_first[:, None], 1.0).bool() & rejected_draft[:, None]
        dist = dist.masked_fill(zero_it, 0.0)
    q = exponential_noise(R, dist.shape[1], meta.generators, dist.device)
    final = (dist / q).argmax(-1)
    out = torch.full((R, K + 1), PLACEHOLDER, dtype=torch.long, device=probs.device)
    keep = torch.arange(K + 1, device=probs.device)[None, :] < first[:, None]
    out[:, :K] = torch.where(keep[:, :K], safe_draft, out[:, :K])
    out[torch.arange(R), first] = final
    return out
