"""The Worker: owns the model's whole life in this process, so that the engine keeps only requests.

Built in one pass, in this order (each step needs the ones before it):

1. the CPU kernels start building on a thread (first run only) while the target loads from its
   model family and weight format (models/loader.py); tensor-parallel ranks start first, since
   rank 0 shards its copy as they shard theirs;
2. a GGUF target's own blocks are read once (its int4 layers and embedding stay exact);
3. the tokenizer and the EOS ids;
4. the drafter, built on the full target (its view of the embedding and LM head before sharding);
5. the linears quantized / repacked for the execution mode, the fused layer kernels enabled;
6. the KV dtype made concrete and the paged pool sized (target and drafter layers);
7. the ModelRunner (wrapped for tensor parallelism), then the step-cost table the draft allocation
   reads (measured once per model and machine, cached on disk).

The engine talks to it through the step contract (draftwise/step.py): `execute(SchedulerOutput)`
(or `prepare` + `run` with async scheduling) returns a ModelRunnerOutput, `propose` the next
step's drafts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import threading

import torch

from draftwise.config import EngineConfig, ModelConfig, cache_dir, default_kv_tokens
from draftwise.inputs import set_chat_template
from draftwise.distributed.tensor_parallel import DrafterTargetView, check_divisibility, shard_target
from draftwise.kernels import attention_reads_16bit, kernels_id
from draftwise.kernels import load as load_kernels
from draftwise.layers.fused_layer import enable_fused_layers
from draftwise.layers.linear import prepare_linears_for_inference
from draftwise.layers.quant import GroupAffineEmbedding, quantize_model
from draftwise.machine import available_memory
from draftwise.models.gguf_weights import GGUFBlocks
from draftwise.models.loader import (gguf_path_for, load_target_model, load_tokenizer, read_config_json,
                                     resolve_model_dir)
from draftwise.spec_decode.factory import build_proposer
from draftwise.spec_decode.proposer import NextStep, Proposer
from draftwise.step import ModelRunnerOutput, SchedulerOutput
from draftwise.worker.model_runner import ModelRunner, StepInputs, StepTimer
from draftwise.worker.tensor_parallel import TensorParallelRunner, TPDriver, threads_per_rank

# seconds the start-up step-cost table may spend on extra rounds (best of more rounds on a busy
# machine); the fixed rounds run whatever the budget
STEP_COST_BUDGET_S = 1.5

logger = logging.getLogger("draftwise")


def resolve_kv_cache_dtype(config: EngineConfig) -> EngineConfig:
    """`kv_cache_dtype="auto"` made concrete: bf16 for quantized weights with fp32 activations on a
    CPU whose row-invariant attention kernel reads 16-bit caches in registers (half the memory at the
    same speed; those targets' linears take bf16 activations already), else the model's dtype
    (without the kernel a 16-bit cache would fall back to per-row SDPA)."""
    if config.kv_cache_dtype != "auto":
        return config
    kv = config.dtype
    if config.quantization is not None and config.dtype == "float32" and torch.device(config.device).type == "cpu" \
            and attention_reads_16bit():
        kv = "bfloat16"
    return dataclasses.replace(config, kv_cache_dtype=kv)


class Worker:
    def __init__(self, config: EngineConfig):
        if config.quantization is not None and torch.device(config.device).type == "cpu":
            # the CPU kernels build (first run only, a compiler subprocess) while the weights load
            threading.Thread(target=load_kernels, name="draftwise-kernel-build", daemon=True).start()
        torch.manual_seed(config.seed)
        self.tp = start_tensor_parallel(config) if config.tensor_parallel_size > 1 else None
        self.model, self.model_cfg, self.model_path = load_target_model(
            config.model, config.torch_dtype, config.device,
            max_position=config.max_model_len + 256, quantization=config.quantization)
        drafter_target = self._shard_target(config)
        blocks = self._gguf_blocks(config)
        self._keep_embedding_quantized(config, blocks)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        set_chat_template(self.tokenizer, config.chat_template)
        self.eos_token_ids = self._eos_token_ids()
        self.proposer: Proposer | None = None
        if config.speculative_config is not None:
            self.proposer = build_proposer(config.speculative_config, drafter_target, self.model_cfg, config,
                                           self.model_path)
        self._prepare_linears(config, blocks)
        del blocks
        self.config = config = resolve_kv_cache_dtype(config)     # before the KV pool is sized
        self.lookahead = self.proposer.num_lookahead_tokens if self.proposer else 0
        self.num_kv_blocks = config.num_kv_blocks or self._kv_blocks_for_budget()
        runner = ModelRunner(config, self.model, self.model_cfg, self.proposer, self.num_kv_blocks)
        # every tensor-parallel rank runs the same runner on rank 0's SchedulerOutput
        self.runner = TensorParallelRunner(runner, self.tp) if self.tp is not None else runner
        self.step_costs = self._measured_step_costs() if self.proposer is not None else None

    # --- the step contract --------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched)

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """A step's tensors, built on the engine thread (async scheduling runs them with `run`)."""
        return self.runner.prepare(sched)

    def run(self, inputs: StepInputs) -> ModelRunnerOutput:
        return self.runner.run(inputs)

    def propose(self, step: ModelRunnerOutput, num_tokens: int, max_requests: int | None = None,
                next_step: NextStep | None = None):
        """Drafts for the next step, one per scheduled request (None where it gets none); with
        `max_requests`, for at most that many of them; `next_step`: what they are weighed against."""
        if self.proposer is not None:        # a call that drafts for none leaves it at 0
            self.proposer.last_catch_up_seconds = 0.0
        return self.runner.propose(step, num_tokens, max_requests, next_step)

    @property
    def catch_up_seconds(self) -> float:
        """Seconds of the last `propose` the drafter spent catching up (Proposer.last_catch_up_seconds)."""
        return self.proposer.last_catch_up_seconds if self.proposer is not None else 0.0

    def on_request_finished(self, request) -> None:
        if self.proposer is not None:
            self.proposer.on_request_finished(request)

    @property
    def timer(self) -> StepTimer:
        return self.runner.timer

    @property
    def expected_acceptance(self) -> float | None:
        """The drafter's acceptance prior (its training curve), where it has one."""
        return getattr(self.proposer, "expected_acceptance", None)

    @property
    def fault(self) -> str | None:
        """Why no step can run any more (a tensor-parallel rank died), None while healthy."""
        return self.tp.broken if self.tp is not None else None

    def record_hidden_states(self, layers: tuple[int, ...], recorder) -> None:
        """Keep the residual entering `layers` and the final hidden state of every fed row:
        `recorder.record(scheduled, cache_positions, output)` runs after each target forward
        (training data generation)."""
        self.model.set_aux_hidden_state_layers(layers)
        self.runner.hidden_recorder = recorder

    def shutdown(self) -> None:
        if self.tp is not None:
            self.tp.shutdown()

    # --- construction ---------------------------------------------------------------------------------
    def _shard_target(self, config: EngineConfig):
        """With tensor parallelism: rank 0's shard of the target; returns what the drafter reads of
        the target (the whole embedding and LM head, copied before sharding), else the target."""
        if self.tp is None:
            return self.model
        emb = self.model.embed_tokens.weight.detach().clone()
        head = emb if self.model_cfg.tie_word_embeddings else self.model.lm_head.weight.detach().clone()
        view = DrafterTargetView(self.model, emb, head)
        shard_target(self.model, 0, config.tensor_parallel_size)
        return view

    def _gguf_blocks(self, config: EngineConfig):
        """int4 on a GGUF: the file's own blocks (models/gguf_weights.py, decoded on demand), so
        its Q4_1 / Q4_0 layer weights and its embedding stay exact; {} otherwise ("gguf" models are
        built from their blocks by the loader)."""
        gguf = gguf_path_for(config.model)
        if gguf is None or config.quantization != "int4" or self.tp is not None:
            return {}
        return GGUFBlocks(gguf)

    def _keep_embedding_quantized(self, config: EngineConfig, blocks) -> None:
        """Look tokens up in the GGUF's own embedding blocks instead of the dense fp32 table (exact;
        a quarter of the table's memory or less). Done before the drafters are built, since they
        share the target's embedding; the LM head keeps reading the dense weight until the
        quantization replaces it."""
        parts = blocks.get("embed_tokens")
        if not parts or tuple(parts[0].codes.shape) != tuple(self.model.embed_tokens.weight.shape):
            return
        self.model.embed_tokens = GroupAffineEmbedding(parts[0], dtype=config.torch_dtype).to(config.device)

    def _eos_token_ids(self) -> tuple[int, ...]:
        eos = tuple(self.model_cfg.eos_token_ids)
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        return eos + (tok_eos,) if tok_eos is not None and tok_eos not in eos else eos

    def _prepare_linears(self, config: EngineConfig, blocks) -> None:
        """Weight-only quantization (layers/quant.py), else, on CPU, the weight layout the execution
        mode reads fastest (layers/linear.py); the drafter's linears get the same treatment (int8
        per channel when quantizing: its weights are not GGUF blocks, and 8 bits keep it close)."""
        draft = getattr(self.proposer, "model", None)
        if config.quantization is not None:
            if config.quantization != "gguf":         # a "gguf" model was built on its blocks by the loader
                quantize_model(self.model, config.quantization, blocks)
            if draft is not None:
                quantize_model(draft, "int8")
            if config.quantization in ("int4", "gguf") and config.enforce_eager and hasattr(self.model, "layers"):
                enable_fused_layers(self.model)       # eager steps: each decoder layer in two C++ calls
            return
        if torch.device(config.device).type == "cpu" and self.tp is None:
            # compiled graphs read a transposed copy of every weight (and only that copy)
            compiled = not config.enforce_eager
            prepare_linears_for_inference(self.model, compiled)
            if draft is not None:
                prepare_linears_for_inference(draft, compiled)

    def _kv_blocks_for_budget(self) -> int:
        """Blocks of the KV pool (target and drafter layers, the KV dtype): what kv_cache_memory
        holds, else the default token count (config.default_kv_tokens, for kv_pool_seqs sequences
        or max_num_seqs) capped at a quarter of the available memory; at least one full sequence,
        at most four times that many full sequences (blocks beyond the running sequences keep
        finished prefixes for the prefix cache; a small model needs no more)."""
        c, m = self.config, self.model_cfg
        specs = [(m.num_key_value_heads, m.head_dim)] * m.num_hidden_layers
        if self.proposer is not None:
            specs += self.proposer.kv_layer_specs()
        elem = torch.empty((), dtype=c.kv_torch_dtype).element_size()
        per_block = c.block_size * sum(2 * h * d * elem for h, d in specs)
        blocks_per_seq = math.ceil((c.max_model_len + self.lookahead + 1) / c.block_size)
        pool_seqs = max(c.max_num_seqs, c.kv_pool_seqs or 0)
        if c.kv_cache_memory is not None:
            fit = c.kv_cache_memory // per_block
            if fit < blocks_per_seq:
                raise ValueError(f"kv_cache_memory={c.kv_cache_memory} bytes holds {fit} KV blocks of {c.block_size} "
                                 f"tokens, less than one sequence of max_model_len={c.max_model_len} needs "
                                 f"({blocks_per_seq} blocks, {blocks_per_seq * per_block} bytes)")
        else:
            fit = math.ceil(default_kv_tokens(pool_seqs, c.max_model_len) / c.block_size)
            avail = available_memory()
            if avail is not None:
                fit = min(fit, avail // 4 // per_block)
            fit = max(fit, blocks_per_seq)
        return int(min(fit, 4 * blocks_per_seq * pool_seqs))

    def _measured_step_costs(self) -> dict[int, float]:
        """Target step seconds by token count for the draft allocation and the adaptive policy:
        token counts up to 64 measured (a few seconds at start-up, once per model and machine);
        past that the cost is about linear in the tokens and is extrapolated. Besides the powers
        of two, one token past each from 4 on: the step's cost is not linear between them (the
        linears run rows in register tiles of 8 on AVX-512 and 4 on AVX2) - a 9th row cost 20 %
        of an 8-row step on Zen 4, where interpolating between 8 and 16 said 9 %."""
        c = self.config
        k = c.speculative_config.num_speculative_tokens
        limit = max(2, min(c.max_num_batched_tokens, c.max_num_seqs * (1 + k), 64))
        powers = [1 << i for i in range(7) if 1 << i < limit]
        sizes = sorted(set(powers) | {p + 1 for p in powers if p >= 4 and p + 1 < limit} | {limit})
        return self._step_costs(sizes)

    def _step_costs(self, sizes) -> dict[int, float]:
        """Start-up table of target step costs, measured once per model, execution mode and
        machine and cached on disk (a restart reads it back)."""
        c = self.config
        key = json.dumps(["v2", os.path.abspath(self.model_path), c.quantization, bool(c.enforce_eager), c.dtype, c.device,
                          torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), torch.__version__, kernels_id(),
                          c.block_size, c.tensor_parallel_size, list(sizes)])
        path = os.path.join(cache_dir(), "step_costs", hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
        try:
            with open(path) as f:
                return {int(k): float(v) for k, v in json.load(f).items()}
        except (OSError, ValueError):
            pass
        costs = self.runner.measure_target_costs(sizes, budget_s=STEP_COST_BUDGET_S)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(costs, f)
        os.replace(path + ".tmp", path)
        return costs


def start_tensor_parallel(config: EngineConfig) -> TPDriver:
    """Check the sharding fits, then start the worker ranks (rank 0 is this process)."""
    world = config.tensor_parallel_size
    if config.quantization is not None:
        raise ValueError("quantization together with tensor parallelism is not supported")
    check_divisibility(ModelConfig.from_hf_dict(read_config_json(resolve_model_dir(config.model))), world)
    if not config.enforce_eager:
        raise ValueError("tensor parallelism runs eager steps: compiled graphs (--compile / "
                         "enforce_eager=False) are not supported with tensor_parallel_size > 1")
    torch.set_num_threads(threads_per_rank(world))
    return TPDriver(config, world)
