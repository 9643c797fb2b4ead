"""Other APIs answered by chat completions: what OpenAI's Responses API (common/responses_api.py) and
Anthropic's Messages API (common/anthropic_api.py) share.

A translated request re-enters the app at its chat endpoint, so API keys, rate limits, guardrails,
metrics and (in the gateway) caching and routing apply to it as to chat; `ChatRelay` then writes the
app's answer, whole or streamed, through a `Translator` into the other API's shape. Both stream as
server-sent events named by their `type` (`event: <type>` then `data: <json>`).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from hyperserve.common.asgi import is_event_stream, read_body, replay, without_content_length
from hyperserve.common.errors import APIError
from hyperserve.common.sse import EventSplitter, sse_chunks

CHAT_PATH = "/v1/chat/completions"


class Translator(Protocol):
    """One request's answer in another API's shape (the stream's methods return its events in order)."""

    def from_completion(self, completion: dict[str, Any]) -> dict[str, Any]: ...  # a whole answer

    def start(self) -> list[dict[str, Any]]: ...  # a stream's first events, before any chunk

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]: ...  # one chat chunk (or error event)

    def finish(self) -> list[dict[str, Any]]: ...  # after the last chunk

    def translate_error(self, body: dict[str, Any], status: int) -> dict[str, Any]: ...  # an OpenAI-style one


async def read_json(receive) -> dict[str, Any]:
    """The request body as a JSON object; 400 otherwise."""
    try:
        body = json.loads(await read_body(receive))
    except (ValueError, RecursionError) as bad:
        raise APIError(400, f"the request body is not valid JSON: {bad}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


async def call_app(app, scope, receive, send, body: dict[str, Any], translator: Translator,
                   path: str = CHAT_PATH) -> None:
    """POST `body` to the app's `path` (its chat endpoint) for this request; the answer goes to `send`
    translated. The client's own messages (its disconnect) still reach the app."""
    data = json.dumps(body).encode()
    headers = without_content_length(scope["headers"])
    inner = {**scope, "method": "POST", "path": path, "raw_path": path.encode(),
             "headers": headers + [(b"content-length", str(len(data)).encode())]}
    await app(inner, replay(data, receive), ChatRelay(send, translator).send)


def event_stream(events: list[dict[str, Any]]) -> bytes:
    return "".join(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n" for event in events).encode()


class ChatRelay:
    """Wraps the app's `send`: its answer (JSON, or server-sent events) goes out translated. Errors
    keep their status and headers (Retry-After), their body in the other API's shape."""

    def __init__(self, send, translator: Translator) -> None:
        self._send, self.translator = send, translator
        self._start: dict[str, Any] | None = None
        self._streaming = False
        self._buffer = b""  # a JSON answer's body so far
        self._events_in = EventSplitter()  # a streamed one's events

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = without_content_length(message.get("headers", []))
            self._streaming = message["status"] == 200 and is_event_stream(headers)
            self._start = {**message, "headers": headers}
            if self._streaming:
                await self._send(self._start)
                await self._events(self.translator.start(), more=True)
            return
        if message["type"] != "http.response.body":
            return await self._send(message)
        body, more = message.get("body", b""), message.get("more_body", False)
        if self._streaming:
            chunks = sse_chunks(self._events_in.feed(body, final=not more))
            events = [event for chunk in chunks for event in self.translator.feed(chunk)]
            if not more:
                events += self.translator.finish()
            return await self._events(events, more)
        self._buffer += body
        if more:
            return
        answer = self._buffer
        try:
            parsed = json.loads(answer)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            if self._start["status"] == 200 and "error" not in parsed:
                answer = json.dumps(self.translator.from_completion(parsed)).encode()
            elif isinstance(parsed.get("error"), dict):
                answer = json.dumps(self.translator.translate_error(parsed, self._start["status"])).encode()
        self._start["headers"].append((b"content-length", str(len(answer)).encode()))
        await self._send(self._start)
        await self._send({"type": "http.response.body", "body": answer})

    async def _events(self, events: list[dict[str, Any]], more: bool) -> None:
        await self._send({"type": "http.response.body", "body": event_stream(events), "more_body": more})
