"""Self-distillation data shards: token ids, loss mask and the target's hidden states, on disk.

One shard is one safetensors file holding S sequences concatenated along the token axis:

- ``input_ids``   int32 [N]          prompt + response tokens
- ``loss_mask``   uint8 [N]          1 on response tokens (what the drafter learns to predict)
- ``offsets``     int64 [S + 1]      sequence s is rows offsets[s] : offsets[s + 1]
- ``prompt_index`` int64 [S]         the prompt each sequence came from (resume bookkeeping)
- ``aux``         fp16 [N, k * H]    residual stream *entering* each of the shard's ``aux_layers``
- ``final``       fp16 [N, H]        final-normed hidden state (teacher logits = target LM head of it)

The hidden states of a sequence's last token are zero (it was sampled, never fed back); nothing
reads them, since row t predicts token t + 1. The metadata records the aux layers, so each trainer
picks the columns it needs: EAGLE-3 the residual entering layers (2, N//2, N-3), DFlash the
layers ``id + 1`` of its layer-output ids. Teacher logits are recomputed through the frozen LM
head rather than stored (a row of SmolLM2 logits is 96 KB, its final hidden state 1.2 KB).
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class ShardSequence:
    input_ids: torch.Tensor      # [L] long
    loss_mask: torch.Tensor      # [L] long (0/1)
    aux: torch.Tensor            # [L, k*H] (the requested layers only)
    final: torch.Tensor          # [L, H]
    prompt_index: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def truncate(self, n: int) -> "ShardSequence":
        if len(self) <= n:
            return self
        return ShardSequence(self.input_ids[:n], self.loss_mask[:n], self.aux[:n], self.final[:n], self.prompt_index)


def shard_paths(directory: str) -> list[str]:
    """The shards of a directory, or of several comma-separated directories (e.g. self-distilled and
    teacher-forced data trained together)."""
    out = []
    for d in directory.split(","):
        out += sorted(glob.glob(os.path.join(d, "shard_*.safetensors")))
    return out


def write_shard(path: str, seqs: list[ShardSequence], aux_layers: tuple[int, ...], meta: dict) -> None:
    """Atomically write `seqs` (aux holding every layer of `aux_layers`) to `path`."""
    from safetensors.torch import save_file
    if not seqs:
        raise ValueError("a shard needs at least one sequence")
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in seqs]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in seqs]).to(torch.uint8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        "prompt_index": torch.tensor([s.prompt_index for s in seqs], dtype=torch.long),
        "aux": torch.cat([s.aux for s in seqs]).to(torch.float16).contiguous(),
        "final": torch.cat([s.final for s in seqs]).to(torch.float16).contiguous(),
    }
    metadata = {"aux_layers": json.dumps(list(aux_layers)), "draftwise": json.dumps(meta)}
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=metadata)
    os.replace(tmp, path)


def shard_aux_layers(path: str) -> tuple[int, ...]:
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        md = f.metadata() or {}
    if "aux_layers" not in md:
        raise ValueError(f"{path} is not a draftwise data shard (no aux_layers metadata)")
    return tuple(json.loads(md["aux_layers"]))


def completed_prompts(directory: str) -> set[int]:
    """Prompt indices already written to shards in `directory` (to resume generation)."""
    from safetensors import safe_open
    done: set[int] = set()
    for p in shard_paths(directory):
        with safe_open(p, framework="pt") as f:
            done.update(f.get_tensor("prompt_index").tolist())
    return done


def _column_index(have: tuple[int, ...], want: tuple[int, ...], hidden: int, path: str) -> torch.Tensor | None:
    missing = [w for w in want if w not in have]
    if missing:
        raise ValueError(f"{path} holds hidden states entering layers {list(have)}, not {missing}; "
                         "regenerate the data with those --aux-layers")
    if tuple(want) == tuple(have):
        return None
    cols = [torch.arange(have.index(w) * hidden, (have.index(w) + 1) * hidden) for w in want]
    return torch.cat(cols)


def iter_shard_sequences(directory: str, aux_layers: tuple[int, ...], min_len: int = 3,
                         shards: list[str] | None = None) -> Iterator[ShardSequence]:
    """Every sequence of the shards in `directory`, with the aux columns of `aux_layers` only."""
    from safetensors import safe_open
    paths = shards if shards is not None else shard_paths(directory)
    if not paths:
        raise ValueError(f"no data shards (shard_*.safetensors) in {directory!r}; "
                         "run `draftwise train gen-data` first")
    for p in paths:
        have = shard_aux_layers(p)
        with safe_open(p, framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        hidden = t["final"].shape[1]
        cols = _column_index(have, tuple(aux_layers), hidden, p)
        aux = t["aux"] if cols is None else t["aux"][:, cols]
        off = t["offsets"].tolist()
        for s in range(len(off) - 1):
            a, b = off[s], off[s + 1]
            if b - a < min_len:
                continue
            yield ShardSequence(t["input_ids"][a:b].long(), t["loss_mask"][a:b].long(), aux[a:b],
                                t["final"][a:b], int(t["prompt_index"][s]))


def count_shard_tokens(directory: str) -> tuple[int, int, int]:
    """(sequences, tokens, loss tokens) over the shards in `directory`."""
    from safetensors import safe_open
    n_seq = n_tok = n_loss = 0
    for p in shard_paths(directory):
        with safe_open(p, framework="pt") as f:
            n_seq += f.get_slice("prompt_index").get_shape()[0]
            m = f.get_tensor("loss_mask")
        n_tok += m.numel()
        n_loss += int(m.sum())
    return n_seq, n_tok, n_loss


class ShardStream:
    """Endless stream of training sequences, epoch after epoch. Each epoch visits the shards present
    when it starts (so shards written meanwhile by a running `gen-data` join the next epoch), in a
    seeded random order, and each shard's sequences in a seeded random order; sequences longer than
    `max_len` are cut. `state()` / `load_state()` resume at the exact sequence."""

    def __init__(self, directory: str, aux_layers: tuple[int, ...], seed: int = 0, max_len: int = 2048):
        self.directory, self.aux_layers = directory, tuple(aux_layers)
        self.seed, self.max_len = seed, max_len
        self.epoch, self.order, self.shard_pos, self.seq_pos = 0, [], 0, 0
        self._loaded: tuple[str, list[ShardSequence]] | None = None
        self._new_epoch(0)

    def _new_epoch(self, epoch: int) -> None:
        paths = shard_paths(self.directory)
        if not paths:
            raise ValueError(f"no data shards (shard_*.safetensors) in {self.directory!r}; "
                             "run `draftwise train gen-data` first")
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        self.epoch = epoch
        self.order = [paths[i] for i in torch.randperm(len(paths), generator=g).tolist()]
        self.shard_pos = self.seq_pos = 0

    def state(self) -> dict:
        return {"epoch": self.epoch, "order": list(self.order), "shard_pos": self.shard_pos,
                "seq_pos": self.seq_pos}

    def load_state(self, st: dict) -> None:
        self.epoch, self.order = st["epoch"], list(st["order"])
        self.shard_pos, self.seq_pos = st["shard_pos"], st["seq_pos"]
        self._loaded = None

    def _sequences(self, name: str) -> list[ShardSequence]:
        if self._loaded is None or self._loaded[0] != name:
            path = name if os.path.exists(name) else os.path.join(self.directory.split(",")[0], name)
            seqs = list(iter_shard_sequences(self.directory, self.aux_layers, shards=[path]))
            g = torch.Generator().manual_seed(self.seed * 104729 + self.epoch * 31 + hash_name(os.path.basename(name)))
            seqs = [seqs[i] for i in torch.randperm(len(seqs), generator=g).tolist()]
            self._loaded = (name, seqs)
        return self._loaded[1]

    def __iter__(self):
        return self

    def __next__(self) -> ShardSequence:
        for _ in range(len(self.order) + 2):
            if self.shard_pos >= len(self.order):
                self._new_epoch(self.epoch + 1)
            seqs = self._sequences(self.order[self.shard_pos])
            if self.seq_pos < len(seqs):
                s = seqs[self.seq_pos]
                self.seq_pos += 1
                return s.truncate(self.max_len)
            self.shard_pos += 1
            self.seq_pos = 0
        raise ValueError(f"the shards in {self.directory!r} hold no usable sequences")


def hash_name(name: str) -> int:
    import zlib
    return zlib.crc32(name.encode()) & 0x7FFFFFFF
