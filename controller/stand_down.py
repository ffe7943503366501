"""Standing down: the plain step an adaptive step is past the point where no draft budget beats
one (StepTerms.stand_down_at; `PlainStep`), and begin_step's fast path while it stands down
step after step without deciding it again (`StandDown`).

Found once, that answer holds for the next steps of the same time model, batch size and k (or
fewer: the budget's terms for fewer drafts are the first of k's) until a calibration batch moves the rates (SpecPolicy._set_rates drops it), the batch's summed
context falls below that point (a sequence swapped for a shorter one), or its bucket's next
probe is due: begin_step then checks the held terms and counts the step, and nothing else.
Deciding it again had cost a plain step of 4-16 sequences 12-20 us in a served run (policy,
probe schedule, terms and time model each cold in the caches after the forward), 0.7-1.2% of
the step; the fast path reads this one object and the batch's context (in place it still
costs more than the 7 us it takes with the caches flushed: DESIGN.md section 8). It answers
exactly what the full path would: the same float comparison, the same probe count.

The policy holds one for each batch size it stood down at (SpecPolicy._downs). Served, a
batch's size moves every few steps as requests arrive and finish: holding only the last one,
13% of a standing-down engine's steps at 100% of saturation went the full way (about 25 us
each against the fast path's 2.5). A held one whose bucket probed since (at another batch size)
names a probe step that has passed: its next step goes the full way and holds anew."""
from __future__ import annotations

import numpy as np

from controller.step import SpecStep
from controller.time_model import TimeModel


class StandDown:
    """The terms of a stand-down: a plan's time model `version` (`model`) at the batch size it
    is held for (SpecPolicy._downs) and k drafts stands down while b2 * (summed context) >=
    `start` and its bucket's step count (`counts[bucket]`, the ProbeSchedule's own list) stays
    below `probe_at`."""

    __slots__ = ("version", "k", "b2", "start", "counts", "bucket", "probe_at", "model", "step")

    def __init__(self, version: int, model, k: int, start: float, probes, bucket: int, may_probe: bool = True,
                 price: float = 1.0):
        """may_probe: False where no probe is ever due at these terms (drafting could not pay
        were every draft accepted: ProbeSchedule.due's `allowed`); price: what a probe would cost now
        (ProbeSchedule.due's `price`)."""
        self.version, self.model, self.k = version, model, k
        self.b2, self.start = model.b2, start
        self.counts, self.bucket = probes.steps, bucket
        # ProbeSchedule.due's first True
        self.probe_at = probes.next_at(bucket, price) if may_probe else float("inf")
        self.step: PlainStep | None = None  # the PlainStep each of its steps is handed (SpecPolicy.held_plain)


class PlainStep:
    """An adaptive step past the context where no draft budget beats a plain step
    (StepTerms.stand_down_at, controller/terms.py), or a static step with nothing to draft (k = 0:
    plain decoding): a plain decode step, as a SpecStep with budget 0 would be, without building
    one between two forwards. The runner and SpecPolicy.end_plain_step read
    only what it holds; asked for anything else (a test deciding on drafts anyway), it builds
    that SpecStep and answers from it."""

    __slots__ = ("policy", "model", "kv", "max_keep_list", "k", "mode", "_full")
    probe, cold_start, budget, best_m, wants = False, False, 0, 0, 0

    def __init__(self, policy, model: TimeModel, kv, max_keep, k: int, mode: str = "adaptive"):
        self.policy, self.model, self.kv, self.max_keep_list, self.k = policy, model, kv, max_keep, k
        self.mode, self._full = mode, None

    @property
    def max_keep(self) -> np.ndarray:
        return np.asarray(self.max_keep_list, dtype=np.int64)

    def __getattr__(self, name: str):
        if self._full is None:
            self._full = SpecStep(self.policy, self.mode, False, self.kv, self.max_keep_list, self.model, None,
                                  self.k)
        return getattr(self._full, name)
