"""Only our own lines on stderr: every command run as a user runs it (a subprocess), every line it
writes to stderr checked against the formats draftwise chose - its own messages and log lines,
uvicorn's standard server log, and the progress bars it shows. A third-party warning, a leak
report at exit (triton's nanobind bindings printed ~40 lines after every command) or a traceback
fails the test."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.models.gguf_builder import write_tiny_llama_gguf

OURS = [
    r"draftwise: ",                                              # errors, the kernel-build line
    r"draftwise chat — ",
    r"\[start-up [\d.]+ s \| prefill ",                          # generate's timing line
    r"(\S+ \S+ )?(DEBUG|INFO|WARNING|ERROR) draftwise(\.[\w.]+)?: ",   # our loggers (the server adds a time)
    r"INFO:     (Started server process|Waiting for application (startup|shutdown)|Application (startup|shutdown) "
    r"complete|Uvicorn running on|Shutting down|Finished server process|127\.0\.0\.1:\d+ - \")",   # uvicorn
    r"(bench|gen-datastore|answers)?:? *\d+%\|",                 # tqdm bars we show
]


def foreign_lines(stderr: str) -> list[str]:
    lines = [seg for line in stderr.splitlines() for seg in line.split("\r") if seg.strip()]
    return [ln for ln in lines if not any(re.match(p, ln) for p in OURS)]


def cli(*args, timeout=300, input=None, env=None):
    return subprocess.run([sys.executable, "-m", "draftwise.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=timeout, input=input, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("stderr")
    return write_tiny_llama_gguf(str(d / "tiny-Q8_0.gguf"), {"attn_q": "Q8_0", "ffn_up": "Q8_0"}, hidden=64,
                                 inter=128, vocab=512, tokenizer=True)


def test_generate_chat_bench_and_cache_print_only_our_lines(tiny, tmp_path):
    commands = {
        "generate": ("generate", "--model", tiny, "--max-tokens", "6", "--max-model-len", "256", "hello"),
        "generate (default model)": ("generate", "--max-tokens", "4", "hi"),
        "chat": ("chat", "--model", tiny, "--max-tokens", "6", "--max-model-len", "256"),
        "bench": ("bench", "--model", tiny, "--methods", "ar,suffix", "--dataset", "code-edits", "--num-prompts", "1",
                  "--max-turns", "1", "--max-tokens", "4", "--max-model-len", "512", "--out", str(tmp_path / "b")),
        # the torch profiler it runs prints libkineto's USDT lines unless muted at its start and stop
        "bench step-cost": ("bench", "step-cost", "--model", tiny, "--formats", "gguf", "--threads", "1", "--rows",
                            "1,2", "--contexts", "16", "--repeats", "1", "--out", str(tmp_path / "s")),
        "cache": ("cache", "list"),
        "bad model": ("generate", "--model", str(tmp_path / "none.gguf"), "hi"),
    }
    # each command in its own process, two at a time (each mostly imports)
    with ThreadPoolExecutor(2) as ex:
        runs = dict(zip(commands, ex.map(
            lambda name: cli(*commands[name], input="hello\n\n" if name == "chat" else None), commands)))
    for name, p in runs.items():
        assert p.returncode == (2 if name == "bad model" else 0), (name, p.stderr[-2000:])
        assert foreign_lines(p.stderr) == [], (name, foreign_lines(p.stderr)[:10])
    assert runs["generate"].stderr.strip().splitlines()[-1].startswith("[start-up")


def test_serve_start_requests_and_sigterm_print_only_our_lines(tiny):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "draftwise.entrypoints.cli", "serve", "--model", tiny, "--port",
                             str(port), "--max-model-len", "256", "--max-num-seqs", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
        assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
        structured = {**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}
        assert httpx.post(url + "/v1/chat/completions", json=structured, timeout=120).status_code == 200
        assert httpx.post(url + "/v1/chat/completions", json={"messages": "nope"}, timeout=60).status_code == 400
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert foreign_lines(err) == [], foreign_lines(err)[:10]
    assert "Application startup complete" in err and "Finished server process" in err
