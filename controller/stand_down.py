"""Standing down, step after step, without deciding it again: begin_step's fast path.

Past the context where no draft budget beats a plain step (StepTerms.stand_down_at), an
adaptive step is a plain one (PlainStep). Found once, that answer holds for the next steps of
the same time model, batch size and k until a calibration batch moves the rates
(SpecPolicy._set_rates drops it), the batch's summed context falls below that point (a
sequence swapped for a shorter one), or its bucket's next probe is due: begin_step then checks
the held terms and counts the step, and nothing else. Deciding it again had cost a plain step
of 4-16 sequences 12-20 us in a served run (policy, probe schedule, terms and time model each
cold in the caches after the forward), 0.7-1.2% of the step; the fast path reads this one
object and the batch's context. It answers exactly what the full path would: the same float
comparison, the same probe count."""
from __future__ import annotations


class StandDown:
    """The terms of the last stand-down: a plan's time model `version` (`model`) at n sequences
    and k drafts stands down while b2 * (summed context) >= `start` and its bucket's step count
    (`counts[bucket]`, the ProbeSchedule's own list) stays below `probe_at`."""

    __slots__ = ("version", "n", "k", "b2", "start", "counts", "bucket", "probe_at", "model")

    def __init__(self, version: int, model, n: int, k: int, start: float, probes, bucket: int):
        self.version, self.model, self.n, self.k = version, model, n, k
        self.b2, self.start = model.b2, start
        self.counts, self.bucket = probes.steps, bucket
        self.probe_at = probes.last[bucket] + probes.every[bucket]  # ProbeSchedule.due's first True
