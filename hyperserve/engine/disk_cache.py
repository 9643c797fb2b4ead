"""DiskKVStore: the disk tier of the prefix cache.

Blocks evicted from the KV pool are written here (one safetensors file per block, holding every
layer's K and V), and loaded back into the pool when a later prefix needs them: reading a block
back costs far less than recomputing its tokens. The directory is named after the model's
identity (a hash of its config, weights, dtypes, quantization and block size), so two models never
share KV, and files are named by their block's SHA-256, stable across processes, so the tier
survives restarts. A file is written whole or not at all (temporary file, fsync, rename); one
that cannot be read back is a miss, never an error. Oldest files go first when the tier outgrows
its budget.
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger("hyperserve.disk_cache")

_NAME = re.compile(r"[0-9a-f]{64}")


class DiskKVStore:
    def __init__(self, root: str | os.PathLike, namespace: str, max_bytes: int) -> None:
        self.directory = Path(root) / re.sub(r"[^A-Za-z0-9_.-]+", "_", namespace)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        for leftover in self.directory.glob("*.tmp"):  # a write cut short by a crash
            leftover.unlink(missing_ok=True)
        files = sorted((p for p in self.directory.glob("*.safetensors") if _NAME.fullmatch(p.stem)),
                       key=lambda p: p.stat().st_mtime)
        self._index: OrderedDict[bytes, int] = OrderedDict(  # block hash -> file bytes, oldest first
            (bytes.fromhex(p.stem), p.stat().st_size) for p in files
        )
        self._bytes = sum(self._index.values())
        self.num_reads = 0
        self.num_writes = 0
        self.num_corrupt = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def save(self, block_hash: bytes, tensors: dict[str, torch.Tensor]) -> None:
        """Every layer's K and V of one block (and their scales, quantized), by name; a block
        already stored is not written again."""
        if block_hash in self._index:
            return
        path = self._path(block_hash)
        temporary = path.with_suffix(".tmp")
        save_file({name: t.contiguous().cpu() for name, t in tensors.items()}, str(temporary))
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
        size = path.stat().st_size
        self._index[block_hash] = size
        self._bytes += size
        self.num_writes += 1
        while self._bytes > self.max_bytes and len(self._index) > 1:
            oldest, _ = self._index.popitem(last=False)
            self._remove(oldest)

    def load(self, block_hash: bytes) -> dict[str, torch.Tensor] | None:
        """The block's tensors; None (and the file dropped, with a warning) if it cannot be read."""
        self.num_reads += 1
        try:
            return load_file(str(self._path(block_hash)))
        except Exception as error:  # truncated, corrupt or deleted behind our back: a miss
            self.discard(block_hash, error)
            return None

    def discard(self, block_hash: bytes, error: Exception) -> None:
        logger.warning("disk KV cache: dropping unreadable block %s: %s", block_hash.hex()[:16], error)
        self.num_corrupt += 1
        if block_hash in self._index:
            del self._index[block_hash]
            self._remove(block_hash)

    def _remove(self, block_hash: bytes) -> None:
        path = self._path(block_hash)
        if path.exists():
            self._bytes -= path.stat().st_size
            path.unlink(missing_ok=True)

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}.safetensors"


class DiskTier:
    """Connects a DiskKVStore to the KV pool: evicted blocks spill to disk, hits load back."""

    def __init__(
        self,
        store: DiskKVStore,
        read_block: Callable[[int], dict[str, torch.Tensor]],
        write_block: Callable[[int, dict[str, torch.Tensor]], None],
    ) -> None:
        self.store, self._read, self._write = store, read_block, write_block

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.store

    def load_into(self, block_hash: bytes, block_id: int) -> bool:
        tensors = self.store.load(block_hash)
        if tensors is None:
            return False
        try:
            self._write(block_id, tensors)
        except Exception as error:  # readable, but not this pool's shapes or dtypes
            self.store.discard(block_hash, error)
            return False
        return True

    def spill(self, block_id: int, block_hash: bytes) -> None:
        self.store.save(block_hash, self._read(block_id))
