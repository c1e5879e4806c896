"""Incremental detokenization: the concatenated pieces equal a full decode, a piece is never
revised (multi-byte characters split across tokens come out once, whole), and the engine's
streamed `new_text` adds up to the final text."""
import pytest

from draftwise.engine.detokenizer import IncrementalDetokenizer


def _byte_level_tokenizer():
    """A byte-level BPE tokenizer with every byte a token of its own (so 'é' is two tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("fast", [True, False])
def test_pieces_add_up_and_multibyte_characters_come_out_once(fast):
    tok = _byte_level_tokenizer()
    text = "naïve café — 日本語 ok 🙂!"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text.encode("utf-8"))            # one token per byte
    det = IncrementalDetokenizer(tok)
    if not fast:
        det._stream = None                                   # the window fallback
    pieces = [det.add([t]) for t in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)           # nothing emitted half-way
    assert sum(1 for p in pieces if p) < len(ids)           # partial characters held back


def test_engine_stream_text_is_linear_and_never_repeats(tiny_llama, tmp_path):
    import shutil

    from draftwise import LLM, SamplingParams
    from tests.tokenizer_util import add_tiny_tokenizer
    path, _ = tiny_llama
    d = str(tmp_path / "m")
    shutil.copytree(path, d)
    add_tiny_tokenizer(d)
    llm = LLM(d, block_size=4, max_model_len=128, speculative_config={"method": "ngram",
                                                                      "num_speculative_tokens": 3})
    engine = llm.engine
    rid = engine.add_request({"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8]},
                             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == rid
            streamed += o.new_text
            final = o
    comp = final.outputs[0]
    assert streamed == comp.text == engine.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
