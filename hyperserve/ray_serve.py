"""HyperServe on Ray Serve: engine replicas across a cluster, autoscaled on load, routed by prefix.

`hyperserve ray-serve` (or `serve run hyperserve.ray_serve:build`, or `serve deploy` with a config
whose import_path is that builder) deploys two Ray Serve deployments:

- Engine (ray_replica.py): one HyperServe engine per replica with its OpenAI app, the very
  `build_app` that `hyperserve serve` runs, called in-process (ASGI) for each request, so every
  endpoint, streaming and error of the plain server behaves the same (the WebSocket, /v1/ws, is the
  ingress's: each of its requests is a streamed HTTP request to a replica). LoRA adapters loaded at
  run time are the same on every replica (ray_adapters.py). A replica declares its CPUs, GPUs and
  memory and is ready once its model is loaded; Ray Serve autoscales the replicas on ongoing
  requests (min and max replicas, a target per replica, up and down delays; with min 0 the first
  request waits for a replica to start) and restarts a replica whose process dies or whose engine
  stops.
- Ingress: the HTTP front, a FastAPI app with the security layer (API keys, limits, guardrails)
  that hands each request to an Engine replica through a DeploymentHandle and streams its bytes
  back, with the key it was authenticated by. What outlives a request is kept here, once for all
  replicas: the Batch API's files and batches (`files_dir`; each line goes to a replica as any
  request) and stored /v1/responses answers (a later turn's previous_response_id finds them
  whichever replica answered). A replica that dies before answering: the request goes to
  another, once; after the first byte: a stream ends with an error event and a body is cut
  short, never a hang.

PrefixAffinityRouter (ray_router.py, Ray Serve's request-router API) picks the replica: requests
whose prompts begin alike (the first `affinity_prefix_chars` characters: the system prompt, a
shared document) go to the same replica by rendezvous hashing, so that replica's prefix cache
holds their KV, unless it has `max_imbalance` more requests in flight than the least loaded
replica: then the least loaded. The ingress's /metrics has the routing decisions and requests in
flight per replica, beside every replica's own metrics.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hyperserve import ray_metrics
from hyperserve.common.affinity import affinity_text, salted_key
from hyperserve.common.errors import APIError
from hyperserve.common.lora_folders import adapter_folder
from hyperserve.common.sse import EventSplitter, sse_chunks, sse_event
from hyperserve.common.websocket_api import Stream, serve_websocket
from hyperserve.ray_adapters import LOAD, UNLOAD, AdapterSet, IngressAdapters
from hyperserve.security.config import cache_salt
from hyperserve.server.protocol import LoadLoRARequest, UnloadLoRARequest

if TYPE_CHECKING:
    from hyperserve.server.settings import ServerSettings

logger = logging.getLogger("hyperserve.ray")

APP_NAME = "hyperserve"
PINS = "v1/cache"  # POST pins a prefix's KV on a replica; DELETE v1/cache/{id} unpins it
HOP_BY_HOP = {"content-length", "transfer-encoding", "connection"}


class RayServeConfig(BaseModel):
    """What `hyperserve ray-serve` flags and a `serve deploy` config's `args` set."""

    model_config = ConfigDict(extra="forbid")

    model: str = "smollm2-135m"
    served_model_name: str | None = Field(None, description="the name clients send as `model`")
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineConfig fields for every replica")
    min_replicas: int = Field(1, ge=0, description="replicas kept however idle (0: scale to zero)")
    max_replicas: int = Field(1, ge=1, description="replicas at most")
    initial_replicas: int | None = Field(None, ge=0, description="replicas at start (default: min_replicas)")
    target_ongoing_requests: float = Field(8.0, gt=0,
                                           description="requests per replica that autoscaling aims at")
    upscale_delay_s: float = Field(10.0, ge=0, description="load above target this long adds replicas")
    downscale_delay_s: float = Field(60.0, ge=0, description="load below target this long removes replicas")
    look_back_period_s: float = Field(30.0, gt=0,
                                      description="autoscaling averages the load over this window")
    metrics_interval_s: float = Field(10.0, gt=0, description="how often replicas report their load")
    max_ongoing_requests: int = Field(32, ge=1,
                                      description="requests per replica at most; more wait at the ingress")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per replica (its engine's threads)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (give --device cuda with it)")
    memory_gb: float | None = Field(None, gt=0, description="memory per replica that Ray reserves")
    prefix_affinity: bool = Field(True, description="route by prompt prefix (off: least loaded replica)")
    affinity_prefix_chars: int = Field(512, ge=1,
                                       description="characters of the prompt that pick its replica")
    max_imbalance: int = Field(4, ge=0, description="in-flight requests over the least loaded replica's that "
                               "the prefix's replica may have and still be chosen")
    api_key: str | None = Field(None, description="one API key for every client")
    security_config: str | None = Field(None,
                                        description="a keys YAML, as `hyperserve serve --security-config`")
    files_dir: str | None = Field(None, description="where the ingress keeps the Batch API's files, batches "
                                  "and results, found again after a restart (None: a temporary directory)")
    lora_modules: dict[str, str] = Field(default_factory=dict,
                                         description="LoRA adapters every replica serves as models, name: "
                                         "directory (on every node; a relative one from where you deploy)")
    lora_dir: str | None = Field(None, description="the folder POST /v1/load_lora_adapter may load adapters "
                                 "from, on every node (each load reaches every replica)")
    lora_on_demand: bool = Field(False, description="a request whose model is a folder of lora_dir holding "
                                 "an adapter loads it on every replica first (vLLM's filesystem LoRA "
                                 "resolver)")
    embedding_model: str | None = Field(None, description="a sentence encoder every replica serves "
                                        "/v1/embeddings with: all-MiniLM-L6-v2 or multilingual-e5-small")
    # chat answers, as `hyperserve serve` decides them above the engine (ServerSettings)
    default_max_tokens: int = Field(2048, ge=1, description="the most tokens a chat request that sets "
                                    "no max_tokens generates")
    reasoning_parser: str | None = Field(None, description="qwen3 or deepseek_r1: a reasoning model's "
                                         "<think>...</think> in chat answers' reasoning_content")
    tool_call_parser: str | None = Field(None, description="how the model writes tool calls (default: as its "
                                         "chat template renders them, else hermes)")

    @model_validator(mode="after")
    def _consistent(self) -> RayServeConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        if self.lora_on_demand and self.lora_dir is None:
            raise ValueError("lora_on_demand loads adapters from lora_dir: give it too")
        if self.embedding_model is not None:
            from hyperserve.common.embedder import WINDOWS

            if self.embedding_model not in WINDOWS:
                raise ValueError(f"embedding_model must be one of {sorted(WINDOWS)}, "
                                 f"got {self.embedding_model!r}")
        self.server_settings()  # a parser's name, checked here rather than by every replica at start
        return self

    def server_settings(self) -> ServerSettings:
        """What replicas and the ingress decide above the engine, as `hyperserve serve` would."""
        from hyperserve.server.settings import ServerSettings

        return ServerSettings(self.name, default_max_tokens=self.default_max_tokens, files_dir=self.files_dir,
                              reasoning_parser=self.reasoning_parser, tool_call_parser=self.tool_call_parser)

    @field_validator("lora_modules")
    @classmethod
    def _absolute(cls, modules: dict[str, str]) -> dict[str, str]:
        """Replicas start in Ray's working directory: resolve where the deploy starts."""
        return {name: str(Path(path).resolve()) for name, path in modules.items()}

    @field_validator("lora_dir")
    @classmethod
    def _absolute_dir(cls, directory: str | None) -> str | None:
        return directory and str(Path(directory).resolve())

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


# ---- the ingress -------------------------------------------------------------------------------


def _ingress_app(config: RayServeConfig):
    """The ingress's FastAPI app: security, the Batch API and stored responses (as `hyperserve
    serve` has them), the whole application's /metrics, the WebSocket, everything else forwarded."""
    from ray import serve

    from hyperserve.common.batch_api import BatchAPI
    from hyperserve.common.body_limit import BodyLimit
    from hyperserve.common.errors import install_error_handlers
    from hyperserve.common.responses_api import ResponsesAPI
    from hyperserve.security.config import load_security_config
    from hyperserve.security.middleware import Governor, add_security

    settings = config.server_settings()
    app = FastAPI(title="HyperServe on Ray Serve")
    install_error_handlers(app)
    governor = None
    if config.api_key is not None or config.security_config is not None:
        governor = Governor(load_security_config(config.security_config, config.api_key))
    add_security(app, governor)
    app.add_middleware(ResponsesAPI, governor=governor, store_bytes=settings.responses_store_bytes)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    # outermost: uploads may exceed max_body_bytes; each batch line goes through everything above
    app.add_middleware(BatchAPI, governor=governor, files_dir=settings.files_dir and Path(settings.files_dir),
                       concurrency=settings.batch_concurrency,
                       busy_concurrency=settings.batch_concurrency_busy, registry=ray_metrics.REGISTRY)

    @app.get("/metrics")
    async def metrics() -> Response:
        ingress: Ingress = serve.get_replica_context().servable_object
        return Response(await ingress.metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.websocket("/v1/ws")
    async def websocket(ws: WebSocket) -> None:
        ingress: Ingress = serve.get_replica_context().servable_object
        await serve_websocket(ws, functools.partial(ingress.open_stream, config))

    @app.post(LOAD)
    async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> Response:
        ingress: Ingress = serve.get_replica_context().servable_object
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        return await ingress.load_adapter(body, headers, getattr(request.state, "key_digest", None))

    @app.post(UNLOAD)
    async def unload_lora_adapter(body: UnloadLoRARequest) -> dict[str, Any]:
        ingress: Ingress = serve.get_replica_context().servable_object
        return ingress.adapters.unload(body.lora_name)

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        ingress: Ingress = serve.get_replica_context().servable_object
        key_digest = getattr(request.state, "key_digest", None)
        refused = await ingress.resolve(config, body, list(request.headers.items()), key_digest)
        if refused is not None:
            return refused
        cache_scope = getattr(request.state, "cache_scope", None)  # the API key's, where keys are on
        affinity = _prefix_key(body, path, config, cache_scope, ingress.adapters.served)
        pinned = path.startswith(PINS + "/") and request.method == "DELETE"  # a pin is one replica's
        head, chunks = await ingress.send(request.method, "/" + path, request.url.query,
                                          list(request.headers.items()), body, key_digest, affinity,
                                          ingress.pins.replica(path[len(PINS) + 1:]) if pinned else None)
        headers = {k: v for k, v in head["headers"] if k.lower() not in HOP_BY_HOP}
        if path == PINS and request.method == "POST" and head["status"] == 200:
            answer = b"".join([chunk async for chunk in chunks])
            ingress.pins.add(answer, headers["x-hyperserve-replica"])
            return Response(answer, status_code=200, headers=headers)
        streaming = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_guarded(chunks, streaming), status_code=head["status"], headers=headers)

    return app


def _prefix_key(body: bytes, path: str, config: RayServeConfig, cache_scope: str | None,
                adapters: Collection[str]) -> str | None:
    """The request's affinity key: its prompt's prefix, salted as the replica's prefix cache will
    salt it (the API key's scope, the client's `cache_salt`, a LoRA adapter's own KV: `adapters`
    are the names served). A /v1/cache pin's too, so that it is made where the requests that begin
    with it go."""
    if not config.prefix_affinity or not path.endswith(("chat/completions", "completions", PINS)):
        return None
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    chat = path.endswith("chat/completions") or (path == PINS and "messages" in request)
    prefix = affinity_text(request, chat)[: config.affinity_prefix_chars] or None
    salt, model = cache_salt(cache_scope, request.get("cache_salt")), request.get("model")
    if isinstance(model, str) and model in adapters:
        salt += f"\x1fadapter:{model}"
    return salted_key(prefix, salt)


async def _guarded(chunks: AsyncIterator[bytes], streaming: bool) -> AsyncIterator[bytes]:
    """The replica's body; if the replica dies mid-answer, a stream ends with an error event (a
    plain body is cut short: the client sees an incomplete response, not a hang)."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as error:  # RayActorError and kin: the replica went away
        logger.warning("a replica failed mid-answer: %s", error)
        if streaming:
            yield sse_event(_replica_failed(error).body()).encode()


def _answer_error(status: int, text: bytes) -> APIError:
    """A replica's error answer, to raise where the request came by WebSocket."""
    try:
        return APIError.from_body(status, json.loads(text))
    except ValueError:
        return APIError.from_body(status, text.decode(errors="replace"))


def _replica_failed(error: Exception) -> APIError:
    """What a client is told of a replica that went away (RayActorError and kin)."""
    return APIError(503, f"the engine replica failed: {type(error).__name__}", type_="server_error",
                    code="replica_failed", headers={"Retry-After": "1"})


class PinReplicas:
    """Which replica holds each /v1/cache pin (its KV is that replica's), so that the pin's DELETE
    reaches it; an entry goes once its pin has expired."""

    def __init__(self) -> None:
        self._where: dict[str, tuple[str, float]] = {}  # pin id -> (replica, expires_at)

    def add(self, answer: bytes, replica: str) -> None:
        now = time.time()
        self._where = {pin: place for pin, place in self._where.items() if place[1] > now}
        pin = json.loads(answer)
        self._where[pin["id"]] = (replica, pin["expires_at"])

    def replica(self, pin_id: str) -> str | None:
        """The pin's replica while it routes requests there (None: any; its 404 says the rest)."""
        replica, _ = self._where.get(pin_id, (None, 0.0))
        return replica if replica in ray_metrics.REPLICAS else None


class Ingress:
    """The ingress deployment: the Engine deployment's handle, and how a request reaches a replica."""

    def __init__(self, engine, lora_modules: dict[str, str]) -> None:
        self.engine = engine
        self.pins = PinReplicas()
        self.adapters = IngressAdapters(lora_modules)

    async def send(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                   key_digest: str | None, prefix_key: str | None, replica: str | None = None,
                   adapters: AdapterSet | None = None) -> tuple[dict[str, Any], ReplicaBody]:
        """The response head and the rest of the body from a replica (`replica`: that one), which
        serves `adapters` (default: the application's) for it; a replica that dies before its head
        is replaced by another, once."""
        adapters = self.adapters.served if adapters is None else adapters
        for attempt in range(2):
            generator = self.engine.options(stream=True).handle.remote(
                method, path, query, headers, body, key_digest=key_digest, prefix_key=prefix_key,
                replica=replica if not attempt else None, adapters=adapters)
            try:
                head = await generator.__anext__()
                return head, ReplicaBody(generator)
            except Exception:
                generator.cancel()
                if attempt:
                    raise
                ray_metrics.RETRIED.inc()
                logger.warning("a replica failed before answering; sending the request to another",
                               exc_info=True)
        raise AssertionError("unreachable")

    async def load_adapter(self, body: LoadLoRARequest, headers: list[tuple[str, str]],
                           key_digest: str | None, if_missing: bool = False) -> Response | None:
        """A replica loads the adapter and its answer is the client's; from the next request on,
        every replica serves it (ray_adapters.py). None: `if_missing`, and a load this one waited
        for has made it."""
        data = body.model_copy(update={"load_inplace": True}).model_dump_json().encode()
        answers: list[Response] = []

        async def send(wanted: AdapterSet) -> int:
            head, chunks = await self.send("POST", LOAD, "", headers, data, key_digest, None, adapters=wanted)
            kept = {k: v for k, v in head["headers"] if k.lower() not in HOP_BY_HOP}
            answer = b"".join([c async for c in chunks])
            answers.append(Response(answer, status_code=head["status"], headers=kept))
            return head["status"]

        await self.adapters.load(body.lora_name, body.lora_path, body.load_inplace, send, if_missing)
        return answers[0] if answers else None

    async def resolve(self, config: RayServeConfig, body: bytes, headers: list[tuple[str, str]],
                      key_digest: str | None) -> Response | None:
        """With `lora_on_demand`: load the adapter a request's `model` names, if no model or adapter
        is served by that name and a folder of `lora_dir` holds one; its load's 4xx is the request's
        answer (None: go on, to the replica's answer or its 404)."""
        if not config.lora_on_demand or not body[:64].lstrip().startswith(b"{"):
            return None
        try:
            model = json.loads(body).get("model")
        except ValueError:
            return None  # the replica says what is wrong with it
        if not isinstance(model, str) or model == config.name or model in self.adapters.served:
            return None
        folder = adapter_folder(Path(config.lora_dir), model)
        if folder is None:
            return None
        load = LoadLoRARequest(lora_name=model, lora_path=str(folder))
        answer = await self.load_adapter(load, [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP],
                                         key_digest, if_missing=True)
        return answer if answer is not None and answer.status_code != 200 else None

    async def open_stream(self, config: RayServeConfig, kind: str, body: dict[str, Any],
                          ws: WebSocket) -> Stream:
        """A WebSocket's request (common/websocket_api.py), sent to a replica as the streamed HTTP
        request it is, routed by its prefix: the replica validates it, and its 4xx comes back here
        before any chunk."""
        path = "v1/chat/completions" if kind == "chat.completions" else "v1/completions"
        data = json.dumps({**body, "stream": True}).encode()
        state = ws.scope.get("state") or {}
        json_type = [("content-type", "application/json")]
        refused = await self.resolve(config, data, json_type, state.get("key_digest"))
        if refused is not None:
            raise _answer_error(refused.status_code, bytes(refused.body))
        try:
            head, answer = await self.send("POST", "/" + path, "", json_type, data, state.get("key_digest"),
                                           _prefix_key(data, path, config, state.get("cache_scope"),
                                                       self.adapters.served))
        except Exception as error:  # RayActorError and kin, twice: this request's error, not the socket's
            raise _replica_failed(error) from error
        if head["status"] != 200:
            raise _answer_error(head["status"], b"".join([chunk async for chunk in answer]))
        return Stream(_events(answer), answer.cancel)

    async def metrics(self, timeout_s: float = 5.0) -> bytes:
        """The ingress's metrics and every Engine replica's own (TTFT, KV cache usage, …), each
        replica's samples labelled with its id: one scrape sees the whole application. A replica
        that does not answer within timeout_s is left out of this scrape."""
        replicas = sorted(ray_metrics.REPLICAS) or [None]  # None: any one (the router then learns them all)
        # each in a context of its own: handle calls take their request's internal id from the
        # context, and Ray Serve's router keeps one pending request per id (the second stalled)
        scraped = await asyncio.gather(*(asyncio.create_task(self._scrape(replica, timeout_s),
                                                             context=contextvars.Context())
                                         for replica in replicas))
        return merge_metrics(generate_latest(ray_metrics.REGISTRY), dict(s for s in scraped if s is not None))

    async def _scrape(self, replica: str | None, timeout_s: float) -> tuple[str, bytes] | None:
        """(replica id, its /metrics), or None if it did not answer."""
        generator = self.engine.options(stream=True).handle.remote("GET", "/metrics", "", [], b"",
                                                                 replica=replica)
        try:
            async with asyncio.timeout(timeout_s):
                head = await generator.__anext__()
                body = b"".join([chunk async for chunk in generator])
        except Exception as error:  # noqa: BLE001 - gone or busy past the timeout: this scrape goes without
            logger.warning("no metrics from replica %s: %r", replica or "(any)", error)
            return None
        finally:
            generator.cancel()
        headers = dict(head["headers"])
        return (headers["x-hyperserve-replica"], body) if head["status"] == 200 else None


def merge_metrics(own: bytes, replicas: dict[str, bytes]) -> bytes:
    """One exposition of the ingress's metrics and each replica's, its samples labelled
    `replica`; families of one name (the Batch API's, which the ingress and replicas both have)
    become one."""
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for replica, text in [(None, own), *replicas.items()]:
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            labels = {} if replica is None else {"replica": replica}
            merged.samples += [s._replace(labels={**s.labels, **labels}) for s in family.samples]

    class Exposition:
        def collect(self):
            return families.values()

    return generate_latest(Exposition())


class ReplicaBody:
    """The rest of a replica's answer, chunk by chunk. Leaving it early, or cancel(), cancels the
    replica's request (the client went away)."""

    def __init__(self, generator) -> None:
        self.generator = generator

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.generator:
                yield chunk
        finally:
            self.generator.cancel()

    def cancel(self) -> None:
        self.generator.cancel()


async def _events(body: ReplicaBody) -> AsyncIterator[dict[str, Any]]:
    """A replica's SSE stream as its JSON objects, for the WebSocket; an error event, or the
    replica failing mid-answer, is raised as the error it is."""
    events = EventSplitter()
    try:
        async for chunk in body:
            for data in sse_chunks(events.feed(chunk)):
                if "error" in data:
                    raise APIError.from_body(500, data)
                yield data
    except (APIError, asyncio.CancelledError):
        raise
    except Exception as error:  # RayActorError and kin: the replica went away
        raise _replica_failed(error) from error


# ---- the application ---------------------------------------------------------------------------


def build(args: dict[str, Any] | RayServeConfig | None = None):
    """The Ray Serve application (`serve run hyperserve.ray_serve:build model=...`, or a `serve
    deploy` config's import_path, its `args` RayServeConfig's fields)."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from hyperserve.ray_replica import EngineReplica

    config = args if isinstance(args, RayServeConfig) else RayServeConfig(**(args or {}))
    actor_options: dict[str, Any] = {"num_cpus": config.num_cpus, "num_gpus": config.num_gpus}
    if config.memory_gb is not None:
        actor_options["memory"] = int(config.memory_gb * 2**30)
    engine = serve.deployment(
        EngineReplica, name="Engine", ray_actor_options=actor_options,
        max_ongoing_requests=config.max_ongoing_requests,
        autoscaling_config=AutoscalingConfig(
            min_replicas=config.min_replicas, max_replicas=config.max_replicas,
            initial_replicas=config.initial_replicas, target_ongoing_requests=config.target_ongoing_requests,
            upscale_delay_s=config.upscale_delay_s, downscale_delay_s=config.downscale_delay_s,
            look_back_period_s=config.look_back_period_s, metrics_interval_s=config.metrics_interval_s),
        request_router_config=RequestRouterConfig(
            request_router_class="hyperserve.ray_router.PrefixAffinityRouter",
            request_router_kwargs={"max_imbalance": config.max_imbalance}),
        health_check_period_s=5, graceful_shutdown_timeout_s=30,
    ).bind(config)
    ingress = serve.deployment(serve.ingress(_ingress_app(config))(Ingress), name="Ingress",
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)  # I/O only
    return ingress.bind(engine, config.lora_modules)


def run(config: RayServeConfig, address: str | None = None, host: str = "127.0.0.1",
        port: int = 8000) -> None:
    """Connect to a Ray cluster (address "auto": the one `ray start` made on this machine; None:
    start one here, stopped again on exit) and serve the application on host:port until SIGINT or
    SIGTERM, which delete it (and stop the cluster this started)."""
    import signal

    import ray
    from ray import serve

    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds through the finally below
    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build(config), name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("HyperServe on Ray Serve: http://%s:%d (ready in %.1f s)", host, port,
                    time.perf_counter() - started)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        logger.info("deleting the application")
        serve.delete(APP_NAME)
        if address is None:
            serve.shutdown()
        ray.shutdown()
