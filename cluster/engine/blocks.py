"""KV-cache blocks: which blocks each sequence's positions live in, with reference counts
so that forked samples share their prompt's full blocks."""
from __future__ import annotations

from collections import deque

from cluster.engine.request import Sequence


class BlockAllocator:
    """Cache blocks with reference counts: forked samples share their prompt's full blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_blocks = deque(range(num_blocks))
        self.refs = [0] * num_blocks

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def grow(self, seq: Sequence, positions: int) -> bool:
        """Make `seq.block_table` cover `positions` positions; False if blocks ran out."""
        need = self.blocks_for(positions) - len(seq.block_table)
        if need > len(self.free_blocks):
            return False
        for _ in range(max(0, need)):
            block = self.free_blocks.popleft()
            self.refs[block] = 1
            seq.block_table.append(block)
        return True

    def share(self, seq: Sequence, blocks: list[int]) -> None:
        """`seq` starts with `blocks`, which another sequence holds too (read-only)."""
        for block in blocks:
            self.refs[block] += 1
        seq.block_table = list(blocks)

    def release(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []
