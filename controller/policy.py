"""Speculation control on one rank: draft budget, early stop, the keep decision, and
calibration. Everything here is a deterministic function of what every rank holds (the
gathered draft distributions, validation outcomes, the plan's step and time-model
version), so all ranks reach the same answers without talking to each other."""
from __future__ import annotations

import numpy as np

from controller.config import SpeculativeConfig
from controller.decision import decide
from controller.estimators import Calibrator, confidence
from controller.time_model import TimeModel

PROBE_EVERY = 16  # every 16th decode step drafts and verifies the full k: calibration data


class SpecPolicy:
    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self.adaptive = cfg.enabled and cfg.adaptive.enabled
        self.calibrator = Calibrator(max(cfg.num_speculative_tokens, 1))
        self.models: dict[int, TimeModel] = {0: TimeModel()}
        self.probe = False
        self.decode_steps = 0  # counted identically on every rank (every rank runs every plan)

    def begin_step(self) -> bool:
        """Start a decode step; True when it is a probe step (no pruning, full budget).
        Without probes, drafts the estimate calls hopeless are never verified, and the
        calibrator could never learn that they are not."""
        self.decode_steps += 1
        self.probe = self.adaptive and self.decode_steps % PROBE_EVERY == 1
        return self.probe

    # ------------------------------------------------------------------ time models
    def install(self, model: TimeModel) -> int:
        self.models[model.version] = model
        for old in sorted(self.models)[:-4]:  # keep a few: plans may still name the previous one
            del self.models[old]
        return model.version

    def model(self, version: int) -> TimeModel:
        if version not in self.models:
            raise KeyError(f"time model version {version} was never installed on this rank")
        return self.models[version]

    # ------------------------------------------------------------------ before drafting
    def draft_budget(self, kv_lens: np.ndarray, k: int, version: int) -> int:
        """How many draft steps to run: the m in 0..k that maximises the estimated
        throughput when every sequence has the calibrated acceptance of each position.
        0 means a plain decode step."""
        if not self.adaptive or k == 0 or self.probe:
            return k
        tm, n = self.model(version), len(kv_lens)
        rates = self.calibrator.position_rates()[:k]
        best_m, best = 0, n / tm.validate_ms(np.ones(n), kv_lens)
        for m in range(1, k + 1):
            draft_ms = m * tm.draft_step_ms(n)
            keep = decide(np.broadcast_to(rates[:m], (n, m)), kv_lens, tm, self.cfg.adaptive.min_gain, draft_ms)
            a = np.cumprod(rates[:m])
            expected = n + sum(a[:L].sum() for L in keep)
            theta = expected / (draft_ms + tm.validate_ms(keep + 1, kv_lens))
            if theta > best:
                best_m, best = m, theta
        return best_m

    # ------------------------------------------------------------------ while drafting
    def keep_drafting(self, top_prob: np.ndarray, kv_lens: np.ndarray, max_keep: np.ndarray, version: int,
                      draft_ms: float) -> bool:
        """After j draft steps (top_prob: (n, j)): would any sequence keep draft j+1 even if
        it were certain (confidence 1)? If not, drafting further cannot pay: stop."""
        if not (self.adaptive and self.cfg.adaptive.early_stop) or self.probe:
            return True
        n, j = top_prob.shape
        conf = np.concatenate([self.confidence(top_prob, top_prob), np.ones((n, 1))], axis=1)
        keep = decide(conf, kv_lens, self.model(version), self.cfg.adaptive.min_gain, draft_ms, max_keep)
        return bool((keep > j).any())

    # ------------------------------------------------------------------ the decision
    def confidence(self, top_prob: np.ndarray, token_prob: np.ndarray) -> np.ndarray:
        return confidence(self.cfg.adaptive.estimator, top_prob, token_prob, self.calibrator)

    def keep(self, top_prob: np.ndarray, token_prob: np.ndarray, kv_lens: np.ndarray, max_keep: np.ndarray,
             version: int, draft_ms: float) -> np.ndarray:
        """(n,) drafts each sequence validates."""
        if not self.adaptive or self.probe:
            return np.minimum(max_keep, top_prob.shape[1])
        conf = self.confidence(top_prob, token_prob)
        return decide(conf, kv_lens, self.model(version), self.cfg.adaptive.min_gain, draft_ms, max_keep)

    def observe(self, top_prob: np.ndarray, verified: np.ndarray, accepted: np.ndarray) -> None:
        self.calibrator.update(top_prob, verified, accepted)
