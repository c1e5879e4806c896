"""Structured outputs: decoding constrained by a JSON schema, a regex, a list of choices or an EBNF
grammar, on xgrammar (the grammar engine vLLM and SGLang use), lossless under speculation.

Plain constrained decoding masks, before sampling, every token the grammar forbids after the
output so far. A speculative step verifies several positions at once, so each verified position
must see the mask plain decoding would compute there: the mask after the output *and the drafts
before that position*. Per request and step:

1. when the drafts arrive (`valid_draft`), the matcher walks the draft tree depth-first, accepting
   each node's token and rolling back after its subtree: nodes the grammar forbids are cut with
   their subtrees before scheduling, so no compute is spent verifying impossible tokens;
2. after the target's forward (`fill_masks`), the same walk fills one bitmask row per verified row:
   the root's (the state after the output) and each node's (the state after its path), and the
   logits are masked before verification or sampling - the bonus position included;
3. the emitted tokens are accepted for good (`accept`); rejected drafts were never accepted (every
   walk rolls back), so nothing needs undoing. A grammar that reaches its end finishes the request.

Grammars are compiled once per distinct spec (xgrammar's compiler cache), by the server on its
prompt-preparation thread, never on the engine thread. JSON is generated without free whitespace
(`any_whitespace=False`, separators "," and ":"): a small model could otherwise pad a document
with whitespace forever, and compact JSON takes fewer tokens."""
from __future__ import annotations

import json
import threading

import torch

from draftwise.sampling_params import StructuredOutputParams
from draftwise.spec_decode.draft import Draft


def _choice_grammar(choices: tuple[str, ...]) -> str:
    # JSON string literals are valid EBNF string literals (same escapes)
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompiler:
    """Compiles StructuredOutputParams for one tokenizer and vocabulary (thread-safe; compiled
    grammars are cached by xgrammar per spec)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        import xgrammar as xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()

    def compile(self, p: StructuredOutputParams):
        try:
            with self._lock:
                if p.json is not None:
                    schema = p.json if isinstance(p.json, str) else json.dumps(p.json)
                    return self._compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
                if p.json_object:
                    return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                              separators=(",", ":"))
                if p.regex is not None:
                    return self._compiler.compile_regex(p.regex)
                if p.choice is not None:
                    return self._compiler.compile_grammar(_choice_grammar(p.choice))
                return self._compiler.compile_grammar(p.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            what = ("JSON schema" if p.json is not None else "regex" if p.regex is not None
                    else "grammar" if p.grammar is not None else "structured output")
            import re
            msg = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", (str(e).strip().splitlines() or [repr(e)])[0])
            raise ValueError(f"invalid {what}: {msg}") from None


class RequestGrammar:
    """One request's grammar state: an xgrammar matcher that has accepted the request's output."""

    def __init__(self, compiled):
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled)       # unlimited rollback: drafts are walked and undone

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    @staticmethod
    def _children(draft: Draft) -> tuple[list[int], list[list[int]]]:
        roots, children = [], [[] for _ in draft.token_ids]
        for i, p in enumerate(draft.parents):
            (roots if p < 0 else children[p]).append(i)
        return roots, children

    def _walk(self, draft: Draft, visit) -> None:
        """Depth-first over the draft: for each node the grammar accepts after its path, call
        visit(node) in the state after it; forbidden nodes are skipped with their subtrees."""
        roots, children = self._children(draft)
        m, toks = self.matcher, draft.token_ids

        def walk(nodes):
            for c in nodes:
                if m.accept_token(toks[c]):
                    visit(c)
                    walk(children[c])
                    m.rollback(1)
        walk(roots)

    def valid_draft(self, draft: Draft | None) -> Draft | None:
        """`draft` without the nodes the grammar forbids (and their subtrees)."""
        if not draft or self.terminated:
            return None
        keep: list[int] = []
        self._walk(draft, keep.append)
        if len(keep) == len(draft):
            return draft
        keep.sort()
        index = {old: new for new, old in enumerate(keep)}
        probs = [draft.probs[i] for i in keep] if draft.probs is not None else None
        return Draft([draft.token_ids[i] for i in keep], [index.get(draft.parents[i], -1) for i in keep],
                     draft.source, probs) if keep else None

    def fill_masks(self, draft: Draft | None, bitmask: torch.Tensor, root_row: int) -> None:
        """Bitmask rows for a verified step: `root_row` for the position after the output, and
        `root_row + 1 + j` for draft node j (the position after its path)."""
        m = self.matcher
        m.fill_next_token_bitmask(bitmask, root_row)

        def fill(c):
            if not m.is_terminated():          # after a stop token nothing is generated: no mask
                m.fill_next_token_bitmask(bitmask, root_row + 1 + c)
        if draft:
            self._walk(draft, fill)

    def accept(self, token_ids: list[int]) -> None:
        for t in token_ids:
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"token {t} violates the request's grammar (a mask was not applied)")


def apply_grammar_masks(logits: torch.Tensor, scheds, vocab_size: int) -> None:
    """Mask, in place, the logits rows of the scheduled requests that have a grammar. Rows are laid
    out per request as verification reads them: the root, then the draft nodes."""
    import xgrammar as xgr
    rows, row = [], 0
    work = []
    for s in scheds:
        n = s.num_draft_tokens + 1
        g = getattr(s.request, "grammar", None)
        if g is not None and s.completes_prompt:
            work.append((g, s.draft, row))
            rows.extend(range(row, row + n))
        row += n
    if not work:
        return
    bitmask = xgr.allocate_token_bitmask(row, vocab_size)
    for g, draft, r in work:
        g.fill_masks(draft, bitmask, r)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab_size, indices=rows)
    roots = torch.tensor([r for _, _, r in work], device=logits.device)
    dead = torch.isinf(logits[roots]).all(-1).tolist()
    if any(dead):
        # a grammar this vocabulary cannot continue: fails the step, and failure isolation then
        # fails the request alone
        raise ValueError("the structured output allows no token of this model's vocabulary at this point "
                         "of the output (the grammar cannot be completed with this tokenizer)")
