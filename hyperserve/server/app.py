"""The HTTP server: FastAPI routes, SSE and WebSocket transports, errors, health and metrics.

The model loads in the background after the socket opens, so /health answers 503 until it is
ready. Every error leaves as an OpenAI-style body; nothing a client sends produces a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyperserve.engine.engine import LLMEngine
from hyperserve.security.middleware import Governor
from hyperserve.server.async_engine import AsyncEngine
from hyperserve.server.metrics import ServerMetrics
from hyperserve.server.openai_api import APIError, Job, OpenAIServing
from hyperserve.server.protocol import CacheRequest, ChatCompletionRequest, CompletionRequest, now

logger = logging.getLogger("hyperserve.server")


@dataclass
class ServerSettings:
    model_name: str
    max_queue: int = 256  # waiting requests beyond which new ones get 429
    max_body_bytes: int = 4 * 2**20
    disconnect_poll_s: float = 0.25


@dataclass
class _State:
    serving: OpenAIServing | None = None
    async_engine: AsyncEngine | None = None
    load_error: str | None = None
    shutting_down: bool = False
    websockets: set[asyncio.Task] = field(default_factory=set)


def build_app(
    load_engine: Callable[[], LLMEngine],
    settings: ServerSettings,
    on_load_error: Callable[[Exception], None] | None = None,
    governor: Governor | None = None,
) -> FastAPI:
    state = _State()
    metrics = ServerMetrics(settings.model_name)

    async def load() -> None:
        try:
            engine = await asyncio.to_thread(load_engine)
        except Exception as error:
            logger.exception("model failed to load")
            state.load_error = f"{type(error).__name__}: {error}"
            if on_load_error is not None:
                on_load_error(error)
            return
        state.async_engine = AsyncEngine(engine, on_step=metrics.observe_step)
        state.serving = OpenAIServing(state.async_engine, settings.model_name, settings.max_queue)
        logger.info("model %s ready", settings.model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(load())
        yield
        state.shutting_down = True
        loader.cancel()
        if state.async_engine is not None:
            await asyncio.to_thread(state.async_engine.shutdown)

    app = FastAPI(title="HyperServe", lifespan=lifespan)
    add_security(app, governor)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)  # added last: outermost

    def serving() -> OpenAIServing:
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", type_="service_unavailable",
                           headers={"Retry-After": "5"})
        if state.serving is None:
            message = f"the model failed to load: {state.load_error}" if state.load_error else "the model is loading"
            raise APIError(503, message, type_="service_unavailable", headers={"Retry-After": "5"})
        return state.serving

    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if state.serving is None or state.shutting_down:
            return JSONResponse({"status": state.load_error or "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        s = serving()
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": now(),
                                            "owned_by": "hyperserve", "max_model_len": s.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        s = serving()
        return await _respond(s, s.prepare_completion(body), body.stream, request, settings)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        s = serving()
        return await _respond(s, s.prepare_chat(body), body.stream, request, settings)

    @app.post("/v1/cache")
    async def pin_cache(body: CacheRequest) -> dict[str, Any]:
        return await serving().pin(body)

    @app.delete("/v1/cache/{pin_id}")
    async def unpin_cache(pin_id: str) -> dict[str, Any]:
        if not serving().engine.unpin(pin_id):
            raise APIError(404, f"no pinned prefix {pin_id!r}", param="id", code="cache_not_found")
        return {"id": pin_id, "object": "cache.deleted", "deleted": True}

    @app.websocket("/v1/ws")
    async def websocket(ws: WebSocket) -> None:
        await _serve_websocket(ws, serving)

    return app


def add_security(app: FastAPI, governor: Governor | None) -> None:
    """API keys, limits and guardrails (hyperserve.security), inside the body-size limit."""
    if governor is not None:
        from hyperserve.security.middleware import SecurityMiddleware

        app.add_middleware(SecurityMiddleware, governor=governor)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI-style body (shared by the server and the gateway)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(error.errors()), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        body = APIError(error.status_code, str(error.detail)).body()
        return JSONResponse(body, status_code=error.status_code)


async def _respond(s: OpenAIServing, job: Job, stream: bool, request: Request, settings: ServerSettings) -> Response:
    s.start(job)
    if stream:
        return StreamingResponse(_sse(s, job), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": job.id})
    try:
        body = await _unless_disconnected(s.collect(job), request, settings.disconnect_poll_s)
    finally:
        job.close()
    if body is None:
        return Response(status_code=499)  # the client is gone; the request was aborted
    return JSONResponse(body, headers={"Server-Timing": _server_timing(job), "X-Request-Id": job.id})


async def _sse(s: OpenAIServing, job: Job) -> AsyncIterator[str]:
    """Server-sent events as OpenAI sends them. A client that disconnects cancels this
    generator, which aborts the request in the engine (AsyncEngine.generate's finally)."""
    try:
        async for chunk in s.stream_chunks(job):
            yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as error:  # mid-stream failures become an error event, never a broken stream
        yield f"data: {json.dumps(APIError(500, str(error), type_='server_error').body())}\n\n"
    yield "data: [DONE]\n\n"


async def _unless_disconnected(work, request: Request, poll_s: float):
    """Await `work`, cancelling it (and so aborting the engine request) if the client leaves."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None


def _server_timing(job: Job) -> str:
    """queue, prefill and decode time of the job's first request, in milliseconds."""
    m = job.finals[0].metrics if job.finals and job.finals[0] else None
    if m is None or m.first_scheduled_time is None or m.first_token_time is None or m.finished_time is None:
        return ""
    parts = {
        "queue": m.first_scheduled_time - m.arrival_time,
        "prefill": m.first_token_time - m.first_scheduled_time,
        "decode": m.finished_time - m.first_token_time,
    }
    return ", ".join(f"{name};dur={seconds * 1000:.1f}" for name, seconds in parts.items())


async def _serve_websocket(ws: WebSocket, serving: Callable[[], OpenAIServing]) -> None:
    """JSON messages in: {"type": "chat.completions" | "completions", "request_id", "body"} or
    {"type": "cancel", "request_id"}. Out: {"type": "chunk" | "done" | "cancelled" | "error", ...}."""
    await ws.accept()
    tasks: dict[str, asyncio.Task] = {}
    jobs: dict[str, Job] = {}
    send_lock = asyncio.Lock()

    async def send(message: dict[str, Any]) -> None:
        async with send_lock:
            await ws.send_json(message)

    async def run(request_id: str, job: Job, s: OpenAIServing) -> None:
        try:
            async for chunk in s.stream_chunks(job):
                await send({"type": "chunk", "request_id": request_id, "data": chunk})
            await send({"type": "done", "request_id": request_id})
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await send({"type": "cancelled", "request_id": request_id})
            raise
        finally:
            tasks.pop(request_id, None)
            jobs.pop(request_id).close()

    try:
        while True:
            message = await ws.receive_json()
            request_id = str(message.get("request_id") or f"ws-{len(tasks)}-{now()}")
            try:
                kind = message.get("type")
                if kind == "cancel":
                    task = tasks.get(request_id)
                    if task is not None:
                        task.cancel()
                    continue
                s = serving()
                if kind == "chat.completions":
                    job = s.prepare_chat(ChatCompletionRequest.model_validate(message.get("body") or {}))
                elif kind == "completions":
                    job = s.prepare_completion(CompletionRequest.model_validate(message.get("body") or {}))
                else:
                    raise APIError(400, f"unknown message type {kind!r}; expected chat.completions, "
                                        "completions or cancel", param="type")
                if request_id in tasks:
                    raise APIError(400, f"request_id {request_id!r} is already running", param="request_id")
                s.start(job)
                jobs[request_id] = job
                tasks[request_id] = asyncio.create_task(run(request_id, job, s))
            except ValidationError as error:
                await send({"type": "error", "request_id": request_id, **_validation_body(error.errors())})
            except APIError as error:
                await send({"type": "error", "request_id": request_id, "status": error.status, **error.body()})
    except (WebSocketDisconnect, json.JSONDecodeError, RuntimeError):
        pass
    finally:
        for job in list(jobs.values()):
            job.close()  # covers tasks cancelled before they ever ran
        for task in list(tasks.values()):
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


def _validation_body(errors: list[dict[str, Any]]) -> dict[str, Any]:
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}").body()
    location = [str(part) for part in first.get("loc", []) if part != "body"]
    param = location[0] if location else None  # the top-level field, as OpenAI names it
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', []) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors)
    return APIError(400, message, param=param).body()


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
        body = json.dumps(APIError(413, f"request body exceeds {self.max_bytes} bytes").body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
