"""KVCacheManager: each request's block table, grown lazily from the BlockPool, and prefix reuse.

With prefix caching on, a request's full blocks are identified by a hash chain: block i's hash
is a SHA-256 over block i-1's hash and its own tokens, so it covers every token before it, and no
request can craft tokens whose blocks collide with another's (Python's `hash` is 64 bits and not
built to resist that). A new (or resumed) request
takes every cached block of its longest cached prefix and computes only the rest; blocks it fills
are registered once their KV is written.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Protocol

from hyperserve.engine.block_pool import BlockPool
from hyperserve.engine.request import Request


class PrefixTier(Protocol):
    """A lower tier of the prefix cache (the disk): holds blocks by hash, fills pool blocks."""

    def __contains__(self, block_hash: bytes) -> bool: ...

    def load_into(self, block_hash: bytes, block_id: int) -> bool:
        """Fill the pool block with the stored KV; False (a miss) if it cannot be read."""


@dataclass(slots=True)
class Pin:
    """A prefix held in the cache: one reference on each of its full blocks until `expires_at`."""

    block_ids: list[int]
    num_tokens: int
    expires_at: float


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 lower_tier: PrefixTier | None = None, max_pinned_fraction: float = 0.5) -> None:
        self.block_size = block_size
        self.max_pinned_blocks = int(num_blocks * max_pinned_fraction)  # pins never starve running requests
        self.lower_tier = lower_tier
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full blocks
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks registered
        self.pins: dict[str, Pin] = {}
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of which found (in either tier)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(pin.block_ids) for pin in self.pins.values())

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """Blocks of the longest cached prefix of the request's tokens, leaving at least one
        token to compute (its logits are needed), and how many of them the lower tier supplied."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        num_promoted = 0
        for block_hash in self._hashes(request)[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                block_id = self._promote(block_hash, protect=blocks)
                num_promoted += block_id is not None
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks, num_promoted

    def _promote(self, block_hash: bytes, protect: list[int]) -> int | None:
        """Bring a block back from the lower tier into the pool as an idle cached block, holding
        `protect` (the prefix found so far) so that making room cannot evict it."""
        if self.lower_tier is None or block_hash not in self.lower_tier:
            return None
        if self.pool.num_free_blocks - sum(1 for b in protect if self.pool.is_idle(b)) < 1:
            return None
        for block_id in protect:
            self.pool.touch(block_id)
        (block_id,) = self.pool.allocate(1)
        loaded = self.lower_tier.load_into(block_hash, block_id)
        if loaded:
            self.pool.cache(block_id, block_hash)
        self.pool.free([block_id] + protect[::-1])
        return block_id if loaded else None

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def allocate_slots(self, request_id: str, num_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Make room for the first `num_tokens` tokens of a request, starting from `cached_blocks`
        (from `cached_prefix`) if it has no blocks yet; False, changing nothing, if the pool is short."""
        table = self._block_tables.setdefault(request_id, [])
        cached_blocks = cached_blocks or []
        num_new = self.num_blocks_for(num_tokens) - len(table) - len(cached_blocks)
        idle_cached = sum(1 for b in cached_blocks if self.pool.is_idle(b))  # in the free queue now
        if num_new > self.pool.num_free_blocks - idle_cached:
            if not table:
                del self._block_tables[request_id]
            return False
        if cached_blocks:  # only a request with no blocks yet takes a cached prefix
            for block_id in cached_blocks:
                self.pool.touch(block_id)
            table.extend(cached_blocks)
            self._num_registered[request_id] = len(cached_blocks)  # already in the cache
        if num_new > 0:
            table.extend(self.pool.allocate(num_new))
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Return the blocks past the first `num_tokens` tokens (rejected draft tokens' KV)."""
        table = self._block_tables[request_id]
        keep = max(self.num_blocks_for(num_tokens), self._num_registered.get(request_id, 0))
        if len(table) > keep:
            self.pool.free(table[keep:][::-1])
            del table[keep:]

    def register_computed(self, request: Request) -> None:
        """Offer the request's blocks that are full and computed to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        table, hashes = self._block_tables[request_id], self._hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes), len(table))
        for i in range(self._num_registered.get(request_id, 0), num_full):
            self.pool.cache(table[i], hashes[i])
        self._num_registered[request_id] = max(num_full, self._num_registered.get(request_id, 0))

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables[request_id]

    def pin(self, request: Request, expires_at: float) -> Pin | None:
        """Keep the request's registered full blocks cached (not evictable) until `expires_at`;
        None, pinning nothing, if that would take pins past `max_pinned_blocks`."""
        num_blocks = self._num_registered.get(request.request_id, 0)
        if num_blocks > self.max_pinned_blocks - self.num_pinned_blocks:
            return None
        block_ids = self._block_tables.get(request.request_id, [])[:num_blocks]
        for block_id in block_ids:
            self.pool.touch(block_id)
        pin = Pin(block_ids, num_blocks * self.block_size, expires_at)
        self.pins[request.request_id] = pin
        return pin

    def unpin(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is not None:
            self.pool.free(pin.block_ids[::-1])
        return pin is not None

    def expire_pins(self, now: float) -> None:
        for pin_id in [p for p, pin in self.pins.items() if pin.expires_at <= now]:
            self.unpin(pin_id)

    def free(self, request_id: str) -> None:
        table = self._block_tables.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if table:
            self.pool.free(table[::-1])  # tail first: prefix blocks stay cached the longest

    def _hashes(self, request: Request) -> list[bytes]:
        """The hash chain over the request's full blocks, extended as tokens arrive."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        tokens, size = request.all_token_ids, self.block_size
        while (len(hashes) + 1) * size <= len(tokens):
            start = len(hashes) * size
            parent = hashes[-1] if hashes else request.cache_salt
            hashes.append(hashlib.sha256(parent + array("q", tokens[start : start + size]).tobytes()).digest())
        return hashes
