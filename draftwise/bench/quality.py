"""`draftwise bench quality`: perplexity of draftwise and of llama.cpp on the same GGUF file over the
same held-out text - the check that running a file on its own blocks loses nothing against the
reference engine for that format.

    draftwise bench quality --model FILE.gguf [--conversations 16] [--min-tokens 16384] [--context 1024]

The text: held-out ShareGPT conversations (the 2 % split the drafter trainers never see), rendered
with the model's chat template, each cut to --context tokens, taken in order until there are at
least --conversations of them and --min-tokens tokens. Each conversation is scored alone, every
token after the first, with its own preceding tokens as context (so the context is at most
--context). draftwise feeds it through its model in chunks of --chunk tokens (the kernels a
server runs); llama.cpp (llama-cpp-python, when installed) evaluates the same token ids with all
logits kept. Both report exp(mean negative log-likelihood) over the same tokens."""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from draftwise import LLM
from draftwise.bench.quant_quality import chunked_logits
from draftwise.config import cache_dir
from draftwise.models.gguf_convert import gguf_metadata_dir
from draftwise.models.loader import gguf_path_for, load_tokenizer
from draftwise.training.data import is_heldout, iter_examples, iter_sharegpt, to_messages


def heldout_token_ids(tokenizer, conversations: int, min_tokens: int, context: int) -> list[list[int]]:
    """Held-out ShareGPT conversations as token ids: through the chat template, or for a base
    model without one (Gemma 3 270M) as plain text, the turns one paragraph each, with the special
    tokens the tokenizer adds (its BOS)."""
    if getattr(tokenizer, "chat_template", None):
        seqs = (list(ex.input_ids) for ex in iter_examples(tokenizer, None, "heldout", context))
    else:
        msgs = (to_messages(r) for r in iter_sharegpt(None) if is_heldout(r.get("id", ""), 0.02))
        seqs = (tokenizer("\n\n".join(m["content"] for m in ms)).input_ids[:context] for ms in msgs if ms)
    out, total = [], 0
    for ids in seqs:
        out.append(ids)
        total += len(ids)
        if len(out) >= conversations and total >= min_tokens:
            break
    return out


def nll_of(logits: torch.Tensor, ids: list[int]) -> float:
    """Summed negative log-likelihood of ids[1:] under logits[:-1] (rows: positions)."""
    lp = torch.log_softmax(logits[:-1].double(), -1)
    return -float(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())


def draftwise_nll(model: str, seqs: list[list[int]], chunk: int, context: int) -> tuple[float, float]:
    llm = LLM(model, speculative_config=None, max_model_len=context + 16)
    kv = llm.engine.config.kv_torch_dtype
    t0, nll = time.perf_counter(), 0.0
    for ids in seqs:
        nll += nll_of(chunked_logits(llm.engine.worker.model, ids, chunk, kv), ids)
    return nll, time.perf_counter() - t0


def llamacpp_nll(path: str, seqs: list[list[int]], context: int, threads: int | None) -> tuple[float, float]:
    import numpy as np
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=context + 16, logits_all=True, verbose=False,
                n_threads=threads or torch.get_num_threads(), n_batch=512)
    t0, nll = time.perf_counter(), 0.0
    for ids in seqs:
        llm.reset()
        llm.eval(ids)
        logits = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
        nll += nll_of(logits, ids)
    return nll, time.perf_counter() - t0


def main(argv=None) -> dict:
    import importlib.util
    p = argparse.ArgumentParser(prog="draftwise bench quality", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file or a packaged model name")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=16384)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=64, help="tokens per draftwise forward")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    path = gguf_path_for(a.model)
    if path is None:
        raise ValueError(f"bench quality compares engines on one GGUF file: {a.model!r} is none")
    tok = load_tokenizer(gguf_metadata_dir(path, cache_dir()))
    if tok is None:
        raise ValueError(f"{path}: no tokenizer could be read from the file")
    seqs = heldout_token_ids(tok, a.conversations, a.min_tokens, a.context)
    scored = sum(len(s) - 1 for s in seqs)
    rows = {}
    nll, secs = draftwise_nll(a.model, seqs, a.chunk, a.context)
    rows["draftwise"] = {"perplexity": math.exp(nll / scored), "seconds": secs}
    if importlib.util.find_spec("llama_cpp") is not None:
        nll, secs = llamacpp_nll(path, seqs, a.context, a.threads)
        rows["llama.cpp"] = {"perplexity": math.exp(nll / scored), "seconds": secs}
    ref = rows.get("llama.cpp", rows["draftwise"])["perplexity"]
    print(f"{path}: {len(seqs)} held-out conversations, {scored} scored tokens, context <= {a.context}")
    print("| engine | perplexity | vs llama.cpp | seconds |\n|---|---|---|---|")
    for name, r in rows.items():
        r["vs_llamacpp"] = r["perplexity"] / ref - 1.0
        print(f"| {name} | {r['perplexity']:.4f} | {100 * r['vs_llamacpp']:+.2f} % | {r['seconds']:.1f} |")
    result = {"model": path, "conversations": len(seqs), "tokens": scored, "context": a.context, "engines": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return result
