"""`draftwise bench` end to end on a tiny model: table, JSON, plot, greedy match, sweep."""
import json
import os

import pytest

from tests.helpers import make_tiny_hf
from draftwise.entrypoints.cli import main


def test_bench_runs_methods_side_by_side(tmp_path):
    from tests.tokenizer_util import add_tiny_tokenizer
    model = str(tmp_path / "m")
    make_tiny_hf(model)
    add_tiny_tokenizer(model)
    q = tmp_path / "question.jsonl"
    q.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"hello {i} world", "and again"]})
                           for i in range(3)) + "\n")
    out = str(tmp_path / "out")
    rc = main(["bench", "--model", model, "--methods", "ar,ngram", "--dataset", str(q), "--max-tokens", "12",
               "--max-model-len", "256", "--out", out])
    assert rc == 0
    res = json.load(open(os.path.join(out, "bench.json")))["results"]
    assert [r["method"] for r in res] == ["ar", "ngram"]
    assert res[1]["greedy_match"] == 1.0 and res[1]["num_drafts"] > 0
    assert res[0]["speedup_vs_ar"] == 1.0
    for r in res:                                   # time to first token and decode speed apart
        assert r["ttft_mean_s"] > 0 and r["decode_tokens_per_s"] > 0
    assert os.path.getsize(os.path.join(out, "bench.png")) > 1000
    md = open(os.path.join(out, "bench.md")).read()
    assert "| ngram |" in md and "Streaming read bandwidth at" in md
    assert json.load(open(os.path.join(out, "bench.json")))["weight_stream"]["bandwidth_before_gbs"] > 0
    # quantized targets: speculation is compared with plain decoding of the same weights
    rc = main(["bench", "--model", model, "--methods", "ar,ar@int4,ngram@int4,suffix@int4", "--dataset", str(q),
               "--max-tokens", "12", "--max-model-len", "256", "--out", out])
    assert rc == 0
    res = {r["method"]: r for r in json.load(open(os.path.join(out, "bench.json")))["results"]}
    assert res["ngram@int4"]["greedy_reference"] == "ar@int4" and res["ngram@int4"]["greedy_match"] == 1.0
    assert res["suffix@int4"]["greedy_match"] == 1.0 and res["ar@int4"]["quantization"] == "int4"
    rc = main(["bench", "--model", model, "--methods", "ar,ngram", "--dataset", str(q), "--max-tokens", "8",
               "--max-model-len", "256", "--out", out, "--sweep", "1,2"])
    assert rc == 0
    sw = json.load(open(os.path.join(out, "sweep.json")))
    assert set(sw["tokens_per_s"]) == {"ar", "ngram"} and sw["batch_sizes"] == [1, 2]
    # interleaved: both engines serve the prompts at once, their steps alternating
    rc = main(["bench", "--model", model, "--methods", "ar,ngram", "--dataset", str(q), "--max-tokens", "8",
               "--max-model-len", "256", "--out", out, "--sweep", "2", "--interleave", "--rounds", "2"])
    assert rc == 0
    sw = json.load(open(os.path.join(out, "sweep.json")))
    assert sw["interleaved"] and all(len(sw["samples"][m]["2"]) == 2 for m in ("ar", "ngram"))
    assert "interleaved" in open(os.path.join(out, "sweep.md")).read()


def test_interleaved_engines_each_count_their_own_tokens_and_seconds(tmp_path):
    """Two engines stepping in turn serve the same prompts: greedy speculation emits exactly the
    plain engine's tokens, and each engine's seconds are its own steps' (together at most the
    wall time of the whole run)."""
    import argparse
    import time
    from tests.tokenizer_util import add_tiny_tokenizer
    from draftwise.bench.run import parse_methods, run_interleaved
    model = str(tmp_path / "m")
    make_tiny_hf(model)
    add_tiny_tokenizer(model)
    args = argparse.Namespace(model=model, max_tokens=10, ignore_eos=False, max_model_len=256, enforce_eager=True)
    convs = [[f"hello {i} world hello {i} world"] for i in range(4)]
    t0 = time.perf_counter()
    res = run_interleaved(parse_methods("ar,ngram"), args, convs, 2)
    wall = time.perf_counter() - t0
    assert res["ar"]["output_tokens"] == res["ngram"]["output_tokens"] > 0
    assert 0 < res["ar"]["time_s"] + res["ngram"]["time_s"] < wall
    assert res["ngram"]["tokens_per_s"] == res["ngram"]["output_tokens"] / res["ngram"]["time_s"]


def test_a_peer_that_cannot_run_is_a_row_with_its_error(tmp_path):
    """A peer never silently leaves the table: its row carries the error, the others their figures."""
    from tests.tokenizer_util import add_tiny_tokenizer
    model = str(tmp_path / "m")
    make_tiny_hf(model)
    add_tiny_tokenizer(model)
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 0, "turns": ["hello"]}) + "\n")
    out = str(tmp_path / "out")
    rc = main(["bench", "--model", model, "--methods", "ar,openvino", "--dataset", str(q), "--max-tokens", "4",
               "--max-model-len", "128", "--out", out])
    assert rc == 0
    res = {r["method"]: r for r in json.load(open(os.path.join(out, "bench.json")))["results"]}
    assert "needs a GGUF model" in res["openvino"]["error"] and res["ar"]["output_tokens"] > 0
    assert "| openvino | failed: could not run" in open(os.path.join(out, "bench.md")).read()


def _fake_peer_python(tmp_path, crash_on_generate: bool):
    """An interpreter stand-in running a peer worker that loads, then (optionally) kills itself
    with SIGKILL on its first request, as a native crash would."""
    import sys
    code = tmp_path / "fake_worker.py"
    code.write_text(
        "import json, os, signal, sys\n"
        "print(json.dumps({'started': True}), flush=True)\n"
        "sys.stdin.readline()\n"
        "print(json.dumps({'ready': True, 'weights': 'gguf'}), flush=True)\n"
        "for line in sys.stdin:\n"
        f"    if {crash_on_generate}:\n"
        "        sys.stderr.write('fatal: illegal instruction in the peer\\n'); sys.stderr.flush()\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    n = len(json.loads(line)['prompts'])\n"
        "    r = {'text': 'hi', 'ids': [1, 2], 'ttft_s': 0.01, 'total_s': 0.02, 'prompt_tokens': 3}\n"
        "    print(json.dumps({'results': [r] * n, 'wall_s': 0.02}), flush=True)\n")
    py = tmp_path / "fake-python"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{code}"\n')
    py.chmod(0o755)
    return str(py)


def test_a_peer_process_that_crashes_is_reported_and_ends_alone(tmp_path):
    import pytest
    from draftwise.bench.peers import PeerCrashed, PeerProcess
    ok = PeerProcess("llamacpp", "x.gguf", 4, python=_fake_peer_python(tmp_path, False))
    assert ok.generate([{"role": "user", "content": "hello"}])[1] == [1, 2] and ok.weights == "gguf"
    ok.close()
    peer = PeerProcess("llamacpp", "x.gguf", 4, python=_fake_peer_python(tmp_path, True))
    with pytest.raises(PeerCrashed, match="signal 9.*illegal instruction"):
        peer.generate([{"role": "user", "content": "hello"}])
    peer.close()


def test_a_crashing_peer_leaves_the_other_rows(tmp_path, monkeypatch):
    from tests.tokenizer_util import add_tiny_tokenizer
    import draftwise.bench.peers as peers
    model = str(tmp_path / "m")
    make_tiny_hf(model)
    add_tiny_tokenizer(model)
    monkeypatch.setattr(peers, "peer_model", lambda name, model, ov=None: "fake.gguf")
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 0, "turns": ["hello"]}) + "\n")
    out = str(tmp_path / "out")
    rc = main(["bench", "--model", model, "--methods", "ar,llamacpp,ngram", "--dataset", str(q), "--max-tokens", "4",
               "--max-model-len", "128", "--out", out, "--peer-python",
               "llamacpp=" + _fake_peer_python(tmp_path, True)])
    assert rc == 0
    res = {r["method"]: r for r in json.load(open(os.path.join(out, "bench.json")))["results"]}
    assert "signal 9" in res["llamacpp"]["error"]
    assert res["ar"]["output_tokens"] > 0 and res["ngram"]["greedy_match"] == 1.0


def test_step_cost_bench(tmp_path):
    model = str(tmp_path / "m")
    make_tiny_hf(model)
    out = str(tmp_path / "sc")
    rc = main(["bench", "step-cost", "--model", model, "--formats", "fp32,int4", "--threads", "1",
               "--rows", "1,4", "--contexts", "8,40", "--requests", "1,3", "--repeats", "2", "--out", out])
    assert rc == 0
    data = json.load(open(os.path.join(out, "step_cost.json")))
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2 * 2 and "capability" in data["machine"]
    assert sorted({r["requests"] for r in rows}) == [1, 3]
    for r in rows:
        assert r["step_ms"] > 0 and r["linears_ms"] > 0 and r["lm_head_ms"] > 0
        assert {"attention_ms", "other ops_ms", "python / dispatch_ms", "sampling_ms"} <= set(r)
    assert os.path.getsize(os.path.join(out, "step_cost.png")) > 1000


def test_step_cost_reports_the_linears_rate_beside_the_kernels_ceiling(tmp_path, capsys):
    """Each M's layer-linear rate in GMAC/s a core, from the layers' own shapes, and the ceiling:
    the model's largest linear's own kernel on cache-resident weights, in the same run."""
    from tests.models.gguf_builder import write_tiny_llama_gguf
    from draftwise import LLM, kernels
    from draftwise.bench.step_cost import kernel_ceiling, layer_linear_macs
    linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path = write_tiny_llama_gguf(str(tmp_path / "t-Q4_K.gguf"), {n: "Q4_K" for n in linears}, tokenizer=True)
    llm = LLM(path, max_model_len=64)
    model = llm.engine.worker.runner.model
    # 2 layers: q 256 + k, v 2 x 128 (2 KV heads of 64), o 256, gate and up 2 x 512, down 512 -> 256
    assert layer_linear_macs(model) == 2 * (256 * 512 + 256 * 256 + 256 * 1024 + 512 * 256)
    ceiling = kernel_ceiling(model, seconds=0.05)
    if kernels.load() is None:
        assert ceiling is None
    else:
        # gate and up (256 -> 1024) is the largest
        assert ceiling["bits"] == 4 and ceiling["gmacs_per_core"] > 0 and ceiling["inputs"] == 256
    del llm
    out = str(tmp_path / "sc")
    assert main(["bench", "step-cost", "--model", path, "--formats", "gguf", "--threads", "1", "--rows", "1,2",
                 "--contexts", "8", "--repeats", "1", "--out", out]) == 0
    rows = json.load(open(os.path.join(out, "step_cost.json")))["rows"]
    assert all(r["linear_gmacs_per_core"] > 0 and r["linear_gmac"] == r["rows"] * layer_linear_macs(model) / 1e9
               for r in rows)
    table = capsys.readouterr().out
    assert "GMAC/s a core" in table and ("4-bit codes, 16 x 256 x 256" in table or kernels.load() is None)


def test_step_cost_times_a_draft_models_token(tmp_path, capsys):
    model, draft = str(tmp_path / "m"), str(tmp_path / "d")
    make_tiny_hf(model)
    make_tiny_hf(draft, layers=1, seed=3)
    out = str(tmp_path / "sc")
    rc = main(["bench", "step-cost", "--model", model, "--formats", "fp32", "--threads", "1", "--rows", "1,2",
               "--contexts", "8", "--repeats", "2", "--draft-model", draft, "--draft-quantization", "Q8_0",
               "--out", out])
    assert rc == 0
    rows = json.load(open(os.path.join(out, "step_cost.json")))["rows"]
    assert len(rows) == 2 and all(r["draft_token_ms"] > 0 for r in rows)
    assert "ms per drafted token" in capsys.readouterr().out


def test_quality_scores_every_token_after_the_first():
    import math
    import torch
    from draftwise.bench.quality import nll_of
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    ids = [2, 1, 0]
    want = -(torch.log_softmax(logits[0].double(), -1)[1] + torch.log_softmax(logits[1].double(), -1)[0])
    assert math.isclose(nll_of(logits, ids), float(want), rel_tol=1e-12)


def test_draft_model_presets_take_the_draft_model_option():
    from draftwise.bench.run import parse_methods
    with pytest.raises(ValueError, match="needs --draft-model"):
        parse_methods("ar,draft-model")
    (_, plain, _), (_, spec, _) = parse_methods("ar,draft-model-suffix", None, "qwen2.5-coder-0.5b", "Q4_0")
    assert plain is None
    assert spec == {"method": "draft_model", "num_speculative_tokens": 4, "hybrid": "suffix",
                    "model": "qwen2.5-coder-0.5b", "quantization": "Q4_0"}


@pytest.mark.parametrize("model,draft,given,want", [
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", None, "Q4_0"),      # the packaged pair, as `auto` runs it
    ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-0.5b", None, "Q4_0"),   # the target by alias
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "none", None),      # its own weights, asked for
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "Q8_0", "Q8_0"),
    ("qwen2.5-coder-1.5b", "/models/other-draft.gguf", None, None),  # not the packaged pair
    (None, "qwen2.5-coder-0.5b", None, None),                        # the default target has no pair
])
def test_draft_model_methods_default_to_the_packaged_pairs_quantization(model, draft, given, want):
    from types import SimpleNamespace
    from draftwise.bench.run import draft_quantization
    args = SimpleNamespace(model=model, draft_model=draft, draft_quantization=given)
    assert draft_quantization(args) == want


def test_rounds_report_medians_and_the_median_ratio_of_each_round():
    """With --rounds, tokens/s is the median over rounds and a speedup the median of the ratios
    measured within each round (a round run while the machine is slow slows every method)."""
    from draftwise.bench.run import combine_rounds

    def run(method, tps, spec=None, outputs=((1, 2),)):
        return {"method": method, "spec": spec, "quantization": "gguf", "tokens_per_s": tps,
                "decode_tokens_per_s": tps, "outputs": [list(outputs)]}

    rounds = [[run("ar", 10.0), run("auto", 15.0, "auto")],
              [run("ar", 20.0), run("auto", 24.0, "auto")],       # a fast spell: both faster
              [run("ar", 12.0), run("auto", 18.0, "auto", outputs=((1, 3),))]]
    ar, auto = combine_rounds(rounds)
    assert ar["tokens_per_s"] == 12.0 and auto["tokens_per_s"] == 18.0
    assert auto["round_tokens_per_s"] == [15.0, 24.0, 18.0]
    assert auto["speedup_vs_ar"] == 1.5                # ratios 1.5, 1.2, 1.5: their median
    assert auto["greedy_match"] == 1.0 and auto["greedy_reference"] == "ar"
    assert ar["same_outputs_every_round"] and not auto["same_outputs_every_round"]


def test_library_edits_are_real_functions_of_15_to_40_lines():
    import json as json_module
    import pytest
    from draftwise.bench.datasets import load_prompts
    convs = load_prompts("library-edits:json", None)
    assert len(convs) == 10 and all(len(c) == 2 for c in convs)
    for c in convs:
        code = c[0].split("```python\n", 1)[1].split("\n```", 1)[0]
        assert 15 <= len(code.splitlines()) <= 40
        name = c[0].split("`")[1]
        assert f"def {name}(" in code
    src = open(json_module.__file__).read()
    assert convs[0][0].split("```python\n", 1)[1].split("\n```", 1)[0].splitlines()[0] in src
    assert len(load_prompts("library-edits:json", 3)) == 3
    with pytest.raises(ValueError, match="no installed module"):
        load_prompts("library-edits:no_such_module_here", None)


def test_bench_engines_keep_the_pool_a_server_keeps_for_the_next_turn(tiny_llama):
    """One request at a time, but the KV pool `draftwise serve` has at its defaults (16 sequences
    of 512 tokens and one max_model_len sequence), so a conversation's first turn is still cached
    when its second comes after the other conversations' first turns."""
    from types import SimpleNamespace
    from draftwise.bench.run import build_engine_llm
    from draftwise.config import default_kv_tokens
    args = SimpleNamespace(model=tiny_llama[0], max_model_len=256, enforce_eager=True)
    llm = build_engine_llm(None, args, 1)
    assert llm.engine.config.max_num_seqs == 1
    assert llm.engine.scheduler.allocator.num_blocks == default_kv_tokens(16, 256) // 16 > default_kv_tokens(1, 256) // 16
