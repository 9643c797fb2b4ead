"""The Engine deployment of HyperServe on Ray Serve (ray_serve.py): one engine and its OpenAI app
per replica, the very `build_app` that `hyperserve serve` runs, called in process (ASGI) for each
request the ingress hands it, so every endpoint, streaming and error behaves as the plain server's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asgi_lifespan import LifespanManager

from hyperserve.ray_adapters import AdapterSet, ReplicaAdapters
from hyperserve.security.middleware import KEY_DIGEST

if TYPE_CHECKING:
    from hyperserve.ray_serve import RayServeConfig
    from hyperserve.security.middleware import Governor

logger = logging.getLogger("hyperserve.ray")


class EngineReplica:
    """One engine and its OpenAI app; `handle` runs one HTTP request through the app and yields
    the response's head ({"status", "headers"}) and then its body, chunk by chunk."""

    async def __init__(self, config: RayServeConfig) -> None:
        from ray import serve

        from hyperserve.config import EngineConfig
        from hyperserve.engine.engine import LLMEngine
        from hyperserve.layers.lora import LoRARequest
        from hyperserve.server.app import build_app
        from hyperserve.server.model_pool import ModelEntry

        lora = {"enable_lora": True} if config.lora_modules or config.lora_dir else {}
        engine_config = EngineConfig.from_kwargs(model=config.model, **{**config.engine, **lora})
        adapters = {name: LoRARequest(name, i, path)
                    for i, (name, path) in enumerate(config.lora_modules.items(), start=1)}
        entry = ModelEntry(config.name, functools.partial(LLMEngine, engine_config), adapters=adapters)
        errors: list[Exception] = []
        self.app = build_app([entry], config.server_settings(), on_load_error=errors.append,
                             governor=replica_governor(config), embedding_model=config.embedding_model,
                             lora_dir=config.lora_dir and Path(config.lora_dir))
        self.adapters = ReplicaAdapters(config.lora_modules)
        self.replica = serve.get_replica_context().replica_id.unique_id
        # through the whole app, as uvicorn runs it: the middleware's own start and stop included
        self._lifespan = LifespanManager(self.app, startup_timeout=None, shutdown_timeout=None)
        await self._lifespan.__aenter__()
        while (await self._call("GET", "/health"))[0] != 200:  # ready once the model is loaded
            if errors:
                raise RuntimeError(f"the model failed to load: {errors[0]}")
            await asyncio.sleep(0.1)
        logger.info("replica %s ready", self.replica)

    async def handle(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                     key_digest: str | None = None, prefix_key: str | None = None, replica: str | None = None,
                     adapters: AdapterSet | None = None) -> AsyncIterator[dict[str, Any] | bytes]:
        """key_digest: the SHA-256 of the API key the ingress authenticated the request by (a batch
        line carries no key of its own); prefix_key and replica (this one's id, where the request
        is for it alone) are for the router, which reads them from the call; adapters: the LoRA
        adapters the application serves, which this replica's app is brought to first."""
        loading = None
        if adapters is not None:
            call = functools.partial(self._call, key_digest=key_digest)
            loading = await self.adapters.sync(adapters, path, body, call)
        async for message in self._asgi(method, path, query, headers, body, key_digest):
            if message["type"] == "http.response.start":
                if loading is not None and message["status"] == 200:
                    self.adapters.loaded(loading, adapters)
                head = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                head.append(("x-hyperserve-replica", self.replica))
                yield {"status": message["status"], "headers": head}
            elif message.get("body"):
                yield message["body"]

    async def __del__(self) -> None:
        """Ray Serve's graceful shutdown (after the replica's requests have drained): the app's
        shutdown stops the engine."""
        lifespan, self._lifespan = getattr(self, "_lifespan", None), None
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)

    async def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose engine stopped is replaced."""
        status, text = await self._call("GET", "/health")
        if status != 200:
            raise RuntimeError(f"replica {self.replica} is unhealthy: {status} {text[:200]}")

    async def _call(self, method: str, path: str, body: dict | None = None,
                    key_digest: str | None = None) -> tuple[int, str]:
        """This replica's app answering one request of its own (a JSON body)."""
        status, chunks = 0, []
        headers = [("content-type", "application/json")] if body is not None else []
        data = json.dumps(body).encode() if body is not None else b""
        async for message in self._asgi(method, path, "", headers, data, key_digest):
            if message["type"] == "http.response.start":
                status = message["status"]
            else:
                chunks.append(message.get("body", b""))
        return status, b"".join(chunks).decode(errors="replace")

    async def _asgi(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                    key_digest: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """The app's messages for one request. Leaving early (the caller went away) tells the app the
        client disconnected and waits for it to finish (it aborts the engine request)."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
                 "root_path": "",
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
                 "client": ("127.0.0.1", 0), "server": ("hyperserve-replica", 80)}
        if key_digest is not None:  # from the ingress, never from a client's request
            scope[KEY_DIGEST] = key_digest
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        pending_body = [body]

        async def receive() -> dict[str, Any]:
            if pending_body:
                return {"type": "http.request", "body": pending_body.pop(), "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    break
            else:
                task.result()  # the app ended without a whole response: its error
        finally:
            disconnected.set()
            if not task.done():
                await asyncio.wait([task], timeout=10)


def replica_governor(config: RayServeConfig) -> Governor | None:
    """With API keys, a replica knows each request's key too (the one the ingress authenticated it
    by, passed beside it), for what is each key's own on a replica as on `hyperserve serve`: the
    cache scope its prefix cache, pins and n-gram history are kept apart by. Limits, guardrails and
    the audit log stay with the ingress (SecurityConfig.keys_only)."""
    if config.api_key is None and config.security_config is None:
        return None
    from hyperserve.security.config import load_security_config
    from hyperserve.security.middleware import Governor

    return Governor(load_security_config(config.security_config, config.api_key).keys_only())
