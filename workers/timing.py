"""Timing probes for the startup sweep: a validate forward of n sequences x q tokens at a
given context length, and the draft positions of a decode step for n sequences. They use throwaway sequence
states over the first cache blocks, so run them before any request is admitted. Every
rank must run the same probe at the same time (the forwards contain collectives)."""
from __future__ import annotations

import time

import numpy as np
import torch

from controller.catchup import SWEEP_CATCHUP  # tokens a timed draft step catches up on per sequence
from models.attention import AttnBatch
from workers.drafting import draft_rows
from workers.plan import SamplingParams
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
def draft_ms(runner: ModelRunner, n: int, ctx: int, steps: int, runs: int = 3, catchup: int = SWEEP_CATCHUP) -> float:
    """`steps` draft positions for n sequences as a decode step drafts them (the runner's own
    draft loop): a catch-up of `catchup` tokens per sequence (SWEEP_CATCHUP: a steady step's; more:
    one after standing down), then the draft forwards,
    each with its distribution's top two. A catch-up of one token and no draft loop, as
    the sweep once timed, made batch 8's three draft positions look 4.1 ms where steady decode
    steps took 5.6: the budget drafted there until online draft times had corrected the model,
    stood down, and drafted again once they had left the registry's window."""
    if runner.proposer is None:
        return 0.0
    seqs = _fake_seqs(runner, n, ctx + steps + 1)
    hidden = runner.target.arch.hidden_size
    w = runner.target.lm_head.weight
    params = [SamplingParams()] * n  # greedy
    if not 1 <= catchup < ctx:
        raise ValueError(f"a draft's catch-up of {catchup} tokens needs 1..{ctx - 1} (context {ctx})")
    start = ctx - catchup  # the hiddens of positions start..ctx-1 pair with tokens start+1..ctx
    zeros = torch.zeros(catchup, hidden, dtype=w.dtype, device=w.device)

    def run():
        for s in seqs:
            s.num_computed, s.draft_len = ctx, start + 1
            s.hidden_start = start
            runner.proposer.start(s, zeros)
            del s.tokens[ctx + 1:]
        draft_rows(runner.proposer, seqs, params, steps, lambda *_: None, False, runner.block_size, runner.device)

    return _timed(run, runs)
