"""Batch 1's early stop and keep set, built up one draft at a time.

At batch 1 the decision's candidates are the drafts in order, so every keep set is a prefix,
and a step asks about the same prefixes again after each draft: the early stop twice per
draft (`worth_drafting`: the best prefix with one more draft and without it) and the keep
rule once at the end (`best_one`). Here each prefix's expected tokens and time terms are
added once, as its draft arrives, and each question is a few divisions over the prefixes
held. The arithmetic is `best_one`'s, term for term (the same integers, the same float
divisions in the same order), so the answers are equal (tests/test_decision.py checks it);
this only stops redoing it. At batch 1 the controller's Python was most of the gap to
static-3 (0.16-0.18 ms on a 2.9 ms step, about a third of it the early stop's two passes).

The engine runs the compiled twin of this class (models/csrc/one_row.cpp, `new_one_row`):
between forward passes, which stream the weights through the caches, this Python finds its
code and objects in memory rather than cache, and an early-stop question that takes 10 us
warm took 100-130 us. Both give the same answers, bit for bit (tests/test_one_row.py); this
one is the reference, and the fallback where the kernels do not load.
"""
from __future__ import annotations

from controller.decision import CONF_BITS, CONF_ONE, StepCosts, beats_at_rate
from controller.estimators import logistic_estimate
from controller.time_model import UNITS_PER_MS


def new_one_row(costs: StepCosts, min_gain: float, cap: int, weights: list | None = None, compiled=None):
    """A OneRow for one step: the compiled one when `compiled` (the kernels' module, and
    `weights` as its LogisticWeights) is given, else this module's."""
    if compiled is None:
        return OneRow(costs, min_gain, cap, weights)
    return compiled.OneRow(costs.f_list, costs.per_token, costs.ctx_list[0], costs.fixed + costs.ctx_sum, min_gain,
                           cap, weights)


class OneRow:
    def __init__(self, costs: StepCosts, min_gain: float, cap: int, weights: list | None = None):
        """weights: the logistic model's (w0, w1, w2, w3) per position, for add_logistic."""
        self.f, self.o, self.weights = costs.f_list, costs.per_token, weights
        self.min_gain, self.scale = min_gain, 1.0 + min_gain
        self.top = self.margin = None  # watched buffers (watch), or a step's rows of the slab (begin's row)
        self.slab = None  # (top, margin) columns the steps beginning at a row of them draft into (watch_slab)
        self.budget_terms = None  # set_budget's
        self.by_rate, self.lam = False, -1.0  # the early stop at the budget's rate (set_budget, begin), or at Theta
        self.restart(costs.ctx_list[0], costs.fixed + costs.ctx_sum, cap)

    def restart(self, ctx: int, fixed: int, cap: int) -> None:
        """A new step of the same time model and weights: ctx, the sequence's context cost per
        validated token; fixed, the step's fixed time terms with its one certain token's context."""
        self.ctx, self.cap = ctx, cap
        self.e = [CONF_ONE]  # expected tokens of prefix m (fixed point), m = 0, 1, ..
        self.t = [fixed]  # its time terms but the draft time and f
        self.div = [1.0]  # (1 + min_gain)^m, as best_one multiplies it up
        self.acc = CONF_ONE  # path probability of the longest prefix
        self.drafts = 0  # estimates added
        self.closed = False  # a path probability reached 0, or the cap: no longer prefix counts

    def set_budget(self, b2: float, base: float, fixed: int, terms: list[list[tuple]], scale: float,
                   units_per_ms: float = UNITS_PER_MS, by_rate: bool = False) -> None:
        """The draft budget's terms at batch 1 (StepTerms.budget_terms): b2, the time model's
        context coefficient; base, the time of a plain step without its context term; fixed, the
        step's fixed time terms in units (StepCosts.fixed); terms[k], the budget's (m, expected,
        time, verified) for m = 1..k; scale, 1 + min_gain; units_per_ms, time units per ms; by_rate:
        each step's early stop weighs time at the throughput its budget expects (controller/early_stop.py)."""
        self.b2, self.base, self.fixed0, self.budget_terms, self.budget_scale = b2, base, fixed, terms, scale
        self.units_per_ms, self.by_rate = units_per_ms, by_rate

    def begin(self, kv: int, cap: int, k: int, row: int = -1) -> int:
        """A new step (restart) for a sequence of context length kv that may verify `cap`
        drafts, and the draft budget's choice of 0..k draft steps: SpecStep._budget's, the
        same floats in the same order (one call a step where the compiled twin runs). row >= 0:
        the step drafts into rows row.. of the slab (watch_slab), which next_at and keep_at
        read from then on, with no buffers of the step's own to watch."""
        if self.budget_terms is None or not 0 <= k < len(self.budget_terms):
            raise IndexError(f"OneRow.begin: no budget terms for {k} drafts")
        if row >= 0:
            if self.slab is None or row + k > len(self.slab[0]):
                raise IndexError("OneRow.begin: rows past the watched slab")
            self.top, self.margin = (a[row:row + k] for a in self.slab)
        kv_ms = self.b2 * float(kv)
        ctx = int(round(kv_ms * self.units_per_ms))  # decision.context_unit
        self.restart(ctx, self.fixed0 + ctx, cap)
        best_m, best = 0, 1.0 / (self.base + kv_ms)
        for m, expected, fixed, verified in self.budget_terms[k]:
            theta = expected / (fixed + verified * kv_ms)
            if theta > best * self.budget_scale:
                best_m, best = m, theta
        self.lam = best * CONF_ONE / self.units_per_ms if self.by_rate else -1.0  # decision.rate_units
        return best_m

    def add(self, c: float) -> None:
        """The next draft's acceptance estimate."""
        self.drafts += 1
        if self.closed or self.drafts > self.cap:
            self.closed = True
            return
        acc = (self.acc * min(max(int(round(c * CONF_ONE)), 0), CONF_ONE)) >> CONF_BITS
        if acc <= 0:
            self.closed = True
            return
        self.acc = acc
        self.e.append(self.e[-1] + acc)
        self.t.append(self.t[-1] + self.ctx)
        self.div.append(self.div[-1] * self.scale)

    def add_logistic(self, p: float, m: float) -> None:
        """The next draft's logistic estimate, from its top probability p and margin m."""
        self.add(logistic_estimate(self.weights[self.drafts], p, m))

    def set_terms(self, draft_units: list[int], rates: list[float]) -> None:
        """The draft times (units, by number of draft steps) and each position's rate for a draft
        not yet made, which next and keep read."""
        self.draft_units, self.rates = draft_units, rates

    def next(self, j: int, p: float, m: float) -> bool:
        """Draft j (the step's j-th) arrived, with top probability p and margin m: its logistic
        estimate added, is draft j + 1 worth drafting?"""
        if self.drafts != j - 1:
            raise ValueError("OneRow.next: drafts must arrive in order")
        self.add_logistic(p, m)
        return self.worth_drafting(self.draft_units[j], self.draft_units[j + 1], self.rates[j])

    def watch(self, top, margin) -> None:
        """The draft loop's (budget, n) float64 buffers of top probabilities and margins (held,
        not copied): next_at(j) reads draft j's of row 0 itself."""
        if top.shape != margin.shape or top.ndim != 2:
            raise ValueError("OneRow.watch: top and margin must be equal (budget, n) arrays")
        self.top, self.margin = top, margin

    def watch_slab(self, top, margin) -> None:
        """The policy's draft slab (SpecPolicy.draft_row): (rows, 1) columns the steps beginning at a
        row of them draft into, watched once for this OneRow's life instead of a step's buffers at
        every step."""
        if top.shape != margin.shape or top.ndim != 2:
            raise ValueError("OneRow.watch_slab: top and margin must be equal (rows, n) arrays")
        self.slab = (top, margin)

    def next_at(self, j: int) -> bool:
        """next(j, ...) with draft j's top probability and margin read from the watched buffers."""
        if not 1 <= j <= len(self.top):
            raise IndexError("OneRow.next_at: no such row in the watched buffers")
        return self.next(j, float(self.top[j - 1, 0]), float(self.margin[j - 1, 0]))

    def keep_at(self, m: int) -> int:
        """keep(m), the drafts not yet added read from the watched buffers first."""
        if not m <= len(self.top):
            raise IndexError("OneRow.keep_at: no such row in the watched buffers")
        for j in range(self.drafts, m):
            self.add_logistic(float(self.top[j, 0]), float(self.margin[j, 0]))
        return self.keep(m)

    def keep(self, m: int) -> int:
        """Drafts to verify of the m drafted."""
        return self.best(self.draft_units[m], m)[0]

    def _total(self, m: int, d: int) -> int:
        return max(self.t[m] + d + self.f[m] + ((self.o * self.e[m]) >> CONF_BITS), 1)

    def _theta(self, m: int, d: int) -> float:
        theta = self.e[m] / self._total(m, d)
        return theta / self.div[m] if self.min_gain else theta

    def best(self, d: int, upto: int) -> tuple[int, float]:
        """The best prefix of at most `upto` drafts and its score, d the draft time in units
        (best_one: ties keep the shorter prefix)."""
        best, count = self._theta(0, d), 0
        for m in range(1, min(upto, len(self.e) - 1) + 1):
            theta = self._theta(m, d)
            if theta > best:
                best, count = theta, m
        return count, best

    def worth_drafting(self, d_stop: int, d_go: int, rate: float) -> bool:
        """After the drafts added so far (j), is draft j+1 worth drafting, it taken at `rate`?
        worth_drafting's batch-1 answer: the best prefix with it must be it (j+1 drafts, at
        draft time d_go) and beat the best prefix without it (at d_stop): by Theta, or at the
        budget's rate where begin set one (as early_stop.worth_drafting at batch 1)."""
        j = self.drafts
        if self.closed or j + 1 > self.cap:
            return False
        acc = (self.acc * min(max(int(round(rate * CONF_ONE)), 0), CONF_ONE)) >> CONF_BITS
        if acc <= 0:
            return False
        e = self.e[j] + acc
        go_t = max(self.t[j] + self.ctx + d_go + self.f[j + 1] + ((self.o * e) >> CONF_BITS), 1)
        go = e / go_t
        if self.min_gain:
            go /= self.div[j] * self.scale
        if self.lam >= 0:
            for m in range(j + 1):  # the best prefix with it is it ...
                if go <= self._theta(m, d_go):
                    return False
            m, stop = self.best(d_stop, j)  # ... and worth more than the best without it
            return beats_at_rate(go, go_t, stop, self._total(m, d_stop), self.lam)
        for m in range(j + 1):
            if go <= self._theta(m, d_stop) or (d_go < d_stop and go <= self._theta(m, d_go)):
                return False
        return True
