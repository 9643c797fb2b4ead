"""What the gateway reports: Prometheus metrics (its request log is hyperserve.common.request_log)."""

from __future__ import annotations

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
