"""The validate-time model and its least-squares fit.

    T_val = b0 + b1 * sum_i q_i + b2 * sum_i q_i * kv_i      (ms)
    T_draft = d0 + d1 * n                                     (ms per draft step)

q_i is the number of tokens sequence i validates (kept drafts + 1) and kv_i its context
length. Fitted by least squares on measured steps, coefficients non-negative.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TIME_UNIT_NS = 100  # the decision compares times as integers of this many nanoseconds
_UNITS_PER_MS = 1_000_000 // TIME_UNIT_NS


@dataclass(frozen=True)
class TimeModel:
    version: int = 0
    b0: float = 1.0  # ms per validate forward
    b1: float = 0.1  # ms per validated token
    b2: float = 0.0  # ms per validated token per context token
    d0: float = 0.5  # ms per draft step
    d1: float = 0.01  # ms per draft step per sequence

    def validate_ms(self, q: np.ndarray, kv: np.ndarray) -> float:
        q, kv = np.asarray(q, dtype=np.float64), np.asarray(kv, dtype=np.float64)
        return self.b0 + self.b1 * q.sum() + self.b2 * (q * kv).sum()

    def validate_ms_from(self, q_tokens: int, kv_tokens: int) -> float:
        """The same prediction from the summed features."""
        return self.b0 + self.b1 * q_tokens + self.b2 * kv_tokens

    def draft_step_ms(self, n: int) -> float:
        return self.d0 + self.d1 * n

    def step_units(self, kv: np.ndarray, draft_ms: float) -> tuple[int, np.ndarray]:
        """Integer time of a step that validates one token per sequence (plus the draft
        time), and (n,) the integer cost of each further token of sequence i."""
        kv = np.asarray(kv, dtype=np.int64)
        per_token = np.rint((self.b1 + self.b2 * kv.astype(np.float64)) * _UNITS_PER_MS).astype(np.int64)
        base = int(round((draft_ms + self.b0) * _UNITS_PER_MS)) + int(per_token.sum())
        return max(base, 1), per_token


def features(q: np.ndarray, kv: np.ndarray) -> np.ndarray:
    """One row of the design matrix for a step: [1, sum q, sum q*kv]."""
    q, kv = np.asarray(q, dtype=np.float64), np.asarray(kv, dtype=np.float64)
    return np.array([1.0, q.sum(), (q * kv).sum()])


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients clipped at zero: refit with the clipped ones removed
    until none is negative (an active-set pass; at most as many rounds as columns)."""
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        coef[:] = 0.0
        coef[active] = sol
        if (coef >= 0).all():
            break
        active &= coef > 0
    return np.clip(coef, 0.0, None)


@dataclass(frozen=True)
class FitReport:
    model: TimeModel
    mae_ms: float
    mape: float
    samples: int


def relative_nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Minimise relative, not absolute, error: every row is scaled by 1/y, so a 5 ms
    batch-1 step counts as much as a 50 ms batch-32 step (decisions at batch 1 hinge on
    the ratio of the per-step and per-token terms)."""
    w = 1.0 / np.maximum(np.abs(y), 1e-6)
    return nonneg_lstsq(x * w[:, None], y * w)


def robust_nonneg_lstsq(x: np.ndarray, y: np.ndarray, rounds: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative least squares that drops outliers (a neighbour stealing the CPU for a
    moment makes one timing 50x too long): points whose residual exceeds 4 robust
    standard deviations (and 20% of their value) are left out, then refit. Returns
    (coefficients, mask of the points kept)."""
    keep = np.ones(len(y), dtype=bool)
    coef = relative_nonneg_lstsq(x, y)
    for _ in range(rounds):
        resid = y - x @ coef
        mad = np.median(np.abs(resid[keep] - np.median(resid[keep]))) * 1.4826
        new = (np.abs(resid) <= np.maximum(4 * mad, 0.2 * np.abs(y))) | (resid < 0)
        if new.sum() < x.shape[1] or (new == keep).all():
            break
        keep = new
        coef = relative_nonneg_lstsq(x[keep], y[keep])
    return coef, keep


def fit(rows: np.ndarray, validate_ms: np.ndarray, draft_n: np.ndarray, draft_ms: np.ndarray,
        version: int) -> FitReport:
    """rows: (m, 3) features of validate steps; draft_n / draft_ms: draft steps' batch
    sizes and times per draft step. MAE and MAPE are over the points the fit kept."""
    b, kept = robust_nonneg_lstsq(rows, validate_ms)
    d = (robust_nonneg_lstsq(np.stack([np.ones_like(draft_n, dtype=np.float64), draft_n], 1), draft_ms)[0]
         if len(draft_n) >= 2 else np.array([0.5, 0.01]))
    model = TimeModel(version, float(b[0]), float(b[1]), float(b[2]), float(d[0]), float(d[1]))
    pred = rows[kept] @ b
    err = np.abs(pred - validate_ms[kept])
    return FitReport(model, float(err.mean()), float((err / np.maximum(validate_ms[kept], 1e-6)).mean()),
                     int(kept.sum()))
