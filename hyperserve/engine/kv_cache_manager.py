"""KVCacheManager: each request's block table, grown lazily from the BlockPool."""

from __future__ import annotations

from hyperserve.engine.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make room for the first `num_tokens` tokens of a request; False if the pool is short."""
        table = self._block_tables.setdefault(request_id, [])
        num_new = self.num_blocks_for(num_tokens) - len(table)
        if num_new > self.pool.num_free_blocks:
            return False
        if num_new > 0:
            table.extend(self.pool.allocate(num_new))
        return True

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables[request_id]

    def free(self, request_id: str) -> None:
        table = self._block_tables.pop(request_id, None)
        if table:
            self.pool.free(table)
