"""A calibration batch's pending steps (SpecPolicy.observe holds them until the batch):
each step's (top_prob, margin, verified, accepted, rule, width), taken apart and stacked
into the arrays the estimators fit on."""
from __future__ import annotations

from itertools import chain

import numpy as np

from controller.step import EXPLORE_EVERY

BYTES_FROM = 16  # joined: lists longer than this (a step's sequences) go through bytes


def every(pending: list[tuple], r: int, offset: int) -> list[tuple]:
    """The pending steps' sequence-steps numbered offset, offset + r, offset + 2r, .. (counting
    across the steps in order), as pending steps of their own; steps left with none drop out."""
    out, base = [], 0
    for top, margin, verified, accepted, rule, width in pending:
        start = (offset - base) % r
        base += len(verified)
        if start < len(verified):
            out.append((top[start::r], margin[start::r], verified[start::r], accepted[start::r],
                        None if rule is None else rule[start::r], width))
    return out


def stacked(pending: list[tuple]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pending steps' top probabilities and margins, the first w_i columns of each step's
    (n_i, m_i) (w_i: the drafts some sequence verified), as (rows, width) arrays, past a step's
    width 0 and 1 (nothing was verified there), and each draft's weight: EXPLORE_EVERY for
    drafts only exploration verified (at or past the rule's choice), which stand for the
    EXPLORE_EVERY - 1 unverified like them, else 1. Built in a few array operations, not a few
    per step: at batch 1 a batch of 256 steps took 3.5 ms one by one. (Steps hand their whole
    draft block and the slicing happens here: between forward passes it cost batch 1 about
    10 us a step.)"""
    widths = [p[5] for p in pending]
    counts = [len(p[0]) for p in pending]
    rules: list = []
    for (t, _, _, _, rule, w) in pending:
        rules.extend([w] * len(t) if rule is None else rule.tolist() if isinstance(rule, np.ndarray) else rule)
    width, rows = max(widths), sum(counts)
    col = np.arange(width)[None, :]
    inside = col < np.repeat(np.asarray(widths), counts)[:, None]  # row-major, as each step's ravel
    top, margin, weights = np.zeros((rows, width)), np.ones((rows, width)), np.ones((rows, width))
    top[inside] = np.concatenate([t[:, :w].ravel() for t, _, _, _, _, w in pending])
    margin[inside] = np.concatenate([m[:, :w].ravel() for _, m, _, _, _, w in pending])
    weights[inside & (col >= np.asarray(rules, dtype=np.int64)[:, None])] = float(EXPLORE_EVERY)
    return top, margin, weights


def joined(parts: list) -> np.ndarray:
    """The pending steps' per-sequence values (lists of ints or int arrays) end to end, as
    one int64 array: lists (small batches) joined in Python, where converting each cost a
    numpy call; long lists of counts as bytes (a third of the time at batch 256: 8,192
    values in 50 us instead of 150)."""
    if all(isinstance(p, list) for p in parts):
        if parts and len(parts[0]) > BYTES_FROM:
            try:
                return np.frombuffer(b"".join(map(bytes, parts)), dtype=np.uint8).astype(np.int64)
            except ValueError:  # a value past 0..255
                pass
        return np.array(list(chain.from_iterable(parts)), dtype=np.int64)
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
