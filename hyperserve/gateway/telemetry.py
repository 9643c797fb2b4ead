"""What the gateway reports: Prometheus metrics and a JSON-lines request log."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FAST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_SLOW_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("hyperserve:gateway_requests", "Requests by route, cache outcome and status",
                                ["route", "cache", "status"], registry=r)
        self.cache_lookup = Histogram("hyperserve:gateway_cache_lookup_seconds",
                                      "Cache lookup time, embedding included", ["result"], buckets=_FAST_BUCKETS,
                                      registry=r)
        self.cascade_escalations = Counter("hyperserve:gateway_cascade_escalations",
                                           "Cascade escalations by route, stage model and reason",
                                           ["route", "model", "reason"], registry=r)
        self.backend_latency = Histogram("hyperserve:gateway_backend_latency_seconds",
                                         "Backend attempt latency (to the full answer, or the stream's end)",
                                         ["backend"], buckets=_SLOW_BUCKETS, registry=r)
        self.backend_errors = Counter("hyperserve:gateway_backend_errors", "Failed backend attempts",
                                      ["backend", "error"], registry=r)
        self.backend_up = Gauge("hyperserve:gateway_backend_up", "1 while the backend's circuit is closed",
                                ["backend"], registry=r)
        self.overhead = Histogram("hyperserve:gateway_overhead_seconds",
                                  "Time the gateway adds to a non-streaming pass-through request",
                                  buckets=_FAST_BUCKETS, registry=r)

    def observe_backend(self, backend: str, seconds: float, error: str | None) -> None:
        self.backend_latency.labels(backend).observe(seconds)
        if error is not None:
            self.backend_errors.labels(backend, error).inc()


class RequestLog:
    """One JSON object per line and request: route, backend, cache outcome, latency breakdown
    (milliseconds) and tokens. Never prompts or keys."""

    def __init__(self, path: str | None) -> None:
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1) if path else None  # lives as long as the app
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps({"ts": round(time.time(), 3), **record}, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
