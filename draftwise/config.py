"""Configuration dataclasses: the target architecture, the engine, speculation."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_METHODS = ("eagle3", "dflash", "draft_model", "ngram", "suffix")
HYBRID_SOURCES = ("suffix", "ngram")
REQUANTIZE_TYPES = ("Q4_0", "Q4_1", "Q8_0")    # block types a draft model can be re-quantized to
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _rope_fields(d: dict) -> tuple[float, dict | None]:
    """Read rope_theta / rope_scaling in both the old (top-level) and the transformers>=5
    (`rope_parameters`) styles."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") not in ("default", None):
        scaling = dict(params)
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return float(theta), scaling


HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "gemma3": "Gemma3ForCausalLM"}


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer (the Llama family: Llama, Qwen2, Qwen3, Gemma 3)."""
    architecture: str = "llama"          # "llama" | "qwen2" (q/k/v biases) | "qwen3" (q/k norms) | "gemma3"
    vocab_size: int = 32000
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 3: interleaved sliding-window layers with their own RoPE base, GELU (tanh) MLPs,
    # the embedding scaled by sqrt(hidden), a softmax scale from query_pre_attn_scalar
    sliding_window: int = 0                  # keys a sliding layer sees (itself included); 0: none
    sliding_layers: tuple[int, ...] = ()     # the sliding-window layers
    rope_local_theta: float | None = None    # the sliding layers' RoPE base (None: rope_theta)
    query_pre_attn_scalar: float | None = None   # softmax scale = this ** -0.5 (None: head_dim)
    hidden_act: str = "silu"                 # "silu" | "gelu_tanh"
    extra: dict = field(default_factory=dict)

    @property
    def qk_norm(self) -> bool:
        return self.architecture in ("qwen3", "gemma3")

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        model_type = d.get("model_type", "llama")
        arch = next((a for a in ("qwen3", "qwen2", "gemma3") if model_type.startswith(a) or any(a.title() in x for x in archs)),
                    "llama")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        theta, scaling = _rope_fields(d)
        if arch == "gemma3" and (d.get("rope_parameters") or {}).get("full_attention"):
            theta, scaling = _rope_fields({"rope_parameters": d["rope_parameters"]["full_attention"]})
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            attention_bias=d.get("attention_bias", arch == "qwen2"),     # Qwen2 always has q/k/v biases
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **(_gemma3_fields(d) if arch == "gemma3" else {}),
            extra=d,
        )

    def to_hf_dict(self) -> dict:
        d = dict(self.extra)
        d.update({
            "architectures": [HF_ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        })
        return d


def _gemma3_fields(d: dict) -> dict:
    """Gemma 3's own fields from a Hugging Face config (layer_types, or the older pattern)."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if not types:
        pattern = d.get("sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    params = d.get("rope_parameters") or {}
    local = d.get("rope_local_base_freq") or (params.get("sliding_attention") or {}).get("rope_theta") or 10000.0
    return dict(sliding_window=int(d.get("sliding_window") or 0),
                sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
                rope_local_theta=float(local), query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
                hidden_act="gelu_tanh")


@dataclass
class SpeculativeConfig:
    method: str
    model: str | None = None
    num_speculative_tokens: int | None = None
    # tree drafting (EAGLE-3 heads, draft models): topk 1 == chain. None (with num_speculative_tokens
    # None): the shipped drafter's recommended preset (its config's "draftwise_speculative_config")
    eagle_topk: int | None = None
    eagle_depth: int | None = None
    # n-gram
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # "fused": when every request is greedy, verify on the rows' argmax alone (no probabilities);
    # "logits": always run the probabilistic sampler on the logits.
    rejection_sampler: str = "fused"
    # choose per step how many tokens to speculate from measured step costs (spec_decode/policy.py)
    adaptive: bool = False
    # each step verifies the part of every request's draft that maximises the batch's expected
    # tokens per second under the measured step costs (spec_decode/allocation.py); False: whole drafts
    allocate_drafts: bool = True
    # suffix decoding (vLLM's keys and defaults)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # a static corpus searched beside the request and cached outputs (spec_decode/datastore.py):
    # "auto" - the datastore shipped for this target, if any; None / "none" - off; or a directory
    suffix_decoding_datastore: str | None = "auto"
    # suffix decoding: verify a tree of candidates instead of the most likely chain
    draft_tree: bool = False
    # draft_model: None - the draft model's own weights; a GGUF block type ("Q4_0", "Q4_1", "Q8_0") its
    # linears are re-quantized to at load (a smaller type drafts faster; outputs are unchanged)
    quantization: str | None = None
    # draft_model chains: a request's chain ends after a token the draft model gives less than this
    # probability (Hugging Face's assistant_confidence_threshold; 0 drafts every chain in full)
    draft_confidence_threshold: float = 0.4
    # hybrid drafting: "suffix" | "ngram" beside an eagle3 / dflash / draft_model drafter
    hybrid: str | None = None
    # False: requests sampled with a seed are decoded without drafts, so a seed gives the same
    # tokens whatever else is in the batch (drafts change how many random numbers a step uses)
    draft_seeded_sampling: bool = True

    @classmethod
    def from_any(cls, spec: Any) -> "SpeculativeConfig | None":
        if spec is None:
            return None
        if isinstance(spec, SpeculativeConfig):
            spec.validate_basic()
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(spec).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = set(spec) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; known keys: {sorted(known)}")
        if "method" not in spec:
            raise ValueError("speculative_config needs a 'method' (one of " + ", ".join(SUPPORTED_METHODS) + ")")
        cfg = cls(**spec)
        cfg.validate_basic()
        return cfg

    def validate_basic(self) -> None:
        if self.method not in SUPPORTED_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; supported: {', '.join(SUPPORTED_METHODS)}")
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "suffix" and k is None:
            self.num_speculative_tokens = k = self.suffix_decoding_max_tree_depth   # vLLM's default
        if self.method not in ("dflash", "eagle3") and k is None:     # drafters carry a preset
            raise ValueError(f"speculative method {self.method!r} needs num_speculative_tokens")
        if not isinstance(self.suffix_decoding_max_tree_depth, int) or self.suffix_decoding_max_tree_depth < 1:
            raise ValueError("suffix_decoding_max_tree_depth must be an integer >= 1, got "
                             f"{self.suffix_decoding_max_tree_depth!r}")
        if not isinstance(self.suffix_decoding_max_cached_requests, int) or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_cached_requests must be an integer >= 0, got "
                             f"{self.suffix_decoding_max_cached_requests!r}")
        if not isinstance(self.suffix_decoding_max_spec_factor, (int, float)) or self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_max_spec_factor must be > 0, got "
                             f"{self.suffix_decoding_max_spec_factor!r}")
        if not isinstance(self.suffix_decoding_min_token_prob, (int, float)) or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob!r}")
        ds = self.suffix_decoding_datastore
        if ds is not None and not isinstance(ds, str):
            raise ValueError(f"suffix_decoding_datastore must be 'auto', 'none' or a directory, got {ds!r}")
        if self.draft_tree and self.method != "suffix" and self.hybrid != "suffix":
            raise ValueError("draft_tree applies to suffix decoding (method 'suffix' or hybrid 'suffix'); "
                             "EAGLE-3 trees use eagle_topk > 1")
        if self.hybrid is not None:
            if self.hybrid not in HYBRID_SOURCES:
                raise ValueError(f"hybrid must be one of {', '.join(HYBRID_SOURCES)}, got {self.hybrid!r}")
            if self.method not in ("eagle3", "dflash", "draft_model"):
                raise ValueError(f"hybrid drafting pairs {self.hybrid!r} with a model drafter (method eagle3, "
                                 f"dflash or draft_model), not {self.method!r}")
        if self.rejection_sampler not in ("fused", "logits"):
            raise ValueError(f"rejection_sampler must be 'fused' or 'logits', got {self.rejection_sampler!r}")
        if self.eagle_topk is not None and (not isinstance(self.eagle_topk, int) or self.eagle_topk < 1):
            raise ValueError(f"eagle_topk must be an integer >= 1, got {self.eagle_topk!r}")
        if self.eagle_depth is not None and (not isinstance(self.eagle_depth, int) or self.eagle_depth < 1):
            raise ValueError(f"eagle_depth must be an integer >= 1, got {self.eagle_depth!r}")
        topk = self.eagle_topk or 1
        if topk > 1 and self.method not in ("eagle3", "draft_model"):
            raise ValueError("tree drafting (eagle_topk > 1) is available with methods 'eagle3' and 'draft_model'")
        if self.quantization is not None:
            if self.method != "draft_model":
                raise ValueError("speculative_config['quantization'] re-quantizes a draft model: it applies to "
                                 "method 'draft_model' only")
            if str(self.quantization).upper() not in REQUANTIZE_TYPES:
                raise ValueError(f"speculative_config['quantization'] must be one of {', '.join(REQUANTIZE_TYPES)}, "
                                 f"got {self.quantization!r}")
            self.quantization = str(self.quantization).upper()
        t = self.draft_confidence_threshold
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t <= 1:
            raise ValueError(f"draft_confidence_threshold must be in [0, 1], got {t!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method 'draft_model' needs speculative_config['model']: a packaged model's short "
                             "name, a GGUF file or a model directory with the target's tokenizer")
        if self.adaptive and topk > 1:
            raise ValueError("adaptive speculation length applies to chain drafting (eagle_topk = 1)")
        if self.method == "ngram":
            if not (1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
                raise ValueError("ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if topk > 1 and k is not None:
            depth = self.eagle_depth or k
            capacity = topk + (depth - 1) * topk * topk
            if k > capacity:
                raise ValueError(f"num_speculative_tokens={k} exceeds what a tree of eagle_topk="
                                 f"{topk}, eagle_depth={depth} can hold ({capacity} nodes)")


@dataclass
class EngineConfig:
    model: str
    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    block_size: int = 16
    num_kv_blocks: int | None = None      # None: what kv_cache_memory holds
    # bytes for the KV pool (target and drafter layers); None: default_kv_tokens of the model's KV
    kv_cache_memory: int | None = None
    # the batch the default pool is sized for (None: max_num_seqs): one request at a time that
    # keeps earlier conversations' prefixes for their next turn wants a server's pool, not one sequence's
    kv_pool_seqs: int | None = None
    kv_cache_dtype: str = "auto"          # "auto" (the model's dtype), "float32", "bfloat16", "float16"
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    speculative_config: SpeculativeConfig | None = None
    # eager steps; False compiles the step's graphs (worker/compiled_graphs.py)
    enforce_eager: bool = True
    compile_sizes: tuple[int, ...] | None = None   # static token buckets; None: (1, 2, 4, 8)
    # weight-only quantization of the target's (and drafter's) linears: None | "int8" | "int4" |
    # "gguf" (a GGUF's own blocks, every type: draftwise/formats)
    quantization: str | None = None
    # automatic prefix caching: full KV blocks shared across requests by a hash of their tokens
    enable_prefix_caching: bool = True
    # tensor parallelism: the target sharded over this many processes (torch.distributed)
    tensor_parallel_size: int = 1
    # where the worker ranks run: "mp" (local processes) or "ray" (Ray actors, across nodes)
    distributed_executor_backend: str = "mp"
    # async scheduling: the model runs on a worker thread; while step n runs, step n+1's KV blocks
    # are reserved and step n-1's outputs detokenized (engine._step_async)
    async_scheduling: bool = False
    # the chat template in place of the model's own (its text); None: the model's
    chat_template: str | None = None
    # a directory holding the tokenizer to use in place of the model's own; None: the model's
    tokenizer: str | None = None
    # sampling defaults from the model's generation_config.json (a request's own values win)
    generation_defaults: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.compile_sizes is not None:
            sizes = tuple(self.compile_sizes)
            if not sizes or not all(isinstance(x, int) and x >= 1 for x in sizes):
                raise ValueError(f"compile_sizes must be positive integers, got {self.compile_sizes!r}")
            self.compile_sizes = tuple(sorted(set(sizes)))
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}")
        if self.quantization is not None and self.quantization not in ("int8", "int4", "gguf"):
            raise ValueError(f"unknown quantization {self.quantization!r}; choose 'gguf', 'int8', 'int4' or None")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {sorted(DTYPES)}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_pool_seqs is not None and self.kv_pool_seqs < 1:
            raise ValueError(f"kv_pool_seqs must be >= 1, got {self.kv_pool_seqs}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose 'auto' or one of "
                             f"{sorted(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's dtype ("auto" is resolved by the engine before it is read: the model's
        dtype, or bf16 for quantized weights where the CPU attention kernel reads 16-bit caches)."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else DTYPES[self.kv_cache_dtype]


# The KV pool's default size, counted in the model's own tokens (a model with more layers or KV
# heads gets more memory, not fewer tokens): a full batch of max_num_seqs requests of
# DEFAULT_KV_TOKENS_PER_SEQ tokens each, plus one full max_model_len sequence; at most a quarter of
# the memory available at start-up. SmolLM2-135M (bf16 cache, 23 KB a token) at the defaults
# (16 x 512 + 2,048 tokens): 236 MB; Qwen2.5-Coder-1.5B (28.7 KB a token): 294 MB. Pass
# kv_cache_memory (--kv-cache-memory) for another size.
DEFAULT_KV_TOKENS_PER_SEQ = 512


def default_kv_tokens(max_num_seqs: int, max_model_len: int) -> int:
    return max_num_seqs * DEFAULT_KV_TOKENS_PER_SEQ + max_model_len


def parse_bytes(text: str | int) -> int:
    """'512MiB', '1GiB', '300MB', '4096' -> bytes."""
    if isinstance(text, int):
        return text
    import re
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 1GiB, 300MB)")
    unit = (m.group(2) or "").rstrip("b")
    mult = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
            "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}[unit]
    return int(float(m.group(1)) * mult)


def cache_dir() -> str:
    """draftwise's own cache folder: $DRAFTWISE_CACHE, else draftwise under $XDG_CACHE_HOME (as
    torch's extensions and the Hugging Face cache honour it), else ~/.cache/draftwise."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    d = os.environ.get("DRAFTWISE_CACHE") or os.path.join(xdg, "draftwise")
    os.makedirs(d, exist_ok=True)
    return d
