"""KVCacheManager: each request's block tables, grown lazily from the BlockPool, and prefix reuse.

With prefix caching on, a request's full blocks are identified by a hash chain: block i's hash
is a SHA-256 over block i-1's hash and its own tokens, so it covers every token before it, and no
request can craft tokens whose blocks collide with another's (Python's `hash` is 64 bits and not
built to resist that). A new (or resumed) request
takes every cached block of its longest cached prefix and computes only the rest; blocks it fills
are registered once their KV is written.

Layers that attend through a sliding window never read keys behind it, so their KV need not be
kept: such layers form a group with its own pool and block tables, whose blocks behind the window
go back to the pool as a sequence advances (still cached, for prefix reuse, until evicted); the
dropped entries of the table point at the padding block (one past the pool, never read: the
window masks it). Memory per sequence is then bounded by the window, not the context. A model
whose every layer is windowed (Mistral) has that one group; Gemma 3 has two, its full-attention
layers' and its local layers'. A cached prefix counts for a windowed group only if the blocks its
next token can see are still cached.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hyperserve.engine.block_pool import BlockPool
from hyperserve.engine.request import Request


def extend_hashes(hashes: list[bytes], token_ids: list[int], block_size: int,
                  salt: bytes = b"") -> list[bytes]:
    """Extend `hashes` (the chain of token_ids' first len(hashes) full blocks) over every full block."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else salt
        block = array("q", token_ids[start : start + block_size]).tobytes()
        hashes.append(hashlib.sha256(parent + block).digest())
    return hashes


def tenant_salt(cache_salt: str) -> bytes:
    """The start of the hash chain of a request given `cache_salt` (vLLM's field; the server sets
    one per API key's scope): requests share cached KV only when their salts are equal, so no
    tenant can time another's prompts by what hits the cache."""
    return hashlib.sha256(b"cache_salt:" + cache_salt.encode()).digest() if cache_salt else b""


class PrefixTier(Protocol):
    """A lower tier of the prefix cache (the disk): holds blocks by hash, fills pool blocks."""

    def __contains__(self, block_hash: bytes) -> bool: ...

    def load_into(self, block_hash: bytes, block_id: int) -> bool:
        """Fill the pool block with the stored KV; False (a miss) if it cannot be read."""


@dataclass(slots=True)
class Pin:
    """A prefix held in the cache: one reference on each of its blocks (per group) until `expires_at`."""

    block_ids: list[list[int]]
    num_tokens: int
    expires_at: float


@dataclass(slots=True)
class CachedPrefix:
    """The longest cached prefix of a request: its blocks in each group (a windowed group's table
    starts with padding where the window no longer reaches), and how many the lower tier supplied."""

    tables: list[list[int]]
    num_blocks: int = 0
    num_from_lower_tier: int = 0

    @property
    def blocks(self) -> list[int]:
        return self.tables[0]


@dataclass(slots=True)
class KVGroup:
    """Layers that share block tables and a pool. `window`: how far back their queries see (None:
    the whole context); blocks wholly behind it are released."""

    pool: BlockPool
    window: int | None = None
    tables: dict[str, list[int]] = field(default_factory=dict)
    num_released: dict[str, int] = field(default_factory=dict)  # request id -> leading entries dropped

    @property
    def padding_block(self) -> int:
        return self.pool.num_blocks

    def held(self, table: list[int]) -> list[int]:
        return [b for b in table if b != self.padding_block]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 lower_tier: PrefixTier | None = None, max_pinned_fraction: float = 0.5,
                 window: int | None = None, num_window_blocks: int | None = None,
                 min_idle_cached: Sequence[int | None] = (None, None)) -> None:
        """One group of num_blocks, windowed if `window` is given; with num_window_blocks as well,
        two: the full-attention layers' (num_blocks) and the windowed layers' (num_window_blocks).
        min_idle_cached: each group's, see BlockPool (Gemma 3 270M's windowed group holds 2 GB of
        float32 KV: cached until full, it grew by 280 MB per 32 unrelated prompts)."""
        self.block_size = block_size
        self.max_pinned_blocks = int(num_blocks * max_pinned_fraction)  # pins never starve running requests
        self.lower_tier = lower_tier
        self.enable_prefix_caching = enable_prefix_caching
        if num_window_blocks is None:
            self.groups = [KVGroup(BlockPool(num_blocks, min_idle_cached[0]), window)]
        else:
            self.groups = [KVGroup(BlockPool(num_blocks, min_idle_cached[0])),
                           KVGroup(BlockPool(num_window_blocks, min_idle_cached[1]), window)]
        if lower_tier is not None and window is not None:
            raise ValueError("the lower prefix tier keeps whole blocks of every layer: not with windowed KV")
        self.pool = self.groups[0].pool
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
        return max(group.pool.usage for group in self.groups)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(pin.block_ids[0]) for pin in self.pins.values())

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_visible_block(self, group: KVGroup, position: int) -> int:
        """The first block holding a key that the token at `position` attends to in this group."""
        return 0 if group.window is None else max(0, (position - group.window + 1) // self.block_size)

    def cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest cached prefix of the request's tokens, leaving at least one token to compute
        (its logits are needed); none for a request whose prompt tokens' logits are wanted."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return CachedPrefix([[] for _ in self.groups])
        hashes = self._hashes(request)[: (request.num_tokens - 1) // self.block_size]
        first = self.groups[0]
        blocks: list[int] = []
        num_promoted = 0
        if first.window is None:
            for block_hash in hashes:
                block_id = first.pool.lookup(block_hash)
                if block_id is None:
                    block_id = self._promote(block_hash, protect=blocks)
                    num_promoted += block_id is not None
                if block_id is None:
                    break
                blocks.append(block_id)
        num_blocks = len(blocks) if first.window is None else len(hashes)
        for group in self.groups:
            if group.window is not None:
                num_blocks = self._window_hit(group, hashes, num_blocks)
        tables = []
        for group in self.groups:
            if group.window is None:  # only the first group is unwindowed
                tables.append(blocks[:num_blocks])
            else:
                skip = self.first_visible_block(group, num_blocks * self.block_size)
                found = [group.pool.lookup(h) for h in hashes[skip:num_blocks]]
                tables.append([group.padding_block] * skip + found)
        return CachedPrefix(tables, num_blocks, num_promoted)

    def _window_hit(self, group: KVGroup, hashes: list[bytes], num_blocks: int) -> int:
        """The longest prefix of at most num_blocks blocks whose blocks visible to the next token
        are all cached in this windowed group."""
        while num_blocks > 0:
            visible = range(self.first_visible_block(group, num_blocks * self.block_size), num_blocks)
            missing = [i for i in visible if group.pool.lookup(hashes[i]) is None]
            if not missing:
                break
            num_blocks = missing[-1]  # a prefix that ends before the last missing block
        return num_blocks

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

    def num_cached_blocks(self, hashes: list[bytes]) -> int:
        """How many of a chain's leading blocks the pool holds."""
        for i, block_hash in enumerate(hashes):
            if self.pool.lookup(block_hash) is None:
                return i
        return len(hashes)

    def insert_cached(self, hashes: list[bytes]) -> list[tuple[int, int]]:
        """Take blocks computed elsewhere (another server's prefill) into the prefix cache: each
        hash not cached yet gets a block, which joins the cache idle, as a finished request's
        blocks do; the caller writes their KV before the next step. Stops early when no block is
        free. Returns (index in `hashes`, block id) of each block placed. Only for a single,
        unwindowed group."""
        held, placed = [], []  # the chain's blocks, held until all are in, so that none evicts another
        for i, block_hash in enumerate(hashes):
            block_id = self.pool.lookup(block_hash)
            if block_id is not None:
                self.pool.touch(block_id)
            elif self.pool.num_free_blocks < 1:
                break
            else:
                (block_id,) = self.pool.allocate(1)
                self.pool.cache(block_id, block_hash)
                placed.append((i, block_id))
            held.append(block_id)
        self.pool.free(held[::-1])
        return placed

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def allocate_slots(self, request_id: str, num_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        """Make room for the first `num_tokens` tokens of a request, starting from `prefix`
        (from `cached_prefix`) if it has no blocks yet; False, changing nothing, if a pool is short."""
        needed = self.num_blocks_for(num_tokens)
        if prefix is None and all(len(group.tables.get(request_id, ())) >= needed for group in self.groups):
            return True  # most decode steps: the last block has room
        prefix_tables = prefix.tables if prefix is not None else [[] for _ in self.groups]
        num_new = []
        for group, cached in zip(self.groups, prefix_tables):
            n = needed - len(group.tables.get(request_id, ())) - len(cached)
            held = group.held(cached)
            idle_cached = sum(1 for b in held if group.pool.is_idle(b))  # in the free queue now
            if n > group.pool.num_free_blocks - idle_cached:
                return False
            num_new.append(n)
        for group, cached, n in zip(self.groups, prefix_tables, num_new):
            table = group.tables.setdefault(request_id, [])
            if cached:  # only a request with no blocks yet takes a cached prefix
                for block_id in group.held(cached):
                    group.pool.touch(block_id)
                table.extend(cached)
                group.num_released[request_id] = len(cached) - len(group.held(cached))
            if n > 0:
                table.extend(group.pool.allocate(n))
        if prefix is not None and prefix.num_blocks:
            self._num_registered[request_id] = prefix.num_blocks  # already in the cache
        return True

    def release_behind_window(self, request_id: str, num_computed: int) -> None:
        """Return the windowed groups' blocks that the tokens from position num_computed on can no
        longer see. Registered ones stay in the prefix cache until evicted."""
        for group in self.groups:
            table = group.tables.get(request_id)
            if group.window is None or table is None:
                continue
            end = min(self.first_visible_block(group, num_computed), len(table))
            start = group.num_released.get(request_id, 0)
            if end > start:
                group.pool.free(group.held(table[start:end]))
                table[start:end] = [group.padding_block] * (end - start)
                group.num_released[request_id] = end

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Return the blocks past the first `num_tokens` tokens (rejected draft tokens' KV)."""
        keep = max(self.num_blocks_for(num_tokens), self._num_registered.get(request_id, 0))
        for group in self.groups:
            table = group.tables[request_id]
            if len(table) > keep:
                group.pool.free(group.held(table[keep:])[::-1])
                del table[keep:]

    def register_computed(self, request: Request) -> None:
        """Offer the request's blocks that are full and computed to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        hashes = self._hashes(request)
        start = self._num_registered.get(request_id, 0)
        num_full = start
        for group in self.groups:
            table = group.tables[request_id]
            num_full = min(request.num_computed_tokens // self.block_size, len(hashes), len(table))
            for i in range(start, num_full):
                if table[i] != group.padding_block:
                    group.pool.cache(table[i], hashes[i])
        self._num_registered[request_id] = max(num_full, start)

    def block_table(self, request_id: str) -> list[int]:
        """The first group's table: the full-attention layers' (or every layer's)."""
        return self.groups[0].tables[request_id]

    def window_block_table(self, request_id: str) -> list[int] | None:
        """The windowed layers' table when they have their own group; None otherwise."""
        return self.groups[1].tables[request_id] if len(self.groups) > 1 else None

    def pin(self, request: Request, expires_at: float) -> Pin | None:
        """Keep the request's registered full blocks cached (not evictable) until `expires_at`;
        None, pinning nothing, if that would take pins past `max_pinned_blocks`."""
        num_blocks = self._num_registered.get(request.request_id, 0)
        if num_blocks > self.max_pinned_blocks - self.num_pinned_blocks:
            return None
        block_ids = []
        for group in self.groups:
            held = group.held(group.tables.get(request.request_id, [])[:num_blocks])
            for block_id in held:
                group.pool.touch(block_id)
            block_ids.append(held)
        pin = Pin(block_ids, num_blocks * self.block_size, expires_at)
        self.pins[request.request_id] = pin
        return pin

    def unpin(self, pin_id: str) -> bool:
        pin = self.pins.pop(pin_id, None)
        if pin is not None:
            for group, block_ids in zip(self.groups, pin.block_ids):
                group.pool.free(block_ids[::-1])
        return pin is not None

    def next_pin_expiry(self) -> float | None:
        """When the first pin expires (time.time()'s clock); None without pins."""
        return min((pin.expires_at for pin in self.pins.values()), default=None)

    def expire_pins(self, now: float) -> None:
        for pin_id in [p for p, pin in self.pins.items() if pin.expires_at <= now]:
            self.unpin(pin_id)

    def free(self, request_id: str) -> None:
        self._block_hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        for group in self.groups:
            table = group.tables.pop(request_id, None)
            group.num_released.pop(request_id, None)
            if table:
                group.pool.free(group.held(table)[::-1])  # tail first: prefix blocks stay cached the longest

    def _hashes(self, request: Request) -> list[bytes]:
        """The hash chain over the request's full blocks, extended as tokens arrive."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        return extend_hashes(hashes, request.all_token_ids, self.block_size, request.cache_salt)
