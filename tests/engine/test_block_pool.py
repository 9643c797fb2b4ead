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


def test_blocks_are_handed_out_so_that_memory_grows_with_use():
    """Used blocks holding nothing first, then never-used blocks lowest first, then cached ones."""
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1] and pool.num_used_blocks == 2
    pool.cache(1, b"prefix")
    pool.free([1, 0])
    assert pool.allocate(1) == [0]  # used and uncached: no new memory, nothing evicted
    assert pool.allocate(4) == [2, 3, 4, 5]  # never used, before evicting the cached block
    assert pool.num_evictions == 0 and pool.num_used_blocks == 6
    assert pool.allocate(1) == [1] and pool.num_evictions == 1  # the pool is full: evict
    assert pool.num_free_blocks == 0


def test_reset_cache_makes_cached_blocks_plain_free_blocks():
    pool = BlockPool(3)
    pool.allocate(3)
    pool.cache(2, b"h")
    pool.free([2])
    pool.reset_cache()
    assert pool.lookup(b"h") is None and pool.allocate(1) == [2] and pool.num_evictions == 0


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


def _request(request_id: str, tokens: list[int]):
    from hyperserve.engine.request import Request
    from hyperserve.sampling_params import SamplingParams

    return Request(request_id, tokens, SamplingParams(), 0.0)


def _compute(kv: KVCacheManager, request) -> None:
    """Admit a request with its cached prefix and mark all its tokens computed."""
    cached = kv.cached_prefix(request)[0]
    assert kv.allocate_slots(request.request_id, request.num_tokens, cached)
    request.num_computed_tokens = request.num_tokens
    kv.register_computed(request)


def test_a_shared_prefix_reuses_full_blocks_only():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = _request("a", list(range(10)))  # 2 full blocks + 2 tokens
    _compute(kv, first)
    second = _request("b", list(range(9)) + [99, 98])  # shares 9 tokens: 2 full blocks
    cached = kv.cached_prefix(second)[0]
    assert cached == kv.block_table("a")[:2]
    third = _request("c", [7] + list(range(1, 12)))  # differs in the first token: nothing
    assert kv.cached_prefix(third)[0] == []


def test_at_least_one_token_is_left_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _compute(kv, _request("a", list(range(8))))
    again = _request("b", list(range(8)))  # identical 2-block prompt
    assert len(kv.cached_prefix(again)[0]) == 1


def test_freed_blocks_stay_cached_until_the_pool_needs_them_lru_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    _compute(kv, _request("old", [1] * 8))
    kv.free("old")
    _compute(kv, _request("new", [2] * 8))
    kv.free("new")
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 4
    _compute(kv, _request("x", [3] * 5))  # needs 2 blocks: the least recently freed go
    assert kv.pool.num_evictions == 2
    assert kv.cached_prefix(_request("q", [1] * 9))[0] == []  # "old" was evicted
    assert len(kv.cached_prefix(_request("q2", [2] * 9))[0]) == 2  # "new" survived


def test_blocks_in_use_are_never_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    _compute(kv, _request("running", [5] * 8))  # 2 blocks held
    _compute(kv, _request("other", [6] * 8))
    kv.free("other")
    assert not kv.allocate_slots("big", 12)  # 3 blocks: only 2 can be freed up
    assert kv.allocate_slots("fits", 8)
    assert len(kv.cached_prefix(_request("probe", [5] * 9))[0]) == 2  # still cached and held


def test_taking_an_idle_cached_block_counts_against_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    _compute(kv, _request("a", [1] * 8))
    kv.free("a")  # 3 free, 2 of them cached
    request = _request("b", [1] * 8 + [2] * 5)
    cached = kv.cached_prefix(request)[0]
    assert len(cached) == 2
    assert not kv.allocate_slots("b", 13, cached)  # needs 2 new + the 2 cached: 4 > 3
    assert kv.num_free_blocks == 3  # nothing was taken
