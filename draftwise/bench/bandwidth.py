"""How close plain decoding runs to the machine's memory limit.

A plain decoding step of a quantized model reads every layer's weights and the LM head once, so its
rate is bounded by (streaming read bandwidth) / (bytes of weights per step). `draftwise bench`
measures the bandwidth at the run's thread count, before and after the run (it drifts on shared
machines), and reports each plain method's weight stream, decode tokens/s x bytes per step, as a
share of it: the same bytes for every engine reading the same GGUF file."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from draftwise.models.loader import gguf_path_for

STREAM_BYTES = 1 << 29          # 512 MiB: far past any CPU's last-level cache


def read_bandwidth_gbs(nbytes: int = STREAM_BYTES, repeats: int = 5) -> float:
    """The machine's streaming read bandwidth in GB/s at torch's current thread count: the best of
    `repeats` sums of an fp32 buffer of `nbytes` (a vectorised, parallel read of every byte once)."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    buf.sum()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def gguf_bytes_per_token(path: str) -> int:
    """The bytes of a GGUF file's tensors one plain decoding step reads: all of them, less the token
    embedding where the file has its own output head (a lookup reads one row of it; a tied
    embedding is the head, read whole)."""
    from gguf import GGUFReader
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    total = sum(sizes.values())
    if "output.weight" in sizes:
        total -= sizes.get("token_embd.weight", 0)
    return total


@dataclass
class WeightStream:
    bytes_per_token: int | None     # None: the model is not a GGUF file
    bandwidth_before_gbs: float
    bandwidth_after_gbs: float

    @property
    def bandwidth_gbs(self) -> float:
        return max(self.bandwidth_before_gbs, self.bandwidth_after_gbs)

    def rate_gbs(self, decode_tokens_per_s: float) -> float | None:
        return None if self.bytes_per_token is None else decode_tokens_per_s * self.bytes_per_token / 1e9

    def markdown(self, results: list[dict], threads: int) -> str:
        """The paragraph under the bench table: bandwidth, bytes per step, each plain method's share."""
        line = (f"Streaming read bandwidth at {threads} threads: {self.bandwidth_before_gbs:.1f} GB/s before the "
                f"run, {self.bandwidth_after_gbs:.1f} after.")
        if self.bytes_per_token is None:
            return line
        parts = []
        for r in results:
            dec = r.get("decode_tokens_per_s")
            if r.get("error") or dec is None or not is_plain(r):
                continue
            rate = self.rate_gbs(dec)
            parts.append(f"{r['method']} {rate:.1f} GB/s ({rate / self.bandwidth_gbs:.0%})")
        line += f" Weights read per plain step: {self.bytes_per_token / 1e9:.3f} GB."
        if parts:
            line += " Plain decoding's weight stream (share of the higher bandwidth): " + ", ".join(parts) + "."
        return line


def is_plain(result: dict) -> bool:
    """A method that decodes one token per model pass on the file's own weights: draftwise without
    speculation on the GGUF blocks, or a peer's plain mode."""
    spec = result.get("spec")
    if spec is None:
        return result.get("quantization") == "gguf"
    return spec in ("llamacpp", "openvino")


def measure_around(model: str, run):
    """`run()`'s result and the WeightStream measured around it."""
    path = gguf_path_for(model)
    before = read_bandwidth_gbs()
    out = run()
    after = read_bandwidth_gbs()
    return out, WeightStream(None if path is None else gguf_bytes_per_token(path), before, after)
