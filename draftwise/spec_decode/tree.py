"""EAGLE-2/3 tree drafting and tree verification (in the style of MNN's TokenTree / evaluatePosterior).

Drafting (`draft_trees`): every wanted request grows one tree of `depth` levels; each level keeps
the global top-k leaves (by cumulative draft log-probability) as the next frontier. All requests'
frontiers go through the draft layer together, one batched pass per level, with TREE attention
over the paged draft KV:

    cache entry   seq_len + (d-1)*k + i   holds the i-th frontier node of depth d (d = 1 .. depth-1)
    RoPE position seq_len + d - 1         for every depth-d node (the chain's recurrence position)
    hidden        the pre-norm output at the node's parent (the prefill's last row for depth 1)

where `seq_len` is the cache entry / position of the sampled token (the tree's root) and k = topk.
Entries before `seq_len` are always visible; among the tree entries a node sees itself and its
ancestors (`TokenTree.get_mask()`). The deepest level is scored but never fed, so a tree writes
(depth-1)*k draft entries. `finalize` keeps the best `num_spec_tokens` nodes.

Verification (`verify_trees`): greedy = the longest path whose tokens equal the target argmax at
their parent; sampling = SpecInfer-style multi-candidate recursive rejection sampling (drafts are
deterministic, q one-hot). The target-layer K/V of the accepted nodes is then moved to the
request's next contiguous cache entries (`compact_tree_kv`), so the scheduler's rollback leaves
exactly the accepted path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftwise.kernels import row_argmax
from draftwise.layers.attention import TREE, AttentionMetadata, slots_for_positions
from draftwise.sample.sampler import SamplingMetadata, target_probs


@dataclass
class TreeDraft:
    """A finalized draft tree. Index 0 is the root (the sampled token, already known); nodes
    1..n-1 are in creation order (parents before children)."""
    token_ids: list[int]              # [n] target-vocabulary ids; [0] = root
    depths: torch.Tensor              # [n] long: root 0, its children 1, ...
    mask: torch.Tensor                # [n, n] bool: ancestor-or-self (column 0, the root, always set)
    parents: list[int]                # [n] tree index of each node's parent; parents[0] = -1
    retrieve_indices: list[list[int]] = field(default_factory=list)  # one root-to-leaf path per leaf
    scores: torch.Tensor | None = None  # [n] float: cumulative draft log-probability (root 0)

    @property
    def num_nodes(self) -> int:
        """Draft nodes (the root excluded)."""
        return len(self.token_ids) - 1

    def children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in self.token_ids]
        for i, p in enumerate(self.parents):
            if p >= 0:
                ch[p].append(i)
        return ch


def tree_draft_from_parents(root_token: int, tokens: list[int], parents: list[int],
                            probs: list[float] | None = None) -> TreeDraft:
    """A TreeDraft from nodes in creation order (`parents[i]` the index of node i's parent among the
    nodes, -1 for a child of the root), as model-free drafters (suffix decoding) produce them."""
    n = len(tokens) + 1
    par = [-1] + [p + 1 for p in parents]
    depths = [0] * n
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        if not 0 <= par[i] < i:
            raise ValueError(f"tree node {i - 1} has parent {parents[i - 1]}: parents must come first")
        depths[i] = depths[par[i]] + 1
        mask[i] |= mask[par[i]]
    has_child = set(par[1:])
    paths = []
    for leaf in range(1, n):
        if leaf not in has_child:
            path, cur = [], leaf
            while cur >= 0:
                path.append(cur)
                cur = par[cur]
            paths.append(path[::-1])
    scores = None
    if probs is not None:
        scores = torch.tensor([0.0] + [float(p) for p in probs]).clamp_min(1e-12).log()
        scores[0] = 0.0
    return TreeDraft([int(root_token)] + [int(t) for t in tokens], torch.tensor(depths), mask, par, paths,
                     scores)


class TokenTree:
    """A token tree (MNN-style TokenTree), batched over B trees as tensors.

    Node ids are creation order (init's k nodes are 0..k-1, every grow appends A*k candidates).
    `parents` holds node ids (-1 = the virtual root), `scores` cumulative log-probabilities,
    `depth` the drafting depth + 1 (root children 1). Inputs may be unbatched ([k] / [A, k]); then
    `finalize` returns one TreeDraft instead of a list."""

    def __init__(self, topk: int, d2t: torch.Tensor | None = None):
        self.topk = topk
        self.d2t = d2t
        self.unbatched = False
        self.active_parents: torch.Tensor | None = None   # [B, k] frontier index of each new active's parent

    def _d2t(self, idx: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return idx
        return idx + self.d2t.to(idx.device)[idx]

    def init(self, indices: torch.Tensor, scores: torch.Tensor) -> None:
        """The root's top-k: indices/scores [B, k] draft ids and their log-probabilities."""
        if indices.dim() == 1:
            self.unbatched = True
            indices, scores = indices[None], scores[None]
        B, k = indices.shape
        dev = indices.device
        self.tokens = self._d2t(indices.long())
        self.parents = torch.full((B, k), -1, dtype=torch.long, device=dev)
        self.scores = scores.float().clone()
        self.depth = torch.ones(B, k, dtype=torch.long, device=dev)
        self.actives = torch.arange(k, device=dev).expand(B, k).clone()
        self.active_parents = None
        self.mask = torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k).clone()

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def get_ids(self) -> torch.Tensor:
        """[B, k] target ids of the frontier (the next draft pass's input)."""
        out = self.tokens.gather(1, self.actives)
        return out[0] if self.unbatched else out

    def get_mask(self) -> torch.Tensor:
        """[B, k, M] frontier i sees the j-th of the M tree entries fed so far (pass by pass, k per
        pass) iff it is one of its ancestors or itself."""
        return self.mask[0] if self.unbatched else self.mask

    def grow(self, indices: torch.Tensor, scores: torch.Tensor) -> None:
        """Expand every frontier node by its top-k: indices/scores [B, A, k] (or [B, A*k]), the
        children of frontier node a at [:, a]. Keeps the global top-k by cumulative score as the
        next frontier (ties: creation order)."""
        if self.unbatched:
            indices, scores = indices[None], scores[None]
        B, A = self.actives.shape
        indices = indices.reshape(B, A, -1)
        scores = scores.reshape(B, A, -1).float()
        c = indices.shape[2]
        N = self.num_nodes
        dev = indices.device
        parent_cum = self.scores.gather(1, self.actives)                       # [B, A]
        cum = (parent_cum[:, :, None] + scores).reshape(B, A * c)
        par = self.actives[:, :, None].expand(B, A, c).reshape(B, A * c)
        pdepth = self.depth.gather(1, self.actives)[:, :, None].expand(B, A, c).reshape(B, A * c)
        self.tokens = torch.cat([self.tokens, self._d2t(indices.long()).reshape(B, A * c)], 1)
        self.parents = torch.cat([self.parents, par], 1)
        self.scores = torch.cat([self.scores, cum], 1)
        self.depth = torch.cat([self.depth, pdepth + 1], 1)
        k = min(self.topk, A * c)
        order = torch.sort(cum, dim=1, descending=True, stable=True).indices[:, :k]   # [B, k]
        self.active_parents = order // c
        self.actives = N + order
        M = self.mask.shape[2]
        rows = self.mask.gather(1, self.active_parents[:, :, None].expand(B, k, M))
        self.mask = torch.cat([rows, torch.eye(k, dtype=torch.bool, device=dev).expand(B, k, k)], 2)

    def finalize(self, sample_token, max_draft_tokens: int):
        """Keep the best `max_draft_tokens` nodes by cumulative score (ties: earlier node), in
        creation order, behind the sampled token. A kept node's parent is always kept (a child's
        cumulative score never exceeds its parent's)."""
        B, N = self.tokens.shape
        dev = self.tokens.device
        if not torch.is_tensor(sample_token):
            sample_token = torch.tensor(sample_token, dtype=torch.long)
        sample_token = sample_token.reshape(-1).to(dev)
        M = max(0, min(max_draft_tokens, N))
        order = torch.sort(self.scores, dim=1, descending=True, stable=True).indices[:, :M]
        kept = torch.sort(order, dim=1).values                                   # [B, M] node ids
        idx_of = torch.full((B, N + 1), -1, dtype=torch.long, device=dev)        # node id + 1 -> index
        idx_of[:, 0] = 0                                                         # the virtual root
        idx_of.scatter_(1, kept + 1, torch.arange(1, M + 1, device=dev).expand(B, M))
        parents = idx_of.gather(1, self.parents.gather(1, kept) + 1)            # [B, M]
        if bool((parents < 0).any()):
            raise AssertionError("finalize kept a node without its parent")
        n = M + 1
        parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), parents], 1)
        tokens = torch.cat([sample_token[:, None], self.tokens.gather(1, kept)], 1)
        depths = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), self.depth.gather(1, kept)], 1)
        scores = torch.cat([torch.zeros(B, 1, device=dev), self.scores.gather(1, kept)], 1)
        # ancestor-or-self: row i = row parent(i) | e_i; parents precede children
        mask = torch.eye(n, dtype=torch.bool, device=dev).expand(B, n, n).clone()
        ar = torch.arange(B, device=dev)
        for i in range(1, n):
            mask[:, i] |= mask[ar, parents[:, i]]
        has_child = torch.zeros(B, n, dtype=torch.bool, device=dev)
        has_child[ar[:, None].expand(B, M), parents[:, 1:]] = True
        out = []
        tok_l, par_l, leaf_l = tokens.tolist(), parents.tolist(), (~has_child).tolist()
        for b in range(B):
            paths = []
            for leaf in range(1, n):
                if leaf_l[b][leaf]:
                    path, cur = [], leaf
                    while cur >= 0:
                        path.append(cur)
                        cur = par_l[b][cur]
                    paths.append(path[::-1])
            if n == 1:
                paths = [[0]]
            out.append(TreeDraft(tok_l[b], depths[b].cpu(), mask[b].cpu(), par_l[b], paths, scores[b].cpu()))
        return out[0] if self.unbatched else out


# --- drafting --------------------------------------------------------------------------------------
def draft_trees(proposer, logits: torch.Tensor, h: torch.Tensor, inp, sel: torch.Tensor, kv_cache,
                block_size: int, num_spec_tokens: int, d2t: torch.Tensor | None = None,
                entry_shift: int = 0) -> list[TreeDraft]:
    """One TreeDraft per wanted request. logits [n, draft_vocab] / h [n, H]: the draft's outputs at
    each wanted request's last valid row (they predict the root's children); `d2t` maps draft ids
    to target ids. `entry_shift` moves every tree entry and RoPE position: 0 for EAGLE (the root is
    fed one position early, beside the target's hidden state), 1 for a draft model, which fed the
    root at its own position and entry `seq_len`."""
    dev = logits.device
    n = logits.shape[0]
    k = max(1, min(proposer.topk, logits.shape[-1]))
    depth = max(1, proposer.depth)
    want = sel.tolist()
    bt = inp.block_tables[sel]
    seq = torch.tensor([inp.seq_lens[i] + entry_shift for i in want], dtype=torch.long, device=dev)
    tree = TokenTree(k, d2t)
    top = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    tree.init(top.indices, top.values)
    req = torch.arange(n, device=dev).repeat_interleave(k)
    hidden = h.repeat_interleave(k, 0)                      # depth-1 nodes: the root's hidden
    for d in range(1, depth):
        ids = tree.get_ids().reshape(-1)                      # [n*k] frontier of depth d
        entries = (seq + (d - 1) * k)[:, None] + torch.arange(k, device=dev)[None, :]
        slots = slots_for_positions(bt, req, entries.reshape(-1), block_size)
        pos = (seq + d - 1).repeat_interleave(k)
        meta = AttentionMetadata(slots, [k] * n, (seq + d * k).tolist(), bt, block_size, TREE,
                                 tree.get_mask(), [d * k] * n).finalize()
        out = proposer.layer_step(ids, pos, hidden, meta, kv_cache)     # [n*k, H] pre-norm
        lp = torch.log_softmax(proposer.logits_step(out).float(), -1)
        top = lp.topk(k, dim=-1)
        tree.grow(top.indices.view(n, k, k), top.values.view(n, k, k))
        # next frontier's hidden = the output at its parent (a node of this pass)
        src = (torch.arange(n, device=dev)[:, None] * k + tree.active_parents).reshape(-1)
        hidden = out[src]
    sampled = inp.next_token_ids[sel]
    return tree.finalize(sampled, num_spec_tokens)


# --- verification ----------------------------------------------------------------------------------
def _structure(s):
    """(tokens, children) of a scheduled request's draft: its tree, or its chain as a path."""
    if s.tree is not None:
        return s.tree.token_ids, s.tree.children()
    K = s.num_draft_tokens
    toks = s.token_ids[len(s.token_ids) - K - 1:]
    return toks, [[i + 1] for i in range(K)] + [[]]


def greedy_tree_path(argmax_rows: list[int], tokens: list[int], children: list[list[int]]):
    """Longest accepted path: a node is accepted when its token equals the target argmax at its
    (accepted) parent. Children of a node are distinct, so the accepted nodes form one path.
    Returns (path of tree indices without the root, bonus token)."""
    path, cur = [], 0
    while True:
        t = argmax_rows[cur]
        nxt = next((c for c in children[cur] if tokens[c] == t), None)
        if nxt is None:
            return path, t
        path.append(nxt)
        cur = nxt


def _uniform(gen) -> float:
    return float(torch.rand(1, generator=gen))


def _sample(p: torch.Tensor, gen) -> int:
    """Exponential race: a sample from p (unnormalised ok)."""
    q = torch.empty_like(p).exponential_(generator=gen)
    return int((p / q).argmax())


def sample_tree_path(probs: torch.Tensor, tokens: list[int], children: list[list[int]], gen,
                     renormalise: bool = True):
    """SpecInfer / EAGLE-2 multi-candidate recursive rejection sampling for deterministic drafts
    (q one-hot). probs [n, V]: the target's sampling distribution at every tree node (row 0 = root).
    At each node try its children in order: accept x w.p. p(x); on rejection set p(x) = 0 and
    renormalise; if all are rejected emit a sample of the residual; at an accepted leaf emit the
    bonus from its distribution. `renormalise=False` is a deliberately wrong variant (tests).
    Returns (path of tree indices without the root, emitted token)."""
    path, cur = [], 0
    while True:
        p = probs[cur].clone()
        accepted = None
        for c in children[cur]:
            x = tokens[c]
            total = float(p.sum()) if renormalise else 1.0
            px = float(p[x])
            if total > 0 and _uniform(gen) * total < px:
                accepted = c
                break
            p[x] = 0.0
        if accepted is None:
            if float(p.sum()) <= 0:          # all mass on rejected candidates (numerically): fall back
                p = probs[cur]
            return path, _sample(p, gen)
        path.append(accepted)
        cur = accepted


def verify_trees(logits: torch.Tensor, scheds, sampling: SamplingMetadata, device):
    """Verify every scheduled request's tree (or chain) in one batch.

    logits: [sum(num_draft + 1), V] laid out as SpecDecodeMetadata.logits_indices: for each request
    its last num_draft + 1 rows, i.e. the tree root (the sampled token) then the nodes in tree order.
    Returns (new_tokens, accepted_rows) per request: accepted path tokens + one bonus/correction
    token, and the row offsets (within the request's rows of the step) of the root and the accepted
    nodes in path order. Requests whose prompt is not complete get ([], [])."""
    counts = [s.num_draft_tokens + 1 for s in scheds]
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    argmax = row_argmax(logits).tolist()
    greedy = sampling.greedy.tolist()
    sampled_reqs = [r for r, s in enumerate(scheds) if not greedy[r] and s.completes_prompt]
    probs = None
    prow: dict[int, int] = {}
    if sampled_reqs:
        rows, idx = [], []
        for r in sampled_reqs:
            prow[r] = len(rows)
            rows.extend(range(offs[r], offs[r + 1]))
            idx.extend([r] * counts[r])
        it = torch.tensor(idx, device=sampling.temperature.device)
        sub = SamplingMetadata(sampling.temperature[it], sampling.top_k[it], sampling.top_p[it],
                               sampling.greedy[it], [sampling.generators[i] for i in idx], False,
                               sampling.min_p[it] if sampling.min_p is not None else None)
        probs = target_probs(logits[torch.tensor(rows, device=logits.device)], sub).cpu()
    new_tokens, accepted_rows = [], []
    for r, s in enumerate(scheds):
        if not s.completes_prompt:
            new_tokens.append([])
            accepted_rows.append([])
            continue
        tokens, children = _structure(s)
        if greedy[r]:
            path, last = greedy_tree_path(argmax[offs[r]:offs[r + 1]], tokens, children)
        else:
            pr = probs[prow[r]:prow[r] + counts[r]]
            path, last = sample_tree_path(pr, tokens, children, sampling.generators[r])
        root_row = s.num_prefix_tokens - 1
        new_tokens.append([tokens[c] for c in path] + [last])
        accepted_rows.append([root_row] + [root_row + c for c in path])
    return new_tokens, accepted_rows


def compact_tree_kv(kv_cache, scheds, accepted_rows, block_tables: torch.Tensor, block_size: int,
                    num_layers: int) -> None:
    """Move the target-layer K/V of each request's accepted nodes to the cache entries right after
    its root (root entry + 1, + 2, ...), so that rolling back to start + prefix + accepted keeps
    exactly the accepted path."""
    req, src, dst = [], [], []
    for r, (s, rows) in enumerate(zip(scheds, accepted_rows)):
        if s.tree is None or len(rows) < 2:
            continue
        root = rows[0]
        for j, row in enumerate(rows[1:], 1):
            if row != root + j:
                req.append(r)
                src.append(s.start_pos + row)
                dst.append(s.start_pos + root + j)
    if not src:
        return
    dev = block_tables.device
    ri = torch.tensor(req, dtype=torch.long, device=dev)
    s_slots = slots_for_positions(block_tables, ri, torch.tensor(src, dtype=torch.long, device=dev), block_size)
    d_slots = slots_for_positions(block_tables, ri, torch.tensor(dst, dtype=torch.long, device=dev), block_size)
    kv_cache.copy_slots(s_slots, d_slots, layers=range(num_layers))
