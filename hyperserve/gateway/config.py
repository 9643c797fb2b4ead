"""Gateway configuration: the YAML file `hyperserve gateway --config` reads, validated at start.

Every section is a pydantic model that forbids unknown keys, so a typo fails at start with the
path of the offending key (`routes.0.balance: ...`) instead of being silently ignored.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LocalModel(_Section):
    """A HyperServe engine the gateway starts itself (`hyperserve serve` on a free loopback port)."""

    model: str = "smollm2-135m"
    args: list[str] = Field(default_factory=list, description="extra `hyperserve serve` flags")


class BackendConfig(_Section):
    """One OpenAI-compatible server: a URL, or a local model the gateway launches."""

    name: str
    url: str | None = None
    local: LocalModel | None = None
    model: str | None = Field(default=None, description="model name the backend expects (default: the route's)")
    api_key_env: str | None = Field(default=None, description="environment variable holding its API key")
    weight: float = Field(default=1.0, gt=0)
    tenant_salt: bool | None = Field(default=None, description=(
        "send each API key's cache scope as `cache_salt`, so tenants share no prefix-cached KV there "
        "(HyperServe and vLLM take the field); default: for the engines the gateway runs itself"))

    @model_validator(mode="after")
    def _one_source(self) -> BackendConfig:
        if (self.url is None) == (self.local is None):
            raise ValueError("give exactly one of url and local")
        if self.url is not None and not re.match(r"^https?://", self.url):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        return self


class BackendRef(_Section):
    name: str
    weight: float | None = Field(default=None, gt=0, description="overrides the backend's weight on this route")


class CascadeConfig(_Section):
    """Ask `models[0]` first; escalate to the next when its mean token log-probability is below
    `min_confidence` (or it fails)."""

    models: list[str] = Field(min_length=2)
    min_confidence: float = Field(default=-1.0, le=0, description="mean log-probability per generated token")


class RouteConfig(_Section):
    """A model name clients ask for: weighted backends, or a cascade over other routes."""

    model: str
    backends: list[str | BackendRef] = Field(default_factory=list)
    cascade: CascadeConfig | None = None
    balance: Literal["least-outstanding", "prefix-affinity"] = "least-outstanding"
    affinity_prefix_chars: int = Field(default=256, ge=1, description="characters of the prompt that pick a replica")
    affinity_max_imbalance: int = Field(default=8, ge=0,
                                        description="outstanding requests above the least-loaded replica before "
                                                    "affinity gives way")
    timeout_s: float = Field(default=120.0, gt=0)
    retries: int = Field(default=2, ge=0, description="further attempts on 5xx or connection errors")
    backoff_s: float = Field(default=0.05, ge=0, description="first retry delay; doubles each time")

    @model_validator(mode="after")
    def _one_kind(self) -> RouteConfig:
        if bool(self.backends) == (self.cascade is not None):
            raise ValueError("give exactly one of backends and cascade")
        return self

    def backend_refs(self) -> list[BackendRef]:
        return [BackendRef(name=b) if isinstance(b, str) else b for b in self.backends]


class BreakerConfig(_Section):
    failures: int = Field(default=3, ge=1, description="consecutive failures that open the circuit")
    cooldown_s: float = Field(default=5.0, gt=0, description="time out before one probe request is let through")


class SemanticCacheConfig(_Section):
    enabled: bool = True
    threshold: float = Field(default=0.9, gt=0, le=1, description="cosine similarity for a hit")


class CacheConfig(_Section):
    """Responses cached for deterministic requests (temperature 0 or a seed), or when a client
    sends `x-hyperserve-cache: on`; `x-hyperserve-cache: off` always bypasses."""

    enabled: bool = True
    semantic: SemanticCacheConfig = Field(default_factory=SemanticCacheConfig)
    store: Literal["sqlite", "redis", "memory"] = "sqlite"
    path: str = ".hyperserve/gateway-cache.sqlite"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "hyperserve:cache:"
    ttl_s: float = Field(default=86400.0, gt=0)
    max_entries: int = Field(default=100_000, ge=1)
    timeout_s: float = Field(default=0.5, gt=0, description="a store call slower than this is a miss")


class LogConfig(_Section):
    path: str | None = Field(default=None, description="JSON-lines request log; none when unset")


class GatewayConfig(_Section):
    backends: list[BackendConfig] = Field(min_length=1)
    routes: list[RouteConfig] = Field(min_length=1)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _references(self) -> GatewayConfig:
        backends = [b.name for b in self.backends]
        routes = [r.model for r in self.routes]
        for names, what in ((backends, "backends"), (routes, "routes")):
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"{what}: duplicate names {duplicates}")
        for i, route in enumerate(self.routes):
            for ref in route.backend_refs():
                if ref.name not in backends:
                    raise ValueError(f"routes.{i}.backends: unknown backend {ref.name!r}; known: {backends}")
            for name in route.cascade.models if route.cascade else []:
                if name not in routes or name == route.model:
                    raise ValueError(f"routes.{i}.cascade.models: {name!r} is not another route; known: {routes}")
        return self


def load_config(path: str | Path) -> GatewayConfig:
    """Read and validate a gateway YAML file; raises ValueError naming the offending key."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read gateway config {path}: {error}") from error
    return parse_config(data, source=str(path))


def parse_config(data: object, source: str = "config") -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data if data is not None else {})
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
                             for e in error.errors())
        raise ValueError(f"invalid gateway config {source}: {problems}") from None


def backend_api_key(backend: BackendConfig) -> str | None:
    if backend.api_key_env is None:
        return None
    key = os.environ.get(backend.api_key_env)
    if key is None:
        raise ValueError(f"backends.{backend.name}.api_key_env: environment variable {backend.api_key_env} is not set")
    return key
