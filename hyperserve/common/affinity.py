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


def rendezvous_score(key: str, name: str, weight: float = 1.0) -> float:
    """Weighted rendezvous hashing: the highest-scoring name takes the key, each name winning a
    `weight` share of keys, and a name that goes away moves only its own keys."""
    digest = hashlib.blake2b(f"{key}\x00{name}".encode(), digest_size=8).digest()
    uniform = (int.from_bytes(digest, "big") + 0.5) / 2**64  # in (0, 1)
    return -weight / math.log(uniform)
