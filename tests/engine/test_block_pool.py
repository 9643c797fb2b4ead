from __future__ import annotations

import pytest

from hyperserve.engine.block_pool import BlockPool
from hyperserve.engine.kv_cache_manager import KVCacheManager


def test_blocks_are_reused_after_free():
    pool = BlockPool(4)
    first = pool.allocate(3)
    assert pool.num_free_blocks == 1 and pool.usage == 0.75
    pool.free(first)
    assert pool.num_free_blocks == 4
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]


def test_double_free_is_an_error():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(blocks)


def test_over_allocation_is_an_error():
    with pytest.raises(RuntimeError):
        BlockPool(2).allocate(3)


def test_block_tables_grow_lazily_one_block_per_block_size_tokens():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 5)  # 2 blocks
    assert len(kv.block_table("a")) == 2
    assert kv.allocate_slots("a", 8)  # still 2
    assert len(kv.block_table("a")) == 2
    assert kv.allocate_slots("a", 9)
    assert len(kv.block_table("a")) == 3
    assert not kv.allocate_slots("b", 8)  # needs 2, 1 free: refused, nothing taken
    assert kv.num_free_blocks == 1
    kv.free("a")
    assert kv.num_free_blocks == 4
