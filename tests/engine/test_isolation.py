"""Failure isolation: an error attributable to one request fails that request alone; the others in
its batch finish with exactly the output they would have had; a fault of the engine itself (every
request fails, alone too) raises EngineFault and leaves the engine usable; a failed model thread
under async scheduling does not wedge later steps; a failing drafter only costs speed."""
import pytest

from draftwise import LLM, SamplingParams
from draftwise.step import EngineFault
from draftwise.sample import sampler as sampler_mod

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3] * 20, list(range(30, 70)), [7, 7, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
POISON_SEED = 424242


def _llm(path, **kw):
    return LLM(path, block_size=4, max_model_len=128, max_num_seqs=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)


def _poison_sampling(monkeypatch):
    """Sampling metadata fails whenever the poisoned request is in the batch (a stand-in for any
    per-request fault: a grammar, a stop condition, a sampling parameter)."""
    real = sampler_mod.SamplingMetadata.from_params.__func__

    def from_params(cls, params_list, generators, device):
        if any(p.seed == POISON_SEED for p in params_list):
            raise OverflowError("poisoned request")
        return real(cls, params_list, generators, device)
    monkeypatch.setattr(sampler_mod.SamplingMetadata, "from_params", classmethod(from_params))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_bad_request_fails_alone(tiny_llama, monkeypatch, async_scheduling):
    path, _ = tiny_llama
    llm = _llm(path, async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    _poison_sampling(monkeypatch)
    bad = SamplingParams(temperature=0.8, seed=POISON_SEED, max_tokens=12)
    outs = llm.generate(prompts[:2] + [{"prompt_token_ids": [9, 9, 9]}] + prompts[2:],
                        [GREEDY, GREEDY, bad, GREEDY, GREEDY])
    assert outs[2].finished and outs[2].outputs[0].finish_reason == "error"
    assert "poisoned request" in outs[2].outputs[0].error
    good = [o.outputs[0] for i, o in enumerate(outs) if i != 2]
    assert [c.token_ids for c in good] == ref
    assert all(c.finish_reason == "length" and c.error is None for c in good)
    assert all(r == 0 for r in llm.engine.scheduler.allocator.ref)
    assert not llm.engine.has_unfinished_requests()


def test_extreme_top_k_does_not_fail_the_batch(tiny_llama):
    path, _ = tiny_llama
    llm = _llm(path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    huge = SamplingParams(temperature=0, top_k=2 ** 63, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=2 ** 70, seed=3, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts + [{"prompt_token_ids": [4, 5]}], [GREEDY, huge, GREEDY, GREEDY, sampled])
    assert [o.outputs[0].token_ids for o in outs[:4]] == ref
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_fault_raises_and_engine_recovers(tiny_llama, monkeypatch, async_scheduling):
    path, _ = tiny_llama
    llm = _llm(path, async_scheduling=async_scheduling)
    engine = llm.engine
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    real_run = engine.worker.runner.run

    def broken(inp):
        raise RuntimeError("injected model-thread failure")
    monkeypatch.setattr(engine.worker.runner, "run", broken)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    with pytest.raises(EngineFault, match="injected model-thread failure"):
        for _ in range(3):
            engine.step()
    assert engine._inflight is None
    for rid in ids:
        engine.abort_request(rid)
    monkeypatch.setattr(engine.worker.runner, "run", real_run)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert all(r == 0 for r in engine.scheduler.allocator.ref)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_transient_model_failure_is_retried(tiny_llama, monkeypatch, async_scheduling):
    """One failed step (the model thread raising once): its requests are re-run one at a time and
    every output is unchanged."""
    path, _ = tiny_llama
    llm = _llm(path, async_scheduling=async_scheduling)
    engine = llm.engine
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    real_run = engine.worker.runner.run
    calls = {"n": 0}

    def flaky(inp):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("transient")
        return real_run(inp)
    monkeypatch.setattr(engine.worker.runner, "run", flaky)
    outs = llm.generate(prompts, GREEDY)
    assert calls["n"] > 3
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_failing_drafter_only_costs_speed(tiny_llama, monkeypatch):
    path, _ = tiny_llama
    llm = _llm(path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]

    def broken(*a, **k):
        raise RuntimeError("drafter broke")
    monkeypatch.setattr(llm.engine.worker.proposer, "propose", broken)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
