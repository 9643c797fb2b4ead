"""The gateway's HTTP and WebSocket endpoints: each parses what it is sent, asks the Gateway
(gateway/app.py), and answers in OpenAI's shapes."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from hyperserve.common.errors import APIError
from hyperserve.common.websocket_api import OpenStream, Stream, serve_websocket
from hyperserve.gateway.websocket import answer_chunks, close_later

if TYPE_CHECKING:
    from hyperserve.gateway.app import Answer, Gateway

routes = APIRouter()


def _gateway(connection: Request | WebSocket) -> Gateway:
    return connection.app.state.gateway


@routes.get("/health")
async def health(request: Request) -> Response:
    return _gateway(request).health()


@routes.get("/metrics")
async def prometheus(request: Request) -> Response:
    return Response(await _gateway(request).metrics_text(), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "hyperserve"}
                                       for name in _gateway(request).model_names()]}


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


@routes.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def _complete(request: Request, chat: bool) -> Response:
    started = time.perf_counter()
    gateway = _gateway(request)
    gateway.check_ready()
    body = await _json_body(request, "chat" if chat else "completion")
    return _response(await gateway.answer(body, chat, getattr(request.state, "cache_scope", None),
                                          request.headers.get("x-hyperserve-cache", ""), started))


@routes.post("/v1/embeddings")
@routes.post("/v1/score")
@routes.post("/v1/rerank")
async def embeddings(request: Request) -> Response:
    gateway = _gateway(request)
    gateway.check_ready()
    path = request.url.path
    body = await _json_body(request, {"/v1/score": "score", "/v1/rerank": "rerank"}.get(path, "embedding"))
    return _response(await gateway.embed(body, path))


@routes.websocket("/v1/ws")
async def websocket(ws: WebSocket) -> None:
    await serve_websocket(ws, _gateway_streams(_gateway(ws)))


@routes.api_route("/v1/{path:path}", methods=["GET", "POST", "DELETE"])
async def engine_endpoints(path: str, request: Request) -> Response:
    return await _gateway(request).pass_through(path, request)


def _response(answer: Answer) -> Response:
    if answer.events is not None:
        return StreamingResponse(answer.events, media_type="text/event-stream", headers=answer.headers)
    return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers)


def _gateway_streams(gateway: Gateway) -> OpenStream:
    """How WS /v1/ws opens a request (gateway/websocket.py): checked now, answered as it is read,
    as its HTTP twin with `"stream": true` would be."""
    async def open_stream(kind: str, body: dict[str, Any], ws: WebSocket) -> Stream:
        gateway.check_ready()
        chat = kind == "chat.completions"
        check_body(body, "chat" if chat else "completion")
        scope = getattr(ws.state, "cache_scope", None)
        chunks = answer_chunks(lambda: gateway.answer({**body, "stream": True}, chat, scope, "",
                                                      time.perf_counter()))
        return Stream(chunks, lambda: close_later(chunks, gateway.pending))

    return open_stream


async def _json_body(request: Request, kind: str) -> dict[str, Any]:
    """The parsed body of a `kind` request (chat, completion, embedding, score or rerank), checked
    by check_body."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_body(body, kind)
    return body


def check_body(body: dict[str, Any], kind: str) -> None:
    """A `kind` request's body checked just enough to route and cache it; the backend validates
    the rest."""
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise APIError(400, "model must be a string", param="model")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise APIError(400, "messages must be a non-empty list of message objects", param="messages")
    else:  # what an embedding-made answer needs: /v1/embeddings' input, /v1/score's texts, /v1/rerank's query
        needed = {"completion": ["prompt"], "embedding": ["input"], "score": ["text_1", "text_2"],
                  "rerank": ["query", "documents"]}[kind]
        for field_name in needed:
            if field_name not in body:
                raise APIError(400, f"{field_name} is required", param=field_name)
