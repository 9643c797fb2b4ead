"""BlockPool: the free list of KV cache blocks and their reference counts.

Plain Python over integer block ids, so the scheduler and its tests never touch tensors. A block
is free exactly when its reference count is zero; reference counts above one let later features
(prefix caching, n > 1) share a block between sequences.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} KV blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody references go back to the free list."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
