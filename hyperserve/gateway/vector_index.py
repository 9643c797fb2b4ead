"""Approximate nearest neighbours for the semantic cache: one usearch HNSW index per namespace,
so a lookup only ever sees entries with the same model, system prompt and sampling parameters."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
from usearch.index import Index


class VectorIndex:
    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._indexes: dict[str, Index] = {}
        self._lock = threading.Lock()  # inserts come from worker threads, searches from the event loop

    def __len__(self) -> int:
        return sum(len(index) for index in self._indexes.values())

    def add(self, namespace: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """keys: [N] uint64 entry ids; vectors: [N, dim] unit float32."""
        with self._lock:
            index = self._indexes.get(namespace)
            if index is None:
                index = self._indexes[namespace] = Index(ndim=self.dim, metric="cos", dtype="f32")
        index.add(keys.astype(np.uint64), vectors, threads=2 if len(keys) > 64 else 1)

    def remove(self, namespace: str, key: int) -> None:
        index = self._indexes.get(namespace)
        if index is not None and key in index:
            index.remove(key)

    def nearest(self, namespace: str, vector: np.ndarray) -> tuple[int, float] | None:
        """(entry id, cosine similarity) of the closest vector in the namespace, or None."""
        index = self._indexes.get(namespace)
        if index is None or len(index) == 0:
            return None
        match = index.search(vector, 1)
        if len(match.keys) == 0:
            return None
        return int(match.keys[0]), 1.0 - float(match.distances[0])

    def save(self, directory: Path, cursor: int) -> None:
        """Every namespace's graph, and the store cursor they are complete up to."""
        directory.mkdir(parents=True, exist_ok=True)
        with self._lock:
            for namespace, index in self._indexes.items():
                index.save(str(directory / f"{namespace}.usearch"))
            (directory / "manifest.json").write_text(json.dumps({"cursor": cursor, "namespaces": list(self._indexes)}))

    def load(self, directory: Path) -> int | None:
        """Graphs saved by `save`; returns their cursor, or None when there is nothing to load."""
        manifest = directory / "manifest.json"
        if not manifest.exists():
            return None
        saved = json.loads(manifest.read_text())
        with self._lock:
            for namespace in saved["namespaces"]:
                self._indexes[namespace] = Index.restore(str(directory / f"{namespace}.usearch"))
        return saved["cursor"]
