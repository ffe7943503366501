"""The validate- and draft-time models and their least-squares fits.

    T_val = f(Q) + b2 * sum_i q_i * kv_i (+ v if the step drafted)
                                                 (ms), Q = sum_i q_i
    T_draft = h(n) + m g(n)                      (ms for m >= 1 draft steps of n sequences; the
                                                  first step also catches the draft up on the
                                                  tokens accepted last step: h)
    T_other = o0 + o1 E (+ o2 + o3 n if the step drafts)
                                                 (ms per step, E tokens emitted: scheduling,
                                                  sampling, accepting, detokenizing, storing)

T_other is measured online (the step's wall time less drafting and validation; a step with
a one-off in it, such as a calibration batch, is left out: StepStats.steady). Its
per-token part is what speculation pays for every token it emits (about 0.15 ms per
token at batch 1 and 32 here), so it belongs in Theta's denominator: without it a
speculative step looked cheaper than it is, and the budget drafted at batch 8, where
plain decoding is faster.

A step that drafts also spends more outside drafting and validation than its tokens
explain: the keep decision and calibration, the sampler's multi-token accept, the
proposer's bookkeeping. At batch 2 here a plain step's rest took 0.143 ms (E = 2), a
static-1 step's 0.194 (E = 3.6) and an adaptive-1 step's 0.253 (E = 3.6), against 0.206 for
a plain step at batch 8 (E = 8): a line in E alone, fitted over all of them, priced a
drafting step at batch 2 about 0.1 ms (8% of the step) too cheap, and the budget drafted at
batch 2, where plain decoding was 2.5% faster. o2 + o3 n is that extra, per drafting step
of n sequences; the budget charges it to every m >= 1 and not to a plain step.

A step that drafted also validates dearer than one that did not at the same tokens: the
draft's forwards displace the target's weights from the caches. In a recorded batch-1
trace a step that drafted and verified nothing (Q = 1) validated in 1.27 ms median against
a plain step's 1.06 (and Q = 2 / 3 / 4 in 1.35 / 1.41 / 1.48). v is that, fitted with the
validate model as a column that is 1 where the step drafted (once the steps hold both
kinds); the budget charges it with o2 + o3 n (`drafting_extra_ms`).

q_i is the number of tokens sequence i validates (kept drafts + 1) and kv_i its context
length. Two kinds (`speculative.adaptive.time_model`):

  linear  f(Q) = b0 + b1 Q
  table   f piecewise linear between knots (Q = 1, 2, 4, ..., the largest measured),
          non-decreasing, extrapolated past the last knot with the last segment's slope.
          A CPU's cost per token falls as Q grows (one token 3.3 ms, eight 7.5 ms at
          batch 1 here), which a line cannot follow.

Draft time is a table over n for both kinds: h and g at n = 1, 2, 4, ..., the largest
measured, non-decreasing. With one line g(n) = d0 + d1 n over n = 1..64 and one h for
every n, the fit priced batch 1's further draft step at 0.39 ms where its steps measured
0.29 (and its first step's extra at 0.35 where it measured 0.21); the early stop, weighing
a draft's expected tokens against that price, stopped a position early. (A model made by hand may still give
g as d0 + d1 n and h as d_first.)

Both are fitted by least squares on measured steps with every coefficient non-negative
(for the table, every segment's slope), relative to each step's time, dropping outliers.
"""
from __future__ import annotations

import dataclasses
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

TIME_UNIT_NS = 100  # the decision compares times as integers of this many nanoseconds
UNITS_PER_MS = 1_000_000 // TIME_UNIT_NS


@dataclass(frozen=True)
class TimeModel:
    version: int = 0
    b0: float = 1.0  # ms per validate forward
    b1: float = 0.1  # ms per validated token
    b2: float = 0.0  # ms per validated token per context token
    d0: float = 0.5  # ms per draft step
    d1: float = 0.01  # ms per draft step per sequence
    d_first: float = 0.0  # ms a step's first draft step costs beyond the others (MTP catches up on accepted tokens)
    o0: float = 0.0  # ms per step outside drafting and validation
    o1: float = 0.0  # ... per emitted token
    o2: float = 0.0  # ... more in a step that drafts
    o3: float = 0.0  # ... and per sequence of such a step
    v_drafted: float = 0.0  # validate ms more in a step that drafted (its target weights reloaded into the caches)
    # the table kind's f at q_knots (empty: linear)
    q_knots: tuple = ()
    q_ms: tuple = ()
    n_knots: tuple = ()  # draft time at these batch sizes (both kinds, once fitted; empty: d0, d1 and d_first)
    n_ms: tuple = ()  # g
    h_ms: tuple = ()  # h (empty: d_first at every n)
    # ms per token a first draft step catches up on past a steady step's (after standing down, or on a
    # new prompt; controller/catchup.py; 0: not priced)
    catchup_ms: float = 0.0
    # the registry has priced a plain step from settled online plain steps (registry.py; until then plain probes
    # come more often: probes.py). A model made by hand counts as measured
    plain_measured: bool = True

    @property
    def kind(self) -> str:
        return "table" if self.q_knots else "linear"

    def q_ms_at(self, q_total):
        """f(Q): validate ms without the context term, for a scalar or an array of totals."""
        if self.q_knots:
            return piecewise(q_total, self.q_knots, self.q_ms)
        return self.b0 + self.b1 * np.asarray(q_total, dtype=np.float64)

    def validate_ms(self, q: np.ndarray, kv: np.ndarray) -> float:
        q, kv = np.asarray(q, dtype=np.float64), np.asarray(kv, dtype=np.float64)
        return self.validate_ms_from(q.sum(), (q * kv).sum())

    def validate_ms_from(self, q_tokens: int, kv_tokens: int, drafted: bool = False) -> float:
        """The same prediction from the summed features (drafted: the step drafted first)."""
        # the same floats as q_ms_at's, without numpy's per-call cost (every step asks)
        if not self.q_knots:
            ms = (self.b0 + self.b1 * float(q_tokens)) + self.b2 * kv_tokens
        else:
            ms = piecewise_at(q_tokens, self.q_knots, self.q_ms) + self.b2 * kv_tokens
        return ms + self.v_drafted if drafted else ms

    def validate_ms_at(self, q_tokens: np.ndarray, kv_tokens: np.ndarray,
                       drafted: np.ndarray | None = None) -> np.ndarray:
        """validate_ms_from for arrays of steps' summed features (drafted: 1 where the step drafted)."""
        ms = self.q_ms_at(q_tokens) + self.b2 * np.asarray(kv_tokens, dtype=np.float64)
        return ms if drafted is None else ms + self.v_drafted * np.asarray(drafted, dtype=np.float64)

    def other_ms(self, emitted: float) -> float:
        """The rest of a plain step that emits `emitted` tokens."""
        return self.o0 + self.o1 * emitted

    def drafting_extra_ms(self, n: int) -> float:
        """What a step of n sequences costs more when it drafts, beyond its draft forwards and its
        validated tokens: its rest (o2 + o3 n) and its validation (v_drafted)."""
        return (self.o2 + self.o3 * n) + self.v_drafted

    def draft_step_ms(self, n: int) -> float:
        """g(n): one more draft step for n sequences."""
        if self.n_knots:
            return piecewise_at(n, self.n_knots, self.n_ms)
        return self.d0 + self.d1 * n

    def first_ms(self, n: int) -> float:
        """h(n): what the first of n sequences' draft steps costs beyond the others."""
        return piecewise_at(n, self.n_knots, self.h_ms) if self.h_ms else self.d_first

    def draft_ms(self, n: int, steps: int) -> float:
        """`steps` draft steps for n sequences: h(n) + steps g(n) (nothing for none)."""
        return self.first_ms(n) + steps * self.draft_step_ms(n) if steps > 0 else 0.0

    def draft_ms_at(self, n: np.ndarray, steps: np.ndarray) -> np.ndarray:
        """draft_ms for arrays of steps' batch sizes and draft step counts."""
        n, steps = np.asarray(n, dtype=np.float64), np.asarray(steps, dtype=np.float64)
        g = piecewise(n, self.n_knots, self.n_ms) if self.n_knots else self.d0 + self.d1 * n
        h = piecewise(n, self.n_knots, self.h_ms) if self.h_ms else self.d_first
        return np.where(steps > 0, h + steps * g, 0.0)


def piecewise(x, knots, values):
    """Linear between knots, the end segments' slopes beyond them (non-decreasing tables
    stay so; at least the first value below the first knot)."""
    x = np.asarray(x, dtype=np.float64)
    k, v = np.asarray(knots, dtype=np.float64), np.asarray(values, dtype=np.float64)
    y = np.interp(x, k, v)
    if len(k) > 1:
        slope = (v[-1] - v[-2]) / (k[-1] - k[-2])
        y = np.where(x > k[-1], v[-1] + slope * (x - k[-1]), y)
    return y


def piecewise_at(x, knots, values) -> float:
    """piecewise at one x, in Python floats: the same value (np.interp's arithmetic), without
    the five numpy calls that made a scalar's prediction cost several microseconds a step."""
    x = float(x)
    last, j = len(knots) - 1, bisect_right(knots, x) - 1
    if j < 0:
        return float(values[0])
    if j >= last:
        if x > knots[last] and last > 0:
            slope = (values[last] - values[last - 1]) / (knots[last] - knots[last - 1])
            return values[last] + slope * (x - knots[last])
        return float(values[last])
    if knots[j] == x:
        return float(values[j])
    return (values[j + 1] - values[j]) / (knots[j + 1] - knots[j]) * (x - knots[j]) + values[j]


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
        kept = resid[keep]  # (indexed once: a mask's copy of a full window cost each round about 30 us)
        mad = np.median(np.abs(kept - np.median(kept))) * 1.4826
        new = (np.abs(resid) <= np.maximum(4 * mad, 0.2 * np.abs(y))) | (resid < 0)
        if new.sum() < x.shape[1] or (new == keep).all():
            break
        keep = new
        coef = relative_nonneg_lstsq(x[keep], y[keep])
    return coef, keep


KINDS = ("table", "linear")  # controller.config.TIME_MODELS


def fit(rows: np.ndarray, validate_ms: np.ndarray, draft_n: np.ndarray, draft_ms: np.ndarray,
        version: int, kind: str = "linear", other: tuple | None = None,
        draft_steps: np.ndarray | None = None) -> FitReport:
    """rows: (m, 3) features [1, Q, sum q*kv] of validate steps, or (m, 4) with a fourth, 1 where
    the step drafted (v_drafted is fitted where rows hold both kinds, else 0); draft_n / draft_ms /
    draft_steps: batch size, time and number of draft steps of steps that drafted (steps
    omitted: times per single step); other: (tokens emitted, ms[, drafting batch size]) of
    the rest of measured steps, the batch size 0 where the step did not draft (omitted:
    none did). MAE and MAPE are over the validate points the fit kept."""
    report = _fit_validate(rows, validate_ms, version, kind)
    report = dataclasses.replace(report, model=_fit_draft(report.model, draft_n, draft_ms, draft_steps))
    if other is not None and len(other[0]) >= 2:
        o = other_fit(*other)
        report = dataclasses.replace(report, model=dataclasses.replace(
            report.model, o0=float(o[0]), o1=float(o[1]), o2=float(o[2]), o3=float(o[3])))
    return report


def other_fit(emitted: np.ndarray, ms: np.ndarray, drafting_n: np.ndarray | None = None) -> np.ndarray:
    """[o0, o1, o2, o3] of ms = o0 + o1 E (+ o2 + o3 n where the step drafted), robust,
    relative, non-negative. A term the steps cannot tell apart stays 0: o2 and o3 where every
    step drafted or none did (o0 holds it), o3 where every drafting step had one batch size."""
    e = np.asarray(emitted, dtype=np.float64)
    cols = [np.ones_like(e), e]
    d = np.zeros_like(e) if drafting_n is None else np.asarray(drafting_n, dtype=np.float64)
    drafted = d > 0
    terms = [0, 1]
    if drafted.any() and not drafted.all():
        cols.append(drafted.astype(np.float64))
        terms.append(2)
        if len(np.unique(d[drafted])) > 1:
            cols.append(d)
            terms.append(3)
    coef = robust_nonneg_lstsq(np.stack(cols, 1), np.asarray(ms, dtype=np.float64))[0]
    out = np.zeros(4)
    out[terms] = coef
    return out


def _fit_validate(rows, validate_ms, version: int, kind: str) -> FitReport:
    if kind not in KINDS:
        raise ValueError(f"unknown time model kind {kind!r}; expected one of {KINDS}")
    drafted = rows[:, 3] if rows.shape[1] > 3 else np.zeros(len(rows))
    both = bool(drafted.any()) and not bool(drafted.all())  # else v_drafted cannot be told apart: 0
    extra = [drafted] if both else []
    if kind == "table":
        knots = doubling_knots(rows[:, 1])
        b, kept = robust_nonneg_lstsq(np.column_stack([ramps(rows[:, 1], knots), rows[:, 2]] + extra), validate_ms)
        v = float(b[-1]) if both else 0.0
        b = b[:-1] if both else b
        table = dict(q_knots=tuple(knots), q_ms=tuple(knot_values(b[:-1], knots)), b2=float(b[-1]), v_drafted=v)
        model = TimeModel(version, **table)
    else:
        b, kept = robust_nonneg_lstsq(np.column_stack([rows[:, :3]] + extra), validate_ms)
        model = TimeModel(version, float(b[0]), float(b[1]), float(b[2]), v_drafted=float(b[3]) if both else 0.0)
    return error_report(model, rows[kept], validate_ms[kept])


def error_report(model: TimeModel, rows: np.ndarray, validate_ms: np.ndarray) -> FitReport:
    """model's MAE and MAPE on validate steps; rows: their features [1, Q, sum q*kv] (and drafted)."""
    err = np.abs(model.validate_ms_at(rows[:, 1], rows[:, 2], rows[:, 3] if rows.shape[1] > 3 else None)
                 - validate_ms)
    return FitReport(model, float(err.mean()), float((err / np.maximum(validate_ms, 1e-6)).mean()), len(validate_ms))


def _fit_draft(model: TimeModel, n: np.ndarray, ms: np.ndarray, steps: np.ndarray | None) -> TimeModel:
    """h(n) + m g(n) on steps that drafted m >= 1 times, h and g non-decreasing piecewise
    linear over n (knots 1, 2, 4, .., the largest n). While every step drafted as many times
    (a startup sweep at k = 1, which times one draft position only) the first step's extra
    cannot be told apart: h stays 0."""
    n, ms = np.asarray(n, dtype=np.float64), np.asarray(ms, dtype=np.float64)
    if len(n) < 2:
        return model  # too little to fit: the defaults
    m = np.ones_like(n) if steps is None else np.asarray(steps, dtype=np.float64)
    knots = doubling_knots(n)
    base = ramps(n, knots)
    several = len(np.unique(m)) > 1
    x = np.column_stack(([base] if several else []) + [base * m[:, None]])
    coef = robust_nonneg_lstsq(x, ms)[0]
    h, g = (coef[:len(knots)], coef[len(knots):]) if several else (np.zeros(len(knots)), coef)
    return dataclasses.replace(model, d_first=0.0, n_knots=tuple(knots.tolist()),
                               n_ms=tuple(knot_values(g, knots).tolist()), h_ms=tuple(knot_values(h, knots).tolist()))


def doubling_knots(x: np.ndarray) -> np.ndarray:
    """1, 2, 4, ... up to the largest x (which is the last knot)."""
    top = max(float(np.max(x)), 1.0)
    knots = [1.0]
    while knots[-1] * 2 < top:
        knots.append(knots[-1] * 2)
    if top > knots[-1]:
        knots.append(top)
    return np.array(knots)


def ramps(x: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Design matrix [1, r_1 .. r_m]: r_s rises from 0 to its segment's width between knots
    s-1 and s (the last one without bound), so non-negative weights give a non-decreasing
    piecewise-linear function."""
    x = np.asarray(x, dtype=np.float64)[:, None]
    lo, hi = knots[:-1][None, :], knots[1:][None, :]
    r = np.clip(x - lo, 0.0, hi - lo)
    if r.shape[1]:
        r[:, -1] = np.maximum(x[:, 0] - knots[-2], 0.0)
    return np.column_stack([np.ones(len(x)), r])


def knot_values(coef: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """The fitted function at the knots, from ramps' weights [c, d_1 .. d_m]."""
    return coef[0] + np.concatenate([[0.0], np.cumsum(coef[1:] * np.diff(knots))])


def held_out_mape(rows: np.ndarray, validate_ms: np.ndarray, kind: str) -> float:
    """Fit on every other step, the MAPE on the rest (the same split for every kind)."""
    train = np.arange(len(validate_ms)) % 2 == 0
    if train.sum() < 4 or (~train).sum() < 1:
        return float("nan")
    m = fit(rows[train], validate_ms[train], np.array([]), np.array([]), 0, kind).model
    return error_report(m, rows[~train], validate_ms[~train]).mape
