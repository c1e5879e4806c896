"""Tensor parallelism for the Llama / Qwen3 target on torch.distributed (gloo on CPU, NCCL on GPUs).

Megatron layout, applied in place to a loaded model (`shard_target`):

- attention: q/k/v column-parallel by heads (rank r keeps query heads r*H/N .. and its KV heads;
  with fewer KV heads than ranks each KV head is replicated on N/Hkv ranks, as vLLM does), o_proj
  row-parallel (all-reduce of the partial outputs);
- MLP: gate/up column-parallel, down row-parallel (all-reduce);
- embedding: vocab-parallel (each rank looks up its vocabulary slice, zeros elsewhere, all-reduce);
- LM head: vocab-parallel, the logits slices gathered on rank 0 (the only rank that samples).

After every all-reduce the residual stream is identical on all ranks, so the auxiliary hidden
states the drafters read are consistent everywhere; rank 0 uses its own. The drafters (EAGLE-3 head,
DFlash drafter) run unsharded on rank 0 only: they are small, and sharding them would add two
all-reduces per draft layer per drafting pass for matmuls of a few hundred KFLOPs. They read the
target's embedding / LM head through `DrafterTargetView`, which keeps full copies on rank 0.

Every rank runs the same ModelRunner over its shard: rank 0 broadcasts each step's SchedulerOutput
(worker/tensor_parallel.py `TensorParallelRunner`), every rank prepares the same tensors from it and
runs its shard of the forward, meeting the others at the all-reduces; only rank 0 samples. The
model runner has no tensor-parallel branch.

Head counts that do not divide (e.g. SmolLM2's 3 KV heads on 2 ranks) are refused with an error
naming the numbers."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from draftwise.models.llama import Attention, MLP


def check_divisibility(cfg, world: int) -> None:
    h, kv, inter, name = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, "tensor_parallel_size"
    if world < 1:
        raise ValueError(f"{name} must be >= 1, got {world}")
    if h % world:
        raise ValueError(f"{name}={world} does not divide the {h} attention heads")
    if kv % world and world % kv:
        raise ValueError(f"{name}={world} and the {kv} KV heads: one must divide the other "
                         f"(KV heads are split across ranks, or replicated when there are fewer)")
    if inter % world:
        raise ValueError(f"{name}={world} does not divide the MLP size {inter}")


def local_kv_heads(num_kv: int, world: int) -> int:
    return max(1, num_kv // world)


def _kv_head_range(num_kv: int, world: int, rank: int) -> tuple[int, int]:
    if num_kv >= world:
        n = num_kv // world
        return rank * n, (rank + 1) * n
    per = world // num_kv                       # ranks sharing one KV head
    h = rank // per
    return h, h + 1


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T): the input features are split across ranks."""

    def __init__(self, weight: torch.Tensor, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.start, self.end = start, start + weight.shape[0]
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.start) & (ids < self.end)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        out = torch.nn.functional.embedding(local, self.weight) * inside[..., None].to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelLMHead(nn.Module):
    """Local logits for a vocabulary slice; rank 0 gathers the full rows (others return None)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, shard: int, rank: int, world: int, group=None):
        super().__init__()
        pad = shard - weight.shape[0]
        if pad:
            weight = torch.cat([weight, weight.new_zeros(pad, weight.shape[1])], 0)
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.vocab_size, self.rank, self.world, self.group = vocab_size, rank, world, group

    def forward(self, h: torch.Tensor):
        local = torch.nn.functional.linear(h, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self.group)
        if self.rank != 0:
            return None
        return torch.cat(parts, -1)[..., :self.vocab_size]


def shard_target(model: nn.Module, rank: int, world: int, group=None) -> nn.Module:
    """Keep this rank's shard of every layer of a loaded Llama/Qwen3 target (in place)."""
    cfg = model.config
    check_divisibility(cfg, world)
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h_loc, kv_loc = H // world, local_kv_heads(Hkv, world)
    k0, k1 = _kv_head_range(Hkv, world, rank)
    for mod in model.modules():
        if isinstance(mod, Attention):
            w = mod.qkv_proj.weight.detach()
            b = mod.qkv_proj.bias.detach() if mod.qkv_proj.bias is not None else None
            q_rows = slice(rank * h_loc * D, (rank + 1) * h_loc * D)
            k_rows = slice(H * D + k0 * D, H * D + k1 * D)
            v_rows = slice(H * D + Hkv * D + k0 * D, H * D + Hkv * D + k1 * D)
            qkv = nn.Linear(w.shape[1], (h_loc + 2 * kv_loc) * D, bias=b is not None)
            qkv.weight.data = torch.cat([w[q_rows], w[k_rows], w[v_rows]]).contiguous()
            if b is not None:
                qkv.bias.data = torch.cat([b[q_rows], b[k_rows], b[v_rows]]).contiguous()
            mod.qkv_proj = qkv
            mod.o_proj = RowParallelLinear(mod.o_proj.weight.detach()[:, q_rows], group)
            mod.num_heads, mod.num_kv_heads = h_loc, kv_loc
            mod.q_size, mod.kv_size = h_loc * D, kv_loc * D
        elif isinstance(mod, MLP):
            inter = mod.intermediate
            loc = inter // world
            w = mod.gate_up_proj.weight.detach()
            rows = slice(rank * loc, (rank + 1) * loc)
            gu = nn.Linear(w.shape[1], 2 * loc, bias=False)
            gu.weight.data = torch.cat([w[:inter][rows], w[inter:][rows]]).contiguous()
            mod.gate_up_proj = gu
            mod.down_proj = RowParallelLinear(mod.down_proj.weight.detach()[:, rows], group)
            mod.intermediate = loc
    V = cfg.vocab_size
    shard = -(-V // world)
    lo, hi = rank * shard, min(V, (rank + 1) * shard)
    emb = model.embed_tokens.weight.detach()
    head = model.lm_head.weight.detach()
    model.embed_tokens = VocabParallelEmbedding(emb[lo:hi], lo, group)
    model.lm_head = VocabParallelLMHead(head[lo:hi], V, shard, rank, world, group)
    model.tp_rank, model.tp_world = rank, world
    model.num_local_kv_heads = kv_loc
    return model


class DrafterTargetView:
    """What a drafter reads from the target, on rank 0 of a tensor-parallel target: full copies of
    the embedding and LM head (no collectives), and the target's own config / aux-layer methods."""

    def __init__(self, model: nn.Module, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor):
        self._model = model
        self.config = model.config
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
        self.lm_head.weight = (self.embed_tokens.weight if lm_head_weight is embed_weight
                               else nn.Parameter(lm_head_weight, requires_grad=False))

    def get_eagle3_aux_hidden_state_layers(self):
        return self._model.get_eagle3_aux_hidden_state_layers()

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)
