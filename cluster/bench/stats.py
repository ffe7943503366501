"""Medians and bootstrap intervals over benchmark rounds.

Every arm is measured in several interleaved rounds; a ratio between two arms is taken
per round (both measured side by side, so drift of the machine cancels) and summarised
by its median and a 95% percentile-bootstrap interval of that median.
"""
from __future__ import annotations

import numpy as np

RESAMPLES = 10_000
LEVEL = 0.95


def median(values: list[float]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))


def bootstrap_ci(values: list[float], seed: int = 0, resamples: int = RESAMPLES,
                 level: float = LEVEL) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of `values` (seeded: same input, same
    interval). One value gives a zero-width interval."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    if x.size == 1:
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, x.size, size=(resamples, x.size))], axis=1)
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(medians, [tail, 100 - tail])
    return float(low), float(high)


def ratio_summary(arm: list[float], to: list[float], seed: int = 0) -> tuple[float, tuple[float, float]]:
    """Median and interval of the per-round ratios arm[r] / to[r]."""
    if len(arm) != len(to):
        raise ValueError(f"ratio of {len(arm)} rounds to {len(to)} rounds")
    ratios = [a / b for a, b in zip(arm, to)]
    return median(ratios), bootstrap_ci(ratios, seed)


def contains_one(ci: tuple[float, float] | list[float]) -> bool:
    return ci[0] <= 1.0 <= ci[1]
