"""A bench peer engine in a child process: llama.cpp (llama-cpp-python) or OpenVINO GenAI.

    python peer_worker.py        (started by draftwise.bench.peers.PeerProcess, never by hand)

This file imports nothing from draftwise (nor torch): it runs under whatever Python has the peer's
library - OpenVINO GenAI lives in an environment of its own - and a peer that crashes (a native
build that segfaults) ends this process only; the bench reports the crash as that peer's row.

Protocol, one JSON object per line. stdin: first the configuration
    {"peer": "llamacpp" | "llamacpp-pld" | "openvino" | "openvino-pld", "model": PATH,
     "max_tokens": N, "threads": T, "max_num_seqs": B, "ignore_eos": bool}
then requests
    {"op": "generate", "prompts": [{"messages": [...], "text": "..."}, ...]}
    {"op": "prefill", "token_ids": [...], "repeats": R}
stdout: {"started": true} at once, {"ready": true, "weights": ...} once loaded, then one reply per request
    generate: {"results": [{"text", "ids", "ttft_s", "total_s", "prompt_tokens"[, "num_tokens"]}, ...],
               "wall_s"}  (num_tokens: generated tokens where the re-encoded ids may differ)
    prefill:  {"ttft_s": best seconds to the first token}
and {"error": "..."} for a request the peer refused. A prompt's "messages" are used where the
model has a chat template, its "text" (the conversation as plain text) where it has none.

- llama.cpp answers one prompt at a time (llama-cpp-python has no batched server loop); its
  prompt-lookup variant drafts 5 tokens. Threads: T for decode and prefill.
- OpenVINO GenAI's LLMPipeline reads the model directory (an export) or the GGUF file itself;
  with B > 1 it runs its continuous-batching scheduler over all prompts of a request at once
  (max_num_seqs = B), prefix caching off; greedy; INFERENCE_NUM_THREADS = T.
"""
from __future__ import annotations

import json
import os
import sys
import time


# replies go to the original stdout; fd 1 itself is pointed at stderr, so whatever the native
# libraries print cannot corrupt the protocol
_PROTOCOL = None


def _send(obj) -> None:
    global _PROTOCOL
    if _PROTOCOL is None:
        _PROTOCOL = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    _PROTOCOL.write(json.dumps(obj) + "\n")
    _PROTOCOL.flush()


class LlamaCpp:
    def __init__(self, cfg: dict):
        from llama_cpp import Llama
        path, pld = cfg["model"], cfg["peer"] == "llamacpp-pld"
        if not path.endswith(".gguf"):
            raise ValueError(f"the llama.cpp peer needs a GGUF file, got {path!r}")
        kw = {}
        if pld:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=5)
        n = cfg["threads"]
        # logits_all with the prompt-lookup draft model: without it the peer fails on long prompts
        self.llm = Llama(model_path=path, n_ctx=4096, n_threads=n, n_threads_batch=n, verbose=False,
                         logits_all=pld, **kw)
        self.max_tokens = cfg["max_tokens"]
        self.ignore_eos = cfg.get("ignore_eos", False)
        self.chat = "tokenizer.chat_template" in self.llm.metadata
        self.weights = "gguf"

    def generate(self, prompts: list[dict]) -> list[dict]:
        return [self._one(p) for p in prompts]

    def _one(self, prompt: dict) -> dict:
        t0, first, parts = time.perf_counter(), None, []
        kw = {"logit_bias": {self.llm.token_eos(): -1e9}} if self.ignore_eos else {}
        if self.chat:
            stream = self.llm.create_chat_completion(messages=prompt["messages"], max_tokens=self.max_tokens,
                                                     temperature=0.0, stream=True, **kw)
        else:
            stream = self.llm.create_completion(prompt["text"], max_tokens=self.max_tokens, temperature=0.0,
                                                stream=True, **kw)
        for chunk in stream:
            choice = chunk["choices"][0]
            piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if piece:
                first = first or time.perf_counter()
                parts.append(piece)
        total = time.perf_counter() - t0
        text = "".join(parts)
        ids = self.llm.tokenize(text.encode(), add_bos=False, special=False)
        return {"text": text, "ids": ids, "ttft_s": None if first is None else first - t0, "total_s": total,
                "prompt_tokens": None}

    def prefill(self, ids: list[int], repeats: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            self.llm.reset()
            t0 = time.perf_counter()
            self.llm.eval(ids)
            best = min(best, time.perf_counter() - t0)
        return best


class OpenVINO:
    def __init__(self, cfg: dict):
        import openvino_genai as ov_genai
        self.ov_genai = ov_genai
        path, pld = cfg["model"], cfg["peer"] == "openvino-pld"
        if not (path.endswith(".gguf") or os.path.exists(os.path.join(path, "openvino_model.xml"))):
            raise ValueError(f"the OpenVINO peers need a GGUF file or an exported model directory, got {path!r}")
        props = {"INFERENCE_NUM_THREADS": cfg["threads"]}
        if pld:
            props["prompt_lookup"] = True
        sched = ov_genai.SchedulerConfig()
        sched.enable_prefix_caching = False
        sched.max_num_seqs = max(1, cfg.get("max_num_seqs", 1))
        sched.cache_size = 1                               # GB of KV cache
        self.pipe = ov_genai.LLMPipeline(path, "CPU", scheduler_config=sched, **props)
        self.tok = self.pipe.get_tokenizer()
        self.cfg = ov_genai.GenerationConfig()
        self.cfg.max_new_tokens, self.cfg.do_sample = cfg["max_tokens"], False
        self.cfg.ignore_eos = bool(cfg.get("ignore_eos", False))
        if pld:
            self.cfg.num_assistant_tokens, self.cfg.max_ngram_size = 5, 3
        self.weights = _export_weights(path)
        try:
            self.chat = bool(self.tok.get_chat_template())
        except Exception:                                  # noqa: BLE001 - older tokenizers
            self.chat = True

    def _render(self, prompt: dict) -> str:
        if self.chat:
            return self.tok.apply_chat_template(prompt["messages"], add_generation_prompt=True)
        return prompt["text"]

    def generate(self, prompts: list[dict]) -> list[dict]:
        texts = [self._render(p) for p in prompts]
        t0 = time.perf_counter()
        if len(texts) == 1:
            enc = self.tok.encode(texts[0], add_special_tokens=not self.chat)
            res = self.pipe.generate(enc, self.cfg)
            total = time.perf_counter() - t0
            ids = [int(t) for t in res.tokens[0]]
            eos = self.tok.get_eos_token_id()
            if ids and ids[-1] == eos and not self.cfg.ignore_eos:
                ids = ids[:-1]
            pm = res.perf_metrics
            return [{"text": self.tok.decode(ids, skip_special_tokens=True), "ids": ids,
                     "ttft_s": pm.get_ttft().mean / 1000.0, "total_s": total,
                     "prompt_tokens": int(pm.get_num_input_tokens())}]
        # several prompts: the continuous-batching scheduler runs them together
        res = self.pipe.generate(texts, self.cfg)
        total = time.perf_counter() - t0
        out = []
        for text in res.texts:
            ids = [int(t) for t in self.tok.encode(text, add_special_tokens=False).input_ids.data[0]]
            out.append({"text": text, "ids": ids, "ttft_s": None, "total_s": total, "prompt_tokens": None})
        # the tokens generated (the texts re-encoded can differ by a token or two): the pipeline's
        # count, shared out in proportion
        generated = int(res.perf_metrics.get_num_generated_tokens())
        lengths = sum(len(r["ids"]) for r in out) or 1
        for r in out:
            r["num_tokens"] = round(generated * len(r["ids"]) / lengths)
        return out

    def prefill(self, ids: list[int], repeats: int) -> float:
        import numpy as np
        import openvino as ov
        cfg = self.ov_genai.GenerationConfig()
        cfg.max_new_tokens, cfg.do_sample = 1, False

        def inputs(toks):
            t = ov.Tensor(np.array([toks], dtype=np.int64))
            return self.ov_genai.TokenizedInputs(t, ov.Tensor(np.ones((1, len(toks)), dtype=np.int64)))

        self.pipe.generate(inputs(ids[:32]), cfg)
        best = float("inf")
        for _ in range(repeats):
            res = self.pipe.generate(inputs(ids), cfg)
            best = min(best, res.perf_metrics.get_ttft().mean / 1000.0)
        return best


def _export_weights(path: str) -> str:
    """What the model's weights are: a GGUF file's own types, or what the export recorded."""
    if path.endswith(".gguf"):
        return "gguf"
    try:
        with open(os.path.join(path, "draftwise_export.json")) as f:
            return json.load(f)["weights"]
    except (OSError, ValueError, KeyError):
        return "unknown"


PEERS = {"llamacpp": LlamaCpp, "llamacpp-pld": LlamaCpp, "openvino": OpenVINO, "openvino-pld": OpenVINO}


def main() -> int:
    _send({"started": True})
    cfg = json.loads(sys.stdin.readline())
    try:
        peer = PEERS[cfg["peer"]](cfg)
    except Exception as e:                                  # noqa: BLE001 - reported to the parent
        _send({"error": f"{type(e).__name__}: {e}"})
        return 2
    _send({"ready": True, "weights": peer.weights})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "generate":
                t0 = time.perf_counter()
                results = peer.generate(req["prompts"])
                _send({"results": results, "wall_s": time.perf_counter() - t0})
            elif req["op"] == "prefill":
                _send({"ttft_s": peer.prefill(req["token_ids"], req.get("repeats", 3))})
            else:
                _send({"error": f"unknown op {req['op']!r}"})
        except Exception as e:                              # noqa: BLE001
            _send({"error": f"{type(e).__name__}: {e}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
