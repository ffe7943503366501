"""Tensor-parallel building blocks (Megatron style), each owning a `weight_loader`.

A layer's shard is fixed at construction from an explicit `TPGroup`; the collective it
needs is called in its `forward`, where a reader can see it. With `TPGroup()` (size 1)
every layer is a plain single-device layer, which is also how the replicated draft model
runs on each rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models import kernels
from models.module import Module


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None when size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim (in rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"tensor-parallel size {d} does not divide {what}={n}")
    return n // d


def _narrow(full: torch.Tensor, dim: int, index: int, size: int) -> torch.Tensor:
    return full.narrow(dim, index * size, size)


class ReplicatedLinear(Module):
    """The same full weight on every rank (small projections such as MTP's eh_proj)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        param.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(self, x, self.weight, self.bias)


class ColumnParallelLinear(Module):
    """Output features split across ranks; no communication in forward."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.out_per_rank = _divide(out_features, tp.size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(self.out_per_rank), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        param.data.copy_(_narrow(full, 0, self.tp.rank, self.out_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(self, x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], tp: TPGroup, bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), tp, bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        size = self.out_sizes[shard_id] // self.tp.size
        offset = sum(self.out_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, size).copy_(_narrow(full, 0, self.tp.rank, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. Query heads are split; KV heads are split when there are at
    least as many as ranks, otherwise each rank keeps a replica of the one it needs (as vLLM)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TPGroup, bias: bool):
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _divide(num_kv_heads, tp.size, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            _divide(tp.size, num_kv_heads, "tp size (KV heads are replicated); num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden, out * tp.size, tp, bias)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst, src = param.data.narrow(0, 0, q), _narrow(full, 0, self.tp.rank, q)
        else:
            offset = q if shard_id == "k" else q + kv
            dst = param.data.narrow(0, offset, kv)
            src = full.narrow(0, self.kv_head_start * self.head_dim, kv)
        dst.copy_(src)


class RowParallelLinear(Module):
    """Input features split across ranks; partial sums are all-reduced in forward, unless
    `reduce=False`: then the caller sums several partial outputs and reduces once (MoE)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False, reduce: bool = True):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.in_per_rank = _divide(in_features, tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        if param is self.bias:
            param.data.copy_(full)
        else:
            param.data.copy_(_narrow(full, 1, self.tp.rank, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kernels.linear(self, x, self.weight)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(Module):
    """Rows of the (padded) vocabulary split across ranks; lookups are all-reduced."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = padded_vocab(vocab_size, tp.size) // tp.size
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        rows = max(0, min(self.per_rank, self.vocab_size - self.start))
        param.data.zero_()
        param.data[:rows].copy_(full[self.start:self.start + rows])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-parallel output projection; the shards are gathered so every rank holds the
    same full logits (needed for identical decisions without a broadcast)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last(kernels.linear(self, hidden, self.weight))
        return logits[..., : self.vocab_size]


def draft_head(head: ParallelLMHead) -> ParallelLMHead:
    """A second head over `head`'s weight (the same tensor, not a copy): a draft's own, whose
    weights the CPU kernels may stream in another dtype than the target's (models/kernels.py,
    pack_weights_as)."""
    other = ParallelLMHead(head.vocab_size, head.weight.shape[1], head.tp)
    other.weight = head.weight
    return other
