"""WS /v1/ws: chat and completion requests over one WebSocket, each streamed and cancellable.

JSON messages in (text frames, or binary ones holding the JSON as UTF-8):
{"type": "chat.completions" | "completions", "request_id", "body"} or {"type": "cancel", "request_id"}.
Out: {"type": "chunk" | "done" | "cancelled" | "error", "request_id", ...}, a chunk's `data` being
what the HTTP endpoint would stream. A frame that is not a JSON object, or lacks what its type needs,
gets an error event; the socket stays open. The protocol is shared by `hyperserve serve`, whose
engine answers in process, and the Ray Serve ingress, which hands each request to a replica: each
gives `serve_websocket` how it opens a request's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.websockets import WebSocket, WebSocketDisconnect

from hyperserve.common.errors import APIError, validation_body

KINDS = ("chat.completions", "completions")


@dataclass
class Stream:
    """One request's chunks, and how to stop it: `close` is called however the request ends,
    also when it was cancelled before its first chunk, and may be called twice."""

    chunks: AsyncIterator[dict[str, Any]]
    close: Callable[[], None]


# (kind, body, socket) -> the request's stream; raises APIError or ValidationError for a bad request
OpenStream = Callable[[str, dict[str, Any], WebSocket], Awaitable[Stream]]


async def serve_websocket(ws: WebSocket, open_stream: OpenStream) -> None:
    await ws.accept(subprotocol="hyperserve" if "hyperserve" in ws.scope.get("subprotocols", []) else None)
    tasks: dict[str, asyncio.Task] = {}
    streams: dict[str, Stream] = {}
    send_lock = asyncio.Lock()

    async def send(message: dict[str, Any]) -> None:
        async with send_lock:
            await ws.send_json(message)

    async def error(request_id: str | None, error: APIError) -> None:
        await send({"type": "error", "request_id": request_id, "status": error.status, **error.body()})

    async def run(request_id: str, stream: Stream) -> None:
        try:
            async for chunk in stream.chunks:
                await send({"type": "chunk", "request_id": request_id, "data": chunk})
            await send({"type": "done", "request_id": request_id})
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await send({"type": "cancelled", "request_id": request_id})
            raise
        except APIError as failure:
            with contextlib.suppress(Exception):
                await error(request_id, failure)
        finally:
            tasks.pop(request_id, None)
            streams.pop(request_id).close()

    async def handle(message: dict[str, Any], request_id: str) -> None:
        kind = message.get("type")
        if kind == "cancel":
            task = tasks.get(request_id)
            if task is not None:
                task.cancel()
            return
        if kind not in KINDS:
            raise APIError(400, f"unknown message type {kind!r}; expected chat.completions, completions "
                                "or cancel", param="type")
        body = message.get("body")
        if not isinstance(body, dict):
            raise APIError(400, "body must be a JSON object (the request, as for the HTTP endpoint)",
                           param="body")
        if request_id in tasks:
            raise APIError(400, f"request_id {request_id!r} is already running", param="request_id")
        streams[request_id] = await open_stream(kind, body, ws)
        tasks[request_id] = asyncio.create_task(run(request_id, streams[request_id]))

    try:
        while True:
            frame = await ws.receive()
            if frame["type"] == "websocket.disconnect":
                break
            request_id = None
            try:
                text = frame["text"] if frame.get("text") is not None else frame.get("bytes") or b""
                try:  # a text frame, or a binary one holding the same JSON as UTF-8
                    message = json.loads(text)
                except ValueError as bad:  # UnicodeDecodeError included
                    raise APIError(400, f"a message must be a JSON object: {bad}") from None
                if not isinstance(message, dict):
                    raise APIError(400, f"a message must be a JSON object, not {type(message).__name__}")
                request_id = message.get("request_id")
                if request_id is not None and not isinstance(request_id, str | int):
                    raise APIError(400, "request_id must be a string", param="request_id")
                if request_id is None:
                    request_id = f"ws-{len(tasks)}-{int(time.time())}"
                request_id = str(request_id)
                await handle(message, request_id)
            except ValidationError as invalid:
                await send({"type": "error", "request_id": request_id, "status": 400,
                            **validation_body(invalid.errors())})
            except APIError as refusal:
                await error(request_id, refusal)
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        for stream in list(streams.values()):
            stream.close()  # covers requests cancelled before they ever ran
        for task in list(tasks.values()):
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
