"""The Batch API's files on disk: each file's bytes beside a JSON record of what it is (owner, name,
purpose), so a server restarted on the same --files-dir still has them."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hyperserve.common.errors import APIError


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def write_atomically(path: Path, data: bytes) -> None:
    """Write a file whole or not at all (a crash mid-write leaves the old one)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


@dataclass
class StoredFile:
    id: str
    owner: str  # the API key that uploaded (or whose batch wrote) it ("" without keys)
    filename: str
    purpose: str  # batch (an input), batch_output
    bytes: int
    created_at: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None}


class FileStore:
    """Files on disk, each visible to its owner alone; `max_bytes` is what they may hold together.
    Without a directory they live in a temporary one, removed by close() (the app's shutdown): a
    server stopped by SIGTERM ends by the signal, after uvicorn's shutdown, so nothing at exit would."""

    def __init__(self, directory: Path | None, max_bytes: int) -> None:
        self._temporary = None if directory is not None else tempfile.TemporaryDirectory(prefix="hyperserve-files-")
        self.directory = Path(directory or self._temporary.name)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.files: dict[str, StoredFile] = {}
        for record in sorted(self.directory.glob("file_*.json")):  # those kept by an earlier run
            try:
                stored = StoredFile(**json.loads(record.read_text()))
            except (ValueError, TypeError):
                continue  # not one of ours
            if self.path(stored.id).exists():
                self.files[stored.id] = stored

    def close(self) -> None:
        """Remove the temporary directory, if the files live in one."""
        if self._temporary is not None:
            self._temporary.cleanup()

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def path(self, file_id: str) -> Path:
        return self.directory / file_id

    def add(self, owner: str, filename: str, purpose: str, data: bytes) -> StoredFile:
        if self.bytes + len(data) > self.max_bytes:
            raise APIError(400, f"the server's files would hold more than {self.max_bytes} bytes; delete some first",
                           code="storage_full")
        stored = StoredFile(new_id("file"), owner, filename, purpose, len(data))
        write_atomically(self.path(stored.id), data)
        write_atomically(self.directory / f"{stored.id}.json", json.dumps(asdict(stored)).encode())
        self.files[stored.id] = stored
        return stored

    def get(self, owner: str, file_id: str, param: str = "file_id") -> StoredFile:
        stored = self.files.get(file_id)
        if stored is None or stored.owner != owner:
            raise APIError(404, f"no file {file_id!r}", param=param, code="file_not_found")
        return stored

    def delete(self, owner: str, file_id: str) -> None:
        self.get(owner, file_id)
        (self.directory / f"{file_id}.json").unlink(missing_ok=True)
        self.path(file_id).unlink(missing_ok=True)
        del self.files[file_id]
