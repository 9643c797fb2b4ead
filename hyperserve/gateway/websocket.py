"""WS /v1/ws on the gateway: the server's WebSocket protocol (common/websocket_api.py) over the
gateway's routes, so a client streams and cancels through the gateway as it does against one server.

Each request goes where its HTTP twin would (response cache, route, cascade, fallback) and is
streamed: a chunk per SSE event the HTTP endpoint would send. A backend's error, before its first
byte or in the middle of its stream, becomes the request's error event. Cancelling closes the
backend's stream, which cancels the request on one of our servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from hyperserve.common.errors import APIError
from hyperserve.common.sse import DONE, parse_sse_data

if TYPE_CHECKING:
    from hyperserve.gateway.app import Answer


async def answer_chunks(answer: Callable[[], Awaitable[Answer]]) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed `answer()`. Nothing is asked of the gateway until the first chunk
    is, so a request cancelled before it ran holds no backend connection."""
    reply = await answer()
    if reply.events is None:  # refused before any stream (a cascade's every stage failed)
        error = (reply.body or {}).get("error") or {}
        raise APIError(reply.status, str(error.get("message") or "the backend refused the request"),
                       type_=error.get("type") or "bad_gateway")
    failure = None
    async with contextlib.aclosing(reply.events) as events:
        async for event in events:  # to the end: the stream's last step caches and logs the answer
            data = parse_sse_data(event)
            if data is None or data == DONE:
                continue
            chunk = json.loads(data)  # the gateway's own events, re-encoded from the backend's
            if "error" in chunk:
                failure = chunk["error"]
                continue
            yield chunk
    if failure is not None:
        raise APIError(502, str(failure.get("message")), type_=failure.get("type") or "bad_gateway")


def close_later(chunks: AsyncIterator[dict[str, Any]], tasks: set[asyncio.Task]) -> None:
    """Stream.close: ends a stream its reader left part-way (its backend connection with it);
    the task stays in `tasks` until it is done."""
    async def close() -> None:
        with contextlib.suppress(RuntimeError):  # still running: its own cancellation ends it
            await chunks.aclose()

    task = asyncio.get_running_loop().create_task(close())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
