"""The text of a chat message's content, one way for every layer that reads it.

OpenAI's `content` is a string, null, or a list of parts (`{"type": "text", "text": ...}`, images,
audio). Callers that have validated the request (the server) get a ValueError for what they cannot
serve; callers that only look (cache keys, guardrails) take `text_parts(..., strict=False)`, which
skips what is not text instead of failing on it.
"""

from __future__ import annotations

from typing import Any


def text_parts(content: Any, strict: bool = True) -> list[str]:
    """The text pieces of a message's content, in order."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        if strict:
            raise ValueError(f"message content must be a string or a list of parts, not {type(content).__name__}")
        return []
    pieces = []
    for part in content:
        is_text = isinstance(part, dict) and part.get("type") == "text"
        text = part.get("text") if is_text else None
        if is_text and isinstance(text, str):
            pieces.append(text)
        elif strict:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"content parts of type {kind!r} are not supported: send text parts "
                             '({"type": "text", "text": "..."})' if not is_text
                             else "a text content part needs a string 'text'")
    return pieces


def message_text(content: Any, strict: bool = True, separator: str = "") -> str:
    return separator.join(text_parts(content, strict))
