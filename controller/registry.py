"""The profile registry: validate and draft timings in, versioned time models out.

Pure bookkeeping (the Ray actor around it lives in cluster/profile_actor.py). It keeps the
startup sweep's points (rescaled to the machine's speed now: `sweep_speed`) plus a window
of recent online steps, and refits every `refit_every` new samples (twice as long after
each scheduled refit that changed no prediction of the recent steps by SAME_FIT, up to
SCHEDULE_MAX times), or sooner when the recent prediction error grows well past the error
of the last fit (waiting twice as long, up to SCHEDULE_MAX times refit_every, after each
such refit that changed no prediction). Samples are kept as columns of numbers
(`SampleColumns`, controller/samples.py), so a refit reads arrays instead of thousands of
objects: with a full window a refit took 4.8 ms from the objects (6.7 ms for the table
model), 2.2 ms (4.4) from columns. An in-process rank pays it inside its step loop, and at
batch 1, where the linear model's recent error stayed above twice its fit's, drift refits
had come every 32-70 steps.
"""
from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from controller.catchup import CATCHUP_MIN_SAMPLES, catchup_ms
from controller.samples import (CATCHUP_TOKENS, DRAFT_MS, DRAFT_SEQS, DRAFT_STEPS, EMITTED, KV_TOKENS, NUM_SEQS,
                                ONE_OFF, OTHER_MS, Q_TOKENS, SETTLING, VALIDATE_MS, SampleColumns, StepSample)
from controller.time_model import KINDS, FitReport, TimeModel, error_report, fit, held_out_mape
from controller.yields import BUCKETS, batch_bucket

WINDOW = 4096  # online samples kept for refits
RECENT = 32  # samples in the "recent error" window
STEADY_CATCHUP = 16  # catch-up tokens per sequence beyond which a draft time is a one-off
ERROR_GROWTH = 2.0  # refit early when recent MAPE exceeds this multiple of the fit's MAPE
SPEED_WINDOW = 512  # the latest online validate steps that say how fast the machine runs now ...
SPEED_MIN_SAMPLES = RECENT  # ... once there are this many of them
SPEED_LIMITS = (0.25, 4.0)  # the sweep is never rescaled by more than this
PLAIN_MIN_SAMPLES = 16  # settled plain steps in the window that say how fast plain decoding runs now
DRAFT_MIN_SAMPLES = 16  # steady online draft steps that say how much dearer the draft runs in the engine
SAME_FIT = 0.05  # a scheduled refit whose model predicts the recent steps within this of the last one's ...
SCHEDULE_MAX = 8  # ... doubles the wait for the next scheduled one (and drift ones), up to this many times refit_every


class ProfileRegistry:
    def __init__(self, refit_every: int = 64, initial: TimeModel | None = None, sweep: list[StepSample] = (),
                 kind: str = "linear"):
        self.refit_every, self.kind = refit_every, kind
        self.model = initial or TimeModel()
        self._sweep = SampleColumns(sweep)  # the startup sweep, kept in every refit (rescaled: sweep_speed)
        # the initial model's error on the sweep it was fitted to: what drift is measured against from the
        # first step (with none, the drift refit could not come before the first scheduled one)
        self.last_report: FitReport | None = self._report_on_sweep(self.model) if initial is not None else None
        self._sweep_model: TimeModel | None = None  # the sweep's own fit (table kind), made on first use
        # the draft's in-engine time over the sweep's, last measured, per batch-size bucket (draft_overhead)
        self._draft_overheads: dict[int, float] = {}
        # ms per catch-up token past a steady step's, last measured (controller/catchup.py; None: never)
        self._catchup_ms: float | None = None
        # what a steady drafting step's rest costs more (TimeModel o2, o3), last measured on DRAFT_MIN_SAMPLES of
        # them: fitted from fewer (a server standing down drafts only its probes, after long catch-ups, and
        # their rests are dearer), 23 probe steps had priced it at 0.135 ms where steady drafting steps read
        # 0.012-0.03, and batch 1 stood down for good (DESIGN.md section 8, probes)
        self._extra_rest = (0.0, 0.0)
        # what a drafting step's validation costs more (TimeModel.v_drafted), last measured where the window held
        # DRAFT_MIN_SAMPLES validate steps that drafted and as many that did not (standing down, none draft)
        self._v_drafted = 0.0
        self._plain_speed: float | None = None  # sweep_speed as last measured on settled plain steps
        self._online = SampleColumns(size=WINDOW)
        self.recent_err: deque[float] = deque(maxlen=RECENT)
        self.since_fit = 0
        self.drift_wait = RECENT  # samples a drift refit waits for: doubles while drift refits do not cure it
        self.schedule = refit_every  # samples a scheduled refit waits for: doubles while refits change nothing

    @property
    def online(self) -> list[StepSample]:
        """The online samples held (oldest first)."""
        return self._online.samples()

    def seed(self, samples: list[StepSample]) -> FitReport:
        """Fit the first model from the startup sweep."""
        self._sweep, self._sweep_model = SampleColumns(samples), None
        return self.refit()

    def add(self, samples: list[StepSample]) -> TimeModel | None:
        """Record online samples; returns a new model when a refit happened."""
        validated = [s for s in samples if s.q_tokens]
        model = self.model
        # only the latest RECENT errors are kept, of the steps a fit reads (no settling plain step: _validated)
        rows = _validated(self._online.extend(validated)[-RECENT:])
        if len(rows):  # each step's error, in a few array operations (not a prediction per sample)
            measured = rows[:, VALIDATE_MS]
            predicted = model.validate_ms_at(rows[:, Q_TOKENS], rows[:, KV_TOKENS], rows[:, DRAFT_STEPS] > 0)
            self.recent_err.extend((np.abs(predicted - measured) / np.maximum(measured, 1e-6)).tolist())
        self.since_fit += len(validated)
        scheduled = self.since_fit >= self.schedule
        if not scheduled:
            if self.since_fit < RECENT or len(self.recent_err) < RECENT:
                return None
            if self.since_fit < self.drift_wait or not self._drifted():
                return None
        # a steady machine gives the same fit again and again (2-5 ms each, in the step loop of an in-process
        # rank): while they change nothing, scheduled refits come half as often
        self.refit()
        same = _predicts_alike(model, self.model, self._online.rows()[-RECENT:])
        if scheduled or not same:
            self.schedule = min(2 * self.schedule, SCHEDULE_MAX * self.refit_every) if same else self.refit_every
        if not same:
            self.drift_wait = RECENT  # the model moved: follow it
        elif not scheduled:
            # the window holds thousands of samples: a drift refit that changed no prediction (noise the error
            # crossed its bar on, or a regime the model cannot follow yet) is followed by one twice as late
            self.drift_wait = min(2 * self.drift_wait, SCHEDULE_MAX * self.refit_every)
        return self.model

    def _report_on_sweep(self, model: TimeModel) -> FitReport | None:
        validated = self._sweep_validated()
        return error_report(model, _features(validated), validated[:, VALIDATE_MS]) if len(validated) else None

    def _sweep_validated(self) -> np.ndarray:
        """The sweep's validate points (its draft points carry no validation)."""
        sweep = self._sweep.rows()
        return sweep[sweep[:, Q_TOKENS] > 0]

    def _drifted(self) -> bool:
        fit_mape = self.last_report.mape if self.last_report else float("inf")
        return sum(self.recent_err) / RECENT > ERROR_GROWTH * max(fit_mape, 0.05)  # (np.mean of a deque: 10 us)

    def adopt(self, model: TimeModel) -> TimeModel:
        """Take a model from outside (an operator, a test) as the next version."""
        self.model = dataclasses.replace(model, version=self.model.version + 1)
        self.since_fit = 0
        return self.model

    def sweep_speed(self) -> float:
        """How much slower (> 1) or faster the machine runs now than during the startup
        sweep: the median, over online validate steps, of their time over what the sweep's own
        fit predicts. Over the latest SPEED_WINDOW settled plain steps in the window where it
        holds PLAIN_MIN_SAMPLES of them (a step that drafted validates dearer: TimeModel.v_drafted,
        which the refit tells apart only against a sweep at the speed of plain decoding; and so
        does a plain step still settling after drafting, StepSample.settling), and remembered;
        with too few, as last so measured; before any, over the latest SPEED_WINDOW validate
        steps (1.0 before SPEED_MIN_SAMPLES of them). A batch that drafts has its plain steps
        from its plain probes' stretches, a few settled ones in every PLAIN_EVERY * PLAIN_RUN
        steps (controller/probes.py): measured against its drafting steps, a plain step had
        been priced at what it costs among them.

        A refit scales the sweep's validate and draft times by it. Online validate steps
        come at every step, online draft steps only while drafting pays; without the
        scale a sweep taken at a slow moment (this 2-core machine ran one 2x slower than
        another minutes later) kept draft steps looking 2x dearer than the validate steps
        beside them once online steps had corrected the validate times, and batch 1 stood
        down, which yields no draft steps to correct them."""
        validated, online = self._sweep_validated(), self._online.rows()
        if len(validated) < 3:
            return 1.0
        plain = _validated(online)
        plain = plain[plain[:, DRAFT_STEPS] == 0][-SPEED_WINDOW:]
        if len(plain) >= PLAIN_MIN_SAMPLES:
            self._plain_speed = self._speed_over(plain)
            return self._plain_speed
        if self._plain_speed is not None:
            return self._plain_speed
        online = online[online[:, Q_TOKENS] > 0][-SPEED_WINDOW:]
        return self._speed_over(online) if len(online) >= SPEED_MIN_SAMPLES else 1.0

    def _speed_over(self, rows: np.ndarray) -> float:
        """The median of the rows' validate time over the sweep's own fit's, within SPEED_LIMITS."""
        predicted = self._sweep_fit().validate_ms_at(rows[:, Q_TOKENS], rows[:, KV_TOKENS])
        speed = float(np.median(rows[:, VALIDATE_MS] / np.maximum(predicted, 1e-6)))
        return min(max(speed, SPEED_LIMITS[0]), SPEED_LIMITS[1])

    def draft_overhead(self, n: int) -> float:
        """How much dearer (> 1) the draft of n sequences runs between the target's forwards
        than the sweep, which timed it on its own with its weights in cache, beyond the
        machine's speed: its batch-size bucket's (yields.batch_bucket) median, over the latest
        steady online draft steps of that bucket, of each step's draft time over the sweep's
        own fit's, divided by the same step's validate time over the fit's. Measured whenever
        the window holds DRAFT_MIN_SAMPLES such steps of the bucket, and remembered: the budget
        stops drafting where drafting does not pay, the window then fills with plain steps,
        and a sweep no longer corrected by online draft steps (about 1.35x too cheap here at
        batch 1 and 8) had made the budget draft again: batch 8 switched between standing
        down and drafting as refits came.

        A bucket not measured yet takes the nearest measured bucket's below it (the cache's
        reload is a larger share of a smaller draft forward), else 1.0. One overhead for every
        batch size, measured on a served engine's warm-up at saturation (1.3-1.9 at 13-16
        sequences), had priced batch 1's draft steps at 0.7-1.0 ms where they took 0.45: batch
        1 stood down, drafted only a stand-down probe's one row after a long catch-up (never a
        steady step), and so never measured its own overhead (1.0-1.07): it stood down for good.
        Left at the sweep's price instead, a bucket that does not pay drafts for the few steps
        that measure it.

        Each step's draft time is set against its own validate time, not against sweep_speed
        (the latest validate steps, plain ones included): this machine's speed swings by 1.5-2x
        over seconds, the two windows span different stretches of it, and the overhead so
        measured ranged 1.03-1.87 over one batch-1 benchmark where the paired one held 1.46-1.68.
        At batch 1 drafting pays about 6% over plain decoding, so a fast stretch read as a dear
        draft made adaptive stand down for up to 600 steps at a time."""
        self._measure_draft_overheads()
        return self._overhead_at(n)

    def _overhead_at(self, n: int) -> float:
        """draft_overhead(n) as last measured."""
        held = self._draft_overheads
        for bucket in range(batch_bucket(n), -1, -1):
            if bucket in held:
                return held[bucket]
        return 1.0

    def _measure_draft_overheads(self) -> None:
        """Each bucket's overhead over its own latest SPEED_WINDOW steady draft steps in the window
        (the latest of all buckets together were nearly all batch 1's in a served run, and the
        few dozen drafting steps at 4-7 sequences, 1.45x the sweep there, never counted)."""
        drafted = self._steady_drafts(self._online.rows())
        drafted = drafted[drafted[:, VALIDATE_MS] > 0]
        swept = self._steady_drafts(self._sweep.rows())
        if len(drafted) < DRAFT_MIN_SAMPLES or len(swept) < 2:
            return
        fitted = self._sweep_fit()
        n = _drafting(drafted)
        draft = drafted[:, DRAFT_MS] / np.maximum(fitted.draft_ms_at(n, drafted[:, DRAFT_STEPS]), 1e-6)
        validate = drafted[:, VALIDATE_MS] / np.maximum(
            fitted.validate_ms_at(drafted[:, Q_TOKENS], drafted[:, KV_TOKENS]), 1e-6)
        ratio, buckets = draft / validate, _buckets(n)
        for bucket in np.unique(buckets).tolist():
            mine = ratio[buckets == bucket][-SPEED_WINDOW:]
            if len(mine) >= DRAFT_MIN_SAMPLES:
                self._draft_overheads[bucket] = min(max(float(np.median(mine)), SPEED_LIMITS[0]), SPEED_LIMITS[1])

    def _sweep_fit(self) -> TimeModel:
        """The sweep's own times fitted, validate and draft (what sweep_speed and draft_overhead
        compare online steps against): the table kind, whatever the registry fits, as a line's
        misfit at one end (the CPU's per-token cost falls with Q) would read as a change of speed
        where the steps all fall (batch 1: Q = 1)."""
        if self._sweep_model is None:
            validated, drafted = self._sweep_validated(), self._steady_drafts(self._sweep.rows())
            self._sweep_model = fit(_features(validated), validated[:, VALIDATE_MS], _drafting(drafted),
                                    drafted[:, DRAFT_MS], 0, "table", None, drafted[:, DRAFT_STEPS]).model
        return self._sweep_model

    @staticmethod
    def _steady_drafts(rows: np.ndarray) -> np.ndarray:
        """Rows that drafted without a one-off: a step that first caught up on a prompt or on the
        tokens of steps that drafted nothing, or that drafted right after a calibration batch
        (StepSample.one_off), paid what the budget must not expect at every step."""
        return rows[(rows[:, DRAFT_STEPS] > 0) & _steady(rows)]

    def _data(self) -> np.ndarray:
        """The sweep, its times scaled by sweep_speed (draft times also by their batch size's
        draft_overhead), then the online window."""
        sweep, online = self._sweep.rows(), self._online.rows()
        if not len(online):
            return sweep
        speed = self.sweep_speed()
        self._measure_draft_overheads()
        overhead = np.array([self._overhead_at(n) for n in _drafting(sweep).astype(int).tolist()])
        if speed != 1.0 or (overhead != 1.0).any():
            sweep = sweep.copy()
            sweep[:, VALIDATE_MS] *= speed
            sweep[:, DRAFT_MS] *= speed * overhead
        return np.concatenate([sweep, online])

    def refit(self) -> FitReport:
        data = self._data()
        validated = _validated(data)
        if len(validated) < 3:  # nothing to fit yet: same coefficients, next version
            self.model = dataclasses.replace(self.model, version=self.model.version + 1)
            self.since_fit = 0
            return FitReport(self.model, float("nan"), float("nan"), len(validated))
        rows = _features(validated)
        drafted = self._steady_drafts(data)  # the draft cost of steady drafting
        # a step's rest: plain steps' (settled after drafting, as for the validate fit), and steady drafting
        # steps' where there are enough of them to say what drafting adds (o2 + o3 n); else that as last
        # measured (`_extra_rest`)
        timed = (data[:, OTHER_MS] > 0) & (data[:, EMITTED] > 0) & (data[:, SETTLING] == 0)
        drafting = data[:, DRAFT_STEPS] > 0
        steady = timed & drafting & _steady(data)
        measured = int(steady.sum()) >= DRAFT_MIN_SAMPLES
        timed = (timed & ~drafting) | steady if measured else timed & ~drafting
        other = (data[timed, EMITTED], data[timed, OTHER_MS], np.where(drafting[timed], data[timed, NUM_SEQS], 0.0))
        report = fit(rows, validated[:, VALIDATE_MS], _drafting(drafted), drafted[:, DRAFT_MS],
                     self.model.version + 1, self.kind, other, drafted[:, DRAFT_STEPS])
        model = report.model
        if measured:
            self._extra_rest = (model.o2, model.o3)
        else:
            model = dataclasses.replace(model, o2=self._extra_rest[0], o3=self._extra_rest[1])
        online = _validated(self._online.rows())
        drafted = int((online[:, DRAFT_STEPS] > 0).sum())
        if min(drafted, len(online) - drafted) >= DRAFT_MIN_SAMPLES:  # (settled plain steps)
            self._v_drafted = model.v_drafted
        else:
            model = dataclasses.replace(model, v_drafted=self._v_drafted)
        model = dataclasses.replace(model, plain_measured=self._plain_speed is not None)
        report = dataclasses.replace(report, model=self._with_catchup(model))
        self.model, self.last_report, self.since_fit = report.model, report, 0
        self.recent_err.clear()
        return report

    def _with_catchup(self, model: TimeModel) -> TimeModel:
        """model with the cost per catch-up token (catchup.catchup_ms) of the window's steps that
        drafted after a long catch-up, or as last measured where it holds too few of them (a
        server that stands down for good drafts only its probes' rows); until the window has
        measured it once, as the startup sweep's long catch-ups (cluster/engine/sweep.py) measure
        it against the sweep's own fit."""
        measured = _catchup_of(model, _long_catchups(self._online.rows()))
        if measured is None and self._catchup_ms is None:
            swept = _long_catchups(self._sweep.rows())
            if len(swept) >= CATCHUP_MIN_SAMPLES:
                measured = _catchup_of(self._sweep_fit(), swept)
        if measured is not None:
            self._catchup_ms = measured
        return dataclasses.replace(model, catchup_ms=self._catchup_ms or 0.0)

    def held_out_mape(self) -> dict[str, float]:
        """Each kind of time model fitted on every other measured step (sweep and online),
        its MAPE on the rest: which kind predicts better here."""
        validated = _validated(self._data())
        return {kind: held_out_mape(_features(validated), validated[:, VALIDATE_MS], kind) for kind in KINDS}


def _long_catchups(rows: np.ndarray) -> np.ndarray:
    """The rows that drafted after a long catch-up (and no other one-off)."""
    return rows[(rows[:, DRAFT_STEPS] > 0) & (rows[:, CATCHUP_TOKENS] > STEADY_CATCHUP * _drafting(rows))
                & (rows[:, ONE_OFF] == 0)]


def _catchup_of(model: TimeModel, picked: np.ndarray) -> float | None:
    """catchup.catchup_ms over `picked` (_long_catchups) against `model`'s steady draft times."""
    return catchup_ms(model, _drafting(picked), picked[:, DRAFT_STEPS], picked[:, CATCHUP_TOKENS], picked[:, DRAFT_MS])


def _predicts_alike(old: TimeModel, new: TimeModel, rows: np.ndarray) -> bool:
    """Do the two models predict the validate and draft times of these steps within SAME_FIT
    of each other (every step, relative)?"""
    if not len(rows):
        return False
    validated = rows[rows[:, Q_TOKENS] > 0]
    n, steps = _drafting(rows), np.maximum(rows[:, DRAFT_STEPS], 1)
    drafted = validated[:, DRAFT_STEPS] > 0
    pairs = [(old.validate_ms_at(validated[:, Q_TOKENS], validated[:, KV_TOKENS], drafted),
              new.validate_ms_at(validated[:, Q_TOKENS], validated[:, KV_TOKENS], drafted)),
             (old.draft_ms_at(n, steps), new.draft_ms_at(n, steps))]
    return all(bool(np.all(np.abs(b - a) <= SAME_FIT * np.maximum(np.abs(a), 1e-6))) for a, b in pairs)


def _validated(rows: np.ndarray) -> np.ndarray:
    """The rows a validate time is fitted on: validate points (the sweep's draft points carry no
    validation), of plain steps only those settled after drafting (StepSample.settling)."""
    return rows[(rows[:, Q_TOKENS] > 0) & (rows[:, SETTLING] == 0)]


def _steady(rows: np.ndarray) -> np.ndarray:
    """Rows whose draft, if any, had no one-off (ProfileRegistry._steady_drafts)."""
    return (rows[:, CATCHUP_TOKENS] <= STEADY_CATCHUP * _drafting(rows)) & (rows[:, ONE_OFF] == 0)


def _drafting(rows: np.ndarray) -> np.ndarray:
    """StepSample.drafting of each row: the sequences its draft time is for."""
    return np.where(rows[:, DRAFT_SEQS] > 0, rows[:, DRAFT_SEQS], rows[:, NUM_SEQS])


def _buckets(n: np.ndarray) -> np.ndarray:
    """yields.batch_bucket of each batch size (positive integers as floats)."""
    return np.minimum(np.frexp(np.maximum(n, 1.0))[1] - 1, BUCKETS - 1)


def _features(validated: np.ndarray) -> np.ndarray:
    """(m, 4): StepSample.features() of each row, [1, Q, sum q*kv], and 1 where the step drafted."""
    return np.column_stack([np.ones(len(validated)), validated[:, Q_TOKENS], validated[:, KV_TOKENS],
                            (validated[:, DRAFT_STEPS] > 0).astype(np.float64)])
