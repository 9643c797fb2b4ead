"""Server-sent events as OpenAI streams them: `data: <json>` events, ended by `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

DONE = "[DONE]"


def sse_event(data: dict[str, Any] | str) -> str:
    """One event: a JSON object, or a raw string such as DONE."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class EventSplitter:
    """An SSE byte stream cut into whole events as its chunks arrive (a chunk may end mid-event),
    each event without the blank line that ends it."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes, final: bool = False) -> list[bytes]:
        """The events `data` completes; with `final`, what is left counts as the last one."""
        self._buffer += data
        if final:
            events, self._buffer = self._buffer, b""
        else:
            events, _, self._buffer = self._buffer.rpartition(b"\n\n")
        return [event for event in events.split(b"\n\n") if event]


def parse_sse_data(line: str) -> str | None:
    """The payload of a `data:` line (DONE included); None for any other line (comments, blanks)."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def sse_chunks(events: list[bytes]) -> list[dict[str, Any]]:
    """The JSON objects of whole events' `data:` lines (EventSplitter's events); DONE, other lines
    and data that is not a JSON object are left out."""
    chunks = []
    for line in b"\n".join(events).decode(errors="replace").splitlines():
        try:
            chunk = parse_sse_chunk(line)
        except ValueError:
            continue
        if chunk is not None:
            chunks.append(chunk)
    return chunks


def parse_sse_chunk(line: str) -> dict[str, Any] | None:
    """The JSON object of a `data:` line; None for DONE, other lines and non-object payloads.
    Raises ValueError for a payload that is not JSON."""
    data = parse_sse_data(line)
    if data is None or data == DONE:
        return None
    chunk = json.loads(data)
    return chunk if isinstance(chunk, dict) else None
