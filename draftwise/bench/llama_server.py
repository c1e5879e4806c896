"""llama.cpp's own server as a peer of `draftwise bench`: the engine a CPU user would pick instead
for speculative decoding (a draft model, EAGLE-3 and DFlash drafters, n-gram modes).

Each row starts `llama-server` on a free local port with the same GGUF files, threads and
context, one slot, and times it through its OpenAI endpoint: end-to-end seconds per request from
here, and its own `timings` object (`prompt_ms`, `predicted_n`, `predicted_ms`, `draft_n`,
`draft_n_accepted`) for time to first token, decode speed and acceptance. A server that exits or
stops answering ends its own row with the reason (PeerCrashed), never the run.

Methods: `llamacpp-server` (plain), `llamacpp-server:draft` (`--draft-model`; draft-simple at each
`--spec-draft-n-max` in turn, the faster reported), `llamacpp-server:ngram-mod`, `:ngram-cache`,
`:ngram-simple`, and `:eagle3` / `:dflash` with `--server-drafter FILE.gguf`."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time

import httpx

from draftwise.bench.peers import PeerCrashed, PeerTiming
from draftwise.models.loader import gguf_path_for, load_tokenizer
from draftwise.models.gguf_convert import gguf_metadata_dir
from draftwise.config import cache_dir

PREFIX = "llamacpp-server"
SPEC_TYPES = {"": None, "draft": "draft-simple", "ngram-mod": "ngram-mod", "ngram-cache": "ngram-cache",
              "ngram-simple": "ngram-simple", "eagle3": "draft-eagle3", "dflash": "draft-dflash"}
METHODS = tuple(PREFIX + (":" + k if k else "") for k in SPEC_TYPES)
START_TIMEOUT_S = 300.0


def is_server_method(name: str) -> bool:
    return name in METHODS


def server_mode(name: str) -> str:
    """"" (plain), "draft", "ngram-mod", ... for a method name."""
    if not is_server_method(name):
        raise ValueError(f"unknown llama-server method {name!r}; known: {', '.join(METHODS)}")
    return name.partition(":")[2]


def server_command(binary: str, model: str, mode: str, port: int, threads: int, ctx: int,
                   drafter: str | None = None, n_max: int | None = None, p_min: float | None = None) -> list[str]:
    """The llama-server command line of one row: the same model file, threads and context as
    draftwise's rows, one slot, the speculative mode's own flags."""
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-c", str(ctx), "-np", "1", "--no-warmup"]
    spec = SPEC_TYPES[mode]
    if spec is None:
        return cmd
    cmd += ["--spec-type", spec]
    if mode in ("draft", "eagle3", "dflash"):
        if not drafter:
            flag = "--draft-model" if mode == "draft" else "--server-drafter"
            raise ValueError(f"{PREFIX}:{mode} needs {flag} (a GGUF file)")
        cmd += ["-md", drafter, "-td", str(threads), "-tbd", str(threads)]
        if n_max is not None:
            cmd += ["--spec-draft-n-max", str(n_max)]
        if p_min is not None:
            cmd += ["--spec-draft-p-min", str(p_min)]
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerPeer:
    """One llama-server process answering chat requests greedily; `stats` sums its timings."""

    def __init__(self, binary: str, model: str, mode: str, threads: int, ctx: int, max_tokens: int,
                 ignore_eos: bool = False, drafter: str | None = None, n_max: int | None = None,
                 p_min: float | None = None, request_timeout_s: float | None = None):
        if not binary or not os.path.isfile(binary) or not os.access(binary, os.X_OK):
            raise ValueError(f"llama-server binary {binary!r} is missing or not executable "
                             "(`draftwise bench build-peer --server --out DIR` builds DIR/bin/llama-server)")
        gguf = gguf_path_for(model)
        if gguf is None:
            raise ValueError(f"{PREFIX} needs a GGUF model, got {model!r}")
        self.name = PREFIX + (":" + mode if mode else "")
        self.max_tokens, self.ignore_eos = max_tokens, ignore_eos
        self.tok = load_tokenizer(gguf_metadata_dir(gguf, cache_dir()))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout = request_timeout_s or max(120.0, max_tokens * 2.0)
        self.stats = {"prompt_n": 0, "predicted_n": 0, "predicted_ms": 0.0, "draft_n": 0, "draft_n_accepted": 0}
        self._log = tempfile.TemporaryFile(mode="w+")
        self.command = server_command(binary, gguf, mode, self.port, threads, ctx,
                                      gguf_path_for(drafter) if drafter else None, n_max, p_min)
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.client = httpx.Client(timeout=self.timeout)
        self._wait_ready()

    def _tail(self) -> str:
        self._log.seek(0)
        lines = [line for line in self._log.read().strip().splitlines() if line.strip()]
        return " | ".join(lines[-3:])[-600:]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(f"llama-server exited with status {self.proc.returncode} while starting: {self._tail()}")
            try:
                if self.client.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.close()
        raise ValueError(f"llama-server did not become ready in {START_TIMEOUT_S:.0f} s: {self._tail()}")

    def generate(self, messages) -> tuple[str, list[int], PeerTiming]:
        body = {"messages": messages, "max_tokens": self.max_tokens, "temperature": 0.0, "stream": False,
                "cache_prompt": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        t0 = time.perf_counter()
        try:
            r = self.client.post(self.url + "/v1/chat/completions", json=body)
        except httpx.TimeoutException:
            self.close()
            raise PeerCrashed(f"{self.name}: no answer in {self.timeout:.0f} s (server killed)") from None
        except httpx.HTTPError as e:
            try:
                code = self.proc.wait(timeout=2)           # a crash closes the connection just before it exits
            except subprocess.TimeoutExpired:
                code = None
            how = f"exited with status {code}" if code is not None else f"did not answer ({type(e).__name__})"
            raise PeerCrashed(f"{self.name}: the server {how}: {self._tail()}") from None
        total = time.perf_counter() - t0
        if r.status_code != 200:
            raise PeerCrashed(f"{self.name}: HTTP {r.status_code}: {r.text[:300]}")
        data = r.json()
        text = data["choices"][0]["message"].get("content") or ""
        t = data.get("timings") or {}
        for k in self.stats:
            self.stats[k] += t.get(k) or 0
        ids = self.tok.encode(text, add_special_tokens=False) if self.tok is not None else []
        n = t.get("predicted_n")
        ttft = t["prompt_ms"] / 1000.0 if t.get("prompt_ms") is not None else None
        return text, ids, PeerTiming(ttft, total, t.get("prompt_n"), n)

    def prefill(self, token_ids: list[int], repeats: int) -> float:
        """Best seconds over `repeats` for the prompt `token_ids` (raw tokens, as draftwise reads
        them) and one new token: the request's wall clock from here, its prompt cache off."""
        body = {"prompt": list(token_ids), "n_predict": 1, "temperature": 0.0, "cache_prompt": False, "stream": False}
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            try:
                r = self.client.post(self.url + "/completion", json=body)
            except httpx.HTTPError as e:
                raise PeerCrashed(f"{self.name}: no prefill answer ({type(e).__name__}): {self._tail()}") from None
            if r.status_code != 200:
                raise PeerCrashed(f"{self.name}: HTTP {r.status_code}: {r.text[:300]}")
            best = min(best, time.perf_counter() - t0)
            prompt_n = (r.json().get("timings") or {}).get("prompt_n")
            if prompt_n is not None and prompt_n != len(token_ids):
                raise PeerCrashed(f"{self.name}: read {prompt_n} prompt tokens of {len(token_ids)}")
        return best

    def generate_batch(self, conversations):
        return [self.generate(m) for m in conversations]

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close() if not self._log.closed else None


def acceptance(stats: dict) -> dict:
    """Drafted / accepted counts and the acceptance rate from a row's summed timings."""
    n, a = int(stats.get("draft_n") or 0), int(stats.get("draft_n_accepted") or 0)
    return {"server_draft_n": n, "server_draft_n_accepted": a, "server_acceptance_rate": a / n if n else None,
            "server_decode_tokens_per_s": stats["predicted_n"] / (stats["predicted_ms"] / 1000.0)
            if stats.get("predicted_ms") else None}


def dump_command(cmd: list[str]) -> str:
    return " ".join(json.dumps(c) if " " in c else c for c in cmd)
