"""What the draft budget expects of a draft position: the share of the drafts made there
that the keep rule verified and the share that were accepted, counted over every draft
made, verified or not.

The calibrator's observed rates count only verified drafts, which the rule picked for their
confidence: at batch 8 those were accepted 89% of the time while the rule verified one draft
in ten, and a budget reading them drafted at steps that then verified almost nothing. The
mean acceptance estimate over all drafts would do instead only where the estimator is
calibrated on unverified drafts, which it cannot be before it has seen any. Counts only:
the same on every rank.
"""
from __future__ import annotations

import numpy as np

from controller.estimators import HALVE_AT, PRIOR_WEIGHT, Calibrator


class DraftYields:
    def __init__(self, k: int):
        self.drafted = np.zeros(k)
        self.kept = np.zeros(k)
        self.accepted = np.zeros(k)
        self._pending = [[], [], []]  # the same three per position, since the last fold (Python ints)

    def count_drafts(self, max_keep, m: int) -> None:
        """A step's drafts: sequence i drafted min(m, max_keep[i]) it could verify (a list or an array)."""
        drafted = self._pending[0]
        drafted.extend([0] * (m - len(drafted)))
        if isinstance(max_keep, list):
            for cap in max_keep:
                for j in range(min(m, cap)):
                    drafted[j] += 1
        else:
            for j in range(m):
                drafted[j] += int((max_keep > j).sum())

    def count_outcomes(self, rule, accepted: np.ndarray) -> None:
        """The drafts the rule chose to verify (a list or an array, per sequence) and, of those,
        accepted (`accepted` may count more: drafts only exploration verified)."""
        kept, got = self._pending[1], self._pending[2]
        width = max(rule) if isinstance(rule, list) else int(rule.max(initial=0))
        kept.extend([0] * (width - len(kept)))
        got.extend([0] * (width - len(got)))
        if isinstance(rule, list):
            for r, a in zip(rule, accepted.tolist()):
                for j in range(r):
                    kept[j] += 1
                for j in range(min(a, r)):
                    got[j] += 1
            return
        accepted = np.minimum(accepted, rule)
        for j in range(width):
            kept[j] += int((rule > j).sum())
            got[j] += int((accepted > j).sum())

    def fold(self) -> None:
        """Add the pending counts (the policy's calibration batches); old evidence halves."""
        drafted, kept, accepted = self._pending
        if not drafted:
            return
        m = len(drafted)
        for total, new in ((self.drafted, drafted), (self.kept, kept), (self.accepted, accepted)):
            total[:len(new[:m])] += new[:m]
        self._pending = [[], [], []]
        full = self.drafted >= HALVE_AT
        if full.any():
            for a in (self.drafted, self.kept, self.accepted):
                a[full] /= 2

    def shares(self, prior_rates: np.ndarray) -> tuple[list[float], list[float]]:
        """(accepted, verified) shares per position; before data (PRIOR_WEIGHT pseudo-drafts)
        every draft verified and accepted at the product of the prior's conditional rates."""
        accepted = (self.accepted + PRIOR_WEIGHT * np.cumprod(prior_rates)) / (self.drafted + PRIOR_WEIGHT)
        kept = (self.kept + PRIOR_WEIGHT) / (self.drafted + PRIOR_WEIGHT)
        return accepted.tolist(), kept.tolist()


def prior_rates(calibrator: Calibrator) -> np.ndarray:
    """The calibrator's conditional acceptance per position, each position it has too few
    trials at taking the rate of the one before: deeper drafts are explored only by probes,
    and 0.5 there made every position past the budget look hopeless."""
    rates, trials = calibrator.position_rates(), calibrator.trials.sum(1)
    for j in range(1, len(rates)):
        if trials[j] < PRIOR_WEIGHT:
            rates[j] = rates[j - 1]
    return rates
