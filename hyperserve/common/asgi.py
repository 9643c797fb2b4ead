"""Small ASGI helpers shared by the middleware that reads or rewrites request bodies."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any


async def read_body(receive) -> bytes:
    """The whole request body (what arrived before a disconnect)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay(body: bytes, receive):
    """A `receive` that gives the (possibly rewritten) body once, then the client's own messages
    (its disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a response's headers announce server-sent events."""
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


def without_content_length(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A response's headers for a body that will be rewritten (its length set again, or streamed)."""
    return [(k, v) for k, v in headers if k.lower() != b"content-length"]


async def send_json(send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
                + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]})
    await send({"type": "http.response.body", "body": data})


def limited_receive(receive, max_bytes: int, error: Exception):
    """`receive` that raises `error` once the body passes max_bytes."""
    received = 0

    async def counted():
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > max_bytes:
            raise error
        return message

    return counted


async def send_file(send, path: Path, chunk_bytes: int = 2**20) -> None:
    """A file's bytes as a 200 response, read a chunk at a time off the event loop."""
    size = os.path.getsize(path)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())]})
    with path.open("rb") as handle:
        while True:
            chunk = await asyncio.to_thread(handle.read, chunk_bytes)
            more = handle.tell() < size
            await send({"type": "http.response.body", "body": chunk, "more_body": more})
            if not more:
                break
