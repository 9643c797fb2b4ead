"""The HTTP server: FastAPI routes, SSE and WebSocket transports, errors, health and metrics.

The models load in the background after the socket opens, so /health answers 503 until the
pinned ones are ready; requests are routed by `model` (server/model_pool.py: several models, some
loaded on demand). Every error leaves as an OpenAI-style body; nothing a client sends produces a 500. If the
engine stops for good (a device error, out of memory), /health turns 503 at once, every waiting
and running request fails with 503, and `on_engine_dead` is called: `hyperserve serve` then
exits non-zero so that its supervisor (systemd, Kubernetes, Ray) starts a fresh process, since a
process whose device or memory failed is not to be trusted with a restarted engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hyperserve import __version__
from hyperserve.common.anthropic_api import AnthropicAPI
from hyperserve.common.batch_api import BatchAPI
from hyperserve.common.body_limit import BodyLimit
from hyperserve.common.errors import APIError, install_error_handlers, unavailable
from hyperserve.common.responses_api import ResponsesAPI
from hyperserve.common.sse import DONE, sse_event
from hyperserve.common.web_ui import install_web_ui
from hyperserve.common.websocket_api import OpenStream, Stream, serve_websocket
from hyperserve.engine.engine import LLMEngine
from hyperserve.security.middleware import Governor, add_security
from hyperserve.server.embeddings import EmbeddingRequest, EmbeddingServing, RerankRequest, ScoreRequest
from hyperserve.server.lora_adapters import RuntimeAdapters
from hyperserve.server.metrics import ServerMetrics
from hyperserve.server.model_pool import ModelEntry, ModelPool, ServedModel
from hyperserve.server.openai_api import Job, OpenAIServing
from hyperserve.server.protocol import (
    CacheRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    KVPrefillRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
    now,
)
from hyperserve.server.settings import ServerSettings

logger = logging.getLogger("hyperserve.server")


@dataclass
class _State:
    started: bool = False  # the pinned models' loads have finished (or failed)
    shutting_down: bool = False
    websockets: set[asyncio.Task] = field(default_factory=set)
    embeddings: EmbeddingServing | None = None  # once loaded
    embedding_error: str | None = None


def build_app(
    models: Callable[[], LLMEngine] | list[ModelEntry],
    settings: ServerSettings,
    on_load_error: Callable[[Exception], None] | None = None,
    governor: Governor | None = None,
    on_engine_dead: Callable[[BaseException], None] | None = None,
    max_loaded_models: int | None = None,
    idle_unload_s: float | None = 300.0,
    lora_dir: Path | None = None,
    lora_on_demand: bool = False,
    memory_budget_bytes: int | None = None,
    embedding_model: str | None = None,
) -> FastAPI:
    """`models`: one engine factory (served as settings.model_name), or several named models.
    `lora_dir`: the directory /v1/load_lora_adapter may load adapters from (None: none);
    `lora_on_demand`: a request naming one of its folders loads that adapter (lora_adapters.py).
    `memory_budget_bytes`: what the loaded models' weights and KV pools may hold together.
    `embedding_model`: an encoder (common/embedder.py's MODELS) that serves /v1/embeddings."""
    state = _State()
    metrics = ServerMetrics()
    entries = [ModelEntry(settings.model_name, models)] if callable(models) else models
    pool = ModelPool(entries, settings, metrics, on_engine_dead, max_loaded_models, idle_unload_s,
                     memory_budget_bytes)

    async def start() -> None:
        if embedding_model is not None:
            try:
                state.embeddings = await asyncio.to_thread(EmbeddingServing, embedding_model,
                                                           settings.max_queue, metrics)
            except Exception as error:  # noqa: BLE001 - reported by /health; on_load_error stops the server
                state.embedding_error = f"{embedding_model}: {error}"
                if on_load_error is not None:
                    on_load_error(RuntimeError(state.embedding_error))
        await pool.start()
        state.started = True
        failed = [m for m in pool.pinned if m.load_error is not None]
        if failed and on_load_error is not None:
            on_load_error(RuntimeError(f"{failed[0].name}: {failed[0].load_error}"))
        while pool.idle_unload_s is not None:
            await asyncio.sleep(min(pool.idle_unload_s / 4, 5.0))
            await pool.unload_idle()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        background = asyncio.create_task(start())
        yield
        state.shutting_down = True
        background.cancel()
        await pool.shutdown()

    app = FastAPI(title="HyperServe", lifespan=lifespan)
    add_security(app, governor)
    app.add_middleware(ResponsesAPI, governor=governor, store_bytes=settings.responses_store_bytes)
    app.add_middleware(AnthropicAPI)  # /v1/messages over the chat route too
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.batch_api:  # outermost: uploads may exceed max_body_bytes; each line goes through the rest
        app.add_middleware(BatchAPI, governor=governor,
                           files_dir=settings.files_dir and Path(settings.files_dir),
                           concurrency=settings.batch_concurrency,
                           busy_concurrency=settings.batch_concurrency_busy, registry=metrics.registry)

    async def serving(model: str | None) -> OpenAIServing:
        if state.shutting_down:
            raise unavailable("the server is shutting down")
        await adapters.resolve(model)
        s = await pool.serving(model)
        if s.engine.dead is not None:
            raise unavailable(f"the engine stopped and the server is restarting: {s.engine.dead}", 10)
        return s

    adapters = RuntimeAdapters(pool, lora_dir, lora_on_demand, serving)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        """200 once every pinned model is loaded and running (on-demand ones load when asked for)."""
        if embedding_model is not None and state.embeddings is None:
            return JSONResponse({"status": state.embedding_error or "loading"}, status_code=503)
        for model in pool.pinned:
            if model.serving is None or state.shutting_down:
                return JSONResponse({"status": model.load_error or "loading"}, status_code=503)
            if model.async_engine.dead is not None:
                return JSONResponse({"status": f"engine stopped: {model.async_engine.dead}"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """/health under the name vLLM and SageMaker also probe."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """Every model served, with whether it is loaded and how (pinned or on demand), and the
        LoRA adapters on each (`parent`: its base model)."""
        cards = []
        for model in pool.models.values():
            cards.append(_model_card(model))
            cards += [{"id": name, "object": "model", "created": now(), "owned_by": "hyperserve",
                       "parent": model.name, "root": lora.lora_path}
                      for name, lora in model.entry.adapters.items()]
        if state.embeddings is not None:
            cards.append(state.embeddings.card())
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> dict[str, Any]:
        return await adapters.load(body.lora_name, body.lora_path, body.load_inplace)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> dict[str, Any]:
        return adapters.unload(body.lora_name)

    @app.post("/v1/models/{name}/load")
    async def load_model(name: str) -> dict[str, Any]:
        await serving(name)
        return _model_card(pool.model(name))

    @app.post("/v1/models/{name}/unload")
    async def unload_model(name: str) -> dict[str, Any]:
        model = pool.model(name)
        if not model.entry.on_demand:
            raise APIError(400, f"the model {name!r} is pinned (always loaded); only on-demand models unload",
                           param="model")
        if model.busy:
            raise APIError(409, f"the model {name!r} is running requests; unload it once they finish",
                           type_="conflict", code="model_busy")
        await model.unload()
        return _model_card(model)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        s = await serving(body.model)
        job = await s.prepare_completion(body, _scope(request))
        return await _respond(s, job, body.stream, request, settings)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        s = await serving(body.model)
        job = await s.prepare_chat(body, _scope(request))
        return await _respond(s, job, body.stream, request, settings)

    def embedder(model: str | None) -> EmbeddingServing:
        if state.embeddings is None:
            if embedding_model is not None:
                raise unavailable("the embedding model is loading")
            raise APIError(404, "this server serves no embedding model: start it with --embedding-model "
                                "all-MiniLM-L6-v2", param="model", code="model_not_found")
        if model in pool.models:
            raise APIError(400, f"{model!r} is a generative model; embeddings come from "
                                f"{state.embeddings.name!r}", param="model")
        return state.embeddings

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        return await embedder(body.model).embed(body)

    @app.post("/v1/score")
    @app.post("/score")
    async def score(body: ScoreRequest) -> dict[str, Any]:
        return await embedder(body.model).score(body)

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @app.post("/rerank")
    async def rerank(body: RerankRequest) -> dict[str, Any]:
        return await embedder(body.model).rerank(body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await (await serving(body.model)).tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await (await serving(body.model)).detokenize(body)

    @app.post("/v1/cache")
    async def pin_cache(body: CacheRequest, request: Request) -> dict[str, Any]:
        return await (await serving(body.model)).pin(body, _scope(request))

    @app.delete("/v1/cache/{pin_id}")
    async def unpin_cache(pin_id: str) -> dict[str, Any]:
        if not any(m.async_engine.unpin(pin_id) for m in pool.loaded()):
            raise APIError(404, f"no pinned prefix {pin_id!r}", param="id", code="cache_not_found")
        return {"id": pin_id, "object": "cache.deleted", "deleted": True}

    if settings.role == "prefill":
        @app.post("/v1/kv/prefill")
        async def prefill_kv(body: KVPrefillRequest) -> Response:
            body_bytes = await (await serving(body.model)).prefill_kv(body)
            return Response(body_bytes, media_type="application/octet-stream")

    @app.websocket("/v1/ws")
    async def websocket(ws: WebSocket) -> None:
        await serve_websocket(ws, _engine_streams(serving))

    install_web_ui(app, metrics.registry, "server")
    return app


def _scope(connection: Request | WebSocket) -> str | None:
    """The caller's API key's cache scope (security sets it; None without keys): its requests
    share cached KV and n-gram drafts with no other scope's."""
    return getattr(connection.state, "cache_scope", None)


def _model_card(model: ServedModel) -> dict[str, Any]:
    card = {"id": model.name, "object": "model", "created": now(), "owned_by": "hyperserve",
            "loaded": model.serving is not None, "on_demand": model.entry.on_demand,
            "memory_bytes": model.memory_bytes}
    if model.serving is not None:
        card["max_model_len"] = model.serving.max_model_len
    return card


async def _respond(s: OpenAIServing, job: Job, stream: bool, request: Request,
                   settings: ServerSettings) -> Response:
    s.start(job, final_only=not stream)
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
    generator, which aborts the request in the engine (Job.close in OpenAIServing.run)."""
    try:
        async for chunk in s.stream_chunks(job):
            yield sse_event(chunk)
    except APIError as error:  # mid-stream failures become an error event, never a broken stream
        yield sse_event(error.body())
    except Exception as error:
        logger.exception("stream %s failed", job.id)
        yield sse_event(APIError(500, f"internal error: {type(error).__name__}", type_="server_error").body())
    yield sse_event(DONE)


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


def _engine_streams(serving: Callable[[str | None], Awaitable[OpenAIServing]]) -> OpenStream:
    """How the server's WebSocket opens a request: validated and started on its model's engine."""
    async def open_stream(kind: str, body: dict[str, Any], ws: WebSocket) -> Stream:
        model = body.get("model")
        s = await serving(model if isinstance(model, str) else None)  # a wrong type fails validation below
        if kind == "chat.completions":
            job = await s.prepare_chat(ChatCompletionRequest.model_validate(body), _scope(ws))
        else:
            job = await s.prepare_completion(CompletionRequest.model_validate(body), _scope(ws))
        s.start(job)
        return Stream(s.stream_chunks(job), job.close)

    return open_stream
