"""Attention over packed ragged tokens with a block-paged, position-indexed KV cache.

Per layer, keys are (num_blocks, nkv, hd, B) and values (num_blocks, nkv, B, hd): the token
at position p of sequence i writes block table[i][p // B] at offset p % B. Attention reads
positions 0..p, so a slot written by a rejected draft is simply overwritten when that
position is computed again (gpt-fast's trick): rejection needs no cache bookkeeping.

Two paths, one result:
  float32 on the CPU: the paged kernel (models/csrc/cpu_ops.cpp) reads keys and values
      where they lie, for decode, ragged verification and prefill chunks alike; no gather,
      no padding
  anything else (another device or dtype, autograd, no compiler), with torch ops:
      prefill chunks per sequence, causal SDPA over the chunk's own keys (a chunk that
      continues a sequence reads its cached prefix); short queries (at most SHORT_QUERY
      per sequence) gather their contexts through the block tables, padded to the
      longest, masked; a batch of both, each kind its own way
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from models import kernels

SHORT_QUERY = 17  # a verification query: the last token and up to 16 drafts
PYTHON_TOKENS = 16  # up to this many tokens AttnBatch.build's index arithmetic runs in plain Python (at 32 numpy was faster)

KVCache = tuple[torch.Tensor, torch.Tensor]  # keys (num_blocks, nkv, hd, B), values (num_blocks, nkv, B, hd)


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> KVCache:
    keys = torch.zeros(num_blocks, num_kv_heads, head_dim, block_size, dtype=dtype, device=device)
    values = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
    return keys, values


@dataclass
class AttnBatch:
    """Where the packed tokens of one forward live: T tokens of n sequences, sequence i
    contributing lens[i] tokens at positions starts[i] onward."""

    positions: torch.Tensor  # (T,) absolute position of each token
    slots: torch.Tensor  # (T,) block * B + offset each token writes
    q_seq: torch.Tensor  # (T,) sequence index of each token
    q_col: torch.Tensor  # (T,) index of each token among its sequence's
    tables: torch.Tensor  # (n, W) block tables, zero-padded
    last_index: torch.Tensor  # (n,) index into T of each sequence's last token
    starts: list[int]
    lens: list[int]
    block_size: int
    short: bool  # every sequence has at most SHORT_QUERY tokens
    memo: dict = field(default_factory=dict)  # per-forward values layers share (rotary cos/sin)

    @staticmethod
    def build(starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> "AttnBatch":
        """Index arithmetic in plain Python for the few tokens of a decode or draft step, all
        of it one tensor and views of it (at batch 1: 13 us, where a dozen numpy calls and six
        tensors took 24), in numpy for longer ones. A position past its own block table reads block 0, as
        zero-padded tables do; one past every table is an IndexError."""
        n = len(starts)
        if not n:
            raise ValueError("an attention batch needs at least one sequence")
        total = sum(lengths)
        if total > PYTHON_TOKENS:
            return AttnBatch._build_numpy(starts, lengths, block_tables, block_size, device)
        width = max(len(b) for b in block_tables)
        positions, slots, q_seq, q_col, last, t = [], [], [], [], [], 0
        for i, (start, length, table) in enumerate(zip(starts, lengths, block_tables)):
            for c in range(length):
                p = start + c
                j = p // block_size
                if j >= width:
                    raise IndexError(f"position {p} is past every block table ({width} blocks of {block_size})")
                positions.append(p)
                slots.append((table[j] if j < len(table) else 0) * block_size + p % block_size)
            q_seq.extend([i] * length)
            q_col.extend(range(length))
            t += length
            last.append(t - 1)
        flat = positions + slots + q_seq + q_col + last
        for table in block_tables:
            flat.extend(table)
            flat.extend([0] * (width - len(table)))
        # one conversion (numpy's from a list: 16 us for 1000 ints, torch.tensor's 56) and views of it
        every = torch.from_numpy(np.array(flat, dtype=np.int64)).to(device)
        tables = every[4 * t + n:].view(n, width)
        return AttnBatch(every[:t], every[t:2 * t], every[2 * t:3 * t], every[3 * t:4 * t], tables,
                         every[4 * t:4 * t + n], [int(x) for x in starts], [int(x) for x in lengths], block_size,
                         short=max(lengths) <= SHORT_QUERY)

    @staticmethod
    def _build_numpy(starts, lengths, block_tables, block_size: int, device) -> "AttnBatch":
        n = len(starts)
        lens = np.asarray(lengths, dtype=np.int64)
        start = np.asarray(starts, dtype=np.int64)
        q_seq = np.repeat(np.arange(n), lens)
        first = np.cumsum(lens) - lens
        q_col = np.arange(int(lens.sum())) - first[q_seq]
        positions = start[q_seq] + q_col
        tables = np.zeros((n, max(len(b) for b in block_tables)), dtype=np.int64)
        for i, b in enumerate(block_tables):
            tables[i, :len(b)] = b
        slots = tables[q_seq, positions // block_size] * block_size + positions % block_size

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        return AttnBatch(tensor(positions), tensor(slots), tensor(q_seq), tensor(q_col), tensor(tables),
                         tensor(first + lens - 1),
                         [int(x) for x in starts], [int(x) for x in lengths], block_size,
                         short=int(lens.max()) <= SHORT_QUERY)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, batch: AttnBatch,
                    scale: float) -> torch.Tensor:
    """q: (T, nh, hd); k, v: (T, nkv, hd), written into the cache first. Returns (T, nh, hd)."""
    ops = kernels.ops_for(q)
    write_cache(k, v, cache, batch, ops)
    if ops is not None:
        return ops.paged_attention(q.contiguous(), cache[0], cache[1], batch.tables, batch.q_seq, batch.positions,
                                   scale)
    if batch.short:
        return _padded(q, cache, batch, scale)
    short = [i for i, length in enumerate(batch.lens) if length <= SHORT_QUERY]
    if len(short) < 2:
        return _prefill(q, k, v, cache, batch, scale)
    # a few long queries among short ones (a draft's catch-up where one sequence is new): the long ones one by
    # one, the short ones padded together (one by one, a batch-32 catch-up with one prompt in it had cost an
    # H200 12-13 ms where 4 without it)
    out = _prefill(q, k, v, cache, batch, scale, skip=set(short))
    rows, sub = _sub_batch(batch, short, q.device)
    out[rows] = _padded(q[rows], cache, sub, scale)
    return out


def write_cache(k: torch.Tensor, v: torch.Tensor, cache: KVCache, batch: AttnBatch, ops=None) -> None:
    if ops is not None:
        ops.cache_write(k.contiguous(), v.contiguous(), cache[0], cache[1], batch.slots)
        return
    block, offset = batch.slots // batch.block_size, batch.slots % batch.block_size
    cache[0][block, :, :, offset] = k  # advanced indices apart: (T, nkv, hd) on the left
    cache[1][block, :, offset, :] = v


def gather_context(cache: KVCache, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions 0..length-1 of each sequence: (m, nkv, length, hd) each."""
    m, width = tables.shape
    keys = cache[0][tables].permute(0, 2, 1, 4, 3)  # (m, nkv, W, B, hd)
    values = cache[1][tables].permute(0, 2, 1, 3, 4)
    nkv, block, hd = keys.shape[1], keys.shape[3], keys.shape[4]
    return (keys.reshape(m, nkv, width * block, hd)[:, :, :length],
            values.reshape(m, nkv, width * block, hd)[:, :, :length])


def _prefill(q, k, v, cache: KVCache, batch: AttnBatch, scale: float, skip: set[int] = frozenset()) -> torch.Tensor:
    """Per sequence: its chunk's queries against the chunk's own keys (a fresh prompt), or
    against its cached prefix and the chunk (a chunk that continues a sequence). The rows of
    sequences in `skip` are left unwritten."""
    out = torch.empty_like(q)
    first = 0
    for i, (start, length) in enumerate(zip(batch.starts, batch.lens)):
        rows = slice(first, first + length)
        if i in skip:
            first += length
            continue
        qi = q[rows].transpose(0, 1)[None]  # (1, nh, L, hd)
        if start == 0:  # KV heads repeated: a 4-d causal call takes the flash kernel (about 3x the math path here)
            rep = q.shape[1] // k.shape[1]
            o = F.scaled_dot_product_attention(qi, k[rows].transpose(0, 1).repeat_interleave(rep, 0)[None],
                                               v[rows].transpose(0, 1).repeat_interleave(rep, 0)[None],
                                               is_causal=True, scale=scale)
        else:
            keys, values = gather_context(cache, batch.tables[i:i + 1], start + length)
            key_pos = torch.arange(start + length, device=q.device)
            mask = key_pos[None, :] <= (start + torch.arange(length, device=q.device))[:, None]  # (L, C)
            o = F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
        first += length
    return out


def _sub_batch(batch: AttnBatch, seqs: list[int], device) -> tuple[torch.Tensor, AttnBatch]:
    """The tokens of sequences `seqs` (indices into the batch, ascending): their rows in the
    packed tokens, and the batch of those sequences alone."""
    firsts = [0, *itertools.accumulate(batch.lens[:-1])]
    rows = [firsts[i] + c for i in seqs for c in range(batch.lens[i])]
    q_seq = [j for j, i in enumerate(seqs) for _ in range(batch.lens[i])]
    at = torch.tensor(rows, device=device)
    lens = [batch.lens[i] for i in seqs]
    sub = AttnBatch(batch.positions[at], batch.slots[at], torch.tensor(q_seq, device=device), batch.q_col[at],
                    batch.tables[torch.tensor(seqs, device=device)],
                    torch.tensor(list(itertools.accumulate(lens)), device=device) - 1,
                    [batch.starts[i] for i in seqs], lens, batch.block_size, short=max(lens) <= SHORT_QUERY)
    return at, sub


def _padded(q, cache: KVCache, batch: AttnBatch, scale: float) -> torch.Tensor:
    """Short ragged queries without the kernel: gather every context, pad the queries to
    the longest, mask."""
    n, nh, hd = len(batch.lens), q.shape[1], q.shape[2]
    longest, context = max(batch.lens), max(s + n_ for s, n_ in zip(batch.starts, batch.lens))
    keys, values = gather_context(cache, batch.tables, context)  # (n, nkv, C, hd)
    q_col = batch.q_col
    qp = q.new_zeros(n, longest, nh, hd)
    qp[batch.q_seq, q_col] = q
    q_pos = torch.zeros(n, longest, dtype=torch.long, device=q.device)  # padded queries see key 0 only
    q_pos[batch.q_seq, q_col] = batch.positions
    mask = (torch.arange(context, device=q.device)[None, None, :] <= q_pos[:, :, None])[:, None]  # (n, 1, Q, C)
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # (n, nh, Q, hd)
    return out.transpose(1, 2)[batch.q_seq, q_col]
