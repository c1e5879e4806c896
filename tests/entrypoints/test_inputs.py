"""Prompts as the engine takes them: a text prompt gets the special tokens its tokenizer adds
(Gemma's BOS) but never a doubled BOS from a chat template that writes it; a model without a chat
template continues a conversation as plain text."""
import pytest

from draftwise.inputs import conversation_prompt, tokenize_prompt


class Tok:
    """A character tokenizer that adds BOS (id 1) as Gemma's does; '#' in text is that BOS."""
    bos_token_id = 1
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        ids = [1 if c == "#" else ord(c) for c in text]
        return type("Enc", (), {"input_ids": ([1] if add_special_tokens else []) + ids})()


def test_text_prompts_get_one_bos():
    tok = Tok()
    assert tokenize_prompt(tok, "ab")[1] == [1, ord("a"), ord("b")]
    assert tokenize_prompt(tok, "#ab")[1] == [1, ord("a"), ord("b")]     # a template's own BOS kept once
    assert tokenize_prompt(tok, {"prompt_token_ids": [5, 6]})[1] == [5, 6]


def test_base_models_continue_plain_text():
    msgs = [{"role": "user", "content": "def f():"}, {"role": "assistant", "content": "pass"},
            {"role": "user", "content": "again"}]
    assert conversation_prompt(Tok(), msgs) == "def f():\n\npass\n\nagain\n\n"
    with pytest.raises(ValueError):
        conversation_prompt(Tok(), [])
