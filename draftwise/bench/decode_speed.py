"""Decode throughput of draftwise vs Hugging Face `transformers` generate, side by side in one run
(batch 1 and 8 by default). `python -m draftwise.bench.decode_speed [--batch-sizes 1,8] [--tokens 64]`"""
from __future__ import annotations

import argparse
import time

import torch

from draftwise.models.loader import DEFAULT_MODEL

PROMPTS = ["Write a short poem about the sea.", "Explain how a CPU cache works.",
           "Give three tips for learning a language.", "What is the capital of Australia?",
           "Summarise the plot of Hamlet.", "Describe a healthy breakfast.",
           "Why is the sky blue?", "List four prime numbers and explain why they are prime."]


def draftwise_tps(model: str, batch: int, tokens: int) -> float:
    from draftwise import LLM, SamplingParams
    llm = LLM(model, max_model_len=1024, max_num_seqs=batch)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in (PROMPTS * 4)[:batch]]
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def hf_tps(model: str, batch: int, tokens: int) -> float:
    from transformers import AutoModelForCausalLM
    from draftwise.models.loader import load_tokenizer, resolve_model_dir
    path = resolve_model_dir(model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = load_tokenizer(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in (PROMPTS * 4)[:batch]]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        hf.generate(**enc, max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        out = hf.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        dt = time.perf_counter() - t0
    return (out.shape[1] - enc.input_ids.shape[1]) * batch / dt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args(argv)
    print("| batch | draftwise tokens/s | transformers tokens/s | ratio |\n|---|---|---|---|")
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        d, h = draftwise_tps(a.model, b, a.tokens), hf_tps(a.model, b, a.tokens)
        print(f"| {b} | {d:.1f} | {h:.1f} | {d / h:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
