"""Attention over packed ragged tokens with a position-indexed, block-paged KV cache.

Token t of sequence i writes its K/V to slot `block_table[i][pos // B] * B + pos % B`.
Attention reads every slot of positions 0..pos, so a slot written by a rejected draft is
simply overwritten when that position is computed again (gpt-fast's trick): rejection
needs no cache bookkeeping at all.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


MAX_GROUPED_QUERY = 17  # ragged batches with queries up to this long (the last token + 16 drafts) attend per length


@dataclass
class QueryGroup:
    """The sequences of a ragged batch that share one query length L, attended together
    without padding."""

    tokens: torch.Tensor  # (g * L,) packed index of each of their tokens, sequence-major
    ctx_slots: torch.Tensor  # (g, C_g) cache slots of their positions 0..C_g-1
    mask: torch.Tensor  # (g, 1, L, C_g)
    length: int


@dataclass
class AttnBatch:
    """Where the packed tokens of one forward live. T tokens of n sequences; Q is the
    longest per-sequence query, C the longest context."""

    positions: torch.Tensor  # (T,) absolute position of each token
    slots: torch.Tensor  # (T,) cache slot each token writes
    q_seq: torch.Tensor  # (T,) sequence index of each token
    q_col: torch.Tensor  # (T,) index of each token within its sequence's queries
    ctx_slots: torch.Tensor  # (n, C) cache slots of positions 0..C-1 of each sequence
    mask: torch.Tensor  # (n, 1, Q, C) True where the query may attend to the key
    last_index: torch.Tensor  # (n,) index into T of each sequence's last token
    uniform: bool = False  # every sequence has Q queries: T = n * Q, packed order is (n, Q)
    # A verification batch (short, ragged queries) attends per query length, so attention
    # costs sum_i q_i * C, not n * max(q) * C: the validate-time model's premise.
    groups: list[QueryGroup] | None = None
    memo: dict = field(default_factory=dict)  # per-forward values layers share (rotary cos/sin)

    @staticmethod
    def build(starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> "AttnBatch":
        """Sequence i contributes tokens at positions starts[i] .. starts[i] + lengths[i] - 1.
        Index arithmetic runs in numpy (a few microseconds, where small torch ops cost more)."""
        n = len(starts)
        lens = np.asarray(lengths, dtype=np.int64)
        start = np.asarray(starts, dtype=np.int64)
        q_seq = np.repeat(np.arange(n), lens)
        first = np.cumsum(lens) - lens
        q_col = np.arange(int(lens.sum())) - first[q_seq]
        positions = start[q_seq] + q_col
        width = max(len(b) for b in block_tables)
        tables = np.zeros((n, width), dtype=np.int64)
        for i, b in enumerate(block_tables):
            tables[i, :len(b)] = b
        slots = tables[q_seq, positions // block_size] * block_size + positions % block_size
        ctx = int((start + lens).max())
        key_pos = np.arange(ctx)
        ctx_slots = tables[:, np.minimum(key_pos // block_size, width - 1)] * block_size + key_pos % block_size
        q_pos = np.zeros((n, int(lens.max())), dtype=np.int64)  # padded queries see key 0 only
        q_pos[q_seq, q_col] = positions
        mask = (key_pos.reshape(1, 1, -1) <= q_pos[:, :, None])[:, None]
        uniform = bool((lens == lens[0]).all())

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        groups = None
        if not uniform and lens.max() <= MAX_GROUPED_QUERY:
            groups = []
            for length in np.unique(lens):
                idx = np.flatnonzero(lens == length)
                width_g = int((start[idx] + length).max())
                tokens = (first[idx][:, None] + np.arange(length)).ravel()
                groups.append(QueryGroup(tensor(tokens), tensor(ctx_slots[idx, :width_g]),
                                         tensor(mask[idx][:, :, :length, :width_g]), int(length)))
        fields = (positions, slots, q_seq, q_col, ctx_slots, mask, first + lens - 1)
        return AttnBatch(*(tensor(t) for t in fields), uniform=uniform, groups=groups)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                    batch: AttnBatch, scale: float) -> torch.Tensor:
    """q: (T, nh, hd); k, v: (T, nkv, hd); cache: two (S, nkv, hd) tensors. Returns (T, nh, hd)."""
    cache_k, cache_v = cache
    cache_k[batch.slots] = k
    cache_v[batch.slots] = v
    nh, hd = q.shape[1], q.shape[2]
    if batch.groups is not None:
        out = torch.empty_like(q)
        for g in batch.groups:
            qg = q[g.tokens].view(-1, g.length, nh, hd)
            out[g.tokens] = _attend(qg, cache, g.ctx_slots, g.mask, scale).reshape(-1, nh, hd)
        return out
    n, queries = batch.mask.shape[0], batch.mask.shape[2]
    if batch.uniform:  # no padding: the packed tokens already are (n, Q)
        return _attend(q.reshape(n, queries, nh, hd), cache, batch.ctx_slots, batch.mask, scale).reshape(q.shape)
    qp = q.new_zeros(n, queries, nh, hd)
    qp[batch.q_seq, batch.q_col] = q
    return _attend(qp, cache, batch.ctx_slots, batch.mask, scale)[batch.q_seq, batch.q_col]


def _attend(qp: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], ctx_slots: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """qp: (n, Q, nh, hd) queries; ctx_slots: (n, C); mask: (n, 1, Q, C). Returns (n, Q, nh, hd)."""
    keys = cache[0][ctx_slots].transpose(1, 2)  # (n, nkv, C, hd)
    values = cache[1][ctx_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # (n, nh, Q, hd)
    return out.transpose(1, 2)
