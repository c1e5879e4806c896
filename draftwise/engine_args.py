"""EngineArgs: every engine option in one place.

`LLM(model, **kwargs)`, `draftwise generate / chat / serve` and the server all build their engine
from an EngineArgs, and the command-line flags are generated from its fields (`add_cli_args`), so
an option, its default and its help text exist once. `create_engine_config()` resolves the
user-facing values ("auto" speculation and weights, "512MiB") into the engine's EngineConfig.

One compile default everywhere: eager steps (start-up in seconds). `enforce_eager=False` /
`--compile` compiles the step's graphs per token bucket: faster steps once compiled, after minutes
of compilation the first time on a small CPU (cached on disk for later starts)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import MISSING, dataclass, field, fields

from draftwise.config import EngineConfig, SpeculativeConfig, parse_bytes
from draftwise.inputs import read_chat_template
from draftwise.models.loader import DEFAULT_MODEL
from draftwise.models.loader import native_quantization
from draftwise.models.hub import HubOptions
from draftwise.models.names import ResolvedModel, resolve_model, resolve_tokenizer
from draftwise.models.packaged import installed_draft_model, packaged_model

# The default ("auto") is the configuration that measured fastest (`draftwise bench`, MT-bench and
# the code-edits workload; docs/benchmarks.md): suffix decoding, chain drafts of variable length -
# and where the target is a packaged model whose smaller sibling is installed (Qwen2.5-Coder-1.5B
# and -0.5B), that draft model beside it, re-quantized to a cheap type: each step the cost-aware
# hybrid (spec_decode/hybrid.py) verifies suffix decoding's draft where it pays more than the
# draft model's chain, and the draft model's chain, at the length that pays, where suffix decoding
# finds little (new text). The shipped EAGLE-3 head with suffix beside it measured slower on the
# default model than suffix alone (its drafting step costs more than its acceptance saves), so it
# stays opt-in. The adaptive policy is off: it sizes one draft length for every step, which fits
# model drafters but not suffix decoding's variable-length drafts. Seeded sampled requests are
# decoded without drafts, so seeds stay reproducible across batches.
DEFAULT_TRAINING_FREE = {"method": "suffix", "draft_seeded_sampling": False}
DRAFT_MODEL_CHAIN = 4      # the draft model's longest chain (the hybrid picks 1..4 each step)


def default_speculative_config(model: str) -> dict:
    """The "auto" speculative configuration for `model`: suffix decoding, with the target's packaged
    draft model beside it where one is installed."""
    draft = installed_draft_model(model)
    if draft is None:
        return dict(DEFAULT_TRAINING_FREE)
    return {"method": "draft_model", "model": draft.name, "quantization": packaged_model(model).draft_quantization,
            "num_speculative_tokens": DRAFT_MODEL_CHAIN, "hybrid": "suffix", "draft_seeded_sampling": False}


def resolve_quantization(model: str, quantization: str | None) -> str | None:
    """"auto" (the default): the model's own weight format - a quantized GGUF runs on its own
    blocks ("gguf", every type draftwise/formats reads), anything else in its checkpoint dtype.
    "none" / None: the checkpoint dtype (a GGUF dequantized to fp32). "int8" / "int4": weight-only
    quantization."""
    if quantization is None or str(quantization).lower() in ("none", "fp32", "float32"):
        return None
    if str(quantization).lower() == "auto":
        return native_quantization(model)
    return quantization


def _opt(default, help: str, **flag):
    """A field with its command-line help (and argparse extras such as `choices`)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class EngineArgs:
    model: str = _opt(DEFAULT_MODEL, "a GGUF file or checkpoint directory, a packaged model's short name, "
                                     "ollama:NAME[:TAG], or a Hugging Face name ORG/REPO[:QUANT] / ORG/REPO/FILE.gguf")
    speculative_config: object = _opt(
        "auto", "'auto' (the measured fastest: suffix decoding), 'none', or JSON, e.g. "
                "'{\"method\": \"eagle3\"}' (a dict in Python)")
    max_model_len: int = _opt(2048, "context length in tokens")
    max_num_seqs: int = _opt(16, "requests per batch")
    max_num_batched_tokens: int | None = _opt(None, "tokens per step (default: max(max_model_len, 512))")
    block_size: int = _opt(16, "KV-cache block size in tokens")
    num_kv_blocks: int | None = _opt(None, "KV blocks in the pool (default: what --kv-cache-memory holds)")
    kv_cache_memory: str | None = _opt(None, "memory for the KV cache, e.g. 512MiB (default: the model's KV for "
                                             "--max-num-seqs x 512 tokens plus one --max-model-len sequence, at most "
                                             "a quarter of the available memory)")
    kv_pool_seqs: int | None = _opt(None, "size the default KV pool for this many sequences (default: --max-num-seqs): "
                                          "more keeps more finished conversations' prefixes cached")
    kv_cache_dtype: str = _opt("auto", "KV-cache dtype; 16-bit halves its memory (auto: bfloat16 for quantized "
                                       "weights where the CPU attention kernel runs, else the model's dtype)",
                               choices=["auto", "float32", "bfloat16", "float16"])
    dtype: str = _opt("float32", "activation / weight dtype", choices=["float32", "bfloat16", "float16"])
    quantization: str | None = _opt("auto", "weights: auto (the model's own format: a quantized GGUF runs on "
                                            "its own blocks), gguf, none (the checkpoint dtype), int8, int4",
                                    choices=["auto", "gguf", "none", "int8", "int4"])
    device: str = _opt("cpu", "cpu, or cuda (untested: no GPU was at hand)")
    seed: int = _opt(0, "engine seed")
    threads: int | None = _opt(None, "torch CPU threads (default: all cores)")
    enforce_eager: bool = _opt(True, "eager steps (the default; --compile compiles the step's graphs)")
    compile_sizes: str | None = _opt(None, "static token buckets for compiled graphs, e.g. 1,2,4,8 (default)")
    enable_prefix_caching: bool = _opt(True, "automatic prefix caching")
    tensor_parallel_size: int = _opt(1, "shard the target over this many processes (torch.distributed)")
    distributed_executor_backend: str = _opt("mp", "where tensor-parallel ranks run: mp (local processes) or ray "
                                                   "(Ray actors on the cluster's nodes; pip install 'draftwise[ray]')",
                                             choices=["mp", "ray"])
    async_scheduling: bool = _opt(False, "run the model on a worker thread: reserve step n+1's KV blocks and "
                                         "detokenize step n-1 while step n runs")
    chat_template: str | None = _opt(None, "a chat template in place of the model's own: a Jinja file, or the "
                                           "template itself (default: the one in the model's files, if any)")
    tokenizer: str | None = _opt(None, "the tokenizer of another model (ORG/REPO, a directory or a GGUF), for a "
                                       "GGUF whose metadata lacks a usable tokenizer or chat template")
    revision: str | None = _opt(None, "the Hub revision (branch, tag or commit) of a model named by Hub name")
    hf_token: str | None = _opt(None, "Hugging Face token for gated or private repos (default: HF_TOKEN)")
    offline: bool = _opt(False, "read Hub models from the Hugging Face cache only, never the network "
                                "(as HF_HUB_OFFLINE=1)")
    quiet: bool = _opt(False, "no download progress bars (they are shown only on a terminal anyway)")

    # --- command line --------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            extra = {k: v for k, v in f.metadata.items() if k != "help"}
            default = f.default if f.default is not MISSING else None
            if isinstance(default, bool):
                g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=f.metadata["help"])
                continue
            typ = int if f.type in ("int", "int | None") else str
            text = f.metadata["help"]
            if "(default" not in text:
                text += " (default: %(default)s)"
            g.add_argument(flag, type=typ, default=default, help=text, **extra)
        g.add_argument("--compile", dest="enforce_eager", action="store_false",
                       help="compile the step's graphs (the same as --no-enforce-eager)")
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help=argparse.SUPPRESS)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    # --- the engine's config -----------------------------------------------------------------------
    def speculative(self) -> SpeculativeConfig | None:
        spec = self.speculative_config
        if isinstance(spec, str):
            s = spec.strip()
            if s.lower() in ("", "none", "null"):
                return None
            if s.lower() == "auto":
                spec = default_speculative_config(self.model)
            else:
                try:
                    spec = json.loads(s)
                except json.JSONDecodeError as e:
                    raise ValueError(f"speculative_config is not valid JSON (nor 'auto' / 'none'): {e}") from None
        return SpeculativeConfig.from_any(spec)

    def hub_options(self) -> HubOptions:
        return HubOptions(revision=self.revision, token=self.hf_token, offline=bool(self.offline),
                          quiet=bool(self.quiet))

    def resolved_model(self) -> ResolvedModel:
        """The model on disk (fetched from the Hub into its cache when named by Hub name)."""
        return resolve_model(self.model, self.hub_options())

    def create_engine_config(self) -> EngineConfig:
        model = self.resolved_model()
        spec = self.speculative()
        if spec is not None and spec.model is not None and spec.method in ("draft_model", "eagle3", "dflash"):
            # a drafter by name: local, packaged or on the Hub (its own revision is the default branch)
            opts = dataclasses.replace(self.hub_options(), revision=None)
            spec.model = resolve_model(spec.model, opts, role="model" if spec.method == "draft_model"
                                       else "drafter").path
        sizes = self.compile_sizes
        if isinstance(sizes, str):
            try:
                sizes = tuple(int(x) for x in sizes.split(",") if x.strip()) or None
            except ValueError:
                raise ValueError(f"compile_sizes must be comma-separated integers, got {sizes!r}") from None
        return EngineConfig(
            model=model.path, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or max(self.max_model_len, 512),
            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks, dtype=self.dtype, device=self.device,
            seed=self.seed, speculative_config=spec, enforce_eager=bool(self.enforce_eager),
            compile_sizes=sizes, quantization=resolve_quantization(model.path, self.quantization),
            enable_prefix_caching=self.enable_prefix_caching, tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            async_scheduling=self.async_scheduling,
            kv_cache_memory=None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory),
            kv_cache_dtype=self.kv_cache_dtype, kv_pool_seqs=self.kv_pool_seqs,
            chat_template=None if self.chat_template is None else read_chat_template(self.chat_template),
            tokenizer=None if self.tokenizer is None else resolve_tokenizer(self.tokenizer, self.hub_options()),
            generation_defaults=dict(model.generation_defaults))
