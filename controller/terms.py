"""The time terms a step's decisions read, per time model and batch size: computed once and
kept while that model is in use (steps repeat a batch size far more often than a model
changes), the draft budget's also until the next calibration batch moves the shares they are
weighted with (`forget_budget`). SpecPolicy owns one (`SpecPolicy.terms`) and reads it in
begin_step (the cold start's `could_pay`, `stand_down_at`) and for batch 1's OneRow; SpecStep
reads it for the budget (`best_budget_rate`), the early stop and the keep decision (controller/step.py)."""
from __future__ import annotations

import numpy as np

from controller.decision import draft_units, f_table, rest_units
from controller.time_model import TimeModel

# the least time a step is priced at: a refit on a few samples can price every term at 0 (forced refits every
# 4 steps at TP=4 had made a step's time 0, and the budget divided by it)
MIN_STEP_MS = 1e-6


class StepTerms:
    def __init__(self, min_gain: float, shares, batch_margin: float = 0.0):
        """min_gain: speculative.adaptive.min_gain; shares: (n, at) -> the draft yields' (accepted,
        verified) shares per position (SpecPolicy.shares); batch_margin:
        speculative.adaptive.batch_draft_margin."""
        self.min_gain = min_gain
        self.batch_margin = batch_margin
        self.shares = shares
        self._f_cache: dict[tuple, tuple] = {}  # values a time model gives a batch size (f_values, draft_step_ms)
        self._budget_cache: dict[tuple, tuple] = {}  # the budget's terms (see budget_terms)

    def enter(self, n: int) -> float:
        """The factor by which a budget m > 0 must beat a plain step for n sequences, beyond
        1 + min_gain: 1 + batch_draft_margin from two sequences on, 1 at batch 1."""
        return 1.0 + self.batch_margin if n > 1 else 1.0

    def forget_budget(self) -> None:
        """The shares moved (a calibration batch): the budget's terms follow them."""
        self._budget_cache = {}

    def f_values(self, tm: TimeModel, use: str, n: int, extra: int):
        """Values of f that steps of one batch size ask again and again, computed once per
        time model (steps repeat a batch size far more often than a model changes)."""
        def compute():
            return tm.q_ms_at(n * np.arange(1, extra + 2)).tolist() if use == "budget" else f_table(tm, n, extra)

        return self._per_model(tm, (use, id(tm), n, extra), compute)

    def many_terms(self, tm: TimeModel, n: int, extra: int) -> tuple[int, int, np.ndarray]:
        """A large batch's step's time terms in units (step_costs' fixed and per_token, and f for
        up to `extra` validated drafts), computed once per time model and batch size."""
        def compute():
            return (*rest_units(tm, n), self.f_values(tm, "decide", n, extra)[0])

        return self._per_model(tm, ("many", id(tm), n, extra), compute)

    def draft_unit_list(self, tm: TimeModel, n: int, count: int) -> list[int]:
        """The draft time of m = 0..count - 1 draft steps of n sequences in units (0 for none), as
        SpecStep._draft_ms gives it, computed once per time model and batch size."""
        def compute():
            first, g = self.draft_terms(tm, n)
            return [0] + [draft_units(first + m * g) for m in range(1, count)]

        return self._per_model(tm, ("units", id(tm), n, count), compute)

    def draft_terms(self, tm: TimeModel, n: int) -> tuple[float, float]:
        """(tm.first_ms(n), tm.draft_step_ms(n)): h(n) and g(n), computed once per time model and batch size."""
        return self._per_model(tm, ("hg", id(tm), n), lambda: (tm.first_ms(n), tm.draft_step_ms(n)))

    def _per_model(self, tm: TimeModel, key: tuple, compute):
        """compute()'s value for `key`, kept while `tm` is the model it was computed for."""
        hit = self._f_cache.get(key)
        if hit is None or hit[0] is not tm:  # (an id can come back for a new model once the old one is gone)
            if len(self._f_cache) > 256:
                self._f_cache.clear()
            hit = self._f_cache[key] = (tm, compute())
        return hit[1]

    def could_pay(self, tm: TimeModel, n: int, k: int) -> bool:
        """Would drafting beat a plain step for n sequences were every draft verified and
        accepted (the context's cost left out)? If not, no acceptance rate can make it pay.
        Computed once per time model and batch size (it reads no shares)."""
        def compute():
            base, terms = self.budget_terms(tm, n, k, optimistic=True)
            scale = (1.0 + self.min_gain) * self.enter(n)
            return any(expected / fixed > scale / base for _, expected, fixed, _ in terms)

        return self._per_model(tm, ("pays", id(tm), n, k), compute)

    def budget_terms(self, tm: TimeModel, n: int, k: int, optimistic: bool = False,
                     at: int = 0) -> tuple[float, list[tuple]]:
        """The draft budget's terms that do not depend on the batch's context (SpecStep._budget),
        computed once per time model, batch size and calibration batch: other + f at m = 0, and
        per m the expected tokens, the time without the context term, and the validated tokens
        per sequence. The same floats, added in the same order, as computing them each step.
        optimistic: every draft verified and accepted, in place of the observed shares; at: the
        shares of a sequence's record's level (controller/history.py)."""
        key = (id(tm), n, k, optimistic, at)
        hit = self._budget_cache.get(key)
        if hit is not None and hit[0] is tm:
            return hit[1]
        if len(self._budget_cache) > 256:
            self._budget_cache.clear()
        first, g = self.draft_terms(tm, n)
        f = self.f_values(tm, "budget", n, k)  # f(n (m + 1)) in ms for m = 0..k
        (gain, share), o0, o1 = ([1.0] * k,) * 2 if optimistic else self.shares(n, at), tm.o0, tm.o1
        o0 += tm.drafting_extra_ms(n)  # what a step that drafts costs more outside drafting and validation
        terms, expected, verified = [], 1.0, 1.0
        for m in range(1, k + 1):
            expected += gain[m - 1]
            verified += share[m - 1]  # validated tokens per sequence: f between its knots n, 2n, ..
            x = verified - 1.0
            lo = min(int(x), k - 1)
            f_val = f[lo] + (x - lo) * (f[lo + 1] - f[lo])
            terms.append((m, expected, max((o0 + o1 * (n * expected)) + (first + m * g) + f_val, MIN_STEP_MS),
                          verified))
        out = (max(tm.other_ms(n) + f[0], MIN_STEP_MS), terms)
        self._budget_cache[key] = (tm, out)
        return out

    def stand_down_at(self, tm: TimeModel, n: int, k: int) -> float:
        """The batch's context cost (ms, tm.b2 times its summed context) from which on the draft
        budget (SpecStep._budget) is 0 for n sequences and up to k drafts: inf where no such
        point is known. Kept with the budget's terms.

        Draft budget m beats a plain step where e (base + x) > s (F + v x) (e, F, v: its expected
        tokens, time without the context term and validated tokens per sequence; base: the plain
        step's; s = (1 + min_gain) times enter(n); x the context cost), and e <= v (a draft is accepted only if
        verified): for s' = s (1 - 1e-9), m loses once x (e - s' v) <= s' F - e base, i.e. from
        x = (s' F - e base) / (e - s' v) on where e < s' v. The margin keeps the loop's float
        comparisons (relative errors near 1e-16) from disagreeing near that point: there it runs."""
        key = (id(tm), n, k, "down")
        hit = self._budget_cache.get(key)
        if hit is not None and hit[0] is tm:
            return hit[1]
        base, terms = self.budget_terms(tm, n, k)
        scale = (1.0 + self.min_gain) * self.enter(n) * (1.0 - 1e-9)
        at = -np.inf
        for _, expected, fixed, verified in terms:
            slope = expected - scale * verified
            if slope >= 0.0:
                at = np.inf
                break
            at = max(at, (scale * fixed - expected * base) / slope)
        at = max(at, 0.0) if np.isfinite(at) else float(at)
        self._budget_cache[key] = (tm, at)
        return at


def best_budget_rate(base: float, terms: list[tuple], kv_ms: float, scale: float, per_token: float = 0.0,
                     enter: float = 1.0) -> tuple[int, float]:
    """The draft budget's argmax over m = 0..k (StepTerms.budget_terms' base and terms, the
    batch's context cost kv_ms, scale = 1 + min_gain), each token a row emits costing per_token
    ms more where the step drafts (its rows' catch-up); ties keep the smaller m. A budget m > 0
    must beat the plain step by the factor enter (StepTerms.enter) as well. best_budget_rate
    also gives the chosen budget's estimated throughput (a sequence's tokens per ms): the rate the early stop
    weighs a draft step's time at (controller/early_stop.py)."""
    best_m, best = 0, enter / (base + kv_ms)
    for m, expected, fixed, verified in terms:
        cost = fixed + verified * kv_ms
        theta = expected / (cost + expected * per_token if per_token else cost)
        if theta > best * scale:
            best_m, best = m, theta
    return best_m, best
