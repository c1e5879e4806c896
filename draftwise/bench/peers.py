"""Peer engines for `draftwise bench`, run on the same weights and prompts when installed:
Hugging Face transformers `generate` (plain and prompt lookup, in this process), and in child
processes (draftwise/bench/peer_worker.py, under the Python of the environment that has them)
llama.cpp via llama-cpp-python (plain and its prompt-lookup drafting) on the same GGUF, and
OpenVINO GenAI's `LLMPipeline` on the CPU (plain and prompt lookup, continuous batching for a
batch) reading the same GGUF or an OpenVINO model exported from the same dequantized weights
(`python -m draftwise.bench.openvino_export`, in an environment with optimum-intel).

A peer answers conversations and reports (text, token ids, PeerTiming) for each: its time to
first token and the prompt tokens it read, so the bench reports decode speed and time to first
token apart, as it does for draftwise's own rows. A native peer that crashes ends its own
process only (PeerCrashed): the bench keeps the other rows."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from draftwise.inputs import conversation_prompt
from draftwise.models.loader import gguf_path_for, load_tokenizer, resolve_model_dir


@dataclass
class PeerTiming:
    ttft_s: float | None           # request start -> first token (None: the peer does not say)
    total_s: float                 # request start -> last token
    prompt_tokens: int | None = None
    num_tokens: int | None = None  # tokens generated, where the returned ids are a re-encoding


class HFPeer:
    def __init__(self, model: str, max_tokens: int, prompt_lookup: bool):
        from transformers import AutoModelForCausalLM
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


class PeerCrashed(RuntimeError):
    """The peer's process ended while it had work (a native crash, a kill, out of memory)."""


WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_worker.py")


class PeerProcess:
    """A native peer engine (llama.cpp, OpenVINO GenAI) in a child process running
    draftwise/bench/peer_worker.py under `python` (default: this interpreter; OpenVINO GenAI usually
    has an environment of its own). A crash there ends that process only and surfaces here as
    PeerCrashed with the end of its stderr; a peer that refuses to load raises ValueError."""

    def __init__(self, peer: str, model: str, max_tokens: int, python: str | None = None, max_num_seqs: int = 1,
                 ignore_eos: bool = False):
        import subprocess
        import sys
        import tempfile
        self.name = peer
        self.max_tokens = max_tokens
        self._stderr = tempfile.TemporaryFile(mode="w+")
        # a fresh environment for the child: the peer's own Python finds its own packages
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        self.proc = subprocess.Popen([python or sys.executable, WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        self._recv()                                          # the interpreter is up
        self._send({"peer": peer, "model": model, "max_tokens": max_tokens, "threads": torch.get_num_threads(),
                    "max_num_seqs": max_num_seqs, "ignore_eos": ignore_eos})
        msg = self._recv()
        if "error" in msg:
            self.close()
            raise ValueError(f"{peer}: {msg['error']}")
        self.weights = msg.get("weights", "unknown")

    def _send(self, obj) -> None:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._crashed()

    def _recv(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self._crashed()
        return json.loads(line)

    def _crashed(self):
        rc = self.proc.wait()
        self._stderr.seek(0)
        tail = self._stderr.read()[-800:].strip()
        how = f"signal {-rc}" if rc < 0 else f"status {rc}"
        raise PeerCrashed(f"peer {self.name} ended with {how}" + (f": {tail}" if tail else ""))

    def request(self, obj) -> dict:
        self._send(obj)
        msg = self._recv()
        if "error" in msg:
            raise RuntimeError(f"{self.name}: {msg['error']}")
        return msg

    def generate_batch(self, conversations) -> list[tuple[str, list[int], PeerTiming]]:
        """Answers to several conversations; a batching peer runs them together."""
        prompts = [{"messages": m, "text": conversation_prompt(None, m)} for m in conversations]
        res = self.request({"op": "generate", "prompts": prompts})["results"]
        return [(r["text"], r["ids"], PeerTiming(r["ttft_s"], r["total_s"], r["prompt_tokens"], r.get("num_tokens")))
                for r in res]

    def generate(self, messages):
        return self.generate_batch([messages])[0]

    def prefill(self, token_ids: list[int], repeats: int) -> float:
        return float(self.request({"op": "prefill", "token_ids": list(token_ids), "repeats": repeats})["ttft_s"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except Exception:                                 # noqa: BLE001
                self.proc.kill()
        self._stderr.close()


def peer_model(name: str, model: str, openvino_model: str | None = None) -> str:
    """The file or directory a native peer reads: the model's GGUF file (llama.cpp; OpenVINO GenAI
    reads it too), or an OpenVINO export given by --openvino-model."""
    if name.startswith("openvino") and openvino_model:
        return openvino_model
    path = gguf_path_for(model) or model
    if not path.endswith(".gguf"):
        raise ValueError(f"peer {name} needs a GGUF model (or, for OpenVINO, --openvino-model DIR), got {model!r}")
    return path


def make_peer(name: str, model: str, max_tokens: int, openvino_model: str | None = None,
              python: dict | None = None, max_num_seqs: int = 1, ignore_eos: bool = False):
    """A peer by name; `python` maps a peer family ("llamacpp", "openvino") to the interpreter of
    the environment that has it."""
    if name in ("hf", "hf-pld"):
        return HFPeer(model, max_tokens, name == "hf-pld")
    if name in ("llamacpp", "llamacpp-pld", "openvino", "openvino-pld"):
        family = name.split("-")[0]
        return PeerProcess(name, peer_model(name, model, openvino_model), max_tokens, (python or {}).get(family),
                           max_num_seqs, ignore_eos)
    raise ValueError(f"unknown peer {name!r}")
