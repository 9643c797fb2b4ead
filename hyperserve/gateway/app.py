"""The gateway's HTTP front: OpenAI's API in, cache -> route -> backend, OpenAI's API out.

Per request: parse, look up the response cache (exact, then semantic), and on a miss forward to a
backend picked by the route (streaming passes through chunk by chunk and is folded into a complete
answer for the cache). Headers say what happened: `x-hyperserve-cache: hit-exact | hit-semantic |
miss | bypass`, `x-hyperserve-similarity`, `x-hyperserve-backend`, `x-hyperserve-cascade`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hyperserve.common.affinity import affinity_text
from hyperserve.common.body_limit import BodyLimit
from hyperserve.common.errors import APIError, install_error_handlers
from hyperserve.common.request_log import RequestLog
from hyperserve.common.sse import DONE, parse_sse_data, sse_event
from hyperserve.common.web_ui import install_web_ui
from hyperserve.gateway.backends import Backend, build_backend, wait_ready
from hyperserve.gateway.cache_store import RedisStore, SQLiteStore
from hyperserve.gateway.config import GatewayConfig
from hyperserve.gateway.response_cache import CacheKey, ResponseCache, cache_key, is_deterministic
from hyperserve.gateway.router import Route, Router
from hyperserve.gateway.streaming import StreamAccumulator, replay
from hyperserve.gateway.telemetry import GatewayMetrics
from hyperserve.security.middleware import Governor, add_security

logger = logging.getLogger("hyperserve.gateway")


def build_cache(config: GatewayConfig) -> ResponseCache | None:
    c = config.cache
    if not c.enabled:
        return None
    if c.store == "redis":
        try:
            store = RedisStore(c.redis_url, c.redis_prefix, c.max_entries, c.timeout_s)
        except Exception as error:
            raise ValueError(f"cache.redis_url: cannot reach {c.redis_url}: {error}") from error
    else:
        store = SQLiteStore(":memory:" if c.store == "memory" else c.path, c.max_entries)
    embedder = None
    if c.semantic.enabled:
        from hyperserve.common.embedder import shared_embedder

        embedder = shared_embedder()
    index_dir = Path(c.path).with_suffix(".index") if c.store == "sqlite" else None  # Redis replicas replay
    return ResponseCache(store, c.ttl_s, embedder, c.semantic.threshold, index_dir, c.timeout_s)


@dataclass
class _State:
    router: Router | None = None
    cache: ResponseCache | None = None
    backends: dict[str, Backend] = field(default_factory=dict)
    ready: bool = False
    start_error: str | None = None
    pending: set[asyncio.Task] = field(default_factory=set)  # cache inserts after the answer went out


def build_gateway_app(config: GatewayConfig, embedded: dict[str, Any] | None = None,
                      max_body_bytes: int = 4 * 2**20, governor: Governor | None = None) -> FastAPI:
    """`embedded`: backend name -> ASGI app served in this process on a private Unix socket (how
    `hyperserve serve --semantic-cache` puts the cache in front of its own engine)."""
    state = _State()
    metrics = GatewayMetrics()
    log = RequestLog(config.log.path)
    embedded = embedded or {}
    socket_dir = tempfile.mkdtemp(prefix="hyperserve-") if embedded else None
    sockets = {name: os.path.join(socket_dir, f"{name}.sock") for name in embedded}

    async def start() -> list[Any]:
        servers = []
        for name, app in embedded.items():
            server = _EmbeddedServer(uvicorn.Config(app, uds=sockets[name], log_level="warning"))
            servers.append((server, asyncio.create_task(server.serve())))
        for b in config.backends:
            state.backends[b.name] = build_backend(b, config.breaker, uds=sockets.get(b.name))
        routes = {r.model: Route(r, [(state.backends[ref.name], ref.weight or state.backends[ref.name].weight)
                                     for ref in r.backend_refs()]) for r in config.routes}
        state.router = Router(routes, metrics)
        state.cache = await asyncio.to_thread(build_cache, config)
        if state.cache is not None:
            if state.cache.embedder is not None:
                await state.cache.embedder.embed_async(["warm up"])  # the first call is ~30x slower
            count = await asyncio.to_thread(state.cache.sync_index)
            logger.info("response cache ready: %d entries indexed", count)
        return servers

    async def wait_for_backends() -> None:
        try:
            await asyncio.gather(*(wait_ready(b) for b in state.backends.values()))
            state.ready = True
            logger.info("gateway ready: routes %s", sorted(state.router.routes))
        except Exception as error:
            state.start_error = str(error)
            logger.error("gateway start failed: %s", error)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        servers = await start()
        waiter = asyncio.create_task(wait_for_backends())
        yield
        waiter.cancel()
        if state.pending:
            await asyncio.gather(*state.pending, return_exceptions=True)
        for backend in state.backends.values():
            await backend.close()
        for server, task in servers:
            server.should_exit = True
            await task
        if state.cache is not None:
            state.cache.close()
        log.close()

    app = FastAPI(title="HyperServe gateway", lifespan=lifespan)
    add_security(app, governor)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        backends = {name: "up" if b.breaker.is_closed else "down" for name, b in state.backends.items()}
        status = "ok" if state.ready else state.start_error or "starting"
        return JSONResponse({"status": status, "backends": backends}, status_code=200 if state.ready else 503)

    def refresh_backend_health() -> None:
        for name, backend in state.backends.items():
            metrics.backend_up.labels(name).set(1 if backend.breaker.is_closed else 0)

    @app.get("/metrics")
    async def prometheus() -> Response:
        refresh_backend_health()
        text = generate_latest(metrics.registry).decode()
        for name in embedded:  # the in-process engine's own metrics, so one scrape sees everything
            with contextlib.suppress(aiohttp.ClientError):
                async with state.backends[name].session.get("/metrics") as upstream:
                    text += await upstream.text()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "hyperserve"}
                                           for name in sorted(state.router.routes if state.router else [])]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "DELETE"])
    async def engine_endpoints(path: str, request: Request) -> Response:
        """With one in-process engine, its other endpoints (/v1/cache pins) pass straight through."""
        if len(embedded) != 1:
            raise APIError(404, f"no endpoint /v1/{path}", code="not_found")
        backend = state.backends[next(iter(embedded))]
        async with backend.session.request(request.method, f"/v1/{path}", data=await request.body(),
                                           headers={"content-type": "application/json"}) as upstream:
            return Response(await upstream.read(), status_code=upstream.status,
                            media_type=upstream.headers.get("content-type"))

    async def handle(request: Request, chat: bool) -> Response:
        started = time.perf_counter()
        if not state.ready:
            raise APIError(503, f"the gateway is {state.start_error or 'starting'}", type_="service_unavailable",
                           headers={"Retry-After": "5"})
        body = await _json_body(request, chat)
        name = body.get("model") or _default_route(state.router)
        route = state.router.route(name)
        kind = "chat" if chat else "completion"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        stream = body.get("stream") is True
        include_usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))
        record: dict[str, Any] = {"id": uuid.uuid4().hex[:16], "route": name, "kind": kind, "stream": stream}
        timings: dict[str, float] = {}

        key: CacheKey | None = None
        vector = None
        mode = request.headers.get("x-hyperserve-cache", "").lower()
        if state.cache is not None and mode != "off" and (mode == "on" or is_deterministic(body)):
            key = cache_key(kind, name, body, getattr(request.state, "cache_scope", None))  # set by security
            t = time.perf_counter()
            try:
                hit, vector = await state.cache.lookup(key)
            except Exception as error:  # an unreachable or slow store degrades to a miss, never to an error
                logger.warning("response cache: lookup failed, serving a miss: %s: %s", type(error).__name__, error)
                hit, vector = None, None
            timings["cache_lookup"] = time.perf_counter() - t
            metrics.cache_lookup.labels(f"hit-{hit.kind}" if hit else "miss").observe(timings["cache_lookup"])
            if hit is not None:
                answer = {**hit.entry.response, "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                          "created": int(time.time())}
                headers = {"x-hyperserve-cache": f"hit-{hit.kind}", "x-hyperserve-similarity": f"{hit.similarity:.4f}"}
                finish(record, timings, started, f"hit-{hit.kind}", 200, answer.get("usage"),
                       similarity=round(hit.similarity, 4))
                if stream:
                    return StreamingResponse(replay(answer, chat, include_usage), media_type="text/event-stream",
                                             headers=headers)
                return JSONResponse(answer, headers=headers)
        cache_state = "miss" if key is not None else "bypass"
        affinity = affinity_text(body, chat)[: route.config.affinity_prefix_chars]

        if stream and route.config.cascade is None:
            upstream = {**body, "stream_options": {"include_usage": True}}  # token counts for the log
            lines, backend = await state.router.stream(name, path, upstream, affinity)
            record["backend"] = backend
            relay = _relay(lines, chat, include_usage, key, vector, record, timings, started, cache_state)
            return StreamingResponse(relay, media_type="text/event-stream",
                                     headers={"x-hyperserve-cache": cache_state, "x-hyperserve-backend": backend,
                                              "Cache-Control": "no-cache"})

        reply = await state.router.complete(name, path, {**body, "stream": False}, affinity)
        timings["backend"] = reply.backend_s
        record["backend"] = reply.backend
        headers = {"x-hyperserve-cache": cache_state, "x-hyperserve-backend": reply.backend}
        if reply.cascade:
            headers["x-hyperserve-cascade"] = ",".join(reply.cascade)
            record["cascade"] = reply.cascade
        if key is not None and reply.status == 200 and _finished(reply.body):
            remember(key, reply.body, vector)
        if route.config.cascade is None and not stream:
            metrics.overhead.observe(max(0.0, time.perf_counter() - started - reply.backend_s))
        finish(record, timings, started, cache_state, reply.status, reply.body.get("usage"))
        if stream:
            return StreamingResponse(replay(reply.body, chat, include_usage), media_type="text/event-stream",
                                     headers=headers)
        return JSONResponse(reply.body, status_code=reply.status, headers=headers)

    async def _relay(lines: AsyncIterator[str], chat: bool, include_usage: bool, key: CacheKey | None, vector: Any,
                     record: dict[str, Any], timings: dict[str, float], started: float,
                     cache_state: str) -> AsyncIterator[str]:
        folded = StreamAccumulator(chat)
        status = 200
        try:
            async for line in lines:
                data = parse_sse_data(line)
                if data is None:
                    continue
                if data == DONE:
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"the backend sent a non-object event: {data[:100]}")
                if "error" in chunk:
                    status = 502
                else:
                    folded.add(chunk)
                    if "ttft" not in timings:
                        timings["ttft"] = time.perf_counter() - started
                if chunk.get("usage") and not chunk.get("choices") and not include_usage:
                    continue  # we asked for usage; the client did not
                yield sse_event(data)
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            status = 502
            yield sse_event(APIError(502, f"the backend stream broke: {error}", type_="bad_gateway").body())
        finally:
            await lines.aclose()  # releases the connection (and the backend's outstanding count) now
        yield sse_event(DONE)
        answer = folded.response()
        if key is not None and status == 200 and answer is not None:
            remember(key, answer, vector)
        finish(record, timings, started, cache_state, status, folded.usage)

    async def insert(key: CacheKey, body: dict[str, Any], vector: Any) -> None:
        try:
            await state.cache.insert(key, body, vector)
        except Exception as error:  # a cache that cannot store (Redis down, disk full) must not fail requests
            logger.warning("response cache: insert failed: %s: %s", type(error).__name__, error)

    def remember(key: CacheKey, body: dict[str, Any], vector: Any) -> None:
        task = asyncio.create_task(insert(key, body, vector))
        state.pending.add(task)
        task.add_done_callback(state.pending.discard)

    def finish(record: dict[str, Any], timings: dict[str, float], started: float, cache: str, status: int,
               usage: dict[str, Any] | None, **extra: Any) -> None:
        metrics.requests.labels(record["route"], cache, str(status)).inc()
        timings["total"] = time.perf_counter() - started
        log.write({**record, **extra, "cache": cache, "status": status,
                   "latency_ms": {k: round(v * 1000, 2) for k, v in timings.items()},
                   "tokens": {"prompt": (usage or {}).get("prompt_tokens"),
                              "completion": (usage or {}).get("completion_tokens")}})

    async def embedded_samples() -> dict[str, list]:
        """The in-process engine's /stats samples, so its dashboard sits beside the gateway's."""
        merged: dict[str, list] = {}
        for name in embedded:
            with contextlib.suppress(aiohttp.ClientError, ValueError, KeyError):
                async with state.backends[name].session.get("/stats") as upstream:
                    for sample_name, samples in (await upstream.json())["samples"].items():
                        merged.setdefault(sample_name, []).extend(samples)
        return merged

    install_web_ui(app, metrics.registry, "gateway", refresh_backend_health, embedded_samples)
    return app


class _EmbeddedServer(uvicorn.Server):
    """An engine server inside the gateway's process: the gateway's own server owns the signals,
    drains its requests, then stops this one from its shutdown."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _json_body(request: Request, chat: bool) -> dict[str, Any]:
    """The parsed body, checked just enough to route and cache it; the backend validates the rest."""
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise APIError(400, "model must be a string", param="model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise APIError(400, "messages must be a non-empty list of message objects", param="messages")
    elif "prompt" not in body:
        raise APIError(400, "prompt is required", param="prompt")
    return body


def _default_route(router: Router) -> str:
    if len(router.routes) == 1:
        return next(iter(router.routes))
    raise APIError(400, f"model is required; this gateway serves {sorted(router.routes)}", param="model")


def _finished(body: dict[str, Any]) -> bool:
    choices = body.get("choices") or []
    return bool(choices) and all(c.get("finish_reason") in ("stop", "length") for c in choices)
