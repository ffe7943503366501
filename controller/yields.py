"""What the draft budget expects of a draft position: the share of the drafts made there
that were verified (the keep rule's choice and exploration's) and the share that were
accepted, counted over every draft made, verified or not: what drafting there cost and
brought, exploration's validations included.

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
        self.verified = np.zeros(k)
        self.accepted = np.zeros(k)
        self._pending = [[], [], []]  # the same three per position, since the last fold (Python ints)

    def count_drafts(self, max_keep, m: int) -> None:
        """A step's drafts: sequence i drafted min(m, max_keep[i]) it could verify (a list or an array)."""
        _add_at_least(self._pending[0], _histogram(max_keep, m), len(max_keep))

    def count_outcomes(self, verified, accepted: np.ndarray) -> None:
        """Drafts verified per sequence (a list or an array) and, of those, accepted (an array)."""
        width = max(verified) if isinstance(verified, list) else int(verified.max(initial=0))
        if isinstance(verified, list):
            accepted = accepted.tolist()
        _add_at_least(self._pending[1], _histogram(verified, width), len(verified))
        _add_at_least(self._pending[2], _histogram(accepted, width), len(verified))

    def fold(self) -> None:
        """Add the pending counts (the policy's calibration batches); old evidence halves."""
        drafted, kept, accepted = self._pending
        if not drafted:
            return
        m = len(drafted)
        for total, new in ((self.drafted, drafted), (self.verified, kept), (self.accepted, accepted)):
            total[:len(new[:m])] += new[:m]
        self._pending = [[], [], []]
        full = self.drafted >= HALVE_AT
        if full.any():
            for a in (self.drafted, self.verified, self.accepted):
                a[full] /= 2

    def shares(self, prior_rates: np.ndarray) -> tuple[list[float], list[float]]:
        """(accepted, verified) shares per position; before data (PRIOR_WEIGHT pseudo-drafts)
        every draft verified and accepted at the product of the prior's conditional rates."""
        accepted = (self.accepted + PRIOR_WEIGHT * np.cumprod(prior_rates)) / (self.drafted + PRIOR_WEIGHT)
        kept = (self.verified + PRIOR_WEIGHT) / (self.drafted + PRIOR_WEIGHT)
        return accepted.tolist(), kept.tolist()


def _histogram(values, width: int) -> list[int]:
    """How many of `values` (a list or an array) equal 0, 1, .., width (larger ones count as width)."""
    if isinstance(values, list):
        hist = [0] * (width + 1)
        for v in values:
            hist[min(v, width)] += 1
        return hist
    return np.bincount(np.minimum(values, width), minlength=width + 1).tolist()


def _add_at_least(counts: list, hist: list[int], n: int) -> None:
    """counts[j] += how many values are above j, for j < width (from their histogram)."""
    width = len(hist) - 1
    counts.extend([0] * (width - len(counts)))
    below = 0
    for j in range(width):
        below += hist[j]
        counts[j] += n - below


def prior_rates(calibrator: Calibrator) -> np.ndarray:
    """The calibrator's conditional acceptance per position, each position it has too few
    trials at taking the rate of the one before: deeper drafts are explored only by probes,
    and 0.5 there made every position past the budget look hopeless."""
    rates, trials = calibrator.position_rates(), calibrator.trials.sum(1)
    for j in range(1, len(rates)):
        if trials[j] < PRIOR_WEIGHT:
            rates[j] = rates[j - 1]
    return rates
