"""Prefix affinity: requests that share a prompt's beginning go to the same replica, where that
prefix's KV is cached. Used by the gateway's prefix-affinity routes and the Ray Serve router."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any


def affinity_text(body: dict[str, Any], chat: bool) -> str:
    """The request's prompt as text, from its beginning: the messages (system prompt first) or the
    prompt. Callers keep a prefix of it as the affinity key."""
    if chat:
        return json.dumps(body.get("messages"), separators=(",", ":"))
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def salted_key(prefix: str | None, salt: str) -> str | None:
    """The affinity key of a prompt prefix whose cached KV only requests of the same `salt` share
    (the engine's, security.config.cache_salt): one key per tenant, so tenants that send the same
    system prompt spread over the replicas rather than crowding the one it hashes to."""
    return prefix if prefix is None or not salt else f"{salt}\x00{prefix}"


def rendezvous_score(key: str, name: str, weight: float = 1.0) -> float:
    """Weighted rendezvous hashing: the highest-scoring name takes the key, each name winning a
    `weight` share of keys, and a name that goes away moves only its own keys."""
    digest = hashlib.blake2b(f"{key}\x00{name}".encode(), digest_size=8).digest()
    uniform = (int.from_bytes(digest, "big") + 0.5) / 2**64  # in (0, 1)
    return -weight / math.log(uniform)
