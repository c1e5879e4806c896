"""Plain-decoding throughput of draftwise engine variants vs Hugging Face `transformers` generate,
side by side in one process. Each engine is built once; timed runs are interleaved round-robin
(`--rounds`) and the median is reported, because this machine's timings drift.

`python -m draftwise.bench.decode_speed [--batch-sizes 1,8] [--tokens 64] [--rounds 3]
    [--variants compiled,eager,transformers]`

Variants: compiled, eager, eager-async (async scheduling), compiled-async, int8, int4 (compiled,
quantized target), tp2 (tensor parallelism over 2 processes, eager), transformers."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftwise.models.loader import DEFAULT_MODEL
from draftwise import LLM, SamplingParams
from draftwise.models.loader import load_tokenizer, resolve_model_dir

PROMPTS = ["Write a short poem about the sea.", "Explain how a CPU cache works.",
           "Give three tips for learning a language.", "What is the capital of Australia?",
           "Summarise the plot of Hamlet.", "Describe a healthy breakfast.",
           "Why is the sky blue?", "List four prime numbers and explain why they are prime."]


def _messages(batch):
    return [[{"role": "user", "content": p}] for p in (PROMPTS * 4)[:batch]]


VARIANTS = {
    "compiled": {"enforce_eager": False, "quantization": None},
    "eager": {"enforce_eager": True, "quantization": None},
    "eager-async": {"enforce_eager": True, "async_scheduling": True, "quantization": None},
    "compiled-async": {"enforce_eager": False, "async_scheduling": True, "quantization": None},
    "int8": {"enforce_eager": False, "quantization": "int8"},
    "int4": {"enforce_eager": False, "quantization": "int4"},
    "tp2": {"enforce_eager": True, "tensor_parallel_size": 2, "quantization": None},
}


class DraftwiseRunner:
    def __init__(self, model: str, batch: int, tokens: int, **kw):
        t0 = time.perf_counter()
        self.llm = LLM(model, max_model_len=1024, max_num_seqs=batch, speculative_config=None, **kw)
        self.startup_s = time.perf_counter() - t0
        tok = self.llm.tokenizer
        self.prompts = ([self.llm.apply_chat_template(m) for m in _messages(batch)] if tok is not None
                        else [{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(batch)])
        self.sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        self.llm.generate(self.prompts[:1], SamplingParams(temperature=0, max_tokens=4))

    def __call__(self) -> float:
        t0 = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.sp)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


class HFRunner:
    def __init__(self, model: str, batch: int, tokens: int):
        from transformers import AutoModelForCausalLM
        path = resolve_model_dir(model)
        self.hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = load_tokenizer(path)
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in _messages(batch)]
        self.enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        self.batch, self.tokens = batch, tokens
        with torch.inference_mode():
            self.hf.generate(**self.enc, max_new_tokens=2, do_sample=False)

    def __call__(self) -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.hf.generate(**self.enc, max_new_tokens=self.tokens, min_new_tokens=self.tokens,
                                   do_sample=False)
            dt = time.perf_counter() - t0
        return (out.shape[1] - self.enc.input_ids.shape[1]) * self.batch / dt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variants", default="compiled,eager,transformers")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    names = a.variants.split(",")
    bad = [n for n in names if n not in VARIANTS and n != "transformers"]
    if bad:
        raise SystemExit(f"unknown variants {bad}; known: {', '.join(list(VARIANTS) + ['transformers'])}")
    base = names[-1] if "transformers" not in names else "transformers"
    print("| batch | " + " | ".join(f"{n} tok/s" for n in names) + " | " +
          " | ".join(f"{n} / {base}" for n in names if n != base) + " |")
    print("|---|" + "---|" * (2 * len(names) - 1))
    for b in [int(x) for x in a.batch_sizes.split(",")]:
        runners = {n: (HFRunner(a.model, b, a.tokens) if n == "transformers"
                       else DraftwiseRunner(a.model, b, a.tokens, **VARIANTS[n])) for n in names}
        res = {k: [] for k in runners}
        for _ in range(a.rounds):
            for k, run in runners.items():
                res[k].append(run())
        med = {k: statistics.median(v) for k, v in res.items()}
        print(f"| {b} | " + " | ".join(f"{med[n]:.1f}" for n in names) + " | " +
              " | ".join(f"{med[n] / med[base]:.2f}x" for n in names if n != base) + " |", flush=True)
        for run in runners.values():
            if hasattr(run, "llm"):
                run.llm.shutdown()
        del runners


if __name__ == "__main__":
    main()
