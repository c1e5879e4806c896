"""Peer engines for `draftwise bench`, run on the same weights and prompts when installed:
Hugging Face transformers `generate` (plain and prompt lookup) and llama.cpp via llama-cpp-python
(plain and its prompt-lookup drafting) on the same GGUF."""
from __future__ import annotations

import importlib.util

import torch


class HFPeer:
    def __init__(self, model: str, max_tokens: int, prompt_lookup: bool):
        from transformers import AutoModelForCausalLM
        from draftwise.models.loader import load_tokenizer, resolve_model_dir
        path = resolve_model_dir(model)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tok = load_tokenizer(path)
        if self.tok is None:
            raise ValueError("transformers peer needs a tokenizer")
        self.max_tokens = max_tokens
        self.pld = prompt_lookup

    @torch.inference_mode()
    def generate(self, messages):
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([self.tok(text, add_special_tokens=False).input_ids])
        kw = {"prompt_lookup_num_tokens": 5} if self.pld else {}
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_tokens,
                                  do_sample=False, eos_token_id=self.tok.eos_token_id,
                                  pad_token_id=self.tok.eos_token_id, **kw)
        new = out[0, ids.shape[1]:].tolist()
        return self.tok.decode(new, skip_special_tokens=True), new


class LlamaCppPeer:
    def __init__(self, model: str, max_tokens: int, prompt_lookup: bool):
        if importlib.util.find_spec("llama_cpp") is None:
            raise ImportError("llama-cpp-python is not installed")
        from llama_cpp import Llama
        from draftwise.models.loader import PACKAGED_GGUF, find_packaged_gguf
        path = find_packaged_gguf(model) if model in PACKAGED_GGUF else model
        if not path.endswith(".gguf"):
            raise ValueError("llama.cpp peer needs a GGUF model")
        kw = {}
        if prompt_lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=5)
        n = torch.get_num_threads()          # the same threads as the draftwise methods of the run
        self.llm = Llama(model_path=path, n_ctx=4096, n_threads=n, n_threads_batch=n, verbose=False, **kw)
        self.max_tokens = max_tokens

    def generate(self, messages):
        out = self.llm.create_chat_completion(messages=messages, max_tokens=self.max_tokens, temperature=0.0)
        text = out["choices"][0]["message"]["content"] or ""
        ids = self.llm.tokenize(text.encode(), add_bos=False, special=False)
        return text, ids


def make_peer(name: str, model: str, max_tokens: int):
    if name in ("hf", "hf-pld"):
        return HFPeer(model, max_tokens, name == "hf-pld")
    if name in ("llamacpp", "llamacpp-pld"):
        return LlamaCppPeer(model, max_tokens, name == "llamacpp-pld")
    raise ValueError(f"unknown peer {name!r}")
