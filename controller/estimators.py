"""Acceptance estimates c[i, j] from the draft distributions.

  top_prob             the draft's top probability at position j
  top_prob_calibrated  the same through an online per-position calibrator: observed
                       acceptance per (position, bucket of top probability)
  top_prob_logistic    an online per-position logistic model on the top probability p and
                       the margin p - p2 to the second largest (default)
  token_prob           the draft's probability of the token it drafted (xLLM's choice)

The top_prob estimators depend on the draft distribution at j but not on the token drawn
from it. `token_prob` makes the choice to verify a token depend on that token; it stays
lossless only because an unverified draft decides its own position in the sampler
(DESIGN.md section 8, rejection sampling). For greedy decoding it equals `top_prob`.
"""
from __future__ import annotations

import math

import numpy as np

def outcomes(k: int, verified: np.ndarray, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, k) masks: position j of sequence i was a trial if it was verified and every
    draft before it was accepted; a hit if it was accepted too (hits lie within trials)."""
    j = np.arange(k)[None, :]
    accepted = np.asarray(accepted)[:, None]
    trial = (j < np.asarray(verified)[:, None]) & (j <= accepted)
    return trial, trial & (j < accepted)


NUM_BUCKETS = 16
LOGIT_RANGE = (-6.0, 3.0)  # bucket edges, evenly spaced in log-odds: most drafts here have p < 0.1
PRIOR_WEIGHT = 8.0  # pseudo-trials at the raw top probability before data arrives
HALVE_AT = 4096  # forget old evidence: halve a bucket's counts when its trials reach this


class Calibrator:
    """Observed acceptance per (draft position, top-probability bucket). Updated only from
    validation outcomes, which every rank sees identically, so every rank's copy agrees."""

    EDGES = np.linspace(*LOGIT_RANGE, NUM_BUCKETS - 1)

    def __init__(self, k: int):
        self.hits = np.zeros((k, NUM_BUCKETS), dtype=np.int64)
        self.trials = np.zeros((k, NUM_BUCKETS), dtype=np.int64)
        mids = np.concatenate([[LOGIT_RANGE[0] - 0.5], (self.EDGES[:-1] + self.EDGES[1:]) / 2, [LOGIT_RANGE[1] + 0.5]])
        self.centers = 1.0 / (1.0 + np.exp(-mids))  # the prior: each bucket's middle probability

    @classmethod
    def buckets(cls, top_prob: np.ndarray) -> np.ndarray:
        """Buckets evenly spaced in log-odds (uniform ones in p put most drafts into the first)."""
        p = np.clip(np.asarray(top_prob, dtype=np.float64), 1e-6, 1 - 1e-6)
        return np.searchsorted(cls.EDGES, np.log(p) - np.log1p(-p))

    def estimate(self, top_prob: np.ndarray, start: int = 0) -> np.ndarray:
        """top_prob: (n, k') of positions start..start+k'-1 -> calibrated acceptance (n, k')."""
        b = self.buckets(top_prob)
        j = np.broadcast_to(np.arange(start, start + b.shape[1]), b.shape)
        hits, trials = self.hits[j, b], self.trials[j, b]
        return (hits + PRIOR_WEIGHT * self.centers[b]) / (trials + PRIOR_WEIGHT)

    def update(self, top_prob: np.ndarray, verified: np.ndarray, accepted: np.ndarray, repeat: int = 1) -> None:
        """Count each trial and hit (`outcomes`) in its (position, bucket), `repeat` times (each
        stands for that many: a sample of the calibration batch)."""
        n, k = top_prob.shape
        trial, hit = outcomes(k, verified, accepted)
        rows, pos = np.nonzero(trial)
        cell = pos * NUM_BUCKETS + self.buckets(top_prob[rows, pos])  # only the trials' buckets
        size = k * NUM_BUCKETS
        trials = np.bincount(cell, minlength=size).reshape(k, NUM_BUCKETS)
        hits = np.bincount(cell, hit[rows, pos], minlength=size).astype(np.int64).reshape(k, NUM_BUCKETS)
        self.trials[:k] += repeat * trials
        self.hits[:k] += repeat * hits
        full = self.trials >= HALVE_AT
        if full.any():
            self.trials[full] //= 2
            self.hits[full] //= 2

    def position_rates(self) -> np.ndarray:
        """(k,) observed conditional acceptance per position (prior 0.5 where no data)."""
        hits, trials = self.hits.sum(1), self.trials.sum(1)
        return (hits + 0.5 * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)


START = [0.0, 0.0, 0.0, 0.0]  # the logistic model's start: 0.5 for every draft
PRIOR_PRECISION = 1.0  # the logistic model's starting curvature (how firmly it holds its start)
FORGET = 0.999  # per step: old evidence fades, so the model follows a drifting workload
EPS = 1e-4
NEWTON_ITERS = 2  # damped Newton steps per calibration batch at most ...
NEWTON_TOL = 1e-4  # ... fewer once a step moves no weight by this much
HALVINGS = 10  # a step is halved at most this often before it is left out


class LogisticCalibrator:
    """P(accept) = sigmoid(w_j . [1, log p, log(1 - p), log(p - p2)]) per position j, p and
    p2 the draft's two largest probabilities there. The margin p - p2 raised the held-out
    AUC from 0.78 to 0.85 and cut the log-loss from 0.45 to 0.40 (batch fits on half of
    8,038 fully verified static-7 rows of a recorded trace, scored on the rest; the entropy
    and the path's log probability added nothing next to it). Starts at 0.5 for every draft:
    started at the raw top probability (w = [0, 1, -1, 0]), an under-confident draft's
    estimates stayed near 0.01 where 68% were accepted, the keep rule never verified those,
    and only verified drafts teach the model. Fitted online, second order (a few hundred drafts
    suffice, where gradient steps on these unscaled features were slow and unstable): a running
    (k, 4, 4) curvature of the old evidence holds w near where it was, and each batch of
    outcomes moves w toward the least of that quadratic plus the batch's log-loss by up to
    NEWTON_ITERS Newton steps, each halved until that objective falls; then the batch's
    curvature at the new w joins the running one. (One full step, the way it was first fitted,
    overshot where a large batch contradicted confident estimates.) Old curvature fades
    (FORGET a step) and what fades returns as the start's, pulling toward START, so the matrix
    never drops below PRIOR_PRECISION * I: a long run of identical drafts cannot make it singular. Float64
    operations in a fixed order on inputs every rank holds identically, so every rank's
    weights agree."""

    WIDTH = 4

    def __init__(self, k: int):
        self.w = np.tile(np.array(START), (k, 1))
        self._prior = np.eye(self.WIDTH) * PRIOR_PRECISION
        self.h = np.tile(self._prior, (k, 1, 1))
        self._w = self.w.tolist()  # the weights as Python floats (estimate_column's small path)

    @staticmethod
    def features(top_prob: np.ndarray, margin: np.ndarray) -> np.ndarray:
        """Top probabilities and margins (same shape) -> features, one more axis of 4."""
        p = np.clip(np.asarray(top_prob, dtype=np.float64), EPS, 1 - EPS)
        m = np.clip(np.asarray(margin, dtype=np.float64), EPS, 1.0)
        return np.stack([np.ones_like(p), np.log(p), np.log1p(-p), np.log(m)], axis=-1)

    def estimate(self, top_prob: np.ndarray, margin: np.ndarray) -> np.ndarray:
        """(n, k') of positions 0..k'-1 -> (n, k') estimates."""
        x = self.features(top_prob, margin)
        return _sigmoid((x * self.w[None, : x.shape[1]]).sum(-1))

    def estimate_column(self, top_prob, margin, j: int, compiled=None):
        """Position j's estimates for one column, each the same double as estimate_one's:
        a list for lists (a few values: numpy's per-call cost would dominate), an array for
        arrays, computed by the kernels' logistic_column where compiled is given (the
        same libm calls in the same order), else draft by draft."""
        if not isinstance(top_prob, list):
            if compiled is not None:
                return compiled.logistic_column(self._w[j], top_prob, margin)
            return np.array([self.estimate_one(float(p), float(m), j) for p, m in zip(top_prob, margin)])
        return [self.estimate_one(p, m, j) for p, m in zip(top_prob, margin)]

    def estimate_one(self, p: float, m: float, j: int) -> float:
        """Position j's estimate for one draft (plain Python)."""
        return logistic_estimate(self._w[j], p, m)

    @property
    def weights(self) -> list[list[float]]:
        """(w0, w1, w2, w3) per position, as Python floats."""
        return self._w

    def update(self, top_prob: np.ndarray, margin: np.ndarray, verified: np.ndarray, accepted: np.ndarray,
               steps: int = 1, weights: np.ndarray | None = None) -> None:
        """Outcomes of `steps` steps at once (their old evidence fades `steps` times). Only
        the trials enter the sums (per position, over its slice of the trials sorted by
        position: linear in the trials). weights: (n, k), each draft's weight in the log-loss
        (default 1)."""
        n, k = np.asarray(top_prob).shape
        if k == 0:
            return
        trial, hit = outcomes(k, verified, accepted)
        rows, pos = np.nonzero(trial)
        if not len(rows):
            return
        order = np.argsort(pos, kind="stable")  # the trials by position: each position's a slice (`cuts`)
        rows, pos = rows[order], pos[order]
        cuts = np.searchsorted(pos, np.arange(k + 1))
        x = self.features(np.asarray(top_prob)[rows, pos], np.asarray(margin)[rows, pos])  # (T, 4)
        y = hit[rows, pos].astype(np.float64)
        # inverse sampling rates: a rarely verified kind of draft counts for all of its kind
        sw = np.ones(len(rows)) if weights is None else np.asarray(weights, dtype=np.float64)[rows, pos]
        fade = FORGET ** steps
        # the old evidence, faded, holds w near where it was (held); what faded returns as the start's pull (back)
        held, back = fade * self.h[:k], (1.0 - fade) * self._prior
        prior = held + back
        anchor = (held @ self.w[:k, :, None])[..., 0] + back @ np.array(START)
        w = self.w[:k].copy()
        z = _logits(x, w, cuts)
        now = _objective(z, w, prior, anchor, cuts, sw, y)
        for _ in range(NEWTON_ITERS):
            p = _sigmoid(z)
            grad = (prior @ w[..., None])[..., 0] - anchor + _sums(cuts, sw * (p - y), x)
            step = -np.linalg.solve(prior + _curvature(cuts, sw * p * (1 - p), x), grad[..., None])[..., 0]
            # A full step overshoots where the batch's outcomes contradict confident estimates (curvature near
            # 0 there, gradient large): one step of 512 drafts moved a position's weights from [3.6, -1.0, -0.3,
            # -1.3] to [13.2, 5.2, -6.4, 15.9] and the next to [14.0, -67.1, 18.7, 13.9]. Halved, per position,
            # until the objective falls (or left out).
            scale = np.ones(k)
            for _ in range(HALVINGS + 1):
                tried = w + scale[:, None] * step
                z_tried = _logits(x, tried, cuts)
                moved = _objective(z_tried, tried, prior, anchor, cuts, sw, y)
                worse = moved > now
                if not worse.any():
                    break
                scale[worse] *= 0.5
            better = ~worse
            step *= np.where(better, scale, 0.0)[:, None]
            w += step
            z = np.where(better[pos], z_tried, z)
            now = np.where(better, moved, now)
            if np.abs(step).max() < NEWTON_TOL:
                break
        p = _sigmoid(z)
        self.h[:k] = prior + _curvature(cuts, sw * p * (1 - p), x)  # the batch's curvature where w landed
        self.w[:k] = w
        self._w = self.w.tolist()


def logistic_estimate(w: list[float], p: float, m: float) -> float:
    """The logistic estimate of one draft from its top probability p and margin m; w: its
    position's (w0, w1, w2, w3). (models/csrc/one_row.cpp computes the same, bit for bit.)"""
    w0, w1, w2, w3 = w
    p, m = min(max(p, EPS), 1 - EPS), min(max(m, EPS), 1.0)
    z = min(max(w0 + w1 * math.log(p) + w2 * math.log1p(-p) + w3 * math.log(m), -60.0), 60.0)
    return 1.0 / (1.0 + math.exp(-z))


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0)))


def _sums(cuts: np.ndarray, values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(k, 4): per position (the trials cuts[j]:cuts[j + 1]), the sum of values times each feature."""
    return np.stack([values[a:b] @ x[a:b] for a, b in zip(cuts[:-1], cuts[1:])])


def _curvature(cuts: np.ndarray, weight: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(k, 4, 4): per position, the sum of weight times x x^T."""
    xw = x * weight[:, None]
    return np.stack([xw[a:b].T @ x[a:b] for a, b in zip(cuts[:-1], cuts[1:])])


def _logits(x: np.ndarray, w: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """(T,): each trial's w_j . x, position by position."""
    return np.concatenate([x[a:b] @ w[j] for j, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))])


def _objective(z, w, prior, anchor, cuts, sw, y) -> np.ndarray:
    """(k,): per position, the quadratic that holds w (0.5 w^T prior w - anchor . w) plus the batch's
    weighted log-loss at logits z."""
    loss = sw * (np.logaddexp(0.0, z) - y * z)
    held = 0.5 * (w[:, None, :] @ prior @ w[..., None])[:, 0, 0] - (anchor * w).sum(-1)
    return held + np.array([loss[a:b].sum() for a, b in zip(cuts[:-1], cuts[1:])])
