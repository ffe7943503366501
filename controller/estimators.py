"""Acceptance estimates c[i, j] from the draft distributions.

  top_prob             the draft's top probability at position j
  top_prob_calibrated  the same through an online per-position calibrator (default)
  token_prob           the draft's probability of the token it drafted (xLLM's choice)

Under sampling only the first two are lossless: they depend on the draft distribution
at j but not on the token drawn from it. `token_prob` makes the choice to verify a token
depend on that token, which skews the output distribution (DESIGN.md section 3); it is
allowed for greedy decoding only, where it equals `top_prob`.
"""
from __future__ import annotations

import numpy as np

NUM_BUCKETS = 16
PRIOR_WEIGHT = 8.0  # pseudo-trials at the raw top probability before data arrives
HALVE_AT = 4096  # forget old evidence: halve a bucket's counts when its trials reach this


class Calibrator:
    """Observed acceptance per (draft position, top-probability bucket). Updated only from
    validation outcomes, which every rank sees identically, so every rank's copy agrees."""

    def __init__(self, k: int):
        self.hits = np.zeros((k, NUM_BUCKETS), dtype=np.int64)
        self.trials = np.zeros((k, NUM_BUCKETS), dtype=np.int64)
        self.centers = (np.arange(NUM_BUCKETS) + 0.5) / NUM_BUCKETS

    @staticmethod
    def buckets(top_prob: np.ndarray) -> np.ndarray:
        return np.minimum((np.asarray(top_prob) * NUM_BUCKETS).astype(np.int64), NUM_BUCKETS - 1)

    def estimate(self, top_prob: np.ndarray) -> np.ndarray:
        """top_prob: (n, k') with k' <= k -> calibrated acceptance (n, k')."""
        b = self.buckets(top_prob)
        j = np.broadcast_to(np.arange(b.shape[1]), b.shape)
        hits, trials = self.hits[j, b], self.trials[j, b]
        return (hits + PRIOR_WEIGHT * self.centers[b]) / (trials + PRIOR_WEIGHT)

    def update(self, top_prob: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        """Position j of sequence i was a trial if it was verified and every draft before it
        was accepted; a hit if it was accepted too."""
        n, k = top_prob.shape
        j = np.arange(k)[None, :]
        trial = (j < np.asarray(verified)[:, None]) & (j <= np.asarray(accepted)[:, None])
        hit = j < np.asarray(accepted)[:, None]
        b = self.buckets(top_prob)
        jj = np.broadcast_to(j, (n, k))
        np.add.at(self.trials, (jj[trial], b[trial]), 1)
        np.add.at(self.hits, (jj[hit & trial], b[hit & trial]), 1)
        full = self.trials >= HALVE_AT
        if full.any():
            self.trials[full] //= 2
            self.hits[full] //= 2

    def position_rates(self) -> np.ndarray:
        """(k,) observed conditional acceptance per position (prior 0.5 where no data)."""
        hits, trials = self.hits.sum(1), self.trials.sum(1)
        return (hits + 0.5 * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)


def confidence(estimator: str, top_prob: np.ndarray, token_prob: np.ndarray,
               calibrator: Calibrator | None) -> np.ndarray:
    """(n, k) acceptance estimates for the chosen estimator."""
    if estimator == "top_prob":
        return top_prob
    if estimator == "token_prob":
        return token_prob
    if estimator == "top_prob_calibrated":
        return calibrator.estimate(top_prob)
    raise ValueError(f"unknown estimator {estimator!r}")
