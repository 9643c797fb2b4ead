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


def test_a_pool_written_on_demand_caches_about_its_working_set():
    """With min_idle_cached, idle cached blocks are reused before never-used ones once they number
    max(min_idle_cached, the most blocks in use at once): memory stops growing with unrelated prompts."""

    def requests(pool: BlockPool, first: int, count: int, size: int) -> None:  # one at a time, own prefixes
        for request in range(first, first + count):
            blocks = pool.allocate(size)
            for i, block in enumerate(blocks):
                pool.cache(block, (request, i))
            pool.free(blocks[::-1])

    pool = BlockPool(100, min_idle_cached=2)
    requests(pool, 0, 10, 3)
    assert pool.peak_in_use == 3
    assert pool.num_used_blocks == 5 and pool.num_cached_blocks == 5  # not 30: the pool stopped growing
    assert pool.lookup((9, 0)) is not None and pool.lookup((8, 2)) is None  # the latest prompt stays cached
    requests(pool, 10, 1, 8)  # a wider working set: as many idle blocks may stay cached
    requests(pool, 11, 10, 3)
    assert pool.peak_in_use == 8 and pool.num_cached_blocks == 10 and pool.num_used_blocks == 10
    unbounded = BlockPool(100)  # memory allocated up front: cache until full
    requests(unbounded, 0, 10, 3)
    assert unbounded.num_used_blocks == 30 and unbounded.num_evictions == 0


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
    prefix = kv.cached_prefix(request)
    assert kv.allocate_slots(request.request_id, request.num_tokens, prefix)
    request.num_computed_tokens = request.num_tokens
    kv.register_computed(request)


def test_a_shared_prefix_reuses_full_blocks_only():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = _request("a", list(range(10)))  # 2 full blocks + 2 tokens
    _compute(kv, first)
    second = _request("b", list(range(9)) + [99, 98])  # shares 9 tokens: 2 full blocks
    cached = kv.cached_prefix(second).blocks
    assert cached == kv.block_table("a")[:2]
    third = _request("c", [7] + list(range(1, 12)))  # differs in the first token: nothing
    assert kv.cached_prefix(third).blocks == []


def test_at_least_one_token_is_left_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _compute(kv, _request("a", list(range(8))))
    again = _request("b", list(range(8)))  # identical 2-block prompt
    assert len(kv.cached_prefix(again).blocks) == 1


def test_freed_blocks_stay_cached_until_the_pool_needs_them_lru_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    _compute(kv, _request("old", [1] * 8))
    kv.free("old")
    _compute(kv, _request("new", [2] * 8))
    kv.free("new")
    assert kv.num_free_blocks == 4 and kv.pool.num_cached_blocks == 4
    _compute(kv, _request("x", [3] * 5))  # needs 2 blocks: the least recently freed go
    assert kv.pool.num_evictions == 2
    assert kv.cached_prefix(_request("q", [1] * 9)).blocks == []  # "old" was evicted
    assert len(kv.cached_prefix(_request("q2", [2] * 9)).blocks) == 2  # "new" survived


def test_blocks_in_use_are_never_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    _compute(kv, _request("running", [5] * 8))  # 2 blocks held
    _compute(kv, _request("other", [6] * 8))
    kv.free("other")
    assert not kv.allocate_slots("big", 12)  # 3 blocks: only 2 can be freed up
    assert kv.allocate_slots("fits", 8)
    assert len(kv.cached_prefix(_request("probe", [5] * 9)).blocks) == 2  # still cached and held


def test_taking_an_idle_cached_block_counts_against_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    _compute(kv, _request("a", [1] * 8))
    kv.free("a")  # 3 free, 2 of them cached
    request = _request("b", [1] * 8 + [2] * 5)
    prefix = kv.cached_prefix(request)
    assert len(prefix.blocks) == 2
    assert not kv.allocate_slots("b", 13, prefix)  # needs 2 new + the 2 cached: 4 > 3
    assert kv.num_free_blocks == 3  # nothing was taken


def _advance(kv: KVCacheManager, request, num_tokens: int) -> None:
    """Compute the request's tokens up to num_tokens, as the scheduler would step by step."""
    kv.release_behind_window(request.request_id, request.num_computed_tokens)
    assert kv.allocate_slots(request.request_id, num_tokens)
    request.num_computed_tokens = num_tokens
    kv.register_computed(request)


def test_a_windowed_group_releases_blocks_behind_the_window():
    kv = KVCacheManager(num_blocks=8, block_size=4, window=6)
    request = _request("a", list(range(40)))
    for end in range(1, 41):
        _advance(kv, request, end)
        held = [b for b in kv.block_table("a") if b != kv.groups[0].padding_block]
        assert len(held) <= 3  # the 6-token window and the block being written
    table = kv.block_table("a")
    assert len(table) == 10 and table[:7] == [kv.groups[0].padding_block] * 7
    kv.free("a")
    assert kv.num_free_blocks == 8


def test_full_attention_layers_keep_every_block_and_windowed_ones_only_the_window():
    kv = KVCacheManager(num_blocks=16, block_size=4, window=6, num_window_blocks=4)
    request = _request("a", list(range(40)))
    for end in range(8, 41, 8):  # chunks of 8 tokens
        _advance(kv, request, end)
    assert len(kv.block_table("a")) == 10 and kv.pool.num_free_blocks == 6
    pad = kv.groups[1].padding_block
    assert kv.window_block_table("a")[:6] == [pad] * 6  # the last chunk (32..39) saw from token 27 on
    kv.release_behind_window("a", 40)  # the next token sees from 35 on: block 8 and after
    assert kv.groups[1].pool.num_free_blocks == 2
    assert not kv.allocate_slots("b", 13)  # the windowed pool cannot take a 13-token chunk: nothing taken
    assert kv.pool.num_free_blocks == 6 and "b" not in kv.groups[0].tables
    kv.free("a")
    assert kv.pool.num_free_blocks == 16 and kv.groups[1].pool.num_free_blocks == 4


def test_a_windowed_prefix_hit_needs_the_blocks_its_next_token_sees():
    kv = KVCacheManager(num_blocks=16, block_size=4, window=6, num_window_blocks=8)
    first = _request("a", list(range(33)))
    for end in range(4, 34, 4):
        _advance(kv, first, end)
    kv.free("a")
    again = _request("b", list(range(33)))  # 8 full blocks to reuse; the next token (32) sees 27..32
    prefix = kv.cached_prefix(again)
    assert prefix.num_blocks == 8
    pad = kv.groups[1].padding_block
    assert prefix.tables[1][:6] == [pad] * 6 and pad not in prefix.tables[1][6:]
    assert kv.allocate_slots("b", 33, prefix)
    kv.free("b")
    # Evict windowed block 7 (tokens 28..31): a hit must end before it, where blocks 5 and 6 are visible.
    kv.groups[1].pool._evict(prefix.tables[1][7])
    prefix = kv.cached_prefix(_request("c", list(range(33))))
    assert prefix.num_blocks == 7 and prefix.tables[1][5:] == [b for b in prefix.tables[1][5:] if b != pad]
