"""SpecDecodeMetadata: index bookkeeping for verifying drafts interleaved in the flat batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SpecDecodeMetadata:
    draft_token_ids: torch.Tensor        # [total_drafts] drafts in batch order
    num_draft_tokens: list[int]          # [R]
    cu_num_draft_tokens: torch.Tensor    # [R]
    logits_indices: torch.Tensor         # [total_drafts + R] rows of the flat batch to compute logits at
    target_logits_indices: torch.Tensor  # [total_drafts] rows of the logits that verify a draft
    bonus_logits_indices: torch.Tensor   # [R] rows of the logits that give the bonus token

    @property
    def max_spec_len(self) -> int:
        return max(self.num_draft_tokens) if self.num_draft_tokens else 0

    @classmethod
    def build(cls, num_draft_tokens: list[int], cu_num_scheduled_tokens: list[int],
              input_ids: torch.Tensor) -> "SpecDecodeMetadata":
        device = input_ids.device
        nd = torch.tensor(num_draft_tokens, dtype=torch.long)
        cu_sched = torch.tensor(cu_num_scheduled_tokens, dtype=torch.long)
        counts = nd + 1
        R = nd.shape[0]
        req = torch.repeat_interleave(torch.arange(R), counts)
        cu_counts = torch.cumsum(counts, 0)
        offset_in_req = torch.arange(int(cu_counts[-1]) if R else 0) - (cu_counts - counts)[req]
        logits_indices = cu_sched[req] - counts[req] + offset_in_req
        bonus = cu_counts - 1
        is_target = torch.ones(len(logits_indices), dtype=torch.bool)
        is_target[bonus] = False
        target_idx = torch.nonzero(is_target).flatten()
        draft_ids = input_ids[(logits_indices[target_idx] + 1).to(device)]
        return cls(draft_ids, list(num_draft_tokens), torch.cumsum(nd, 0).to(device),
                   logits_indices.to(device), target_idx.to(device), bonus.to(device))

    def draft_matrix(self) -> torch.Tensor:
        """[R, max_spec_len] drafts, padded with -1."""
        R, K = len(self.num_draft_tokens), self.max_spec_len
        out = torch.full((R, K), -1, dtype=torch.long, device=self.draft_token_ids.device)
        if K:
            nd = torch.tensor(self.num_draft_tokens, device=out.device)
            req = torch.repeat_interleave(torch.arange(R, device=out.device), nd)
            col = torch.arange(len(req), device=out.device) - (torch.cumsum(nd, 0) - nd)[req]
            out[req, col] = self.draft_token_ids
        return out
