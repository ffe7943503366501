"""What the draft budget expects of a draft position: the share of the drafts made there
that were verified (the keep rule's choice and exploration's) and the share that were
accepted, counted over every draft made, verified or not: what drafting there cost and
brought, exploration's validations included.

The calibrator's observed rates count only verified drafts, which the rule picked for their
confidence: at batch 8 those were accepted 89% of the time while the rule verified one draft
in ten, and a budget reading them drafted at steps that then verified almost nothing. The
mean acceptance estimate over all drafts would do instead only where the estimator is
calibrated on unverified drafts, which it cannot be before it has seen any. Counts only:
the same on every rank. They are kept per batch-size bucket (YieldsByBatch), as the share
the rule verifies depends on the batch.
"""
from __future__ import annotations

import numpy as np

from controller.decision import SMALL
from controller.estimators import HALVE_AT, PRIOR_WEIGHT, Calibrator
from controller.pending import joined


# Batch 1's prior, in pseudo-drafts. Its steps are one request's at a time, and a bucket's first
# drafts are a request or two's: in one engine of five warmed up alike, 57-88 first drafts accepted
# 46-53% (the workload's 73-76%) stood batch 1 down, and stand-down probes, one position each,
# backed off, had not moved its counts after thousands of steps (DESIGN.md section 8, probes).
# About six requests' first drafts; bucket 0 of a server that drafts holds thousands.
ALONE_PRIOR_WEIGHT = 256.0


class DraftYields:
    def __init__(self, k: int, prior_weight: float = PRIOR_WEIGHT):
        """prior_weight: the prior's pseudo-drafts at every position (shares)."""
        self.prior_weight = prior_weight
        self.drafted = np.zeros(k)
        self.verified = np.zeros(k)
        self.accepted = np.zeros(k)
        # each step's counts since the last fold, as given: ((max_keep, drafts made), verified,
        # accepted). Counted into positions at the fold (`pending`), one histogram per calibration
        # batch, where counting each step cost batch 1 about 10 us a step.
        self._steps: list[tuple] = []

    def count(self, max_keep, m: int, verified, accepted) -> None:
        """A step's drafts and outcomes: sequence i drafted min(m, max_keep[i]) it could verify,
        verified[i] of them, and accepted[i] of those (each a list or an array, held until the
        fold)."""
        self._steps.append(((max_keep, m), verified, accepted))

    def pending(self) -> list[list[int]]:
        """The counts since the last fold: per position j, the drafts made there (that could be
        verified), verified and accepted; each list as long as its deepest position counted.
        A few array operations over the steps' values end to end, not a few per step (at batch
        1 a fold of 256 steps took about 0.5 ms one step at a time)."""
        steps = self._steps
        if not steps:
            return [[], [], []]
        sizes = [len(s[1]) for s in steps]
        drafts = np.array([s[0][1] for s in steps], dtype=np.int64)
        made = np.minimum(joined([s[0][0] for s in steps]),
                          drafts if max(sizes) == 1 else np.repeat(drafts, sizes))
        return [above(v, int(v.max(initial=0))) for v in (made, joined([s[1] for s in steps]),
                                                          joined([s[2] for s in steps]))]

    def fold(self) -> None:
        """Add the pending counts (the policy's calibration batches); old evidence halves."""
        drafted, kept, accepted = self.pending()
        self._steps = []
        if not drafted:
            return
        m = len(drafted)
        for total, new in ((self.drafted, drafted), (self.verified, kept), (self.accepted, accepted)):
            total[:len(new[:m])] += new[:m]
        full = self.drafted >= HALVE_AT
        if full.any():
            for a in (self.drafted, self.verified, self.accepted):
                a[full] /= 2

    def shares(self, prior_rates: np.ndarray) -> tuple[list[float], list[float]]:
        """(accepted, verified) shares per position; the prior (prior_weight pseudo-drafts): every
        draft verified and accepted at the product of the prior's conditional rates."""
        w = self.prior_weight
        accepted = (self.accepted + w * np.cumprod(prior_rates)) / (self.drafted + w)
        kept = (self.verified + w) / (self.drafted + w)
        return accepted.tolist(), kept.tolist()


BUCKETS = 8  # batch sizes 1, 2-3, 4-7, .., 64-127 and 128 or more


def batch_bucket(n: int) -> int:
    """The yields' bucket of a step of n sequences: 0 for 1, 1 for 2-3, 2 for 4-7, ..."""
    return min(max(n, 1).bit_length() - 1, BUCKETS - 1)


class YieldsByBatch:
    """A DraftYields per batch-size bucket (batch_bucket). What a draft brings depends on the
    batch: the keep rule verifies less as validation's cost grows with it (at batch 1 it
    verified nearly every draft, at batch 8 one in ten), and a stand-down probe's rows count
    what the rule would have verified there. Pooled, a server's steps at 8 sequences, which
    verified little, would tell its steps at one sequence that a draft brings little, and
    its steps at one would tell those at 8 that drafts are verified. A bucket with no counts
    yet expects the prior (DraftYields.shares); batch 1's weighs it ALONE_PRIOR_WEIGHT drafts."""

    def __init__(self, k: int):
        self.k = k
        self.buckets: dict[int, DraftYields] = {}

    def of(self, n: int) -> DraftYields:
        """The yields of steps of n sequences' bucket (new and empty the first time)."""
        bucket = batch_bucket(n)
        if bucket not in self.buckets:
            self.buckets[bucket] = _new_yields(self.k, bucket)
        return self.buckets[bucket]

    def count_steps(self, steps: list[tuple]) -> None:
        """Steps' drafts and outcomes (DraftYields.count), each ((max_keep, drafts made),
        verified, accepted), into the bucket of their batch size, len(verified)."""
        held, size = None, -1
        for step in steps:  # as DraftYields.count would, a bucket looked up only where the batch size changes
            if len(step[1]) != size:
                size = len(step[1])
                held = self.of(size)._steps
            held.append(step)

    def fold(self) -> None:
        for yields in self.buckets.values():
            yields.fold()

    def shares(self, n: int, prior_rates: np.ndarray) -> tuple[list[float], list[float]]:
        """DraftYields.shares of the bucket of steps of n sequences."""
        bucket = batch_bucket(n)
        yields = self.buckets.get(bucket)
        return (yields if yields is not None else _new_yields(self.k, bucket)).shares(prior_rates)


def _new_yields(k: int, bucket: int) -> DraftYields:
    return DraftYields(k, ALONE_PRIOR_WEIGHT if bucket == 0 else PRIOR_WEIGHT)


def above(values, m: int) -> list[int]:
    """[how many of values (a list of ints or an int array) exceed j, for j < m]: in Python for
    a short list (a numpy call costs microseconds between forward passes), else one histogram."""
    if isinstance(values, list) and len(values) <= SMALL:
        return [sum(v > j for v in values) for j in range(m)]
    counts = np.bincount(np.minimum(values, m), minlength=m + 1)
    return (len(values) - np.cumsum(counts)[:-1]).tolist()


def prior_rates(calibrator: Calibrator) -> np.ndarray:
    """The calibrator's conditional acceptance per position, each position it has too few
    trials at taking the rate of the one before: deeper drafts are explored only by probes,
    and 0.5 there made every position past the budget look hopeless."""
    rates, trials = calibrator.position_rates(), calibrator.trials.sum(1)
    for j in range(1, len(rates)):
        if trials[j] < PRIOR_WEIGHT:
            rates[j] = rates[j - 1]
    return rates
