"""A tiny Hugging Face tokenizer (vocabulary of exactly 256 ids, ChatML chat template) for the tiny
test models of conftest.make_tiny_hf, which ship without one.

    add_tiny_tokenizer(model_dir)   # writes tokenizer.json / tokenizer_config.json into model_dir

Ids 0, 1, 2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (so the tiny models' pad=0, bos=1,
eos=2 line up with them, as in SmolLM2); every other id decodes to a printable piece, so whatever
a random model samples detokenizes to non-empty ASCII text.
"""
from __future__ import annotations

import string

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and the target model verifies them in one step.",
    "A paged key value cache stores attention state in fixed size blocks.",
    "Hello world! How are you today? I am fine, thank you.",
    "Continuous batching lets new requests join the running batch at every step.",
    "Once upon a time there was a small model that wanted to speak quickly.",
    "The server streams tokens to many clients at the same time.",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 and 42 or 2024 appear in text too.",
    "What is the capital of France? Paris is the capital of France.",
    "Write a short poem about the sea, the wind and the stars at night.",
]


def build_tiny_tokenizer(vocab_size: int = 256):
    """A `transformers.PreTrainedTokenizerFast` with exactly `vocab_size` ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    alphabet = sorted(set(string.ascii_letters + string.digits + string.punctuation) | {"\u2581", "\n"})
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, min_frequency=1, show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    n = tok.get_vocab_size()
    if n != vocab_size:
        raise RuntimeError(f"tiny tokenizer has {n} ids, expected {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE)


def add_tiny_tokenizer(model_dir: str, vocab_size: int = 256):
    """Save the tiny tokenizer into `model_dir` (next to a tiny model's config.json); returns it."""
    tok = build_tiny_tokenizer(vocab_size)
    tok.save_pretrained(model_dir)
    return tok
