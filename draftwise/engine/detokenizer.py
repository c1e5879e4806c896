"""Incremental detokenization: each output token is turned into text once, in O(1) per token.

Decoding the whole output at every step is quadratic in its length, and its text can change
behind the end (a multi-byte character completed by a later token), so a stream cut from it
repeats text. `IncrementalDetokenizer` wraps the tokenizers library's streaming decoder
(`tokenizers.decoders.DecodeStream`), which keeps a small window of pending tokens and returns
text only once it is final: appended text never changes. Tokenizers without a Rust backend
(slow Python tokenizers) get the same contract from a prefix/read-offset window (the scheme vLLM's
incremental detokenizer uses)."""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None) or getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []          # window fallback: tokens seen
        self._prefix = 0                   # fallback: start of the context window
        self._read = 0                     # fallback: tokens whose text has been emitted

    def add(self, token_ids: list[int]) -> str:
        """Text that `token_ids` (the next output tokens) complete; never revised later."""
        if self._stream is not None:
            parts = []
            for t in token_ids:
                piece = self._stream.step(self._backend, t)
                if piece:
                    parts.append(piece)
            return "".join(parts)
        return "".join(self._add_window(t) for t in token_ids)

    def _add_window(self, token_id: int) -> str:
        self._ids.append(token_id)
        dec = self.tokenizer.decode
        kw = {"skip_special_tokens": self.skip_special_tokens}
        before = dec(self._ids[self._prefix:self._read], **kw)
        after = dec(self._ids[self._prefix:], **kw)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before):]
        return ""
