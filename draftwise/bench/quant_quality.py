"""Quality of the quantized targets: perplexity on held-out text and greedy agreement with fp32.

    python -m draftwise.bench.quant_quality --modes none,int8,int4,int4:float32 --conversations 32

A mode is the weights (none = fp32, int8, int4), optionally `:` the KV-cache dtype (float32,
bfloat16, float16; default: what the engine picks for those weights).

Perplexity: teacher-forced negative log-likelihood of the assistant tokens of held-out ShareGPT
conversations (the 2 % split the trainers never see), chat-templated, cut to --max-len tokens, fed in
chunks of --chunk tokens so the quantized kernels (used up to 32 rows: decode, verification) are
what is measured; `--chunk 512 --prompts 0` measures the long-prefill path instead (chunks over 32
rows run on the weights rounded to bf16).
Agreement: greedy continuations of MT-bench first turns, compared with fp32 token by token
(`prefix`: fraction of tokens before the first difference; `identical`: whole outputs equal)."""
from __future__ import annotations

import argparse
import json
import math

import torch

from draftwise import LLM, SamplingParams
from draftwise.bench.datasets import load_prompts
from draftwise.layers.attention import AttentionMetadata, CAUSAL
from draftwise.training.data import iter_examples
from draftwise.worker.kv_cache import KVCache


def heldout_examples(tokenizer, n: int, max_len: int):
    """(token ids, assistant mask) of the first n held-out ShareGPT conversations."""
    return [(ex.input_ids, ex.loss_mask) for _, ex in zip(range(n), iter_examples(tokenizer, None, "heldout", max_len))]


@torch.inference_mode()
def chunked_logits(model, ids: list[int], chunk: int, kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of every row, the sequence fed `chunk` tokens at a time through a paged KV cache."""
    cfg, bs = model.config, 16
    nblocks = -(-len(ids) // bs)
    cache = KVCache(nblocks, bs, [(cfg.num_key_value_heads, cfg.head_dim)] * cfg.num_hidden_layers,
                    kv_dtype, "cpu")
    bt = torch.arange(nblocks)[None]
    out = []
    for a in range(0, len(ids), chunk):
        b = min(len(ids), a + chunk)
        pos = torch.arange(a, b)
        meta = AttentionMetadata(pos.clone(), [b - a], [b], bt, bs, CAUSAL).finalize()
        out.append(model(torch.tensor(ids[a:b]), pos, meta, cache, torch.arange(b - a)).logits)
    return torch.cat(out)


@torch.inference_mode()
def perplexity(model, examples, chunk: int = 16, kv_dtype: torch.dtype = torch.float32) -> float:
    nll, n = 0.0, 0
    for ids, mask in examples:
        logits = chunked_logits(model, ids, chunk, kv_dtype)
        lp = torch.log_softmax(logits[:-1].float(), -1)
        tgt = torch.tensor(ids[1:])
        m = torch.tensor(mask[1:]).bool()
        nll -= float(lp[torch.arange(len(tgt)), tgt][m].sum())
        n += int(m.sum())
    return math.exp(nll / n)


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = total = 0
    for a, b in zip(ref, got):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        same += k
        total += len(a)
    return {"prefix": round(same / total, 4), "identical": sum(a == b for a, b in zip(ref, got)), "of": len(ref)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--modes", default="none,int8,int4")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--chunk", type=int, default=16, help="tokens per forward when scoring")
    p.add_argument("--dataset", default=None,
                   help="prompts (a JSONL such as MT-bench's question.jsonl) for the greedy agreement check")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.prompts > 0 and not a.dataset:
        p.error("--dataset PATH is needed for the greedy agreement check (or --prompts 0: perplexity only)")
    if a.threads:
        torch.set_num_threads(a.threads)
    # --prompts 0: perplexity only
    convs = load_prompts(a.dataset, None)[::max(1, 80 // a.prompts)][:a.prompts] if a.prompts > 0 else []
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    results, ref = {}, None
    for mode in a.modes.split(","):
        weights, _, kv = mode.partition(":")
        q = None if weights == "none" else weights
        llm = LLM(a.model, quantization=q, speculative_config=None, enforce_eager=True, max_model_len=1024,
                  kv_cache_dtype=kv or "auto")
        outs = [o.outputs[0].token_ids for o in llm.chat([[{"role": "user", "content": c[0]}] for c in convs], sp)] \
            if convs else []
        ex = heldout_examples(llm.tokenizer, a.conversations, a.max_len)
        kv_dtype = llm.engine.config.kv_torch_dtype
        ppl = perplexity(llm.engine.worker.model, ex, a.chunk, kv_dtype)
        r = {"perplexity": round(ppl, 3), "kv_cache_dtype": str(kv_dtype).replace("torch.", "")}
        if ref is None:
            ref = outs
        elif convs:
            r["greedy_agreement_with_" + a.modes.split(",")[0]] = agreement(ref, outs)
        results[mode] = r
        print(mode, json.dumps(r), flush=True)
    return results


if __name__ == "__main__":
    main()
