"""A measured decode step (`StepSample`), and samples kept as columns of numbers
(`SampleColumns`), as the profile registry (controller/registry.py) holds and refits them."""
from __future__ import annotations

from itertools import chain
from typing import NamedTuple

import numpy as np

# A plain step's validation costs more right after steps that drafted (the draft's forwards have displaced the
# target's weights and buffers from the caches): one adaptive-7 engine at batch 1, drafting and plain stretches
# alternated, validated a plain step in 0.340 / 0.327 / 0.321 ms at the 1st / 2nd / 3rd plain step after drafting,
# 0.315-0.317 from the 4th on (the same as 16-64 steps on). Priced from plain probes (single plain steps among
# drafting ones), a plain step had looked 6.5% dearer than a settled one, and batch 1 drafted where plain decoding
# was faster.
SETTLE_STEPS = 3


class StepSample(NamedTuple):
    """One measured decode step (rank 0's clock), or one sweep point: a validate point has
    draft_steps == 0, a draft point has q_tokens == 0. A named tuple: the engine makes one
    every step, and a frozen dataclass's construction cost a batch-8 step about 4.6 us."""

    num_seqs: int
    q_tokens: int  # sum of q_i
    kv_tokens: int  # sum of q_i * kv_i
    validate_ms: float
    draft_steps: int
    draft_ms: float
    other_ms: float = 0.0  # the rest of the step (scheduling, sampling, bookkeeping); 0: not measured
    emitted: int = 0  # tokens the step emitted (sequences plus accepted drafts)
    catchup_tokens: int = 0  # tokens the draft caught up on before its first step (0: unknown)
    draft_seqs: int = 0  # sequences that drafted (0: all num_seqs; a probe standing down drafts for a few)
    one_off: int = 0  # 1: the draft ran right after a one-off (a calibration batch): not its steady cost
    # 1: a plain step among the first SETTLE_STEPS after a step that drafted: it validated at about what the drafting
    # steps around it cost, not at plain decoding's cost (the registry leaves it out of the validate fit)
    settling: int = 0

    @property
    def drafting(self) -> int:
        """Sequences the draft time is for."""
        return self.draft_seqs or self.num_seqs

    def features(self) -> list[float]:
        return [1.0, float(self.q_tokens), float(self.kv_tokens)]


FIELDS = StepSample._fields
(NUM_SEQS, Q_TOKENS, KV_TOKENS, VALIDATE_MS, DRAFT_STEPS, DRAFT_MS, OTHER_MS, EMITTED, CATCHUP_TOKENS,
 DRAFT_SEQS, ONE_OFF, SETTLING) = range(len(FIELDS))


class SampleColumns:
    """StepSamples as rows of float64 (integers exact), in the order added; with `size`, only
    the last `size` of them (a ring)."""

    def __init__(self, samples=(), size: int | None = None):
        samples = list(samples)
        self.size = size if size is not None else max(len(samples), 1)
        self._rows = np.zeros((self.size, len(FIELDS)))
        self.count = 0  # rows ever added
        for sample in samples:
            self.append(sample)

    def append(self, sample: StepSample) -> None:
        self.extend([sample])

    def extend(self, samples: list[StepSample]) -> np.ndarray:
        """The samples in order, in one numpy call (a row at a time cost 2-3 us a sample); returns
        their rows (the last `size` of them)."""
        if not samples:
            return self._rows[:0]
        kept = samples[-self.size:]  # a row per sample, its fields in order (fromiter: a third of np.array's time)
        block = np.fromiter(chain.from_iterable(kept), np.float64, len(kept) * len(FIELDS)).reshape(len(kept), -1)
        at = (self.count + len(samples) - len(block)) % self.size
        first = min(len(block), self.size - at)
        self._rows[at:at + first] = block[:first]
        self._rows[:len(block) - first] = block[first:]
        self.count += len(samples)
        return block

    def __len__(self) -> int:
        return min(self.count, self.size)

    def rows(self) -> np.ndarray:
        """(len, fields), oldest first."""
        if self.count <= self.size:
            return self._rows[:self.count]
        start = self.count % self.size
        return np.concatenate([self._rows[start:], self._rows[:start]])

    def samples(self) -> list[StepSample]:
        return [StepSample(*(_field(f, v) for f, v in zip(FIELDS, r))) for r in self.rows()]


def _field(name: str, value: float):
    return float(value) if name.endswith("_ms") else int(value)
