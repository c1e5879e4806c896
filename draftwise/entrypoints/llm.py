"""The offline API: `LLM(model, ...).generate(prompts, sampling_params)` and `.chat(messages)`."""
from __future__ import annotations

from typing import Iterator

from draftwise.engine.engine import LLMEngine
from draftwise.engine_args import EngineArgs
from draftwise.models.loader import DEFAULT_MODEL
from draftwise.outputs import RequestOutput
from draftwise.sampling_params import SamplingParams
from draftwise.inputs import apply_chat_template

class LLM:
    """`LLM(model, **options)`: the options are EngineArgs' fields (engine_args.py), e.g.
    `speculative_config` - "auto" (default: suffix decoding, the measured fastest), None (plain
    decoding), or a dict / JSON string (SpeculativeConfig's keys) -, `quantization` - "auto"
    (default: the model's own weight format), None, "gguf", "int8" or "int4" -, `enforce_eager` (default
    True; False compiles the step's graphs), `max_model_len`, `max_num_seqs`, `threads`."""

    def __init__(self, model: str = DEFAULT_MODEL, **options):
        self._start(EngineArgs(model=model, **options))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm._start(args)
        return llm

    def _start(self, args: EngineArgs) -> None:
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
        self.engine = LLMEngine(args.create_engine_config())

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
        return apply_chat_template(self.engine.tokenizer, messages)

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
