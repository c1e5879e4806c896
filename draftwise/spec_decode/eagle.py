"""EagleProposer: EAGLE-3 chain drafting (a propose() per step), and tree drafting when
eagle_topk > 1 (a token tree in the style of MNN's TokenTree, batched over requests).

Chain: a prefill pass over the step's valid rows (input ids shifted by one, the next token
scattered in at each request's last row) writes the draft layer's KV and yields the first draft;
then K-1 recurrent passes feed back the pre-norm hidden state. Drafts are greedy."""
from __future__ import annotations

import torch

from draftwise.kernels import row_argmax
from draftwise.layers.attention import CAUSAL, AttentionMetadata, slots_for_positions
from draftwise.spec_decode.draft import Draft
from draftwise.spec_decode.proposer import Proposer, ProposerInput
from draftwise.models.eagle3 import eagle3_aux_layer_ids
from draftwise.spec_decode.tree import draft_trees


class EagleProposer(Proposer):
    method = "eagle3"
    needs_aux_hidden_states = True

    def __init__(self, draft_model, raw_config: dict, target_model, num_speculative_tokens: int,
                 eagle_topk: int = 1, eagle_depth: int | None = None):
        self.model = draft_model
        # the passes propose runs: the drafter's eager ones, or compiled graphs (compile_graphs)
        self.layer_step = draft_model
        self.logits_step = draft_model.compute_logits
        self.raw_config = raw_config
        self.target = target_model
        self.k = num_speculative_tokens
        self.topk = eagle_topk
        self.depth = eagle_depth or num_speculative_tokens
        self._aux = eagle3_aux_layer_ids(raw_config) or target_model.get_eagle3_aux_hidden_state_layers()
        if len(self._aux) * target_model.config.hidden_size != draft_model.fc.in_features:
            raise ValueError(f"draft fc expects {draft_model.fc.in_features} input features, the target gives "
                             f"{len(self._aux)} x {target_model.config.hidden_size}")
        # P(first j drafts accepted), from the trainer's held-out evaluation (adaptive policy prior)
        acc = (raw_config.get("draftwise_training") or {}).get("heldout_acc")
        self.expected_acceptance = None
        if isinstance(acc, list) and acc:
            run, self.expected_acceptance = 1.0, []
            for a in acc:
                run *= float(a)
                self.expected_acceptance.append(run)
        if self.topk > 1:
            # tree verification writes 1 + K nodes, tree drafting writes topk entries per depth
            self.num_lookahead_tokens = max(self.k + 1, self.topk * self.depth + 1)
        else:
            self.num_lookahead_tokens = self.k + 1

    def kv_layer_specs(self):
        c = self.model.config
        return [(c.num_key_value_heads, c.head_dim)]

    def bind_kv_cache(self, first_layer: int) -> None:
        self.model.set_layer_idx(first_layer)

    def aux_layers(self):
        return tuple(self._aux)

    def compile_graphs(self, compile_graph, common: dict, dtype, device) -> list:
        m, H = self.model, self.model.config.hidden_size

        def layer_inputs(n):
            return (torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device),
                    torch.zeros(n, H, dtype=dtype, device=device))

        self.layer_step = compile_graph(m.forward, "eagle3 layer", 3, layer_inputs, **common)
        self.logits_step = compile_graph(m.compute_logits, "eagle3 lm_head", 1,
                                         lambda n: (torch.zeros(n, H, dtype=dtype, device=device),),
                                         uses_attention=False, **common)
        return [self.layer_step, self.logits_step]

    # ------------------------------------------------------------------------------------------
    def _prefill(self, inp: ProposerInput, kv_cache, block_size):
        """Draft prefill over the valid rows; returns pre-norm hidden [Tv, H] and last-row index per request."""
        dev = inp.token_ids.device
        ql = torch.tensor(inp.query_lens, device=dev)
        last = torch.cumsum(ql, 0) - 1
        ids = torch.empty_like(inp.token_ids)
        ids[:-1] = inp.token_ids[1:]
        ids[last] = inp.next_token_ids
        req_index = torch.repeat_interleave(torch.arange(len(inp.query_lens), device=dev), ql)
        slots = slots_for_positions(inp.block_tables, req_index, inp.positions, block_size)
        meta = AttentionMetadata(slots, inp.query_lens, inp.seq_lens, inp.block_tables, block_size, CAUSAL).finalize()
        hidden = self.model.combine_hidden_states(inp.aux_hidden_states)
        prenorm = self.layer_step(ids, inp.positions, hidden, meta, kv_cache)
        return prenorm, last

    def propose(self, inp: ProposerInput, kv_cache, block_size: int, num_spec_tokens: int):
        R = len(inp.query_lens)
        # requests with no valid rows this step (cannot happen for running requests) are skipped
        prenorm, last = self._prefill(inp, kv_cache, block_size)
        want = [i for i in range(R) if inp.want_draft[i]]
        out: list[Draft | None] = [None] * R
        if not want or num_spec_tokens <= 0:
            return out
        dev = prenorm.device
        sel = torch.tensor(want, device=dev)
        h = prenorm[last[sel]]
        logits = self.logits_step(h)
        if self.topk > 1:
            trees = draft_trees(self, logits, h, inp, sel, kv_cache, block_size, num_spec_tokens, d2t=self.model.d2t)
            for j, i in enumerate(want):
                out[i] = Draft.from_tree(trees[j], self.method)
            return out
        tok = self.model.draft_to_target(row_argmax(logits))
        drafts = [tok]
        bt = inp.block_tables[sel]
        pos = torch.tensor([inp.seq_lens[i] for i in want], device=dev)  # position of the sampled token
        n = len(want)
        ar = torch.arange(n, device=dev)
        for _ in range(num_spec_tokens - 1):
            slots = slots_for_positions(bt, ar, pos, block_size)
            meta = AttentionMetadata(slots, [1] * n, (pos + 1).tolist(), bt, block_size, CAUSAL).finalize()
            h = self.layer_step(tok, pos, h, meta, kv_cache)
            tok = self.model.draft_to_target(row_argmax(self.logits_step(h)))
            drafts.append(tok)
            pos = pos + 1
        d = torch.stack(drafts, 1).tolist()
        for j, i in enumerate(want):
            out[i] = Draft.chain(d[j], self.method)
        return out
