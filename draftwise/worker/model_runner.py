"""The model runner: turns a SchedulerOutput into tensors, runs the target (verification included),
samples / rejection-samples, and runs the proposer for the next step's drafts."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from draftwise.config import EngineConfig, ModelConfig
from draftwise.kernels import row_argmax
from draftwise.layers.attention import CAUSAL, TREE, AttentionMetadata, cache_slots, slots_for_positions
from draftwise.sample.rejection_sampler import greedy_accept, rejection_sample
from draftwise.sample.sampler import SamplingMetadata
from draftwise.spec_decode.draft import Draft
from draftwise.spec_decode.metadata import SpecDecodeMetadata
from draftwise.spec_decode.proposer import NextStep, Proposer, ProposerInput
from draftwise.step import ModelRunnerOutput, SchedulerOutput
from draftwise.worker.kv_cache import KVCache
from draftwise.outputs import TokenLogprob
from draftwise.sample.logits_processors import apply_logits_processors
from draftwise.spec_decode.tree import compact_tree_kv, verify_trees
from draftwise.structured_output import apply_grammar_masks
from draftwise.worker.compiled_graphs import DEFAULT_STATIC_SIZES, compile_graph, configure_compile_cache

logger = logging.getLogger("draftwise")


@dataclass
class StepInputs:
    """A prepared step (ModelRunner.prepare): tensors built from the scheduler's decisions."""
    sched: SchedulerOutput
    input_ids: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    cache_pos: torch.Tensor
    meta: AttentionMetadata
    cu: list[int]
    num_draft: list[int]
    sampling: SamplingMetadata
    spec_meta: SpecDecodeMetadata
    any_tree: bool


class StepTimer:
    """Accumulates wall time per phase of a step (drafting, verification, sampling, bookkeeping)."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self.steps = 0

    def add(self, name: str, dt: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + dt

    def reset(self):
        self.totals, self.steps = {}, 0


class ModelRunner:
    def __init__(self, config: EngineConfig, model, model_cfg: ModelConfig, proposer: Proposer | None,
                 num_blocks: int):
        self.config = config
        self.model = model               # a tensor-parallel target is called the same way
        self.model_cfg = model_cfg
        self.proposer = proposer
        self._explore_turn = 0           # which requests a request-limited drafting step drafts for
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        specs = [(model.num_local_kv_heads, model_cfg.head_dim)] * model_cfg.num_hidden_layers
        if proposer is not None:
            proposer.bind_kv_cache(len(specs))
            specs += proposer.kv_layer_specs()
            if proposer.needs_aux_hidden_states:
                model.set_aux_hidden_state_layers(proposer.aux_layers())
        self.kv_cache = KVCache(num_blocks, self.block_size, specs, config.kv_torch_dtype, self.device)
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)
        spec = config.speculative_config
        self.fused_greedy = spec is None or spec.rejection_sampler == "fused"
        self.timer = StepTimer()
        # optional hook that keeps the target's hidden states of every fed row (data generation)
        self.hidden_recorder = None
        self.graphs = []
        if not config.enforce_eager:
            self._compile_graphs()

    def _compile_graphs(self) -> None:
        """Compile the target's layer stack and LM head, and the drafter's passes, for every
        token bucket before serving (the warmup). Disk-cached across restarts."""
        configure_compile_cache()
        t0 = time.perf_counter()
        dev, dt = self.device, self.config.torch_dtype
        common = dict(static_sizes=self.config.compile_sizes or DEFAULT_STATIC_SIZES,
                      max_tokens=self.config.max_num_batched_tokens, kv_cache=self.kv_cache,
                      block_size=self.block_size)
        H = self.model_cfg.hidden_size

        def ids_pos(n):
            return (torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev))

        model = self.model
        model.layers_step = compile_graph(model.run_layers, "target", 2, ids_pos, **common)
        model.logits_step = compile_graph(model.compute_logits, "target lm_head", 1,
                                          lambda n: (torch.zeros(n, H, dtype=dt, device=dev),),
                                          uses_attention=False, **common)
        self.graphs += [model.layers_step, model.logits_step]
        if self.proposer is not None:
            self.graphs.extend(self.proposer.compile_graphs(compile_graph, common, dt, dev))
        logger.info("compiled %d graph families in %.1f s", len(self.graphs), time.perf_counter() - t0)

    @torch.inference_mode()
    def measure_target_costs(self, sizes, repeats: int = 3, context: int = 0,
                             large_repeats: int | None = 2, num_requests: int = 1,
                             budget_s: float = 0.0, max_rounds: int = 12) -> dict[int, float]:
        """Seconds per target forward (layers + LM head on every row) of `num_requests` requests each
        feeding each token count in `sizes` after `context` cached tokens, best of `repeats` (`large_repeats`
        for more than 8 tokens: the start-up measurement keeps those short; None = `repeats`), on
        scratch KV blocks (call before serving). Rounds visit every size in turn, so a slow spell
        of a shared machine lands on all sizes alike; with `budget_s`, rounds go on (up to
        `max_rounds`) while the measurement has taken less than that many seconds, since a busy
        machine only ever makes a forward slower and the best of more rounds is nearer its cost.
        The adaptive policy's cost table and `draftwise bench step-cost` both read this."""
        inputs = {}
        for n in sizes:
            step = self.scratch_step_inputs(n, context, num_requests)
            if step is None:
                break
            inputs[n] = step
        reps = {n: repeats if n * num_requests <= 8 or large_repeats is None else large_repeats for n in inputs}
        best = {n: float("inf") for n in inputs}
        start, i = time.perf_counter(), 0
        while i <= max(reps.values(), default=0) or (i <= max_rounds and time.perf_counter() - start < budget_s):
            for n, step in inputs.items():
                if i > reps[n] and time.perf_counter() - start >= budget_s:
                    continue
                t0 = time.perf_counter()
                self._target_forward(*step)
                if i:                                       # round 0 warms up
                    best[n] = min(best[n], time.perf_counter() - t0)
            i += 1
        return best

    def scratch_step_inputs(self, n: int, context: int = 0, num_requests: int = 1):
        """(input_ids, positions, attention metadata, logits rows) of `num_requests` requests each
        feeding `n` tokens after `context` cached ones, in scratch KV blocks (requests share the
        blocks: only the shapes matter); None if the pool is too small."""
        total = context + n
        need = -(-total // self.block_size)
        if need > self.kv_cache.num_blocks:
            return None
        bt = torch.arange(need, dtype=torch.long, device=self.device)[None].expand(num_requests, need)
        pos = torch.arange(context, total, device=self.device).repeat(num_requests)
        req_index = torch.arange(num_requests, device=self.device).repeat_interleave(n)
        slots = slots_for_positions(bt, req_index, pos, self.block_size)
        meta = AttentionMetadata(slots, [n] * num_requests, [total] * num_requests, bt.contiguous(),
                                 self.block_size, CAUSAL, row_invariant=self.config.quantization is not None).finalize()
        rows = n * num_requests
        ids = torch.zeros(rows, dtype=torch.long, device=self.device)
        return ids, pos, meta, torch.arange(rows, device=self.device)

    # --- helpers ---------------------------------------------------------------------------------
    def _block_tables(self, reqs) -> torch.Tensor:
        width = max(1, max(len(r.block_ids) for r in reqs))
        return torch.tensor([list(r.block_ids) + [0] * (width - len(r.block_ids)) for r in reqs], dtype=torch.long,
                            device=self.device)

    def _sampling_metadata(self, reqs) -> SamplingMetadata:
        gens = [r.generator if r.generator is not None else self.generator for r in reqs]
        return SamplingMetadata.from_params([r.params for r in reqs], gens, self.device)

    def _target_forward(self, input_ids, positions, meta, logits_indices):
        return self.model(input_ids, positions, meta, self.kv_cache, logits_indices)

    # --- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.run(self.prepare(out))

    def prepare(self, out: SchedulerOutput, sampling: bool = True) -> "StepInputs":
        """Everything a step reads from the scheduler and the requests, as tensors (async scheduling
        builds these before handing the step to the model thread, so the scheduler may move on).
        `sampling=False`: the forward's inputs only (tensor-parallel worker ranks, which hold
        RequestViews and never sample)."""
        t0 = time.perf_counter()
        scheds = out.scheduled
        reqs = [s.request for s in scheds]
        ids, pos, qlens, seqlens = [], [], [], []
        # cache entries are consecutive (tree nodes included); RoPE positions may differ (trees)
        cache_idx, slots = [], []
        any_tree = any(s.tree is not None for s in scheds)
        for s in scheds:
            n = s.num_new_tokens
            ids.extend(s.token_ids)
            cache_idx.extend(range(s.start_pos, s.start_pos + n))
            slots.extend(cache_slots(s.request.block_ids, s.start_pos, n, self.block_size))
            if s.tree is not None:
                # prefix rows at their own positions, then tree nodes at depth-based positions
                base = s.start_pos + s.num_prefix_tokens - 1
                pos.extend(range(s.start_pos, s.start_pos + s.num_prefix_tokens - 1))
                pos.extend((base + s.tree.depths).tolist())
            else:
                pos.extend(range(s.start_pos, s.start_pos + n))
            qlens.append(n)
            seqlens.append(s.start_pos + n)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        block_tables = self._block_tables(reqs)
        cache_pos = torch.tensor(cache_idx, dtype=torch.long, device=self.device)
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        tree_mask = None
        if any_tree:
            tree_mask = self._tree_verify_mask(scheds, max(qlens))
        meta = AttentionMetadata(slot_mapping, qlens, seqlens, block_tables, self.block_size,
                                 TREE if any_tree else CAUSAL, tree_mask,
                                 row_invariant=self.config.quantization is not None).finalize()
        cu = torch.cumsum(torch.tensor(qlens), 0).tolist()
        num_draft = [s.num_draft_tokens for s in scheds]
        sampling_meta = self._sampling_metadata(reqs) if sampling else None
        # logits at each request's last num_draft + 1 rows (trees: the root, then the nodes)
        spec_meta = SpecDecodeMetadata.build(num_draft, cu, input_ids)
        self.timer.add("prepare", time.perf_counter() - t0)
        return StepInputs(out, input_ids, positions, block_tables, cache_pos, meta, cu, num_draft, sampling_meta,
                          spec_meta, any_tree)

    def forward(self, inp: "StepInputs"):
        """The target forward of a prepared step (every tensor-parallel rank runs this alike)."""
        return self._target_forward(inp.input_ids, inp.positions, inp.meta, inp.spec_meta.logits_indices)

    def keep_accepted_paths(self, inp: "StepInputs", accepted_rows: list[list[int]]) -> None:
        """After tree verification: move each request's accepted nodes' target-layer K/V right
        behind its root, so the cache holds exactly the accepted path (every rank alike)."""
        compact_tree_kv(self.kv_cache, inp.sched.scheduled, accepted_rows, inp.block_tables, self.block_size,
                        self.model_cfg.num_hidden_layers)

    @torch.inference_mode()
    def run(self, inp: "StepInputs") -> ModelRunnerOutput:
        """The target forward, verification / sampling and tree KV compaction of a prepared step."""
        out, scheds = inp.sched, inp.sched.scheduled
        input_ids, positions, block_tables, cache_pos = inp.input_ids, inp.positions, inp.block_tables, inp.cache_pos
        cu, num_draft, sampling, spec_meta = inp.cu, inp.num_draft, inp.sampling, inp.spec_meta
        any_tree = inp.any_tree
        t1 = time.perf_counter()
        output = self.forward(inp)
        t2 = time.perf_counter()
        if self.hidden_recorder is not None:
            self.hidden_recorder.record(scheds, cache_pos, output)
        if any(s.request.needs_logits_processing for s in scheds):
            apply_logits_processors(output.logits, scheds)
        if any(s.request.grammar is not None for s in scheds):
            apply_grammar_masks(output.logits, scheds, self.model_cfg.vocab_size)
        accepted_rows: list[list[int]] = []
        if any_tree:
            new_tokens, accepted_rows = verify_trees(output.logits, scheds, sampling, self.device)
            self.keep_accepted_paths(inp, accepted_rows)
        elif sampling.all_greedy and self.fused_greedy:
            # each request's drafts are its last scheduled tokens; the argmax list is the step's
            # one host sync
            drafts = [s.token_ids[len(s.token_ids) - k:] if k else [] for s, k in zip(scheds, num_draft)]
            new_tokens = greedy_accept(row_argmax(output.logits).tolist(), drafts)
        else:
            nd = torch.tensor(num_draft, dtype=torch.long, device=self.device)
            rows = rejection_sample(output.logits, spec_meta.draft_matrix(), nd, sampling).tolist()
            new_tokens = [[t for t in row if t != -1] for row in rows]
        t3 = time.perf_counter()
        step_new, step_acc = [], []
        for s, toks in zip(scheds, new_tokens):
            if not s.completes_prompt:
                step_new.append([])
                step_acc.append(0)
            else:
                step_new.append(toks)
                step_acc.append(len(toks) - 1)
        logprobs = self._logprobs(scheds, step_new, output.logits, num_draft)
        self.timer.add("target_forward", t2 - t1)
        self.timer.add("sampling", t3 - t2)
        self.timer.steps += 1
        starts = [0] + cu[:-1]
        return ModelRunnerOutput(out, step_new, step_acc, input_ids, positions, output.aux_hidden_states,
                          block_tables, starts, accepted_rows, logprobs)

    def _logprobs(self, scheds, new_tokens, logits, num_draft) -> list:
        """Log-probabilities (raw target distribution, before temperature / top-k / top-p) of each
        emitted token, plus the top `params.logprobs` alternatives, for requests that ask for them.
        Token i of a step is scored by the verification row that predicted it: row i of a chain, the
        row of its parent node in a tree - the same distribution plain decoding computes."""
        out: list = [None] * len(scheds)
        want = [i for i, s in enumerate(scheds) if s.request.params.logprobs is not None and new_tokens[i]]
        if not want:
            return out
        offs = [0]
        for n in num_draft:
            offs.append(offs[-1] + n + 1)
        rows, toks, spans = [], [], []
        for i in want:
            s, new = scheds[i], new_tokens[i]
            if s.tree is not None:
                src, node = [0], 0              # follow the emitted tokens down the tree
                children = s.tree.children()
                for t in new[:-1]:
                    node = next(c for c in children[node] if s.tree.token_ids[c] == t)
                    src.append(node)
            else:
                src = list(range(len(new)))
            spans.append((len(rows), len(new)))
            rows.extend(offs[i] + j for j in src)
            toks.extend(new)
        lp = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)].float(), -1)
        chosen = lp.gather(1, torch.tensor(toks, device=lp.device)[:, None])[:, 0].tolist()
        k = max(scheds[i].request.params.logprobs for i in want)
        top_v, top_i = (lp.topk(k, -1) if k > 0 else (lp[:, :0], lp[:, :0].long()))
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for i, (a, n) in zip(want, spans):
            kk = scheds[i].request.params.logprobs
            out[i] = [TokenLogprob(toks[a + j], chosen[a + j],
                                   list(zip(top_i[a + j][:kk], top_v[a + j][:kk]))) for j in range(n)]
        return out

    def _tree_verify_mask(self, scheds, max_q) -> torch.Tensor:
        """Per request [max_q, max_q]: prefix rows causal; tree rows see the prefix and their ancestors."""
        R = len(scheds)
        m = torch.zeros(R, max_q, max_q, dtype=torch.bool)
        for r, s in enumerate(scheds):
            n = s.num_new_tokens
            m[r, :n, :n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            if s.tree is not None:
                p = s.num_prefix_tokens - 1            # row of the tree root (the sampled token)
                t = s.tree.mask.shape[0]
                m[r, p:p + t, p:p + t] = s.tree.mask
        return m.to(self.device)

    # --- drafting --------------------------------------------------------------------------------
    def _drafts_allowed(self, params) -> bool:
        spec = self.config.speculative_config
        return spec.draft_seeded_sampling or params.seed is None or params.greedy

    @torch.inference_mode()
    def propose(self, step: ModelRunnerOutput, num_spec_tokens: int, max_requests: int | None = None,
                next_step: NextStep | None = None) -> list[Draft | None]:
        """Drafts for every scheduled request (None where none is wanted); with `max_requests`,
        for that many of them at most (the others only update the drafter's state), taken in
        turn from step to step."""
        if self.proposer is None:
            return [None] * len(step.sched.scheduled)
        t0 = time.perf_counter()
        scheds = step.sched.scheduled
        reads_rows = self.proposer.reads_target_rows
        rows, qlens, seq_lens, next_ids, want = [], [], [], [], []
        for i, s in enumerate(scheds):
            req = s.request
            tree_rows = step.accepted_rows[i] if step.accepted_rows and s.tree is not None else None
            if tree_rows is not None:
                n_valid = s.num_prefix_tokens - 1 + len(tree_rows)
            else:
                n_valid = s.num_prefix_tokens + step.num_accepted[i]
            last_pos = s.start_pos + n_valid - 1
            seq_lens.append(last_pos + 1)
            want.append(bool(num_spec_tokens > 0 and s.completes_prompt and not req.is_finished
                             and req.params.speculate and self._drafts_allowed(req.params)
                             and last_pos + 1 + num_spec_tokens < self.config.max_model_len))
            if not reads_rows:
                continue
            start = step.query_start[i]
            if tree_rows is not None:
                rows.extend([start + j for j in range(s.num_prefix_tokens - 1)] + [start + j for j in tree_rows])
            else:
                rows.extend(range(start, start + n_valid))
            qlens.append(n_valid)
            if s.completes_prompt and step.new_token_ids[i]:
                next_ids.append(step.new_token_ids[i][-1])
            else:
                next_ids.append(req.all_token_ids[last_pos + 1] if last_pos + 1 < req.num_tokens else 0)
        if max_requests is not None and sum(want) > max_requests:
            want = _some_of(want, max_requests, self._explore_turn)
            self._explore_turn += 1
        if not any(want) and not self.proposer.needs_aux_hidden_states:
            return [None] * len(scheds)
        if not reads_rows:                   # a drafter of token histories (suffix, n-gram)
            inp = ProposerInput(None, None, None, [], None, seq_lens, step.block_tables, want,
                                [s.request for s in scheds], step.new_token_ids, next_step)
        else:
            row_t = torch.tensor(rows, dtype=torch.long, device=self.device)
            if step.accepted_rows:
                positions = torch.cat([torch.arange(s.start_pos, s.start_pos + q)
                                       for s, q in zip(scheds, qlens)]).to(self.device)
            else:
                positions = step.positions[row_t]
            inp = ProposerInput(
                token_ids=step.input_ids[row_t], positions=positions,
                aux_hidden_states=step.aux_hidden_states[row_t] if step.aux_hidden_states is not None else None,
                query_lens=qlens, next_token_ids=torch.tensor(next_ids, dtype=torch.long, device=self.device),
                seq_lens=seq_lens, block_tables=step.block_tables, want_draft=want,
                requests=[s.request for s in scheds], new_tokens=step.new_token_ids, next_step=next_step)
        drafts = self.proposer.propose(inp, self.kv_cache, self.block_size, num_spec_tokens)
        # variable-length drafters may propose past the position limit: keep what fits (a tree's
        # first nodes are a valid tree)
        for i, (d, n) in enumerate(zip(drafts, seq_lens)):
            room = self.config.max_model_len - 1 - n
            if d is not None and len(d) > room:
                drafts[i] = d.truncated(room) if room > 0 else None
        self.timer.add("drafting", time.perf_counter() - t0)
        return drafts


def _some_of(want: list[bool], n: int, turn: int) -> list[bool]:
    """`want` with only n of its True entries kept, starting at the `turn`-th (cyclically)."""
    idx = [i for i, w in enumerate(want) if w]
    keep = {idx[(turn + j) % len(idx)] for j in range(n)}
    return [i in keep for i in range(len(want))]
