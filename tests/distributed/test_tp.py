"""Tensor parallelism (2 processes, gloo): greedy and seeded sampling equal TP=1 on tiny Llama and
Qwen3 targets, with EAGLE-3 chain / tree and DFlash drafting; bad sizes are ValueErrors; a crashed
worker fails requests with a clear error; the server answers the OpenAI client."""
import os
import signal
import time

import pytest

from tests.helpers import make_tiny_hf
from tests.helpers import load_cfg, write_dflash_checkpoint, write_eagle3_checkpoint
from draftwise import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [3] * 20, list(range(30, 60)), [12, 13, 12, 13, 12]]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _gen(llm, sps):
    return _ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sps))


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    llama, qwen = str(d / "llama"), str(d / "qwen3")
    make_tiny_hf(llama, "llama", seed=3)               # 4 heads, 2 KV heads: 2 + 1 per rank
    make_tiny_hf(qwen, "qwen3", seed=4, kv_heads=1)    # 1 KV head: replicated on both ranks
    return {"llama": llama, "qwen3": qwen, "dir": d}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_equals_tp1_greedy_with_drafters_and_seeded_sampling(targets, arch):
    """Plain decoding on both targets; each drafter on one of them (what a drafter shards does not
    depend on the target's family: its KV heads split or replicate with the target's)."""
    path = targets[arch]
    cfg = load_cfg(path)
    ck = write_eagle3_checkpoint(str(targets["dir"] / f"e-{arch}"), cfg, seed=5)
    if arch == "llama":
        dck = write_dflash_checkpoint(str(targets["dir"] / f"d-{arch}"), cfg, block_size=4, target_layer_ids=(0, 2))
        specs = [None, {"method": "eagle3", "model": ck, "num_speculative_tokens": 3}, {"method": "dflash", "model": dck}]
    else:
        specs = [None,
                 {"method": "eagle3", "model": ck, "num_speculative_tokens": 4, "eagle_topk": 2, "eagle_depth": 2},
                 # the adaptive policy measures step costs at start-up: every rank takes part (its
                 # draft lengths follow the costs, so seeded requests go without drafts to stay comparable)
                 {"method": "suffix", "adaptive": True, "draft_tree": True, "num_speculative_tokens": 6,
                  "draft_seeded_sampling": False}]
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=100 + i, ignore_eos=True)
               for i in range(len(PROMPTS))]
    kw = dict(block_size=4, max_model_len=128, max_num_seqs=4)
    # whole drafts: the allocation sizes drafts by each engine's measured step costs, which differ
    # between two engines on a loaded machine, and a seeded request's tokens follow its draft lengths
    specs = [spec if spec is None or spec.get("adaptive") else {**spec, "allocate_drafts": False} for spec in specs]
    for spec in specs:
        one = LLM(path, speculative_config=spec, **kw)
        two = LLM(path, speculative_config=spec, tensor_parallel_size=2, **kw)
        try:
            assert _gen(two, GREEDY) == _gen(one, GREEDY), spec
            assert _gen(two, sampled) == _gen(one, sampled), spec
            # the adaptive policy drafts only where its measured step costs say drafting pays (a
            # loaded CI machine may measure that it does not): equality is what it must keep
            if spec is not None and not spec.get("adaptive"):
                assert two.get_metrics()["spec_decode"]["num_drafts"] > 0, spec
        finally:
            two.shutdown()


def test_bad_tensor_parallel_sizes(targets):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the 4 attention heads"):
        LLM(targets["llama"], speculative_config=None, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(targets["llama"], speculative_config=None, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="quantization"):
        LLM(targets["llama"], speculative_config=None, tensor_parallel_size=2, quantization="int8")


def test_a_crashed_worker_fails_requests_with_a_clear_error(targets):
    llm = LLM(targets["llama"], speculative_config=None, block_size=4, max_model_len=128, tensor_parallel_size=2)
    assert _gen(llm, GREEDY)
    worker = llm.engine.worker.tp.ranks.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    t0 = time.time()
    with pytest.raises(RuntimeError, match="tensor-parallel worker 1"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)
    assert time.time() - t0 < 30
    llm.shutdown()


def test_serve_with_tensor_parallelism_answers_the_openai_client(targets, tmp_path):
    openai = pytest.importorskip("openai")
    from tests.helpers import ServerThread
    from tests.tokenizer_util import add_tiny_tokenizer
    from draftwise.entrypoints.openai.api_server import build_app
    path = str(tmp_path / "m")
    make_tiny_hf(path, "llama", seed=3)
    add_tiny_tokenizer(path)
    llm = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, max_model_len=128,
              tensor_parallel_size=2)
    ref = LLM(path, speculative_config=None, max_model_len=128)
    with ServerThread(build_app(llm, "tp")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        r = client.completions.create(model="tp", prompt="Hello world, how are", max_tokens=8, temperature=0)
        want = ref.generate(["Hello world, how are"], SamplingParams(temperature=0, max_tokens=8))[0]
        assert r.choices[0].text == want.outputs[0].text
    assert llm.engine.worker.tp.closed                  # the app's shutdown released the workers
