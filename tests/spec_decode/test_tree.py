"""EAGLE tree drafting and verification: TokenTree, batched tree drafting, greedy / sampling tree
verification, accepted-path KV compaction, and end-to-end equivalence with plain decoding."""
import collections
import functools
import math
import os
import random
from types import SimpleNamespace

import pytest
import torch

import draftwise.spec_decode.eagle as E
import draftwise.spec_decode.tree as T
import draftwise.worker.model_runner as MR
from draftwise import LLM, SamplingParams
from draftwise.worker.kv_cache import KVCache
from draftwise.layers.attention import CAUSAL, AttentionMetadata, slots_for_positions
from draftwise.sample.sampler import SamplingMetadata
from draftwise.spec_decode.tree import TokenTree, TreeDraft, compact_tree_kv, sample_tree_path, verify_trees

from tests.helpers import make_tiny_hf
from tests.helpers import load_cfg, write_eagle3_checkpoint

torch.set_num_threads(1)

# whole trees verified: these tests exercise tree verification, which the batch-aware allocation
# would mostly skip on random tiny models (timing-dependent)
TREE_SPEC = {"method": "eagle3", "num_speculative_tokens": 6, "eagle_topk": 2, "eagle_depth": 3,
             "allocate_drafts": False}
PROMPTS = [[5, 6, 7, 8], [3] * 17, list(range(30, 61)), [9, 9], list(range(200, 211))]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _log(*ps):
    return torch.tensor([math.log(p) for p in ps])


# --- TokenTree ------------------------------------------------------------------------------------
def test_token_tree_hand_worked():
    """topk 2, three levels, d2t adds 100.
    init:  n0 tok3 .6, n1 tok5 .3
    grow:  n0 -> n2 tok1 (.6*.6=.36), n3 tok2 (.18); n1 -> n4 tok4 (.27), n5 tok6 (.015)
           frontier [n2, n4]
    grow:  n2 -> n6 tok7 (.144), n7 tok8 (.108); n4 -> n8 tok7 (.216), n9 tok9 (.027)
           frontier [n8, n6]
    finalize(42, 6): best six n0 .6, n2 .36, n1 .3, n4 .27, n8 .216, n3 .18 -> creation order
           n0 n1 n2 n3 n4 n8 = tree indices 1..6."""
    tt = TokenTree(2, d2t=torch.full((10,), 100, dtype=torch.long))
    tt.init(torch.tensor([3, 5]), _log(.6, .3))
    assert tt.get_ids().tolist() == [103, 105]
    assert tt.get_mask().tolist() == [[True, False], [False, True]]
    tt.grow(torch.tensor([[1, 2], [4, 6]]), torch.stack([_log(.6, .3), _log(.9, .05)]))
    assert tt.get_ids().tolist() == [101, 104]
    assert tt.active_parents[0].tolist() == [0, 1]
    assert tt.get_mask().int().tolist() == [[1, 0, 1, 0], [0, 1, 0, 1]]
    tt.grow(torch.tensor([[7, 8], [7, 9]]), torch.stack([_log(.4, .3), _log(.8, .1)]))
    assert tt.get_ids().tolist() == [107, 107]
    assert tt.active_parents[0].tolist() == [1, 0]
    assert tt.get_mask().int().tolist() == [[0, 1, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1]]
    tree = tt.finalize(42, 6)
    assert isinstance(tree, TreeDraft)
    assert tree.token_ids == [42, 103, 105, 101, 102, 104, 107]
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 5]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert tree.mask.int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1, 1]]
    assert tree.retrieve_indices == [[0, 1, 3], [0, 1, 4], [0, 2, 5, 6]]
    assert torch.allclose(tree.scores.exp(), torch.tensor([1, .6, .3, .36, .18, .27, .216]))
    # fewer nodes than asked for keeps everything; a batch gives one tree per row
    tb = TokenTree(2)
    tb.init(torch.tensor([[3, 5], [1, 0]]), torch.stack([_log(.6, .3), _log(.5, .4)]))
    trees = tb.finalize(torch.tensor([7, 8]), 10)
    assert [t.token_ids for t in trees] == [[7, 3, 5], [8, 1, 0]]
    assert [t.retrieve_indices for t in trees] == [[[0, 1], [0, 2]]] * 2


# --- verification on crafted logits -------------------------------------------------------------
def _hand_tree():
    tt = TokenTree(2, d2t=torch.full((10,), 100, dtype=torch.long))
    tt.init(torch.tensor([3, 5]), _log(.6, .3))
    tt.grow(torch.tensor([[1, 2], [4, 6]]), torch.stack([_log(.6, .3), _log(.9, .05)]))
    tt.grow(torch.tensor([[7, 8], [7, 9]]), torch.stack([_log(.4, .3), _log(.8, .1)]))
    return tt.finalize(42, 6)     # tokens [42, 103, 105, 101, 102, 104, 107], parents [-1,0,0,1,1,2,5]


def _sched(tree=None, prefix=1, start=10, chain=None, completes=True):
    drafts = tree.token_ids[1:] if tree is not None else (chain or [])
    toks = list(range(500, 500 + prefix)) + drafts
    return SimpleNamespace(tree=tree, num_draft_tokens=len(drafts), num_prefix_tokens=prefix,
                           token_ids=toks, start_pos=start, completes_prompt=completes)


def _logits_rows(argmaxes, V=300):
    lg = torch.randn(len(argmaxes), V) * 0.1
    lg[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return lg


def test_greedy_tree_verification_picks_longest_path():
    tree = _hand_tree()
    # request 0: root argmax 103 -> node 1; node 1 argmax 102 -> node 4; node 4 argmax 77 -> bonus
    a0 = [103, 102, 0, 0, 77, 0, 0]
    # request 1 (3 prefix tokens): 105 -> node 2, 104 -> node 5, 107 -> node 6 (a leaf), bonus 9
    a1 = [105, 0, 104, 0, 0, 107, 9]
    # request 2: nothing accepted (root argmax is no child)
    a2 = [55, 103, 105, 101, 102, 104, 107]
    # request 3: a chain of 3 drafts, 2 accepted; request 4: no drafts; request 5: unfinished prefill
    a3 = [11, 12, 99, 13]
    a4 = [21]
    a5 = [31]
    scheds = [_sched(tree), _sched(tree, prefix=3), _sched(tree), _sched(chain=[11, 12, 13], prefix=2),
              _sched(prefix=4), _sched(prefix=5, completes=False)]
    logits = _logits_rows(a0 + a1 + a2 + a3 + a4 + a5)
    params = [SamplingParams(temperature=0)] * len(scheds)
    meta = SamplingMetadata.from_params(params, [torch.Generator()] * len(scheds), "cpu")
    new, rows = verify_trees(logits, scheds, meta, "cpu")
    assert new == [[103, 102, 77], [105, 104, 107, 9], [55], [11, 12, 99], [21], []]
    assert rows[0] == [0, 1, 4]
    assert rows[1] == [2, 4, 7, 8]
    assert rows[2] == [0]
    assert rows[3] == [1, 2, 3]
    assert rows[5] == []


def test_compaction_moves_only_target_kv_of_accepted_nodes():
    bs, L = 4, 2                                   # 2 target layers + 1 draft layer
    kv = KVCache(8, bs, [(1, 2)] * (L + 1), torch.float32, "cpu")
    for li in range(L + 1):
        k, v = kv.layer(li)
        k.copy_(torch.arange(kv.num_slots, dtype=torch.float32)[:, None, None].expand_as(k) + 1000 * li)
        v.copy_(-k)
    before = [tuple(t.clone() for t in kv.layer(li)) for li in range(L + 1)]
    bt = torch.tensor([[6, 2, 7, 0], [3, 1, 5, 4]])
    tree = _hand_tree()
    scheds = [_sched(tree, prefix=1, start=5), _sched(tree, prefix=2, start=3)]
    # request 0: accepted nodes 2, 5, 6 (rows 2, 5, 6) -> entries 7, 10, 11 move to 6, 7, 8
    # request 1: accepted node 1 (row 2 == root row + 1): nothing moves
    compact_tree_kv(kv, scheds, [[0, 2, 5, 6], [1, 2]], bt, bs, L)

    def slot(r, e):
        return int(slots_for_positions(bt, torch.tensor([r]), torch.tensor([e]), bs))

    moved = {slot(0, 6): slot(0, 7), slot(0, 7): slot(0, 10), slot(0, 8): slot(0, 11)}
    for li in range(L + 1):
        for which in (0, 1):
            exp = before[li][which].clone()
            if li < L:
                for d, s in moved.items():
                    exp[d] = before[li][which][s]
            assert torch.equal(kv.layer(li)[which], exp), (li, which)


def _tree_fixture():
    """A 2-level tree over a 5-token vocabulary with crafted target distributions."""
    # root children 1 (tok 2), 2 (tok 0); node 1 children 3 (tok 4), 4 (tok 2); node 2 child 5 (tok 1)
    tokens = [9, 2, 0, 4, 2, 1]
    parents = [-1, 0, 0, 1, 1, 2]
    ch = [[] for _ in tokens]
    for i, p in enumerate(parents):
        if p >= 0:
            ch[p].append(i)
    probs = torch.tensor([[.30, .05, .35, .20, .10],
                          [.10, .20, .30, .25, .15],
                          [.05, .50, .15, .20, .10],
                          [.2, .2, .2, .2, .2],
                          [.6, .1, .1, .1, .1],
                          [.1, .1, .1, .1, .6]])
    return tokens, ch, probs


def _exact_two_tokens(tokens, ch, probs):
    """Target law of the first two emitted tokens: p0(x) p_x(y), where p_x is node x's row when x is
    a root child (the second token is then the next emission on that path)."""
    out = {}
    for x in range(probs.shape[1]):
        node = next((c for c in ch[0] if tokens[c] == x), None)
        if node is None:
            out[(x,)] = float(probs[0, x])
        else:
            for y in range(probs.shape[1]):
                out[(x, y)] = float(probs[0, x] * probs[node, y])
    return out


@pytest.mark.parametrize("renormalise", [True, False])
def test_tree_rejection_sampling_matches_target_law(renormalise):
    tokens, ch, probs = _tree_fixture()
    exact = _exact_two_tokens(tokens, ch, probs)
    g = torch.Generator().manual_seed(0)
    n = 20000
    counts = collections.Counter()
    for _ in range(n):
        path, last = sample_tree_path(probs, tokens, ch, g, renormalise=renormalise)
        emitted = [tokens[c] for c in path] + [last]
        counts[tuple(emitted[:2]) if len(emitted) >= 2 and path else (emitted[0],)] += 1
    chi2 = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in exact.items())
    assert sum(counts.values()) == sum(counts[k] for k in exact)
    dof = len(exact) - 1
    # the correct sampler passes, the variant without renormalisation is caught
    if renormalise:
        assert chi2 < dof + 6 * math.sqrt(2 * dof), chi2
    else:
        assert chi2 > dof + 10 * math.sqrt(2 * dof), chi2


# --- engine level -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tree_head(tiny_llama, tmp_path_factory):
    path, _ = tiny_llama
    return write_eagle3_checkpoint(str(tmp_path_factory.mktemp("tree_head")), load_cfg(path))


def _tree_llm(path, ckpt, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    return LLM(path, speculative_config=dict(TREE_SPEC, model=ckpt), **kw)


def test_tree_greedy_matches_plain_decoding(tiny_llama, tree_head):
    path, _ = tiny_llama
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 9, 16, 20, 13)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _ids(LLM(path, block_size=4, max_model_len=128).generate(prompts, sps))
    # a small token budget mixes prefill chunks with tree verification and drops some trees
    llm = _tree_llm(path, tree_head, max_num_batched_tokens=24)
    assert _ids(llm.generate(prompts, sps)) == ref
    m = llm.get_metrics()
    assert m["spec_decode"]["num_drafts"] > 0
    assert m["kv_blocks_used"] == 0


@torch.no_grad()
def test_tree_drafting_matches_chain_recurrence(tiny_llama, tree_head, monkeypatch):
    """Every node's cumulative score equals the chain recurrence along its root path (fresh causal
    passes over the same draft KV), for every request of a batched drafting step."""
    path, _ = tiny_llama
    llm = _tree_llm(path, tree_head)
    calls = []
    orig = T.draft_trees

    def spy(proposer, logits, h, inp, sel, kv_cache, block_size, k, **kw):
        trees = orig(proposer, logits, h, inp, sel, kv_cache, block_size, k, **kw)
        calls.append((proposer, logits.clone(), h.clone(), inp, sel.clone(), kv_cache, block_size, trees))
        return trees

    monkeypatch.setattr(E, "draft_trees", spy)
    eng = llm.engine
    for p in PROMPTS[:4]:
        eng.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    checked = 0
    for _ in range(3):
        calls.clear()
        eng.step()
        assert len(calls) == 1
        proposer, logits, h, inp, sel, kv, bs, trees = calls[0]
        model = proposer.model
        assert len(trees) == len(sel) == 4
        for j, i in enumerate(sel.tolist()):
            tree, L = trees[j], inp.seq_lens[i]
            assert tree.num_nodes == 6 and tree.token_ids[0] == int(inp.next_token_ids[i])
            assert sorted({n for pth in tree.retrieve_indices for n in pth}) == list(range(7))
            bt = inp.block_tables[i:i + 1]
            for pth in tree.retrieve_indices:
                hid, lp, cum = h[j:j + 1], torch.log_softmax(logits[j].float(), -1), 0.0
                for t, node in enumerate(pth[1:], 1):
                    tok = tree.token_ids[node]          # full draft vocabulary: draft id == target id
                    assert tok in lp.topk(2).indices.tolist()
                    cum += float(lp[tok])
                    assert abs(cum - float(tree.scores[node])) < 1e-4
                    assert int(tree.depths[node]) == t
                    if t < len(pth) - 1:
                        e = L + t - 1
                        slots = slots_for_positions(bt, torch.tensor([0]), torch.tensor([e]), bs)
                        meta = AttentionMetadata(slots, [1], [e + 1], bt, bs, CAUSAL).finalize()
                        hid = model(torch.tensor([tok]), torch.tensor([e]), hid, meta, kv)
                        lp = torch.log_softmax(model.compute_logits(hid)[0].float(), -1)
                    checked += 1
    assert checked > 50


def test_tree_oracle_acceptance_and_draft_state(tiny_llama, tree_head, monkeypatch):
    """Drafts forced to contain the true greedy continuation along random root-to-leaf paths (cut at
    a random depth): long, non-contiguous accepted paths. Outputs must equal plain decoding, the
    moved KV must be right (later tokens depend on it), and the drafter's state after acceptance
    must equal a fresh engine's state for the same token prefix."""
    path, _ = tiny_llama
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 12, 20, 24, 16)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = _ids(LLM(path, block_size=4, max_model_len=128).generate(prompts, sps))
    full = {tuple(p): p + r for p, r in zip(PROMPTS, ref)}
    rng = random.Random(0)
    orig_draft, orig_compact = T.draft_trees, T.compact_tree_kv
    states, moved = [], []

    def oracle(proposer, logits, h, inp, sel, kv_cache, block_size, k, **kw):
        trees = orig_draft(proposer, logits, h, inp, sel, kv_cache, block_size, k, **kw)
        for j, i in enumerate(sel.tolist()):
            seq = full[tuple(inp.requests[i].prompt_token_ids)]
            L, tree = inp.seq_lens[i], trees[j]
            assert tree.token_ids[0] == seq[L]
            states.append((seq[:L], h[j].clone(), L - len(inp.requests[i].prompt_token_ids)))
            pth = rng.choice(tree.retrieve_indices)
            cut = rng.randint(0, len(pth) - 1)
            for t, node in enumerate(pth[1:], 1):
                good = seq[L + t] if L + t < len(seq) else 0
                tree.token_ids[node] = good if t <= cut else (good + 1) % 256
        return trees

    def spy_compact(kv, scheds, rows, *a):
        moved.extend(r for r in rows if r and r != list(range(r[0], r[0] + len(r))))
        return orig_compact(kv, scheds, rows, *a)

    monkeypatch.setattr(E, "draft_trees", oracle)
    monkeypatch.setattr(MR, "compact_tree_kv", spy_compact)
    llm = _tree_llm(path, tree_head)
    assert _ids(llm.generate(prompts, sps)) == ref
    sd = llm.get_metrics()["spec_decode"]
    assert sd["num_accepted_tokens"] > sd["num_drafts"], sd
    assert sd["accepted_per_position"][2] > 0
    assert len(moved) >= 3
    # drafter state after (tree) acceptance == fresh prefill of the same prefix
    monkeypatch.setattr(E, "draft_trees", orig_draft)
    got = {}

    def spy(proposer, logits, h, inp, sel, kv_cache, block_size, k, **kw):
        for j, i in enumerate(sel.tolist()):
            got[tuple(inp.requests[i].prompt_token_ids)] = h[j].clone()
        return orig_draft(proposer, logits, h, inp, sel, kv_cache, block_size, k, **kw)

    monkeypatch.setattr(E, "draft_trees", spy)
    later = [(p, hh) for p, hh, n_out in states if n_out >= 3][::3][:12]
    fresh = _tree_llm(path, tree_head)
    eng = fresh.engine
    for p, _ in later:
        eng.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()
    assert len(got) == len({tuple(p) for p, _ in later}) > 5
    for p, hh in later:
        assert torch.allclose(got[tuple(p)], hh, atol=1e-4, rtol=1e-4)


# --- sampling distribution, end to end ----------------------------------------------------------
def _two_sample_chi2(a, b):
    """Chi-square homogeneity test of two samples of hashables; returns the p-value."""
    from scipy.stats import chi2_contingency
    ca, cb = collections.Counter(a), collections.Counter(b)
    keys = sorted(set(ca) | set(cb))
    return float(chi2_contingency([[ca[k] for k in keys], [cb[k] for k in keys]]).pvalue)


def test_tree_sampling_preserves_target_distribution(tmp_path, monkeypatch):
    """Seeded samples of the first tokens with and without tree speculation (tiny vocabulary) are
    the same distribution; a verifier that skips the renormalisation is detected."""
    V, N = 6, 3000
    tgt = str(tmp_path / "tgt")
    make_tiny_hf(tgt, "llama", vocab=V, seed=3)
    prompt = {"prompt_token_ids": [3, 4, 5, 1]}
    kw = dict(block_size=4, max_model_len=16, max_num_seqs=N, max_num_batched_tokens=8 * N)

    def run(llm, seed0):
        sps = [SamplingParams(temperature=1.0, top_p=0.98, max_tokens=3, seed=seed0 + i, ignore_eos=True)
               for i in range(N)]
        return [tuple(o.outputs[0].token_ids) for o in llm.generate([prompt] * N, sps)]

    plain = run(LLM(tgt, **kw), 0)
    # the head drafts over the two likeliest second tokens: every root has both as children,
    # so the second child is tried (and the renormalisation matters) at every step
    used = sorted(t for t, _ in collections.Counter(x[1] for x in plain).most_common(2))
    head = write_eagle3_checkpoint(str(tmp_path / "head"), load_cfg(tgt), draft_vocab=2)
    from safetensors.torch import load_file, save_file
    f = os.path.join(head, "model.safetensors")
    t = load_file(f)
    t["d2t"] = torch.tensor(used) - torch.arange(2)
    t["t2d"] = torch.zeros(V, dtype=torch.bool)
    t["t2d"][used] = True
    save_file(t, f)
    spec = LLM(tgt, speculative_config=dict(TREE_SPEC, model=head), **kw)
    tree = run(spec, 10 ** 6)
    assert spec.get_metrics()["spec_decode"]["num_accepted_tokens"] > N // 4
    for key in (lambda x: x[1], lambda x: x[:2], lambda x: x[1:]):
        assert _two_sample_chi2([key(x) for x in plain], [key(x) for x in tree]) > 1e-3
    monkeypatch.setattr(T, "sample_tree_path", functools.partial(T.sample_tree_path, renormalise=False))
    broken = run(LLM(tgt, speculative_config=dict(TREE_SPEC, model=head), **kw), 10 ** 6)
    assert min(_two_sample_chi2([key(x) for x in plain], [key(x) for x in broken])
               for key in (lambda x: x[1], lambda x: x[:2], lambda x: x[1:])) < 1e-3
