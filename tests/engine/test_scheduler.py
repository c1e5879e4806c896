"""The scheduler and the block allocator on their own: hand-built step results, no model.

Each test drives `schedule()` -> a hand-made ModelRunnerOutput -> `update_from_output()` and checks
the invariants the engine relies on: token accounting, draft cuts, stop conditions, preemption,
lookahead reservation and reference counts."""
from dataclasses import dataclass, field

import pytest

from draftwise.config import EngineConfig
from draftwise.engine.kv_cache import BlockAllocator
from draftwise.engine.request import Request, RequestStatus
from draftwise.engine.scheduler import Scheduler
from draftwise.sampling_params import SamplingParams
from draftwise.spec_decode.draft import Draft


@dataclass
class Result:
    """The fields of a ModelRunnerOutput the scheduler reads."""
    new_token_ids: list
    num_accepted: list
    logprobs: list = field(default_factory=list)

    def __post_init__(self):
        self.logprobs = self.logprobs or [None] * len(self.new_token_ids)


def _sched(num_blocks=64, lookahead=0, **kw):
    cfg = EngineConfig("unused", **{"max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 32,
                                    "max_num_seqs": 4, "enable_prefix_caching": False, **kw})
    return Scheduler(cfg, num_blocks, lookahead)


def _req(rid, n_prompt=6, max_tokens=20, eos=(), **params):
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=eos)


def _refs(s: Scheduler) -> int:
    return sum(s.allocator.ref)


def test_prefill_is_chunked_by_the_token_budget_then_decodes():
    s = _sched(max_num_batched_tokens=4)
    r = _req("a", n_prompt=6)
    s.add(r)
    out = s.schedule()
    assert [x.token_ids for x in out.scheduled] == [[10, 11, 12, 13]]
    assert not out.scheduled[0].completes_prompt
    assert s.update_from_output(out, Result([[]], [0])) == []       # a chunk samples nothing
    assert r.num_computed_tokens == 4 and r.output_token_ids == []
    out = s.schedule()
    assert out.scheduled[0].token_ids == [14, 15] and out.scheduled[0].completes_prompt
    (u,) = s.update_from_output(out, Result([[99]], [0]))
    assert u.new_token_ids == [99] and r.output_token_ids == [99] and r.num_computed_tokens == 6
    out = s.schedule()
    assert out.scheduled[0].token_ids == [99] and out.scheduled[0].start_pos == 6


def test_drafts_are_verified_and_rolled_back_to_the_accepted_prefix():
    s = _sched(lookahead=0)
    r = _req("a")
    s.add(r)
    s.update_from_output(out := s.schedule(), Result([[50]], [0]))
    s.add_drafts(out, [Draft.chain([51, 52, 53], "ngram")])
    out = s.schedule()
    (x,) = out.scheduled
    assert x.token_ids == [50, 51, 52, 53] and x.num_draft_tokens == 3 and x.tree is None
    # drafts 51, 52 accepted, 60 sampled in place of 53
    (u,) = s.update_from_output(out, Result([[51, 52, 60]], [2]))
    assert (u.num_draft_tokens, u.num_accepted, u.draft_source) == (3, 2, "ngram")
    assert r.output_token_ids == [50, 51, 52, 60]
    assert r.num_computed_tokens == 6 + 1 + 2          # prompt, 50 and the two accepted drafts
    assert r.draft is None                             # a draft is used once
    assert s.schedule().scheduled[0].token_ids == [60]


def test_a_draft_over_the_budget_is_cut_and_a_cut_tree_keeps_its_parents():
    s = _sched(max_num_batched_tokens=3)
    r = _req("a", n_prompt=2)
    s.add(r)
    s.update_from_output(out := s.schedule(), Result([[50]], [0]))
    tree = Draft([61, 62, 63, 64], [-1, -1, 0, 1], "suffix", [0.6, 0.4, 0.5, 0.3])
    s.add_drafts(out, [tree])
    (x,) = s.schedule().scheduled
    assert x.token_ids == [50, 61, 62] and x.num_draft_tokens == 2
    assert x.draft.parents == [-1, -1] and x.tree is not None           # two children of the root
    assert x.tree.token_ids == [50, 61, 62] and x.tree.parents == [-1, 0, 0]


def test_stop_token_inside_accepted_drafts_cuts_the_output_and_frees_blocks():
    s = _sched()
    r = _req("a", eos=(7,))
    s.add(r)
    s.update_from_output(out := s.schedule(), Result([[50]], [0]))
    s.add_drafts(out, [Draft.chain([7, 8], "suffix")])
    out = s.schedule()
    (u,) = s.update_from_output(out, Result([[7, 8, 9]], [2]))
    assert u.new_token_ids == [7] and r.output_token_ids == [50, 7]
    assert r.is_finished and r.finish_reason == "stop"
    assert _refs(s) == 0 and not s.has_unfinished()


def test_max_tokens_finishes_with_length():
    s = _sched()
    r = _req("a", max_tokens=2)
    s.add(r)
    s.update_from_output(out := s.schedule(), Result([[50]], [0]))
    s.add_drafts(out, [Draft.chain([51, 52], "ngram")])
    s.update_from_output(s.schedule(), Result([[51, 52, 53]], [2]))
    assert r.output_token_ids == [50, 51] and r.finish_reason == "length"


def test_lookahead_and_draft_slots_are_reserved():
    s = _sched(lookahead=3)
    r = _req("a", n_prompt=6)
    s.add(r)
    out = s.schedule()
    assert len(r.block_ids) == 3                       # 6 prompt + 3 lookahead entries: 3 blocks of 4
    s.update_from_output(out, Result([[50]], [0]))
    s.add_drafts(out, [Draft.chain([51] * 4, "eagle3")])
    s.schedule()
    assert len(r.block_ids) == 4                       # 7 tokens + 4 drafts + 3 lookahead: 14 entries


def test_preemption_frees_the_newest_request_and_recomputes_it_later():
    s = _sched(num_blocks=16, max_num_batched_tokens=64, max_model_len=60)   # 64 KV entries
    a, b = _req("a", n_prompt=30, max_tokens=40), _req("b", n_prompt=30, max_tokens=40)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [x.request for x in out.scheduled] == [a, b]
    s.update_from_output(out, Result([[1], [2]], [0, 0]))
    # both need a new block soon; drafts make a grow past the pool
    s.add_drafts(out, [Draft.chain([3] * 8, "ngram"), None])
    out = s.schedule()
    assert out.preempted == [b] and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.block_ids == [] and s.waiting[0] is b
    assert [x.request for x in out.scheduled] == [a]
    assert _refs(s) == len(a.block_ids)


def test_finished_while_in_flight_is_skipped_and_blocks_wait_for_the_step():
    s = _sched()
    r = _req("a")
    s.add(r)
    out = s.schedule()
    blocks = list(r.block_ids)
    s.begin_flight(out)
    s.finish(r, "abort")
    assert blocks and all(s.allocator.ref[b] == 1 for b in blocks)   # the running step still writes them
    assert s.update_from_output(out, Result([[50]], [0])) == []
    s.end_flight()
    assert _refs(s) == 0 and r.output_token_ids == []


def test_fail_ends_one_request_with_its_error():
    s = _sched()
    a, b = _req("a"), _req("b")
    s.add(a)
    s.add(b)
    s.schedule()
    u = s.fail(a, "ValueError: bad grammar")
    assert u.request is a and a.finish_reason == "error" and a.error == "ValueError: bad grammar"
    assert s.running == [b]


# --- the allocator ----------------------------------------------------------------------------------
def test_allocator_reference_counts_and_double_free():
    pool = BlockAllocator(4)
    x = pool.allocate(3)
    assert pool.num_free == 1 and pool.num_used == 3
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate(2)
    pool.free(x)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(x[:1])


def test_allocator_evicts_least_recently_freed_and_counts_revived_hits():
    from draftwise.engine.kv_cache import block_hashes
    pool = BlockAllocator(3, enable_caching=True)
    toks = list(range(8))
    h = block_hashes(toks, 4, 2)
    a = pool.allocate(2)
    pool.cache_block(a[0], h[0], toks[:4])
    pool.cache_block(a[1], h[1], toks[4:])
    pool.free(a)                                  # a[1] freed first (the tail), then a[0]
    assert pool.num_free_after_touch(a) == 1      # both hits leave the free queue when taken
    fresh = pool.allocate(2)                      # the never-used block, then the oldest freed: a[1]
    assert a[1] in fresh and pool.lookup(h, toks, 4) == [a[0]]
    pool.record_lookup(8, 4)
    assert pool.stats()["hit_rate"] == 0.5


def test_allocator_refuses_a_hash_hit_with_other_tokens():
    pool = BlockAllocator(2, enable_caching=True)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"k" * 32, [1, 2, 3, 4])
    assert pool.lookup([b"k" * 32], [1, 2, 3, 4], 4) == [b]
    assert pool.lookup([b"k" * 32], [1, 2, 3, 5], 4) == []      # same key, other tokens: a miss


def test_a_draft_cut_whole_is_watched_and_the_emitted_tokens_decide_it():
    """The allocation learns from drafts it does not verify: a draft cut whole is compared with the
    tokens the target goes on to emit, and the calibration counts the agreement."""
    from draftwise.spec_decode.allocation import DraftAllocator, StepCosts
    dear = DraftAllocator(StepCosts({1: 0.001, 64: 0.064}))   # a token costs a token: cut everything
    s = _sched()
    s.draft_allocator = dear
    a, b = _req("a"), _req("b", max_tokens=3)
    s.add(a)
    s.add(b)
    out = s.schedule()
    s.update_from_output(out, Result([[50], [70]], [0, 0]))
    s.add_drafts(out, [Draft.chain([51, 52, 53], "suffix", [0.2, 0.1, 0.05]),
                       Draft.chain([71, 72, 73], "suffix", [0.2, 0.1, 0.05])])
    out = s.schedule()
    assert [x.num_draft_tokens for x in out.scheduled] == [0, 0]      # neither verified
    s.update_from_output(out, Result([[51], [71]], [0, 0]))
    assert dear.watched == 0                          # both agree so far: undecided
    before = dict(dear.calibration.groups)
    out = s.schedule()
    s.update_from_output(out, Result([[99], [72]], [0, 0]))
    # a: 51 agreed, then 99 where the draft said 52 - one node accepted, the second rejected;
    # b: 71, 72 agreed, and the request ended (max_tokens=3) before node 3 was decided
    assert b.is_finished
    assert dear.watched == 2 and dear.watched_agreed == 1 + 2
    acc0, seen0, _ = dear.calibration.groups[("suffix", 0)]
    assert (acc0, seen0) == pytest.approx((2.0, 2.0), abs=0.01) and ("suffix", 0) not in before
    acc1, seen1, _ = dear.calibration.groups[("suffix", 1)]
    assert (acc1, seen1) == pytest.approx((1.0, 2.0), abs=0.01)   # a's rejected second node, b's accepted one
    assert ("suffix", 2) not in dear.calibration.groups   # b's third node: never decided
    assert not s._watched
