"""Peer engines for `draftwise bench`, run on the same weights and prompts when installed:
Hugging Face transformers `generate` (plain and prompt lookup), llama.cpp via llama-cpp-python
(plain and its prompt-lookup drafting) on the same GGUF, and OpenVINO GenAI's `LLMPipeline` on the
CPU (plain and prompt lookup) over an OpenVINO model exported from the same dequantized weights
(`python -m draftwise.bench.openvino_export`, in an environment with optimum-intel).

A peer answers one conversation at a time and reports (text, token ids, PeerTiming): its time to
first token and the prompt tokens it read, so the bench reports decode speed and time to first
token apart, as it does for draftwise's own rows."""
from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass

import torch


@dataclass
class PeerTiming:
    ttft_s: float | None           # request start -> first token (None: the peer does not say)
    total_s: float                 # request start -> last token
    prompt_tokens: int | None = None


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
        from transformers.generation.streamers import BaseStreamer

        class FirstToken(BaseStreamer):          # generate() puts the prompt first, then each new token
            calls, at = 0, None

            def put(self, value):
                self.calls += 1
                if self.calls == 2:
                    self.at = time.perf_counter()

            def end(self):
                pass

        first = FirstToken()
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.max_tokens,
                                  do_sample=False, eos_token_id=self.tok.eos_token_id,
                                  pad_token_id=self.tok.eos_token_id, streamer=None if self.pld else first, **kw)
        total = time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        ttft = None if first.at is None else first.at - t0
        return self.tok.decode(new, skip_special_tokens=True), new, PeerTiming(ttft, total, ids.shape[1])


class LlamaCppPeer:
    def __init__(self, model: str, max_tokens: int, prompt_lookup: bool):
        if importlib.util.find_spec("llama_cpp") is None:
            raise ImportError("llama-cpp-python is not installed")
        from llama_cpp import Llama
        from draftwise.models.loader import gguf_path_for
        path = gguf_path_for(model) or model
        if not path.endswith(".gguf"):
            raise ValueError("llama.cpp peer needs a GGUF model")
        kw = {}
        if prompt_lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=5)
        n = torch.get_num_threads()          # the same threads as the draftwise methods of the run
        # logits_all with the prompt-lookup draft model: without it the peer fails on long prompts
        self.llm = Llama(model_path=path, n_ctx=4096, n_threads=n, n_threads_batch=n, verbose=False,
                         logits_all=prompt_lookup, **kw)
        self.max_tokens = max_tokens
        # a base model (no chat template in the file) continues plain text, as the engine's methods
        self.chat = "tokenizer.chat_template" in self.llm.metadata

    def generate(self, messages):
        from draftwise.inputs import conversation_prompt
        t0, first, parts = time.perf_counter(), None, []
        if self.chat:
            stream = self.llm.create_chat_completion(messages=messages, max_tokens=self.max_tokens, temperature=0.0,
                                                     stream=True)
        else:
            stream = self.llm.create_completion(conversation_prompt(None, messages), max_tokens=self.max_tokens,
                                                temperature=0.0, stream=True)
        for chunk in stream:
            choice = chunk["choices"][0]
            piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if piece:
                first = first or time.perf_counter()
                parts.append(piece)
        text = "".join(parts)
        ids = self.llm.tokenize(text.encode(), add_bos=False, special=False)
        return text, ids, PeerTiming(None if first is None else first - t0, time.perf_counter() - t0)


class OpenVINOPeer:
    """OpenVINO GenAI LLMPipeline on the CPU: greedy, prefix caching off, INFERENCE_NUM_THREADS =
    the run's threads; `prompt_lookup` adds its prompt-lookup drafting (5 tokens, n-grams up to 3)."""

    def __init__(self, model_dir: str | None, max_tokens: int, prompt_lookup: bool):
        if importlib.util.find_spec("openvino_genai") is None:
            raise ImportError("openvino-genai is not installed (pip install openvino-genai)")
        if not model_dir or not os.path.exists(os.path.join(model_dir, "openvino_model.xml")):
            raise ValueError("the openvino peers need --openvino-model DIR: an OpenVINO model exported from the same "
                             "weights (python -m draftwise.bench.openvino_export --help)")
        import openvino_genai as ov_genai
        props = {"INFERENCE_NUM_THREADS": torch.get_num_threads()}
        if prompt_lookup:
            props["prompt_lookup"] = True
        scheduler = ov_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        self.pipe = ov_genai.LLMPipeline(model_dir, "CPU", scheduler_config=scheduler, **props)
        self.tok = self.pipe.get_tokenizer()
        self.cfg = ov_genai.GenerationConfig()
        self.cfg.max_new_tokens, self.cfg.do_sample = max_tokens, False
        if prompt_lookup:
            self.cfg.num_assistant_tokens, self.cfg.max_ngram_size = 5, 3
        self.weights = _openvino_weight_format(model_dir)

    def generate(self, messages):
        prompt = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        enc = self.tok.encode(prompt, add_special_tokens=False)
        t0 = time.perf_counter()
        res = self.pipe.generate(enc, self.cfg)
        total = time.perf_counter() - t0
        ids = [int(t) for t in res.tokens[0]]
        eos = self.tok.get_eos_token_id()
        if ids and ids[-1] == eos:
            ids = ids[:-1]
        pm = res.perf_metrics
        return (self.tok.decode(ids, skip_special_tokens=True), ids,
                PeerTiming(pm.get_ttft().mean / 1000.0, total, int(pm.get_num_input_tokens())))


def _openvino_weight_format(model_dir: str) -> str:
    """What the exported model's weights are, as the export recorded it."""
    try:
        with open(os.path.join(model_dir, "draftwise_export.json")) as f:
            return json.load(f)["weights"]
    except (OSError, ValueError, KeyError):
        return "unknown"


def make_peer(name: str, model: str, max_tokens: int, openvino_model: str | None = None):
    if name in ("hf", "hf-pld"):
        return HFPeer(model, max_tokens, name == "hf-pld")
    if name in ("llamacpp", "llamacpp-pld"):
        return LlamaCppPeer(model, max_tokens, name == "llamacpp-pld")
    if name in ("openvino", "openvino-pld"):
        return OpenVINOPeer(openvino_model, max_tokens, name == "openvino-pld")
    raise ValueError(f"unknown peer {name!r}")
