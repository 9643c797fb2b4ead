from __future__ import annotations

import torch

from hyperserve.engine.disk_cache import DiskKVStore


def test_blocks_round_trip_bit_exactly(tmp_path):
    store = DiskKVStore(tmp_path, "model/f32 bs16", max_bytes=2**30)
    kv = {"key": torch.randn(30, 16, 3, 64), "value": torch.randn(30, 16, 3, 64)}
    store.save(1234567890123, kv)
    assert 1234567890123 in store
    assert all(torch.equal(store.load(1234567890123)[name], kv[name]) for name in kv)
    reopened = DiskKVStore(tmp_path, "model/f32 bs16", max_bytes=2**30)  # survives a restart
    assert all(torch.equal(reopened.load(1234567890123)[name], kv[name]) for name in kv)


def test_the_oldest_blocks_go_when_over_budget(tmp_path):
    kv = {"key": torch.zeros(2, 4, 1, 8), "value": torch.zeros(2, 4, 1, 8)}
    store = DiskKVStore(tmp_path, "m", max_bytes=3 * 600)
    for block_hash in range(5):
        store.save(block_hash, kv)
    assert 0 not in store and 4 in store
    assert len(list(store.directory.glob("*.safetensors"))) == len(store._index) <= 3
