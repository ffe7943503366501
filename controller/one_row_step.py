"""Batch 1's adaptive step on the logistic estimate: SpecStep's decisions for one sequence,
made by its OneRow (controller/one_row.py, compiled where the kernels load).

SpecPolicy.begin_step makes one for every adaptive step of one sequence (the default
estimator, k > 0). It answers as a SpecStep would at batch 1, decision for decision (the
general step reaches the same integers through decide_small and worth_drafting, which
tests/test_one_row_step.py holds it to), with less Python on the way: between two forward
passes, which evict the caches, batch 1's controller took 46.5-48.7 us a step (median) as a
SpecStep with batch-1 branches and 35-36 us as this one (adaptive-7, in the engine).
"""
from __future__ import annotations

import numpy as np

from controller.step import EXPLORE_EVERY, SpecStep
from controller.time_model import TimeModel


class OneRowStep(SpecStep):
    # the step's OneRow (SpecPolicy.one_row); early_stop gave it buffers to read (_watched); its first row in the
    # policy's draft slab (None: none free), and whether the draft loop took them (draft_inputs)
    __slots__ = ("_one", "_watched", "_row", "_lent")

    def __init__(self, policy, probe: bool, kv, max_keep, model: TimeModel, k: int, cold_start: bool = False,
                 level: int = 0):
        """kv, max_keep: one context length and cap (lists, or arrays); k > 0: drafts the step may make;
        level: its sequence's record's (controller/history.py), whose OneRow decides."""
        self.policy, self.mode, self.probe, self.model, self.oracle = policy, "adaptive", probe, model, None
        self.cold_start, self.level = cold_start, level
        self.kv = self.kv_list = kv if isinstance(kv, list) else kv.tolist()
        self.max_keep_list = max_keep if isinstance(max_keep, list) else max_keep.tolist()
        self._caps = None if isinstance(max_keep, list) else max_keep
        # (of SpecStep's state, what this step's methods, the runner and end_step read)
        self._explore = self.rows = self.rule_keep = self.drafted = None
        self._watched = self._lent = False
        self._first = -policy.adaptive_steps % EXPLORE_EVERY  # 0: this step explores its row
        cap = self.kmax = self.max_keep_list[0]
        # the budget (SpecStep._budget): the OneRow's best m, one position more for a probe or the early stop
        one = self._one = policy.one_row(model, cap, level)
        row = self._row = policy.draft_row(k)
        best_m = self.best_m = self.wants = one.begin(self.kv_list[0], cap, k, -1 if row is None else row)
        budget = min(k, best_m + 1) if probe or (best_m and policy.early_stop_on) else best_m
        if budget and not probe and policy.probes.plain_due(model.plain_measured):
            budget = 0  # a plain probe
        if probe and best_m == 0 and budget:  # a stand-down probe: its one row drafts, and exploration verifies it
            self.rows = self._explore = [0]
            if not cap:
                budget, self.rows = 0, None
        self.budget = budget

    def keep_drafting(self, top_prob: np.ndarray, margin: np.ndarray, tokens) -> bool:
        """SpecStep.keep_drafting: after j drafts (top_prob, margin: (1, j)), is draft j + 1 worth drafting?"""
        if self.probe or not self.policy.early_stop_on:
            return True
        j = top_prob.shape[1]
        return self._one.next(j, float(top_prob[0, j - 1]), float(margin[0, j - 1]))

    def draft_inputs(self, budget: int):
        """SpecStep.draft_inputs: the step's rows of the policy's draft slab, which its OneRow has
        watched since it was built and reads from the row begin named: no buffers to watch a step
        (between forward passes, watching the draft loop's new ones cost a step about 9 us)."""
        if self._row is None:
            return None
        self._lent = True
        return self.policy.draft_slab[:, self._row:self._row + budget]

    def early_stop(self, top_prob: np.ndarray, margin: np.ndarray, tokens):
        """SpecStep.early_stop: the OneRow's next_at over the draft loop's (budget, 1) buffers,
        which it reads itself (one call between two draft forwards): the slab rows it lent
        (draft_inputs), else the buffers given, watched; None at a probe."""
        if self.probe or not self.policy.early_stop_on:
            return None
        one = self._one
        if not self._lent:
            one.watch(top_prob, margin)
        self._watched = True
        return one.next_at

    def draft_next(self):
        """SpecStep.draft_next: the compiled OneRow's, over the slab rows the draft loop took
        (draft_inputs), where early_stop answered; None for the Python OneRow or own buffers."""
        if not (self._lent and self._watched and self.policy.fused_drafts):
            return None
        return getattr(self._one, "draft_next", None)

    def keep(self, top_prob: np.ndarray, token_prob: np.ndarray, margin: np.ndarray, tokens) -> list[int]:
        """SpecStep.keep: [drafts the sequence validates] of the m drafted (top_prob, margin: (1, m))."""
        m, cap = top_prob.shape[1], self.max_keep_list[0]
        if m == 0:
            return [0]
        one = self._one
        if self._watched:  # the last draft's estimate read from the draft loop's buffers, in the same call
            count = one.keep_at(m)
        else:  # a probe's drafts (no early stop)
            for j in range(one.drafts, m):
                one.add_logistic(float(top_prob[0, j]), float(margin[0, j]))
            count = one.keep(m)
        self.rule_keep, self.drafted = [count], (self.max_keep_list, m)
        explored = self._first == 0 if self._explore is None else self._explore
        return [min(cap, m) if explored else count]
