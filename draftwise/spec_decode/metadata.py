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
        """Request i's last num_draft_tokens[i] + 1 scheduled rows (its flat rows end at
        cu_num_scheduled_tokens[i]) get logits: all but the last verify the drafts that follow
        them in the batch, the last gives the bonus token. Built as host lists, one tensor each."""
        device = input_ids.device
        logits_rows, target, bonus, draft_rows, cu_drafts = [], [], [], [], []
        row = drafts = 0
        for k, end in zip(num_draft_tokens, cu_num_scheduled_tokens):
            first = end - k - 1
            logits_rows.extend(range(first, end))
            target.extend(range(row, row + k))
            draft_rows.extend(range(first + 1, end))
            row += k + 1
            bonus.append(row - 1)
            drafts += k
            cu_drafts.append(drafts)

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device=device)
        return cls(input_ids[tensor(draft_rows)], list(num_draft_tokens), tensor(cu_drafts), tensor(logits_rows),
                   tensor(target), tensor(bonus))

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
