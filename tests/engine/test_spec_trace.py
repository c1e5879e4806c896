"""The per-token speculation trace (SamplingParams.spec_trace): exact against the engine's own
counters for every drafter, its texts concatenate to the output text (stop strings included), it
costs nothing when off, and the server's spans match the text they ride with."""
import pytest

from draftwise import LLM, SamplingParams
from tests.helpers import drafter_specs, tiny_target_with_drafters

PROMPTS = ["one two three one two three one two", "abc abc abc abc", "The quick brown fox jumps over"]


@pytest.fixture(scope="module")
def traced_model(tmp_path_factory):
    path, head, _ = tiny_target_with_drafters(tmp_path_factory, "traced", 5, 2)
    return path, head


@pytest.mark.parametrize("name", ["suffix", "ngram", "eagle3", "eagle3-tree", "hybrid"])
def test_trace_is_exact_for_every_drafter(traced_model, name):
    path, head = traced_model
    # whole drafts: on this random model the allocation would verify few, and the trace needs some
    llm = LLM(path, speculative_config=dict(drafter_specs(head, None)[name], allocate_drafts=False), max_model_len=256)
    traced = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, spec_trace=True)
    outs = llm.generate(PROMPTS, traced)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    sources = {"hybrid": {"eagle3", "suffix"}, "eagle3-tree": {"eagle3"}}.get(name, {name})
    accepted_somewhere = 0
    for o, p in zip(outs, plain):
        c = o.outputs[0]
        assert c.token_ids == p.outputs[0].token_ids and c.text == p.outputs[0].text   # tracing changes nothing
        assert [e.token_id for e in c.spec_trace] == c.token_ids
        assert "".join(e.text for e in c.spec_trace) == c.text
        drafted = [e for e in c.spec_trace if e.source is not None]
        assert len(drafted) == o.metrics.num_accepted_tokens
        assert {e.source for e in drafted} <= sources
        steps = [e.step for e in c.spec_trace]
        assert steps == sorted(steps) and steps[0] == 0
        # within a step the drafts come first, then the target's own token
        for s in set(steps):
            kinds = [e.source is None for e in c.spec_trace if e.step == s]
            assert kinds == sorted(kinds)
        accepted_somewhere += len(drafted)
        assert p.outputs[0].spec_trace is None                  # off by default
    if name in ("suffix", "ngram", "hybrid"):
        assert accepted_somewhere > 0


def test_trace_is_cut_with_the_text_at_a_stop_string(traced_model):
    path, _ = traced_model
    llm = LLM(path, speculative_config={"method": "suffix"}, max_model_len=256)
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                    spec_trace=True))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.text == free.text[:free.text.index(stop)]
    assert "".join(e.text for e in c.spec_trace) == c.text
    assert len(c.spec_trace) == len(c.token_ids)
    assert sum(e.source is not None for e in c.spec_trace) == out.metrics.num_accepted_tokens
