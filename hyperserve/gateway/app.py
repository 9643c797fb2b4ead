"""The gateway: OpenAI's API in, cache -> route -> backend, OpenAI's API out (its endpoints in
gateway/routes.py).

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
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from hyperserve.common.affinity import affinity_text
from hyperserve.common.anthropic_api import AnthropicAPI
from hyperserve.common.batch_api import BatchAPI
from hyperserve.common.body_limit import BodyLimit
from hyperserve.common.errors import APIError, install_error_handlers
from hyperserve.common.request_log import RequestLog
from hyperserve.common.responses_api import ResponsesAPI
from hyperserve.common.sse import DONE, parse_sse_data, sse_event
from hyperserve.common.web_ui import install_web_ui
from hyperserve.gateway.backends import Backend, build_backend, wait_ready
from hyperserve.gateway.cache_store import RedisStore, SQLiteStore
from hyperserve.gateway.config import GatewayConfig
from hyperserve.gateway.response_cache import CacheKey, ResponseCache, cache_key, is_deterministic
from hyperserve.gateway.router import Route, Router
from hyperserve.gateway.routes import routes
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


class Gateway:
    """The gateway's state (backends, router, response cache, metrics, request log) and what it
    does with a request; build_gateway_app puts the HTTP routes in front of it.
    `embedded`: backend name -> ASGI app served in this process on a private Unix socket (how
    `hyperserve serve --semantic-cache` puts the cache in front of its own engine)."""

    def __init__(self, config: GatewayConfig, embedded: dict[str, Any] | None = None) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.log = RequestLog(config.log.path)
        self.embedded = embedded or {}
        self._socket_dir = tempfile.mkdtemp(prefix="hyperserve-") if self.embedded else None
        self.sockets = {name: os.path.join(self._socket_dir, f"{name}.sock") for name in self.embedded}
        self.router: Router | None = None
        self.cache: ResponseCache | None = None
        self.backends: dict[str, Backend] = {}
        self.ready = False
        self.start_error: str | None = None
        self.pending: set[asyncio.Task] = set()  # cache inserts after the answer went out, streams closing
        self._servers: list[tuple[_EmbeddedServer, asyncio.Task]] = []
        self._waiter: asyncio.Task | None = None

    # ---- lifetime ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Embedded engines, backends, routes and the cache now; ready once every backend answers."""
        for name, app in self.embedded.items():
            server = _EmbeddedServer(uvicorn.Config(app, uds=self.sockets[name], log_level="warning"))
            self._servers.append((server, asyncio.create_task(server.serve())))
        for b in self.config.backends:
            self.backends[b.name] = build_backend(b, self.config.breaker, uds=self.sockets.get(b.name))
        routes = {r.model: Route(r, [(self.backends[ref.name], ref.weight or self.backends[ref.name].weight)
                                     for ref in r.backend_refs()]) for r in self.config.routes}
        self.router = Router(routes, self.metrics)
        self.cache = await asyncio.to_thread(build_cache, self.config)
        if self.cache is not None:
            if self.cache.embedder is not None:
                await self.cache.embedder.embed_async(["warm up"])  # the first call is ~30x slower
            count = await asyncio.to_thread(self.cache.sync_index)
            logger.info("response cache ready: %d entries indexed", count)
        self._waiter = asyncio.create_task(self._wait_for_backends())

    async def _wait_for_backends(self) -> None:
        try:
            await asyncio.gather(*(wait_ready(b) for b in self.backends.values()))
            self.ready = True
            logger.info("gateway ready: routes %s", sorted(self.router.routes))
        except Exception as error:
            self.start_error = str(error)
            logger.error("gateway start failed: %s", error)

    async def close(self) -> None:
        if self._waiter is not None:
            self._waiter.cancel()
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)
        for backend in self.backends.values():
            await backend.close()
        for server, task in self._servers:
            server.should_exit = True
            await task
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self.cache is not None:
            self.cache.close()
        self.log.close()

    # ---- status --------------------------------------------------------------------------------

    def health(self) -> Response:
        backends = {name: "up" if b.breaker.is_closed else "down" for name, b in self.backends.items()}
        status = "ok" if self.ready else self.start_error or "starting"
        return JSONResponse({"status": status, "backends": backends}, status_code=200 if self.ready else 503)

    def refresh_backend_health(self) -> None:
        for name, backend in self.backends.items():
            self.metrics.backend_up.labels(name).set(1 if backend.breaker.is_closed else 0)

    async def metrics_text(self) -> str:
        """The gateway's metrics, and the in-process engine's, so one scrape sees everything."""
        self.refresh_backend_health()
        text = generate_latest(self.metrics.registry).decode()
        for name in self.embedded:
            with contextlib.suppress(aiohttp.ClientError):
                async with self.backends[name].session.get("/metrics") as upstream:
                    text += await upstream.text()
        return text

    async def embedded_samples(self) -> dict[str, list]:
        """The in-process engine's /stats samples, so its dashboard sits beside the gateway's."""
        merged: dict[str, list] = {}
        for name in self.embedded:
            with contextlib.suppress(aiohttp.ClientError, ValueError, KeyError):
                async with self.backends[name].session.get("/stats") as upstream:
                    for sample_name, samples in (await upstream.json())["samples"].items():
                        merged.setdefault(sample_name, []).extend(samples)
        return merged

    def model_names(self) -> list[str]:
        return sorted(self.router.routes if self.router else [])

    # ---- requests ------------------------------------------------------------------------------

    async def pass_through(self, path: str, request: Request) -> Response:
        """With one in-process engine, its other endpoints (/v1/cache pins) pass straight through."""
        if len(self.embedded) != 1:
            raise APIError(404, f"no endpoint /v1/{path}", code="not_found")
        backend = self.backends[next(iter(self.embedded))]
        async with backend.session.request(request.method, f"/v1/{path}", data=await request.body(),
                                           headers={"content-type": "application/json"}) as upstream:
            return Response(await upstream.read(), status_code=upstream.status,
                            media_type=upstream.headers.get("content-type"))

    def check_ready(self) -> None:
        if not self.ready:
            raise APIError(503, f"the gateway is {self.start_error or 'starting'}",
                           type_="service_unavailable",
                           headers={"Retry-After": "5"})

    async def embed(self, body: dict[str, Any], path: str) -> Answer:
        """Embeddings, and the scores and rerankings made of them (/v1/score, /v1/rerank): from a
        backend by the route `model` names (balanced, with retries and fallback as completions are;
        never cached, and a cascade route cannot embed)."""
        name = body.get("model") or _default_route(self.router)
        if self.router.route(name).config.cascade is not None:
            raise APIError(400, f"the route {name!r} is a cascade of generative models; it cannot embed",
                           param="model")
        call = _Call("embedding", False, False, time.perf_counter(),
                     {"id": uuid.uuid4().hex[:16], "route": name})
        reply = await self.router.complete(name, path, body, None)
        call.timings["backend"] = reply.backend_s
        call.record["backend"] = reply.backend
        self._finish(call, "bypass", reply.status, reply.body.get("usage"))
        return Answer(reply.status, {"x-hyperserve-backend": reply.backend}, reply.body)

    async def answer(self, body: dict[str, Any], chat: bool, scope: str | None, cache_mode: str,
                     started: float) -> Answer:
        """A completion (its body checked by routes.check_body): from the response cache where it
        may be, else from a backend by its route. `scope`: the API key's cache scope (security
        sets it), or None; `cache_mode`: the x-hyperserve-cache header (on, off, or empty: cached
        when deterministic)."""
        name = body.get("model") or _default_route(self.router)
        route = self.router.route(name)
        stream = body.get("stream") is True
        include_usage = stream and bool((body.get("stream_options") or {}).get("include_usage"))
        call = _Call("chat" if chat else "completion", stream, include_usage, started,
                     {"id": uuid.uuid4().hex[:16], "route": name})

        mode = cache_mode.lower()
        if self.cache is not None and mode != "off" and (mode == "on" or is_deterministic(body)):
            call.key = cache_key(call.kind, name, body, scope)
            cached = await self._from_cache(call)
            if cached is not None:
                return cached
        call.cache_state = "miss" if call.key is not None else "bypass"
        affinity = affinity_text(body, chat)[: route.config.affinity_prefix_chars]
        path = "/v1/chat/completions" if chat else "/v1/completions"

        if stream and route.config.cascade is None:
            upstream = {**body, "stream_options": {"include_usage": True}}  # token counts for the log
            lines, backend = await self.router.stream(name, path, upstream, affinity, scope)
            call.record["backend"] = backend
            return Answer(200, {"x-hyperserve-cache": call.cache_state, "x-hyperserve-backend": backend,
                                "Cache-Control": "no-cache"}, events=self._relay(lines, call))

        reply = await self.router.complete(name, path, {**body, "stream": False}, affinity, scope)
        call.timings["backend"] = reply.backend_s
        call.record["backend"] = reply.backend
        headers = {"x-hyperserve-cache": call.cache_state, "x-hyperserve-backend": reply.backend}
        if reply.cascade:
            headers["x-hyperserve-cascade"] = ",".join(reply.cascade)
            call.record["cascade"] = reply.cascade
        if call.key is not None and reply.status == 200 and _finished(reply.body):
            self._remember(call, reply.body)
        if route.config.cascade is None and not stream:
            self.metrics.overhead.observe(max(0.0, time.perf_counter() - started - reply.backend_s))
        self._finish(call, call.cache_state, reply.status, reply.body.get("usage"))
        if stream and reply.status == 200:  # a refusal is an HTTP error, not a stream
            events = _aiter(replay(reply.body, chat, call.include_usage))
            return Answer(reply.status, headers, reply.body, events)
        return Answer(reply.status, headers, reply.body)

    async def _from_cache(self, call: _Call) -> Answer | None:
        """The cached answer to `call` (exact, then semantic), or None; a miss keeps the prompt's
        vector on `call` for the insert."""
        t = time.perf_counter()
        try:
            hit, call.vector = await self.cache.lookup(call.key)
        except Exception as error:  # an unreachable or slow store degrades to a miss, never to an error
            logger.warning("response cache: lookup failed, serving a miss: %s: %s",
                           type(error).__name__, error)
            hit, call.vector = None, None
        call.timings["cache_lookup"] = time.perf_counter() - t
        outcome = f"hit-{hit.kind}" if hit else "miss"
        self.metrics.cache_lookup.labels(outcome).observe(call.timings["cache_lookup"])
        if hit is None:
            return None
        answer = {**hit.entry.response, "id": f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}",
                  "created": int(time.time())}
        headers = {"x-hyperserve-cache": outcome, "x-hyperserve-similarity": f"{hit.similarity:.4f}"}
        self._finish(call, outcome, 200, answer.get("usage"), similarity=round(hit.similarity, 4))
        events = _aiter(replay(answer, call.chat, call.include_usage)) if call.stream else None
        return Answer(200, headers, answer, events)

    async def _relay(self, lines: AsyncIterator[str], call: _Call) -> AsyncIterator[str]:
        """A backend's stream to the client as it comes, folded into a whole answer for the cache."""
        folded = StreamAccumulator(call.chat)
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
                    if "ttft" not in call.timings:
                        call.timings["ttft"] = time.perf_counter() - call.started
                if chunk.get("usage") and not chunk.get("choices") and not call.include_usage:
                    continue  # we asked for usage; the client did not
                yield sse_event(data)
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            status = 502
            yield sse_event(APIError(502, f"the backend stream broke: {error}", type_="bad_gateway").body())
        finally:
            await lines.aclose()  # releases the connection (and the backend's outstanding count) now
        yield sse_event(DONE)
        answer = folded.response()
        if call.key is not None and status == 200 and answer is not None:
            self._remember(call, answer)
        self._finish(call, call.cache_state, status, folded.usage)

    def _remember(self, call: _Call, body: dict[str, Any]) -> None:
        """Insert the answer in the cache after it went out, never failing the request."""
        async def insert() -> None:
            try:
                await self.cache.insert(call.key, body, call.vector)
            except Exception as error:  # a store that cannot (Redis down, disk full) must not fail requests
                logger.warning("response cache: insert failed: %s: %s", type(error).__name__, error)

        task = asyncio.create_task(insert())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    def _finish(self, call: _Call, cache: str, status: int, usage: dict[str, Any] | None,
                **extra: Any) -> None:
        self.metrics.requests.labels(call.record["route"], cache, str(status)).inc()
        call.timings["total"] = time.perf_counter() - call.started
        self.log.write({**call.record, "kind": call.kind, "stream": call.stream, **extra, "cache": cache,
                        "status": status,
                        "latency_ms": {k: round(v * 1000, 2) for k, v in call.timings.items()},
                        "tokens": {"prompt": (usage or {}).get("prompt_tokens"),
                                   "completion": (usage or {}).get("completion_tokens")}})


@dataclass
class _Call:
    """One request as the gateway handles it: what the log records and the cache needs."""

    kind: str  # "chat" | "completion" | "embedding"
    stream: bool
    include_usage: bool
    started: float
    record: dict[str, Any]  # the request log's fields besides the ones above: id, route, backend, cascade
    timings: dict[str, float] = field(default_factory=dict)
    key: CacheKey | None = None  # None: not cached
    vector: Any = None  # the prompt's embedding, from a semantic lookup that missed
    cache_state: str = "bypass"

    @property
    def chat(self) -> bool:
        return self.kind == "chat"


@dataclass
class Answer:
    """A completion as the gateway gives it: a status and headers, with the whole body, the SSE
    events of a streamed request, or both (a cached or cascaded answer, replayed as a stream)."""

    status: int
    headers: dict[str, str]
    body: dict[str, Any] | None = None
    events: AsyncIterator[str] | None = None


async def _aiter(events: Iterable[str]) -> AsyncIterator[str]:
    for event in events:
        yield event


def build_gateway_app(config: GatewayConfig, embedded: dict[str, Any] | None = None,
                      max_body_bytes: int = 4 * 2**20, governor: Governor | None = None,
                      files_dir: Path | None = None) -> FastAPI:
    """A FastAPI app for a Gateway (see Gateway for `embedded`); `files_dir`: where /v1/files keeps
    the Batch API's files (None: a temporary directory)."""
    gateway = Gateway(config, embedded)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await gateway.start()
        yield
        await gateway.close()

    app = FastAPI(title="HyperServe gateway", lifespan=lifespan)
    app.state.gateway = gateway
    add_security(app, governor)
    app.add_middleware(ResponsesAPI, governor=governor)  # /v1/responses over the chat route, keys and all
    app.add_middleware(AnthropicAPI)  # and /v1/messages
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    # /v1/files and /v1/batches, each line through the routes (no `priority`: not every backend takes one)
    app.add_middleware(BatchAPI, governor=governor, files_dir=files_dir, priority=None,
                       registry=gateway.metrics.registry)
    install_error_handlers(app)
    app.include_router(routes)
    install_web_ui(app, gateway.metrics.registry, "gateway", gateway.refresh_backend_health,
                   gateway.embedded_samples)
    return app


class _EmbeddedServer(uvicorn.Server):
    """An engine server inside the gateway's process: the gateway's own server owns the signals,
    drains its requests, then stops this one from its shutdown."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _default_route(router: Router) -> str:
    if len(router.routes) == 1:
        return next(iter(router.routes))
    raise APIError(400, f"model is required; this gateway serves {sorted(router.routes)}", param="model")


def _finished(body: dict[str, Any]) -> bool:
    choices = body.get("choices") or []
    return bool(choices) and all(c.get("finish_reason") in ("stop", "length") for c in choices)
