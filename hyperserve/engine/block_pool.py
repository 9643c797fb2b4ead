"""BlockPool: KV cache blocks, their reference counts, and the prefix cache over them.

Plain Python over integer block ids, so the scheduler and its tests never touch tensors.

A block is free when its reference count is zero. A full block may carry a hash of its tokens and
everything before them; a freed block keeps its hash, so a later request with the same prefix can
take it back instead of recomputing it. Handing a hashed block out for new data is its eviction
from the cache. Only full blocks are hashed, and full blocks are never written again, so a shared
block is never written while shared.

Free blocks are handed out in this order, so that the pool's memory grows with what it holds:
1. blocks used before that hold nothing worth keeping;
2. blocks never used, lowest id first: the KV tensors are allocated untouched (see
   `KVCache.allocate`), so the process's memory grows only as these are first written;
3. cached blocks, least recently freed first: evicting from the prefix cache comes last.
A pool given `min_idle_cached` (the CPU's default pool, whose pages are touched on demand) swaps
the last two once the prefix cache holds as many idle blocks as it may: otherwise every prompt's
blocks stay cached and the process grows to the pool's cap (4 GB) over a day of unrelated prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


class BlockPool:
    def __init__(self, num_blocks: int, min_idle_cached: int | None = None) -> None:
        """min_idle_cached: None keeps idle cached blocks until no never-used block is left. A
        number: a never-used block is taken only while fewer than max(min_idle_cached, the most
        blocks in use at once so far) idle blocks are cached, so the cache holds about as much as the
        running requests did at their peak, and at least min_idle_cached blocks."""
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_uncached: OrderedDict[int, None] = OrderedDict()
        self._num_fresh = num_blocks  # blocks num_blocks - _num_fresh ... num_blocks - 1 were never used
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._ref_counts = [0] * num_blocks
        self.min_idle_cached = min_idle_cached
        self.peak_in_use = 0  # the most blocks referenced at once
        self._hash_of: dict[int, Hashable] = {}  # block id -> its prefix hash
        self._block_of: dict[Hashable, int] = {}  # prefix hash -> block id
        self.num_evictions = 0
        # Called with (block id, hash) just before a cached block is reused for new data.
        self.on_evict: Callable[[int, Hashable], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + self._num_fresh + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks ever handed out: the part of the pool whose memory has been touched."""
        return self.num_blocks - self._num_fresh

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests, 0.0 to 1.0 (cached free ones excluded)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} KV blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block_id, _ = self._free_uncached.popitem(last=False)
            elif self._num_fresh and self._grows_for_cache():
                block_id = self.num_blocks - self._num_fresh
                self._num_fresh -= 1
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                self._evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        self._record_peak()
        return block_ids

    def _record_peak(self) -> None:
        self.peak_in_use = max(self.peak_in_use, self.num_blocks - self.num_free_blocks)

    def _grows_for_cache(self) -> bool:
        """Whether a never-used block goes before evicting an idle cached one."""
        return (not self._free_cached or self.min_idle_cached is None
                or len(self._free_cached) < max(self.min_idle_cached, self.peak_in_use))

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block, in order; unreferenced cached ones join the LRU tail.

        Callers pass a sequence's blocks last-first, so its prefix blocks, the likeliest to be
        shared again, are evicted last."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                queue = self._free_cached if block_id in self._hash_of else self._free_uncached
                queue[block_id] = None

    def is_idle(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

    def lookup(self, block_hash: Hashable) -> int | None:
        return self._block_of.get(block_hash)

    def touch(self, block_id: int) -> None:
        """Take one more reference to a cached block (taking it off the free queue if idle)."""
        if self._ref_counts[block_id] == 0:
            self._free_cached.pop(block_id, None)
            self._free_uncached.pop(block_id, None)
        self._ref_counts[block_id] += 1
        self._record_peak()

    def cache(self, block_id: int, block_hash: Hashable) -> None:
        """Record that a full block holds the KV of this prefix (first writer wins)."""
        if block_hash not in self._block_of and block_id not in self._hash_of:
            self._block_of[block_hash] = block_id
            self._hash_of[block_id] = block_hash
            if block_id in self._free_uncached:  # an idle block: now a cached one
                del self._free_uncached[block_id]
                self._free_cached[block_id] = None

    def reset_cache(self) -> None:
        self._hash_of.clear()
        self._block_of.clear()
        self._free_uncached.update(self._free_cached)
        self._free_cached.clear()

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash)
            del self._block_of[block_hash]
            self.num_evictions += 1
