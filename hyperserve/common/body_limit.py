"""BodyLimit: request bodies over a size get 413 before any handler reads them."""

from __future__ import annotations

from hyperserve.common.asgi import send_json
from hyperserve.common.errors import APIError


class BodyLimit:
    """Reject request bodies over `max_bytes` with 413, whether or not Content-Length is sent."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send) -> None:
        await send_json(send, 413, APIError(413, f"request body exceeds {self.max_bytes} bytes").body())


class _TooLarge(Exception):
    pass
