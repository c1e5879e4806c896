"""Paged attention over a flattened batch of requests.

Every request contributes `query_len` tokens to the flat batch (prefill chunks, 1 decode token,
1 + K verification tokens, a tree of draft nodes, or a DFlash block). Its keys are the first
`seq_len` entries of its cache, in cache-index order (entry j lives at slot
`block_table[j // block_size] * block_size + j % block_size`). The last `query_len` of those
entries are the ones written in this step; the rest (`context_len = seq_len - query_len`) are
always visible. Among the step's own entries the mask is one of:

- ``causal``: query i sees step entries 0..i (prefill, decode, chain verification);
- ``noncausal``: query i sees every step entry (DFlash's block);
- ``tree``: query i sees step entry j iff ``tree_mask[r, i, j]`` (tree drafting / verification;
  tree nodes are stored at consecutive cache entries while their RoPE positions are depth-based).

The metadata is built once per forward and shared by every layer.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from draftwise.kernels import attend_rows_kernel

CAUSAL, NONCAUSAL, TREE = "causal", "noncausal", "tree"


# Requests whose query is at most this long (decode, verification, tree, DFlash block) attend in
# one batched call; a longer query (a prefill chunk) attends on its own, so a mixed step does not
# pad every decode row to the prefill chunk's length.
MAX_BATCHED_QUERY = 16


@dataclass
class AttentionGroup:
    """Requests that attend in one dense SDPA call, with everything derived for it."""
    req_index: list[int]                    # requests of the step in this group
    token_rows: torch.Tensor | None         # [Tg] rows of the flat batch (None: all rows, in order)
    query_lens: list[int]
    seq_lens: list[int]
    kv_slots: torch.Tensor                  # [Rg, max_kv]
    attn_mask: torch.Tensor | None          # [Rg, 1, max_q, max_kv] bool or None (no masking needed)
    uniform: bool                           # all query_lens equal: pure reshapes
    q_index: torch.Tensor | None = None     # [Rg, max_q] rows of the group's tokens (Tg = padding)
    out_index: torch.Tensor | None = None   # [Tg] rows of the padded [Rg*max_q] output
    kv_start: int | None = None             # one request whose visible entries are consecutive
    #   cache slots kv_start .. kv_start + seq_len - 1: K/V are read in place (no gather)
    _grouped_masks: dict | None = None      # attn_mask repeated per query group, by group size
    square: bool = False                    # one causal request with no earlier context (a first
    #   prefill chunk): SDPA's own causal mask, no mask tensor

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    def grouped_mask(self, groups: int) -> torch.Tensor | None:
        """attn_mask for `groups` query heads folded into the query axis ([R, 1, G*max_q, max_kv]);
        built once per step and shared by every layer."""
        if self.attn_mask is None or groups == 1:
            return self.attn_mask
        if groups not in self._grouped_masks:
            self._grouped_masks[groups] = self.attn_mask.repeat(1, 1, groups, 1)
        return self._grouped_masks[groups]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] cache slot each query token's K/V is written to
    query_lens: list[int]               # per request
    seq_lens: list[int]                 # per request, keys visible after this step's writes
    block_tables: torch.Tensor          # [R, max_blocks]
    block_size: int
    mask_kind: str = CAUSAL
    tree_mask: torch.Tensor | None = None   # [R, max_q, M] bool, for mask_kind == TREE: query i
    #   sees the j-th of the request's last `tree_kv_lens[r]` cache entries iff tree_mask[r, i, j];
    #   earlier entries are always visible. tree_kv_lens defaults to query_lens (verification);
    #   tree *drafting* passes cover all tree entries written so far.
    tree_kv_lens: list[int] | None = None
    # row-invariant attention: every query row of a causal query (decode, chain verification,
    # prefill chunks of any length) attends alone over exactly its keys, with no padding and no
    # mask, exactly as plain decoding of that token at batch 1 would - so a token's K/V and logits
    # depend neither on how many drafts or requests shared its step nor on how its prompt was
    # chunked (quantized targets round activations to bf16, which turns last-bit differences into
    # different outputs). One kernel call per layer where draftwise's kernels run, else one SDPA
    # call per row and layer.
    row_invariant: bool = False
    groups: list[AttentionGroup] | None = None   # derived by finalize()
    row_plan: list | None = None                 # row-invariant queries (finalize)
    window_plans: dict = field(default_factory=dict)   # sliding window -> its row plan (window_plan)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    def finalize(self) -> "AttentionMetadata":
        """Split the requests into attention groups (short queries batched together, each long
        query alone) and derive each group's gather indices and mask."""
        R = len(self.query_lens)
        # row-invariant mode covers causal queries and tree verification (every node attends alone
        # over the context and its ancestors: the keys plain decoding of that path would have)
        rows_alone = self.row_invariant and (self.mask_kind == CAUSAL
                                             or (self.mask_kind == TREE and self.tree_kv_lens is None))
        short = [r for r in range(R) if rows_alone or self.query_lens[r] <= MAX_BATCHED_QUERY]
        long_ = [r for r in range(R) if not rows_alone and self.query_lens[r] > MAX_BATCHED_QUERY]
        self.row_plan = None
        if rows_alone:
            self.row_plan = self._row_plan(short)
            short = []                           # attended row by row (paged_attention)
        parts = ([short] if short else []) + [[r] for r in long_]
        if not parts:
            self.groups = []
            return self
        if len(parts) == 1 and not self.row_plan:     # one group covers every row
            self.groups = [self._group(parts[0], None)]
            return self
        starts = [0]
        for q in self.query_lens:
            starts.append(starts[-1] + q)
        dev = self.block_tables.device
        self.groups = []
        for reqs in parts:
            rows = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in reqs]).to(dev)
            self.groups.append(self._group(reqs, rows))
        return self

    def _row_plan(self, reqs: list[int]) -> list:
        """Row-invariant mode: (first row, seq_len of each row, key slots of the longest) for each
        request in `reqs`; its rows attend one at a time over exactly their own keys."""
        dev = self.block_tables.device
        starts = [0]
        for q in self.query_lens:
            starts.append(starts[-1] + q)
        plan = []
        # every request's cache slots in position order, one row per request (its first s are its
        # keys): three tensor ops for the step instead of a handful per request
        bs = self.block_size
        table_slots = (self.block_tables[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)
        for r in reqs:
            q, s = self.query_lens[r], self.seq_lens[r]
            slots = table_slots[r, :s]
            if self.mask_kind == TREE:
                # one entry per row: the context, then the step's entries its mask row allows
                # (parents precede children, so these are its ancestors in depth order, then itself)
                ctx = torch.arange(s - q, device=dev)
                for i in range(q):
                    mine = torch.nonzero(self.tree_mask[r, i, :q]).flatten() + (s - q)
                    keys = slots[torch.cat([ctx, mine])]
                    plan.append((starts[r] + i, [keys.numel()], keys))
            else:
                plan.append((starts[r], list(range(s - q + 1, s + 1)), slots))
        return plan

    def window_plan(self, window: int) -> list:
        """The row plan of a sliding-window layer: each row attends alone over the last `window`
        of its keys (a row's keys are in position order - the context, then its own causal or
        tree-ancestor entries - so the window is the tail of its list). Built once per step and
        window, shared by every layer of that window."""
        plan = self.window_plans.get(window)
        if plan is not None:
            return plan
        if self.row_plan is None and self.mask_kind != CAUSAL:
            raise ValueError("sliding-window attention runs causal and tree-verification steps only")
        base = self.row_plan if self.row_plan is not None else self._row_plan(list(range(len(self.query_lens))))
        plan = []
        for start, seq_lens, slots in base:
            if max(seq_lens) <= window:
                plan.append((start, seq_lens, slots))
                continue
            for i, n in enumerate(seq_lens):
                k0 = max(0, n - window)
                plan.append((start + i, [n - k0], slots[k0:n]))
        self.window_plans[window] = plan
        return plan

    def _group(self, reqs: list[int], token_rows) -> AttentionGroup:
        dev = self.block_tables.device
        q_list = [self.query_lens[r] for r in reqs]
        s_list = [self.seq_lens[r] for r in reqs]
        all_reqs = len(reqs) == len(self.query_lens)
        bt = self.block_tables if all_reqs else self.block_tables[torch.tensor(reqs, device=dev)]
        R = len(reqs)
        max_q, max_kv = max(q_list), max(s_list)
        T = sum(q_list)
        q_lens = torch.tensor(q_list, device=dev)
        s_lens = torch.tensor(s_list, device=dev)
        j = torch.arange(max_kv, device=dev)
        width = bt.shape[1]
        blk = torch.clamp(j // self.block_size, max=width - 1)
        kv_slots = bt[:, blk] * self.block_size + (j % self.block_size)[None, :]
        kv_start = None
        if R == 1 and dev.type == "cpu":
            used = bt[0, :-(-max_kv // self.block_size)]
            if used.numel() == 1 or bool((used[1:] - used[:-1] == 1).all()):
                kv_start = int(used[0]) * self.block_size
        uniform = min(q_list) == max_q
        square = R == 1 and self.mask_kind == CAUSAL and q_list[0] == s_list[0] and q_list[0] > 1
        q_index = out_index = None
        if not uniform:
            starts = torch.cumsum(q_lens, 0) - q_lens
            i = torch.arange(max_q, device=dev)
            idx = starts[:, None] + i[None, :]
            q_index = torch.where(i[None, :] < q_lens[:, None], idx, torch.full_like(idx, T))
            req = torch.repeat_interleave(torch.arange(R, device=dev), q_lens)
            pos_in_req = torch.arange(T, device=dev) - starts[req]
            out_index = req * max_q + pos_in_req
        tree_mask = self.tree_mask
        tree_kv = self.tree_kv_lens
        if tree_mask is not None and not all_reqs:
            tree_mask = tree_mask[torch.tensor(reqs, device=tree_mask.device)]
            tree_kv = None if tree_kv is None else [tree_kv[r] for r in reqs]
        mask = None if square else _build_mask(self.mask_kind, q_lens, s_lens, max_q, max_kv, tree_mask, tree_kv)
        return AttentionGroup(reqs, token_rows, q_list, s_list, kv_slots, mask, uniform, q_index,
                              out_index, kv_start, {}, square)


def _build_mask(kind, q_lens, s_lens, max_q, max_kv, tree_mask, tree_kv_lens):
    all_full = int(s_lens.min()) == max_kv
    if kind == NONCAUSAL or (kind == CAUSAL and max_q == 1):
        if all_full:
            return None
        m = torch.arange(max_kv, device=q_lens.device)[None, :] < s_lens[:, None]
        return m[:, None, None, :].expand(-1, 1, max_q, -1)
    qi = torch.arange(max_q, device=q_lens.device)[None, :, None]
    kj = torch.arange(max_kv, device=q_lens.device)[None, None, :]
    ql, sl = q_lens[:, None, None], s_lens[:, None, None]
    ctx = sl - ql
    rel = kj - ctx
    valid = kj < sl
    if kind == CAUSAL:
        allowed = valid & (rel <= qi)
    elif kind == TREE:
        tm = tree_mask
        if tm is None:
            raise ValueError("tree attention needs tree_mask")
        R = q_lens.shape[0]
        if tree_kv_lens is not None:
            ctx = sl - torch.tensor(tree_kv_lens, device=q_lens.device)[:, None, None]
            rel = kj - ctx
        M = tm.shape[2]
        relc = rel.clamp(0, M - 1).expand(R, max_q, max_kv)
        within = torch.gather(tm[:, :max_q, :], 2, relc)
        allowed = valid & ((kj < ctx) | within)
    else:
        raise ValueError(f"unknown mask kind {kind!r}")
    allowed = allowed | ((qi >= ql) & (kj == 0))   # padded query rows: see one key, output dropped
    return allowed[:, None]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_slots, Hkv, D]. Returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    return attend_cached(q, k_cache, v_cache, meta, scale, window)


def attend_cached(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, window: int = 0) -> torch.Tensor:
    """Attention of q over the caches, the step's own K/V already written (paged_attention after
    its write; the fused int4 layer writes K/V itself). The output has q's dtype. `window` > 0: a
    sliding-window layer, each query seeing only its last `window` keys (itself included)."""
    if window and max(meta.seq_lens, default=0) > window:
        out = torch.empty_like(q)
        _attend_rows(q, k_cache, v_cache, meta.window_plan(window), scale, out)
        return out
    if len(meta.groups) == 1 and not meta.row_plan:
        return _attend_group(q, k_cache, v_cache, meta.groups[0], scale).to(q.dtype)
    out = torch.empty_like(q)
    for g in meta.groups:
        out[g.token_rows] = _attend_group(q[g.token_rows], k_cache, v_cache, g, scale).to(q.dtype)
    if meta.row_plan:
        _attend_rows(q, k_cache, v_cache, meta.row_plan, scale, out)
    return out


def _attend_rows(q, k_cache, v_cache, plan, scale: float, out: torch.Tensor) -> None:
    """Row-invariant attention: each row alone over exactly its own keys (a prefix of its request's
    keys, gathered once), the computation plain decoding at batch 1 does for that token. On CPUs
    with draftwise's kernels (fp32 caches, head_dim a multiple of 16) one C++ call does every row
    in a fixed order of operations; otherwise one SDPA call per row."""
    if attend_rows_kernel(q, k_cache, v_cache, plan, scale, out):
        return
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    for start, seq_lens, slots in plan:
        keys = k_cache.index_select(0, slots).unsqueeze(0).transpose(1, 2)      # [1, Hkv, L, D]
        vals = v_cache.index_select(0, slots).unsqueeze(0).transpose(1, 2)
        for i, s in enumerate(seq_lens):
            qg = q[start + i].reshape(1, Hkv, G, D)
            o = F.scaled_dot_product_attention(qg, keys[:, :, :s].to(q.dtype), vals[:, :, :s].to(q.dtype),
                                               scale=scale)
            out[start + i] = o.reshape(H, D)


def _attend_group(q, k_cache, v_cache, g: AttentionGroup, scale: float) -> torch.Tensor:
    """One group's attention. Grouped-query heads are folded into the query axis
    ([R, Hkv, G * max_q, D], the mask repeated per group) so SDPA runs one dense kernel per KV head
    instead of expanding K/V."""
    R = g.num_reqs
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    max_kv = g.kv_slots.shape[1]
    if g.square:
        return _attend_square(q, k_cache, v_cache, g, scale)
    if g.kv_start is not None:       # consecutive blocks: read the cache in place
        keys = k_cache[g.kv_start:g.kv_start + max_kv].unsqueeze(0).transpose(1, 2)
        vals = v_cache[g.kv_start:g.kv_start + max_kv].unsqueeze(0).transpose(1, 2)
    else:
        flat = g.kv_slots.view(-1)
        keys = k_cache.index_select(0, flat).view(R, max_kv, Hkv, D).transpose(1, 2)   # [R, Hkv, max_kv, D]
        vals = v_cache.index_select(0, flat).view(R, max_kv, Hkv, D).transpose(1, 2)
    if g.uniform:
        qp = q.view(R, T // R, H, D)
    else:
        qp = torch.cat([q, q.new_zeros(1, H, D)], 0)[g.q_index]
    max_q = qp.shape[1]
    # [R, max_q, Hkv, G, D] -> [R, Hkv, G, max_q, D] -> [R, Hkv, G * max_q, D]
    qg = qp.view(R, max_q, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, G * max_q, D)
    out = F.scaled_dot_product_attention(qg, keys.to(q.dtype), vals.to(q.dtype),
                                         attn_mask=g.grouped_mask(G), scale=scale)
    out = out.view(R, Hkv, G, max_q, D).permute(0, 3, 1, 2, 4)    # [R, max_q, Hkv, G, D]
    if g.uniform:
        return out.reshape(T, H, D)
    return out.reshape(R * max_q, H, D)[g.out_index]


def _attend_square(q, k_cache, v_cache, g: AttentionGroup, scale: float) -> torch.Tensor:
    """A first prefill chunk: T queries over exactly their own T keys, causal - SDPA's flash kernel
    with its own causal mask (it skips the masked half; no mask tensor is built). Over a bf16 CPU
    cache it runs in bf16 (q rounded once; the kernel accumulates in fp32), reading K/V in place:
    ~2.5x faster than fp32 copies of them. Returns [T, H, D] in the dtype it ran in."""
    T, H, D = q.shape
    dt = torch.bfloat16 if (q.device.type == "cpu" and k_cache.dtype == torch.bfloat16) else q.dtype
    if g.kv_start is not None:
        keys, vals = k_cache[g.kv_start:g.kv_start + T], v_cache[g.kv_start:g.kv_start + T]
    else:
        flat = g.kv_slots.view(-1)
        keys, vals = k_cache.index_select(0, flat), v_cache.index_select(0, flat)
    out = F.scaled_dot_product_attention(q.to(dt).transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0).to(dt),
                                         vals.transpose(0, 1).unsqueeze(0).to(dt), is_causal=True, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1).contiguous()                      # [T, H, D]


# --- the attention call inside (possibly compiled) model code ---------------------------------------
# A compiled graph cannot take the per-step metadata (Python lists, ragged shapes) as inputs without
# recompiling for every batch. As in vLLM, the metadata and the KV cache travel in a forward context
# set around the call, and attention is an opaque custom op that reads it: the graph around it is
# compiled for a padded token count, the op attends over the real tokens only.
_context: list[tuple[AttentionMetadata, object]] = []


@contextmanager
def forward_context(meta: AttentionMetadata, kv_cache):
    _context.append((meta, kv_cache))
    try:
        yield
    finally:
        _context.pop()


@torch.library.custom_op("draftwise::paged_attention", mutates_args=())
def _paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int,
                        scale: float, window: int) -> torch.Tensor:
    if not _context:
        raise RuntimeError("paged attention called outside a forward_context")
    meta, kv_cache = _context[-1]
    n = meta.slot_mapping.shape[0]          # real tokens; rows past n are bucket padding
    k_cache, v_cache = kv_cache.layer(layer_idx)
    out = paged_attention(q[:n], k[:n], v[:n], k_cache, v_cache, meta, scale, window)
    if n == q.shape[0]:
        return out.contiguous()
    return torch.cat([out, out.new_zeros(q.shape[0] - n, *q.shape[1:])], 0)


@_paged_attention_op.register_fake
def _(q, k, v, layer_idx, scale, window):
    return torch.empty_like(q)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float,
           meta: AttentionMetadata | None, kv_cache, window: int = 0) -> torch.Tensor:
    """Attention for layer `layer_idx`: direct in eager mode (metadata passed in), through the
    custom op when the metadata lives in the forward context (compiled graphs pass None).
    `window` > 0: a sliding-window layer (attend_cached)."""
    if meta is not None:
        k_cache, v_cache = kv_cache.layer(layer_idx)
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale, window)
    return _paged_attention_op(q, k, v, layer_idx, scale, window)


def cache_slots(block_ids: list[int], start: int, n: int, block_size: int) -> list[int]:
    """The paged-slot mapping of one request's cache indices [start, start + n) as a list: what
    `slots_for_positions` gives for them, built on the host block by block (a step's inputs are a
    few rows per request; a dozen small tensor ops per step cost more than the list). A position
    past the request's blocks raises IndexError instead of landing in another request's slots."""
    out: list[int] = []
    p, end = start, start + n
    while p < end:
        b, off = divmod(p, block_size)
        take = min(block_size - off, end - p)
        base = block_ids[b] * block_size + off
        out.extend(range(base, base + take))
        p += take
    return out


def slots_for_positions(block_tables: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
                        block_size: int) -> torch.Tensor:
    """The paged-slot mapping: cache slot of absolute cache index `positions` of request `req_index`
    (block number clamped to the table width)."""
    width = block_tables.shape[1]
    blk = torch.clamp(positions // block_size, max=width - 1)
    return block_tables[req_index, blk] * block_size + positions % block_size
