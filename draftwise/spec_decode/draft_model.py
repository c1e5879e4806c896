"""DraftModelProposer: a smaller language model with the target's tokenizer drafts for it (vLLM's
`draft_model`, llama.cpp's `--model-draft`, OpenVINO GenAI's "fast draft").

The draft model's K/V lives in the engine's paged pool as extra layers (`layers.N …`), addressed by
the request's own block table, so a draft token sits at the same position and cache entry as the
target's token there. Rolling back rejected drafts needs no copy: the proposer remembers per request
how many leading positions of its cache are right (`synced`), and each step feeds the draft model
the positions from there on - the tokens the target kept, then the newest token (the root of the
next draft, at its own position). Rejected draft entries beyond `synced` are simply overwritten.
A chain's own tokens that the target keeps are not fed again: their entries, written by the chain
passes, already hold them (the tokens are compared with the request's before they are trusted).
Steps the engine runs without drafting, steps where other requests draft and this one does not,
chunked prompts and prefix-cache hits are caught up the same way when the request next drafts (the
draft model's cache entries of a shared block are not trusted: a request starts from 0), and a
preempted request starts again from 0.

Chain drafting: one pass over every request's catch-up rows and its root yields the first draft
token (greedy), then up to K-1 one-row passes; a request's chain ends early after a token the
draft model gives less than `confidence_threshold` (as Hugging Face's assisted generation does: a
doubtful token's successors are seldom accepted, and each costs a pass). Tree drafting (draft_topk > 1): the root's top-k and then
`depth` levels of the global top-k frontier, all requests batched per level with TREE attention
(spec_decode/tree.py `draft_trees`, entries shifted by one past the root). Drafts carry the draft
model's path probability (the product of its top-1 probabilities), which the draft allocation
calibrates per source and depth."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from draftwise.kernels import row_argmax
from draftwise.layers.attention import CAUSAL, AttentionMetadata, slots_for_positions
from draftwise.spec_decode.draft import Draft
from draftwise.spec_decode.drafting_seconds import DraftingSeconds
from draftwise.spec_decode.proposer import Proposer, ProposerInput
from draftwise.spec_decode.tree import draft_trees


@dataclass
class _Segment:
    """Rows of one request fed to the draft model in one pass."""
    row: int                 # the request's index in the ProposerInput (its block table row)
    start: int               # position of the first row
    tokens: list[int]        # token ids at start, start + 1, ...; the last is the draft's root


class DraftModelProposer(Proposer):
    method = "draft_model"
    # a catch-up row's seconds are learned from feeds of at least this many catch-up rows: a few
    # rows share a pass's fixed cost (a 1-row pass of the 0.5B is ~11 ms, 0.3 ms a row in a feed
    # of hundreds), and priced from those a new turn's prompt looked several times its cost
    CATCH_UP_ROWS_MEASURED = 32

    def __init__(self, draft, num_speculative_tokens: int, topk: int = 1, depth: int | None = None,
                 max_rows_per_pass: int = 512, row_invariant: bool = False, confidence_threshold: float = 0.0):
        self.draft = draft                     # a target-family model (models/registry.py)
        self.confidence_threshold = confidence_threshold
        # causal passes attend row by row (a quantized draft model: its layers then run as one
        # fused stack, and a draft never depends on its batch-mates)
        self.row_invariant = row_invariant
        self.k = num_speculative_tokens
        self.topk = topk
        self.depth = depth or num_speculative_tokens
        self.max_rows = max(1, max_rows_per_pass)
        self._synced: dict[str, tuple[int, int]] = {}    # request id -> (num_preemptions, synced)
        self.pass_seconds = DraftingSeconds()            # a one-row-per-request pass, by requests
        self.catch_up_row_seconds = 0.0                  # decayed mean seconds a catch-up row costs
        # request id -> (position, chain tokens the last chain draft fed from there on)
        self._chain_fed: dict[str, tuple[int, list[int]]] = {}
        if topk > 1:      # tree verification writes 1 + K nodes; tree drafting (depth-1)*topk past the root
            self.num_lookahead_tokens = max(self.k + 1, topk * self.depth + 1)
        else:
            self.num_lookahead_tokens = self.k + 1

    # the passes draft_trees calls: the draft model has no hidden-state input
    def layer_step(self, ids, positions, hidden, meta, kv_cache):
        h, _ = self.draft.run_layers(ids, positions, meta, kv_cache)
        return h

    def logits_step(self, h):
        return self.draft.compute_logits(h)

    def kv_layer_specs(self):
        c = self.draft.config
        return [(self.draft.num_local_kv_heads, c.head_dim)] * c.num_hidden_layers

    def bind_kv_cache(self, first_layer: int) -> None:
        for i, layer in enumerate(self.draft.layers):
            layer.self_attn.layer_idx = first_layer + i

    def on_request_finished(self, request) -> None:
        self._synced.pop(request.request_id, None)
        self._chain_fed.pop(request.request_id, None)

    def drafting_seconds(self, num_requests: int, num_spec_tokens: int) -> float | None:
        """Seconds of drafting `num_spec_tokens`-token chains for `num_requests` requests: a
        one-row pass each, as measured (None until one was). A request's catch-up rows (the
        tokens it was verified on since it last drafted) are left out: every token the target
        keeps is fed to the draft model at most once, whichever drafter drafted it, so they are
        paid - at a fraction of a pass per row - whichever drafter this step chooses."""
        if not self.pass_seconds.means:
            return None
        return num_spec_tokens * self.pass_seconds.mean(num_requests)

    def catch_up_seconds(self, inp: ProposerInput, i: int) -> float:
        """Seconds request i's next draft would spend catching the draft model up: the rows beyond
        a steady step's it has not been fed (every token since it last drafted), at the measured
        seconds of a catch-up row (0 until one was measured)."""
        req = inp.requests[i]
        pre, synced = self._synced.get(req.request_id, (req.num_preemptions, 0))
        if pre != req.num_preemptions:
            synced = 0
        return max(0, inp.seq_lens[i] + 1 - synced - steady_rows(self.k)) * self.catch_up_row_seconds

    # ------------------------------------------------------------------------------------------
    def _segments(self, inp: ProposerInput) -> list[_Segment]:
        """Per request that drafts this step: the positions from its first stale draft entry up to
        its newest token, then the root of its draft."""
        segs = []
        offsets = [0]
        for q in inp.query_lens:
            offsets.append(offsets[-1] + q)
        step_tokens = inp.token_ids.tolist()
        for i, req in enumerate(inp.requests):
            if not inp.want_draft[i]:
                # left behind until it next drafts: a request the allocation seldom drafts for
                # does not pay the draft model for its prompt and answer each time another
                # request in the batch drafts
                continue
            seq = inp.seq_lens[i]
            first = seq - inp.query_lens[i]          # position of this step's first valid row
            pre, synced = self._synced.get(req.request_id, (req.num_preemptions, 0))
            fed_at, fed = self._chain_fed.pop(req.request_id, (-1, ()))
            if pre != req.num_preemptions:
                synced = 0
            elif fed_at == synced:
                synced = _matching_prefix_end(req.all_token_ids, synced, fed, seq)
            synced = min(synced, seq)
            if synced < first:
                tokens = list(req.all_token_ids[synced:first]) + step_tokens[offsets[i]:offsets[i + 1]]
            else:
                tokens = step_tokens[offsets[i] + synced - first:offsets[i + 1]]
            tokens.append(int(inp.next_token_ids[i]))
            segs.append(_Segment(i, synced, tokens))
            self._synced[req.request_id] = (req.num_preemptions, seq + 1)
        return segs

    def _feed(self, segs: list[_Segment], inp: ProposerInput, kv_cache, block_size: int) -> dict[int, torch.Tensor]:
        """Run the draft model over the segments in passes of at most max_rows rows (a segment may
        span passes, in order); returns each root segment's final hidden state by request row."""
        dev = inp.token_ids.device
        roots: dict[int, torch.Tensor] = {}
        pending = [(s, 0) for s in segs]           # (segment, rows of it already fed)
        while pending:
            batch, room, rest = [], self.max_rows, []
            for s, done in pending:
                if room == 0:
                    rest.append((s, done))
                    continue
                n = min(room, len(s.tokens) - done)
                batch.append((s, done, n))
                room -= n
                if done + n < len(s.tokens):
                    rest.append((s, done + n))
            ids = torch.tensor([t for s, d, n in batch for t in s.tokens[d:d + n]], dtype=torch.long, device=dev)
            pos = torch.cat([torch.arange(s.start + d, s.start + d + n) for s, d, n in batch]).to(dev)
            rows = torch.tensor([s.row for s, _, _ in batch], dtype=torch.long, device=dev)
            bt = inp.block_tables[rows]
            qlens = [n for _, _, n in batch]
            seg_index = torch.repeat_interleave(torch.arange(len(batch), device=dev), torch.tensor(qlens, device=dev))
            slots = slots_for_positions(bt, seg_index, pos, block_size)
            seq_lens = [s.start + d + n for s, d, n in batch]
            meta = AttentionMetadata(slots, qlens, seq_lens, bt, block_size, CAUSAL,
                                     row_invariant=self.row_invariant).finalize()
            h, _ = self.draft.run_layers(ids, pos, meta, kv_cache)
            ends = torch.cumsum(torch.tensor(qlens), 0) - 1
            for j, (s, d, n) in enumerate(batch):
                if d + n == len(s.tokens):
                    roots[s.row] = h[int(ends[j])]
            pending = rest
        return roots

    @torch.inference_mode()
    def propose(self, inp: ProposerInput, kv_cache, block_size: int, num_spec_tokens: int):
        R = len(inp.query_lens)
        out: list[Draft | None] = [None] * R
        self.last_catch_up_seconds = 0.0
        if not any(inp.want_draft) or num_spec_tokens <= 0:
            return out                   # nothing to draft: the positions are caught up later
        segs = self._segments(inp)
        t0 = time.perf_counter()
        roots = self._feed(segs, inp, kv_cache, block_size)
        self.last_catch_up_seconds = catch_up_share(segs, num_spec_tokens) * (time.perf_counter() - t0)
        rows = catch_up_rows(segs, num_spec_tokens)
        if rows >= self.CATCH_UP_ROWS_MEASURED:
            per_row, old = self.last_catch_up_seconds / rows, self.catch_up_row_seconds
            self.catch_up_row_seconds = per_row if old == 0.0 else old + 0.1 * (per_row - old)
        want = [i for i in range(R) if inp.want_draft[i] and i in roots]
        dev = inp.token_ids.device
        sel = torch.tensor(want, device=dev)
        h = torch.stack([roots[i] for i in want])
        logits = self.logits_step(h)
        if self.topk > 1:
            trees = draft_trees(self, logits, h, inp, sel, kv_cache, block_size, num_spec_tokens, entry_shift=1)
            for j, i in enumerate(want):
                out[i] = Draft.from_tree(trees[j], self.method)
            return out
        n = len(want)
        bt = inp.block_tables[sel]
        ar = torch.arange(n, device=dev)
        pos = torch.tensor([inp.seq_lens[i] + 1 for i in want], device=dev)   # where the first draft goes
        tok, prob = _top1(logits)
        drafts, path = [tok], [prob]
        # a request's chain ends after a token the draft model gives less than the threshold
        alive = prob >= self.confidence_threshold
        length = torch.ones(n, dtype=torch.long, device=dev)
        for _ in range(num_spec_tokens - 1):
            if not bool(alive.any()):
                break
            length += alive
            t0 = time.perf_counter()
            slots = slots_for_positions(bt, ar, pos, block_size)
            meta = AttentionMetadata(slots, [1] * n, (pos + 1).tolist(), bt, block_size, CAUSAL,
                                     row_invariant=self.row_invariant).finalize()
            tok, prob = _top1(self.logits_step(self.layer_step(tok, pos, None, meta, kv_cache)))
            self.pass_seconds.observe(n, time.perf_counter() - t0)
            drafts.append(tok)
            path.append(path[-1] * prob)
            alive &= prob >= self.confidence_threshold
            pos = pos + 1
        d = torch.stack(drafts, 1).tolist()
        p = torch.stack(path, 1).tolist()
        for j, (i, m) in enumerate(zip(want, length.tolist())):
            out[i] = Draft.chain(d[j][:m], self.method, p[j][:m])
            # the chain passes wrote entries for every draft token but the last, from the
            # position after the root on: those the target keeps need not be fed again
            self._chain_fed[inp.requests[i].request_id] = (inp.seq_lens[i] + 1, d[j][:len(drafts) - 1])
        return out


def steady_rows(num_spec_tokens: int) -> int:
    """The most rows a request drafting every step feeds: the tokens its last verification
    emitted (at most all K drafts and the bonus token), then the root."""
    return num_spec_tokens + 2


def catch_up_rows(segs: list[_Segment], num_spec_tokens: int) -> int:
    """A feed's rows beyond its requests' steady rows: those that catch them up."""
    steady = steady_rows(num_spec_tokens)
    return sum(max(0, len(s.tokens) - steady) for s in segs)


def catch_up_share(segs: list[_Segment], num_spec_tokens: int) -> float:
    """The share of a feed's rows that catch requests up (`catch_up_rows`). A request that has not drafted for a while - the allocation skipped
    it, or it is a new turn of a long conversation - feeds every token since in one prefill-like
    pass; each token is fed once whichever step feeds it, so that work is no price of this step's
    draft, and counting it there made one long prompt price drafting out for the rest of a run."""
    rows = sum(len(s.tokens) for s in segs)
    return catch_up_rows(segs, num_spec_tokens) / rows if rows else 0.0


def _matching_prefix_end(tokens, start: int, fed, limit: int) -> int:
    """The first position from `start` on (at most `limit`) where the request's tokens leave the
    chain tokens `fed` there: the draft model's entries before it hold the request's own tokens."""
    end = start
    for t in fed:
        if end >= limit or end >= len(tokens) or int(tokens[end]) != int(t):
            break
        end += 1
    return end


def _top1(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy draft tokens [n] and the draft model's probability of each [n]."""
    tok = row_argmax(logits)
    lse = torch.logsumexp(logits.float(), -1)
    return tok, torch.exp(logits.float().gather(1, tok[:, None])[:, 0] - lse)
