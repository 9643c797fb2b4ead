"""Routing: a model name -> a backend, with load balancing, retries, fallback and cascades.

- least-outstanding: the backend with the fewest in-flight requests per unit of weight;
- prefix-affinity: rendezvous hashing of the prompt's first characters, so conversations that
  share a long prefix land on the replica whose prefix cache already holds it, unless that replica
  is `affinity_max_imbalance` requests busier than the least-loaded one; where the backends keep
  tenants' caches apart (`cache_salt`), of the tenant and the prefix (Route.affinity_key);
- a failed attempt (connection error, 5xx, 429) is retried on another backend with exponential
  backoff; the circuit breaker takes a failing backend out and lets one probe back in;
- a cascade asks its first route and escalates while the answer's mean token log-probability is
  below `min_confidence`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from hyperserve.common.affinity import rendezvous_score, salted_key
from hyperserve.common.errors import APIError
from hyperserve.gateway.backends import Backend
from hyperserve.gateway.config import RouteConfig
from hyperserve.gateway.telemetry import GatewayMetrics
from hyperserve.security.config import cache_salt


@dataclass
class Reply:
    """A complete (non-streaming) answer from a backend."""

    status: int
    body: dict[str, Any]
    backend: str
    backend_s: float
    cascade: list[str] = field(default_factory=list)  # "model:confidence" per cascade stage tried


class Route:
    def __init__(self, config: RouteConfig, backends: list[tuple[Backend, float]]) -> None:
        self.config = config
        self.backends = backends  # (backend, weight on this route)

    @property
    def name(self) -> str:
        return self.config.model

    def affinity_key(self, prefix: str | None, scope: str | None, client_salt: Any) -> str | None:
        """What places a request on a prefix-affinity route: its prompt's prefix, with the salt its
        backends' prefix caches will see (the API key's scope on backends that salt tenants, a
        client's own `cache_salt` on any)."""
        return salted_key(prefix, cache_salt(scope if any(b.tenant_salt for b, _ in self.backends) else None,
                                             client_salt))

    def pick(self, affinity_key: str | None, tried: set[str]) -> Backend | None:
        """A backend for the next attempt: one not tried yet if any is available, else any available."""
        now = time.monotonic()
        available = [(b, w) for b, w in self.backends if b.available(now)]
        candidates = [(b, w) for b, w in available if b.name not in tried] or available
        if not candidates:
            return None
        probe = next((b for b, _ in candidates if not b.breaker.is_closed), None)
        if probe is not None:  # a backend whose cooldown is over gets one request to prove itself
            return probe
        least, least_weight = min(candidates, key=lambda bw: (bw[0].outstanding + 1) / bw[1])
        if self.config.balance == "prefix-affinity" and affinity_key is not None:
            preferred, _ = max(candidates, key=lambda bw: rendezvous_score(affinity_key, bw[0].name, bw[1]))
            if preferred.outstanding <= least.outstanding + self.config.affinity_max_imbalance:
                return preferred
        return least


class Router:
    def __init__(self, routes: dict[str, Route], metrics: GatewayMetrics) -> None:
        self.routes, self.metrics = routes, metrics

    def route(self, name: str) -> Route:
        route = self.routes.get(name)
        if route is None:
            raise APIError(404, f"the model {name!r} does not exist; this gateway serves "
                                f"{sorted(self.routes)}", param="model", code="model_not_found")
        return route

    async def _send(self, route: Route, path: str, body: dict[str, Any], affinity_key: str | None,
                    scope: str | None) -> tuple[aiohttp.ClientResponse, Backend, float]:
        """The first acceptable response (status < 500 and not 429), its headers read, trying
        backends in turn. The caller reads the body and then calls `_done`. `scope`: the API
        key's, sent as `cache_salt` to backends that salt tenants' prefix caches."""
        tried: set[str] = set()
        failures: list[str] = []
        retry_after: str | None = None
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(5.0, route.config.timeout_s),
                                        sock_read=route.config.timeout_s)
        affinity_key = route.affinity_key(affinity_key, scope, body.get("cache_salt"))
        for attempt in range(route.config.retries + 1):
            if attempt:
                await asyncio.sleep(route.config.backoff_s * 2 ** (attempt - 1))
            backend = route.pick(affinity_key, tried)
            if backend is None:
                break
            tried.add(backend.name)
            backend.breaker.on_attempt()
            backend.outstanding += 1
            started = time.perf_counter()
            try:
                sent = {**body, "model": backend.model or route.name}
                if backend.tenant_salt and scope is not None:
                    sent["cache_salt"] = cache_salt(scope, body.get("cache_salt"))
                response = await backend.session.post(path, json=sent, timeout=timeout)
                if response.status >= 500 or response.status == 429:
                    await response.read()
                    response.release()
                    server_error = response.status >= 500
                    self._done(backend, started, "failure" if server_error else "neutral",
                               f"http_{response.status}")
                    failures.append(f"{backend.name}: HTTP {response.status}")
                    if not server_error:
                        retry_after = response.headers.get("Retry-After", "1")
                    continue
            except (TimeoutError, aiohttp.ClientError) as error:
                self._done(backend, started, "failure", type(error).__name__)
                failures.append(f"{backend.name}: {type(error).__name__} {error}".strip())
                continue
            except BaseException:  # cancelled (the client left, or the route's timeout)
                self._done(backend, started, "neutral", "cancelled")
                raise
            return response, backend, started
        if retry_after is not None:
            raise APIError(429, f"every backend for {route.name!r} is overloaded; retry later",
                           type_="rate_limit_error", headers={"Retry-After": retry_after})
        if not failures:
            raise APIError(503, f"no backend for {route.name!r} is available (all circuits open); "
                                "retry later", type_="service_unavailable", headers={"Retry-After": "1"})
        raise APIError(502, f"every attempt for {route.name!r} failed: {'; '.join(failures)}",
                       type_="bad_gateway")

    def _done(self, backend: Backend, started: float, outcome: str = "ok", error: str | None = None) -> None:
        """outcome: "ok" and "failure" move the circuit breaker; "neutral" (a 429, a client that
        left) says nothing about the backend's health."""
        backend.outstanding -= 1
        if outcome == "ok":
            backend.breaker.on_success()
        elif outcome == "failure":
            backend.breaker.on_failure(time.monotonic())
        self.metrics.observe_backend(backend.name, time.perf_counter() - started, error)

    async def complete(self, name: str, path: str, body: dict[str, Any], affinity_key: str | None,
                       scope: str | None = None) -> Reply:
        route = self.route(name)
        if route.config.cascade is not None:
            return await self._cascade(route, path, body, affinity_key, scope)
        try:
            async with asyncio.timeout(route.config.timeout_s):
                response, backend, started = await self._send(route, path, body, affinity_key, scope)
                try:
                    raw = await response.read()
                except aiohttp.ClientError as error:
                    self._done(backend, started, "failure", type(error).__name__)
                    raise APIError(502, f"{backend.name}: the answer broke off: {error}", type_="bad_gateway"
                                   ) from None
                except BaseException:
                    self._done(backend, started, "neutral", "cancelled")
                    raise
                finally:
                    response.release()
                self._done(backend, started)
        except TimeoutError:
            raise APIError(504, f"{route.name!r} did not answer within {route.config.timeout_s} s",
                           type_="timeout") from None
        try:
            data = json.loads(raw)
        except ValueError:
            data = {"error": {"message": raw[:500].decode(errors="replace"), "type": "bad_gateway"}}
        return Reply(response.status, data, backend.name, time.perf_counter() - started)

    async def stream(self, name: str, path: str, body: dict[str, Any], affinity_key: str | None,
                     scope: str | None = None) -> tuple[AsyncIterator[str], str]:
        """SSE lines from a backend, and the backend's name. Retries happen only before the first
        byte; a failure after it ends the stream with an error event."""
        route = self.route(name)
        response, backend, started = await self._send(route, path, body, affinity_key, scope)
        if response.status != 200:  # a 4xx: the client's mistake, passed through
            text = (await response.read()).decode(errors="replace")
            response.release()
            self._done(backend, started)
            raise APIError(response.status, _error_message(text), code="backend_error")

        async def lines() -> AsyncIterator[str]:
            outcome, error = "neutral", "cancelled"
            try:
                async for raw in response.content:
                    yield raw.decode().rstrip("\r\n")
                outcome, error = "ok", None
            except (TimeoutError, aiohttp.ClientError) as failure:
                outcome, error = "failure", type(failure).__name__
                raise
            finally:
                response.release()
                self._done(backend, started, outcome, error)

        return lines(), backend.name

    async def _cascade(self, route: Route, path: str, body: dict[str, Any], affinity_key: str | None,
                       scope: str | None) -> Reply:
        cascade = route.config.cascade
        chat = path.endswith("chat/completions")
        wants_logprobs = body.get("logprobs")
        probe = {**body, "logprobs": True} if chat else {**body, "logprobs": body.get("logprobs") or 0}
        trace: list[str] = []
        for stage, model in enumerate(cascade.models):
            last = stage == len(cascade.models) - 1
            try:
                reply = await self.complete(model, path, body if last else probe, affinity_key, scope)
            except APIError:
                if last:
                    raise
                trace.append(f"{model}:error")
                self.metrics.cascade_escalations.labels(route.name, model, "error").inc()
                continue
            if last or reply.status != 200:
                reply.cascade = trace + [model]
                return reply
            confidence = mean_logprob(reply.body, chat)
            trace.append(f"{model}:{confidence:.3f}")
            if confidence >= cascade.min_confidence:
                if not wants_logprobs:
                    for choice in reply.body.get("choices", []):
                        choice["logprobs"] = None
                reply.cascade = trace
                return reply
            self.metrics.cascade_escalations.labels(route.name, model, "low_confidence").inc()
        raise AssertionError("the last cascade stage always returns")


def mean_logprob(body: dict[str, Any], chat: bool) -> float:
    """The least confident choice's mean log-probability per token (0 for an empty answer)."""
    means = []
    for choice in body.get("choices") or [{}]:
        logprobs = choice.get("logprobs") or {}
        if chat:
            values = [t.get("logprob", 0.0) for t in logprobs.get("content") or []]
        else:
            values = [v for v in logprobs.get("token_logprobs") or [] if v is not None]
        means.append(sum(values) / len(values) if values else 0.0)
    return min(means)


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500] or "the backend rejected the request"
