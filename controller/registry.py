"""The profile registry: validate and draft timings in, versioned time models out.

Pure bookkeeping (the Ray actor around it lives in cluster/profile_actor.py). It keeps the
startup sweep's points plus a window of recent online steps, and refits every
`refit_every` new samples, or sooner when the recent prediction error grows well past
the error of the last fit.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import numpy as np

from controller.time_model import KINDS, FitReport, TimeModel, fit, held_out_mape

WINDOW = 4096  # online samples kept for refits
RECENT = 32  # samples in the "recent error" window
STEADY_CATCHUP = 16  # catch-up tokens per sequence beyond which a draft time is a one-off
ERROR_GROWTH = 2.0  # refit early when recent MAPE exceeds this multiple of the fit's MAPE


@dataclass(frozen=True)
class StepSample:
    """One measured decode step (rank 0's clock), or one sweep point: a validate point has
    draft_steps == 0, a draft point has q_tokens == 0."""

    num_seqs: int
    q_tokens: int  # sum of q_i
    kv_tokens: int  # sum of q_i * kv_i
    validate_ms: float
    draft_steps: int
    draft_ms: float
    other_ms: float = 0.0  # the rest of the step (scheduling, sampling, bookkeeping); 0: not measured
    emitted: int = 0  # tokens the step emitted (sequences plus accepted drafts)
    catchup_tokens: int = 0  # tokens the draft caught up on before its first step (0: unknown)
    draft_seqs: int = 0  # sequences that drafted (0: all num_seqs; a probe standing down drafts for a few)

    @property
    def drafting(self) -> int:
        """Sequences the draft time is for."""
        return self.draft_seqs or self.num_seqs

    def features(self) -> list[float]:
        return [1.0, float(self.q_tokens), float(self.kv_tokens)]


class ProfileRegistry:
    def __init__(self, refit_every: int = 64, initial: TimeModel | None = None, sweep: list[StepSample] = (),
                 kind: str = "linear"):
        self.refit_every, self.kind = refit_every, kind
        self.model = initial or TimeModel()
        self.last_report: FitReport | None = None
        self.sweep: list[StepSample] = list(sweep)  # the startup sweep, kept in every refit
        self.online: deque[StepSample] = deque(maxlen=WINDOW)
        self.recent_err: deque[float] = deque(maxlen=RECENT)
        self.since_fit = 0

    def seed(self, samples: list[StepSample]) -> FitReport:
        """Fit the first model from the startup sweep."""
        self.sweep = list(samples)
        return self.refit()

    def add(self, samples: list[StepSample]) -> TimeModel | None:
        """Record online samples; returns a new model when a refit happened."""
        for s in samples:
            if s.q_tokens == 0:
                continue
            predicted = self.model.validate_ms_from(s.q_tokens, s.kv_tokens)
            self.recent_err.append(abs(predicted - s.validate_ms) / max(s.validate_ms, 1e-6))
            self.online.append(s)
            self.since_fit += 1
        fit_mape = self.last_report.mape if self.last_report else float("inf")
        drifted = len(self.recent_err) == RECENT and float(np.mean(self.recent_err)) > ERROR_GROWTH * max(fit_mape, 0.05)
        if self.since_fit >= self.refit_every or (drifted and self.since_fit >= RECENT):
            self.refit()
            return self.model
        return None

    def adopt(self, model: TimeModel) -> TimeModel:
        """Take a model from outside (an operator, a test) as the next version."""
        self.model = dataclasses.replace(model, version=self.model.version + 1)
        self.since_fit = 0
        return self.model

    def refit(self) -> FitReport:
        data = self.sweep + list(self.online)
        validated = [s for s in data if s.q_tokens > 0]  # sweep draft points carry no validation
        if len(validated) < 3:  # nothing to fit yet: same coefficients, next version
            self.model = dataclasses.replace(self.model, version=self.model.version + 1)
            self.since_fit = 0
            return FitReport(self.model, float("nan"), float("nan"), len(validated))
        rows = np.array([s.features() for s in validated])
        val = np.array([s.validate_ms for s in validated])
        # the draft cost of steady drafting: a step that first caught up on a prompt or on the tokens
        # of steps that drafted nothing paid a one-off the budget must not expect at every step
        drafted = [s for s in data
                   if s.draft_steps > 0 and s.catchup_tokens <= STEADY_CATCHUP * s.drafting]
        draft_n = np.array([s.drafting for s in drafted], dtype=np.float64)
        draft_ms = np.array([s.draft_ms for s in drafted])
        draft_steps = np.array([s.draft_steps for s in drafted], dtype=np.float64)
        timed = [s for s in data if s.other_ms > 0 and s.emitted > 0]
        other = (np.array([s.emitted for s in timed], dtype=np.float64), np.array([s.other_ms for s in timed]))
        report = fit(rows, val, draft_n, draft_ms, self.model.version + 1, self.kind, other, draft_steps)
        self.model, self.last_report, self.since_fit = report.model, report, 0
        self.recent_err.clear()
        return report

    def held_out_mape(self) -> dict[str, float]:
        """Each kind of time model fitted on every other measured step (sweep and online),
        its MAPE on the rest: which kind predicts better here."""
        validated = [s for s in self.sweep + list(self.online) if s.q_tokens > 0]
        rows = np.array([s.features() for s in validated]).reshape(-1, 3)
        val = np.array([s.validate_ms for s in validated])
        return {kind: held_out_mape(rows, val, kind) for kind in KINDS}
