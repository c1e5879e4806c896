"""llama-server rows of `draftwise bench` against a fake binary that speaks its endpoints (the real
server is a benchmark dependency, never a test dependency)."""
import json
import os
import sys

import pytest

from draftwise.bench.build_peer import build_llama_server
from draftwise.bench.llama_server import server_command
from draftwise.entrypoints.cli import main
from tests.models.gguf_builder import write_tiny_llama_gguf

FAKE = os.path.join(os.path.dirname(__file__), "fake_llama_server.py")


def fake_binary(tmp_path) -> str:
    path = tmp_path / "llama-server"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_tiny_llama_gguf(str(tmp_path / "tiny-Q8_0.gguf"), {"attn_q": "Q8_0"}, hidden=64, inter=128, vocab=512,
                                 tokenizer=True)


def questions(tmp_path, n=2):
    q = tmp_path / "q.jsonl"
    q.write_text("\n".join(json.dumps({"turns": [f"edit function number {i} please", "now add type hints"]})
                           for i in range(n)) + "\n")
    return str(q)


def test_server_command_names_each_mode():
    plain = server_command("/b/llama-server", "m.gguf", "", 9000, 2, 2048)
    assert plain[:3] == ["/b/llama-server", "-m", "m.gguf"] and "--spec-type" not in plain
    assert ["-t", "2"] == plain[plain.index("-t"):plain.index("-t") + 2] and "-np" in plain
    draft = server_command("/b/llama-server", "m.gguf", "draft", 9000, 2, 2048, "d.gguf", 8, 0.5)
    assert draft[draft.index("--spec-type") + 1] == "draft-simple" and draft[draft.index("-md") + 1] == "d.gguf"
    assert draft[draft.index("--spec-draft-n-max") + 1] == "8" and draft[draft.index("--spec-draft-p-min") + 1] == "0.5"
    ngram = server_command("/b/llama-server", "m.gguf", "ngram-mod", 9000, 2, 2048)
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-mod" and "-md" not in ngram
    with pytest.raises(ValueError, match="--server-drafter"):
        server_command("/b/llama-server", "m.gguf", "eagle3", 9000, 2, 2048)


def test_server_rows_and_a_server_killed_mid_run_leaves_the_others(tmp_path, tiny_gguf, monkeypatch):
    binary = fake_binary(tmp_path)
    record = tmp_path / "args.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_ARGS", str(record))
    out = str(tmp_path / "out")
    # the ngram-mod server (the third started) dies at its second request
    calls = {"n": 0}
    import draftwise.bench.llama_server as ls
    real_popen = ls.subprocess.Popen

    def popen(cmd, **kw):
        calls["n"] += 1
        env = dict(os.environ, **({"FAKE_LLAMA_SERVER_DIE_AT": "2"} if "ngram-mod" in cmd else {}))
        return real_popen(cmd, env=env, **kw)
    monkeypatch.setattr(ls.subprocess, "Popen", popen)
    rc = main(["bench", "--model", tiny_gguf, "--methods",
               "ar,llamacpp-server,llamacpp-server:draft,llamacpp-server:ngram-mod,llamacpp-server:ngram-cache",
               "--llama-server", binary, "--draft-model", tiny_gguf, "--dataset", questions(tmp_path),
               "--max-tokens", "6", "--max-model-len", "256", "--threads", "1", "--out", out])
    assert rc == 0
    res = {r["method"]: r for r in json.load(open(os.path.join(out, "bench.json")))["results"]}
    assert "exited with status 3" in res["llamacpp-server:ngram-mod"]["error"]
    for name in ("llamacpp-server", "llamacpp-server:draft", "llamacpp-server:ngram-cache"):
        r = res[name]
        assert not r.get("error") and r["output_tokens"] > 0 and r["tokens_per_s"] > 0, r
        assert r["ttft_mean_s"] == pytest.approx(0.002) and r["decode_tokens_per_s"] > 0
    assert res["llamacpp-server:draft"]["server_draft_n"] == 4 * 4 and \
        res["llamacpp-server:draft"]["server_acceptance_rate"] == 0.5
    assert set(res["llamacpp-server:draft"]["server_n_max_tokens_per_s"]) == {"4", "8"} or \
        set(res["llamacpp-server:draft"]["server_n_max_tokens_per_s"]) == {4, 8}
    assert res["llamacpp-server:ngram-cache"]["matches_server_plain"] == 1.0
    assert res["ar"]["output_tokens"] > 0
    started = [json.loads(line) for line in open(record)]
    draft_runs = [a for a in started if "draft-simple" in a]
    assert sorted(a[a.index("--spec-draft-n-max") + 1] for a in draft_runs) == ["4", "8"]
    assert all(a[a.index("-t") + 1] == "1" and a[a.index("-c") + 1] == "256" for a in started)
    md = open(os.path.join(out, "bench.md")).read()
    assert "| llamacpp-server:ngram-mod | failed:" in md and "8 of 16 drafted accepted" in md


def test_a_server_that_hangs_or_cannot_start_ends_its_own_row(tmp_path, tiny_gguf, monkeypatch):
    from draftwise.bench.llama_server import LlamaServerPeer
    from draftwise.bench.peers import PeerCrashed
    binary = fake_binary(tmp_path)
    monkeypatch.setenv("FAKE_LLAMA_SERVER_HANG_AT", "1")
    peer = LlamaServerPeer(binary, tiny_gguf, "", 1, 256, 8, request_timeout_s=1.0)
    with pytest.raises(PeerCrashed, match="no answer in 1 s"):
        peer.generate([{"role": "user", "content": "hi"}])
    assert peer.proc.poll() is not None                     # the hung server was killed
    monkeypatch.setenv("FAKE_LLAMA_SERVER_FAIL_START", "1")
    with pytest.raises(ValueError, match="exited with status 1 while starting.*failed to load model"):
        LlamaServerPeer(binary, tiny_gguf, "", 1, 256, 8)
    with pytest.raises(ValueError, match="missing or not executable.*build-peer --server"):
        LlamaServerPeer(str(tmp_path / "nope"), tiny_gguf, "", 1, 256, 8)


def test_build_peer_server_reuses_a_finished_build_and_names_a_failed_step(tmp_path, monkeypatch):
    said = []
    out = tmp_path / "peer"
    (out / "bin").mkdir(parents=True)
    binary = fake_binary(out / "bin")
    assert build_llama_server(str(out), "avx2", flags={"avx2", "fma", "f16c"}, say=said.append) == \
        str(out / "bin" / "llama-server") == binary
    assert "reusing the finished build" in said[0]
    fresh = tmp_path / "fresh"
    broken = tmp_path / "python-that-fails"
    broken.write_text("#!/bin/sh\necho 'no network here' >&2\nexit 7\n")
    broken.chmod(0o755)
    with pytest.raises(ValueError, match="failed at 'pip download.*exit 7.*build.log"):
        build_llama_server(str(fresh), "avx2", python=str(broken), flags={"avx2", "fma", "f16c"})
    assert "no network here" in (fresh / "build.log").read_text()


def test_prefill_bench_times_llama_server_on_token_ids_and_names_a_crash(tmp_path, tiny_gguf, monkeypatch):
    from draftwise.bench.peers import PeerCrashed
    from draftwise.bench.prefill import llama_server_ttft
    binary = fake_binary(tmp_path)
    ids = list(range(100, 164))
    assert 0 < llama_server_ttft(binary, tiny_gguf, ids, 2, 1) < 60
    monkeypatch.setenv("FAKE_LLAMA_SERVER_DIE_AT", "2")            # the warm-up answers, the timed prefill kills it
    with pytest.raises(PeerCrashed, match="no prefill answer"):
        llama_server_ttft(binary, tiny_gguf, ids, 2, 1)
