"""KV blocks moved between engines, the engine's side of disaggregated prefill: which of a prompt's
blocks the prefix cache can hold, reading blocks out, and taking blocks computed elsewhere in.

Blocks are named by their prefix hashes, so a decode engine takes only the blocks it lacks and a
request for the prompt then finds them in its prefix cache like any other cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperserve.engine.kv_cache_manager import KVCacheManager, extend_hashes, tenant_salt
from hyperserve.engine.model_runner import ModelRunner


@dataclass
class KVTransferStats:
    """KV blocks moved between engines (disaggregated prefill), since start."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0  # new here (blocks this engine had already are not counted)
    bytes_received: int = 0
    transfer_seconds: float = 0.0  # the receiving side's wait: the other engine's prefill and the transfer
    transfer_failures: int = 0  # transfers that failed, whose prompts were computed here instead


class KVTransfer:
    def __init__(self, kv_cache: KVCacheManager, runner: ModelRunner) -> None:
        self.kv_cache, self.runner = kv_cache, runner
        self.stats = KVTransferStats()

    def unsupported(self) -> str | None:
        """Why this engine cannot send or take KV blocks (None: it can)."""
        if not self.kv_cache.enable_prefix_caching:
            return "prefix caching is off"
        if len(self.kv_cache.groups) > 1 or self.kv_cache.groups[0].window is not None:
            return "sliding-window attention keeps its own KV layout"
        return None

    def prefix_hashes(self, token_ids: list[int], cache_salt: str = "") -> list[bytes]:
        """The hash chain of the blocks a request for this prompt (of this tenant) can take from
        the prefix cache: its full blocks but the one holding its last token, which the request
        computes itself."""
        size = self.kv_cache.block_size
        return extend_hashes([], token_ids, size, tenant_salt(cache_salt))[: (len(token_ids) - 1) // size]

    def read_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """The KV of these blocks, on the CPU: each tensor [blocks, layers, block_size, ...]."""
        tensors = {name: t.cpu() for name, t in self.runner.read_blocks(block_ids).items()}
        self.stats.blocks_sent += len(block_ids)
        self.stats.bytes_sent += sum(t.numel() * t.element_size() for t in tensors.values())
        return tensors

    def import_prefix(self, hashes: list[bytes], tensors: dict[str, torch.Tensor]) -> int:
        """Take a prefix's blocks computed elsewhere (tensors as read_blocks gives them, for these
        hashes) into the prefix cache, so a request for it computes only what follows; returns how
        many blocks were new here. Raises ValueError for blocks of another shape."""
        if not hashes:
            return 0
        expected = self.runner.read_blocks([0])
        if set(tensors) != set(expected) or any(
                tensors[name].shape[1:] != t.shape[1:] or len(tensors[name]) != len(hashes)
                for name, t in expected.items()):
            raise ValueError("the KV blocks do not fit this engine's cache (another model or block size?)")
        placed = self.kv_cache.insert_cached(hashes)  # (index in the chain, block id) of those new here
        if not placed:
            return 0
        if len(placed) < len(hashes):
            indices = torch.tensor([i for i, _ in placed], dtype=torch.long)
            tensors = {n: t.index_select(0, indices) for n, t in tensors.items()}
        self.runner.write_blocks([b for _, b in placed], tensors)
        self.stats.blocks_received += len(placed)
        self.stats.bytes_received += sum(t.numel() * t.element_size() for t in tensors.values())
        return len(placed)
