"""Poisson load: requests arrive at a rate, an engine of at most `max_batch` sequences
admits them as slots free (continuous batching), prefills them and decodes them with the
same controller replay as the waves (replay.Run).

A request replays one recorded sequence: its prompt length is that sequence's starting
context, its output `output_len` tokens. Admitted requests are prefilled together in one
forward (the cost model's validate time for their prompt tokens at context 0), which emits
each one's first token; decode steps follow, one per engine iteration, over every running
sequence. Reported per arm and rate: output tokens per second over the whole run (prefill
included), the median time per output token after the first (TPOT), and the median and
99th-percentile time to the first token (TTFT).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from cluster.sim.replay import Run, SimArm, SimResult
from cluster.sim.traces import DraftPool


def simulate_load(arm: SimArm, rate: float, pool: DraftPool, cost, spec, startup, output_len: int,
                  num_requests: int, seed: int = 0, control_time: bool = True) -> dict:
    """arm.batch is the engine's largest batch; rate in requests per second."""
    if rate <= 0:
        raise ValueError(f"rate {rate} must be positive (requests per second)")
    run = Run.start(arm, pool, spec, startup, seed)
    rng = np.random.default_rng(seed + 1)  # the same arrivals and requests for every arm at this seed
    arrivals = np.cumsum(rng.exponential(1e3 / rate, num_requests))  # ms
    sources = rng.integers(0, len(pool.sizes), num_requests)
    waiting, slots = deque(range(num_requests)), arm.batch
    kv, left = np.zeros(slots, dtype=np.int64), np.zeros(slots, dtype=np.int64)
    source, owner = np.zeros(slots, dtype=np.int64), np.full(slots, -1)
    first, done = np.zeros(num_requests), np.zeros(num_requests)
    out, now, finished = SimResult(arm), 0.0, 0
    while finished < num_requests:
        free = np.flatnonzero(owner < 0)
        admit = []
        while waiting and arrivals[waiting[0]] <= now and len(admit) < len(free):
            admit.append(waiting.popleft())
        live = np.flatnonzero(left > 0)
        if not admit and not live.size:
            now = arrivals[waiting[0]]  # idle until the next request
            continue
        if admit:
            prompts = pool.kv[sources[admit]]
            now += cost.validate_ms(prompts, np.zeros(len(admit))) + cost.other_ms(len(admit), len(admit))
            for slot, r in zip(free, admit):
                owner[slot], source[slot], kv[slot] = r, sources[r], pool.kv[sources[r]]
                left[slot], first[r] = output_len - 1, now
            continue
        now += run.step(live, kv, left, source, cost, out, control_time)
        for slot in live[left[live] <= 0]:
            done[owner[slot]], owner[slot] = now, -1
            finished += 1
    ttft = first - arrivals
    tpot = (done - first) / max(output_len - 1, 1)
    summary = out.summary()
    summary.update(name=f"{arm.name}@{rate:g}/s", rate=rate, max_batch=arm.batch,
                   tok_per_s=round(1e3 * num_requests * output_len / now, 2),
                   tpot_p50_ms=round(float(np.median(tpot)), 3), ttft_p50_ms=round(float(np.median(ttft)), 3),
                   ttft_p99_ms=round(float(np.percentile(ttft, 99)), 3),
                   mean_batch=round(out.seq_steps / max(out.steps, 1), 2))
    return summary
