"""Prefill speed side by side: one long prompt, one new token, time to first token.

    python -m draftwise.bench.prefill --tokens 1000 --threads 2 --peers openvino,llamacpp \\
        --peer-python openvino=ov-env/bin/python --llama-server peer/bin/llama-server

The prompt is ShareGPT text (the held-out split) cut to --tokens tokens of the target's tokenizer
and sent as a raw prompt to every engine, so each reads the same tokens. draftwise runs with prefix
caching off (a repeat would hit the cache) and its default weights; llama-server (--llama-server)
gets the token ids on its /completion endpoint with its prompt cache off. Each engine's best of
--repeats runs counts. Prints prompt tokens / time to first token per engine, and the ratio to
draftwise."""
from __future__ import annotations

import argparse
import json
import time

import torch

from draftwise import LLM, SamplingParams
from draftwise.bench.llama_server import LlamaServerPeer
from draftwise.bench.peers import make_peer
from draftwise.bench.run import peer_pythons
from draftwise.bench.step_cost import machine_line
from draftwise.models.loader import load_tokenizer, resolve_model_dir
from draftwise.training.data import is_heldout, iter_sharegpt, to_messages


def long_prompt(tokenizer, n_tokens: int) -> list[int]:
    """The first n_tokens tokens of held-out ShareGPT text (conversations joined)."""
    ids: list[int] = []
    for rec in iter_sharegpt():
        if not is_heldout(rec.get("id", "")):
            continue
        for m in to_messages(rec) or []:
            ids += tokenizer(m["content"] + "\n", add_special_tokens=False).input_ids
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise ValueError(f"the held-out ShareGPT split has fewer than {n_tokens} tokens")


def draftwise_ttft(model: str, ids: list[int], repeats: int) -> float:
    llm = LLM(model, enable_prefix_caching=False, speculative_config=None, max_model_len=max(2048, len(ids) + 16))
    sp = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": ids[:32]}], sp)                 # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], sp)
        best = min(best, time.perf_counter() - t0)
        if len(out[0].outputs[0].token_ids) != 1:        # a failed request returns at once: no timing
            raise RuntimeError(f"draftwise did not produce the token ({out[0].outputs[0].finish_reason})")
    return best


def peer_ttft(name: str, model: str, ids: list[int], repeats: int, openvino_model: str | None = None,
              python: dict | None = None) -> float:
    """A native peer's best time to first token over `ids` (its own process: peers.PeerProcess)."""
    peer = make_peer(name, model, 1, openvino_model, python)
    try:
        return peer.prefill(ids, repeats)
    finally:
        peer.close()


def llama_server_ttft(binary: str, model: str, ids: list[int], repeats: int, threads: int) -> float:
    """llama.cpp's own server's best time to first token over `ids` (started here on a free port
    with the same GGUF file and threads)."""
    server = LlamaServerPeer(binary, model, "", threads, max(2048, len(ids) + 16), 1)
    try:
        server.prefill(ids[:32], 1)                                      # warm-up
        return server.prefill(ids, repeats)
    finally:
        server.close()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peers", default="", help="comma list of openvino, llamacpp")
    p.add_argument("--openvino-model", default=None, help="an OpenVINO export (default: the model's GGUF file)")
    p.add_argument("--peer-python", default=None, help="NAME=PATH[,NAME=PATH]: the Python that has a peer")
    p.add_argument("--llama-server", default=None,
                   help="a llama-server binary (`draftwise bench build-peer --server`): adds its row")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    ids = long_prompt(load_tokenizer(resolve_model_dir(a.model)), a.tokens)
    times = {"draftwise": draftwise_ttft(a.model, ids, a.repeats)}
    for peer in filter(None, a.peers.split(",")):
        if peer not in ("openvino", "llamacpp"):
            raise SystemExit(f"unknown peer {peer!r} (openvino, llamacpp)")
        times[peer] = peer_ttft(peer, a.model, ids, a.repeats, a.openvino_model, peer_pythons(a))
    if a.llama_server:
        times["llama-server"] = llama_server_ttft(a.llama_server, a.model, ids, a.repeats, torch.get_num_threads())
    print(f"{machine_line()}; {torch.get_num_threads()} threads; prompt {len(ids)} tokens")
    out = {}
    for name, t in times.items():
        out[name] = {"ttft_s": round(t, 4), "prefill_tokens_per_s": round(len(ids) / t, 1),
                     "vs_draftwise": round(times["draftwise"] / t, 3)}
        print(f"{name:10s} {t * 1000:8.1f} ms  {len(ids) / t:8.1f} tok/s  speed vs draftwise {times['draftwise'] / t:.2f}x")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
