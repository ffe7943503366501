"""Timing probes for the startup sweep: a validate forward of n sequences x q tokens at a
given context length, and one draft step of n sequences. They use throwaway sequence
states over the first cache blocks, so run them before any request is admitted. Every
rank must run the same probe at the same time (the forwards contain collectives)."""
from __future__ import annotations

import time

import numpy as np
import torch

from models.attention import AttnBatch
from workers.proposer import SeqState
from workers.runner import ModelRunner


def _fake_seqs(runner: ModelRunner, n: int, positions: int) -> list[SeqState]:
    per_seq = -(-positions // runner.block_size)
    total_blocks = runner.cache[0][0].shape[0]
    if n * per_seq > total_blocks:
        raise ValueError(f"profile point n={n} x {positions} positions does not fit the KV cache")
    gen = torch.Generator().manual_seed(n * 1_000_003 + positions)  # fixed random tokens per probe shape
    vocab = runner.target.arch.vocab_size
    return [SeqState(-1 - i, torch.randint(0, vocab, (positions,), generator=gen).tolist(),
                     list(range(i * per_seq, (i + 1) * per_seq))) for i in range(n)]


def _timed(fn, runs: int) -> float:
    """Median of `runs` timings after a warm-up: robust to a noisy neighbour."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


@torch.inference_mode()
def validate_ms(runner: ModelRunner, n: int, q: int, ctx: int, runs: int = 3) -> float:
    seqs = _fake_seqs(runner, n, ctx + q)
    batch = AttnBatch.build([ctx] * n, [q] * n, [s.block_table for s in seqs], runner.block_size, runner.device)
    ids = torch.tensor([t for s in seqs for t in s.tokens[ctx:ctx + q]], device=runner.device)

    def forward():
        runner.target.logits(runner.target(ids, batch, runner.cache)).cpu()

    return _timed(forward, runs)


@torch.inference_mode()
def draft_step_ms(runner: ModelRunner, n: int, ctx: int, runs: int = 3) -> float:
    """One draft step: a catch-up of one token per sequence, then its distribution."""
    if runner.proposer is None:
        return 0.0
    seqs = _fake_seqs(runner, n, ctx + 2)
    hidden = runner.target.arch.hidden_size
    w = runner.target.lm_head.weight

    def step():
        for s in seqs:
            s.draft_len = s.num_computed = ctx
            s.reset_hidden(ctx - 1, torch.zeros(1, hidden, dtype=w.dtype, device=w.device))
            del s.tokens[ctx + 1:]
        torch.softmax(runner.proposer.begin(seqs, runner.block_size)[1].float().cpu(), dim=-1)

    return _timed(step, runs)
