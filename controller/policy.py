"""Speculation control on one rank: draft budget, early stop, the keep decision, and
calibration. Everything here is a deterministic function of what every rank holds (the
gathered draft distributions, validation outcomes, the plan's mode, step and time-model
version), so all ranks reach the same answers without talking to each other.

Modes (chosen per step by the plan):
  static    draft k, verify every draft
  adaptive  draft budget, early stop and the causal keep decision (DESIGN.md section 3)
  oracle    verify exactly the drafts that match a known reference continuation (benchmark
            floor on validate cost; needs the reference tokens in the plan)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from controller.config import SpeculativeConfig
from controller.decision import decide
from controller.estimators import Calibrator, LogisticCalibrator, confidence
from controller.time_model import TimeModel

MODES = ("static", "adaptive", "oracle")
PROBE_EVERY = 32  # an adaptive step explores one draft position past the budget every 32 steps ...
PROBE_MAX_EVERY = 1024  # ... backing off (doubling) while probes keep finding that drafting does not pay ...
PROBE_SHARE = 4  # ... and verifies everything drafted for every 4th sequence (rotating)


@dataclass
class StepContext:
    mode: str
    probe: bool
    kv: np.ndarray  # (n,) context length of each sequence
    max_keep: np.ndarray  # (n,) drafts each sequence may verify
    model: TimeModel
    oracle: np.ndarray | None  # (n, k) reference tokens after the last emitted one (-1 past the end)


class SpecPolicy:
    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self.calibrator = Calibrator(max(cfg.num_speculative_tokens, 1))  # also the draft budget's position rates
        self.logistic = LogisticCalibrator(max(cfg.num_speculative_tokens, 1))
        self.models: dict[int, TimeModel] = {0: TimeModel()}
        self.in_use = 0  # the newest version a plan has named
        self._lock = threading.Lock()
        self.adaptive_steps = 0  # counted identically on every rank (every rank runs every plan)
        self.probes = 0
        self.probe_every = PROBE_EVERY
        self.last_probe = -PROBE_EVERY  # the first adaptive step probes
        self.ctx: StepContext | None = None

    # ------------------------------------------------------------------ time models
    def install(self, model: TimeModel) -> int:
        # Installs may arrive on another thread than steps (Ray Compiled Graph): lock.
        with self._lock:
            self.models[model.version] = model
            self._evict()
        return model.version

    def model(self, version: int) -> TimeModel:
        """The model a plan names. Plans name non-decreasing versions, so older ones go."""
        with self._lock:
            if version not in self.models:
                raise KeyError(f"time model version {version} is not on this rank (never installed, or older "
                               f"than v{self.in_use}, which plans already use)")
            if version > self.in_use:
                self.in_use = version
                self._evict()
            return self.models[version]

    def _evict(self) -> None:
        """Drop versions older than the one plans use now; never that one or newer ones
        (the Engine may still be on it however many refits arrive before it moves)."""
        for old in [v for v in self.models if v < self.in_use]:
            del self.models[old]

    def latest(self) -> TimeModel:
        with self._lock:
            return self.models[max(self.models)]

    # ------------------------------------------------------------------ one step
    def begin_step(self, mode: str, kv: np.ndarray, max_keep: np.ndarray, version: int,
                   oracle: np.ndarray | None = None) -> StepContext:
        """Probe steps: without them, drafts the estimate calls hopeless would never be
        verified, and the calibrator could never learn that they are not. A probe drafts
        one position past the budget and verifies all drafts of a rotating quarter of the
        sequences: cheap enough to run where speculation does not pay. (Drafting all k at a
        probe was tried: DESIGN.md section 8, probes.)"""
        if mode not in MODES:
            raise ValueError(f"unknown speculation mode {mode!r}; expected one of {MODES}")
        probe = False
        if mode == "adaptive":
            self.adaptive_steps += 1
            probe = self.adaptive_steps - self.last_probe >= self.probe_every
            if probe:
                self.last_probe, self.probes = self.adaptive_steps, self.probes + 1
        self.ctx = StepContext(mode, probe, kv, max_keep, self.model(version), oracle)
        return self.ctx

    def draft_budget(self, k: int) -> int:
        """How many draft steps to run: the m in 0..k that maximises the estimated
        throughput n (1 + a_1 + .. + a_m) / (m T_step + T_val) when every sequence has the
        calibrated acceptance of each position and the batch's mean context (O(k) scalar
        arithmetic, the same on every rank). 0 means a plain decode step."""
        c = self.ctx
        if c.mode != "adaptive" or k == 0:
            return k
        tm, n = c.model, len(c.kv)
        kv_sum = float(np.sum(c.kv))
        a = np.cumprod(self.calibrator.position_rates()[:k])
        best_m, best, expected = 0, 1.0 / (tm.other_ms(n) + tm.validate_ms_from(n, kv_sum)), 1.0
        draft_ms = tm.draft_step_ms(n)
        for m in range(1, k + 1):
            expected += a[m - 1]
            theta = expected / (tm.other_ms(n * expected) + m * draft_ms
                                + tm.validate_ms_from(n * (m + 1), (m + 1) * kv_sum))
            if theta > best * (1.0 + self.cfg.adaptive.min_gain):
                best_m, best = m, theta
        if c.probe:  # back off while probing keeps confirming that drafting does not pay
            self.probe_every = min(PROBE_MAX_EVERY, self.probe_every * 2) if best_m == 0 else PROBE_EVERY
            return min(k, best_m + 1)
        return best_m

    def keep_drafting(self, top_prob: np.ndarray, tokens: np.ndarray) -> bool:
        """After j draft steps (top_prob, tokens: (n, j)), is draft j+1 worth drafting?
        adaptive: only if some sequence would keep it even with confidence 1;
        oracle: only if some sequence still matches the reference."""
        c = self.ctx
        n, j = top_prob.shape
        if c.mode == "oracle":
            return bool((self._oracle_match(tokens) >= j).any())
        if c.mode != "adaptive" or c.probe or not self.cfg.adaptive.early_stop:
            return True
        conf = np.concatenate([self.confidence(top_prob, top_prob), np.ones((n, 1))], axis=1)
        draft_ms = (j + 1) * c.model.draft_step_ms(n)  # predicted, never measured: same on every rank
        keep = decide(conf, c.kv, c.model, self.cfg.adaptive.min_gain, draft_ms, c.max_keep)
        return bool((keep > j).any())

    def keep(self, top_prob: np.ndarray, token_prob: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """(n,) drafts each sequence validates; top_prob, token_prob, tokens: (n, m)."""
        c = self.ctx
        m = top_prob.shape[1]
        if c.mode == "oracle":
            return np.minimum(np.minimum(self._oracle_match(tokens), c.max_keep), m)
        if c.mode == "static" or m == 0:
            return np.minimum(c.max_keep, m)
        conf = self.confidence(top_prob, token_prob)
        draft_ms = m * c.model.draft_step_ms(len(c.kv))
        keep = decide(conf, c.kv, c.model, self.cfg.adaptive.min_gain, draft_ms, c.max_keep)
        if c.probe:  # a rotating share of sequences verifies everything drafted
            chosen = (np.arange(len(keep)) + self.probes) % PROBE_SHARE == 0
            keep = np.where(chosen, np.minimum(c.max_keep, m), keep)
        return keep

    def _oracle_match(self, tokens: np.ndarray) -> np.ndarray:
        j = tokens.shape[1]
        match = tokens == self.ctx.oracle[:, :j]
        return np.cumprod(match, axis=1).sum(axis=1)

    # ------------------------------------------------------------------ estimates
    def confidence(self, top_prob: np.ndarray, token_prob: np.ndarray) -> np.ndarray:
        return confidence(self.cfg.adaptive.estimator, top_prob, token_prob, self.calibrator, self.logistic)

    def observe(self, top_prob: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        self.calibrator.update(top_prob, verified, accepted)
        if self.cfg.adaptive.estimator == "top_prob_logistic":
            self.logistic.update(top_prob, verified, accepted)
