"""LLMEngine: owns the scheduler, the model runner and the tokenizer; `step()` advances every
running request by one (speculative) step and reports what changed."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import time

import torch

from draftwise.config import EngineConfig, SpeculativeConfig
from draftwise.engine.errors import EngineFault
from draftwise.engine.request import Request
from draftwise.engine.scheduler import RequestUpdate, Scheduler, SchedulerOutput
from draftwise.inputs import tokenize_prompt
from draftwise.models.loader import load_target_model, load_tokenizer
from draftwise.outputs import CompletionOutput, RequestOutput, TokenTrace
from draftwise.sampling_params import SamplingParams
from draftwise.spec_decode.allocation import DraftAllocator, StepCosts
from draftwise.spec_decode.metrics import SpecDecodingStats
from draftwise.worker.model_runner import ModelRunner

logger = logging.getLogger("draftwise")


def resolve_kv_cache_dtype(config: EngineConfig) -> EngineConfig:
    """`kv_cache_dtype="auto"` made concrete: bf16 for quantized weights with fp32 activations on a
    CPU whose row-invariant attention kernel reads 16-bit caches in registers (half the memory at the
    same speed; those targets' linears take bf16 activations already), else the model's dtype
    (without the kernel a 16-bit cache would fall back to per-row SDPA)."""
    if config.kv_cache_dtype != "auto":
        return config
    kv = config.dtype
    if config.quantization is not None and config.dtype == "float32" and torch.device(config.device).type == "cpu":
        from draftwise.kernels import attention_reads_16bit
        if attention_reads_16bit():
            kv = "bfloat16"
    return dataclasses.replace(config, kv_cache_dtype=kv)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.quantization is not None and torch.device(config.device).type == "cpu":
            # the CPU kernels build (first run only, a compiler subprocess) while the weights load
            from draftwise.kernels import load as load_kernels
            threading.Thread(target=load_kernels, name="draftwise-kernel-build", daemon=True).start()
        torch.manual_seed(config.seed)
        self.tp = self._start_tensor_parallel() if config.tensor_parallel_size > 1 else None
        self.model, self.model_cfg, self.model_path = load_target_model(
            config.model, config.torch_dtype, config.device,
            max_position=config.max_model_len + 256, quantization=config.quantization)
        drafter_target = self.model
        if self.tp is not None:
            from draftwise.distributed.tensor_parallel import DrafterTargetView, shard_target
            emb = self.model.embed_tokens.weight.detach().clone()
            head = emb if self.model_cfg.tie_word_embeddings else self.model.lm_head.weight.detach().clone()
            drafter_target = DrafterTargetView(self.model, emb, head)
            shard_target(self.model, 0, config.tensor_parallel_size)
        blocks = self._gguf_blocks()               # int4 on a GGUF: its own blocks, read once
        self._keep_embedding_quantized(blocks)
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = tuple(self.model_cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None \
                and self.tokenizer.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids += (self.tokenizer.eos_token_id,)
        self.spec_config: SpeculativeConfig | None = config.speculative_config
        self.proposer = None
        self.num_spec_tokens = 0
        if self.spec_config is not None:
            from draftwise.spec_decode.factory import build_proposer
            self.proposer = build_proposer(self.spec_config, drafter_target, self.model_cfg, config,
                                           self.model_path)
            self.num_spec_tokens = self.spec_config.num_speculative_tokens
        self._prepare_linears(blocks)
        del blocks
        self.config = config = resolve_kv_cache_dtype(config)     # before the KV pool is sized
        lookahead = self.proposer.num_lookahead_tokens if self.proposer else 0
        num_blocks = config.num_kv_blocks or self._kv_blocks_for_budget(lookahead)
        self.runner = ModelRunner(config, self.model, self.model_cfg, self.proposer, num_blocks)
        if self.tp is not None:            # every rank runs the same runner on rank 0's SchedulerOutput
            from draftwise.distributed.worker import TensorParallelRunner
            self.runner = TensorParallelRunner(self.runner, self.tp)
        step_costs = self._measured_step_costs() if self.proposer is not None else None
        allocator = None
        if step_costs is not None and self.spec_config.allocate_drafts:
            allocator = DraftAllocator(StepCosts(step_costs))
        self.scheduler = Scheduler(config, num_blocks, lookahead, allocator)
        self.spec_stats = SpecDecodingStats()
        self.spec_stats_by_source: dict[str, SpecDecodingStats] = {}
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.policy = None
        if self.spec_config is not None and self.spec_config.adaptive:
            from draftwise.spec_decode.policy import SpeculationPolicy
            self.policy = SpeculationPolicy(self.num_spec_tokens,
                                            prior_acceptance=getattr(self.proposer, "expected_acceptance", None))
            self.policy.set_step_costs(step_costs)
        self.num_steps = 0
        self._inflight = None                 # async scheduling: (SchedulerOutput, Future) of the running step
        self._grammar_compiler = None
        self._pool = None

    def _kv_blocks_for_budget(self, lookahead: int) -> int:
        """Blocks of the KV pool (target and drafter layers, the KV dtype): what kv_cache_memory
        holds, else the default token count (config.default_kv_tokens) capped at a quarter of the
        available memory; at least one full sequence, at most four times max_num_seqs full
        sequences (blocks beyond the running sequences keep finished prefixes for the prefix cache;
        a small model needs no more)."""
        from draftwise.config import default_kv_tokens
        from draftwise.machine import available_memory
        c, m = self.config, self.model_cfg
        specs = [(m.num_key_value_heads, m.head_dim)] * m.num_hidden_layers
        if self.proposer is not None:
            specs += self.proposer.kv_layer_specs()
        elem = torch.empty((), dtype=c.kv_torch_dtype).element_size()
        per_block = c.block_size * sum(2 * h * d * elem for h, d in specs)
        blocks_per_seq = math.ceil((c.max_model_len + lookahead + 1) / c.block_size)
        if c.kv_cache_memory is not None:
            fit = c.kv_cache_memory // per_block
            if fit < blocks_per_seq:
                raise ValueError(f"kv_cache_memory={c.kv_cache_memory} bytes holds {fit} KV blocks of {c.block_size} "
                                 f"tokens, less than one sequence of max_model_len={c.max_model_len} needs "
                                 f"({blocks_per_seq} blocks, {blocks_per_seq * per_block} bytes)")
        else:
            fit = math.ceil(default_kv_tokens(c.max_num_seqs, c.max_model_len) / c.block_size)
            avail = available_memory()
            if avail is not None:
                fit = min(fit, avail // 4 // per_block)
            fit = max(fit, blocks_per_seq)
        return int(min(fit, 4 * blocks_per_seq * c.max_num_seqs))

    def _measured_step_costs(self) -> dict[int, float]:
        """Target step seconds by token count for the draft allocation and the adaptive policy:
        token counts up to 64 measured (a few seconds at start-up, once per model and machine);
        past that the cost is about linear in the tokens and is extrapolated."""
        c = self.config
        limit = max(2, min(c.max_num_batched_tokens, c.max_num_seqs * (1 + self.num_spec_tokens), 64))
        sizes = sorted({1 << i for i in range(7) if 1 << i < limit} | {limit})
        return self._step_costs(sizes)

    def _step_costs(self, sizes) -> dict[int, float]:
        """Start-up table of target step costs, measured once per model, execution mode and
        machine and cached on disk (a restart reads it back)."""
        import hashlib
        import json
        import os
        from draftwise.config import cache_dir
        c = self.config
        key = json.dumps([os.path.abspath(self.model_path), c.quantization, bool(c.enforce_eager), c.dtype, c.device,
                          torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), torch.__version__,
                          c.block_size, c.tensor_parallel_size, list(sizes)])
        path = os.path.join(cache_dir(), "step_costs", hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
        try:
            with open(path) as f:
                return {int(k): float(v) for k, v in json.load(f).items()}
        except (OSError, ValueError):
            pass
        costs = self.runner.measure_target_costs(sizes)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(costs, f)
        os.replace(path + ".tmp", path)
        return costs

    def _start_tensor_parallel(self):
        """Check the sharding fits, then start the worker ranks (rank 0 is this process)."""
        from draftwise.config import ModelConfig
        from draftwise.distributed.tensor_parallel import check_divisibility
        from draftwise.distributed.worker import TPDriver, threads_per_rank
        from draftwise.models.loader import read_config_json, resolve_model_dir
        config, world = self.config, self.config.tensor_parallel_size
        if config.quantization is not None:
            raise ValueError("quantization together with tensor parallelism is not supported")
        check_divisibility(ModelConfig.from_hf_dict(read_config_json(resolve_model_dir(config.model))), world)
        if not config.enforce_eager:
            raise ValueError("tensor parallelism runs eager steps: compiled graphs (--compile / "
                             "enforce_eager=False) are not supported with tensor_parallel_size > 1")
        torch.set_num_threads(threads_per_rank(world))
        return TPDriver(config, world)

    def shutdown(self) -> None:
        """Finish an in-flight step and stop worker threads / tensor-parallel workers (idempotent)."""
        if self._inflight is not None:
            self._inflight[1].result()
            self._inflight = None
            self.scheduler.end_flight()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.tp is not None:
            self.tp.shutdown()

    def _gguf_blocks(self):
        """int4 on a GGUF: the file's own blocks (models/gguf_weights.py, decoded on demand), so
        its Q4_1 / Q4_0 layer weights and its embedding stay exact; {} otherwise ("gguf" models are
        built from their blocks by the loader)."""
        from draftwise.models.loader import gguf_path_for
        gguf = gguf_path_for(self.config.model)
        if gguf is None or self.config.quantization != "int4" or self.tp is not None:
            return {}
        from draftwise.models.gguf_weights import GGUFBlocks
        return GGUFBlocks(gguf)

    def _keep_embedding_quantized(self, blocks) -> None:
        """Look tokens up in the GGUF's own embedding blocks instead of the dense fp32 table (exact;
        a quarter of the table's memory or less). Done before the drafters are built, since they
        share the target's embedding; the LM head keeps reading the dense weight until the
        quantization below replaces it."""
        parts = blocks.get("embed_tokens")
        if not parts or tuple(parts[0].codes.shape) != tuple(self.model.embed_tokens.weight.shape):
            return
        from draftwise.layers.quant import GroupAffineEmbedding
        self.model.embed_tokens = GroupAffineEmbedding(parts[0], dtype=self.config.torch_dtype).to(self.config.device)

    def _prepare_linears(self, blocks) -> None:
        """Weight-only quantization (layers/quant.py), else, on CPU, the weight layout the execution
        mode reads fastest (layers/linear.py); the drafter's linears get the same treatment (int8
        per channel when quantizing: its weights are not GGUF blocks, and 8 bits keep it close)."""
        config = self.config
        draft = getattr(self.proposer, "model", None)
        if config.quantization is not None:
            from draftwise.layers.quant import quantize_model
            if config.quantization != "gguf":         # a "gguf" model was built on its blocks by the loader
                quantize_model(self.model, config.quantization, blocks)
            if draft is not None:
                quantize_model(draft, "int8")
            if config.quantization in ("int4", "gguf") and config.enforce_eager and hasattr(self.model, "layers"):
                # eager steps: each decoder layer in two C++ calls around attention
                from draftwise.layers.fused_layer import enable_fused_layers
                enable_fused_layers(self.model)
            return
        if torch.device(config.device).type == "cpu" and self.tp is None:
            # compiled graphs read a transposed copy of every weight (and only that copy)
            from draftwise.layers.linear import prepare_linears_for_inference
            compiled = not config.enforce_eager
            prepare_linears_for_inference(self.model, compiled)
            if draft is not None:
                prepare_linears_for_inference(draft, compiled)

    # --- requests ----------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, longer than max_model_len={self.config.max_model_len} "
                             "allows (it must leave room for at least one new token)")
        vocab = self.model_cfg.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.top_k >= vocab:           # keeping every token: the same as no top-k (as vLLM clamps)
            params = dataclasses.replace(params, top_k=-1)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        for name in ("logit_bias", "allowed_token_ids"):
            bad = [t for t in (getattr(params, name) or ()) if t >= vocab]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        req = Request(rid, ids, params, text, self.eos_token_ids)
        if params.bad_words:
            req.bad_words_ids = self._bad_words_ids(params.bad_words)
        if params.structured_output is not None:
            from draftwise.structured_output import RequestGrammar
            req.grammar = RequestGrammar(self.compile_grammar(params.structured_output))
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences of each bad word, alone and after a space (as vLLM bans them)."""
        if self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer")
        out = []
        for w in words:
            for text in (w, " " + w.lstrip()):
                ids = self.tokenizer(text, add_special_tokens=False).input_ids
                if ids and ids not in out:
                    out.append(ids)
        return out

    def compile_grammar(self, spec):
        """The compiled grammar of a StructuredOutputParams (cached per spec; the server calls this
        on its prompt-preparation thread first, so the engine thread finds it compiled)."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        if self._grammar_compiler is None:
            from draftwise.structured_output import GrammarCompiler
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids)
        return self._grammar_compiler.compile(spec)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; returns its final output (finish_reason "abort"), None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if not req.is_finished:
            self.scheduler.finish(req, "abort")
            if self.proposer is not None:
                self.proposer.on_request_finished(req)
        return self._make_output(req, [], "")

    @property
    def fault(self) -> str | None:
        """Why the engine can no longer step (a tensor-parallel rank died), None while healthy."""
        return self.tp.broken if self.tp is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # --- one step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.config.async_scheduling:
            return self._step_async()
        t0, fwd0 = time.perf_counter(), self.runner.timer.totals.get("target_forward", 0.0)
        draft0 = self.runner.timer.totals.get("drafting", 0.0)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return self._nothing_scheduled()
        try:
            step = self.runner.execute(sched)
        except EngineFault:
            raise
        except Exception as err:             # noqa: BLE001 - find whose fault it was
            return self._emit(self._isolate(sched, err))
        items = self._apply(sched, step)
        self._propose(sched, step)
        outputs = self._emit(items)
        allocator = self.scheduler.draft_allocator
        if allocator is not None:            # what this step cost, for the allocation's cost model
            # (drafting apart: the allocator weighs it separately, against skipping the drafter)
            fwd = self.runner.timer.totals.get("target_forward", 0.0) - fwd0
            drafting = self.runner.timer.totals.get("drafting", 0.0) - draft0
            allocator.costs.observe_step(sum(len(s.token_ids) for s in sched.scheduled), fwd,
                                         time.perf_counter() - t0 - fwd - drafting)
        return outputs

    def _nothing_scheduled(self) -> list[RequestOutput]:
        if not self.scheduler.running and self.scheduler.waiting:
            raise RuntimeError("the KV pool cannot hold the next waiting request")
        return []

    # --- async scheduling -------------------------------------------------------------------------
    def _step_async(self) -> list[RequestOutput]:
        """One step with the model running on a worker thread (async scheduling).

        What overlaps with step n on the model thread: the KV blocks step n+1 may need are reserved
        for the worst case (every draft of step n accepted, the next draft at full length), and the
        outputs of step n-1 are detokenized and returned. Step n+1 itself is scheduled and its
        tensors built only once step n's accepted tokens are applied and the next drafts proposed,
        because those decide its token ids, positions and slots; it is then launched at once, before
        step n's outputs are detokenized. (Building step n+1 with provisional positions during step n
        and correcting them afterwards would also hide scheduling and input preparation; measured on
        CPU they are ~1-2 % of a step - the target's forward is 91-93 % - so it is not done.)
        Requests that finish while a step is in flight (a stop string, an abort) release their blocks
        when that step has completed; its results for them are dropped. Outputs are unchanged."""
        if self._inflight is None:
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                return self._nothing_scheduled()
            failed = self._launch(sched)
            if failed is not None:
                return self._emit(failed)
        sched, fut = self._inflight
        self.scheduler.reserve_ahead(sched, self.num_spec_tokens)
        try:
            step = fut.result()
        except Exception as err:             # noqa: BLE001 - the model thread failed: isolate, recover
            step = err
        finally:
            self._inflight = None
            self.scheduler.end_flight()
        if isinstance(step, EngineFault):
            raise step
        if isinstance(step, Exception):
            return self._emit(self._isolate(sched, step))
        items = self._apply(sched, step)
        self._propose(sched, step)
        nxt = self.scheduler.schedule()
        if nxt.scheduled:
            items += self._launch(nxt) or []
        return self._emit(items)

    def _launch(self, sched) -> list | None:
        """Start `sched` on the model thread; if preparing it fails, run it through `_isolate`
        instead and return those items."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="draftwise-model")
        try:
            inputs = self.runner.prepare(sched)      # tensors built here: the scheduler may move on
        except EngineFault:
            raise
        except Exception as err:                     # noqa: BLE001
            return self._isolate(sched, err)
        self.scheduler.begin_flight(sched)
        self._inflight = (sched, self._pool.submit(self.runner.run, inputs))
        return None

    # --- failure isolation ------------------------------------------------------------------------
    def _isolate(self, sched: SchedulerOutput, err: Exception) -> list[RequestUpdate]:
        """A step raised `err`. Run each of its requests in a step of its own, so that a failure
        attributable to one request (its sampling parameters, stop conditions, grammar ...) fails that
        request alone with a clear error while the others advance as usual. A step's K/V writes are
        positions the request had not yet computed, so re-running them is harmless. If several
        requests were in the step and every one of them fails on its own too, the fault is the
        engine's: `EngineFault` is raised and the caller decides (the server fails the batch and keeps
        serving)."""
        scheds = [s for s in sched.scheduled if not s.request.is_finished]
        logger.warning("a step of %d request(s) failed (%s: %s); running them one at a time",
                       len(scheds), type(err).__name__, err)
        items, failures = [], []
        for s in scheds:
            solo = SchedulerOutput([s])
            try:
                step = self.runner.execute(solo)
            except EngineFault:
                raise
            except Exception as e:               # noqa: BLE001
                failures.append((s.request, e))
                continue
            items += self._apply(solo, step)
            self._propose(solo, step)
        if len(scheds) > 1 and len(failures) == len(scheds):
            raise EngineFault(f"every request of the step failed: {type(err).__name__}: {err}") from err
        for req, e in failures:
            logger.error("request %s failed: %s: %s", req.request_id, type(e).__name__, e)
            items.append(self.scheduler.fail(req, f"{type(e).__name__}: {e}"))
        return items

    # --- the phases of a step ---------------------------------------------------------------------
    def _apply(self, sched: SchedulerOutput, step) -> list[RequestUpdate]:
        """Hand a step's result to the scheduler (it owns request state) and count drafts."""
        t0 = time.perf_counter()
        updates = self.scheduler.update_from_output(sched, step)
        for u in updates:
            if u.num_draft_tokens:
                self._observe_drafts(u)
        self.runner.timer.add("bookkeeping", time.perf_counter() - t0)
        self.num_steps += 1
        return updates

    def _observe_drafts(self, u: RequestUpdate) -> None:
        self.spec_stats.observe(u.num_draft_tokens, u.num_accepted)
        src = u.draft_source or self.spec_config.method
        self.spec_stats_by_source.setdefault(src, SpecDecodingStats()).observe(u.num_draft_tokens, u.num_accepted)
        if self.policy is not None and src == self.spec_config.method:
            # the policy sizes the model drafter: it learns from that drafter's drafts only
            self.policy.observe_acceptance(u.num_draft_tokens, u.num_accepted)

    def _propose(self, sched: SchedulerOutput, step) -> None:
        """Drafts for the next step (or none, where the adaptive policy says plain decoding pays)."""
        k = self.num_spec_tokens
        if self.policy is not None:
            k = self.policy.choose(len(self.scheduler.running))
        allocator = self.scheduler.draft_allocator
        if (self.policy is not None and k == 0) or (allocator is not None and not self.scheduler.must_draft()
                                                    and not allocator.worth_drafting(*self.scheduler.next_step_shape())):
            # plain decoding this step: skip the drafter entirely (its KV for these positions goes
            # stale, which can only lower later acceptance, never change outputs)
            return
        t_draft = time.perf_counter()
        try:
            drafts = self.runner.propose(step, k)
        except Exception:                    # noqa: BLE001 - drafts only ever save time
            logger.exception("the drafter failed; this step's requests decode without drafts")
            return
        t_draft = time.perf_counter() - t_draft
        if self.policy is not None:
            self.policy.observe_draft_time(len(sched.scheduled), k, t_draft)
        if allocator is not None:
            allocator.observe_drafting(t_draft)
        self.scheduler.add_drafts(sched, drafts)

    def _emit(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """Detokenize (stop strings) and build the step's outputs."""
        t0 = time.perf_counter()
        outputs = []
        now = time.time()
        for u in updates:
            req = u.request
            new_text = self._detokenize(req, u)
            if req.is_finished:
                req.metrics.finished_time = now
            outputs.append(self._make_output(req, u.new_token_ids, new_text, u.new_logprobs))
        for o in outputs:
            if o.finished:
                req = self.requests.pop(o.request_id, None)
                if req is not None and self.proposer is not None:
                    self.proposer.on_request_finished(req)
        self.runner.timer.add("bookkeeping", time.perf_counter() - t0)
        return outputs

    def _detokenize(self, req: Request, u: RequestUpdate) -> str:
        """Append the text of the step's new tokens (incrementally: linear in the output) and apply
        stop strings; returns the text added by this step. Traced requests get a TokenTrace per
        token (the step's first `num_accepted` tokens are the accepted drafts)."""
        appended = u.new_token_ids
        if self.tokenizer is None:
            return ""
        if req.detokenizer is None:
            from draftwise.engine.detokenizer import IncrementalDetokenizer
            req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        old = req.text
        if req.spec_trace is None:
            text = old + req.detokenizer.add(appended)
        else:
            pieces = [req.detokenizer.add([t]) for t in appended]
            req.spec_trace.extend(TokenTrace(t, p, u.draft_source if j < u.num_accepted else None, req.num_steps - 1)
                                  for j, (t, p) in enumerate(zip(appended, pieces)))
            text = old + "".join(pieces)
        if req.params.stop and len(text) > len(old):
            search_from = max(0, len(old) - max(len(s) for s in req.params.stop) + 1)
            hits = [i for i in (text.find(s, search_from) for s in req.params.stop) if i >= 0]
            if hits:
                text = text[:min(hits)]
                if req.is_finished:
                    req.finish_reason = "stop"
                else:
                    self.scheduler.finish(req, "stop")
        req.text = text
        if req.spec_trace is not None and req.is_finished:
            req.spec_trace = trace_cut_to(req.spec_trace, len(text))
        return text[len(old):]

    def _make_output(self, req: Request, new_ids: list[int], new_text: str, new_lps=None) -> RequestOutput:
        lps = list(req.logprobs) if req.params.logprobs is not None else None
        comp = CompletionOutput(0, req.text, list(req.output_token_ids), req.finish_reason, lps, req.error,
                                req.spec_trace)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], req.is_finished,
                             req.metrics, new_token_ids=new_ids, new_text=new_text, new_logprobs=new_lps)

    # --- stats ----------------------------------------------------------------------------------------
    def get_metrics(self) -> dict:
        d = {"spec_decode": self.spec_stats.as_dict(),
             "spec_decode_by_source": {k: v.as_dict() for k, v in sorted(self.spec_stats_by_source.items())},
             "kv_blocks_used": self.scheduler.allocator.num_used,
             "kv_blocks_total": self.scheduler.allocator.num_blocks,
             "prefix_cache": self.scheduler.allocator.stats(),
             "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
             "num_steps": self.num_steps,
             "step_time_s": dict(self.runner.timer.totals)}
        if self.policy is not None:
            d["speculation_policy"] = self.policy.table()
        if self.scheduler.draft_allocator is not None:
            d["draft_allocation"] = self.scheduler.draft_allocator.table()
        return d


def trace_cut_to(trace: list[TokenTrace], num_chars: int) -> list[TokenTrace]:
    """A copy of `trace` whose texts concatenate to the first `num_chars` characters of theirs
    (a stop string cut the output text; the tokens behind the cut stay, with empty text). A new
    list: outputs already handed out keep the one they were given."""
    out, left = [], num_chars
    for e in trace:
        keep = e.text[:max(left, 0)]
        left -= len(e.text)
        out.append(e if keep == e.text else TokenTrace(e.token_id, keep, e.source, e.step))
    return out
