"""Compiled execution with warmup buckets (every bucket warmed with speculation enabled, on PyTorch).

A `BucketedGraph` wraps one model function whose tensor arguments all have the flat token
dimension first (the target's layer stack, an LM head, the EAGLE-3 layer, DFlash's block pass):

- token counts up to the largest *static size* are padded to the nearest size (powers of two by
  default: 1, 2, 4, 8) and run a graph specialised for exactly that shape: these are the decode,
  verification (batch x (1 + K), tree sizes) and drafting shapes, where per-op overhead dominates;
- larger token counts (prefill chunks, big batches) run one graph compiled with a dynamic token
  dimension, padded to a multiple of `DYNAMIC_PAD` so similar sizes share memory plans.

Every graph is compiled by `warmup()` at start-up; afterwards calls run under
`torch.compiler.set_stance("fail_on_recompile")`, so nothing compiles while serving (a shape the
warmup missed raises inside dynamo; we fall back to eager for that call and log it once).

Attention is an opaque custom op that reads the step's metadata from `forward_context` and
attends over the real (unpadded) tokens only; padding rows produce zeros and are sliced off.
On CPU the graphs come from Inductor (C++/OpenMP); on CUDA from Inductor's Triton backend.
CUDA graphs are not captured: the paged-attention op reads ragged metadata that a captured graph
would freeze (vLLM splits its graphs at attention for this; not done here).

Compiled artefacts go to Inductor's FX-graph / AOT-autograd caches under the draftwise cache
directory (`$DRAFTWISE_CACHE/inductor`), so a restart reuses them instead of recompiling.
"""
from __future__ import annotations

import logging
import os
import sys
import time

import torch

from draftwise.layers.attention import CAUSAL, AttentionMetadata, forward_context, slots_for_positions
from draftwise.config import cache_dir

logger = logging.getLogger("draftwise")

DEFAULT_STATIC_SIZES = (1, 2, 4, 8)
DYNAMIC_PAD = 16


def keep_triton_out() -> None:
    """On a PyTorch build without a GPU backend, mark `triton` as absent before torch._dynamo looks
    for it. Inductor's CPU code generation never uses it, but once imported (it is installed as a
    dependency of xgrammar) its bindings print hundreds of nanobind "leaked" lines at interpreter
    exit. With a CUDA or ROCm build triton is left alone: there Inductor needs it."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None and "triton" not in sys.modules:
        sys.modules["triton"] = None        # `import triton` raises ImportError: "not installed"


def configure_compile_cache() -> str:
    """Point Inductor's on-disk caches at the draftwise cache directory (before first compile)."""
    d = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir(), "inductor"))
    keep_triton_out()
    import torch._dynamo.config as dcfg
    import torch._inductor.config as icfg
    icfg.fx_graph_cache = True
    dcfg.recompile_limit = max(dcfg.recompile_limit, 64)
    dcfg.accumulated_recompile_limit = max(dcfg.accumulated_recompile_limit, 1024)
    return d


def bucket_for(n: int, static_sizes: tuple[int, ...]) -> tuple[int, bool]:
    """(padded size, is_static) for a call with n tokens."""
    for s in static_sizes:
        if n <= s:
            return s, True
    return -(-n // DYNAMIC_PAD) * DYNAMIC_PAD, False


def _pad_rows(t: torch.Tensor, size: int) -> torch.Tensor:
    n = t.shape[0]
    if n == size:
        return t
    return torch.cat([t, t.new_zeros(size - n, *t.shape[1:])], 0)


def _slice_rows(out, n: int):
    if out is None:
        return None
    if isinstance(out, tuple):
        return tuple(_slice_rows(o, n) for o in out)
    return out[:n]


class BucketedGraph:
    """`fn(*tensors, meta, kv_cache)` (or `fn(*tensors)` when `uses_attention` is False) run
    through graphs compiled per token bucket. Call it exactly like `fn`."""

    def __init__(self, fn, name: str, num_tensor_args: int, static_sizes=DEFAULT_STATIC_SIZES,
                 uses_attention: bool = True, max_tokens: int = 1024):
        self.fn, self.name = fn, name
        self.num_tensor_args = num_tensor_args
        self.static_sizes = tuple(sorted(set(static_sizes)))
        self.uses_attention = uses_attention
        self.max_tokens = max_tokens
        self._static = torch.compile(fn, fullgraph=True, dynamic=False)
        self._dynamic = torch.compile(fn, fullgraph=True, dynamic=True)
        self.warm: set[tuple[int, bool]] = set()
        self.fallbacks = 0          # calls that ran eager because their shape was not warmed
        self.calls = 0              # calls served by a compiled graph

    # --- calls -----------------------------------------------------------------------------------
    def __call__(self, *args):
        tensors = args[:self.num_tensor_args]
        rest = args[self.num_tensor_args:]
        n = tensors[0].shape[0]
        size, static = bucket_for(n, self.static_sizes)
        if n == 0 or (size if static else 0, static) not in self.warm:
            return self.fn(*args)
        padded = [_pad_rows(t, size) for t in tensors]
        graph = self._static if static else self._dynamic
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                if self.uses_attention:
                    meta, kv_cache = rest
                    with forward_context(meta, kv_cache):
                        out = graph(*padded, None, None)
                else:
                    out = graph(*padded)
        except RuntimeError as e:
            if "recompil" not in str(e).lower():
                raise
            if self.fallbacks == 0:
                logger.warning("%s: shape %d was not warmed up; running eager (%s)", self.name, n,
                               str(e).splitlines()[0])
            self.fallbacks += 1
            return self.fn(*args)
        self.calls += 1
        return _slice_rows(out, n)

    # --- warmup ----------------------------------------------------------------------------------
    def warmup(self, make_inputs, kv_cache=None, block_size: int = 16, scratch_blocks=None) -> None:
        """Compile every static size and the dynamic graph. `make_inputs(n)` returns the n-row
        tensor arguments; attention graphs write their K/V into `scratch_blocks` of the cache
        (nothing is running yet)."""
        sizes = [(s, True) for s in self.static_sizes]
        dyn = min(self.max_tokens, max(self.static_sizes) * 2 + DYNAMIC_PAD)
        if dyn > max(self.static_sizes):
            sizes.append(bucket_for(dyn, self.static_sizes))
        for size, static in sizes:
            t0 = time.perf_counter()
            tensors = make_inputs(size)
            graph = self._static if static else self._dynamic
            if not static:
                torch._dynamo.mark_dynamic(tensors[0], 0)
            if self.uses_attention:
                meta = warmup_metadata(size, scratch_blocks, block_size, tensors[0].device)
                with forward_context(meta, kv_cache):
                    graph(*tensors, None, None)
            else:
                graph(*tensors)
            dt = time.perf_counter() - t0
            self.warm.add((size, True) if static else (0, False))
            logger.info("compiled %s for %s tokens in %.1f s", self.name,
                        size if static else f"dynamic >{max(self.static_sizes)}", dt)


def warmup_metadata(n: int, blocks: list[int], block_size: int, device) -> AttentionMetadata:
    """Causal metadata for one request of n tokens living in `blocks` (scratch space)."""
    need = -(-n // block_size)
    if len(blocks) < need:
        raise ValueError(f"warmup needs {need} KV blocks for {n} tokens, the pool has {len(blocks)}")
    bt = torch.tensor([blocks[:need]], dtype=torch.long, device=device)
    pos = torch.arange(n, device=device)
    slots = slots_for_positions(bt, torch.zeros_like(pos), pos, block_size)
    return AttentionMetadata(slots, [n], [n], bt, block_size, CAUSAL).finalize()


def compile_graph(fn, name: str, num_tensor_args: int, make_inputs, *, static_sizes, max_tokens: int,
                  uses_attention: bool = True, kv_cache=None, block_size: int = 16) -> BucketedGraph:
    """A BucketedGraph of `fn`, warmed up for every bucket. The caller installs it where the
    model declares its compiled steps (`LlamaForCausalLM.layers_step`, a proposer's steps)."""
    graph = BucketedGraph(fn, name, num_tensor_args, static_sizes, uses_attention=uses_attention,
                          max_tokens=max_tokens)
    scratch = list(range(kv_cache.num_blocks)) if kv_cache is not None else []
    with torch.inference_mode():
        graph.warmup(make_inputs, kv_cache, block_size, scratch)
    return graph
