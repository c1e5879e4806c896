"""Prefill speed side by side: one long prompt, one new token, time to first token.

    python -m draftwise.bench.prefill --tokens 1000 --threads 2 --peers openvino,llamacpp \\
        --openvino-model ov-smollm2-int4

The prompt is ShareGPT text (the held-out split) cut to --tokens tokens of the target's tokenizer
and sent as a raw prompt to every engine, so each reads the same tokens. draftwise runs with prefix
caching off (a repeat would hit the cache) and its default weights; each engine's best of
--repeats runs counts. Prints prompt tokens / time to first token per engine, and the ratio to
draftwise."""
from __future__ import annotations

import argparse
import json
import time

import torch


def long_prompt(tokenizer, n_tokens: int) -> list[int]:
    """The first n_tokens tokens of held-out ShareGPT text (conversations joined)."""
    from draftwise.training.data import is_heldout, iter_sharegpt, to_messages
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
    from draftwise import LLM, SamplingParams
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


def openvino_ttft(model_dir: str, ids: list[int], repeats: int) -> float:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai
    from draftwise.bench.peers import OpenVINOPeer
    peer = OpenVINOPeer(model_dir, 1, prompt_lookup=False)       # the bench peer's pipeline and settings
    pipe, cfg = peer.pipe, peer.cfg

    def inputs(toks):
        t = ov.Tensor(np.array([toks], dtype=np.int64))
        return ov_genai.TokenizedInputs(t, ov.Tensor(np.ones((1, len(toks)), dtype=np.int64)))

    pipe.generate(inputs(ids[:32]), cfg)
    best = float("inf")
    for _ in range(repeats):
        res = pipe.generate(inputs(ids), cfg)
        best = min(best, res.perf_metrics.get_ttft().mean / 1000.0)
    return best


def llamacpp_ttft(gguf: str, ids: list[int], repeats: int) -> float:
    from llama_cpp import Llama
    n = torch.get_num_threads()
    llm = Llama(model_path=gguf, n_ctx=max(2048, len(ids) + 16), n_threads=n, n_threads_batch=n, verbose=False)
    best = float("inf")
    for _ in range(repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peers", default="", help="comma list of openvino, llamacpp")
    p.add_argument("--openvino-model", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from draftwise.bench.step_cost import machine_line
    from draftwise.models.loader import gguf_path_for, load_tokenizer, resolve_model_dir
    ids = long_prompt(load_tokenizer(resolve_model_dir(a.model)), a.tokens)
    times = {"draftwise": draftwise_ttft(a.model, ids, a.repeats)}
    for peer in filter(None, a.peers.split(",")):
        if peer == "openvino":
            if not a.openvino_model:
                raise SystemExit("--peers openvino needs --openvino-model DIR")
            times[peer] = openvino_ttft(a.openvino_model, ids, a.repeats)
        elif peer == "llamacpp":
            times[peer] = llamacpp_ttft(gguf_path_for(a.model) or a.model, ids,
                                        a.repeats)
        else:
            raise SystemExit(f"unknown peer {peer!r} (openvino, llamacpp)")
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
