"""The target's hidden states on one rank, kept for the MTP module.

The MTP module pairs the target's hidden state at position p-1 with the token at p, so it
needs every position's hidden state since a sequence last drafted. Each target forward goes
into the log once, as one entry: its output (T, H) and where each sequence's rows lie in it
(`add`). A sequence holds only the number of the first entry it has not read
(SeqState.hidden_step), and the proposer collects its rows from the entries since then
(`rows`) when it catches up. A step costs the log one append whatever the batch, where
keeping each sequence's rows itself had cost 16 of the 96 us a batch-8 step standing down
paid over an engine without speculation (a slice per sequence per step and their joins).

A decode step's output goes into a large block of rows, reused once no entry reads it
(`Block`); a prefill's is kept as it is. Keeping each forward's own output tensor alive
had slowed the next forwards, their working memory allocated among the kept tensors:
keeping 1,000-3,000 of them made plain decoding's forwards 1.0-1.8% slower. The target's
final norm also writes the output into the block's rows itself (`reserve`, CausalLM.forward's
`out`), with stores that bypass the caches (models/csrc/elementwise.cpp): copying it there
after the forward had cost 20-25 us of a batch-8 step, the rows long gone from the core's
caches by then (the head's weights stream through them), and the norm writing its only
output there, cached, about 38 us of a batch-16 step (each line of the block read in first).

Entries older than the oldest one a live sequence still reads are dropped (`trim`, every
TRIM_EVERY entries). The log holds every entry since then: a sequence that has not drafted
for long keeps the other sequences' rows of that stretch alive with its own.
"""
from __future__ import annotations

import torch

TRIM_EVERY = 16  # entries added between two trims
BLOCK_ROWS = 4096  # rows per block; a forward of more than an eighth of that (a prefill) is kept as it is
SPARE_BLOCKS = 2  # emptied blocks kept for reuse


class Block:
    """Rows that entries' outputs were copied into: `used` of them, read by `readers` entries."""

    __slots__ = ("rows", "size", "used", "readers")

    def __init__(self, like: torch.Tensor, rows: int):
        self.rows = torch.empty((rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
        self.size = rows  # len(self.rows), asked at every step: a tensor's len() is a Python call of torch's
        self.used = self.readers = 0

    def fits(self, hidden: torch.Tensor) -> bool:
        rows = self.rows
        return (self.used + hidden.shape[0] <= self.size and rows.shape[1:] == hidden.shape[1:]
                and rows.dtype == hidden.dtype and rows.device == hidden.device)


class HiddenLog:
    def __init__(self, block_rows: int = BLOCK_ROWS):
        # per entry: [the tensor its output (T, H) lies in, its first row there, T, its sequences (the caller's
        # list, each with a seq_id), first row of each, rows of each (both None: row i is sequence i's one row),
        # {id: place} made on first read, the Block its output was copied into (None: the forward's own tensor,
        # from row 0)]
        self.entries: list[list] = []
        self.first = 0  # the number of entries[0]
        self._added = 0  # entries added since the last trim
        self.block_rows = block_rows
        self._block: Block | None = None  # the block outputs are copied into now
        self._spare: list[Block] = []
        self._oldest: tuple | None = None  # (sequence, its entry) that held the oldest entry at the last trim

    @property
    def end(self) -> int:
        """The number the next entry gets."""
        return self.first + len(self.entries)

    def reserve(self, n: int) -> tuple[torch.Tensor, int] | None:
        """Where the next forward should also write its n output rows (CausalLM.forward's `out`) for
        `add(..., written=True)` to keep them without a copy: (block rows, first row). None where
        `add` keeps the output as it is (n > block_rows // 8), or before the first output (it gives
        the rows' width and dtype)."""
        block = self._block
        if block is None or n > self.block_rows // 8:
            return None
        if block.used + n > block.size:
            block = self._block = self._new_block(block.rows)
        return block.rows, block.used

    def take(self, seqs: list, live=None) -> tuple[torch.Tensor, int] | None:
        """reserve and add in one call, for a forward of one row per sequence (a step that drafts
        nothing): the rows the forward must write its output to, already kept as the next entry
        (sequence seqs[i]'s next position is row i), or None where reserve would say None (then
        nothing is kept: the caller adds the output). Cold, after a forward, the two calls had
        taken 3.1-3.2 us at 32 sequences (median), this one 2.6-2.7."""
        block, n = self._block, len(seqs)
        if block is None or n > self.block_rows // 8:
            return None
        at = block.used
        if at + n > block.size:
            block = self._block = self._new_block(block.rows)
            at = 0
        block.used, block.readers = at + n, block.readers + 1
        self.entries.append([block.rows, at, n, seqs, None, None, None, block])
        self._added += 1
        if live is not None and self._added >= TRIM_EVERY:
            self.trim(live)
        return block.rows, at

    def add(self, seqs: list, hidden: torch.Tensor, firsts: list[int] | None, counts: list[int] | None,
            live=None, written: bool = False) -> None:
        """A forward's output: sequence seqs[i]'s (its `seq_id`'s) next positions are rows firsts[i] ..
        firsts[i] + counts[i] - 1 (firsts, counts None: its next position is row i, as in a step that
        drafted nothing). The list is held as it is, not copied: the runner's own list of the step's
        sequences (a list of their ids made for it had cost a step about 1 us at 32 sequences).
        written: the forward also wrote it where `reserve` said, which is kept; else a small output
        is copied into a block, a large one kept as it is. live: the rank's sequences by id (or any
        collection of them), to `trim` by every TRIM_EVERY entries (None: the caller trims). The
        signature is Proposer.keep's: MTPProposer's keep is this method."""
        block = self._block
        if written:  # no torch call at all: the entry says where in the block its rows start (a slice costs 1-2 us)
            at, n = block.used, len(seqs) if firsts is None else hidden.shape[0]
            block.used, block.readers = at + n, block.readers + 1
            self.entries.append([block.rows, at, n, seqs, firsts, counts, None, block])
        else:
            block = None
            n = hidden.shape[0]
            if n <= self.block_rows // 8:
                block = self._block
                if block is None or not block.fits(hidden):
                    block = self._block = self._new_block(hidden)
                at = block.used
                block.rows[at:at + n].copy_(hidden)
                block.used, block.readers = at + n, block.readers + 1
                self.entries.append([block.rows, at, n, seqs, firsts, counts, None, block])
            else:
                self.entries.append([hidden, 0, n, seqs, firsts, counts, None, None])
        self._added += 1
        if live is not None and self._added >= TRIM_EVERY:
            self.trim(live)

    def output(self, number: int) -> torch.Tensor:
        """Entry `number`'s rows, all of them (negative: counted from the end)."""
        data, at, n = self.entries[number - self.first if number >= 0 else number][:3]
        return data[at:at + n]

    def _new_block(self, like: torch.Tensor) -> Block:
        while self._spare:
            block = self._spare.pop()
            block.used = 0
            if block.fits(like):
                return block
        return Block(like, self.block_rows)

    def rows(self, seq_id: int, since: int) -> list[torch.Tensor]:
        """seq_id's rows in the entries numbered since .. end - 1, in order (views: read them
        before the log is trimmed again)."""
        parts = []
        for entry in self.entries[since - self.first:]:
            where = entry[6]
            if where is None:
                where = entry[6] = {s.seq_id: i for i, s in enumerate(entry[3])}
            i = where.get(seq_id)
            if i is not None:
                data, at, firsts = entry[0], entry[1], entry[4]
                if firsts is None:
                    parts.append(data[at + i:at + i + 1])
                else:
                    at += firsts[i]
                    parts.append(data[at:at + entry[5][i]])
        return parts

    def trim(self, live) -> None:
        """Every TRIM_EVERY entries: drop those below the oldest any of `live` (every sequence on this
        rank: a dict of them by id, or any collection of them) still reads; a block none of the rest
        reads is kept for reuse. Where the sequence that held the oldest entry at the last scan is still
        live and reads from there, nothing can go and no sequence is looked at (a sequence's entry only
        moves on, and a new one starts at the end): standing down, the scan over every sequence had
        cost about 30 us cold at 32 sequences, every TRIM_EVERY steps."""
        if self._added < TRIM_EVERY:
            return
        self._added = 0
        held = self._oldest
        if held is not None and held[0].hidden_step == held[1] and _holds(live, held[0]):
            return
        owner = min(live.values() if isinstance(live, dict) else live, key=_hidden_step, default=None)
        oldest = owner.hidden_step if owner is not None else self.end
        self._oldest = (owner, oldest) if owner is not None else None
        if oldest > self.first:
            for entry in self.entries[:oldest - self.first]:
                block = entry[7]
                if block is not None:
                    block.readers -= 1
                    if not block.readers and block is not self._block and len(self._spare) < SPARE_BLOCKS:
                        self._spare.append(block)
            del self.entries[:oldest - self.first]
            self.first = oldest


def _hidden_step(seq) -> int:
    return seq.hidden_step


def _holds(live, seq) -> bool:
    """Is seq among `live` (a dict of sequences by id, or any collection of them)?"""
    return live.get(seq.seq_id) is seq if isinstance(live, dict) else any(s is seq for s in live)
