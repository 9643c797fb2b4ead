"""Exact and semantic response caching.

A request is cacheable when its answer is reproducible (temperature 0, a fixed seed, or a beam
search) or the client opts in. Two keys come from the normalised request and the caller's cache scope:
- the exact key hashes everything that shapes the answer (model, messages with their tool calls,
  sampling parameters, response_format, tools and tool_choice);
- the semantic namespace hashes the same minus the last user message (or prompt), whose
  embedding is then matched by cosine similarity. A different system prompt, earlier turn,
  temperature or max_tokens is a different namespace, so it can never produce a hit: the whole
  conversation takes part, the earlier turns exactly and the last one by meaning.
The scope (an API key's `cache_scope`, by default the key itself) is part of both, so one tenant's
answers never reach another tenant unless both keys name the same scope.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyperserve.common.embedder import Embedder
from hyperserve.common.messages import message_text
from hyperserve.gateway.cache_store import CacheEntry, CacheStore
from hyperserve.gateway.vector_index import VectorIndex

logger = logging.getLogger("hyperserve.gateway")

# Fields that never change the answer, so two requests differing only in them share an entry.
_TRANSPORT_FIELDS = frozenset({"stream", "stream_options", "user", "priority", "model"})


@dataclass
class CacheKey:
    exact: str
    namespace: str
    text: str | None  # what is embedded for the semantic lookup; None: exact matching only


@dataclass
class CacheHit:
    kind: str  # "exact" | "semantic"
    entry: CacheEntry
    similarity: float


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _content(message: dict[str, Any]) -> str:
    """The message's text with whitespace runs folded (they do not make a different question);
    content that is not all text keys by its exact JSON, so it never matches a text-only message."""
    try:
        text = message_text(message.get("content"))
    except ValueError:
        return json.dumps(message.get("content"), sort_keys=True)
    return " ".join(text.split())


def _message(message: dict[str, Any]) -> dict[str, Any]:
    """What of a message shapes the answer: its role, its text, and an assistant's tool calls or
    the call a tool result answers."""
    keyed = {"role": message.get("role"), "content": _content(message)}
    for field in ("tool_calls", "tool_call_id", "name"):
        if message.get(field) is not None:
            keyed[field] = message[field]
    return keyed


def is_deterministic(body: dict[str, Any]) -> bool:
    return (body.get("temperature", 1.0) == 0 or body.get("seed") is not None
            or body.get("use_beam_search") is True)


def cache_key(kind: str, model: str, body: dict[str, Any], scope: str | None = None) -> CacheKey:
    """kind: "chat" | "completion"; model: the route the client asked for; scope: the tenant whose
    entries may answer (None: an open gateway, one shared scope)."""
    params = {k: v for k, v in body.items() if k not in _TRANSPORT_FIELDS and k not in ("messages", "prompt")}
    if kind == "chat":
        messages = [_message(m) for m in body.get("messages") or []]
        exact = _hash([scope, kind, model, params, messages])
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "user":
            return CacheKey(exact, _hash([scope, kind, model, params, messages[:-1]]), last["content"])
        return CacheKey(exact, exact, None)
    prompt = body.get("prompt")
    exact = _hash([scope, kind, model, params, prompt])
    text = " ".join(prompt.split()) if isinstance(prompt, str) else None
    return CacheKey(exact, _hash([scope, kind, model, params]), text)


class ResponseCache:
    def __init__(self, store: CacheStore, ttl_s: float, embedder: Embedder | None = None,
                 threshold: float = 0.9, index_dir: Path | None = None, timeout_s: float = 1.0) -> None:
        """index_dir: where the vector index is saved on close and loaded at start, so a restart
        does not rebuild it from the store (35 s for 100,000 entries). timeout_s: the longest a
        store call may take; the store runs on worker threads, never on the event loop, and a
        call that takes longer raises TimeoutError (the gateway counts it as a miss)."""
        self.store, self.ttl_s, self.timeout_s = store, ttl_s, timeout_s
        self._syncing = asyncio.Lock()
        self.embedder, self.threshold = embedder, threshold
        self.index = VectorIndex(embedder.dim) if embedder is not None else None
        self.index_dir = index_dir
        self._cursor: Any = None
        if self.index is not None and index_dir is not None:
            cursor = self.index.load(index_dir)
            if cursor is not None and cursor <= store.high_water():
                self._cursor = cursor
            elif cursor is not None:  # saved for another store (the database was replaced): rebuild
                self.index = VectorIndex(embedder.dim)

    @property
    def semantic(self) -> bool:
        return self.embedder is not None

    async def _call(self, function, *args):
        return await asyncio.wait_for(asyncio.to_thread(function, *args), self.timeout_s)

    def sync_index(self) -> int:
        """Add embeddings stored since the last call (by this or another replica) to the index
        (blocking: for start-up, off the event loop)."""
        if self.index is None:
            return 0
        return self._add_to_index(*self.store.entries_since(self._cursor))

    async def _catch_up(self) -> None:
        """sync_index for a running gateway: the store is read on a worker thread, the in-memory
        index is changed on the event loop, one catch-up at a time."""
        if self.index is None:
            return
        async with self._syncing:
            self._add_to_index(*await self._call(self.store.entries_since, self._cursor))

    def _add_to_index(self, cursor: Any, vectors: list) -> int:
        self._cursor = cursor
        by_namespace: dict[str, list] = {}
        for v in vectors:
            by_namespace.setdefault(v.namespace, []).append(v)
        for namespace, group in by_namespace.items():
            self.index.add(namespace, np.array([v.id for v in group]), np.stack([v.embedding for v in group]))
        return len(vectors)

    async def lookup(self, key: CacheKey) -> tuple[CacheHit | None, Any]:
        """The best hit, and the query embedding (reused by `insert` after a miss)."""
        entry = await self._call(self.store.get, key.exact)
        if entry is not None:
            return CacheHit("exact", entry, 1.0), None
        if not self.semantic or key.text is None:
            return None, None
        vector = (await self.embedder.embed_async([key.text]))[0]
        await self._catch_up()
        found = self.index.nearest(key.namespace, vector)
        if found is None or found[1] < self.threshold:
            return None, vector
        entry_id, similarity = found
        entry = await self._call(self.store.get_by_id, entry_id)
        if entry is None or entry.namespace != key.namespace:  # expired or evicted since it was indexed
            self.index.remove(key.namespace, entry_id)
            return None, vector
        return CacheHit("semantic", entry, similarity), vector

    async def insert(self, key: CacheKey, response: dict[str, Any], vector: Any = None) -> None:
        if self.semantic and key.text is not None and vector is None:
            vector = (await self.embedder.embed_async([key.text]))[0]
        entry = CacheEntry(key.exact, key.namespace, key.text or "", response,
                           vector if key.text is not None else None, time.time() + self.ttl_s)
        await self._call(self.store.put, entry)
        await self._catch_up()

    def close(self) -> None:
        if self.index is not None and self.index_dir is not None and self._cursor is not None:
            self.index.save(self.index_dir, self._cursor)
        self.store.close()
