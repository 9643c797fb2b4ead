"""Where cached responses live: SQLite on disk (the default, survives restarts) or Redis (shared by
several gateway replicas). Both keep a TTL per entry and a maximum size with LRU eviction.

Entries have integer ids so the vector index can name them; `entries_since(cursor)` feeds each
replica's index with entries any replica added (for SQLite: everything, at start).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass
class CacheEntry:
    key: str  # exact-match key: hash of the normalised request
    namespace: str  # semantic namespace: hash of everything but the embedded text
    text: str  # the text that was embedded (the last user message, or the prompt)
    response: dict[str, Any]  # the OpenAI response body, non-streaming shape
    embedding: np.ndarray | None = None  # [dim] float32, unit length; None when not semantically indexed
    expires_at: float = 0.0
    id: int = 0  # assigned by the store


@dataclass
class IndexedVector:
    id: int
    namespace: str
    embedding: np.ndarray


class CacheStore(Protocol):
    def get(self, key: str) -> CacheEntry | None:
        """The live entry with this exact key (refreshing its LRU position), or None."""

    def get_by_id(self, entry_id: int) -> CacheEntry | None: ...

    def put(self, entry: CacheEntry) -> CacheEntry:
        """Store (replacing an entry with the same key), evicting the least recently used beyond
        the size limit; returns the entry with its id."""

    def entries_since(self, cursor: Any) -> tuple[Any, list[IndexedVector]]:
        """Embeddings added after `cursor` (None: from the start) and the cursor to pass next."""

    def high_water(self) -> int:
        """The largest id ever assigned (a saved index beyond it belongs to another store)."""

    def __len__(self) -> int: ...

    def close(self) -> None: ...


def _vector(blob: bytes | None) -> np.ndarray | None:
    return np.frombuffer(blob, dtype=np.float32).copy() if blob else None


@dataclass
class SQLiteStore:
    """One table; WAL mode so reads never wait for a write. `path=":memory:"` keeps nothing."""

    path: str
    max_entries: int
    _db: sqlite3.Connection = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.executescript("""
            PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;
            CREATE TABLE IF NOT EXISTS entries (
                id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT UNIQUE NOT NULL, namespace TEXT NOT NULL,
                text TEXT NOT NULL, response TEXT NOT NULL, embedding BLOB,
                expires_at REAL NOT NULL, last_used REAL NOT NULL);
            CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_used);
            CREATE INDEX IF NOT EXISTS entries_expiry ON entries (expires_at);
        """)
        self._count = self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]  # kept, not recounted

    _COLUMNS = "id, key, namespace, text, response, embedding, expires_at"

    def _row(self, row) -> CacheEntry | None:
        if row is None:
            return None
        entry_id, key, namespace, text, response, embedding, expires_at = row
        return CacheEntry(key, namespace, text, json.loads(response), _vector(embedding), expires_at, entry_id)

    def _live(self, where: str, value: Any) -> CacheEntry | None:
        now = time.time()
        with self._lock:
            row = self._db.execute(f"SELECT {self._COLUMNS} FROM entries WHERE {where} = ? AND expires_at > ?",
                                   (value, now)).fetchone()
            if row is not None:
                self._db.execute("UPDATE entries SET last_used = ? WHERE id = ?", (now, row[0]))
        return self._row(row)

    def get(self, key: str) -> CacheEntry | None:
        return self._live("key", key)

    def get_by_id(self, entry_id: int) -> CacheEntry | None:
        return self._live("id", entry_id)

    def put(self, entry: CacheEntry) -> CacheEntry:
        blob = entry.embedding.astype(np.float32).tobytes() if entry.embedding is not None else None
        now = time.time()
        with self._lock:  # every statement below uses an index: an insert costs O(log n)
            self._db.execute("BEGIN")
            removed = self._db.execute("DELETE FROM entries WHERE key = ?", (entry.key,)).rowcount
            removed += self._db.execute("DELETE FROM entries WHERE expires_at <= ?", (now,)).rowcount
            cursor = self._db.execute(
                "INSERT INTO entries (key, namespace, text, response, embedding, expires_at, last_used) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (entry.key, entry.namespace, entry.text, json.dumps(entry.response), blob, entry.expires_at, now))
            entry.id = cursor.lastrowid
            self._count += 1 - removed
            if self._count > self.max_entries:
                self._count -= self._db.execute(
                    "DELETE FROM entries WHERE id IN (SELECT id FROM entries ORDER BY last_used LIMIT ?)",
                    (self._count - self.max_entries,)).rowcount
            self._db.execute("COMMIT")
        return entry

    def entries_since(self, cursor: int | None) -> tuple[int, list[IndexedVector]]:
        with self._lock:
            rows = self._db.execute("SELECT id, namespace, embedding FROM entries WHERE id > ? AND "
                                    "embedding IS NOT NULL AND expires_at > ? ORDER BY id",
                                    (cursor or 0, time.time())).fetchall()
        vectors = [IndexedVector(i, ns, _vector(blob)) for i, ns, blob in rows]
        return (rows[-1][0] if rows else cursor or 0), vectors

    def high_water(self) -> int:
        with self._lock:
            row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'entries'").fetchone()
        return row[0] if row else 0

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM entries WHERE expires_at > ?", (time.time(),)).fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class RedisStore:
    """Keys under `prefix`: `e:{id}` entry JSON and `k:{key}` -> id (both with the TTL), `lru` a
    sorted set of ids by last use, `next` the id counter, and `log` a stream of (id, namespace,
    embedding) that every replica reads to keep its vector index in step."""

    def __init__(self, url: str, prefix: str, max_entries: int, timeout_s: float = 0.5) -> None:
        import redis

        # a Redis that stops answering costs a request timeout_s, then an error (a cache miss)
        self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.redis.ping()  # an unreachable Redis fails at start, not on the first request
        self.prefix, self.max_entries = prefix, max_entries

    def _k(self, *parts: Any) -> str:
        return self.prefix + ":".join(str(p) for p in parts)

    def get(self, key: str) -> CacheEntry | None:
        entry_id = self.redis.get(self._k("k", key))
        return self.get_by_id(int(entry_id)) if entry_id is not None else None

    def get_by_id(self, entry_id: int) -> CacheEntry | None:
        raw = self.redis.get(self._k("e", entry_id))
        if raw is None:
            return None
        self.redis.zadd(self._k("lru"), {entry_id: time.time()})
        data = json.loads(raw)
        return CacheEntry(data["key"], data["namespace"], data["text"], data["response"], None,
                          data["expires_at"], entry_id)

    def put(self, entry: CacheEntry) -> CacheEntry:
        entry.id = int(self.redis.incr(self._k("next")))
        ttl_ms = max(1, int((entry.expires_at - time.time()) * 1000))
        body = json.dumps({"key": entry.key, "namespace": entry.namespace, "text": entry.text,
                           "response": entry.response, "expires_at": entry.expires_at})
        pipe = self.redis.pipeline()
        pipe.set(self._k("e", entry.id), body, px=ttl_ms)
        pipe.set(self._k("k", entry.key), entry.id, px=ttl_ms)
        pipe.zadd(self._k("lru"), {entry.id: time.time()})
        if entry.embedding is not None:
            pipe.xadd(self._k("log"), {"id": entry.id, "ns": entry.namespace,
                                       "v": entry.embedding.astype(np.float32).tobytes()},
                      maxlen=2 * self.max_entries, approximate=True)
        pipe.execute()
        overflow = self.redis.zcard(self._k("lru")) - self.max_entries
        if overflow > 0:
            evicted = [int(i) for i, _ in self.redis.zpopmin(self._k("lru"), overflow)]
            self.redis.delete(*[self._k("e", i) for i in evicted])  # their k: keys expire with the TTL
        return entry

    def entries_since(self, cursor: str | None) -> tuple[str, list[IndexedVector]]:
        cursor = cursor or "0"
        vectors = []
        while True:
            batch = self.redis.xread({self._k("log"): cursor}, count=10_000)
            if not batch:
                return cursor, vectors
            for message_id, fields in batch[0][1]:
                cursor = message_id.decode()
                vectors.append(IndexedVector(int(fields[b"id"]), fields[b"ns"].decode(), _vector(fields[b"v"])))

    def high_water(self) -> int:
        return int(self.redis.get(self._k("next")) or 0)

    def __len__(self) -> int:
        return int(self.redis.zcard(self._k("lru")))

    def close(self) -> None:
        self.redis.close()
