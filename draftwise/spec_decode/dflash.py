"""DFlashProposer: block-parallel drafting (DFlash).

Every step, the target's auxiliary states at all valid rows of all requests (prefill chunks and
accepted tokens alike) are projected into the draft layers' paged KV cache at their positions
(context KV injection). Then, for the requests that want drafts, one non-causal pass over the
query block `[bonus, mask, ..., mask]` at positions seq_len + 0..B-1 (the bonus being the token
just sampled at position seq_len) gives B-1 greedy drafts through the target's LM head.

The block's own K/V land at the block's cache entries (seq_len .. seq_len+B-1); the next step's
injection overwrites the accepted ones with context and the next block the rest, so nothing stale
is ever visible (a block only sees entries < its own seq_len + B).
"""
from __future__ import annotations

import logging
import time

import torch

from draftwise.layers.attention import NONCAUSAL, AttentionMetadata, slots_for_positions
from draftwise.models.dflash import dflash_capture_layers
from draftwise.spec_decode.draft import Draft
from draftwise.spec_decode.proposer import Proposer, ProposerInput
from draftwise.layers.quant import Int8Linear, quantize_int8_per_channel

logger = logging.getLogger("draftwise")


class DFlashProposer(Proposer):
    method = "dflash"
    needs_aux_hidden_states = True

    def __init__(self, draft_model, raw_config: dict, target_model, target_cfg):
        self.model = draft_model
        self.block_step = draft_model          # the block pass: eager, or its compiled graph
        self.raw_config = raw_config
        self.target = target_model
        self.target_cfg = target_cfg
        self.block_size = draft_model.block_size
        self.mask_token_id = draft_model.mask_token_id
        # the block occupies seq_len .. seq_len + B - 1: B entries from the sampled token on
        self.num_lookahead_tokens = self.block_size
        N = target_cfg.num_hidden_layers
        if draft_model.num_target_layers and draft_model.num_target_layers != N:
            logger.warning("this DFlash checkpoint was trained for a %d-layer target; the target has %d "
                           "layers (check that the draft and the target belong together)",
                           draft_model.num_target_layers, N)
        self._aux = dflash_capture_layers(draft_model.target_layer_ids, N)
        need = len(self._aux) * target_cfg.hidden_size
        if draft_model.fc.in_features != need:
            raise ValueError(f"DFlash fc expects {draft_model.fc.in_features} input features, the target "
                             f"gives {len(self._aux)} x {target_cfg.hidden_size}")
        draft_model.build_fused_kv()
        self.timings: dict[str, float] = {"inject": 0.0, "block": 0.0, "lm_head": 0.0}
        self.num_calls = 0
        self.num_blocks = 0
        self.draft_head = self._int8_head()     # None: the target's own head

    def _int8_head(self):
        """An int8 copy of the target's LM head for the drafts' argmax (CPU): the block's k rows through
        the full-vocabulary head were most of a drafting step (fp32 GEMMs of a few rows take a slow
        path here); verification still uses the target's own head, so outputs are unchanged."""
        w = getattr(self.target.lm_head, "weight", None)
        if w is None or w.device.type != "cpu":
            return None
        q, scale = quantize_int8_per_channel(w.detach())
        return Int8Linear(q, scale)

    def block_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of block rows [m, H] for the drafts' argmax."""
        return self.draft_head(hidden) if self.draft_head is not None else self.target.compute_logits(hidden)

    def kv_layer_specs(self):
        c = self.model.config
        return [(c.num_key_value_heads, c.head_dim)] * self.model.num_layers

    def bind_kv_cache(self, first_layer: int) -> None:
        self.model.set_first_layer(first_layer)
        self.model.build_fused_kv()

    def aux_layers(self):
        return tuple(self._aux)

    def compile_graphs(self, compile_graph, common: dict, dtype, device) -> list:
        H = self.target.config.hidden_size
        self.block_step = compile_graph(self.model.forward, "dflash block", 2,
                                        lambda n: (torch.zeros(n, H, dtype=dtype, device=device),
                                                   torch.arange(n, device=device)), **common)
        return [self.block_step]

    # ------------------------------------------------------------------------------------------
    def propose(self, inp: ProposerInput, kv_cache, block_size: int, num_spec_tokens: int):
        R = len(inp.query_lens)
        dev = inp.token_ids.device
        out: list[Draft | None] = [None] * R
        t0 = time.perf_counter()
        self.num_calls += 1
        # 1. context KV injection for every valid row of every request
        if inp.token_ids.numel():
            ql = torch.tensor(inp.query_lens, device=dev)
            req_index = torch.repeat_interleave(torch.arange(R, device=dev), ql)
            slots = slots_for_positions(inp.block_tables, req_index, inp.positions, block_size)
            self.model.inject_context(inp.aux_hidden_states, inp.positions, slots, kv_cache)
        t1 = time.perf_counter()
        self.timings["inject"] += t1 - t0
        want = [i for i in range(R) if inp.want_draft[i]]
        k = min(num_spec_tokens, self.block_size - 1)
        if not want or k <= 0:
            return out
        # 2. the query block [bonus, mask, ..., mask] at seq_len + 0..B-1, non-causal
        B, n = self.block_size, len(want)
        sel = torch.tensor(want, device=dev)
        start = torch.tensor([inp.seq_lens[i] for i in want], device=dev)
        offs = torch.arange(B, device=dev)
        pos = (start[:, None] + offs[None, :]).reshape(-1)
        ids = torch.full((n, B), self.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = inp.next_token_ids[sel]
        bt = inp.block_tables[sel]
        slots = slots_for_positions(bt, torch.arange(n, device=dev).repeat_interleave(B), pos, block_size)
        meta = AttentionMetadata(slots, [B] * n, [inp.seq_lens[i] + B for i in want], bt, block_size,
                                 NONCAUSAL).finalize()
        h = self.block_step(self.target.embed_tokens(ids.reshape(-1)), pos, meta, kv_cache)
        t2 = time.perf_counter()
        self.timings["block"] += t2 - t1
        # 3. block positions 1..k through the target's LM head, greedy
        hd = h.view(n, B, -1)[:, 1:1 + k].reshape(n * k, -1)
        logits = self.block_logits(hd).view(n, k, -1)
        drafts = logits.argmax(-1).tolist()
        self.timings["lm_head"] += time.perf_counter() - t2
        self.num_blocks += n
        for j, i in enumerate(want):
            out[i] = Draft.chain(drafts[j], self.method)
        return out
