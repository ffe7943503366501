"""A sequence's own draft record, and how it shifts what a batch-1 step expects of its drafts.

The budget and the early stop expect a draft not yet made to be accepted at its position's
rate over every sequence. Sequences differ far more than that: on a served run's batch-1
steps of static-3, the share of steps whose three drafts were all accepted ran from 0 to 0.88
across requests (median 0.5, 10th-90th percentile 0.26-0.69). Replaying those steps' outcomes
under the run's mean step times, a depth chosen step by step from each request's record so
far (this module's rule) made about 3.5% more tokens per ms than the best one depth for all
(0.999 vs 0.965).

The record is the sequence's accepted drafts (hits) and its drafts verified up to the first
rejection (trials, the conditional trials the rates count), each outcome weighing
HISTORY_DECAY less each later step of the sequence, whether it drafted or not (`fade`): a
record that stands its sequence down gets no new outcomes, and without the fade a bad
stretch of six or seven steps had kept a sequence plain to its end (in one process, a request
alone after a stretch at batch 2: level -3, 160 steps without a draft but the probes').
Faded, it drifts back to the pooled rates within about 25 steps and the sequence drafts
again. Its rate, shrunk toward the pooled one by HISTORY_WEIGHT pseudo-trials, shifts every
position's rate by the same amount in logits, rounded to a LEVEL_STEP grid of at most
LEVELS steps either way: a step's rates, budget terms and batch-1 OneRow are then those of
its level, each computed once per calibration batch (controller/policy.py). Only batch 1
reads it: a larger batch's budget and early stop are one decision for all its rows.

Off by default (`speculative.adaptive.seq_history`): offline at batch 1, in runs with and
without it in turn, adaptive / static-3 read 0.993-1.003 with it and 1.004-1.019 without,
and its controller took 0.050-0.054 ms a step against 0.047-0.048 (DESIGN.md section 3).
When it is off the runner keeps no record and hands begin_step none.

Every rank keeps the same record (the same outcomes, the same float operations in the same
order), so every rank finds the same level.
"""
from __future__ import annotations

import math
from bisect import bisect_right

HISTORY_WEIGHT = 8.0  # pseudo-trials at the pooled rate a record starts from
HISTORY_DECAY = 0.9  # an outcome weighs this much less each later step of the sequence
LEVEL_STEP = 0.5  # the shift's resolution (logits) ...
LEVELS = 4  # ... and its bound in steps either way (+-2 logits)
EMPTY = 0.01  # a record of fewer trials is dropped (fade)
EDGE = 1e-6  # rates are held inside (EDGE, 1 - EDGE) before their logits are taken


def record(hits: float, trials: float, verified: int, accepted: int) -> tuple[float, float]:
    """A record (hits, trials) after a step that verified `verified` drafts of the sequence,
    `accepted` of them: every draft up to and including the first rejected one was a trial."""
    return hits * HISTORY_DECAY + accepted, trials * HISTORY_DECAY + min(verified, accepted + 1)


def fade(hits: float, trials: float) -> tuple[float, float]:
    """A record after a step that verified none of the sequence's drafts (below EMPTY trials,
    an empty one)."""
    if trials * HISTORY_DECAY < EMPTY:
        return 0.0, 0.0
    return hits * HISTORY_DECAY, trials * HISTORY_DECAY


def level(hits: float, trials: float, pooled: float) -> int:
    """The record's shift from the pooled conditional rate, in LEVEL_STEP logits (0: none)."""
    return level_in(hits, trials, pooled, bounds(pooled))


def bounds(pooled: float) -> list[float]:
    """The record rates where the level steps up, from -LEVELS to LEVELS: halfway between two
    levels' shifted pooled rates, in logits. Computed once per calibration batch, so that a
    step finds its level with one bisection and no logarithm (level_in)."""
    return [1.0 / (1.0 + math.exp(-(_logit(pooled) + (k + 0.5) * LEVEL_STEP))) for k in range(-LEVELS, LEVELS)]


def level_in(hits: float, trials: float, pooled: float, steps_at: list[float]) -> int:
    """level, given the pooled rate's bounds: the record's rate shrunk toward the pooled one,
    placed among them."""
    if trials <= 0.0:
        return 0
    return bisect_right(steps_at, (hits + HISTORY_WEIGHT * pooled) / (trials + HISTORY_WEIGHT)) - LEVELS


def shifted(rates: list[float], at: int) -> list[float]:
    """Conditional acceptance rates shifted by `at` levels in logits (level 0: as given)."""
    if not at:
        return list(rates)
    shift = at * LEVEL_STEP
    return [1.0 / (1.0 + math.exp(-(_logit(r) + shift))) for r in rates]


def shifted_shares(accepted: list[float], verified: list[float], at: int) -> list[float]:
    """The budget's accepted shares per position (DraftYields.shares: of the drafts made there,
    the share accepted, a path probability) shifted by `at` levels: each position's share over
    the one before taken as its conditional rate, shifted, and multiplied up again; never
    above the share verified there (a draft is accepted only if verified)."""
    if not at:
        return list(accepted)
    out, path, before = [], 1.0, 1.0
    for share, kept in zip(accepted, verified):
        rate = share / before if before > 0.0 else 0.0
        before = share
        path = min(path * shifted([rate], at)[0], kept)
        out.append(path)
    return out


def _logit(p: float) -> float:
    p = min(max(p, EDGE), 1.0 - EDGE)
    return math.log(p / (1.0 - p))
