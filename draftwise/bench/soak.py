"""Robustness runs against a real `draftwise serve` process (loopback only, bounded counts).

    draftwise bench load --soak --num-requests 1000 --concurrency 16 -- --speculative-config none
    draftwise bench load --bad-input --url http://127.0.0.1:8000

`--bad-input` sends a catalogue of malformed and extreme requests (wrong types, out-of-range and
extreme numbers, lone surrogates, unknown fields' values, oversized bodies, over-long prompts,
bad JSON, a wrong model name) while well-formed streams run beside them, and checks that every bad
request is a 4xx in OpenAI's error shape, that nothing is a 5xx, and that every good stream ends
with [DONE] and the same text as the same request alone.

`--soak` starts its own server (the arguments after `--` go to `draftwise serve`), then reports
its RSS fresh, after the load (`--num-requests` streamed requests at `--concurrency`), after a
bad-input round and a large-prompt round, the 429s under an overload burst when the server has a
queue limit, and how long the idle server takes to exit on SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from draftwise.bench.load import format_results, run_load_test

GOOD = {"prompt": "Write a haiku about the sea.", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def bad_input_cases(model: str, max_request_bytes: int = 1 << 20) -> list[tuple[str, str, bytes | dict]]:
    """(name, path, body) for requests that must be answered with a 4xx. A body given as bytes is
    sent as is (malformed JSON, lone surrogates as \\u escapes)."""
    c, ch = "/v1/completions", "/v1/chat/completions"
    base = {"model": model, "prompt": "hi", "max_tokens": 4}
    msgs = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases: list[tuple[str, str, bytes | dict]] = []
    for field, values in {
        "top_k": [-2, 1.5, "5", True], "top_p": [0, -0.1, 1.5, "x", None], "temperature": [-1, "hot", [1]],
        "max_tokens": [0, -5, 2 ** 63, 1.5, "10"], "seed": [2 ** 64, -(2 ** 63) - 1, 1.5, "7"],
        "logprobs": [21, -1, "a"], "n": [17, 0], "stop": ["", [""], [1], {"a": 1}],
        "presence_penalty": [5.0], "logit_bias": [{"5": 1000}, {"x": 1}], "echo": ["yes"], "best_of": [0, 17],
        "stream": ["yes"], "stream_options": [{"include_usage": "no"}], "model": ["no-such-model", 5],
        "prompt": [[], "", [-1], [10 ** 12], [[1], [2]], 5, None],
    }.items():
        for v in values:
            cases.append((f"completions {field}={v!r}"[:80], c, {**base, field: v}))
    for name, m in {"no messages": [], "bad role": [{"role": "robot", "content": "hi"}],
                    "user without content": [{"role": "user"}], "content type": [{"role": "user", "content": 5}],
                    "part type": [{"role": "user", "content": [{"type": "image", "text": "x"}]}]}.items():
        cases.append((f"chat {name}", ch, {**msgs, "messages": m}))
    surrogate = json.dumps({**msgs, "messages": [{"role": "user", "content": "a\ud800b"}]}).encode()
    cases.append(("chat lone surrogate", ch, surrogate))
    cases.append(("completions lone surrogate", c, json.dumps({**base, "prompt": "\udfff"}).encode()))
    cases.append(("stop lone surrogate", c, json.dumps({**base, "stop": ["\ud83d"]}).encode()))
    cases.append(("malformed JSON", c, b'{"model": "x", "prompt": '))
    cases.append(("not an object", c, b"[1, 2, 3]"))
    cases.append(("empty body", c, b""))
    cases.append(("over-long prompt", c, {**base, "prompt": "word " * 40_000}))
    cases.append(("max_tokens past the context", c, {**base, "max_tokens": 10 ** 6}))
    cases.append(("oversized body", c, {**base, "prompt": "x" * (max_request_bytes + 10)}))
    return cases


def _post(client, path: str, body) -> object:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


def run_bad_inputs(url: str, model: str | None = None, good_streams: int = 4, timeout: float = 300) -> dict:
    """Send every bad-input case while `good_streams` well-formed streams run; see the module doc."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout) as client:
        model = model or client.get("/v1/models").json()["data"][0]["id"]
        ref = client.post("/v1/completions", json={**GOOD, "model": model}).json()["choices"][0]["text"]

        def stream(_):
            with httpx.Client(base_url=url.rstrip("/"), timeout=timeout) as c2, \
                    c2.stream("POST", "/v1/completions", json={**GOOD, "model": model, "stream": True}) as r:
                lines = [ln for ln in r.iter_lines() if ln]
            text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]
                           if "choices" in json.loads(ln[6:]))
            return r.status_code == 200 and lines[-1] == "data: [DONE]" and text == ref

        cases = bad_input_cases(model)
        results = []
        with ThreadPoolExecutor(good_streams) as ex:
            futs = [ex.submit(stream, i) for i in range(good_streams)]
            t0 = time.perf_counter()
            for name, path, body in cases:
                r = _post(client, path, body)
                shaped = False
                try:
                    err = r.json()["error"]
                    shaped = set(err) == {"message", "type", "param", "code"} and bool(err["message"])
                except Exception:       # noqa: BLE001
                    pass
                results.append((name, r.status_code, shaped))
            bad_s = time.perf_counter() - t0
            good_ok = [f.result() for f in futs]
    wrong = [(n, s) for n, s, shaped in results if not (400 <= s < 500 and shaped)]
    return {"bad_requests": len(results), "answered_4xx": sum(1 for _, s, _ in results if 400 <= s < 500),
            "server_errors_5xx": sum(1 for _, s, _ in results if s >= 500), "not_openai_shaped_or_not_4xx": wrong,
            "by_status": {str(s): sum(1 for _, x, _ in results if x == s) for s in sorted({s for _, s, _ in results})},
            "good_streams": good_streams, "good_streams_identical": sum(good_ok), "bad_round_s": bad_s}


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_soak(serve_args: list[str], num_requests: int = 1000, concurrency: int = 16, max_tokens: int = 32,
             startup_timeout: float = 1800, log_path: str | None = None) -> dict:
    """Start `draftwise serve serve_args...` on a free loopback port and measure it (module doc)."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(log_path or os.devnull, "w")
    t_start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "draftwise.entrypoints.cli", "serve", "--port", str(port),
                             *serve_args], stdout=log, stderr=subprocess.STDOUT)
    res: dict = {"serve_args": serve_args}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t_start > startup_timeout:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.5)
        res["startup_s"] = time.perf_counter() - t_start
        res["rss_fresh_mb"] = _rss_mb(proc.pid)
        res["load"] = run_load_test(url, num_requests=num_requests, concurrency=concurrency, max_tokens=max_tokens)
        res["rss_after_load_mb"] = _rss_mb(proc.pid)
        res["bad_input"] = run_bad_inputs(url)
        res["rss_after_bad_input_mb"] = _rss_mb(proc.pid)
        res["load_again"] = run_load_test(url, num_requests=max(concurrency, num_requests // 10),
                                          concurrency=concurrency, max_tokens=max_tokens)
        res["rss_end_mb"] = _rss_mb(proc.pid)
        res["metrics_rejections"] = {line.split("}")[0].split('"')[1]: float(line.split()[-1])
                                     for line in httpx.get(url + "/metrics").text.splitlines()
                                     if line.startswith("draftwise_requests_total{")}
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        res["exit_code"] = proc.wait(timeout=120)
        res["idle_exit_s"] = time.perf_counter() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return res


def format_soak(r: dict) -> str:
    b = r["bad_input"]
    return "\n".join([
        f"server: draftwise serve {' '.join(r['serve_args'])} (ready in {r['startup_s']:.1f} s)",
        f"RSS: fresh {r['rss_fresh_mb']:.0f} MB | after load {r['rss_after_load_mb']:.0f} MB | after bad input "
        f"{r['rss_after_bad_input_mb']:.0f} MB | after a second load {r['rss_end_mb']:.0f} MB",
        "load: " + format_results(r["load"]).replace("\n", "\n      "),
        format_bad_inputs(b),
        f"outcomes (/metrics): {r['metrics_rejections']}",
        f"SIGTERM when idle: exit code {r['exit_code']} after {r['idle_exit_s']:.2f} s"])


def format_bad_inputs(b: dict) -> str:
    lines = [f"bad input: {b['bad_requests']} requests -> {b['answered_4xx']} answered 4xx {b['by_status']}, "
             f"{b['server_errors_5xx']} 5xx; well-formed streams beside them identical to alone: "
             f"{b['good_streams_identical']}/{b['good_streams']}"]
    for name, status in b["not_openai_shaped_or_not_4xx"]:
        lines.append(f"  not a shaped 4xx: {name} -> {status}")
    return "\n".join(lines)
