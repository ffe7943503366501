"""Attention over packed ragged tokens with a position-indexed, block-paged KV cache.

Token t of sequence i writes its K/V to slot `block_table[i][pos // B] * B + pos % B`.
Attention reads every slot of positions 0..pos, so a slot written by a rejected draft is
simply overwritten when that position is computed again (gpt-fast's trick): rejection
needs no cache bookkeeping at all.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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

    @staticmethod
    def build(starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> "AttnBatch":
        """Sequence i contributes tokens at positions starts[i] .. starts[i] + lengths[i] - 1."""
        n = len(starts)
        lens = torch.tensor(lengths, dtype=torch.long)
        start = torch.tensor(starts, dtype=torch.long)
        q_seq = torch.repeat_interleave(torch.arange(n), lens)
        first = torch.cumsum(lens, 0) - lens
        q_col = torch.arange(int(lens.sum())) - first[q_seq]
        positions = start[q_seq] + q_col
        width = max(len(b) for b in block_tables)
        tables = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.long)  # (n, nb)
        slots = tables[q_seq, positions // block_size] * block_size + positions % block_size
        ctx = int((start + lens).max())
        key_pos = torch.arange(ctx)
        ctx_slots = tables[:, (key_pos // block_size).clamp(max=width - 1)] * block_size + key_pos % block_size
        q_pos = torch.zeros(n, int(lens.max()), dtype=torch.long)  # padded queries see key 0 only
        q_pos[q_seq, q_col] = positions
        mask = (key_pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)).unsqueeze(1)
        fields = (positions, slots, q_seq, q_col, ctx_slots, mask, first + lens - 1)
        return AttnBatch(*(t.to(device) for t in fields))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                    batch: AttnBatch, scale: float) -> torch.Tensor:
    """q: (T, nh, hd); k, v: (T, nkv, hd); cache: two (S, nkv, hd) tensors. Returns (T, nh, hd)."""
    cache_k, cache_v = cache
    cache_k[batch.slots] = k
    cache_v[batch.slots] = v
    n, queries = batch.mask.shape[0], batch.mask.shape[2]
    qp = q.new_zeros(n, queries, q.shape[1], q.shape[2])
    qp[batch.q_seq, batch.q_col] = q
    keys = cache_k[batch.ctx_slots].transpose(1, 2)  # (n, nkv, C, hd)
    values = cache_v[batch.ctx_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, values, attn_mask=batch.mask, scale=scale,
                                         enable_gqa=True)  # (n, nh, Q, hd)
    return out.transpose(1, 2)[batch.q_seq, batch.q_col]
