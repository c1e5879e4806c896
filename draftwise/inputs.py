"""Prompts as the engine takes them: text, token ids, or chat messages through the model's chat
template. Free functions of a tokenizer, shared by the engine, `LLM` and the HTTP front end (which
may run without the model's weights)."""
from __future__ import annotations

import os


def tokenize_prompt(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) of a string, a list of token ids, or a dict with
    'prompt_token_ids' (and optionally the 'prompt' text they came from) or 'prompt'."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    if not isinstance(prompt, str):
        raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
    # the special tokens the model's tokenizer adds (Gemma's BOS; SmolLM2 and Qwen add none), as
    # llama.cpp and vLLM's completions do; a chat template that writes BOS itself is not doubled
    ids = tokenizer(prompt, add_special_tokens=True).input_ids
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return prompt, ids


NO_CHAT_TEMPLATE = ("this model has no chat template: send a completion (a plain prompt), or supply a "
                    "template with --chat-template FILE (chat_template= in the Python API)")


def read_chat_template(value: str) -> str:
    """A chat template given as vLLM's --chat-template takes it: the path of a Jinja file, or the
    template itself (text holding '{{' or '{%')."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    if not text.strip():
        raise ValueError(f"chat_template {value!r} is empty")
    return text


def set_chat_template(tokenizer, template: str | None) -> None:
    """Give the tokenizer the user's chat template (read_chat_template's text), in place of its own."""
    if template is None:
        return
    if tokenizer is None:
        raise ValueError("chat_template needs the model's tokenizer, and this model has none")
    tokenizer.chat_template = template


def apply_chat_template(tokenizer, messages, add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation (a non-empty list of {'role', 'content'} dicts)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(NO_CHAT_TEMPLATE)
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def conversation_prompt(tokenizer, messages) -> str:
    """A conversation as the model takes it: through its chat template, or for a base model
    without one (Gemma 3 270M) as plain text, one paragraph per turn, the answer to continue."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return apply_chat_template(tokenizer, messages)
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    return "\n\n".join(str(m.get("content", "")) for m in messages) + "\n\n"
