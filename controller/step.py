"""One decode step's speculation decisions, made by `SpecPolicy.begin_step` and read by the
runner top to bottom:

    step = policy.begin_step(mode, kv, max_keep, version, k)
    draft step.budget positions for step.rows (None: every sequence), and after each one
        step.keep_drafting(...)           the early stop (step.early_stop: as a callable of j)
    keep = step.keep(...)                 drafts each sequence validates
    policy.end_step(step, ...)            outcomes, calibration batches, the probe back-off

Everything here is a deterministic function of what every rank holds, so all ranks reach
the same answers without talking to each other.
"""
from __future__ import annotations

import numpy as np

from controller.decision import (CONF_BITS, REFINE_ROUNDS, SMALL, StepCosts, decide_cols, decide_small, decide_with,
                                 quantize, rate_units, step_costs)
from controller.early_stop import worth_drafting, worth_drafting_paths
from controller.terms import best_budget_rate
from controller.time_model import TimeModel

EXPLORE_EVERY = 8  # at every adaptive step, every 8th sequence (rotating) verifies everything drafted


class SpecStep:
    """mode: static | adaptive | oracle. probe: this adaptive step explores one draft position
    past what the budget found worth drafting. rows: at a probe where drafting does not pay
    at all, one sequence drafts, and exploration verifies
    it (each row that drafts first catches up on every position since it last drafted: at
    batch 32 a probe's four explored rows had caught up on 500-600 tokens, 10-16 ms); None:
    every one. That row is the one cheapest to catch up where the runner says (cheapest:
    start -> that row, the first of equals from row start on; its RowsBehind's), start a row
    that turns with the probes; else the row that turns."""

    # slots: a batch-1 step's few microseconds of Python touch fewer cache lines than a dict's
    __slots__ = ("policy", "mode", "probe", "kv", "model", "oracle", "cold_start", "kv_list", "_first", "_explore",
                 "rows", "costs", "rule_keep", "drafted", "conf", "_paths", "_hg", "_many",
                 "_caps", "max_keep_list", "kmax", "best_m", "budget", "kv_total", "catchup", "level", "wants",
                 "lam")

    def __init__(self, policy, mode: str, probe: bool, kv, max_keep, model: TimeModel,
                 oracle: np.ndarray | None, k: int, cold_start: bool = False, kv_total: int | None = None,
                 catchup=None, level: int = 0, cheapest=None):
        self.policy, self.mode, self.probe, self.model, self.oracle = policy, mode, probe, model, oracle
        self.catchup = catchup  # SpecPolicy.begin_step's: the rows' catch-up the budget prices (None: none)
        self.cold_start = cold_start  # a probe because the calibrators are cold (SpecPolicy.begin_step): no back-off
        self.level = level  # batch 1: its sequence's record's level (controller/history.py); 0: the pooled rates
        n = len(kv)
        self.kv_total = kv_total  # sum(kv), where begin_step had it
        if n <= SMALL:  # small batches: Python ints
            self.kv = self.kv_list = kv if isinstance(kv, list) else kv.tolist()
        else:
            self.kv, self.kv_list = np.asarray(kv, dtype=np.int64), None
        self._first = -policy.adaptive_steps % EXPLORE_EVERY  # exploration's first row (`explore`)
        self._explore: list[int] | None = None
        self.rows: list[int] | None = None
        self.costs: StepCosts | None = None  # adaptive steps: the decision's time terms, on first use
        self.rule_keep = None  # adaptive steps: what the keep rule chose (before exploration)
        self.drafted = None  # ... and (max_keep, drafts made): what the draft yields count (at the calibration batch)
        self.conf: list | None = None  # adaptive steps: acceptance estimates of the positions drafted so far
        self._paths: list[np.ndarray] = []  # large batches: their quantised path probabilities, before the caps
        self._hg: tuple | None = None  # the time model's h(n) and g(n), asked once per step
        self._many = None  # a large batch (logistic estimate, compiled): its ManyRows, which reads the draft buffers
        self._set_caps(max_keep)
        self.best_m = k  # the budget's own choice (adaptive), before a probe's or the early stop's extra position
        self.lam = None  # adaptive: the early stop's rate, the budget's expected throughput (None: Theta's)
        self.wants = 0  # ... and before its rows' catch-up is priced (adaptive; catchup.DraftStretches)
        self.budget = self._budget(k) if mode == "adaptive" and k else k
        if self.budget and mode == "adaptive" and not probe and policy.probes.plain_due(model.plain_measured):
            self.budget = 0  # a plain probe (controller/probes.py): what a plain step's rest costs here
        if mode == "adaptive" and probe and self.best_m == 0 and self.budget:  # a stand-down probe
            start = policy.probes.probes % n  # one row (see rows above)
            self.rows = self._explore = [start if cheapest is None else cheapest(start)]
            caps = np.zeros_like(self.max_keep)
            caps[self.rows] = self.max_keep[self.rows]
            self._set_caps(caps)
            self._hg = None  # h(n) and g(n) of the rows that draft
            if not self.kmax:
                self.budget, self.rows = 0, None

    def _set_caps(self, max_keep) -> None:
        """max_keep: (n,) drafts each sequence may verify, a list or an array. Small batches
        keep it as a list (max_keep_list); the array (`max_keep`) is made on first use."""
        if len(max_keep) <= SMALL:  # small batches: Python ints
            self.max_keep_list = max_keep if isinstance(max_keep, list) else max_keep.tolist()
            self._caps = max_keep if isinstance(max_keep, np.ndarray) else None
            self.kmax = self.max_keep_list[0] if len(max_keep) == 1 else max(self.max_keep_list, default=0)
        elif isinstance(max_keep, list) and max_keep.count(max_keep[0]) == len(max_keep):  # the usual: all k
            self._caps = self.policy.full_caps(len(max_keep), max_keep[0])
            self.max_keep_list, self.kmax = None, max(max_keep[0], 0)
        else:
            self._caps = np.asarray(max_keep, dtype=np.int64)
            self.max_keep_list, self.kmax = None, int(self._caps.max(initial=0))

    @property
    def explore(self) -> list[int]:
        """Rows that verify everything drafted (adaptive steps): every EXPLORE_EVERY-th from a
        first row that rotates with the steps; made on first use (most steps never ask)."""
        if self._explore is None:
            self._explore = list(range(self._first, len(self.kv), EXPLORE_EVERY))
        return self._explore

    @property
    def max_keep(self) -> np.ndarray:
        """(n,) drafts each sequence may verify, as an array."""
        if self._caps is None:
            self._caps = np.array(self.max_keep_list, dtype=np.int64)
        return self._caps

    # ------------------------------------------------------------------ budget
    def _budget(self, k: int) -> int:
        """How many draft steps to run: the m in 0..k that maximises the estimated
        throughput n (1 + y_1 + .. + y_m) / (T_draft(m) + T_val(n (1 + v_1 + .. + v_m)) + T_other),
        y_j and v_j the shares of drafts at position j that were accepted and that were verified
        (SpecPolicy.shares, counted over steps of about n sequences), at the batch's mean
        context (O(k) scalar arithmetic, the same on every rank). 0 means a plain decode step.
        Sets best_m."""
        policy, tm, n = self.policy, self.model, len(self.kv)
        # one validated token per sequence: context cost of the batch (batch 1's OneRowStep: its OneRow's begin)
        total = self.kv_total
        if total is None:
            total = sum(self.kv_list) if self.kv_list is not None else self.kv.sum()
        kv_ms = tm.b2 * float(total)
        base, terms = policy.terms.budget_terms(tm, n, k, at=self.level)
        scale, enter = 1.0 + policy.cfg.adaptive.min_gain, policy.terms.enter(n)
        best_m, rate = best_budget_rate(base, terms, kv_ms, scale, enter=enter)
        self.wants = best_m
        if best_m and self.catchup is not None:
            # rows behind by more than a steady step: each token the step emits them pays its share of
            # their catch-up (controller/catchup.py; expected: tokens per row); asked only where it would draft
            per_token = tm.catchup_ms * self.catchup(k)
            if per_token > 0.0:
                best_m, rate = best_budget_rate(base, terms, kv_ms, scale, per_token, enter)
        self.best_m = best_m
        if policy.cfg.adaptive.early_stop_at_rate:  # the budget's rate is a sequence's: the batch's is n times it
            self.lam = rate_units(n * rate)
        if self.probe:
            return min(k, best_m + 1)
        # one position of headroom: the early stop, which sees each step's drafts, decides on it
        # (at batch 1 the budget alone stopped at 2 of 3 drafts static-3 verifies to its gain)
        return min(k, best_m + 1) if best_m and policy.early_stop_on else best_m

    # ------------------------------------------------------------------ early stop
    def keep_drafting(self, top_prob: np.ndarray, margin: np.ndarray, tokens: np.ndarray) -> bool:
        """After j draft steps (top_prob, margin, tokens: (n, j), a row per drafting sequence),
        is draft j+1 worth drafting? adaptive: only if the best keep set with it, each
        sequence's next draft at its position's observed conditional acceptance (one step
        ahead; the draft itself is not known yet), beats the best without it and without its
        draft step; oracle: only if some sequence still matches the reference."""
        j = top_prob.shape[1]
        if self.mode == "oracle":
            return bool((self._oracle_match(np.asarray(tokens)) >= j).any())
        if self.mode != "adaptive" or self.probe or not self.policy.early_stop_on:
            return True
        # draft times are predicted, never measured: the same on every rank
        cols = self._estimates(top_prob, margin, j)
        if not isinstance(cols[0], list):  # large batch: each position's path probabilities quantised once
            return worth_drafting_paths(self._path_cols(j), self._costs(), self.policy.cfg.adaptive.min_gain,
                                        self._draft_ms(j), self._draft_ms(j + 1), self.policy.next_rates[j],
                                        self.max_keep, self.policy.compiled, self.lam)
        return worth_drafting(cols, self._costs(), self.policy.cfg.adaptive.min_gain, self._draft_ms(j),
                              self._draft_ms(j + 1), self.policy.rates_at(self.level)[j], self.max_keep_list,
                              self.lam)

    def draft_inputs(self, budget: int):
        """Where the draft loop writes its (3, budget, n) confidence inputs (top probability, margin,
        drafted token's probability), or None: buffers of its own (a batch-1 OneRowStep lends rows
        of the policy's draft slab)."""
        return None

    def draft_next(self):
        """Asked by the draft loop after early_stop: a callable (logits, tokens, inputs, j) -> bool that
        writes position j's confidence inputs into the loop's buffers and answers the early stop after
        it in one call, or None (the loop calls the kernel and early_stop's answer apart). Batch 1's
        compiled OneRowStep has one."""
        return None

    def early_stop(self, top_prob: np.ndarray, margin: np.ndarray, tokens):
        """The early stop over the draft loop's (budget, n) buffers, which it fills a row per
        position: a callable j -> keep_drafting after j drafts, or None where the step drafts
        its whole budget (static steps, probes, early_stop off: asking cost static-3 about 20
        us a step at batch 1). (Batch 1 on the logistic estimate: OneRowStep's.)"""
        if self.mode != "oracle" and (self.mode != "adaptive" or self.probe or not self.policy.early_stop_on):
            return None
        # from here: an oracle step, or an adaptive one that may stop early
        many = self._many_rows(top_prob, margin)
        if many is not None:
            return many.next_at
        return lambda j: self.keep_drafting(top_prob[:j].T, margin[:j].T, tokens[:j].T)

    def _many_rows(self, top_prob: np.ndarray, margin: np.ndarray):
        """For early_stop, past its checks (no probe, early_stop on): a
        large batch's compiled ManyRows (models/csrc/many_rows.cpp) over the draft loop's
        (budget, n) float64 buffers, where it decides as keep_drafting and keep would (the
        same functions on the same integers), else None: oracle steps, small batches, other
        estimators, no kernels, or buffers of another layout. It makes the step's context costs
        itself from the contexts (as step_costs would), and its time terms come from the policy,
        computed once per time model and batch size: the costs' numpy calls had been a fifth of
        a batch-256 step's controller time, right after a forward pass (cold caches)."""
        policy = self.policy
        compiled, adaptive = policy.compiled, policy.cfg.adaptive
        if (compiled is None or self.mode != "adaptive"
                or adaptive.estimator != "top_prob_logistic" or len(self.kv) < 2
                or top_prob.dtype != np.float64 or margin.dtype != np.float64
                or not (top_prob.flags.c_contiguous and margin.flags.c_contiguous)):
            return None
        fixed, per_token, f = policy.terms.many_terms(self.model, len(self.kv), len(self.kv) * self.kmax)
        self._many = compiled.ManyRows(self.max_keep, self.kv, self.model.b2, f, fixed,
                                       policy.terms.draft_unit_list(self.model, len(self.kv), self.budget + 2),
                                       policy.next_rates, per_token, adaptive.min_gain, REFINE_ROUNDS,
                                       policy.compiled_weights(), top_prob, margin,
                                       -1.0 if self.lam is None else self.lam)
        return self._many

    # ------------------------------------------------------------------ keep
    def keep(self, top_prob: np.ndarray, token_prob: np.ndarray, margin: np.ndarray,
             tokens: np.ndarray | None) -> list[int]:
        """The drafts each sequence validates, a list of n ints; top_prob, token_prob, margin,
        tokens: (n, m)."""
        n, m = top_prob.shape
        if self.mode == "oracle":  # (tokens may be a tensor: only an oracle step reads them)
            return np.minimum(np.minimum(self._oracle_match(np.asarray(tokens)), self.max_keep), m).tolist()
        if self.mode == "static" or m == 0:
            if self.max_keep_list is not None:
                return [c if c < m else m for c in self.max_keep_list]
            return np.minimum(self.max_keep, m).tolist()
        policy = self.policy
        if self._many is not None:  # a large batch's ManyRows: the estimates it made for the early stop, reused
            # the rule's choice, and the list with exploration's rows (`explore`) verifying all they drafted
            self.rule_keep, out = self._many.keep_explored(m, self._first, EXPLORE_EVERY)
            self.drafted = (self.max_keep, m)
            return out
        by_token = policy.cfg.adaptive.estimator == "token_prob"
        if by_token:
            conf = token_prob
        else:  # small batches decide on the estimates as rows; large ones on their path probabilities
            cols = self._estimates(top_prob, margin, m)
            conf = _matrix(cols) if isinstance(cols[0], list) else None
        draft_ms = self._draft_ms(m)
        # exploration: the estimator learns only from verified drafts, and those the rule picked are
        # the confident ones; a rotating share, chosen by step and row alone, verifies everything
        # (observe weighs the drafts only it verified by EXPLORE_EVERY, their sampling rate)
        if isinstance(conf, list):
            keep = self.rule_keep = decide_small(conf, self._costs(), policy.cfg.adaptive.min_gain, draft_ms,
                                                 self.max_keep_list)
            self.drafted = (self.max_keep_list, m)
            out = list(keep)
            for i in self.explore:
                out[i] = min(self.max_keep_list[i], m)
            return out
        if by_token:
            keep = decide_with(conf, self._costs(), policy.cfg.adaptive.min_gain, draft_ms, self.max_keep)
        else:  # the early stop's path probabilities, quantised once per position
            keep = decide_cols(self._path_cols(m), self.max_keep, self._costs(), policy.cfg.adaptive.min_gain, draft_ms,
                               policy.compiled)
        self.rule_keep, self.drafted = keep, (self.max_keep, m)
        out = keep.copy()
        out[self.explore] = np.minimum(self.max_keep[self.explore], m)
        return out.tolist()

    # ------------------------------------------------------------------ helpers
    def _costs(self) -> StepCosts:
        """The step's decision costs, computed on first use (a step that drafts nothing never needs them)."""
        if self.costs is None:
            extra = len(self.kv) * self.kmax
            self.costs = step_costs(self.model, self.kv if self.kv_list is None else self.kv_list, extra,
                                    self.policy.terms.f_values(self.model, "decide", len(self.kv), extra))
        return self.costs

    def _draft_terms(self) -> tuple[float, float]:
        """The time model's h(n) and g(n), n the sequences that draft, looked up once per step."""
        if self._hg is None:
            n = len(self.kv) if self.rows is None else len(self.rows)
            self._hg = self.policy.terms.draft_terms(self.model, n)
        return self._hg

    def _draft_ms(self, steps: int) -> float:
        """The time model's draft_ms(n, steps)."""
        if steps <= 0:
            return 0.0
        h, g = self._draft_terms()
        return h + steps * g

    def _oracle_match(self, tokens: np.ndarray) -> np.ndarray:
        j = tokens.shape[1]
        match = tokens == self.oracle[:, :j]
        return np.cumprod(match, axis=1).sum(axis=1)

    def _path_cols(self, count: int) -> list[np.ndarray]:
        """Quantised path probabilities of the first `count` positions (path_probs' columns,
        before the caps), from the estimates already made (`_estimates`)."""
        compiled = self.policy.compiled  # its path_column: the same integers (models/csrc/rank.cpp)
        for j in range(len(self._paths), count):
            prev = self._paths[-1] if j else None
            if compiled is not None:
                col = compiled.path_column(self.conf[j], prev)
            else:
                q = quantize(self.conf[j])
                col = q if prev is None else (prev * q) >> CONF_BITS
            self._paths.append(col)
        return self._paths[:count]

    def _estimates(self, top_prob, margin, count: int) -> list:
        """Acceptance estimates of the step's first `count` draft positions, one column
        each, computed once per position and step (the calibrators change only between
        steps); Python lists for small batches, arrays for large ones. top_prob, margin:
        (n, >= count) arrays. token_prob's early stop uses the top
        probability, an upper bound of the drafted token's."""
        if self.conf is None:
            self.conf = []
        small = len(self.kv) * self.kmax <= SMALL
        policy = self.policy
        est = policy.cfg.adaptive.estimator
        for j in range(len(self.conf), count):
            col, m = top_prob[:, j], margin[:, j]
            col = col.tolist() if small else np.asarray(col, dtype=np.float64)
            if est == "top_prob_logistic":
                m = m.tolist() if small else np.asarray(m, dtype=np.float64)
                col = policy.logistic.estimate_column(col, m, j, policy.compiled)
            elif est == "top_prob_calibrated":
                col = policy.calibrator.estimate(np.asarray(col, dtype=np.float64)[:, None], start=j)[:, 0]
                col = col.tolist() if small else col
            self.conf.append(col)
        return self.conf[:count]


def _matrix(cols: list[list[float]]) -> list[list[float]]:
    """A small batch's columns (Python lists) -> rows, as the decision takes them."""
    return [list(row) for row in zip(*cols)]

