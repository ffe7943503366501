"""The target's hidden states on one rank, kept for the MTP module.

The MTP module pairs the target's hidden state at position p-1 with the token at p, so it
needs every position's hidden state since a sequence last drafted. Each target forward goes
into the log once, as one entry: its output (T, H) and where each sequence's rows lie in it
(`add`). A sequence holds only the number of the first entry it has not read
(SeqState.hidden_step), and the proposer collects its rows from the entries since then
(`rows`) when it catches up. A step costs the log one append whatever the batch, where
keeping each sequence's rows itself had cost 16 of the 96 us a batch-8 step standing down
paid over an engine without speculation (a slice per sequence per step and their joins).

Entries older than the oldest one a live sequence still reads are dropped (`trim`, every
TRIM_EVERY entries). The log holds every entry since then: a sequence that has not drafted
for long keeps the other sequences' rows of that stretch alive with its own.
"""
from __future__ import annotations

import torch

TRIM_EVERY = 16  # entries added between two trims


class HiddenLog:
    def __init__(self):
        # per entry: [output (T, H), sequence ids, first row of each, rows of each, {id: place} made on first read]
        self.entries: list[list] = []
        self.first = 0  # the number of entries[0]
        self._added = 0  # entries added since the last trim

    @property
    def end(self) -> int:
        """The number the next entry gets."""
        return self.first + len(self.entries)

    def add(self, hidden: torch.Tensor, ids: list[int], firsts: list[int], counts: list[int]) -> None:
        """A forward's output: sequence ids[i]'s next positions are rows firsts[i] .. firsts[i] + counts[i] - 1."""
        self.entries.append([hidden, ids, firsts, counts, None])
        self._added += 1

    def rows(self, seq_id: int, since: int) -> list[torch.Tensor]:
        """seq_id's rows in the entries numbered since .. end - 1, in order (views)."""
        parts = []
        for entry in self.entries[since - self.first:]:
            where = entry[4]
            if where is None:
                where = entry[4] = {sid: i for i, sid in enumerate(entry[1])}
            i = where.get(seq_id)
            if i is not None:
                first = entry[2][i]
                parts.append(entry[0][first:first + entry[3][i]])
        return parts

    def trim(self, live) -> None:
        """Every TRIM_EVERY entries: drop those below the oldest any of `live` (SeqState, every
        sequence on this rank) still reads."""
        if self._added < TRIM_EVERY:
            return
        self._added = 0
        oldest = min((s.hidden_step for s in live), default=self.end)
        if oldest > self.first:
            del self.entries[:oldest - self.first]
            self.first = oldest
