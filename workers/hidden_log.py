"""The target's hidden states on one rank, kept for the MTP module.

The MTP module pairs the target's hidden state at position p-1 with the token at p, so it
needs every position's hidden state since a sequence last drafted. Each forward's output
(T, H) goes into the log once (`add`: its first row's number); a sequence holds only the
numbers of its rows (SeqState.hidden_rows), and the proposer reads them back with `gather`
when it catches up. A step costs one list append per sequence, where copying each
sequence's rows out of the step's tensor had cost a slice per sequence per step and a join
of them every 16 steps: 16 of the 96 us a batch-8 step standing down paid over an engine
without speculation.

Every JOIN_AT forwards the outputs added since the last join are copied into one tensor
(a gather over a stand-down of hundreds of steps reads a few tensors, not hundreds), and
tensors holding no row at or above `oldest` (no live sequence reads them) are dropped. The
log holds the rows of every step since the oldest row a live sequence still holds: a
sequence that has not drafted for long keeps the other sequences' rows of that stretch alive
with its own.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right

import torch

JOIN_AT = 16  # forwards whose outputs are joined into one tensor


class HiddenLog:
    def __init__(self):
        self.starts: list[int] = []  # row number of each part's first row
        self.parts: list[torch.Tensor] = []  # joined tensors, then the outputs added since the last join
        self.joined = 0  # parts[:joined] are joined tensors
        self.end = 0  # rows ever added

    def add(self, h: torch.Tensor) -> int:
        """Log a forward's output (T, H); returns the number of its first row."""
        start = self.end
        self.starts.append(start)
        self.parts.append(h)
        self.end += len(h)
        return start

    def due(self) -> bool:
        """Have JOIN_AT outputs gathered since the last join?"""
        return len(self.parts) - self.joined >= JOIN_AT

    def join(self, oldest: int) -> None:
        """Drop the parts that hold no row at or above `oldest` (the oldest row any sequence
        still holds), then copy the outputs added since the last join into one tensor."""
        drop = len(self.parts) if oldest >= self.end else max(bisect_right(self.starts, oldest) - 1, 0)
        del self.parts[:drop], self.starts[:drop]
        self.joined = max(self.joined - drop, 0)
        if len(self.parts) - self.joined > 1:
            self.parts[self.joined:] = [torch.cat(self.parts[self.joined:])]
            del self.starts[self.joined + 1:]
        self.joined = len(self.parts)

    def gather(self, rows: list[int]) -> torch.Tensor:
        """The rows numbered `rows` (increasing, all still held), in order, as one (len, H) tensor."""
        out, i = [], 0
        part = bisect_right(self.starts, rows[0]) - 1
        while i < len(rows):
            while rows[i] >= self.starts[part] + len(self.parts[part]):
                part += 1
            start, h = self.starts[part], self.parts[part]
            j = bisect_left(rows, start + len(h), i)  # rows[i:j] lie in this part
            first, last = rows[i] - start, rows[j - 1] - start
            if last - first == j - i - 1:  # consecutive rows: a view
                out.append(h[first:last + 1])
            else:
                out.append(h[torch.tensor(rows[i:j]) - start])
            i = j
        return out[0] if len(out) == 1 else torch.cat(out)

    def __len__(self) -> int:
        """Rows held."""
        return sum(len(h) for h in self.parts)
