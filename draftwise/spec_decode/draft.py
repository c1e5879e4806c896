"""`Draft`: the one representation of a request's proposed tokens, whatever drafter made them.

A draft is a tree rooted at the request's newest token (already known, not part of the draft):
nodes in creation order, every node after its parent, `parents[i]` the index of node i's parent
among the nodes or -1 for a child of the root. A chain - parents [-1, 0, 1, ...] - is the
degenerate tree and the common case; verification takes the fused chain path when `is_chain` and
builds the tree structures (ancestor mask, depths, root-to-leaf paths) only for branching drafts.

Because parents come first, the first n nodes of a draft are always a valid draft: the scheduler
and the runner cut drafts to a token budget or to the room left before max_model_len with
`truncated(n)`, chains and trees alike."""
from __future__ import annotations

from dataclasses import dataclass, field

from draftwise.spec_decode.tree import tree_draft_from_parents


@dataclass
class Draft:
    token_ids: list[int]                  # [n] target-vocabulary ids, creation order
    parents: list[int]                    # [n] parent index among the nodes, -1 = the root
    source: str                           # the drafter that made it: "eagle3", "suffix", "ngram", ...
    # [n] the drafter's estimate that each node is accepted (path probability), None if it has none
    probs: list[float] | None = None
    # the verification tree (spec_decode/tree.py TreeDraft), when the drafter already built it
    plan: object | None = field(default=None, repr=False, compare=False)
    # how often the request's recent drafts were right (allocation.agreement_level: 0 seldom,
    # 1 middling, 2 mostly), set by the scheduler; the draft allocation's calibration conditions on it
    level: int = field(default=1, compare=False)

    def __post_init__(self):
        if len(self.parents) != len(self.token_ids):
            raise ValueError(f"a draft of {len(self.token_ids)} tokens has {len(self.parents)} parents")
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"draft parents {self.parents} do not come before their children")

    @classmethod
    def chain(cls, token_ids, source: str, probs: list[float] | None = None, level: int = 1) -> "Draft":
        toks = [int(t) for t in token_ids]
        return cls(toks, list(range(-1, len(toks) - 1)), source, probs, level=level)

    @classmethod
    def from_tree(cls, tree, source: str) -> "Draft":
        """The draft of a TreeDraft built by tree drafting (spec_decode/tree.py), kept as its
        verification plan; its scores are cumulative log-probabilities (path probability = exp)."""
        probs = tree.scores[1:].exp().tolist() if tree.scores is not None else None
        return cls([int(t) for t in tree.token_ids[1:]], [p - 1 for p in tree.parents[1:]], source, probs,
                   plan=tree)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def expected_accepted(self) -> float:
        """Expected accepted tokens: the sum of the nodes' path probabilities (a node counts only
        when every ancestor is accepted), or the length when the drafter gives no probabilities."""
        return float(sum(self.probs)) if self.probs is not None else float(len(self))

    def truncated(self, n: int) -> "Draft":
        """The first `n` nodes (a valid draft: parents come first)."""
        n = max(0, n)
        if n >= len(self):
            return self
        probs = self.probs[:n] if self.probs is not None else None
        return Draft(self.token_ids[:n], self.parents[:n], self.source, probs, level=self.level)

    def verification_tree(self, root_token: int):
        """The TreeDraft verification reads (ancestor mask, depths, paths), rooted at `root_token`."""
        if self.plan is None:
            self.plan = tree_draft_from_parents(root_token, self.token_ids, self.parents, self.probs)
        return self.plan
