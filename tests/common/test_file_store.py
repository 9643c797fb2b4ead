"""FileStore: files on disk that a store on the same directory finds again, each its owner's alone;
a temporary store's directory removed on close."""

from __future__ import annotations

import pytest

from hyperserve.common.errors import APIError
from hyperserve.common.file_store import FileStore


def test_files_are_found_again_by_a_store_on_the_same_directory(tmp_path):
    store = FileStore(tmp_path, max_bytes=100)
    kept = store.add("key:alice", "in.jsonl", "batch", b"{}\n")
    gone = store.add("key:alice", "old.jsonl", "batch", b"[]\n")
    store.delete("key:alice", gone.id)
    (tmp_path / "file_broken.json").write_text("{not json")  # a record cut short is skipped
    again = FileStore(tmp_path, max_bytes=100)
    assert list(again.files) == [kept.id] and again.get("key:alice", kept.id) == kept
    assert again.path(kept.id).read_bytes() == b"{}\n" and not again.path(gone.id).exists()
    with pytest.raises(APIError, match="no file"):
        again.get("key:bob", kept.id)
    with pytest.raises(APIError, match="more than 100 bytes"):
        again.add("key:alice", "big.jsonl", "batch", b"x" * 98)


def test_a_store_without_a_directory_removes_its_temporary_one_on_close():
    store = FileStore(None, max_bytes=100)
    store.add("", "in.jsonl", "batch", b"{}\n")
    assert store.directory.is_dir()
    store.close()
    assert not store.directory.exists()
