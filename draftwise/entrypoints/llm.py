"""The offline API: `LLM(model, ...).generate(prompts, sampling_params)` and `.chat(messages)`."""
from __future__ import annotations

from typing import Iterator

from draftwise.config import EngineConfig, SpeculativeConfig, parse_bytes
from draftwise.engine.engine import LLMEngine
from draftwise.models.loader import DEFAULT_MODEL
from draftwise.outputs import RequestOutput
from draftwise.sampling_params import SamplingParams

# The default ("auto") is the configuration that measured fastest on the default model
# (`draftwise bench`, MT-bench and the code-edits workload, README "Choosing the default"): suffix
# decoding, chain drafts of variable length (1.30x and 1.35x over plain decoding; a rerun 1.07x and
# 1.37x). The shipped EAGLE-3 head with suffix beside it and the adaptive policy measured 1.22x and
# 0.93x: its drafting step costs more on this CPU than its acceptance (1.35) saves, so a model
# drafter is opt-in until one measures faster. The adaptive policy is not on by default either: it
# sizes one draft length for every step, which fits model drafters but not suffix decoding's
# variable-length drafts (suffix + adaptive measured 1.03x and 0.92x). Seeded sampled requests are
# decoded without drafts, so seeds stay reproducible across batches.
DEFAULT_TRAINING_FREE = {"method": "suffix", "draft_seeded_sampling": False}


def default_speculative_config(model: str) -> dict:
    """The "auto" speculative configuration for `model` (any model: suffix decoding needs no
    drafter weights)."""
    return dict(DEFAULT_TRAINING_FREE)


def resolve_quantization(model: str, quantization: str | None) -> str | None:
    """"auto" (the default): the model's own weight format - a Q4_1 GGUF (the packaged SmolLM2) runs
    as int4, exactly its blocks; anything else in its checkpoint dtype. "none" / None: the checkpoint
    dtype (a GGUF dequantized to fp32). "int8" / "int4": weight-only quantization."""
    if quantization is None or str(quantization).lower() in ("none", "fp32", "float32"):
        return None
    if str(quantization).lower() == "auto":
        from draftwise.models.loader import native_quantization
        return native_quantization(model)
    return quantization


class LLM:
    """`speculative_config`: "auto" (default: see DEFAULT_TRAINING_FREE), None (plain decoding), or a
    dict / JSON string (SpeculativeConfig's keys). `quantization`: "auto" (default: the model's own
    weight format, see `resolve_quantization`), None (full precision), "int8" or "int4"."""
    def __init__(self, model: str = DEFAULT_MODEL, *, max_model_len: int = 2048, max_num_seqs: int = 16,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, dtype: str = "float32", device: str = "cpu",
                 seed: int = 0, speculative_config="auto", enforce_eager: bool | None = None,
                 compile_sizes: tuple[int, ...] | None = None, quantization: str | None = "auto",
                 enable_prefix_caching: bool = True, tensor_parallel_size: int = 1,
                 async_scheduling: bool = False, kv_cache_memory: int | str | None = None,
                 kv_cache_dtype: str = "auto"):
        if isinstance(speculative_config, str) and speculative_config.strip().lower() == "auto":
            speculative_config = default_speculative_config(model)
        spec = SpeculativeConfig.from_any(speculative_config)
        quantization = resolve_quantization(model, quantization)
        cfg = EngineConfig(model=model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens or max(max_model_len, 512),
                           block_size=block_size, num_kv_blocks=num_kv_blocks, dtype=dtype,
                           device=device, seed=seed, speculative_config=spec,
                           enforce_eager=enforce_eager, compile_sizes=compile_sizes,
                           quantization=quantization, enable_prefix_caching=enable_prefix_caching,
                           tensor_parallel_size=tensor_parallel_size, async_scheduling=async_scheduling,
                           kv_cache_memory=None if kv_cache_memory is None else parse_bytes(kv_cache_memory),
                           kv_cache_dtype=kv_cache_dtype)
        self.engine = LLMEngine(cfg)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _add_all(self, prompts, sampling_params) -> list[str]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        # validate every prompt before queueing any, so bad input leaves nothing half-added
        for p, sp in zip(prompts, params):
            _, ids = self.engine.tokenize_prompt(p)
            if len(ids) >= self.engine.config.max_model_len:
                raise ValueError(f"prompt is {len(ids)} tokens, longer than max_model_len="
                                 f"{self.engine.config.max_model_len} allows")
        return [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        ids = self._add_all(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [final[i] for i in ids]

    def stream(self, prompt, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (with `new_text` / `new_token_ids`) after every step that produced tokens."""
        (rid,) = self._add_all([prompt], sampling_params)
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def apply_chat_template(self, messages) -> str:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (list of dicts) or several (list of lists)."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.apply_chat_template(m) for m in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> dict:
        return self.engine.get_metrics()

    def shutdown(self) -> None:
        """Release the engine's worker processes (tensor parallelism); the LLM is unusable after."""
        self.engine.shutdown()
