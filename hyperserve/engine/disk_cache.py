"""DiskKVStore: the disk tier of the prefix cache.

Blocks evicted from the KV pool are written here (one safetensors file per block, holding every
layer's K and V), under a directory per model, dtype and block size, and loaded back into the pool
when a later prefix needs them: reading a block back costs far less than recomputing its tokens.
Block hashes are stable across processes, so the tier survives restarts. Oldest files go first
when the tier outgrows its budget.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class DiskKVStore:
    def __init__(self, root: str | os.PathLike, namespace: str, max_bytes: int) -> None:
        self.directory = Path(root) / re.sub(r"[^A-Za-z0-9_.-]+", "_", namespace)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        files = sorted(self.directory.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        self._index: OrderedDict[int, int] = OrderedDict(  # block hash -> file bytes, oldest first
            (int(p.stem), p.stat().st_size) for p in files
        )
        self._bytes = sum(self._index.values())
        self.num_reads = 0
        self.num_writes = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._index

    def save(self, block_hash: int, tensors: dict[str, torch.Tensor]) -> None:
        """Every layer's K and V of one block (and their scales, quantized), by name; a block
        already stored is not written again."""
        if block_hash in self._index:
            return
        path = self._path(block_hash)
        save_file({name: t.contiguous().cpu() for name, t in tensors.items()}, str(path))
        size = path.stat().st_size
        self._index[block_hash] = size
        self._bytes += size
        self.num_writes += 1
        while self._bytes > self.max_bytes and len(self._index) > 1:
            oldest, oldest_size = self._index.popitem(last=False)
            self._path(oldest).unlink(missing_ok=True)
            self._bytes -= oldest_size

    def load(self, block_hash: int) -> dict[str, torch.Tensor]:
        self.num_reads += 1
        return load_file(str(self._path(block_hash)))

    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash}.safetensors"


class DiskTier:
    """Connects a DiskKVStore to the KV pool: evicted blocks spill to disk, hits load back."""

    def __init__(
        self,
        store: DiskKVStore,
        read_block: Callable[[int], dict[str, torch.Tensor]],
        write_block: Callable[[int, dict[str, torch.Tensor]], None],
    ) -> None:
        self.store, self._read, self._write = store, read_block, write_block

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.store

    def load_into(self, block_hash: int, block_id: int) -> None:
        self._write(block_id, self.store.load(block_hash))

    def spill(self, block_id: int, block_hash: int) -> None:
        self.store.save(block_hash, self._read(block_id))
