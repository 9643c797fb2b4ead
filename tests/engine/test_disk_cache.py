from __future__ import annotations

import hashlib

import torch

from hyperserve.engine.disk_cache import DiskKVStore, DiskTier


def block_hash(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def kv_block() -> dict[str, torch.Tensor]:
    return {"key": torch.randn(30, 16, 3, 64), "value": torch.randn(30, 16, 3, 64)}


def test_blocks_round_trip_bit_exactly(tmp_path):
    store = DiskKVStore(tmp_path, "model/f32 bs16", max_bytes=2**30)
    kv = kv_block()
    store.save(block_hash(1), kv)
    assert block_hash(1) in store
    assert all(torch.equal(store.load(block_hash(1))[name], kv[name]) for name in kv)
    reopened = DiskKVStore(tmp_path, "model/f32 bs16", max_bytes=2**30)  # survives a restart
    assert all(torch.equal(reopened.load(block_hash(1))[name], kv[name]) for name in kv)
    assert not list(store.directory.glob("*.tmp"))  # written through a temporary file, renamed


def test_the_oldest_blocks_go_when_over_budget(tmp_path):
    kv = {"key": torch.zeros(2, 4, 1, 8), "value": torch.zeros(2, 4, 1, 8)}
    store = DiskKVStore(tmp_path, "m", max_bytes=3 * 600)
    for i in range(5):
        store.save(block_hash(i), kv)
    assert block_hash(0) not in store and block_hash(4) in store
    assert len(list(store.directory.glob("*.safetensors"))) == len(store._index) <= 3


def test_a_truncated_or_corrupt_file_is_a_miss_with_a_warning(tmp_path, caplog):
    store = DiskKVStore(tmp_path, "m", max_bytes=2**30)
    for i in range(3):
        store.save(block_hash(i), kv_block())
    truncated, garbage = store._path(block_hash(0)), store._path(block_hash(1))
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    garbage.write_bytes(b"\x00" * 100)
    written = {}
    tier = DiskTier(store, read_block=lambda block_id: {}, write_block=lambda block_id, t: written.update(t))
    assert tier.load_into(block_hash(0), 7) is False
    assert tier.load_into(block_hash(1), 7) is False
    assert tier.load_into(block_hash(2), 7) is True and set(written) == {"key", "value"}
    assert block_hash(0) not in store and not truncated.exists()  # dropped, not tried again
    assert store.num_corrupt == 2 and "unreadable block" in caplog.text


def test_a_block_of_other_shapes_is_a_miss(tmp_path):
    store = DiskKVStore(tmp_path, "m", max_bytes=2**30)
    store.save(block_hash(0), kv_block())

    def write_block(block_id, tensors):
        raise RuntimeError("shape mismatch")

    assert DiskTier(store, lambda block_id: {}, write_block).load_into(block_hash(0), 3) is False
    assert block_hash(0) not in store


def test_leftover_temporary_files_and_foreign_names_are_ignored(tmp_path):
    store = DiskKVStore(tmp_path, "m", max_bytes=2**30)
    (store.directory / "deadbeef.tmp").write_bytes(b"partial")
    (store.directory / "notes.safetensors").write_bytes(b"x")
    reopened = DiskKVStore(tmp_path, "m", max_bytes=2**30)
    assert len(reopened._index) == 0 and not (store.directory / "deadbeef.tmp").exists()
