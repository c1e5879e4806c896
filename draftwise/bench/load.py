"""A bounded load test against a running OpenAI-compatible server (`draftwise serve`).

    draftwise bench load --url http://127.0.0.1:8000 --num-requests 200 --concurrency 8

Sends `num_requests` completions (or chat) requests with at most `concurrency` in flight and prints
throughput (requests/s, output tokens/s) and latency percentiles (end-to-end, and time to first
token and time per output token after it when streaming). Only loopback URLs are accepted unless --allow-remote is given.

`--turns N` (chat): each of `num_requests` sessions is a conversation of N user turns (from
--dataset, MT-bench / Spec-Bench question.jsonl, or follow-ups to the default prompts); turn k
resends the whole history with the model's own earlier answers, as a chat client does. Time to first
token is reported for first turns and for follow-up turns apart: follow-ups are where automatic
prefix caching saves the prefill of the history. Each session names itself (`x-session-id`), so a
router in front of several replicas (`serve --data-parallel-size N`) can keep it on one replica.

When the server exposes draftwise's /metrics, the summary adds what the run did to them: the
prefix-cache hit rate over its prompt tokens and the mean speculative acceptance length.
"""
import asyncio
import ipaddress
import json
import math
import time
from urllib.parse import urlparse

DEFAULT_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain speculative decoding in two sentences.",
    "List five uses for a paper clip.",
    "What is the capital of France, and why is it famous?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a haiku about autumn leaves.",
    "Summarize the plot of a detective novel you invent.",
    "How does a hash table work?",
]


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))   # nearest-rank
    return s[k]


def _is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _run(url: str, num_requests: int, concurrency: int, max_tokens: int, prompts: list,
               model: str | None, api_key: str | None, stream: bool, chat: bool, temperature: float,
               timeout: float, turns: int = 1, settle_s: float = 0.0) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=timeout, limits=limits) as client:
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)
        latencies, ttfts, follow_ttfts, errors, tpots = [], [], [], [], []
        tokens = {"prompt": 0, "completion": 0}

        async def session(i: int) -> None:
            conv = prompts[i % len(prompts)]
            conv = [conv] if isinstance(conv, str) else list(conv)
            history: list[dict] = []
            async with sem:
                for t in range(turns if chat else 1):
                    user = conv[t] if t < len(conv) else "Tell me more."
                    history.append({"role": "user", "content": user})
                    answer = await one(history if chat else user, t > 0, f"load-{i}")
                    if answer is None:
                        return
                    history.append({"role": "assistant", "content": answer})

        async def one(p, follow_up: bool, session_id: str):
            body = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True}
            if chat:
                body["messages"] = list(p)
                path = "/v1/chat/completions"
            else:
                body["prompt"] = p
                path = "/v1/completions"
            text = []
            t0 = time.perf_counter()
            try:
                if stream:
                    body["stream"] = True
                    body["stream_options"] = {"include_usage": True}
                    usage, first = None, None
                    async with client.stream("POST", path, json=body, headers={"x-session-id": session_id}) as r:
                        if r.status_code != 200:
                            await r.aread()
                            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                raise RuntimeError(ev["error"].get("message"))
                            ch = ev.get("choices") or []
                            piece = ((ch[0].get("delta") or {}).get("content") or ch[0].get("text") or "") if ch else ""
                            # time to the first generated text: a chat stream opens with a role-only
                            # chunk the server sends before any token exists
                            if first is None and piece:
                                first = time.perf_counter()
                            text.append(piece)
                            if ev.get("usage"):
                                usage = ev["usage"]
                    if first is not None:
                        (follow_ttfts if follow_up else ttfts).append(first - t0)
                else:
                    r = await client.post(path, json=body, headers={"x-session-id": session_id})
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                    data = r.json()
                    usage = data.get("usage")
                    c = data["choices"][0]
                    text.append((c.get("message") or {}).get("content") or c.get("text") or "")
                end = time.perf_counter()
                latencies.append(end - t0)
                if usage:
                    tokens["prompt"] += usage["prompt_tokens"]
                    tokens["completion"] += usage["completion_tokens"]
                    if stream and first is not None and usage["completion_tokens"] > 1:
                        # time per output token after the first
                        tpots.append((end - first) / (usage["completion_tokens"] - 1))
            except Exception as e:          # noqa: BLE001 - count and go on
                errors.append(str(e) or type(e).__name__)
                return None
            return "".join(text)

        before = await _server_counters(client)
        t_start = time.perf_counter()
        await asyncio.gather(*(session(i) for i in range(num_requests)))
        wall = time.perf_counter() - t_start
        await asyncio.sleep(settle_s)          # replicas behind a router report every second
        after = await _server_counters(client)

    ok = len(latencies)
    res = {
        "url": base, "model": model, "num_requests": num_requests, "concurrency": concurrency,
        "max_tokens": max_tokens, "stream": stream, "chat": chat, "turns": turns if chat else 1,
        "completed": ok, "errors": len(errors), "wall_s": wall,
        "requests_per_s": ok / wall if wall > 0 else 0.0,
        "output_tokens_per_s": tokens["completion"] / wall if wall > 0 else 0.0,
        "prompt_tokens": tokens["prompt"], "completion_tokens": tokens["completion"],
        "latency_p50_s": _percentile(latencies, 50), "latency_p99_s": _percentile(latencies, 99),
        "latency_mean_s": sum(latencies) / ok if ok else float("nan"),
    }
    if stream:
        res["ttft_p50_s"] = _percentile(ttfts, 50)
        res["ttft_p99_s"] = _percentile(ttfts, 99)
        if tpots:
            res["tpot_p50_s"] = _percentile(tpots, 50)
            res["tpot_p99_s"] = _percentile(tpots, 99)
        if follow_ttfts:
            res["follow_up_ttft_p50_s"] = _percentile(follow_ttfts, 50)
            res["follow_up_ttft_p99_s"] = _percentile(follow_ttfts, 99)
    if before is not None and after is not None:
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        if d.get("draftwise_prefix_cache_queries_total", 0) > 0:
            res["prefix_cache_hit_rate"] = d["draftwise_prefix_cache_hits_total"] / d["draftwise_prefix_cache_queries_total"]
        if d.get("draftwise_spec_decode_num_drafts_total", 0) > 0:
            res["spec_acceptance_length"] = 1 + (d["draftwise_spec_decode_num_accepted_tokens_total"]
                                                 / d["draftwise_spec_decode_num_drafts_total"])
    if errors:
        res["first_errors"] = errors[:5]
    return res


COUNTERS = ("draftwise_prefix_cache_queries_total", "draftwise_prefix_cache_hits_total",
            "draftwise_spec_decode_num_drafts_total", "draftwise_spec_decode_num_accepted_tokens_total")


async def _server_counters(client) -> dict | None:
    """The server's prefix-cache and speculative-decoding counters (None without draftwise /metrics)."""
    try:
        r = await client.get("/metrics")
    except Exception:                  # noqa: BLE001
        return None
    if r.status_code != 200:
        return None
    out = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            out[name] = float(value)
    return out or None


def run_load_test(url: str = "http://127.0.0.1:8000", num_requests: int = 200, concurrency: int = 8,
                  max_tokens: int = 64, prompts: list[str] | None = None, model: str | None = None,
                  api_key: str | None = None, stream: bool = True, chat: bool = False,
                  temperature: float = 0.0, timeout: float = 600.0, allow_remote: bool = False,
                  turns: int = 1, settle_s: float = 0.0) -> dict:
    """Run the load test and return its summary (see `format_results`)."""
    if num_requests < 1 or concurrency < 1 or max_tokens < 1:
        raise ValueError("num_requests, concurrency and max_tokens must be >= 1")
    if not allow_remote and not _is_loopback(url):
        raise ValueError(f"{url} is not a loopback address (pass allow_remote=True / --allow-remote)")
    return asyncio.run(_run(url, num_requests, min(concurrency, num_requests), max_tokens,
                            prompts or DEFAULT_PROMPTS, model, api_key, stream, chat, temperature, timeout,
                            turns, settle_s))


def format_results(r: dict) -> str:
    lines = [f"{r['completed']}/{r['num_requests']} requests ok ({r['errors']} errors), concurrency "
             f"{r['concurrency']}, max_tokens {r['max_tokens']}, {'stream' if r['stream'] else 'no stream'}, "
             f"{'chat' if r['chat'] else 'completions'}, in {r['wall_s']:.2f}s",
             f"throughput: {r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tokens/s "
             f"({r['completion_tokens']} output, {r['prompt_tokens']} prompt tokens)",
             f"latency: p50 {r['latency_p50_s'] * 1000:.0f} ms, p99 {r['latency_p99_s'] * 1000:.0f} ms, "
             f"mean {r['latency_mean_s'] * 1000:.0f} ms"]
    if "ttft_p50_s" in r:
        lines.append(f"time to first token: p50 {r['ttft_p50_s'] * 1000:.0f} ms, p99 {r['ttft_p99_s'] * 1000:.0f} ms")
    if "tpot_p50_s" in r:
        lines.append(f"time per output token after the first: p50 {r['tpot_p50_s'] * 1000:.1f} ms, "
                     f"p99 {r['tpot_p99_s'] * 1000:.1f} ms")
    if "follow_up_ttft_p50_s" in r:
        lines.append(f"time to first token, follow-up turns: p50 {r['follow_up_ttft_p50_s'] * 1000:.0f} ms, "
                     f"p99 {r['follow_up_ttft_p99_s'] * 1000:.0f} ms")
    if "prefix_cache_hit_rate" in r or "spec_acceptance_length" in r:
        lines.append("server: " + ", ".join(
            ([f"prefix-cache hit rate {r['prefix_cache_hit_rate']:.3f}"] if "prefix_cache_hit_rate" in r else [])
            + ([f"mean acceptance length {r['spec_acceptance_length']:.2f}"] if "spec_acceptance_length" in r
               else [])))
    for e in r.get("first_errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)
